package core

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

// dataset writes files of the given sizes under a new root and returns the root and paths.
func dataset(t *testing.T, sizes ...int) (string, []string) {
	t.Helper()
	root := t.TempDir()
	var paths []string
	for i, n := range sizes {
		p := filepath.Join(root, "sub", fmt.Sprintf("f%03d.bin", i))
		os.MkdirAll(filepath.Dir(p), 0o755)
		data := make([]byte, n)
		rng := rand.New(rand.NewPCG(uint64(i), 1))
		for j := range data {
			data[j] = byte(rng.Uint32())
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	return root, paths
}

// testTiers returns tier configurations with the given budgets, memory first, then disk,
// in temporary directories.
func testTiers(t testing.TB, budgets ...string) []tiers.Config {
	t.Helper()
	var cfgs []tiers.Config
	for i, b := range budgets {
		kind := tiers.Memory
		if i > 0 {
			kind = tiers.Disk
		}
		cfgs = append(cfgs, tiers.Config{Dir: t.TempDir(), Kind: kind, Budget: b})
	}
	return cfgs
}

func newEngine(t *testing.T, budgets ...string) *Engine {
	t.Helper()
	e, err := NewEngine(EngineConfig{Tiers: testTiers(t, budgets...)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

func readAll(t *testing.T, e *Engine, root, path string) (Origin, []byte) {
	t.Helper()
	res, err := e.Read(context.Background(), root, path, false)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	defer res.Release()
	return res.Origin, bytes.Clone(res.Bytes())
}

func wantBytes(t *testing.T, path string, got []byte) {
	t.Helper()
	want, _ := os.ReadFile(path)
	if !bytes.Equal(got, want) {
		t.Fatalf("%s: got %d bytes that differ from the source's %d", path, len(got), len(want))
	}
}

// settle waits for the data mover to publish everything queued.
func settle(e *Engine) {
	e.mover.stop()
	e.mover = startMover(e, 256<<20)
}

// sparseFile creates a file of size bytes that takes no space (and no time to write).
func sparseFile(t *testing.T, dir, name string, size int64) string {
	t.Helper()
	p := filepath.Join(dir, name)
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestConcurrentMissesReadSourceOnce(t *testing.T) {
	root, paths := dataset(t, 1<<20)
	e := newEngine(t, "64MiB")
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := e.Read(context.Background(), root, paths[0], false)
			if err != nil {
				errs <- err
				return
			}
			want, _ := os.ReadFile(paths[0])
			if !bytes.Equal(res.Bytes(), want) {
				errs <- errors.New("wrong bytes")
			}
			res.Release()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	settle(e)
	s := e.Stats()
	if s.SourceReads != 1 || s.Misses != 1 {
		t.Errorf("16 concurrent readers: %d source reads, %d misses; want 1 and 1", s.SourceReads, s.Misses)
	}
	if got := s.Misses + s.InflightHits + s.Hits["memory"]; got != 16 {
		t.Errorf("misses+inflight+hits = %d, want 16", got)
	}
	if origin, got := readAll(t, e, root, paths[0]); origin != OriginMemory {
		t.Errorf("read after publication came from %q, want memory", origin)
	} else {
		wantBytes(t, paths[0], got)
	}
	if s := e.Stats(); s.SourceReads != 1 {
		t.Errorf("source reads after a hit: %d, want 1", s.SourceReads)
	}
}

func TestWantMappingReturnsPublishedTierFile(t *testing.T) {
	root, paths := dataset(t, 5000)
	e, err := NewEngine(EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: "1MiB"}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	res, err := e.Read(context.Background(), root, paths[0], true)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Release()
	if res.Mapping == nil {
		t.Fatalf("wantMapping miss returned no mapping (origin %q)", res.Origin)
	}
	wantBytes(t, paths[0], res.Bytes())
}

func TestSpillToNextTierAndOversize(t *testing.T) {
	root, paths := dataset(t, 3000, 3000, 3000)
	rootBig, big := dataset(t, 20000) // another dataset: its file may be evicted for root's
	paths = append(paths, big[0])
	one := tiers.EntrySize(paths[0], 3000)
	e := newEngine(t, fmt.Sprint(2*one), fmt.Sprint(4*one)) // memory holds 2 files, disk 4
	for _, p := range paths[:3] {
		_, got := readAll(t, e, root, p)
		wantBytes(t, p, got)
		settle(e)
	}
	// The first two filled memory; the third went to disk without eviction.
	wantOrigins := []Origin{OriginMemory, OriginMemory, OriginDisk}
	for i, p := range paths[:3] {
		if origin, _ := readAll(t, e, root, p); origin != wantOrigins[i] {
			t.Errorf("%s served from %q, want %q", p, origin, wantOrigins[i])
		}
	}
	// Force eviction from memory: a new engine over tiers that are full.
	s := e.Stats()
	if s.Spilled != 0 || s.Evictions != 0 {
		t.Errorf("spills before the tiers were full: %+v", s)
	}
	// The 20000-byte file is larger than memory but fits on disk.
	_, got := readAll(t, e, rootBig, paths[3])
	wantBytes(t, paths[3], got)
	settle(e)
	if origin, _ := readAll(t, e, rootBig, paths[3]); origin != OriginDisk {
		t.Errorf("large file served from %q after caching, want disk", origin)
	}
	// Every tier is full now: a file of another dataset evicts the oldest memory file, which
	// spills to disk, evicting the large file there (of a dataset other than its own).
	root2, more := dataset(t, 3000)
	readAll(t, e, root2, more[0])
	settle(e)
	if origin, _ := readAll(t, e, root2, more[0]); origin != OriginMemory {
		t.Errorf("new file served from %q, want memory", origin)
	}
	if origin, _ := readAll(t, e, root, paths[0]); origin != OriginDisk {
		t.Errorf("oldest memory file served from %q after eviction, want disk (spilled)", origin)
	}
	s = e.Stats()
	if s.Spilled < 1 || s.Evictions < 2 {
		t.Errorf("after overflow: spilled %d, evictions %d; want >= 1 and >= 2", s.Spilled, s.Evictions)
	}
	for _, ti := range s.Tiers {
		if ti.Used > ti.Budget {
			t.Errorf("tier %s over budget: %+v", ti.Kind, ti)
		}
	}
}

func TestOversizeFileServedUncached(t *testing.T) {
	root, paths := dataset(t, 1<<20)
	e := newEngine(t, "100KiB", "200KiB")
	for range 2 {
		origin, got := readAll(t, e, root, paths[0])
		wantBytes(t, paths[0], got)
		settle(e)
		if origin != OriginSource {
			t.Errorf("oversize file served from %q, want source", origin)
		}
	}
	if s := e.Stats(); s.Uncached != 2 || s.SourceReads != 2 {
		t.Errorf("uncached %d, source reads %d; want 2 and 2", s.Uncached, s.SourceReads)
	}
}

func TestDamagedEntryIsRefetched(t *testing.T) {
	root, paths := dataset(t, 4096)
	e := newEngine(t, "1MiB")
	readAll(t, e, root, paths[0])
	settle(e)
	cachedPath := e.tiers[0].CachedPath(paths[0])
	b, err := os.ReadFile(cachedPath)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(cachedPath, b[:100], 0o600) // damage it
	origin, got := readAll(t, e, root, paths[0])
	wantBytes(t, paths[0], got)
	if origin != OriginSource {
		t.Errorf("damaged entry served from %q, want source", origin)
	}
}

func TestReadErrors(t *testing.T) {
	root, paths := dataset(t, 10)
	outside := t.TempDir()
	secret := filepath.Join(outside, "secret")
	os.WriteFile(secret, []byte("x"), 0o644)
	link := filepath.Join(root, "sub", "link")
	if err := os.Symlink(secret, link); err != nil {
		t.Fatal(err)
	}
	inside := filepath.Join(root, "sub", "inside-link")
	os.Symlink(paths[0], inside)
	fifo := filepath.Join(root, "fifo")
	syscall.Mkfifo(fifo, 0o644)

	e := newEngine(t, "1MiB")
	for _, tc := range []struct {
		name, root, path string
		errno            syscall.Errno
		is               error
	}{
		{"missing", root, filepath.Join(root, "nope"), syscall.ENOENT, fs.ErrNotExist},
		{"directory", root, filepath.Join(root, "sub"), syscall.EISDIR, nil},
		{"outside", root, secret, syscall.EACCES, ErrOutsideRoot},
		{"dotdot", root, root + "/../x", syscall.EINVAL, ErrBadPath},
		{"relative", root, "sub/f000.bin", syscall.EINVAL, ErrBadPath},
		{"symlink escape", root, link, syscall.EACCES, ErrOutsideRoot},
		{"not regular", root, fifo, syscall.EINVAL, nil},
	} {
		_, err := e.Read(context.Background(), tc.root, tc.path, false)
		if got := Errno(err); got != tc.errno {
			t.Errorf("%s: errno %v (%v), want %v", tc.name, got, err, tc.errno)
		}
		if tc.is != nil && !errors.Is(err, tc.is) {
			t.Errorf("%s: %v is not %v", tc.name, err, tc.is)
		}
	}
	_, got := readAll(t, e, root, inside) // a link that stays inside the dataset is fine
	wantBytes(t, paths[0], got)

	restricted, err := NewEngine(EngineConfig{Roots: []string{t.TempDir()}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer restricted.Close()
	if _, err := restricted.Read(context.Background(), root, paths[0], false); !errors.Is(err, ErrOutsideRoot) {
		t.Errorf("root outside the server's roots: got %v, want ErrOutsideRoot", err)
	}
}

func TestErrnoErrorRoundTrip(t *testing.T) {
	_, err := os.Open("/nonexistent/fitcache")
	back := NewErrnoError(int32(Errno(err)), ReasonOf(err), err.Error())
	if !errors.Is(back, fs.ErrNotExist) {
		t.Errorf("ENOENT over the wire is not fs.ErrNotExist: %v", back)
	}
	outside := fmt.Errorf("%w: /x", ErrOutsideRoot)
	back = NewErrnoError(int32(Errno(outside)), ReasonOf(outside), outside.Error())
	if !errors.Is(back, ErrOutsideRoot) || !errors.Is(back, fs.ErrPermission) {
		t.Errorf("outside-root over the wire lost its identity: %v", back)
	}
	if NewErrnoError(0, ReasonUnspecified, "") != nil {
		t.Error("errno 0 is not nil")
	}
	// The reason decides, not the message: a file's own EACCES that happens to quote the
	// sentinel's text is not outside the root.
	quoting := NewErrnoError(int32(syscall.EACCES), ReasonUnspecified, "open /d/"+ErrOutsideRoot.Error()+": permission denied")
	if errors.Is(quoting, ErrOutsideRoot) || !errors.Is(quoting, fs.ErrPermission) {
		t.Errorf("a permission error quoting the sentinel: Is(ErrOutsideRoot) %v", errors.Is(quoting, ErrOutsideRoot))
	}
	for _, sentinel := range []error{ErrBadPath, ErrCacheFull, ErrTooLarge, ErrChanged, ErrClosed} {
		err := fmt.Errorf("%w: /d/x", sentinel)
		back := NewErrnoError(int32(Errno(err)), ReasonOf(err), "no words in common")
		if !errors.Is(back, sentinel) {
			t.Errorf("%v over the wire lost its identity (reason %d)", sentinel, ReasonOf(err))
		}
	}
	if cacheFull := NewErrnoError(int32(syscall.ENOSPC), ReasonCacheFull, ""); !errors.Is(cacheFull, ErrTooLarge) {
		t.Error("ErrCacheFull over the wire is not ErrTooLarge, which it wraps")
	}
	// A server of an earlier version sends no reason: its EFBIG still means "read the source".
	if old := NewErrnoError(int32(syscall.EFBIG), ReasonUnspecified, ""); !errors.Is(old, ErrTooLarge) {
		t.Error("EFBIG without a reason is not ErrTooLarge")
	}
}

// A dataset twice the cache, read in a new random order each epoch, as training does: the
// files cached first stay (nothing of the dataset is evicted for another of its files), so
// every epoch after the first hits on half the files and reads the other half from the
// source once. With FIFO eviction a fixed order hit nothing and random orders 40-45%.
func TestDatasetLargerThanTheCacheDoesNotThrash(t *testing.T) {
	const n = 40
	sizes := make([]int, n)
	for i := range sizes {
		sizes[i] = 3000
	}
	root, paths := dataset(t, sizes...)
	e := newEngine(t, fmt.Sprint(n/2*tiers.EntrySize(paths[0], 3000)))
	for epoch := range 4 {
		order := rand.New(rand.NewPCG(uint64(epoch), 7)).Perm(n)
		if epoch == 3 {
			order = order[:0]
			for i := range n { // a fixed order too
				order = append(order, i)
			}
		}
		before := e.Stats()
		hits := 0
		for _, i := range order {
			res, err := e.Read(context.Background(), root, paths[i], true)
			if err != nil {
				t.Fatal(err)
			}
			if res.Origin == OriginMemory {
				hits++
			}
			wantBytes(t, paths[i], res.Bytes())
			res.Release()
		}
		after := e.Stats()
		reads := after.SourceReads - before.SourceReads
		if epoch > 0 && (hits != n/2 || reads != n/2) {
			t.Errorf("epoch %d: %d hits, %d source reads; want %d each", epoch, hits, reads, n/2)
		}
		if after.Evictions != 0 {
			t.Fatalf("epoch %d: %d evictions, want none", epoch, after.Evictions)
		}
	}
	// A client reading through the node socket is told at once, before anything is read.
	before := e.Stats()
	for _, p := range paths {
		if err := e.Fetch(context.Background(), root, p); err != nil && !errors.Is(err, ErrCacheFull) {
			t.Fatalf("fetch %s: %v", p, err)
		}
	}
	if reads := e.Stats().SourceReads - before.SourceReads; reads != 0 {
		t.Errorf("fetches of files without room read %d files, want 0", reads)
	}
}

// A dataset that stops fitting is said once, in the log and in the stats' warnings: its
// files that do not fit are read from the source at every read, which a user sizing the
// cache must hear of. A dataset that fits says nothing.
func TestADatasetThatDoesNotFitIsSaidOnce(t *testing.T) {
	root, paths := dataset(t, 3000, 3000, 3000, 3000, 3000)
	e := newEngine(t, fmt.Sprint(2*tiers.EntrySize(paths[0], 3000)))
	full := func() (n int) {
		for _, w := range e.Stats().Warnings {
			if strings.Contains(w, "full of the dataset "+root) {
				n++
			}
		}
		return n
	}
	for _, p := range paths[:2] {
		readAll(t, e, root, p)
	}
	if n := full(); n != 0 {
		t.Fatalf("%d warnings of a dataset that fits", n)
	}
	for range 2 {
		for _, p := range paths {
			_, got := readAll(t, e, root, p)
			wantBytes(t, p, got)
		}
	}
	if n := full(); n != 1 {
		t.Errorf("%d warnings of a dataset that does not fit, want 1: %q", n, e.Stats().Warnings)
	}
}

// Reads after Close fail cleanly (they once panicked on an unmapped file of the engine).
func TestReadAfterCloseIsErrClosed(t *testing.T) {
	root, paths := dataset(t, 100)
	e, err := NewEngine(EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: "1MiB"}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, e, root, paths[0])
	e.Close()
	if _, err := e.Read(context.Background(), root, paths[0], false); !errors.Is(err, ErrClosed) {
		t.Errorf("read after Close: got %v, want ErrClosed", err)
	}
	if err := e.Store(StoreRequest{Root: root, Path: paths[0], Data: []byte("x")}); !errors.Is(err, ErrClosed) {
		t.Errorf("store after Close: got %v, want ErrClosed", err)
	}
}

// heapGrowth runs f and returns how much the Go heap grew at its peak, sampled while f runs.
func heapGrowth(t *testing.T, f func()) uint64 {
	t.Helper()
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	done := make(chan struct{})
	peak := make(chan uint64)
	go func() {
		var max uint64
		for {
			var m runtime.MemStats
			runtime.ReadMemStats(&m)
			if m.HeapAlloc > max {
				max = m.HeapAlloc
			}
			select {
			case <-done:
				peak <- max
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	f()
	close(done)
	max := <-peak
	if max < before.HeapAlloc {
		return 0
	}
	return max - before.HeapAlloc
}

// A file larger than every tier is refused before it is read: the caller reads the source.
// In a build without it, the engine read it whole into memory (10 GiB). The
// refusal is counted as an uncached file, not as a failed read.
func TestFileLargerThanTiersIsNotReadIntoMemory(t *testing.T) {
	root := t.TempDir()
	huge := sparseFile(t, root, "huge.bin", 10<<30)
	e := newEngine(t, "64MiB")
	for _, wantMapping := range []bool{true, false} {
		var err error
		grew := heapGrowth(t, func() { _, err = e.Read(context.Background(), root, huge, wantMapping) })
		if !errors.Is(err, ErrTooLarge) || Errno(err) != 27 { // EFBIG
			t.Errorf("wantMapping=%v: got %v (errno %d), want ErrTooLarge (EFBIG)", wantMapping, err, Errno(err))
		}
		if grew > 64<<20 {
			t.Errorf("wantMapping=%v: heap grew by %d MiB", wantMapping, grew>>20)
		}
	}
	if s := e.Stats(); s.Uncached < 1 || s.Errors != 0 {
		t.Errorf("uncached = %d, errors = %d; want >= 1 and 0: a declined read is no error", s.Uncached, s.Errors)
	}
}

// A large file that fits a tier is copied into it through a small buffer and served as a
// mapping; a caller that needs bytes gets them only up to MaxSendBytes.
func TestLargeFileIsStreamedIntoATier(t *testing.T) {
	root := t.TempDir()
	big := sparseFile(t, root, "big.bin", 256<<20)
	f, _ := os.OpenFile(big, os.O_WRONLY, 0)
	f.WriteAt([]byte("end"), 256<<20-3)
	f.Close()
	e, err := NewEngine(EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Disk, Budget: "1GiB"}},
		MaxSendBytes: 1 << 20}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	var res Result
	grew := heapGrowth(t, func() { res, err = e.Read(context.Background(), root, big, true) })
	if err != nil {
		t.Fatal(err)
	}
	defer res.Release()
	if res.Mapping == nil || res.Origin != OriginSource || len(res.Bytes()) != 256<<20 || string(res.Bytes()[256<<20-3:]) != "end" {
		t.Fatalf("got mapping %v, origin %q, %d bytes; want the whole file mapped from a tier", res.Mapping != nil, res.Origin, len(res.Bytes()))
	}
	if grew > 64<<20 {
		t.Errorf("copying a 256 MiB file into a tier grew the heap by %d MiB", grew>>20)
	}
	if _, err := e.Read(context.Background(), root, big, false); !errors.Is(err, ErrTooLarge) {
		t.Errorf("bytes of a cached file over MaxSendBytes: got %v, want ErrTooLarge", err)
	}
	if s := e.Stats(); s.SourceReads != 1 || s.Published != 1 {
		t.Errorf("source reads %d, published %d; want 1 and 1", s.SourceReads, s.Published)
	}
}
