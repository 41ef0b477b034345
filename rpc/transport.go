package rpc

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cloudwego/gopkg/bufiox"
	"github.com/cloudwego/kitex/pkg/remote"
	"github.com/cloudwego/kitex/pkg/remote/trans"
	"github.com/cloudwego/kitex/pkg/rpcinfo"
	"github.com/cloudwego/kitex/pkg/utils"
	"golang.org/x/sys/unix"
)

// FitCache's transport for Kitex, on both sides, over Go's net package. Kitex's own (netpoll)
// cannot take connections that authenticated before it saw them, and neither it nor Kitex's
// Go net transport lets a message's bytes travel between a file and the socket without
// copies through Go's heap. This one uses Kitex's protocol handlers
// (trans.NewDefaultSvrTransHandler and trans.NewDefaultCliTransHandler) and codecs, and
// owns the connections and their buffers (see buffer.go), which lets
//
//   - a server send a Read reply's bytes from the cached file (sendfile, or the mapped file
//     written to the socket) once the reply's other fields are written, and release the file
//     once the reply is out (see request): a server serves a connection's requests one at a
//     time, in its goroutine, and a request's state lives in its context;
//   - a client read a Read reply's bytes from the socket straight into the buffer they are
//     returned in (the caller's, with ReadInto), once the fields before them are checked
//     (see codec.go).
//
// Everything else is Kitex's: framing (Framed transport), Thrift encoding and decoding of every
// other field, sequence ids, exceptions, connection pooling on the client (a connection per
// call in flight).

// conn is a connection of the transport: what Kitex's protocol handlers get.
type conn struct {
	net.Conn // as accepted (counted by the guard listener) or dialed (authenticated)
	// sock is the socket itself, for sendfile and peeks; nil when the connection is no
	// socket of the standard library's.
	sock   syscall.Conn
	r      *bufiox.DefaultReader
	w      *bufiox.DefaultWriter
	closed atomic.Bool
}

// newConn wraps c, which must be used through the returned conn only. Its bytes are read and
// written on the connection c wraps, if any (see gate.Conn.NetConn): a *net.TCPConn writes
// a message's parts with one writev. A positive readAhead caps each read into the
// connection's buffer (see replyReadAhead).
func newConn(c net.Conn, readAhead int) *conn {
	raw := c
	for {
		u, ok := raw.(interface{ NetConn() net.Conn })
		if !ok {
			break
		}
		raw = u.NetConn()
	}
	var src io.Reader = raw
	if readAhead > 0 {
		src = cappedReader{r: raw, max: readAhead}
	}
	cc := &conn{Conn: c, r: bufiox.NewDefaultReader(src), w: bufiox.NewDefaultWriter(raw)}
	cc.sock, _ = raw.(syscall.Conn)
	return cc
}

// replyReadAhead caps each read into a client connection's buffer. A reply's file bytes go
// from the socket straight into the caller's buffer (buffer.readDirect), and what the buffer
// read ahead of them is copied there once more. Uncapped, the buffer grows to the largest
// message it held and takes in nearly a whole Read reply at its first read (112,405 of a 110
// KiB file's 112,640 bytes copied twice: BenchmarkRemoteRead); capped, at most this much.
// Replies without a file's bytes are small, and requests (a server's reads) are not capped:
// a replica's Store carries its bytes through the buffer.
const replyReadAhead = 4 << 10

// cappedReader reads at most max bytes at a time from r.
type cappedReader struct {
	r   io.Reader
	max int
}

func (c cappedReader) Read(p []byte) (int, error) { return c.r.Read(p[:min(len(p), c.max)]) }

// Read reads through the connection's buffer.
func (c *conn) Read(b []byte) (int, error) { return c.r.Read(b) }

// Close closes the connection once.
func (c *conn) Close() error {
	if !c.closed.CompareAndSwap(false, true) {
		return net.ErrClosed
	}
	return c.Conn.Close()
}

// IsActive reports whether an idle connection can carry another call: it is open, the peer
// has not closed it, and it holds no bytes that no call asked for. Kitex's connection pool
// asks before it reuses one, so that a call does not fail on a connection that a server
// closed while it was idle (a server that restarted, or stopped).
func (c *conn) IsActive() bool {
	if c.closed.Load() || c.r.Buffered() > 0 {
		return false
	}
	if c.sock == nil {
		return true
	}
	rc, err := c.sock.SyscallConn()
	if err != nil {
		return false
	}
	active := false
	rc.Read(func(fd uintptr) bool {
		var b [1]byte
		_, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		active = errors.Is(err, unix.EAGAIN) // nothing to read, and not closed
		return true                          // never wait
	})
	return active
}

// canSendFile reports whether sendFile sends a file's bytes without them entering this
// process: over TCP (Go's TCPConn.ReadFrom uses sendfile); a Unix socket's bytes are better
// written from a mapping than read and written again.
func (c *conn) canSendFile() bool {
	_, ok := c.sock.(io.ReaderFrom)
	return ok
}

// sendFile writes n bytes of f, from its current offset, to the connection (see
// canSendFile). Anything written through the connection's buffer must have been flushed.
func (c *conn) sendFile(f *os.File, n int64) error {
	written, err := c.sock.(io.ReaderFrom).ReadFrom(io.LimitReader(f, n))
	if err == nil && written != n {
		err = io.ErrUnexpectedEOF // the cached file is shorter than its index said
	}
	return err
}

// cork sets TCP_CORK on a TCP socket (on: partial segments are held back, off: they are sent)
// and reports whether it did.
func (c *conn) cork(on bool) bool {
	if c.sock == nil {
		return false
	}
	rc, err := c.sock.SyscallConn()
	if err != nil {
		return false
	}
	v := 0
	if on {
		v = 1
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_CORK, v) }); err != nil {
		return false
	}
	return serr == nil
}

// callKey is the context key of a client's call.
type callKey struct{}

// callState carries a client call's deadline and cancellation (those of ctx) to the
// connection it runs on. Kitex runs a call in another goroutine, and waits for it, when the
// call has an RPC timeout or a context that can be done; such a call costs a fifth more CPU
// time for a file of 100 KiB. Client.call gives it neither, so that it runs in the caller's
// goroutine, and the connection's deadlines end it instead: ctx's deadline, or an instant in
// the past once ctx is done.
type callState struct {
	ctx  context.Context
	mu   sync.Mutex  // protects conn and stop
	conn *conn       // the call's connection while the call uses it
	stop func() bool // unregisters interrupt
}

// callOf returns the call ctx belongs to, or nil.
func callOf(ctx context.Context) *callState {
	s, _ := ctx.Value(callKey{}).(*callState)
	return s
}

// attach gives c the call's deadline; a call done meanwhile interrupts it.
func (s *callState) attach(c *conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.conn = c
	d, _ := s.ctx.Deadline()
	if s.ctx.Err() != nil {
		d = time.Unix(1, 0)
	}
	c.SetDeadline(d)
	if s.stop == nil {
		s.stop = context.AfterFunc(s.ctx, s.interrupt)
	}
}

// interrupt ends the call's reads and writes on its connection.
func (s *callState) interrupt() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn != nil {
		s.conn.SetDeadline(time.Unix(1, 0))
	}
}

// detach ends the call's use of its connection, which may go back to the pool.
func (s *callState) detach() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.conn = nil
}

// end ends the call.
func (s *callState) end() {
	s.mu.Lock()
	s.conn = nil
	stop := s.stop
	s.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// requestKey is the context key of a request on a server of this transport.
type requestKey struct{}

// request is one request on a server connection: what its handler leaves for after its reply
// is written.
type request struct {
	release []func()
	files   map[*byte]sendable // bytes of a reply that may be sent from a file instead
	batch   []batchPart        // the data of a ReadBatch reply, in order (see encodeBatch)
}

// sendable is a file whose bytes are the same as some bytes in memory (its mapping).
type sendable struct {
	f *os.File
	n int
}

// requestOf returns the request ctx belongs to, or nil outside this transport's servers.
func requestOf(ctx context.Context) *request {
	r, _ := ctx.Value(requestKey{}).(*request)
	return r
}

// afterReply runs f once the reply has been written, or the request ended without one.
func (r *request) afterReply(f func()) { r.release = append(r.release, f) }

// sendFrom says that the reply's bytes b are f's n bytes from its current offset, which
// may be sent from the file instead of from memory; b stays valid until the reply is out.
// The request closes f.
func (r *request) sendFrom(b []byte, f *os.File) {
	if len(b) == 0 {
		f.Close()
		return
	}
	if r.files == nil {
		r.files = map[*byte]sendable{}
	}
	r.files[&b[0]] = sendable{f: f, n: len(b)}
	r.afterReply(func() { f.Close() })
}

// fileOf returns the file that holds exactly the bytes b, if one was registered.
func (r *request) fileOf(b []byte) (*os.File, bool) {
	if r == nil || len(b) == 0 {
		return nil, false
	}
	s, ok := r.files[&b[0]]
	return s.f, ok && s.n == len(b)
}

// done runs what waits for the reply, in reverse order of registration.
func (r *request) done() {
	for i := len(r.release) - 1; i >= 0; i-- {
		r.release[i]()
	}
	r.release, r.files, r.batch = nil, nil, nil
}

// transServerFactory makes servers of this transport.
type transServerFactory struct{}

// NewTransServer implements remote.TransServerFactory.
func (transServerFactory) NewTransServer(opt *remote.ServerOption, h remote.ServerTransHandler) remote.TransServer {
	return &transServer{opt: opt, h: h, conns: map[*conn]bool{}}
}

// transServer accepts connections from its listener and serves each in a goroutine of its
// own, one request at a time.
type transServer struct {
	opt   *remote.ServerOption
	h     remote.ServerTransHandler
	count utils.AtomicInt

	mu       sync.Mutex     // protects ln, conns and stopping
	ln       net.Listener   // set by BootstrapServer
	conns    map[*conn]bool // open connections: true while one serves a request
	stopping bool
	served   sync.WaitGroup // connections being served
}

// CreateListener implements remote.TransServer.
func (s *transServer) CreateListener(addr net.Addr) (net.Listener, error) {
	return net.Listen(addr.Network(), addr.String())
}

// errStopped ends BootstrapServer when the server stops. It is no nil error: Kitex's Run,
// which may see BootstrapServer return before it waits for it (a server stopped as soon as it
// started), takes nil then for an error and fails on it; Serve reports it as nil.
var errStopped = errors.New("fitcache: server stopped")

// BootstrapServer implements remote.TransServer: it serves ln until Shutdown, and then
// returns errStopped.
func (s *transServer) BootstrapServer(ln net.Listener) error {
	s.mu.Lock()
	s.ln = ln
	stopping := s.stopping
	s.mu.Unlock()
	if stopping { // stopped before it started: ln was not closed
		ln.Close()
		return errStopped
	}
	for {
		nc, err := ln.Accept()
		if err != nil {
			s.mu.Lock()
			stopping := s.stopping
			s.mu.Unlock()
			if stopping {
				return errStopped
			}
			return err
		}
		c := newConn(nc, 0)
		s.mu.Lock()
		if s.stopping {
			s.mu.Unlock()
			c.Close()
			continue
		}
		s.conns[c] = false
		s.served.Add(1)
		s.mu.Unlock()
		go s.serve(c)
	}
}

// serve reads and answers requests on c until it fails or the server stops.
func (s *transServer) serve(c *conn) {
	s.count.Inc()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		c.Close()
		s.count.Dec()
		s.served.Done()
	}()
	ctx, err := s.h.OnActive(context.Background(), c)
	if err != nil {
		return
	}
	defer s.h.OnInactive(ctx, c)
	for {
		c.SetReadDeadline(time.Now().Add(max(2*time.Minute, s.opt.MaxConnectionIdleTime)))
		if _, err = c.r.Peek(1); err != nil {
			break // closed, or idle for too long
		}
		if !s.busy(c, true) {
			return
		}
		if ri := rpcinfo.GetRPCInfo(ctx); ri != nil {
			c.SetReadDeadline(deadline(ri.Config().ReadWriteTimeout()))
		}
		req := &request{}
		err = s.h.OnRead(context.WithValue(ctx, requestKey{}, req), c)
		req.done()
		if err != nil || !s.busy(c, false) {
			break
		}
	}
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !os.IsTimeout(err) {
		s.h.OnError(ctx, err, c)
	}
}

// busy marks c as serving a request or idle, and reports whether it may go on (the server is
// not stopping, or c is busy with a request that arrived before).
func (s *transServer) busy(c *conn, b bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.conns[c] = b
	return !s.stopping || b
}

// Shutdown implements remote.TransServer: it stops accepting, closes the idle connections,
// and waits for the requests being served, at most the server's exit wait time.
func (s *transServer) Shutdown() error {
	s.mu.Lock()
	s.stopping = true
	if s.ln != nil {
		s.ln.Close()
	}
	for c, busy := range s.conns {
		if !busy {
			c.Close()
		}
	}
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), s.opt.ExitWaitTime)
	defer cancel()
	if g, ok := s.h.(remote.GracefulShutdown); ok {
		g.GracefulShutdown(ctx)
	}
	done := make(chan struct{})
	go func() { s.served.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		for c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		return ctx.Err()
	}
}

// ConnCount implements remote.TransServer.
func (s *transServer) ConnCount() utils.AtomicInt { return utils.AtomicInt(s.count.Value()) }

// svrTransHandlerFactory makes Kitex's protocol handler for servers over this transport.
type svrTransHandlerFactory struct{}

// NewTransHandler implements remote.ServerTransHandlerFactory.
func (svrTransHandlerFactory) NewTransHandler(opt *remote.ServerOption) (remote.ServerTransHandler, error) {
	return trans.NewDefaultSvrTransHandler(opt, extension{})
}

// cliTransHandlerFactory makes Kitex's protocol handler for clients over this transport.
type cliTransHandlerFactory struct{}

// NewTransHandler implements remote.ClientTransHandlerFactory.
func (cliTransHandlerFactory) NewTransHandler(opt *remote.ClientOption) (remote.ClientTransHandler, error) {
	return trans.NewDefaultCliTransHandler(opt, extension{})
}

// extension is what Kitex's protocol handlers ask of a transport (trans.Extension).
type extension struct{}

// SetReadTimeout implements trans.Extension: a client's call has its RPC timeout (and a
// little more, as Kitex gives it) to read its reply; a server sets its read deadlines itself
// (see transServer.serve).
func (extension) SetReadTimeout(ctx context.Context, c net.Conn, cfg rpcinfo.RPCConfig, role remote.RPCRole) {
	if role == remote.Client && callOf(ctx) == nil { // a call's deadline is its own (see callState)
		c.SetReadDeadline(deadline(trans.GetReadTimeout(cfg)))
	}
}

// replyWriteTimeout is how long a server's reply has to be written: as long as a client
// waits for a read (ClientConfig.ReadTimeout), so that a peer that stops reading holds a
// connection, and the files its reply sends from, no longer.
const replyWriteTimeout = time.Minute

// NewWriteByteBuffer implements trans.Extension. A client's request has as long to be
// written as its call (see callState), a server's reply replyWriteTimeout.
func (extension) NewWriteByteBuffer(ctx context.Context, c net.Conn, msg remote.Message) remote.ByteBuffer {
	cc := connOf(c)
	call := callOf(ctx)
	switch ri := msg.RPCInfo(); {
	case call != nil:
		call.attach(cc)
	case msg.RPCRole() != remote.Client:
		cc.SetWriteDeadline(deadline(replyWriteTimeout))
	case ri != nil:
		cc.SetWriteDeadline(deadline(trans.GetReadTimeout(ri.Config())))
	}
	b := newBuffer(cc, remote.BitWritable, requestOf(ctx))
	b.call = call
	return b
}

// deadline returns the deadline of a timeout from now, none for 0.
func deadline(t time.Duration) time.Time {
	if t <= 0 {
		return time.Time{}
	}
	return time.Now().Add(t)
}

// NewReadByteBuffer implements trans.Extension.
func (extension) NewReadByteBuffer(ctx context.Context, c net.Conn, msg remote.Message) remote.ByteBuffer {
	b := newBuffer(connOf(c), remote.BitReadable, nil)
	b.call = callOf(ctx)
	return b
}

// ReleaseBuffer implements trans.Extension.
func (extension) ReleaseBuffer(b remote.ByteBuffer, err error) error {
	if b == nil {
		return nil
	}
	return b.Release(err)
}

// IsTimeoutErr implements trans.Extension.
func (extension) IsTimeoutErr(err error) bool {
	return os.IsTimeout(err) || errors.Is(err, os.ErrDeadlineExceeded)
}

// IsRemoteClosedErr implements trans.Extension.
func (extension) IsRemoteClosedErr(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, net.ErrClosed)
}

// connOf returns the transport's connection under c, which Kitex's client connection pool
// wraps.
func connOf(c net.Conn) *conn {
	for {
		switch v := c.(type) {
		case *conn:
			return v
		case remote.RawConn:
			c = v.RawConn()
		default:
			panic("rpc: a connection of another transport")
		}
	}
}

// dialer dials connections of this transport: inner's, wrapped once it returned them (after
// the handshake, for a client with a token).
type dialer struct{ inner remote.Dialer }

// DialTimeout implements remote.Dialer.
func (d dialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	c, err := d.inner.DialTimeout(network, address, timeout)
	if err != nil {
		return nil, err
	}
	return newConn(c, replyReadAhead), nil
}
