package clayout

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/fitcache/fitcache/tiers"
)

// paths the layout must agree on: plain, unclean, leading dots, non-ASCII, a base name past
// the length kept in a data file's name, a block's name, the root.
var layoutPaths = []string{
	"/data/train/n01440764/img_0001.JPEG",
	"/data//train/./a/../b.bin",
	"/data/.hidden/..dots.txt",
	"/données/été/ß.bin",
	"/data/" + strings.Repeat("long", 60) + ".bin",
	tiers.BlockName("/data/big.h5", 4<<20, 12),
	"/",
}

// C cleans absolute paths as Go's filepath.Clean does.
func FuzzCleanPath(f *testing.F) {
	for _, p := range append(layoutPaths, "/..", "/a/b/..", "//x///y/", "/a/./", "/a/b/../../..") {
		f.Add(p)
	}
	f.Fuzz(func(t *testing.T, p string) {
		if !strings.HasPrefix(p, "/") || strings.IndexByte(p, 0) >= 0 {
			return
		}
		got, ok := CleanPath(p)
		if !ok {
			if len(p) < 4096 && len(filepath.Clean(p)) < 4096 {
				t.Fatalf("C refused %q", p)
			}
			return
		}
		if want := filepath.Clean(p); got != want {
			t.Fatalf("C cleans %q to %q, Go to %q", p, got, want)
		}
	})
}

// C hashes a clean path and names its data file as package tiers does.
func FuzzNamesMatchGo(f *testing.F) {
	for _, p := range layoutPaths {
		f.Add(p)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p := filepath.Clean("/" + s) // Go's functions clean the path; C's take it clean
		if len(p) >= 4000 {
			return
		}
		key, check := Hashes(p)
		if want := uint64(tiers.KeyOf(p)); key != want {
			t.Fatalf("key of %q: C %#x, Go %#x", p, key, want)
		}
		if want := tiers.CheckOf(p); check != want {
			t.Fatalf("check of %q: C %#x, Go %#x", p, check, want)
		}
		rel, ok := RelPath(p)
		if want := tiers.RelPath(p); !ok || rel != want {
			t.Fatalf("data file of %q: C %q (%v), Go %q", p, rel, ok, want)
		}
		n := int64(len(s)) * 7919 // any block number, and the sizes a server takes
		for _, bb := range []int64{64 << 10, 4 << 20, 256 << 20} {
			if got, want := BlockName(p, bb, n), tiers.BlockName(p, bb, n); got != want {
				t.Fatalf("block %d of %d bytes of %q: C %q, Go %q", n, bb, p, got, want)
			}
		}
	})
}

// C finds, in indexes Go wrote, every copy Go published (whole files and blocks, in either
// of two tiers), with the size, modification time and inode Go recorded, and the source's
// inode and change time the preload shim's fstat reports; it misses what
// was never published or was removed, and, asked for a later session, what was not checked
// in it.
func TestLookupsFindWhatGoPublished(t *testing.T) {
	var dirs []string
	var tierList []*tiers.Tier
	for _, kind := range []tiers.Kind{tiers.Memory, tiers.Disk} {
		dir := filepath.Join(t.TempDir(), kind.String())
		tier, err := tiers.New(tiers.Config{Dir: dir, Kind: kind, Budget: "16MiB", CreateParents: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tier.Close() })
		dirs, tierList = append(dirs, dir), append(tierList, tier)
	}
	published, number := map[string]int{}, map[string]int{}
	for i, p := range layoutPaths[:6] {
		p = filepath.Clean(p)
		data := []byte(strings.Repeat(string(rune('a'+i)), 100*(i+1)))
		e := tiers.Entry{SourcePath: p, Size: int64(len(data)), MTimeNanos: int64(1000 + i), Session: 5, Group: "/data",
			SourceIno: uint64(7000 + i), SourceCTimeNanos: int64(1_700_000_000_000_000_000 + i)}
		if err := tierList[i%2].Publish(e, data); err != nil {
			t.Fatal(err)
		}
		published[p], number[p] = i%2, i
	}
	for p, tier := range published {
		hit, err := Lookup(dirs, 5, true, p)
		if err != nil {
			t.Fatalf("%q: C missed a copy Go published in tier %d: %v", p, tier, err)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(dirs[tier], tiers.RelPath(p)), &st); err != nil {
			t.Fatal(err)
		}
		size, _ := tierList[tier].CachedSize(p)
		i := number[p]
		if hit.Tier != tier || hit.Size != size || hit.Ino != st.Ino || hit.Dev != st.Dev || hit.MTimeNano != int64(1000+i) {
			t.Errorf("%q: C found %+v, Go has tier %d, size %d, device %d, inode %d, mtime %d", p, hit, tier, size,
				st.Dev, st.Ino, 1000+i)
		}
		if hit.SrcIno != uint64(7000+i) || hit.SrcCTimeNano != int64(1_700_000_000_000_000_000+i) {
			t.Errorf("%q: C found the source's inode %d and change time %d, Go published %d and %d", p, hit.SrcIno,
				hit.SrcCTimeNano, 7000+i, 1_700_000_000_000_000_000+i)
		}
		// The descriptor a server would answer the open with is known by its inode: the same
		// hit. A copy of the file elsewhere, on the same file system, is none.
		f, err := os.Open(filepath.Join(dirs[tier], tiers.RelPath(p)))
		if err != nil {
			t.Fatal(err)
		}
		byFd, err := LookupFd(dirs, p, int(f.Fd()))
		f.Close()
		if err != nil || byFd != hit {
			t.Errorf("%q: fc_lookup_fd of the copy found %+v (%v), fc_lookup %+v", p, byFd, err, hit)
		}
		other := filepath.Join(dirs[tier], "other")
		if err := os.WriteFile(other, make([]byte, size), 0o600); err != nil {
			t.Fatal(err)
		}
		if f, err = os.Open(other); err != nil {
			t.Fatal(err)
		}
		byFd, err = LookupFd(dirs, p, int(f.Fd()))
		f.Close()
		if !errors.Is(err, syscall.ENOENT) {
			t.Errorf("%q: fc_lookup_fd took another file of the size for the copy: %+v (%v)", p, byFd, err)
		}
		if _, err := Lookup(dirs, 6, true, p); !errors.Is(err, syscall.ENOENT) {
			t.Errorf("%q: a copy not checked in session 6 served to it (%v)", p, err)
		}
		if _, err := Lookup(dirs, 6, false, p); err != nil {
			t.Errorf("%q: without the session required: %v", p, err)
		}
	}
	if _, err := Lookup(dirs, 0, false, "/data/never.bin"); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("a file never published: %v", err)
	}
	gone := filepath.Clean(layoutPaths[0])
	tierList[published[gone]].Forget(gone)
	if _, err := Lookup(dirs, 0, false, gone); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("a copy Go removed: %v", err)
	}
}

// memoryTier opens a tier of 16 MiB in a temporary directory, closed at the end of the test.
func memoryTier(tb testing.TB) (string, *tiers.Tier) {
	tb.Helper()
	dir := filepath.Join(tb.TempDir(), "memory")
	tier, err := tiers.New(tiers.Config{Dir: dir, Kind: tiers.Memory, Budget: "16MiB", CreateParents: true}, nil)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { tier.Close() })
	return dir, tier
}

// Readers count hits on a counter line per process: two processes write different cache
// lines, one process keeps its line, a process past the free lines takes over a gone owner's
// (its counts kept), and one past every live owner's shares a line. Go's sum sees every count.
func TestHitCountersPerProcess(t *testing.T) {
	dir, tier := memoryTier(t)
	// Pids above pid_max belong to no process: owners that are gone.
	raw, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Fatal(err)
	}
	pidMax, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		t.Fatal(err)
	}
	var wantN, wantBytes int64
	count := func(pid, n int, bytes int64) int {
		t.Helper()
		line, err := CountHitsAs(dir, pid, n, bytes)
		if err != nil {
			t.Fatalf("pid %d: %v", pid, err)
		}
		wantN, wantBytes = wantN+int64(n), wantBytes+int64(n)*bytes
		if n, bytes := tier.Hits(); n != wantN || bytes != wantBytes {
			t.Fatalf("after pid %d: Go sums %d hits of %d bytes, C counted %d of %d", pid, n, bytes, wantN, wantBytes)
		}
		return line
	}
	a, b := count(pidMax+1, 3, 100), count(pidMax+2, 5, 1000)
	if a == b {
		t.Errorf("two processes count on one line (%d)", a)
	}
	if again := count(pidMax+1, 1, 7); again != a {
		t.Errorf("a process counted on line %d, then on line %d", a, again)
	}
	used := map[int]bool{a: true, b: true}
	for pid := pidMax + 3; len(used) < CounterLines; pid++ {
		line := count(pid, 1, 1)
		if used[line] {
			t.Fatalf("pid %d took line %d, taken already, with %d of %d free", pid, line, CounterLines-len(used), CounterLines)
		}
		used[line] = true
	}
	// Every line claimed, by processes that are gone: one of them is taken over near the
	// pid's own, its counts kept (checked by count).
	late := pidMax + 1000
	line := count(late, 2, 10)
	if d := (line - late%CounterLines + CounterLines) % CounterLines; d >= 8 {
		t.Errorf("pid %d took over line %d, %d past its own", late, line, d)
	}
	// Every line held by a live process (this one): a new process shares the pid's own.
	if err := SetCounterOwners(dir, os.Getpid()); err != nil {
		t.Fatal(err)
	}
	shared := pidMax + 2000
	if line := count(shared, 4, 50); line != shared%CounterLines {
		t.Errorf("pid %d counted on line %d with every line held, want its own %d", shared, line, shared%CounterLines)
	}
}

// BenchmarkCountHit: fc_count_hit from parallel readers, each with a mapping of its own as a
// process has, counting on a line of its own (as now) or all on one line (as every reader
// did before each process had its line).
func BenchmarkCountHit(b *testing.B) {
	dir, _ := memoryTier(b)
	for _, shared := range []bool{false, true} {
		name := map[bool]string{false: "own-line", true: "shared-line"}[shared]
		b.Run(name, func(b *testing.B) {
			var next atomic.Int64
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				pid := 1 << 30 // no process has it: a line of its own
				if !shared {
					pid += int(next.Add(1))
				}
				var n int64
				for pb.Next() {
					n++
				}
				if err := CountHitsLoop(dir, pid, n); err != nil {
					b.Error(err)
				}
			})
		})
	}
}

// A reader's tiers opened over a small index follow it as it grows: C finds every copy
// published since, and the hits it counted on the index before it grew stay in the server's
// sum.
func TestLookupsFollowTheIndexAsItGrows(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "memory")
	tier, err := tiers.New(tiers.Config{Dir: dir, Kind: tiers.Memory, Budget: "1GiB", CreateParents: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	ts, err := OpenTiers([]string{dir}, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ts.Close()
	publish := func(i int) string {
		p := fmt.Sprintf("/data/f%d", i)
		if err := tier.Publish(tiers.Entry{SourcePath: p, Size: 1, MTimeNanos: 1}, []byte{1}); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if _, err := ts.Lookup(false, publish(0)); err != nil {
		t.Fatalf("the first file: %v", err)
	}
	ts.CountHit(100) // on the first index
	small := tier.Info().IndexBytes
	const n = 5000
	for i := 1; i < n; i++ {
		publish(i)
	}
	if grown := tier.Info().IndexBytes; grown <= small {
		t.Fatalf("%d files: the index stayed at %d bytes", n, grown)
	}
	for i := range n {
		if _, err := ts.Lookup(false, fmt.Sprintf("/data/f%d", i)); err != nil {
			t.Fatalf("file %d of %d, after the index grew: %v", i, n, err)
		}
	}
	ts.CountHit(10) // on the last
	if hits, bytes := tier.Hits(); hits != 2 || bytes != 110 {
		t.Errorf("the server's sum: %d hits of %d bytes, want 2 of 110", hits, bytes)
	}
}
