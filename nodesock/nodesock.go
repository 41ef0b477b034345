// Package nodesock serves the node socket: a small binary protocol over a Unix socket for C
// code on the node that can carry neither a Go runtime nor a Thrift stack. Its first user is
// the hit path of libfitcache in a process forked after the library was loaded (a miss there
// cannot enter Go); the preload shim of the transparent mode is the next.
//
// A request asks the server to bring one file into its tiers; the caller then finds it there
// itself, through the tiers' index (capi/fclookup.c), so the file's bytes never cross the
// socket and the source is still read once per file.
//
// Wire format (integers little-endian), one request and one reply at a time per connection:
//
//	request: magic "FCN1", op uint32 (OpFetch), root length uint32, path length uint32,
//	         root bytes, path bytes (absolute, clean, path inside root)
//	reply:   magic "FCN1", errno int32 (0: the file is in a tier now), message length uint32,
//	         message bytes (why it failed, at most maxMessage bytes; empty on success)
//
// The socket lives in the private runtime directory (mode 0600) and a connection is served
// only if its peer runs as this server's user (SO_PEERCRED), so nobody else can use it.
package nodesock

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Magic starts every request and reply.
const Magic = "FCN1"

// OpFetch asks the server to bring a file into its tiers.
const OpFetch = 1

// maxPath bounds the root and the path of a request (PATH_MAX).
const maxPath = 4096

// maxMessage bounds the message of a reply.
const maxMessage = 1000

// maxConns bounds the connections served at once; more wait in the kernel's backlog. Each
// process keeps a connection per client, so an idle one is closed after idleTimeout: it
// would otherwise hold its place for the life of the process.
const (
	maxConns    = 256
	idleTimeout = 10 * time.Second
)

// Fetcher brings a file into the tiers. It returns nil when the file is in a tier, or an
// error whose errno (see Errno) tells the caller what to do: read the source for EFBIG (no
// tier takes the file), report ENOENT, EACCES and the like as the file's own error.
type Fetcher func(ctx context.Context, root, path string) error

// Config configures a node socket server.
type Config struct {
	Fetch   Fetcher
	Errno   func(error) syscall.Errno // maps Fetch's errors to errno values
	Timeout time.Duration             // bound on one fetch; 0 means 60 s
	Log     *slog.Logger              // nil discards
}

// Server serves a node socket.
type Server struct {
	ln    *net.UnixListener
	cfg   Config
	slots chan struct{} // one token per connection being served
	wg    sync.WaitGroup
	ctx   context.Context
	stop  context.CancelFunc
}

// Listen creates the socket at path (replacing a stale one), readable and writable by this
// user only, and serves it until Close.
func Listen(path string, cfg Config) (*Server, error) {
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	old := syscall.Umask(0o077)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 60 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	s := &Server{ln: ln, cfg: cfg, slots: make(chan struct{}, maxConns)}
	s.ctx, s.stop = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Close stops accepting, cancels fetches in progress, waits for the connections to end and
// removes the socket.
func (s *Server) Close() error {
	s.stop()
	s.ln.SetUnlinkOnClose(true)
	err := s.ln.Close()
	s.wg.Wait()
	return err
}

func (s *Server) accept() {
	defer s.wg.Done()
	var conns sync.WaitGroup
	defer conns.Wait()
	for {
		select {
		case s.slots <- struct{}{}:
		case <-s.ctx.Done():
			return
		}
		c, err := s.ln.AcceptUnix()
		if err != nil {
			<-s.slots
			if errors.Is(err, net.ErrClosed) {
				return
			}
			s.cfg.Log.Warn("node socket: accept", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		conns.Add(1)
		go func() {
			defer conns.Done()
			defer func() { <-s.slots }()
			s.serve(c)
		}()
	}
}

// serve answers requests on one connection until the peer closes it.
func (s *Server) serve(c *net.UnixConn) {
	defer c.Close()
	stop := context.AfterFunc(s.ctx, func() { c.Close() })
	defer stop()
	if uid, err := peerUID(c); err != nil || uid != os.Geteuid() {
		s.cfg.Log.Warn("node socket: refused a peer of another user", "uid", uid, "err", err)
		return
	}
	for {
		// A connection kept idle frees its place after idleTimeout (the C side reconnects).
		c.SetReadDeadline(time.Now().Add(idleTimeout))
		root, path, err := readRequest(c)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, os.ErrDeadlineExceeded) {
				s.cfg.Log.Warn("node socket: bad request", "err", err)
			}
			return
		}
		ctx, cancel := context.WithTimeout(s.ctx, s.cfg.Timeout)
		ferr := s.cfg.Fetch(ctx, root, path)
		cancel()
		var errno syscall.Errno
		var msg string
		if ferr != nil {
			if errno = s.cfg.Errno(ferr); errno == 0 {
				errno = syscall.EIO
			}
			msg = ferr.Error()
			if len(msg) > maxMessage {
				msg = msg[:maxMessage]
			}
		}
		reply := binary.LittleEndian.AppendUint32([]byte(Magic), uint32(int32(errno)))
		reply = binary.LittleEndian.AppendUint32(reply, uint32(len(msg)))
		reply = append(reply, msg...)
		if _, err := c.Write(reply); err != nil {
			return
		}
	}
}

// readRequest reads one fetch request.
func readRequest(r io.Reader) (root, path string, err error) {
	var hdr [16]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return "", "", err
	}
	le := binary.LittleEndian
	op, rootLen, pathLen := le.Uint32(hdr[4:8]), le.Uint32(hdr[8:12]), le.Uint32(hdr[12:16])
	switch {
	case string(hdr[:4]) != Magic:
		return "", "", errors.New("bad magic")
	case op != OpFetch:
		return "", "", fmt.Errorf("unknown operation %d", op)
	case rootLen == 0 || rootLen > maxPath || pathLen == 0 || pathLen > maxPath:
		return "", "", fmt.Errorf("bad lengths %d, %d", rootLen, pathLen)
	}
	buf := make([]byte, rootLen+pathLen)
	if _, err := io.ReadFull(r, buf); err != nil {
		return "", "", err
	}
	return string(buf[:rootLen]), string(buf[rootLen:]), nil
}

// AppendRequest appends a fetch request for path under root to b (for tests and Go callers).
func AppendRequest(b []byte, root, path string) []byte {
	le := binary.LittleEndian
	b = append(b, Magic...)
	b = le.AppendUint32(b, OpFetch)
	b = le.AppendUint32(b, uint32(len(root)))
	b = le.AppendUint32(b, uint32(len(path)))
	b = append(b, root...)
	return append(b, path...)
}

// peerUID returns the user id of the process at the other end of c.
func peerUID(c *net.UnixConn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return -1, err
	}
	if cerr != nil {
		return -1, cerr
	}
	return int(cred.Uid), nil
}

// PathFor returns the node socket of the server listening for RPC on the Unix socket at
// rpcSocket: beside it, with ".node" appended.
func PathFor(rpcSocket string) string { return rpcSocket + ".node" }
