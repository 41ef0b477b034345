package core

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"

	"github.com/fitcache/fitcache/tiers"
)

// EngineConfig configures an Engine.
type EngineConfig struct {
	// Tiers, fastest first. A tier that cannot be opened (missing, not writable) is skipped
	// with a log line; an engine with no tier serves every read from the source.
	Tiers []tiers.Config
	// Roots the engine serves files under. Empty means any root the caller names, for a
	// per-user server reachable only by its user. Each must exist: its symbolic links are
	// resolved once, at start, and a caller's root is served only if it resolves inside one.
	Roots []string
	// GenerationFile, if set, is where the engine keeps the counter of removed cached files
	// that local clients watch to drop mappings they keep (see tiers.Generation).
	GenerationFile string
	// InlineMissBytes: a local caller that misses a file of at most this size gets the bytes
	// at once instead of waiting for the data mover to publish the file for it to map.
	// Publishing writes the file into a tier, which costs about as much as the copies of
	// sending it (page allocation in tmpfs), so for small files waiting only adds latency;
	// for large ones the copies cost more. 0 means 1 MiB; negative means never.
	InlineMissBytes int64
	// MoverQueueBytes bounds the bytes waiting for the data mover; past it, the reader that
	// missed publishes the file itself before answering. 0 means 256 MiB.
	MoverQueueBytes int64
}

// Engine serves reads from tiers and the source. It is safe for concurrent use.
type Engine struct {
	tiers   []*tiers.Tier
	roots   []string // EngineConfig.Roots with symbolic links resolved
	stats   Stats
	log     *slog.Logger
	mover   *mover
	gen     *tiers.Generation // nil without EngineConfig.GenerationFile
	genFile string
	inline  int64 // see EngineConfig.InlineMissBytes

	mu        sync.Mutex // protects flights and realRoots
	flights   map[string]*flight
	realRoots map[string]string // dataset root -> root with symbolic links resolved
}

// flight is a file being read from the source or published. Readers that miss while it exists
// share its result, so the source is read once (invariant 3).
type flight struct {
	done      chan struct{} // closed when data, mtime and err are set
	data      []byte
	mtime     int64 // the source's modification time, Unix nanoseconds
	err       error
	published chan struct{} // closed when the data mover has finished with the file
}

// NewEngine opens the configured tiers and starts the data mover. A nil logger discards.
func NewEngine(cfg EngineConfig, log *slog.Logger) (*Engine, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	e := &Engine{log: log, flights: make(map[string]*flight), realRoots: make(map[string]string),
		inline: cfg.InlineMissBytes}
	if e.inline == 0 {
		e.inline = 1 << 20
	}
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
	if cfg.GenerationFile != "" {
		gen, err := tiers.CreateGeneration(cfg.GenerationFile)
		if err != nil {
			return nil, fmt.Errorf("generation file: %w", err)
		}
		e.gen, e.genFile = gen, cfg.GenerationFile
	}
	for _, tc := range cfg.Tiers {
		tc.OnRemove = e.gen.Bump
		t, err := tiers.New(tc, log)
		if err != nil {
			log.Warn("skipping tier", "kind", tc.Kind.String(), "dir", tc.Dir, "err", err)
			continue
		}
		e.tiers = append(e.tiers, t)
	}
	if len(e.tiers) == 0 {
		log.Warn("no usable tier: every read goes to the source")
	}
	queue := cfg.MoverQueueBytes
	if queue <= 0 {
		queue = 256 << 20
	}
	e.mover = startMover(e, queue)
	return e, nil
}

// Close stops the data mover after it has published what it holds.
func (e *Engine) Close() error {
	e.mover.stop()
	return e.gen.Close()
}

// GenerationFile returns the path of the removal counter clients watch, or "".
func (e *Engine) GenerationFile() string { return e.genFile }

// Stats returns the engine's counters and the state of its tiers.
func (e *Engine) Stats() StatsSnapshot {
	s := e.stats.Snapshot()
	for _, t := range e.tiers {
		s.Tiers = append(s.Tiers, t.Info())
	}
	return s
}

// AddClientHits records hits clients served from this engine's tier files themselves.
func (e *Engine) AddClientHits(byKind map[string]int64, bytes int64) {
	e.stats.AddClientHits(byKind, bytes)
}

// CountRefusal records a request refused for a wrong or missing job token.
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
	Origin  string         // a tier kind, "inflight" or "source"
	// MTimeNanos is the source file's modification time, for a replica's copy.
	MTimeNanos int64
}

// Bytes returns the file's bytes.
func (r Result) Bytes() []byte {
	if r.Mapping != nil {
		return r.Mapping.Bytes()
	}
	return r.Data
}

// Release releases the mapping, if any.
func (r Result) Release() {
	if r.Mapping != nil {
		r.Mapping.Release()
	}
}

// Read returns the file at path, which must be inside root. With wantMapping, a file that is
// cached comes back as a mapping of the tier file (for a client on this node that maps it
// itself), and so does a missed file larger than EngineConfig.InlineMissBytes, once the data
// mover has published it; otherwise the bytes come from memory.
func (e *Engine) Read(ctx context.Context, root, path string, wantMapping bool) (Result, error) {
	res, err := e.read(ctx, root, path, wantMapping)
	if err != nil {
		e.stats.errors.Add(1)
		return Result{}, err
	}
	e.stats.bytesServed.Add(int64(len(res.Bytes())))
	return res, nil
}

func (e *Engine) read(ctx context.Context, root, path string, wantMapping bool) (Result, error) {
	if err := e.checkRoot(root, path); err != nil {
		return Result{}, err
	}
	if m, err := tiers.Probe(e.tiers, path); err == nil {
		e.stats.hits[m.Tier].Add(1)
		return Result{Mapping: m, Origin: m.Tier.String(), MTimeNanos: m.MTimeNanos}, nil
	} else if !errors.Is(err, tiers.ErrNotCached) || errors.Is(err, tiers.ErrDamaged) {
		e.log.Warn("probe", "path", path, "err", err)
	}

	f, leader := e.join(path)
	if leader {
		e.stats.misses.Add(1)
		e.fill(f, root, path)
	} else {
		e.stats.inflightHits.Add(1)
	}
	select {
	case <-f.done:
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
	if f.err != nil {
		return Result{}, f.err
	}
	origin := "inflight"
	if leader {
		origin = "source"
	}
	if wantMapping && int64(len(f.data)) > e.inline {
		select {
		case <-f.published:
			if m, err := tiers.Probe(e.tiers, path); err == nil {
				return Result{Mapping: m, Origin: origin, MTimeNanos: f.mtime}, nil
			}
		case <-ctx.Done():
			return Result{}, ctx.Err()
		}
	}
	return Result{Data: f.data, Origin: origin, MTimeNanos: f.mtime}, nil
}

// Store caches a file's bytes that a client read from the file's owner, so that this server,
// a replica, holds a copy without reading the source. A file already cached or on its way is
// left alone.
func (e *Engine) Store(root, path string, data []byte, mtimeNanos int64) error {
	if err := e.checkRoot(root, path); err != nil {
		return err
	}
	if m, err := tiers.Probe(e.tiers, path); err == nil {
		m.Release()
		return nil
	}
	f, leader := e.join(path)
	if !leader {
		return nil
	}
	f.data, f.mtime = data, mtimeNanos
	close(f.done)
	e.stats.stored.Add(1)
	e.mover.enqueue(job{entry: tiers.Entry{SourcePath: path, Size: int64(len(data)), MTimeNanos: mtimeNanos}, flight: f})
	return nil
}

// join returns the flight for path, creating it if there is none; leader is true for the
// caller that created it and must fill it.
func (e *Engine) join(path string) (f *flight, leader bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if f, ok := e.flights[path]; ok {
		return f, false
	}
	f = &flight{done: make(chan struct{}), published: make(chan struct{})}
	e.flights[path] = f
	return f, true
}

// fill reads the source for a flight and hands the bytes to the data mover, which ends the
// flight once the file is published.
func (e *Engine) fill(f *flight, root, path string) {
	realRoot, err := e.realRoot(root)
	if err == nil {
		f.data, f.mtime, err = ReadSource(path, realRoot)
	}
	if err == nil {
		e.stats.sourceReads.Add(1)
		e.stats.sourceBytes.Add(int64(len(f.data)))
	}
	f.err = err
	close(f.done)
	if err != nil {
		e.land(path, f)
		return
	}
	e.mover.enqueue(job{entry: tiers.Entry{SourcePath: path, Size: int64(len(f.data)), MTimeNanos: f.mtime}, flight: f})
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
// own real path is checked against the resolved root when it is opened (ReadSource).
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
