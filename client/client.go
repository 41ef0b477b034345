// Package client reads dataset files through FitCache. It is what the C ABI and the Python
// package use for what the C hit path of libfitcache (capi/hitpath.c) does not do itself:
// reaching and restarting the server, cluster mode, reads while the server is down.
//
// A [Client] serves a read from the first place that has the file:
//
//  1. the tier directories of the server on this node, mapped directly: no RPC;
//  2. the server, which reads the source once, publishes the file into a tier and names the
//     tier file to map (or sends the bytes when the file cannot be cached); [Client.Fetch]
//     stops there, for callers that read the tier file themselves;
//  3. the source itself, when the server cannot be reached and cannot be restarted, so that a
//     cache failure never fails a read.
//
// With no servers configured the server is the per-user embedded server (package embedded),
// started on demand. In cluster mode a cluster server also uses a Client to answer the
// preload shim's misses for files other servers own ([Client.OpenForReader]).
//
// Usage:
//
//	cfg, err := core.LoadConfig(nil)
//	...
//	c, err := client.Open("/data/train", cfg, slog.Default())
//	...
//	defer c.Close()
//	buf, err := c.Read("/data/train/0001.jpg")
//	defer buf.Release()
//	use(buf.Bytes())
package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/edsrzf/mmap-go"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// Buffer is a file's bytes: a read-only mapping of a cached file, or memory holding them.
// Release it when done; Release is idempotent.
type Buffer interface {
	Bytes() []byte
	Release() error
}

type heapBuffer []byte

func (b heapBuffer) Bytes() []byte  { return b }
func (b heapBuffer) Release() error { return nil }

// sourceMapping is a read-only mapping of a source file too large to copy.
type sourceMapping struct {
	mu sync.Mutex // protects m
	m  mmap.MMap  // nil once released
}

func (s *sourceMapping) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m
}

func (s *sourceMapping) Release() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		return nil
	}
	err := s.m.Unmap()
	s.m = nil
	return err
}

// Back-off after the embedded server could not be reached or restarted: reads go to the
// source for this long, doubling up to the maximum while the server stays unusable.
const (
	minBackoff = time.Second
	maxBackoff = 30 * time.Second
)

// Client reads files under one dataset root. It is safe for concurrent use.
type Client struct {
	root     string // absolute, clean
	realRoot string // root with symbolic links resolved, for direct source reads
	cfg      core.Config
	log      *slog.Logger

	// life is held shared by every read and exclusively by Close, which so waits for reads
	// in progress (each bounded by the read timeout) before it frees what they use.
	life sync.RWMutex

	mu        sync.Mutex    // protects conn, downUntil, backoff and attempt; never held while waiting
	conn      *serverConn   // the embedded server, or nil while not connected
	downUntil time.Time     // before then, read the source directly
	backoff   time.Duration // the next back-off
	attempt   *connectAttempt

	// view is the last connection that succeeded, kept when it fails: its tier directories
	// and removal counter stay usable while the server does not answer, so files cached
	// before keep being served from the tiers without waiting for it.
	view atomic.Pointer[serverConn]

	cluster *clusterRouter // set in cluster mode (Config.Servers)
	own     *ownServer     // the cluster server this client runs in, if any (see SetOwnServer)
	spawned atomic.Bool    // set once this client started (or waited for) a server

	counts   counters
	external atomic.Pointer[func() ExternalCounts]                // see SetExternalCounts
	onState  atomic.Pointer[func(up bool, backoff time.Duration)] // see SetOnServerState
	pending  hitReport                                            // local hits not yet reported to the server
	pf       prefetchJobs                                         // prefetch jobs to renew (see Prefetch)
	closed   atomic.Bool
	stop     chan struct{}
	stopped  chan struct{}
}

// serverConn is a connection to the embedded server and what it told about itself.
type serverConn struct {
	rpc  *rpc.Client
	dirs []tiers.Dir       // the server's tier directories, fastest first
	gen  *tiers.Generation // the server's removal counter, or nil
}

// tierView returns the tier directories and removal counter of the last server that
// answered (none before the first).
func (c *Client) tierView() ([]tiers.Dir, *tiers.Generation) {
	if v := c.view.Load(); v != nil {
		return v.dirs, v.gen
	}
	return nil, nil
}

// connectAttempt is one try at reaching (or starting) the embedded server; readers that need
// the server while it runs wait for it, each no longer than its read timeout.
type connectAttempt struct {
	done chan struct{} // closed when err is set
	err  error
}

type counters struct {
	localHits   atomic.Int64 // served from a tier file mapped by this client
	serverReads atomic.Int64 // answered by the server
	directReads atomic.Int64 // read from the source because the server was unavailable
	connects    atomic.Int64 // attempts to reach or start the embedded server
	errors      atomic.Int64
}

type hitReport struct {
	mu     sync.Mutex // protects byTier and bytes
	byTier map[string]int64
	bytes  int64
}

// Open returns a client for the dataset under root, connecting to (and if needed starting)
// the embedded server. A server that cannot be started is not an error: reads then go to the
// source until it can be.
func Open(root string, cfg core.Config, log *slog.Logger) (*Client, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, err
	}
	fi, err := os.Stat(abs)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, &os.PathError{Op: "open dataset", Path: abs, Err: syscall.ENOTDIR}
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return nil, err
	}
	c := &Client{root: abs, realRoot: real, cfg: cfg, log: log,
		stop: make(chan struct{}), stopped: make(chan struct{})}
	c.pending.byTier = make(map[string]int64)
	if cfg.Servers != "" {
		if c.cluster, err = newClusterRouter(cfg, log); err != nil {
			return nil, err
		}
	} else if _, err := c.ensureConn(nil, cfg.StartTimeout+cfg.ReadTimeout); err != nil {
		log.Warn("fitcache server unavailable; reading from the source", "err", err)
	}
	go c.reportLoop()
	return c, nil
}

// Root returns the dataset root.
func (c *Client) Root() string { return c.root }

// RealRoot returns the dataset root with its symbolic links resolved: files are opened
// beneath it (see core.OpenSource).
func (c *Client) RealRoot() string { return c.realRoot }

// current returns the connection to the embedded server and whether reads should skip it
// for now (it failed recently).
func (c *Client) current() (conn *serverConn, down bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conn, time.Now().Before(c.downUntil)
}

// ensureConn returns a working connection to the embedded server: the current one unless it
// is failed, else the result of a connection attempt (started here, or already running),
// waited for at most wait. While the server is backing off it returns ErrUnavailable at once.
// No lock is held while waiting, so reads of cached files never wait on the server.
func (c *Client) ensureConn(failed *serverConn, wait time.Duration) (*serverConn, error) {
	c.mu.Lock()
	if c.conn != nil && c.conn != failed {
		conn := c.conn
		c.mu.Unlock()
		return conn, nil
	}
	if failed != nil && c.conn == failed {
		c.conn = nil
		go failed.rpc.Close() // it waits for calls still in flight on it
	}
	if time.Now().Before(c.downUntil) {
		c.mu.Unlock()
		return nil, fmt.Errorf("%w: backing off after a failure", rpc.ErrUnavailable)
	}
	a := c.attempt
	if a == nil {
		a = &connectAttempt{done: make(chan struct{})}
		c.attempt = a
		go c.connect(a)
	}
	c.mu.Unlock()

	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-a.done:
	case <-timer.C:
		return nil, fmt.Errorf("%w: no answer within %s", rpc.ErrUnavailable, wait)
	}
	if a.err != nil {
		return nil, a.err
	}
	conn, _ := c.current()
	if conn == nil {
		return nil, fmt.Errorf("%w: connection lost", rpc.ErrUnavailable)
	}
	return conn, nil
}

// connect runs one connection attempt: it reaches the embedded server, starting it if none
// runs (see embedded.EnsureRunning, which gives up at once on a server that holds the lock but
// does not answer), and learns its tiers. On failure reads go to the source for a back-off
// that doubles while the server stays unusable.
func (c *Client) connect(a *connectAttempt) {
	c.counts.connects.Add(1)
	conn, err := c.dial()
	c.mu.Lock()
	if err == nil && c.closed.Load() {
		conn.rpc.Close()
		conn.gen.Close()
		closeDirs(conn.dirs)
		err = core.ErrClosed
	}
	if err == nil {
		c.conn, c.downUntil, c.backoff = conn, time.Time{}, 0
		c.tellState(true, 0)
		if old := c.view.Swap(conn); old != nil {
			// Safe while readers use them: a closed counter reads 0, a closed directory
			// gives misses.
			old.gen.Close()
			closeDirs(old.dirs)
		}
	} else {
		c.backoff = min(max(2*c.backoff, minBackoff), maxBackoff)
		c.downUntil = time.Now().Add(c.backoff)
		c.log.Warn("fitcache server unavailable; reading from the source", "err", err, "retry_in", c.backoff)
		c.tellState(false, c.backoff)
	}
	a.err = err
	c.attempt = nil
	c.mu.Unlock()
	close(a.done)
}

// dial connects to the embedded server, starting it if needed.
func (c *Client) dial() (*serverConn, error) {
	if err := embedded.CheckSocket(c.cfg.RuntimeDir); err != nil {
		return nil, fmt.Errorf("%w: %w", rpc.ErrUnavailable, err)
	}
	server, err := rpc.Dial(embedded.SocketPath(c.cfg.RuntimeDir), rpc.ClientConfig{ReadTimeout: c.cfg.ReadTimeout,
		CallTimeout: min(2*time.Second, c.cfg.ReadTimeout)})
	if err != nil {
		return nil, err
	}
	var hello *fitcachepb.HelloReply
	ping := func(ctx context.Context) error {
		var err error
		hello, err = server.Hello(ctx)
		return err
	}
	if err := embedded.EnsureRunning(context.Background(), c.cfg, ping); err != nil {
		server.Close()
		return nil, fmt.Errorf("%w: %w", rpc.ErrUnavailable, err)
	}
	conn := &serverConn{rpc: server, dirs: tierDirs(hello.Tiers, c.log)}
	if hello.GenerationFile != "" {
		if conn.gen, err = tiers.OpenGeneration(hello.GenerationFile); err != nil {
			c.log.Warn("cannot watch the server's removals; not keeping mappings", "err", err)
		}
	}
	return conn, nil
}

// tierDirs opens the tiers of a Hello reply as directories to read (held open and checked
// once, see tiers.OpenDir), skipping with a log line a tier of an unknown kind or one that
// cannot be used. Close them with closeDirs.
func tierDirs(infos []*fitcachepb.TierInfo, log *slog.Logger) []tiers.Dir {
	var dirs []tiers.Dir
	for _, t := range infos {
		kind, err := tiers.ParseKind(t.Kind)
		var d tiers.Dir
		if err == nil {
			d, err = tiers.OpenDir(t.Dir, kind)
		}
		if err != nil {
			log.Warn("ignoring a tier of the server", "dir", t.Dir, "err", err)
			continue
		}
		dirs = append(dirs, d)
	}
	return dirs
}

// closeDirs closes directories from tierDirs; readers still using them get misses.
func closeDirs(dirs []tiers.Dir) {
	for _, d := range dirs {
		d.Close()
	}
}

// Resolve turns a path relative to the root, or absolute, into a clean absolute path inside
// the root, or reports why it is not one.
func (c *Client) Resolve(path string) (string, error) {
	if !filepath.IsAbs(path) {
		path = filepath.Join(c.root, path)
	}
	path = filepath.Clean(path)
	if !core.Within(path, c.root) {
		return "", fmt.Errorf("%w: %s is not under %s", core.ErrOutsideRoot, path, c.root)
	}
	return path, nil
}

// Read returns the whole file at path (absolute, or relative to the root).
func (c *Client) Read(path string) (Buffer, error) {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return nil, core.ErrClosed
	}
	buf, err := c.read(path)
	if err != nil {
		c.counts.errors.Add(1)
	}
	return buf, err
}

// Fetch is Read for a caller that reads cached files from the tiers itself (the C hit path of
// libfitcache): when the file is in a tier of the server on this node, or the server just put
// it there, it returns cached true and no buffer, without mapping the file. Otherwise it
// returns the file as Read does (a file no tier takes, no server, cluster mode).
func (c *Client) Fetch(path string) (cached bool, buf Buffer, err error) {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return false, nil, core.ErrClosed
	}
	buf, err = c.readInto(path, false)
	if err != nil {
		c.counts.errors.Add(1)
	}
	return err == nil && buf == nil, buf, err
}

// read serves path: from a tier file of the server, from the server, or from the source when
// the server is unavailable. It waits for a server problem no longer than the read timeout.
func (c *Client) read(path string) (Buffer, error) { return c.readInto(path, true) }

// readInto is read; without mapTiers, a file found in (or just published into) a tier of
// the server on this node gives a nil buffer and no error instead of a mapping.
func (c *Client) readInto(path string, mapTiers bool) (Buffer, error) {
	path, err := c.Resolve(path)
	if err != nil {
		return nil, err
	}
	if c.cluster != nil {
		return c.readCluster(path)
	}
	dirs, _ := c.tierView()
	if !mapTiers && tiers.Listed(dirs, path) {
		return nil, nil
	}
	if m, err := tiers.Probe(dirs, path); err == nil {
		c.hit(m)
		return m, nil
	}
	if _, down := c.current(); down {
		return c.readDirect(path)
	}
	deadline := time.Now().Add(c.cfg.ReadTimeout)
	var failed *serverConn
	for try := 0; try < 2; try++ {
		conn, err := c.ensureConn(failed, time.Until(deadline))
		if err != nil {
			break
		}
		buf, err := c.readFromServer(conn, path, deadline, mapTiers)
		if errors.Is(err, core.ErrTooLarge) {
			return c.readDirect(path)
		}
		if !errors.Is(err, rpc.ErrUnavailable) {
			return buf, err
		}
		c.log.Warn("fitcache server unavailable", "err", err)
		failed = conn
	}
	return c.readDirect(path)
}

// hit counts a read served from a tier file by this client.
func (c *Client) hit(m *tiers.Mapping) {
	c.counts.localHits.Add(1)
	c.pending.add(m.Tier.String(), m.Size)
}

func (c *Client) readFromServer(conn *serverConn, path string, deadline time.Time, mapTiers bool) (Buffer, error) {
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	reply, err := conn.rpc.Read(ctx, c.root, path, true)
	if err != nil {
		return nil, err
	}
	c.counts.serverReads.Add(1)
	if !mapTiers && reply.CachedPath != "" {
		return nil, nil
	}
	return c.replyBuffer(ctx, conn.rpc, reply, conn.dirs, path)
}

// replyBuffer turns a server's reply to a local read into a buffer: the tier file it names,
// mapped, or the bytes it carries. A tier file evicted between the reply and our open is
// asked for again, as bytes.
func (c *Client) replyBuffer(ctx context.Context, server *rpc.Client, reply *fitcachepb.ReadReply, dirs []tiers.Dir, path string) (Buffer, error) {
	if reply.CachedPath != "" {
		if m, err := tiers.Probe(dirs, path); err == nil {
			return m, nil
		}
		var err error
		if reply, err = server.Read(ctx, c.root, path, false); err != nil {
			return nil, err
		}
	}
	return heapBuffer(reply.Data), nil
}

// directReadMax is the largest file a direct source read copies into memory; larger files are
// mapped, so that no file is ever held whole in this process's memory.
const directReadMax = 1 << 20

// readDirect reads the source without the cache; the dataset-root checks still apply. A
// large file is mapped rather than copied.
func (c *Client) readDirect(path string) (Buffer, error) {
	src, err := core.OpenSource(c.root, c.realRoot, path)
	if err != nil {
		return nil, err
	}
	defer src.Close()
	var buf Buffer
	if src.Size() > directReadMax {
		m, err := src.Map()
		if err != nil {
			return nil, err
		}
		buf = &sourceMapping{m: m}
	} else {
		data, err := src.ReadAll()
		if err != nil {
			return nil, err
		}
		buf = heapBuffer(data)
	}
	c.counts.directReads.Add(1)
	return buf, nil
}

// Size returns the size of the file at path: from its cached copy when there is one, else
// from the source's metadata (no data is read).
func (c *Client) Size(path string) (int64, error) {
	path, err := c.Resolve(path)
	if err != nil {
		return 0, err
	}
	if m, err := tiers.Probe(c.localDirs(), path); err == nil {
		defer m.Release()
		return m.Size, nil
	}
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return 0, err
	}
	if !core.Within(real, c.realRoot) {
		return 0, fmt.Errorf("%w: %s resolves to %s, outside %s", core.ErrOutsideRoot, path, real, c.realRoot)
	}
	fi, err := os.Stat(real)
	if err != nil {
		return 0, err
	}
	if fi.IsDir() {
		return 0, &os.PathError{Op: "size", Path: path, Err: syscall.EISDIR}
	}
	return fi.Size(), nil
}

// ReadAt copies up to len(p) bytes of the file at path, starting at off, into p, and returns
// how many it copied (0 at or past the end).
func (c *Client) ReadAt(path string, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%w: negative offset", core.ErrBadPath)
	}
	buf, err := c.Read(path)
	if err != nil {
		return 0, err
	}
	defer buf.Release()
	b := buf.Bytes()
	if off >= int64(len(b)) {
		return 0, nil
	}
	return copy(p, b[off:]), nil
}

// ClientStats are a client's own counters.
type ClientStats struct {
	LocalHits   int64 `json:"local_hits"`
	ServerReads int64 `json:"server_reads"`
	DirectReads int64 `json:"direct_reads"`
	Connects    int64 `json:"connects"`
	Errors      int64 `json:"errors"`
	// Cluster mode: servers this client declared dead itself, or because a server's other
	// clients had; dead servers that came back; calls that got no answer.
	ServersDead     int64 `json:"servers_declared_dead,omitempty"`
	ServersGossiped int64 `json:"servers_dead_by_gossip,omitempty"`
	ServersRejoined int64 `json:"servers_rejoined,omitempty"`
	ServerFailures  int64 `json:"server_failures,omitempty"`
}

// Stats returns this client's counters and, when the server answers, the server's (after
// reporting this client's pending hits to it), as JSON: {"client": {...}, "server": {...}}.
func (c *Client) Stats() (string, error) {
	out := struct {
		Client  ClientStats                `json:"client"`
		Server  json.RawMessage            `json:"server,omitempty"`
		Servers map[string]json.RawMessage `json:"servers,omitempty"`
		Error   string                     `json:"server_error,omitempty"`
	}{Client: ClientStats{
		LocalHits: c.counts.localHits.Load(), ServerReads: c.counts.serverReads.Load(),
		DirectReads: c.counts.directReads.Load(), Connects: c.counts.connects.Load(),
		Errors: c.counts.errors.Load(),
	}}
	if f := c.external.Load(); f != nil {
		ext := (*f)()
		out.Client.LocalHits += ext.Hits
		out.Client.ServerReads += ext.Fetches
		out.Client.DirectReads += ext.Direct
	}
	if c.cluster != nil {
		out.Client.ServersDead, out.Client.ServersRejoined = c.cluster.deaths.Load(), c.cluster.rejoins.Load()
		out.Client.ServersGossiped, out.Client.ServerFailures = c.cluster.gossiped.Load(), c.cluster.failures.Load()
		if server := c.reportTo(); server != nil {
			c.flushHits(server)
		}
		out.Servers = c.cluster.stats()
		b, err := json.Marshal(out)
		return string(b), err
	}
	if server := c.reportTo(); server != nil {
		c.flushHits(server)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if js, err := server.Stats(ctx); err == nil {
			out.Server = json.RawMessage(js)
		} else {
			out.Error = err.Error()
		}
	} else {
		out.Error = "no server"
	}
	b, err := json.Marshal(out)
	return string(b), err
}

func (h *hitReport) add(tier string, bytes int64) {
	h.mu.Lock()
	h.byTier[tier]++
	h.bytes += bytes
	h.mu.Unlock()
}

// take returns the pending report and clears it.
func (h *hitReport) take() (map[string]int64, int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.byTier) == 0 {
		return nil, 0
	}
	by, bytes := h.byTier, h.bytes
	h.byTier, h.bytes = make(map[string]int64), 0
	return by, bytes
}

// flushHits reports pending local hits; a failed report is put back for the next try.
func (c *Client) flushHits(server *rpc.Client) {
	by, bytes := c.pending.take()
	if by == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := server.ReportHits(ctx, by, bytes); err != nil {
		c.pending.mu.Lock()
		for k, v := range by {
			c.pending.byTier[k] += v
		}
		c.pending.bytes += bytes
		c.pending.mu.Unlock()
	}
}

// reportLoop reports local hits to the server once a second, so that server statistics
// count reads the server never saw, drops kept mappings of files the server removed
// meanwhile, so that an idle client does not keep evicted files alive in the tiers, and
// renews the client's prefetch jobs.
func (c *Client) reportLoop() {
	defer close(c.stopped)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-tick.C:
			if server := c.reportTo(); server != nil {
				c.flushHits(server)
			}
			c.renewPrefetch()
		}
	}
}

// reportTo returns the server that local hits are reported to: the embedded server, or in
// cluster mode the first server on this node.
func (c *Client) reportTo() *rpc.Client {
	if c.cluster != nil {
		return c.cluster.localServer()
	}
	if conn, _ := c.current(); conn != nil {
		return conn.rpc
	}
	return nil
}

// ExternalCounts are reads that the C layer of libfitcache served without this client.
type ExternalCounts struct {
	Hits    int64 // from the server's tiers (the hit path)
	Fetches int64 // misses the server cached for it (through its node socket)
	Direct  int64 // files it read from the source (no room for them in the tiers)
}

// SetExternalCounts gives the client a count of the reads served around it (see
// ExternalCounts), which Stats adds to its own. The server counts those hits and fetches
// itself (through the tiers' index and its node socket).
func (c *Client) SetExternalCounts(count func() ExternalCounts) { c.external.Store(&count) }

// MarkUnavailable tells the client that its server did not answer a caller that went around
// it (the node socket of the C hit path): reads go to the source for a back-off, as after a
// failed connection, instead of waiting for the server once more.
func (c *Client) MarkUnavailable() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Now().Before(c.downUntil) {
		return
	}
	c.backoff = min(max(2*c.backoff, minBackoff), maxBackoff)
	c.downUntil = time.Now().Add(c.backoff)
	c.log.Warn("fitcache server did not answer; reading from the source", "retry_in", c.backoff)
	c.tellState(false, c.backoff)
}

// SetOnServerState gives the client a function to call whenever it connects to its server
// (up) and whenever it decides to read without it for a while (it could not reach or start
// it, or the server did not answer), with the back-off, so that callers going around the
// client (the C hit path's node socket) use the server exactly when the client does. It is
// called at once with the current state.
func (c *Client) SetOnServerState(f func(up bool, backoff time.Duration)) {
	c.onState.Store(&f)
	c.mu.Lock()
	up, left := c.conn != nil, time.Until(c.downUntil)
	c.mu.Unlock()
	f(up && left <= 0, max(left, 0))
}

// tellState calls the SetOnServerState function, if any.
func (c *Client) tellState(up bool, backoff time.Duration) {
	if f := c.onState.Load(); f != nil {
		(*f)(up, backoff)
	}
}

// TierDirs returns the tier directories on this node that the client reads cached files
// from (its server's, or in cluster mode those of the servers on this node), fastest first.
func (c *Client) TierDirs() []tiers.Dir { return c.localDirs() }

// NodeSocket returns the node socket (see package nodesock) where C code on this node
// without Go asks for the files it misses: the embedded server's or, in cluster mode, that
// of the first live server on this node (by address) that announced one in its hello, which
// answers opens for every file of the job (see OpenForReader); "" when there is none.
func (c *Client) NodeSocket() string {
	if c.cluster != nil {
		return c.cluster.nodeSocket()
	}
	return nodesock.PathFor(embedded.SocketPath(c.cfg.RuntimeDir))
}

// localDirs returns the tier directories this client maps files from.
func (c *Client) localDirs() []tiers.Dir {
	if c.cluster != nil {
		return c.cluster.localDirs()
	}
	dirs, _ := c.tierView()
	return dirs
}

// generation returns the removal generation of the servers whose files this client maps.
func (c *Client) generation() uint64 {
	if c.cluster != nil {
		return c.cluster.generation()
	}
	_, gen := c.tierView()
	return gen.Load()
}

// Close reports pending hits and stops the client, after reads in progress have ended. It
// closes the client's connections and unmaps what it kept. It is idempotent. Buffers already
// handed out stay valid until released.
func (c *Client) Close() error {
	if c.closed.Swap(true) {
		return nil
	}
	close(c.stop)
	<-c.stopped
	if server := c.reportTo(); server != nil {
		c.flushHits(server)
	}
	// A connection attempt still running frees what it made itself, seeing closed; wait for
	// it (no lock held: reads go on meanwhile) so that nothing outlives the client.
	c.mu.Lock()
	attempt := c.attempt
	c.mu.Unlock()
	if attempt != nil {
		<-attempt.done
	}
	c.life.Lock() // no read is in progress from here on
	defer c.life.Unlock()
	c.mu.Lock()
	conn := c.conn
	c.conn = nil
	c.mu.Unlock()
	if conn != nil {
		conn.rpc.Close()
	}
	if v := c.view.Swap(nil); v != nil {
		v.gen.Close()
		closeDirs(v.dirs)
	}
	if c.cluster != nil {
		c.cluster.close()
	}
	return nil
}

// IsMapped reports whether a buffer's bytes are a file mapping rather than memory of the Go
// heap (which C code must not keep).
func IsMapped(b Buffer) bool {
	switch b.(type) {
	case *tiers.Mapping, *sourceMapping:
		return true
	}
	return false
}
