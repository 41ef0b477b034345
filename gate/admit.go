package gate

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Admitter runs the accept loop of a port whose connections must authenticate before
// anything they send is read: it closes at once a connection past MaxConns open (counting
// those still authenticating), takes a place in Pending for each other one (closing the
// oldest where its share is taken), and authenticates each in a goroutine of its own, so that
// a slow peer delays no one else. Closed connections are counted and logged through Refuse.
// Set its fields before Serve; it is safe for concurrent use.
type Admitter struct {
	MaxConns int64                     // connections open at once (authenticating or not)
	Pending  Pending                   // places of the connections authenticating
	KeyOf    func(net.Conn) string     // what Pending counts by; nil means PeerKey
	Refuse   func(host, reason string) // counts and logs a refused connection

	open atomic.Int64 // connections accepted and not closed
}

// Conn is an accepted connection, which holds a place among its Admitter's open connections
// until it is closed.
type Conn struct {
	net.Conn
	a    *Admitter
	once sync.Once
}

// NetConn returns the connection accepted, for a transport to reach its socket.
func (c *Conn) NetConn() net.Conn { return c.Conn }

// Close closes the connection and gives back its place.
func (c *Conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.a.open.Add(-1) })
	return err
}

// Open returns the number of connections open, authenticating or not.
func (a *Admitter) Open() int { return int(a.open.Load()) }

// Serve accepts connections from ln until ln is closed, or an accept fails after done was
// closed, and runs authenticate(c, key) for each admitted one in a goroutine of its own. The
// authentication must end with Pending.End(key, c), then hand c on or close it.
func (a *Admitter) Serve(ln net.Listener, done <-chan struct{}, authenticate func(c *Conn, key string)) {
	keyOf := a.KeyOf
	if keyOf == nil {
		keyOf = PeerKey
	}
	backoff := 5 * time.Millisecond
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors or the like: wait a little, as net/http does.
			select {
			case <-done:
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		if a.open.Add(1) > a.MaxConns {
			a.open.Add(-1)
			a.Refuse(PeerHost(c.RemoteAddr()), "too many connections")
			c.Close()
			continue
		}
		key := keyOf(c)
		ac := &Conn{Conn: c, a: a}
		if victim, from := a.Pending.Start(key, ac); victim != nil {
			v := victim.(*Conn)
			a.Refuse(PeerHost(v.RemoteAddr()), "closed to make room: too many connections authenticating from "+from)
			v.Close() // its authentication fails, and its goroutine ends
		}
		go authenticate(ac, key)
	}
}
