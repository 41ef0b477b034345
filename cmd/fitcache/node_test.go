package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/nodetiers"
	"github.com/fitcache/fitcache/privdir/privdirtest"
	"golang.org/x/sys/unix"
)

// ls --node and clear --node, through the command: a tier held by a live server (this
// process holds its lock) is listed as live and kept; one left behind is listed, kept by a
// dry run and removed by clear; a link named like a tier is never followed.
func TestNodeTiersThroughTheCommand(t *testing.T) {
	dir, outside := t.TempDir(), t.TempDir()
	for name, size := range map[string]int{"fitcache-1000/fitcache.lock": 0, "fitcache-1000/ab/data": 30000,
		"fitcache-1001/fitcache.lock": 0, "fitcache-1001/data": 100, filepath.Join(outside, "keep"): 1} {
		path := name
		if !filepath.IsAbs(path) {
			path = filepath.Join(dir, name)
		}
		os.MkdirAll(filepath.Dir(path), 0o700)
		if err := os.WriteFile(path, make([]byte, size), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(outside, filepath.Join(dir, "fitcache-evil")); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, "fitcache-1001", "fitcache.lock"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	unix.Flock(int(lock.Fd()), unix.LOCK_EX)
	lock.WriteString("pid 777, test server\n")

	out, err := fitcacheCommand(t, nil, "ls", "--node", "--dir", dir, "--json")
	var ls struct{ Tiers []nodetiers.Tier }
	if err != nil || json.Unmarshal([]byte(out), &ls) != nil || len(ls.Tiers) != 2 ||
		ls.Tiers[0].Held || ls.Tiers[0].Files != 1 || !ls.Tiers[1].Held || ls.Tiers[1].HolderPID != 777 {
		t.Fatalf("fitcache ls --node --json: got %+v (%v), want fitcache-1000 left behind and fitcache-1001 held\n%s", ls, err, out)
	}
	out, err = fitcacheCommand(t, nil, "ls", "--node", "--dir", dir)
	if err != nil || !strings.Contains(out, "live, pid 777") || !strings.Contains(out, "none (left behind)") ||
		!strings.Contains(out, "total: 2 directories, 2 files") {
		t.Errorf("fitcache ls --node: %v\n%s", err, out)
	}

	out, err = fitcacheCommand(t, nil, "clear", "--node", "--dir", dir, "--dry-run", "--json")
	var cl struct {
		DryRun  bool `json:"dry_run"`
		Results []nodetiers.Result
	}
	if err != nil || json.Unmarshal([]byte(out), &cl) != nil || !cl.DryRun || len(cl.Results) != 2 ||
		cl.Results[0].Action != nodetiers.WouldRemove || cl.Results[1].Action != nodetiers.Skipped {
		t.Errorf("fitcache clear --node --dry-run --json: got %+v (%v)\n%s", cl, err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "fitcache-1000", "ab", "data")); err != nil {
		t.Errorf("the dry run removed something: %v", err)
	}

	out, err = fitcacheCommand(t, nil, "clear", "--node", "--dir", dir)
	if err != nil || !strings.Contains(out, "removed 1 directories, 1 files") || !strings.Contains(out, "held by a live fitcache server: pid 777") {
		t.Errorf("fitcache clear --node: %v\n%s", err, out)
	}
	for path, want := range map[string]bool{"fitcache-1000": false, "fitcache-1001/data": true, "fitcache-evil": true,
		filepath.Join(outside, "keep"): true} {
		if !filepath.IsAbs(path) {
			path = filepath.Join(dir, path)
		}
		if _, err := os.Lstat(path); (err == nil) != want {
			t.Errorf("%s exists after clear --node: got %v, want %v", path, err == nil, want)
		}
	}
}

// As a user other than root, clear --node --user of another user is refused with a clear
// error, and the other user's tier stays.
func TestClearNodeRefusesAnotherUsersTiers(t *testing.T) {
	if dir, ok := privdirtest.Victim(); ok { // the rerun, as nobody
		out, err := fitcacheCommand(t, nil, "clear", "--node", "--dir", dir, "--user", "root")
		if err == nil || !strings.Contains(out, "only root may clear another user's tiers") {
			t.Errorf("clear --node --user root as nobody: %v\n%s", err, out)
		}
		return
	}
	shared := privdirtest.SharedDir(t)
	tier := filepath.Join(shared, "fitcache-0")
	os.Mkdir(tier, 0o700)
	os.WriteFile(filepath.Join(tier, "fitcache.lock"), nil, 0o600)
	privdirtest.RunAsNobody(t, shared)
	if _, err := os.Stat(filepath.Join(tier, "fitcache.lock")); err != nil {
		t.Errorf("root's tier after nobody's clear: %v", err)
	}
}
