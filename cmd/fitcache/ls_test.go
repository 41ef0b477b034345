package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/server"
	"github.com/fitcache/fitcache/tiers"
)

// With FITCACHE_SERVERS set, `fitcache ls` lists what the job's servers hold, each server's
// tiers, and names a server that does not answer; not the local embedded cache (its tier
// here holds a file of its own, which must not show). `fitcache clear` clears the job's.
func TestLsListsTheJobsServers(t *testing.T) {
	dir := t.TempDir()
	root := filepath.Join(dir, "data")
	os.Mkdir(root, 0o755)
	for i := range 5 {
		os.WriteFile(filepath.Join(root, fmt.Sprintf("f%d", i)), []byte(strings.Repeat("x", 1000+i)), 0o644)
	}
	// The job's two servers, each having read some of the files into its tier.
	var addrs []string
	for i, names := range [][]string{{"f0", "f1", "f2"}, {"f3", "f4"}} {
		s, err := server.Start(server.Config{Listen: "127.0.0.1:0", Token: "job-token", Roots: []string{root},
			RuntimeDir: filepath.Join(dir, fmt.Sprint("run", i)),
			Tiers:      []tiers.Config{{Kind: tiers.Memory, Dir: filepath.Join(dir, fmt.Sprint("tier", i)), Budget: "64MiB"}}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		addrs = append(addrs, s.Addr())
		cacheFiles(t, s.Addr(), root, names)
	}
	// The embedded cache of this node, which ls listed before.
	local := filepath.Join(dir, "local")
	emb, err := server.Start(server.Config{Embedded: true, RuntimeDir: filepath.Join(dir, "localrun"),
		Tiers: []tiers.Config{{Kind: tiers.Memory, Dir: local, Budget: "64MiB"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer emb.Close()
	if _, err := emb.Engine().Read(context.Background(), root, filepath.Join(root, "f0"), false); err != nil {
		t.Fatal(err)
	}

	env := []string{"FITCACHE_SERVERS=" + strings.Join(append(addrs, "127.0.0.1:1"), ","), "FITCACHE_TOKEN=job-token",
		"FITCACHE_RUNTIME_DIR=" + filepath.Join(dir, "localrun"), "FITCACHE_TIERS=memory:" + local}
	out, err := fitcacheCommand(t, env, "ls", "--json")
	if err != nil {
		t.Fatalf("fitcache ls --json: %v\n%s", err, out)
	}
	var got struct {
		Servers map[string][]core.CacheUsage `json:"servers"`
		Down    map[string]string            `json:"unreachable"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("fitcache ls --json printed no listing of the job's servers: %v\n%s", err, out)
	}
	for i, want := range []int{3, 2} {
		us := got.Servers[addrs[i]]
		if len(us) != 1 || us[0].Root != root || us[0].Files != want || us[0].Dir != filepath.Join(dir, fmt.Sprint("tier", i)) {
			t.Errorf("server %s: got %+v, want %d files of %s in its tier", addrs[i], us, want, root)
		}
	}
	if _, ok := got.Down["127.0.0.1:1"]; !ok || len(got.Servers) != 2 {
		t.Errorf("got servers %v and unreachable %v, want the two servers and 127.0.0.1:1 unreachable", got.Servers, got.Down)
	}
	out, err = fitcacheCommand(t, env, "ls")
	if err != nil || !strings.Contains(out, "server "+addrs[0]) || !strings.Contains(out, "job total: 5 files") ||
		strings.Contains(out, local) {
		t.Errorf("fitcache ls: %v\n%s", err, out)
	}
	// clear too: a dry run changes nothing, then every server of the job lets go of the
	// dataset's files, and the embedded cache keeps its own.
	out, err = fitcacheCommand(t, env, "clear", "--dry-run", root)
	if err != nil || !strings.Contains(out, "job total would clear (dry run): 5 files") {
		t.Errorf("fitcache clear --dry-run: %v\n%s", err, out)
	}
	out, err = fitcacheCommand(t, env, "clear", root)
	if err != nil || !strings.Contains(out, "job total cleared: 5 files") {
		t.Errorf("fitcache clear: %v\n%s", err, out)
	}
	for _, addr := range addrs {
		if us, err := askServer(addr, "job-token", func(c *rpc.Client) ([]core.CacheUsage, error) {
			return c.Usage(context.Background())
		}); err != nil || len(us) != 0 {
			t.Errorf("server %s after fitcache clear: holds %+v (%v), want nothing", addr, us, err)
		}
	}
	if us := emb.Engine().Usage(); len(us) != 1 || us[0].Files != 1 {
		t.Errorf("the embedded cache after a clear of the job: %+v, want its one file kept", us)
	}
	// No server answers: an error, not the local cache.
	env[0] = "FITCACHE_SERVERS=127.0.0.1:1"
	for _, cmd := range [][]string{{"ls"}, {"clear", "--all"}} {
		if out, err := fitcacheCommand(t, env, cmd...); err == nil || !strings.Contains(out, "no server of the job") {
			t.Errorf("fitcache %s with no server up: %v\n%s", cmd[0], err, out)
		}
	}
}

// cacheFiles reads names under root through the server at addr and waits until its tiers
// hold them.
func cacheFiles(t *testing.T, addr, root string, names []string) {
	t.Helper()
	c, err := rpc.Dial(addr, rpc.ClientConfig{Token: "job-token"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, n := range names {
		if _, err := c.Read(context.Background(), root, filepath.Join(root, n), false); err != nil {
			t.Fatal(err)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		us, err := c.Usage(context.Background())
		if err == nil && len(us) == 1 && us[0].Files == len(names) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("server %s: its tiers hold %+v (%v), want %d files", addr, us, err, len(names))
		}
	}
}
