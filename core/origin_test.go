package core

import (
	"testing"

	"github.com/fitcache/fitcache/tiers"
)

func TestTierOrigins(t *testing.T) {
	seen := map[Origin]bool{}
	for _, k := range tiers.Kinds() {
		o := TierOrigin(k)
		if got, ok := o.Tier(); !ok || got != k {
			t.Errorf("TierOrigin(%v).Tier() = %v, %v", k, got, ok)
		}
		if o.String() != k.String() {
			t.Errorf("TierOrigin(%v) is named %q", k, o.String())
		}
		if seen[o] {
			t.Errorf("two kinds have origin %d", o)
		}
		seen[o] = true
	}
	for _, o := range []Origin{OriginNone, OriginInflight, OriginSource, OriginPeer, OriginSourceWhileCached} {
		if k, ok := o.Tier(); ok || seen[o] {
			t.Errorf("%v names tier %v", o, k)
		}
	}
}
