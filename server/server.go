package server

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	kitexserver "github.com/cloudwego/kitex/server"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/gate"
	"github.com/fitcache/fitcache/metrics"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// Config is what a server is told: everything `fitcache serve` decides from its flags and
// the FITCACHE_* options. Zero values take the defaults shown.
type Config struct {
	// Listen is the TCP address (host:port) of a cluster server; it needs Token and Roots.
	// Listen and Socket are not both set. A host name is listened on at every address it
	// resolves to, and the server does not start while another process holds the port on any
	// of them (see gate.ListenTCP).
	Listen string
	// Socket is the Unix socket of a server for this user on this node. It appears once the
	// engine is ready (a client that finds no socket waits for the server being started, one
	// whose ping gets no answer on an existing socket takes the server for hung), and the
	// server stops (Done) when it is removed or replaced: clients find a server by its path.
	Socket string
	// Embedded makes this the per-user embedded server of RuntimeDir (see package embedded):
	// Start takes the runtime directory's server lock, waiting up to 3 s for a server that is
	// exiting (else it fails with an error wrapping embedded.ErrAlreadyRunning), holds it until
	// Close, and listens on embedded.SocketPath(RuntimeDir) when Listen and Socket are empty.
	Embedded bool
	// Token of the job (see rpc.ServerConfig.Token); required with Listen.
	Token string
	// Roots the server serves files under (see core.EngineConfig.Roots); required with
	// Listen. Empty: any root a caller names (a server reachable only by its user).
	Roots []string
	// Tiers, fastest first (see core.EngineConfig.Tiers). A TCP server that can open none of
	// them does not start (core.ErrNoTier): it owns a share of the job's files, which it
	// would otherwise read from the source at every read.
	Tiers []tiers.Config
	// Verify checks the data checksum of every cached file when the tiers are opened.
	Verify bool
	// Prefetch is how many source reads prefetch runs at once; 0 turns prefetch off.
	Prefetch int
	// BlockBytes is the size of the blocks ranges of large files are cached in (0: the
	// default, see core.EngineConfig.BlockBytes).
	BlockBytes int64
	// Limits bound the tiers' budgets from outside their configuration (the job's memory
	// cgroup, the site's limits; see core.Limits); MemoryAtExit says what becomes of the
	// memory tiers' copies when the server closes (see core.MemoryAtExit; "" keeps them).
	Limits       core.Limits
	MemoryAtExit core.MemoryAtExit
	// RuntimeDir is the private directory (see embedded.PrepareDir, which makes it when it
	// is missing) of the embedded server's lock and socket, and of a TCP server's node socket
	// (server-HOST_PORT.node) and the record of its tiers (server-HOST_PORT.tiers, see
	// tiers.WriteServed). Required with Embedded or Listen.
	RuntimeDir string
	// Warnings are problems found before the server started (a default directory replaced,
	// say), reported with the engine's statistics.
	Warnings []string
	// MetricsAddr, if set, is the host:port at which Prometheus metrics are served over HTTP,
	// path /metrics (see package metrics), to a bounded number of connections per peer and in
	// all (see metricsMaxConns).
	MetricsAddr string
	// ReadyFile, if set, is written with the RPC address and a newline once the server
	// accepts requests (never through a symbolic link: a path that is one is refused), and
	// removed by Close.
	ReadyFile string
	// IdleTimeout, if positive: the server stops (Done) after this long without a request.
	IdleTimeout time.Duration
	// MaxFrameBytes and MaxConns bound requests and replies, and open connections (see
	// rpc.ServerConfig); 0 takes rpc's defaults.
	MaxFrameBytes, MaxConns int
	// Cluster is the job's configuration (servers, failure policy, timeouts, this node's
	// name) for the node socket of a TCP server: with Cluster.Servers set, the node socket
	// answers this node's readers for every file of the job, each from its owner (see
	// nodesocket.go); without, a TCP server has no node socket. Its token is Token.
	Cluster config.Config
	// ID names the server in replies and logs; default HOST:PID.
	ID string
	// Log receives the server's log; nil discards it.
	Log *slog.Logger

	// failAfter, for tests, makes Start fail right after its step of that name.
	failAfter string
	// lookup, for tests, resolves the host names of Listen and MetricsAddr (nil: the system's
	// resolver).
	lookup gate.Lookup
	// gossipBindWait, for tests, is how long a gossip port held by another socket is waited
	// for (0: membership.DefaultBindWait).
	gossipBindWait time.Duration
}

// ErrConfig reports a Config that Start refuses before opening anything.
var ErrConfig = errors.New("invalid server configuration")

// rpcStartWait bounds how long Start waits for an RPC server without a token to answer
// (see awaitRPC), rpcStopWait how long Close waits for the RPC server to end once stopped
// (Kitex's Stop itself waits up to its exit wait time, 5 s, for the connections to close).
// idleCheck is how often the idle timeout and the socket are checked (more often for an
// idle timeout under 4 s).
const (
	rpcStartWait = 10 * time.Second
	rpcStopWait  = 10 * time.Second
	idleCheck    = time.Second
)

// Server is a running FitCache server: the engine with its tiers, the RPC listener (TCP or
// Unix socket), the node socket, the metrics and the ready file. It is safe for concurrent
// use.
type Server struct {
	cfg Config
	log *slog.Logger

	// What Start opened, in this order; nil (or zero) for what it did not. Set by Start
	// only, before it returns.
	lock       *os.File // the embedded server lock
	ln         net.Listener
	socketID   uint64 // inode of the Unix socket Start created, 0 for none
	metricsLn  net.Listener
	engine     *core.Engine
	metrics    *metrics.Server // with metricsLn
	cluster    *clusterNode
	node       *nodesock.Server
	nodePath   string
	rpc        kitexserver.Server
	rpcStopped chan struct{} // closed once the RPC server's Run returned, with rpcErr set
	rpcErr     error
	metricsSrv *http.Server
	serving    sync.WaitGroup // the metrics server's goroutine
	readyFile  string         // removed by Close

	lastRequest atomic.Int64 // time of the last request (Unix nanoseconds), for IdleTimeout

	watchStop chan struct{} // closed by Close: ends watch
	watching  sync.WaitGroup

	mu       sync.Mutex // protects reason
	reason   string
	done     chan struct{} // closed by stop
	stopOnce sync.Once     // closes done

	closeOnce sync.Once
}

// Start opens a server as cfg says, in order: the runtime directory and the embedded lock,
// the TCP listener, the metrics listener (both before the engine, whose start rescans the
// tiers), the engine, the Unix socket, the node socket (a failure there is logged: readers
// then read their misses through Go or from the source), the record of the tiers in the
// runtime directory (for readers of the node while the server is dead), the RPC server, the
// metrics server
// and the ready file; a server without a token is started once its RPC server answered a
// request (see awaitRPC). On any failure Start closes what it opened (see Close) and
// returns the error.
func Start(cfg Config) (*Server, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	if cfg.Embedded && cfg.Socket == "" && cfg.Listen == "" {
		cfg.Socket = embedded.SocketPath(cfg.RuntimeDir)
	}
	if cfg.ID == "" {
		host, _ := os.Hostname()
		cfg.ID = fmt.Sprintf("%s:%d", host, os.Getpid())
	}
	s := &Server{cfg: cfg, log: cfg.Log, rpcStopped: make(chan struct{}), watchStop: make(chan struct{}),
		done: make(chan struct{})}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	s.lastRequest.Store(time.Now().UnixNano())
	for _, step := range []struct {
		name string
		run  func() error
	}{
		{"runtime dir", s.prepareRuntimeDir},
		{"lock", s.lockEmbedded},
		{"listen", s.listenTCP},
		{"metrics listen", s.listenMetrics},
		{"engine", s.openEngine},
		{"socket", s.listenUnix},
		{"node socket", s.openNodeSocket},
		{"tiers record", s.recordTiers},
		{"rpc", s.serveRPC},
		{"metrics", s.serveMetrics},
		{"ready file", s.writeReadyFile},
	} {
		err := step.run()
		if err == nil && cfg.failAfter == step.name {
			err = fmt.Errorf("failing after %s, as the test asked", step.name)
		}
		if err != nil {
			if cerr := s.Close(); cerr != nil {
				err = errors.Join(err, fmt.Errorf("closing what was opened: %w", cerr))
			}
			return nil, err
		}
	}
	s.watching.Add(1)
	go s.watch()
	return s, nil
}

// check refuses what no server may do, before anything is opened.
func (c *Config) check() error {
	switch {
	case c.Listen != "" && c.Socket != "":
		return fmt.Errorf("%w: both a TCP address and a Unix socket to listen on", ErrConfig)
	case c.Listen == "" && c.Socket == "" && !c.Embedded:
		return fmt.Errorf("%w: no TCP address or Unix socket to listen on", ErrConfig)
	case c.Listen != "" && c.Token == "":
		return fmt.Errorf("%w: a TCP server needs a job token", ErrConfig)
	case c.Listen != "" && len(c.Roots) == 0:
		return fmt.Errorf("%w: a TCP server needs dataset roots", ErrConfig)
	case (c.Embedded || c.Listen != "") && c.RuntimeDir == "":
		return fmt.Errorf("%w: no runtime directory", ErrConfig)
	case c.ReadyFile != "":
		return checkReadyFile(c.ReadyFile)
	}
	return nil
}

func (s *Server) prepareRuntimeDir() error {
	if !s.cfg.Embedded && s.cfg.Listen == "" {
		return nil
	}
	return embedded.PrepareDir(s.cfg.RuntimeDir)
}

func (s *Server) lockEmbedded() (err error) {
	if s.cfg.Embedded {
		s.lock, err = embedded.LockServer(s.cfg.RuntimeDir, 3*time.Second)
	}
	return err
}

func (s *Server) listenTCP() (err error) {
	if s.cfg.Listen != "" {
		if s.ln, err = gate.ListenTCP(context.Background(), s.cfg.Listen, s.cfg.lookup); err != nil {
			return err
		}
	}
	return nil
}

func (s *Server) listenMetrics() (err error) {
	if s.cfg.MetricsAddr != "" {
		if s.metricsLn, err = gate.ListenTCP(context.Background(), s.cfg.MetricsAddr, s.cfg.lookup); err != nil {
			return fmt.Errorf("metrics: %w", err)
		}
	}
	return nil
}

func (s *Server) openEngine() (err error) {
	ecfg := core.EngineConfig{Tiers: s.cfg.Tiers, Roots: s.cfg.Roots,
		Verify: s.cfg.Verify, Warnings: s.cfg.Warnings, Prefetch: core.PrefetchConfig{Reads: s.cfg.Prefetch},
		BlockBytes: s.cfg.BlockBytes, RequireTier: s.cfg.Listen != "", Limits: s.cfg.Limits, MemoryAtExit: s.cfg.MemoryAtExit,
		Holder: "listening on " + s.cfg.Listen + s.cfg.Socket + ", runtime dir " + s.cfg.RuntimeDir}
	if s.cfg.Listen != "" && s.cfg.Cluster.Servers != "" {
		// The lists of this node's readers are brought into the node through the cluster node,
		// which openNodeSocket makes before the RPC server takes a request.
		ecfg.NodeFetch = func(ctx context.Context, root, path string) (bool, error) {
			if s.cluster == nil {
				return false, fmt.Errorf("%w: no cluster node", core.ErrTooLarge)
			}
			return s.cluster.fetchForPrefetch(ctx, root, path)
		}
		ecfg.BlockOwner = func(ctx context.Context, root, path string, n int64, ask bool) (bool, error) {
			if s.cluster == nil {
				return false, fmt.Errorf("%w: no cluster node", core.ErrTooLarge)
			}
			return s.cluster.cacheBlockAtOwner(ctx, root, path, n, ask)
		}
	}
	s.engine, err = core.NewEngine(ecfg, s.log)
	if errors.Is(err, core.ErrNoTier) {
		// Several servers on one node sharing the default tiers is the usual cause.
		return fmt.Errorf("%w\n(each server of a node needs tier directories of its own: fitcache serve --tiers kind:dir,...)", err)
	}
	if err != nil {
		return fmt.Errorf("engine: %w", err)
	}
	if s.metricsLn != nil {
		// Read from the engine and the RPC handler at each scrape; the Read RPCs and the
		// node socket's opens are observed as they are answered.
		s.metrics = metrics.New(s.engine)
	}
	return nil
}

// listenUnix creates the Unix socket, once the engine is ready (see Config.Socket). Its file
// is removed by Close, not by the listener: a socket that another server put in its place
// is left to that server.
func (s *Server) listenUnix() (err error) {
	if s.cfg.Socket == "" {
		return nil
	}
	if s.ln, err = rpc.ListenUnix(s.cfg.Socket); err != nil {
		return err
	}
	if ul, ok := s.ln.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
	}
	s.socketID = socketIdentity(s.cfg.Socket)
	return nil
}

// openNodeSocket opens the node socket, where C code on this node without Go (libfitcache
// after fork, the preload shim) asks for misses (see nodesocket.go). A cluster server has one only
// when it knows the job's servers, so that it serves every file from its owner; the RPC
// server announces its path in its hello. A node socket that cannot be opened is logged, not
// fatal; the servers' membership, which starts here with the cluster node, fails the start
// if it cannot start (see startMembership).
func (s *Server) openNodeSocket() (err error) {
	path := ""
	switch {
	case s.cfg.Socket != "":
		path = nodesock.PathFor(s.cfg.Socket)
	case s.cfg.Cluster.Servers == "":
		s.log.Info("no node socket: without the job's servers (--servers or FITCACHE_SERVERS) programs run by `fitcache run` on this node read only the files cached here")
	default:
		if s.cluster, err = newClusterNode(s.engine, s.cfg.Cluster, s.cfg.Token, s.cfg.Listen, s.log); err != nil {
			s.log.Warn("no node socket: programs run by `fitcache run` on this node read only the files cached here", "err", err)
		} else {
			if err := s.cluster.startMembership(s.cfg.gossipBindWait); err != nil {
				return err
			}
			path = listenFile(s.cfg.RuntimeDir, s.cfg.Listen, ".node")
		}
	}
	if path == "" {
		return nil
	}
	var onOpen func(core.Origin, time.Duration)
	if s.metrics != nil {
		onOpen = s.metrics.ObserveNodeOpen
	}
	if s.node, err = nodesock.Listen(path, nodeServer(s.engine, s.cluster, s.log, s.touch, onOpen)); err != nil {
		s.log.Warn("no node socket: processes forked after loading libfitcache and programs run by `fitcache run` read misses from the source", "err", err)
		return nil
	}
	s.nodePath = path
	return nil
}

// recordTiers records the tiers of a server among the job's in its runtime directory (see
// tiers.WriteServed), so that a reader on its node still finds them while the server is dead
// (its hello tells them otherwise). A record that cannot be written is logged, not fatal:
// readers then read those files elsewhere while the server is dead.
func (s *Server) recordTiers() error {
	if s.cluster == nil || s.cluster.self == "" {
		return nil
	}
	if err := tiers.WriteServed(s.cfg.RuntimeDir, tiers.ServedName(s.cluster.self), s.engine.TierDirs()); err != nil {
		s.log.Warn("the readers of this node will not find its tiers while this server is dead", "err", err)
	}
	return nil
}

// nodeConnections returns the connections the node socket accepted (0 without one).
func (s *Server) nodeConnections() int64 {
	if s.node == nil {
		return 0
	}
	return s.node.Connections()
}

// serveRPC starts the RPC server.
func (s *Server) serveRPC() error {
	var onRead func(bool, core.Origin, time.Duration, int64)
	if s.metrics != nil {
		onRead = s.metrics.ObserveRead
	}
	srv, handler, done := rpc.Serve(s.engine, s.ln, rpc.ServerConfig{ID: s.cfg.ID, Log: s.log, Token: s.cfg.Token,
		NodeSocket: s.nodePath, ReaderFills: s.cluster == nil, Ring: s.cluster.ring(),
		MaxFrameBytes: s.cfg.MaxFrameBytes, MaxConns: s.cfg.MaxConns,
		OnRequest: s.touch, OnRead: onRead, OnNewJob: s.announceJob, Members: s.cluster.Members,
		OnReportedDead: s.cluster.reportedDead, ForwardBlock: s.cluster.forwardBlock, NodeConnections: s.nodeConnections})
	s.cluster.relayTo(handler.Learn)
	s.rpc = srv
	go func() {
		s.rpcErr = <-done
		close(s.rpcStopped)
	}()
	if s.metrics != nil {
		s.metrics.WatchMembership(handler)
	}
	if s.cfg.Token == "" {
		if err := s.awaitRPC(); err != nil {
			return err
		}
	}
	s.log.Info("fitcache server ready", "address", s.Addr(), "pid", os.Getpid(), "tiers", len(s.engine.TierDirs()),
		"idle_timeout", s.cfg.IdleTimeout, "roots", s.cfg.Roots, "prefetch", s.cfg.Prefetch, "node_socket", s.nodePath,
		"cluster_routed", s.cluster != nil)
	return nil
}

// awaitRPC returns once the RPC server answers a request (Stats), or fails when it ended or
// did not answer within rpcStartWait. A server without a token runs on Kitex's netpoll
// transport, whose Stop reads a field that its start, in the background, writes without a
// lock: it must not be stopped before it has started. (With a token, on Kitex's Go net
// transport, a Stop that comes too early does nothing, and Close makes the start fail.)
func (s *Server) awaitRPC() error {
	c, err := rpc.Dial(s.Addr(), rpc.ClientConfig{})
	if err != nil {
		return fmt.Errorf("RPC server: %w", err)
	}
	defer c.Close()
	deadline := time.Now().Add(rpcStartWait)
	for {
		_, err := c.Stats(context.Background())
		if err == nil {
			return nil
		}
		select {
		case <-s.rpcStopped:
			return fmt.Errorf("RPC server: %w", s.rpcErr)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("RPC server does not answer after %v: %w", rpcStartWait, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The metrics server's bounds. Whoever reaches its address may connect, and each connection
// it accepts is a descriptor of the process that serves the data and gossip ports: with a
// read-header timeout alone, 22,950 idle keep-alive connections took a server to its
// descriptor limit, its accepts failed on the gossip port too, and another server declared
// it dead. So each connection holds a place (gate.PlacesListener): metricsPerPeer per peer
// host (or other user of this host), metricsMaxConns in all, and metricsMaxConns more for the
// server's own user; a new connection past its share closes the oldest one there, so that a
// flood from one host neither takes the descriptors nor keeps a scrape from another host
// waiting behind it (a cap that left new connections in the kernel's queue kept a scrape
// out for minutes). A connection that does not send its request in time, takes too long to
// be answered, or idles between requests is closed. Prometheus keeps one connection per
// target.
const (
	metricsMaxConns       = 32
	metricsPerPeer        = 8
	metricsHeaderTimeout  = 5 * time.Second
	metricsReadTimeout    = 10 * time.Second
	metricsWriteTimeout   = 30 * time.Second
	metricsIdleTimeout    = 90 * time.Second
	metricsMaxHeaderBytes = 16 << 10
)

// serveMetrics serves the metrics (see the bounds above).
func (s *Server) serveMetrics() error {
	if s.metrics == nil {
		return nil
	}
	s.metricsSrv = &http.Server{Handler: s.metrics.Handler(), ReadHeaderTimeout: metricsHeaderTimeout,
		ReadTimeout: metricsReadTimeout, WriteTimeout: metricsWriteTimeout, IdleTimeout: metricsIdleTimeout,
		MaxHeaderBytes: metricsMaxHeaderBytes}
	ln := gate.PlacesListener(s.metricsLn, &gate.Pending{PerPeer: metricsPerPeer, Total: metricsMaxConns,
		Own: gate.OwnUser()})
	s.serving.Add(1)
	go func() {
		defer s.serving.Done()
		if err := s.metricsSrv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("metrics server stopped", "err", err) // scrapes fail; the cache serves on
		}
	}()
	s.log.Info("metrics at /metrics", "address", s.metricsLn.Addr().String())
	return nil
}

// writeReadyFile writes the ready file, which Close removes. A ready file that cannot be
// written is logged, not fatal.
func (s *Server) writeReadyFile() error {
	if s.cfg.ReadyFile == "" {
		return nil
	}
	s.readyFile = s.cfg.ReadyFile
	if err := writeReadyFile(s.cfg.ReadyFile, s.Addr()+"\n"); err != nil {
		s.log.Warn("cannot write the ready file", "file", s.cfg.ReadyFile, "err", err)
	}
	return nil
}

// watch stops the server (Done) when it has been idle for IdleTimeout, when its Unix socket
// was removed or replaced (no client can reach it any more: a new server may start), or when
// its RPC server ended.
func (s *Server) watch() {
	defer s.watching.Done()
	every := idleCheck
	if idle := s.cfg.IdleTimeout; idle > 0 && idle/4 < every {
		every = max(idle/4, 10*time.Millisecond)
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-s.watchStop:
			return
		case <-s.rpcStopped:
			s.stop(fmt.Sprintf("server stopped: %v", s.rpcErr))
			return
		case <-tick.C:
			if idle := s.cfg.IdleTimeout; idle > 0 && time.Since(time.Unix(0, s.lastRequest.Load())) > idle {
				s.stop("idle for " + idle.String())
				return
			}
			if s.socketID != 0 && socketIdentity(s.cfg.Socket) != s.socketID {
				s.stop("socket " + s.cfg.Socket + " was removed or replaced")
				return
			}
		}
	}
}

// touch records a request, for the idle timeout.
func (s *Server) touch() { s.lastRequest.Store(time.Now().UnixNano()) }

// announceJob passes a job that began with a reader of this node on to the job's other
// servers (see clusterNode.announce); a server without a cluster node has none to tell.
func (s *Server) announceJob(ctx context.Context, job string) {
	if s.cluster != nil {
		s.cluster.announce(ctx, job)
	}
}

// stop records why the server stops and closes Done, the first time.
func (s *Server) stop(reason string) {
	s.stopOnce.Do(func() {
		s.mu.Lock()
		s.reason = reason
		s.mu.Unlock()
		close(s.done)
	})
}

// Done is closed when the server stops on its own (see Reason) or is closed. Its owner then
// calls Close.
func (s *Server) Done() <-chan struct{} { return s.done }

// Reason says why Done was closed: "idle for 15m0s", "socket PATH was removed or replaced",
// "server stopped: ERR" (the RPC server ended) or "closed"; "" while it is open.
func (s *Server) Reason() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reason
}

// Addr returns the address the RPC server listens on: host:port (with the port chosen when
// Config.Listen gave 0) or the Unix socket's path.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// NodeSocket returns the path of the node socket, or "" when the server has none.
func (s *Server) NodeSocket() string { return s.nodePath }

// MetricsAddr returns the host:port of the metrics server, or "" when it has none.
func (s *Server) MetricsAddr() string {
	if s.metricsLn == nil {
		return ""
	}
	return s.metricsLn.Addr().String()
}

// Engine returns the server's engine.
func (s *Server) Engine() *core.Engine { return s.engine }

// Close stops the server and releases what it holds, in this order:
//
//  1. its Unix socket file, while it is still this server's, so that new clients start a
//     fresh server instead of reaching this one while it stops; the metrics server;
//  2. the node socket, which waits for the opens it is answering (they use the engine and
//     the cluster node's clients);
//  3. the cluster node's clients: the other servers of the job, told to stop at the same
//     time, wait for these clients' connections to close before they stop (up to Kitex's
//     exit wait time), so these close before this server's RPC server waits for theirs,
//     and no server of the job waits for another;
//  4. the RPC listener, then the RPC server, which waits for its connections to close (up
//     to Kitex's exit wait time), so that no request finds the engine closed;
//  5. the engine: its prefetch, data mover and tiers, with their locks;
//  6. the ready file: once it is gone, the tiers are free;
//  7. the embedded lock, last: a server started meanwhile, which waits for it, then finds
//     the tiers free.
//
// Start closes what it opened the same way when it fails. Close returns what failed,
// joined; closing again does nothing.
func (s *Server) Close() error {
	var err error
	s.closeOnce.Do(func() { err = s.close() })
	return err
}

func (s *Server) close() error {
	s.stop("closed")
	close(s.watchStop)
	s.watching.Wait()
	var errs []error
	fail := func(what string, err error) {
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("%s: %w", what, err))
		}
	}
	if s.socketID != 0 && socketIdentity(s.cfg.Socket) == s.socketID {
		fail("remove socket", os.Remove(s.cfg.Socket))
	}
	if s.metricsSrv != nil {
		fail("close metrics server", s.metricsSrv.Close())
	} else if s.metricsLn != nil {
		fail("close metrics listener", s.metricsLn.Close())
	}
	if s.node != nil {
		fail("close node socket", s.node.Close())
	}
	if s.cluster != nil {
		fail("close the cluster node", s.cluster.Close())
	}
	if s.ln != nil {
		// Closed before Kitex's Stop, which does nothing until its Run has set the server
		// up (moments after Start with a token): a Run that gets this far then fails on
		// the closed listener instead of serving on.
		s.ln.Close()
	}
	if s.rpc != nil {
		fail("stop RPC server", s.rpc.Stop())
		select {
		case <-s.rpcStopped:
		case <-time.After(rpcStopWait):
			fail("stop RPC server", fmt.Errorf("still running %v after Stop", rpcStopWait))
		}
	}
	s.serving.Wait()
	if s.engine != nil {
		fail("close engine", s.engine.Close())
	}
	if s.readyFile != "" {
		fail("remove ready file", os.Remove(s.readyFile))
	}
	if s.lock != nil {
		fail("release the embedded server lock", s.lock.Close())
	}
	return errors.Join(errs...)
}

// listenFile names a file of the server listening on the TCP address listen in its runtime
// directory: "server-HOST_PORT" and the suffix.
func listenFile(runtimeDir, listen, suffix string) string {
	return filepath.Join(runtimeDir, "server-"+strings.NewReplacer(":", "_", "/", "_").Replace(listen)+suffix)
}

// socketIdentity returns the inode of the socket file at path, or 0 if there is none.
func socketIdentity(path string) uint64 {
	if path == "" {
		return 0
	}
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFSOCK {
		return 0
	}
	return st.Ino
}
