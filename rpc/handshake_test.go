package rpc

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cloudwego/kitex/pkg/kerrors"
)

// squatter listens where a client expects a server, handles each connection with a
// function that returns what the connection sent it, and keeps that. It is what another user
// gets by binding the port of a server that is not up yet, or died.
type squatter struct {
	ln  net.Listener
	mu  sync.Mutex // protects got
	got [][]byte   // what each connection sent, once handled
	wg  sync.WaitGroup
}

func listenSquatter(t *testing.T, handle func(c net.Conn) []byte) *squatter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &squatter{ln: ln}
	go func() {
		for range 100 {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer c.Close()
				c.SetDeadline(time.Now().Add(3 * time.Second))
				got := handle(c)
				s.mu.Lock()
				s.got = append(s.got, got)
				s.mu.Unlock()
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); s.wg.Wait() })
	return s
}

// answering handles a connection by answering everything it reads with answer (nil:
// nothing).
func answering(answer []byte) func(c net.Conn) []byte {
	return func(c net.Conn) []byte {
		var got []byte
		buf := make([]byte, 4096)
		for range 100 {
			n, err := c.Read(buf)
			got = append(got, buf[:n]...)
			if err != nil {
				break
			}
			if answer != nil {
				c.Write(answer)
			}
		}
		return got
	}
}

// relaying handles a connection by relaying it to target, both ways.
func relaying(target string) func(c net.Conn) []byte {
	return func(c net.Conn) []byte {
		up, err := net.Dial("tcp", target)
		if err != nil {
			return nil
		}
		defer up.Close()
		var fromClient bytes.Buffer
		done := make(chan struct{})
		go func() {
			io.Copy(io.MultiWriter(up, &fromClient), c)
			up.(*net.TCPConn).CloseWrite()
			close(done)
		}()
		io.Copy(c, up)
		c.Close()
		<-done
		return fromClient.Bytes()
	}
}

// received closes the squatter and returns what its connections were sent.
func (s *squatter) received() [][]byte {
	s.ln.Close()
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.got
}

// TestSquatterGetsNothingAndIsDown: a listener at a server's address that does not know the
// token gets no token, no request, and is taken for a server that is down (refused), not for
// a slow one that stays in the ring. In a build without it, the client sent
// it the job token in clear ("FCT1", its length, the token) and took a wrong answer for a
// refused token.
func TestSquatterGetsNothingAndIsDown(t *testing.T) {
	const token = "the-job-token-0123456789"
	for _, answer := range [][]byte{bytes.Repeat([]byte{'A'}, 64), nil} {
		s := listenSquatter(t, answering(answer))
		c, err := Dial(s.ln.Addr().String(), ClientConfig{Token: token, ConnectTimeout: 500 * time.Millisecond,
			CallTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Hello(context.Background())
		c.Close()
		if err == nil {
			t.Fatal("Hello answered by a squatter")
		}
		if answer != nil && (!errors.Is(err, ErrUnavailable) || !IsRefused(err)) {
			t.Errorf("squatter answering garbage: %v; want ErrUnavailable and refused (the server is down)", err)
		}
		if answer == nil && (!errors.Is(err, ErrUnavailable) || IsRefused(err)) {
			t.Errorf("squatter answering nothing: %v; want ErrUnavailable, a timeout", err)
		}
		for _, got := range s.received() {
			if bytes.Contains(got, []byte(token)) || len(got) > 36 {
				t.Errorf("the squatter received %d bytes %q: want at most the handshake's hello (36 bytes), no token", len(got), got)
			}
		}
	}
}

// TestRelayedConnectionIsRefused: a listener at a dead server's address that relays the
// exchange to a live server of the job (the relay knows no token) gets no working connection:
// the server's proof covers the relay's connection, not the client's. In a build without it, the relay passed the token on, read it, and had the client served.
func TestRelayedConnectionIsRefused(t *testing.T) {
	const token = "the-job-token-0123456789"
	addr, _, e := serveTCP(t, ServerConfig{Token: token})
	r := listenSquatter(t, relaying(addr))
	c, err := Dial(r.ln.Addr().String(), ClientConfig{Token: token, ConnectTimeout: time.Second, CallTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Hello(context.Background())
	c.Close()
	if err == nil || !IsRefused(err) {
		t.Errorf("Hello through a relay: %v, want a refusal (the relay is no server of the job)", err)
	}
	for _, got := range r.received() {
		if bytes.Contains(got, []byte(token)) || len(got) > 36 {
			t.Errorf("the relay received %d bytes %q: want at most the handshake's hello, no token", len(got), got)
		}
	}
	if n := e.Stats().Refusals; n < 1 {
		t.Errorf("server refusals: %d, want the relayed connection refused", n)
	}
	direct, _ := Dial(addr, ClientConfig{Token: token})
	defer direct.Close()
	if _, err := direct.Hello(context.Background()); err != nil {
		t.Errorf("direct Hello: %v", err)
	}
}

// The two proofs of the handshake are kept apart (a server's proof replayed as a client's
// is refused) and bound to the connection's endpoints, with both spellings of an IPv4
// address agreeing.
func TestHandshakeProofs(t *testing.T) {
	v4 := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1).To4(), Port: 7070}
	mapped := &net.TCPAddr{IP: net.ParseIP("::ffff:127.0.0.1"), Port: 7070}
	other := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2), Port: 7070}
	a, _ := endpointBytes(v4)
	b, _ := endpointBytes(mapped)
	c, _ := endpointBytes(other)
	if !bytes.Equal(a, b) || bytes.Equal(a, c) {
		t.Errorf("endpoints: %x for 127.0.0.1, %x for ::ffff:127.0.0.1 (want equal), %x for 127.0.0.2", a, b, c)
	}
	unnamed, _ := endpointBytes(&net.UnixAddr{Name: "@", Net: "unix"})
	empty, _ := endpointBytes(&net.UnixAddr{Name: "", Net: "unix"})
	if !bytes.Equal(unnamed, empty) {
		t.Errorf("unnamed unix socket: %x and %x", unnamed, empty)
	}

	// A client that sends back the server's own proof as its proof.
	addr, _, e := serveTCP(t, ServerConfig{Token: testToken})
	conn := dialRaw(t, addr)
	conn.Write(append([]byte(handshakeMagic), make([]byte, nonceSize)...))
	answer := make([]byte, challengeSize)
	if _, err := io.ReadFull(conn, answer); err != nil {
		t.Fatal(err)
	}
	conn.Write(answer[nonceSize:])
	if !closedWithin(conn, 5*time.Second) {
		t.Error("a client that replayed the server's proof keeps its connection")
	}
	waitFor(t, "the refusal", func() bool { return e.Stats().Refusals == 1 })
}

// A client dials and authenticates at most maxHandshakes connections to its server at once;
// a dial that waited its timeout for a place goes ahead anyway.
func TestHandshakesAtOnceAreBounded(t *testing.T) {
	inner := &countingDialer{}
	d := newHandshakeDialer(inner, newJobKeys(testToken))
	var wg sync.WaitGroup
	for range 4 * maxHandshakes {
		wg.Go(func() { d.DialTimeout("tcp", "127.0.0.1:1", 5*time.Second) })
	}
	wg.Wait()
	if got := inner.most.Load(); got > maxHandshakes || got == 0 {
		t.Errorf("%d dials at once, want at most %d", got, maxHandshakes)
	}
	inner.most.Store(0)
	for range 2 * maxHandshakes { // each dial takes longer than the wait
		wg.Go(func() { d.DialTimeout("tcp", "127.0.0.1:1", 5*time.Millisecond) })
	}
	wg.Wait()
	if got := inner.most.Load(); got <= maxHandshakes {
		t.Errorf("%d dials at once after waiting their timeout, want more than %d", got, maxHandshakes)
	}
}

// countingDialer fails every dial after a while, and records how many were in flight at most.
type countingDialer struct{ now, most atomic.Int64 }

func (d *countingDialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	n := d.now.Add(1)
	defer d.now.Add(-1)
	for m := d.most.Load(); n > m && !d.most.CompareAndSwap(m, n); m = d.most.Load() {
	}
	time.Sleep(20 * time.Millisecond)
	return nil, syscall.ECONNREFUSED
}

// failingDialer fails every dial with err.
type failingDialer struct{ err error }

func (d failingDialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	return nil, d.err
}

// A connection that could not be made in time (netpoll reports it as a plain "i/o timeout"
// whose Timeout method says false), or that was closed right after it was accepted, is a
// timeout, not a refusal: one slow connect on a loaded machine must not declare a cluster
// server dead at once. Only "nothing listens" is refused, which netpoll reports as a
// connection closed by the peer.
func TestConnectTimeoutIsNotRefused(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedAddr := closed.Addr().String()
	closed.Close()
	netpollTimeout := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("i/o timeout")}
	netpollClosed := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection has been closed by peer")}
	for _, tc := range []struct {
		name, addr string
		err        error
		refused    bool
	}{
		{"connect timeout, server listening", ln.Addr().String(), netpollTimeout, false},
		{"closed after accept, server listening", ln.Addr().String(), netpollClosed, false},
		{"closed by peer, nothing listening", closedAddr, netpollClosed, true},
		{"connection refused", closedAddr, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, true},
	} {
		d := newHandshakeDialer(failingDialer{tc.err}, newJobKeys(testToken))
		_, err := d.DialTimeout("tcp", tc.addr, time.Second)
		if got := IsRefused(kerrors.ErrGetConnection.WithCause(err)); got != tc.refused {
			t.Errorf("%s: IsRefused = %v, want %v (%v)", tc.name, got, tc.refused, err)
		}
	}
}
