package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/internal/testserver"
	"github.com/fitcache/fitcache/routing"
	"github.com/fitcache/fitcache/rpc"
)

// writeFile writes data to name under dir and returns its path.
func writeFile(t *testing.T, dir, name string, data []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// waitFor waits up to 10 seconds for cond.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out waiting")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// open, as the node socket of a cluster server uses it: every file comes with its
// bytes, from its owner on the ring: the server's own files and those of another server on
// its node as tier files, the files of other nodes as sealed memory files; the source is
// read once per file. A dead server's files come from their new owner (recache) or the
// source (pfs).
func TestOpenServesEachFileFromItsOwner(t *testing.T) {
	for _, policy := range []string{config.PolicyRecache, config.PolicyPFS} {
		t.Run(policy, func(t *testing.T) { testOpen(t, policy) })
	}
}

func testOpen(t *testing.T, policy string) {
	root := t.TempDir()
	rng := rand.New(rand.NewSource(1))
	want := map[string][]byte{}
	var names []string
	for i := range 60 {
		name := fmt.Sprintf("d%d/f%02d.bin", i%3, i)
		data := make([]byte, []int{0, 1, 4096, 70000}[i%4]+rng.Intn(3000))
		rng.Read(data)
		os.MkdirAll(filepath.Join(root, filepath.Dir(name)), 0o755)
		writeFile(t, root, name, data)
		want[name] = data
		names = append(names, name)
	}
	// Nodes are loopback addresses: self and a peer on 127.0.0.1, a remote on 127.0.0.2.
	self, peer, remote := testserver.Start(t, "127.0.0.1", root, "64MiB", rpc.ServerConfig{}), testserver.Start(t, "127.0.0.1", root, "64MiB", rpc.ServerConfig{}),
		testserver.Start(t, "127.0.0.2", root, "64MiB", rpc.ServerConfig{})
	servers := []*testserver.Server{self, peer, remote}
	cfg, err := config.Load(map[string]string{"servers": self.Addr + "," + peer.Addr + "," + remote.Addr,
		"token": "tok", "node": "127.0.0.1", "policy": policy, "wait_timeout": "5", "rpc_timeout": "2"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := newRootReader(root, cfg, nil, self.Engine, self.Addr, routing.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.close()

	// open reads a file through open and checks its bytes and what it is.
	open := func(name string, wantOrigin core.Origin) {
		t.Helper()
		f, origin, err := c.open(context.Background(), name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		defer f.Close()
		got, err := io.ReadAll(f)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[name]) {
			t.Fatalf("%s: got %d bytes, want the source's %d", name, len(got), len(want[name]))
		}
		if origin != wantOrigin {
			t.Errorf("%s: origin %v, want %v", name, origin, wantOrigin)
		}
		if origin == core.OriginPeer {
			link, _ := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
			if !strings.HasPrefix(link, "/memfd:fitcache:"+filepath.Base(name)) {
				t.Errorf("%s: memory file named %q", name, link)
			}
			if _, err := f.WriteAt([]byte("x"), 0); !errors.Is(err, syscall.EPERM) {
				t.Errorf("%s: write to the memory file: %v, want EPERM (sealed)", name, err)
			}
			if err := f.Truncate(0); !errors.Is(err, syscall.EPERM) {
				t.Errorf("%s: truncate the memory file: %v, want EPERM (sealed)", name, err)
			}
		}
	}
	// A file of the remote server is kept as a node-local copy by the server this client runs
	// in (it has room): opened from its tier.
	originOf := map[string]core.Origin{self.Addr: core.OriginMemory, peer.Addr: core.OriginMemory, remote.Addr: core.OriginMemory}
	owned := map[string]int{}
	for epoch := range 2 {
		for _, name := range names {
			owner := c.owner(name)
			owned[owner]++
			open(name, originOf[owner])
		}
		if got := testserver.SourceReads(servers...); got != int64(len(names)) {
			t.Fatalf("epoch %d: %d source reads, want one per file (%d)", epoch, got, len(names))
		}
	}
	for _, s := range servers {
		if owned[s.Addr] == 0 {
			t.Fatalf("server %s owns no file: the test proves nothing (%v)", s.Addr, owned)
		}
	}

	// The remote server dies. Its files this node keeps a node-local copy of are read from
	// it, with no source read whatever the policy; the others come from the next live server,
	// on this node here, which reads each from the source once (recache), or from the source
	// every time (pfs).
	lost := map[string]bool{} // the remote server's files, with true for those without a copy
	nth := 0
	for _, name := range names {
		if c.owner(name) == remote.Addr {
			lost[name] = nth%2 == 0
			if lost[name] {
				self.Engine.Forget(root, filepath.Join(root, name))
			}
			nth++
		}
	}
	remote.Stop()
	before := testserver.SourceReads(servers[:2]...)
	for range 2 {
		for _, name := range names {
			noCopy, isLost := lost[name]
			switch {
			case !isLost:
				open(name, originOf[c.owner(name)])
			case !noCopy:
				open(name, core.OriginMemory) // the node-local copy
			case policy == config.PolicyPFS:
				open(name, core.OriginSource)
			default:
				open(name, core.OriginMemory)
			}
		}
	}
	after := testserver.SourceReads(servers[:2]...)
	withoutCopy := nth - nth/2
	if policy == config.PolicyRecache && after-before != int64(withoutCopy) {
		t.Errorf("recache: %d source reads by the live servers, want one per file of the dead one that no node-local copy holds (%d)",
			after-before, withoutCopy)
	}
	if policy == config.PolicyPFS && after != before {
		t.Errorf("pfs: the live servers read %d files, want none (the dead one's are read from the source or a node-local copy)", after-before)
	}
	if _, _, err := c.open(context.Background(), "../outside"); !errors.Is(err, core.ErrOutsideRoot) {
		t.Errorf("a path outside the root: %v, want ErrOutsideRoot", err)
	}
}

// forget, as the node socket of a cluster server uses it for a write-open: the copies go from
// the file's owner, wherever it is, and from every server on this node (the shim maps their
// tiers itself), even one that cached the file under an earlier placement.
func TestForgetDropsTheOwnersAndThisNodesCopies(t *testing.T) {
	root := t.TempDir()
	var names []string
	for i := range 30 {
		name := fmt.Sprintf("f%02d.bin", i)
		writeFile(t, root, name, make([]byte, 3000+i))
		names = append(names, name)
	}
	self, peer, remote := testserver.Start(t, "127.0.0.1", root, "64MiB", rpc.ServerConfig{}), testserver.Start(t, "127.0.0.1", root, "64MiB", rpc.ServerConfig{}),
		testserver.Start(t, "127.0.0.2", root, "64MiB", rpc.ServerConfig{})
	servers := []*testserver.Server{self, peer, remote}
	cfg, err := config.Load(map[string]string{"servers": self.Addr + "," + peer.Addr + "," + remote.Addr,
		"token": "tok", "node": "127.0.0.1", "wait_timeout": "5", "rpc_timeout": "2"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := newRootReader(root, cfg, nil, self.Engine, self.Addr, routing.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.close()
	byOwner := map[string]string{} // a file of each server
	for _, name := range names {
		byOwner[c.owner(name)] = name
	}
	if len(byOwner) != 3 {
		t.Fatalf("the files are owned by %d servers, want 3: the test proves nothing", len(byOwner))
	}
	ctx := context.Background()
	for _, name := range byOwner {
		f, _, err := c.open(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	// The peer on this node also holds the remote server's file, as if from an earlier
	// placement: readers here would map it.
	stray := filepath.Join(root, byOwner[remote.Addr])
	if res, err := peer.Engine.Read(ctx, root, stray, true); err != nil {
		t.Fatal(err)
	} else {
		res.Release()
	}
	// self holds its own file and a node-local copy of the remote server's.
	waitFor(t, func() bool { return self.CachedFiles() == 2 && peer.CachedFiles() == 2 && remote.CachedFiles() == 1 })

	for owner, name := range byOwner {
		if err := c.forget(ctx, name); err != nil {
			t.Fatalf("forget(%s) of %s: %v", name, owner, err)
		}
	}
	for _, s := range servers {
		if n := s.CachedFiles(); n != 0 {
			t.Errorf("server %s still holds %d files after forget", s.Addr, n)
		}
	}
	if err := c.forget(ctx, "../outside"); !errors.Is(err, core.ErrOutsideRoot) {
		t.Errorf("forget of a path outside the root: %v, want ErrOutsideRoot", err)
	}
}

// A cluster server answers the preload shim of any job through one long-lived reader of the root. A file
// another server on this node holds, rewritten at the source since, is answered from that
// server, which checks its copy for the shim's job (a session that began after the reader's),
// never from its tier opened with the reader's own, older session.
func TestOpenChecksCopiesOfOtherLocalServersForTheReadersJob(t *testing.T) {
	root := t.TempDir()
	self, peer := testserver.Start(t, "127.0.0.1", root, "64MiB", rpc.ServerConfig{}), testserver.Start(t, "127.0.0.1", root, "64MiB", rpc.ServerConfig{})
	cfg, err := config.Load(map[string]string{"servers": self.Addr + "," + peer.Addr, "token": "tok",
		"node": "127.0.0.1", "wait_timeout": "5", "rpc_timeout": "2"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := newRootReader(root, cfg, nil, self.Engine, self.Addr, routing.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.close()
	var name string
	for i := 0; name == ""; i++ { // a file the other server owns
		if n := fmt.Sprintf("f%d.bin", i); c.owner(n) == peer.Addr {
			name = n
		}
	}
	path := writeFile(t, root, name, []byte("first version"))
	read := func() string {
		t.Helper()
		f, _, err := c.open(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		b, _ := io.ReadAll(f)
		return string(b)
	}
	if got := read(); got != "first version" {
		t.Fatalf("first read: %q", got)
	}
	if err := os.WriteFile(path, []byte("SECOND VERSION"), 0o644); err != nil {
		t.Fatal(err)
	}
	peer.Engine.BeginSession("the shim's next run") // its `fitcache run` said hello there
	if got := read(); got != "SECOND VERSION" {
		t.Errorf("after the file changed and a new job began: %q, want the new bytes", got)
	}
}

// TestReplicaCopiesCarryTheirOwnersStamp: with two replicas, the files a server's own engine
// reads from the source for its node's readers reach their replica with a stamp it accepts.
func TestReplicaCopiesCarryTheirOwnersStamp(t *testing.T) {
	root := t.TempDir()
	for i := range 30 {
		writeFile(t, root, fmt.Sprintf("own%02d.bin", i), bytes.Repeat([]byte{byte(i)}, 5000))
	}
	a, b := testserver.Start(t, "127.0.0.1", root, "64MiB", rpc.ServerConfig{}), testserver.Start(t, "127.0.0.2", root, "64MiB", rpc.ServerConfig{})
	cfg, err := config.Load(map[string]string{"servers": a.Addr + "," + b.Addr, "token": "tok", "node": "n0",
		"wait_timeout": "5", "rpc_timeout": "2", "replicas": "2"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := newRootReader(root, cfg, nil, a.Engine, a.Addr, routing.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 30 {
		f, _, err := c.open(context.Background(), fmt.Sprintf("own%02d.bin", i))
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	c.close() // waits for the replica copies
	sa, sb := a.Engine.Stats(), b.Engine.Stats()
	// Every file is at its owner and at the other server: a replica copy or, for a file the
	// other server owns, possibly the node-local copy the own server kept before the replica
	// copy came (which then finds it there). (The owners publish their copies in the
	// background.)
	waitFor(t, func() bool { return a.CachedFiles()+b.CachedFiles() == 2*30 })
	if stored, refused := sa.Stored+sb.Stored, sa.StoreRefused+sb.StoreRefused; stored == 0 || refused != 0 {
		t.Errorf("%d replica copies stored, %d refused; want some, none refused", stored, refused)
	}
}
