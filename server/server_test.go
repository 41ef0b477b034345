package server

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/membership"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/rpctest"
	"github.com/fitcache/fitcache/tiers"
)

// dataset writes n files of distinct sizes and bytes under a new directory and returns it
// with their contents by path.
func dataset(t *testing.T, n int) (string, map[string][]byte) {
	t.Helper()
	root := t.TempDir()
	files := map[string][]byte{}
	for i := range n {
		p := filepath.Join(root, fmt.Sprintf("f%02d", i))
		files[p] = bytes.Repeat([]byte{byte(i + 1)}, 1000*(i+1))
		if err := os.WriteFile(p, files[p], 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root, files
}

// embeddedConfig is the configuration of an embedded server in a new runtime directory,
// with a memory tier of its own.
func embeddedConfig(t *testing.T) Config {
	t.Helper()
	dir := t.TempDir()
	return Config{Embedded: true, RuntimeDir: filepath.Join(dir, "run"),
		Tiers: []tiers.Config{{Kind: tiers.Memory, Dir: filepath.Join(dir, "tier"), Budget: "64MiB"}}}
}

// tcpConfig is the configuration of a TCP server on 127.0.0.1 with the job token of
// startEngineServer, serving root, with a memory tier of its own.
func tcpConfig(t *testing.T, root string) Config {
	t.Helper()
	dir := t.TempDir()
	return Config{Listen: "127.0.0.1:0", Token: "tok", Roots: []string{root}, RuntimeDir: filepath.Join(dir, "run"),
		Tiers: []tiers.Config{{Kind: tiers.Memory, Dir: filepath.Join(dir, "tier"), Budget: "64MiB"}}}
}

// start starts a server that the test closes at its end (a second Close does nothing).
func start(t *testing.T, cfg Config) *Server {
	t.Helper()
	s, err := Start(cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// readAll reads every file through an RPC client of the server at addr and checks its bytes.
func readAll(t *testing.T, addr, token, root string, files map[string][]byte) {
	t.Helper()
	c, err := rpc.Dial(addr, rpc.ClientConfig{Token: token})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for p, want := range files {
		r, err := c.Read(context.Background(), root, p, false)
		if err != nil {
			t.Fatalf("read %s through %s: %v", p, addr, err)
		}
		if !bytes.Equal(r.Data, want) {
			t.Fatalf("read %s through %s: %d bytes, want the source's %d", p, addr, len(r.Data), len(want))
		}
	}
}

// exists reports whether something is at path.
func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// eventually polls cond every 10 ms for up to 5 s.
func eventually(cond func() bool) bool {
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}

// openFDs counts the descriptors this process has open.
func openFDs(t *testing.T) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("cannot count descriptors: %v", err)
	}
	return len(fds)
}

// goroutines counts this process's goroutines, but for Kitex's balancer watchers: Kitex
// starts one for every client it makes and never stops it (its lbcache, not cacheable by
// default), the one with which Start probes a server without a token included.
func goroutines() (n int, stacks []byte) {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		if !bytes.Contains(g, []byte("lbcache.(*BalancerFactory).watcher")) {
			n++
		}
	}
	return n, buf
}

// holdsTiers checks that the server opened every tier of cfg (a tier another server still
// holds is skipped: see core.EngineConfig.Tiers).
func holdsTiers(t *testing.T, s *Server, cfg Config) {
	t.Helper()
	if got, want := len(s.Engine().TierDirs()), len(cfg.Tiers); got != want {
		t.Errorf("the server opened %d tiers, want %d (warnings: %v)", got, want, s.Engine().Stats().Warnings)
	}
}

// An embedded server answers on its socket, holds its lock and announces its node socket;
// Close removes its sockets and releases the lock and the tiers, so that the next embedded
// server of the runtime directory starts with the same tiers.
func TestEmbeddedServerStartsAndCloses(t *testing.T) {
	root, files := dataset(t, 5)
	cfg := embeddedConfig(t)
	for round := range 2 {
		s := start(t, cfg)
		sock := embedded.SocketPath(cfg.RuntimeDir)
		if s.Addr() != sock || s.NodeSocket() != nodesock.PathFor(sock) {
			t.Fatalf("round %d: address %q, node socket %q; want %q and its node socket", round, s.Addr(), s.NodeSocket(), sock)
		}
		holdsTiers(t, s, cfg)
		if pid := embedded.RunningPID(cfg.RuntimeDir); pid != os.Getpid() {
			t.Errorf("round %d: the embedded lock names pid %d, want this process", round, pid)
		}
		readAll(t, sock, "", root, files)
		if err := s.Close(); err != nil {
			t.Errorf("round %d: Close: %v", round, err)
		}
		for _, p := range []string{sock, s.NodeSocket()} {
			if exists(p) {
				t.Errorf("round %d: %s left after Close", round, p)
			}
		}
		if pid := embedded.RunningPID(cfg.RuntimeDir); pid != 0 {
			t.Errorf("round %d: the embedded lock is still held (pid %d) after Close", round, pid)
		}
	}
}

// A TCP server with a job token serves its files to clients that know the token and its
// metrics; Close frees its port, its metrics port and its tiers for the next server.
func TestTCPServerStartsAndCloses(t *testing.T) {
	root, files := dataset(t, 5)
	cfg := tcpConfig(t, root)
	cfg.MetricsAddr = "127.0.0.1:0"
	cfg.ReadyFile = filepath.Join(t.TempDir(), "ready")
	for round := range 2 {
		s := start(t, cfg)
		holdsTiers(t, s, cfg)
		if b, err := os.ReadFile(cfg.ReadyFile); err != nil || string(b) != s.Addr()+"\n" {
			t.Errorf("round %d: ready file %q (%v), want the address %s", round, b, err, s.Addr())
		}
		readAll(t, s.Addr(), cfg.Token, root, files)
		stranger, err := rpc.Dial(s.Addr(), rpc.ClientConfig{Token: "another-job"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := stranger.Stats(context.Background()); err == nil {
			t.Errorf("round %d: a client of another job was answered", round)
		}
		stranger.Close()
		resp, err := http.Get("http://" + s.MetricsAddr() + "/metrics")
		if err != nil {
			t.Fatalf("round %d: metrics: %v", round, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(body), "fitcache_source_reads_total") {
			t.Errorf("round %d: metrics without fitcache_source_reads_total:\n%.300s", round, body)
		}
		if err := s.Close(); err != nil {
			t.Errorf("round %d: Close: %v", round, err)
		}
		if exists(cfg.ReadyFile) {
			t.Errorf("round %d: the ready file is left after Close", round)
		}
		cfg.Listen, cfg.MetricsAddr = s.Addr(), s.MetricsAddr() // the next round takes the same ports
	}
}

// Close is idempotent, also when called at once from several goroutines, and closes Done.
func TestCloseIsIdempotent(t *testing.T) {
	s := start(t, embeddedConfig(t))
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() { errs[i] = s.Close() })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("Close %d: %v", i, err)
		}
	}
	if err := s.Close(); err != nil {
		t.Errorf("Close after Close: %v", err)
	}
	select {
	case <-s.Done():
	default:
		t.Fatal("Done is open after Close")
	}
	if got := s.Reason(); got != "closed" {
		t.Errorf("Reason: got %q, want %q", got, "closed")
	}
}

// A server closed right after Start stops serving and frees its address, with or without a
// token (on Kitex's two transports, whose Stop does nothing or races with a start still
// under way in the background).
func TestCloseRightAfterStartFreesTheAddress(t *testing.T) {
	root, _ := dataset(t, 1)
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"embedded", embeddedConfig(t)},
		{"TCP with a token", tcpConfig(t, root)},
	} {
		cfg := tc.cfg
		s := start(t, cfg)
		if cfg.Listen != "" {
			cfg.Listen = s.Addr()
		}
		s.Close()
		before, _ := goroutines()
		for i := range 20 {
			s, err := Start(cfg) // fails if the address is still taken
			if err != nil {
				t.Fatalf("%s: start %d: %v", tc.name, i, err)
			}
			if err := s.Close(); err != nil {
				t.Fatalf("%s: close %d: %v", tc.name, i, err)
			}
		}
		if !eventually(func() bool { n, _ := goroutines(); return n <= before }) {
			n, stacks := goroutines()
			t.Errorf("%s: %d goroutines after 20 servers started and closed, %d before:\n%s", tc.name, n, before, stacks)
		}
	}
}

// A server stops (Done) once idle for its idle timeout, not before; requests keep it up.
func TestIdleServerStops(t *testing.T) {
	root, files := dataset(t, 1)
	cfg := embeddedConfig(t)
	cfg.IdleTimeout = 300 * time.Millisecond
	s := start(t, cfg)
	for range 6 { // 600 ms of requests every 100 ms
		readAll(t, s.Addr(), "", root, files)
		select {
		case <-s.Done():
			t.Fatalf("stopped while answering requests: %s", s.Reason())
		case <-time.After(100 * time.Millisecond):
		}
	}
	select {
	case <-s.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("still up 5 s after the last request")
	}
	if got, want := s.Reason(), "idle for 300ms"; got != want {
		t.Errorf("Reason: got %q, want %q", got, want)
	}
}

// A server whose socket was replaced by another server's stops (clients reach only the
// new one), and its Close leaves the new socket in place.
func TestServerWhoseSocketWasReplacedStopsAndLeavesTheNewOne(t *testing.T) {
	cfg := embeddedConfig(t)
	cfg.Embedded, cfg.Socket = false, filepath.Join(cfg.RuntimeDir, "s.sock")
	if err := embedded.PrepareDir(cfg.RuntimeDir); err != nil {
		t.Fatal(err)
	}
	s := start(t, cfg)
	other, err := rpc.ListenUnix(cfg.Socket) // replaces the file
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	select {
	case <-s.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the server did not notice that its socket was replaced")
	}
	if want := "socket " + cfg.Socket + " was removed or replaced"; s.Reason() != want {
		t.Errorf("Reason: got %q, want %q", s.Reason(), want)
	}
	if err := s.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if socketIdentity(cfg.Socket) == 0 {
		t.Error("Close removed the socket of the server that replaced it")
	}
}

// Start refuses what no server may do before it opens anything.
func TestStartRefusesBadConfigs(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(dir, "ready")
	if err := os.Symlink(filepath.Join(dir, "victim"), link); err != nil {
		t.Fatal(err)
	}
	run := filepath.Join(dir, "run")
	for _, tc := range []struct {
		name string
		cfg  Config
		want error
	}{
		{"no address", Config{RuntimeDir: run}, ErrConfig},
		{"TCP and Unix at once", Config{Listen: "127.0.0.1:0", Socket: filepath.Join(run, "s"), Token: "t", Roots: []string{dir}, RuntimeDir: run}, ErrConfig},
		{"TCP without a token", Config{Listen: "127.0.0.1:0", Roots: []string{dir}, RuntimeDir: run}, ErrConfig},
		{"TCP without a root", Config{Listen: "127.0.0.1:0", Token: "t", RuntimeDir: run}, ErrConfig},
		{"embedded without a runtime directory", Config{Embedded: true}, ErrConfig},
		{"ready file planted as a link", Config{Embedded: true, RuntimeDir: run, ReadyFile: link}, errReadyLink},
	} {
		s, err := Start(tc.cfg)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
		if s != nil {
			s.Close()
		}
	}
	if exists(run) {
		t.Error("a refused Start created the runtime directory")
	}
}

// freePort returns a TCP port on host that nothing listens on (now).
func freePort(t *testing.T, host string) string {
	t.Helper()
	return rpctest.Refused(t, host)
}

// A Start that fails at any step leaves nothing open: no descriptor, goroutine, socket or
// ready file, and neither the embedded lock nor the tiers' locks, so that the same server
// then starts on the same port with its tiers. Failures that happen (the metrics address in
// use or unbindable, found before the engine opens the tiers; a Unix socket path too long to
// bind, found once the engine is up) and one made after each step of Start.
func TestFailedStartLeavesNothingOpen(t *testing.T) {
	root, files := dataset(t, 3)
	other, _ := startEngineServer(t, "127.0.0.2", root)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()

	embeddedServer := func(t *testing.T) Config {
		cfg := embeddedConfig(t)
		cfg.ReadyFile = filepath.Join(t.TempDir(), "ready")
		return cfg
	}
	// A cluster server with everything: metrics, a ready file, a node socket routed
	// through the job's servers.
	clusterServer := func(t *testing.T) Config {
		cfg := tcpConfig(t, root)
		cfg.Listen, cfg.MetricsAddr = freePort(t, "127.0.0.1"), freePort(t, "127.0.0.1")
		cfg.ReadyFile = filepath.Join(t.TempDir(), "ready")
		var err error
		cfg.Cluster, err = config.Load(map[string]string{"servers": cfg.Listen + "," + other, "node": "127.0.0.1",
			"wait_timeout": "5", "rpc_timeout": "2"})
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	var gossipTaken io.Closer // by the case "gossip port in use"
	type testCase struct {
		name  string
		cfg   func(t *testing.T) Config
		spoil func(cfg *Config) // makes Start fail
		fix   func(cfg *Config) // undoes spoil
	}
	cases := []testCase{
		{"metrics address in use", clusterServer,
			func(cfg *Config) { cfg.MetricsAddr = taken.Addr().String() }, func(cfg *Config) { cfg.MetricsAddr = "127.0.0.1:0" }},
		{"metrics address unbindable", clusterServer,
			func(cfg *Config) { cfg.MetricsAddr = "192.0.2.1:9" }, func(cfg *Config) { cfg.MetricsAddr = "127.0.0.1:0" }},
		{"gossip port in use", clusterServer, func(cfg *Config) {
			gossipTaken = takeGossipPort(t, cfg.Listen)
			cfg.gossipBindWait = 100 * time.Millisecond
		}, func(cfg *Config) { gossipTaken.Close() }},
		{"socket path too long", embeddedServer,
			func(cfg *Config) { cfg.Socket = filepath.Join(cfg.RuntimeDir, strings.Repeat("s", 120)) },
			func(cfg *Config) { cfg.Socket = "" }},
	}
	for _, step := range []string{"runtime dir", "lock", "listen", "metrics listen", "engine", "socket", "node socket",
		"tiers record", "rpc", "metrics", "ready file"} {
		for _, kind := range []struct {
			name string
			cfg  func(t *testing.T) Config
		}{{"embedded", embeddedServer}, {"cluster", clusterServer}} {
			cases = append(cases, testCase{kind.name + " server failing after " + step, kind.cfg,
				func(cfg *Config) { cfg.failAfter = step }, func(cfg *Config) { cfg.failAfter = "" }})
		}
	}

	// The first server of a process starts what lives as long as the process (netpoll's
	// pollers, Kitex's globals): the counts are taken after one.
	cfg := clusterServer(t)
	s := start(t, cfg)
	readAll(t, s.Addr(), cfg.Token, root, files)
	s.Close()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg(t)
			tc.spoil(&cfg)
			// No garbage collection meanwhile: it would close a listener or file left open
			// and unreachable (their finalizers do), and hide the leak.
			defer debug.SetGCPercent(debug.SetGCPercent(-1))
			fds := openFDs(t)
			routines, _ := goroutines()
			if s, err := Start(cfg); err == nil {
				s.Close()
				t.Fatal("Start did not fail")
			}
			if !eventually(func() bool { return openFDs(t) <= fds }) {
				t.Errorf("%d descriptors open after the failed Start, %d before", openFDs(t), fds)
			}
			if !eventually(func() bool { n, _ := goroutines(); return n <= routines }) {
				n, stacks := goroutines()
				t.Errorf("%d goroutines after the failed Start, %d before:\n%s", n, routines, stacks)
			}
			left := []string{cfg.ReadyFile}
			if cfg.Listen != "" {
				left = append(left, listenFile(cfg.RuntimeDir, cfg.Listen, ".node"))
			} else {
				sock := cmp.Or(cfg.Socket, embedded.SocketPath(cfg.RuntimeDir))
				left = append(left, sock, nodesock.PathFor(sock))
			}
			for _, p := range left {
				if exists(p) {
					t.Errorf("%s left", p)
				}
			}
			if pid := embedded.RunningPID(cfg.RuntimeDir); pid != 0 {
				t.Errorf("the embedded lock is still held (pid %d)", pid)
			}
			tc.fix(&cfg)
			s := start(t, cfg) // on the same port, tiers and runtime directory
			holdsTiers(t, s, cfg)
			readAll(t, s.Addr(), cfg.Token, root, files)
			if err := s.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
	}
}

// takeGossipPort binds the UDP side of the gossip port of the server to listen at listen, as
// another program (another user's) may hold it, and returns the socket.
func takeGossipPort(t *testing.T, listen string) net.PacketConn {
	t.Helper()
	gossip, err := membership.GossipAddr(listen, membership.DefaultPortOffset)
	if err != nil {
		t.Fatal(err)
	}
	taken, err := net.ListenPacket("udp", gossip)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { taken.Close() })
	return taken
}

// clusterConfig returns the configuration of a cluster server on 127.0.0.1 serving root, in a
// job with the server at other.
func clusterConfig(t *testing.T, root, other string) Config {
	t.Helper()
	cfg := tcpConfig(t, root)
	cfg.Listen = freePort(t, "127.0.0.1")
	var err error
	cfg.Cluster, err = config.Load(map[string]string{"servers": cfg.Listen + "," + other, "node": "127.0.0.1",
		"wait_timeout": "5", "rpc_timeout": "2"})
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// A cluster server whose gossip port another socket holds does not start: the other servers
// would take it for dead, and keep it so, while it ran. The error names the port. Before, the
// server started without its membership, with a warning.
func TestTakenGossipPortFailsTheStart(t *testing.T) {
	root, _ := dataset(t, 1)
	other, _ := startEngineServer(t, "127.0.0.2", root)
	cfg := clusterConfig(t, root, other)
	taken := takeGossipPort(t, cfg.Listen)
	cfg.gossipBindWait = 200 * time.Millisecond
	s, err := Start(cfg)
	if err == nil {
		s.Close()
		t.Fatal("the server started without its gossip port")
	}
	if !errors.Is(err, membership.ErrPortInUse) || !strings.Contains(err.Error(), taken.LocalAddr().String()) {
		t.Errorf("got %v, want membership.ErrPortInUse naming %s", err, taken.LocalAddr())
	}
	t.Log(err)
}

// A TCP server whose every tier another server holds does not start (several servers of a
// node given the same tiers, as the default tiers are): it would own a share of the ring and
// read that share from the source at every read. The error names the tier and its holder.
// An embedded server in the same position still starts, reading from the source.
func TestTCPServerWhoseTiersAreHeldDoesNotStart(t *testing.T) {
	root, _ := dataset(t, 1)
	first := start(t, tcpConfig(t, root))
	cfg := tcpConfig(t, root)
	cfg.Tiers = first.cfg.Tiers
	s, err := Start(cfg)
	if err == nil {
		s.Close()
		t.Fatal("a second server started on the tiers of the first")
	}
	for _, want := range []string{first.cfg.Tiers[0].Dir, "held by", "listening on " + first.cfg.Listen, "--tiers"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	if !errors.Is(err, core.ErrNoTier) || !errors.Is(err, tiers.ErrLocked) {
		t.Errorf("got %v, want core.ErrNoTier wrapping tiers.ErrLocked", err)
	}
	emb := embeddedConfig(t)
	emb.Tiers = first.cfg.Tiers
	start(t, emb).Close()
}

// A cluster server started with the job's servers answers its node socket with a file that
// another server owns: the bytes that server sent, kept as a node-local copy in its tier.
func TestClusterServerNodeSocketOpensAnotherServersFile(t *testing.T) {
	root, files := dataset(t, 20)
	other, otherEngine := startEngineServer(t, "127.0.0.2", root)
	cfg := clusterConfig(t, root, other)
	s := start(t, cfg)
	if s.NodeSocket() != listenFile(cfg.RuntimeDir, cfg.Listen, ".node") {
		t.Fatalf("node socket %q, want the runtime directory's for %s", s.NodeSocket(), cfg.Listen)
	}
	origins := map[core.Origin]int{}
	for p, want := range files {
		origins[openBytes(t, s.NodeSocket(), root, p, want)]++
	}
	if origins[core.OriginMemory] != len(files) {
		t.Errorf("opens by origin: %v; want every file from this server's tier (its own, and copies of the other's)", origins)
	}
	theirs, mine := otherEngine.Stats(), s.Engine().Stats()
	if theirs.SourceReads == 0 || theirs.SourceReads+mine.SourceReads != int64(len(files)) || mine.Guests != theirs.SourceReads {
		t.Errorf("the other server read %d files from the source, this one %d and kept %d node-local copies; "+
			"want each file read once, by its owner, and a copy of each of the other's", theirs.SourceReads,
			mine.SourceReads, mine.Guests)
	}
}
