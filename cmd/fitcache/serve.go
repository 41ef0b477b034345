package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/discovery"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/metrics"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

type stringList []string

func (l *stringList) String() string     { return fmt.Sprint(*l) }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	asEmbedded := fs.Bool("embedded", false, "run as the per-user embedded server in the runtime directory (one at a time; exits when idle)")
	socket := fs.String("socket", "", "Unix socket to listen on (default: the runtime directory's, with --embedded)")
	listen := fs.String("listen", "", "TCP address to listen on (host:port), for cluster mode; needs a job token")
	tokenFile := fs.String("token-file", "", "file holding the job token (0600; see 'fitcache token'); default FITCACHE_TOKEN / FITCACHE_TOKEN_FILE")
	metricsAddr := fs.String("metrics", "", "serve Prometheus metrics over HTTP at this address (host:port), path /metrics; off by default")
	readyFile := fs.String("ready-file", "", "write this file once the server accepts requests (a readiness signal for launchers)")
	tierSpec := fs.String("tiers", "", "tiers, fastest first: kind:dir[:budget],... (default: FITCACHE_TIERS, else memory under /dev/shm and disk under ~/.cache)")
	idle := fs.Duration("idle-timeout", 0, "exit after this long without a request; 0: FITCACHE_IDLE_TIMEOUT or 15m with --embedded, never otherwise")
	verify := fs.Bool("verify", false, "check the data checksum of every cached file at start and remove damaged ones (default: FITCACHE_VERIFY)")
	maxFrame := fs.String("max-frame", "", "largest request or reply (a file larger than this cannot be served as bytes); default 64MiB with a job token (clients hold replies to 64MiB), no limit without")
	maxConns := fs.Int("max-conns", 1024, "most connections open at once on a server with a job token; more are closed at once")
	servers := fs.String("servers", "", "with --listen: the job's servers (host:port,..., @HOSTFILE or slurm; default FITCACHE_SERVERS), so that the node socket serves this node's readers every file of the job (see 'fitcache run')")
	prefetch := fs.Int("prefetch", -1, fmt.Sprintf("source reads prefetch runs at once, reading ahead of readers from the file lists they hand over; 0 turns it off (default: FITCACHE_PREFETCH, else %d)", core.DefaultPrefetch))
	var roots stringList
	fs.Var(&roots, "root", "serve only files under this dataset root (repeatable; required with --listen, where --root / serves every file this user can read; default otherwise: any root the caller names)")
	fs.Parse(args)

	opts := map[string]string{"tiers": *tierSpec, "servers": *servers}
	if *idle > 0 {
		opts["idle_timeout"] = idle.String()
	}
	if *verify {
		opts["verify"] = "true"
	}
	if *prefetch >= 0 {
		opts["prefetch"] = strconv.Itoa(*prefetch)
	}
	cfg, err := config.Load(opts)
	if err != nil {
		return err
	}
	log := logger()
	if cfg.RuntimeDirWarning != "" {
		log.Warn(cfg.RuntimeDirWarning)
	}
	token, err := discovery.LoadToken(cfg.Token, firstNonEmpty(*tokenFile, cfg.TokenFile))
	if err != nil {
		return err
	}
	if *listen != "" && token == "" {
		return errors.New("a TCP server needs a job token: --token-file FILE (make one with 'fitcache token FILE') or FITCACHE_TOKEN")
	}
	if *listen != "" && len(roots) == 0 {
		return errors.New("a TCP server needs --root DIR (repeatable): the dataset directories it may serve; --root / serves every file this user can read to every holder of the job token")
	}
	if *listen != "" && slices.Contains(roots, "/") {
		log.Warn("--root / serves every file this user can read to every holder of the job token")
	}
	var frame tiers.SizeOrPercent
	if *maxFrame != "" {
		frame, err = tiers.ParseSize(*maxFrame)
		if err != nil || frame.Percent != 0 || frame.Bytes < 1<<20 || frame.Bytes > 1<<31-1 {
			return fmt.Errorf("--max-frame %q: want a size from 1MiB to 2GiB", *maxFrame)
		}
	}
	if *maxConns < 1 {
		return fmt.Errorf("--max-conns %d: want at least 1", *maxConns)
	}
	if *readyFile != "" {
		if err := checkReadyFile(*readyFile); err != nil {
			return err
		}
	}
	if *socket == "" && *listen == "" {
		if !*asEmbedded {
			return errors.New("give --listen HOST:PORT, --socket PATH, or --embedded for the per-user server")
		}
		if err := embedded.PrepareDir(cfg.RuntimeDir); err != nil {
			return err
		}
		*socket = embedded.SocketPath(cfg.RuntimeDir)
	}
	idleTimeout := time.Duration(0)
	if *asEmbedded {
		// A server that is exiting (its socket was removed, say) lets go of the lock within
		// a second: wait for it rather than leave its clients without a server.
		lock, err := embedded.LockServer(cfg.RuntimeDir, 3*time.Second)
		if errors.Is(err, embedded.ErrAlreadyRunning) {
			log.Info("another embedded server is running; exiting", "runtime_dir", cfg.RuntimeDir, "err", err)
			return nil
		}
		if err != nil {
			return err
		}
		defer lock.Close()
		idleTimeout = cfg.IdleTimeout
	} else if *idle > 0 {
		idleTimeout = *idle
	}

	tierCfgs, err := cfg.TierConfigs()
	if err != nil {
		return err
	}
	var ln net.Listener
	genFile := *socket + ".gen"
	if *listen != "" {
		if err := embedded.PrepareDir(cfg.RuntimeDir); err != nil {
			return err
		}
		genFile = listenFile(cfg.RuntimeDir, *listen, ".gen")
		if ln, err = net.Listen("tcp", *listen); err != nil {
			return fmt.Errorf("listen on %s: %w", *listen, err)
		}
	}
	engine, err := core.NewEngine(core.EngineConfig{Tiers: tierCfgs, Roots: roots, GenerationFile: genFile,
		Verify: cfg.Verify, Warnings: warnings(cfg.RuntimeDirWarning), Prefetch: core.PrefetchConfig{Reads: cfg.Prefetch}, Holder: "listening on " + firstNonEmpty(*listen, *socket) + ", runtime dir " + cfg.RuntimeDir}, log)
	if err != nil {
		if ln != nil {
			ln.Close()
		}
		return err
	}
	if ln == nil {
		// The socket appears only once the engine is ready (its tiers rescanned): a client
		// that finds no socket waits for the server being started, while one whose ping
		// gets no answer on an existing socket takes the server for hung.
		if ln, err = rpc.ListenUnix(*socket); err != nil {
			engine.Close()
			return err
		}
	}
	var lastRequest atomic.Int64
	lastRequest.Store(time.Now().UnixNano())
	// C code on this node without Go (libfitcache after fork, the preload shim) asks for
	// misses on the node socket (see nodeserve.go). A cluster server has one only when it
	// knows the job's servers, so that it serves every file from its owner; it announces
	// its path in its hello.
	var node *nodesock.Server
	var routed *clusterNode
	nodePath := ""
	switch {
	case *socket != "":
		nodePath = nodesock.PathFor(*socket)
	case cfg.Servers == "":
		log.Info("no node socket: without the job's servers (--servers or FITCACHE_SERVERS) programs run by `fitcache run` on this node read only the files cached here")
	default:
		if routed, err = newClusterNode(engine, cfg, token, *listen, log); err != nil {
			log.Warn("no node socket: programs run by `fitcache run` on this node read only the files cached here", "err", err)
		} else {
			nodePath = listenFile(cfg.RuntimeDir, *listen, ".node")
		}
	}
	// Metrics are read from the engine and the RPC handler at each scrape; the Read RPCs
	// and the node socket's opens are observed as they are answered.
	var m *metrics.Server
	var onRead func(bool, string, time.Duration, int64)
	var onOpen func(core.Origin, time.Duration)
	if *metricsAddr != "" {
		m = metrics.New(engine)
		onRead, onOpen = m.ObserveRead, m.ObserveNodeOpen
	}
	if nodePath != "" {
		touch := func() { lastRequest.Store(time.Now().UnixNano()) }
		if node, err = nodesock.Listen(nodePath, nodeServer(engine, routed, log, touch, onOpen)); err != nil {
			log.Warn("no node socket: processes forked after loading libfitcache and programs run by `fitcache run` read misses from the source", "err", err)
			nodePath = ""
		}
	}
	id, _ := os.Hostname()
	srv, handler, done := rpc.Serve(engine, ln, rpc.ServerConfig{
		ID: fmt.Sprintf("%s:%d", id, os.Getpid()), Log: log, Token: token, NodeSocket: nodePath,
		MaxFrameBytes: int(frame.Bytes), MaxConns: *maxConns,
		OnRequest: func() { lastRequest.Store(time.Now().UnixNano()) }, OnRead: onRead,
	})
	log.Info("fitcache server ready", "address", ln.Addr().String(), "pid", os.Getpid(), "tiers", len(engine.TierDirs()),
		"idle_timeout", idleTimeout, "roots", roots, "prefetch", cfg.Prefetch, "node_socket", nodePath, "cluster_routed", routed != nil)
	if m != nil {
		m.WatchMembership(handler)
		mln, err := net.Listen("tcp", *metricsAddr)
		if err != nil {
			return fmt.Errorf("metrics: %w", err)
		}
		go http.Serve(mln, m.Handler())
		log.Info("metrics at /metrics", "address", mln.Addr().String())
	}
	if *readyFile != "" {
		if err := writeReadyFile(*readyFile, ln.Addr().String()+"\n"); err != nil {
			log.Warn("cannot write the ready file", "file", *readyFile, "err", err)
		}
		defer os.Remove(*readyFile)
	}

	socketID := socketIdentity(*socket)
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var reason string
	for reason == "" {
		select {
		case sig := <-signals:
			reason = "signal " + sig.String()
		case err := <-done:
			reason = fmt.Sprintf("server stopped: %v", err)
		case <-tick.C:
			if idleTimeout > 0 && time.Since(time.Unix(0, lastRequest.Load())) > idleTimeout {
				reason = "idle for " + idleTimeout.String()
			}
			// Clients find this server by its socket's path: if the socket was removed or
			// replaced, none can reach it any more, so exit and let a new server start.
			if socketID != 0 && socketIdentity(*socket) != socketID {
				reason = "socket " + *socket + " was removed or replaced"
				socketID = 0 // not ours to remove any more
			}
		}
	}
	log.Info("fitcache server stopping", "reason", reason)
	// Remove the socket first so that new clients start a fresh server instead of reaching
	// this one while it stops.
	if socketID != 0 && socketIdentity(*socket) == socketID {
		os.Remove(*socket)
	}
	// The node socket and its cluster clients go first: the other servers' RPC servers wait
	// (up to Kitex's exit wait time) for those clients' connections to close when they stop.
	if node != nil {
		node.Close()
	}
	if routed != nil {
		routed.Close()
	}
	srv.Stop()
	engine.Close()
	log.Info("fitcache server stopped")
	return nil
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

// warnings returns the non-empty messages.
func warnings(msgs ...string) []string {
	var out []string
	for _, m := range msgs {
		if m != "" {
			out = append(out, m)
		}
	}
	return out
}

func firstNonEmpty(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

// tokenCmd creates a job token file for servers and clients of a job to share.
func tokenCmd(args []string) error {
	if len(args) != 1 || strings.HasPrefix(args[0], "-") {
		return errors.New("usage: fitcache token FILE (creates FILE, mode 0600, with a new random token)")
	}
	_, err := discovery.CreateTokenFile(args[0])
	return err
}
