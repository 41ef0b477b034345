package gate

import (
	"sync"
	"time"
)

// RateLog decides which log lines about refused peers are written: at most one per key (a
// peer host, say) per interval, with the number left unwritten since the key's previous
// line, so that a peer hammering a port with a wrong token or junk cannot flood the log. The
// zero value writes every line; it is safe for concurrent use.
type RateLog struct {
	Every time.Duration    // at most one line per key per Every
	Now   func() time.Time // nil means time.Now

	mu   sync.Mutex // protects keys
	keys map[string]*keyLines
}

type keyLines struct {
	logged     time.Time // when the key's last line was written
	suppressed int       // lines since then, not written
}

// maxRateKeys bounds the keys remembered; past it, keys quiet for an interval are
// forgotten, and if none is, all are.
const maxRateKeys = 4096

// Allow counts a line for key and reports whether to write it (the key had no line for an
// interval) and, if so, how many of its lines were left unwritten since its last one.
func (l *RateLog) Allow(key string) (write bool, suppressed int) {
	now := time.Now
	if l.Now != nil {
		now = l.Now
	}
	t := now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		l.keys = make(map[string]*keyLines)
	}
	k, ok := l.keys[key]
	if ok && t.Sub(k.logged) < l.Every {
		k.suppressed++
		return false, 0
	}
	if ok {
		suppressed = k.suppressed
	} else {
		l.forget(t)
		k = &keyLines{}
		l.keys[key] = k
	}
	k.logged, k.suppressed = t, 0
	return true, suppressed
}

// forget makes room for a new key. l.mu must be held.
func (l *RateLog) forget(t time.Time) {
	if len(l.keys) < maxRateKeys {
		return
	}
	for key, k := range l.keys {
		if t.Sub(k.logged) >= l.Every {
			delete(l.keys, key)
		}
	}
	if len(l.keys) >= maxRateKeys {
		clear(l.keys)
	}
}
