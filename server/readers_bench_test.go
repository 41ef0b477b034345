package server

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/internal/testserver"
	"github.com/fitcache/fitcache/routing"
	"github.com/fitcache/fitcache/rpc"
)

// BenchmarkOpenRemote measures what a cluster server does for a reader of its node
// that misses a file another node owns and the node has no room to keep (the data plane of a
// dataset larger than the node's share): the remote read over Kitex and the memory file.
func BenchmarkOpenRemote(b *testing.B) {
	root := b.TempDir()
	self := testserver.Start(b, "127.0.0.1", root, "1MiB", rpc.ServerConfig{})
	remote := testserver.Start(b, "127.0.0.2", root, "256MiB", rpc.ServerConfig{})
	cfg, err := config.Load(map[string]string{"servers": self.Addr + "," + remote.Addr, "token": "tok",
		"node": "127.0.0.1", "wait_timeout": "5", "rpc_timeout": "5"})
	if err != nil {
		b.Fatal(err)
	}
	cfg.Direct = true
	c, err := newRootReader(root, cfg, nil, self.Engine, self.Addr, routing.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer c.close()
	var names []string
	for i := 0; len(names) < 64; i++ {
		name := fmt.Sprintf("f%04d.bin", i)
		if c.owner(name) == remote.Addr {
			os.WriteFile(filepath.Join(root, name), make([]byte, 110<<10), 0o644)
			names = append(names, name)
		}
	}
	ctx := context.Background()
	for _, n := range names { // cached at the owner
		f, _, err := c.open(ctx, n)
		if err != nil {
			b.Fatal(err)
		}
		f.Close()
	}
	b.SetBytes(110 << 10)
	b.ResetTimer()
	for i := range b.N {
		f, _, err := c.open(ctx, names[i%len(names)])
		if err != nil {
			b.Fatal(err)
		}
		f.Close()
	}
}
