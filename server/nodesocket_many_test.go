package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/internal/splice"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// countedServer is an engine serving root over RPC on host, with its requests counted.
type countedServer struct {
	addr     string
	engine   *core.Engine
	requests atomic.Int64
	stop     func()
}

func startCountedServer(t *testing.T, host, root string) *countedServer {
	t.Helper()
	e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: "64MiB"}},
		Roots: []string{root}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	s := &countedServer{addr: ln.Addr().String(), engine: e}
	srv, _, _ := rpc.Serve(e, ln, rpc.ServerConfig{Token: "tok", OnRequest: func() { s.requests.Add(1) }})
	stopped := false
	s.stop = func() {
		if !stopped {
			stopped = true
			srv.Stop()
			e.Close()
		}
	}
	t.Cleanup(s.stop)
	return s
}

// A batch of a reader on this node (OpOpenMany) is opened with one ReadBatch call per server
// on another node that owns some of its files, whatever their number; each file has its bytes
// or its own error (a missing file ENOENT, one outside the roots EACCES). A server that died
// since is found out by its batch call: its files go to their new owners (recache), with the
// right bytes still.
func TestClusterNodeSocketOpensABatchWithACallPerOwner(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	want := map[string][]byte{}
	var first, second []string
	for i := range 120 {
		p := filepath.Join(root, fmt.Sprintf("f%03d", i))
		want[p] = bytes.Repeat([]byte{byte(i)}, 100*i+1)
		if err := os.WriteFile(p, want[p], 0o644); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			first = append(first, p)
		} else {
			second = append(second, p)
		}
	}
	os.WriteFile(filepath.Join(outside, "secret"), []byte("no"), 0o644)
	self, engine := startEngineServer(t, "127.0.0.1", root)
	others := []*countedServer{startCountedServer(t, "127.0.0.2", root), startCountedServer(t, "127.0.0.3", root),
		startCountedServer(t, "127.0.0.4", root)}
	servers := self
	for _, o := range others {
		servers += "," + o.addr
	}
	cn := startClusterNode(t, engine, self, map[string]string{"servers": servers, "node": "127.0.0.1",
		"wait_timeout": "5", "rpc_timeout": "2", "policy": "recache"})
	sock := filepath.Join(t.TempDir(), "s.node")
	var opens atomic.Int64
	ns, err := nodesock.Listen(sock, nodeServer(engine, cn, nil, func() {}, func(core.Origin, time.Duration) { opens.Add(1) }))
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	c, err := cn.client(context.Background(), root)
	if err != nil {
		t.Fatal(err)
	}
	owned := map[string]int{}
	for _, p := range first {
		owned[c.owner(p)]++
	}
	for _, o := range others {
		if owned[o.addr] == 0 {
			t.Fatalf("server %s owns no file of the batch: the test proves nothing (%v)", o.addr, owned)
		}
	}

	// The first batch, with a missing file and one outside the roots among the others.
	missing, secret := filepath.Join(root, "missing"), filepath.Join(outside, "secret")
	batch := append([]string{missing}, first...)
	batch = append(batch, secret)
	before := make([]int64, len(others))
	for i, o := range others {
		before[i] = o.requests.Load()
	}
	got := openMany(t, sock, root, batch)
	checkBatch(t, batch, got, want)
	if !errors.Is(got[0].Err, fs.ErrNotExist) || !errors.Is(got[len(got)-1].Err, syscall.EACCES) {
		t.Errorf("a missing file: %v, want ENOENT; a file outside the roots: %v, want EACCES",
			got[0].Err, got[len(got)-1].Err)
	}
	for i, o := range others {
		if n := o.requests.Load() - before[i]; n != 1 {
			t.Errorf("server %s owns %d files of the batch and had %d requests for it, want 1", o.addr, owned[o.addr], n)
		}
	}
	if n := opens.Load(); n != int64(len(first)) {
		t.Errorf("%d opens observed, want the batch's %d files", n, len(first))
	}

	// A server dies: the next batch finds it out, and its files come from their new owners.
	dead := others[2]
	n := 0
	for _, p := range second {
		if c.owner(p) == dead.addr {
			n++
		}
	}
	if n == 0 {
		t.Fatalf("%s owns no file of the second batch: the test proves nothing", dead.addr)
	}
	dead.stop()
	got = openMany(t, sock, root, second)
	checkBatch(t, second, got, want)
	for _, p := range second {
		if c.owner(p) == dead.addr {
			t.Errorf("%s is still placed on the dead server %s", p, dead.addr)
			break
		}
	}
}

// openMany opens paths through the node socket sock in one batch.
func openMany(t *testing.T, sock, root string, paths []string) []nodesock.Opened {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got, err := nodesock.OpenMany(ctx, sock, root, paths)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// checkBatch checks that each file of paths that want has came with its bytes (through its
// descriptor, or inline), and closes the descriptors.
func checkBatch(t *testing.T, paths []string, got []nodesock.Opened, want map[string][]byte) {
	t.Helper()
	for i, p := range paths {
		o := got[i]
		if o.File != nil {
			defer o.File.Close()
		}
		if o.Release != nil {
			defer o.Release()
		}
		data, ok := want[p]
		if !ok {
			continue
		}
		if o.Err != nil {
			t.Errorf("%s: %v", p, o.Err)
			continue
		}
		b, err := o.Data, error(nil)
		if o.File != nil {
			b, err = io.ReadAll(o.File)
		}
		if err != nil || !bytes.Equal(b, data) {
			t.Errorf("%s: %d bytes (%v), want its %d", p, len(b), err, len(data))
		}
	}
}

// A node without room for node-local copies relays the files that servers on other nodes
// send through pipes (package splice), never holding their bytes: each file comes with its
// bytes, whether it fits in a pipe or not, and every pipe is back once the batch is answered.
func TestClusterNodeSocketRelaysOtherNodesFilesThroughPipes(t *testing.T) {
	root := t.TempDir()
	want := map[string][]byte{}
	var paths []string
	for i := range 48 {
		p := filepath.Join(root, fmt.Sprintf("f%03d", i))
		size := 1 + i*5000
		if i%12 == 11 {
			size = splice.Max + 1000*i // larger than a pipe: through memory
		}
		want[p] = bytes.Repeat([]byte{byte(i), byte(i >> 8), 7}, size/3+1)[:size]
		if err := os.WriteFile(p, want[p], 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	self, engine := startEngineServerWithBudget(t, "127.0.0.1", root, "256KiB")
	servers := self
	for _, host := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"} {
		servers += "," + startCountedServer(t, host, root).addr
	}
	cn := startClusterNode(t, engine, self, map[string]string{"servers": servers, "node": "127.0.0.1",
		"wait_timeout": "5", "rpc_timeout": "5"})
	sock := filepath.Join(t.TempDir(), "s.node")
	ns, err := nodesock.Listen(sock, nodeServer(engine, cn, nil, func() {}, nil))
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()

	// The first batch fills the node's tier with what its copies can take.
	checkBatch(t, paths, openMany(t, sock, root, paths), want)
	before, _ := splice.Counts()
	checkBatch(t, paths, openMany(t, sock, root, paths), want)
	got, _ := splice.Counts()
	if got == before {
		t.Error("no file of the second batch went through a pipe")
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, inUse := splice.Counts(); inUse != 0; _, inUse = splice.Counts() {
		if time.Now().After(deadline) {
			t.Fatalf("%d pipes not given back after the batch", inUse)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
