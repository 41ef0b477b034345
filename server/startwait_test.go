package server

import (
	"bytes"
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fitcache/fitcache/client"
	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/rpctest"
)

// A listed server that never started costs the job's first client the wait_timeout (it may
// still be starting) and later clients nothing: the servers, up for wait_timeout without
// hearing of it in their membership, name it dead in their hello replies. Before, every new
// client (each DataLoader worker of each epoch) waited the whole wait_timeout for it.
func TestAServerThatNeverStartedCostsOnlyTheFirstClient(t *testing.T) {
	root, files := dataset(t, 20)
	const wait = 4 * time.Second
	ghost := rpctest.Hang(t, "127.0.0.3")
	a, b := tcpConfig(t, root), tcpConfig(t, root)
	a.Listen, b.Listen = freePort(t, "127.0.0.1"), freePort(t, "127.0.0.2")
	servers := strings.Join([]string{a.Listen, b.Listen, ghost}, ",")
	job := func(node string) config.Config {
		cfg, err := config.Load(map[string]string{"servers": servers, "token": "tok", "node": node,
			"wait_timeout": wait.String(), "rpc_timeout": "2", "probe_interval": "200ms"})
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	a.Cluster, b.Cluster = job("127.0.0.1"), job("127.0.0.2")
	start(t, a)
	start(t, b)
	begun := time.Now()

	open := func() (*client.Client, time.Duration) {
		t.Helper()
		at := time.Now()
		c, err := client.Open(root, job("n0"), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c, time.Since(at)
	}
	first, took := open()
	t.Logf("the first client started in %s", took)
	if took < wait/2 {
		t.Errorf("the first client started in %s; want it to wait for a server that may still be starting (wait_timeout %s)",
			took, wait)
	}
	readFiles(t, first, files)

	hello, err := rpc.Dial(a.Listen, rpc.ClientConfig{Token: "tok"})
	if err != nil {
		t.Fatal(err)
	}
	defer hello.Close()
	for !slices.Contains(helloDead(t, hello), ghost) {
		if time.Since(begun) > wait+15*time.Second {
			t.Fatalf("the server's hello names %v dead %s after it started; want the server that never started, %s",
				helloDead(t, hello), time.Since(begun), ghost)
		}
		time.Sleep(50 * time.Millisecond)
	}
	later, took := open()
	t.Logf("a later client started in %s", took)
	if took > wait/2 {
		t.Errorf("a later client started in %s; want no wait for the server the job's servers name dead", took)
	}
	readFiles(t, later, files)
}

func helloDead(t *testing.T, c *rpc.Client) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	reply, err := c.Hello(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return reply.Dead
}

// readFiles reads every file through c and checks its bytes.
func readFiles(t *testing.T, c *client.Client, files map[string][]byte) {
	t.Helper()
	for p, want := range files {
		buf, err := c.Read(p)
		if err != nil {
			t.Fatalf("read %s: %v", p, err)
		}
		if !bytes.Equal(buf.Bytes(), want) {
			t.Fatalf("read %s: wrong bytes", p)
		}
		buf.Release()
	}
}
