package main

import (
	"os"
	"path/filepath"
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
