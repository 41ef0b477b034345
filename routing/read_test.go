package routing

import (
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
)

// Replica copies are bounded: a file over the size limit is not copied, and Close waits for
// the copies in flight.
func TestReplicaCopiesAreBoundedAndAwaited(t *testing.T) {
	e, err := core.NewEngine(core.EngineConfig{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, _, _ := rpc.Serve(e, ln, rpc.ServerConfig{Token: "t"})
	defer srv.Stop()
	rc, err := rpc.Dial(ln.Addr().String(), rpc.ClientConfig{Token: "t"})
	if err != nil {
		t.Fatal(err)
	}
	r := &Router{log: slog.New(slog.DiscardHandler), stop: make(chan struct{}), stopped: make(chan struct{}),
		peers: map[string]*Peer{}}
	p := &Peer{rpc: rc}
	r.peers["replica"] = p
	close(r.stopped)
	root := t.TempDir()
	small := filepath.Join(root, "small")
	if err := os.WriteFile(small, []byte("small"), 0o644); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(small)
	stamp := rpc.NewStamper("t").Stamp(small, core.Result{Data: []byte("small"), MTimeNanos: fi.ModTime().UnixNano()})
	r.Replicate([]*Peer{p}, root, filepath.Join(root, "big"), make([]byte, replicaMaxFile+1), rpc.Stamp{})
	r.Replicate([]*Peer{p}, root, small, []byte("small"), stamp)
	r.Close() // waits for the copy in flight
	if got := r.replicasSkipped.Load(); got != 1 {
		t.Errorf("replica copies skipped: %d, want 1 (the file over %d bytes)", got, replicaMaxFile)
	}
	if got := e.Stats().Stored; got != 1 {
		t.Errorf("replica copies stored once Close returned: %d, want 1", got)
	}
	if got := r.replicaBytes.Load(); got != 0 {
		t.Errorf("replica bytes in flight after Close: %d", got)
	}
}
