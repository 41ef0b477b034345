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

// writeReaderFill claims sourcePath in tier and writes data into its fill file as a reader
// does (capi/fill.c), and, with finish, the mode and times the copy of a source of mode
// mode and modification time mtime gets. It returns the fill file's path and inode.
func writeReaderFill(t *testing.T, tier *Tier, sourcePath string, data []byte, finish bool, mode uint32, mtime int64) (string, uint64) {
	t.Helper()
	if _, err := tier.Claim(sourcePath); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(tier.Path, FillName(sourcePath))
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if finish {
		if err := os.Chmod(p, os.FileMode(mode)); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, time.Unix(0, mtime), time.Unix(0, mtime)); err != nil {
			t.Fatal(err)
		}
	}
	var st syscall.Stat_t
	if err := syscall.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return p, st.Ino
}

// Adopt publishes the fill file's bytes as the copy, with its checksum: the one its reader
// reported (the copy is not read), or read from it for a reader that reported none. Its mode
// and times are the source's, whether its reader set them or not. The fill file keeps its
// name, so the file stays claimed, until the copy is listed; then Adopt removes it.
func TestAdoptPublishesTheFill(t *testing.T) {
	data := bytes.Repeat([]byte("fitcache"), 1000)
	const mtime, mode = int64(1_700_000_000_123_456_789), 0o644
	for _, tc := range []struct {
		name        string
		hasChecksum bool
		finish      bool
	}{
		{"reader's checksum, mode and times", true, true},
		{"reader's checksum only", true, false},
		{"an older reader's fill", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tier := newTier(t, Memory, "1MiB")
			p, ino := writeReaderFill(t, tier, "/d/a", data, tc.finish, mode, mtime)
			f, err := tier.OpenFill("/d/a", ino, int64(len(data)))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			// An older reader's report has zeros where the checksum goes: not taken.
			f.Checksum, f.HasChecksum = 0, tc.hasChecksum
			if tc.hasChecksum {
				f.Checksum = crc32c(data)
			}
			if err := tier.Adopt(Entry{SourcePath: "/d/a", Size: int64(len(data)), MTimeNanos: mtime, Mode: mode}, f); err != nil {
				t.Fatal(err)
			}
			if !tier.Listed("/d/a") || !f.Adopted() {
				t.Fatalf("after Adopt: listed %v, adopted %v; want both", tier.Listed("/d/a"), f.Adopted())
			}
			// The copy is opened (to be read, or its mode and times set) only where its
			// reader left something to do.
			if opened, want := f.fd >= 0, !tc.hasChecksum || !tc.finish; opened != want {
				t.Errorf("the fill file opened by Adopt: %v, want %v", opened, want)
			}
			if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the fill file after Adopt: %v, want it removed (the claim ended)", err)
			}
			m, err := tier.Open("/d/a")
			if err != nil {
				t.Fatal(err)
			}
			defer m.Release()
			if !bytes.Equal(m.Bytes(), data) {
				t.Error("the copy's bytes differ from the fill's")
			}
			if m.Entry.Checksum != crc32c(data) {
				t.Errorf("checksum %08x, want %08x", m.Entry.Checksum, crc32c(data))
			}
			var st syscall.Stat_t
			if err := syscall.Stat(tier.CachedPath("/d/a"), &st); err != nil {
				t.Fatal(err)
			}
			if st.Mode&0o7777 != mode|0o400 || st.Mtim.Nano() != mtime || st.Nlink != 1 {
				t.Errorf("the copy: mode %o, mtime %d, %d links; want %o, %d, 1", st.Mode&0o7777, st.Mtim.Nano(), st.Nlink, mode|0o400, mtime)
			}
			valid, damaged, err := Dir{Path: tier.Path, Kind: Memory}.Check()
			if err != nil || valid != 1 || len(damaged) != 0 {
				t.Errorf("check: %d valid, %v damaged, %v", valid, damaged, err)
			}
		})
	}
}

// A reported checksum is recorded as it is, the copy not read: one that does not match the
// bytes (a reader's bug, or bytes that changed after it computed it) is not the copy's
// checksum, so the copy fails its check (Verify) and is removed, never served as valid.
func TestAWrongReportedChecksumFailsTheCopysCheck(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{Dir: dir, Kind: Disk, Budget: "1MiB"}
	tier, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { tier.Close() }()
	data := []byte("the bytes the reader wrote")
	_, ino := writeReaderFill(t, tier, "/d/a", data, true, 0o600, 1)
	f, err := tier.OpenFill("/d/a", ino, int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	f.Checksum, f.HasChecksum = crc32c(data)^1, true
	err = tier.Adopt(Entry{SourcePath: "/d/a", Size: int64(len(data)), MTimeNanos: 1, Mode: 0o600}, f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	m, err := tier.Open("/d/a")
	if err != nil {
		t.Fatal(err)
	}
	if m.Entry.Checksum != crc32c(data)^1 {
		t.Errorf("the index's checksum is %08x, want the reported %08x (the copy read again?)", m.Entry.Checksum, crc32c(data)^1)
	}
	m.Release()
	valid, damaged, err := Dir{Path: dir, Kind: Disk}.Check()
	if err != nil || valid != 0 || len(damaged) != 1 || !errors.Is(damaged[0].Err, ErrDamaged) {
		t.Fatalf("Check: %d valid, %v damaged, %v; want the copy damaged", valid, damaged, err)
	}
	tier.Close()
	cfg.Verify = true
	if tier, err = New(cfg, nil); err != nil {
		t.Fatal(err)
	}
	if tier.Listed("/d/a") {
		t.Error("the copy is listed after a verifying start")
	}
	if _, err := tier.Open("/d/a"); err == nil {
		t.Error("the copy was served after a verifying start")
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

// A fill placed in another tier is copied there, checked against the checksum its reader
// reported: a copy of other bytes is not published.
func TestPublishFillChecksTheReportedChecksum(t *testing.T) {
	first, next := newTier(t, Memory, "1MiB"), newTier(t, Disk, "1MiB")
	data := []byte("the bytes the reader read")
	for _, tc := range []struct {
		name     string
		checksum uint32
		want     error
	}{
		{"its checksum", crc32c(data), nil},
		{"another checksum", crc32c(data) ^ 1, ErrBadFill},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := "/d/" + tc.name
			_, ino := writeReaderFill(t, first, src, data, true, 0o600, 1)
			f, err := first.OpenFill(src, ino, int64(len(data)))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			f.Checksum, f.HasChecksum = tc.checksum, true
			err = next.PublishFill(Entry{SourcePath: src, Size: int64(len(data)), MTimeNanos: 1}, f)
			if !errors.Is(err, tc.want) {
				t.Fatalf("PublishFill: %v, want %v", err, tc.want)
			}
			if listed := next.Listed(src); listed != (tc.want == nil) {
				t.Errorf("listed: %v, want %v", listed, tc.want == nil)
			}
		})
	}
}

// The server's own fill writes the copy into its claim's fill file (Claim.Fill), with the
// room reserved first, and Adopt links that file into place: the copy is the fill file (same
// inode), its checksum the bytes', and the reservation becomes the copy's room.
func TestClaimFillWritesTheCopyIntoTheFillFile(t *testing.T) {
	data := bytes.Repeat([]byte("server's fill "), 5000)
	const mtime, mode = int64(1_700_000_000_123_456_789), 0o640
	e := Entry{SourcePath: "/d/a", Size: int64(len(data)), MTimeNanos: mtime, Mode: mode}
	need := EntrySize("/d/a", e.Size)
	tier := newTier(t, Memory, "1MiB")
	c, err := tier.Claim("/d/a")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	f, err := c.Fill(e, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	if info := tier.Info(); info.Used != need || info.Writing != need {
		t.Errorf("after Fill: used %d, writing %d; want both %d (reserved)", info.Used, info.Writing, need)
	}
	if !f.HasChecksum || f.Checksum != crc32c(data) {
		t.Errorf("fill's checksum %08x (%v), want %08x", f.Checksum, f.HasChecksum, crc32c(data))
	}
	var fst syscall.Stat_t
	if err := syscall.Stat(filepath.Join(tier.Path, FillName("/d/a")), &fst); err != nil {
		t.Fatal(err)
	}
	if err := tier.Adopt(e, f); err != nil {
		t.Fatal(err)
	}
	if info := tier.Info(); info.Used != need || info.Writing != 0 || info.Files != 1 {
		t.Errorf("after Adopt: used %d, writing %d, %d files; want %d, 0, 1", info.Used, info.Writing, info.Files, need)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(tier.CachedPath("/d/a"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Ino != fst.Ino || st.Mode&0o7777 != mode|0o400 || st.Mtim.Nano() != mtime || st.Nlink != 1 {
		t.Errorf("the copy: inode %d, mode %o, mtime %d, %d links; want inode %d (the fill file's), %o, %d, 1",
			st.Ino, st.Mode&0o7777, st.Mtim.Nano(), st.Nlink, fst.Ino, mode|0o400, mtime)
	}
	m, err := tier.Open("/d/a")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release()
	if !bytes.Equal(m.Bytes(), data) || m.Entry.Checksum != crc32c(data) {
		t.Errorf("the copy: bytes equal %v, checksum %08x; want true, %08x", bytes.Equal(m.Bytes(), data), m.Entry.Checksum, crc32c(data))
	}
	c.Release()
	if info := tier.Info(); info.Used != need || !tier.Listed("/d/a") {
		t.Errorf("after Release: used %d, listed %v; want %d, true", info.Used, tier.Listed("/d/a"), need)
	}
	if state, _ := tier.ClaimStateOf("/d/a"); state != Unclaimed {
		t.Errorf("claim after Adopt and Release: %v, want Unclaimed", state)
	}
}

// Claim.Fill writes nothing into a tier without room for the copy (ErrNoRoom), fails on a
// source of another size than the entry's, and a claim released unpublished gives back its
// reservation and removes its fill file.
func TestClaimFillKeepsTheBudget(t *testing.T) {
	data := bytes.Repeat([]byte{7}, 40_000)
	e := Entry{SourcePath: "/d/a", Size: int64(len(data))}
	tier := newTier(t, Memory, "64KiB")
	publish(t, tier, "/d/other", bytes.Repeat([]byte{1}, 30_000)) // leaves less than the copy needs
	used := tier.Info().Used
	c, err := tier.Claim("/d/a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Fill(e, bytes.NewReader(data)); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("Fill without room: %v, want ErrNoRoom", err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(tier.Path, FillName("/d/a")), &st); err != nil || st.Size != 0 {
		t.Errorf("fill file after a Fill without room: %d bytes (%v), want 0", st.Size, err)
	}
	if got := tier.Info().Used; got != used {
		t.Errorf("used %d after a Fill without room, want %d", got, used)
	}
	c.Release()

	tier = newTier(t, Memory, "1MiB")
	for _, src := range [][]byte{data[:100], append(data, 1)} {
		c, err := tier.Claim("/d/a")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Fill(e, bytes.NewReader(src)); !errors.Is(err, ErrShortSource) {
			t.Errorf("Fill from %d bytes for %d: %v, want ErrShortSource", len(src), len(data), err)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(tier.Path, FillName("/d/a")), &st); err != nil || st.Size != 0 {
			t.Errorf("fill file after a failed Fill: %d bytes (%v), want 0 (its reservation given back)", st.Size, err)
		}
		c.Release()
		if info := tier.Info(); info.Used != 0 || info.Writing != 0 {
			t.Errorf("after a failed Fill: used %d, writing %d; want 0", info.Used, info.Writing)
		}
		if state, _ := tier.ClaimStateOf("/d/a"); state != Unclaimed {
			t.Errorf("claim after Release: %v, want Unclaimed", state)
		}
	}
	c, err = tier.Claim("/d/a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Fill(e, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	c.Release() // never adopted
	if info := tier.Info(); info.Used != 0 || info.Writing != 0 || tier.Listed("/d/a") {
		t.Errorf("a fill released unpublished: used %d, writing %d, listed %v; want 0, 0, false", info.Used, info.Writing, tier.Listed("/d/a"))
	}
	if state, _ := tier.ClaimStateOf("/d/a"); state != Unclaimed {
		t.Errorf("claim after Release: %v, want Unclaimed", state)
	}
}
