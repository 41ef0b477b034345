package rpc

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
)

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
// token to get that far, without one (the user's own Unix socket) it need not. In a build without it, the generated decoder allocated 80 GiB and the client process
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
