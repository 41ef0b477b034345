package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// The transparent mode in cluster mode. The preload shim (preload/) runs no Go and speaks no
// Thrift: it opens cached files of the servers on its node itself, and asks one of them for
// the rest over its node socket (package nodesock), which answers with a descriptor. In
// cluster mode that server reads through a Client of its own, made for the dataset root and
// told which server it runs in (SetOwnServer), and answers with what OpenForReader returns,
// so that every file still has one owner on the ring and the source is read once per file,
// whichever node reads it. Bytes from other nodes travel over Kitex, as for any client.

// ownServer is the cluster server a client runs inside (see SetOwnServer).
type ownServer struct {
	id     string // its id on the ring (host:port)
	engine *core.Engine
}

// SetOwnServer tells a cluster-mode client that it runs inside the server id of the ring,
// whose engine is e: OpenForReader opens that server's files with e, not over RPC. Call it
// before the client's first OpenForReader.
func (c *Client) SetOwnServer(id string, e *core.Engine) { c.own = &ownServer{id: id, engine: e} }

// SetServerState tells a cluster-mode client what the job's servers found of server id (see
// package membership): dead, its reads go by the policy at once; alive, it is walked again.
// A client outside cluster mode, or one that routes through its node's servers, ignores it.
func (c *Client) SetServerState(id string, alive bool) {
	if c.cluster != nil {
		c.cluster.told(id, alive)
	}
}

// OpenForReader returns a read-only descriptor holding the bytes of the file at path
// (absolute, or relative to the root) for a reader on this node that has no client of its
// own: a miss of the preload shim, which the server running this client answers through its
// node socket. It works in cluster mode only (errors.ErrUnsupported otherwise: the embedded
// server answers with its engine). The file's place on the ring decides what the descriptor
// is, and its Origin says so:
//
//   - a file of the server this client runs in (SetOwnServer): that engine's answer (see
//     core.Engine.OpenForReader), its cached copy, read from the source first on a miss;
//   - a file of another server on this node: the cached copy in that server's tier, which
//     that server fills on a miss (the tier's origin, core.TierOrigin);
//   - a file of a server on another node: a sealed memory file (memfd) holding the bytes it
//     sent (core.OriginPeer), so that the file stays cached at its owner only;
//   - a file read from the source (its owner is dead under the pfs policy, no server
//     answers, or it is too large to send): the source itself, opened beneath the dataset
//     root (core.OriginSource), as a direct read of Read would.
//
// Dead servers are detected and the failure policy applied as for Read. The caller closes
// the file.
func (c *Client) OpenForReader(ctx context.Context, path string) (*os.File, core.Origin, error) {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return nil, 0, core.ErrClosed
	}
	if c.cluster == nil {
		return nil, 0, fmt.Errorf("client OpenForReader outside cluster mode: %w", errors.ErrUnsupported)
	}
	path, err := c.Resolve(path)
	if err != nil {
		return nil, 0, err
	}
	return c.openForReader(ctx, path)
}

// openForReader is OpenForReader for a resolved path, the client's lifetime lock held.
func (c *Client) openForReader(ctx context.Context, path string) (*os.File, core.Origin, error) {
	// A copy the server this client runs in holds (its own, or a node-local copy of a file
	// another server owns, also one whose owner died since) serves first, checked.
	if c.own != nil {
		if f, origin, ok := c.own.engine.OpenCached(c.root, path); ok {
			return f, origin, nil
		}
		if f, ok := c.openLargeNow(path); ok {
			return f, core.OriginSourceWhileCached, nil
		}
	}
	var f *os.File
	var origin core.Origin
	err := c.route(path, func(p *peer, rest []*peer) (err error) {
		f, origin, err = c.openFromPeer(ctx, p, rest, path)
		return err
	})
	if errors.Is(err, errReadSource) {
		f, origin, err = c.openSource(path)
	}
	if err != nil {
		c.counts.errors.Add(1)
		return nil, 0, err
	}
	return f, origin, nil
}

// openLargeNow opens a large file (core.ReadNowBytes or more) whose owner is another server
// from its source at once, so that the reader does not wait for the owner's copy and its
// transfer, and brings the file to this node in the background, as prefetch does
// (FetchForReader: the owner caches it, this node keeps a node-local copy where there is
// room); the next open finds it here. A file this client's own server owns is handed over by
// that server's engine itself (core.Engine.OpenForReader). false: open it as any other.
func (c *Client) openLargeNow(path string) (*os.File, bool) {
	if targets := c.cluster.targets(path); len(targets) == 0 || targets[0].member.ID == c.own.id {
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
			if err := c.FetchForReader(ctx, path); err != nil && !errors.Is(err, core.ErrTooLarge) &&
				!errors.Is(err, core.ErrCacheFull) {
				c.log.Warn("bringing a large file to this node", "path", path, "err", err)
			}
		}()
	}
	return f, true
}

// notLargeMax bounds the files a client remembers as too small for openLargeNow (about 100
// bytes each); past it, the others are stat'ed at each open.
const notLargeMax = 1 << 20

// bringTimeout bounds the background transfer of a large file (see openLargeNow); Close
// waits for it.
const bringTimeout = time.Minute

// openFromPeer opens the file at path as one server holds it (see OpenForReader); rest are
// the servers that hold replicas.
func (c *Client) openFromPeer(ctx context.Context, p *peer, rest []*peer, path string) (*os.File, core.Origin, error) {
	dirs, _ := p.state()
	if own := c.own; own != nil && p.member.ID == own.id {
		if len(rest) == 0 {
			return own.engine.OpenForReader(ctx, c.root, path)
		}
		// Replicas: a file this read takes from the source goes to the next servers too, as
		// a read through a client sends it (see Read).
		res, err := own.engine.Read(ctx, c.root, path, true)
		if err != nil {
			return nil, 0, err // too large to cache: read the source
		}
		if res.Origin == core.OriginSource {
			c.replicate(rest, path, res.Bytes(), c.cluster.stamper.Stamp(path, res))
		}
		res.Release()
		if f, d, err := openTier(anySession(dirs), path); err == nil { // the engine checked it
			return f, core.TierOrigin(d.Kind), nil
		}
		return own.engine.OpenForReader(ctx, c.root, path) // evicted meanwhile, or not in a tier
	}
	// A server on this node is asked too, not its tiers opened here: the reader is of
	// another job than this long-lived client, and a copy this client's session would take
	// may not be checked for the reader's (the reader looked in the tiers itself first). The
	// server checks the copy before it names it.
	var session uint32
	if c.own != nil {
		session = c.own.engine.Session()
	}
	buf := transferBuffers.Get().(*[]byte)
	defer transferBuffers.Put(buf)
	reply, err := c.askPeerInto(ctx, p, path, *buf)
	if err != nil {
		return nil, 0, err
	}
	data := reply.Data
	if reply.CachedPath != "" { // a server on this node cached it: hand out its tier file
		checked := anySession(dirs) // the server checked the copy before it answered
		if rpc.OriginOf(reply) == core.OriginSource && len(rest) > 0 {
			if m, err := tiers.Probe(checked, path); err == nil {
				c.replicate(rest, path, m.Bytes(), rpc.StampOf(reply))
				m.Release()
			}
		}
		if f, d, err := openTier(checked, path); err == nil {
			return f, core.TierOrigin(d.Kind), nil
		}
		// Evicted between the reply and the open: ask for the bytes.
		if reply, err = p.rpc.Read(ctx, c.root, path, false); err != nil {
			return nil, 0, err
		}
		data = reply.Data
	} else {
		if rpc.OriginOf(reply) == core.OriginSource && len(rest) > 0 {
			c.replicate(rest, path, data, rpc.StampOf(reply))
		}
		// A server on another node sent the bytes: a node-local copy, where there is room,
		// serves this node's next reads of the file from its own tiers.
		if c.keepGuest(ctx, path, reply, session) == nil {
			if f, d, err := openTier(anySession(c.own.engine.TierDirs()), path); err == nil {
				return f, core.TierOrigin(d.Kind), nil
			}
		}
	}
	f, err := memFile(path, data, reply.MtimeNanos)
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
// the tiers of the server this client runs in (see core.Engine.StoreGuest), where they take
// room its own files do not need. session is that engine's session taken before the server
// was asked. It returns nil once the copy is in a tier.
func (c *Client) keepGuest(ctx context.Context, path string, reply *fitcachepb.ReadReply, session uint32) error {
	if c.own == nil || reply.CachedPath != "" {
		return errors.ErrUnsupported
	}
	if c.guestsFull() {
		return fmt.Errorf("%w: no room for node-local copies of %s", core.ErrCacheFull, c.root)
	}
	err := c.own.engine.StoreGuest(ctx, core.GuestCopy{Root: c.root, Path: path, Data: reply.Data, Session: session,
		Source: tiers.Identity{Size: int64(len(reply.Data)), MTimeNanos: reply.MtimeNanos, CTimeNanos: reply.CtimeNanos,
			Ino: uint64(reply.Inode)}})
	if errors.Is(err, core.ErrCacheFull) {
		// The tiers hold the server's own files and this dataset's copies: no room will come
		// soon (copies of a dataset never make room for each other). Try again later.
		c.guestsFullUntil.Store(time.Now().Add(guestsFullRecheck).UnixNano())
	}
	return err
}

// guestsFullRecheck is how long a client keeps no node-local copies after the tiers had no
// room for one.
const guestsFullRecheck = time.Second

// guestsFull reports whether the tiers had no room for a node-local copy of this client's
// dataset less than guestsFullRecheck ago.
func (c *Client) guestsFull() bool { return time.Now().UnixNano() < c.guestsFullUntil.Load() }

// FetchForReader brings the file at path (absolute, or relative to the root) into a tier of
// this node for a reader on it that finds cached files itself, as the C hit path of
// libfitcache does after the node socket's OpFetch. That is the owner's copy when the owner
// is a server of this node (the one this client runs in, see SetOwnServer, or another, asked
// over RPC), else a node-local copy of the bytes the owner on another node sends, kept by the
// server this client runs in where its own files leave room (core.Engine.StoreGuest). It
// returns an error wrapping core.ErrCacheFull when no tier of this node takes the file (the
// reader then has the server open it, see OpenForReader), core.ErrTooLarge when the file is to
// be read from the source (too large, or its owner is dead under the pfs policy), or the
// file's own error. It works in cluster mode only.
func (c *Client) FetchForReader(ctx context.Context, path string) error {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return core.ErrClosed
	}
	if c.cluster == nil || c.own == nil {
		return fmt.Errorf("client FetchForReader outside a cluster server: %w", errors.ErrUnsupported)
	}
	path, err := c.Resolve(path)
	if err != nil {
		return err
	}
	if f, _, ok := c.own.engine.OpenCached(c.root, path); ok { // this server's copy, or a node-local one
		f.Close()
		return nil
	}
	err = c.route(path, func(p *peer, rest []*peer) error { return c.fetchFromPeer(ctx, p, rest, path) })
	if errors.Is(err, errReadSource) {
		return fmt.Errorf("%w: %s is read from the source", core.ErrTooLarge, path)
	}
	if err != nil && !errors.Is(err, core.ErrCacheFull) {
		c.counts.errors.Add(1)
	}
	return err
}

// fetchFromPeer brings path into a tier of this node through one server (see FetchForReader);
// rest are the servers that hold replicas.
func (c *Client) fetchFromPeer(ctx context.Context, p *peer, rest []*peer, path string) error {
	own := c.own
	if p.member.ID == own.id {
		if len(rest) == 0 {
			return own.engine.Fetch(ctx, c.root, path)
		}
		res, err := own.engine.Read(ctx, c.root, path, true) // replicas, as in openFromPeer
		if err != nil {
			return err
		}
		if res.Origin == core.OriginSource {
			c.replicate(rest, path, res.Bytes(), c.cluster.stamper.Stamp(path, res))
		}
		res.Release()
		return nil
	}
	if !p.local && c.guestsFull() {
		// No room for a node-local copy now: asking the owner would only move the bytes here
		// to be dropped (the reader has the server open the file instead).
		return fmt.Errorf("%w: no room for node-local copies of %s", core.ErrCacheFull, c.root)
	}
	session := own.engine.Session()
	buf := transferBuffers.Get().(*[]byte)
	defer transferBuffers.Put(buf)
	reply, err := c.askPeerInto(ctx, p, path, *buf)
	if err != nil {
		return err
	}
	if rpc.OriginOf(reply) == core.OriginSource && len(rest) > 0 {
		if reply.CachedPath != "" {
			dirs, _ := p.state()
			if m, err := tiers.Probe(anySession(dirs), path); err == nil {
				c.replicate(rest, path, m.Bytes(), rpc.StampOf(reply))
				m.Release()
			}
		} else {
			c.replicate(rest, path, reply.Data, rpc.StampOf(reply))
		}
	}
	switch {
	case reply.CachedPath != "": // another server of this node cached it in its tier
		return nil
	case p.local: // too large for that server's tiers to keep, or no room there
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
func (c *Client) openSource(path string) (*os.File, core.Origin, error) {
	src, err := core.OpenSource(c.root, c.realRoot, path)
	if err != nil {
		return nil, 0, err
	}
	f, err := src.ReaderFile()
	if err != nil {
		return nil, 0, err
	}
	c.counts.directReads.Add(1)
	return f, core.OriginSource, nil
}

// memfdName bounds the name of a memory file (the kernel takes 249 bytes).
const memfdName = 200

// memFile returns a memory file (memfd) holding data, named after path (a reader sees
// /memfd:fitcache:NAME in /proc/self/fd), read-only to everyone it is handed to: it is
// sealed against writes and size changes, and its mode is 0444. Its modification time is
// the source's when known, so that fstat agrees with the source on size and time. Closing
// the last descriptor frees it.
func memFile(path string, data []byte, mtimeNanos int64) (*os.File, error) {
	name := "fitcache:" + filepath.Base(path)
	if len(name) > memfdName {
		name = name[:memfdName]
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memory file for %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), "memfd:"+name)
	if err := fillMemFile(f, data, mtimeNanos); err != nil {
		f.Close()
		return nil, fmt.Errorf("memory file for %s: %w", path, err)
	}
	return f, nil
}

func fillMemFile(f *os.File, data []byte, mtimeNanos int64) error {
	fd := int(f.Fd())
	if _, err := f.Write(data); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, 0o444); err != nil {
		return err
	}
	if mtimeNanos != 0 {
		ts := unix.NsecToTimespec(mtimeNanos)
		unix.UtimesNanoAt(fd, "", []unix.Timespec{ts, ts}, unix.AT_EMPTY_PATH) // best effort
	}
	seals := unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		return err
	}
	_, err := f.Seek(0, io.SeekStart) // the reader shares the offset: it starts at 0
	return err
}

// Owner returns the id of the server a read of path goes to first in cluster mode: its
// owner on the ring or, under recache, the next live server; "" when it is read from the
// source (pfs policy and a dead owner) or outside cluster mode.
func (c *Client) Owner(path string) string {
	if c.cluster == nil {
		return ""
	}
	path, err := c.Resolve(path)
	if err != nil {
		return ""
	}
	if t := c.cluster.targets(path); len(t) > 0 {
		return t[0].member.ID
	}
	return ""
}

// LocalServers returns the ids of the job's servers on this node (config.Config.Node), alive
// or not, sorted (not nil, if empty); nil outside cluster mode.
func (c *Client) LocalServers() []string {
	if c.node != nil {
		return c.node.ids()
	}
	if c.cluster == nil {
		return nil
	}
	ids := []string{}
	for id, p := range c.cluster.peers {
		if p.local {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids
}

// nodeSocket returns the node socket of the first live server on this node (by address)
// that announced one and whose socket is this user's.
func (r *clusterRouter) nodeSocket() string {
	var ids []string
	for id, p := range r.peers {
		if p.local {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	for _, id := range ids {
		p := r.peers[id]
		p.mu.Lock()
		path, dead := p.nodeSocket, p.dead
		p.mu.Unlock()
		if !dead && path != "" && ownSocket(path) {
			return path
		}
	}
	return ""
}

// ownSocket reports whether path is a Unix socket of this user (not a link): a reader hands
// its opens to whoever listens there and trusts the descriptors that come back.
func ownSocket(path string) bool {
	var st syscall.Stat_t
	return syscall.Lstat(path, &st) == nil && st.Mode&syscall.S_IFMT == syscall.S_IFSOCK && int(st.Uid) == os.Geteuid()
}

// Forget drops the cached copies of the file at path (absolute, or relative to the root)
// that a reader could be given, because its source is being written: a write-open through the
// preload shim, which the server this client runs in was told of over its node socket. Every
// live server of the job is asked, in parallel: besides the owner and replicas, any server
// may hold a node-local copy (see FetchForReader), which readers on its node read themselves. It works in cluster mode only (errors.ErrUnsupported otherwise: the embedded
// server forgets with its engine).
func (c *Client) Forget(ctx context.Context, path string) error {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return core.ErrClosed
	}
	if c.cluster == nil {
		return fmt.Errorf("client Forget outside cluster mode: %w", errors.ErrUnsupported)
	}
	path, err := c.Resolve(path)
	if err != nil {
		return err
	}
	var mu sync.Mutex // protects errs
	var errs []error
	var wg sync.WaitGroup
	for _, p := range c.cluster.peers {
		if _, dead := p.state(); dead {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if own := c.own; own != nil && p.member.ID == own.id {
				err = own.engine.Forget(c.root, path)
			} else {
				err = p.rpc.Forget(ctx, c.root, path)
			}
			if err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("server %s: %w", p.member.ID, err))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
