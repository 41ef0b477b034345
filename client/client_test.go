package client

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
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

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc")
	}
	return len(ents)
}

func mappedIndexes(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skip("no /proc")
	}
	return strings.Count(string(b), "fitcache.index")
}

// Opening and closing clients leaks neither sockets nor mappings (of the tiers' indexes, which
// each client maps). Each cycle once leaked a socket and a mapping (EMFILE after 259 cycles
// under ulimit -n 128).
func TestOpenCloseLeaksNothing(t *testing.T) {
	cfg, _ := startServer(t)
	root := t.TempDir()
	writeFile(t, root, "a", []byte("a"))
	cycle := func() {
		c, err := Open(root, cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		readBytes(t, c, "a")
		c.Close()
	}
	cycle() // warm up what Kitex keeps per process
	runtime.GC()
	fds, indexes := openFDs(t), mappedIndexes(t)
	for range 300 {
		cycle()
	}
	// The server in this process closes its ends of the connections asynchronously.
	deadline := time.Now().Add(5 * time.Second)
	for openFDs(t) > fds+5 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := openFDs(t); got > fds+5 {
		t.Errorf("open descriptors: %d before 300 open/close cycles, %d after", fds, got)
	}
	if got := mappedIndexes(t); got > indexes {
		t.Errorf("mappings of the tiers' indexes: %d before 300 open/close cycles, %d after", indexes, got)
	}
}

// A file too large for the tiers is mapped from the source, never copied into memory, both
// when the server says so and when the client reads the source without a server. On the main
// branch before this change the server read a 10 GiB file into memory (and was OOM-killed),
// and so did the client's direct read.
func TestLargeFilesAreMappedNotCopied(t *testing.T) {
	cfg, stop := startServerWithBudget(t, "64MiB")
	root := t.TempDir()
	huge := filepath.Join(root, "huge.bin")
	f, err := os.Create(huge)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(10 << 30)
	f.WriteAt([]byte("tail"), 10<<30-4)
	f.Close()
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	check := func(when string) {
		t.Helper()
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		buf, err := c.Read("huge.bin")
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		defer buf.Release()
		runtime.ReadMemStats(&after)
		b := buf.Bytes()
		if !IsMapped(buf) || len(b) != 10<<30 || string(b[len(b)-4:]) != "tail" || b[5<<30] != 0 {
			t.Errorf("%s: got %T of %d bytes; want a mapping of the 10 GiB file", when, buf, len(b))
		}
		if grew := int64(after.TotalAlloc - before.TotalAlloc); grew > 64<<20 {
			t.Errorf("%s: reading a 10 GiB file allocated %d MiB", when, grew>>20)
		}
		p := make([]byte, 4)
		if n, err := c.ReadAt("huge.bin", p, 10<<30-4); n != 4 || err != nil || string(p) != "tail" {
			t.Errorf("%s: ReadAt at the end: %d %v %q", when, n, err, p)
		}
	}
	check("with the server")
	stop()
	check("without a server")
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }
