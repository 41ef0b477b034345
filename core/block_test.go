package core

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

// newBlockEngine returns an engine with 1 MiB blocks and one memory tier of budget.
func newBlockEngine(t *testing.T, budget string) *Engine {
	t.Helper()
	e, err := NewEngine(EngineConfig{Tiers: testTiers(t, budget), BlockBytes: 1 << 20}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// readBlock reads block n and returns its origin and bytes.
func readBlock(t *testing.T, e *Engine, root, path string, n int64) (Origin, []byte) {
	t.Helper()
	res, err := e.ReadBlock(context.Background(), root, path, n, true)
	if err != nil {
		t.Fatalf("block %d of %s: %v", n, path, err)
	}
	defer res.Release()
	return res.Origin, bytes.Clone(res.Bytes())
}

// wantBlock checks that got holds block n (of 1 MiB) of the file at path.
func wantBlock(t *testing.T, path string, n int64, got []byte) {
	t.Helper()
	data, _ := os.ReadFile(path)
	want := data[min(int64(len(data)), n<<20):min(int64(len(data)), (n+1)<<20)]
	if !bytes.Equal(got, want) {
		t.Fatalf("block %d: got %d bytes that differ from the source's %d", n, len(got), len(want))
	}
}

// A file larger than the tier is cached by the blocks that are read: each is read from the
// source once, by however many readers at once, and served from the tier afterwards; the
// last block is short and a block past the end is empty.
func TestBlocksOfAFileLargerThanTheTierAreCachedAsTheyAreRead(t *testing.T) {
	root, paths := dataset(t, 10<<20+123)
	path := paths[0]
	e := newBlockEngine(t, "6MiB")
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, n := range []int64{0, 3, 10} {
				res, err := e.ReadBlock(context.Background(), root, path, n, true)
				if err != nil {
					t.Errorf("block %d: %v", n, err)
					continue
				}
				wantBlock(t, path, n, res.Bytes())
				res.Release()
			}
		}()
	}
	wg.Wait()
	if s := e.Stats(); s.SourceReads != 3 || s.SourceBytes != 2<<20+123 || s.Errors != 0 {
		t.Fatalf("source reads %d (%d bytes), errors %d; want 3 blocks read once (%d bytes), no error",
			s.SourceReads, s.SourceBytes, s.Errors, 2<<20+123)
	}
	for _, n := range []int64{0, 3, 10} {
		if origin, got := readBlock(t, e, root, path, n); origin != OriginMemory {
			t.Errorf("block %d again: origin %q, want memory", n, origin)
		} else {
			wantBlock(t, path, n, got)
		}
	}
	if _, got := readBlock(t, e, root, path, 11); len(got) != 0 {
		t.Errorf("block past the end: %d bytes, want none", len(got))
	}
	if _, err := e.ReadBlock(context.Background(), root, path, -1, true); !errors.Is(err, ErrBadPath) {
		t.Errorf("block -1: %v, want ErrBadPath", err)
	}
	if s := e.Stats(); s.SourceReads != 3 {
		t.Errorf("source reads %d after hits, want 3", s.SourceReads)
	}
}

// Blocks never evict blocks of the file's own dataset: once the tier is full of them, the
// next block is declined (the caller reads the source) and counted as uncached, not failed.
func TestBlocksBeyondTheTierAreDeclinedNotFailed(t *testing.T) {
	root, paths := dataset(t, 10<<20)
	e := newBlockEngine(t, "4MiB")
	declined := 0
	for n := int64(0); n < 10; n++ {
		res, err := e.ReadBlock(context.Background(), root, paths[0], n, true)
		switch {
		case errors.Is(err, ErrCacheFull) || errors.Is(err, ErrTooLarge):
			declined++
		case err != nil:
			t.Fatalf("block %d: %v", n, err)
		default:
			wantBlock(t, paths[0], n, res.Bytes())
			res.Release()
		}
	}
	if s := e.Stats(); declined < 5 || s.Errors != 0 || s.Uncached < int64(declined) {
		t.Fatalf("declined %d, errors %d, uncached %d; want most declined, none an error", declined, s.Errors, s.Uncached)
	}
	if origin, _ := readBlock(t, e, root, paths[0], 0); origin != OriginMemory {
		t.Errorf("block 0 again: origin %q; a declined block must not evict the cached ones", origin)
	}
}

// A block is served only while its file is the version it was read from: a new job's
// session finds the file changed and reads the block again; Forget drops every block.
func TestBlocksOfAChangedFileAreReadAgain(t *testing.T) {
	root, paths := dataset(t, 3<<20)
	path := paths[0]
	e := newBlockEngine(t, "64MiB")
	readBlock(t, e, root, path, 0)
	readBlock(t, e, root, path, 2)
	changed := bytes.Repeat([]byte("x"), 3<<20)
	if err := os.WriteFile(path, changed, 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chtimes(path, time.Now(), time.Now().Add(time.Hour))
	e.BeginSession("next job")
	origin, got := readBlock(t, e, root, path, 0)
	if origin != OriginSource || !bytes.Equal(got, changed[:1<<20]) {
		t.Fatalf("block 0 of the changed file: origin %q, new bytes %v; want the source's new bytes", origin, bytes.Equal(got, changed[:1<<20]))
	}
	if s := e.Stats(); s.StaleCopies != 1 {
		t.Errorf("stale copies %d, want 1 (block 0, found stale)", s.StaleCopies)
	}
	for _, tier := range e.tiers {
		if tier.Listed(tiers.BlockName(path, e.blockBytes, 2)) {
			t.Error("block 2 of the version before is still listed: a stale block drops all of its file's")
		}
	}
	if err := e.Forget(root, path); err != nil {
		t.Fatal(err)
	}
	for _, tier := range e.tiers {
		for _, n := range []int64{0, 2} {
			if tier.Listed(tiers.BlockName(path, e.blockBytes, n)) {
				t.Errorf("block %d still listed after Forget", n)
			}
		}
	}
}

// A file rewritten during a session: the next block filled is of the new version, and the
// blocks of the version before go, so that no reader gets blocks of both.
func TestAFileChangedDuringASessionLosesItsOlderBlocks(t *testing.T) {
	root, paths := dataset(t, 3<<20)
	path := paths[0]
	e := newBlockEngine(t, "64MiB")
	readBlock(t, e, root, path, 0)
	changed := bytes.Repeat([]byte("y"), 3<<20)
	if err := os.WriteFile(path, changed, 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chtimes(path, time.Now(), time.Now().Add(time.Hour))
	if _, got := readBlock(t, e, root, path, 1); !bytes.Equal(got, changed[1<<20:2<<20]) {
		t.Fatal("block 1 is not of the new version")
	}
	for _, tier := range e.tiers {
		if tier.Listed(tiers.BlockName(path, e.blockBytes, 0)) {
			t.Fatal("block 0 of the version before is still listed beside block 1 of the new one")
		}
	}
	if origin, got := readBlock(t, e, root, path, 0); origin != OriginSource || !bytes.Equal(got, changed[:1<<20]) {
		t.Fatalf("block 0 again: origin %q; want the new version, read from the source", origin)
	}
}

// A server started with another block size removes the blocks of the size before: nobody
// asks for them any more, and a dataset's blocks never evict one another.
func TestBlocksOfAnotherSizeAreRemovedAtStart(t *testing.T) {
	root, paths := dataset(t, 3<<20)
	cfg := EngineConfig{Tiers: testTiers(t, "64MiB"), BlockBytes: 1 << 20}
	e, err := NewEngine(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	readBlock(t, e, root, paths[0], 1)
	e.Close()
	cfg.BlockBytes = 2 << 20
	e, err = NewEngine(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if e.tiers[0].Listed(tiers.BlockName(paths[0], 1<<20, 1)) {
		t.Fatal("a block of 1 MiB is still cached under a server of 2 MiB blocks")
	}
	if _, got := readBlock(t, e, root, paths[0], 1); len(got) != 1<<20 {
		t.Fatalf("block 1 of 2 MiB blocks: %d bytes, want the file's last 1 MiB", len(got))
	}
}

// prefetchAll fails the test on err (NewEngine's for e), closes e at its end, and prefetches
// paths in one job that it waits for.
func prefetchAll(t *testing.T, e *Engine, err error, root string, paths []string) PrefetchInfo {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths}); err != nil {
		t.Fatal(err)
	}
	return waitPrefetch(t, e, root, "a")
}

// Prefetch caches a large file that no tier takes whole by its blocks: all of them where
// the tiers have room (here two tiers of 6 MiB for a file of 10 MiB), and up to the budget,
// without evicting, where they have not; each block is read from the source once.
func TestPrefetchCachesALargeFileNoTierTakesByBlocks(t *testing.T) {
	for _, tc := range []struct {
		budgets []string
		state   string
	}{
		{[]string{"6MiB", "6MiB"}, PrefetchDone},
		{[]string{"6MiB"}, PrefetchBudget},
	} {
		root, paths := dataset(t, 10<<20+123)
		path := paths[0]
		e, err := NewEngine(EngineConfig{Tiers: testTiers(t, tc.budgets...), BlockBytes: 1 << 20,
			Prefetch: PrefetchConfig{Reads: 4}}, nil)
		info := prefetchAll(t, e, err, root, paths)
		cached := 0
		for n := range int64(11) {
			if e.HoldsBlock(path, n) {
				cached++
			}
		}
		s := e.Stats()
		if info.State != tc.state || info.Failed != 0 || s.Evictions != 0 || s.SourceReads != int64(cached) {
			t.Errorf("tiers %v: job %+v, %d evictions, %d source reads; want %s, none failed or evicted, "+
				"a read per cached block (%d)", tc.budgets, info, s.Evictions, s.SourceReads, tc.state, cached)
		}
		if want := map[string]int{PrefetchDone: 11, PrefetchBudget: 4}[tc.state]; cached < want {
			t.Errorf("tiers %v: %d blocks cached, want at least %d", tc.budgets, cached, want)
		}
		for n := range int64(11) {
			if !e.HoldsBlock(path, n) {
				continue
			}
			origin, got := readBlock(t, e, root, path, n)
			wantBlock(t, path, n, got)
			if origin != OriginMemory && origin != OriginDisk {
				t.Errorf("block %d after prefetch: origin %q, want a tier", n, origin)
			}
		}
	}
}

// Closing the engine stops a prefetch of a large file's blocks between two blocks: a file
// may have thousands of them, and Close must not wait for all.
func TestClosingStopsAPrefetchOfBlocks(t *testing.T) {
	root, paths := dataset(t, 20<<20)
	e, err := NewEngine(EngineConfig{Tiers: testTiers(t, "16MiB", "16MiB"), BlockBytes: 64 << 10,
		Prefetch: PrefetchConfig{Reads: 4}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Blocks 0-2 go through; the workers wait before the next ones until Close began.
	closing := make(chan struct{})
	testHookPrefetchBlock = func(n int64) {
		if n >= 3 {
			<-closing
		}
	}
	t.Cleanup(func() { testHookPrefetchBlock = nil })
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); e.Stats().SourceReads < 3; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first 3 blocks were not read in 10 s")
		}
	}
	closed := make(chan struct{})
	go func() { e.Close(); close(closed) }()
	for stopping := false; !stopping; time.Sleep(time.Millisecond) { // Close has stopped prefetch
		e.pf.mu.Lock()
		stopping = e.pf.stopped
		e.pf.mu.Unlock()
	}
	close(closing)
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return in 30 s")
	}
	if n := e.Stats().SourceReads; n != 3 {
		t.Errorf("%d of the file's 320 blocks read once Close began with 3 read: want no more", n)
	}
}

// In a cluster, prefetch caches the blocks this server owns and asks the owners of the
// others (EngineConfig.BlockOwner); once owners declined blockOwnerFailuresMax blocks, it
// asks no more of them, and goes on with its own.
func TestPrefetchOfBlocksAsksTheirOwners(t *testing.T) {
	root, paths := dataset(t, 40<<20)
	path := paths[0]
	var asked, declined atomic.Int64
	e, err := NewEngine(EngineConfig{Tiers: testTiers(t, "32MiB", "32MiB"), BlockBytes: 1 << 20,
		Prefetch: PrefetchConfig{Reads: 4},
		BlockOwner: func(ctx context.Context, root, p string, n int64, ask bool) (bool, error) {
			if n%2 == 0 {
				return true, nil
			}
			if !ask {
				return false, nil
			}
			asked.Add(1)
			if n >= 21 { // the owners of the blocks from 21 on are full
				declined.Add(1)
				return false, fmt.Errorf("%w: block %d", ErrCacheFull, n)
			}
			return false, nil
		}}, nil)
	info := prefetchAll(t, e, err, root, paths)
	for n := range int64(40) {
		if held := e.HoldsBlock(path, n); held != (n%2 == 0) {
			t.Errorf("block %d held %v, want %v (this server owns the even blocks)", n, held, n%2 == 0)
		}
	}
	if info.State != PrefetchDone || info.Failed != 0 {
		t.Errorf("job %+v, want done without failure", info)
	}
	if d := declined.Load(); d < blockOwnerFailuresMax || d > blockOwnerFailuresMax+blockPrefetchWidth {
		t.Errorf("%d blocks asked of owners that declined, want about %d: asks stop after that", d, blockOwnerFailuresMax)
	}
	if a := asked.Load(); a < 10 {
		t.Errorf("%d blocks asked of their owners, want the odd ones below 21 (10) at least", a)
	}
}
