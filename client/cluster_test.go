package client

import (
	"testing"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/internal/testserver"
	"github.com/fitcache/fitcache/rpc"
)

// Cluster servers run in the test process (package testserver), for the tests of the direct
// path.

// testServer is a cluster server run in this process.
type testServer struct {
	*testserver.Server
	addr   string
	engine *core.Engine
	h      *rpc.Handler
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
	s := testserver.Start(t, host, root, budget, cfg)
	return &testServer{Server: s, addr: s.Addr, engine: s.Engine, h: s.Handler}
}

// stop stops the server as a kill would.
func (s *testServer) stop() { s.Stop() }

// sourceReads sums the source reads of the servers.
func sourceReads(servers []*testServer) int64 {
	var n int64
	for _, s := range servers {
		n += testserver.SourceReads(s.Server)
	}
	return n
}

// cachedFiles is how many files a server's tiers hold.
func cachedFiles(s *testServer) int { return s.CachedFiles() }
