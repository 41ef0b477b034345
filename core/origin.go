package core

import (
	"fmt"

	"github.com/fitcache/fitcache/tiers"
)

// Origin says where the bytes a request got came from: for the engine's results
// (Result.Origin), the descriptors OpenForReader hands out, the latency histograms and the
// replies on the wire. One enum for all of them: the IDL's enum Origin (rpc/fitcache.thrift)
// and the node socket's FC_ORIGIN_ values (capi/fcnode.h) are the same numbers, and tests
// hold them together. The names (String) are the labels of the metrics and of statistics.
//
// The numbers of the two sources (2 and 4) are those the node socket gave them before the
// enum, so that a shim and a server of different versions still agree on what the shim acts
// on (a source, handed over); the shim takes every other origin for a whole copy.
type Origin uint32

const (
	// OriginNone: no bytes (a failed request), or a reply of a server that did not say.
	OriginNone Origin = 0
	// OriginInflight: a file another request on this node was reading or publishing.
	OriginInflight Origin = 1
	// OriginSource: the source file, read by this request; from OpenForReader, the source
	// itself, opened beneath its dataset root (no tier takes the file whole).
	OriginSource Origin = 2
	// OriginPeer: bytes another node's server sent (cluster mode); from OpenForReader, a
	// memory file holding them.
	OriginPeer Origin = 3
	// OriginSourceWhileCached: the source of a large file (ReadNowBytes), handed to the
	// reader while the file is cached whole; later opens get the copy.
	OriginSourceWhileCached Origin = 4

	// A tier of this node, one origin per tiers.Kind in its order (TierOrigin).
	OriginMemory Origin = 8 + Origin(tiers.Memory)
	OriginPMem   Origin = 8 + Origin(tiers.PMem)
	OriginNVMe   Origin = 8 + Origin(tiers.NVMe)
	OriginDisk   Origin = 8 + Origin(tiers.Disk)
)

// Every tier kind has its origin: a kind added to package tiers stops the build here until
// it has one.
var _ = [1]struct{}{}[OriginDisk-OriginMemory+1-tiers.NumKinds]

// origins is every origin.
var origins = [...]Origin{OriginNone, OriginInflight, OriginSource, OriginPeer, OriginSourceWhileCached,
	OriginMemory, OriginPMem, OriginNVMe, OriginDisk}

// Known reports whether o is an origin of this version (a value from the wire may not be).
func (o Origin) Known() bool {
	for _, known := range origins {
		if o == known {
			return true
		}
	}
	return false
}

// OriginNamed returns the origin String names s, and whether there is one.
func OriginNamed(s string) (Origin, bool) {
	for _, o := range origins {
		if o.String() == s {
			return o, true
		}
	}
	return OriginNone, false
}

// TierOrigin returns the origin of bytes read from a tier of kind k.
func TierOrigin(k tiers.Kind) Origin { return OriginMemory + Origin(k) }

// Tier returns the kind of the tier o names, and whether o names one.
func (o Origin) Tier() (tiers.Kind, bool) {
	if o < OriginMemory || o > OriginDisk {
		return 0, false
	}
	return tiers.Kind(o - OriginMemory), true
}

// String names the origin: a tier kind, "inflight", "source", "peer", "source-while-cached"
// or "none".
func (o Origin) String() string {
	if k, ok := o.Tier(); ok {
		return k.String()
	}
	switch o {
	case OriginNone:
		return "none"
	case OriginInflight:
		return "inflight"
	case OriginSource:
		return "source"
	case OriginPeer:
		return "peer"
	case OriginSourceWhileCached:
		return "source-while-cached"
	}
	return fmt.Sprintf("origin(%d)", uint32(o))
}
