package rpc

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cloudwego/kitex/pkg/kerrors"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/gate"
	"github.com/fitcache/fitcache/tiers"
)

const testToken = "job-token"

// serveTCP serves a fresh engine on a loopback TCP port with cfg and returns the address.
func serveTCP(t testing.TB, cfg ServerConfig) (string, *Handler, *core.Engine) {
	t.Helper()
	return serveTCPWithTiers(t, cfg, t.TempDir())
}

// serveTCPWithTiers is serveTCP with the memory tier in dir.
func serveTCPWithTiers(t testing.TB, cfg ServerConfig, dir string) (string, *Handler, *core.Engine) {
	t.Helper()
	e := newTestEngine(t, dir)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, h, _ := Serve(e, ln, cfg)
	t.Cleanup(func() { srv.Stop() })
	return ln.Addr().String(), h, e
}

// newTestEngine returns an engine with a memory tier of 16 MiB in dir, closed when the test
// ends.
func newTestEngine(t testing.TB, dir string) *core.Engine {
	t.Helper()
	e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: dir, Kind: tiers.Memory, Budget: "16MiB"}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// dialRaw opens a plain TCP connection, closed at the end of the test.
func dialRaw(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// authenticate runs the client's side of the handshake with token on c: nil if the server
// proved that it knows the token (and this client's proof was sent), ErrUnproven if not.
func authenticate(t *testing.T, c net.Conn, token string) error {
	t.Helper()
	err := clientHandshake(c, newJobKeys(token), time.Now().Add(5*time.Second))
	if err != nil && !errors.Is(err, ErrUnproven) {
		t.Fatalf("handshake: %v", err)
	}
	return err
}

// closedWithin reports whether the server closes c (EOF or reset) within d, reading and
// discarding whatever it sends first.
func closedWithin(c net.Conn, d time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

// hugeThriftCall returns the start of a Thrift "Read" call whose first string field claims
// 2 GiB: framed, the frame's length prefix claims 2 GiB too.
func hugeThriftCall(framed bool) []byte {
	var b []byte
	if framed {
		b = binary.BigEndian.AppendUint32(b, 1<<31-1)
	}
	b = binary.BigEndian.AppendUint32(b, 0x80010001) // binary protocol version 1, CALL
	b = binary.BigEndian.AppendUint32(b, 4)
	b = append(b, "Read"...)
	b = binary.BigEndian.AppendUint32(b, 1)       // sequence id
	b = append(b, 12, 0, 1)                       // field 1: struct ReadRequest
	b = append(b, 11, 0, 1)                       // field 1: string token
	b = binary.BigEndian.AppendUint32(b, 1<<31-1) // of 2 GiB
	return b
}

func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// TestHugeRequestIsRefusedBeforeItsBody: a request claiming 2 GiB, sent by clients with and
// without the job token, gets its connection closed at once and costs the server no memory.
func TestHugeRequestIsRefusedBeforeItsBody(t *testing.T) {
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken})
	for _, tc := range []struct {
		name         string
		token        string // "" makes no handshake
		framed, acks bool
	}{
		{"no handshake, framed", "", true, false},
		{"no handshake, unframed", "", false, false},
		{"wrong token", "guess", true, false},
		{"job token, framed", testToken, true, true},
		{"job token, unframed", testToken, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := heapInUse()
			var wg sync.WaitGroup
			for range 3 {
				c := dialRaw(t, addr)
				if tc.token != "" {
					if got := authenticate(t, c, tc.token) == nil; got != tc.acks {
						t.Fatalf("handshake passed: %v, want %v", got, tc.acks)
					}
				}
				wg.Add(1)
				go func() { // the body, until the server closes the connection
					defer wg.Done()
					c.SetWriteDeadline(time.Now().Add(10 * time.Second))
					c.Write(hugeThriftCall(tc.framed))
					chunk := make([]byte, 1<<20)
					for range 64 {
						if _, err := c.Write(chunk); err != nil {
							return
						}
					}
				}()
				if !closedWithin(c, 5*time.Second) {
					t.Errorf("connection still open 5s after a 2 GiB request")
				}
				c.Close()
			}
			wg.Wait()
			if grown := int64(heapInUse()) - int64(before); grown > 32<<20 {
				t.Errorf("server heap grew by %d MiB", grown>>20)
			}
		})
	}
}

func TestConnectionsBeyondTheCapAreClosed(t *testing.T) {
	const maxConns = 3
	addr, h, e := serveTCP(t, ServerConfig{Token: testToken, MaxConns: maxConns})
	var kept []net.Conn
	for range maxConns {
		c := dialRaw(t, addr)
		if err := authenticate(t, c, testToken); err != nil {
			t.Fatalf("connection within the cap refused: %v", err)
		}
		kept = append(kept, c)
	}
	extra := dialRaw(t, addr)
	if !closedWithin(extra, 5*time.Second) {
		t.Errorf("connection %d of %d still open", maxConns+1, maxConns)
	}
	if got := h.Conns(); got != maxConns {
		t.Errorf("open connections: got %d, want %d", got, maxConns)
	}
	if got := e.Stats().Refusals; got != 1 {
		t.Errorf("refusals: got %d, want 1", got)
	}
	kept[0].Close()
	waitFor(t, "a closed connection to free its place", func() bool { return h.Conns() < maxConns })
	if err := authenticate(t, dialRaw(t, addr), testToken); err != nil {
		t.Errorf("connection after one closed: %v", err)
	}
}

// TestUnauthenticatedConnectionsReachNoHandler: clients without the token never get a
// request decoded; refusals are counted each time and logged once per peer and interval.
func TestUnauthenticatedConnectionsReachNoHandler(t *testing.T) {
	var requests atomic.Int64
	var logs lockedBuffer
	addr, _, e := serveTCP(t, ServerConfig{Token: testToken, OnRequest: func() { requests.Add(1) },
		Log: slog.New(slog.NewTextHandler(&logs, nil)), RefusalLogInterval: time.Hour})
	const attempts = 10
	for i := range attempts {
		token := []string{"", "wrong"}[i%2]
		c, err := Dial(addr, ClientConfig{Token: token})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Hello(context.Background()); err == nil {
			t.Errorf("token %q: Hello succeeded", token)
		}
		c.Close()
	}
	if n := requests.Load(); n != 0 {
		t.Errorf("requests that reached the handler: %d, want 0", n)
	}
	// A client with another token gives up when the server's proof fails, and the server
	// counts the refusal when it sees the connection closed without the client's proof.
	waitFor(t, "every refusal to be counted", func() bool { return e.Stats().Refusals >= attempts })
	if n := e.Stats().Refusals; n != attempts {
		t.Errorf("refusals counted: %d, want %d", n, attempts)
	}
	if n := strings.Count(logs.String(), "refused a client"); n != 1 {
		t.Errorf("refusal lines logged: %d, want 1:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "peer=127.0.0.1") {
		t.Errorf("refusal line without the peer's address:\n%s", logs.String())
	}

	c, _ := Dial(addr, ClientConfig{Token: testToken})
	defer c.Close()
	if _, err := c.Hello(context.Background()); err != nil || requests.Load() != 1 {
		t.Errorf("client with the token: %v, %d requests", err, requests.Load())
	}
}

func TestClientClose(t *testing.T) {
	addr, h, _ := serveTCP(t, ServerConfig{Token: testToken})
	c, err := Dial(addr, ClientConfig{Token: testToken})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Hello(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := h.Conns(); got != 1 {
		t.Fatalf("server connections: got %d, want 1", got)
	}
	if err := c.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	waitFor(t, "the server to see the connection closed", func() bool { return h.Conns() == 0 })
	if err := c.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := c.Hello(context.Background()); !errors.Is(err, core.ErrClosed) {
		t.Errorf("Hello after Close: got %v, want core.ErrClosed", err)
	}
}

func TestFileLargerThanAFrameIsRefused(t *testing.T) {
	const frame = 1 << 20
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken, MaxFrameBytes: frame})
	root := t.TempDir()
	for _, tc := range []struct {
		size int
		want syscall.Errno
	}{{frame / 2, 0}, {2 * frame, syscall.EFBIG}} {
		path := filepath.Join(root, "f"+string(rune('a'+tc.size%26)))
		want := bytes.Repeat([]byte{7}, tc.size)
		os.WriteFile(path, want, 0o644)
		c, _ := Dial(addr, ClientConfig{Token: testToken})
		r, err := c.Read(context.Background(), root, path, false)
		if got := core.Errno(err); got != tc.want {
			t.Errorf("%d bytes: errno %v (%v), want %v", tc.size, got, err, tc.want)
		}
		if tc.want == 0 && !bytes.Equal(r.GetData(), want) {
			t.Errorf("%d bytes: got %d bytes back", tc.size, len(r.GetData()))
		}
		c.Close()
	}
}

// waitFor polls cond for up to 5 seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for range 500 {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s", what)
}

// lockedBuffer is a bytes.Buffer safe for concurrent use (a log destination).
type lockedBuffer struct {
	mu  sync.Mutex // protects buf
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestDialerGivesUpOnASilentServer: a server that never answers the handshake costs a client
// its connect timeout, not a hang.
func TestDialerGivesUpOnASilentServer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() { // accept and say nothing
		for range 10 {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	c, _ := Dial(ln.Addr().String(), ClientConfig{Token: testToken, ConnectTimeout: 200 * time.Millisecond, CallTimeout: 10 * time.Second})
	defer c.Close()
	done := make(chan error, 1)
	go func() { _, err := c.Hello(context.Background()); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, ErrUnavailable) || IsRefused(err) {
			t.Errorf("Hello to a silent server: got %v (refused %v), want ErrUnavailable, a timeout", err, IsRefused(err))
		}
	case <-time.After(5 * time.Second):
		t.Error("Hello to a server that never answers the handshake still waiting after 5s")
	}
}

// Garbage on many connections at once, before and after authentication, does not bring the
// server down: a real client is served afterwards.
func TestGarbageOnManyConnectionsIsSurvived(t *testing.T) {
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken})
	garbage := bytes.Repeat([]byte{0xff, 0x00, 0x13, 0x37, 0x80, 0x01, 0x00, 0x00}, 512)
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.DialTimeout("tcp", addr, 5*time.Second)
			if err != nil {
				return // the accept queue may overflow for a moment: that is the server's right
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if i%2 == 1 { // half of them past the handshake
				if clientHandshake(c, newJobKeys(testToken), time.Now().Add(5*time.Second)) != nil {
					return
				}
			}
			c.Write(garbage)
			io.Copy(io.Discard, c)
		}()
	}
	wg.Wait()
	c, err := Dial(addr, ClientConfig{Token: testToken})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Hello(context.Background()); err != nil {
		t.Fatalf("after 200 connections of garbage the server does not answer: %v", err)
	}
}

// Connections that do not authenticate take only the few places of their own host: a client
// of another host still gets in. On the main branch before this change connections still
// authenticating counted towards the one cap, so anyone reaching the port could fill it.
// (Peers on this host are counted by user, see TestAnotherUsersFloodLeavesTheJobItsPlaces:
// here every peer is taken for a host of its own address.)
func TestUnauthenticatedFloodTakesOnlyItsHostsPlaces(t *testing.T) {
	pendingKeyOf = func(c net.Conn) string { return gate.PeerHost(c.RemoteAddr()) }
	t.Cleanup(func() { pendingKeyOf = gate.PeerKey })
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken, HandshakeTimeout: 5 * time.Second})
	for range 2 * gate.MaxPendingPerPeer {
		dialRaw(t, addr) // from 127.0.0.1, silent
	}
	_, port, _ := net.SplitHostPort(addr)
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}, Timeout: 2 * time.Second}
	c, err := d.Dial("tcp", "127.0.0.1:"+port)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := authenticate(t, c, testToken); err != nil {
		t.Errorf("a client of another host during a flood: %v", err)
	}
}

// A user that shares a host with a client of the job (a node of the job, reaching the server
// from elsewhere) and holds every place of that host with half-sent handshakes does not keep
// the client out: the client's connection takes the place of the oldest one, and it needs it
// for one round trip. Before, the client was refused for as long as the flood held.
func TestFloodFromTheClientsOwnHostDoesNotKeepItOut(t *testing.T) {
	pendingKeyOf = func(c net.Conn) string { return gate.PeerHost(c.RemoteAddr()) } // as from another host
	t.Cleanup(func() { pendingKeyOf = gate.PeerKey })
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken, HandshakeTimeout: 5 * time.Second})
	for range gate.MaxPendingPerPeer {
		dialRaw(t, addr) // silent, from the client's host
	}
	c := dialRaw(t, addr)
	if err := authenticate(t, c, testToken); err != nil {
		t.Errorf("a client of the job on the flooded host: %v", err)
	}
}

// A server that closes a new connection because it has too many is busy, not dead: the
// client's error is not a refused connection (which declares a cluster server dead at once).
func TestServerAtItsCapIsNotRefused(t *testing.T) {
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken, MaxConns: 1})
	held := dialRaw(t, addr)
	if err := authenticate(t, held, testToken); err != nil {
		t.Fatalf("first connection refused: %v", err)
	}
	c, err := Dial(addr, ClientConfig{Token: testToken, ConnectTimeout: time.Second, CallTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.Hello(context.Background())
	if err == nil {
		t.Fatal("a call beyond the cap succeeded")
	}
	if IsRefused(err) {
		t.Errorf("a server at its connection cap looks refused (dead at once): %v", err)
	}
}

// A burst of calls from a new client, each needing a connection of its own (a node's
// prefetch, the servers of a job on one host), is not refused by the server's limits on
// connections authenticating: before, the server closed the oldest of the burst's
// connections, their calls failed, and the client took the server for dead.
func TestABurstOfNewConnectionsIsNotRefused(t *testing.T) {
	addr, _, e := serveTCP(t, ServerConfig{Token: testToken, HandshakeTimeout: 5 * time.Second})
	const calls = 4 * gate.MaxPendingPerPeer
	clients := make([]*Client, 3) // three servers' clients on this host, as on loopback
	for i := range clients {
		c, err := Dial(addr, ClientConfig{Token: testToken, CallTimeout: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients[i] = c
	}
	var wg sync.WaitGroup
	errs := make(chan error, calls)
	for i := range calls {
		wg.Go(func() {
			if _, err := clients[i%len(clients)].Hello(context.Background()); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("a call of the burst failed: %v", err)
	}
	if n := e.Stats().Refusals; n != 0 {
		t.Errorf("%d connections of the job's own user refused", n)
	}
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
