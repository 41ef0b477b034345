package tiers

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/privdir"
	"github.com/fitcache/fitcache/privdir/privdirtest"
)

// forged returns the data file of a cached copy of src: cached files hold exactly the
// source's bytes, so anyone can make one.
func forged(src string, data []byte) []byte { return bytes.Clone(data) }

// plantAsNobody writes file contents at path as the user nobody (creating its bins).
func plantAsNobody(t *testing.T, path string, contents []byte) {
	t.Helper()
	stage := filepath.Join(privdirtest.SharedDir(t), "stage")
	if err := os.WriteFile(stage, contents, 0o644); err != nil {
		t.Fatal(err)
	}
	privdirtest.AsNobody(t, fmt.Sprintf("mkdir -p %s && cp %s %s", filepath.Dir(path), stage, path))
}

func TestPlantedTierDirectoryIsRefused(t *testing.T) {
	shared := privdirtest.SharedDir(t)
	planted := filepath.Join(shared, "fitcache-0")
	privdirtest.AsNobody(t, "mkdir -m 777 "+planted)
	src := "/data/img.jpg"
	plantAsNobody(t, filepath.Join(planted, RelPath(src)), forged(src, []byte("forged bytes")))

	if tier, err := New(Config{Dir: planted, Kind: Memory, Budget: "1MiB"}, nil); !errors.Is(err, privdir.ErrNotPrivate) ||
		!strings.Contains(err.Error(), "nobody") {
		if tier != nil {
			tier.Close()
		}
		t.Fatalf("New on nobody's directory: got %v, want ErrNotPrivate naming nobody", err)
	}
	if d, err := OpenDir(planted, Memory); !errors.Is(err, privdir.ErrNotPrivate) {
		d.Close()
		t.Fatalf("OpenDir of nobody's directory: got %v, want ErrNotPrivate", err)
	}

	// With a fallback record (the default memory tier), a private stand-in is used instead
	// and the user is told why.
	record := filepath.Join(t.TempDir(), "memory-tier")
	tier, err := New(Config{Dir: planted, Kind: Memory, Budget: "1MiB", FallbackRecord: record}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	if tier.Path == planted || !strings.Contains(tier.Warning(), "nobody") || !strings.Contains(tier.Warning(), tier.Path) {
		t.Errorf("stand-in %s, warning %q: want another directory and a warning naming nobody and it", tier.Path, tier.Warning())
	}
	if _, err := tier.Open(src); !errors.Is(err, ErrNotCached) {
		t.Errorf("stand-in serves %s: %v", src, err)
	}
}

// looseTier returns a tier directory of ours that was left with mode 0777 in a shared
// directory, so that nobody could plant things in it before the server starts.
func looseTier(t *testing.T) (dir, shared string) {
	t.Helper()
	shared = privdirtest.SharedDir(t)
	dir = filepath.Join(shared, "tier")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o777)
	return dir, shared
}

func TestPlantedBinLinkIsRemovedNotFollowed(t *testing.T) {
	dir, shared := looseTier(t)
	src := "/data/a"
	bin1 := strings.Split(RelPath(src), "/")[0]
	trap := filepath.Join(shared, "trap")
	privdirtest.AsNobody(t, fmt.Sprintf("mkdir -m 777 %s && ln -s %s %s/%s", trap, trap, dir, bin1))

	tier, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	if fi, _ := os.Lstat(dir); fi.Mode().Perm() != 0o700 {
		t.Errorf("tier mode %v after New, want 0700", fi.Mode().Perm())
	}
	publish(t, tier, src, []byte("ours"))
	if ents, _ := os.ReadDir(trap); len(ents) != 0 {
		t.Errorf("Publish wrote through the planted link into %s: %v", trap, ents)
	}
	if fi, err := os.Lstat(filepath.Join(dir, bin1)); err != nil || !fi.IsDir() {
		t.Errorf("bin %s is not a real directory after New and Publish: %v %v", bin1, fi, err)
	}
}

func TestPlantedBinOfAnotherUserIsRefused(t *testing.T) {
	dir, _ := looseTier(t)
	src := "/data/a"
	plantAsNobody(t, filepath.Join(dir, RelPath(src)), forged(src, []byte("nobody's bytes")))
	tier, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err == nil {
		defer tier.Close()
		m, oerr := tier.Open(src)
		if oerr == nil {
			t.Errorf("served nobody's forged entry: %q", m.Bytes())
		}
	}
	if !errors.Is(err, privdir.ErrNotPrivate) || !strings.Contains(err.Error(), "65534") ||
		!strings.Contains(err.Error(), filepath.Join(dir, strings.Split(RelPath(src), "/")[0])) {
		t.Fatalf("New with nobody's bin: got %v, want ErrNotPrivate naming uid 65534 and the bin", err)
	}
}

func TestLinksInOwnTierAreMisses(t *testing.T) {
	for _, tc := range []struct {
		name    string
		openat2 func(int, string, *unix.OpenHow) (int, error)
	}{
		{"openat2", unix.Openat2},
		{"openat per level (kernel without openat2)", func(int, string, *unix.OpenHow) (int, error) { return -1, unix.ENOSYS }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer func(f func(int, string, *unix.OpenHow) (int, error)) { openat2 = f }(openat2)
			openat2 = tc.openat2
			testLinksInOwnTierAreMisses(t)
		})
	}
}

func testLinksInOwnTierAreMisses(t *testing.T) {
	tier := newTier(t, Disk, "1MiB")
	outside := t.TempDir()
	for _, tc := range []struct {
		name, src string
		plant     func(path string)
	}{
		{"entry link", "/data/entry", func(path string) {
			os.MkdirAll(filepath.Dir(path), 0o700)
			target := filepath.Join(outside, "forged")
			os.WriteFile(target, forged("/data/entry", []byte("forged")), 0o600)
			os.Symlink(target, path)
		}},
		{"bin link", "/data/bin", func(path string) {
			bin := filepath.Dir(path)
			real := filepath.Join(outside, "bin")
			os.MkdirAll(real, 0o700)
			os.WriteFile(filepath.Join(real, filepath.Base(path)), forged("/data/bin", []byte("forged")), 0o600)
			os.MkdirAll(filepath.Dir(bin), 0o700)
			os.RemoveAll(bin)
			os.Symlink(real, bin)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.plant(tier.CachedPath(tc.src))
			for name, o := range map[string]Opener{"Dir": tier.Dir, "Tier": tier} {
				if m, err := o.Open(tc.src); !errors.Is(err, ErrNotCached) {
					m.Release()
					t.Errorf("%s.Open followed the link: err %v", name, err)
				}
			}
		})
	}
	tier.Close()
	again, err := New(Config{Dir: tier.Path, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if len(again.Damaged()) != 2 || again.Info().Files != 0 {
		t.Errorf("rescan: damaged %v, info %+v: want both links removed", again.Damaged(), again.Info())
	}
	for _, p := range []string{again.CachedPath("/data/entry"), filepath.Dir(again.CachedPath("/data/bin"))} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("link %s left by rescan: %v", p, err)
		}
	}
	if _, err := os.Stat(filepath.Join(outside, "forged")); err != nil {
		t.Errorf("rescan removed a link's target: %v", err)
	}
}

func TestTierPathLinkTargetIsUntouched(t *testing.T) {
	base := t.TempDir()
	target := filepath.Join(base, "target")
	os.Mkdir(target, 0o755)
	leftover := filepath.Join(target, tempPrefix+"precious")
	os.WriteFile(leftover, []byte("x"), 0o644)
	link := filepath.Join(base, "tier")
	os.Symlink(target, link)
	if tier, err := New(Config{Dir: link, Kind: Disk, Budget: "1MiB"}, nil); !errors.Is(err, privdir.ErrNotPrivate) {
		if tier != nil {
			tier.Close()
		}
		t.Fatalf("New on a link: got %v, want ErrNotPrivate", err)
	}
	if fi, _ := os.Stat(target); fi.Mode().Perm() != 0o755 {
		t.Errorf("link target chmodded to %v", fi.Mode().Perm())
	}
	if _, err := os.Stat(leftover); err != nil {
		t.Errorf("file in the link's target removed: %v", err)
	}
}

func TestSecondServerIsLockedOut(t *testing.T) {
	dir := t.TempDir()
	first, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB", Holder: "runtime dir /run/a"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = New(Config{Dir: dir, Kind: Disk, Budget: "1MiB", Holder: "runtime dir /run/b"}, nil)
	want := fmt.Sprintf("pid %d, runtime dir /run/a", os.Getpid())
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), want) {
		t.Fatalf("second New: got %v, want ErrLocked naming %q", err, want)
	}
	if got := Holder(dir); !strings.Contains(got, want) {
		t.Errorf("Holder = %q, want it to name %q", got, want)
	}
	for range 2 {
		if err := first.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	if got := Holder(dir); got != "" {
		t.Errorf("Holder after Close = %q, want none", got)
	}
	if err := first.Publish(Entry{SourcePath: "/d/x", Size: 1}, []byte("x")); err == nil {
		t.Error("Publish after Close succeeded")
	}
	second, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatalf("New after Close: %v", err)
	}
	second.Close()
}

func overwrite(t *testing.T, path string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func TestVerifyRemovesOverwrittenData(t *testing.T) {
	dir := t.TempDir()
	tier, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	publish(t, tier, "/d/good", []byte("good bytes"))
	publish(t, tier, "/d/bad", []byte("good bytes"))
	overwrite(t, tier.CachedPath("/d/bad"), 0, []byte("EVIL"))
	tier.Close()

	valid, damaged, err := (Dir{Path: dir, Kind: Disk}).Check()
	if err != nil || valid != 1 || len(damaged) != 1 || !errors.Is(damaged[0].Err, ErrDamaged) {
		t.Fatalf("Check: valid %d damaged %v err %v; want 1 valid and 1 damaged", valid, damaged, err)
	}
	if _, err := os.Stat(tier.CachedPath("/d/bad")); err != nil {
		t.Errorf("Check changed the tier: %v", err)
	}

	verified, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB", Verify: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer verified.Close()
	if diff := fmt.Sprint(cached(t, verified, "/d/good", "/d/bad")); diff != "[/d/good]" {
		t.Errorf("cached after verify: %s, want [/d/good]", diff)
	}
	if d := verified.Damaged(); len(d) != 1 || d[0].Rel != RelPath("/d/bad") {
		t.Errorf("Damaged = %v, want the overwritten entry", d)
	}
	if info := verified.Info(); info.Files != 1 || info.Used != EntrySize("/d/good", 10) {
		t.Errorf("accounting after verify: %+v", info)
	}
}

// What a crash or an older FitCache can leave in a tier is removed by the rescan, never
// served: a data file without its record (an entry of the format with a trailer, or a crash
// between the renames of publication), a record without its data file, and a record left
// from an older copy (it names another inode).
func TestEntriesWithoutValidRecordsAreRemoved(t *testing.T) {
	tier := newTier(t, Disk, "1MiB")
	for _, src := range []string{"/d/no-record", "/d/no-data", "/d/old-record", "/d/good"} {
		publish(t, tier, src, []byte("bytes of "+src))
	}
	record := func(src string) string {
		p := tier.CachedPath(src)
		return filepath.Join(filepath.Dir(p), recordPrefix+filepath.Base(p))
	}
	os.Remove(record("/d/no-record"))
	os.Remove(tier.CachedPath("/d/no-data"))
	oldRecord, _ := os.ReadFile(record("/d/old-record"))
	publish(t, tier, "/d/old-record", []byte("new bytes"))
	os.WriteFile(record("/d/old-record"), oldRecord, 0o600)
	tier.Close()

	again, err := New(Config{Dir: tier.Path, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if diff := cmp.Diff([]string{"/d/good"}, cached(t, again, "/d/no-record", "/d/no-data", "/d/old-record", "/d/good")); diff != "" {
		t.Errorf("cached after rescan (-want +got):\n%s", diff)
	}
	if n := len(again.Damaged()); n != 3 {
		t.Errorf("rescan found %d damaged entries, want 3: %v", n, again.Damaged())
	}
	for _, p := range []string{tier.CachedPath("/d/no-record"), record("/d/no-data"), tier.CachedPath("/d/old-record"), record("/d/old-record")} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s left by the rescan: %v", p, err)
		}
	}
}

func TestPublishFrom(t *testing.T) {
	data := bytes.Repeat([]byte("0123456789abcdef"), 200_000) // 3.2 MB: several chunks
	for _, tc := range []struct {
		name    string
		size    int64
		r       io.Reader
		wantErr error
	}{
		{"exact", int64(len(data)), bytes.NewReader(data), nil},
		{"one byte at a time", 1000, iotest.OneByteReader(bytes.NewReader(data[:1000])), nil},
		{"empty", 0, bytes.NewReader(nil), nil},
		{"short", int64(len(data)) + 1, bytes.NewReader(data), ErrShortSource},
		{"long", int64(len(data)) - 1, bytes.NewReader(data), ErrShortSource},
		{"failing", 10, iotest.ErrReader(io.ErrClosedPipe), io.ErrClosedPipe},
		{"too large", 2 << 20 * 10, bytes.NewReader(nil), ErrNoRoom},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tier := newTier(t, Disk, "16MiB")
			err := tier.PublishFrom(Entry{SourcePath: "/d/f", Size: tc.size}, tc.r)
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Fatalf("got %v, want %v", err, tc.wantErr)
			}
			temps, _ := filepath.Glob(filepath.Join(tier.Path, "*", "*", tempPrefix+"*"))
			if len(temps) != 0 {
				t.Errorf("temporary files left: %v", temps)
			}
			m, oerr := tier.Open("/d/f")
			if tc.wantErr != nil {
				if oerr == nil || tier.Info().Used != 0 {
					t.Errorf("failed publish left an entry or accounting: %v %+v", oerr, tier.Info())
				}
				return
			}
			if oerr != nil {
				t.Fatal(oerr)
			}
			defer m.Release()
			if !bytes.Equal(m.Bytes(), data[:tc.size]) || m.Checksum != crc32c(data[:tc.size]) {
				t.Errorf("published %d bytes (checksum %#x), want %d", len(m.Bytes()), m.Checksum, tc.size)
			}
		})
	}
}

func TestPublishFromBoundsMemory(t *testing.T) {
	tier := newTier(t, Disk, "1GiB")
	const size = 64 << 20
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	if err := tier.PublishFrom(Entry{SourcePath: "/d/big", Size: size}, io.LimitReader(zeros{}, size)); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 4<<20 {
		t.Errorf("PublishFrom of %d MiB allocated %d bytes, want at most 4 MiB", size>>20, alloc)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

func TestVerifyReportsWhileHeldAndRepairsOtherwise(t *testing.T) {
	cfg := Config{Dir: t.TempDir(), Kind: Disk, Budget: "1MiB", Holder: "runtime dir /run/one"}
	tier, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	publish(t, tier, "/d/good", []byte("good bytes"))
	publish(t, tier, "/d/bad", []byte("good bytes"))
	overwrite(t, tier.CachedPath("/d/bad"), 3, []byte("!"))

	held, err := Verify(cfg, nil)
	if err != nil || held.Removed || held.Valid != 1 || len(held.Damaged) != 1 || !strings.Contains(held.Holder, "/run/one") {
		t.Fatalf("Verify while held: %+v, %v; want 1 valid, 1 damaged not removed, the holder named", held, err)
	}
	if _, err := os.Stat(tier.CachedPath("/d/bad")); err != nil {
		t.Errorf("Verify removed an entry of a held tier: %v", err)
	}
	tier.Close()

	repaired, err := Verify(cfg, nil)
	if err != nil || !repaired.Removed || repaired.Valid != 1 || len(repaired.Damaged) != 1 {
		t.Fatalf("Verify of a free tier: %+v, %v; want 1 damaged entry removed", repaired, err)
	}
	if again, err := Verify(cfg, nil); err != nil || len(again.Damaged) != 0 || again.Valid != 1 {
		t.Errorf("Verify after repair: %+v, %v", again, err)
	}
	if _, err := Verify(Config{Dir: filepath.Join(cfg.Dir, "missing"), Kind: Disk}, nil); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Verify of a missing tier: got %v, want ErrNotExist", err)
	}
}

// A tier whose lock someone holds for a moment (fitcache info reading the holder) is still
// taken by a starting server. On the main branch before this change the server skipped the
// tier for its whole life.
func TestTierLockWaitsForABriefHolder(t *testing.T) {
	dir := t.TempDir()
	first, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	first.Close()
	f, err := os.Open(filepath.Join(dir, lockName))
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		f.Close()
	}()
	tier, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatalf("a lock held for 300 ms: %v", err)
	}
	tier.Close()
}

// A Dir held open by OpenDir keeps reading the directory it checked, even if its path is
// renamed away and replaced, and gives misses once closed (no panic, no other directory).
func TestHeldDirReadsWhatItChecked(t *testing.T) {
	base := t.TempDir()
	path := filepath.Join(base, "tier")
	tier, err := New(Config{Dir: path, Kind: Memory, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	if err := tier.Publish(Entry{SourcePath: "/d/f", Size: 4}, []byte("real")); err != nil {
		t.Fatal(err)
	}
	d, err := OpenDir(path, Memory)
	if err != nil {
		t.Fatal(err)
	}
	os.Rename(path, filepath.Join(base, "moved"))
	os.Mkdir(path, 0o700) // an empty stand-in at the old path
	m, err := d.Open("/d/f")
	if err != nil {
		t.Fatalf("held directory after its path was replaced: %v", err)
	}
	if string(m.Bytes()) != "real" {
		t.Errorf("got %q", m.Bytes())
	}
	m.Release()
	d.Close()
	if _, err := d.Open("/d/f"); !errors.Is(err, ErrNotCached) {
		t.Errorf("closed directory: got %v, want ErrNotCached", err)
	}
}

// A memory tier directory planted by another user with mode 0700, which this user cannot even
// open, is refused as not private, and with a fallback record (the default memory tier) a
// private stand-in is used, as for a planted directory this user can open. Run as nobody,
// with root's directory. Before, New failed with EACCES, and the user had no memory tier.
func TestClosedTierDirectoryFallsBack(t *testing.T) {
	if planted, ok := privdirtest.Victim(); ok {
		if tier, err := New(Config{Dir: planted, Kind: Memory, Budget: "1MiB"}, nil); !errors.Is(err, privdir.ErrNotPrivate) {
			if tier != nil {
				tier.Close()
			}
			t.Fatalf("New on root's closed directory: got %v, want ErrNotPrivate", err)
		}
		record := filepath.Join(t.TempDir(), "memory-tier")
		tier, err := New(Config{Dir: planted, Kind: Memory, Budget: "1MiB", FallbackRecord: record}, nil)
		if err != nil {
			t.Fatalf("New with a fallback record: %v", err)
		}
		defer tier.Close()
		if tier.Path == planted || !strings.Contains(tier.Warning(), "root") {
			t.Errorf("stand-in %s, warning %q: want another directory and a warning naming root", tier.Path, tier.Warning())
		}
		return
	}
	planted := filepath.Join(privdirtest.SharedDir(t), "fitcache-65534")
	if err := os.Mkdir(planted, 0o700); err != nil {
		t.Fatal(err)
	}
	privdirtest.RunAsNobody(t, planted)
}
