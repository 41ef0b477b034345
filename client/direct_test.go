package client

import (
	"bytes"
	"fmt"
	"maps"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fitcache/fitcache/config"
)

// clusterConfig configures a client of the servers (on node "n0", which none is on), with
// opts added.
func clusterConfig(t *testing.T, opts map[string]string, servers ...*testServer) config.Config {
	t.Helper()
	var addrs []string
	for _, s := range servers {
		addrs = append(addrs, s.addr)
	}
	o := map[string]string{"servers": strings.Join(addrs, ","), "token": "tok", "node": "n0", "wait_timeout": "5",
		"rpc_timeout": "2"}
	maps.Copy(o, opts)
	cfg, err := config.Load(o)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// squat listens at addr, answers whatever a connection sends with 64 bytes of garbage, and
// records what it was sent. It is what another user gets by binding the port of a server of
// the job that died.
func squat(t *testing.T, addr string) (received func() []byte) {
	t.Helper()
	var ln net.Listener
	var err error
	for range 50 { // the dead server's port may take a moment to be free
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex // protects got
	var got []byte
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range 100 {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.SetDeadline(time.Now().Add(2 * time.Second))
			buf := make([]byte, 4096)
			n, _ := c.Read(buf)
			c.Write(bytes.Repeat([]byte{'A'}, 64))
			m, _ := c.Read(buf[n:])
			mu.Lock()
			got = append(got, buf[:n+m]...)
			mu.Unlock()
			c.Close()
		}
	}()
	stop := func() { ln.Close(); wg.Wait() }
	t.Cleanup(stop)
	return func() []byte {
		stop()
		mu.Lock()
		defer mu.Unlock()
		return got
	}
}

// TestSquatterAtADeadServersAddress: a server of the job dies and another user binds its
// port. The client gives that listener nothing but a nonce, declares the server dead at the
// first call (as for a refused connection), and reads every file with its bytes. On the main
// branch before this change the client sent the squatter the job token, and took its answer
// for a refusal of the token: the reads of the dead server's files failed with EACCES, and
// the server was never declared dead.
func TestSquatterAtADeadServersAddress(t *testing.T) {
	root := t.TempDir()
	want := map[string][]byte{}
	for i := range 40 {
		name := fmt.Sprintf("f%02d.bin", i)
		want[name] = bytes.Repeat([]byte{byte(i)}, 1000+i)
		writeFile(t, root, name, want[name])
	}
	a, b := startClusterServer(t, "127.0.0.1", root), startClusterServer(t, "127.0.0.2", root)
	c, err := Open(root, clusterConfig(t, nil, a, b), discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b.stop()
	received := squat(t, b.addr)
	for name, data := range want {
		if got := readBytes(t, c, name); !bytes.Equal(got, data) {
			t.Fatalf("%s: wrong bytes", name)
		}
	}
	if got := c.cluster.Counts().Deaths; got != 1 {
		t.Errorf("servers declared dead: %d, want 1", got)
	}
	if got := c.cluster.Counts().Failures; got != 1 {
		t.Errorf("failed calls: %d, want 1 (the squatter declared dead at the first)", got)
	}
	if got := received(); bytes.Contains(got, []byte("tok")) || len(got) == 0 {
		t.Errorf("the squatter received %q: want the handshake's hello and no token", got)
	}
}

// TestReplicaCopiesCarryTheirOwnersStamp: with two replicas, the files a client reads over
// RPC from the source reach their replica with a stamp it accepts.
func TestReplicaCopiesCarryTheirOwnersStamp(t *testing.T) {
	root := t.TempDir()
	for i := range 30 {
		writeFile(t, root, fmt.Sprintf("rpc%02d.bin", i), bytes.Repeat([]byte{byte(i)}, 5000))
	}
	a, b := startClusterServer(t, "127.0.0.1", root), startClusterServer(t, "127.0.0.2", root)
	cfg := clusterConfig(t, map[string]string{"replicas": "2"}, a, b)
	c, err := Open(root, cfg, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	for i := range 30 {
		readBytes(t, c, fmt.Sprintf("rpc%02d.bin", i))
	}
	c.Close() // waits for the replica copies
	sa, sb := a.engine.Stats(), b.engine.Stats()
	// (The owners publish their copies in the background.)
	waitFor(t, func() bool { return cachedFiles(a)+cachedFiles(b) == 2*30 })
	if stored, refused := sa.Stored+sb.Stored, sa.StoreRefused+sb.StoreRefused; stored != 30 || refused != 0 {
		t.Errorf("%d replica copies stored, %d refused; want 30 (one per file), none refused", stored, refused)
	}
}
