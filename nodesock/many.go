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

// Opened is the answer for one file of an OpOpenMany request: a read-only descriptor and what
// it holds (a core.Origin), or the file's own error.
type Opened struct {
	File   *os.File
	Origin uint32
	Err    error
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
// opened, then one OpOpen reply per file, in order, each a write of its own with its
// descriptor. A malformed path list ends the connection, as a malformed request does.
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
		for _, r := range res {
			if r.File != nil {
				r.File.Close()
			}
		}
	}()
	if err := acked(); err != nil { // the client is gone
		return err
	}
	le := binary.LittleEndian
	for _, r := range res {
		errno, msg := s.errnoOf(r.Err)
		origin := r.Origin
		if errno != 0 {
			origin = 0
		}
		reply := le.AppendUint32([]byte(Magic), uint32(int32(errno)))
		reply = le.AppendUint32(reply, origin)
		reply = le.AppendUint32(reply, uint32(len(msg)))
		reply = append(reply, msg...)
		if errno != 0 || r.File == nil {
			_, err = c.Write(reply)
		} else {
			_, _, err = c.WriteMsgUnix(reply, unix.UnixRights(int(r.File.Fd())), nil)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// openMany opens the files of a batch: with the ManyOpener, else with the Opener a few at a
// time, else not at all (ENOSYS for each).
func (s *Server) openMany(ctx context.Context, root string, paths []string) []Opened {
	if s.cfg.OpenMany != nil {
		res := s.cfg.OpenMany(ctx, root, paths)
		if len(res) == len(paths) {
			return res
		}
		for _, r := range res {
			if r.File != nil {
				r.File.Close()
			}
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
	next := make(chan int, len(paths))
	for i := range paths {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for range min(len(paths), openManyWorkers) {
		wg.Go(func() {
			for i := range next {
				f, origin, err := s.cfg.Open(ctx, root, paths[i])
				res[i] = Opened{File: f, Origin: origin, Err: err}
			}
		})
	}
	wg.Wait()
	return res
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
// caller closes the descriptors), each with its descriptor or the server's error for that
// file (an ErrnoError); or an error for the whole request: ErrUnknownOp from a server older
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
		for _, o := range out {
			if o.File != nil {
				o.File.Close()
			}
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
		f, origin, err := readOpenReply(ctx, c, path, deadline, i == 0)
		if err != nil && !errors.As(err, new(*ErrnoError)) {
			for _, o := range out {
				if o.File != nil {
					o.File.Close()
				}
			}
			return nil, err
		}
		out = append(out, Opened{File: f, Origin: origin, Err: err})
	}
	return out, nil
}
