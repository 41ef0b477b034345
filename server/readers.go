package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/discovery"
	"github.com/fitcache/fitcache/internal/splice"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/routing"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// What a cluster server answers the readers of its node's socket with, for one dataset root.
// The preload shim (preload/) runs no Go and speaks no Thrift: it opens cached files of the
// servers on its node itself, and asks one of them for the rest over its node socket (package
// nodesock), which answers with a descriptor. The server opens its own files with its engine
// and routes the others over the ring (package routing), so that every file still has one
// owner on the ring and the source is read once per file, whichever node reads it. Bytes
// from other nodes travel over Kitex.

// rootReader serves the readers of one dataset root on this server's node (see clusterNode).
// It is safe for concurrent use.
type rootReader struct {
	root     string // absolute, clean
	realRoot string // root with symbolic links resolved, for source opens
	log      *slog.Logger
	engine   *core.Engine // this server's
	self     string       // this server's id on the ring, "" if it is not among the job's servers
	cluster  *routing.Router

	// life is held shared by every request and exclusively by close, which so waits for
	// requests in progress before it frees what they use.
	life   sync.RWMutex
	closed atomic.Bool
	// guestsFullUntil (Unix ns): before then, no node-local copy is kept (see keepGuest).
	guestsFullUntil atomic.Int64
	// bringing: the large files being brought to this node in the background (see
	// openLargeNow), path -> struct{}.
	bringing sync.Map
	// notLarge: files openLargeNow found too small, path -> struct{}, at most notLargeMax
	// (notLargeCount counts the attempts to add one).
	notLarge      sync.Map
	notLargeCount atomic.Int64
	forwards      singleflight.Group // blocks being forwarded (see forwardBlock)
}

// newRootReader routes the readers' requests for the dataset under root over the job's
// servers that cfg names (see routing.New, with o), for the server self (its id on the ring,
// "" when it is not among them) whose engine is engine.
func newRootReader(root string, cfg config.Config, log *slog.Logger, engine *core.Engine, self string,
	o routing.Options) (*rootReader, error) {
	abs, real, err := core.DatasetRoot(root)
	if err != nil {
		return nil, err
	}
	if cfg.Job == "" {
		cfg.Job = newJobID() // a job of its own: its copies are checked once for it
	}
	members, token, err := discovery.Job(cfg.ServerSpec(), cfg.Token, cfg.TokenFile)
	if err != nil {
		return nil, err
	}
	r, err := routing.New(cfg, log, members, token, o)
	if err != nil {
		return nil, err
	}
	return &rootReader{root: abs, realRoot: real, log: log, engine: engine, self: self, cluster: r}, nil
}

// newJobID returns a new random job id (see config.Config.Job).
func newJobID() string {
	var b [12]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// resolve returns path (absolute, or relative to the root) absolute and clean (see
// core.ResolveIn).
func (c *rootReader) resolve(path string) (string, error) { return core.ResolveIn(c.root, path) }

// close waits for the requests in progress and closes the router. It is idempotent.
func (c *rootReader) close() error {
	if c.closed.Swap(true) {
		return nil
	}
	c.life.Lock()
	defer c.life.Unlock()
	return c.cluster.Close()
}

// open returns a read-only descriptor holding the bytes of the file at path (absolute, or
// relative to the root) for a reader on this node that has no client of its own: a miss of
// the preload shim, which this server answers through its node socket (OpOpen). The file's
// place on the ring decides what the descriptor is, and its Origin says so:
//
//   - a file of this server: its engine's answer (see
//     core.Engine.OpenForReader), its cached copy, read from the source first on a miss;
//   - a file of another server on this node: the cached copy in that server's tier, which
//     that server fills on a miss (the tier's origin, core.TierOrigin);
//   - a file of a server on another node: a sealed memory file (memfd) holding the bytes it
//     sent (core.OriginPeer), so that the file stays cached at its owner only;
//   - a file read from the source (its owner is dead under the pfs policy, no server
//     answers, or it is too large to send): the source itself, opened beneath the dataset
//     root (core.OriginSource), as a direct read of Read would.
//
// Dead servers are detected and the failure policy applied as for a client's reads. The
// caller closes the file.
func (c *rootReader) open(ctx context.Context, path string) (*os.File, core.Origin, error) {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return nil, 0, core.ErrClosed
	}
	path, err := c.resolve(path)
	if err != nil {
		return nil, 0, err
	}
	return c.openResolved(ctx, path)
}

// openResolved is open for a resolved path, the reader's lifetime lock held.
func (c *rootReader) openResolved(ctx context.Context, path string) (*os.File, core.Origin, error) {
	// A copy this server holds (its own, or a node-local copy of a file
	// another server owns, also one whose owner died since) serves first, checked.
	if c.self != "" {
		if f, origin, ok := c.engine.OpenCached(c.root, path); ok {
			return f, origin, nil
		}
		if f, ok := c.openLargeNow(path); ok {
			return f, core.OriginSourceWhileCached, nil
		}
	}
	var f *os.File
	var origin core.Origin
	err := c.cluster.Route(path, func(p *routing.Peer, rest []*routing.Peer) (err error) {
		f, origin, err = c.openFromPeer(ctx, p, rest, path)
		return err
	})
	if errors.Is(err, routing.ErrReadSource) {
		f, origin, err = c.openSource(path)
	}
	if err != nil {
		return nil, 0, err
	}
	return f, origin, nil
}

// openLargeNow opens a large file (core.ReadNowBytes or more) whose owner is another server
// from its source at once, so that the reader does not wait for the owner's copy and its
// transfer, and brings the file to this node in the background, as prefetch does
// (fetch: the owner caches it, this node keeps a node-local copy where there is room); the
// next open finds it here. A file this server owns is handed over by its engine itself
// (core.Engine.OpenForReader). false: open it as any other.
func (c *rootReader) openLargeNow(path string) (*os.File, bool) {
	if targets := c.cluster.Targets(path); len(targets) == 0 || targets[0].ID() == c.self {
		return nil, false
	}
	// The size costs a stat of the source (a metadata round trip on a parallel file system):
	// once per file, since a file found small is remembered as such.
	if _, small := c.notLarge.Load(path); small {
		return nil, false
	}
	st, err := os.Stat(path) // its size only: the open below is made beneath the root
	if err != nil || !st.Mode().IsRegular() || st.Size() < core.ReadNowBytes {
		if err == nil && c.notLargeCount.Add(1) <= notLargeMax {
			c.notLarge.Store(path, struct{}{})
		}
		return nil, false
	}
	f, _, err := c.openSource(path)
	if err != nil {
		return nil, false
	}
	if _, busy := c.bringing.LoadOrStore(path, struct{}{}); !busy {
		go func() {
			defer c.bringing.Delete(path)
			ctx, cancel := context.WithTimeout(context.Background(), bringTimeout)
			defer cancel()
			if err := c.fetch(ctx, path); err != nil && !errors.Is(err, core.ErrTooLarge) &&
				!errors.Is(err, core.ErrCacheFull) {
				c.log.Warn("bringing a large file to this node", "path", path, "err", err)
			}
		}()
	}
	return f, true
}

// notLargeMax bounds the files a reader remembers as too small for openLargeNow (about 100
// bytes each); past it, the others are stat'ed at each open.
const notLargeMax = 1 << 20

// bringTimeout bounds the background transfer of a large file (see openLargeNow); Close
// waits for it.
const bringTimeout = time.Minute

// openFromPeer opens the file at path as one server holds it (see open); rest are
// the servers that hold replicas.
func (c *rootReader) openFromPeer(ctx context.Context, p *routing.Peer, rest []*routing.Peer, path string) (*os.File, core.Origin, error) {
	dirs, _ := p.State()
	if c.self != "" && p.ID() == c.self {
		if len(rest) == 0 {
			return c.engine.OpenForReader(ctx, c.root, path)
		}
		// Replicas: a file this read takes from the source goes to the next servers too, as
		// a read through a client sends it (see routing.Router.Replicate).
		res, err := c.engine.Read(ctx, c.root, path, true)
		if err != nil {
			return nil, 0, err // too large to cache: read the source
		}
		if res.Origin == core.OriginSource {
			c.cluster.Replicate(rest, c.root, path, res.Bytes(), c.cluster.Stamp(path, res))
		}
		res.Release()
		if f, d, err := openTier(routing.AnySession(dirs), path); err == nil { // the engine checked it
			return f, core.TierOrigin(d.Kind), nil
		}
		return c.engine.OpenForReader(ctx, c.root, path) // evicted meanwhile, or not in a tier
	}
	// A server on this node is asked too, not its tiers opened here: the reader is of
	// another job than this long-lived reader, and a copy this server's session would take
	// may not be checked for the reader's (the reader looked in the tiers itself first). The
	// server checks the copy before it names it.
	var session uint32
	if c.self != "" {
		session = c.engine.Session()
	}
	buf := transferBuffers.Get().(*[]byte)
	defer transferBuffers.Put(buf)
	reply, err := c.cluster.Ask(ctx, p, c.root, path, *buf)
	if err != nil {
		return nil, 0, err
	}
	data := reply.Data
	if reply.CachedPath != "" { // a server on this node cached it: hand out its tier file
		checked := routing.AnySession(dirs) // the server checked the copy before it answered
		if rpc.OriginOf(reply) == core.OriginSource && len(rest) > 0 {
			if m, err := tiers.Probe(checked, path); err == nil {
				c.cluster.Replicate(rest, c.root, path, m.Bytes(), rpc.StampOf(reply))
				m.Release()
			}
		}
		if f, d, err := openTier(checked, path); err == nil {
			return f, core.TierOrigin(d.Kind), nil
		}
		// Evicted between the reply and the open: ask for the bytes.
		if reply, err = p.RPC().Read(ctx, c.root, path, false); err != nil {
			return nil, 0, err
		}
		data = reply.Data
	} else {
		if rpc.OriginOf(reply) == core.OriginSource && len(rest) > 0 {
			c.cluster.Replicate(rest, c.root, path, data, rpc.StampOf(reply))
		}
		// A server on another node sent the bytes: a node-local copy, where there is room,
		// serves this node's next reads of the file from its own tiers.
		if c.keepGuest(ctx, path, reply, session) == nil {
			if f, d, err := openTier(routing.AnySession(c.engine.TierDirs()), path); err == nil {
				return f, core.TierOrigin(d.Kind), nil
			}
		}
	}
	f, err := nodesock.MemFile(path, data, reply.MtimeNanos)
	if err != nil {
		return nil, 0, err
	}
	return f, core.OriginPeer, nil
}

// transferBuffers hold the bytes of a file another node's server sends, while a server of
// this node keeps them as a node-local copy or hands them to a reader as a memory file: both
// copy them (as does replicate), so the buffer serves the next file. A new buffer per file
// cost a node's server a tenth of its CPU time in garbage collection (a perf profile of
// bench/bench_cluster.py, a reader on a node without room for other nodes' files).
var transferBuffers = sync.Pool{New: func() any { b := make([]byte, transferBufferSize); return &b }}

// transferBufferSize is the size of a transfer buffer: a larger file gets a buffer of its own.
const transferBufferSize = 1 << 20

// keepGuest keeps the bytes a server on another node sent for path as a node-local copy in
// the tiers of this server (see core.Engine.StoreGuest), where they take
// room its own files do not need. session is that engine's session taken before the server
// was asked. It returns nil once the copy is in a tier.
func (c *rootReader) keepGuest(ctx context.Context, path string, reply *fitcachepb.ReadReply, session uint32) error {
	if c.self == "" || reply.CachedPath != "" {
		return errors.ErrUnsupported
	}
	if c.guestsFull() {
		return fmt.Errorf("%w: no room for node-local copies of %s", core.ErrCacheFull, c.root)
	}
	err := c.engine.StoreGuest(ctx, core.GuestCopy{Root: c.root, Path: path, Data: reply.Data, Session: session,
		Source: tiers.Identity{Size: int64(len(reply.Data)), MTimeNanos: reply.MtimeNanos, CTimeNanos: reply.CtimeNanos,
			Ino: uint64(reply.Inode)}})
	if errors.Is(err, core.ErrCacheFull) {
		// The tiers hold the server's own files and this dataset's copies: no room will come
		// soon (copies of a dataset never make room for each other). Try again later.
		c.guestsFullUntil.Store(time.Now().Add(guestsFullRecheck).UnixNano())
	}
	return err
}

// guestsFullRecheck is how long a reader keeps no node-local copies after the tiers had no
// room for one.
const guestsFullRecheck = time.Second

// guestsFull reports whether the tiers had no room for a node-local copy of this reader's
// dataset less than guestsFullRecheck ago.
func (c *rootReader) guestsFull() bool { return time.Now().UnixNano() < c.guestsFullUntil.Load() }

// fetch brings the file at path (absolute, or relative to the root) into a tier of this node
// for a reader on it that finds cached files itself, as the C hit path of libfitcache does
// after the node socket's OpFetch. That is the owner's copy when the owner is a server of
// this node (this one, or another, asked over RPC), else a node-local copy of the bytes the
// owner on another node sends, kept by this server where its own files leave room
// (core.Engine.StoreGuest). It returns an error wrapping core.ErrCacheFull when no tier of
// this node takes the file (the reader then has the server open it, see open),
// core.ErrTooLarge when the file is to be read from the source (too large, or its owner is
// dead under the pfs policy), or the file's own error. It fails with errors.ErrUnsupported on
// a server that is not among the job's servers.
func (c *rootReader) fetch(ctx context.Context, path string) error {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return core.ErrClosed
	}
	if c.self == "" {
		return fmt.Errorf("fetch for a reader outside the job's servers: %w", errors.ErrUnsupported)
	}
	path, err := c.resolve(path)
	if err != nil {
		return err
	}
	if f, _, ok := c.engine.OpenCached(c.root, path); ok { // this server's copy, or a node-local one
		f.Close()
		return nil
	}
	err = c.cluster.Route(path, func(p *routing.Peer, rest []*routing.Peer) error { return c.fetchFromPeer(ctx, p, rest, path) })
	if errors.Is(err, routing.ErrReadSource) {
		return fmt.Errorf("%w: %s is read from the source", core.ErrTooLarge, path)
	}
	if err != nil && !errors.Is(err, core.ErrCacheFull) {
	}
	return err
}

// fetchFromPeer brings path into a tier of this node through one server (see fetch);
// rest are the servers that hold replicas.
func (c *rootReader) fetchFromPeer(ctx context.Context, p *routing.Peer, rest []*routing.Peer, path string) error {
	if p.ID() == c.self {
		if len(rest) == 0 {
			return c.engine.Fetch(ctx, c.root, path)
		}
		res, err := c.engine.Read(ctx, c.root, path, true) // replicas, as in openFromPeer
		if err != nil {
			return err
		}
		if res.Origin == core.OriginSource {
			c.cluster.Replicate(rest, c.root, path, res.Bytes(), c.cluster.Stamp(path, res))
		}
		res.Release()
		return nil
	}
	if !p.Local() && c.guestsFull() {
		// No room for a node-local copy now: asking the owner would only move the bytes here
		// to be dropped (the reader has the server open the file instead).
		return fmt.Errorf("%w: no room for node-local copies of %s", core.ErrCacheFull, c.root)
	}
	session := c.engine.Session()
	buf := transferBuffers.Get().(*[]byte)
	defer transferBuffers.Put(buf)
	reply, err := c.cluster.Ask(ctx, p, c.root, path, *buf)
	if err != nil {
		return err
	}
	if rpc.OriginOf(reply) == core.OriginSource && len(rest) > 0 {
		if reply.CachedPath != "" {
			dirs, _ := p.State()
			if m, err := tiers.Probe(routing.AnySession(dirs), path); err == nil {
				c.cluster.Replicate(rest, c.root, path, m.Bytes(), rpc.StampOf(reply))
				m.Release()
			}
		} else {
			c.cluster.Replicate(rest, c.root, path, reply.Data, rpc.StampOf(reply))
		}
	}
	switch {
	case reply.CachedPath != "": // another server of this node cached it in its tier
		return nil
	case p.Local(): // too large for that server's tiers to keep, or no room there
		return fmt.Errorf("%w: %s is not in a tier of this node", core.ErrCacheFull, path)
	}
	return c.keepGuest(ctx, path, reply, session)
}

// openTier opens the cached copy of path in the first of dirs that has it.
func openTier(dirs []tiers.Dir, path string) (*os.File, tiers.Dir, error) {
	for _, d := range dirs {
		if f, err := d.OpenFile(path); err == nil {
			return f, d, nil
		}
	}
	return nil, tiers.Dir{}, tiers.ErrNotCached
}

// openSource opens the source file at path beneath the dataset root, for a reader.
func (c *rootReader) openSource(path string) (*os.File, core.Origin, error) {
	src, err := core.OpenSource(c.root, c.realRoot, path)
	if err != nil {
		return nil, 0, err
	}
	f, err := src.ReaderFile()
	if err != nil {
		return nil, 0, err
	}
	return f, core.OriginSource, nil
}

// forget drops the cached copies of the file at path (absolute, or relative to the root)
// that a reader could be given, because its source is being written: a write-open through the
// preload shim, which this server was told of over its node socket (OpForget). Every live
// server of the job is asked, in parallel: besides the owner and replicas, any server may
// hold a node-local copy (see fetch), which readers on its node read themselves.
func (c *rootReader) forget(ctx context.Context, path string) error {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return core.ErrClosed
	}
	path, err := c.resolve(path)
	if err != nil {
		return err
	}
	var mu sync.Mutex // protects errs
	var errs []error
	var wg sync.WaitGroup
	for _, p := range c.cluster.Peers() {
		if _, dead := p.State(); dead {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if c.self != "" && p.ID() == c.self {
				err = c.engine.Forget(c.root, path)
			} else {
				err = p.RPC().Forget(ctx, c.root, path)
			}
			if err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("server %s: %w", p.ID(), err))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Batches of the node socket (nodesock.OpOpenMany): the misses of one DataLoader batch that
// a reader on this node sends its server at once. The files other nodes own are asked of
// each owner in one ReadBatch call, so a batch costs its server a call per owner, not a call
// per file; the others are opened as open opens them, a few at a time.

// opened is what openMany answers for one file: its descriptor and what it holds, or
// the bytes another node's server sent (Data, or Pipe: core.OriginPeer), or the file's own
// error. Release, if set, is to be called once Data is no longer used; a Pipe goes back with
// splice.Put once sent (nodesock.Opened does that).
type opened struct {
	File    *os.File
	Data    []byte
	Pipe    *splice.Pipe // the bytes another node's server sent, spliced (see openBatchFromPeer)
	Origin  core.Origin
	Err     error
	Release func()
}

// openManyWorkers is how many files of a batch that go to no other node's server are opened
// at once (as fc_read_many's Go side reads a batch's misses).
const openManyWorkers = 8

// batchBufferSize is the size of the pooled buffers ReadBatch replies are read into: a
// DataLoader batch's share of one owner (a batch of 64 files of about 100 KiB over 4
// servers); a larger reply gets a buffer of its own.
const batchBufferSize = 4 << 20

// batchBuffers hold the bytes of a ReadBatch reply while they are copied into node-local
// copies or memory files (see transferBuffers).
var batchBuffers = sync.Pool{New: func() any { b := make([]byte, batchBufferSize); return &b }}

// openMany opens the files at paths (absolute, or relative to the root) for readers on this
// node as open opens each, and returns one opened per path, in order (the
// caller closes the files). A file's error is that file's only. A file of at most inlineMax
// bytes that a server on another node sends, and that this node keeps no copy of, comes as
// its bytes (Data, with its Release, or in a Pipe: see openBatchFromPeer) rather than as a
// memory file that would copy them. The files that servers on
// other nodes own are asked of each owner in one ReadBatch call, all owners at once; an owner
// that does not answer is counted as failing once for its batch, and its files go as a failed
// read of each would: to the new owner once it is dead (recache), else to the source.
func (c *rootReader) openMany(ctx context.Context, paths []string, inlineMax int) []opened {
	out := make([]opened, len(paths))
	c.life.RLock()
	defer c.life.RUnlock()
	var fail error
	switch {
	case c.closed.Load():
		fail = core.ErrClosed
	}
	if fail != nil {
		for i := range out {
			out[i].Err = fail
		}
		return out
	}
	resolved := make([]string, len(paths))
	owners := map[*routing.Peer][]int{} // files of servers on other nodes, by owner
	var alone []int                     // the others, opened one at a time
	for i, p := range paths {
		path, err := c.resolve(p)
		if err != nil {
			out[i].Err = err
			continue
		}
		resolved[i] = path
		if c.self != "" {
			if f, origin, ok := c.engine.OpenCached(c.root, path); ok {
				out[i] = opened{File: f, Origin: origin}
				continue
			}
			if f, ok := c.openLargeNow(path); ok {
				out[i] = opened{File: f, Origin: core.OriginSourceWhileCached}
				continue
			}
		}
		if targets := c.cluster.Targets(path); len(targets) > 0 && !targets[0].Local() &&
			(c.self == "" || targets[0].ID() != c.self) {
			owners[targets[0]] = append(owners[targets[0]], i)
			continue
		}
		alone = append(alone, i)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex // protects alone once the owners' batches run
	for p, idx := range owners {
		wg.Go(func() {
			if again := c.openBatchFromPeer(ctx, p, resolved, idx, out, inlineMax); len(again) > 0 {
				mu.Lock()
				alone = append(alone, again...)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	next := make(chan int, len(alone))
	for _, i := range alone {
		next <- i
	}
	close(next)
	for range min(len(alone), openManyWorkers) {
		wg.Go(func() {
			for i := range next {
				f, origin, err := c.openResolved(ctx, resolved[i])
				out[i] = opened{File: f, Origin: origin, Err: err}
			}
		})
	}
	wg.Wait()
	return out
}

// openBatchFromPeer opens the files paths[i] (i in idx) that p, a server on another node,
// owns, with one ReadBatch call, into out; it returns the files to open one at a time (see
// open): those whose bytes did not fit in the reply, and all of them when p did not
// answer and is dead now (their new owner, or the source, has them) or refused the call as a
// whole (each file then gets its own answer).
func (c *rootReader) openBatchFromPeer(ctx context.Context, p *routing.Peer, paths []string, idx []int, out []opened,
	inlineMax int) (again []int) {
	var session uint32
	if c.self != "" {
		session = c.engine.Session()
	}
	req := &fitcachepb.ReadBatchRequest{Root: c.root, Paths: make([]string, len(idx))}
	for k, i := range idx {
		req.Paths[k] = paths[i]
	}
	// The buffer goes back to the pool once the files handed out inline from it are released.
	buf := batchBuffers.Get().(*[]byte)
	var refs atomic.Int32
	refs.Store(1)
	release := func() {
		if refs.Add(-1) == 0 {
			batchBuffers.Put(buf)
		}
	}
	defer release()
	// Where this node keeps no copy of them, the files' bytes go from the owner's connection
	// through pipes to the reader's socket (package splice), never into this server's memory:
	// that saves copying each file in and out again (the servers' CPU per file of
	// bench/bench_cluster.py's share case fell 7-23%, docs/BENCHMARKS.md section 26). A node with room for
	// node-local copies, or a job with replicas (a file the owner read from the source is
	// copied to them), takes them into memory.
	var sink *rpc.PipeSink
	if inlineMax >= splice.Max && (c.self == "" || c.guestsFull()) && c.cluster.Replicas() <= 1 {
		sink = &rpc.PipeSink{}
		defer sink.Close()
	}
	reply, err := c.cluster.AskBatch(ctx, p, req, *buf, sink)
	if errors.Is(err, rpc.ErrUnavailable) {
		if c.cluster.Failed(p, err) {
			return idx // dead: each goes to its new owner (recache) or the source (pfs)
		}
		for _, i := range idx { // not dead yet: its reads are served from the source meanwhile
			f, origin, err := c.openSource(paths[i])
			out[i] = opened{File: f, Origin: origin, Err: err}
		}
		return nil
	}
	if err != nil {
		return idx
	}
	c.cluster.Succeeded(p)
	for k, i := range idx {
		r := reply.Replies[k]
		err := core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
		switch {
		case err == nil && sink.Piped(k):
			out[i] = opened{Pipe: sink.Take(k), Origin: core.OriginPeer}
		case err == nil:
			out[i] = c.openReplied(ctx, paths[i], r, session, inlineMax)
			if out[i].Data != nil {
				refs.Add(1)
				out[i].Release = release
			}
		case errors.Is(err, syscall.ENOBUFS): // did not fit in the reply with the others
			again = append(again, i)
		case errors.Is(err, core.ErrTooLarge): // too large for the owner to cache or send
			f, origin, err := c.openSource(paths[i])
			out[i] = opened{File: f, Origin: origin, Err: err}
		default:
			out[i].Err = err
		}
	}
	return again
}

// openReplied hands out the bytes of path that its owner on another node sent in reply r (as
// openFromPeer does): copied to the servers that hold replicas when the owner read them from
// the source, kept as a node-local copy where there is room and opened there, else as they
// are (Data) when they are inlineMax bytes or fewer, else a memory file. session is this
// server's session taken before the owner was asked.
func (c *rootReader) openReplied(ctx context.Context, path string, r *fitcachepb.ReadReply, session uint32, inlineMax int) opened {
	if rpc.OriginOf(r) == core.OriginSource {
		if targets := c.cluster.Targets(path); len(targets) > 1 {
			c.cluster.Replicate(targets[1:], c.root, path, r.Data, rpc.StampOf(r))
		}
	}
	if c.self != "" && c.keepGuest(ctx, path, r, session) == nil {
		if f, d, err := openTier(routing.AnySession(c.engine.TierDirs()), path); err == nil {
			return opened{File: f, Origin: core.TierOrigin(d.Kind)}
		}
	}
	if len(r.Data) <= inlineMax {
		if r.Data == nil {
			r.Data = []byte{}
		}
		return opened{Data: r.Data, Origin: core.OriginPeer}
	}
	f, err := nodesock.MemFile(path, r.Data, r.MtimeNanos)
	if err != nil {
		return opened{Err: err}
	}
	return opened{File: f, Origin: core.OriginPeer}
}

// cacheBlockAtOwner has block n of the file at path cached by the server that owns it on the
// ring (the next live one if it is dead), for this server's prefetch of a large file
// (core.EngineConfig.BlockOwner): mine reports that this server owns it, and is to cache it
// itself; else, with ask, the owner is asked to cache it, and sends none of it.
func (c *rootReader) cacheBlockAtOwner(ctx context.Context, path string, n int64, ask bool) (mine bool, err error) {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return false, core.ErrClosed
	}
	bb := c.cluster.BlockBytes()
	if bb <= 0 {
		return false, fmt.Errorf("%w: the servers' block size is not known yet", rpc.ErrUnavailable)
	}
	if targets := c.cluster.Targets(tiers.BlockName(path, bb, n)); len(targets) > 0 && targets[0].ID() == c.self {
		return true, nil
	}
	if !ask {
		return false, nil
	}
	_, _, err = c.cluster.AskBlock(ctx, c.root, path, bb, n, 0, 0, false)
	return false, err
}

// guestBlockMax bounds the blocks a server keeps copies of for its node (forwardBlock): a
// larger block travels by ranges only, and is never held whole in memory.
const guestBlockMax = 16 << 20

// forwardBlock serves a ranged request for a block from a reader of this node
// (rpc.ServerConfig.ForwardBlock): the range as the block's owner on the ring sends it, or ok
// false when this server owns the block or holds it, and serves it itself. The block is numbered in this server's block size (an owner of another
// refuses it). When the owner is on another node, the whole block comes, once however many
// readers ask for it at once, and is kept on this node (a guest copy) where there is room,
// so that the readers of this node read it from its tiers from then on. A block nobody can
// serve (its owner declined it, or is dead under the pfs policy) fails with ErrTooLarge:
// the reader reads the source, and this server never caches a block it does not own.
func (c *rootReader) forwardBlock(ctx context.Context, path string, n, off, length int64) ([]byte, bool, error) {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return nil, false, core.ErrClosed
	}
	if c.self == "" {
		return nil, false, nil
	}
	bb := c.engine.BlockBytes()
	name := tiers.BlockName(path, bb, n)
	if targets := c.cluster.Targets(name); len(targets) > 0 && targets[0].ID() == c.self ||
		c.engine.HoldsBlock(path, n) {
		return nil, false, nil // served here
	}
	// keep: the whole block comes, once for all the readers asking at once (the key is the
	// block's), and each takes its range of it; else each its range.
	keep := bb <= guestBlockMax && !c.guestsFull()
	key := name
	if !keep {
		key = fmt.Sprintf("%s|%d|%d", name, off, length)
	}
	v, err, _ := c.forwards.Do(key, func() (any, error) {
		session := c.engine.Session() // before the request: see core.GuestCopy.Session
		reply, otherNode, err := c.cluster.AskBlock(ctx, c.root, path, bb, n, off, length, keep)
		if err != nil {
			return nil, err
		}
		if keep && otherNode && len(reply.Data) > 0 {
			err := c.engine.StoreGuest(ctx, core.GuestCopy{Root: c.root, Path: path, IsBlock: true, Block: n,
				Data: reply.Data, Session: session, Source: tiers.Identity{Size: int64(len(reply.Data)),
					MTimeNanos: reply.MtimeNanos, CTimeNanos: reply.CtimeNanos, Ino: uint64(reply.Inode)}})
			if errors.Is(err, core.ErrCacheFull) {
				c.guestsFullUntil.Store(time.Now().Add(guestsFullRecheck).UnixNano()) // as keepGuest does
			}
		}
		return reply.Data, nil
	})
	if errors.Is(err, routing.ErrReadSource) {
		return nil, false, fmt.Errorf("%w: no server serves block %d of %s", core.ErrTooLarge, n, path)
	}
	if err != nil {
		return nil, false, err
	}
	data := v.([]byte)
	if keep { // the whole block: this caller's range of it
		lo := min(off, int64(len(data)))
		data = data[lo : lo+min(length, int64(len(data))-lo)]
	}
	return data, true, nil
}
