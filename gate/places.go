package gate

import (
	"net"
	"sync"
)

// PlacesListener returns a listener whose connections each hold a place of places, by
// PeerKey, for as long as they are open: a port that serves peers without authenticating
// them (the metrics port) then holds a bounded number of connections, and a new connection
// that finds its peer's share, or the places in all, taken closes the oldest one there
// instead of waiting behind it. So idle connections from one host cannot take the
// process's descriptors (the data and gossip ports need them), nor keep another host's
// scrapes out: a peer must open connections faster than a scrape's round trip to keep one
// out, as on the RPC port (see Pending).
func PlacesListener(ln net.Listener, places *Pending) net.Listener {
	return &placesListener{Listener: ln, places: places}
}

type placesListener struct {
	net.Listener
	places *Pending
}

// Accept implements net.Listener.
func (l *placesListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	pc := &placedConn{Conn: c, places: l.places, key: PeerKey(c)}
	if victim, _ := l.places.Start(pc.key, pc); victim != nil {
		victim.Close() // its place is already given to pc
	}
	return pc, nil
}

// placedConn is a connection holding a place, which it gives back when closed.
type placedConn struct {
	net.Conn
	places *Pending
	key    string
	once   sync.Once
}

// Close implements net.Conn.
func (c *placedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.places.End(c.key, c) })
	return err
}
