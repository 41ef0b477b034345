package tiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/fitcache/fitcache/privdir"
	"github.com/fitcache/fitcache/privdir/privdirtest"
)

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
