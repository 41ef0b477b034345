package tiers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

// publishTiny publishes n one-byte files /data/f<from> .. /data/f<from+n-1>.
func publishTiny(t *testing.T, tier *Tier, from, n int) {
	t.Helper()
	for i := from; i < from+n; i++ {
		publish(t, tier, fmt.Sprintf("/data/f%d", i), []byte{byte(i)})
	}
}

// The index starts small and grows with the files the tier holds, never evicting one below
// its ceiling; a reader that mapped it before it grew finds every copy, and so does the
// server's own view; the index file on disk is the size Info reports.
func TestIndexGrowsWithItsFiles(t *testing.T) {
	tier := newTier(t, Disk, "1GiB") // ceiling: 8,192 buckets
	if got, want := tier.Info().IndexBytes, indexLen(minIndexBuckets); got != want {
		t.Fatalf("an empty tier's index takes %d bytes, want %d", got, want)
	}
	reader := readerOf(t, tier)
	const n = 6000
	publishTiny(t, tier, 0, n)
	info := tier.Info()
	if info.Files != n || info.IndexEvictions != 0 {
		t.Fatalf("after %d files: %d files, %d evicted for the index", n, info.Files, info.IndexEvictions)
	}
	tier.background.Wait() // the next index made ahead, if it is
	info = tier.Info()
	tier.mu.Lock()
	size, next := indexLen(tier.ix.buckets), int64(0)
	if tier.nextIndex != nil {
		next = indexLen(tier.nextIndex.ix.buckets)
	}
	tier.mu.Unlock()
	if size < indexLen(4096) || size >= indexLen(indexCeiling(1<<30)) {
		t.Errorf("the index of %d files takes %d bytes, want %d (4,096 buckets) up to less than its ceiling's %d",
			n, size, indexLen(4096), indexLen(indexCeiling(1<<30)))
	}
	if info.IndexBytes != size+next {
		t.Errorf("Info says the index takes %d bytes, want %d and the next one's %d", info.IndexBytes, size, next)
	}
	st, err := os.Stat(filepath.Join(tier.Path, indexName))
	if err != nil || st.Size() != size {
		t.Errorf("the index file: %v (%v), want %d bytes", st, err, size)
	}
	for i := range n {
		p := fmt.Sprintf("/data/f%d", i)
		for who, d := range map[string]Dir{"a reader opened before the index grew": reader, "the server": tier.Dir} {
			m, err := d.Open(p)
			if err != nil {
				t.Fatalf("%s misses %s: %v", who, p, err)
			}
			if b := m.Bytes(); len(b) != 1 || b[0] != byte(i) {
				t.Fatalf("%s reads %v for %s", who, b, p)
			}
			m.Release()
		}
	}
}

// A server started over a tier sizes the index for the files it finds, and keeps the last
// validation session through the index's growth.
func TestIndexOfARestartedServerFitsItsFiles(t *testing.T) {
	dir := t.TempDir()
	tier, err := New(Config{Dir: dir, Kind: Disk, Budget: "1GiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tier.NoteSession(7)
	publishTiny(t, tier, 0, 3000) // grows at least once
	grown := tier.Info().IndexBytes
	tier.Close()
	again, err := New(Config{Dir: dir, Kind: Disk, Budget: "1GiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if got := again.LastSession(); got != 7 {
		t.Errorf("the restarted server's last session: %d, want 7", got)
	}
	if info := again.Info(); info.Files != 3000 || info.IndexBytes != indexLen(4096) || info.IndexEvictions != 0 {
		t.Errorf("restarted over 3,000 files: %d files, an index of %d bytes (want %d; %d before), %d evicted",
			info.Files, info.IndexBytes, indexLen(4096), grown, info.IndexEvictions)
	}
}

// At its ceiling the index grows no more: a full bucket evicts its oldest file.
func TestIndexAtItsCeilingEvicts(t *testing.T) {
	tier := newTier(t, Disk, "64MiB") // ceiling: minIndexBuckets
	publishTiny(t, tier, 0, 4000)     // 8 KiB each: 32 MiB, in the budget
	info := tier.Info()
	if info.IndexBytes != indexLen(minIndexBuckets) {
		t.Errorf("the index grew past its ceiling: %d bytes", info.IndexBytes)
	}
	if info.IndexEvictions == 0 || info.Files+int(info.IndexEvictions) != 4000 {
		t.Errorf("4,000 files in %d buckets of %d: %d held, %d evicted for the index", minIndexBuckets, indexWays,
			info.Files, info.IndexEvictions)
	}
}

// Where the first bucket overflows as files come in, and so when the index grows: the
// figures its geometry's comment gives.
func TestIndexBucketsOverflowNearTheLoadsTheDocsGive(t *testing.T) {
	for _, c := range []struct {
		buckets  uint32
		min, max float64 // entries per bucket at the first overflow
	}{{1 << 10, 1.4, 3.2}, {1 << 14, 1.1, 2.3}} {
		ix := &index{buckets: c.buckets}
		var loads []float64
		for _, format := range []string{"/data/train/f%d", "/data/train/%08d.jpg", "/imagenet/n%08d.JPEG"} {
			counts := map[uint32]int{}
			for i := 0; ; i++ {
				b := ix.bucketOf(KeyOf(fmt.Sprintf(format, i)))
				if counts[b]++; counts[b] > indexWays {
					loads = append(loads, float64(i)/float64(c.buckets))
					break
				}
			}
		}
		for _, l := range loads {
			if l < c.min || l > c.max {
				t.Errorf("%d buckets: the first overflowed at %.2f entries per bucket (all: %.2f), want %.1f to %.1f",
					c.buckets, l, loads, c.min, c.max)
			}
		}
		t.Logf("%d buckets: first overflow at %.2f entries per bucket", c.buckets, loads)
	}
}

// A lookup of the server's own while its index grows, at the worst moment (the new index in
// place, not yet its view's), finds the file in the old index, which is not retired yet, and
// maps nothing of its own: every reader's hit is counted once.
func TestIndexGrowingCountsEveryHitOnce(t *testing.T) {
	tier := newTier(t, Disk, "1GiB")
	publish(t, tier, "/data/a", []byte{1})
	tier.mu.Lock()
	old := tier.ix
	var ix *index
	err := withFd(tier.dirFile, func(dirfd int) error {
		var err error
		ix, _, err = createIndex(dirfd, old.buckets*2, old.copyTo, func(ix *index) {
			if _, ok := tier.CachedSize("/data/a"); !ok {
				t.Error("the server's lookup missed while its index grew")
			}
			tier.view.replace(ix)
		})
		return err
	})
	if err != nil {
		tier.mu.Unlock()
		t.Fatal(err)
	}
	tier.ix = ix
	tier.mu.Unlock()
	atomic.AddUint64(ix.word64(counterBase+lineHits), 1) // a reader's hit on the new index
	atomic.AddUint64(ix.word64(counterBase+lineHitBytes), 10)
	if n, b := tier.Hits(); n != 1 || b != 10 {
		t.Errorf("Hits: %d of %d bytes, want 1 of 10", n, b)
	}
	if !old.retired() {
		t.Error("the old index is not retired")
	}
}

// A reader follows an index that grew twice within indexRetry (a reader only waits that
// long after an index it could not open).
func TestReaderFollowsTwoGrowthsAtOnce(t *testing.T) {
	tier := newTier(t, Disk, "1GiB")
	reader := readerOf(t, tier)
	for round := range 2 {
		p := fmt.Sprintf("/data/after-%d", round)
		tier.mu.Lock()
		err := tier.growIndex()
		tier.mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		publish(t, tier, p, []byte{byte(round)})
		m, err := reader.Open(p)
		if err != nil {
			t.Fatalf("growth %d: the reader misses a file published after it: %v", round+1, err)
		}
		m.Release()
	}
}

// smallTmpfs mounts a tmpfs of size bytes for the test (skipped where this process may not
// mount one), unmounted at its end.
func smallTmpfs(t *testing.T, size int) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, fmt.Sprintf("size=%d,mode=0700", size)); err != nil {
		t.Skipf("cannot mount a tmpfs here: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// An index that cannot grow for want of room in its file system says so and stays as it
// was: nothing is left behind, the tier goes on publishing and its readers on finding.
func TestIndexThatCannotGrowStaysAsItWas(t *testing.T) {
	fs := smallTmpfs(t, 1800<<10) // the first index (660 KiB) fits; one of twice its buckets does not
	tier, err := New(Config{Dir: filepath.Join(fs, "tier"), Kind: Memory, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	publish(t, tier, "/data/a", []byte("a"))
	tier.mu.Lock()
	err = tier.growIndex()
	tier.mu.Unlock()
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("growing an index on a full file system: %v, want ENOSPC", err)
	}
	if got := tier.Info().IndexBytes; got != indexLen(minIndexBuckets) {
		t.Errorf("the index takes %d bytes after a failed growth, want %d", got, indexLen(minIndexBuckets))
	}
	if left := tempFiles(t, tier.Path); len(left) > 0 {
		t.Errorf("left behind: %v", left)
	}
	publish(t, tier, "/data/b", []byte("b"))
	for _, p := range []string{"/data/a", "/data/b"} {
		m, err := tier.Open(p)
		if err != nil {
			t.Fatalf("%s after a failed growth: %v", p, err)
		}
		m.Release()
	}
}

// A reader that keeps reading while the server restarts finds every copy the restarted
// server keeps, all along: the restarted server's index lists them before it is renamed into
// place (the reader moves to it at once), not one by one after; also when the index cannot
// grow to list every copy found (a lower budget: the oldest of an overflowing bucket are
// evicted, and only they may be missed).
func TestReaderFindsEveryFileWhileTheServerRestarts(t *testing.T) {
	for _, restartBudget := range []string{"1GiB", "64MiB"} { // 64 MiB: a ceiling of 1,024 buckets
		t.Run("budget="+restartBudget, func(t *testing.T) {
			dir := memoryDir(t)
			tier, err := New(Config{Dir: dir, Kind: Memory, Budget: "1GiB"}, nil)
			if err != nil {
				t.Fatal(err)
			}
			const n = 6000
			publishTiny(t, tier, 0, n)
			tier.Close()
			reader, err := OpenDir(tier.Path, Memory)
			if err != nil {
				t.Fatal(err)
			}
			defer reader.Close()
			var stop atomic.Bool
			var lookups atomic.Int64
			missed := map[string]bool{}
			done := make(chan struct{})
			go func() {
				defer close(done)
				deadline := time.Now().Add(time.Minute)
				for i := 0; !stop.Load() && i < 50_000_000 && time.Now().Before(deadline); i++ {
					p := fmt.Sprintf("/data/f%d", (i*7919)%n)
					m, err := reader.Open(p)
					lookups.Add(1)
					if err != nil {
						missed[p] = true
						continue
					}
					m.Release()
				}
			}()
			for lookups.Load() == 0 {
				time.Sleep(time.Millisecond)
			}
			before := lookups.Load()
			again, err := New(Config{Dir: dir, Kind: Memory, Budget: restartBudget}, nil)
			during := lookups.Load() - before
			time.Sleep(20 * time.Millisecond) // lookups in the new index
			stop.Store(true)
			<-done
			if err != nil {
				t.Fatal(err)
			}
			defer again.Close()
			if during == 0 {
				t.Fatal("the reader made no lookup while the server restarted")
			}
			var kept []string
			for p := range missed {
				if m, err := again.Open(p); err == nil {
					m.Release()
					kept = append(kept, p)
				}
			}
			if len(kept) > 0 {
				t.Errorf("%d copies the restarted server keeps were missed during its restart (%d lookups then): %v",
					len(kept), during, kept[:min(len(kept), 5)])
			}
			info := again.Info()
			if restartBudget == "1GiB" && info.Files != n {
				t.Errorf("restarted over %d files: %d", n, info.Files)
			}
			if restartBudget == "64MiB" && (info.IndexEvictions == 0 || info.Files+int(info.IndexEvictions) != n) {
				t.Errorf("restarted at the index's ceiling: %d files kept, %d evicted, want %d in all, some evicted",
					info.Files, info.IndexEvictions, n)
			}
			// What a bucket keeps is its newest copies (published last), as before.
			newestEvicted, oldestKept := map[uint32]int{}, map[uint32]int{}
			for i := range n {
				p := fmt.Sprintf("/data/f%d", i)
				b := again.ix.bucketOf(KeyOf(p))
				if m, err := again.Open(p); err == nil {
					m.Release()
					if _, ok := oldestKept[b]; !ok {
						oldestKept[b] = i
					}
				} else {
					newestEvicted[b] = i
				}
			}
			for b, e := range newestEvicted {
				if k, ok := oldestKept[b]; ok && k < e {
					t.Errorf("bucket %d kept f%d and evicted the newer f%d", b, k, e)
				}
			}
		})
	}
}

// memoryDir returns a new directory in /dev/shm (where files are made a hundred times faster
// than on some test machines' disks), removed at the test's end; a temporary directory where
// there is no /dev/shm.
func memoryDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "fitcache-test-")
	if err != nil {
		return t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// pathsOfOneBucket returns n source paths whose entries fall in one bucket of an index of
// the given buckets.
func pathsOfOneBucket(buckets uint32, n int) []string {
	ix := &index{buckets: buckets}
	var paths []string
	for i := 0; len(paths) < n; i++ {
		if p := fmt.Sprintf("/data/same-bucket-%d", i); ix.bucketOf(KeyOf(p)) == 0 {
			paths = append(paths, p)
		}
	}
	return paths
}

// Once a bucket is full, the file of the index's next growth is made ahead, outside the
// tier's lock, and counted in IndexBytes; the growth puts that file in place, readers and
// the server find every copy in it, and closing the tier leaves no file behind.
func TestIndexFileIsMadeAheadOfItsGrowth(t *testing.T) {
	tier, err := New(Config{Dir: memoryDir(t), Kind: Memory, Budget: "1GiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	reader := readerOf(t, tier)
	same := pathsOfOneBucket(minIndexBuckets, indexWays+1)
	for _, p := range same[:indexWays-1] {
		publish(t, tier, p, []byte{1})
	}
	tier.background.Wait()
	if got, want := tier.Info().IndexBytes, indexLen(minIndexBuckets); got != want {
		t.Errorf("IndexBytes before any bucket is full: %d, want %d (none made ahead)", got, want)
	}
	publish(t, tier, same[indexWays-1], []byte{1}) // fills the bucket
	tier.background.Wait()
	tier.mu.Lock()
	var next *index
	if tier.nextIndex != nil {
		next = tier.nextIndex.ix
	}
	tier.mu.Unlock()
	if next == nil || next.buckets != 2*minIndexBuckets {
		t.Fatalf("no next index of %d buckets made once a bucket was full: %v", 2*minIndexBuckets, next)
	}
	if got, want := tier.Info().IndexBytes, indexLen(minIndexBuckets)+indexLen(2*minIndexBuckets); got != want {
		t.Errorf("IndexBytes with the next index made: %d, want %d", got, want)
	}
	publish(t, tier, same[indexWays], []byte{1}) // overflows the bucket: the index grows
	tier.mu.Lock()
	grown := tier.ix
	tier.mu.Unlock()
	if grown != next {
		t.Errorf("the index grew into a file made then (%d buckets), not the one made ahead", grown.buckets)
	}
	tier.background.Wait()
	if got, want := tier.Info().IndexBytes, indexLen(2*minIndexBuckets); got != want {
		t.Errorf("IndexBytes after the growth: %d, want %d", got, want)
	}
	publishTiny(t, tier, 0, 100)
	paths := same
	for i := range 100 {
		paths = append(paths, fmt.Sprintf("/data/f%d", i))
	}
	for _, p := range paths {
		for who, d := range map[string]Dir{"a reader": reader, "the server": tier.Dir} {
			m, err := d.Open(p)
			if err != nil {
				t.Fatalf("%s misses %s after the growth: %v", who, p, err)
			}
			m.Release()
		}
	}
	publishTiny(t, tier, 100, 3*minIndexBuckets) // the next growth's file made ahead, or on its way
	if err := tier.Close(); err != nil {
		t.Fatal(err)
	}
	if left := tempFiles(t, tier.Path); len(left) > 0 {
		t.Errorf("left behind by Close: %v", left)
	}
}

// A file system without room to spare for the next index gets none made ahead: allocating it
// would take the room copies are being written to for a moment, and fail them. It is not
// tried again at every publish, and every copy is published.
func TestNextIndexIsNotMadeWithoutRoomToSpare(t *testing.T) {
	fs := smallTmpfs(t, 660<<10+1400<<10) // the index, and less than twice the next one's 1,300 KiB
	var tries atomic.Int64
	log := slog.New(messageCounter{"could not make the tier's next index ahead of its growth", &tries})
	tier, err := New(Config{Dir: filepath.Join(fs, "tier"), Kind: Memory, Budget: "200MiB"}, log)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	for _, p := range append(pathsOfOneBucket(minIndexBuckets, indexWays), "/data/a", "/data/b", "/data/c") {
		publish(t, tier, p, []byte{1})
		tier.background.Wait()
	}
	info := tier.Info()
	if tries.Load() != 1 || info.IndexBytes != indexLen(minIndexBuckets) {
		t.Errorf("a next index was tried %d times (want once) and IndexBytes is %d (want %d)",
			tries.Load(), info.IndexBytes, indexLen(minIndexBuckets))
	}
	if info.LimitedBy != "" {
		t.Errorf("the budget was lowered: %s", info.LimitedBy)
	}
	if left := tempFiles(t, tier.Path); len(left) > 0 {
		t.Errorf("left behind: %v", left)
	}
}

// messageCounter is a slog handler that counts the records whose message is msg.
type messageCounter struct {
	msg string
	n   *atomic.Int64
}

func (h messageCounter) Enabled(context.Context, slog.Level) bool { return true }
func (h messageCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		h.n.Add(1)
	}
	return nil
}
func (h messageCounter) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h messageCounter) WithGroup(string) slog.Handler      { return h }

// Info may be asked while the tier closes (a metrics scrape during a server's exit).
func TestInfoWhileTheTierCloses(t *testing.T) {
	tier, err := New(Config{Dir: memoryDir(t), Kind: Memory, Budget: "1GiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pathsOfOneBucket(minIndexBuckets, indexWays) { // a next index made ahead
		publish(t, tier, p, []byte{1})
	}
	tier.background.Wait()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 1000 {
			tier.Info()
		}
	}()
	if err := tier.Close(); err != nil {
		t.Error(err)
	}
	<-done
}

// tempFiles lists the temporary files in dir.
func tempFiles(t *testing.T, dir string) []string {
	t.Helper()
	names, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var temps []string
	for _, e := range names {
		if strings.HasPrefix(e.Name(), tempPrefix) {
			temps = append(temps, e.Name())
		}
	}
	return temps
}

// createIndex builds a new index of the given buckets in the tier directory dirfd, filled by
// fill (nil for none), and puts it in place, handing it to installed (nil for none) first and
// giving back the old one's slots at once. It returns the last session the old index
// recorded.
func createIndex(dirfd int, buckets uint32, fill, installed func(*index)) (*index, uint32, error) {
	n, err := newIndexFile(dirfd, buckets)
	if err != nil {
		return nil, 0, err
	}
	if fill != nil {
		fill(n.ix)
	}
	sessions, old, err := n.install(dirfd, installed)
	if err != nil {
		return nil, 0, err
	}
	old.giveBack(dirfd)
	return n.ix, sessions, nil
}

// A restarted server whose index cannot list every copy it finds (nine in one bucket of
// eight slots) keeps the newest eight and lists them from the start: at the index's ceiling
// (as it kept them before it listed copies ahead of the index's rename), and where its file
// system has no room beside the old index for one of enough buckets (the largest that fits).
func TestARestartKeepsTheNewestCopiesOfAFullBucket(t *testing.T) {
	for _, tc := range []struct {
		name, budget string
		buckets      uint32 // of the restarted server's index
		dir          func(t *testing.T) string
	}{
		{"at the ceiling", "256MiB", 2 * minIndexBuckets, func(t *testing.T) string { return memoryDir(t) }},
		{"no room to grow", "1GiB", 2 * minIndexBuckets, func(t *testing.T) string {
			// Room for the indexes of 1,024, 2,048 and 4,096 buckets at once as the first server
			// grows it, then for the 4,096 one and one of 2,048 beside it, not two of 4,096.
			return filepath.Join(smallTmpfs(t, 5000<<10), "tier")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := tc.dir(t)
			same := pathsOfOneBucket(2*minIndexBuckets, indexWays+1) // one bucket at 1,024 and 2,048
			tier, err := New(Config{Dir: dir, Kind: Memory, Budget: "1GiB"}, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range same[:indexWays] {
				publish(t, tier, p, []byte{1})
			}
			tier.background.Wait()                       // the next index made ahead
			publish(t, tier, same[indexWays], []byte{1}) // grows to 4,096 buckets
			if info := tier.Info(); info.Files != len(same) {
				t.Fatalf("the first server holds %d files, want %d", info.Files, len(same))
			}
			tier.Close()
			again, err := New(Config{Dir: dir, Kind: Memory, Budget: tc.budget}, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer again.Close()
			reader := readerOf(t, again)
			var kept []string
			for _, p := range same {
				if m, err := reader.Open(p); err == nil {
					m.Release()
					kept = append(kept, p)
				}
			}
			if diff := cmp.Diff(same[1:], kept); diff != "" {
				t.Errorf("copies kept (-want +got):\n%s", diff)
			}
			if info := again.Info(); info.Files != indexWays || info.IndexEvictions != 1 || info.IndexBytes != indexLen(tc.buckets) {
				t.Errorf("after the restart: %d files, %d evicted, an index of %d bytes; want %d, 1 and %d",
					info.Files, info.IndexEvictions, info.IndexBytes, indexWays, indexLen(tc.buckets))
			}
		})
	}
}

// A retired index keeps a temporary name until its slots are given back; a server that stops
// before then (killed within the grace) leaves it there, and the next server's rescan gives
// it back: a reader that still maps it does not keep its pages.
func TestARetiredIndexLeftByAStoppedServerIsGivenBack(t *testing.T) {
	dir := memoryDir(t)
	tier, err := New(Config{Dir: dir, Kind: Memory, Budget: "1GiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	publishTiny(t, tier, 0, 100)
	held, err := os.Open(filepath.Join(dir, indexName)) // a reader's hold on the index to retire
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	tier.mu.Lock()
	err = tier.growIndex()
	tier.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	retired := tempFiles(t, dir)
	if len(retired) != 1 {
		t.Fatalf("temporary files during the retired index's grace: %v, want the retired index", retired)
	}
	tier.lock.Close() // the server dies: its lock goes, its grace never ends
	again, err := New(Config{Dir: dir, Kind: Memory, Budget: "1GiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if _, err := os.Lstat(filepath.Join(dir, retired[0])); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the retired index left by the stopped server is still there: %v", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(held.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if st.Blocks*512 > indexSlots {
		t.Errorf("the retired index a reader maps still takes %d bytes, want at most its header's %d", st.Blocks*512, indexSlots)
	}
	if hdr := make([]byte, hdrRetired+4); func() bool { n, _ := held.ReadAt(hdr, 0); return n < len(hdr) }() ||
		hdr[hdrRetired] != 1 {
		t.Error("the retired index a reader maps is not marked retired")
	}
}
