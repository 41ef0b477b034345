package client

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/rpctest"
)

// A fresh client (a new DataLoader worker) of a job whose servers know one of them dead
// starts without waiting for it, and reads every file with its bytes: on a node without a
// server of the job, and on the dead server's own node; for a server killed (connections
// refused) and for one that hangs (connections taken, never answered); and for a server
// killed moments ago, before the survivors' membership found it dead, whose connections are
// refused although the membership still holds it alive. Before, each such client waited the
// whole wait_timeout (20 s here) for the dead server, and on its node twice: once for the
// node's server, once for the same server on the ring.
func TestFreshClientWaitsForNoServerTheJobKnowsDead(t *testing.T) {
	root := t.TempDir()
	want := map[string][]byte{}
	for i := range 40 {
		name := fmt.Sprintf("f%02d.bin", i)
		want[name] = bytes.Repeat([]byte{byte(i)}, 100+i)
		writeFile(t, root, name, want[name])
	}
	for _, tc := range []struct {
		name string
		hung bool // the dead server hangs rather than refuses
		own  bool // the client is on the dead server's node
		// lately: the survivors' membership has not found it dead yet, and holds it alive
		lately bool
	}{
		{name: "killed lately, client on its node", own: true, lately: true},
		{name: "killed, client on a node without a server"},
		{name: "killed, client on its node", own: true},
		{name: "hung, client on a node without a server", hung: true},
		{name: "hung, client on its node", hung: true, own: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var members []string // what the survivors' membership holds alive
			srvCfg := rpc.ServerConfig{Members: func() (alive, dead, reported []string) { return members, nil, nil }}
			var servers []*testServer
			for i := 1; i <= 3; i++ {
				servers = append(servers, startClusterServerWithConfig(t, fmt.Sprintf("127.0.0.%d", i), root, "64MiB", srvCfg))
			}
			dead := &testServer{addr: rpctest.Hang(t, "127.0.0.4")}
			if !tc.hung {
				s := startClusterServer(t, "127.0.0.4", root)
				s.stop()
				dead = s
			}
			for _, s := range append(servers, dead) {
				members = append(members, s.addr)
			}
			for _, s := range servers { // what the servers' membership tells them
				if !tc.lately {
					s.h.Learn(dead.addr, false)
				}
			}
			opts := map[string]string{"wait_timeout": "20"}
			if tc.own {
				opts["node"] = "127.0.0.4"
			}
			cfg := clusterConfig(t, opts, append(servers, dead)...)
			start := time.Now()
			c, err := Open(root, cfg, discardLogger())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			opened := time.Since(start)
			t.Logf("opened in %s", opened)
			for name, data := range want {
				if got := readBytes(t, c, name); !bytes.Equal(got, data) {
					t.Fatalf("%s: wrong bytes", name)
				}
			}
			// Generous against a loaded machine; what is tested is that it waits for nothing.
			if d := time.Since(start); d > 4*time.Second {
				t.Errorf("open took %s and reading %d files %s; want no wait for the dead server (wait_timeout 20s)",
					opened, len(want), d)
			}
			if c.cluster == nil {
				t.Fatal("no direct path: want the ring, the node's server being dead")
			}
			if got := c.cluster.Counts().Gossiped; got != 1 && !tc.lately {
				t.Errorf("servers taken for dead on the servers' word: %d, want 1", got)
			}
		})
	}
}

// With every listed server unreachable (a job started before its servers came up, or a typo)
// the client fails within seconds, with an error that names each address and why it gave no
// answer: refused, timed out, or not proving the job token. Before, the first read waited
// wait_timeout (60 s) in silence twice, then failed with "connection refused".
func TestNoServerAnsweringFailsFastNamingEach(t *testing.T) {
	root := t.TempDir()
	writeFile(t, root, "a", []byte("a"))
	refused := &testServer{addr: rpctest.Refused(t, "127.0.0.1")}
	hung := &testServer{addr: rpctest.Hang(t, "127.0.0.2")}
	other := startClusterServer(t, "127.0.0.3", root) // the token "tok": the client has another
	cfg := clusterConfig(t, map[string]string{"wait_timeout": "60", "token": "not-tok", "node": "127.0.0.1"},
		refused, hung, other)
	start := time.Now()
	c, err := Open(root, cfg, discardLogger())
	took := time.Since(start)
	if err == nil {
		c.Close()
		t.Fatal("Open succeeded with no server answering")
	}
	t.Log(err)
	if took > 15*time.Second {
		t.Errorf("Open failed after %s; want a few seconds, not wait_timeout (60s)", took)
	}
	for addr, why := range map[string]string{refused.addr: "refused", hung.addr: "timed out", other.addr: "job token"} {
		if !strings.Contains(err.Error(), addr+": ") || !strings.Contains(err.Error(), why) {
			t.Errorf("the error does not say %s for %s", why, addr)
		}
	}
}

// A reader started with the job's servers (srun starts them at once) whose node's server
// binds its port a moment after the others answered still reads through its node's server:
// the server is given the start grace, not taken for dead. The others' membership has not
// heard of it yet.
func TestNodeServerStartingAMomentLateIsWaitedFor(t *testing.T) {
	root := t.TempDir()
	writeFile(t, root, "a", []byte("a"))
	var servers []*testServer
	for i := 1; i <= 3; i++ {
		servers = append(servers, startClusterServer(t, fmt.Sprintf("127.0.0.%d", i), root))
	}
	late := &testServer{addr: rpctest.Refused(t, "127.0.0.4")}
	cfg := clusterConfig(t, map[string]string{"wait_timeout": "20", "node": "127.0.0.4"}, append(servers, late)...)
	type opened struct {
		c   *Client
		err error
	}
	done := make(chan opened, 1)
	go func() {
		c, err := Open(root, cfg, discardLogger())
		done <- opened{c, err}
	}()
	time.Sleep(time.Second)
	startClusterServerWithConfig(t, late.addr, root, "64MiB", rpc.ServerConfig{})
	o := <-done
	if o.err != nil {
		t.Fatal(o.err)
	}
	defer o.c.Close()
	// In-process servers serve no node socket: the reader takes the direct path, with the
	// node's server alive on it.
	if _, dead := o.c.cluster.Peers()[late.addr].State(); dead {
		t.Errorf("the node's server, started a moment late, was taken for dead")
	}
}
