// Package client reads dataset files through FitCache. It is what the C ABI and the Python
// package use for what the C hit path of libfitcache (capi/hitpath.c, capi/miss.c) does not do itself:
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
// started on demand. In cluster mode a reader on a node with servers of the job reads through
// their node socket; elsewhere it routes over the ring itself (package routing).
//
// Usage:
//
//	cfg, err := config.Load(nil)
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
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"sync"

	"sync/atomic"
	"syscall"
	"time"

	"github.com/edsrzf/mmap-go"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/discovery"
	"github.com/fitcache/fitcache/routing"
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

func (b heapBuffer) Bytes() []byte { return b }

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

// Client reads files under one dataset root. It is safe for concurrent use.
type Client struct {
	root     string // absolute, clean
	realRoot string // root with symbolic links resolved, for direct source reads
	cfg      config.Config
	log      *slog.Logger

	// life is held shared by every read and exclusively by Close, which so waits for reads
	// in progress (each bounded by the read timeout) before it frees what they use.
	life sync.RWMutex

	// standIn serves readers forked from this process when no server of the node answers
	// (see standin.go).
	standIn standIn

	mu        sync.Mutex    // protects conn, downUntil, backoff and attempt; never held while waiting
	conn      *serverConn   // the embedded server, or nil while not connected
	downUntil time.Time     // before then, read the source directly
	backoff   time.Duration // the next back-off
	attempt   *connectAttempt

	// view is the last connection that succeeded, kept when it fails: its tier directories
	// stay usable while the server does not answer, so files cached before keep being
	// served from the tiers without waiting for it.
	view atomic.Pointer[serverConn]

	cluster *routing.Router // set in cluster mode (Config.Servers) on a node without a server of the job
	node    *nodeRouter     // set in cluster mode on a node with servers of the job (see noderouter.go)
	// deadTiers serves copies from the tiers of this node's servers while they do not answer
	// (cluster mode; see deadtiers.go).
	deadTiers *deadTiers

	// notLarge: files found under core.ReadNowBytes (read whole, see source), path ->
	// struct{}, at most notLargeMax (notLargeCount counts the attempts to add one).
	notLarge      sync.Map
	notLargeCount atomic.Int64

	counts   counters
	external atomic.Pointer[func() ExternalCounts]                // see SetExternalCounts
	onState  atomic.Pointer[func(up bool, backoff time.Duration)] // see SetOnServerState
	pending  hitReport                                            // local hits not yet reported to the server
	pf       prefetchJobs                                         // prefetch jobs to renew (see Prefetch)
	ranges   rangeFiles                                           // files kept open for ReadAt (see ranges.go)
	brings   blockBrings                                          // blocks being cached for ReadAt
	closed   atomic.Bool
	stop     chan struct{}
	stopped  chan struct{}
	// reads is the context of reads' calls to servers, cancelled by Close so that it does not
	// wait for misses in flight (a server busy with a large file, one that stopped); nil in a
	// Client not made by Open.
	reads      context.Context
	cancelRead context.CancelFunc
}

type counters struct {
	localHits   atomic.Int64 // served from a tier file mapped by this client
	serverReads atomic.Int64 // answered by the server
	directReads atomic.Int64 // read from the source because the server was unavailable
	// sourceOpens counts the opens of large files' sources for ranges (see largeSize),
	// sourceRanges and sourceRangeBytes the ranges read from them (blocks not cached).
	sourceOpens      atomic.Int64
	sourceRanges     atomic.Int64
	sourceRangeBytes atomic.Int64
	connects         atomic.Int64 // attempts to reach or start the embedded server
	errors           atomic.Int64
}

// Open returns a client for the dataset under root, connecting to (and if needed starting)
// the embedded server. A server that cannot be started is not an error: reads then go to the
// source until it can be.
func Open(root string, cfg config.Config, log *slog.Logger) (*Client, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	abs, real, err := core.DatasetRoot(root)
	if err != nil {
		return nil, err
	}
	if cfg.Job == "" {
		cfg.Job = NewJobID() // a job of its own: its copies are checked once for it
	}
	c := &Client{root: abs, realRoot: real, cfg: cfg, log: log,
		stop: make(chan struct{}), stopped: make(chan struct{})}
	c.reads, c.cancelRead = context.WithCancel(context.Background())
	c.pending.byTier = make(map[string]int64)
	if cfg.Servers != "" {
		members, token, err := discovery.Job(cfg.ServerSpec(), cfg.Token, cfg.TokenFile)
		if err != nil {
			return nil, err
		}
		c.deadTiers = newDeadTiers(cfg.RuntimeDir, log)
		if !cfg.Direct {
			if c.node, err = newNodeRouter(cfg, log, members, token); err != nil {
				return nil, err
			}
		}
		if c.node == nil {
			if c.cluster, err = routing.New(cfg, log, members, token, routing.Options{}); err != nil {
				return nil, err
			}
			// The node's server did not answer the node router's hello but the direct path
			// waited for it (it was starting, not dead): take the node's path after all.
			if !cfg.Direct && c.cluster.LocalAnswered() {
				if node, err := newNodeRouter(cfg, log, members, token); err == nil && node != nil {
					if err := c.cluster.Close(); err != nil {
						log.Warn("closing the direct path's connections", "err", err)
					}
					c.cluster, c.node = nil, node
				}
			}
		}
	} else if _, err := c.ensureConn(nil, cfg.StartTimeout+cfg.ReadTimeout); err != nil {
		log.Warn("fitcache server unavailable; reading from the source", "err", err)
	}
	go c.reportLoop()
	return c, nil
}

// NewJobID returns a new random job id (see config.Config.Job).
func NewJobID() string {
	var b [12]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Job returns the id of the client's job (config.Config.Job, or the one Open made up).
func (c *Client) Job() string { return c.cfg.Job }

// Root returns the dataset root.
func (c *Client) Root() string { return c.root }

// RealRoot returns the dataset root with its symbolic links resolved: files are opened
// beneath it (see core.OpenSource).
func (c *Client) RealRoot() string { return c.realRoot }

// Resolve turns a path relative to the root, or absolute, into a clean absolute path inside
// the root, or reports why it is not one.
func (c *Client) Resolve(path string) (string, error) {
	return core.ResolveIn(c.root, path)
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
	if c.node != nil {
		return c.readNode(path, mapTiers)
	}
	if c.cluster != nil {
		return c.readCluster(path)
	}
	dirs := c.tierView()
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
		if err != nil && c.readsEnded() {
			return nil, core.ErrClosed
		}
		if errors.Is(err, core.ErrTooLarge) {
			return c.readDirect(path)
		}
		if errors.Is(err, errNoProbeAnswer) { // hung: no reconnection would answer either
			c.MarkUnavailable()
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

// readContext returns the context of a read's calls to servers: it ends at deadline, or at
// once when the client is closed (see Close).
func (c *Client) readContext(deadline time.Time) (context.Context, context.CancelFunc) {
	if c.reads == nil {
		return context.WithDeadline(context.Background(), deadline)
	}
	return context.WithDeadline(c.reads, deadline)
}

// readsEnded reports whether Close ended the reads' calls to servers: a read whose call
// failed then returns core.ErrClosed rather than reading the source for a caller that is
// done with the client.
func (c *Client) readsEnded() bool { return c.reads != nil && c.reads.Err() != nil }

func (c *Client) readFromServer(conn *serverConn, path string, deadline time.Time, mapTiers bool) (Buffer, error) {
	ctx, cancel := c.readContext(deadline)
	defer cancel()
	unwatch := watchServer(ctx, conn.rpc, cancel)
	reply, err := conn.rpc.Read(ctx, c.root, path, true)
	if hung := unwatch(); err != nil && hung {
		return nil, fmt.Errorf("%w: %w", rpc.ErrUnavailable, errNoProbeAnswer)
	}
	if err != nil {
		return nil, err
	}
	c.counts.serverReads.Add(1)
	if !mapTiers && reply.CachedPath != "" {
		return nil, nil
	}
	return c.replyBuffer(ctx, conn.rpc, reply, conn.dirs, path)
}

// A read the server has not answered after probeAfter is watched: a Hello goes to the
// server then, and again every probeAfter while the read runs, each waiting at most
// probeTimeout. A server busy with a long source read answers it, and the read goes on
// (up to the read timeout); one that does not (stopped with SIGSTOP, hung: the kernel still
// accepts its connections) has the read abandoned, so that it costs a miss about
// probeAfter+probeTimeout instead of the whole read timeout.
const (
	probeAfter   = 500 * time.Millisecond
	probeTimeout = time.Second
)

// errNoProbeAnswer reports a read abandoned because its server did not answer a probe.
var errNoProbeAnswer = errors.New("the server did not answer a probe beside a read")

// watchServer probes server while a call under ctx runs (see probeAfter), and cancels the
// call through cancel when a probe gets no answer. The returned function ends the watch at
// once (a probe in flight is cancelled) and reports whether it gave up on the server.
// Liveness decides, not the time the call takes: a probe answered, or failed at once, keeps
// the call waiting.
func watchServer(ctx context.Context, server *rpc.Client, cancel context.CancelFunc) (unwatch func() (hung bool)) {
	wctx, stop := context.WithCancel(ctx)
	var hung atomic.Bool
	go func() {
		timer := time.NewTimer(probeAfter)
		defer timer.Stop()
		for {
			select {
			case <-wctx.Done():
				return
			case <-timer.C:
			}
			pctx, pcancel := context.WithTimeout(wctx, probeTimeout)
			_, err := server.Hello(pctx)
			// Only a probe left without an answer tells of a hung server: one that failed
			// otherwise (a pooled connection the server closed) is no sign against a live
			// server, and the call itself fails if the server is gone.
			unanswered := errors.Is(pctx.Err(), context.DeadlineExceeded)
			pcancel()
			if err != nil && unanswered && wctx.Err() == nil {
				hung.Store(true) // before cancel: the call returns after it, and sees it
				cancel()
				return
			}
			timer.Reset(probeAfter)
		}
	}()
	return func() bool {
		stop()
		return hung.Load()
	}
}

// replyBuffer turns a server's reply to a local read into a buffer: the tier file it names,
// mapped, or the bytes it carries. A tier file evicted between the reply and our open is
// asked for again, as bytes.
func (c *Client) replyBuffer(ctx context.Context, server *rpc.Client, reply *fitcachepb.ReadReply, dirs []tiers.Dir, path string) (Buffer, error) {
	if reply.CachedPath != "" {
		if m, err := tiers.Probe(routing.AnySession(dirs), path); err == nil {
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

// TierDirs returns the tier directories on this node that the client reads cached files
// from (its server's, or in cluster mode those of the servers on this node), fastest first.
// In cluster mode they include the tiers of this node's servers that were dead when the
// client started, for a session no copy is checked in: a reader serves copies from them
// only once it has checked their source itself (see deadTiers; the C hit path of a process
// forked after load, read_checked).
func (c *Client) TierDirs() []tiers.Dir {
	dirs := c.localDirs()
	if c.cluster != nil && c.deadTiers != nil {
		for _, d := range c.deadTiers.of(c.cluster.DeadLocal()) {
			dirs = append(dirs, d.WithSession(math.MaxUint32))
		}
	}
	return dirs
}

// ReaderFills reports whether this client's server records the fills of its readers: a
// reader that misses a small file may then read it from the source itself and write its copy
// into the server's first tier (capi/fill.c, tiers.Claim). Only the embedded server does;
// in cluster mode the node's server opens every miss (OpOpen).
func (c *Client) ReaderFills() bool {
	if c.node != nil || c.cluster != nil {
		return false
	}
	conn, down := c.current()
	return conn != nil && !down && conn.readerFills
}

// localDirs returns the tier directories this client maps files from.
func (c *Client) localDirs() []tiers.Dir {
	if c.node != nil {
		return c.node.dirs()
	}
	if c.cluster != nil {
		return c.cluster.LocalDirs()
	}
	return c.tierView()
}

// Close reports pending hits and stops the client, after reads in progress have ended: those
// waiting for a server stop waiting at once and return core.ErrClosed. It closes the
// client's connections and unmaps what it kept. It is idempotent. Buffers already handed out
// stay valid until released.
func (c *Client) Close() error {
	if c.closed.Swap(true) {
		return nil
	}
	if c.cancelRead != nil {
		c.cancelRead()
	}
	close(c.stop)
	<-c.stopped

	// Pending hits are reported, unless the server is known not to answer now (a report
	// would wait for it).
	if server := c.reportTo(); server != nil && !c.serverDown() {
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
	var errs []error // what Close could not release cleanly (as bbolt's DB.Close joins them)
	// The stand-in's reads hold life: it is stopped before life is taken.
	if err := c.standIn.close(); err != nil {
		errs = append(errs, fmt.Errorf("stand-in node socket: %w", err))
	}
	c.life.Lock() // no read is in progress from here on
	defer c.life.Unlock()
	c.brings.stop() // no read asks for a block any more; each ask under way ends at once
	c.mu.Lock()
	conn := c.conn
	c.conn = nil
	c.mu.Unlock()
	if conn != nil {
		if err := conn.rpc.Close(); err != nil {
			errs = append(errs, fmt.Errorf("connection to the server: %w", err))
		}
	}
	if v := c.view.Swap(nil); v != nil {
		errs = append(errs, routing.CloseDirs(v.dirs))
	}
	if c.cluster != nil {
		errs = append(errs, c.cluster.Close())
	}
	if c.node != nil {
		errs = append(errs, c.node.close())
	}
	if c.deadTiers != nil {
		errs = append(errs, c.deadTiers.close())
	}
	c.ranges.close()
	return errors.Join(errs...)
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
