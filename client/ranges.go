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
	"io"
	"os"
	"sync"
	"time"

	"github.com/fitcache/fitcache/core"
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
	if k, ok, err := c.readCopy(dirs, path+wholeSuffix, path, p, off); ok {
		return k, err
	}
	conn, blockBytes := c.blockServer()
	if conn == nil {
		return c.readAtWhole(path, p, off)
	}
	size, err := c.largeSize(path)
	if errors.Is(err, errNotLarge) {
		return c.readAtWhole(path, p, off)
	}
	if err != nil {
		return 0, err
	}
	done := 0
	for done < len(p) && off+int64(done) < size {
		at := off + int64(done)
		n, within := at/blockBytes, at%blockBytes
		want := p[done:min(len(p), done+int(min(blockBytes-within, size-at)))]
		k, err := c.readBlockRange(conn, dirs, path, n, want, within)
		if err != nil {
			return done, err
		}
		if k == 0 {
			break // the file is shorter than it was
		}
		done += k
	}
	return done, nil
}

// wholeSuffix follows a path in the key of its whole copy among rangeFiles (a block's has a
// NUL byte and digits, a source's none).
const wholeSuffix = "\x00whole"

// readAtWhole is ReadAt through the whole file (a small file, or no server with blocks).
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

// blockServer returns the connection to the server on this node that caches blocks, and
// their size; nil in cluster mode and while there is no such server (then ranges are read
// through whole files, as before blocks).
func (c *Client) blockServer() (*serverConn, int64) {
	if c.cluster != nil || c.node != nil {
		return nil, 0
	}
	conn, down := c.current()
	if conn == nil || down || conn.blockBytes <= 0 {
		return nil, 0
	}
	return conn, conn.blockBytes
}

// errNotLarge reports a file read through whole copies (see largeSize).
var errNotLarge = errors.New("not a large file")

// largeSize returns the size of the large file at path, whose source it keeps open for
// ranges not cached (see rangeFiles); errNotLarge for a file under core.ReadNowBytes, which
// is read whole. A source is kept open for sourceKeep at most, so that a file replaced on
// the source is seen within that long.
func (c *Client) largeSize(path string) (int64, error) {
	if size, ok := c.ranges.size(path); ok {
		return size, nil
	}
	if _, small := c.notLarge.Load(path); small {
		return 0, errNotLarge
	}
	src, err := core.OpenSource(c.root, c.realRoot, path)
	if err != nil {
		return 0, err
	}
	if src.Size() < core.ReadNowBytes {
		src.Close()
		if c.notLargeCount.Add(1) <= notLargeMax {
			c.notLarge.Store(path, struct{}{})
		}
		return 0, errNotLarge
	}
	f, err := src.ReaderFile()
	if err != nil {
		return 0, err
	}
	c.counts.sourceOpens.Add(1)
	c.ranges.add(path, rangeFile{f: f, size: src.Size(), until: time.Now().Add(sourceKeep)})
	return src.Size(), nil
}

// sourceKeep is how long a client reads ranges of a large file through one open of its source.
const sourceKeep = 5 * time.Second

// readBlockRange reads len(p) bytes at within of block n of the file at path: from the
// block in a tier of this node, else from the source, asking the server to cache the block.
func (c *Client) readBlockRange(conn *serverConn, dirs []tiers.Dir, path string, n int64, p []byte, within int64) (int, error) {
	name := tiers.BlockName(path, n)
	if k, ok, err := c.readCopy(dirs, name, name, p, within); ok {
		return k, err
	}
	k, _, ok, err := c.ranges.readAt(path, p, n*conn.blockBytes+within)
	if !ok { // its source was closed meanwhile
		if _, err := c.largeSize(path); err != nil {
			return 0, err
		}
		k, _, _, err = c.ranges.readAt(path, p, n*conn.blockBytes+within)
	}
	c.counts.sourceRanges.Add(1)
	c.counts.sourceRangeBytes.Add(int64(k))
	c.bringBlock(conn, path, n)
	return k, err
}

// readCopy reads len(p) bytes at off from the cached copy of name (a whole file or a
// block) in a tier of this node, kept open under key; ok is false when no tier has it.
func (c *Client) readCopy(dirs []tiers.Dir, key, name string, p []byte, off int64) (n int, ok bool, err error) {
	n, kind, ok, err := c.ranges.readAt(key, p, off)
	if !ok {
		f, d, oerr := openTier(dirs, name)
		if oerr != nil {
			return 0, false, nil
		}
		n, err = readFull(f, p, off)
		c.ranges.add(key, rangeFile{f: f, kind: d.Kind})
		kind = d.Kind
	}
	c.counts.localHits.Add(1)
	c.pending.add(kind.String(), int64(n))
	return n, true, err
}

// readFull reads len(p) bytes of f at off, fewer only at the end of the file.
func readFull(f *os.File, p []byte, off int64) (int, error) {
	n, err := f.ReadAt(p, off)
	if err == io.EOF {
		err = nil
	}
	return n, err
}

// bringBlock asks the server, in the background, to cache block n of the file at path,
// unless it was asked already (a failed ask is repeated after blockAskAgain) or
// blockBringsMax asks are under way (the next miss on the block asks again).
func (c *Client) bringBlock(conn *serverConn, path string, n int64) {
	name := tiers.BlockName(path, n)
	c.brings.mu.Lock()
	if at, asked := c.brings.asked[name]; asked && time.Since(at) < blockAskAgain ||
		c.brings.running >= blockBringsMax {
		c.brings.mu.Unlock()
		return
	}
	if c.brings.asked == nil || len(c.brings.asked) >= blockAsksMax {
		c.brings.asked = make(map[string]time.Time)
	}
	c.brings.asked[name] = time.Now()
	c.brings.running++
	c.brings.wg.Add(1)
	c.brings.mu.Unlock()
	go func() {
		defer func() {
			c.brings.mu.Lock()
			c.brings.running--
			c.brings.mu.Unlock()
			c.brings.wg.Done()
		}()
		ctx, cancel := context.WithTimeout(context.Background(), c.cfg.ReadTimeout)
		defer cancel()
		go func() { // Close does not wait for a slow server
			select {
			case <-c.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		if _, err := conn.rpc.ReadBlock(ctx, c.root, path, n, true); err != nil &&
			!errors.Is(err, core.ErrTooLarge) && !errors.Is(err, core.ErrCacheFull) && ctx.Err() == nil {
			c.log.Warn("caching a block", "path", path, "block", n, "err", err)
		}
	}()
}

const (
	// blockBringsMax bounds the blocks a client asks its server to cache at once.
	blockBringsMax = 4
	// blockAskAgain is how long a client waits before asking again for a block it asked for
	// (the server declined it: no room; or a reader still misses on it).
	blockAskAgain = 10 * time.Second
	// blockAsksMax bounds the asks a client remembers (about 100 bytes each).
	blockAsksMax = 1 << 16
)

// blockBrings are a client's background asks for blocks (see bringBlock).
type blockBrings struct {
	mu      sync.Mutex           // protects asked and running
	asked   map[string]time.Time // block name -> when it was asked for
	running int
	wg      sync.WaitGroup // the asks under way, awaited by Close
}

// rangeFile is a file a client keeps open to read ranges of: a whole copy or a block in a
// tier (kind), or the source of a large file (until: when it must be opened again, size: its
// size then).
type rangeFile struct {
	f     *os.File
	kind  tiers.Kind
	size  int64
	until time.Time
}

// rangeFiles are the files a client keeps open for ranges, at most rangeFilesMax: a range
// of a cached copy costs one pread, as a range of the source does. A copy never changes
// once published (a new copy is a new file), one evicted meanwhile still holds the right
// bytes, and each was checked against its source for this client's job when it was opened
// (tiers.Dir.OpenFile), as a mapping a client keeps is. It is safe for concurrent use.
type rangeFiles struct {
	mu    sync.RWMutex // held shared by reads of the files, exclusively to close one
	files map[string]rangeFile
}

// rangeFilesMax bounds the files kept open: 1 GiB of 4 MiB blocks.
const rangeFilesMax = 256

// readAt reads len(p) bytes at off from the file kept for key, if there is one still valid.
func (r *rangeFiles) readAt(key string, p []byte, off int64) (n int, kind tiers.Kind, ok bool, err error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	rf, found := r.files[key]
	if !found || !rf.until.IsZero() && time.Now().After(rf.until) {
		return 0, 0, false, nil
	}
	n, err = readFull(rf.f, p, off)
	return n, rf.kind, true, err
}

// size returns the size of the source kept for path, if there is one still valid.
func (r *rangeFiles) size(path string) (int64, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	rf, found := r.files[path]
	if !found || time.Now().After(rf.until) {
		return 0, false
	}
	return rf.size, true
}

// add keeps rf open for key, closing the one it replaces and, past rangeFilesMax, another.
func (r *rangeFiles) add(key string, rf rangeFile) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.files == nil {
		r.files = make(map[string]rangeFile)
	}
	if old, ok := r.files[key]; ok {
		old.f.Close()
		delete(r.files, key)
	}
	for k, old := range r.files { // an arbitrary one: map order
		if len(r.files) < rangeFilesMax {
			break
		}
		old.f.Close()
		delete(r.files, k)
	}
	r.files[key] = rf
}

// close closes every file kept.
func (r *rangeFiles) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rf := range r.files {
		rf.f.Close()
	}
	r.files = nil
}
