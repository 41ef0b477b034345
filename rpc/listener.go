package rpc

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fitcache/fitcache/gate"
)

// guardListener hands Kitex only connections that passed the handshake (see handshake.go),
// and at most maxConns at a time (counting those still authenticating). Connections that have
// not authenticated yet are further limited, in all and per peer (gate.Pending: a host, or a
// user on this host), so that whoever can reach the port without the token cannot take the
// places of the job's clients; a new connection that finds its share taken closes the oldest
// one still authenticating there. Connections past maxConns are closed at once (a client takes
// that as a server too busy to answer, not as a dead one). Closed connections are counted and
// logged through refuse. Authentication runs in a goroutine per connection with a deadline, so
// a slow client delays no one else.
type guardListener struct {
	inner    net.Listener
	keys     *jobKeys
	maxConns int64
	timeout  time.Duration             // for the handshake
	refuse   func(peer, reason string) // counts and logs a refused connection

	active  atomic.Int64  // connections open, authenticated or authenticating
	ready   chan net.Conn // authenticated connections waiting for Accept
	done    chan struct{} // closed by Close
	once    sync.Once     // closes done
	pending gate.Pending  // connections authenticating
}

func newGuardListener(inner net.Listener, keys *jobKeys, maxConns int, timeout time.Duration,
	refuse func(peer, reason string)) *guardListener {
	g := &guardListener{inner: inner, keys: keys, maxConns: int64(maxConns),
		timeout: timeout, refuse: refuse, ready: make(chan net.Conn), done: make(chan struct{}),
		pending: gate.Pending{Own: gate.OwnUser()}}
	go g.acceptLoop()
	return g
}

// pendingKeyOf is gate.PeerKey, which tests replace to see connections as from other hosts.
var pendingKeyOf = gate.PeerKey

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
		host := gate.PeerHost(c.RemoteAddr())
		if g.active.Add(1) > g.maxConns {
			g.active.Add(-1)
			g.refuse(host, "too many connections")
			c.Close()
			continue
		}
		key := pendingKeyOf(c)
		cc := &countedConn{Conn: c, active: &g.active}
		if victim, from := g.pending.Start(key, cc); victim != nil {
			v := victim.(*countedConn)
			g.refuse(gate.PeerHost(v.RemoteAddr()), "closed to make room: too many connections authenticating from "+from)
			v.Close() // its handshake fails, and its goroutine ends
		}
		go g.authenticate(cc, key)
	}
}

// authenticate runs the server's side of the handshake on c and hands c to Accept, or closes
// it. A refusal is counted before the connection is closed.
func (g *guardListener) authenticate(c *countedConn, key string) {
	c.SetDeadline(time.Now().Add(g.timeout))
	err := serverHandshake(c, g.keys)
	g.pending.End(key, c)
	if err != nil {
		g.refuse(gate.PeerHost(c.RemoteAddr()), err.Error())
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

// String describes the listener without reading its state (Kitex prints its options).
func (g *guardListener) String() string {
	return "fitcache handshake guard on " + g.inner.Addr().String()
}
