package rpc

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
)

// The attacks of the red team's report (issue 16, items 1, 2 and 7), run against the code.

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
// a slow one that stays in the ring. On the main branch before this change the client sent
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
// the server's proof covers the relay's connection, not the client's. On the main branch
// before this change the relay passed the token on, read it, and had the client served.
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

// storeSetup serves an owner and a replica with the job token, and a file of the dataset.
func storeSetup(t *testing.T) (owner, replica *Client, replicaEngine *core.Engine, root, path string, data []byte) {
	t.Helper()
	ownerAddr, _, _ := serveTCP(t, ServerConfig{Token: testToken})
	replicaAddr, _, replicaEngine := serveTCP(t, ServerConfig{Token: testToken})
	owner, _ = Dial(ownerAddr, ClientConfig{Token: testToken})
	replica, _ = Dial(replicaAddr, ClientConfig{Token: testToken})
	t.Cleanup(func() { owner.Close(); replica.Close() })
	root = t.TempDir()
	path = filepath.Join(root, "train.bin")
	data = bytes.Repeat([]byte("the real bytes "), 1000)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return owner, replica, replicaEngine, root, path, data
}

// TestStoreTakesOnlyCopiesItsOwnerStamped: a replica keeps a copy only if its bytes match
// the checksum and stamp its owner put in its Read reply and the source it sees itself;
// forged bytes are refused with EBADMSG and counted, and the replica serves the real bytes.
func TestStoreTakesOnlyCopiesItsOwnerStamped(t *testing.T) {
	owner, replica, e, root, path, data := storeSetup(t)
	ctx := context.Background()
	r, err := owner.Read(ctx, root, path, false)
	if err != nil || !bytes.Equal(r.Data, data) {
		t.Fatalf("owner read: %v", err)
	}
	stamp := StampOf(r)
	forged := bytes.Repeat([]byte("forged bytes!! "), 1000)
	withSum := stamp
	withSum.Checksum = crc32.Checksum(forged, castagnoli)
	otherKey := NewStamper("a token of no job").Stamp(path, core.Result{Data: forged, MTimeNanos: stamp.MTimeNanos,
		CTimeNanos: stamp.CTimeNanos, Ino: stamp.Ino})
	for _, tc := range []struct {
		name  string
		data  []byte
		stamp Stamp
	}{
		{"forged bytes, the owner's stamp", forged, stamp},
		{"forged bytes, their own checksum", forged, withSum},
		{"forged bytes, stamped with another key", forged, otherKey},
		{"no stamp", data, Stamp{MTimeNanos: stamp.MTimeNanos, Checksum: stamp.Checksum}},
		{"the real bytes, cut short", data[:len(data)-1], stamp},
	} {
		err := replica.Store(ctx, root, path, tc.data, tc.stamp)
		if core.Errno(err) != syscall.EBADMSG || !errors.Is(err, core.ErrBadCopy) {
			t.Errorf("%s: got %v, want EBADMSG (ErrBadCopy)", tc.name, err)
		}
	}
	if s := e.Stats(); s.StoreRefused != 5 || s.Stored != 0 {
		t.Errorf("after forged copies: %d refused (want 5), %d stored (want 0)", s.StoreRefused, s.Stored)
	}
	if err := replica.Store(ctx, root, path, data, stamp); err != nil {
		t.Fatalf("the owner's copy: %v", err)
	}
	got, err := replica.Read(ctx, root, path, false)
	if err != nil || !bytes.Equal(got.Data, data) || OriginOf(got) == core.OriginSource {
		t.Errorf("replica read after the owner's copy: origin %q, real bytes %v, %v", got.GetOrigin(), bytes.Equal(got.GetData(), data), err)
	}
	if s := e.Stats(); s.Stored != 1 || s.SourceReads != 0 {
		t.Errorf("%d stored (want 1), %d source reads (want 0)", s.Stored, s.SourceReads)
	}
}

// TestStoreRefusesAStaleCopy: a copy of a version of the source that is no longer there is
// refused (EAGAIN), even with its owner's stamp.
func TestStoreRefusesAStaleCopy(t *testing.T) {
	owner, replica, e, root, path, data := storeSetup(t)
	ctx := context.Background()
	r, err := owner.Read(ctx, root, path, false)
	if err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Hour)
	os.Chtimes(path, later, later)
	if err := replica.Store(ctx, root, path, data, StampOf(r)); !errors.Is(err, core.ErrChanged) || core.Errno(err) != syscall.EAGAIN {
		t.Errorf("stale copy: got %v, want EAGAIN (ErrChanged)", err)
	}
	if s := e.Stats(); s.StoreRefused != 1 || s.Stored != 0 {
		t.Errorf("%d refused (want 1), %d stored (want 0)", s.StoreRefused, s.Stored)
	}
}

// TestHugeListFrameLeavesTheServerUp: a request whose list claims 2^31-1 strings, sent after
// the handshake, closes that connection and nothing else; the server serves on. On the main
// branch before this change the generated decoder allocated 32 GiB for it and the server died
// of a fatal out-of-memory error.
func TestHugeListFrameLeavesTheServerUp(t *testing.T) {
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken})
	root := t.TempDir()
	path := filepath.Join(root, "f")
	os.WriteFile(path, []byte("still here"), 0o644)
	for _, f := range [][]byte{hugeListCall, hugeMapCall} {
		c := dialRaw(t, addr)
		if err := authenticate(t, c, testToken); err != nil {
			t.Fatal(err)
		}
		c.Write(f)
		if !closedWithin(c, 5*time.Second) {
			t.Errorf("connection still open after a %d-byte frame claiming 2^31-1 elements", len(f))
		}
	}
	cl, _ := Dial(addr, ClientConfig{Token: testToken})
	defer cl.Close()
	if r, err := cl.Read(context.Background(), root, path, false); err != nil || string(r.Data) != "still here" {
		t.Errorf("read after the hostile frames: %v", err)
	}
}

// TestHugeListFrameLeavesATokenlessServerUp: the same against the per-user server on a Unix
// socket, which has no token and decodes what its user's processes send.
func TestHugeListFrameLeavesATokenlessServerUp(t *testing.T) {
	sock := serve(t, "")
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(hugeListCall)
	if !closedWithin(c, 5*time.Second) {
		t.Error("connection still open after a frame claiming 2^31-1 strings")
	}
	cl, _ := Dial(sock, ClientConfig{})
	defer cl.Close()
	if _, err := cl.Hello(context.Background()); err != nil {
		t.Errorf("Hello after the hostile frame: %v", err)
	}
}

// hostileServer answers every request on ln (after the handshake with token, if any) with a
// Hello reply whose list of tiers claims 2^31-1 entries.
func hostileServer(t *testing.T, ln net.Listener, token string) {
	t.Helper()
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range 20 {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if token != "" && serverHandshake(c, newJobKeys(token)) != nil {
				c.Close()
				continue
			}
			var head [4]byte
			if _, err := io.ReadFull(c, head[:]); err == nil {
				req := make([]byte, min(binary.BigEndian.Uint32(head[:]), 1<<16))
				if _, err := io.ReadFull(c, req); err == nil && len(req) > 8 {
					reply := slices.Clone(hugeListReply)
					seq := req[8+binary.BigEndian.Uint32(req[4:8]):][:4] // after version, name length and name
					copy(reply[4+4+4+len("Hello"):], seq)
					c.Write(reply)
					io.Copy(io.Discard, c)
				}
			}
			c.Close()
		}
	}()
}

// TestHostileReplyFailsTheCall: a client answered with a reply whose list claims 2^31-1
// elements gets an error, and its process lives on; with a token the listener must know the
// token to get that far, without one (the user's own Unix socket) it need not. On the main
// branch before this change the generated decoder allocated 80 GiB and the client process
// died of a fatal out-of-memory error.
func TestHostileReplyFailsTheCall(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "hostile.sock")
	uln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	hostileServer(t, uln, "")
	tln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hostileServer(t, tln, testToken)
	for addr, token := range map[string]string{sock: "", tln.Addr().String(): testToken} {
		c, _ := Dial(addr, ClientConfig{Token: token, CallTimeout: 3 * time.Second})
		_, err := c.Hello(context.Background())
		c.Close()
		if err == nil || !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "malformed frame") {
			t.Errorf("token %q: Hello answered with a hostile reply: %v, want ErrUnavailable for a malformed frame", token, err)
		}
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
// and a user's half-open connections only take that user's places. On the main branch before
// this change the places were counted per host, and the flood took all of 127.0.0.1's.
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
