package rpc

import (
	"math"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// The IDL's enum Origin has core.Origin's values, one for one (TestOriginsMatchTheIDL): the
// conversions are casts.

// wireOrigin is o as a reply carries it.
func wireOrigin(o core.Origin) fitcachepb.Origin { return fitcachepb.Origin(o) }

// OriginOf returns where the server of reply found the file: OriginNone for a server that did
// not say, and for a value no origin has.
func OriginOf(reply *fitcachepb.ReadReply) core.Origin {
	if reply.Origin < 0 || reply.Origin > math.MaxUint32 {
		return core.OriginNone
	}
	return core.Origin(reply.Origin)
}
