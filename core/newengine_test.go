package core

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/privdir/privdirtest"
	"github.com/fitcache/fitcache/tiers"
)

// hasWarning reports whether one of the engine's warnings contains all of parts.
func hasWarning(t *testing.T, e *Engine, parts ...string) bool {
	t.Helper()
	for _, w := range e.Stats().Warnings {
		found := true
		for _, p := range parts {
			found = found && strings.Contains(w, p)
		}
		if found {
			return true
		}
	}
	t.Logf("warnings: %q", e.Stats().Warnings)
	return false
}

func TestSecondEngineIsWarnedOffHeldTier(t *testing.T) {
	cfg := []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: "1MiB"}}
	first, err := NewEngine(EngineConfig{Tiers: cfg, Holder: "runtime dir /run/one"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	second, err := NewEngine(EngineConfig{Tiers: cfg, Holder: "runtime dir /run/two"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(second.TierDirs()); n != 0 {
		t.Errorf("second engine uses %d tiers, want none: the first holds it", n)
	}
	if !hasWarning(t, second, cfg[0].Dir, fmt.Sprintf("pid %d", os.Getpid()), "/run/one") {
		t.Error("no warning naming the tier and its holder")
	}
	if js, _ := json.Marshal(second.Stats()); !strings.Contains(string(js), `"warnings":[`) {
		t.Errorf("stats JSON without warnings: %s", js)
	}
	second.Close()
	first.Close()
	third, err := NewEngine(EngineConfig{Tiers: cfg}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer third.Close()
	if n, w := len(third.TierDirs()), third.Stats().Warnings; n != 1 || len(w) != 0 {
		t.Errorf("after the first engine closed: %d tiers, warnings %q; want the tier and no warning", n, w)
	}
}

func TestPlantedDefaultMemoryTierFallsBackWithWarning(t *testing.T) {
	shared := privdirtest.SharedDir(t)
	planted := filepath.Join(shared, "fitcache-0")
	privdirtest.AsNobody(t, "mkdir -m 777 "+planted)
	runtimeDir := t.TempDir()
	for _, tc := range []struct {
		name     string
		record   string
		wantDirs int
		want     []string
	}{
		{"no fallback", "", 0, []string{planted, "skipped", "nobody"}},
		// The record may be any file; servers use config.MemoryTierRecord (config imports core).
		{"fallback", filepath.Join(runtimeDir, "memory-tier"), 1, []string{planted, "nobody", "private directory"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := NewEngine(EngineConfig{Tiers: []tiers.Config{
				{Dir: planted, Kind: tiers.Memory, Budget: "1MiB", FallbackRecord: tc.record}}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			dirs := e.TierDirs()
			if len(dirs) != tc.wantDirs || (len(dirs) == 1 && dirs[0].Path == planted) {
				t.Errorf("tiers %v: want %d, never nobody's %s", dirs, tc.wantDirs, planted)
			}
			if !hasWarning(t, e, tc.want...) {
				t.Errorf("no warning with %q", tc.want)
			}
		})
	}
}

func TestVerifyingEngineDropsOverwrittenFiles(t *testing.T) {
	root, paths := dataset(t, 5000)
	want, _ := os.ReadFile(paths[0])
	cfg := []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Disk, Budget: "1MiB"}}
	open := func(verify bool) *Engine {
		t.Helper()
		e, err := NewEngine(EngineConfig{Tiers: cfg, Verify: verify}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	e := open(false)
	readAll(t, e, root, paths[0])
	e.Close() // publishes what the mover holds
	cachedFile := (tiers.Dir{Path: cfg[0].Dir}).CachedPath(paths[0])
	f, err := os.OpenFile(cachedFile, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte("EVIL"), 100)
	f.Close()

	e = open(true)
	defer e.Close()
	res, err := e.Read(context.Background(), root, paths[0], false)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Release()
	if res.Origin != OriginSource || string(res.Bytes()) != string(want) {
		t.Errorf("after verify: origin %s, right bytes %v; want the source's bytes", res.Origin, string(res.Bytes()) == string(want))
	}
	if !hasWarning(t, e, "removed 1 damaged") {
		t.Error("no warning about the removed entry")
	}
}
