package rpc

import (
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// The IDL's enum Origin has core.Origin's values, one for one (TestOriginsMatchTheIDL): the
// conversions are casts. Replies also carry the origin's name (origin_name), which servers
// older than the enum sent alone, and clients older than it read.

// setOrigin records o in reply, as a value and by name.
func setOrigin(reply *fitcachepb.ReadReply, o core.Origin) {
	reply.Origin, reply.OriginName = fitcachepb.Origin(o), o.String()
}

// OriginOf returns where the server of reply found the file: the enum, or for a server older
// than it the origin's name; OriginNone for a server that said neither, and for a value or a
// name no origin has.
func OriginOf(reply *fitcachepb.ReadReply) core.Origin {
	if o := core.Origin(reply.Origin); reply.Origin > 0 && int64(o) == int64(reply.Origin) && o.Known() {
		return o
	}
	if o, ok := core.OriginNamed(reply.OriginName); ok {
		return o
	}
	return core.OriginNone
}
