package tiers

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A claim is exclusive until released; FillName is where readers (capi/fill.c) make it.
func TestClaimIsExclusive(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	c, err := tier.Claim("/data/a.bin")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(filepath.Join(tier.Path, FillName("/data/a.bin"))); err != nil {
		t.Fatalf("no fill file where FillName says: %v", err)
	}
	if _, err := tier.Claim("/data/a.bin"); !errors.Is(err, ErrClaimed) {
		t.Fatalf("second claim: %v, want ErrClaimed", err)
	}
	if state, idle := tier.ClaimStateOf("/data/a.bin"); state != Left || idle > time.Minute {
		t.Errorf("ClaimStateOf: %v, idle %v; want Left (unlocked), fresh", state, idle)
	}
	c.Release()
	if _, err := tier.Claim("/data/a.bin"); err != nil {
		t.Fatalf("claim after release: %v", err)
	}
}

// OpenFill takes only the reader's file: the inode and size it names, a regular file with
// one name, not reached through a link.
func TestOpenFillChecksTheReadersFile(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	fill := func(path string) (string, uint64) {
		t.Helper()
		if _, err := tier.Claim(path); err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(tier.Path, FillName(path))
		if err := os.WriteFile(p, []byte("12345"), 0o600); err != nil {
			t.Fatal(err)
		}
		var st syscall.Stat_t
		syscall.Stat(p, &st)
		return p, st.Ino
	}
	p, ino := fill("/d/ok")
	f, err := tier.OpenFill("/d/ok", ino, 5)
	if err != nil {
		t.Fatalf("the reader's own file: %v", err)
	}
	f.Close()
	if _, err := tier.OpenFill("/d/ok", ino, 4); !errors.Is(err, ErrBadFill) {
		t.Errorf("another size: %v, want ErrBadFill", err)
	}
	if _, err := tier.OpenFill("/d/ok", ino+1, 5); !errors.Is(err, ErrBadFill) {
		t.Errorf("another inode: %v, want ErrBadFill", err)
	}
	if err := os.Link(p, filepath.Join(tier.Path, "second-name")); err == nil {
		if _, err := tier.OpenFill("/d/ok", ino, 5); !errors.Is(err, ErrBadFill) {
			t.Errorf("a file with two names: %v, want ErrBadFill", err)
		}
	}
	// A link in place of the fill file is not followed.
	p2, _ := fill("/d/link")
	os.Remove(p2)
	target := filepath.Join(t.TempDir(), "elsewhere")
	os.WriteFile(target, []byte("12345"), 0o600)
	os.Symlink(target, p2)
	var st syscall.Stat_t
	syscall.Stat(target, &st)
	if _, err := tier.OpenFill("/d/link", st.Ino, 5); err == nil {
		t.Error("a symbolic link was followed")
	}
}

// Adopt publishes the fill file's bytes as the copy, with its checksum, and leaves the fill
// file for the caller to remove: the file stays claimed until it is listed.
func TestAdoptPublishesTheFill(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	data := bytes.Repeat([]byte("fitcache"), 1000)
	if _, err := tier.Claim("/d/a"); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(tier.Path, FillName("/d/a"))
	os.WriteFile(p, data, 0o600)
	var st syscall.Stat_t
	syscall.Stat(p, &st)
	f, err := tier.OpenFill("/d/a", st.Ino, int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := tier.Adopt(Entry{SourcePath: "/d/a", Size: int64(len(data)), MTimeNanos: 1e18}, f); err != nil {
		t.Fatal(err)
	}
	if !tier.Listed("/d/a") {
		t.Fatal("not listed after Adopt")
	}
	if _, err := tier.Claim("/d/a"); !errors.Is(err, ErrClaimed) {
		t.Errorf("claim before the fill file is removed: %v, want ErrClaimed", err)
	}
	tier.RemoveFill("/d/a", st.Ino)
	m, err := tier.Open("/d/a")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release()
	if !bytes.Equal(m.Bytes(), data) {
		t.Error("the copy's bytes differ from the fill's")
	}
	valid, damaged, err := Dir{Path: tier.Path, Kind: Memory}.Check()
	if err != nil || valid != 1 || len(damaged) != 0 {
		t.Errorf("check: %d valid, %v damaged, %v", valid, damaged, err)
	}
}

// A claim is held while its fill file is locked (a reader reads the source: capi/fill.c locks
// it), and taken over only once nobody locks it.
func TestAClaimIsTakenOverOnlyWhenUnlocked(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	if _, err := tier.Claim("/d/x"); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(tier.Path, FillName("/d/x"))
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	lk := unix.Flock_t{Type: unix.F_WRLCK}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &lk); err != nil {
		t.Fatal(err)
	}
	if state, _ := tier.ClaimStateOf("/d/x"); state != Held {
		t.Errorf("locked claim: state %v, want Held", state)
	}
	if tier.TakeAbandonedClaim("/d/x") {
		t.Error("a locked claim was taken over")
	}
	f.Close() // the holder dies: the kernel drops its lock
	if state, _ := tier.ClaimStateOf("/d/x"); state != Left {
		t.Errorf("unlocked claim: state %v, want Left", state)
	}
	if !tier.TakeAbandonedClaim("/d/x") {
		t.Error("an old unlocked claim was not taken over")
	}
	if state, _ := tier.ClaimStateOf("/d/x"); state != Unclaimed {
		t.Errorf("after the take-over: state %v, want Unclaimed", state)
	}
}
