package nodesock

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The client side of the node socket, for Go readers (the C side is capi/fcnode.h): a client
// of a cluster job on a node with a server of the job reads a file no tier of the node holds
// through the node's server, which answers for every file of the job.

// ErrUnavailable wraps failures to reach the server or get its answer in time, as opposed to
// errors it answered with.
var ErrUnavailable = errors.New("node socket: server unavailable")

// Open asks the server at the node socket path to open the file at path (inside root) for a
// reader (OpOpen), waiting ProbeTimeout for each ack of the server and until ctx's deadline
// (or its cancellation) for its answer: a server that stops acknowledging (stopped with
// SIGSTOP, hung) is given up within ProbeTimeout, one busy with a large file is waited for.
// It returns the descriptor the server sent (the caller closes
// it) and its origin (core.Origin's values), an error carrying the server's errno (see
// ErrnoError) when it refused, or one wrapping ErrUnavailable when it could not be asked. The
// server must run as this user or as root: its answer is read as a dataset file.
func Open(ctx context.Context, socketPath, root, path string) (*os.File, uint32, error) {
	c, err := dial(ctx, socketPath)
	if err != nil {
		return nil, 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(ProbeTimeout))
	if _, err := c.Write(AppendRequest(nil, OpOpen, root, path)); err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if err := ReadAck(c); err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	// Cancelling ctx ends the wait at once: the read below fails at a deadline in the past.
	defer context.AfterFunc(ctx, func() { c.SetReadDeadline(time.Unix(1, 0)) })()
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(24 * time.Hour)
	}
	return readOpenReply(ctx, c, path, deadline, true, nil)
}

// dial connects to the node socket at socketPath, served by this user or root, within
// ProbeTimeout; its errors wrap ErrUnavailable.
func dial(ctx context.Context, socketPath string) (*net.UnixConn, error) {
	d := net.Dialer{Timeout: ProbeTimeout}
	conn, err := d.DialContext(ctx, "unix", socketPath)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	c := conn.(*net.UnixConn)
	if uid, err := peerUID(c); err != nil || (uid != os.Geteuid() && uid != 0) {
		c.Close()
		return nil, fmt.Errorf("%w: %s is served by user %d, not this one", ErrUnavailable, socketPath, uid)
	}
	return c, nil
}

// readOpenReply reads one OpOpen reply (for the file at path) from c, waiting ProbeTimeout
// for its start, and no later than deadline: with acks set, the server may send acks first
// while it works (each 4 bytes of a write of its own: reading 4 bytes at a time takes each
// whole, and the reply's start), each a sign of life that renews the probe. The descriptor
// rides with the reply's first bytes. It returns the descriptor and origin, an ErrnoError the
// server answered with, or an error wrapping ErrUnavailable. With inline not nil, the reply is
// an OpOpenMany one (its inline length after the message length), and a file's inline bytes
// are read into *inline.
func readOpenReply(ctx context.Context, c *net.UnixConn, path string, deadline time.Time, acks bool,
	inline *[]byte) (*os.File, uint32, error) {
	var file *os.File
	fail := func(err error) (*os.File, uint32, error) {
		if file != nil {
			file.Close()
		}
		return nil, 0, err
	}
	head := make([]byte, 16, 20)
	if inline != nil {
		head = head[:20]
	}
	for n := 0; n < len(Magic) || (acks && string(head[:n]) == Ack); {
		if n == len(Ack) { // an ack: the server lives
			n = 0
		}
		if err := ctx.Err(); err != nil {
			return fail(fmt.Errorf("%w: %v", ErrUnavailable, err))
		}
		probe := time.Now().Add(ProbeTimeout)
		if deadline.Before(probe) {
			probe = deadline
		}
		c.SetReadDeadline(probe)
		k, err := readWithRights(c, head[n:len(Magic)], &file, path)
		if err != nil {
			return fail(fmt.Errorf("%w: %v", ErrUnavailable, err))
		}
		n += k
	}
	c.SetReadDeadline(time.Now().Add(ProbeTimeout)) // the rest came in the same write
	if _, err := io.ReadFull(c, head[len(Magic):]); err != nil {
		return fail(fmt.Errorf("%w: %v", ErrUnavailable, err))
	}
	le := binary.LittleEndian
	if string(head[:4]) != Magic || le.Uint32(head[12:16]) > maxMessage {
		return fail(fmt.Errorf("%w: a malformed reply", ErrUnavailable))
	}
	msg := make([]byte, le.Uint32(head[12:16]))
	if _, err := io.ReadFull(c, msg); err != nil {
		return fail(fmt.Errorf("%w: %v", ErrUnavailable, err))
	}
	errno := syscall.Errno(int32(le.Uint32(head[4:8])))
	if inline != nil && le.Uint32(head[16:20]) != inlineNone {
		n := le.Uint32(head[16:20])
		if n > MaxInline || file != nil || errno != 0 {
			return fail(fmt.Errorf("%w: a malformed reply (%d inline bytes)", ErrUnavailable, n))
		}
		*inline = make([]byte, n)
		if _, err := io.ReadFull(c, *inline); err != nil {
			return fail(fmt.Errorf("%w: %v", ErrUnavailable, err))
		}
		return nil, le.Uint32(head[8:12]), nil
	}
	if errno != 0 {
		return fail(&ErrnoError{Errno: errno, Message: string(msg)})
	}
	if file == nil {
		return nil, 0, fmt.Errorf("%w: a reply without its descriptor", ErrUnavailable)
	}
	return file, le.Uint32(head[8:12]), nil
}

// readWithRights reads into buf from c, keeping in *file the first descriptor that comes
// with the bytes (named name; any other is closed).
func readWithRights(c *net.UnixConn, buf []byte, file **os.File, name string) (int, error) {
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if msgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
		for _, m := range msgs {
			if fds, err := unix.ParseUnixRights(&m); err == nil {
				for _, fd := range fds {
					if *file == nil {
						unix.CloseOnExec(fd)
						*file = os.NewFile(uintptr(fd), name)
					} else {
						unix.Close(fd)
					}
				}
			}
		}
	}
	if err == nil && n == 0 {
		err = io.ErrUnexpectedEOF
	}
	if err == nil && flags&unix.MSG_CTRUNC != 0 {
		err = errors.New("truncated control message")
	}
	return n, err
}

// ErrnoError is an error the server answered with: its errno and message.
type ErrnoError struct {
	Errno   syscall.Errno
	Message string
}

func (e *ErrnoError) Error() string {
	if e.Message != "" {
		return e.Message
	}
	return e.Errno.Error()
}

// Unwrap lets errors.Is compare the errno (fs.ErrNotExist for ENOENT, say).
func (e *ErrnoError) Unwrap() error { return e.Errno }
