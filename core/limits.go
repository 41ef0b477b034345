package core

import (
	"errors"
	"math"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/tiers"
)

// Limits bound the tiers' budgets from outside their configuration, and follow the node while
// the server runs: the memory the job may use (its memory cgroup), the site's limits for each
// user and for the node, and the free space each tier's file system keeps for others. The
// zero value limits nothing.
//
// Why: pages of a tmpfs are charged to the memory cgroup of the process that writes them and,
// without swap, cannot be reclaimed. A memory tier sized from /dev/shm alone took a batch job
// over its memory limit, and the kernel's OOM killer killed the training process. The engine
// reads the limits every Interval and lowers a tier's budget when they leave less room than
// it holds (tiers.Tier.Ceil): it evicts its oldest files, which move to the next tier when
// there is one, before the kernel has to kill anything. When room comes back, the budget
// rises again, up to the configured one.
type Limits struct {
	// Memory reads the memory cgroup the server runs in; nil when there is none to follow.
	Memory func() (MemoryReading, error)
	// Reserve is the part of the cgroup's limit left to the job itself (its processes and
	// their growth): the memory tiers take at most the limit, less the reserve, less what
	// the job uses besides reclaimable page cache. Zero means DefaultMemoryReserve.
	Reserve tiers.SizeOrPercent
	// MemoryPerUser caps the memory tiers of this server together, MemoryPerNode what the
	// memory file system holds in all (every user's tiers, and anything else in it), and
	// DiskPerUser the other tiers of this server together; 0: no cap. They come from the
	// site's configuration (config.Site).
	MemoryPerUser, MemoryPerNode, DiskPerUser int64
	// KeepFree is left free in each tier's file system, for other users and jobs; zero
	// keeps nothing free beyond the tiers' budgets.
	KeepFree tiers.SizeOrPercent
	// Interval between readings; 0 means DefaultLimitsInterval.
	Interval time.Duration
	// StatFS returns the size and free bytes of the file system holding dir; nil means
	// statfs(2). Tests replace it.
	StatFS func(dir string) (total, free int64, err error)
}

// MemoryReading is one reading of a memory cgroup (see cgroup.Usage).
type MemoryReading struct {
	// Limit is the cgroup's effective limit in bytes; math.MaxInt64 when it has none.
	Limit int64
	// Unreclaimable is what the cgroup uses besides page cache that the kernel can reclaim:
	// processes' memory and tmpfs pages, the memory tiers' copies among them.
	Unreclaimable int64
	// OOMKills counts the processes the kernel killed in the cgroup for want of memory.
	OOMKills uint64
}

// Defaults of Limits.
const (
	DefaultLimitsInterval = 100 * time.Millisecond
	// DefaultMemoryReserve leaves a quarter of the job's memory limit to the job.
	DefaultMemoryReserve = "25%"
)

// zero reports whether l limits nothing.
func (l Limits) zero() bool {
	return l.Memory == nil && l.MemoryPerUser == 0 && l.MemoryPerNode == 0 && l.DiskPerUser == 0 &&
		l.KeepFree == (tiers.SizeOrPercent{})
}

// limiter applies Limits to an engine's tiers, once at start and then every Interval.
type limiter struct {
	e    *Engine
	l    Limits
	stop chan struct{}
	done sync.WaitGroup

	mu       sync.Mutex // protects oomKills and readErr
	oomKills uint64     // the cgroup's count at the last reading
	readErr  bool       // the last reading of the cgroup failed (logged once per failure run)
}

// startLimiter applies l to e's tiers now and starts following it; nil when l is zero.
func startLimiter(e *Engine, l Limits) *limiter {
	if l.zero() {
		return nil
	}
	if l.Reserve == (tiers.SizeOrPercent{}) {
		l.Reserve, _ = tiers.ParseSize(DefaultMemoryReserve)
	}
	if l.Interval <= 0 {
		l.Interval = DefaultLimitsInterval
	}
	if l.StatFS == nil {
		l.StatFS = statFS
	}
	lim := &limiter{e: e, l: l, stop: make(chan struct{})}
	if l.Memory != nil {
		if r, err := l.Memory(); err == nil {
			lim.oomKills = r.OOMKills
		}
	}
	lim.apply()
	lim.done.Go(lim.loop)
	return lim
}

func (lim *limiter) loop() {
	tick := time.NewTicker(lim.l.Interval)
	defer tick.Stop()
	for {
		select {
		case <-lim.stop:
			return
		case <-tick.C:
			lim.apply()
		}
	}
}

// close stops following the limits; a nil limiter is closed already.
func (lim *limiter) close() {
	if lim == nil {
		return
	}
	close(lim.stop)
	lim.done.Wait()
}

// apply reads the limits once and sets each tier's ceiling from them.
func (lim *limiter) apply() {
	l, e := lim.l, lim.e
	room := int64(math.MaxInt64) // what the memory tiers may still take of the job's limit
	if mem, ok := lim.readMemory(); ok {
		room = mem.Limit - l.Reserve.Resolve(mem.Limit) - mem.Unreclaimable
	}
	var usedMemory, usedOther int64
	for _, t := range e.tiers {
		if t.Kind == tiers.Memory {
			usedMemory += t.Info().Used
		} else {
			usedOther += t.Info().Used
		}
	}
	for i, t := range e.tiers {
		used := t.Info().Used
		ceil, why := int64(math.MaxInt64), ""
		lower := func(n int64, reason string) {
			if n < ceil {
				ceil, why = n, reason
			}
		}
		if t.Kind == tiers.Memory {
			if room != math.MaxInt64 {
				lower(used+room, "cgroup memory limit")
			}
			if l.MemoryPerUser > 0 {
				lower(l.MemoryPerUser-(usedMemory-used), "site memory_per_user")
			}
			if l.MemoryPerNode > 0 {
				if total, free, err := l.StatFS(t.Path); err == nil {
					lower(used+l.MemoryPerNode-(total-free), "site memory_per_node")
				}
			}
		} else if l.DiskPerUser > 0 {
			lower(l.DiskPerUser-(usedOther-used), "site disk_per_user")
		}
		if l.KeepFree != (tiers.SizeOrPercent{}) {
			if total, free, err := l.StatFS(t.Path); err == nil {
				lower(used+free-l.KeepFree.Resolve(total), "file system free space")
			}
		}
		budget, err := t.Ceil(ceil, why, e.spillFrom(i))
		if err != nil {
			e.log.Warn("lowering a tier's budget", "tier", t.Path, "err", err)
		}
		if t.Kind == tiers.Memory && room != math.MaxInt64 {
			room -= max(budget-used, 0) // the room this tier may grow into is not another's
		}
	}
}

// readMemory reads the memory cgroup, if there is one with a limit, and reports OOM kills
// in it since the last reading.
func (lim *limiter) readMemory() (MemoryReading, bool) {
	if lim.l.Memory == nil {
		return MemoryReading{}, false
	}
	r, err := lim.l.Memory()
	lim.mu.Lock()
	defer lim.mu.Unlock()
	if err != nil {
		if !lim.readErr {
			lim.e.log.Warn("cannot read the memory cgroup: the memory tier keeps its budget", "err", err)
		}
		lim.readErr = true
		return MemoryReading{}, false
	}
	lim.readErr = false
	if r.OOMKills > lim.oomKills {
		lim.e.stats.Warn("the kernel killed a process of this job for want of memory (memory cgroup OOM kill)")
		lim.e.log.Warn("OOM kill in the server's memory cgroup", "kills", r.OOMKills-lim.oomKills, "limit", r.Limit,
			"unreclaimable", r.Unreclaimable)
	}
	lim.oomKills = r.OOMKills
	return r, r.Limit < math.MaxInt64
}

// spillFrom returns the spill function for evictions from tier i: the victim moves to the
// tiers after it, if one takes it.
func (e *Engine) spillFrom(i int) func(*tiers.Mapping) {
	next := i + 1
	if next >= len(e.tiers) {
		return nil
	}
	return func(victim *tiers.Mapping) {
		e.stats.evictions.Add(1)
		if e.place(next, victim.Entry, content{data: victim.Bytes()}) == nil {
			e.stats.spilled.Add(1)
		}
	}
}

// statFS returns the size and the bytes available to unprivileged users of the file system
// holding dir.
func statFS(dir string) (total, free int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, err
	}
	if st.Bsize <= 0 {
		return 0, 0, errors.New("statfs: no block size")
	}
	return int64(st.Blocks) * st.Bsize, int64(st.Bavail) * st.Bsize, nil
}
