package rpc

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
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
