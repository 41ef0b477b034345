package server

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// floodServerEnv, set to a directory, makes TestMetricsFloodLeavesTheDataPortServing run
// the server under attack (in a child process of the test, see floodServer) instead.
const floodServerEnv = "FITCACHE_TEST_FLOOD_SERVER"

// floodFDLimit is the child's descriptor limit: low, so that the flood would reach it with
// a few hundred connections, and well above what the server needs.
const floodFDLimit = 256

// Idle connections to the metrics port leave the server's descriptors bounded and its data
// port serving, and let a scrape in. The server runs in a child process whose descriptor
// limit is floodFDLimit; the test opens more idle connections than that to its metrics port,
// counts the child's descriptors, reads through its data port, and scrapes.
func TestMetricsFloodLeavesTheDataPortServing(t *testing.T) {
	if dir := os.Getenv(floodServerEnv); dir != "" {
		floodServer(t, dir)
		return
	}
	if _, err := os.Stat("/proc/self/fd"); err != nil {
		t.Skipf("cannot count a process's descriptors: %v", err)
	}
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	want := []byte("bytes served through the data port")
	if err := os.WriteFile(filepath.Join(root, "f"), want, 0o644); err != nil {
		t.Fatal(err)
	}
	child := exec.Command(os.Args[0], "-test.run=^TestMetricsFloodLeavesTheDataPortServing$", "-test.count=1")
	child.Env = append(os.Environ(), floodServerEnv+"="+dir)
	child.Stderr = os.Stderr
	stdin, err := child.StdinPipe() // closed: the child closes its server and exits
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		exited := make(chan error, 1)
		go func() { exited <- child.Wait() }()
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			child.Process.Kill()
			<-exited
		}
	})
	ready := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		ready <- line
		io.Copy(io.Discard, stdout)
	}()
	var dataAddr, metricsAddr string
	select {
	case line := <-ready:
		if _, err := fmt.Sscan(line, &dataAddr, &metricsAddr); err != nil {
			t.Fatalf("the child server said %q, want its data and metrics addresses: %v", line, err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the child server did not start within 60 s")
	}
	fds := func() int {
		entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", child.Process.Pid))
		if err != nil {
			t.Fatalf("count the child server's descriptors: %v", err)
		}
		return len(entries)
	}
	before := fds()

	// The flood: idle connections, up to twice what the child may have descriptors. Those
	// the server does not accept at once wait in the kernel's queue; one that finds the queue
	// full (somaxconn) ends it, which the code before the places never let happen: it
	// accepted every connection until it ran out of descriptors.
	var flood []net.Conn
	t.Cleanup(func() {
		for _, c := range flood {
			c.Close()
		}
	})
	for range 2 * floodFDLimit {
		c, err := net.DialTimeout("tcp", metricsAddr, time.Second)
		if err != nil {
			break
		}
		flood = append(flood, c)
	}
	if len(flood) < 4*metricsMaxConns {
		t.Fatalf("only %d connections to the metrics port, want at least %d to test its cap of %d",
			len(flood), 4*metricsMaxConns, metricsMaxConns)
	}
	// Let the child accept what it will: until its count holds for 250 ms (at most 5 s).
	last, steady := fds(), 0
	for deadline := time.Now().Add(5 * time.Second); steady < 5 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		if n := fds(); n == last {
			steady++
		} else {
			last, steady = n, 0
		}
	}
	if got, most := last-before, metricsMaxConns+16; got > most {
		t.Errorf("%d idle connections to the metrics port: the server holds %d more descriptors, want at most %d",
			len(flood), got, most)
	}

	c, err := rpc.Dial(dataAddr, rpc.ClientConfig{Token: "tok"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	r, err := c.Read(ctx, root, filepath.Join(root, "f"), false)
	if err != nil {
		t.Fatalf("read through the data port under the flood: %v", err)
	}
	if string(r.Data) != string(want) {
		t.Fatalf("read through the data port under the flood: %q, want %q", r.Data, want)
	}

	// A scrape under the flood gets in: a new connection takes the place of the oldest idle
	// one, instead of waiting in the kernel's queue behind the flood (minutes, with a cap
	// that left them there).
	scraper := http.Client{Timeout: 10 * time.Second}
	resp, err := scraper.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatalf("scrape under the flood: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "fitcache_served_bytes_total") {
		t.Errorf("scrape under the flood: %s, %d bytes without fitcache_served_bytes_total", resp.Status, len(body))
	}
}

// floodServer is the child of TestMetricsFloodLeavesTheDataPortServing: a TCP server with
// metrics under a descriptor limit of floodFDLimit, serving dir/root. It writes its data and
// metrics addresses on a line, and closes once its standard input does (the test ended).
func floodServer(t *testing.T, dir string) {
	// Go raises the soft limit to the hard one at start; the attack is on the soft one.
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	lim.Cur = min(floodFDLimit, lim.Max)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	s, err := Start(Config{Listen: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0", Token: "tok",
		Roots: []string{filepath.Join(dir, "root")}, RuntimeDir: filepath.Join(dir, "run"),
		Tiers: []tiers.Config{{Kind: tiers.Memory, Dir: filepath.Join(dir, "tier"), Budget: "64MiB"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	fmt.Printf("%s %s\n", s.Addr(), s.MetricsAddr())
	io.Copy(io.Discard, os.Stdin)
}
