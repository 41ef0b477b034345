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

func TestOriginNamesRoundTrip(t *testing.T) {
	for _, o := range origins {
		if got, ok := OriginNamed(o.String()); !ok || got != o || !o.Known() {
			t.Errorf("%v: named back as %v, %v; known %v", o, got, ok, o.Known())
		}
	}
	for _, o := range []Origin{5, 7, 12, 1 << 31} {
		if o.Known() {
			t.Errorf("origin %d is known", uint32(o))
		}
	}
	if o, ok := OriginNamed("tier"); ok {
		t.Errorf(`"tier" names %v`, o)
	}
}
