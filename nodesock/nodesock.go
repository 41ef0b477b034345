// Package nodesock serves the node socket: a small binary protocol over a Unix socket for C
// code on the node that can carry neither a Go runtime nor a Thrift stack: the hit path of
// libfitcache in a process forked after the library was loaded (a miss there cannot enter
// Go), and the preload shim of the transparent mode (preload/), which must not run Go at
// all.
//
// Seven operations, one request and its reply at a time per connection (none for
// OpCacheBlock and OpRecord):
//
//   - OpFetch asks the server to bring one file into its tiers; the caller then finds it
//     there itself, through the tiers' index (capi/fclookup.c), so the file's bytes never
//     cross the socket and the source is still read once per file.
//   - OpOpen does the same and answers with a read-only descriptor of the file (passed with
//     SCM_RIGHTS): its cached copy, or the source itself when no tier takes it (see
//     core.Engine.OpenForReader); a cluster server answers for every file of the job, with a
//     memory file holding the bytes of a file another node owns (see
//     package server, readers.go). The preload shim returns it from open().
//   - OpForget drops the cached copies of a file whose source is being written.
//   - OpFetchBlock is OpFetch for one block of a large file (core.Engine.ReadBlock): the
//     request's path is the block's name (tiers.BlockName: the file's path, a NUL byte, the
//     block size and the block's number). A process forked after it loaded libfitcache
//     asks it for the blocks its ranges miss (capi/hitranges.c, hit_pread).
//   - OpCacheBlock asks for a block to be cached, and nothing more: the server sends neither
//     ack nor reply, and caches the block in the background (askWorkers at a time, up to
//     askQueue waiting; more are dropped: the asker asks again later). The preload shim
//     sends it for the blocks a program reads from the source (preload/ranges.c): it must
//     not wait for them, nor hold a connection of the server while they are cached.
//   - OpOpenMany is OpOpen for the files of a batch (the misses of one fc_read_many call, at
//     most MaxBatch): one request, and one reply per file, in order, each with its
//     descriptor, its bytes (a file of at most MaxInline bytes the server holds in memory:
//     another node's, which a descriptor would first copy into a memory file) or its own
//     errno (a missing file is ENOENT for that file only). A cluster server fetches the files
//     other nodes own with one ReadBatch call per owner (see package server, readers.go). A server older than it closes the connection
//     without an ack (an unknown operation, or a path field longer than a path): the client
//     then asks for each file with OpOpen (ErrUnknownOp).
//   - OpRecord reports a reader's fill (see tiers.Claim): the reader read a small file from
//     the source itself and wrote its copy into the first tier's fill file; the server
//     records it as the cached copy (core.Engine.RecordFill). No ack, no reply, as for
//     OpCacheBlock: the reader has its bytes and waits for nothing. The request's path is the
//     file's path, a NUL byte and the report (recordBytes: the source's size, modification
//     and change times in Unix nanoseconds and inode number as the reader read them, the fill
//     file's inode number, a uint32 of the source's mode bits (RecordModeBits) and flags, and
//     the CRC-32C of the copy when the flag RecordHasChecksum says so, else 4 bytes of
//     zeros). With the checksum the server records the copy without reading it; without it
//     (an older reader) it reads the copy once for it. A report is recorded by
//     the connection that read it while fewer than askWorkers are being recorded (no worker
//     to wake: a reader's reports come one at a time), else by one of askWorkers workers, up
//     to askQueue waiting; with the queue full, in the connection's own turn. Only servers
//     that say so in their Hello reply (reader_fills) get them.
//
// Wire format (integers little-endian):
//
//	request: magic "FCN3", op uint32, root length uint32, path length uint32,
//	         root bytes, path bytes (absolute, clean, path inside root)
//	ack:     "FCA3", sent as soon as the request has been read, before any work, and
//	         again every AckInterval until the reply (each ack a write of its own)
//	reply:   magic "FCN3", errno int32 (0: done), message length uint32,
//	         message bytes (why it failed, at most maxMessage bytes; empty on success)
//	OpOpen reply: magic "FCN3", errno int32, origin uint32 (core.Origin, 0 on error),
//	         message length uint32, message bytes; on success one descriptor rides along
//	         with the first byte (a separate write from the ack's, so that a client
//	         reading the ack's 4 bytes never reads into it).
//	OpOpenMany request: as any, its path field the list of paths, each followed by a NUL
//	         byte (at most MaxBatch paths, each at most 4096 bytes; checked before the list
//	         is allocated, by its length)
//	OpOpenMany reply: after the acks, per path, in order, each a write of its own (no ack
//	         between them): an OpOpen reply with an inline length uint32 after the message
//	         length, the file's bytes after the message when it is not 0xFFFFFFFF (at most
//	         MaxInline, checked before anything is allocated for them; no descriptor then).
//
// The ack tells a hung server from a slow answer. A server stopped with SIGSTOP (or hung)
// still has its connections accepted by the kernel and its requests buffered, so without it a
// client could only wait for the whole read timeout; with it, a client waits a short probe
// time (ProbeTimeout) for each ack, and the read timeout for the answer only while the server
// keeps acknowledging: one busy reading a large source file is waited for, one that stops
// while a request is in flight is found out within ProbeTimeout. Liveness, not the time an
// answer takes, decides. A server at its connection cap (maxConns) sends no ack until a place
// frees: its clients take it for a hung one and read the source for a while. Earlier versions
// ("FCN1" without an ack, "FCN2" with one ack only) are refused at their first bytes, and
// such a server closes this version's connection the same way, so a client and server of
// different versions fall back at once, never by a timeout.
//
// The socket lives in the private runtime directory (mode 0600) and a connection is served
// only if its peer runs as this server's user (SO_PEERCRED), so nobody else can use it.
package nodesock

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Magic starts every request and reply.
const Magic = "FCN3"

// Ack is what the server sends as soon as it has read a request, and again every
// AckInterval while it works on it (see the package documentation).
const Ack = "FCA3"

// ProbeTimeout is how long a client waits for an ack (or the reply) before it takes the
// server for hung (capi/fcnode.h has the same value).
const ProbeTimeout = time.Second

// AckInterval is how often a server working on a request repeats its ack: a quarter of
// ProbeTimeout, so that a server slowed by a busy machine is not taken for a hung one.
const AckInterval = ProbeTimeout / 4

// Operations (see the package documentation).
const (
	OpFetch      = 1
	OpOpen       = 2
	OpForget     = 3
	OpFetchBlock = 4
	OpCacheBlock = 5
	OpRecord     = 7
)

// recordBytes is the length of an OpRecord report, after the path and its NUL byte;
// recordChecksum is where its checksum starts.
const (
	recordBytes    = 48
	recordChecksum = 44
)

// The mode field of an OpRecord report (FillReport.Mode): the source's mode bits, and flags.
// A server older than the flags takes the permission bits alone.
const (
	RecordModeBits = 0o7777
	// RecordHasChecksum says that the report's last 4 bytes hold the CRC-32C of the bytes the
	// reader wrote into its fill file (FillReport.Checksum), which the server records as the
	// copy's checksum instead of reading the copy to compute it.
	RecordHasChecksum = 1 << 16
)

// The background caching of OpCacheBlock: askWorkers blocks at a time (the engine bounds its
// block fills in all), up to askQueue asks waiting.
const (
	askWorkers = 4
	askQueue   = 1024
)

// maxPath bounds the root and the path of a request (PATH_MAX).
const maxPath = 4096

// maxMessage bounds the message of a reply.
const maxMessage = 1000

// maxConns bounds the connections served at once; more wait in the kernel's backlog. Each
// process keeps up to 4 connections per client (one per thread with a request at once, see
// NODE_CONNS in capi/hitclient.h): 128 readers of a GPU node hold 512 at most. An idle one is
// closed after idleTimeout: it would otherwise hold its place for the life of the process. A
// connection served costs a goroutine and a 4 KiB buffer.
const (
	maxConns    = 1024
	idleTimeout = 10 * time.Second
)

// Fetcher brings a file into the tiers. It returns nil when the file is in a tier, or an
// error whose errno (see Errno) tells the caller what to do: read the source for EFBIG (no
// tier takes the file), report ENOENT, EACCES and the like as the file's own error.
type Fetcher func(ctx context.Context, root, path string) error

// Opener returns a read-only descriptor holding the bytes of the file at path (see
// core.Engine.OpenForReader) and what it is (a core.Origin). The server closes it once sent.
type Opener func(ctx context.Context, root, path string) (*os.File, uint32, error)

// Forgetter drops the cached copies of a file.
type Forgetter func(root, path string) error

// FillReport is an OpRecord report (see the package documentation).
type FillReport struct {
	Size, MTimeNanos, CTimeNanos int64
	Ino, FillIno                 uint64
	Mode                         uint32 // the source's mode bits (RecordModeBits) and flags
	Checksum                     uint32 // the copy's CRC-32C, with RecordHasChecksum in Mode
}

// Recorder records a reader's fill of the file at path (core.Engine.RecordFill).
type Recorder func(root, path string, r FillReport) error

// Config configures a node socket server. Operations without a function are refused
// (ENOSYS).
type Config struct {
	Fetch Fetcher
	Open  Opener
	// OpenMany serves OpOpenMany; without it, each file of a batch is opened with Open.
	OpenMany ManyOpener
	Forget   Forgetter
	// FetchBlock serves OpFetchBlock and OpCacheBlock: path is a block's name (tiers.BlockName).
	FetchBlock Fetcher
	// Record serves OpRecord; without it the reports are read and dropped (the fill files are
	// abandoned claims, see tiers.TakeAbandonedClaim). Noted, if set, is called with each
	// report as soon as it is read, before Record (core.Engine.NoteReport).
	Record  Recorder
	Noted   func(root, path string)
	Errno   func(error) syscall.Errno // maps Fetch's errors to errno values
	Timeout time.Duration             // bound on one fetch; 0 means 60 s
	Log     *slog.Logger              // nil discards
}

// Server serves a node socket.
type Server struct {
	ln    *net.UnixListener
	cfg   Config
	slots chan struct{} // one token per connection being served
	asks  chan blockAsk // OpCacheBlock requests waiting for a worker
	fills chan fillAsk  // OpRecord requests waiting for a worker
	// recording holds a token per OpRecord report being recorded (askWorkers), by a worker or
	// by the connection that read it
	recording chan struct{}
	accepted  atomic.Int64 // connections accepted so far
	wg        sync.WaitGroup
	ctx       context.Context
	stop      context.CancelFunc
}

// Connections returns how many connections the server accepted: a reader process keeps its
// connections (capi/nodesock.c), so these grow with the processes and threads that read, not
// with their requests.
func (s *Server) Connections() int64 { return s.accepted.Load() }

// blockAsk is an OpCacheBlock request.
type blockAsk struct{ root, name string }

// fillAsk is an OpRecord request.
type fillAsk struct {
	root, path string
	report     FillReport
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
	s := &Server{ln: ln, cfg: cfg, slots: make(chan struct{}, maxConns), asks: make(chan blockAsk, askQueue),
		fills: make(chan fillAsk, askQueue), recording: make(chan struct{}, askWorkers)}
	s.ctx, s.stop = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.accept()
	if cfg.FetchBlock != nil {
		for range askWorkers {
			s.wg.Go(s.cacheBlocks)
		}
	}
	if cfg.Record != nil {
		for range askWorkers {
			s.wg.Go(s.recordFills)
		}
	}
	return s, nil
}

// cacheBlocks caches the blocks of OpCacheBlock requests until the server closes. Their
// failures reach nobody: a block no tier takes is read from the source by its reader.
func (s *Server) cacheBlocks() {
	for {
		select {
		case <-s.ctx.Done():
			return
		case a := <-s.asks:
			ctx, cancel := context.WithTimeout(s.ctx, s.cfg.Timeout)
			if err := s.cfg.FetchBlock(ctx, a.root, a.name); err != nil {
				s.cfg.Log.Debug("node socket: a block asked for was not cached", "err", err)
			}
			cancel()
		}
	}
}

// recordFills records the fills of OpRecord requests until the server closes.
func (s *Server) recordFills() {
	for {
		select {
		case <-s.ctx.Done():
			return
		case a := <-s.fills:
			s.recording <- struct{}{}
			s.record(a)
			<-s.recording
		}
	}
}

// record records one reader's fill; its failure reaches nobody (the next reader of the file
// misses, and reads it again).
func (s *Server) record(a fillAsk) {
	if err := s.cfg.Record(a.root, a.path, a.report); err != nil {
		s.cfg.Log.Debug("node socket: a reader's fill was not recorded", "path", a.path, "err", err)
	}
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
		s.accepted.Add(1)
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
	// Requests are read through a buffer: a reader's reports (OpRecord) come back to back,
	// and no request carries a descriptor that a buffered read could take with it.
	r := bufio.NewReaderSize(c, 4096)
	for {
		// A connection kept idle frees its place after idleTimeout (the C side reconnects).
		c.SetReadDeadline(time.Now().Add(idleTimeout))
		op, root, path, err := readRequest(r)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, os.ErrDeadlineExceeded) {
				s.cfg.Log.Warn("node socket: bad request", "err", err)
			}
			return
		}
		if op == OpCacheBlock { // no ack, no reply: see the package documentation
			if s.cfg.FetchBlock != nil {
				select {
				case s.asks <- blockAsk{root, path}:
				default: // asked again later, if it still matters
				}
			}
			continue
		}
		if op == OpRecord { // no ack, no reply
			if a, ok := parseRecord(root, path); !ok {
				s.cfg.Log.Warn("node socket: bad fill report")
				return
			} else if s.cfg.Record != nil {
				if s.cfg.Noted != nil {
					s.cfg.Noted(a.root, a.path)
				}
				select {
				case s.recording <- struct{}{}:
					// Recorded here, while fewer than askWorkers are: a worker would have
					// to be woken for it.
					s.record(a)
					<-s.recording
					continue
				default:
				}
				select {
				case s.fills <- a:
				default:
					s.record(a) // the workers are behind: this connection waits its turn
				}
			}
			continue
		}
		if op == OpOpenMany {
			if err := s.answerMany(c, root, path); err != nil {
				return
			}
			continue
		}
		if err := s.answer(c, op, root, path); err != nil {
			return
		}
	}
}

// answer acknowledges one request, carries it out while repeating the ack, and writes its
// reply.
func (s *Server) answer(c *net.UnixConn, op uint32, root, path string) error {
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.Timeout)
	defer cancel()
	if _, err := c.Write([]byte(Ack)); err != nil {
		return err
	}
	acked := keepAcking(c)
	var err error
	var file *os.File
	var origin uint32
	switch {
	case op == OpFetch && s.cfg.Fetch != nil:
		err = s.cfg.Fetch(ctx, root, path)
	case op == OpOpen && s.cfg.Open != nil:
		file, origin, err = s.cfg.Open(ctx, root, path)
	case op == OpForget && s.cfg.Forget != nil:
		err = s.cfg.Forget(root, path)
	case op == OpFetchBlock && s.cfg.FetchBlock != nil:
		err = s.cfg.FetchBlock(ctx, root, path)
	default:
		err = fmt.Errorf("operation %d: %w", op, syscall.ENOSYS)
	}
	if aerr := acked(); aerr != nil { // the client is gone
		if file != nil {
			file.Close()
		}
		return aerr
	}
	var errno syscall.Errno
	var msg string
	if err != nil {
		if errno = s.cfg.Errno(err); errno == 0 {
			errno = syscall.EIO
		}
		msg = err.Error()
		if len(msg) > maxMessage {
			msg = msg[:maxMessage]
		}
	}
	le := binary.LittleEndian
	reply := le.AppendUint32([]byte(Magic), uint32(int32(errno)))
	if op == OpOpen {
		reply = le.AppendUint32(reply, origin)
	}
	reply = le.AppendUint32(reply, uint32(len(msg)))
	reply = append(reply, msg...)
	if file == nil {
		_, err = c.Write(reply)
		return err
	}
	defer file.Close()
	_, _, err = c.WriteMsgUnix(reply, unix.UnixRights(int(file.Fd())), nil)
	return err
}

// keepAcking writes Ack on c every AckInterval until the returned function is called, which
// returns once no more is written (the reply may follow) with the error a write failed with.
func keepAcking(c net.Conn) (stop func() error) {
	done, finished := make(chan struct{}), make(chan struct{})
	var werr error
	go func() {
		defer close(finished)
		tick := time.NewTicker(AckInterval)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			if _, werr = c.Write([]byte(Ack)); werr != nil {
				return
			}
		}
	}()
	return func() error {
		close(done)
		<-finished
		return werr
	}
}

// readRequest reads one request.
func readRequest(r io.Reader) (op uint32, root, path string, err error) {
	var hdr [16]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, "", "", err
	}
	le := binary.LittleEndian
	op, rootLen, pathLen := le.Uint32(hdr[4:8]), le.Uint32(hdr[8:12]), le.Uint32(hdr[12:16])
	switch {
	case string(hdr[:4]) != Magic:
		return 0, "", "", errors.New("bad magic")
	case op != OpFetch && op != OpOpen && op != OpForget && op != OpFetchBlock && op != OpCacheBlock &&
		op != OpOpenMany && op != OpRecord:
		return 0, "", "", fmt.Errorf("unknown operation %d", op)
	case rootLen == 0 || rootLen > maxPath || pathLen == 0 || pathLen > maxPathField(op):
		return 0, "", "", fmt.Errorf("bad lengths %d, %d", rootLen, pathLen)
	}
	buf := make([]byte, rootLen+pathLen)
	if _, err := io.ReadFull(r, buf); err != nil {
		return 0, "", "", err
	}
	return op, string(buf[:rootLen]), string(buf[rootLen:]), nil
}

// parseRecord splits an OpRecord request's path into the file's path and its report.
func parseRecord(root, field string) (fillAsk, bool) {
	n := len(field) - recordBytes - 1
	if n <= 0 || field[n] != 0 {
		return fillAsk{}, false
	}
	b, le := []byte(field[n+1:]), binary.LittleEndian
	r := FillReport{Size: int64(le.Uint64(b[0:])), MTimeNanos: int64(le.Uint64(b[8:])),
		CTimeNanos: int64(le.Uint64(b[16:])), Ino: le.Uint64(b[24:]), FillIno: le.Uint64(b[32:]),
		Mode: le.Uint32(b[40:]), Checksum: le.Uint32(b[recordChecksum:])}
	return fillAsk{root: root, path: field[:n], report: r}, r.Size >= 0
}

// AppendRecord appends an OpRecord request to b (for tests and Go callers).
func AppendRecord(b []byte, root, path string, r FillReport) []byte {
	le := binary.LittleEndian
	field := append([]byte(path), 0)
	field = le.AppendUint64(field, uint64(r.Size))
	field = le.AppendUint64(field, uint64(r.MTimeNanos))
	field = le.AppendUint64(field, uint64(r.CTimeNanos))
	field = le.AppendUint64(field, r.Ino)
	field = le.AppendUint64(field, r.FillIno)
	field = le.AppendUint32(field, r.Mode)
	field = le.AppendUint32(field, r.Checksum)
	return AppendRequest(b, OpRecord, root, string(field))
}

// maxPathField bounds the path field of a request of operation op: a path, the path list of
// OpOpenMany, or a path and its report (OpRecord).
func maxPathField(op uint32) uint32 {
	switch op {
	case OpOpenMany:
		return maxBatchBody
	case OpRecord:
		return maxPath + 1 + recordBytes
	}
	return maxPath
}

// AppendRequest appends a request of operation op for path under root to b (for tests and
// Go callers).
func AppendRequest(b []byte, op uint32, root, path string) []byte {
	le := binary.LittleEndian
	b = append(b, Magic...)
	b = le.AppendUint32(b, op)
	b = le.AppendUint32(b, uint32(len(root)))
	b = le.AppendUint32(b, uint32(len(path)))
	b = append(b, root...)
	return append(b, path...)
}

// ReadAck reads the ack of a request from r, exactly its bytes (a descriptor riding with
// the reply that follows must not be read with it), for tests and Go callers.
func ReadAck(r io.Reader) error {
	ack := make([]byte, len(Ack))
	if _, err := io.ReadFull(r, ack); err != nil {
		return err
	}
	if string(ack) != Ack {
		return fmt.Errorf("node socket: %q where the ack %q was expected", ack, Ack)
	}
	return nil
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
