package client

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// startPrefetchServer is startServer with prefetch on; it returns the engine too.
func startPrefetchServer(t *testing.T) (config.Config, *core.Engine) {
	t.Helper()
	cfg, err := config.Load(map[string]string{"runtime_dir": t.TempDir(), "tiers": "memory:" + t.TempDir() + ":64MiB"})
	if err != nil {
		t.Fatal(err)
	}
	tierCfgs, _ := cfg.TierConfigs()
	e, err := core.NewEngine(core.EngineConfig{Tiers: tierCfgs, Prefetch: core.PrefetchConfig{Reads: cfg.Prefetch}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := rpc.ListenUnix(embedded.SocketPath(cfg.RuntimeDir))
	if err != nil {
		t.Fatal(err)
	}
	srv, _, _ := rpc.Serve(e, ln, rpc.ServerConfig{})
	t.Cleanup(func() { srv.Stop(); e.Close() })
	cfg.ServerBin = "/nonexistent/fitcache"
	return cfg, e
}

// files writes n small files under a new root and returns the root and their names.
func files(t *testing.T, n int) (string, []string) {
	t.Helper()
	root := t.TempDir()
	var names []string
	for i := range n {
		name := fmt.Sprintf("f%03d.bin", i)
		writeFile(t, root, name, []byte(strings.Repeat("d", 100+i)))
		names = append(names, name)
	}
	return root, names
}

// waitPrefetched waits until the client's prefetch jobs end and returns their progress.
func waitPrefetched(t *testing.T, c *Client) core.PrefetchInfo {
	t.Helper()
	var info core.PrefetchInfo
	waitFor(t, func() bool {
		info = c.PrefetchStatus()
		return info.Terminal()
	})
	return info
}

func TestPrefetchThenReadsHit(t *testing.T) {
	cfg, e := startPrefetchServer(t)
	root, names := files(t, 30)
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	list := append([]string(nil), names...)
	list[0] = filepath.Join(root, list[0]) // absolute and relative paths both work
	if err := c.Prefetch(list); err != nil {
		t.Fatal(err)
	}
	if info := waitPrefetched(t, c); info.State != core.PrefetchDone || info.Fetched != len(names) {
		t.Fatalf("prefetch: %+v, want done with %d files fetched", info, len(names))
	}
	for _, name := range names {
		readBytes(t, c, name)
	}
	if cs := c.counts.localHits.Load(); cs != int64(len(names)) {
		t.Errorf("reads after prefetch: %d local hits, want %d", cs, len(names))
	}
	if s := e.Stats(); s.SourceReads != int64(len(names)) || s.Misses != 0 {
		t.Errorf("server: %d source reads, %d misses; want %d and 0", s.SourceReads, s.Misses, len(names))
	}
	if err := c.Prefetch([]string{"../outside"}); !errors.Is(err, core.ErrOutsideRoot) {
		t.Errorf("a path outside the root: got %v, want ErrOutsideRoot", err)
	}
}

// A list longer than a chunk arrives whole; a second client of the same job (a DataLoader
// worker) with the same list shares the job after its first chunk. A client of another job
// gets a job of its own, which checks the copies for its session and reads nothing again.
func TestPrefetchChunksAndSharedList(t *testing.T) {
	defer func(n int) { prefetchChunkPaths = n }(prefetchChunkPaths)
	prefetchChunkPaths = 3
	cfg, e := startPrefetchServer(t)
	cfg.Job = "one-training-run"
	root, names := files(t, 10)
	var clients []*Client
	for range 2 {
		c, err := Open(root, cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
		if err := c.Prefetch(names); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range clients {
		if info := waitPrefetched(t, c); info.State != core.PrefetchDone || info.Done != len(names) || info.Files != len(names) {
			t.Errorf("client %d: %+v, want done with %d files", i, info, len(names))
		}
	}
	if s := e.Stats(); s.Prefetch.Jobs != 1 || s.SourceReads != int64(len(names)) {
		t.Errorf("server: %d jobs, %d source reads; want 1 shared job and %d reads", s.Prefetch.Jobs, s.SourceReads, len(names))
	}
	cfg.Job = "the-next-run"
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Prefetch(names); err != nil {
		t.Fatal(err)
	}
	if info := waitPrefetched(t, c); info.State != core.PrefetchDone || info.SkippedCached != len(names) {
		t.Errorf("next run: %+v, want done with every file cached already", info)
	}
	if s := e.Stats(); s.Prefetch.Jobs != 2 || s.SourceReads != int64(len(names)) || s.SourceChecks != int64(len(names)) {
		t.Errorf("after the next run: %d jobs, %d source reads, %d source checks; want 2 jobs, %d reads and %d checks",
			s.Prefetch.Jobs, s.SourceReads, s.SourceChecks, len(names), len(names))
	}
}

// In cluster mode each server is sent, and prefetches, the files it owns.
func TestPrefetchClusterEachServerItsOwn(t *testing.T) {
	root, names := files(t, 60)
	var addrs []string
	engines := map[string]*core.Engine{}
	for range 3 {
		e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: "16MiB"}},
			Roots: []string{root}, Prefetch: core.PrefetchConfig{Reads: 4}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv, _, _ := rpc.Serve(e, ln, rpc.ServerConfig{Token: "tok"})
		t.Cleanup(func() { srv.Stop(); e.Close() })
		addrs = append(addrs, ln.Addr().String())
		engines[ln.Addr().String()] = e
	}
	cfg, err := config.Load(map[string]string{"servers": strings.Join(addrs, ","), "token": "tok",
		"node": "elsewhere", "wait_timeout": "10", "rpc_timeout": "5"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Prefetch(names); err != nil {
		t.Fatal(err)
	}
	if info := waitPrefetched(t, c); info.State != core.PrefetchDone || info.Fetched != len(names) {
		t.Fatalf("prefetch: %+v, want done with %d files fetched", info, len(names))
	}
	owned := map[string]int64{}
	for _, name := range names {
		owned[c.cluster.Targets(filepath.Join(root, name))[0].ID()]++
	}
	for addr, e := range engines {
		if s := e.Stats(); s.SourceReads != owned[addr] || s.Prefetch.Fetched != owned[addr] {
			t.Errorf("server %s: %d source reads, %d fetched; want the %d files it owns", addr, s.SourceReads, s.Prefetch.Fetched, owned[addr])
		}
	}
	for _, name := range names {
		readBytes(t, c, name)
	}
	for addr, e := range engines {
		if s := e.Stats(); s.SourceReads != owned[addr] || s.Misses != 0 {
			t.Errorf("server %s after the reads: %d source reads, %d misses; want %d and 0", addr, s.SourceReads, s.Misses, owned[addr])
		}
	}
}

// A server that stops answering renewals is taken to have lost the job after a few, so that
// whoever follows the job (fitcache warmup) stops waiting; one answer resets the count.
func TestPrefetchJobLostWithItsServer(t *testing.T) {
	server, err := rpc.Dial(filepath.Join(t.TempDir(), "gone.sock"), rpc.ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	var j prefetchJobs
	j.set(server, core.PrefetchInfo{State: core.PrefetchRunning, Files: 10})
	gone := fmt.Errorf("%w: no answer", rpc.ErrUnavailable)
	for range maxRenewFailures - 1 {
		j.renewed(server, core.PrefetchInfo{}, gone)
	}
	j.renewed(server, core.PrefetchInfo{State: core.PrefetchRunning, Files: 10, Done: 3}, nil)
	for i := range maxRenewFailures {
		if got := j.jobs[server].State; got != core.PrefetchRunning {
			t.Fatalf("after %d failed renewals: state %q, want running", i, got)
		}
		j.renewed(server, core.PrefetchInfo{}, gone)
	}
	if got := j.jobs[server]; got.State != core.PrefetchUnknown || got.Done != 3 || len(got.Errors) != 1 {
		t.Errorf("after %d failed renewals in a row: %+v, want unknown, its progress and the reason", maxRenewFailures, got)
	}
}
