package server

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/gate"
)

// bothFamilies resolves every name to ::1 and 127.0.0.1, as an /etc/hosts that maps
// localhost to both does (the resolver's order, ::1 first, is the order clients dial in).
func bothFamilies(context.Context, string) ([]netip.Addr, error) {
	return []netip.Addr{netip.MustParseAddr("::1"), netip.MustParseAddr("127.0.0.1")}, nil
}

// portOnBothFamilies returns a port that nothing listens on at ::1 nor 127.0.0.1 (now), or
// skips the test on a host without IPv6.
func portOnBothFamilies(t *testing.T) int {
	t.Helper()
	for range 20 {
		v4, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := v4.Addr().(*net.TCPAddr).Port
		v6, err := net.Listen("tcp", net.JoinHostPort("::1", strconv.Itoa(port)))
		v4.Close()
		if err == nil {
			v6.Close()
			return port
		}
		if !strings.Contains(err.Error(), "address already in use") {
			t.Skipf("no IPv6 loopback here: %v", err)
		}
	}
	t.Fatal("no port free on both ::1 and 127.0.0.1 in 20 tries")
	return 0
}

// A host name that resolves to ::1 and 127.0.0.1: the server listens on both, so that
// another user cannot take the family it did not bind (clients dialling ::1 first met that
// listener and failed at start). A port another process holds on either address keeps the
// server from starting, with an error naming it.
func TestNameOfTwoFamiliesIsServedOnBoth(t *testing.T) {
	root, files := dataset(t, 2)
	port := strconv.Itoa(portOnBothFamilies(t))
	name := "fitcache-two-families.test:" + port
	for _, family := range []string{"::1", "127.0.0.1"} {
		squatter, err := net.Listen("tcp", net.JoinHostPort(family, port))
		if err != nil {
			t.Fatal(err)
		}
		cfg := tcpConfig(t, root)
		cfg.Listen, cfg.lookup = name, bothFamilies
		s, err := Start(cfg)
		squatter.Close()
		if err == nil {
			s.Close()
			t.Fatalf("another process holds %s: the server started on %s anyway", squatter.Addr(), name)
		}
		if !errors.Is(err, gate.ErrAddressTaken) || !strings.Contains(err.Error(), squatter.Addr().String()) {
			t.Errorf("another process holds %s: Start failed with %q, want gate.ErrAddressTaken naming it",
				squatter.Addr(), err)
		}
	}

	cfg := tcpConfig(t, root)
	cfg.Listen, cfg.lookup = name, bothFamilies
	s := start(t, cfg)
	if want := "127.0.0.1:" + port; s.Addr() != want {
		t.Errorf("Addr() = %s, want %s (IPv4 first, as net.Listen would take)", s.Addr(), want)
	}
	for _, family := range []string{"::1", "127.0.0.1"} {
		addr := net.JoinHostPort(family, port)
		readAll(t, addr, cfg.Token, root, files)
		if squatter, err := net.Listen("tcp", addr); err == nil {
			squatter.Close()
			t.Errorf("another process could listen on %s while the server serves %s", addr, name)
		}
	}
}
