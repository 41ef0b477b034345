package core

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// rewrite replaces the bytes of path in place (same inode) and gives it mtime.
func rewrite(t *testing.T, path string, data []byte, mtime time.Time) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(path, mtime, mtime); err != nil {
		t.Fatal(err)
	}
}

// A source file changed between two jobs is read anew by the second: each way a file can
// change (new size, same size with a new mtime, same size and mtime with a new ctime,
// replaced by a rename, removed) is found by the check of the new job's session, once per
// file; within one session the copy is served without asking the source again.
func TestChangedSourceIsNotServedToANewSession(t *testing.T) {
	old := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, path string)
		want   string // bytes read after the change; "" for ENOENT
	}{
		{"size", func(t *testing.T, p string) { rewrite(t, p, []byte("version two"), old) }, "version two"},
		{"mtime", func(t *testing.T, p string) { rewrite(t, p, []byte("v2"), old.Add(time.Second)) }, "v2"},
		{"ctime only", func(t *testing.T, p string) {
			time.Sleep(10 * time.Millisecond) // ctime ticks with the kernel's clock
			rewrite(t, p, []byte("v2"), old)  // same size, mtime set back: only ctime differs
		}, "v2"},
		{"renamed over", func(t *testing.T, p string) {
			tmp := p + ".tmp"
			rewrite(t, tmp, []byte("v2"), old)
			if err := os.Rename(tmp, p); err != nil {
				t.Fatal(err)
			}
		}, "v2"},
		{"removed", func(t *testing.T, p string) { os.Remove(p) }, ""},
		{"dataset directory replaced", func(t *testing.T, p string) {
			dir := filepath.Dir(p)
			if err := os.Rename(dir, dir+".old"); err != nil {
				t.Fatal(err)
			}
			os.Mkdir(dir, 0o755)
			rewrite(t, p, []byte("v2"), old) // a new file, same name, size and mtime
		}, "v2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEngine(t, "1MiB")
			root := t.TempDir()
			path := filepath.Join(root, "f.bin")
			rewrite(t, path, []byte("v1"), old)
			s1 := e.BeginSession("job-1")
			if _, got := readAll(t, e, root, path); string(got) != "v1" {
				t.Fatalf("first read: %q", got)
			}
			tc.change(t, path)
			// The same job does not look at the source again: a change during a job is
			// not seen (README, Limits).
			if _, got := readAll(t, e, root, path); string(got) != "v1" {
				t.Errorf("same session after the change: %q, want the cached v1 (no check per read)", got)
			}
			if s := e.BeginSession("job-1"); s != s1 {
				t.Errorf("the same job got session %d, then %d", s1, s)
			}
			checks := e.Stats().SourceChecks
			if s2 := e.BeginSession("job-2"); s2 <= s1 {
				t.Fatalf("a new job got session %d after %d", s2, s1)
			}
			res, err := e.Read(context.Background(), root, path, false)
			if tc.want == "" {
				if !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("new session, source removed: got %v, want ENOENT", err)
				}
			} else if err != nil {
				t.Fatalf("new session: %v", err)
			} else {
				if got := string(res.Bytes()); got != tc.want {
					t.Errorf("new session: got %q, want %q", got, tc.want)
				}
				res.Release()
			}
			s := e.Stats()
			if s.SourceChecks != checks+1 || s.StaleCopies != 1 {
				t.Errorf("source checks %d -> %d, stale copies %d; want one check that found the copy stale",
					checks, s.SourceChecks, s.StaleCopies)
			}
		})
	}
}

// An unchanged copy is checked once per session, then served as a hit.
func TestUnchangedCopyIsCheckedOncePerSession(t *testing.T) {
	e := newEngine(t, "1MiB")
	root, paths := dataset(t, 100, 200)
	for _, p := range paths {
		readAll(t, e, root, p)
	}
	e.BeginSession("next-job")
	for range 3 {
		for _, p := range paths {
			origin, got := readAll(t, e, root, p)
			wantBytes(t, p, got)
			if origin != OriginMemory {
				t.Errorf("%s served from %q, want the memory tier", p, origin)
			}
		}
	}
	s := e.Stats()
	if s.SourceChecks != int64(len(paths)) || s.StaleCopies != 0 || s.SourceReads != int64(len(paths)) {
		t.Errorf("checks %d, stale %d, source reads %d; want %d checks, none stale, each file read once",
			s.SourceChecks, s.StaleCopies, s.SourceReads, len(paths))
	}
}

// Readers of one file at once (a prefetch and DataLoader workers) share one check of it.
func TestConcurrentReadersShareOneCheck(t *testing.T) {
	e := newEngine(t, "1MiB")
	sizes := make([]int, 30)
	for i := range sizes {
		sizes[i] = 100 + i
	}
	root, paths := dataset(t, sizes...)
	for _, p := range paths {
		readAll(t, e, root, p)
	}
	e.BeginSession("next-job")
	const readers = 8
	var wg sync.WaitGroup
	for range readers {
		wg.Go(func() {
			for _, p := range paths {
				_, got := readAll(t, e, root, p)
				wantBytes(t, p, got)
			}
		})
	}
	wg.Wait()
	if s := e.Stats(); s.SourceChecks != int64(len(paths)) || s.StaleCopies != 0 {
		t.Errorf("%d readers at once: %d checks, %d stale; want one check per file (%d), none stale",
			readers, s.SourceChecks, s.StaleCopies, len(paths))
	}
}

// A restarted server checks the copies its tiers kept before serving them: a file rewritten
// while no server ran is read anew.
func TestRestartedEngineChecksKeptCopies(t *testing.T) {
	cfgs := testTiers(t, "1MiB")
	root := t.TempDir()
	path := filepath.Join(root, "f.bin")
	rewrite(t, path, []byte("v1"), time.Date(2025, 3, 1, 0, 0, 0, 0, time.UTC))
	e, err := NewEngine(EngineConfig{Tiers: cfgs}, nil)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, e, root, path)
	e.Close()
	rewrite(t, path, []byte("v2"), time.Date(2025, 3, 2, 0, 0, 0, 0, time.UTC))
	e, err = NewEngine(EngineConfig{Tiers: cfgs}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, got := readAll(t, e, root, path); string(got) != "v2" {
		t.Errorf("after a restart: got %q, want v2", got)
	}
}

// Fetch (the node socket's miss path) and OpenForReader check too.
func TestFetchAndOpenForReaderCheckTheSource(t *testing.T) {
	e := newEngine(t, "1MiB")
	root := t.TempDir()
	path := filepath.Join(root, "f.bin")
	rewrite(t, path, []byte("v1"), time.Date(2025, 3, 1, 0, 0, 0, 0, time.UTC))
	ctx := context.Background()
	if err := e.Fetch(ctx, root, path); err != nil {
		t.Fatal(err)
	}
	rewrite(t, path, []byte("v2!"), time.Date(2025, 3, 2, 0, 0, 0, 0, time.UTC))
	e.BeginSession("other")
	f, _, err := e.OpenForReader(ctx, root, path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, 16)
	n, _ := f.ReadAt(got, 0)
	if string(got[:n]) != "v2!" {
		t.Errorf("OpenForReader after the change: %q, want v2!", got[:n])
	}
}

// Prefetch checks a job's copies ahead of its readers: after the job of a new session has
// walked the list, every copy is checked, the changed one was read anew, and readers of the
// session find them all checked.
func TestPrefetchChecksCopiesAheadOfReaders(t *testing.T) {
	e := prefetchEngine(t, 4, nil, "1MiB")
	root, paths := dataset(t, 10, 20, 30, 40)
	for _, p := range paths {
		readAll(t, e, root, p)
	}
	rewrite(t, paths[2], []byte("changed"), time.Date(2025, 3, 1, 0, 0, 0, 0, time.UTC))
	s := e.BeginSession("job-2")
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "w1", Paths: paths, Session: s}); err != nil {
		t.Fatal(err)
	}
	info := waitPrefetch(t, e, root, "w1")
	if info.Fetched != 1 || info.SkippedCached != 3 {
		t.Errorf("prefetch fetched %d, skipped %d cached; want the changed file fetched, 3 skipped", info.Fetched, info.SkippedCached)
	}
	for _, p := range paths {
		for _, tier := range e.tiers {
			if listed, checked := tier.Checked(p, s); !listed || !checked {
				t.Errorf("%s after prefetch: listed %v, checked in session %d %v", p, listed, s, checked)
			}
		}
	}
	if _, got := readAll(t, e, root, paths[2]); string(got) != "changed" {
		t.Errorf("changed file: got %q", got)
	}
	// A later session's list does not join the earlier session's job: it checks again.
	s3 := e.BeginSession("job-3")
	info3, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "w2", Paths: paths, Session: s3})
	if err != nil {
		t.Fatal(err)
	}
	if info3.Joined {
		t.Error("a list of a later session joined the earlier session's job")
	}
	waitPrefetch(t, e, root, "w2")
	if got := e.Stats().SourceChecks; got != 8 {
		t.Errorf("source checks %d, want 4 per session", got)
	}
}

// A copy on its way into a tier when the file is forgotten (the preload shim saw it renamed
// over, removed or truncated; the copy may hold the version before) is dropped once it is
// published: before, the forget found nothing to drop and the stale copy was then served to
// the whole session. Here a replica copy waits for the data mover when the forget comes.
func TestForgetDropsACopyOnItsWay(t *testing.T) {
	e := newEngine(t, "1MiB")
	root := t.TempDir()
	path := filepath.Join(root, "f.bin")
	rewrite(t, path, []byte("old"), time.Date(2025, 3, 1, 0, 0, 0, 0, time.UTC))
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	testHookBeforePublish = func(p string) {
		testHookBeforePublish = nil
		tmp := p + ".new"
		rewrite(t, tmp, []byte("new!"), time.Date(2025, 3, 2, 0, 0, 0, 0, time.UTC))
		if err := os.Rename(tmp, p); err != nil {
			t.Error(err)
		}
		if err := e.Forget(root, p); err != nil {
			t.Error(err)
		}
	}
	defer func() { testHookBeforePublish = nil }()
	data := []byte("old")
	if err := e.Store(StoreRequest{Root: root, Path: path, Data: data, MTimeNanos: st.ModTime().UnixNano(),
		Checksum: crc32.Checksum(data, castagnoli)}); err != nil {
		t.Fatal(err)
	}
	e.mover.stop() // waits for the mover to publish what it holds
	if _, got := readAll(t, e, root, path); string(got) != "new!" {
		t.Errorf("after a forget while the copy was on its way: got %q, want the new version", got)
	}
}

// A session that begins while a miss reads the source has the copy checked before it is
// served: the fill checked the source against itself, but only up to the end of its read,
// which may have come before the session began.
func TestCopyFromAFillSpanningASessionIsChecked(t *testing.T) {
	e := newEngine(t, "1MiB")
	root, paths := dataset(t, 1000)
	testHookSourceRead = func(string) {
		testHookSourceRead = nil
		e.BeginSession("a job that began during the read")
	}
	defer func() { testHookSourceRead = nil }()
	_, got := readAll(t, e, root, paths[0])
	wantBytes(t, paths[0], got)
	if s := e.Stats(); s.SourceChecks != 1 {
		t.Errorf("source checks %d, want 1: the copy read before the session began was served unchecked", s.SourceChecks)
	}
}

// A restarted server numbers its sessions on from the last one the server before it began,
// even when that one began many jobs a second (its numbers ran ahead of the clock): a reader
// that kept its number (the C hit path, the preload shim) is never above every new number.
func TestSessionNumbersGrowAcrossRestarts(t *testing.T) {
	cfgs := testTiers(t, "1MiB")
	e, err := NewEngine(EngineConfig{Tiers: cfgs}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var last uint32
	for i := range 100 {
		last = e.BeginSession(fmt.Sprint("job ", i))
	}
	e.Close()
	e, err = NewEngine(EngineConfig{Tiers: cfgs}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if got := e.Session(); got <= last {
		t.Errorf("the restarted server's session is %d, not above the last one before it (%d)", got, last)
	}
	if got := e.BeginSession("a long job id " + strings.Repeat("x", 10_000)); got <= last {
		t.Errorf("a new job got %d", got)
	}
}
