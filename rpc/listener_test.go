package rpc

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/gate"
)

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

// Connections that do not authenticate take only the few places of their own host: a client
// of another host still gets in. In a build without it, connections still
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

// floodEnv names the address a helper process floods (see TestFloodHelper).
const floodEnv = "FITCACHE_TEST_FLOOD"

// floodConns is how many half-sent handshakes the helper leaves open: more than a peer's
// share of the places of connections still authenticating.
const floodConns = 40

// TestFloodHelper is not a test: run by TestAnotherUsersFloodLeavesTheJobItsPlaces as another
// user, it opens floodConns connections to $FITCACHE_TEST_FLOOD, sends half a handshake on
// each, says "ready" and holds them until its standard input closes.
func TestFloodHelper(t *testing.T) {
	addr := os.Getenv(floodEnv)
	if addr == "" {
		t.Skip("a helper process of TestAnotherUsersFloodLeavesTheJobItsPlaces")
	}
	var conns []net.Conn
	for range floodConns {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			continue
		}
		c.Write([]byte("FC"))
		conns = append(conns, c)
	}
	os.Stdout.WriteString("ready " + strconv.Itoa(len(conns)) + "\n")
	io.Copy(io.Discard, os.Stdin)
	for _, c := range conns {
		c.Close()
	}
}

// TestAnotherUsersFloodLeavesTheJobItsPlaces: another user of the node fills the places of
// connections still authenticating with half-sent handshakes, and a client of the job on the
// same node still connects and reads: the kernel says which user each connection is from,
// and a user's half-open connections only take that user's places. In a build without it, the places were counted per host, and the flood took all of 127.0.0.1's.
func TestAnotherUsersFloodLeavesTheJobItsPlaces(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run the flood as another user (nobody, uid 65534)")
	}
	// The test binary, where nobody may run it.
	dir, err := os.MkdirTemp("", "fitcache-flood-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	self, _ := os.Executable()
	bin := filepath.Join(dir, "rpc.test")
	if b, err := os.ReadFile(self); err != nil || os.WriteFile(bin, b, 0o755) != nil {
		t.Fatalf("copy the test binary: %v", err)
	}

	addr, _, e := serveTCP(t, ServerConfig{Token: testToken, HandshakeTimeout: time.Minute})
	flood := exec.Command(bin, "-test.run=^TestFloodHelper$")
	flood.Env = append(os.Environ(), floodEnv+"="+addr)
	flood.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	flood.Dir = dir
	stdin, _ := flood.StdinPipe()
	stdout, _ := flood.StdoutPipe()
	if err := flood.Start(); err != nil {
		t.Fatalf("start the flood as nobody: %v", err)
	}
	defer func() { stdin.Close(); flood.Wait() }()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "ready ") {
		t.Fatalf("flood helper: %q, %v", line, err)
	}
	if n, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "ready "))); n != floodConns {
		t.Fatalf("the flood opened %d connections, want %d", n, floodConns)
	}
	// Its connections beyond its share were closed at once: the flood holds all it can.
	waitFor(t, "the flood's excess to be refused", func() bool { return e.Stats().Refusals >= floodConns-16 })

	root := t.TempDir()
	path := filepath.Join(root, "f")
	os.WriteFile(path, []byte("read during the flood"), 0o644)
	c, _ := Dial(addr, ClientConfig{Token: testToken, ConnectTimeout: 2 * time.Second, CallTimeout: 2 * time.Second})
	defer c.Close()
	if r, err := c.Read(context.Background(), root, path, false); err != nil || string(r.Data) != "read during the flood" {
		t.Errorf("a job client on the flooded host: %v", err)
	}
}
