package tiers

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// publishIn publishes src with n bytes as a file of group.
func publishIn(t *testing.T, tier *Tier, group, src string, n int) {
	t.Helper()
	data := make([]byte, n)
	if err := tier.Publish(Entry{SourcePath: src, Size: int64(n), MTimeNanos: 1, Group: group}, data); err != nil {
		t.Fatalf("publish %s: %v", src, err)
	}
}

func TestUsageAndClearByGroup(t *testing.T) {
	tier := newTier(t, Disk, "1MiB")
	publishIn(t, tier, "/a", "/a/1", 100)
	publishIn(t, tier, "/a", "/a/2", 5000)
	publishIn(t, tier, "/b", "/b/1", 10)
	sizeA := EntrySize("/a/1", 100) + EntrySize("/a/2", 5000)
	sizeB := EntrySize("/b/1", 10)
	want := []Usage{{Group: "/a", Files: 2, Bytes: sizeA}, {Group: "/b", Files: 1, Bytes: sizeB}}
	if diff := cmp.Diff(want, tier.Usage()); diff != "" {
		t.Errorf("Usage (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(want, mustDirUsage(t, tier.Dir)); diff != "" {
		t.Errorf("Dir.Usage (-want +got):\n%s", diff)
	}

	isA := func(g string) bool { return g == "/a" }
	if diff := cmp.Diff(want[:1], tier.Clear(isA, true)); diff != "" {
		t.Errorf("Clear dry run (-want +got):\n%s", diff)
	}
	if got := cached(t, tier, "/a/1", "/a/2", "/b/1"); len(got) != 3 {
		t.Errorf("after a dry run cached %v, want all 3", got)
	}
	if got := tier.Info().Used; got != sizeA+sizeB {
		t.Errorf("after a dry run used %d, want %d", got, sizeA+sizeB)
	}

	if diff := cmp.Diff(want[:1], tier.Clear(isA, false)); diff != "" {
		t.Errorf("Clear (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"/b/1"}, cached(t, tier, "/a/1", "/a/2", "/b/1")); diff != "" {
		t.Errorf("cached after Clear (-want +got):\n%s", diff)
	}
	if info := tier.Info(); info.Used != sizeB || info.Files != 1 {
		t.Errorf("after Clear used %d in %d files, want %d in 1", info.Used, info.Files, sizeB)
	}
	for _, src := range []string{"/a/1", "/a/2"} {
		p := tier.CachedPath(src)
		for _, f := range []string{p, filepath.Join(filepath.Dir(p), recordPrefix+filepath.Base(p))} {
			if _, err := os.Lstat(f); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("%s of a cleared entry: got %v, want it gone", f, err)
			}
		}
	}
	if diff := cmp.Diff(want[1:], mustDirUsage(t, tier.Dir)); diff != "" {
		t.Errorf("Dir.Usage after Clear (-want +got):\n%s", diff)
	}

	// Clearing everything, and the tier takes new files again.
	if diff := cmp.Diff(want[1:], tier.Clear(nil, false)); diff != "" {
		t.Errorf("Clear all (-want +got):\n%s", diff)
	}
	if info := tier.Info(); info.Used != 0 || info.Files != 0 {
		t.Errorf("after clearing all: used %d in %d files, want nothing", info.Used, info.Files)
	}
	if got := tier.Clear(nil, false); len(got) != 0 {
		t.Errorf("clearing an empty tier removed %v", got)
	}
	publishIn(t, tier, "/a", "/a/1", 100)
	if got := cached(t, tier, "/a/1"); len(got) != 1 {
		t.Error("a cleared file cannot be cached again")
	}
}

func TestExistingDoesNotCreate(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tier")
	if _, err := Existing(Config{Dir: dir, Kind: Disk}); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Existing of a missing directory: got %v, want fs.ErrNotExist", err)
	}
	if _, err := (Dir{Path: dir}).Usage(); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Usage of a missing directory: got %v, want fs.ErrNotExist", err)
	}
}

func mustDirUsage(t *testing.T, d Dir) []Usage {
	t.Helper()
	u, err := Dir{Path: d.Path, Kind: d.Kind}.Usage()
	if err != nil {
		t.Fatal(err)
	}
	return u
}
