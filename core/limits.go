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
	// the job uses besides reclaimable page cache. Zero means DefaultMemoryReserve. The
	// larger of Reserve and SiteReserve (the site's, which a user may raise, not lower) is
	// kept.
	Reserve, SiteReserve tiers.SizeOrPercent
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
	e     *Engine
	l     Limits
	stop  chan struct{}
	once  sync.Once
	done  sync.WaitGroup
	slack int64 // hysteresis of the memory ceiling, in bytes of the last limit's reserve

	// The loop's own state (apply runs in one goroutine at a time: at start, then the loop).
	last     MemoryReading // the last reading of the cgroup that succeeded
	haveLast bool
	readErr  bool          // the last reading failed (logged once per run of failures)
	budgets  map[int]int64 // the memory ceiling last set per tier, held while room is within the slack
}

// spillPerApply bounds the bytes that one reading moves to a slower tier when the job's
// memory runs short: the rest is evicted outright, so that memory comes back at memory speed,
// not at the disk's.
const spillPerApply = 32 << 20

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
	lim := &limiter{e: e, l: l, stop: make(chan struct{}), budgets: make(map[int]int64)}
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

// close stops following the limits; a nil limiter is closed already. It is idempotent.
func (lim *limiter) close() {
	if lim == nil {
		return
	}
	lim.once.Do(func() { close(lim.stop) })
	lim.done.Wait()
}

// reserve returns the part of limit left to the job.
func (l Limits) reserve(limit int64) int64 {
	return max(l.Reserve.Resolve(limit), l.SiteReserve.Resolve(limit))
}

// apply reads the limits once and sets each tier's ceiling from them.
//
// The memory ceiling has a hysteresis of a quarter of the reserve (the slack): the tier is
// cut when the job's room is gone (down to the slack below it, so that the next small rise
// of the job's use costs nothing), grows when the room exceeds the slack, and holds its
// budget in between. Without it, every wiggle of the job's use (a fresh DataLoader worker, the
// allocator) evicted a few files of the dataset being read, which the next epoch read again.
func (lim *limiter) apply() {
	l, e := lim.l, lim.e
	room, haveRoom := int64(0), false // what the memory tiers may still take of the job's limit
	if mem, ok := lim.readMemory(); ok {
		reserve := l.reserve(mem.Limit)
		room, haveRoom = mem.Limit-reserve-mem.Unreclaimable, true
		lim.slack = reserve / 4
	}
	for i, t := range e.tiers {
		info := t.Info()
		// Bytes reserved for files being written are in used but not yet in the memory the
		// job uses: counted once, as written.
		used := info.Used - info.Writing
		ceil, why := int64(math.MaxInt64), ""
		lower := func(n int64, reason string) {
			if n < ceil {
				ceil, why = n, reason
			}
		}
		memoryCut := false
		if t.Kind == tiers.Memory {
			if haveRoom {
				lower(lim.memoryCeiling(i, used, room), "cgroup memory limit")
				memoryCut = room < 0
			}
			if l.MemoryPerUser > 0 {
				lower(l.MemoryPerUser-(lim.usedOf(true)-info.Used), "site memory_per_user")
			}
			if l.MemoryPerNode > 0 {
				if total, free, err := l.StatFS(t.Path); err == nil {
					lower(used+shared(l.MemoryPerNode-(total-free)), "site memory_per_node")
				}
			}
		} else if l.DiskPerUser > 0 {
			lower(l.DiskPerUser-(lim.usedOf(false)-info.Used), "site disk_per_user")
		}
		if l.KeepFree != (tiers.SizeOrPercent{}) {
			if total, free, err := l.StatFS(t.Path); err == nil {
				lower(used+shared(free-l.KeepFree.Resolve(total)), "file system free space")
			}
		}
		spill := e.spillFrom(i)
		if memoryCut && spill != nil {
			spill = spillUpTo(spillPerApply, spill)
		}
		budget, err := t.Ceil(ceil, why, spill)
		if err != nil {
			e.log.Warn("lowering a tier's budget", "tier", t.Path, "err", err)
		}
		if t.Kind == tiers.Memory && haveRoom {
			room -= max(budget-used, 0) // the room this tier may grow into is not another's
		}
		if i == 0 && t.Kind == tiers.Memory && budget-used < fillMargin {
			// Readers write their misses into the first tier before the server records
			// them: they stop while it has no room (see RecordFill).
			e.markFillRootsFull()
		}
	}
}

// shared returns the part of room left in a file system that this server may grow into
// before its next reading: half of it. The other users' servers read the same room and do not
// know of each other: each taking all of it, two would together take it twice over before
// either read again. Room already gone (negative) is given back whole.
func shared(room int64) int64 {
	if room > 0 {
		return room / 2
	}
	return room
}

// fillMargin is the room below which the first tier is marked full for readers' fills.
const fillMargin = 16 << 20

// memoryCeiling returns the ceiling of memory tier i, which holds used bytes, when the job's
// memory has room left (negative: over), with the hysteresis described at apply.
func (lim *limiter) memoryCeiling(i int, used, room int64) int64 {
	prev, held := lim.budgets[i]
	var ceil int64
	switch {
	case room < 0 || room > lim.slack || !held:
		ceil = used + room - lim.slack
	default: // within the slack: hold, never above what fits
		ceil = min(prev, used+room)
	}
	lim.budgets[i] = ceil
	return ceil
}

// usedOf returns the bytes held by the memory tiers (memory) or the other tiers.
func (lim *limiter) usedOf(memory bool) int64 {
	var n int64
	for _, t := range lim.e.tiers {
		if (t.Kind == tiers.Memory) == memory {
			n += t.Info().Used
		}
	}
	return n
}

// spillUpTo returns spill, doing nothing once it has been handed n bytes.
func spillUpTo(n int64, spill func(*tiers.Mapping)) func(*tiers.Mapping) {
	return func(m *tiers.Mapping) {
		if n > 0 {
			n -= int64(len(m.Bytes()))
			spill(m)
		}
	}
}

// readMemory reads the memory cgroup and reports OOM kills in it since the last reading. A
// reading that fails is replaced by the last that succeeded: the limit does not go away
// because a file could not be read once. ok is false when there is no limit to follow.
func (lim *limiter) readMemory() (MemoryReading, bool) {
	if lim.l.Memory == nil {
		return MemoryReading{}, false
	}
	r, err := lim.l.Memory()
	if err != nil {
		if !lim.readErr {
			lim.e.log.Warn("cannot read the memory cgroup: the memory tier keeps to the last reading", "err", err)
		}
		lim.readErr = true
		return lim.last, lim.haveLast && lim.last.Limit < math.MaxInt64
	}
	lim.readErr = false
	if lim.haveLast && r.OOMKills > lim.last.OOMKills {
		lim.e.stats.Warn("the kernel killed a process of this job for want of memory (memory cgroup OOM kill)")
		lim.e.log.Warn("OOM kill in the server's memory cgroup", "kills", r.OOMKills-lim.last.OOMKills, "limit", r.Limit,
			"unreclaimable", r.Unreclaimable)
	}
	lim.last, lim.haveLast = r, true
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
