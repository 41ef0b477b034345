package nodetiers_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/nodetiers"
	"github.com/fitcache/fitcache/privdir/privdirtest"
	"golang.org/x/sys/unix"
)

// node is a fake /dev/shm: tiers, held and left behind, and the traps a hostile user sets.
type node struct {
	dir     string // the fake /dev/shm
	outside string // a directory outside it, which must survive
}

// makeNode makes in dir: fitcache-held (a data file; its lock held by this process, as a live
// server holds it, until the test ends), fitcache-1000-ab12 (left behind: a data file under a
// subdirectory and a link to a file outside), fitcache-nolock (no lock file: no tier),
// fitcache-evil (a link to a directory outside), fitcache-x (a file) and other (a directory
// of another name).
func makeNode(t *testing.T, dir string) node {
	t.Helper()
	n := node{dir: dir, outside: t.TempDir()}
	mustWrite(t, filepath.Join(n.outside, "secret"), 100)
	for _, d := range []string{"fitcache-held", "fitcache-1000-ab12/ab/cd", "fitcache-nolock", "other"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	mustWrite(t, filepath.Join(dir, "fitcache-held", "fitcache.lock"), 0)
	mustWrite(t, filepath.Join(dir, "fitcache-held", "data"), 8192)
	mustWrite(t, filepath.Join(dir, "fitcache-1000-ab12", "fitcache.lock"), 0)
	mustWrite(t, filepath.Join(dir, "fitcache-1000-ab12", "ab", "cd", "data"), 20000)
	mustWrite(t, filepath.Join(dir, "fitcache-nolock", "data"), 10)
	mustWrite(t, filepath.Join(dir, "other", "data"), 10)
	mustWrite(t, filepath.Join(dir, "fitcache-x"), 10)
	for link, target := range map[string]string{
		"fitcache-1000-ab12/ab/secret": filepath.Join(n.outside, "secret"),
		"fitcache-evil":                n.outside,
	} {
		if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
			t.Fatal(err)
		}
	}
	// A live server: an exclusive flock on the lock file, which says who holds it.
	lock, err := os.OpenFile(filepath.Join(dir, "fitcache-held", "fitcache.lock"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lock.Close() })
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	lock.WriteString("pid 4242, embedded server, runtime dir /run/user/1000/fitcache\n")
	return n
}

func mustWrite(t *testing.T, path string, size int) {
	t.Helper()
	if err := os.WriteFile(path, []byte(strings.Repeat("x", size)), 0o600); err != nil {
		t.Fatal(err)
	}
}

// exists reports whether path is there (a link itself, not followed).
func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func TestListFindsTheTiersAndTellsHeldFromLeftBehind(t *testing.T) {
	n := makeNode(t, t.TempDir())
	got, err := nodetiers.List(nodetiers.Options{Dirs: []string{n.dir}})
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		base   string
		held   bool
		pid    int
		files  int64
		minLen int64
	}
	want := []row{
		{"fitcache-1000-ab12", false, 0, 1, 20000},
		{"fitcache-held", true, 4242, 1, 8192},
		{"fitcache-nolock", false, 0, 1, 10},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d tiers %+v, want %d (no link, file or other name)", len(got), got, len(want))
	}
	for i, w := range want {
		g := got[i]
		if g.Path != filepath.Join(n.dir, w.base) || g.Held != w.held || g.HolderPID != w.pid || g.Files != w.files ||
			g.Bytes < w.minLen || !g.Readable || g.UID != os.Geteuid() || g.Note != "" || g.Newest.IsZero() {
			t.Errorf("got %+v, want %s held %v by pid %d, %d files of at least %d bytes", g, w.base, w.held, w.pid, w.files, w.minLen)
		}
	}
	if !strings.Contains(got[1].Holder, "embedded server") {
		t.Errorf("holder: got %q, want the lock file's text", got[1].Holder)
	}
}

func TestClearRemovesOnlyWhatNoLiveServerHolds(t *testing.T) {
	n := makeNode(t, t.TempDir())
	o := nodetiers.Options{Dirs: []string{n.dir}}
	before, _ := nodetiers.List(o)

	got, err := nodetiers.Clear(o, nodetiers.AnyUser, true)
	if err != nil {
		t.Fatal(err)
	}
	actions := map[string]string{}
	for _, r := range got {
		actions[filepath.Base(r.Path)] = r.Action
	}
	want := map[string]string{"fitcache-1000-ab12": nodetiers.WouldRemove, "fitcache-held": nodetiers.Skipped,
		"fitcache-nolock": nodetiers.Skipped}
	if len(actions) != len(want) {
		t.Errorf("dry run: got %v, want %v", actions, want)
	}
	for k, v := range want {
		if actions[k] != v {
			t.Errorf("dry run: %s: got %q, want %q", k, actions[k], v)
		}
	}
	if after, _ := nodetiers.List(o); len(after) != len(before) || after[0].Files != before[0].Files {
		t.Errorf("a dry run removed something: got %+v, want %+v", after, before)
	}

	got, err = nodetiers.Clear(o, nodetiers.AnyUser, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range got {
		if r.Action == nodetiers.Removed && (r.Files != 1 || r.Bytes < 20000) {
			t.Errorf("removed %+v, want 1 file of at least 20000 bytes", r)
		}
		if strings.HasSuffix(r.Path, "held") && (!r.Held || r.HolderPID != 4242 || !strings.Contains(r.Reason, "pid 4242")) {
			t.Errorf("the held tier: got %+v, want it skipped, naming pid 4242", r)
		}
	}
	for _, p := range []struct {
		path string
		want bool
	}{
		{filepath.Join(n.dir, "fitcache-1000-ab12"), false},
		{filepath.Join(n.dir, "fitcache-held", "data"), true},
		{filepath.Join(n.dir, "fitcache-held", "fitcache.lock"), true},
		{filepath.Join(n.dir, "fitcache-nolock", "data"), true},
		{filepath.Join(n.dir, "fitcache-evil"), true},
		{filepath.Join(n.dir, "fitcache-x"), true},
		{filepath.Join(n.dir, "other", "data"), true},
		{filepath.Join(n.outside, "secret"), true},
	} {
		if got := exists(p.path); got != p.want {
			t.Errorf("%s exists after Clear: got %v, want %v", p.path, got, p.want)
		}
	}
}

// A walk stops at its bound: List says so, and Clear fails and keeps the tier (its lock file
// with it, so that it stays a tier for the next Clear).
func TestWalksStopAtTheirBound(t *testing.T) {
	dir := t.TempDir()
	tier := filepath.Join(dir, "fitcache-1000")
	os.Mkdir(tier, 0o700)
	mustWrite(t, filepath.Join(tier, "fitcache.lock"), 0)
	for _, name := range []string{"a", "b", "c", "d", "e"} {
		mustWrite(t, filepath.Join(tier, name), 1)
	}
	o := nodetiers.Options{Dirs: []string{dir}, MaxEntries: 3}
	ts, err := nodetiers.List(o)
	if err != nil || len(ts) != 1 || !strings.Contains(ts[0].Note, "bound") || ts[0].Files != 3 {
		t.Fatalf("List: got %+v (%v), want 3 files and a note of the bound", ts, err)
	}
	rs, err := nodetiers.Clear(o, nodetiers.AnyUser, false)
	if err == nil || len(rs) != 1 || rs[0].Action != nodetiers.Failed || !exists(filepath.Join(tier, "fitcache.lock")) {
		t.Errorf("Clear: got %+v (%v), want a failure and the lock file kept", rs, err)
	}
}

// In a shared sticky directory like /dev/shm, as root: --user takes only that user's tiers,
// and a tier nobody planted under someone else's name counts as nobody's.
func TestClearTakesOnlyTheUsersTiers(t *testing.T) {
	shared := privdirtest.SharedDir(t) // skips unless root
	privdirtest.AsNobody(t, "cd "+shared+" && mkdir -m 700 fitcache-0 fitcache-65534-x1 && "+
		"touch fitcache-0/fitcache.lock fitcache-65534-x1/fitcache.lock fitcache-0/data fitcache-65534-x1/data")
	mine := filepath.Join(shared, "fitcache-0-r00t")
	os.Mkdir(mine, 0o700)
	mustWrite(t, filepath.Join(mine, "fitcache.lock"), 0)
	o := nodetiers.Options{Dirs: []string{shared}}

	rs, err := nodetiers.Clear(o, 0, false)
	if err != nil || len(rs) != 1 || rs[0].Path != mine || rs[0].Action != nodetiers.Removed || exists(mine) {
		t.Errorf("clear of root's: got %+v (%v), want %s removed alone", rs, err, mine)
	}
	rs, err = nodetiers.Clear(o, 65534, false)
	if err != nil || len(rs) != 2 || exists(filepath.Join(shared, "fitcache-0")) || exists(filepath.Join(shared, "fitcache-65534-x1")) {
		t.Errorf("clear of nobody's: got %+v (%v), want both of nobody's removed", rs, err)
	}
}

// A user other than root clears only their own tiers, and sees another user's as unreadable.
func TestAUserClearsOnlyTheirOwn(t *testing.T) {
	if dir, ok := privdirtest.Victim(); ok { // the rerun, as nobody
		o := nodetiers.Options{Dirs: []string{dir}}
		if _, err := nodetiers.Clear(o, 0, true); !errors.Is(err, nodetiers.ErrOtherUser) {
			t.Errorf("clear of root's tiers as nobody: got %v, want ErrOtherUser", err)
		}
		ts, err := nodetiers.List(o)
		if err != nil || len(ts) != 1 || ts[0].Readable || ts[0].UID != 0 || ts[0].Note != "unreadable" {
			t.Errorf("list as nobody: got %+v (%v), want root's tier, unreadable", ts, err)
		}
		rs, err := nodetiers.Clear(o, nodetiers.AnyUser, false)
		if err != nil || len(rs) != 0 {
			t.Errorf("clear of every tier as nobody: got %+v (%v), want nothing touched", rs, err)
		}
		return
	}
	shared := privdirtest.SharedDir(t)
	tier := filepath.Join(shared, "fitcache-0")
	os.Mkdir(tier, 0o700)
	mustWrite(t, filepath.Join(tier, "fitcache.lock"), 0)
	privdirtest.RunAsNobody(t, shared)
	if !exists(filepath.Join(tier, "fitcache.lock")) {
		t.Errorf("nobody removed root's tier")
	}
}
