package nodesock

import (
	"fmt"
	"testing"

	"github.com/fitcache/fitcache/capi/clayout"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/tiers"
)

// The C side of the protocol (capi/fcnode.h, for the shim and libfitcache's hit path) has the
// numbers this package and core.Origin have.
func TestCHeaderMatchesTheProtocol(t *testing.T) {
	type pair struct {
		name    string
		c, goes any
	}
	pairs := []pair{
		{"magic", clayout.NodeMagic, Magic},
		{"ack", clayout.NodeAck, Ack},
		{"max message", clayout.NodeMaxMessage, maxMessage},
		{"fetch", clayout.NodeOpFetch, OpFetch},
		{"open", clayout.NodeOpOpen, OpOpen},
		{"forget", clayout.NodeOpForget, OpForget},
		{"fetch block", clayout.NodeOpFetchBlock, OpFetchBlock},
		{"cache block", clayout.NodeOpCacheBlock, OpCacheBlock},
		{"open many", clayout.NodeOpOpenMany, OpOpenMany},
		{"max batch", clayout.NodeMaxBatch, MaxBatch},
		{"max inline", clayout.NodeMaxInline, MaxInline},
		{"no inline bytes", clayout.NodeInlineNone, inlineNone},
		{"record", clayout.NodeOpRecord, OpRecord},
		{"record bytes", clayout.NodeRecordBytes, recordBytes},
		{"record mode bits", clayout.NodeRecordModeBits, RecordModeBits},
		{"record has checksum", clayout.NodeRecordHasCRC, RecordHasChecksum},
		{"record checksum offset", clayout.NodeRecordCRCOffset, recordChecksum},
		{"source", clayout.OriginSource, uint32(core.OriginSource)},
		{"peer", clayout.OriginPeer, uint32(core.OriginPeer)},
		{"source while cached", clayout.OriginSourceWhileCached, uint32(core.OriginSourceWhileCached)},
		{"first tier", clayout.OriginTierFirst, uint32(core.TierOrigin(tiers.Memory))},
	}
	for _, p := range pairs {
		if c, goes := fmt.Sprint(p.c), fmt.Sprint(p.goes); c != goes {
			t.Errorf("%s: %s in C, %s in Go", p.name, c, goes)
		}
	}
}

// The C side names each origin as core.Origin does (the preload shim's debug lines use
// these names, the metrics' origin labels too), and a number it does not know "unknown".
func TestCHeaderNamesTheOrigins(t *testing.T) {
	for o := range core.Origin(32) {
		want := o.String()
		if !o.Known() {
			want = "unknown"
		}
		if got := clayout.OriginName(uint32(o)); got != want {
			t.Errorf("origin %d: C names it %q, Go %q", uint32(o), got, want)
		}
	}
}
