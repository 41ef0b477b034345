package rpc

import (
	"errors"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// guardListener hands Kitex only connections that passed the handshake (see handshake.go),
// and at most maxConns at a time (counting those still authenticating). Connections that have
// not authenticated yet are further limited, in all and per peer, so that whoever can reach
// the port without the token cannot take the places of the job's clients: a peer on another
// host can only use the few places of its host, and a peer on this host the few places of its
// user (see peerUID), whatever address it connects from; the server's own user, whose
// clients share its node, is not held back by the limit in all. When a new connection finds
// its share (or the places in all) taken, the oldest connection still authenticating there
// is closed to make room: a client of the job needs its place for one round trip, so a user
// who shares its host (a node of the job) and holds the host's places with half-sent
// handshakes must open connections faster than that to keep it out, instead of just holding
// them. Connections past maxConns are closed at once (a client takes that as a server too
// busy to answer, not as a dead one). Closed connections are counted and logged through
// refuse. Authentication runs in a goroutine per connection with a deadline, so a slow client
// delays no one else.
type guardListener struct {
	inner    net.Listener
	keys     *jobKeys
	maxConns int64
	timeout  time.Duration             // for the handshake
	refuse   func(peer, reason string) // counts and logs a refused connection
	ownUser  string                    // pendingKey of this server's user's connections from this host

	active atomic.Int64  // connections open, authenticated or authenticating
	ready  chan net.Conn // authenticated connections waiting for Accept
	done   chan struct{} // closed by Close
	once   sync.Once     // closes done

	mu      sync.Mutex               // protects pending
	pending map[string][]pendingConn // connections authenticating, by pendingKey, oldest first
}

// pendingConn is a connection still authenticating.
type pendingConn struct {
	c     *countedConn
	since time.Time
}

// Limits on connections that have not authenticated yet.
//
// The server's own user on this host has maxPending places of its own: its processes are the
// job's own (the servers of a job on one host, as the loopback benchmarks run them, its
// readers), which could stop the server anyway; at maxPendingPerPeer, bursts of their
// connections had the server close some of them.
const (
	maxPending        = 128 // in all, but for the server's own user on this host
	maxPendingPerPeer = 16  // per host, or per other user on this host
)

func newGuardListener(inner net.Listener, keys *jobKeys, maxConns int, timeout time.Duration,
	refuse func(peer, reason string)) *guardListener {
	g := &guardListener{inner: inner, keys: keys, maxConns: int64(maxConns),
		timeout: timeout, refuse: refuse, ready: make(chan net.Conn), done: make(chan struct{}),
		pending: make(map[string][]pendingConn), ownUser: userKey(uint32(os.Getuid()))}
	go g.acceptLoop()
	return g
}

// pendingKeyOf is pendingKey, which tests replace to see connections as from other hosts.
var pendingKeyOf = pendingKey

// pendingKey is what connections still authenticating are counted by: the peer's user when
// the peer is on this host and the kernel says who it is, else the peer's host.
func pendingKey(c net.Conn) string {
	if uid, ok := peerUID(c); ok {
		return userKey(uid)
	}
	return peerHost(c.RemoteAddr())
}

func userKey(uid uint32) string {
	return "uid " + strconv.FormatUint(uint64(uid), 10) + " on this host"
}

// Accept returns the next authenticated connection.
func (g *guardListener) Accept() (net.Conn, error) {
	select {
	case c := <-g.ready:
		return c, nil
	case <-g.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting; connections already handed out stay open.
func (g *guardListener) Close() error {
	g.once.Do(func() { close(g.done) })
	return g.inner.Close()
}

// Addr returns the inner listener's address.
func (g *guardListener) Addr() net.Addr { return g.inner.Addr() }

// Active returns the number of open connections, authenticated or authenticating.
func (g *guardListener) Active() int { return int(g.active.Load()) }

func (g *guardListener) acceptLoop() {
	backoff := 5 * time.Millisecond
	for {
		c, err := g.inner.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				g.Close()
				return
			}
			// Out of descriptors or the like: wait a little, as net/http does.
			select {
			case <-g.done:
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		host := peerHost(c.RemoteAddr())
		if g.active.Add(1) > g.maxConns {
			g.active.Add(-1)
			g.refuse(host, "too many connections")
			c.Close()
			continue
		}
		key := pendingKeyOf(c)
		cc := &countedConn{Conn: c, active: &g.active}
		if victim, from := g.startPending(key, cc); victim != nil {
			g.refuse(peerHost(victim.RemoteAddr()), "closed to make room: too many connections authenticating from "+from)
			victim.Close() // its handshake fails, and its goroutine ends
		}
		go g.authenticate(cc, key)
	}
}

// startPending takes a place for c, a connection counted by key, to authenticate. When key's
// share, or the places in all (for any key but the server's own user's), are taken, it takes
// the place of the oldest connection there and returns it, and the key it was counted by, for
// the caller to close.
func (g *guardListener) startPending(key string, c *countedConn) (victim *countedConn, victimKey string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	share := maxPendingPerPeer
	if key == g.ownUser {
		share = maxPending
	}
	switch {
	case len(g.pending[key]) >= share:
		victim, victimKey = g.pending[key][0].c, key
	case key != g.ownUser && g.pendingOthers() >= maxPending:
		var oldest time.Time
		for k, l := range g.pending {
			if k != g.ownUser && len(l) > 0 && (victim == nil || l[0].since.Before(oldest)) {
				victim, victimKey, oldest = l[0].c, k, l[0].since
			}
		}
	}
	if victim != nil {
		g.dropPending(victimKey, victim)
	}
	g.pending[key] = append(g.pending[key], pendingConn{c: c, since: time.Now()})
	return victim, victimKey
}

// pendingOthers counts the connections authenticating but those of the server's own user
// (g.mu held).
func (g *guardListener) pendingOthers() int {
	n := 0
	for k, l := range g.pending {
		if k != g.ownUser {
			n += len(l)
		}
	}
	return n
}

// dropPending removes c from key's connections authenticating, if it is there (g.mu held).
func (g *guardListener) dropPending(key string, c *countedConn) {
	l := g.pending[key]
	for i, p := range l {
		if p.c == c {
			l = append(l[:i:i], l[i+1:]...)
			break
		}
	}
	if len(l) == 0 {
		delete(g.pending, key)
	} else {
		g.pending[key] = l
	}
}

func (g *guardListener) endPending(key string, c *countedConn) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.dropPending(key, c)
}

// authenticate runs the server's side of the handshake on c and hands c to Accept, or closes
// it. A refusal is counted before the connection is closed.
func (g *guardListener) authenticate(c *countedConn, key string) {
	c.SetDeadline(time.Now().Add(g.timeout))
	err := serverHandshake(c, g.keys)
	g.endPending(key, c)
	if err != nil {
		g.refuse(peerHost(c.RemoteAddr()), err.Error())
		c.Close()
		return
	}
	if c.SetDeadline(time.Time{}) != nil {
		c.Close()
		return
	}
	select {
	case g.ready <- c:
	case <-g.done:
		c.Close()
	}
}

// countedConn decrements active once when closed.
type countedConn struct {
	net.Conn
	active *atomic.Int64
	once   sync.Once
}

// NetConn returns the connection counted, for its transport to reach the socket (see conn).
func (c *countedConn) NetConn() net.Conn { return c.Conn }

// Close closes the connection and releases its place.
func (c *countedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.active.Add(-1) })
	return err
}

// peerHost returns the host part of a peer's address ("unix" for Unix sockets), which is
// what refusals are grouped by: a client's port changes with every connection.
func peerHost(a net.Addr) string {
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

// String describes the listener without reading its state (Kitex prints its options).
func (g *guardListener) String() string {
	return "fitcache handshake guard on " + g.inner.Addr().String()
}
