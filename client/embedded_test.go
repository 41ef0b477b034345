package client

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/rpc/rpctest"
)

// hangServer makes the embedded server of cfg look hung, as a stopped (SIGSTOP) server does:
// the server lock is held and the socket accepts connections that are never answered.
func hangServer(t *testing.T, cfg config.Config) {
	t.Helper()
	os.Remove(embedded.SocketPath(cfg.RuntimeDir))
	ln, err := net.Listen("unix", embedded.SocketPath(cfg.RuntimeDir))
	if err != nil {
		t.Fatal(err)
	}
	lock, err := embedded.LockServer(cfg.RuntimeDir, 0)
	if err != nil {
		ln.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { lock.Close() })
	rpctest.HoldConns(t, ln)
}

func withOptions(t *testing.T, cfg config.Config, opts map[string]string) config.Config {
	t.Helper()
	base := map[string]string{"runtime_dir": cfg.RuntimeDir, "tiers": cfg.Tiers, "server_bin": cfg.ServerBin}
	for k, v := range opts {
		base[k] = v
	}
	out, err := config.Load(base)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// A hung server that holds the server lock is treated as down at once: reads go to the
// source within the read timeout, and later reads do not wait for it again until the
// back-off ends. On the main branch before this change the first read waited 77 s with the
// defaults (here: the 20 s start timeout), then 17 s every 22 s.
func TestHungServerIsDownAtOnce(t *testing.T) {
	cfg, stop := startServer(t)
	stop()
	cfg = withOptions(t, cfg, map[string]string{"read_timeout": "3", "start_timeout": "20", "server_bin": "/bin/true"})
	hangServer(t, cfg)
	root := t.TempDir()
	for i := range 20 {
		writeFile(t, root, fmt.Sprintf("f%02d", i), []byte{byte(i)})
	}
	start := time.Now()
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range 20 {
		if got := readBytes(t, c, fmt.Sprintf("f%02d", i)); got[0] != byte(i) {
			t.Fatalf("f%02d: wrong bytes", i)
		}
	}
	if d := time.Since(start); d > 3*time.Second+time.Second {
		t.Errorf("open and 20 reads with a hung server took %s, want at most the read timeout (3s) and a little", d)
	}
	if cs, _ := clientStats(t, c); cs.DirectReads != 20 {
		t.Errorf("direct reads %d, want 20", cs.DirectReads)
	}
}

// A read of a file the client already has mapped does not wait while another read waits on
// a server that stopped answering. On the main branch before this change both waited: the
// reconnect held the client's lock across the server start.
func TestHitsDoNotWaitForAStuckServer(t *testing.T) {
	cfg, stop := startServer(t)
	cfg = withOptions(t, cfg, map[string]string{"read_timeout": "3", "start_timeout": "20", "server_bin": "/bin/true"})
	root := t.TempDir()
	writeFile(t, root, "cached", bytes.Repeat([]byte("c"), 100_000))
	writeFile(t, root, "other", []byte("o"))
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	readBytes(t, c, "cached")
	waitCached(t, c, "cached")
	readBytes(t, c, "cached") // now a kept mapping
	stop()
	hangServer(t, cfg)

	missDone := make(chan time.Time, 1)
	go func() {
		buf, err := c.Read("other")
		if err == nil {
			buf.Release()
		}
		missDone <- time.Now()
	}()
	time.Sleep(100 * time.Millisecond) // let the miss reach the server
	if got := readBytes(t, c, "cached"); len(got) != 100_000 {
		t.Fatal("wrong bytes")
	}
	hitDone := time.Now()
	if missAt := <-missDone; !hitDone.Before(missAt) {
		t.Errorf("the hit finished after the miss that waits on the stuck server (hit %s, miss %s)", hitDone, missAt)
	}
	// The server stays stuck: the cached file is still served from its tier, not the source.
	before, _ := clientStats(t, c)
	for range 10 {
		readBytes(t, c, "cached")
	}
	after, _ := clientStats(t, c)
	if hits, direct := after.LocalHits-before.LocalHits, after.DirectReads-before.DirectReads; hits != 10 || direct != 0 {
		t.Errorf("10 reads of a cached file with the server stuck: %d local hits, %d direct reads; want 10 and 0", hits, direct)
	}
}

// fitcacheBinary builds the fitcache command once for the tests that need a real server.
var fitcacheBinary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "fitcache-bin-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "fitcache")
	out, err := exec.Command("go", "build", "-o", bin, "../cmd/fitcache").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build: %v\n%s", err, out)
	}
	return bin, nil
})

func realServerConfig(t *testing.T) config.Config {
	t.Helper()
	bin, err := fitcacheBinary()
	if err != nil {
		t.Skip("cannot build the fitcache command:", err)
	}
	cfg, err := config.Load(map[string]string{"runtime_dir": t.TempDir(), "server_bin": bin,
		"tiers": "memory:" + t.TempDir() + ":64MiB", "start_timeout": "20", "read_timeout": "10"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if pid := embedded.RunningPID(cfg.RuntimeDir); pid != 0 {
			syscall.Kill(pid, syscall.SIGTERM)
		}
	})
	return cfg
}

func processGone(pid int) bool { return syscall.Kill(pid, 0) == syscall.ESRCH }

// A server whose socket was deleted exits, so that the next client starts a new one that
// serves. On the main branch before this change the old server ran on unreachable until it
// idled out, and new clients read the source after waiting for the start timeout.
func TestServerWithRemovedSocketIsReplaced(t *testing.T) {
	cfg := realServerConfig(t)
	root := t.TempDir()
	writeFile(t, root, "a", []byte("a"))
	writeFile(t, root, "b", []byte("b"))
	first, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	readBytes(t, first, "a")
	first.Close()
	old := embedded.RunningPID(cfg.RuntimeDir)
	if old == 0 {
		t.Fatal("no server runs after a read")
	}
	os.Remove(embedded.SocketPath(cfg.RuntimeDir))
	waitFor(t, func() bool { return processGone(old) || isZombie(old) })

	second, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	readBytes(t, second, "b")
	if cs, _ := clientStats(t, second); cs.ServerReads != 1 || cs.DirectReads != 0 {
		t.Errorf("after the socket was removed: server reads %d, direct reads %d; want 1 and 0", cs.ServerReads, cs.DirectReads)
	}
	if pid := embedded.RunningPID(cfg.RuntimeDir); pid == 0 || pid == old {
		t.Errorf("server pid %d, want a new one (the old was %d)", pid, old)
	}
}

func isZombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	return err == nil && strings.Contains(string(b), ") Z ")
}

// A client stops waiting as soon as the server it started exits. On the main branch before
// this change a server that exited with status 0 left the client waiting for the whole
// start timeout.
func TestSpawnedServerExitEndsTheWait(t *testing.T) {
	cfg, stop := startServer(t)
	stop()
	os.Remove(embedded.SocketPath(cfg.RuntimeDir)) // no server runs
	cfg = withOptions(t, cfg, map[string]string{"start_timeout": "20", "server_bin": "/bin/true"})
	root := t.TempDir()
	writeFile(t, root, "a", []byte("a"))
	start := time.Now()
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got := readBytes(t, c, "a"); string(got) != "a" {
		t.Fatal("wrong bytes")
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("open and read took %s with a server that exits at once; want well under the 20s start timeout", d)
	}
}
