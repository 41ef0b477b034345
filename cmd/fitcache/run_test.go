package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestDatasetRootsResolveLinksAndRefuseWhatTheShimCannotTake(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	os.Mkdir(data, 0o755)
	os.WriteFile(filepath.Join(dir, "file"), nil, 0o600)
	os.Mkdir(filepath.Join(dir, "a:b"), 0o755)
	link := filepath.Join(dir, "link")
	if err := os.Symlink(data, link); err != nil {
		t.Fatal(err)
	}
	// t.TempDir may itself lie behind a link (/tmp on some systems): compare with its real path.
	realData, _ := filepath.EvalSymlinks(data)
	got, err := datasetRoots([]string{data, link})
	if err != nil {
		t.Fatal(err)
	}
	want := []datasetRoot{{name: data, real: realData}, {name: link, real: realData}}
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(datasetRoot{})); diff != "" {
		t.Errorf("roots (-want +got):\n%s", diff)
	}
	for _, tc := range []struct{ dir, want string }{
		{filepath.Join(dir, "missing"), "no such file"},
		{filepath.Join(dir, "file"), "not a directory"},
		{filepath.Join(dir, "a:b"), "':' or '='"},
		{"/", "whole file system"},
	} {
		if _, err := datasetRoots([]string{tc.dir}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an error with %q", tc.dir, err, tc.want)
		}
	}
}

func TestPreloadEnvironPutsTheShimFirstAndReplacesAnEarlierRun(t *testing.T) {
	env := []string{
		"HOME=/home/u",
		"LD_PRELOAD=/opt/old/libfitcache_preload.so /opt/darshan/libdarshan.so",
		"FITCACHE_PRELOAD_ROOTS=/old",
		"FITCACHE_TIERS=memory:/dev/shm/x",
	}
	roots := []datasetRoot{{name: "/data/in", real: "/data/in"}, {name: "/link", real: "/lustre/set"}}
	server := companionReport{TierDirs: []string{"/dev/shm/t1", "/var/t2"}, Sessions: []uint32{70000001, 70000002},
		NodeSocket: "/run/s.sock.node", BlockBytes: 4 << 20, HeatFile: "/run/user/1000/fitcache/preload.heat"}
	got := preloadEnviron(env, "/pkg/libfitcache_preload.so", roots, server, 30*time.Second)
	want := []string{
		"HOME=/home/u",
		"FITCACHE_TIERS=memory:/dev/shm/x",
		"LD_PRELOAD=/pkg/libfitcache_preload.so /opt/darshan/libdarshan.so",
		"FITCACHE_PRELOAD_ROOTS=/data/in:/link=/lustre/set",
		"FITCACHE_PRELOAD_TIERS=/dev/shm/t1:/var/t2",
		"FITCACHE_PRELOAD_SESSIONS=70000001:70000002",
		"FITCACHE_PRELOAD_SOCKET=/run/s.sock.node",
		"FITCACHE_PRELOAD_TIMEOUT_MS=30000",
		"FITCACHE_PRELOAD_BLOCK_BYTES=4194304",
		"FITCACHE_PRELOAD_HEAT=/run/user/1000/fitcache/preload.heat",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("environment (-want +got):\n%s", diff)
	}
}

func TestPreloadLibraryHonoursTheEnvironment(t *testing.T) {
	lib := filepath.Join(t.TempDir(), "libfitcache_preload.so")
	os.WriteFile(lib, nil, 0o644)
	t.Setenv("FITCACHE_PRELOAD_LIB", lib)
	if got, err := preloadLibrary(); err != nil || got != lib {
		t.Errorf("got %q, %v; want %q", got, err, lib)
	}
	t.Setenv("FITCACHE_PRELOAD_LIB", lib+".missing")
	if _, err := preloadLibrary(); err == nil {
		t.Error("a missing FITCACHE_PRELOAD_LIB was accepted")
	}
}

// The files `fitcache run` prefetches: --prefetch-only and --prefetch-exclude patterns match a
// file's name, or with a '/' its path under the data directory or a directory it is under.
func TestDatasetFilesTakesWhatThePrefetchPatternsSay(t *testing.T) {
	root := t.TempDir()
	all := []string{"a.tfrecord", "a.tfrecord.idx", "train/b.tfrecord", "train/b.tfrecord.idx",
		"train/deep/c.tfrecord", "val/d.tfrecord", "val/notes.txt"}
	for _, rel := range all {
		p := filepath.Join(root, rel)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name          string
		only, exclude []string
		want          []string
	}{
		{"no pattern: every file", nil, nil, all},
		{"exclude by name", nil, []string{"*.idx"},
			[]string{"a.tfrecord", "train/b.tfrecord", "train/deep/c.tfrecord", "val/d.tfrecord", "val/notes.txt"}},
		{"only by name", []string{"*.tfrecord"}, nil,
			[]string{"a.tfrecord", "train/b.tfrecord", "train/deep/c.tfrecord", "val/d.tfrecord"}},
		{"only a directory, by path", []string{"train/*"}, nil,
			[]string{"train/b.tfrecord", "train/b.tfrecord.idx", "train/deep/c.tfrecord"}},
		{"a directory by name with a slash", nil, []string{"val/", "*.idx"},
			[]string{"a.tfrecord", "train/b.tfrecord", "train/deep/c.tfrecord"}},
		{"exclude wins over only", []string{"*.tfrecord", "*.txt"}, []string{"train/deep"},
			[]string{"a.tfrecord", "train/b.tfrecord", "val/d.tfrecord", "val/notes.txt"}},
	} {
		f := prefetchFilter{only: tc.only, exclude: tc.exclude}
		if err := f.check(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		got, err := datasetFiles(root, f)
		if err != nil {
			t.Fatal(err)
		}
		var want []string
		for _, rel := range tc.want {
			want = append(want, filepath.Join(root, rel))
		}
		slices.Sort(want)
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("%s (-want +got):\n%s", tc.name, diff)
		}
	}
	for _, bad := range []string{"[a-", ""} {
		if err := (prefetchFilter{exclude: []string{bad}}).check(); err == nil {
			t.Errorf("pattern %q was accepted", bad)
		}
	}
}
