package core

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

// Large files are cached in blocks as well as whole. A reader of ranges of a large file
// (Client.ReadAt, fc_pread) asks for the blocks its ranges cover: each block is an entry of
// a tier of its own, named by tiers.BlockName (the file's path and the block's number),
// published, indexed, checked against its source, evicted and verified like a whole file. So
// a file larger than every tier, or than the whole cache, is cached by the ranges that are
// read, and a range costs a block's fill at most, never a whole file's copy.
//
// Whole-file reads (Read, OpenForReader) are unchanged: a file some tier can hold is cached
// whole, and a reader of ranges serves a whole copy when there is one.

// DefaultBlockBytes is the size of the blocks large files are cached in, unless
// EngineConfig.BlockBytes says otherwise (docs/BENCHMARKS.md section 12 measures 1-16 MiB).
const DefaultBlockBytes = 4 << 20

// blockFillsMax bounds the blocks an engine reads from the source at once: every reader of
// ranges asks for blocks (four at a time each), and many workers must not turn into as many
// concurrent source reads.
const blockFillsMax = 8

// BlockBytes returns the size of this engine's blocks.
func (e *Engine) BlockBytes() int64 { return e.blockBytes }

// blockLen returns the number of bytes block n of a file of size bytes holds: blockBytes,
// less for the last block, 0 past the end.
func (e *Engine) blockLen(size, n int64) int64 {
	return max(0, min(e.blockBytes, size-n*e.blockBytes))
}

// ReadBlock returns block n of the file at path, inside root: its bytes from n*BlockBytes,
// BlockBytes of them or fewer at the end of the file, none past it. A block not cached is
// read from the source once (readers that miss on it at once share that read) into the
// fastest tier that takes it, and served from there; wantMapping is as for Read. A block
// no tier takes fails with ErrTooLarge or ErrCacheFull, and the caller reads the source.
func (e *Engine) ReadBlock(ctx context.Context, root, path string, n int64, wantMapping bool) (Result, error) {
	if e.closed.Load() {
		return Result{}, ErrClosed
	}
	if n < 0 || n > math.MaxInt64/e.blockBytes-1 { // n*blockBytes must not overflow
		return Result{}, fmt.Errorf("%w: block %d of %s", ErrBadPath, n, path)
	}
	start := time.Now()
	res, err := e.readBlock(ctx, root, path, n, wantMapping)
	if err != nil {
		if !errors.Is(err, ErrTooLarge) && !errors.Is(err, ErrCacheFull) { // declined, not failed
			e.stats.errors.Add(1)
		}
		return Result{}, err
	}
	size := int64(len(res.Bytes()))
	if !wantMapping {
		// Sent. A caller on this node maps the block and counts the ranges it reads of it
		// (a client asking for a block to be cached reads none of it).
		e.stats.bytesServed.Add(size)
	}
	e.lat.observe(opRead, res.Origin, time.Since(start), size)
	return res, nil
}

func (e *Engine) readBlock(ctx context.Context, root, path string, n int64, wantMapping bool) (Result, error) {
	if err := e.checkRoot(root, path); err != nil {
		return Result{}, err
	}
	name := tiers.BlockName(path, e.blockBytes, n)
	if res, hit, err := e.checkedProbe(root, path, name, n, wantMapping); hit || err != nil {
		return res, err
	}
	f, leader := e.join(name)
	origin := OriginInflight
	switch {
	case leader && e.startFill():
		// Filled here: the caller waits for it anyway, and a block is a bounded read. The
		// fill counts the miss (a block past the end of the file is none).
		origin = OriginSource
		func() {
			defer e.fills.Done()
			// Not tied to the caller's context: other readers may share the flight, and
			// each fill ends (a block is a bounded read).
			e.blockSlots <- struct{}{}
			defer func() { <-e.blockSlots }()
			e.fillBlock(f, root, path, n)
		}()
	case leader:
		f.err = ErrClosed
		e.finish(name, f)
	default:
		e.stats.inflightHits.Add(1)
		f.noEvict.Store(false) // a reader wants it: it may evict like any miss (see prefetchBlock)
	}
	select {
	case <-f.done:
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
	if f.err != nil {
		return Result{}, f.err
	}
	if !f.inTier { // past the end of the file
		return Result{Origin: origin, MTimeNanos: f.mtime, CTimeNanos: f.ctime, Ino: f.ino}, nil
	}
	res, err := e.probe(name, wantMapping)
	if errors.Is(err, tiers.ErrNotCached) { // evicted at once by a burst of other fills
		return Result{}, fmt.Errorf("%w: block %d of %s was evicted before it could be served", ErrTooLarge, n, path)
	}
	res.Origin = origin // the times and inode are the copy's, as recorded (see probe)
	return res, err
}

// prefetchBlock brings block n of the file at path (inside root) into a tier for prefetch:
// a cached block is checked against its source in the current session (and filled anew if
// it changed), a block not cached is read from the source as by ReadBlock, but published
// only where there is room without eviction (unless a reader misses it meanwhile). It
// returns the bytes it read from the source: 0 for a block cached already, or being filled
// by another flight. A block no tier takes fails with ErrCacheFull or ErrTooLarge.
func (e *Engine) prefetchBlock(root, path string, n int64) (int64, error) {
	name := tiers.BlockName(path, e.blockBytes, n)
	if err := e.validateEntry(root, path, name, n); err != nil {
		return 0, err
	}
	if _, ok := e.cachedSize(name); ok {
		return 0, nil
	}
	// The fill slots before the flight: a reader that misses the block joins a flight that
	// is being filled, never one queued behind other prefetch fills.
	e.prefetchBlockSlots <- struct{}{}
	defer func() { <-e.prefetchBlockSlots }()
	e.blockSlots <- struct{}{}
	defer func() { <-e.blockSlots }()
	f, leader := e.join(name)
	if !leader {
		return 0, nil
	}
	f.noEvict.Store(true)
	if !e.startFill() {
		f.err = ErrClosed
		e.finish(name, f)
		return 0, ErrClosed
	}
	defer e.fills.Done()
	e.fillBlock(f, root, path, n)
	if f.err != nil || !f.inTier {
		return 0, f.err
	}
	return e.blockLen(f.size, n), nil
}

// fillBlock reads block n of the source into a tier for its flight (see fill, which does
// the same for whole files). The source is opened for the block alone: a block is read
// once, so a file is opened at most once per block it has.
func (e *Engine) fillBlock(f *flight, root, path string, n int64) {
	name := tiers.BlockName(path, e.blockBytes, n)
	defer e.finish(name, f)
	if slices.ContainsFunc(e.tiers, func(t *tiers.Tier) bool { return t.Listed(name) }) {
		// Published by a flight that ended between the caller's probe and its join.
		f.inTier = true
		return
	}
	// Room for the block, before the source is opened: a block the tiers have no room for
	// costs no open (a reader asks for every block it reads in sequence). Its length is a
	// whole block's unless the file's size is known from this session (the last block).
	session := e.sessions.current() // before the open: see fill
	length := e.blockBytes
	if id, ok := e.blockFiles.known(session, path); ok {
		length = e.blockLen(id.Size, n)
	}
	if !e.roomFor(root, tiers.EntrySize(name, length)) {
		f.err = fmt.Errorf("%w: block %d of %s", ErrCacheFull, n, path)
		e.stats.misses.Add(1)
		e.stats.uncached.Add(1)
		return
	}
	src, err := e.openSource(root, path)
	if err != nil {
		f.err = err
		return
	}
	defer src.Close()
	f.mtime, f.ctime, f.ino, f.size = src.MTimeNanos(), src.CTimeNanos(), src.Ino(), src.Size()
	if was, ok := e.blockFiles.note(session, path, src.Identity()); ok && was != src.Identity() {
		// The file changed during the session: its blocks of the version before go, so that
		// this block never joins them.
		for _, t := range e.tiers {
			t.ForgetBlocks(path)
		}
		e.stats.staleCopies.Add(1)
		e.log.Info("dropped the cached blocks of a file that changed", "path", path)
	}
	entry := tiers.Entry{SourcePath: name, Size: e.blockLen(src.Size(), n), MTimeNanos: f.mtime,
		SourceCTimeNanos: f.ctime, SourceIno: f.ino, Session: session, Group: root, Mode: src.Mode()}
	if entry.Size == 0 {
		return // past the end: no bytes, nothing cached
	}
	e.stats.misses.Add(1)
	f.inTier = true
	f.err = e.fillFromSource(src, entry, n*e.blockBytes)
	e.dropIfForgotten(f, name)
	// A fill of a newer version of the file may have noted it while this one copied (and
	// dropped the blocks it found, which this one was not yet among): this block copies the
	// version before, and goes. Either that fill's note comes first and this look sees it,
	// or its drop comes after this block was published and removes it.
	if id, ok := e.blockFiles.known(session, path); f.err == nil && ok && id != src.Identity() {
		for _, t := range e.tiers {
			t.Forget(name)
		}
		f.err = fmt.Errorf("%w: %s changed while its block %d was cached: read the source", ErrTooLarge, path, n)
	}
}

// HoldsBlock reports whether a tier of this engine holds block n of the file at path (its
// own, or a node-local copy of another server's: see StoreGuest).
func (e *Engine) HoldsBlock(path string, n int64) bool {
	_, ok := e.cachedSize(tiers.BlockName(path, e.blockBytes, n))
	return ok
}

// CountSent counts n bytes of a block sent in a ranged reply (see rpc's Handler.Read).
func (e *Engine) CountSent(n int64) { e.stats.bytesServed.Add(n) }

// forgetFlights marks the flights of path and of its blocks forgotten (see Engine.Forget);
// e.mu is held.
func (e *Engine) forgetFlights(path string) {
	if f := e.flights[path]; f != nil {
		f.forgotten.Store(true)
	}
	prefix := filepath.Clean(path) + "\x00" // tiers.BlockName
	for name, f := range e.flights {
		if strings.HasPrefix(name, prefix) {
			f.forgotten.Store(true)
		}
	}
}

// blockFiles remembers, for the current validation session, the identity of each file whose
// blocks were checked or filled: its blocks are checked against one look at the file per
// session (not one stat per block), and a fill that finds the file changed drops the blocks
// of the version before (see fillBlock), so that a reader never gets blocks of two versions
// from this server. It is safe for concurrent use.
type blockFiles struct {
	mu      sync.Mutex // protects session and files
	session uint32
	files   map[string]tiers.Identity
}

// blockFilesMax bounds the files remembered; past it, the memory starts over.
const blockFilesMax = 1 << 16

// identity returns the identity of the file at path in session, from look the first time.
func (b *blockFiles) identity(session uint32, path string, look func() (tiers.Identity, error)) (tiers.Identity, error) {
	b.mu.Lock()
	if b.session == session {
		if id, ok := b.files[path]; ok {
			b.mu.Unlock()
			return id, nil
		}
	}
	b.mu.Unlock()
	id, err := look()
	if err == nil {
		b.note(session, path, id)
	}
	return id, err
}

// known returns the identity recorded for the file at path in session, if any.
func (b *blockFiles) known(session uint32, path string) (tiers.Identity, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.session != session {
		return tiers.Identity{}, false
	}
	id, ok := b.files[path]
	return id, ok
}

// note records id as the identity of the file at path in session, and returns the one it
// replaces (ok false when there was none in this session).
func (b *blockFiles) note(session uint32, path string, id tiers.Identity) (was tiers.Identity, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.session != session || b.files == nil || len(b.files) >= blockFilesMax {
		b.session, b.files = session, make(map[string]tiers.Identity)
	}
	was, ok = b.files[path]
	b.files[path] = id
	return was, ok
}
