package core

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
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

// Bounds on what prefetch jobs hold, so that clients cannot make a server keep lists without
// limit.
const (
	maxPrefetchJobs   = 1024
	maxPrefetchPaths  = 1 << 24 // paths held by all jobs together (16 Mi, about 1.6 GB of paths)
	maxPrefetchErrors = 8       // failure messages a job keeps for its owners
)

// After a reader misses a file of a running job, the files that follow it in the list are
// handed out first: readers read a list in runs (a DataLoader worker reads its batch), so
// they are the reader's next files. A job follows at most this many such runs at once, each
// for at most this many files or until it meets files handed out already.
const (
	maxHotRuns   = 32
	hotRunLength = 256
)

// States of a prefetch job, as PrefetchInfo.State reports them.
const (
	PrefetchRunning   = "running"   // files are being read ahead
	PrefetchDone      = "done"      // every file of the list was dealt with
	PrefetchBudget    = "budget"    // stopped: the tiers are full, and prefetch never evicts
	PrefetchAbandoned = "abandoned" // stopped: no owner renewed it within the lease
	PrefetchReplaced  = "replaced"  // stopped: its only owner sent another list for the root
	PrefetchOff       = "off"       // the server's prefetch is off (option prefetch 0)
	PrefetchUnknown   = "unknown"   // the owner has no job for the root (it ended and was forgotten)
)

// PrefetchConfig configures an engine's prefetch. The zero value turns prefetch off.
type PrefetchConfig struct {
	// Reads is how many source reads prefetch runs at once (see DefaultPrefetch); readers'
	// misses come first and take from the same allowance. 0 turns prefetch off.
	Reads int
	// Lease: a job stops when none of its owners renewed it for this long. 0 means
	// DefaultPrefetchLease.
	Lease time.Duration
	// Clock tells the time leases are measured with; nil means time.Now.
	Clock func() time.Time
}

// PrefetchRequest hands a server a list of files to read ahead of its readers, or renews the
// caller's job.
type PrefetchRequest struct {
	// Root is the dataset root the paths lie in (absolute, clean).
	Root string
	// Owner identifies the caller (one client); a job lives while one of its owners renews it.
	Owner string
	// ListID identifies the whole list (ListDigest of it): owners that send the same list for
	// the same root share one job, and all but the first learn it from the reply to their
	// first chunk (PrefetchInfo.Joined) and need not send the rest. Empty means ListDigest(Paths), for a
	// list sent whole.
	ListID string
	// Offset is the position of Paths[0] in the whole list: a long list is sent in chunks, in
	// order, the first with Offset 0. A first chunk replaces the owner's earlier job for Root.
	Offset int
	// Total is the length of the whole list; 0 means len(Paths).
	Total int
	// ForNode: the list is of the readers of this server's node, in cluster mode, and each
	// file is brought into a tier of this node whichever server owns it (see
	// EngineConfig.NodeFetch): the server's own files as usual, another node's as node-local
	// copies where there is room. Without a NodeFetch it changes nothing.
	ForNode bool
	// ThisEpoch, with ForNode: the first ThisEpoch paths of the whole list are what the node's
	// readers read now; the rest they read only in later epochs (with a DistributedSampler,
	// the other ranks' parts, which a node with room keeps as node-local copies). Those are
	// pulled after every file read now is done, laterAtOnce at a time: during a cold epoch
	// the node's CPU and network go to what its readers wait for. 0 (or the list's length):
	// all of them are read now.
	ThisEpoch int
	// Session is the validation session of the caller's job (see Engine.BeginSession): the
	// job checks the copies it finds cached against their sources, ahead of the readers, so a
	// list joins only a job of the same session or a later one. 0 joins any.
	Session uint32
	// Paths to read, absolute, clean and inside Root, in the order readers will want them. A
	// request with no paths, Offset 0 and Total 0 only renews the owner's job and reports it;
	// one with no paths, Offset 0, a Total and a ListID is a probe: the caller joins the list
	// if the server holds it (Joined), and nothing happens otherwise (state unknown).
	Paths []string
}

// PrefetchInfo is the state and progress of a prefetch job.
type PrefetchInfo struct {
	State string `json:"state"`
	// Joined: the server holds this list already (sent by another owner, whose job the
	// caller now shares, or by the caller before): the rest of it need not be sent.
	Joined bool `json:"joined,omitempty"`
	// Accepted is how many paths of this request were taken.
	Accepted int `json:"accepted"`
	// Files is the length of the whole list, Received how much of it has arrived, Done how
	// many files were dealt with (fetched, skipped or failed).
	Files    int `json:"files"`
	Received int `json:"received"`
	Done     int `json:"done"`
	// Fetched files were read from the source and cached; SkippedCached ones were cached
	// already; SkippedInflight ones were being read for a reader already (demand got there
	// first); Failed ones could not be read (Errors has the first messages).
	Fetched         int      `json:"fetched"`
	SkippedCached   int      `json:"skipped_cached"`
	SkippedInflight int      `json:"skipped_inflight"`
	Failed          int      `json:"failed"`
	Bytes           int64    `json:"bytes"` // of the fetched files
	Owners          int      `json:"owners"`
	Errors          []string `json:"errors,omitempty"`
}

// Terminal reports whether the job ended (or never ran): its progress no longer changes.
func (i PrefetchInfo) Terminal() bool { return i.State != PrefetchRunning }

// PrefetchStats are an engine's prefetch counters (see StatsSnapshot.Prefetch).
type PrefetchStats struct {
	Reads           int   `json:"reads"`        // source reads prefetch may run at once; 0: off
	JobsActive      int   `json:"jobs_active"`  // jobs running now
	FilesQueued     int64 `json:"files_queued"` // files of running jobs not yet handled
	Jobs            int64 `json:"jobs"`         // jobs started
	Fetched         int64 `json:"fetched"`      // files read from the source and cached
	SkippedCached   int64 `json:"skipped_cached"`
	SkippedInflight int64 `json:"skipped_inflight"`
	Failed          int64 `json:"failed"`
	Bytes           int64 `json:"bytes"`          // of the fetched files
	StoppedBudget   int64 `json:"stopped_budget"` // jobs stopped because the tiers were full
	Abandoned       int64 `json:"abandoned"`      // jobs stopped because their owners were gone
}

// Add adds o's counters to s.
func (s *PrefetchStats) Add(o PrefetchStats) {
	s.Reads += o.Reads
	s.JobsActive += o.JobsActive
	s.FilesQueued += o.FilesQueued
	s.Jobs += o.Jobs
	s.Fetched += o.Fetched
	s.SkippedCached += o.SkippedCached
	s.SkippedInflight += o.SkippedInflight
	s.Failed += o.Failed
	s.Bytes += o.Bytes
	s.StoppedBudget += o.StoppedBudget
	s.Abandoned += o.Abandoned
}

// ListDigest identifies a list of paths, for PrefetchRequest.ListID.
func ListDigest(paths []string) string {
	h := sha256.New()
	for _, p := range paths {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

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

type ownerKey struct{ root, owner string }

// prefetchJob is one list of files being read ahead; its fields are protected by the
// prefetcher's mu.
type prefetchJob struct {
	root, listID string
	total        int
	session      uint32               // PrefetchRequest.Session of the list's first sender
	forNode      bool                 // PrefetchRequest.ForNode
	thisEpoch    int                  // PrefetchRequest.ThisEpoch: the files from this index on are for later epochs; 0: none
	later        map[string]bool      // files for later epochs being fetched (at most laterAtOnce)
	sender       string               // the owner that sends the list, chunk by chunk
	paths        []string             // received so far; "" once handed out (or read by a reader)
	pos          map[string]int       // index in paths of each file not handed out yet
	next         int                  // no file before this index is left to hand out
	hot          []hotRun             // runs that follow readers' misses, handed out first
	busy         int                  // files handed out to workers and not finished
	owners       map[string]time.Time // owner -> end of its lease
	state        string
	info         PrefetchInfo // counters: Fetched, Skipped*, Failed, Bytes, Errors
	// cleared: the job had ended when its root's files were removed (Engine.Clear), so the
	// same list sent again starts a new job, which reads them again, instead of joining it.
	cleared bool
}

// hotRun is a stretch of a job's list after a file a reader missed.
type hotRun struct{ at, left int }

// handOut takes the file at index i off the list.
func (j *prefetchJob) handOut(i int) string {
	path := j.paths[i]
	j.paths[i] = ""
	delete(j.pos, path)
	return path
}

// nextFile hands out the job's next file: from the runs after readers' misses first, in
// turn, then in list order; a file for a later epoch (see PrefetchRequest.ThisEpoch) only
// once every file read now is done, and while fewer than laterAtOnce such files are being
// fetched. It reports false when none is to be handed out now.
func (j *prefetchJob) nextFile() (string, bool) {
	for len(j.hot) > 0 {
		r := j.hot[0]
		j.hot = j.hot[1:]
		if r.at < len(j.paths) && j.readNow(r.at) && j.paths[r.at] != "" && r.left > 0 {
			if r.left > 1 {
				j.hot = append(j.hot, hotRun{r.at + 1, r.left - 1}) // runs take turns
			}
			return j.handOut(r.at), true
		}
		// The run met files handed out already, or ended: the list order takes over.
	}
	for j.next < len(j.paths) && j.paths[j.next] == "" {
		j.next++
	}
	switch {
	case j.next >= len(j.paths):
		return "", false
	case j.readNow(j.next):
		return j.handOut(j.next), true
	case j.busy > len(j.later) || len(j.later) >= laterAtOnce: // files read now are in flight
		return "", false
	}
	path := j.handOut(j.next)
	if j.later == nil {
		j.later = map[string]bool{}
	}
	j.later[path] = true
	return path, true
}

// laterAtOnce is how many files for later epochs a job fetches at once. Measured with
// bench/bench_cluster.py (4 nodes on 2 shared cores, a reader per node, 2026-11-26): at full
// prefetch concurrency (16) the pull cost the first epoch over GlusterFS a third of its speed
// (0.44x the file system's limit); one at a time, or only while no reader of the node
// waited, the pull was not done before the warm epochs and they stayed remote (0.22-0.28x
// plain reads with persistent workers); 4 gave 0.55x and 0.91x.
const laterAtOnce = 4

// readNow reports whether the file at index i of the list is read by the readers now rather
// than in a later epoch (see PrefetchRequest.ThisEpoch).
func (j *prefetchJob) readNow(i int) bool { return j.thisEpoch == 0 || i < j.thisEpoch }

// follow starts a run after index i, unless one is about to reach it.
func (j *prefetchJob) follow(i int) {
	for _, r := range j.hot {
		if r.at <= i && i-r.at < 16 {
			return
		}
	}
	if len(j.hot) >= maxHotRuns {
		j.hot = j.hot[1:]
	}
	j.hot = append(j.hot, hotRun{i, hotRunLength})
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
			old.owners[req.Owner] = until // the same list again: a renewal
			info := old.report()
			info.Joined = true
			return info, nil
		}
		if len(req.Paths) == 0 { // a probe: join the list if it is held, else say so
			j := p.find(req.Root, id, total, req.Session, req.ForNode)
			if j == nil {
				return PrefetchInfo{State: PrefetchUnknown}, nil
			}
			p.leave(key)
			j.owners[req.Owner] = until
			p.owned[key] = j
			info := j.report()
			info.Joined = true
			return info, nil
		}
		p.leave(key)
		if j = p.find(req.Root, id, total, req.Session, req.ForNode); j != nil {
			j.owners[req.Owner] = until
			p.owned[key] = j
			info := j.report()
			info.Joined = true
			return info, nil
		}
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

// report returns the job's state and counters.
func (j *prefetchJob) report() PrefetchInfo {
	info := j.info
	info.State, info.Files, info.Received, info.Owners = j.state, j.total, len(j.paths), len(j.owners)
	info.Done = info.Fetched + info.SkippedCached + info.SkippedInflight + info.Failed
	info.Errors = append([]string(nil), j.info.Errors...)
	return info
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

// testHookPrefetch, when set by a test, runs in a worker before it handles a file.
var testHookPrefetch func(path string)

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
