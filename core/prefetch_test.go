package core

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeClock is a clock that moves only when told to.
type fakeClock struct {
	mu sync.Mutex // protects t
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// prefetchEngine returns an engine with prefetch running reads source reads at once, over
// tiers with the given budgets (memory, then disk).
func prefetchEngine(t *testing.T, reads int, clock *fakeClock, budgets ...string) *Engine {
	t.Helper()
	cfgs := testTiers(t, budgets...)
	pc := PrefetchConfig{Reads: reads}
	if clock != nil {
		pc.Clock = clock.Now
	}
	e, err := NewEngine(EngineConfig{Tiers: cfgs, Prefetch: pc}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// waitPrefetch renews the owner's job until it ends, and returns its final state. The bound
// is only there so that a broken prefetch fails the test instead of hanging it.
func waitPrefetch(t *testing.T, e *Engine, root, owner string) PrefetchInfo {
	t.Helper()
	for range 6000 {
		info, err := e.Prefetch(PrefetchRequest{Root: root, Owner: owner})
		if err != nil {
			t.Fatalf("renew: %v", err)
		}
		if info.Terminal() {
			return info
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("the prefetch job did not end within 30 s")
	return PrefetchInfo{}
}

// watchOpens counts the opens of the files in dir with inotify, from outside the engine.
// The returned function drains the events and returns the counts by file name so far.
func watchOpens(t *testing.T, dir string) func() map[string]int {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Skip("no inotify:", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_OPEN|unix.IN_Q_OVERFLOW); err != nil {
		t.Fatal(err)
	}
	counts := map[string]int{}
	return func() map[string]int {
		t.Helper()
		buf := make([]byte, 64<<10)
		for {
			n, err := unix.Read(fd, buf)
			if n <= 0 || err != nil {
				return counts
			}
			for off := 0; off+unix.SizeofInotifyEvent <= n; {
				mask := binary.NativeEndian.Uint32(buf[off+4:])
				length := int(binary.NativeEndian.Uint32(buf[off+12:]))
				name := string(bytes.TrimRight(buf[off+unix.SizeofInotifyEvent:off+unix.SizeofInotifyEvent+length], "\x00"))
				if mask&unix.IN_Q_OVERFLOW != 0 {
					t.Fatal("inotify queue overflow: opens were not counted")
				}
				if mask&unix.IN_ISDIR == 0 && name != "" {
					counts[name]++
				}
				off += unix.SizeofInotifyEvent + length
			}
		}
	}
}

// Prefetch and readers of the same files at the same time read each file from the source
// exactly once (counted by inotify, outside the engine), and every file ends up cached.
func TestPrefetchReadsEachFileOnceWithConcurrentReaders(t *testing.T) {
	sizes := make([]int, 150)
	for i := range sizes {
		sizes[i] = 1 + i*97%20000
	}
	sizes = append(sizes, 2<<20, 3<<20+5) // copied into a tier rather than read into memory
	root, paths := dataset(t, sizes...)
	opens := watchOpens(t, filepath.Join(root, "sub"))
	e := prefetchEngine(t, 16, nil, "64MiB")

	info, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths})
	if err != nil || info.Accepted != len(paths) || info.Files != len(paths) {
		t.Fatalf("prefetch: %+v, %v; want %d paths accepted", info, err, len(paths))
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for r := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			order := append([]string(nil), paths...)
			rand.New(rand.NewPCG(uint64(r), 2)).Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			for _, p := range order {
				res, err := e.Read(context.Background(), root, p, r%2 == 0)
				if err != nil {
					errs <- err
					return
				}
				res.Release()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	final := waitPrefetch(t, e, root, "a")
	settle(e)
	if final.State != PrefetchDone || final.Done != len(paths) || final.Failed != 0 {
		t.Errorf("job: got %+v, want done with all %d files dealt with", final, len(paths))
	}
	counts := opens()
	for _, p := range paths {
		if n := counts[filepath.Base(p)]; n != 1 {
			t.Errorf("%s: opened %d times, want 1", filepath.Base(p), n)
		}
		if _, ok := e.cachedSize(p); !ok {
			t.Errorf("%s: not cached", filepath.Base(p))
		}
	}
	if s := e.Stats(); s.SourceReads != int64(len(paths)) {
		t.Errorf("source reads: got %d, want %d", s.SourceReads, len(paths))
	}
}

// With nobody reading, prefetch fetches the whole list, and a later list of files already
// cached reads nothing.
func TestPrefetchFetchesThenSkipsCached(t *testing.T) {
	root, paths := dataset(t, 5000, 6000, 7000, 0, 3<<20)
	clock := &fakeClock{t: time.Unix(1_000_000, 0)}
	e := prefetchEngine(t, 4, clock, "64MiB")
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths}); err != nil {
		t.Fatal(err)
	}
	info := waitPrefetch(t, e, root, "a")
	if info.State != PrefetchDone || info.Fetched != len(paths) || info.Bytes != 5000+6000+7000+3<<20 {
		t.Errorf("first job: got %+v, want done with %d files fetched", info, len(paths))
	}
	for _, p := range paths {
		origin, got := readAll(t, e, root, p)
		wantBytes(t, p, got)
		if origin != OriginMemory {
			t.Errorf("%s served from %q after prefetch, want memory", filepath.Base(p), origin)
		}
	}
	clock.Advance(time.Minute) // the first job is forgotten
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "b", Paths: paths}); err != nil {
		t.Fatal(err)
	}
	info = waitPrefetch(t, e, root, "b")
	if info.State != PrefetchDone || info.SkippedCached != len(paths) || info.Fetched != 0 {
		t.Errorf("second job: got %+v, want done with every file skipped as cached", info)
	}
	if s := e.Stats(); s.SourceReads != int64(len(paths)) || s.Prefetch.Jobs != 2 || s.Prefetch.Fetched != int64(len(paths)) {
		t.Errorf("stats: %d source reads, prefetch %+v; want %d reads, 2 jobs", s.SourceReads, s.Prefetch, len(paths))
	}
}

// Prefetch stops at the tiers' budgets: it never evicts (nor spills), never goes over a
// budget, and opens no file it does not cache (counted by inotify).
func TestPrefetchStopsAtBudgetWithoutEvicting(t *testing.T) {
	sizes := make([]int, 40)
	for i := range sizes {
		sizes[i] = 64 << 10
	}
	root, paths := dataset(t, sizes...)
	opens := watchOpens(t, filepath.Join(root, "sub"))
	e := prefetchEngine(t, 16, nil, "512KiB", "512KiB")
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths}); err != nil {
		t.Fatal(err)
	}
	info := waitPrefetch(t, e, root, "a")
	settle(e)
	s := e.Stats()
	if info.State != PrefetchBudget || s.Prefetch.StoppedBudget != 1 {
		t.Errorf("job: got %+v (stopped at budget %d), want state %q", info, s.Prefetch.StoppedBudget, PrefetchBudget)
	}
	if s.Evictions != 0 || s.Spilled != 0 {
		t.Errorf("prefetch evicted %d files and spilled %d, want none", s.Evictions, s.Spilled)
	}
	files := 0
	for _, ti := range s.Tiers {
		files += ti.Files
		if ti.Used > ti.Budget {
			t.Errorf("tier %s over budget: %d of %d bytes", ti.Kind, ti.Used, ti.Budget)
		}
	}
	if files != info.Fetched || s.SourceReads != int64(info.Fetched) || info.Fetched < 10 {
		t.Errorf("%d files cached, %d fetched, %d source reads; want them equal (and at least 10: the tiers hold 14)",
			files, info.Fetched, s.SourceReads)
	}
	opened := 0
	for name, n := range opens() {
		opened += n
		if n > 1 {
			t.Errorf("%s: opened %d times by prefetch, want at most 1", name, n)
		}
	}
	if opened != info.Fetched {
		t.Errorf("prefetch opened %d files and cached %d: it opened files it did not cache", opened, info.Fetched)
	}
	for _, p := range paths { // readers get every file, from the tiers or the source
		_, got := readAll(t, e, root, p)
		wantBytes(t, p, got)
	}
}

// A job whose owners stop renewing it stops when its lease runs out; renewals keep it.
func TestPrefetchLeaseExpiryStopsJob(t *testing.T) {
	root, paths := dataset(t, 100, 200, 300, 400, 500, 600)
	clock := &fakeClock{t: time.Unix(1_000_000, 0)}
	taken, release := make(chan struct{}), make(chan struct{})
	testHookPrefetch = func(string) { // the one worker waits on its first file
		taken <- struct{}{}
		<-release
	}
	defer func() { testHookPrefetch = nil }()
	e := prefetchEngine(t, 1, clock, "1MiB")
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths}); err != nil {
		t.Fatal(err)
	}
	<-taken
	renew := func() PrefetchInfo {
		t.Helper()
		info, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a"})
		if err != nil {
			t.Fatal(err)
		}
		return info
	}
	for _, step := range []time.Duration{6 * time.Second, 6 * time.Second} {
		clock.Advance(step)
		if info := renew(); info.State != PrefetchRunning {
			t.Fatalf("renewed job after %v: state %q, want running", step, info.State)
		}
	}
	clock.Advance(DefaultPrefetchLease + time.Second)
	if info := renew(); info.State != PrefetchUnknown {
		t.Errorf("renewal after the lease ran out: state %q, want %q", info.State, PrefetchUnknown)
	}
	if s := e.Stats().Prefetch; s.Abandoned != 1 || s.JobsActive != 0 {
		t.Errorf("stats: %+v, want 1 job abandoned and none active", s)
	}
	close(release) // the worker handles the file it holds, then finds no work
	e.Close()
	if n := e.Stats().SourceReads; n > 1 {
		t.Errorf("%d source reads after the job was abandoned on its first file, want at most 1", n)
	}
}

// Readers' misses go first: a worker takes a file only while readers' source reads and its
// own stay below the limit.
func TestPrefetchGivesWayToDemandReads(t *testing.T) {
	root, paths := dataset(t, 1000, 2000, 3000)
	inRead, release := make(chan struct{}), make(chan struct{})
	testHookSourceRead = func(string) {
		testHookSourceRead = nil
		close(inRead)
		<-release
	}
	defer func() { testHookSourceRead = nil }()
	e := prefetchEngine(t, 1, nil, "1MiB")
	done := make(chan error, 1)
	go func() {
		_, err := e.Read(context.Background(), root, paths[0], false)
		done <- err
	}()
	<-inRead // a reader's source read holds the only slot
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths}); err != nil {
		t.Fatal(err)
	}
	e.pf.mu.Lock()
	demand, active, free := e.pf.demand, e.pf.active, e.pf.slotFree()
	e.pf.mu.Unlock()
	if demand != 1 || active != 0 || free {
		t.Errorf("during a reader's source read: demand %d, prefetch active %d, slot free %v; want 1, 0, false",
			demand, active, free)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if info := waitPrefetch(t, e, root, "a"); info.State != PrefetchDone || info.Done != len(paths) {
		t.Errorf("job after the reader: %+v, want done", info)
	}
	settle(e)
	if n := e.Stats().SourceReads; n != int64(len(paths)) {
		t.Errorf("source reads: got %d, want %d", n, len(paths))
	}
}

// Owners sending the same list share one job; a long list arrives in chunks; a new list
// from an owner replaces its job; prefetch off does nothing.
func TestPrefetchJobsShareReplaceAndChunk(t *testing.T) {
	root, paths := dataset(t, 10, 20, 30, 40, 50, 60, 70)
	release := make(chan struct{})
	testHookPrefetch = func(string) { <-release } // keep the job running while we look
	defer func() { testHookPrefetch = nil }()
	e := prefetchEngine(t, 2, nil, "1MiB")
	id := ListDigest(paths)
	send := func(owner string, off int, part []string) (PrefetchInfo, error) {
		return e.Prefetch(PrefetchRequest{Root: root, Owner: owner, ListID: id, Offset: off, Total: len(paths), Paths: part})
	}
	if info, err := send("a", 0, paths[:3]); err != nil || info.Accepted != 3 || info.Received != 3 || info.Joined {
		t.Fatalf("first chunk: %+v, %v", info, err)
	}
	if _, err := send("a", 5, paths[5:]); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("chunk out of order: got %v, want EINVAL", err)
	}
	if info, err := send("b", 0, paths[:3]); err != nil || !info.Joined || info.Accepted != 0 || info.Owners != 2 {
		t.Errorf("same list from another owner: %+v, %v; want joined, 2 owners", info, err)
	}
	if info, err := send("a", 3, paths[3:]); err != nil || info.Received != len(paths) {
		t.Errorf("last chunk: %+v, %v", info, err)
	}
	if info, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths[:2]}); err != nil || info.Joined || info.Files != 2 {
		t.Errorf("a new list from a: %+v, %v; want a job of its own", info, err)
	}
	if s := e.Stats().Prefetch; s.Jobs != 2 || s.JobsActive != 2 {
		t.Errorf("jobs: %+v, want 2 started and running", s)
	}
	close(release)
	if info := waitPrefetch(t, e, root, "b"); info.State != PrefetchDone || info.Done != len(paths) || info.Owners != 1 {
		t.Errorf("b's job: %+v, want done with all files, b its only owner", info)
	}
	if info := waitPrefetch(t, e, root, "a"); info.State != PrefetchDone || info.Done != 2 {
		t.Errorf("a's job: %+v, want done with 2 files", info)
	}
	e.Close() // its workers are gone before the hook is reset

	off := prefetchEngine(t, 0, nil, "1MiB")
	if info, err := off.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: paths}); err != nil || info.State != PrefetchOff {
		t.Errorf("prefetch off: %+v, %v; want state %q", info, err, PrefetchOff)
	}
	settle(off)
	if n := off.Stats().SourceReads; n != 0 {
		t.Errorf("prefetch off read %d files", n)
	}
}

// Paths are checked like reads: absolute, clean, inside the root.
func TestPrefetchRefusesBadPaths(t *testing.T) {
	root, paths := dataset(t, 10)
	e := prefetchEngine(t, 2, nil, "1MiB")
	for _, tc := range []struct {
		name  string
		req   PrefetchRequest
		check func(error) bool
	}{
		{"outside the root", PrefetchRequest{Root: root, Owner: "a", Paths: []string{paths[0], "/etc/passwd"}},
			func(err error) bool { return errors.Is(err, ErrOutsideRoot) }},
		{"relative", PrefetchRequest{Root: root, Owner: "a", Paths: []string{"sub/f000.bin"}},
			func(err error) bool { return errors.Is(err, ErrBadPath) }},
		{"dot-dot", PrefetchRequest{Root: root, Owner: "a", Paths: []string{root + "/sub/../../x"}},
			func(err error) bool { return errors.Is(err, ErrBadPath) }},
		{"no owner", PrefetchRequest{Root: root, Paths: paths},
			func(err error) bool { return errors.Is(err, syscall.EINVAL) }},
		{"more paths than the total", PrefetchRequest{Root: root, Owner: "a", Total: 1, ListID: "x", Paths: []string{paths[0], paths[0]}},
			func(err error) bool { return errors.Is(err, syscall.EINVAL) }},
	} {
		if _, err := e.Prefetch(tc.req); !tc.check(err) {
			t.Errorf("%s: got %v", tc.name, err)
		}
	}
	if s := e.Stats().Prefetch; s.Jobs != 0 {
		t.Errorf("refused requests started %d jobs", s.Jobs)
	}
}

// Prefetch keeps a quarter of its reads however many readers' misses run, so that readers
// missing whole batches at once cannot keep it from getting ahead of them.
func TestPrefetchSlotFloor(t *testing.T) {
	for _, tc := range []struct {
		limit, demand, active int
		want                  bool
	}{
		{16, 0, 15, true}, {16, 0, 16, false}, {16, 10, 5, true}, {16, 10, 6, false},
		{16, 40, 3, true}, {16, 40, 4, false}, // the floor: 16/4
		{2, 5, 0, false}, {1, 1, 0, false}, // below 4 reads there is no floor
	} {
		p := &prefetcher{limit: tc.limit, floor: tc.limit / 4, demand: tc.demand, active: tc.active}
		if got := p.slotFree(); got != tc.want {
			t.Errorf("limit %d, demand %d, active %d: slot free %v, want %v", tc.limit, tc.demand, tc.active, got, tc.want)
		}
	}
}

// After a reader misses a listed file, the files after it go first; the missed one is not
// handed out (the reader reads it), and a file listed twice is handed out once.
func TestPrefetchFollowsReadersMisses(t *testing.T) {
	p := &prefetcher{limit: 4, running: 1, owned: map[ownerKey]*prefetchJob{}}
	j := &prefetchJob{pos: map[string]int{}, total: 11, state: PrefetchRunning}
	p.jobs = []*prefetchJob{j}
	for i := range 10 {
		path := fmt.Sprintf("/d/%d", i)
		j.pos[path] = len(j.paths)
		j.paths = append(j.paths, path)
	}
	j.paths = append(j.paths, "") // "/d/0" again: dealt with at once
	if first, _ := j.nextFile(); first != "/d/0" {
		t.Fatalf("first file handed out: got %s, want /d/0", first)
	}
	p.startDemand("/d/5")
	p.startDemand("/d/2")
	var got []string
	for {
		path, ok := j.nextFile()
		if !ok {
			break
		}
		got = append(got, path)
	}
	want := []string{"/d/6", "/d/3", "/d/7", "/d/4", "/d/8", "/d/9", "/d/1"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("files handed out: got %v, want %v", got, want)
	}
	if j.info.SkippedInflight != 2 {
		t.Errorf("files read by readers: got %d, want 2", j.info.SkippedInflight)
	}
}

// A node's list whose tail is for later epochs: those files come after every file read now
// is done, laterAtOnce at a time; a reader's miss in the tail is followed only within the
// files read now.
func TestFilesForLaterEpochsComeAfterTheOthers(t *testing.T) {
	p := &prefetcher{limit: 16, floor: 4, running: 1, owned: map[ownerKey]*prefetchJob{}}
	p.cond = sync.NewCond(&p.mu)
	n := 3 + laterAtOnce + 2
	j := &prefetchJob{pos: map[string]int{}, total: n, thisEpoch: 3, state: PrefetchRunning, owners: map[string]time.Time{}}
	p.jobs = []*prefetchJob{j}
	for i := range n {
		path := fmt.Sprintf("/d/%d", i)
		j.pos[path] = len(j.paths)
		j.paths = append(j.paths, path)
	}
	take := func() string {
		t.Helper()
		p.mu.Lock()
		defer p.mu.Unlock()
		_, path := p.take()
		return path
	}
	done := func(path string) {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.active++ // as wait counted it
		p.record(j, path, outcome{kind: fetchedFile})
	}
	var now []string
	for range 3 {
		now = append(now, take())
	}
	if fmt.Sprint(now) != "[/d/0 /d/1 /d/2]" {
		t.Fatalf("files read now: got %v", now)
	}
	if path := take(); path != "" {
		t.Fatalf("a file for a later epoch while files read now are in flight: %s", path)
	}
	for _, path := range now[:2] {
		done(path)
	}
	if path := take(); path != "" {
		t.Fatalf("a file for a later epoch while %s is in flight: %s", now[2], path)
	}
	done(now[2])
	p.startDemand(fmt.Sprintf("/d/%d", n-1)) // a reader reads the last file: no run follows it
	defer p.endDemand()
	var later []string
	for range laterAtOnce {
		later = append(later, take())
	}
	var want []string
	for i := range laterAtOnce {
		want = append(want, fmt.Sprintf("/d/%d", 3+i))
	}
	if fmt.Sprint(later) != fmt.Sprint(want) {
		t.Fatalf("files for later epochs: got %v, want %v", later, want)
	}
	if path := take(); path != "" {
		t.Fatalf("more than %d files for later epochs at once: %s", laterAtOnce, path)
	}
	done(later[0])
	if path, want := take(), fmt.Sprintf("/d/%d", 3+laterAtOnce); path != want {
		t.Fatalf("next file for a later epoch: got %q, want %s", path, want)
	}
	if path := take(); path != "" {
		t.Fatalf("a file the reader read was handed out: %s", path)
	}
}
