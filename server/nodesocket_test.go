package server

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/ring"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

func TestSelfMemberFindsTheServerByItsListenAddress(t *testing.T) {
	members := []ring.Member{{ID: "gpu001:7070", Node: "gpu001"}, {ID: "gpu001:7071", Node: "gpu001"},
		{ID: "gpu002:7070", Node: "gpu002"}, {ID: "10.0.0.3:7070", Node: "10.0.0.3"}}
	for _, tc := range []struct {
		listen, node, want string
	}{
		{"gpu001:7071", "elsewhere", "gpu001:7071"}, // the listen address names it
		{"10.0.0.3:7070", "gpu003", "10.0.0.3:7070"},
		{"0.0.0.0:7070", "gpu002", "gpu002:7070"}, // a wildcard address: its node and port
		{":7071", "gpu001", "gpu001:7071"},
		{"0.0.0.0:7072", "gpu001", ""}, // no server of the job on that port
		{"0.0.0.0:7070", "gpu009", ""}, // nor on that node
	} {
		got, ok := selfMember(members, tc.listen, tc.node)
		if ok != (tc.want != "") || got.ID != tc.want {
			t.Errorf("selfMember(%q, node %q) = %q, %v; want %q", tc.listen, tc.node, got.ID, ok, tc.want)
		}
	}
}

// startEngineServer runs an engine serving root over RPC on host (a loopback address: its
// node), with the job token "tok".
func startEngineServer(t *testing.T, host, root string) (string, *core.Engine) {
	t.Helper()
	return startEngineServerWithBudget(t, host, root, "64MiB")
}

// startEngineServerWithBudget is startEngineServer with a memory tier of budget.
func startEngineServerWithBudget(t *testing.T, host, root, budget string) (string, *core.Engine) {
	t.Helper()
	e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: budget}},
		Roots: []string{root}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	srv, _, _ := rpc.Serve(e, ln, rpc.ServerConfig{Token: "tok"})
	t.Cleanup(func() { srv.Stop(); e.Close() })
	return ln.Addr().String(), e
}

// startClusterNode returns the cluster side of the server self with engine, configured by
// options (config.Load's), closed when the test ends.
func startClusterNode(t *testing.T, engine *core.Engine, self string, options map[string]string) *clusterNode {
	t.Helper()
	cfg, err := config.Load(options)
	if err != nil {
		t.Fatal(err)
	}
	cn, err := newClusterNode(engine, cfg, "tok", self, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cn.Close() })
	return cn
}

// nodeOp sends one node socket request and returns the reply's errno, the origin of an
// OpOpen reply and the descriptor it carried.
func nodeOp(t *testing.T, sock string, op uint32, root, path string) (syscall.Errno, core.Origin, *os.File) {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(nodesock.AppendRequest(nil, op, root, path)); err != nil {
		t.Fatal(err)
	}
	if err := nodesock.ReadAck(c); err != nil {
		t.Fatal(err)
	}
	hdr := make([]byte, 12)
	if op == nodesock.OpOpen {
		hdr = make([]byte, 16)
	}
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(hdr, oob)
	if err == nil && n < len(hdr) {
		_, err = io.ReadFull(c, hdr[n:])
	}
	if err != nil {
		t.Fatalf("reply: %v", err)
	}
	var f *os.File
	if oobn > 0 {
		msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
		fds, err := unix.ParseUnixRights(&msgs[0])
		if err != nil || len(fds) != 1 {
			t.Fatalf("rights: %v %v", fds, err)
		}
		f = os.NewFile(uintptr(fds[0]), path)
	}
	le := binary.LittleEndian
	errno := syscall.Errno(int32(le.Uint32(hdr[4:8])))
	if op != nodesock.OpOpen {
		return errno, 0, f
	}
	return errno, core.Origin(le.Uint32(hdr[8:12])), f
}

// openBytes opens path under root through the node socket sock, checks that the descriptor
// holds want, and returns its origin.
func openBytes(t *testing.T, sock, root, path string, want []byte) core.Origin {
	t.Helper()
	errno, origin, f := nodeOp(t, sock, nodesock.OpOpen, root, path)
	if errno != 0 || f == nil {
		t.Fatalf("open %s: errno %v, descriptor %v", path, errno, f)
	}
	got, err := io.ReadAll(f)
	f.Close()
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("open %s: %d bytes (%v), want the source's %d", path, len(got), err, len(want))
	}
	return origin
}

// The node socket of a cluster server that knows the job's servers answers a reader on its
// node with every file of the job, each from its owner: its own files from its tier, the
// other node's as memory files; OpFetch only for its own files; nothing outside its roots.
func TestClusterNodeSocketServesEveryFileFromItsOwner(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	want := map[string][]byte{}
	for i := range 30 {
		p := filepath.Join(root, fmt.Sprintf("f%02d", i))
		want[p] = bytes.Repeat([]byte{byte(i)}, 1000*i)
		if err := os.WriteFile(p, want[p], 0o644); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(outside, "secret"), []byte("no"), 0o644)
	self, engine := startEngineServer(t, "127.0.0.1", root)
	other, otherEngine := startEngineServer(t, "127.0.0.2", root)
	cn := startClusterNode(t, engine, self, map[string]string{"servers": self + "," + other, "node": "not-this-one",
		"wait_timeout": "5", "rpc_timeout": "2"})
	if cn.self != self || cn.cfg.Node != "127.0.0.1" {
		t.Fatalf("the server found itself as %q on node %q, want %q on 127.0.0.1", cn.self, cn.cfg.Node, self)
	}
	sock := filepath.Join(t.TempDir(), "s.node")
	var mu sync.Mutex // protects opens
	opens := map[core.Origin]int{}
	ns, err := nodesock.Listen(sock, nodeServer(engine, cn, nil, func() {}, func(o core.Origin, _ time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		opens[o]++
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()

	c, err := cn.client(context.Background(), root)
	if err != nil {
		t.Fatal(err)
	}
	owned := map[string]int{}
	for p, data := range want {
		owner := c.owner(p)
		owned[owner]++
		// The other node's files come from this server's tier too: it keeps a node-local
		// copy of what their owner sends (it has room), and OpFetch promises the file there.
		if origin := openBytes(t, sock, root, p, data); origin != core.OriginMemory {
			t.Errorf("open %s of %s: origin %v, want %v", p, owner, origin, core.OriginMemory)
		}
		if errno, _, _ := nodeOp(t, sock, nodesock.OpFetch, root, p); errno != 0 {
			t.Errorf("fetch %s of %s: errno %v, want 0", p, owner, errno)
		}
	}
	if owned[self] == 0 || owned[other] == 0 {
		t.Fatalf("a server owns no file: the test proves nothing (%v)", owned)
	}
	if s := engine.Stats(); s.SourceReads != int64(owned[self]) || s.Guests != int64(owned[other]) {
		t.Errorf("this server read %d files from the source and kept %d node-local copies, want its own %d and %d",
			s.SourceReads, s.Guests, owned[self], owned[other])
	}
	mu.Lock()
	if want := map[core.Origin]int{core.OriginMemory: owned[self] + owned[other]}; !maps.Equal(opens, want) {
		t.Errorf("opens observed by origin: got %v, want %v", opens, want)
	}
	mu.Unlock()
	// A write-open (OpForget) of a file the other node owns drops the copy there.
	var written string
	for p, data := range want {
		if c.owner(p) == other && len(data) > 0 {
			written = p
		}
	}
	held := func() (n int) {
		for _, u := range otherEngine.Usage() {
			n += u.Files
		}
		return n
	}
	before := held()
	for i := 0; i < 500 && before < owned[other]-1; i++ { // the empty file is not cached
		time.Sleep(10 * time.Millisecond)
		before = held()
	}
	if errno, _, _ := nodeOp(t, sock, nodesock.OpForget, root, written); errno != 0 {
		t.Errorf("forget %s: errno %v", written, errno)
	}
	if after := held(); after != before-1 {
		t.Errorf("the other node holds %d files after a forget, %d before: want one fewer", after, before)
	}
	errno, _, f := nodeOp(t, sock, nodesock.OpOpen, outside, filepath.Join(outside, "secret"))
	if errno != syscall.EACCES || f != nil {
		t.Errorf("a file outside the server's roots: errno %v, descriptor %v; want EACCES and none", errno, f)
	}
	if len(cn.clients) != 1 {
		t.Errorf("%d cluster clients, want 1 (none for a root the server does not serve)", len(cn.clients))
	}
}
