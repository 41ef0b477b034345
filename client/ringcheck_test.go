package client_test

import (
	"bytes"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/fitcache/fitcache/client"
	"github.com/fitcache/fitcache/config"
)

// A client whose ring differs from its servers' (virtual_nodes set on the client only, or
// another list of servers) is told so once, by the first hello that names another ring, on a
// node with servers of the job or without; one on the same ring is told nothing. It reads
// either way.
func TestAClientOnAnotherRingThanItsServersIsTold(t *testing.T) {
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "f.bin"), []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	j := newNodeJob(t, root)
	for _, tc := range []struct {
		name    string
		options map[string]string
		warned  string // what the warning names; "" for none
	}{
		{name: "the same ring"},
		{name: "the same ring, virtual_nodes named", options: map[string]string{"virtual_nodes": "1000"}},
		{name: "virtual_nodes set on the client only", options: map[string]string{"virtual_nodes": "100"},
			warned: "virtual_nodes=100 servers=2"},
		{name: "a server missing from the client's list", options: map[string]string{"servers": j.addrs[0]},
			warned: "virtual_nodes=1000 servers=1"},
		// It reads through its node's server, but over the ring when that server dies.
		{name: "on a server's node, the same ring", options: map[string]string{"node": "127.0.0.1",
			"runtime_dir": j.runDirs[0]}},
		{name: "on a server's node, virtual_nodes set on the client only", options: map[string]string{
			"node": "127.0.0.1", "runtime_dir": j.runDirs[0], "virtual_nodes": "100"}, warned: "virtual_nodes=100 servers=2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := map[string]string{"servers": strings.Join(j.addrs[:], ","), "token": "tok", "node": "elsewhere",
				"wait_timeout": "1", "rpc_timeout": "2"}
			for k, v := range tc.options {
				o[k] = v
			}
			cfg, err := config.Load(o)
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var logged bytes.Buffer
			c, err := client.Open(root, cfg, slog.New(slog.NewTextHandler(lockedWriter{&mu, &logged}, nil)))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			got, err := c.Read("f.bin")
			if err != nil {
				t.Fatal(err)
			}
			if string(got.Bytes()) != "data" {
				t.Errorf("read %q", got.Bytes())
			}
			got.Release()
			mu.Lock()
			defer mu.Unlock()
			warnings := strings.Count(logged.String(), "another ring than this client")
			switch {
			case tc.warned == "" && warnings != 0:
				t.Errorf("want no warning, got:\n%s", logged.String())
			case tc.warned != "" && (warnings != 1 || !strings.Contains(logged.String(), tc.warned)):
				t.Errorf("want one warning naming %q, got %d:\n%s", tc.warned, warnings, logged.String())
			}
		})
	}
}

// lockedWriter writes to w under mu: a logger's writes from several goroutines.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
