package rpc

import (
	"net"
	"sync"
	"time"

	"github.com/fitcache/fitcache/gate"
)

// guardListener hands Kitex only connections that passed the handshake (see handshake.go),
// and at most maxConns at a time (counting those still authenticating), through a
// gate.Admitter: connections that have not authenticated yet are further limited, in all and
// per peer (a host, or a user on this host), so that whoever can reach the port without the
// token cannot take the places of the job's clients; a new connection that finds its share
// taken closes the oldest one still authenticating there. Connections past maxConns are closed
// at once (a client takes that as a server too busy to answer, not as a dead one). Closed
// connections are counted and logged through refuse. Authentication runs in a goroutine per
// connection with a deadline, so a slow client delays no one else.
type guardListener struct {
	inner   net.Listener
	keys    *jobKeys
	timeout time.Duration             // for the handshake
	refuse  func(peer, reason string) // counts and logs a refused connection

	admit gate.Admitter
	ready chan net.Conn // authenticated connections waiting for Accept
	done  chan struct{} // closed by Close
	once  sync.Once     // closes done
}

func newGuardListener(inner net.Listener, keys *jobKeys, maxConns int, timeout time.Duration,
	refuse func(peer, reason string)) *guardListener {
	g := &guardListener{inner: inner, keys: keys, timeout: timeout, refuse: refuse,
		ready: make(chan net.Conn), done: make(chan struct{}),
		admit: gate.Admitter{MaxConns: int64(maxConns), Pending: gate.Pending{Own: gate.OwnUser()},
			KeyOf: func(c net.Conn) string { return pendingKeyOf(c) }, Refuse: refuse}}
	go func() {
		g.admit.Serve(inner, g.done, g.authenticate)
		g.Close()
	}()
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
func (g *guardListener) Active() int { return g.admit.Open() }

// authenticate runs the server's side of the handshake on c and hands c to Accept, or closes
// it. A refusal is counted before the connection is closed.
func (g *guardListener) authenticate(c *gate.Conn, key string) {
	c.SetDeadline(time.Now().Add(g.timeout))
	err := serverHandshake(c, g.keys)
	g.admit.Pending.End(key, c)
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

// String describes the listener without reading its state (Kitex prints its options).
func (g *guardListener) String() string {
	return "fitcache handshake guard on " + g.inner.Addr().String()
}
