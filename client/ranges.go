// Ranges of large files: ReadAt serves a range from a whole cached copy when this node has
// one; otherwise, for a file of core.ReadNowBytes or more, from the blocks of the file that
// are cached (see core.Engine.ReadBlock), and a range of a block not cached yet from the
// source at once, while the server caches that block in the background. A reader of ranges
// so never waits for a whole copy, nor for a block, and a file larger than every tier is
// cached by the ranges read.

package client

import (
	"context"
	"errors"
	"fmt"
	"github.com/fitcache/fitcache/routing"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// ReadAt copies up to len(p) bytes of the file at path, starting at off, into p, and returns
// how many it copied (0 at or past the end).
func (c *Client) ReadAt(path string, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%w: negative offset", core.ErrBadPath)
	}
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return 0, core.ErrClosed
	}
	path, err := c.Resolve(path)
	if err != nil {
		c.counts.errors.Add(1)
		return 0, err
	}
	n, err := c.readAt(path, p, off)
	if err != nil {
		c.counts.errors.Add(1)
	}
	return n, err
}

func (c *Client) readAt(path string, p []byte, off int64) (int, error) {
	dirs := c.localDirs()
	c.ranges.sweep(dirs)
	if k, _, ok, err := c.readCopy(dirs, path+wholeSuffix, path, p, off); ok {
		return k, err
	}
	plan := c.blockPlan()
	src, err := c.source(path)
	if errors.Is(err, errNotLarge) {
		return c.readAtWhole(path, p, off)
	}
	if err != nil {
		return 0, err
	}
	defer c.ranges.give(src)
	if plan == nil {
		// No server with blocks (it does not answer, or has none): the range of a large
		// file is read from the source alone, never through a whole copy of the file. A
		// lost embedded server is reached again once its back-off ends, as a whole-file
		// read would (a reader of ranges alone makes no other request).
		if conn, down := c.current(); conn == nil && !down && c.cluster == nil && c.node == nil {
			go c.ensureConn(nil, 0) // starts an attempt, or joins the one under way
		}
		if off >= src.size {
			return 0, nil
		}
		k, err := readFull(src.f, p[:min(int64(len(p)), src.size-off)], off)
		c.counts.sourceRanges.Add(1)
		c.counts.sourceRangeBytes.Add(int64(k))
		return k, err
	}
	// A range may span blocks, each read from a cached copy or from the source: all its
	// pieces must be of one version of the file. A block cached before the source was
	// rewritten in place (same size, even the same mtime) must not be followed by bytes of
	// the new version read from the source: a range of pieces of two versions is read again
	// from the source alone.
	end := min(off+int64(len(p)), src.size)
	pieces := end > off && (end-1)/plan.bytes != off/plan.bytes
	var first version
	mixed, done := false, 0
	for done < len(p) && off+int64(done) < src.size {
		at := off + int64(done)
		n, within := at/plan.bytes, at%plan.bytes
		want := p[done:min(len(p), done+int(min(plan.bytes-within, src.size-at)))]
		k, v, err := c.readBlockRange(plan, dirs, src, path, n, want, within, off, pieces)
		if err != nil {
			return done, err
		}
		if done == 0 {
			first = v
		} else if !first.same(v) {
			mixed = true
		}
		if k == 0 {
			break // the file is shorter than it was
		}
		done += k
	}
	if mixed {
		k, _, err := readVersion(src.f, p[:done], off)
		c.counts.sourceRanges.Add(1)
		c.counts.sourceRangeBytes.Add(int64(k))
		return k, err
	}
	return done, nil
}

// version tells apart the versions of a source file that the pieces of one range were read
// from: a cached copy records the version it copies (tiers.CopyIdentity), a range read from the
// source has the version fstat gives around the read. The size is left out (a block's
// entry records the block's length); the change time is what tells a rewrite in place
// that kept the size and put the modification time back. A zero field is unknown (a copy
// sent by another server may lack the change time) and not compared; a zero version
// (known false) matches nothing.
type version struct {
	known bool
	mtime int64
	ctime int64
	ino   uint64
}

// same reports whether v and w may be the same version of the file.
func (v version) same(w version) bool {
	return v.known && w.known && v.mtime == w.mtime && (v.ctime == 0 || w.ctime == 0 || v.ctime == w.ctime) &&
		(v.ino == 0 || w.ino == 0 || v.ino == w.ino)
}

// versionOf returns the version of the open file f now.
func versionOf(f *os.File) (version, error) {
	var st unix.Stat_t
	var err error
	raw, rerr := f.SyscallConn()
	if rerr != nil {
		return version{}, rerr
	}
	if rerr = raw.Control(func(fd uintptr) { err = unix.Fstat(int(fd), &st) }); rerr != nil {
		return version{}, rerr
	}
	if err != nil {
		return version{}, &os.PathError{Op: "fstat", Path: f.Name(), Err: err}
	}
	return version{known: true, mtime: st.Mtim.Nano(), ctime: st.Ctim.Nano(), ino: st.Ino}, nil
}

// readVersion reads len(p) bytes of f at off (fewer only at the end of the file), and
// returns the version they are of: core.ErrChanged when the file changed during the read.
func readVersion(f *os.File, p []byte, off int64) (int, version, error) {
	before, err := versionOf(f)
	if err != nil {
		return 0, version{}, err
	}
	k, err := readFull(f, p, off)
	if err != nil {
		return k, version{}, err
	}
	after, err := versionOf(f)
	if err != nil {
		return k, version{}, err
	}
	if after != before {
		return k, version{}, fmt.Errorf("%w: %s", core.ErrChanged, f.Name())
	}
	return k, before, nil
}

// wholeSuffix follows a path in the key of its whole copy among rangeFiles (a block's has a
// NUL byte and digits, a source's none).
const wholeSuffix = "\x00whole"

// readAtWhole is ReadAt through the whole file (a small file: see core.ReadNowBytes).
func (c *Client) readAtWhole(path string, p []byte, off int64) (int, error) {
	buf, err := c.read(path)
	if err != nil {
		return 0, err
	}
	defer buf.Release()
	return copyAt(buf.Bytes(), p, off), nil
}

// copyAt copies b[off:] into p and returns how many bytes it copied.
func copyAt(b, p []byte, off int64) int {
	if off >= int64(len(b)) {
		return 0
	}
	return copy(p, b[off:])
}

// BlockBytes returns the size of the blocks the server of this node caches ranges of large
// files in, or 0 where ranges are read through whole files (no server yet): the C hit path
// of libfitcache reads cached blocks itself.
func (c *Client) BlockBytes() int64 {
	if plan := c.blockPlan(); plan != nil {
		return plan.bytes
	}
	return 0
}

// blockPlan says where the blocks of ranges come from. Embedded server: blocks are cached
// in its tiers, on this node. Cluster mode: each block belongs to the server that owns its
// name on the ring (tiers.BlockName), so a large file spreads over the job's nodes; a reader
// on a node with servers of the job asks its node's server, which forwards to the owner, a
// reader elsewhere routes itself. A block in a tier of this node is read from there, any
// other range of a cached block is asked of its owner.
type blockPlan struct {
	bytes int64
	// ask has block n of the file at path cached, sending none of it.
	ask func(ctx context.Context, path string, n int64) error
	// fetch reads a range of a block cached off this node into p, and returns the version
	// of the source the block holds; nil where every cached block is in a tier of this node.
	fetch func(ctx context.Context, path string, n, off int64, p []byte) (int, version, error)
	// check asks the server of this node for a block its tiers list unchecked for this
	// job (see readBlockRange); nil in cluster mode, where fetch serves it.
	check func(ctx context.Context, path string, n int64) bool
}

// blockPlan returns the client's block plan, or nil while it has no server with blocks.
func (c *Client) blockPlan() *blockPlan {
	switch {
	case c.cluster != nil:
		return c.clusterBlockPlan()
	case c.node != nil:
		return c.node.blockPlan(c)
	}
	conn, down := c.current()
	if conn == nil || down || conn.blockBytes <= 0 {
		return nil
	}
	cached := func(ctx context.Context, path string, n int64) (*fitcachepb.ReadReply, error) {
		return conn.rpc.ReadBlock(ctx, c.root, path, conn.blockBytes, n, true)
	}
	return &blockPlan{bytes: conn.blockBytes,
		ask: func(ctx context.Context, path string, n int64) error {
			_, err := cached(ctx, path, n)
			return err
		},
		// The reader waits for the check: watched as a read is (see watchServer), so that a
		// server that stops meanwhile costs it a probe, not the read timeout.
		check: func(ctx context.Context, path string, n int64) bool {
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			unwatch := watchServer(ctx, conn.rpc, cancel)
			reply, err := cached(ctx, path, n)
			if hung := unwatch(); err != nil && hung {
				c.MarkUnavailable()
			}
			return err == nil && reply.CachedPath != ""
		}}
}

// blockPlan is the plan of a reader on a node with servers of the job: its node's server
// caches blocks and forwards the ranges of blocks other servers own (rpc's ForwardBlock). A
// node server that does not answer is marked down, as a read through the node socket would,
// and its blocks are no longer taken for cached: the ranges are read from the source.
func (r *nodeRouter) blockPlan(c *Client) *blockPlan {
	home := r.home()
	bb := int64(0)
	if home != nil {
		bb = home.blockBytes.Load()
	}
	if home == nil || r.down() || bb <= 0 {
		return nil
	}
	failed := func(err error) error {
		if errors.Is(err, rpc.ErrUnavailable) {
			r.markDown(err)
		}
		return err
	}
	return &blockPlan{bytes: bb,
		ask: func(ctx context.Context, path string, n int64) error {
			_, err := home.rpc.ReadBlockRange(ctx, c.root, path, bb, n, 0, 0, true)
			return failed(err)
		},
		fetch: func(ctx context.Context, path string, n, off int64, p []byte) (int, version, error) {
			reply, err := home.rpc.ReadBlockRange(ctx, c.root, path, bb, n, off, int64(len(p)), true)
			if err != nil {
				return 0, version{}, failed(err)
			}
			return copy(p, reply.Data), versionOfReply(reply), nil
		}}
}

// clusterBlockPlan is the plan of a reader that routes over the ring itself.
func (c *Client) clusterBlockPlan() *blockPlan {
	bb := c.cluster.BlockBytes()
	if bb <= 0 {
		return nil
	}
	return &blockPlan{bytes: bb,
		ask: func(ctx context.Context, path string, n int64) error {
			_, _, err := c.cluster.AskBlock(ctx, c.root, path, bb, n, 0, 0, false)
			return err
		},
		fetch: func(ctx context.Context, path string, n, off int64, p []byte) (int, version, error) {
			reply, _, err := c.cluster.AskBlock(ctx, c.root, path, bb, n, off, int64(len(p)), false)
			if err != nil {
				return 0, version{}, err
			}
			return copy(p, reply.Data), versionOfReply(reply), nil
		}}
}

// versionOfReply returns the version of the source a block sent by a server holds.
func versionOfReply(r *fitcachepb.ReadReply) version {
	return version{known: true, mtime: r.MtimeNanos, ctime: r.CtimeNanos, ino: uint64(r.Inode)}
}

// notLargeMax bounds the files a client remembers as read whole (about 100 bytes each);
// past it, the others are stat'ed at each open.
const notLargeMax = 1 << 20

// errNotLarge reports a file read through whole copies (see source).
var errNotLarge = errors.New("not a large file")

// source returns the source of the large file at path, kept open for the ranges of blocks
// not cached (see rangeFiles), with a reference the caller gives back (rangeFiles.give);
// errNotLarge for a file under core.ReadNowBytes, which is read whole. A source is kept for
// sourceKeep at most, so that a file replaced on the source is seen within that long.
func (c *Client) source(path string) (*rangeFile, error) {
	if rf := c.ranges.take(path); rf != nil {
		return rf, nil
	}
	if _, small := c.notLarge.Load(path); small {
		return nil, errNotLarge
	}
	src, err := core.OpenSource(c.root, c.realRoot, path)
	if err != nil {
		return nil, err
	}
	if src.Size() < core.ReadNowBytes {
		src.Close()
		if c.notLargeCount.Add(1) <= notLargeMax {
			c.notLarge.Store(path, struct{}{})
		}
		return nil, errNotLarge
	}
	f, err := src.ReaderFile()
	if err != nil {
		return nil, err
	}
	c.counts.sourceOpens.Add(1)
	return c.ranges.add(path, &rangeFile{f: f, size: src.Size(), until: time.Now().Add(sourceKeep)}), nil
}

// sourceKeep is how long a client reads ranges of a large file through one open of its source.
const sourceKeep = 5 * time.Second

// readBlockRange reads len(p) bytes at within of block n of the file at path: from the
// block in a tier of this node; else, when the block was cached off this node, from its
// holder (plan.fetch); else from the source src, asking for the block to be cached. A block
// the tiers list but not for this job's session yet (a new job over a warm cache) is asked
// for at once: the server checks it against the source (one look per file) and answers, and
// the range is served from it. callOff is where the ReadAt this range is part of began. It
// also returns the version of the file the bytes are of; with pieces (the ReadAt reads
// other blocks too, whose versions are compared), a range read from the source is
// checked not to change while it is read (fstat before and after: core.ErrChanged).
func (c *Client) readBlockRange(plan *blockPlan, dirs []tiers.Dir, src *rangeFile, path string, n int64, p []byte,
	within, callOff int64, pieces bool) (int, version, error) {
	name := tiers.BlockName(path, plan.bytes, n)
	if k, v, ok, err := c.readCopy(dirs, name, name, p, within); ok {
		return k, v, err
	}
	ctx, cancel := c.readContext(time.Now().Add(c.cfg.ReadTimeout))
	defer cancel()
	if plan.check != nil && tiers.Listed(routing.AnySession(dirs), name) && plan.check(ctx, path, n) {
		if k, v, ok, err := c.readCopy(routing.AnySession(dirs), name, name, p, within); ok {
			return k, v, err
		}
	}
	if plan.fetch != nil && c.brings.cachedElsewhere(name) {
		if k, v, err := plan.fetch(ctx, path, n, within, p); err == nil {
			c.counts.serverReads.Add(1)
			return k, v, nil
		}
	}
	var k int
	var v version
	var err error
	if pieces {
		k, v, err = readVersion(src.f, p, n*plan.bytes+within)
	} else {
		k, err = readFull(src.f, p, n*plan.bytes+within)
	}
	c.counts.sourceRanges.Add(1)
	c.counts.sourceRangeBytes.Add(int64(k))
	c.bringBlock(plan, path, n, n*plan.bytes+within, int64(k), callOff)
	return k, v, err
}

// readCopy reads len(p) bytes at off from the cached copy of name (a whole file or a
// block) in a tier of this node, kept mapped under key, and returns the version of the
// source the copy holds; ok is false when no tier has it.
func (c *Client) readCopy(dirs []tiers.Dir, key, name string, p []byte, off int64) (n int, v version, ok bool, err error) {
	rf := c.ranges.take(key)
	if rf == nil {
		if !tiers.Listed(dirs, name) { // an index lookup: a probe of several tiers is not free
			return 0, version{}, false, nil
		}
		m, perr := tiers.Probe(dirs, name)
		if perr != nil {
			return 0, version{}, false, nil
		}
		// The version it copies, from its record, once per mapping: unknown (matching no
		// other piece) if the record cannot be read.
		var v version
		if id, err := tiers.CopyIdentity(dirs, m); err == nil {
			v = version{known: true, mtime: id.MTimeNanos, ctime: id.CTimeNanos, ino: id.Ino}
		}
		rf = c.ranges.add(key, &rangeFile{m: m, kind: m.Tier, ver: v})
	}
	n, cerr := rf.m.CopyAt(p, off)
	if cerr != nil { // truncated under the mapping by someone: a miss, and the mapping goes
		c.ranges.forget(key, rf)
		c.ranges.give(rf)
		return 0, version{}, false, nil
	}
	v = rf.ver
	c.ranges.give(rf)
	c.counts.localHits.Add(1)
	c.pending.add(rf.kind.String(), int64(n))
	return n, v, true, nil
}

// DeclinedSource returns, for the C hit path of libfitcache, a new descriptor (the caller's
// to close) of the source
// of the large file at path (absolute and clean) that this client reads the ranges of blocks
// not cached from, when the server had no room for a block of it lately: the
// other blocks are then read from the source at once in C, without entering Go (the server
// would decline them too), until the blocks are asked for again (blockAskAgain), sourceKeep
// at most. ok is false otherwise.
func (c *Client) DeclinedSource(path string) (fd int, until time.Time, ok bool) {
	c.brings.mu.Lock()
	at, full := c.brings.full[path]
	c.brings.mu.Unlock()
	// Blocks declined are asked for again after blockAskAgain: until then, the server's
	// answer stands.
	if !full || time.Since(at) > blockAskAgain {
		return -1, time.Time{}, false
	}
	rf := c.ranges.take(path)
	if rf == nil || rf.m != nil {
		if rf != nil {
			c.ranges.give(rf)
		}
		return -1, time.Time{}, false
	}
	defer c.ranges.give(rf)
	var err error
	if ctl := func(s uintptr) { fd, err = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }; rf.f != nil {
		raw, rerr := rf.f.SyscallConn()
		if rerr != nil {
			return -1, time.Time{}, false
		}
		if rerr = raw.Control(ctl); rerr != nil {
			return -1, time.Time{}, false
		}
	}
	if err != nil {
		return -1, time.Time{}, false
	}
	until = at.Add(blockAskAgain)
	if keep := time.Now().Add(sourceKeep); keep.Before(until) {
		until = keep
	}
	return fd, until, true
}

// readFull reads len(p) bytes of f at off, fewer only at the end of the file.
func readFull(f *os.File, p []byte, off int64) (int, error) {
	n, err := f.ReadAt(p, off)
	if err == io.EOF {
		err = nil
	}
	return n, err
}

// bringBlock notes that k bytes at off of the file at path, in its block n, were read from
// the source, and asks the server, in the background, to cache that block once it is worth
// it: when the reader reads the file in sequence (the ReadAt that read it, which began at
// callOff, starts where the last range read from the source ended: a ReadAt that spans two
// blocks reads two ranges, and the second is no sign of a reader in sequence), or once the ranges read of the block from the source add up to a quarter of it
// (blockHeatShare). A random reader of sparse ranges so costs the source at most four times
// the bytes it reads, and a first pass over a file does not wait behind copies of blocks
// it barely reads (measured on the emulated parallel file system: with an eighth, the first
// of three passes of random 64 KiB ranges, 8 per block, ran at 0.49x plain reads); a block
// read often is cached after a few of its ranges. A block is asked
// for once (again after blockAskAgain: the server may have declined it). Asks wait in a
// queue of at most blockQueueMax (past it, the next miss on the block asks again), served
// by up to blockBringsMax goroutines.
func (c *Client) bringBlock(plan *blockPlan, path string, n, off, k, callOff int64) {
	name := tiers.BlockName(path, plan.bytes, n)
	b := &c.brings
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	if b.blocks == nil || len(b.blocks) >= blockAsksMax {
		b.blocks = make(map[string]*blockHeat)
	}
	if b.ends == nil || len(b.ends) >= blockAsksMax {
		b.ends = make(map[string]int64)
	}
	sequential := b.ends[path] == callOff && callOff > 0
	b.ends[path] = off + k
	h := b.blocks[name]
	if h == nil {
		h = &blockHeat{}
		b.blocks[name] = h
	}
	h.read += k
	if !sequential && h.read < plan.bytes/blockHeatShare || time.Since(h.asked) < blockAskAgain ||
		len(b.queue) >= blockQueueMax {
		return
	}
	h.asked = time.Now()
	b.queue = append(b.queue, blockAsk{plan: plan, path: path, n: n, name: name})
	if b.running < blockBringsMax {
		b.running++
		b.wg.Add(1)
		go c.bringBlocks()
	}
}

// blockHeat is what a client read of a block from the source, when it asked for it, and
// whether the ask cached it.
type blockHeat struct {
	read   int64
	asked  time.Time
	cached bool
}

// cachedElsewhere reports whether the block named name was cached at this client's ask
// (by a server that may be on another node: see blockPlan.fetch).
func (b *blockBrings) cachedElsewhere(name string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	h := b.blocks[name]
	return h != nil && h.cached
}

// blockHeatShare: a block is asked for once the ranges read of it from the source add up
// to 1/blockHeatShare of it (see bringBlock).
const blockHeatShare = 4

// bringBlocks asks the server for the queued blocks until the queue is empty or the client
// closes.
func (c *Client) bringBlocks() {
	b := &c.brings
	defer b.wg.Done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { // Close does not wait for a slow server
		select {
		case <-c.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	for {
		b.mu.Lock()
		if len(b.queue) == 0 || ctx.Err() != nil {
			b.running--
			b.mu.Unlock()
			return
		}
		ask := b.queue[0]
		b.queue = b.queue[1:]
		b.mu.Unlock()
		actx, acancel := context.WithTimeout(ctx, c.cfg.ReadTimeout)
		err := ask.plan.ask(actx, ask.path, ask.n)
		acancel()
		if err == nil || errors.Is(err, core.ErrCacheFull) {
			b.mu.Lock()
			if h := b.blocks[ask.name]; h != nil && err == nil {
				h.cached = true
			}
			if err != nil { // no room for the dataset's blocks: see Declined
				if b.full == nil || len(b.full) >= blockAsksMax {
					b.full = make(map[string]time.Time)
				}
				b.full[ask.path] = time.Now()
			}
			b.mu.Unlock()
		}
		if err != nil && !errors.Is(err, core.ErrTooLarge) && !errors.Is(err, core.ErrCacheFull) &&
			!errors.Is(err, routing.ErrReadSource) && ctx.Err() == nil {
			c.log.Warn("caching a block", "path", ask.path, "block", ask.n, "err", err)
		}
	}
}

const (
	// blockBringsMax bounds the blocks a client asks its server to cache at once.
	blockBringsMax = 4
	// blockQueueMax bounds the asks waiting.
	blockQueueMax = 1024
	// blockAskAgain is how long a client waits before asking again for a block it asked for
	// (the server declined it: no room; or a reader still misses on it).
	blockAskAgain = 10 * time.Second
	// blockAsksMax bounds the blocks (and files) a client remembers (about 100 bytes each).
	blockAsksMax = 1 << 16
)

// blockBrings are a client's background asks for blocks (see bringBlock).
type blockBrings struct {
	mu      sync.Mutex            // protects closed, blocks, ends, full, queue and running
	full    map[string]time.Time  // path -> when the server last had no room for a block of it
	closed  bool                  // set by Close: no ask starts any more
	blocks  map[string]*blockHeat // block name -> what was read of it, when it was asked for
	ends    map[string]int64      // path -> where the last range read from its source ended
	queue   []blockAsk            // asks waiting, oldest first
	running int                   // goroutines serving the queue
	wg      sync.WaitGroup        // those goroutines, awaited by Close
}

// stop refuses new asks and waits for the goroutines serving the queue, which stop at once
// (the client's stop channel cancels their calls).
func (b *blockBrings) stop() {
	b.mu.Lock()
	b.closed = true
	b.queue = nil
	b.mu.Unlock()
	b.wg.Wait()
}

// blockAsk is an ask for block n of the file at path (named name), through plan.
type blockAsk struct {
	plan *blockPlan
	path string
	n    int64
	name string
}

// rangeFile is what a client keeps for ranges: a mapping of a whole copy or a block in a
// tier (kind), or the source of a large file, open (until: when it must be opened again,
// size: its size then).
type rangeFile struct {
	m     *tiers.Mapping
	ver   version // of the source m copies
	f     *os.File
	kind  tiers.Kind
	size  int64
	until time.Time
	refs  int  // readers using it (rangeFiles.mu)
	gone  bool // no longer kept: its last reader releases it
}

// release unmaps or closes the file.
func (rf *rangeFile) release() {
	if rf.m != nil {
		rf.m.Release()
	} else {
		rf.f.Close()
	}
}

// rangeFiles are the cached copies a client keeps mapped for ranges, at most rangeMapsMax,
// and the sources it keeps open, at most rangeSourcesMax: a range of a cached copy is then a
// copy from memory, as a range of the source is a pread. A copy never changes once
// published (a new copy is a new file), and each was checked against its source for this
// client's job when it was mapped (tiers.Probe), as a mapping a client keeps is. A copy
// the tiers no longer list (evicted, removed, found stale) is dropped within sweepEvery, so
// that its memory is freed. Mappings hold no descriptor. Readers hold a reference to what
// they read, never the lock, so a slow source read holds nobody up. It is safe for
// concurrent use.
type rangeFiles struct {
	mu      sync.Mutex // protects files, sources, swept and the entries' refs and gone
	files   map[string]*rangeFile
	sources int       // entries that are sources
	swept   time.Time // when sweep last looked at the mappings
}

const (
	// rangeMapsMax bounds the copies kept mapped: 16 GiB of 4 MiB blocks (address space;
	// the pages are the tier's, and a copy no longer listed is let go, see sweep).
	rangeMapsMax = 4096
	// rangeSourcesMax bounds the sources kept open (descriptors of the program's).
	rangeSourcesMax = 64
	// sweepEvery paces sweep.
	sweepEvery = time.Second
)

// take returns the file kept for key, if there is one still valid, with a reference taken.
func (r *rangeFiles) take(key string) *rangeFile {
	r.mu.Lock()
	defer r.mu.Unlock()
	rf := r.files[key]
	if rf != nil && !rf.until.IsZero() && time.Now().After(rf.until) {
		r.drop(key) // expired: opened anew by the caller, if it still can be
		return nil
	}
	if rf == nil {
		return nil
	}
	rf.refs++
	return rf
}

// give gives back a reference from take or add.
func (r *rangeFiles) give(rf *rangeFile) {
	r.mu.Lock()
	rf.refs--
	last := rf.gone && rf.refs == 0
	r.mu.Unlock()
	if last {
		rf.release()
	}
}

// add keeps rf for key, in place of the one kept before and, past the bounds, of another of
// its sort (an arbitrary one: map order), and returns it with a reference taken.
func (r *rangeFiles) add(key string, rf *rangeFile) *rangeFile {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.files == nil {
		r.files = make(map[string]*rangeFile)
	}
	r.drop(key)
	isSource := rf.m == nil
	for k, old := range r.files {
		if isSource && r.sources < rangeSourcesMax || !isSource && len(r.files)-r.sources < rangeMapsMax {
			break
		}
		if (old.m == nil) == isSource {
			r.drop(k)
		}
	}
	r.files[key] = rf
	if isSource {
		r.sources++
	}
	rf.refs++
	return rf
}

// forget stops keeping rf for key, if it is still what key holds.
func (r *rangeFiles) forget(key string, rf *rangeFile) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.files[key] == rf {
		r.drop(key)
	}
}

// drop stops keeping the entry of key, if any: it is released now, or by its last reader
// (r.mu held).
func (r *rangeFiles) drop(key string) {
	rf, ok := r.files[key]
	if !ok {
		return
	}
	delete(r.files, key)
	if rf.m == nil {
		r.sources--
	}
	rf.gone = true
	if rf.refs == 0 {
		rf.release()
	}
}

// sweep drops, at most once per sweepEvery, the mappings of copies that dirs no longer
// list: their pages would otherwise stay in use after the server evicted or removed them.
func (r *rangeFiles) sweep(dirs []tiers.Dir) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if now.Sub(r.swept) < sweepEvery {
		return
	}
	r.swept = now
	for key, rf := range r.files {
		if rf.m != nil && !tiers.StillListed(dirs, rf.m) {
			r.drop(key)
		}
	}
}

// close releases every entry; no reader may use one any more.
func (r *rangeFiles) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for key := range r.files {
		r.drop(key)
	}
}
