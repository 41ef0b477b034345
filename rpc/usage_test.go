package rpc

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

func TestUsageAndClearOverRPC(t *testing.T) {
	sock := serve(t, "")
	root := t.TempDir()
	path := filepath.Join(root, "a.bin")
	os.WriteFile(path, make([]byte, 5000), 0o644)
	c, _ := Dial(sock, ClientConfig{})
	defer c.Close()
	ctx := context.Background()
	if _, err := c.Read(ctx, root, path, true); err != nil {
		t.Fatal(err)
	}
	u, err := c.Usage(ctx)
	if err != nil || len(u) != 1 || u[0].Root != root || u[0].Files != 1 || u[0].Kind != "memory" || u[0].Bytes != 8192+4096 {
		t.Fatalf("Usage = %+v, %v; want 1 file of %s in memory, 12 KiB", u, err, root)
	}
	for _, dry := range []bool{true, false} {
		got, err := c.Clear(ctx, root, dry)
		if err != nil || len(got) != 1 || got[0] != u[0] {
			t.Errorf("Clear(dry run %v) = %+v, %v; want %+v", dry, got, err, u[0])
		}
	}
	if u, err := c.Usage(ctx); err != nil || len(u) != 0 {
		t.Errorf("Usage after Clear = %+v, %v; want nothing", u, err)
	}
	if _, err := c.Clear(ctx, "not/absolute", false); core.Errno(err) != syscall.EINVAL {
		t.Errorf("Clear of a relative root: errno %v (%v), want EINVAL", core.Errno(err), err)
	}
}

func TestClearNeedsARootOrAll(t *testing.T) {
	// An empty root must not mean everything unless the request says all.
	h := newHandler(nil, ServerConfig{})
	r, err := h.Clear(context.Background(), &fitcachepb.ClearRequest{})
	if err != nil || r.Errno != int32(syscall.EINVAL) {
		t.Errorf("Clear without root or all: errno %d (%v), want EINVAL", r.GetErrno(), err)
	}
}

func TestForgetOverRPC(t *testing.T) {
	sock := serve(t, "")
	root := t.TempDir()
	path := filepath.Join(root, "a.bin")
	os.WriteFile(path, make([]byte, 5000), 0o644)
	c, _ := Dial(sock, ClientConfig{})
	defer c.Close()
	ctx := context.Background()
	if _, err := c.Read(ctx, root, path, true); err != nil {
		t.Fatal(err)
	}
	cached := false
	for i := 0; i < 500 && !cached; i++ { // the data mover publishes the file after the reply
		u, _ := c.Usage(ctx)
		cached = len(u) == 1
		time.Sleep(10 * time.Millisecond)
	}
	if !cached {
		t.Fatal("the file was not cached after 5 s")
	}
	if err := c.Forget(ctx, root, path); err != nil {
		t.Fatal(err)
	}
	if u, err := c.Usage(ctx); err != nil || len(u) != 0 {
		t.Errorf("Usage after Forget = %+v, %v; want nothing cached", u, err)
	}
	if err := c.Forget(ctx, root, "/etc/passwd"); core.Errno(err) != syscall.EACCES {
		t.Errorf("Forget outside the root: errno %v (%v), want EACCES", core.Errno(err), err)
	}
}
