package nodesock

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/internal/splice"
)

// OpOpenMany opens the files of a batch (the misses of one fc_read_many call) in one request:
// see the package documentation.
const OpOpenMany = 6

// MaxBatch bounds the files of an OpOpenMany request (a caller with more sends several), and
// so the descriptors a server holds for one connection at once.
const MaxBatch = 128

// maxBatchBody bounds the path list of an OpOpenMany request: MaxBatch paths of maxPath bytes,
// each followed by a NUL byte.
const maxBatchBody = MaxBatch * (maxPath + 1)

// openManyWorkers is how many files of a batch a server without a ManyOpener opens at once
// with its Opener.
const openManyWorkers = 8

// MaxInline bounds the bytes of a file sent inline in an OpOpenMany reply, in place of a
// descriptor: the size up to which the C reader copies a file into memory rather than map it
// (FC_READ_MAX_BYTES).
const MaxInline = 512 << 10

// inlineNone is the inline length of an OpOpenMany reply without inline bytes: a descriptor
// rides with it, or none (an error).
const inlineNone = ^uint32(0)

// Opened is the answer for one file of an OpOpenMany request: a read-only descriptor and what
// it holds (a core.Origin), or the file's bytes (Data, at most MaxInline, sent inline: a file
// held in memory, which a descriptor would have to copy into a memory file first; or Pipe,
// bytes another server sent, sent on inline from the pipe they were spliced into), or the
// file's own error. Release, if set, is called once Data is sent (or dropped).
type Opened struct {
	File    *os.File
	Data    []byte
	Pipe    *splice.Pipe
	Origin  uint32
	Err     error
	Release func()
}

// close frees what o holds.
func (o *Opened) close() {
	if o.File != nil {
		o.File.Close()
		o.File = nil
	}
	if o.Pipe != nil {
		splice.Put(o.Pipe)
		o.Pipe = nil
	}
	if o.Release != nil {
		o.Release()
		o.Release = nil
	}
}

// ManyOpener opens the files at paths (each inside root) for a reader, as Opener opens one:
// it returns one Opened per path, in order; the server closes the descriptors once sent. An
// error of one file (ENOENT, say) is that file's only.
type ManyOpener func(ctx context.Context, root string, paths []string) []Opened

// ErrUnknownOp is what OpenMany returns when the server closed the connection before it
// acknowledged the request: a server older than OpOpenMany refuses an operation it does not
// know that way. Its caller asks for each file alone (Open).
var ErrUnknownOp = errors.New("node socket: the server does not know the operation")

// AppendPaths appends the path list of an OpOpenMany request (the request's path field):
// each path followed by a NUL byte.
func AppendPaths(b []byte, paths []string) []byte {
	for _, p := range paths {
		b = append(b, p...)
		b = append(b, 0)
	}
	return b
}

// splitPaths splits the path list of an OpOpenMany request (AppendPaths): at least one path,
// at most MaxBatch, each of 1 to maxPath bytes and NUL-terminated.
func splitPaths(list string) ([]string, error) {
	if !strings.HasSuffix(list, "\x00") {
		return nil, errors.New("a path list without its final NUL")
	}
	paths := strings.Split(list[:len(list)-1], "\x00")
	if len(paths) > MaxBatch {
		return nil, fmt.Errorf("%d paths in a batch, more than %d", len(paths), MaxBatch)
	}
	for _, p := range paths {
		if len(p) == 0 || len(p) > maxPath {
			return nil, fmt.Errorf("a path of %d bytes in a batch", len(p))
		}
	}
	return paths, nil
}

// answerMany answers an OpOpenMany request: acknowledged at once and while the files are
// opened, then a reply per file, in order, each a write of its own with its descriptor or
// followed by its inline bytes. A malformed path list ends the connection, as a malformed
// request does.
func (s *Server) answerMany(c *net.UnixConn, root, list string) error {
	paths, err := splitPaths(list)
	if err != nil {
		s.cfg.Log.Warn("node socket: bad request", "err", err)
		return err
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.Timeout)
	defer cancel()
	if _, err := c.Write([]byte(Ack)); err != nil {
		return err
	}
	acked := keepAcking(c)
	res := s.openMany(ctx, root, paths)
	defer func() {
		for i := range res {
			res[i].close()
		}
	}()
	if err := acked(); err != nil { // the client is gone
		return err
	}
	le := binary.LittleEndian
	for i := range res {
		r := &res[i]
		if r.Err == nil && r.File == nil && r.Pipe == nil && (r.Data == nil || len(r.Data) > MaxInline) {
			r.Err = fmt.Errorf("%w: %s: no descriptor, and %d bytes (at most %d go inline)", syscall.EIO, paths[i],
				len(r.Data), MaxInline)
		}
		errno, msg := s.errnoOf(r.Err)
		origin, inline := r.Origin, inlineNone
		switch {
		case errno != 0:
			origin = 0
		case r.Pipe != nil:
			inline = uint32(r.Pipe.Len())
		case r.File == nil:
			inline = uint32(len(r.Data))
		}
		reply := le.AppendUint32([]byte(Magic), uint32(int32(errno)))
		reply = le.AppendUint32(reply, origin)
		reply = le.AppendUint32(reply, uint32(len(msg)))
		reply = le.AppendUint32(reply, inline)
		reply = append(reply, msg...)
		switch {
		case errno != 0:
			_, err = c.Write(reply)
		case r.File != nil:
			_, _, err = c.WriteMsgUnix(reply, unix.UnixRights(int(r.File.Fd())), nil)
		case r.Pipe != nil:
			err = sendPiped(c, reply, r.Pipe)
		default:
			bufs := net.Buffers{reply, r.Data}
			_, err = bufs.WriteTo(c)
		}
		r.close()
		if err != nil {
			return err
		}
	}
	return nil
}

// sendPiped writes the reply head and then the bytes the pipe p holds on c.
func sendPiped(c *net.UnixConn, head []byte, p *splice.Pipe) error {
	if _, err := c.Write(head); err != nil {
		return err
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	return p.WriteTo(rc)
}

// openMany opens the files of a batch: with the ManyOpener, else with the Opener a few at a
// time, else not at all (ENOSYS for each).
func (s *Server) openMany(ctx context.Context, root string, paths []string) []Opened {
	if s.cfg.OpenMany != nil {
		res := s.cfg.OpenMany(ctx, root, paths)
		if len(res) == len(paths) {
			return res
		}
		for i := range res {
			res[i].close()
		}
		res = make([]Opened, len(paths))
		for i := range res {
			res[i].Err = fmt.Errorf("%w: %d answers to a batch of %d files", syscall.EIO, len(res), len(paths))
		}
		return res
	}
	res := make([]Opened, len(paths))
	if s.cfg.Open == nil {
		for i := range res {
			res[i].Err = fmt.Errorf("operation %d: %w", OpOpenMany, syscall.ENOSYS)
		}
		return res
	}
	Each(len(paths), openManyWorkers, func(i int) {
		f, origin, err := s.cfg.Open(ctx, root, paths[i])
		res[i] = Opened{File: f, Origin: origin, Err: err}
	})
	return res
}

// Each calls f(i) for every i in [0, n), at most workers at a time, and returns when all have
// returned: how the files of a batch are opened at once.
func Each(n, workers int, f func(i int)) {
	next := make(chan int, n) // filled up front: a worker that stops early blocks no one
	for i := range n {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for range min(n, workers) {
		wg.Go(func() {
			for i := range next {
				f(i)
			}
		})
	}
	wg.Wait()
}

// errnoOf returns the errno and message a reply carries for err: 0 and none for nil, EIO for
// an error that maps to no errno.
func (s *Server) errnoOf(err error) (syscall.Errno, string) {
	if err == nil {
		return 0, ""
	}
	errno := s.cfg.Errno(err)
	if errno == 0 {
		errno = syscall.EIO
	}
	msg := err.Error()
	if len(msg) > maxMessage {
		msg = msg[:maxMessage]
	}
	return errno, msg
}

// OpenMany asks the server at the node socket path to open the files at paths (inside root)
// for a reader, MaxBatch at a time (OpOpenMany), waiting as Open does: ProbeTimeout for each
// ack, until ctx's deadline for the answers. It returns one Opened per path, in order (the
// caller closes the descriptors), each with its descriptor, its bytes (Data, when the server
// sent them inline) or the server's error for that file (an ErrnoError); or an error for the whole request: ErrUnknownOp from a server older
// than OpOpenMany, one wrapping ErrUnavailable when the server could not be asked.
func OpenMany(ctx context.Context, socketPath, root string, paths []string) ([]Opened, error) {
	c, err := dial(ctx, socketPath)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	defer context.AfterFunc(ctx, func() { c.SetReadDeadline(time.Unix(1, 0)) })()
	out := make([]Opened, 0, len(paths))
	fail := func(err error) ([]Opened, error) {
		for i := range out {
			out[i].close()
		}
		return nil, err
	}
	for len(out) < len(paths) {
		batch := paths[len(out):]
		batch = batch[:min(len(batch), MaxBatch)]
		got, err := openBatch(ctx, c, root, batch)
		if err != nil {
			return fail(err)
		}
		out = append(out, got...)
	}
	return out, nil
}

// openBatch sends one OpOpenMany request on c and reads its replies.
func openBatch(ctx context.Context, c *net.UnixConn, root string, paths []string) ([]Opened, error) {
	c.SetDeadline(time.Now().Add(ProbeTimeout))
	if _, err := c.Write(AppendRequest(nil, OpOpenMany, root, string(AppendPaths(nil, paths)))); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if err := ReadAck(c); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
			return nil, fmt.Errorf("%w (%d): %v", ErrUnknownOp, OpOpenMany, err)
		}
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(24 * time.Hour)
	}
	out := make([]Opened, 0, len(paths))
	for i, path := range paths {
		// The first reply comes after the acks the server repeats while it works; the others
		// follow it at once.
		var data []byte
		f, origin, err := readOpenReply(ctx, c, path, deadline, i == 0, &data)
		if err != nil && !errors.As(err, new(*ErrnoError)) {
			for i := range out {
				out[i].close()
			}
			return nil, err
		}
		out = append(out, Opened{File: f, Data: data, Origin: origin, Err: err})
	}
	return out, nil
}
