package core

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/fitcache/fitcache/tiers"
)

// usageOf sums an engine's usage per dataset root, as "root: files".
func usageOf(us []CacheUsage) map[string]int {
	out := map[string]int{}
	for _, u := range us {
		out[u.Root] += u.Files
	}
	return out
}

func TestClearByRootAndDryRun(t *testing.T) {
	e := newEngine(t, "64MiB")
	rootA, pathsA := dataset(t, 1000, 2000, 3000)
	rootB, pathsB := dataset(t, 500)
	if filepath.Dir(rootA) != filepath.Dir(rootB) {
		t.Fatalf("test datasets %s and %s want a common parent", rootA, rootB)
	}
	for _, p := range pathsA {
		readAll(t, e, rootA, p)
	}
	readAll(t, e, rootB, pathsB[0])
	u := e.Usage()
	if diff := cmp.Diff(map[string]int{rootA: 3, rootB: 1}, usageOf(u)); diff != "" {
		t.Errorf("Usage (-want +got):\n%s", diff)
	}
	var bytesA int64
	for i, p := range pathsA {
		bytesA += tiers.EntrySize(p, int64(1000*(i+1)))
	}
	wantA := []CacheUsage{{Root: rootA, Kind: "memory", Dir: e.TierDirs()[0].Path, Files: 3, Bytes: bytesA}}
	if diff := cmp.Diff(wantA, u[:1]); diff != "" { // roots sort in the order the test made them
		t.Errorf("Usage of %s (-want +got):\n%s", rootA, diff)
	}

	got, err := e.Clear(rootA, true)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(wantA, got); diff != "" {
		t.Errorf("Clear dry run (-want +got):\n%s", diff)
	}
	if origin, _ := readAll(t, e, rootA, pathsA[0]); origin != OriginMemory {
		t.Errorf("after a dry run a read came from %q, want memory", origin)
	}

	if got, err = e.Clear(rootA, false); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(wantA, got); diff != "" {
		t.Errorf("Clear (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(map[string]int{rootB: 1}, usageOf(e.Usage())); diff != "" {
		t.Errorf("Usage after Clear (-want +got):\n%s", diff)
	}
	if used := e.Stats().Tiers[0].Used; used != tiers.EntrySize(pathsB[0], 500) {
		t.Errorf("tier use after Clear %d, want %d (the other dataset's file)", used, tiers.EntrySize(pathsB[0], 500))
	}
	if origin, data := readAll(t, e, rootA, pathsA[1]); origin != OriginSource {
		t.Errorf("after Clear a read came from %q, want source", origin)
	} else {
		wantBytes(t, pathsA[1], data)
	}
	if origin, _ := readAll(t, e, rootB, pathsB[0]); origin != OriginMemory {
		t.Errorf("Clear of %s also cleared %s: a read came from %q", rootA, rootB, origin)
	}

	// A parent directory clears the roots under it; "" clears everything.
	if got, _ = e.Clear(filepath.Dir(rootA), false); len(usageOf(got)) != 2 {
		t.Errorf("Clear of the parent removed %v, want both roots", usageOf(got))
	}
	readAll(t, e, rootB, pathsB[0])
	if got, _ = e.Clear("", false); !cmp.Equal(usageOf(got), map[string]int{rootB: 1}) {
		t.Errorf("Clear of everything removed %v, want %s: 1", usageOf(got), rootB)
	}
	if u := e.Usage(); len(u) != 0 {
		t.Errorf("Usage after clearing everything: %v", u)
	}
	if _, err := e.Clear("relative/dir", false); !errors.Is(err, ErrBadPath) {
		t.Errorf("Clear of a relative path: got %v, want ErrBadPath", err)
	}
}

func TestDirUsageMatchesEngineUsage(t *testing.T) {
	e := newEngine(t, "64MiB", "64MiB")
	root, paths := dataset(t, 100, 200)
	for _, p := range paths {
		readAll(t, e, root, p)
	}
	got, err := DirUsage(e.TierDirs())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(e.Usage(), got); diff != "" {
		t.Errorf("DirUsage (-engine +records):\n%s", diff)
	}
}

func TestPrefetchAfterClearReadsAgain(t *testing.T) {
	// Warming a dataset up again right after clearing it (its ended job still held, within
	// its lease) must read the files again, not join the job that dealt with them.
	root, paths := dataset(t, 5000, 6000)
	e := prefetchEngine(t, 4, nil, "64MiB")
	for _, owner := range []string{"warmup-1", "warmup-2"} {
		if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: owner, Paths: paths}); err != nil {
			t.Fatal(err)
		}
		if info := waitPrefetch(t, e, root, owner); info.State != PrefetchDone || info.Fetched != len(paths) {
			t.Errorf("%s: got %+v, want done with %d files fetched", owner, info, len(paths))
		}
		if _, err := e.Clear(root, false); err != nil {
			t.Fatal(err)
		}
	}
	if s := e.Stats(); s.Prefetch.Jobs != 2 || s.SourceReads != int64(2*len(paths)) {
		t.Errorf("stats: %d jobs, %d source reads; want 2 jobs, %d reads", s.Prefetch.Jobs, s.SourceReads, 2*len(paths))
	}
}
