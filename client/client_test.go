package client

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// startServer runs an engine and its RPC server in this process, on the embedded socket of
// a new runtime directory, and returns a config pointing clients at it and a stop function.
func startServer(t testing.TB) (config.Config, func()) {
	t.Helper()
	return startServerWithBudget(t, "64MiB")
}

func startServerWithBudget(t testing.TB, budget string) (config.Config, func()) {
	t.Helper()
	return startServerWithTier(t, t.TempDir(), budget)
}

// startServerWithTier is startServer with its memory tier in dir.
func startServerWithTier(t testing.TB, dir, budget string) (config.Config, func()) {
	t.Helper()
	cfg, err := config.Load(map[string]string{
		"runtime_dir": t.TempDir(), "tiers": "memory:" + dir + ":" + budget, "start_timeout": "1",
	})
	if err != nil {
		t.Fatal(err)
	}
	tierCfgs, _ := cfg.TierConfigs()
	e, err := core.NewEngine(core.EngineConfig{Tiers: tierCfgs}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := rpc.ListenUnix(embedded.SocketPath(cfg.RuntimeDir))
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
