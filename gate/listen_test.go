package gate

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"
)

// resolvesTo is a Lookup that gives every name addrs.
func resolvesTo(addrs ...string) Lookup {
	return func(context.Context, string) ([]netip.Addr, error) {
		var out []netip.Addr
		for _, a := range addrs {
			out = append(out, netip.MustParseAddr(a))
		}
		return out, nil
	}
}

// ListenTCP listens on every address a name resolves to, on one port, and leaves out those
// that are not on this host; the listener accepts on each and closes them all.
func TestListenTCPTakesEveryAddressOfAName(t *testing.T) {
	if ln, err := net.Listen("tcp", "[::1]:0"); err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	} else {
		ln.Close()
	}
	for _, tc := range []struct {
		name      string
		addrs     []string // what the name resolves to
		listening []string // the addresses listened on, Addr's first
	}{
		{"both families", []string{"::1", "127.0.0.1", "::ffff:127.0.0.1"}, []string{"127.0.0.1", "::1"}},
		{"one not on this host", []string{"192.0.2.1", "127.0.0.1"}, []string{"127.0.0.1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := ListenTCP(context.Background(), "fitcache-listen.test:0", resolvesTo(tc.addrs...))
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
			if got, want := ln.Addr().String(), net.JoinHostPort(tc.listening[0], port); got != want {
				t.Errorf("Addr() = %s, want %s", got, want)
			}
			for _, host := range tc.listening {
				addr := net.JoinHostPort(host, port)
				c, err := net.DialTimeout("tcp", addr, 5*time.Second)
				if err != nil {
					t.Fatalf("dial %s: %v", addr, err)
				}
				got, err := ln.Accept()
				c.Close()
				if err != nil {
					t.Fatalf("accept from %s: %v", addr, err)
				}
				if got.LocalAddr().String() != addr {
					t.Errorf("a connection to %s accepted at %s", addr, got.LocalAddr())
				}
				got.Close()
			}
			if err := ln.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			if _, err := ln.Accept(); !errors.Is(err, net.ErrClosed) {
				t.Errorf("Accept after Close: %v, want net.ErrClosed", err)
			}
			for _, host := range tc.listening { // closed: free again
				again, err := net.Listen("tcp", net.JoinHostPort(host, port))
				if err != nil {
					t.Errorf("%s:%s after Close: %v", host, port, err)
					continue
				}
				again.Close()
			}
		})
	}
	if _, err := ListenTCP(context.Background(), "fitcache-listen.test:0", resolvesTo("192.0.2.1")); err == nil {
		t.Error("a name of no address on this host: listened anyway")
	}
}
