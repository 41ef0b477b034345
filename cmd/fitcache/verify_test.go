package main

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/tiers"
)

func TestVerifyTiersReportsAndTellsHowToRepair(t *testing.T) {
	cfg := tiers.Config{Dir: t.TempDir(), Kind: tiers.Disk, Budget: "1MiB", Holder: "runtime dir /run/one"}
	tier, err := tiers.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	data := []byte("cached bytes")
	if err := tier.Publish(tiers.Entry{SourcePath: "/d/a", Size: int64(len(data))}, data); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(tier.CachedPath("/d/a"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte("X"), 0)
	f.Close()
	missing := tiers.Config{Dir: cfg.Dir + "/missing", Kind: tiers.Memory}

	for _, tc := range []struct {
		name string
		want []string
	}{
		{"held", []string{"1 damaged", "/run/one", "--verify", "FITCACHE_VERIFY=1", "not present"}},
		{"free", []string{"1 damaged", "removed 1 damaged entries"}},
		{"repaired", []string{"0 entries valid, 0 damaged"}},
	} {
		if tc.name == "free" {
			tier.Close()
		}
		var out bytes.Buffer
		n := verifyTiers(&out, []tiers.Config{cfg, missing})
		for _, w := range tc.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("%s: output lacks %q:\n%s", tc.name, w, out.String())
			}
		}
		if want := map[bool]int{true: 0, false: 1}[tc.name == "repaired"]; n != want {
			t.Errorf("%s: %d damaged, want %d", tc.name, n, want)
		}
	}
}
