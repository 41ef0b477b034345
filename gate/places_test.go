package gate

import (
	"net"
	"testing"
	"time"
)

// A connection past its peer's share takes the place of the oldest one, which is closed;
// one that closes gives its place back.
func TestPlacesListenerClosesTheOldestPastTheShare(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	places := &Pending{PerPeer: 2, Total: 8}
	ln := PlacesListener(inner, places)
	defer ln.Close()
	var clients, served []net.Conn
	defer func() {
		for _, c := range append(clients, served...) {
			c.Close()
		}
	}()
	for i := range 3 {
		c, err := net.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
		s, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		served = append(served, s)
		if got, want := places.Len(), min(i+1, 2); got != want {
			t.Errorf("after %d connections: %d places taken, want %d", i+1, got, want)
		}
	}
	// The first connection was closed by the server to make room: its client reads EOF.
	clients[0].SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := clients[0].Read(make([]byte, 1)); err == nil || n != 0 {
		t.Errorf("the oldest connection past the share: read %d bytes, %v; want it closed", n, err)
	}
	for _, c := range clients[1:] {
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); err == nil || !isTimeout(err) {
			t.Errorf("a connection within the share: %v, want it open (read timeout)", err)
		}
	}
	served[2].Close()
	if got := places.Len(); got != 1 {
		t.Errorf("after a close: %d places taken, want 1", got)
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}
