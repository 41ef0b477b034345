package tiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

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
