package core

import (
	"container/list"
	"crypto/sha256"
	"encoding/hex"
	"sync"
	"time"
)

// Validation sessions: a cached copy is served only while it matches the source's identity
// (size, modification and change times, inode: tiers.Identity), and that is checked once per
// file per job, not on every read (a stat of every file at every read would cost a parallel
// file system the metadata load the cache exists to spare it).
//
// A job (a training run: the processes that read one dataset object's files, or one `fitcache
// run`) begins a session when its first client says hello with the job's id, and its other
// clients, DataLoader workers started anew each epoch among them, join it. Sessions are
// numbered upwards. Each copy's index slot records the last session in which the server found
// it to match its source (tiers.Tier.Validate); a reader of session s serves a copy only if it
// was checked in s or later, and otherwise asks the server, which checks it (one stat of the
// source) before answering. The checks are made ahead of the readers, in bulk, by the job's
// prefetch, which walks the dataset's file list in the readers' order; a copy whose source
// changed is dropped and read again.
//
// An engine begins a session of its own when it starts, so that a restarted server checks
// every copy it finds in its tiers before serving it (a rescan marks every copy unchecked).
//
// Numbers keep growing across restarts: a reader keeps the number its server gave it (the C
// hit path, the preload shim), and one higher than what a restarted server hands out would
// ask the server for every copy until the numbers caught up. So a new session gets at least
// the seconds since sessionEpoch, and at least one more than the last session the server
// before recorded in its tiers (tiers.Tier.NoteSession), whichever is more.

// sessionEpoch is where session numbers start (a uint32 of seconds lasts until 2160).
var sessionEpoch = time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)

// maxSessions bounds the jobs an engine remembers; the least recently seen is forgotten
// first, and a client of a forgotten job that says hello again begins a new session (its
// copies are checked once more).
const maxSessions = 4096

// sessions numbers an engine's validation sessions. It is safe for concurrent use.
type sessions struct {
	now func() time.Time

	mu     sync.Mutex               // protects latest, byJob and order
	latest uint32                   // the last session begun
	byJob  map[string]*list.Element // job id -> its element in order (a *jobSession)
	order  list.List                // jobs, least recently seen first
}

type jobSession struct {
	job     string
	session uint32
}

// newSessions returns the sessions of an engine whose tiers recorded last as the last
// session begun, and begins the engine's own.
func newSessions(now func() time.Time, last uint32) *sessions {
	if now == nil {
		now = time.Now
	}
	s := &sessions{now: now, byJob: make(map[string]*list.Element), latest: last}
	s.latest = s.next()
	return s
}

// next returns the number of a new session (s.mu held, or during construction).
func (s *sessions) next() uint32 {
	secs := s.now().Sub(sessionEpoch) / time.Second
	return max(s.latest+1, uint32(max(secs, 1)))
}

// maxJobBytes bounds the job ids kept as they are; a longer one is kept as its digest.
const maxJobBytes = 128

// begin returns the session of job, and whether it began now (the job had none).
func (s *sessions) begin(job string) (session uint32, began bool) {
	if len(job) > maxJobBytes {
		sum := sha256.Sum256([]byte(job))
		job = "sha256:" + hex.EncodeToString(sum[:])
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if el, ok := s.byJob[job]; ok {
		s.order.MoveToBack(el)
		return el.Value.(*jobSession).session, false
	}
	s.latest = s.next()
	s.byJob[job] = s.order.PushBack(&jobSession{job: job, session: s.latest})
	if s.order.Len() > maxSessions {
		oldest := s.order.Front()
		s.order.Remove(oldest)
		delete(s.byJob, oldest.Value.(*jobSession).job)
	}
	return s.latest, true
}

// current returns the last session begun: a copy checked in it or later may be served to
// every session.
func (s *sessions) current() uint32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.latest
}
