// Package testserver runs FitCache cluster servers inside a test process: an engine with a
// memory tier and its RPC server on a loopback address (a loopback address is a node), which
// a test can stop as a kill would. It is for tests only.
//
// Usage:
//
//	a := testserver.Start(t, "127.0.0.1", root, "64MiB", rpc.ServerConfig{})
//	b := testserver.Start(t, "127.0.0.2", root, "64MiB", rpc.ServerConfig{})
//	... // a client of a.Addr and b.Addr, with the token testserver.Token
//	b.Stop()
package testserver

import (
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/cloudwego/kitex/server"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// Token is the job token of every server Start runs.
const Token = "tok"

// Server is a cluster server run in this process.
type Server struct {
	Addr    string // its address, host:port
	Engine  *core.Engine
	Handler *rpc.Handler
	srv     server.Server
	ln      *connsListener
}

// connsListener keeps the connections it accepted, so that a test can cut them as the death
// of the server's process would.
type connsListener struct {
	net.Listener
	mu    sync.Mutex // protects conns
	conns []net.Conn
}

func (l *connsListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.mu.Lock()
		l.conns = append(l.conns, c)
		l.mu.Unlock()
	}
	return c, err
}

// cut closes the listener and every connection accepted.
func (l *connsListener) cut() {
	l.Listener.Close()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		c.Close()
	}
}

// Start runs a server for root on host (a loopback address: its node; it may carry a port to
// listen on) with a memory tier of budget, configured by cfg with its token set to Token.
// The test's cleanup stops it.
func Start(t testing.TB, host, root, budget string, cfg rpc.ServerConfig) *Server {
	t.Helper()
	if !strings.Contains(host, ":") {
		host += ":0"
	}
	e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: budget}},
		Roots: []string{root}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	cl := &connsListener{Listener: ln}
	cfg.Token = Token
	srv, h, _ := rpc.Serve(e, cl, cfg)
	s := &Server{Addr: ln.Addr().String(), Engine: e, Handler: h, srv: srv, ln: cl}
	t.Cleanup(s.Stop)
	return s
}

// Stop stops the server as a kill would: its connections are cut at once. It is idempotent.
func (s *Server) Stop() {
	if s.srv != nil {
		s.ln.cut()
		s.srv.Stop()
		s.Engine.Close()
		s.srv = nil
	}
}

// CachedFiles returns how many files the server's tiers hold.
func (s *Server) CachedFiles() int {
	n := 0
	for _, u := range s.Engine.Usage() {
		n += u.Files
	}
	return n
}

// SourceReads sums the source reads of servers.
func SourceReads(servers ...*Server) int64 {
	var n int64
	for _, s := range servers {
		n += s.Engine.Stats().SourceReads
	}
	return n
}
