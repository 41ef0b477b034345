package client

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/local"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// startServer runs an engine and its RPC server in this process, on the embedded socket of
// a new runtime directory, and returns a config pointing clients at it and a stop function.
func startServer(t testing.TB) (core.Config, func()) { return startServerWithBudget(t, "64MiB") }

func startServerWithBudget(t testing.TB, budget string) (core.Config, func()) {
	t.Helper()
	return startServerWithTier(t, t.TempDir(), budget)
}

// startServerWithTier is startServer with its memory tier in dir.
func startServerWithTier(t testing.TB, dir, budget string) (core.Config, func()) {
	t.Helper()
	cfg, err := core.LoadConfig(map[string]string{
		"runtime_dir": t.TempDir(), "tiers": "memory:" + dir + ":" + budget, "start_timeout": "1",
	})
	if err != nil {
		t.Fatal(err)
	}
	tierCfgs, _ := cfg.TierConfigs()
	e, err := core.NewEngine(core.EngineConfig{Tiers: tierCfgs,
		GenerationFile: local.SocketPath(cfg.RuntimeDir) + ".gen"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := rpc.ListenUnix(local.SocketPath(cfg.RuntimeDir))
	if err != nil {
		t.Fatal(err)
	}
	srv, _, _ := rpc.Serve(e, ln, rpc.ServerConfig{})
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			srv.Stop()
			e.Close()
		}
	}
	t.Cleanup(stop)
	cfg.ServerBin = "/nonexistent/fitcache" // a dead server cannot be restarted here
	return cfg, stop
}

func writeFile(t *testing.T, dir, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func readBytes(t *testing.T, c *Client, path string) []byte {
	t.Helper()
	buf, err := c.Read(path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	defer buf.Release()
	return bytes.Clone(buf.Bytes())
}

// waitCached waits until the server has published path (a miss is answered before the data
// mover publishes small files).
func waitCached(t *testing.T, c *Client, path string) {
	t.Helper()
	abs, _ := c.Resolve(path)
	waitFor(t, func() bool {
		m, err := tiers.Probe(c.localDirs(), abs)
		if err == nil {
			m.Release()
		}
		return err == nil
	})
}

func clientStats(t *testing.T, c *Client) (ClientStats, core.StatsSnapshot) {
	t.Helper()
	js, err := c.Stats()
	if err != nil {
		t.Fatal(err)
	}
	var out struct {
		Client ClientStats        `json:"client"`
		Server core.StatsSnapshot `json:"server"`
	}
	if err := json.Unmarshal([]byte(js), &out); err != nil {
		t.Fatal(err)
	}
	return out.Client, out.Server
}

func TestReadsMissThenMapLocally(t *testing.T) {
	cfg, _ := startServer(t)
	root := t.TempDir()
	want := bytes.Repeat([]byte("fitcache"), 40000)
	writeFile(t, root, "a.bin", want)
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := 0; i < 3; i++ {
		if got := readBytes(t, c, "a.bin"); !bytes.Equal(got, want) {
			t.Fatalf("read %d: wrong bytes", i)
		}
		if i == 0 {
			waitCached(t, c, "a.bin")
		}
	}
	buf, _ := c.Read("a.bin")
	if !IsMapped(buf) {
		t.Errorf("cached read returned %T, want a mapping (zero copy)", buf)
	}
	buf.Release()
	cs, ss := clientStats(t, c)
	if cs.ServerReads != 1 || cs.LocalHits != 3 || ss.SourceReads != 1 {
		t.Errorf("client %+v, server source reads %d: want 1 server read, 3 local hits, 1 source read", cs, ss.SourceReads)
	}
	if ss.ClientHits != 3 || ss.Hits["memory"] != 3 {
		t.Errorf("server did not receive the client's hit report: %+v", ss)
	}
	p := make([]byte, 5)
	if n, err := c.ReadAt("a.bin", p, 8); err != nil || n != 5 || string(p) != "fitca" {
		t.Errorf("ReadAt = %d %q %v", n, p, err)
	}
	if n, err := c.Size("a.bin"); err != nil || n != int64(len(want)) {
		t.Errorf("Size = %d, %v", n, err)
	}
}

func TestDeadServerFallsBackToSource(t *testing.T) {
	cfg, stop := startServer(t)
	root := t.TempDir()
	writeFile(t, root, "a.bin", []byte("first"))
	writeFile(t, root, "b.bin", []byte("second"))
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	readBytes(t, c, "a.bin")
	stop()
	start := time.Now()
	for _, tc := range []struct{ name, want string }{{"a.bin", "first"}, {"b.bin", "second"}, {"b.bin", "second"}} {
		if got := readBytes(t, c, tc.name); string(got) != tc.want {
			t.Errorf("%s after server death: got %q, want %q", tc.name, got, tc.want)
		}
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("reads after server death took %s", d)
	}
	cs, _ := clientStats(t, c)
	if cs.DirectReads < 1 {
		t.Errorf("no direct reads after the server died: %+v", cs)
	}
	if _, err := c.Read("missing.bin"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file with a dead server: got %v, want ErrNotExist", err)
	}
}

func TestOpenAndPathErrors(t *testing.T) {
	cfg, _ := startServer(t)
	root := t.TempDir()
	if _, err := Open(filepath.Join(root, "missing"), cfg, nil); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing root: got %v", err)
	}
	file := writeFile(t, root, "f", []byte("x"))
	if _, err := Open(file, cfg, nil); core.Errno(err) != 20 { // ENOTDIR
		t.Errorf("root is a file: got %v", err)
	}
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read("../etc/passwd"); !errors.Is(err, core.ErrOutsideRoot) {
		t.Errorf("escape: got %v, want ErrOutsideRoot", err)
	}
	os.Symlink("/etc/passwd", filepath.Join(root, "link"))
	if _, err := c.Size("link"); !errors.Is(err, core.ErrOutsideRoot) {
		t.Errorf("size through a symbolic link out of the root: got %v, want ErrOutsideRoot", err)
	}
	if _, err := c.Read("link"); !errors.Is(err, core.ErrOutsideRoot) {
		t.Errorf("read through a symbolic link out of the root: got %v, want ErrOutsideRoot", err)
	}
	c.Close()
	c.Close()
	if _, err := c.Read("f"); !errors.Is(err, core.ErrClosed) {
		t.Errorf("read after close: got %v, want ErrClosed", err)
	}
}

func TestMappingsAreKeptUntilTheServerRemovesFiles(t *testing.T) {
	one := tiers.EntrySize("/x/f0", 100_000)
	cfg, _ := startServerWithBudget(t, fmt.Sprint(3*one+3*100)) // three files fit
	root := t.TempDir()
	for i := 0; i < 4; i++ {
		writeFile(t, root, fmt.Sprintf("f%d", i), bytes.Repeat([]byte{byte(i)}, 100_000))
	}
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	readBytes(t, c, "f0") // a miss: the server sends small files' bytes and caches them
	waitCached(t, c, "f0")
	first, err := c.Read("f0")
	if err != nil {
		t.Fatal(err)
	}
	again, _ := c.Read("f0")
	if &first.Bytes()[0] != &again.Bytes()[0] {
		t.Error("a second read of a cached file mapped it again instead of reusing the mapping")
	}
	if !IsMapped(first) {
		t.Errorf("a read of a cached file returned %T, want a mapping", first)
	}
	first.Release()
	again.Release()
	if c.maps.fifo.Len() != 1 {
		t.Fatalf("kept mappings: %d, want 1", c.maps.fifo.Len())
	}
	for _, name := range []string{"f1", "f2", "f3"} { // f3 evicts f0 on the server
		readBytes(t, c, name)
		waitCached(t, c, name)
	}
	waitFor(t, func() bool { return c.generation() > 0 })
	if got := readBytes(t, c, "f1"); got[0] != 1 {
		t.Fatalf("f1: wrong bytes")
	}
	for _, name := range []string{"f0", "f2"} {
		if _, kept := c.maps.byPath[filepath.Join(root, name)]; kept {
			t.Errorf("after an eviction the cache still keeps %s", name)
		}
	}
	if got := readBytes(t, c, "f0"); got[0] != 0 || len(got) != 100_000 {
		t.Errorf("evicted file read back wrong")
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestMapCacheBoundAndHandles(t *testing.T) {
	dir := t.TempDir()
	tier, err := tiers.New(tiers.Config{Dir: dir, Kind: tiers.Memory, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := newMapCache(2)
	var handles []Buffer
	for i := 0; i < 3; i++ {
		src := fmt.Sprintf("/d/f%d", i)
		tier.Publish(tiers.Entry{SourcePath: src, Size: 3}, []byte{byte(i), 1, 2})
		m, err := tier.Open(src)
		if err != nil {
			t.Fatal(err)
		}
		handles = append(handles, c.put(src, m, 0))
	}
	if c.fifo.Len() != 2 || c.get("/d/f0", 0) != nil {
		t.Errorf("cache of 2 holds %d mappings; f0 kept: %v", c.fifo.Len(), c.get("/d/f0", 0) != nil)
	}
	if handles[0].Bytes()[0] != 0 {
		t.Error("a handle lost its mapping when the cache dropped it")
	}
	for _, h := range handles {
		h.Release()
		h.Release() // idempotent
	}
	if c.get("/d/f2", 1) != nil || c.fifo.Len() != 0 {
		t.Error("a new generation did not empty the cache")
	}
}
