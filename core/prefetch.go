package core

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

// DefaultPrefetch is the default of the prefetch option: how many source reads a server's
// prefetch runs at once. Reads from a parallel file system are bound by latency, not
// bandwidth: one reader waits a round trip or more per file, so the file system's own limit
// is reached only with many reads in flight. The emulated PFS of the benchmarks (GlusterFS,
// 1 ms, 1 Gbit) stops gaining near 16 (see bench/bench_prefetch.py); more only adds memory
// and contention with the readers, fewer leaves the first epoch at the readers' pace.
const DefaultPrefetch = 16

// DefaultPrefetchLease is how long a prefetch job lives without word from its owners.
// Clients renew their jobs every second, so a job outlives its last client by at most this.
const DefaultPrefetchLease = 10 * time.Second

// MaxPrefetchReads bounds the prefetch option (source reads at once), which clients choose.
const MaxPrefetchReads = 1024

// Prefetch queues a list of files to read from the source ahead of its readers, or renews
// the owner's job (see PrefetchRequest), and returns the job's state. The engine reads with
// at most PrefetchConfig.Reads source reads at once, counting readers' misses first; skips
// files that are cached or being read already; publishes only into a tier with room and
// stops when there is none (it never evicts); and stops a job whose owners stop renewing it.
// With prefetch off it returns state PrefetchOff and does nothing.
func (e *Engine) Prefetch(req PrefetchRequest) (PrefetchInfo, error) {
	if e.closed.Load() {
		return PrefetchInfo{}, ErrClosed
	}
	if req.Owner == "" {
		return PrefetchInfo{}, fmt.Errorf("%w: a prefetch request needs an owner", syscall.EINVAL)
	}
	if req.Offset < 0 || req.Total < 0 {
		return PrefetchInfo{}, fmt.Errorf("%w: negative offset or total", syscall.EINVAL)
	}
	if err := e.checkRoot(req.Root, req.Root); err != nil {
		return PrefetchInfo{}, err
	}
	for _, p := range req.Paths { // the root was checked whole: the rest is lexical
		if err := CheckPath(req.Root, p); err != nil {
			return PrefetchInfo{}, err
		}
	}
	return e.pf.submit(req)
}

// prefetcher reads files ahead of readers for an engine's prefetch jobs. Its workers take
// files from the running jobs in turn.
type prefetcher struct {
	e     *Engine
	limit int // PrefetchConfig.Reads
	floor int // reads prefetch keeps however many readers' misses run (see slotFree)
	lease time.Duration
	now   func() time.Time

	mu       sync.Mutex // protects all below; cond waits on it
	cond     *sync.Cond // broadcast when work, a read slot or tier room may have appeared, and on stop
	jobs     []*prefetchJob
	owned    map[ownerKey]*prefetchJob // each owner's job for a root
	rr       int                       // where workers look for work among jobs next (round robin)
	paths    int                       // paths received by all jobs held
	demand   int                       // readers' source reads in progress (see demandFill)
	active   int                       // files workers are handling
	reserved int64                     // tier bytes set aside for files fetched and not yet published
	running  int                       // jobs in state PrefetchRunning
	stopped  bool
	stats    PrefetchStats
	workers  sync.WaitGroup
}

func newPrefetcher(e *Engine, cfg PrefetchConfig) *prefetcher {
	p := &prefetcher{e: e, limit: max(cfg.Reads, 0), lease: cfg.Lease, now: cfg.Clock, owned: map[ownerKey]*prefetchJob{}}
	p.floor = p.limit / 4
	if p.lease <= 0 {
		p.lease = DefaultPrefetchLease
	}
	if p.now == nil {
		p.now = time.Now
	}
	p.cond = sync.NewCond(&p.mu)
	p.stats.Reads = p.limit
	for range p.limit {
		p.workers.Add(1)
		go p.work()
	}
	return p
}

// stop ends the workers once the files they handle are done (each is one source read at most).
func (p *prefetcher) stop() {
	p.mu.Lock()
	p.stopped = true
	p.cond.Broadcast()
	p.mu.Unlock()
	p.workers.Wait()
}

func (p *prefetcher) submit(req PrefetchRequest) (PrefetchInfo, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return PrefetchInfo{}, ErrClosed
	}
	if p.limit == 0 {
		return PrefetchInfo{State: PrefetchOff}, nil
	}
	p.expire()
	key := ownerKey{req.Root, req.Owner}
	until := p.now().Add(p.lease)
	if len(req.Paths) == 0 && req.Offset == 0 && req.Total == 0 { // a renewal
		j := p.owned[key]
		if j == nil {
			return PrefetchInfo{State: PrefetchUnknown}, nil
		}
		j.owners[req.Owner] = until
		return j.report(), nil
	}
	var j *prefetchJob
	if req.Offset == 0 {
		total := req.Total
		if total == 0 {
			total = len(req.Paths)
		}
		if total < len(req.Paths) {
			return PrefetchInfo{}, fmt.Errorf("%w: %d paths in a list of %d", syscall.EINVAL, len(req.Paths), total)
		}
		id := req.ListID
		if id == "" {
			if total != len(req.Paths) {
				return PrefetchInfo{}, fmt.Errorf("%w: a list sent in chunks needs a list id", syscall.EINVAL)
			}
			id = ListDigest(req.Paths)
		}
		if old := p.owned[key]; old != nil && !old.cleared && old.listID == id && old.total == total && len(old.paths) == total {
			return p.join(old, key, until), nil // the same list again: a renewal
		}
		if len(req.Paths) == 0 { // a probe: join the list if it is held, else say so
			j := p.find(req.Root, id, total, req.Session, req.ForNode)
			if j == nil {
				return PrefetchInfo{State: PrefetchUnknown}, nil
			}
			return p.join(j, key, until), nil
		}
		if j = p.find(req.Root, id, total, req.Session, req.ForNode); j != nil {
			return p.join(j, key, until), nil
		}
		p.leave(key)
		if len(p.jobs) >= maxPrefetchJobs {
			return PrefetchInfo{}, fmt.Errorf("%w: %d prefetch jobs held already", syscall.ENOSPC, len(p.jobs))
		}
		j = &prefetchJob{root: req.Root, listID: id, total: total, session: req.Session, forNode: req.ForNode && p.e.nodeFetch != nil,
			sender: req.Owner, owners: map[string]time.Time{},
			pos: map[string]int{}, state: PrefetchRunning}
		if j.forNode && req.ThisEpoch > 0 && req.ThisEpoch < total {
			j.thisEpoch = req.ThisEpoch
		}
		p.jobs = append(p.jobs, j)
		p.owned[key] = j
		p.running++
		p.stats.Jobs++
	} else {
		j = p.owned[key]
		if j == nil || j.sender != req.Owner || req.Offset != len(j.paths) {
			return PrefetchInfo{}, fmt.Errorf("%w: prefetch chunk at offset %d follows no chunk of this owner's list", syscall.EINVAL, req.Offset)
		}
	}
	if len(j.paths)+len(req.Paths) > j.total {
		return PrefetchInfo{}, fmt.Errorf("%w: more paths than the list's %d", syscall.EINVAL, j.total)
	}
	if p.paths+len(req.Paths) > maxPrefetchPaths {
		return PrefetchInfo{}, fmt.Errorf("%w: prefetch jobs hold %d paths already", syscall.ENOSPC, p.paths)
	}
	for _, path := range req.Paths {
		if _, dup := j.pos[path]; dup { // a file listed twice is handed out once
			j.paths = append(j.paths, "")
			j.info.SkippedCached++
			p.stats.SkippedCached++
			continue
		}
		j.pos[path] = len(j.paths)
		j.paths = append(j.paths, path)
	}
	p.paths += len(req.Paths)
	j.owners[req.Owner] = until
	p.settle(j)
	p.cond.Broadcast()
	info := j.report()
	info.Accepted = len(req.Paths)
	return info, nil
}

// join makes the owner of key an owner of job j until until, leaving the job it owned if
// that is another, and reports j as joined. p.mu is held.
func (p *prefetcher) join(j *prefetchJob, key ownerKey, until time.Time) PrefetchInfo {
	if p.owned[key] != j {
		p.leave(key)
		p.owned[key] = j
	}
	j.owners[key.owner] = until
	info := j.report()
	info.Joined = true
	return info
}

// find returns a job for the same list, of session or a later one, and of the same kind
// (ForNode), if one is held. A job of an earlier session may have passed files that the
// caller's session has yet to check.
func (p *prefetcher) find(root, id string, total int, session uint32, forNode bool) *prefetchJob {
	forNode = forNode && p.e.nodeFetch != nil
	for _, j := range p.jobs {
		if j.root == root && j.listID == id && j.total == total && !j.cleared && j.session >= session &&
			j.forNode == forNode {
			return j
		}
	}
	return nil
}

// clearedRoots marks the ended jobs of the roots match accepts (nil: all) as cleared (see
// prefetchJob.cleared), after Engine.Clear removed their files. Running jobs go on.
func (p *prefetcher) clearedRoots(match func(root string) bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, j := range p.jobs {
		if j.state != PrefetchRunning && (match == nil || match(j.root)) {
			j.cleared = true
		}
	}
}

// leave takes an owner off its job for a root; a running job left without owners stops.
func (p *prefetcher) leave(key ownerKey) {
	j := p.owned[key]
	if j == nil {
		return
	}
	delete(p.owned, key)
	delete(j.owners, key.owner)
	if len(j.owners) == 0 {
		p.setState(j, PrefetchReplaced)
		p.forget(j)
	}
}

// expire drops the owners whose lease ended, and forgets the jobs left without owners: a
// running one is abandoned.
func (p *prefetcher) expire() {
	now := p.now()
	for i := 0; i < len(p.jobs); {
		j := p.jobs[i]
		for o, until := range j.owners {
			if now.After(until) {
				delete(j.owners, o)
				delete(p.owned, ownerKey{j.root, o})
			}
		}
		if len(j.owners) > 0 {
			i++
			continue
		}
		if j.state == PrefetchRunning {
			p.setState(j, PrefetchAbandoned)
			p.stats.Abandoned++
		}
		p.forget(j)
	}
}

// forget removes a job from the table; workers still handling its files finish them.
func (p *prefetcher) forget(j *prefetchJob) {
	for i, x := range p.jobs {
		if x == j {
			p.jobs = append(p.jobs[:i], p.jobs[i+1:]...)
			p.paths -= len(j.paths)
			return
		}
	}
}

func (p *prefetcher) setState(j *prefetchJob, state string) {
	if j.state == PrefetchRunning && state != PrefetchRunning {
		p.running--
	}
	j.state = state
}

// settle marks a running job done once its whole list was handled.
func (p *prefetcher) settle(j *prefetchJob) {
	if j.state == PrefetchRunning && j.busy == 0 && len(j.pos) == 0 && len(j.paths) == j.total {
		p.setState(j, PrefetchDone)
	}
}

func (p *prefetcher) snapshot() PrefetchStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.stopped {
		p.expire()
	}
	s := p.stats
	s.JobsActive = p.running
	for _, j := range p.jobs {
		if j.state == PrefetchRunning {
			s.FilesQueued += int64(j.total - len(j.paths) + len(j.pos))
		}
	}
	return s
}

// work is a worker: it takes files from the running jobs while a source read slot is free
// (readers' misses take theirs first), and fetches them.
func (p *prefetcher) work() {
	defer p.workers.Done()
	for {
		p.mu.Lock()
		j, path := p.wait()
		p.mu.Unlock()
		if j == nil {
			return
		}
		var out outcome
		if j.forNode {
			out = p.fetchForNode(j.root, path)
		} else {
			out = p.fetch(j, path)
		}
		p.mu.Lock()
		p.record(j, path, out)
		p.mu.Unlock()
	}
}

// wait blocks until a file may be fetched and takes it, or returns nil once stopped. p.mu is
// held.
func (p *prefetcher) wait() (*prefetchJob, string) {
	for !p.stopped {
		p.expire()
		if p.slotFree() {
			if j, path := p.take(); j != nil {
				p.active++
				return j, path
			}
		}
		p.cond.Wait()
	}
	return nil, ""
}

// slotFree reports whether a worker may start on a file. Readers' misses go first: prefetch
// reads only while readers' source reads and its own stay below the limit. But it keeps a
// quarter of the limit however many misses run: readers that miss many files at once (each
// DataLoader worker reads a whole batch, several files at a time) would otherwise keep it from
// ever getting ahead of them, and their misses from turning into hits. p.mu is held.
func (p *prefetcher) slotFree() bool {
	return p.demand+p.active < p.limit || p.active < p.floor
}

// take hands out the next file of the running jobs, each job in turn. p.mu is held.
func (p *prefetcher) take() (*prefetchJob, string) {
	for i := range p.jobs {
		k := (p.rr + i) % len(p.jobs)
		j := p.jobs[k]
		if j.state != PrefetchRunning {
			continue
		}
		if path, ok := j.nextFile(); ok {
			p.rr = k + 1
			j.busy++
			return j, path
		}
	}
	return nil, ""
}

// What became of a file a worker took.
const (
	fetchedFile = iota
	skippedCached
	skippedInflight
	fetchFailed
	noRoom  // the tiers are full: the job stops
	stopped // the engine is closing
)

type outcome struct {
	kind     int
	bytes    int64 // of a fetched file
	reserved int64 // tier room set aside for it, to give back
	err      error
}

// record books a file's outcome in its job and frees its slot. p.mu is held.
func (p *prefetcher) record(j *prefetchJob, path string, out outcome) {
	p.active--
	p.reserved -= out.reserved
	j.busy--
	delete(j.later, path)
	switch out.kind {
	case fetchedFile:
		j.info.Fetched++
		j.info.Bytes += out.bytes
		p.stats.Fetched++
		p.stats.Bytes += out.bytes
	case skippedCached:
		j.info.SkippedCached++
		p.stats.SkippedCached++
	case skippedInflight:
		j.info.SkippedInflight++
		p.stats.SkippedInflight++
	case fetchFailed:
		j.info.Failed++
		p.stats.Failed++
		if len(j.info.Errors) < maxPrefetchErrors {
			j.info.Errors = append(j.info.Errors, fmt.Sprintf("%s: %v", path, out.err))
		}
	case noRoom:
		if j.state == PrefetchRunning {
			p.setState(j, PrefetchBudget)
			p.stats.StoppedBudget++
		}
	}
	p.settle(j)
	p.cond.Broadcast()
}

// testHookPrefetch, when set by a test, runs in a worker before it handles a file;
// testHookPrefetchBlock before it handles block n of a large file (see fetchBlocks).
var (
	testHookPrefetch      func(path string)
	testHookPrefetchBlock func(n int64)
)

// fetch reads one file from the source into a tier, unless it is cached already or a reader
// is reading it, through the engine's miss path (fill): a reader that misses the file
// meanwhile shares the read. It is published only where there is room without eviction. A
// cached copy not yet checked against its source in the current session is checked first
// (and dropped, then read anew, if the source changed): that is how a job's copies are
// checked ahead of its readers.
func (p *prefetcher) fetch(j *prefetchJob, path string) outcome {
	e, root := p.e, j.root
	if testHookPrefetch != nil {
		testHookPrefetch(path)
	}
	if err := e.validate(root, path); err != nil {
		return outcome{kind: fetchFailed, err: err}
	}
	if _, ok := e.cachedSize(path); ok {
		return outcome{kind: skippedCached}
	}
	reserved, ok := p.reserve(path)
	if !ok {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.stopped {
			return outcome{kind: stopped}
		}
		return outcome{kind: noRoom}
	}
	out := outcome{reserved: reserved}
	f, leader := e.join(path)
	if !leader {
		out.kind = skippedInflight
		return out
	}
	f.noEvict.Store(true)
	// Published and landed between the probe above and join: nobody reads it now, so one
	// more look is enough to never read a file twice.
	if _, ok := e.cachedSize(path); ok {
		f.inTier = true // readers that joined read it from its tier
		e.finish(path, f)
		out.kind = skippedCached
		return out
	}
	if !e.startFill() {
		f.err = ErrClosed
		e.finish(path, f)
		out.kind = stopped
		return out
	}
	e.fill(f, root, path)
	e.fills.Done()
	<-f.done
	<-f.published
	if errors.Is(f.err, errClaimedByReader) {
		out.kind = skippedInflight // a reader fills it
		return out
	}
	if f.err != nil {
		out.kind, out.err = fetchFailed, f.err
		if errors.Is(f.err, ErrTooLarge) && p.fitsSomeTier(path) {
			out.kind = noRoom // no room without eviction (ErrCacheFull wraps ErrTooLarge)
		} else if errors.Is(f.err, ErrTooLarge) && f.size >= ReadNowBytes {
			return p.fetchBlocks(j, path, f.size, out)
		}
		return out
	}
	// The miss path publishes before it ends the flight: f.inTier says it is in a tier.
	if f.inTier {
		out.kind, out.bytes = fetchedFile, f.size
	} else {
		out.kind = noRoom // read into memory for a reader that joined, no tier took it
	}
	return out
}

// fetchBlocks brings the blocks of a large file that no tier takes whole into the tiers
// (Engine.prefetchBlock), from its first block on and blockPrefetchWidth at a time: the
// readers of its ranges, and programs under `fitcache run`, then find them cached. As for
// whole files, nothing is evicted for them, and the job stops at the budget: at the first
// block no tier has room for. It stops between blocks once the prefetcher stops (the engine
// closes) or the job ends (its owners left): a file may have thousands of blocks. In a
// cluster, each block belongs to the server that owns its name on the ring: the others are
// asked to cache theirs (EngineConfig.BlockOwner), and one that declines or does not answer
// is passed over. out is the file's outcome so far (its reserved room).
func (p *prefetcher) fetchBlocks(j *prefetchJob, path string, size int64, out outcome) outcome {
	e, root := p.e, j.root
	gone := func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.stopped || j.state != PrefetchRunning
	}
	blocks := (size + e.blockBytes - 1) / e.blockBytes
	var (
		next, fetched  atomic.Int64
		remoteFailures atomic.Int64 // blocks other servers did not cache
		stop           atomic.Bool
		mu             sync.Mutex
		firstErr       error
		wg             sync.WaitGroup
	)
	for range min(blockPrefetchWidth, blocks) {
		wg.Go(func() {
			for !stop.Load() {
				n := next.Add(1) - 1
				if n >= blocks {
					return
				}
				if testHookPrefetchBlock != nil {
					testHookPrefetchBlock(n)
				}
				if gone() {
					stop.Store(true)
					mu.Lock()
					firstErr = cmp.Or(firstErr, ErrClosed)
					mu.Unlock()
					return
				}
				if e.blockOwner != nil {
					ask := remoteFailures.Load() < blockOwnerFailuresMax // else owners are full, or away
					ctx, cancel := context.WithTimeout(context.Background(), blockOwnerTimeout)
					mine, err := e.blockOwner(ctx, root, path, n, ask)
					cancel()
					if !mine {
						if err != nil {
							remoteFailures.Add(1)
							e.log.Debug("prefetch: a block's owner did not cache it", "path", path, "block", n, "err", err)
						}
						continue
					}
				}
				got, err := e.prefetchBlock(root, path, n)
				fetched.Add(got)
				if err != nil {
					stop.Store(true)
					mu.Lock()
					firstErr = cmp.Or(firstErr, err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	out.bytes, out.err = fetched.Load(), firstErr
	switch {
	case firstErr == nil:
		out.kind = fetchedFile
	case errors.Is(firstErr, ErrClosed):
		out.kind = stopped
	case errors.Is(firstErr, ErrTooLarge): // ErrCacheFull too: no room without eviction
		out.kind, out.err = noRoom, nil
	default:
		out.kind = fetchFailed
	}
	return out
}

// blockPrefetchWidth is how many blocks of one large file prefetch reads at once: a single
// read of a parallel file system is slow, several in parallel are not. Prefetch holds at most
// prefetchBlockFillsMax of the engine's blockFillsMax block fills, so that readers' misses of
// blocks never wait behind it.
const (
	blockPrefetchWidth    = 4
	prefetchBlockFillsMax = blockFillsMax / 2
)

// In a cluster, the asks of prefetch to other servers to cache their blocks of a file stop
// once blockOwnerFailuresMax were not answered or declined (their tiers are full of the
// dataset, or they are away): a file may have thousands of blocks. Each ask waits
// blockOwnerTimeout at most, which bounds how long Close waits for a worker too.
const (
	blockOwnerFailuresMax = 8
	blockOwnerTimeout     = 10 * time.Second
)

// fetchForNode brings one file of a node's readers' list into a tier of this node through the
// engine's NodeFetch (see PrefetchRequest.ForNode). A file no tier of the node takes is
// skipped, not a failure, and does not stop the job: the readers have the server open it.
func (p *prefetcher) fetchForNode(root, path string) outcome {
	if testHookPrefetch != nil {
		testHookPrefetch(path)
	}
	ctx, cancel := context.WithTimeout(context.Background(), nodeFetchTimeout)
	defer cancel()
	cached, err := p.e.nodeFetch(ctx, root, path)
	switch {
	case err == nil && cached:
		return outcome{kind: skippedCached}
	case err == nil:
		size, _ := p.e.cachedSize(path)
		return outcome{kind: fetchedFile, bytes: size}
	case errors.Is(err, ErrCacheFull) || errors.Is(err, ErrTooLarge):
		return outcome{kind: skippedInflight} // not kept on this node: the readers ask for it
	default:
		return outcome{kind: fetchFailed, err: err}
	}
}

// nodeFetchTimeout bounds one file of a node's readers' list (NodeFetch asks other servers).
const nodeFetchTimeout = time.Minute

// reserve sets aside room in the tiers for a file about to be fetched: reserveBound, or near
// the budget the file's own size, from a stat (no open). It waits while files being fetched
// hold the room it needs, and reports false when there is none left (or the prefetcher
// stopped meanwhile). It returns the bytes set aside.
func (p *prefetcher) reserve(path string) (int64, bool) {
	need := tiers.EntrySize(path, reserveBound)
	exact := false
	p.mu.Lock()
	defer p.mu.Unlock()
	for !p.stopped {
		if p.e.hasRoom(need + p.reserved) {
			p.reserved += need
			return need, true
		}
		if !exact {
			exact = true
			p.mu.Unlock()
			fi, err := os.Stat(path)
			p.mu.Lock()
			need = 0 // a missing file, say: fill reports the error
			if err == nil && fi.Mode().IsRegular() {
				need = tiers.EntrySize(path, fi.Size())
			}
			continue
		}
		if p.reserved == 0 {
			return 0, false
		}
		p.cond.Wait() // until files being fetched give their room back
	}
	return 0, false
}

// reserveBound is the room prefetch sets aside for a file before it knows its size: most
// training samples are smaller; near the budget the file's own size is used.
const reserveBound = 1 << 20

// fitsSomeTier reports whether the file at path would fit in some tier at all, once
// readers' files made room.
func (p *prefetcher) fitsSomeTier(path string) bool {
	fi, err := os.Stat(path)
	if err != nil {
		return false
	}
	need := tiers.EntrySize(path, fi.Size())
	for _, t := range p.e.tiers {
		if t.CanHold(need) {
			return true
		}
	}
	return false
}

// startDemand counts a reader's source read of path, which prefetch gives way to, and
// reports whether prefetch jobs are running. Running jobs that list path take it off their
// list (the reader reads it) and hand out the files after it first.
func (p *prefetcher) startDemand(path string) bool {
	if p.limit == 0 {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.demand++
	if p.running == 0 {
		return false
	}
	for _, j := range p.jobs {
		if i, ok := j.pos[path]; ok && j.state == PrefetchRunning {
			j.handOut(i)
			j.info.SkippedInflight++
			p.stats.SkippedInflight++
			j.follow(i + 1)
			p.settle(j)
		}
	}
	return true
}

func (p *prefetcher) endDemand() {
	if p.limit == 0 {
		return
	}
	p.mu.Lock()
	p.demand--
	p.cond.Broadcast()
	p.mu.Unlock()
}

// ReaderWaits counts a reader of this node waiting on this server for path, in cluster mode
// (the node socket's opens and fetches of files this server brings from their owners), as a
// reader's source read is counted: prefetch gives way to it, the file leaves the lists of
// running jobs (the reader reads it) and the files after it are handed out first. The caller
// calls the function returned once the reader has its answer.
func (e *Engine) ReaderWaits(path string) (done func()) {
	e.pf.startDemand(path)
	return e.pf.endDemand
}

// demandFill is fill for a reader's miss. It counts the read as a demand read, which
// prefetch gives way to, and looks in the tiers once more first: another flight (a reader's
// or prefetch's) may have published the file and ended between the reader's probe and its
// join, and the source is read once per file. The look asks the indexes and maps nothing.
func (e *Engine) demandFill(f *flight, root, path string) {
	e.pf.startDemand(path)
	defer e.pf.endDemand()
	if _, ok := e.cachedSize(path); ok {
		f.inTier = true // the reader reads it from its tier
		e.finish(path, f)
		return
	}
	e.fill(f, root, path)
}

// noEvict reports whether path is being fetched by prefetch alone: then it is published
// only into a tier with room, never evicting files readers may still need. A reader that
// misses the file meanwhile lifts the restriction (see read).
func (e *Engine) noEvict(path string) bool {
	e.mu.Lock()
	f := e.flights[path]
	e.mu.Unlock()
	return f != nil && f.noEvict.Load()
}

// cachedSize reports whether path is cached in a tier, and its size.
//
// It asks the tiers' indexes and maps nothing: prefetch asks it of every file of a list, and
// on a warm cache (a new run over a dataset cached before) mapping each one cost the server
// more CPU than the readers' whole epoch.
func (e *Engine) cachedSize(path string) (int64, bool) {
	for _, t := range e.tiers {
		if size, ok := t.CachedSize(path); ok {
			return size, true
		}
	}
	return 0, false
}

// hasRoom reports whether some tier has room for n bytes of the server's own without evicting
// any of its own files (guests give way).
func (e *Engine) hasRoom(n int64) bool {
	for _, t := range e.tiers {
		if t.HasRoomForOwn(n) { // node-local copies give way (see place)
			return true
		}
	}
	return false
}
