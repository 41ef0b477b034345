package gate

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"syscall"
)

// Lookup resolves a host name to its addresses; nil means net.DefaultResolver.
type Lookup func(ctx context.Context, host string) ([]netip.Addr, error)

// ErrAddressTaken reports that another process holds the port on one of the addresses a
// host name resolves to (see ListenTCP).
var ErrAddressTaken = errors.New("address taken by another process")

// listenPortTries bounds how often ListenTCP picks a new port (port 0) when another process
// holds the one the kernel gave on a further address.
const listenPortTries = 8

// ListenTCP listens on addr (host:port) for connections of the job. When host is a name, it
// listens on every address the name resolves to, all on one port (port 0: one the kernel
// picks on the first address), and returns one listener for them all, whose Addr is the
// first IPv4 address (the one net.Listen would have taken), else the first.
//
// Every address, not one: a name such as localhost may resolve to both ::1 and 127.0.0.1,
// and net.Listen binds only one of them. Another user could then bind the other one at the
// same port, and clients, which dial the addresses in their resolver's order (::1 first),
// met that listener: the handshake kept the token from it, but the job's clients failed at
// start. Dialling only the family the server bound would need every client to know which
// one that was, on nodes whose resolvers may answer differently, and would leave the other
// address to whoever binds it; holding every address makes the name mean this server
// wherever it is dialled from. So a port another process holds on any of the addresses is
// an error wrapping ErrAddressTaken, and the server does not start; an address that is not
// on this host (EADDRNOTAVAIL: nobody here can bind it either) or of a family this host
// lacks is left out, as long as one address is left. A literal address or an empty host
// (every address) is a single listen, as with net.Listen.
func ListenTCP(ctx context.Context, addr string, lookup Lookup) (net.Listener, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	if _, perr := netip.ParseAddr(host); perr == nil || host == "" {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("listen on %s: %w", addr, err)
		}
		return ln, nil
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: port %q: %w", addr, port, err)
	}
	ips, err := ListenAddrs(ctx, host, lookup)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	for try := 1; ; try++ {
		ln, err := listenEvery(host, ips, int(p))
		if p != 0 || try == listenPortTries || !errors.Is(err, ErrAddressTaken) {
			if err != nil {
				return nil, fmt.Errorf("listen on %s: %w", addr, err)
			}
			return ln, nil
		}
	}
}

// ListenAddrs returns the addresses that ListenTCP listens on for the host name host: all
// it resolves to, IPv4 first, each once (IPv4-mapped IPv6 addresses as IPv4). Another
// listener of the same host (the servers' gossip) takes them all too, and advertises the
// first.
func ListenAddrs(ctx context.Context, host string, lookup Lookup) ([]netip.Addr, error) {
	if lookup == nil {
		lookup = func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}
	}
	found, err := lookup(ctx, host)
	if err != nil {
		return nil, err
	}
	var ips []netip.Addr
	for _, ip := range found {
		if ip = ip.Unmap(); !slices.Contains(ips, ip) {
			ips = append(ips, ip)
		}
	}
	if len(ips) == 0 {
		return nil, fmt.Errorf("%s resolves to no address", host)
	}
	slices.SortStableFunc(ips, func(a, b netip.Addr) int {
		switch {
		case a.Is4() == b.Is4():
			return 0
		case a.Is4():
			return -1
		}
		return 1
	})
	return ips, nil
}

// listenEvery listens on port (0: the one the kernel gives the first address) of each of
// ips, the addresses of host (see ListenTCP).
func listenEvery(host string, ips []netip.Addr, port int) (net.Listener, error) {
	var lns []net.Listener
	var skipped []error
	for _, ip := range ips {
		ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(ip, uint16(port))))
		switch {
		case err == nil:
			lns = append(lns, ln)
			if port == 0 {
				port = ln.Addr().(*net.TCPAddr).Port
			}
			continue
		case errors.Is(err, syscall.EADDRNOTAVAIL), errors.Is(err, syscall.EAFNOSUPPORT):
			skipped = append(skipped, err)
			continue
		case errors.Is(err, syscall.EADDRINUSE):
			err = fmt.Errorf("%w: %s, one of the addresses of %s, is in use (%v)", ErrAddressTaken,
				netip.AddrPortFrom(ip, uint16(port)), host, err)
		}
		for _, ln := range lns {
			ln.Close()
		}
		return nil, err
	}
	switch len(lns) {
	case 0:
		return nil, fmt.Errorf("none of the addresses of %s is on this host: %w", host, errors.Join(skipped...))
	case 1:
		return lns[0], nil
	}
	return newMultiListener(lns), nil
}

// multiListener accepts the connections of several listeners, one port on each of a host
// name's addresses. Accept returns them as they come, and the listeners' errors but the
// one of a closed listener; Close closes every listener.
type multiListener struct {
	lns      []net.Listener
	accepted chan acceptResult
	done     chan struct{} // closed by Close
	once     sync.Once     // closes done
}

type acceptResult struct {
	c   net.Conn
	err error
}

func newMultiListener(lns []net.Listener) *multiListener {
	m := &multiListener{lns: lns, accepted: make(chan acceptResult), done: make(chan struct{})}
	for _, ln := range lns {
		go m.acceptFrom(ln)
	}
	return m
}

// acceptFrom hands ln's connections to Accept, one at a time (the others wait in the kernel's
// queue, as with one listener), until ln is closed.
func (m *multiListener) acceptFrom(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		select {
		case m.accepted <- acceptResult{c, err}:
		case <-m.done:
			if c != nil {
				c.Close()
			}
			return
		}
	}
}

// Accept implements net.Listener.
func (m *multiListener) Accept() (net.Conn, error) {
	select {
	case r := <-m.accepted:
		return r.c, r.err
	case <-m.done:
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: m.Addr(), Err: net.ErrClosed}
	}
}

// Close implements net.Listener: it closes every listener.
func (m *multiListener) Close() error {
	var errs []error
	m.once.Do(func() {
		close(m.done)
		for _, ln := range m.lns {
			errs = append(errs, ln.Close())
		}
	})
	return errors.Join(errs...)
}

// Addr implements net.Listener: the first address (see ListenTCP).
func (m *multiListener) Addr() net.Addr { return m.lns[0].Addr() }
