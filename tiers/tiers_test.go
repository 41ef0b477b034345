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

	"github.com/fitcache/fitcache/privdir"
	"github.com/fitcache/fitcache/privdir/privdirtest"
)

func newTier(t *testing.T, kind Kind, budget string) *Tier {
	t.Helper()
	tier, err := New(Config{Dir: t.TempDir(), Kind: kind, Budget: budget}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Close() })
	return tier
}

// readerOf opens the read side of tier as a reader process would (OpenDir), closed at the
// end of the test.
func readerOf(t *testing.T, tier *Tier) Dir {
	t.Helper()
	d, err := OpenDir(tier.Path, tier.Kind)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func publish(t *testing.T, tier *Tier, src string, data []byte) {
	t.Helper()
	if err := tier.Publish(Entry{SourcePath: src, Size: int64(len(data)), MTimeNanos: 1}, data); err != nil {
		t.Fatalf("publish %s: %v", src, err)
	}
}

// cached lists the source paths a tier holds, sorted by the order Dir.Open finds them.
func cached(t *testing.T, tier *Tier, srcs ...string) []string {
	t.Helper()
	var got []string
	for _, src := range srcs {
		m, err := tier.Open(src)
		if err == nil {
			got = append(got, src)
			m.Release()
		} else if !errors.Is(err, ErrNotCached) {
			t.Fatalf("open %s: %v", src, err)
		}
	}
	return got
}

func TestRelPathLayout(t *testing.T) {
	k := KeyOf("/data/train/img_0001.jpg")
	want := fmt.Sprintf("%02x/%02x/%016x-img_0001.jpg", byte(k), byte(k>>8), uint64(k))
	if got := RelPath("/data/train/img_0001.jpg"); got != want {
		t.Errorf("RelPath = %q, want %q", got, want)
	}
	if KeyOf("/data//train/../train/img_0001.jpg") != k {
		t.Error("uncleaned path got another key")
	}
	if got := RelPath("/d/.hidden"); strings.Contains(filepath.Base(got), "-.") {
		t.Errorf("leading dot kept in %q: it could be mistaken for a temporary file", got)
	}
	long := "/d/" + strings.Repeat("x", 400)
	if n := len(filepath.Base(RelPath(long))); n > 255 {
		t.Errorf("cached name of %d bytes exceeds NAME_MAX", n)
	}
}

func FuzzRelPath(f *testing.F) {
	f.Add("/data/a.jpg")
	f.Add("relative/../x")
	f.Fuzz(func(t *testing.T, src string) {
		rel := RelPath(src)
		parts := strings.Split(rel, "/")
		if len(parts) != 3 || !isBinName(parts[0]) || !isBinName(parts[1]) {
			t.Fatalf("RelPath(%q) = %q: want two bin directories and a name", src, rel)
		}
		if isTempName(parts[2]) || len(parts[2]) > 255 || parts[2] == "" {
			t.Fatalf("RelPath(%q) = %q: bad file name", src, rel)
		}
		if RelPath(filepath.Clean(src)) != rel {
			t.Fatalf("RelPath not stable under Clean for %q", src)
		}
	})
}

func TestRecordRoundTripAndDamage(t *testing.T) {
	want := stored{Entry: Entry{SourcePath: "/data/x.bin", Size: 5, MTimeNanos: 42, SourceCTimeNanos: 43, SourceIno: 44,
		Checksum: 7}, ino: 99, seq: 3}
	rec := appendRecord(nil, want)
	got, err := parseRecord(rec)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(stored{})); diff != "" {
		t.Errorf("record (-want +got):\n%s", diff)
	}
	damaged := map[string][]byte{
		"truncated":   rec[:len(rec)-1],
		"first lost":  rec[1:],
		"empty":       nil,
		"bit flipped": flip(rec, 20),
		"size field":  flip(rec, len(rec)-recordFixed+16+2),
		"longer":      append(bytes.Clone(rec), 0),
	}
	for name, b := range damaged {
		if _, err := parseRecord(b); !errors.Is(err, errDamaged) {
			t.Errorf("%s: got %v, want errDamaged", name, err)
		}
	}
}

func flip(b []byte, i int) []byte {
	c := bytes.Clone(b)
	c[i] ^= 0x40
	return c
}

func FuzzParseRecord(f *testing.F) {
	f.Add(appendRecord(nil, stored{Entry: Entry{SourcePath: "/a", Size: 3}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := parseRecord(b)
		if err == nil && (int64(len(b)) != recordSize(s.Entry) || s.Size < 0) {
			t.Fatalf("accepted inconsistent record %+v of %d bytes", s, len(b))
		}
	})
}

func TestCachedFileIsByteExact(t *testing.T) {
	tier := newTier(t, Disk, "1MiB")
	data := []byte("exactly these bytes, nothing after them")
	mtime := time.Date(2020, 1, 2, 3, 4, 5, 6000, time.UTC)
	if err := tier.Publish(Entry{SourcePath: "/d/exact", Size: int64(len(data)), MTimeNanos: mtime.UnixNano()}, data); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(tier.CachedPath("/d/exact"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Errorf("cached file holds %q, want exactly %q", got, data)
	}
	fi, _ := os.Stat(tier.CachedPath("/d/exact"))
	if !fi.ModTime().Equal(mtime) {
		t.Errorf("cached file mtime %v, want the source's %v", fi.ModTime(), mtime)
	}
}

func TestPublishOpen(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	data := []byte("the exact bytes")
	publish(t, tier, "/data/a", data)
	m, err := tier.Open("/data/a")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release()
	if !bytes.Equal(m.Bytes(), data) {
		t.Errorf("got %q, want %q", m.Bytes(), data)
	}
	if m.Tier != Memory || m.SourcePath != "/data/a" {
		t.Errorf("got tier %v path %q", m.Tier, m.SourcePath)
	}
	fi, err := os.Stat(m.Path)
	if err != nil {
		t.Fatal(err)
	}
	if perm := fi.Mode().Perm(); perm != 0o600 {
		t.Errorf("cached file mode %o, want 0600", perm)
	}
	di, _ := os.Stat(tier.Path)
	if perm := di.Mode().Perm(); perm != 0o700 {
		t.Errorf("tier directory mode %o, want 0700", perm)
	}
	if _, err := tier.Open("/data/b"); !errors.Is(err, ErrNotCached) {
		t.Errorf("open of uncached file: got %v, want ErrNotCached", err)
	}
	// Empty files are valid entries.
	publish(t, tier, "/data/empty", nil)
	if m, err := tier.Open("/data/empty"); err != nil || len(m.Bytes()) != 0 {
		t.Errorf("empty file: got %v, err %v", m, err)
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

// A copy opened to be sent comes open, with a mapping of that file made only when its bytes
// are asked for: the file and the mapping hold the same bytes, even once the copy is replaced
// in the tier; a mapping released unmade maps nothing, one that cannot be made says so at
// every Map; a damaged copy is a miss that is removed, as Open's.
func TestOpenToSendGivesTheFileAndMapsItWhenAsked(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	publish(t, tier, "/data/a", []byte("first bytes"))
	m, f, err := tier.OpenToSend("/data/a")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release()
	defer f.Close()
	if m.m != nil || m.Size != int64(len("first bytes")) {
		t.Errorf("opened to send: mapped %v, size %d; want unmapped, %d", m.m != nil, m.Size, len("first bytes"))
	}
	publish(t, tier, "/data/a", []byte("other bytes, longer"))
	got, err := io.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Map(); err != nil || string(got) != "first bytes" || string(m.Bytes()) != "first bytes" {
		t.Errorf("file %q, mapping %q (%v): want both %q", got, m.Bytes(), err, "first bytes")
	}
	unmade, f2, err := tier.OpenToSend("/data/a")
	if err != nil {
		t.Fatal(err)
	}
	unmade.Release()
	if err := unmade.Map(); err != nil || unmade.m != nil {
		t.Errorf("a mapping released before it was made: Map %v, mapped %v; want a no-op", err, unmade.m != nil)
	}
	f2.Close()
	failed, f3, err := tier.OpenToSend("/data/a")
	if err != nil {
		t.Fatal(err)
	}
	f3.Close() // the file it is to be mapped from, closed too early
	if first, again := failed.Map(), failed.Map(); first == nil || again == nil || failed.Bytes() != nil {
		t.Errorf("a mapping that cannot be made: Map %v, then %v, bytes %v; want an error each time and no bytes",
			first, again, failed.Bytes() != nil)
	}
	failed.Release()
	if _, _, err := tier.OpenToSend("/data/b"); !errors.Is(err, ErrNotCached) {
		t.Errorf("open of an uncached file: got %v, want ErrNotCached", err)
	}

	path := tier.CachedPath("/data/a")
	os.WriteFile(path, []byte("other"), 0o600) // truncated in place
	if _, _, err := tier.OpenToSend("/data/a"); !errors.Is(err, ErrDamaged) {
		t.Fatalf("damaged copy: got %v, want ErrDamaged", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("the damaged copy is still there: %v", err)
	}
}

func TestMappingSurvivesEvictionAndReleaseIsIdempotent(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	data := bytes.Repeat([]byte{7}, 100<<10)
	publish(t, tier, "/d/a", data)
	m, err := tier.Open("/d/a")
	if err != nil {
		t.Fatal(err)
	}
	if err := tier.MakeRoom(1<<20, "", nil); err != nil { // evicts everything
		t.Fatal(err)
	}
	if _, err := os.Stat(m.Path); !os.IsNotExist(err) {
		t.Fatalf("file still present after eviction: %v", err)
	}
	if !bytes.Equal(m.Bytes(), data) {
		t.Error("mapping changed after eviction")
	}
	for i := 0; i < 2; i++ {
		if err := m.Release(); err != nil {
			t.Fatalf("release %d: %v", i, err)
		}
	}
	if m.Bytes() != nil {
		t.Error("Bytes after Release is not nil")
	}
}

func TestBudgetAndFIFOEviction(t *testing.T) {
	src := func(i int) string { return fmt.Sprintf("/d/f%d", i) }
	one := EntrySize(src(0), 1000)
	tier := newTier(t, Memory, fmt.Sprint(3*one)) // room for exactly three files
	data := make([]byte, 1000)
	for i := 0; i < 3; i++ {
		publish(t, tier, src(i), data)
	}
	if err := tier.Publish(Entry{SourcePath: src(3), Size: 1000}, data); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("publish over budget: got %v, want ErrNoRoom", err)
	}
	var spilled []string
	if err := tier.MakeRoom(2*one, "", func(m *Mapping) {
		if !bytes.Equal(m.Bytes(), data) {
			t.Errorf("spilled %s with wrong bytes", m.SourcePath)
		}
		spilled = append(spilled, m.SourcePath)
	}); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{src(0), src(1)}, spilled); diff != "" {
		t.Errorf("evicted (-want +got):\n%s", diff)
	}
	publish(t, tier, src(3), data)
	publish(t, tier, src(4), data)
	if diff := cmp.Diff([]string{src(2), src(3), src(4)}, cached(t, tier, src(0), src(1), src(2), src(3), src(4))); diff != "" {
		t.Errorf("cached (-want +got):\n%s", diff)
	}
	if info := tier.Info(); info.Used != 3*one || info.Files != 3 || info.Used > info.Budget {
		t.Errorf("info %+v: want 3 files of %d bytes within budget", info, one)
	}
	if err := tier.MakeRoom(4*one, "", nil); !errors.Is(err, ErrNoRoom) {
		t.Errorf("MakeRoom over the whole budget: got %v, want ErrNoRoom", err)
	}
}

func TestRepublishReplacesAccounting(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	publish(t, tier, "/d/a", make([]byte, 100))
	publish(t, tier, "/d/a", make([]byte, 100))
	if info := tier.Info(); info.Files != 1 || info.Used != EntrySize("/d/a", 100) {
		t.Errorf("after republish: %+v", info)
	}
}

func TestRescanRebuildsUsageAndOrderAndRemovesTemps(t *testing.T) {
	dir := t.TempDir()
	tier, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 100)
	for i := 0; i < 3; i++ {
		// Modification times in the opposite order: rescan orders by publication, not by them.
		mt := time.Unix(1_000_000-int64(i), 0)
		if err := tier.Publish(Entry{SourcePath: fmt.Sprintf("/d/f%d", i), Size: 100, MTimeNanos: mt.UnixNano()}, data); err != nil {
			t.Fatal(err)
		}
	}
	// A crash while writing leaves temporary files behind.
	bin := filepath.Dir(tier.CachedPath("/d/f0"))
	leftovers := []string{filepath.Join(bin, tempPrefix+"123"), filepath.Join(dir, tempPrefix+"probe-1")}
	for _, p := range leftovers {
		if err := os.WriteFile(p, []byte("partial"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	before := tier.Info()
	tier.Close()

	again, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	after := again.Info()
	if after.Used != before.Used || after.Files != 3 {
		t.Errorf("after rescan %+v, before %+v", after, before)
	}
	for _, p := range leftovers {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("leftover %s not removed: %v", p, err)
		}
	}
	// FIFO order survives: making room for one file evicts the oldest.
	var evicted []string
	again.MakeRoom(again.budget-after.Used+1, "", func(m *Mapping) { evicted = append(evicted, m.SourcePath) })
	if diff := cmp.Diff([]string{"/d/f0"}, evicted); diff != "" {
		t.Errorf("evicted after rescan (-want +got):\n%s", diff)
	}

	again.Close()

	// A smaller budget at restart evicts the oldest files down to it.
	small, err := New(Config{Dir: dir, Kind: Disk, Budget: fmt.Sprint(EntrySize("/d/f0", 100))}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"/d/f2"}, cached(t, small, "/d/f0", "/d/f1", "/d/f2")); diff != "" {
		t.Errorf("cached after shrinking (-want +got):\n%s", diff)
	}
}

func TestDamagedAndCollidingEntriesAreMisses(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	publish(t, tier, "/d/a", []byte("0123456789"))
	path := tier.CachedPath("/d/a")

	// Truncation (a person or a broken disk did it; FitCache never does).
	b, _ := os.ReadFile(path)
	os.WriteFile(path, b[:len(b)-4], 0o600)
	if _, err := tier.Dir.Open("/d/a"); !errors.Is(err, ErrNotCached) || !errors.Is(err, ErrDamaged) {
		t.Fatalf("truncated entry: got %v, want ErrNotCached and ErrDamaged", err)
	}
	if _, err := tier.Open("/d/a"); !errors.Is(err, ErrDamaged) {
		t.Fatalf("truncated entry via Tier: got %v", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("Tier.Open left the damaged entry: %v", err)
	}
	if info := tier.Info(); info.Used != 0 || info.Files != 0 {
		t.Errorf("accounting after removing damaged entry: %+v", info)
	}

	// A file in the entry's place that is not the one published (replaced behind our back;
	// the file system may give it the same inode number, but not the same size here).
	publish(t, tier, "/d/a", []byte("0123456789"))
	os.Remove(path)
	os.WriteFile(path, []byte("012345678"), 0o600)
	if _, err := tier.Dir.Open("/d/a"); !errors.Is(err, ErrNotCached) {
		t.Errorf("replaced entry: got %v, want ErrNotCached", err)
	}

	// An entry for another source path with the same key (a hash collision): the index
	// keeps a second hash, so the other path misses.
	publish(t, tier, "/d/b", []byte("b"))
	tier.mu.Lock()
	s, ok := tier.ix.lookup(idOf("/d/b"))
	tier.mu.Unlock()
	if !ok {
		t.Fatal("/d/b not in the index")
	}
	if _, found := tier.ix.lookup(entryID{s.id.key, s.id.check ^ 1}); found {
		t.Error("lookup with the same key and another check hash found an entry")
	}
}

func TestProbeFirstHitWins(t *testing.T) {
	mem, disk := newTier(t, Memory, "1MiB"), newTier(t, Disk, "1MiB")
	publish(t, disk, "/d/only-disk", []byte("disk"))
	publish(t, mem, "/d/both", []byte("same"))
	publish(t, disk, "/d/both", []byte("same"))
	dirs := []Dir{mem.Dir, disk.Dir}
	for _, tc := range []struct {
		src  string
		want string
	}{{"/d/only-disk", "disk"}, {"/d/both", "same"}} {
		m, err := Probe(dirs, tc.src)
		if err != nil {
			t.Fatalf("probe %s: %v", tc.src, err)
		}
		if got := string(m.Bytes()); got != tc.want {
			t.Errorf("probe %s: got %q, want %q", tc.src, got, tc.want)
		}
		m.Release()
	}
	if _, err := Probe(dirs, "/d/none"); err != ErrNotCached {
		t.Errorf("probe miss: got %v, want ErrNotCached", err)
	}
	if _, err := Probe([]Dir(nil), "/d/none"); err != ErrNotCached {
		t.Errorf("probe without tiers: got %v, want ErrNotCached", err)
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in      string
		bytes   int64
		percent float64
	}{
		{"1048576", 1 << 20, 0}, {"512MiB", 512 << 20, 0}, {"64GiB", 64 << 30, 0},
		{"1.5 GB", 1_500_000_000, 0}, {"10k", 10 << 10, 0}, {"80%", 0, 80}, {" 12.5 % ", 0, 12.5},
	} {
		got, err := ParseSize(tc.in)
		if err != nil {
			t.Errorf("ParseSize(%q): %v", tc.in, err)
			continue
		}
		if got.Bytes != tc.bytes || got.Percent != tc.percent {
			t.Errorf("ParseSize(%q) = %+v, want bytes %d percent %v", tc.in, got, tc.bytes, tc.percent)
		}
	}
	for _, bad := range []string{"", "abc", "12XB", "0%", "101%", "-5", "%"} {
		if _, err := ParseSize(bad); err == nil {
			t.Errorf("ParseSize(%q) succeeded, want an error", bad)
		}
	}
	if got := (SizeOrPercent{Percent: 80}).Resolve(1000); got != 800 {
		t.Errorf("80%% of 1000 = %d, want 800", got)
	}
}

func TestNewRejectsUnusableDirectory(t *testing.T) {
	file := filepath.Join(t.TempDir(), "a-file")
	os.WriteFile(file, nil, 0o600)
	if _, err := New(Config{Dir: filepath.Join(file, "tier"), Kind: NVMe}, nil); err == nil {
		t.Error("New under a regular file succeeded")
	}
	if _, err := New(Config{Dir: filepath.Join(t.TempDir(), "not-mounted", "fitcache"), Kind: NVMe}, nil); err == nil {
		t.Error("New created a tier whose parent directory (a mount point) is missing")
	}
	deep := filepath.Join(t.TempDir(), "a", "b")
	if _, err := New(Config{Dir: deep, Kind: Disk, CreateParents: true}, nil); err != nil {
		t.Errorf("New with CreateParents: %v", err)
	}
	if _, err := New(Config{Dir: t.TempDir(), Kind: NVMe, Budget: "lots"}, nil); err == nil {
		t.Error("New with a bad budget succeeded")
	}
	tier, err := New(Config{Dir: t.TempDir(), Kind: NVMe}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if info := tier.Info(); info.Budget != int64(float64(info.Capacity)*0.8) {
		t.Errorf("default NVMe budget %d, want 80%% of %d", info.Budget, info.Capacity)
	}
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

func TestMakeRoomSparesTheGroupBeingRead(t *testing.T) {
	src := func(g string, i int) string { return fmt.Sprintf("/%s/f%d", g, i) }
	one := EntrySize(src("a", 0), 1000)
	tier := newTier(t, Memory, fmt.Sprint(4*one))
	data := make([]byte, 1000)
	put := func(g string, i int) error {
		return tier.Publish(Entry{SourcePath: src(g, i), Size: 1000, Group: "/" + g}, data)
	}
	for i, g := range []string{"old", "a", "old", "a"} {
		if err := put(g, i); err != nil {
			t.Fatal(err)
		}
	}
	var evicted []string
	spill := func(m *Mapping) { evicted = append(evicted, m.SourcePath) }
	// Room for a file of a: the files of old go first, oldest first, even though a's are older.
	if err := tier.MakeRoom(2*one, "/a", spill); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{src("old", 0), src("old", 2)}, evicted); diff != "" {
		t.Errorf("evicted (-want +got):\n%s", diff)
	}
	for i := 4; i < 6; i++ {
		if err := put("a", i); err != nil {
			t.Fatal(err)
		}
	}
	// Full of a: a file of a finds no room, a file of another group evicts a's oldest.
	if err := tier.MakeRoom(one, "/a", nil); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("MakeRoom for a's own file in a tier full of a: got %v, want ErrNoRoom", err)
	}
	evicted = nil
	if err := tier.MakeRoom(one, "/b", spill); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{src("a", 1)}, evicted); diff != "" {
		t.Errorf("evicted for b (-want +got):\n%s", diff)
	}
	// The group survives a restart (it is in the record).
	tier.Close()
	again, err := New(Config{Dir: tier.Path, Kind: Memory, Budget: fmt.Sprint(4 * one)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if err := again.MakeRoom(2*one, "/a", nil); !errors.Is(err, ErrNoRoom) {
		t.Errorf("after a restart, MakeRoom for a evicted a's files: %v", err)
	}
}

// Names that differ only in their last characters (f1, f2, ..., or zero-padded numbers)
// spread over the index's buckets: few buckets overflow, so few files are evicted for room in
// the index rather than in the budget.
func TestIndexBucketsSpreadSequentialNames(t *testing.T) {
	const n = 30000
	ix := &index{buckets: indexCeiling(n * 110 << 10)}
	for _, format := range []string{"/data/train/f%d", "/data/train/%08d", "/data/c%03d/img_%06d.jpg"} {
		counts := map[uint32]int{}
		for i := range n {
			var p string
			if strings.Count(format, "%") == 2 {
				p = fmt.Sprintf(format, i%1000, i)
			} else {
				p = fmt.Sprintf(format, i)
			}
			counts[ix.bucketOf(KeyOf(p))]++
		}
		over := 0
		for _, c := range counts {
			over += max(0, c-indexWays)
		}
		if over > n/1000 {
			t.Errorf("%s: %d of %d files over their bucket's %d slots (%d buckets), want at most %d",
				format, over, n, indexWays, ix.buckets, n/1000)
		}
	}
}

// A block's name is a source path of its own to every part of a tier, and its data file
// shows the block's number after a '#'; no real path (which has no NUL byte) shares it.
func TestBlockNamesAreEntriesOfTheirOwn(t *testing.T) {
	name := BlockName("/data/./train/big.h5", 4096, 12)
	if p, bb, n, ok := SplitBlockName(name); !ok || p != "/data/train/big.h5" || bb != 4096 || n != 12 {
		t.Fatalf("SplitBlockName(%q) = %q, %d, %d, %v", name, p, bb, n, ok)
	}
	if _, _, _, ok := SplitBlockName("/data/train/big.h5"); ok {
		t.Fatal("a path taken for a block")
	}
	if BlockName("/a", 4096, 3) == BlockName("/a", 8192, 3) {
		t.Fatal("blocks of two sizes share a name")
	}
	if rel := RelPath(name); !strings.HasSuffix(rel, "-big.h5#4096:12") || KeyOf(name) == KeyOf("/data/train/big.h5") {
		t.Fatalf("RelPath(block) = %q", rel)
	}
	tier, err := New(Config{Dir: t.TempDir(), Kind: Memory, Budget: "16MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	for n := int64(0); n < 2; n++ {
		e := Entry{SourcePath: BlockName("/data/train/big.h5", 4096, n), Size: 5, MTimeNanos: 1, Group: "/data"}
		if err := tier.Publish(e, []byte("block")); err != nil {
			t.Fatal(err)
		}
	}
	if err := tier.Publish(Entry{SourcePath: "/data/train/big.h5", Size: 4, MTimeNanos: 1, Group: "/data"}, []byte("file")); err != nil {
		t.Fatal(err)
	}
	tier.ForgetBlocks("/data/train/big.h5")
	if tier.Listed(BlockName("/data/train/big.h5", 4096, 0)) || tier.Listed(BlockName("/data/train/big.h5", 4096, 1)) {
		t.Error("ForgetBlocks left a block")
	}
	if !tier.Listed("/data/train/big.h5") {
		t.Error("ForgetBlocks removed the whole file's copy")
	}
}

// TestCopyIdentityIsTheRecordedSourceVersion: a reader of a mapped copy learns the version
// of the source it copies from the copy's record, change time and inode included (the index
// has its size and mtime only), and a copy replaced by another version gives the new one.
func TestCopyIdentityIsTheRecordedSourceVersion(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	d := readerOf(t, tier)
	for _, want := range []Identity{{Size: 5, MTimeNanos: 7, CTimeNanos: 11, Ino: 13},
		{Size: 5, MTimeNanos: 7, CTimeNanos: 12, Ino: 13}} { // rewritten in place, mtime put back
		e := Entry{SourcePath: "/d/f", Size: want.Size, MTimeNanos: want.MTimeNanos, SourceCTimeNanos: want.CTimeNanos,
			SourceIno: want.Ino}
		if err := tier.Publish(e, []byte("hello")); err != nil {
			t.Fatal(err)
		}
		m, err := Probe([]Dir{d}, "/d/f")
		if err != nil {
			t.Fatal(err)
		}
		got, err := CopyIdentity([]Dir{d}, m)
		m.Release()
		if err != nil || got != want {
			t.Errorf("CopyIdentity = %+v, %v; want %+v", got, err, want)
		}
	}
	if _, err := CopyIdentity(nil, &Mapping{Path: "/elsewhere/x"}); !errors.Is(err, ErrNotCached) {
		t.Errorf("a copy of no tier given: got %v, want ErrNotCached", err)
	}
}

// TestAReaderOfAnIndexTruncatedUnderItMisses: another process of the user truncates the
// index a reader has mapped (to its header page, then to nothing): the reader's lookups and
// counters read no page past the end (SIGBUS, a crash of the program) but miss.
func TestAReaderOfAnIndexTruncatedUnderItMisses(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	publish(t, tier, "/d/f", []byte("hello"))
	d := readerOf(t, tier)
	if !Listed([]Dir{d}, "/d/f") {
		t.Fatal("not listed before the truncation")
	}
	for _, size := range []int64{4096, 0} {
		if err := os.Truncate(filepath.Join(tier.Path, indexName), size); err != nil {
			t.Fatal(err)
		}
		if Listed([]Dir{d}, "/d/f") {
			t.Errorf("index truncated to %d bytes: listed, want a miss", size)
		}
		if m, err := d.Open("/d/f"); !errors.Is(err, ErrNotCached) {
			t.Errorf("index truncated to %d bytes: Open = %v, %v; want ErrNotCached", size, m, err)
		}
		d.view.hits()
	}
}

// TestCopyAtFromACopyTruncatedUnderItFails: a cached file truncated in place by another
// process of the user while a reader has it mapped: CopyAt fails with ErrNotCached instead
// of the SIGBUS that would crash the program.
func TestCopyAtFromACopyTruncatedUnderItFails(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	data := make([]byte, 3*4096)
	for i := range data {
		data[i] = byte(i)
	}
	publish(t, tier, "/d/f", data)
	m, err := tier.Open("/d/f")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release()
	p := make([]byte, 100)
	if n, err := m.CopyAt(p, 8192); n != 100 || err != nil || p[0] != data[8192] {
		t.Fatalf("CopyAt = %d, %v; want 100 bytes of the data", n, err)
	}
	if err := os.Truncate(m.Path, 0); err != nil {
		t.Fatal(err)
	}
	if n, err := m.CopyAt(p, 8192); !errors.Is(err, ErrNotCached) {
		t.Errorf("CopyAt of a truncated copy = %d, %v; want ErrNotCached", n, err)
	}
}
