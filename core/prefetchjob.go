package core

// The prefetch jobs: what clients ask for (PrefetchRequest), what they are told
// (PrefetchInfo, PrefetchStats), and one list of files being read ahead (prefetchJob). The
// prefetcher that runs them is in prefetch.go.

import (
	"crypto/sha256"
	"encoding/hex"
	"time"
)

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

// report returns the job's state and counters.
func (j *prefetchJob) report() PrefetchInfo {
	info := j.info
	info.State, info.Files, info.Received, info.Owners = j.state, j.total, len(j.paths), len(j.owners)
	info.Done = info.Fetched + info.SkippedCached + info.SkippedInflight + info.Failed
	info.Errors = append([]string(nil), j.info.Errors...)
	return info
}
