package client

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/embedded"
)

// A server that stops answering after the client connected (SIGSTOP: the kernel still
// accepts its connections) costs a miss a short probe, not the read timeout: the read is
// abandoned when a Hello beside it gets no answer, the file is read from the source, and the
// server is skipped for a back-off. Before, each miss waited the whole read timeout (30 s
// here), once per back-off.
func TestStoppedServerCostsAProbeNotTheReadTimeout(t *testing.T) {
	cfg := realServerConfig(t)
	cfg = withOptions(t, cfg, map[string]string{"read_timeout": "30"})
	root := t.TempDir()
	for _, name := range []string{"a", "b", "c"} {
		writeFile(t, root, name, []byte(name))
	}
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	readBytes(t, c, "a")
	pid := embedded.RunningPID(cfg.RuntimeDir)
	if pid == 0 {
		t.Fatal("no server runs after a read")
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitStopped(t, pid)
	// Killed at the end: a stopped server would otherwise outlive the test.
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	for i, name := range []string{"b", "c"} {
		if i > 0 {
			time.Sleep(minBackoff + 100*time.Millisecond) // the back-off ended: the server is asked again
		}
		start := time.Now()
		if got := readBytes(t, c, name); string(got) != name {
			t.Fatalf("%s: got %q", name, got)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("miss of %s with a stopped server took %s; want a short probe, well under the 30s read timeout", name, d)
		}
	}
	if n := c.counts.directReads.Load(); n != 2 {
		t.Errorf("direct reads %d, want 2", n)
	}
}

// waitStopped waits until the process pid is stopped: kill returns once the signal is sent,
// and a loaded machine can let the server answer one more request before it stops.
func waitStopped(t *testing.T, pid int) {
	t.Helper()
	for range 500 {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		// The state follows the command name, which is in parentheses and may hold spaces.
		if i := bytes.LastIndexByte(b, ')'); err == nil && i >= 0 && i+2 < len(b) && b[i+2] == 'T' {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("process %d did not stop", pid)
}

// A server that answers Hello but takes longer than the probe to answer a read (a large or
// slow source file) is alive: the read is not abandoned, and its answer is used.
func TestSlowReadOnALiveServerCompletes(t *testing.T) {
	cfg, _ := startServer(t)
	cfg = withOptions(t, cfg, map[string]string{"read_timeout": "10"})
	delayReplies(t, embedded.SocketPath(cfg.RuntimeDir), 3*time.Second)
	root := t.TempDir()
	writeFile(t, root, "slow", bytes.Repeat([]byte("s"), 1000))
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	if got := readBytes(t, c, "slow"); len(got) != 1000 {
		t.Fatalf("got %d bytes", len(got))
	}
	if d := time.Since(start); d < 3*time.Second {
		t.Errorf("the read took %s: the delay was not applied, the test proves nothing", d)
	}
	if sr, dr := c.counts.serverReads.Load(), c.counts.directReads.Load(); sr != 1 || dr != 0 {
		t.Errorf("server reads %d, direct reads %d; want the server's answer (1, 0)", sr, dr)
	}
}

// delayReplies puts a proxy at the server socket sock that holds back for delay each answer to
// a request other than Hello (the method name travels in clear): a server busy with a long
// read that still answers probes. After the returned freeze, the proxy forwards nothing more
// in either direction, as a server stopped with SIGSTOP answers nothing while the kernel
// still accepts its connections.
func delayReplies(t *testing.T, sock string, delay time.Duration) (freeze func()) {
	t.Helper()
	real := sock + ".real"
	if err := os.Rename(sock, real); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex // protects conns
	var conns []net.Conn
	frozen, ended := make(chan struct{}), make(chan struct{})
	hold := func() { // while frozen, until the test ends
		select {
		case <-frozen:
			<-ended
		default:
		}
	}
	t.Cleanup(func() {
		close(ended)
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("unix", real)
			if err != nil {
				in.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, in, out)
			mu.Unlock()
			var slow atomic.Bool // the request being answered is not a Hello
			go pipe(in, out, func(b []byte) {
				hold()
				slow.Store(!bytes.Contains(b, []byte("Hello")))
			})
			go pipe(out, in, func([]byte) {
				if slow.Swap(false) {
					time.Sleep(delay)
				}
				hold()
			})
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(frozen) }) }
}

// pipe copies from one connection to the other, calling each before a chunk is forwarded,
// until either closes; then it closes both.
func pipe(from, to net.Conn, each func([]byte)) {
	defer from.Close()
	defer to.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := from.Read(buf)
		if err != nil {
			return
		}
		each(buf[:n])
		if _, err := to.Write(buf[:n]); err != nil {
			return
		}
	}
}

// Close does not wait for a read in flight on a server that is slow to answer it (a large
// source file): the read stops waiting and returns ErrClosed. Before, Close waited for the
// answer, up to the read timeout.
func TestCloseStopsAReadWaitingForTheServer(t *testing.T) {
	cfg, _ := startServer(t)
	cfg = withOptions(t, cfg, map[string]string{"read_timeout": "30"})
	delayReplies(t, embedded.SocketPath(cfg.RuntimeDir), 20*time.Second)
	root := t.TempDir()
	writeFile(t, root, "slow", []byte("slow"))
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	done := make(chan error, 1)
	go func() {
		buf, err := c.Read("slow")
		if err == nil {
			buf.Release()
		}
		done <- err
	}()
	time.Sleep(2 * probeAfter) // the read waits, watched by probes that the server answers
	start := time.Now()
	if err := c.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("close took %s with a read waiting for the server; want it at once", d)
	}
	select {
	case err := <-done:
		if !errors.Is(err, core.ErrClosed) {
			t.Errorf("the read in flight: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("the read in flight did not end after close")
	}
}

// A reader's check of a cached block (a new job over a warm cache asks the server, which
// compares the block with its source) in flight when the server stops answering (its
// connections accepted, nothing answered, as after SIGSTOP) is abandoned after a probe, like
// a read: the range is read from the source. Before, it waited the whole read timeout.
func TestABlockCheckInFlightWhenTheServerStopsCostsAProbe(t *testing.T) {
	cfg, _ := startServerWithBudget(t, "64MiB")
	cfg = withOptions(t, cfg, map[string]string{"read_timeout": "20"})
	root := t.TempDir()
	data, _ := randomBytes(12<<20, 5)
	writeFile(t, root, "big.bin", data)
	first, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	cacheBlocks(t, first, "big.bin", 3)
	first.Close()
	freeze := delayReplies(t, embedded.SocketPath(cfg.RuntimeDir), time.Minute)
	cfg.Job = "another job" // its blocks are unchecked for this job: each is asked for
	second, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	time.AfterFunc(3*probeAfter, freeze) // the check waits meanwhile, its probes answered
	start := time.Now()
	q := make([]byte, 1000)
	if k, err := second.ReadAt("big.bin", q, 5<<20); err != nil || !bytes.Equal(q[:k], data[5<<20:5<<20+1000]) {
		t.Fatalf("ReadAt: %d, %v", k, err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("a range whose block check was in flight when the server stopped took %s; want a probe, well under the 20s read timeout", d)
	}
	if d := time.Since(start); d < 3*probeAfter {
		t.Errorf("the range took %s: it did not wait for the check, the test proves nothing", d)
	}
}
