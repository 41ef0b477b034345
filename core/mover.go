package core

import (
	"errors"
	"sync"

	"github.com/fitcache/fitcache/tiers"
)

// mover is the background data mover: it publishes files read from the source into the
// tiers, one at a time, so at most one file is being written into the tiers by the mover at
// any moment (a burst of misses cannot fill a tier with half-written files).
type mover struct {
	e     *Engine
	limit int64 // bytes allowed to wait in the queue

	mu      sync.Mutex // protects queue, queued and closed
	cond    *sync.Cond // signalled when queue grows or closed is set
	queue   []job
	queued  int64
	closed  bool
	stopped chan struct{} // closed when the loop has exited
}

type job struct {
	entry  tiers.Entry
	flight *flight
}

func startMover(e *Engine, limit int64) *mover {
	m := &mover{e: e, limit: limit, stopped: make(chan struct{})}
	m.cond = sync.NewCond(&m.mu)
	go m.loop()
	return m
}

// enqueue hands a job to the mover; when the queue is full (or the mover stopped) the caller
// publishes the file itself, which slows readers down instead of growing memory without bound.
func (m *mover) enqueue(j job) {
	m.mu.Lock()
	if m.closed || (m.queued > 0 && m.queued+j.entry.Size > m.limit) {
		m.mu.Unlock()
		m.e.publish(j)
		return
	}
	m.queue = append(m.queue, j)
	m.queued += j.entry.Size
	m.cond.Signal()
	m.mu.Unlock()
}

func (m *mover) loop() {
	defer close(m.stopped)
	for {
		m.mu.Lock()
		for len(m.queue) == 0 && !m.closed {
			m.cond.Wait()
		}
		if len(m.queue) == 0 {
			m.mu.Unlock()
			return
		}
		j := m.queue[0]
		m.queue = m.queue[1:]
		m.mu.Unlock()

		m.e.publish(j)

		m.mu.Lock()
		m.queued -= j.entry.Size
		m.mu.Unlock()
	}
}

// stop publishes what is queued, then ends the loop.
func (m *mover) stop() {
	m.mu.Lock()
	m.closed = true
	m.cond.Signal()
	m.mu.Unlock()
	<-m.stopped
}

// testHookBeforePublish, when set by a test, runs before the mover places a file.
var testHookBeforePublish func(path string)

// publish places a job's file and ends its flight.
func (e *Engine) publish(j job) {
	defer e.land(j.entry.SourcePath, j.flight)
	if testHookBeforePublish != nil {
		testHookBeforePublish(j.entry.SourcePath)
	}
	if err := e.place(0, j.entry, content{data: j.flight.data}); err != nil {
		if errors.Is(err, tiers.ErrNoRoom) {
			e.stats.uncached.Add(1)
			return
		}
		e.stats.publishErrors.Add(1)
		e.log.Warn("publish", "path", j.entry.SourcePath, "err", err)
		return
	}
	e.stats.published.Add(1)
	e.dropIfForgotten(j.flight, j.entry.SourcePath)
}

// content is what place writes into a tier: bytes in memory, or a source file, read anew
// for each attempt.
type content struct {
	data     []byte
	src      *Source // when set, data is unused: the entry's bytes are the source's from off
	off      int64
	fill     *tiers.Fill // when set, data and src are unused: a reader's fill file (see RecordFill)
	fillTier *tiers.Tier // the tier that holds fill
}

func (c content) publish(t *tiers.Tier, entry tiers.Entry) error {
	if c.fill != nil {
		return publishFill(t, c.fillTier, entry, c.fill)
	}
	if c.src != nil {
		return t.PublishFrom(entry, c.src.RangeReader(c.off, entry.Size))
	}
	return t.Publish(entry, c.data)
}

// place publishes a file into the fastest tier from index first on that has room without
// eviction; if none has, into the fastest tier that can hold it at all, after evicting its
// oldest files, which spill into the next tiers the same way. It returns ErrNoRoom when the
// file is larger than every tier from first on. Several goroutines may place files at once:
// each tier reserves room for a file before writing it, so budgets hold.
func (e *Engine) place(first int, entry tiers.Entry, c content) error {
	need := tiers.EntrySize(entry.SourcePath, entry.Size)
	candidates := e.tiers[first:]
	for _, t := range candidates {
		if t.HasRoom(need) {
			err := c.publish(t, entry)
			if err == nil || !errors.Is(err, tiers.ErrNoRoom) {
				return err
			}
		}
	}
	if e.noEvict(entry.SourcePath) {
		// Prefetch evicts no file of the server's own (see Engine.Prefetch), but node-local
		// copies of other servers' files never hold one back: without this, a node's
		// prefetch of its readers' list found the room its own files need taken by copies,
		// and those files were read from the source again at every epoch.
		for _, t := range candidates {
			// Another fill may take the room between EvictGuests and publish (publish
			// reserves it before writing anything): a few tries, as below. With one, a
			// prefetch of 4 files into a tier full of guests stopped at "budget" within 200
			// runs on a loaded machine (TestPrefetchOfOwnFilesPushesGuestsOut, which failed
			// once in CI); with three, 800 runs passed.
			for try := 0; try < 3; try++ {
				if !t.CanHold(need) || !t.HasRoomForOwn(need) || t.EvictGuests(need) != nil { // never in vain
					break
				}
				if err := c.publish(t, entry); err == nil || !errors.Is(err, tiers.ErrNoRoom) {
					return err
				}
			}
		}
		return tiers.ErrNoRoom
	}
	for i, t := range candidates {
		if !t.CanHold(need) {
			continue
		}
		next := first + i + 1
		var err error
		// Another file may take the room between MakeRoom and publish (publish reserves it
		// before writing anything, so trying again costs nothing): a few tries, so that a race
		// is not taken for a tier full of the dataset being read.
		for try := 0; try < 3; try++ {
			err = t.MakeRoom(need, entry.Group, func(victim *tiers.Mapping) {
				e.stats.evictions.Add(1)
				if next < len(e.tiers) && e.place(next, victim.Entry, content{data: victim.Bytes()}) == nil {
					e.stats.spilled.Add(1)
				}
			})
			if err == nil {
				err = c.publish(t, entry)
			}
			if err == nil || !errors.Is(err, tiers.ErrNoRoom) {
				return err
			}
		}
	}
	return tiers.ErrNoRoom
}
