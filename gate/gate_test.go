package gate

import (
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestRateLogWritesOneLinePerKeyPerInterval(t *testing.T) {
	now := time.Unix(1000, 0)
	l := &RateLog{Every: 10 * time.Second, Now: func() time.Time { return now }}
	for _, step := range []struct {
		key        string
		advance    time.Duration
		write      bool
		suppressed int
	}{
		{"10.0.0.1", 0, true, 0},
		{"10.0.0.1", time.Second, false, 0},
		{"10.0.0.1", time.Second, false, 0},
		{"10.0.0.2", 0, true, 0},
		{"10.0.0.1", 9 * time.Second, true, 2},
		{"10.0.0.1", time.Second, false, 0},
	} {
		now = now.Add(step.advance)
		write, suppressed := l.Allow(step.key)
		if write != step.write || suppressed != step.suppressed {
			t.Errorf("line for %s after %v: got %v, %d suppressed, want %v, %d", step.key, step.advance,
				write, suppressed, step.write, step.suppressed)
		}
	}
}

// nopCloser is a connection stand-in for Pending.
type nopCloser struct{ id int }

func (*nopCloser) Close() error { return nil }

// A key past its share gives up its oldest place; keys past the places in all give up the
// oldest of any other key; Own has places of its own, as many as in all.
func TestPendingTakesTheOldestPlace(t *testing.T) {
	p := &Pending{PerPeer: 2, Total: 3, Own: "own"}
	a1, a2, a3, b1, c1 := &nopCloser{1}, &nopCloser{2}, &nopCloser{3}, &nopCloser{4}, &nopCloser{5}
	for _, step := range []struct {
		key       string
		c         *nopCloser
		victim    *nopCloser
		victimKey string
	}{
		{"a", a1, nil, ""},
		{"a", a2, nil, ""},
		{"a", a3, a1, "a"}, // a's share
		{"b", b1, nil, ""},
		{"c", c1, a2, "a"}, // the places in all: the oldest is a2
	} {
		time.Sleep(time.Millisecond) // distinct start times (their order is what is checked)
		v, vk := p.Start(step.key, step.c)
		if step.victim != nil && v != step.victim || step.victim == nil && v != nil || vk != step.victimKey {
			t.Errorf("start %s/%d: got victim %v of %q, want %v of %q", step.key, step.c.id, v, vk, step.victim, step.victimKey)
		}
	}
	own := []*nopCloser{{100}, {101}, {102}, {103}}
	for i, c := range own {
		v, _ := p.Start("own", c)
		if want := i == len(own)-1; (v != nil) != want || want && v != own[0] {
			t.Errorf("own connection %d: got victim %v, want one: %v", i, v, want)
		}
	}
	if got, want := p.Len(), 6; got != want { // a3, b1, c1 and 3 of own's
		t.Errorf("places held: got %d, want %d", got, want)
	}
	p.End("b", b1)
	p.End("b", b1) // no place any more: nothing
	if got, want := p.Len(), 5; got != want {
		t.Errorf("places held after End: got %d, want %d", got, want)
	}
}

// TestPeerUID: the kernel names this process's user as the owner of a connection it made
// to itself, over TCP and over a Unix socket.
func TestPeerUID(t *testing.T) {
	for _, network := range []string{"tcp", "unix"} {
		addr := "127.0.0.1:0"
		if network == "unix" {
			addr = filepath.Join(t.TempDir(), "s")
		}
		ln, err := net.Listen(network, addr)
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		c, err := net.Dial(network, ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if uid, ok := PeerUID(s); !ok || uid != uint32(os.Getuid()) {
			t.Errorf("%s: peer uid %d (%v), want %d", network, uid, ok, os.Getuid())
		}
		if got, want := PeerKey(s), UserKey(uint32(os.Getuid())); got != want {
			t.Errorf("%s: pending key %q, want %q", network, got, want)
		}
	}
}
