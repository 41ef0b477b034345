package tiers

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

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
