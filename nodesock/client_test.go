package nodesock

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
)

// Open hands a Go reader the descriptor the server answers with, or the server's error;
// a server that does not acknowledge is unavailable after the probe time.
func TestOpenClient(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "file")
	os.WriteFile(data, []byte("the bytes"), 0o600)
	sock := startWith(t, Config{Open: func(ctx context.Context, root, path string) (*os.File, uint32, error) {
		if path == "/d/missing" {
			return nil, 0, &fs.PathError{Op: "open", Path: path, Err: fs.ErrNotExist}
		}
		f, err := os.Open(data)
		return f, uint32(core.OriginPeer), err
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	f, origin, err := Open(ctx, sock, "/d", "/d/f")
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(f)
	f.Close()
	if string(got) != "the bytes" || origin != uint32(core.OriginPeer) {
		t.Errorf("got %q, origin %d; want the file's bytes and the server's origin, %d", got, origin, core.OriginPeer)
	}
	if _, _, err := Open(ctx, sock, "/d", "/d/missing"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a missing file: %v, want ENOENT", err)
	}

	// A listener that accepts and never answers: unavailable after the probe, not the deadline.
	hung := silentServer(t, filepath.Join(dir, "hung.sock"), func(net.Conn) {})
	start := time.Now()
	if _, _, err := Open(ctx, hung, "/d", "/d/f"); !errors.Is(err, ErrUnavailable) {
		t.Errorf("a hung server: %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 3*ProbeTimeout {
		t.Errorf("a hung server took %s, want about the probe time (%s)", d, ProbeTimeout)
	}
	// No server: unavailable, and not taken for the file's own ENOENT.
	if _, _, err := Open(ctx, filepath.Join(dir, "none.sock"), "/d", "/d/f"); !errors.Is(err, ErrUnavailable) ||
		errors.Is(err, syscall.ENOENT) {
		t.Errorf("no server: %v, want ErrUnavailable and no ENOENT", err)
	}
}

// A server that acknowledged a request and then stops (SIGSTOP: its acks stop coming) is
// given up within about the probe time, not at the request's deadline; one that keeps
// acknowledging is waited for past the probe time, and cancelling the context ends the wait.
func TestOpenWaitsWhileTheServerAcknowledges(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "file")
	os.WriteFile(data, []byte("the bytes"), 0o600)
	release := make(chan struct{})
	sock := startWith(t, Config{Timeout: 30 * time.Second, Open: func(ctx context.Context, root, path string) (*os.File, uint32, error) {
		if path == "/d/held" {
			select {
			case <-release:
			case <-ctx.Done():
			}
		} else {
			time.Sleep(2 * ProbeTimeout)
		}
		f, err := os.Open(data)
		return f, uint32(core.OriginPeer), err
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	f, _, err := Open(ctx, sock, "/d", "/d/slow")
	if err != nil {
		t.Fatalf("a live server slower than the probe time: %v", err)
	}
	got, _ := io.ReadAll(f)
	f.Close()
	if string(got) != "the bytes" {
		t.Errorf("got %q", got)
	}

	held, stop := context.WithCancel(ctx)
	time.AfterFunc(ProbeTimeout/2, stop)
	start := time.Now()
	if _, _, err := Open(held, sock, "/d", "/d/held"); !errors.Is(err, ErrUnavailable) {
		t.Errorf("cancelled: %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 3*ProbeTimeout {
		t.Errorf("a cancelled open took %s, want it to end when cancelled", d)
	}
	close(release)

	// A server that acknowledges once and then says nothing more.
	stopped := silentServer(t, filepath.Join(dir, "stopped.sock"), func(c net.Conn) {
		if _, _, _, err := readRequest(c); err == nil {
			c.Write([]byte(Ack))
		}
	})
	fresh, cancelFresh := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancelFresh()
	start = time.Now()
	if _, _, err := Open(fresh, stopped, "/d", "/d/f"); !errors.Is(err, ErrUnavailable) {
		t.Errorf("a server stopped after its ack: %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 3*ProbeTimeout {
		t.Errorf("a server stopped after its ack took %s, want about the probe time (%s), not the deadline", d, ProbeTimeout)
	}
}

// silentServer listens at path, runs first on each connection it accepts and then leaves the
// connection open without a word, as a hung server's kernel does; all is closed when t ends.
func silentServer(t *testing.T, path string, first func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
			go first(c)
		}
	}()
	return path
}
