package core

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/fitcache/fitcache/tiers"
)

// EngineConfig configures an Engine.
type EngineConfig struct {
	// Tiers, fastest first. A tier that cannot be opened (missing, not writable, not private,
	// held by another server) is skipped with a warning in the engine's stats; an engine with
	// no tier serves every read from the source, unless RequireTier.
	Tiers []tiers.Config
	// RequireTier makes NewEngine fail with ErrNoTier, naming each tier and why it was
	// skipped, when it opens none: a cluster server owns part of the job's files, and one
	// without a tier would read its part from the source on every read.
	RequireTier bool
	// Verify checks every cached file's data checksum when the tiers are opened and removes
	// the damaged ones (tiers.Config.Verify).
	Verify bool
	// Holder describes this server (runtime directory, address) in its tiers' lock files, so
	// that a second server names it when it finds a tier taken.
	Holder string
	// Roots the engine serves files under. Empty means any root the caller names, for a
	// per-user server reachable only by its user. Each must exist: its symbolic links are
	// resolved once, at start, and a caller's root is served only if it resolves inside one.
	Roots []string
	// MaxSendBytes bounds the files served as bytes (to callers that cannot map tier files,
	// such as clients on other nodes): larger ones fail with ErrTooLarge and the caller reads
	// the source. It must stay below the RPC frame limit. 0 means 64 MiB.
	MaxSendBytes int64
	// BlockBytes is the size of the blocks that ranges of large files are cached in (see
	// ReadBlock); 0 means DefaultBlockBytes.
	BlockBytes int64
	// Warnings are problems found before the engine started (a default directory that could
	// not be used, say), reported with its statistics.
	Warnings []string
	// MoverQueueBytes bounds the bytes waiting for the data mover; past it, the reader that
	// missed publishes the file itself before answering. 0 means 256 MiB.
	MoverQueueBytes int64
	// Prefetch configures reading files ahead of readers from the lists they hand over (see
	// Engine.Prefetch); the zero value turns it off.
	Prefetch PrefetchConfig
	// NodeFetch, in a cluster server, brings a file into a tier of this node for its readers,
	// whichever server of the job owns it (see the server's rootReader.fetch, server/readers.go), and reports
	// whether it was there already: prefetch uses it for the lists of PrefetchRequest.ForNode.
	NodeFetch func(ctx context.Context, root, path string) (cached bool, err error)
	// BlockOwner, in a cluster server, reports whether this server owns block n of the file
	// at path on the ring (mine), and else, with ask, has its owner cache it (see
	// the cacheBlockAtOwner of package server, readers.go): prefetch of a large file no tier takes whole (see
	// fetchBlocks).
	BlockOwner func(ctx context.Context, root, path string, n int64, ask bool) (mine bool, err error)
	// Limits bound the tiers' budgets from outside their configuration (the job's memory
	// cgroup, the site's limits, free space), followed while the engine runs; the zero value
	// limits nothing.
	Limits Limits
	// MemoryAtExit says what Close does with the memory tiers' copies; "" keeps them.
	MemoryAtExit MemoryAtExit
}

// Engine serves reads from tiers and the source. It is safe for concurrent use.
type Engine struct {
	tiers []*tiers.Tier
	// testHookBeforeSourceOpen, set by tests, is called by a fill holding the file's claim
	// just before it opens the source.
	testHookBeforeSourceOpen func(path string)
	roots                    []string // EngineConfig.Roots with symbolic links resolved
	stats                    Stats
	lat                      latencies // request durations and bytes by kind and origin
	log                      *slog.Logger
	fullWarned               sync.Map // dataset roots whose tiers were full, root -> struct{} (see warnFull)
	mover                    *mover
	pf                       *prefetcher
	// sessions number the validation sessions: a copy is served only once found to match
	// its source in the current one (see session.go and validate).
	sessions   *sessions
	checkRoots rootDirs           // the dataset roots opened for the current session's checks
	checking   singleflight.Group // one check of a path at a time; its concurrent readers share it
	maxSend    int64              // see EngineConfig.MaxSendBytes
	blockBytes int64              // see EngineConfig.BlockBytes
	blockFiles blockFiles
	blockSlots chan struct{} // one per block being read from the source (see blockFillsMax)
	// prefetchBlockSlots: one per block prefetch reads (see prefetchBlockFillsMax).
	prefetchBlockSlots chan struct{}
	// nodeFetch is EngineConfig.NodeFetch, or nil.
	nodeFetch func(ctx context.Context, root, path string) (cached bool, err error)
	// blockOwner is EngineConfig.BlockOwner, or nil.
	blockOwner func(ctx context.Context, root, path string, n int64, ask bool) (mine bool, err error)
	closed     atomic.Bool
	fills      sync.WaitGroup // source reads in progress (see fill), awaited by Close
	limiter    *limiter       // follows EngineConfig.Limits; nil when there are none
	atExit     MemoryAtExit   // see EngineConfig.MemoryAtExit
	leftMemory atomic.Bool    // set once Close has done with the memory tiers as atExit says
	// fillRoots holds the dataset roots whose readers fill their misses (see noteFillRoot),
	// as map keys; fillRootsN counts them. Looked up lock-free on every recorded fill.
	fillRoots  sync.Map
	fillRootsN atomic.Int32

	mu        sync.Mutex // protects flights, realRoots and reports, and orders startFill before Close
	flights   map[string]*flight
	realRoots map[string]string // dataset root -> root with symbolic links resolved
	reports   map[string]int    // readers' fills reported and not recorded yet, by path (see NoteReport)
}

// flight is a file being read from the source or published. Readers that miss while it exists
// share its result, so the source is read once per file however many readers miss on it at
// once.
type flight struct {
	done      chan struct{} // closed when data, mtime and err are set
	data      []byte        // the bytes of a file a client stored (see Store)
	inTier    bool          // read from the source into a tier: readers are served from there
	size      int64         // the file's size, once the source is open
	fetchOnly bool          // started by Fetch: a file no tier takes is not read (the caller reads it)
	mtime     int64         // the source's modification time, Unix nanoseconds
	ctime     int64         // the source's change time, Unix nanoseconds
	ino       uint64        // the source's inode number
	err       error
	published chan struct{} // closed when the data mover has finished with the file
	noEvict   atomic.Bool   // fetched by prefetch alone: publish without eviction (see noEvict)
	forgotten atomic.Bool   // Forget was called for the file meanwhile: drop what this flight publishes
	// large is closed once fill has the source open and the file is one a reader should
	// not wait for (see ReadNowBytes); forReader, set by a reader that started the flight
	// (OpenForReader), receives a descriptor of that open source. declined, set before large
	// is closed, says that no tier takes the file whole (it is not being cached).
	large     chan struct{}
	forReader chan *os.File
	declined  bool
}

// NewEngine opens the configured tiers and starts the data mover. A nil logger discards.
func NewEngine(cfg EngineConfig, log *slog.Logger) (*Engine, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	e := &Engine{log: log, flights: make(map[string]*flight), realRoots: make(map[string]string),
		reports: make(map[string]int)}
	for _, w := range cfg.Warnings {
		e.stats.Warn(w)
	}
	e.maxSend, e.nodeFetch, e.blockOwner, e.blockBytes = cfg.MaxSendBytes, cfg.NodeFetch, cfg.BlockOwner, cfg.BlockBytes
	if e.maxSend <= 0 {
		e.maxSend = 64 << 20
	}
	if e.blockBytes <= 0 {
		e.blockBytes = DefaultBlockBytes
	}
	e.blockSlots = make(chan struct{}, blockFillsMax)
	e.prefetchBlockSlots = make(chan struct{}, prefetchBlockFillsMax)
	for _, r := range cfg.Roots {
		abs, err := filepath.Abs(r)
		if err == nil {
			abs, err = filepath.EvalSymlinks(abs)
		}
		if err != nil {
			return nil, fmt.Errorf("dataset root %q: %w", r, err)
		}
		e.roots = append(e.roots, abs)
	}
	var skipped []error
	for _, tc := range cfg.Tiers {
		tc.Verify, tc.Holder = cfg.Verify, cfg.Holder
		t, err := tiers.New(tc, log)
		if err != nil {
			skipped = append(skipped, fmt.Errorf("%s %w", tc.Kind, err)) // "memory tier DIR: why"
			log.Warn("skipping tier", "kind", tc.Kind.String(), "dir", tc.Dir, "err", err)
			e.stats.Warn(fmt.Sprintf("%s tier skipped: %v", tc.Kind, err))
			continue
		}
		if w := t.Warning(); w != "" {
			e.stats.Warn(w)
		}
		if n := len(t.Damaged()); n > 0 {
			e.stats.Warn(fmt.Sprintf("%s tier %s: removed %d damaged or foreign entries (see the log)", tc.Kind, t.Path, n))
		}
		e.tiers = append(e.tiers, t)
	}
	if len(e.tiers) == 0 && cfg.RequireTier {
		if len(skipped) == 0 {
			return nil, fmt.Errorf("%w: none configured", ErrNoTier)
		}
		return nil, fmt.Errorf("%w: %w", ErrNoTier, errors.Join(skipped...))
	}
	if len(e.tiers) == 0 {
		log.Warn("no usable tier: every read goes to the source")
	}
	var last uint32
	for _, t := range e.tiers {
		last = max(last, t.LastSession())
		if n := t.DropBlocksNotOf(e.blockBytes); n > 0 {
			log.Info("removed cached blocks of another block size", "tier", t.Path, "blocks", n)
		}
	}
	e.sessions = newSessions(nil, last)
	e.noteSession(e.sessions.current())
	queue := cfg.MoverQueueBytes
	if queue <= 0 {
		queue = 256 << 20
	}
	e.mover = startMover(e, queue)
	e.pf = newPrefetcher(e, cfg.Prefetch)
	e.atExit = cfg.MemoryAtExit
	e.limiter = startLimiter(e, cfg.Limits)
	return e, nil
}

// Close stops prefetch and the data mover after they have published what they hold, leaves
// the memory tiers as EngineConfig.MemoryAtExit says, then closes the tiers, releasing their
// locks for another server. Reads after Close fail with ErrClosed.
func (e *Engine) Close() error {
	e.pf.stop() // its workers finish the files they hold, through the mover
	e.mu.Lock()
	e.closed.Store(true) // no fill starts after this (see startFill)
	e.mu.Unlock()
	e.fills.Wait()
	e.mover.stop()
	e.limiter.close()
	var errs []error
	if err := e.leaveMemory(); err != nil {
		errs = append(errs, err)
	}
	for _, t := range e.tiers {
		if err := t.Close(); err != nil {
			errs = append(errs, fmt.Errorf("%s tier %s: %w", t.Kind, t.Path, err))
		}
	}
	e.checkRoots.close()
	return errors.Join(errs...)
}

// Stats returns the engine's counters and the state of its tiers.
func (e *Engine) Stats() StatsSnapshot {
	s := e.stats.Snapshot()
	s.Prefetch = e.pf.snapshot()
	for _, t := range e.tiers {
		s.Tiers = append(s.Tiers, t.Info())
		// Hits that readers on this node served from the tier without asking (the C hit
		// path of libfitcache counts them in the tier's index).
		n, bytes := t.Hits()
		s.Hits[t.Kind.String()] += n
		s.ClientHits += n
		s.BytesServed += bytes
		n, bytes = t.SourceReads()
		s.ReaderSourceRanges += n
		s.ReaderSourceBytes += bytes
	}
	return s
}

// AddClientHits records hits clients served from this engine's tier files themselves.
func (e *Engine) AddClientHits(byKind map[string]int64, bytes int64) {
	e.stats.AddClientHits(byKind, bytes)
}

// CountRefusal records a connection refused: no handshake, a wrong proof of the job token,
// or too many connections.
func (e *Engine) CountRefusal() { e.stats.refusals.Add(1) }

// TierDirs returns the read side of the engine's tiers, fastest first.
func (e *Engine) TierDirs() []tiers.Dir {
	dirs := make([]tiers.Dir, len(e.tiers))
	for i, t := range e.tiers {
		dirs[i] = t.Dir
	}
	return dirs
}

// Result is the answer to a read: a mapping of a cached file, or the bytes themselves.
type Result struct {
	Mapping *tiers.Mapping // set when the file was served from (or just published to) a tier
	Data    []byte         // set otherwise
	Origin  Origin         // where the bytes came from: a tier, inflight or the source
	// MTimeNanos is the source file's modification time, for a replica's copy.
	MTimeNanos int64
	// CTimeNanos and Ino are the source file's change time and inode number when this read
	// (or the one it joined) opened the source, or when the tier's copy was made.
	CTimeNanos int64
	Ino        uint64
	// File is the cached file Mapping maps, open, for a caller that sends its bytes
	// elsewhere (see ReadToSend); nil otherwise. Release closes it.
	File *os.File
}

// Bytes returns the file's bytes.
func (r Result) Bytes() []byte {
	if r.Mapping != nil {
		return r.Mapping.Bytes()
	}
	return r.Data
}

// Size returns the file's size, without mapping a Mapping not made yet (see ReadToSend).
func (r Result) Size() int64 {
	if r.Mapping != nil {
		return r.Mapping.Size
	}
	return int64(len(r.Data))
}

// Release releases the mapping and closes the file, if any.
func (r Result) Release() {
	if r.Mapping != nil {
		r.Mapping.Release()
	}
	if r.File != nil {
		r.File.Close()
	}
}

// Read returns the file at path, which must be inside root. With wantMapping (a client on
// this node, which maps tier files itself), a cached file comes back as a mapping of its tier
// file; without, a file is only served if it is at most EngineConfig.MaxSendBytes long.
//
// No file is ever held whole in memory: on a miss it is copied from the source into a tier
// and served from there (a client on this node reads the published file itself). A file
// that no tier can take fails with ErrTooLarge, and the caller reads the source itself.
func (e *Engine) Read(ctx context.Context, root, path string, wantMapping bool) (Result, error) {
	if e.closed.Load() {
		return Result{}, ErrClosed
	}
	start := time.Now()
	res, err := e.read(ctx, root, path, wantMapping)
	if err != nil {
		if !errors.Is(err, ErrTooLarge) { // declined, not failed: counted as uncached where decided
			e.stats.errors.Add(1)
		}
		return Result{}, err
	}
	n := int64(len(res.Bytes()))
	e.stats.bytesServed.Add(n)
	e.lat.observe(opRead, res.Origin, time.Since(start), n)
	return res, nil
}

// ReadToSend is Read for a caller that sends the file's bytes elsewhere (a server answering
// a reader on another node) and cannot map tier files: a file served from a tier also comes
// with its cached file open (Result.File), to be sent from the file (sendfile) rather than
// through this process's memory. A hit's Mapping is made only when its bytes are asked for
// (tiers.Mapping.Map), which a caller does before it closes the file; it is released with
// the file (Release).
func (e *Engine) ReadToSend(ctx context.Context, root, path string) (Result, error) {
	if res, ok := e.probeToSend(root, path); ok {
		return res, nil
	}
	res, err := e.Read(ctx, root, path, false)
	if err != nil || res.Mapping == nil {
		return res, err
	}
	for _, t := range e.tiers {
		if !strings.HasPrefix(res.Mapping.Path, t.Path+string(filepath.Separator)) {
			continue
		}
		// The file at the mapping's place now, which is the one mapped if the place still
		// holds it: a place never holds a file again once another replaced it (a copy is
		// published under a new inode, and the mapping keeps its own inode in use).
		if f, err := t.OpenFile(path); err == nil {
			if res.Mapping.Unchanged() {
				res.File = f
			} else {
				f.Close()
			}
		}
		break
	}
	return res, nil
}

// probeToSend is ReadToSend's hit: the copy in the fastest tier that has one, mapped and open
// from a single open of it (tiers.Tier.OpenToSend). It reports false, having counted
// nothing, when the file is to be read as Read reads it: not cached, or an error to report.
func (e *Engine) probeToSend(root, path string) (Result, bool) {
	if e.closed.Load() || e.checkRoot(root, path) != nil || e.validate(root, path) != nil {
		return Result{}, false
	}
	start := time.Now()
	for _, t := range e.tiers { // fastest first; a lookup that misses costs no system call
		m, f, err := t.OpenToSend(path)
		if err != nil {
			continue
		}
		if m.Size > e.maxSend {
			m.Release()
			f.Close()
			return Result{}, false
		}
		res := Result{Mapping: m, File: f, Origin: TierOrigin(m.Tier), MTimeNanos: m.MTimeNanos,
			CTimeNanos: m.SourceCTimeNanos, Ino: m.SourceIno}
		e.stats.hits[m.Tier].Add(1)
		e.stats.bytesServed.Add(m.Size)
		e.lat.observe(opRead, res.Origin, time.Since(start), m.Size)
		return res, true
	}
	return Result{}, false
}

func (e *Engine) read(ctx context.Context, root, path string, wantMapping bool) (Result, error) {
	if err := e.checkRoot(root, path); err != nil {
		return Result{}, err
	}
	if res, hit, err := e.checkedProbe(root, path, path, -1, wantMapping); hit || err != nil {
		return res, err
	}

	f, leader := e.joinAsReader(path)
	if leader {
		e.stats.misses.Add(1)
		if e.startFill() {
			go func() { // not tied to this request: waiters share it
				defer e.fills.Done()
				e.demandFill(f, root, path)
			}()
		} else {
			f.err = ErrClosed
			e.finish(path, f)
		}
	} else {
		e.stats.inflightHits.Add(1)
		f.noEvict.Store(false) // a reader wants it: it may evict like any miss
	}
	select {
	case <-f.done:
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
	if f.err != nil {
		return Result{}, f.err
	}
	origin := OriginInflight
	if leader {
		origin = OriginSource
	}
	if !f.inTier {
		return Result{Data: f.data, Origin: origin, MTimeNanos: f.mtime, CTimeNanos: f.ctime, Ino: f.ino}, nil
	}
	// A session that began while the flight read the source wants the copy checked after it
	// began: a no-op unless one did (then the copy's mark is older), and a stale copy is
	// dropped here, which the probe below takes for an eviction (the caller reads the source).
	if err := e.validate(root, path); err != nil {
		return Result{}, err
	}
	res, err := e.probe(path, wantMapping)
	if errors.Is(err, tiers.ErrNotCached) { // evicted at once by a burst of larger files
		return Result{}, fmt.Errorf("%w: %s was evicted before it could be served", ErrTooLarge, path)
	}
	res.Origin, res.CTimeNanos, res.Ino = origin, f.ctime, f.ino
	return res, err
}

// Fetch brings the file at path (inside root) into a tier, reading the source once as a miss
// of Read does, for callers on this node that then read it from the tier themselves (see
// package nodesock). It maps nothing, and a miss is filled in the calling goroutine (no hand
// over to another one: on a busy node each costs a scheduling delay). It returns an error
// wrapping ErrTooLarge, without reading the file, when no tier takes it: the caller reads
// the source.
func (e *Engine) Fetch(ctx context.Context, root, path string) error {
	_, err := e.countedFetch(ctx, root, path, false)
	return err
}

// countedFetch is fetch with its time observed and its failure counted: a file declined
// (ErrTooLarge) or read now is no failure, and a source handed over is not timed (its copy
// is not done).
func (e *Engine) countedFetch(ctx context.Context, root, path string, forReader bool) (now *readNow, err error) {
	if e.closed.Load() {
		return nil, ErrClosed
	}
	start := time.Now()
	origin, now, err := e.fetch(ctx, root, path, forReader)
	switch {
	case now != nil:
	case err == nil:
		e.lat.observe(opFetch, origin, time.Since(start), 0)
	case !errors.Is(err, ErrTooLarge):
		e.stats.errors.Add(1)
	}
	return now, err
}

// readNow is fetch's answer to a reader of a large file, or of one no tier takes, that it
// does not keep waiting (OpenForReader, see ReadNowBytes). file is the source the flight
// opened, handed to the reader that started the flight (nil for one that joined it: it
// opens the source itself). origin says whether the file is being cached whole
// (OriginSourceWhileCached) or not at all (OriginSource).
type readNow struct {
	file   *os.File
	origin Origin
}

// nowOf is the readNow of a flight whose source fill has handed over (large is closed).
func nowOf(f *flight, file *os.File) *readNow {
	if f.declined {
		return &readNow{file: file, origin: OriginSource}
	}
	return &readNow{file: file, origin: OriginSourceWhileCached}
}

// fetch is Fetch; it also returns where the file came from (a tier, inflight or the
// source). With forReader (OpenForReader), a large file is not waited for (see
// ReadNowBytes): the caller that starts its flight gets a descriptor of the source the
// flight opened, one that joins it a readNow without one, and the copy goes on.
func (e *Engine) fetch(ctx context.Context, root, path string, forReader bool) (origin Origin, now *readNow, err error) {
	if err := e.checkRoot(root, path); err != nil {
		return OriginNone, nil, err
	}
	if err := e.validate(root, path); err != nil {
		return OriginNone, nil, err
	}
	for _, t := range e.tiers {
		if t.Listed(path) {
			e.stats.hits[t.Kind].Add(1)
			return TierOrigin(t.Kind), nil, nil
		}
	}
	f, leader := e.joinAsReader(path)
	origin = OriginInflight
	switch {
	case leader && e.startFill():
		origin = OriginSource
		e.stats.misses.Add(1)
		f.fetchOnly = true
		if !forReader {
			func() {
				defer e.fills.Done() // also if fill panics: Close waits for fills
				e.demandFill(f, root, path)
			}()
			break
		}
		f.forReader = make(chan *os.File, 1)
		go func() {
			defer e.fills.Done()
			e.demandFill(f, root, path)
		}()
		select {
		case file := <-f.forReader:
			return origin, nowOf(f, file), nil
		case <-f.done:
			if file := handedOver(f); file != nil { // handed over, then done at once
				return origin, nowOf(f, file), nil
			}
		case <-ctx.Done():
			go func() { // a descriptor handed over later must not leak
				<-f.done
				if file := handedOver(f); file != nil {
					file.Close()
				}
			}()
			return OriginNone, nil, ctx.Err()
		}
	case leader:
		f.err = ErrClosed
		e.finish(path, f)
	default:
		e.stats.inflightHits.Add(1)
		f.noEvict.Store(false) // a reader wants it: it may evict like any miss
		large := f.large
		if !forReader {
			large = nil // never ready
		}
		select {
		case <-f.done:
		case <-large:
			return OriginNone, nowOf(f, nil), nil
		case <-ctx.Done():
			return OriginNone, nil, ctx.Err()
		}
	}
	if f.err != nil {
		return OriginNone, nil, f.err
	}
	if !f.inTier { // read into memory by a Read that no tier took, joined here
		return OriginNone, nil, fmt.Errorf("%w: no tier takes %s", ErrTooLarge, path)
	}
	// As in read: a session that began meanwhile has the copy checked (a no-op otherwise).
	if err := e.validate(root, path); err != nil {
		return OriginNone, nil, err
	}
	if _, ok := e.cachedSize(path); !ok {
		return OriginNone, nil, fmt.Errorf("%w: %s changed while it was cached: read the source", ErrTooLarge, path)
	}
	return origin, nil, nil
}

// ReadNowBytes: a reader that opens a file at least this long (OpenForReader) is not kept
// waiting for its copy: it gets the source at once, and the copy is made meanwhile. An
// h5py program reading 9% of a 2 GB file spent 1.7-3.8 s in open waiting for the whole
// copy; copying 8 MiB into a memory tier takes about 3 ms here. Smaller files are copied
// first, and read from their copy: the reader does not read the source as well.
const ReadNowBytes = 8 << 20

// handedOver returns the descriptor handOver left for the reader of a flight that is done,
// if it did and nobody took it: handOver sends before the flight is done.
func handedOver(f *flight) *os.File {
	select {
	case file := <-f.forReader:
		return file
	default:
		return nil
	}
}

// handOver passes a descriptor of the source a fill has open to the reader that started the
// flight (OpenForReader), if one did, and lets the readers that joined it read the source
// too: the file is large, or no tier takes it. The reader's descriptor shares the fill's
// open file (no second open of the source); the fill reads at explicit offsets, so the
// reader's own offset is its own.
func (e *Engine) handOver(f *flight, src *Source) {
	if f.forReader != nil {
		if file, err := src.ReaderDup(); err == nil {
			f.forReader <- file // buffered: the only send
		}
	}
	close(f.large)
}

// Latencies returns the histograms of the durations of the requests the engine served
// (Read and Fetch; failed ones are not timed), and the bytes they served, by origin. Every
// kind of request and origin is listed, those without requests too.
func (e *Engine) Latencies() []Latency { return e.lat.snapshot() }

// probe looks path up in the tiers. A cached file too large to send to a caller that cannot
// map it is ErrTooLarge; a damaged entry is logged (and removed by the tier) and is a miss.
func (e *Engine) probe(path string, wantMapping bool) (Result, error) {
	m, err := tiers.Probe(e.tiers, path)
	if err != nil {
		if !errors.Is(err, tiers.ErrNotCached) || errors.Is(err, tiers.ErrDamaged) {
			e.log.Warn("probe", "path", path, "err", err)
		}
		return Result{}, tiers.ErrNotCached
	}
	if !wantMapping && m.Size > e.maxSend {
		m.Release()
		return Result{}, fmt.Errorf("%w: %s has %d bytes, more than the %d a reply carries", ErrTooLarge, path, m.Size, e.maxSend)
	}
	return Result{Mapping: m, Origin: TierOrigin(m.Tier), MTimeNanos: m.MTimeNanos, CTimeNanos: m.SourceCTimeNanos,
		Ino: m.SourceIno}, nil
}

// checkedProbe validates the entry name (the file at path, or its block: see validateEntry)
// and looks it up in the tiers: hit reports a copy served (counted as a hit), err a failure;
// neither is a miss.
func (e *Engine) checkedProbe(root, path, name string, block int64, wantMapping bool) (res Result, hit bool, err error) {
	if err := e.validateEntry(root, path, name, block); err != nil {
		return Result{}, false, err
	}
	res, err = e.probe(name, wantMapping)
	switch {
	case err == nil:
		e.stats.hits[res.Mapping.Tier].Add(1)
		return res, true, nil
	case errors.Is(err, tiers.ErrNotCached):
		return Result{}, false, nil
	}
	return Result{}, false, err
}

// startFill counts a source read about to start, unless the engine is closing.
func (e *Engine) startFill() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return false
	}
	e.fills.Add(1)
	return true
}

// joinAsReader is join for a reader, who wants the file whoever fetches it: a flight of
// prefetch alone that it joins may now evict (noEvict), and is no longer one that prefetch
// may give up (see giveUpIfPrefetchOnly); both under e.mu, so that no reader joins a flight
// as it is given up.
func (e *Engine) joinAsReader(path string) (f *flight, leader bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if f, ok := e.flights[path]; ok {
		f.noEvict.Store(false)
		return f, false
	}
	f = &flight{done: make(chan struct{}), published: make(chan struct{}), large: make(chan struct{})}
	e.flights[path] = f
	return f, true
}

// giveUpIfPrefetchOnly ends the flight f of path, without a source read, if prefetch alone
// wants it (no reader joined it), and reports whether it did: prefetch need not wait for a
// reader that fills the file itself. The flight leaves the table before any reader can join it.
func (e *Engine) giveUpIfPrefetchOnly(path string, f *flight) bool {
	e.mu.Lock()
	if !f.noEvict.Load() || e.flights[path] != f {
		e.mu.Unlock()
		return false
	}
	delete(e.flights, path)
	e.mu.Unlock()
	f.err = errClaimedByReader
	close(f.published)
	close(f.done)
	return true
}

// join returns the flight for path, creating it if there is none; leader is true for the
// caller that created it and must fill it.
func (e *Engine) join(path string) (f *flight, leader bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if f, ok := e.flights[path]; ok {
		return f, false
	}
	f = &flight{done: make(chan struct{}), published: make(chan struct{}), large: make(chan struct{})}
	e.flights[path] = f
	return f, true
}

// fill reads the source for a flight: it copies the file into the fastest tier that takes it
// (through a pooled buffer: the file is never held whole in memory and a miss allocates
// nothing), and readers are answered from there once it is published.
//
// Earlier versions answered small misses with the bytes at once and published them in the
// background; at 30,000 files that cost more than it saved (a buffer per miss for the garbage
// collector, the bytes encoded into and decoded from a reply), so every miss now waits for
// its publication and the client reads the published file, one copy from the page cache.
func (e *Engine) fill(f *flight, root, path string) {
	full := e.fullFor(root)
	if full {
		e.warnFull(root)
	}
	// Nobody waits for the bytes in memory when a client reads the source itself (fetchOnly)
	// or prefetch alone wants the file (noEvict): a file no tier takes is then not read.
	bytesWanted := !f.fetchOnly && !f.noEvict.Load()
	if full && !bytesWanted { // not even opened here
		f.err = fmt.Errorf("%w: %s", ErrCacheFull, path)
		e.stats.uncached.Add(1)
		e.finish(path, f)
		return
	}
	// One reader of the source per file: a reader of this node may be reading it (see
	// claimSource); the claim is given up once the copy is published, or failed.
	claim, err := e.claimSource(path, f)
	if errors.Is(err, errClaimedByReader) {
		return // given up: prefetch alone wanted it (see giveUpIfPrefetchOnly)
	}
	if errors.Is(err, errFilledByReader) {
		f.inTier = true
		e.finish(path, f)
		return
	}
	defer claim.Release()
	// The session is taken before the source is opened: the copy matches the source as it
	// was then, which is all a session asks.
	session := e.sessions.current()
	if e.testHookBeforeSourceOpen != nil {
		e.testHookBeforeSourceOpen(path)
	}
	src, err := e.openSource(root, path)
	if err != nil {
		f.err = err
		e.finish(path, f)
		return
	}
	defer src.Close()
	f.mtime, f.ctime, f.ino = src.MTimeNanos(), src.CTimeNanos(), src.Ino()
	entry := tiers.Entry{SourcePath: path, Size: src.Size(), MTimeNanos: f.mtime, SourceCTimeNanos: f.ctime,
		SourceIno: f.ino, Session: session, Group: root, Mode: src.Mode()}
	f.size = entry.Size
	// A file some tier could hold but none has room for, without evicting files of its own
	// dataset (which a dataset never does), is not cached either: as if the tiers were full.
	if !full && e.canCache(entry) && !e.roomFor(root, tiers.EntrySize(path, entry.Size)) {
		full = true
		e.warnFull(root)
	}
	if entry.Size >= ReadNowBytes || !e.canCache(entry) {
		f.declined = full || !e.canCache(entry) // the reader reads it by blocks
		e.handOver(f, src)
	}
	if !e.canCache(entry) && (entry.Size > uncachedReadMax || !bytesWanted) {
		f.err = fmt.Errorf("%w: %s (%d bytes) fits in no tier", ErrTooLarge, path, entry.Size)
		e.stats.uncached.Add(1)
		e.finish(path, f)
		return
	}
	if full && (entry.Size > uncachedReadMax || !bytesWanted) {
		f.err = fmt.Errorf("%w: %s", ErrCacheFull, path)
		e.stats.uncached.Add(1)
		e.finish(path, f)
		return
	}
	if full || !e.canCache(entry) {
		// No tier takes it (an engine without tiers, or tiers full of the dataset being
		// read): served from memory, uncached.
		if f.data, f.err = src.ReadAll(); f.err == nil {
			e.stats.uncached.Add(1)
			e.stats.sourceReads.Add(1)
			e.stats.sourceBytes.Add(entry.Size)
		}
		e.finish(path, f)
		return
	}
	f.inTier = true
	f.err = e.fillWhole(claim, src, entry)
	e.dropIfForgotten(f, path)
	if errors.Is(f.err, ErrCacheFull) && bytesWanted && entry.Size <= uncachedReadMax {
		// Less room than this file needs, and nothing to evict: served from memory.
		f.inTier = false
		if f.data, f.err = src.ReadAll(); f.err == nil {
			e.stats.sourceReads.Add(1)
			e.stats.sourceBytes.Add(entry.Size)
		}
	}
	e.finish(path, f)
}

// warnFull tells the user, once per dataset root, that the tiers are full of root's files:
// those that do not fit are read from the source at every read, epoch after epoch. That is
// by design (a dataset never evicts its own files), but a user sizing the cache must hear
// of it: in cluster mode the busiest server holds more than an even share (fitcache size
// --servers says how much).
func (e *Engine) warnFull(root string) {
	if _, warned := e.fullWarned.LoadOrStore(root, struct{}{}); warned {
		return
	}
	msg := fmt.Sprintf("the tiers are full of the dataset %s: its files that do not fit are read from the source "+
		"at every read; give the tiers more room (in cluster mode each server its share of the dataset, which "+
		"`fitcache size --servers` tells)", root)
	e.log.Warn(msg)
	e.stats.Warn(msg)
}

// uncachedReadMax is the largest file an engine reads into memory when no tier can take
// it; a larger one fails with ErrTooLarge and the caller reads the source itself.
const uncachedReadMax = 1 << 20

// fullFor reports whether every tier is full of files of group (the dataset being read),
// so that none takes another file of it (see tiers.Tier.FullFor). An engine without tiers
// is not full: it never caches.
func (e *Engine) fullFor(group string) bool {
	return len(e.tiers) > 0 && !slices.ContainsFunc(e.tiers, func(t *tiers.Tier) bool { return !t.FullFor(group) })
}

// roomFor reports whether some tier could take n bytes of a file of group, evicting files of
// other groups if need be (see tiers.Tier.RoomFor).
func (e *Engine) roomFor(group string, n int64) bool {
	return slices.ContainsFunc(e.tiers, func(t *tiers.Tier) bool { return t.RoomFor(group, n) })
}

// canCache reports whether some tier can hold the entry at all.
func (e *Engine) canCache(entry tiers.Entry) bool {
	need := tiers.EntrySize(entry.SourcePath, entry.Size)
	return slices.ContainsFunc(e.tiers, func(t *tiers.Tier) bool { return t.CanHold(need) })
}

// finish ends a flight that the data mover does not take: it leaves the table first, so
// that a reader that comes after the answer never joins it.
func (e *Engine) finish(path string, f *flight) {
	e.land(path, f)
	close(f.done)
}

// fillFromSource copies the entry.Size bytes of a source file at off (the whole file, or
// one of its blocks) into the fastest tier that takes them. It returns ErrTooLarge when no
// tier takes them, so that the caller reads the source itself.
func (e *Engine) fillFromSource(src *Source, entry tiers.Entry, off int64) error {
	return e.placed(src, entry, e.place(0, entry, content{src: src, off: off}))
}

// placed ends a fill of entry from src whose copy's placement returned err: it counts it, and
// returns the error the flight's readers get (nil once published; ErrTooLarge or
// ErrCacheFull when no tier took it, so that the caller reads the source itself; the
// source's change when it changed).
func (e *Engine) placed(src *Source, entry tiers.Entry, err error) error {
	if err != nil {
		if cerr := src.Unchanged(); cerr != nil {
			return cerr // whatever the tier made of the error it was given
		}
	}
	switch {
	case err == nil:
		e.stats.published.Add(1)
	case errors.Is(err, tiers.ErrNoRoom) && e.canCache(entry):
		e.warnFull(entry.Group)
		e.stats.uncached.Add(1)
		return fmt.Errorf("%w: %s (%d bytes)", ErrCacheFull, entry.SourcePath, entry.Size)
	case errors.Is(err, tiers.ErrNoRoom):
		e.stats.uncached.Add(1)
		return fmt.Errorf("%w: %s (%d bytes) fits in no tier", ErrTooLarge, entry.SourcePath, entry.Size)
	default:
		e.stats.publishErrors.Add(1)
		e.log.Warn("publish", "path", entry.SourcePath, "err", err)
		return fmt.Errorf("%w: %s could not be cached: %v", ErrTooLarge, entry.SourcePath, err)
	}
	e.stats.sourceReads.Add(1)
	e.stats.sourceBytes.Add(entry.Size)
	return nil
}

func (e *Engine) openSource(root, path string) (*Source, error) {
	realRoot, err := e.realRoot(root)
	if err != nil {
		return nil, err
	}
	return OpenSource(root, realRoot, path)
}

// land ends a flight: later readers go to the tiers (or, after an error, try the source again).
func (e *Engine) land(path string, f *flight) {
	e.mu.Lock()
	delete(e.flights, path)
	e.mu.Unlock()
	close(f.published)
}

// checkRoot validates a request: root and path clean and absolute, path inside root, and,
// for an engine with dataset roots, root inside one of them once its symbolic links are
// resolved (a link inside a dataset root that points elsewhere is no way out). The file's
// own path is resolved beneath the resolved root when it is opened (OpenSource).
func (e *Engine) checkRoot(root, path string) error {
	if err := CheckPath(root, path); err != nil {
		return err
	}
	if len(e.roots) == 0 {
		return nil
	}
	_, err := e.realRoot(root)
	return err
}

// maxRealRoots bounds the resolved roots remembered; past it, the cache starts over.
const maxRealRoots = 1024

// realRoot returns root with its symbolic links resolved, which for an engine with dataset
// roots must lie inside one of them (ErrOutsideRoot otherwise). Only roots that passed are
// remembered. A remembered root stays safe if the directory is later replaced by a link:
// files are checked against the remembered real path, which is inside a dataset root.
func (e *Engine) realRoot(root string) (string, error) {
	e.mu.Lock()
	real, ok := e.realRoots[root]
	e.mu.Unlock()
	if ok {
		return real, nil
	}
	real, err := filepath.EvalSymlinks(root)
	if err != nil {
		return "", err
	}
	if len(e.roots) > 0 && !slices.ContainsFunc(e.roots, func(r string) bool { return Within(real, r) }) {
		return "", fmt.Errorf("%w: %s (resolved to %s) is not under a dataset root of this server", ErrOutsideRoot, root, real)
	}
	e.mu.Lock()
	if len(e.realRoots) >= maxRealRoots {
		clear(e.realRoots)
	}
	e.realRoots[root] = real
	e.mu.Unlock()
	return real, nil
}
