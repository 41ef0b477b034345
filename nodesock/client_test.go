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
	hung := filepath.Join(dir, "hung.sock")
	ln, err := net.Listen("unix", hung)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
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
