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
// clients share its node, is not held back by the limit in all. An excess connection is
// closed at once (a client takes that as a server too busy to answer, not as a dead one).
// Refused connections are counted and logged through refuse. Authentication runs in a
// goroutine per connection with a deadline, so a slow client delays no one else.
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

	mu      sync.Mutex     // protects pending
	pending map[string]int // connections authenticating, by pendingKey
}

// Limits on connections that have not authenticated yet.
const (
	maxPending        = 128 // in all, but for the server's own user on this host
	maxPendingPerPeer = 16  // per host, or per user on this host
)

func newGuardListener(inner net.Listener, keys *jobKeys, maxConns int, timeout time.Duration,
	refuse func(peer, reason string)) *guardListener {
	g := &guardListener{inner: inner, keys: keys, maxConns: int64(maxConns),
		timeout: timeout, refuse: refuse, ready: make(chan net.Conn), done: make(chan struct{}),
		pending: make(map[string]int), ownUser: userKey(uint32(os.Getuid()))}
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
		if !g.startPending(key) {
			g.active.Add(-1)
			g.refuse(host, "too many connections authenticating from "+key)
			c.Close()
			continue
		}
		go g.authenticate(&countedConn{Conn: c, active: &g.active}, key)
	}
}

// startPending takes a place for a connection counted by key to authenticate, if one is free.
func (g *guardListener) startPending(key string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pending[key] >= maxPendingPerPeer {
		return false
	}
	if key != g.ownUser {
		total := 0
		for k, n := range g.pending {
			if k != g.ownUser {
				total += n
			}
		}
		if total >= maxPending {
			return false
		}
	}
	g.pending[key]++
	return true
}

func (g *guardListener) endPending(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pending[key]--; g.pending[key] <= 0 {
		delete(g.pending, key)
	}
}

// authenticate runs the server's side of the handshake on c and hands c to Accept, or closes
// it. A refusal is counted before the connection is closed.
func (g *guardListener) authenticate(c *countedConn, key string) {
	c.SetDeadline(time.Now().Add(g.timeout))
	err := serverHandshake(c, g.keys)
	g.endPending(key)
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
