package client

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/nodesock"
)

// TestStandInServesForkedReaders: a client on a node without a server of the job serves the
// readers forked from its process a stand-in node socket, which answers a batch as the
// client reads: each file's bytes (inline, or a memory file when large), a missing file's own
// error; it refuses another root, and is gone once the client closes.
func TestStandInServesForkedReaders(t *testing.T) {
	root := t.TempDir()
	want := map[string][]byte{
		"small.bin": bytes.Repeat([]byte{7}, 5000),
		"large.bin": bytes.Repeat([]byte{9}, nodesock.MaxInline+4096),
		"empty.bin": {},
	}
	for name, data := range want {
		writeFile(t, root, name, data)
	}
	a, b := startClusterServer(t, "127.0.0.1", root), startClusterServer(t, "127.0.0.2", root)
	c, err := Open(root, clusterConfig(t, map[string]string{"runtime_dir": t.TempDir()}, a, b), discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	socket, inCluster, err := c.ForkedReaders()
	if err != nil || !inCluster || socket == "" {
		t.Fatalf("ForkedReaders on a node without a server = %q, %v, %v; want a stand-in", socket, inCluster, err)
	}
	if again, _, _ := c.ForkedReaders(); again != socket {
		t.Errorf("a second call gave another socket: %q, then %q", socket, again)
	}
	names := []string{"small.bin", "large.bin", "empty.bin", "missing.bin"}
	paths := make([]string, len(names))
	for i, name := range names {
		paths[i] = filepath.Join(c.Root(), name)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	opened, err := nodesock.OpenMany(ctx, socket, c.Root(), paths)
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range opened {
		name := names[i]
		if name == "missing.bin" {
			if !errors.Is(o.Err, syscall.ENOENT) {
				t.Errorf("%s: error %v, want ENOENT", name, o.Err)
			}
			continue
		}
		got := o.Data
		if o.File != nil {
			got, err = io.ReadAll(o.File)
			o.File.Close()
			if err != nil {
				t.Fatal(err)
			}
		}
		if o.Err != nil || !bytes.Equal(got, want[name]) {
			t.Errorf("%s: %d bytes, error %v; want its %d bytes", name, len(got), o.Err, len(want[name]))
		}
	}
	other, err := nodesock.OpenMany(ctx, socket, "/etc", []string{"/etc/hostname"})
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(other[0].Err, syscall.EACCES) {
		t.Errorf("a file of another root: error %v, want EACCES", other[0].Err)
	}
	c.Close()
	if _, err := os.Stat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the stand-in's socket outlived its client: %v", err)
	}
}

// TestStaleStandInsAreRemoved: a stand-in socket that nothing listens on any more (its
// process was killed) is removed when another stand-in starts; one that is listened on is kept.
func TestStaleStandInsAreRemoved(t *testing.T) {
	dir := t.TempDir()
	stale := filepath.Join(dir, "standin-1-0a0b.node")
	live := filepath.Join(dir, "standin-2-0c0d.node")
	dead, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	dead.SetUnlinkOnClose(false) // as a killed process leaves it
	dead.Close()
	ln, err := net.Listen("unix", live)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	removeStaleStandIns(dir)
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a socket nothing listens on was kept: %v", err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("a socket that is listened on was removed: %v", err)
	}
}
