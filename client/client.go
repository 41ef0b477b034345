// Package client reads dataset files through FitCache. It is what the C ABI and the Python
// package use.
//
// A [Client] serves a read from the first place that has the file:
//
//  1. the tier directories of the server on this node, mapped directly: no RPC, no copy;
//  2. the server, which reads the source once, publishes the file into a tier and names the
//     tier file to map (or sends the bytes when the file cannot be cached);
//  3. the source itself, when the server cannot be reached and cannot be restarted, so that a
//     cache failure never fails a read.
//
// With no servers configured the server is the per-user embedded server (package local),
// started on demand.
//
// Usage:
//
//	c, err := client.Open("/data/train", cfg)
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

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/local"
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

// retryDelay is how long a client reads the source directly after it failed to reach or
// restart the server, before it tries the server again.
const retryDelay = 5 * time.Second

// Client reads files under one dataset root. It is safe for concurrent use.
type Client struct {
	root     string // absolute, clean
	realRoot string // root with symbolic links resolved, for direct source reads
	cfg      core.Config
	log      *slog.Logger

	mu        sync.Mutex // protects server, dirs, gen and downUntil
	server    *rpc.Client
	dirs      []tiers.Dir       // the server's tier directories, fastest first
	gen       *tiers.Generation // the server's removal counter, or nil
	downUntil time.Time         // before then, read the source directly

	maps    *mapCache      // mappings kept between reads
	cluster *clusterRouter // set in cluster mode (Config.Servers)

	counts  counters
	pending hitReport // local hits not yet reported to the server
	closed  atomic.Bool
	stop    chan struct{}
	stopped chan struct{}
}

type counters struct {
	localHits   atomic.Int64 // served from a tier file mapped by this client
	serverReads atomic.Int64 // answered by the server
	directReads atomic.Int64 // read from the source because the server was unavailable
	restarts    atomic.Int64 // embedded server (re)starts this client did or waited for
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
	c := &Client{root: abs, realRoot: real, cfg: cfg, log: log, maps: newMapCache(defaultMaxMappings()),
		stop: make(chan struct{}), stopped: make(chan struct{})}
	c.pending.byTier = make(map[string]int64)
	if cfg.Servers != "" {
		if c.cluster, err = newClusterRouter(cfg, log); err != nil {
			return nil, err
		}
		for _, p := range c.cluster.peers {
			if p.local && (c.server == nil || p.member.ID < c.server.Addr()) {
				c.server = p.rpc // hits served from local tier files are reported to it
			}
		}
	} else if err := c.connect(); err != nil {
		log.Warn("fitcache server unavailable; reading from the source", "err", err)
	}
	go c.reportLoop()
	return c, nil
}

// Root returns the dataset root.
func (c *Client) Root() string { return c.root }

// connect reaches the embedded server, starting it if needed, and learns its tiers.
func (c *Client) connect() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.connectLocked()
}

func (c *Client) connectLocked() error {
	server, err := rpc.Dial(local.SocketPath(c.cfg.RuntimeDir), rpc.ClientConfig{ReadTimeout: c.cfg.ReadTimeout})
	if err != nil {
		return err
	}
	var dirs []tiers.Dir
	var genFile string
	ping := func(ctx context.Context) error {
		hello, err := server.Hello(ctx)
		if err != nil {
			return err
		}
		genFile = hello.GenerationFile
		dirs = dirs[:0]
		for _, t := range hello.Tiers {
			kind, err := tiers.ParseKind(t.Kind)
			if err != nil {
				return err
			}
			dirs = append(dirs, tiers.Dir{Path: t.Dir, Kind: kind})
		}
		return nil
	}
	c.counts.restarts.Add(1)
	if err := local.EnsureRunning(context.Background(), c.cfg, ping); err != nil {
		c.downUntil = time.Now().Add(retryDelay)
		return err
	}
	c.server, c.dirs, c.downUntil = server, dirs, time.Time{}
	// An older counter stays mapped (one page): readers may still be loading it.
	c.gen = nil
	if genFile != "" {
		if c.gen, err = tiers.OpenGeneration(genFile); err != nil {
			c.log.Warn("cannot watch the server's removals; not keeping mappings", "err", err)
		}
	}
	return nil
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
	if c.closed.Load() {
		return nil, core.ErrClosed
	}
	buf, err := c.read(path, 2)
	if err != nil {
		c.counts.errors.Add(1)
	}
	return buf, err
}

// read serves path, reconnecting to the server at most tries times before it reads the
// source directly.
func (c *Client) read(path string, tries int) (Buffer, error) {
	path, err := c.Resolve(path)
	if err != nil {
		return nil, err
	}
	if c.cluster != nil {
		return c.readCluster(path)
	}
	c.mu.Lock()
	server, dirs, gen, down := c.server, c.dirs, c.gen, time.Now().Before(c.downUntil)
	c.mu.Unlock()

	if buf := c.maps.get(path, gen.Load()); buf != nil {
		c.hit(buf.(*mapHandle).s.m)
		return buf, nil
	}
	if m, err := tiers.Probe(dirs, path); err == nil {
		c.hit(m)
		return c.keep(path, m, gen), nil
	}
	if server == nil || down {
		if !down && tries > 0 && c.reconnect(nil) == nil {
			return c.read(path, tries-1)
		}
		return c.readDirect(path)
	}
	buf, err := c.readFromServer(server, dirs, gen, path)
	if errors.Is(err, rpc.ErrUnavailable) {
		c.log.Warn("fitcache server unavailable", "err", err)
		if tries > 0 && c.reconnect(server) == nil {
			return c.read(path, tries-1)
		}
		return c.readDirect(path)
	}
	return buf, err
}

// hit counts a read served from a tier file by this client.
func (c *Client) hit(m *tiers.Mapping) {
	c.counts.localHits.Add(1)
	c.pending.add(m.Tier.String(), m.Size)
}

// keep hands out m through the mapping cache when the server's removals can be watched.
func (c *Client) keep(path string, m *tiers.Mapping, gen *tiers.Generation) Buffer {
	if gen == nil {
		return m
	}
	return c.maps.put(path, m, gen.Load())
}

func (c *Client) readFromServer(server *rpc.Client, dirs []tiers.Dir, gen *tiers.Generation, path string) (Buffer, error) {
	reply, err := server.Read(context.Background(), c.root, path, true)
	if err != nil {
		return nil, err
	}
	c.counts.serverReads.Add(1)
	return c.replyBuffer(server, reply, dirs, path, func(m *tiers.Mapping) Buffer { return c.keep(path, m, gen) })
}

// replyBuffer turns a server's reply to a local read into a buffer: the tier file it names,
// mapped and handed to keep, or the bytes it carries. A tier file evicted between the reply
// and our open is asked for again, as bytes.
func (c *Client) replyBuffer(server *rpc.Client, reply *fitcachepb.ReadReply, dirs []tiers.Dir, path string,
	keep func(*tiers.Mapping) Buffer) (Buffer, error) {
	if reply.CachedPath != "" {
		if m, err := tiers.Probe(dirs, path); err == nil {
			return keep(m), nil
		}
		var err error
		if reply, err = server.Read(context.Background(), c.root, path, false); err != nil {
			return nil, err
		}
	}
	return heapBuffer(reply.Data), nil
}

// reconnect replaces a server that failed (nil: none yet), unless another reader already did.
func (c *Client) reconnect(failed *rpc.Client) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.server != failed && c.server != nil {
		return nil // someone else reconnected meanwhile
	}
	if time.Now().Before(c.downUntil) {
		return rpc.ErrUnavailable
	}
	c.server = nil
	err := c.connectLocked()
	if err != nil {
		c.log.Warn("cannot restart the fitcache server; reading from the source", "err", err, "retry_in", retryDelay)
	}
	return err
}

// readDirect reads the source without the cache; the dataset-root checks still apply.
func (c *Client) readDirect(path string) (Buffer, error) {
	data, _, err := core.ReadSource(path, c.realRoot)
	if err != nil {
		return nil, err
	}
	c.counts.directReads.Add(1)
	return heapBuffer(data), nil
}

// Size returns the size of the file at path: from its cached copy when there is one, else
// from the source's metadata (no data is read).
func (c *Client) Size(path string) (int64, error) {
	path, err := c.Resolve(path)
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	dirs := c.dirs
	c.mu.Unlock()
	if m, err := tiers.Probe(dirs, path); err == nil {
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
		DirectReads: c.counts.directReads.Load(), Connects: c.counts.restarts.Load(),
		Errors: c.counts.errors.Load(),
	}}
	if c.cluster != nil {
		out.Client.ServersDead, out.Client.ServersRejoined = c.cluster.deaths.Load(), c.cluster.rejoins.Load()
		out.Client.ServersGossiped, out.Client.ServerFailures = c.cluster.gossiped.Load(), c.cluster.failures.Load()
		if c.server != nil {
			c.flushHits(c.server)
		}
		out.Servers = c.cluster.stats()
		b, err := json.Marshal(out)
		return string(b), err
	}
	c.mu.Lock()
	server := c.server
	c.mu.Unlock()
	if server != nil {
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
// count reads the server never saw.
func (c *Client) reportLoop() {
	defer close(c.stopped)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-tick.C:
			c.mu.Lock()
			server := c.server
			c.mu.Unlock()
			if server != nil {
				c.flushHits(server)
			}
		}
	}
}

// Close reports pending hits and stops the client. It is idempotent. Buffers already handed
// out stay valid until released.
func (c *Client) Close() error {
	if c.closed.Swap(true) {
		return nil
	}
	close(c.stop)
	<-c.stopped
	c.mu.Lock()
	server := c.server
	c.mu.Unlock()
	if server != nil {
		c.flushHits(server)
	}
	if c.cluster != nil {
		c.cluster.close()
	}
	c.maps.flush()
	return nil
}
