package gate

import (
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"time"
)

// Pending holds the places of a port's connections that have not authenticated yet, by
// PeerKey: a peer on another host can only use the few places of its host, and a peer on this
// host the few places of its user, whatever address it connects from; the server's own user
// (Own), whose processes share its node, is not held back by the limit in all. When a new
// connection finds its share (or the places in all) taken, the oldest connection still
// authenticating there gives up its place (Start returns it, for the caller to close): a
// peer of the job needs its place for one round trip, so a user who shares its host and
// holds the host's places with half-sent handshakes must open connections faster than that
// to keep it out, instead of just holding them. The zero value has the default limits and no
// Own; it is safe for concurrent use.
type Pending struct {
	PerPeer int    // places per key (0: MaxPendingPerPeer)
	Total   int    // places in all, but for Own (0: MaxPending)
	Own     string // the key with Total places of its own: OwnUser(), or "" for none

	mu sync.Mutex // protects m
	m  map[string][]pendingConn
}

// pendingConn is a connection still authenticating.
type pendingConn struct {
	c     io.Closer
	since time.Time
}

// Default limits on connections that have not authenticated yet.
//
// The server's own user on this host has MaxPending places of its own: its processes are the
// job's own (the servers of a job on one host, as the loopback benchmarks run them, its
// readers), which could stop the server anyway; at MaxPendingPerPeer, bursts of their
// connections had the RPC server close some of them.
const (
	MaxPending        = 128 // in all, but for the server's own user on this host
	MaxPendingPerPeer = 16  // per host, or per other user on this host
)

// Start takes a place for c, a connection counted by key, to authenticate. When key's share,
// or the places in all (for any key but Own), are taken, it takes the place of the oldest
// connection there and returns it, and the key it was counted by, for the caller to close.
func (p *Pending) Start(key string, c io.Closer) (victim io.Closer, victimKey string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = make(map[string][]pendingConn)
	}
	share, total := p.PerPeer, p.Total
	if share <= 0 {
		share = MaxPendingPerPeer
	}
	if total <= 0 {
		total = MaxPending
	}
	if key == p.Own && p.Own != "" {
		share = total
	}
	switch {
	case len(p.m[key]) >= share:
		victim, victimKey = p.m[key][0].c, key
	case key != p.Own && p.others() >= total:
		var oldest time.Time
		for k, l := range p.m {
			if k != p.Own && len(l) > 0 && (victim == nil || l[0].since.Before(oldest)) {
				victim, victimKey, oldest = l[0].c, k, l[0].since
			}
		}
	}
	if victim != nil {
		p.drop(victimKey, victim)
	}
	p.m[key] = append(p.m[key], pendingConn{c: c, since: time.Now()})
	return victim, victimKey
}

// End gives back c's place (it authenticated or failed), if it still has one.
func (p *Pending) End(key string, c io.Closer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.drop(key, c)
}

// Len returns the number of connections holding a place.
func (p *Pending) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, l := range p.m {
		n += len(l)
	}
	return n
}

// others counts the connections authenticating but Own's (p.mu held).
func (p *Pending) others() int {
	n := 0
	for k, l := range p.m {
		if k != p.Own {
			n += len(l)
		}
	}
	return n
}

// drop removes c from key's connections authenticating, if it is there (p.mu held).
func (p *Pending) drop(key string, c io.Closer) {
	l := p.m[key]
	for i, pc := range l {
		if pc.c == c {
			l = append(l[:i:i], l[i+1:]...)
			break
		}
	}
	if len(l) == 0 {
		delete(p.m, key)
	} else {
		p.m[key] = l
	}
}

// PeerKey is what connections still authenticating are counted by: the peer's user when the
// peer is on this host and the kernel says who it is, else the peer's host.
func PeerKey(c net.Conn) string {
	if uid, ok := PeerUID(c); ok {
		return UserKey(uid)
	}
	return PeerHost(c.RemoteAddr())
}

// UserKey is the PeerKey of the connections of user uid from this host.
func UserKey(uid uint32) string {
	return "uid " + strconv.FormatUint(uint64(uid), 10) + " on this host"
}

// OwnUser is the PeerKey of this process's user's connections from this host.
func OwnUser() string { return UserKey(uint32(os.Getuid())) }

// PeerHost returns the host part of a peer's address ("unix" for Unix sockets), which is what
// refusals are grouped by: a client's port changes with every connection.
func PeerHost(a net.Addr) string {
	if a == nil {
		return "unknown"
	}
	if a.Network() == "unix" {
		return "unix"
	}
	host, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String()
	}
	return host
}
