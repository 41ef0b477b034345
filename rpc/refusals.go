package rpc

import (
	"log/slog"
	"sync"
	"time"
)

// refusalLog logs refused connections and requests at most once per peer per interval,
// with the number of refusals left unlogged since the peer's previous line, so that a client
// hammering the server with a wrong token cannot flood the log. It is safe for concurrent use.
type refusalLog struct {
	log   *slog.Logger
	every time.Duration    // at most one line per peer per every
	now   func() time.Time // nil means time.Now

	mu    sync.Mutex // protects peers
	peers map[string]*peerRefusals
}

type peerRefusals struct {
	logged     time.Time // when the peer's last line was written
	suppressed int       // refusals since then, not logged
}

// maxRefusalPeers bounds the peers remembered; past it, peers quiet for an interval are
// forgotten, and if none is, all are.
const maxRefusalPeers = 4096

// refuse counts a refusal of peer (a host, without port) and logs it unless the peer had a
// line less than an interval ago.
func (l *refusalLog) refuse(peer, reason string) {
	now := time.Now
	if l.now != nil {
		now = l.now
	}
	t := now()
	l.mu.Lock()
	if l.peers == nil {
		l.peers = make(map[string]*peerRefusals)
	}
	p, ok := l.peers[peer]
	if ok && t.Sub(p.logged) < l.every {
		p.suppressed++
		l.mu.Unlock()
		return
	}
	suppressed := 0
	if ok {
		suppressed = p.suppressed
	} else {
		l.forget(t)
		p = &peerRefusals{}
		l.peers[peer] = p
	}
	p.logged, p.suppressed = t, 0
	l.mu.Unlock()
	l.log.Warn("refused a client", "peer", peer, "reason", reason, "suppressed_since_last", suppressed)
}

// forget makes room for a new peer. l.mu must be held.
func (l *refusalLog) forget(t time.Time) {
	if len(l.peers) < maxRefusalPeers {
		return
	}
	for k, p := range l.peers {
		if t.Sub(p.logged) >= l.every {
			delete(l.peers, k)
		}
	}
	if len(l.peers) >= maxRefusalPeers {
		clear(l.peers)
	}
}
