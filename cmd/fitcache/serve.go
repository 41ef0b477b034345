package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/discovery"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/server"
	"github.com/fitcache/fitcache/tiers"
)

type stringList []string

func (l *stringList) String() string     { return fmt.Sprint(*l) }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// optionalInt is a flag taking a whole number from 0 that may be left unset, so that the
// option's environment variable or default applies. Unset, it prints as "", which keeps the
// flag package from appending a "(default -1)" of its own to a help text that gives the
// real default.
type optionalInt struct {
	n   int
	set bool
}

func (o *optionalInt) String() string {
	if o == nil || !o.set {
		return ""
	}
	return strconv.Itoa(o.n)
}

func (o *optionalInt) Set(v string) error {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return fmt.Errorf("want a whole number from 0, got %q", v)
	}
	o.n, o.set = n, true
	return nil
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	asEmbedded := fs.Bool("embedded", false, "run as the per-user embedded server in the runtime directory (one at a time; exits when idle)")
	socket := fs.String("socket", "", "Unix socket to listen on (default: the runtime directory's, with --embedded)")
	listen := fs.String("listen", "", "TCP address to listen on (host:port), for cluster mode; needs a job token. A host name is listened on at every address it resolves to (IPv4 and IPv6), and the server does not start while another process holds the port on one of them")
	tokenFile := fs.String("token-file", "", "file holding the job token (0600; see 'fitcache token'); default FITCACHE_TOKEN / FITCACHE_TOKEN_FILE")
	metricsAddr := fs.String("metrics", "", "serve Prometheus metrics over HTTP at this address (host:port), path /metrics; off by default")
	readyFile := fs.String("ready-file", "", "write this file once the server accepts requests (a readiness signal for launchers)")
	tierSpec := fs.String("tiers", "", "tiers, fastest first: kind:dir[:budget],... (default: FITCACHE_TIERS, else memory under /dev/shm and disk under ~/.cache); each server of a node needs its own, and one with --listen that can open none does not start")
	idle := fs.Duration("idle-timeout", 0, "exit after this long without a request; 0: FITCACHE_IDLE_TIMEOUT or 15m with --embedded, never otherwise")
	verify := fs.Bool("verify", false, "check the data checksum of every cached file at start and remove damaged ones (default: FITCACHE_VERIFY)")
	maxFrame := fs.String("max-frame", "", "largest request or reply (a file larger than this cannot be served as bytes); default 64MiB with a job token (clients hold replies to 64MiB), no limit without")
	maxConns := fs.Int("max-conns", 1024, "most connections open at once on a server with a job token; more are closed at once")
	servers := fs.String("servers", "", "with --listen: the job's servers (host:port,..., @HOSTFILE or slurm; default FITCACHE_SERVERS), so that the node socket serves this node's readers every file of the job (see 'fitcache run')")
	memoryAtExit := fs.String("memory-at-exit", "", "what becomes of the memory tiers' copies when the server exits: clear (the default: no RAM held after the job), disk (moved to the next tier, for at most 20 s) or keep (for the next server); default FITCACHE_MEMORY_AT_EXIT, else the site's (/etc/fitcache.conf)")
	var prefetch optionalInt
	fs.Var(&prefetch, "prefetch", fmt.Sprintf("prefetch runs `N` source reads at once, reading ahead of readers from the file lists they hand over; 0 turns it off (default: FITCACHE_PREFETCH, else %d)", core.DefaultPrefetch))
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
	if prefetch.set {
		opts["prefetch"] = prefetch.String()
	}
	if *memoryAtExit != "" {
		opts["memory_at_exit"] = *memoryAtExit
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
	if *listen != "" && *socket != "" {
		return errors.New("give --listen HOST:PORT or --socket PATH, not both")
	}
	if *socket == "" && *listen == "" && !*asEmbedded {
		return errors.New("give --listen HOST:PORT, --socket PATH, or --embedded for the per-user server")
	}
	idleTimeout := time.Duration(0)
	if *asEmbedded {
		idleTimeout = cfg.IdleTimeout
	} else if *idle > 0 {
		idleTimeout = *idle
	}
	tierCfgs, err := cfg.TierConfigs()
	if err != nil {
		return err
	}
	atExit, keepRefused := cfg.ExitPolicy()
	s, err := server.Start(server.Config{Listen: *listen, Socket: *socket, Embedded: *asEmbedded, Token: token,
		Roots: roots, Tiers: tierCfgs, Verify: cfg.Verify, Prefetch: cfg.Prefetch, BlockBytes: cfg.BlockBytes, RuntimeDir: cfg.RuntimeDir,
		Limits: cfg.Limits(memoryCgroup(log)), MemoryAtExit: atExit,
		Warnings: warnings(cfg.RuntimeDirWarning, keepRefused), MetricsAddr: *metricsAddr, ReadyFile: *readyFile,
		IdleTimeout: idleTimeout, MaxFrameBytes: int(frame.Bytes), MaxConns: *maxConns, Cluster: cfg, Log: log})
	if errors.Is(err, embedded.ErrAlreadyRunning) {
		log.Info("another embedded server is running; exiting", "runtime_dir", cfg.RuntimeDir, "err", err)
		return nil
	}
	if err != nil {
		return err
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(signals)
	var reason string
	select {
	case sig := <-signals:
		reason = "signal " + sig.String()
	case <-s.Done():
		reason = s.Reason()
	}
	log.Info("fitcache server stopping", "reason", reason)
	if err := s.Close(); err != nil {
		log.Warn("fitcache server stopped, not cleanly", "err", err)
		return nil
	}
	log.Info("fitcache server stopped")
	return nil
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
