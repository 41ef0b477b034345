package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/cloudwego/kitex/server"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// testServer is a cluster server run in this process.
type testServer struct {
	addr   string
	engine *core.Engine
	srv    server.Server
	h      *rpc.Handler
	ln     *connsListener
}

// connsListener keeps the connections it accepted, so that a test can cut them as the death
// of the server's process would.
type connsListener struct {
	net.Listener
	mu    sync.Mutex // protects conns
	conns []net.Conn
}

func (l *connsListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.mu.Lock()
		l.conns = append(l.conns, c)
		l.mu.Unlock()
	}
	return c, err
}

// cut closes the listener and every connection accepted.
func (l *connsListener) cut() {
	l.Listener.Close()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		c.Close()
	}
}

// startClusterServer runs a server for root on host (a loopback address: its node).
func startClusterServer(t testing.TB, host, root string) *testServer {
	t.Helper()
	return startClusterServerWithBudget(t, host, root, "64MiB")
}

// startClusterServerWithBudget is startClusterServer with a memory tier of budget.
func startClusterServerWithBudget(t testing.TB, host, root, budget string) *testServer {
	t.Helper()
	return startClusterServerWithConfig(t, host, root, budget, rpc.ServerConfig{})
}

// startClusterServerWithConfig is startClusterServerWithBudget with the server configured by
// cfg (its token set to "tok"). host may carry a port to listen on.
func startClusterServerWithConfig(t testing.TB, host, root, budget string, cfg rpc.ServerConfig) *testServer {
	t.Helper()
	if !strings.Contains(host, ":") {
		host += ":0"
	}
	e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: budget}},
		Roots: []string{root}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	cl := &connsListener{Listener: ln}
	cfg.Token = "tok"
	srv, h, _ := rpc.Serve(e, cl, cfg)
	s := &testServer{addr: ln.Addr().String(), engine: e, srv: srv, h: h, ln: cl}
	t.Cleanup(func() { s.stop() })
	return s
}

// stop stops the server as a kill would: its connections are cut at once.
func (s *testServer) stop() {
	if s.srv != nil {
		s.ln.cut()
		s.srv.Stop()
		s.engine.Close()
		s.srv = nil
	}
}

// sourceReads sums the source reads of the servers.
func sourceReads(servers []*testServer) int64 {
	var n int64
	for _, s := range servers {
		n += s.engine.Stats().SourceReads
	}
	return n
}

// OpenForReader, as the node socket of a cluster server uses it: every file comes with its
// bytes, from its owner on the ring: the server's own files and those of another server on
// its node as tier files, the files of other nodes as sealed memory files; the source is
// read once per file. A dead server's files come from their new owner (recache) or the
// source (pfs).
func TestOpenForReaderServesEachFileFromItsOwner(t *testing.T) {
	for _, policy := range []string{config.PolicyRecache, config.PolicyPFS} {
		t.Run(policy, func(t *testing.T) { testOpenForReader(t, policy) })
	}
}

func testOpenForReader(t *testing.T, policy string) {
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
	self, peer, remote := startClusterServer(t, "127.0.0.1", root), startClusterServer(t, "127.0.0.1", root),
		startClusterServer(t, "127.0.0.2", root)
	servers := []*testServer{self, peer, remote}
	cfg, err := config.Load(map[string]string{"servers": self.addr + "," + peer.addr + "," + remote.addr,
		"token": "tok", "node": "127.0.0.1", "policy": policy, "wait_timeout": "5", "rpc_timeout": "2"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(root, cfg, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetOwnServer(self.addr, self.engine)

	// open reads a file through OpenForReader and checks its bytes and what it is.
	open := func(name string, wantOrigin core.Origin) {
		t.Helper()
		f, origin, err := c.OpenForReader(context.Background(), name)
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
	originOf := map[string]core.Origin{self.addr: core.OriginMemory, peer.addr: core.OriginMemory, remote.addr: core.OriginMemory}
	owned := map[string]int{}
	for epoch := range 2 {
		for _, name := range names {
			owner := c.Owner(name)
			owned[owner]++
			open(name, originOf[owner])
		}
		if got := sourceReads(servers); got != int64(len(names)) {
			t.Fatalf("epoch %d: %d source reads, want one per file (%d)", epoch, got, len(names))
		}
	}
	for _, s := range servers {
		if owned[s.addr] == 0 {
			t.Fatalf("server %s owns no file: the test proves nothing (%v)", s.addr, owned)
		}
	}

	// The remote server dies. Its files this node keeps a node-local copy of are read from
	// it, with no source read whatever the policy; the others come from the next live server,
	// on this node here, which reads each from the source once (recache), or from the source
	// every time (pfs).
	lost := map[string]bool{} // the remote server's files, with true for those without a copy
	nth := 0
	for _, name := range names {
		if c.Owner(name) == remote.addr {
			lost[name] = nth%2 == 0
			if lost[name] {
				self.engine.Forget(root, filepath.Join(root, name))
			}
			nth++
		}
	}
	remote.stop()
	before := sourceReads(servers[:2])
	for range 2 {
		for _, name := range names {
			noCopy, isLost := lost[name]
			switch {
			case !isLost:
				open(name, originOf[c.Owner(name)])
			case !noCopy:
				open(name, core.OriginMemory) // the node-local copy
			case policy == config.PolicyPFS:
				open(name, core.OriginSource)
			default:
				open(name, core.OriginMemory)
			}
		}
	}
	after := sourceReads(servers[:2])
	withoutCopy := nth - nth/2
	if policy == config.PolicyRecache && after-before != int64(withoutCopy) {
		t.Errorf("recache: %d source reads by the live servers, want one per file of the dead one that no node-local copy holds (%d)",
			after-before, withoutCopy)
	}
	if policy == config.PolicyPFS && after != before {
		t.Errorf("pfs: the live servers read %d files, want none (the dead one's are read from the source or a node-local copy)", after-before)
	}
	if _, _, err := c.OpenForReader(context.Background(), "../outside"); !errors.Is(err, core.ErrOutsideRoot) {
		t.Errorf("a path outside the root: %v, want ErrOutsideRoot", err)
	}
}

// cachedFiles is how many files a server's tiers hold.
func cachedFiles(s *testServer) int {
	n := 0
	for _, u := range s.engine.Usage() {
		n += u.Files
	}
	return n
}

// Forget, as the node socket of a cluster server uses it for a write-open: the copies go from
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
	self, peer, remote := startClusterServer(t, "127.0.0.1", root), startClusterServer(t, "127.0.0.1", root),
		startClusterServer(t, "127.0.0.2", root)
	servers := []*testServer{self, peer, remote}
	cfg, err := config.Load(map[string]string{"servers": self.addr + "," + peer.addr + "," + remote.addr,
		"token": "tok", "node": "127.0.0.1", "wait_timeout": "5", "rpc_timeout": "2"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(root, cfg, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetOwnServer(self.addr, self.engine)
	byOwner := map[string]string{} // a file of each server
	for _, name := range names {
		byOwner[c.Owner(name)] = name
	}
	if len(byOwner) != 3 {
		t.Fatalf("the files are owned by %d servers, want 3: the test proves nothing", len(byOwner))
	}
	ctx := context.Background()
	for _, name := range byOwner {
		f, _, err := c.OpenForReader(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	// The peer on this node also holds the remote server's file, as if from an earlier
	// placement: readers here would map it.
	stray := filepath.Join(root, byOwner[remote.addr])
	if res, err := peer.engine.Read(ctx, root, stray, true); err != nil {
		t.Fatal(err)
	} else {
		res.Release()
	}
	// self holds its own file and a node-local copy of the remote server's.
	waitFor(t, func() bool { return cachedFiles(self) == 2 && cachedFiles(peer) == 2 && cachedFiles(remote) == 1 })

	for owner, name := range byOwner {
		if err := c.Forget(ctx, name); err != nil {
			t.Fatalf("Forget(%s) of %s: %v", name, owner, err)
		}
	}
	for _, s := range servers {
		if n := cachedFiles(s); n != 0 {
			t.Errorf("server %s still holds %d files after Forget", s.addr, n)
		}
	}
	if err := c.Forget(ctx, "../outside"); !errors.Is(err, core.ErrOutsideRoot) {
		t.Errorf("Forget of a path outside the root: %v, want ErrOutsideRoot", err)
	}
}

// A cluster server answers the preload shim of any job through one long-lived client. A file
// another server on this node holds, rewritten at the source since, is answered from that
// server, which checks its copy for the shim's job (a session that began after the client's),
// never from its tier opened with the client's own, older session.
func TestOpenForReaderChecksCopiesOfOtherLocalServersForTheReadersJob(t *testing.T) {
	root := t.TempDir()
	self, peer := startClusterServer(t, "127.0.0.1", root), startClusterServer(t, "127.0.0.1", root)
	cfg, err := config.Load(map[string]string{"servers": self.addr + "," + peer.addr, "token": "tok",
		"node": "127.0.0.1", "wait_timeout": "5", "rpc_timeout": "2"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(root, cfg, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetOwnServer(self.addr, self.engine)
	var name string
	for i := 0; name == ""; i++ { // a file the other server owns
		if n := fmt.Sprintf("f%d.bin", i); c.Owner(n) == peer.addr {
			name = n
		}
	}
	path := writeFile(t, root, name, []byte("first version"))
	read := func() string {
		t.Helper()
		f, _, err := c.OpenForReader(context.Background(), name)
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
	peer.engine.BeginSession("the shim's next run") // its `fitcache run` said hello there
	if got := read(); got != "SECOND VERSION" {
		t.Errorf("after the file changed and a new job began: %q, want the new bytes", got)
	}
}
