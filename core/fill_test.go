package core

import (
	"context"
	"errors"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

// readerFill does what a reader's fill does (capi/fill.c): it claims the file at path in e's
// first tier, reads the source and writes it into the fill file, and returns the report the
// reader sends. It fails the test if the claim is taken.
func readerFill(t *testing.T, e *Engine, path string) FillReport {
	t.Helper()
	first := e.tiers[0]
	if _, err := first.Claim(path); err != nil {
		t.Fatalf("claim %s: %v", path, err)
	}
	return writeFill(t, first, path)
}

// writeFill writes the source at path into its claimed fill file in tier first and returns
// the reader's report.
func writeFill(t *testing.T, first *tiers.Tier, path string) FillReport {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	fill := filepath.Join(first.Path, tiers.FillName(path))
	if err := os.WriteFile(fill, data, 0o600); err != nil {
		t.Fatal(err)
	}
	var fst, sst syscall.Stat_t
	if err := syscall.Stat(fill, &fst); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat(path, &sst); err != nil {
		t.Fatal(err)
	}
	return FillReport{FillIno: fst.Ino, Mode: 0o644, Identity: tiers.Identity{Size: sst.Size,
		MTimeNanos: sst.Mtim.Nano(), CTimeNanos: sst.Ctim.Nano(), Ino: sst.Ino}}
}

// withChecksum returns r with the CRC-32C of the source at path, as a reader that computed it
// reports it.
func withChecksum(t *testing.T, r FillReport, path string) FillReport {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	r.Checksum, r.HasChecksum = crc32.Checksum(data, castagnoli), true
	return r
}

// A reader's fill is recorded, with the checksum it reported or, from an older reader that
// reports none, the one read from the copy.
func TestRecordFillCachesTheReadersCopy(t *testing.T) {
	root, paths := dataset(t, 100_000, 0, 5)
	e := newEngine(t, "64MiB")
	for i, p := range paths {
		r := readerFill(t, e, p)
		if i > 0 {
			r = withChecksum(t, r, p)
		}
		if err := e.RecordFill(root, p, r); err != nil {
			t.Fatalf("record %s: %v", p, err)
		}
		origin, got := readAll(t, e, root, p)
		if origin != TierOrigin(tiers.Memory) {
			t.Errorf("%s served from %v, want the memory tier", p, origin)
		}
		wantBytes(t, p, got)
		if _, err := os.Lstat(filepath.Join(e.tiers[0].Path, tiers.FillName(p))); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("fill file of %s left behind: %v", p, err)
		}
	}
	st := e.Stats()
	if st.SourceReads != 3 || st.ReaderFills != 3 || st.FillsRefused != 0 {
		t.Errorf("source reads %d, reader fills %d, refused %d; want 3, 3, 0", st.SourceReads, st.ReaderFills, st.FillsRefused)
	}
	// The record's checksum is the data's: verify finds nothing damaged.
	valid, damaged, err := tiers.Dir{Path: e.tiers[0].Path, Kind: tiers.Memory}.Check()
	if err != nil || len(damaged) != 0 || valid != 3 {
		t.Errorf("check: %d valid, %v damaged, %v; want 3 valid", valid, damaged, err)
	}
}

// The checksum a reader reports is recorded without the copy being read (the server trusts
// its own user's readers, who could write any bytes into a copy anyway), and it is the
// checksum the copy is checked against: a copy whose bytes are not those the reader
// computed it of (garbled on the way to the fill file, say) fails its check and is removed
// by a verifying start, where a checksum computed by the server from those bytes would have
// hidden the damage.
func TestAReportedChecksumIsWhatTheCopyIsCheckedAgainst(t *testing.T) {
	root, paths := dataset(t, 20_000)
	e := newEngine(t, "64MiB")
	first := e.tiers[0]
	r := withChecksum(t, readerFill(t, e, paths[0]), paths[0])
	fill := filepath.Join(first.Path, tiers.FillName(paths[0]))
	f, err := os.OpenFile(fill, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte("garbled"), 100)
	f.Close()
	if err := e.RecordFill(root, paths[0], r); err != nil {
		t.Fatal(err)
	}
	m, err := first.Open(paths[0])
	if err != nil {
		t.Fatal(err)
	}
	if m.Entry.Checksum != r.Checksum {
		t.Errorf("recorded checksum %08x, want the reported %08x", m.Entry.Checksum, r.Checksum)
	}
	m.Release()
	valid, damaged, err := tiers.Dir{Path: first.Path, Kind: tiers.Memory}.Check()
	if err != nil || valid != 0 || len(damaged) != 1 {
		t.Fatalf("check: %d valid, %v damaged, %v; want the copy damaged", valid, damaged, err)
	}
	dir := first.Path
	e.Close()
	report, err := tiers.Verify(tiers.Config{Dir: dir, Kind: tiers.Memory, Budget: "64MiB"}, nil)
	if err != nil || !report.Removed || len(report.Damaged) != 1 || report.Valid != 0 {
		t.Fatalf("verify: %+v, %v; want the copy found damaged and removed", report, err)
	}
	if valid, damaged, err := (tiers.Dir{Path: dir, Kind: tiers.Memory}).Check(); err != nil || valid != 0 || len(damaged) != 0 {
		t.Errorf("after verify: %d valid, %v damaged, %v; want nothing left", valid, damaged, err)
	}
}

func TestRecordFillRefusesWhatTheReaderDidNotRead(t *testing.T) {
	root, paths := dataset(t, 50_000, 50_000, 50_000)
	e := newEngine(t, "64MiB")
	first := e.tiers[0]
	// A fill file is removed unless it is not the one the report names (then it may be
	// another reader's claim, made since: it is left to become stale).
	check := func(name, path string, r FillReport, want error) {
		t.Helper()
		err := e.RecordFill(root, path, r)
		if !errors.Is(err, want) {
			t.Errorf("%s: got %v, want %v", name, err, want)
		}
		if first.Listed(path) {
			t.Errorf("%s: the copy was recorded", name)
		}
		_, err = os.Lstat(filepath.Join(first.Path, tiers.FillName(path)))
		if left := err == nil; left != (name == "another inode") {
			t.Errorf("%s: fill file left behind: %v", name, left)
		}
	}
	// The source changed after the reader read it.
	r := readerFill(t, e, paths[0])
	os.WriteFile(paths[0], []byte("a newer version"), 0o644)
	check("changed source", paths[0], r, tiers.ErrBadFill)
	// The fill file is not the one the reader says it wrote.
	r = readerFill(t, e, paths[1])
	r.FillIno++
	check("another inode", paths[1], r, tiers.ErrBadFill)
	// Fewer bytes than the source has.
	r = readerFill(t, e, paths[2])
	os.Truncate(filepath.Join(first.Path, tiers.FillName(paths[2])), 10)
	check("short copy", paths[2], r, tiers.ErrBadFill)
	// A path outside the root.
	_, otherPaths := dataset(t, 10)
	r = readerFill(t, e, otherPaths[0])
	check("outside the root", otherPaths[0], r, ErrOutsideRoot)
	if got := e.Stats().FillsRefused; got != 4 {
		t.Errorf("fills refused %d, want 4", got)
	}
}

// A fill of the engine's own waits for a reader that holds the file's claim, and serves the
// reader's copy: the source is read once.
func TestFetchWaitsForTheReaderThatClaimedTheFile(t *testing.T) {
	root, paths := dataset(t, 200_000)
	e := newEngine(t, "64MiB")
	first := e.tiers[0]
	if _, err := first.Claim(paths[0]); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- e.Fetch(context.Background(), root, paths[0]) }()
	select {
	case err := <-done:
		t.Fatalf("fetch returned before the reader's record: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	if err := e.RecordFill(root, paths[0], writeFill(t, first, paths[0])); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("fetch still waits after the reader's record")
	}
	_, got := readAll(t, e, root, paths[0])
	wantBytes(t, paths[0], got)
	if n := e.Stats().SourceReads; n != 1 {
		t.Errorf("source read %d times, want once", n)
	}
}

// A claim its reader left without a report (it died: the kernel dropped its lock) is taken
// over once it has been seen so for tiers.AbandonedAfter; one it reported is waited for,
// however long ago its fill file was written.
func TestFetchTakesOverAnAbandonedClaimAndWaitsForAReportedOne(t *testing.T) {
	root, paths := dataset(t, 20_000, 30_000)
	e := newEngine(t, "64MiB")
	first := e.tiers[0]
	for _, p := range paths {
		if _, err := first.Claim(p); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-time.Hour)
	ctx, cancel := context.WithTimeout(context.Background(), 2*tiers.AbandonedAfter)
	defer cancel()
	if err := e.Fetch(ctx, root, paths[0]); err != nil {
		t.Fatal(err)
	}
	_, got := readAll(t, e, root, paths[0])
	wantBytes(t, paths[0], got)
	if state, _ := first.ClaimStateOf(paths[0]); state != tiers.Unclaimed {
		t.Errorf("the abandoned claim is still there: %v", state)
	}
	// Reported: the record is on its way, however old the fill file.
	r := writeFill(t, first, paths[1])
	e.NoteReport(paths[1])
	os.Chtimes(filepath.Join(first.Path, tiers.FillName(paths[1])), old, old)
	done := make(chan error, 1)
	go func() { done <- e.Fetch(context.Background(), root, paths[1]) }()
	select {
	case err := <-done:
		t.Fatalf("fetch did not wait for the reported fill: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	if err := e.RecordFill(root, paths[1], r); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := e.Stats().SourceReads; n != 2 {
		t.Errorf("%d source reads of 2 files", n)
	}
}

// The engine's own fill holds the claim while it reads the source: a reader cannot claim it.
func TestEnginesFillHoldsTheClaim(t *testing.T) {
	root, paths := dataset(t, 1<<20)
	e := newEngine(t, "64MiB")
	first := e.tiers[0]
	var during error
	e.testHookBeforeSourceOpen = func(path string) { _, during = first.Claim(path) }
	if err := e.Fetch(context.Background(), root, paths[0]); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(during, tiers.ErrClaimed) {
		t.Errorf("a reader's claim during the engine's fill: %v, want ErrClaimed", during)
	}
	if state, _ := first.ClaimStateOf(paths[0]); state != tiers.Unclaimed {
		t.Error("the engine's claim outlived its fill")
	}
}

// Readers filling files and the engine's fetches of the same files at once read each file
// from the source once: whoever claims a file reads it, the others wait for its copy.
func TestFillsAndFetchesAtOnceReadEachFileOnce(t *testing.T) {
	sizes := make([]int, 300)
	for i := range sizes {
		sizes[i] = 1000 + 37*i
	}
	root, paths := dataset(t, sizes...)
	e := newEngine(t, "64MiB")
	first := e.tiers[0]
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 6 {
		wg.Go(func() {
			order := rand.New(rand.NewPCG(uint64(g), 9)).Perm(len(paths))
			for _, i := range order {
				p := paths[i]
				if e.listed(p) {
					continue
				}
				if g%2 == 0 { // a fetch of the engine's own (a prefetch, a reader asking)
					if err := e.Fetch(context.Background(), root, p); err != nil {
						errs <- err
					}
					continue
				}
				c, err := first.Claim(p) // a reader's fill (capi/miss.c fill_read)
				if errors.Is(err, tiers.ErrClaimed) {
					if err := e.Fetch(context.Background(), root, p); err != nil {
						errs <- err
					}
					continue
				}
				if err != nil {
					errs <- err
					continue
				}
				if e.listed(p) {
					c.Release()
					continue
				}
				if err := e.RecordFill(root, p, writeFill(t, first, p)); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	st := e.Stats()
	if st.SourceReads != int64(len(paths)) {
		t.Errorf("%d source reads of %d files (%d by readers)", st.SourceReads, len(paths), st.ReaderFills)
	}
	for _, p := range paths {
		_, got := readAll(t, e, root, p)
		wantBytes(t, p, got)
	}
}

// A fill that finds the tiers full of its dataset is not recorded, and the dataset is marked
// full (tiers.MarkFull) so that its readers stop filling for a while.
func TestAFillWithoutRoomMarksTheDatasetFull(t *testing.T) {
	root, paths := dataset(t, 40_000, 40_000)
	e := newEngine(t, "48KiB") // room for one file and its record
	if err := e.RecordFill(root, paths[0], readerFill(t, e, paths[0])); err != nil {
		t.Fatal(err)
	}
	mark := filepath.Join(e.tiers[0].Path, tiers.FullMarkName(root))
	if _, err := os.Stat(mark); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("marked full with room left: %v", err)
	}
	if err := e.RecordFill(root, paths[1], readerFill(t, e, paths[1])); !errors.Is(err, ErrCacheFull) && !errors.Is(err, ErrTooLarge) {
		t.Fatalf("a fill without room: %v, want ErrCacheFull", err)
	}
	st, err := os.Stat(mark)
	if err != nil || time.Since(st.ModTime()) > time.Minute {
		t.Fatalf("no fresh full mark: %v", err)
	}
	if e.tiers[0].Listed(paths[1]) || !e.tiers[0].Listed(paths[0]) {
		t.Error("the fill without room was recorded, or the first one lost")
	}
}

// Prefetch does not wait for a file a reader is filling: it goes on to the next, and the
// reader's record caches it. The source is read once per file.
func TestPrefetchSkipsAFileAReaderFills(t *testing.T) {
	root, paths := dataset(t, 5000, 6000, 7000)
	clock := &fakeClock{t: time.Unix(1_000_000, 0)}
	e := prefetchEngine(t, 2, clock, "64MiB")
	first := e.tiers[0]
	if _, err := first.Claim(paths[1]); err != nil { // a reader reads paths[1]
		t.Fatal(err)
	}
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths}); err != nil {
		t.Fatal(err)
	}
	info := waitPrefetch(t, e, root, "a")
	if info.Fetched != 2 || info.SkippedInflight != 1 {
		t.Errorf("prefetch: %+v, want 2 fetched and the claimed file skipped", info)
	}
	if err := e.RecordFill(root, paths[1], writeFill(t, first, paths[1])); err != nil {
		t.Fatal(err)
	}
	for _, p := range paths {
		_, got := readAll(t, e, root, p)
		wantBytes(t, p, got)
	}
	if n := e.Stats().SourceReads; n != 3 {
		t.Errorf("%d source reads of 3 files", n)
	}
}

// A reader's fill that only a later tier has room for is copied there, checked against the
// checksum its reader reported: a fill file whose bytes do not have it is refused and
// removed, not published.
func TestAFillCopiedToALaterTierIsChecked(t *testing.T) {
	root, paths := dataset(t, 40_000, 40_000)
	e := newEngine(t, "16KiB", "1MiB") // the first tier cannot hold a file
	first, later := e.tiers[0], e.tiers[1]
	if err := e.RecordFill(root, paths[0], withChecksum(t, readerFill(t, e, paths[0]), paths[0])); err != nil {
		t.Fatal(err)
	}
	if !later.Listed(paths[0]) || first.Listed(paths[0]) {
		t.Errorf("listed in the first tier %v, the later one %v; want the later one only", first.Listed(paths[0]), later.Listed(paths[0]))
	}
	r := withChecksum(t, readerFill(t, e, paths[1]), paths[1])
	r.Checksum ^= 1
	if err := e.RecordFill(root, paths[1], r); !errors.Is(err, tiers.ErrBadFill) {
		t.Errorf("a fill whose bytes do not have the reported checksum: %v, want ErrBadFill", err)
	}
	if later.Listed(paths[1]) {
		t.Error("a fill whose bytes do not have the reported checksum was published")
	}
	for _, p := range paths {
		if _, err := os.Lstat(filepath.Join(first.Path, tiers.FillName(p))); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("fill file of %s left behind: %v", p, err)
		}
	}
}

// The engine's fill of a small file goes the readers' way: the source is read into the
// claim's fill file, which becomes the copy (same inode, no second file), with the checksum
// of the bytes read from the source, and counts as a fill of the engine's own did.
func TestEnginesFillOfASmallFileIsItsClaimsFillFile(t *testing.T) {
	root, paths := dataset(t, 110_000)
	e := newEngine(t, "64MiB")
	first := e.tiers[0]
	var fillIno uint64
	testHookSourceRead = func(path string) { // read, before the copy is placed
		testHookSourceRead = nil
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(first.Path, tiers.FillName(path)), &st); err != nil {
			t.Errorf("no fill file while the engine fills %s: %v", path, err)
		}
		fillIno = st.Ino
	}
	defer func() { testHookSourceRead = nil }()
	if err := e.Fetch(context.Background(), root, paths[0]); err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(first.CachedPath(paths[0]), &st); err != nil {
		t.Fatal(err)
	}
	if st.Ino != fillIno || e.stats.serverFills.Load() != 1 {
		t.Errorf("the copy: inode %d, %d fills through the fill file; want the fill file's inode %d, 1",
			st.Ino, e.stats.serverFills.Load(), fillIno)
	}
	data, err := os.ReadFile(paths[0])
	if err != nil {
		t.Fatal(err)
	}
	m, err := first.Open(paths[0])
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release()
	if m.Entry.Checksum != crc32.Checksum(data, castagnoli) {
		t.Errorf("recorded checksum %08x, want the source's %08x", m.Entry.Checksum, crc32.Checksum(data, castagnoli))
	}
	if s := e.Stats(); s.Published != 1 || s.SourceReads != 1 || s.SourceBytes != int64(len(data)) || s.Misses != 1 {
		t.Errorf("stats: published %d, source reads %d (%d bytes), misses %d; want 1, 1 (%d), 1",
			s.Published, s.SourceReads, s.SourceBytes, s.Misses, len(data))
	}
	if state, _ := first.ClaimStateOf(paths[0]); state != tiers.Unclaimed {
		t.Errorf("claim after the fill: %v, want Unclaimed", state)
	}
	if info := first.Info(); info.Writing != 0 || info.Used != tiers.EntrySize(paths[0], int64(len(data))) {
		t.Errorf("first tier: used %d, writing %d; want %d, 0", info.Used, info.Writing, tiers.EntrySize(paths[0], int64(len(data))))
	}
}

// A source that changes while the engine reads it into the fill file is not cached, and
// neither the fill file nor its reservation outlives the fill.
func TestASourceChangedDuringTheEnginesFillIsNotCached(t *testing.T) {
	root, paths := dataset(t, 100_000)
	e := newEngine(t, "64MiB")
	testHookSourceRead = func(path string) {
		testHookSourceRead = nil
		time.Sleep(20 * time.Millisecond) // a new clock tick for the times (see TestSourceChangedDuringReadIsNotCached)
		if err := os.WriteFile(path, make([]byte, 100_000), 0o644); err != nil {
			t.Error(err)
		}
	}
	defer func() { testHookSourceRead = nil }()
	if err := e.Fetch(context.Background(), root, paths[0]); !errors.Is(err, ErrChanged) {
		t.Fatalf("fetch during a rewrite: %v, want ErrChanged", err)
	}
	first := e.tiers[0]
	if s := e.Stats(); s.Published != 0 || first.Listed(paths[0]) {
		t.Errorf("%d published, listed %v; want 0, false", s.Published, first.Listed(paths[0]))
	}
	if info := first.Info(); info.Used != 0 || info.Writing != 0 {
		t.Errorf("first tier after the failed fill: used %d, writing %d; want 0", info.Used, info.Writing)
	}
	if state, _ := first.ClaimStateOf(paths[0]); state != tiers.Unclaimed {
		t.Errorf("claim after the failed fill: %v, want Unclaimed", state)
	}
}

// A first tier without room for the file now takes no fill file beyond its budget: the file
// goes the old way (here into the next tier, since the first holds only its own dataset),
// and the first tier's budget holds throughout.
func TestAFirstTierWithoutRoomTakesTheOldPath(t *testing.T) {
	root, paths := dataset(t, 40_000, 40_000)
	e := newEngine(t, "48KiB", "64MiB") // room for one file and its record in the first
	first, budget := e.tiers[0], e.tiers[0].Info().Budget
	over := false
	testHookSourceRead = func(string) {
		if info := first.Info(); info.Used > budget {
			over = true
		}
	}
	defer func() { testHookSourceRead = nil }()
	for _, p := range paths {
		if err := e.Fetch(context.Background(), root, p); err != nil {
			t.Fatal(err)
		}
	}
	if over {
		t.Error("the first tier's use went beyond its budget during a fill")
	}
	if !first.Listed(paths[0]) || !e.tiers[1].Listed(paths[1]) {
		t.Errorf("first file in the first tier: %v, second in the next: %v; want both", first.Listed(paths[0]), e.tiers[1].Listed(paths[1]))
	}
	if n := e.stats.serverFills.Load(); n != 1 {
		t.Errorf("%d fills through the fill file, want 1 (the second had no room in the first tier)", n)
	}
	if s := e.Stats(); s.Published != 2 || s.SourceReads != 2 {
		t.Errorf("published %d, source reads %d; want 2, 2", s.Published, s.SourceReads)
	}
	if state, _ := first.ClaimStateOf(paths[1]); state != tiers.Unclaimed {
		t.Errorf("claim after the fill: %v, want Unclaimed", state)
	}
	for i, p := range paths {
		_, got := readAll(t, e, root, p)
		wantBytes(t, paths[i], got)
	}
}

// A fill looks at its source once after reading it (Source.Unchanged: an fstat and a stat
// by path): the copy's writer reads on to see the source's end, which is no second look.
func TestAFillLooksAtItsSourceOnce(t *testing.T) {
	root, paths := dataset(t, 40_000, 3_000_000) // a fill file's, and a copy written as before
	e := newEngine(t, "64MiB")
	looks := 0
	testHookSourceRead = func(string) { looks++ }
	defer func() { testHookSourceRead = nil }()
	for _, p := range paths {
		looks = 0
		if err := e.Fetch(context.Background(), root, p); err != nil {
			t.Fatal(err)
		}
		if looks != 1 {
			t.Errorf("%s: the source was looked at %d times after it was read, want 1", p, looks)
		}
	}
	for i, p := range paths {
		_, got := readAll(t, e, root, p)
		wantBytes(t, paths[i], got)
	}
}
