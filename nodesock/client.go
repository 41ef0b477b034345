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
// reader (OpOpen), waiting ProbeTimeout for the server to acknowledge the request and until
// ctx's deadline for its answer. It returns the descriptor the server sent (the caller closes
// it) and its origin (core.Origin's values), an error carrying the server's errno (see
// ErrnoError) when it refused, or one wrapping ErrUnavailable when it could not be asked. The
// server must run as this user or as root: its answer is read as a dataset file.
func Open(ctx context.Context, socketPath, root, path string) (*os.File, uint32, error) {
	d := net.Dialer{Timeout: ProbeTimeout}
	conn, err := d.DialContext(ctx, "unix", socketPath)
	if err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	c := conn.(*net.UnixConn)
	defer c.Close()
	if uid, err := peerUID(c); err != nil || (uid != os.Geteuid() && uid != 0) {
		return nil, 0, fmt.Errorf("%w: %s is served by user %d, not this one", ErrUnavailable, socketPath, uid)
	}
	c.SetDeadline(time.Now().Add(ProbeTimeout))
	if _, err := c.Write(AppendRequest(nil, OpOpen, root, path)); err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if err := ReadAck(c); err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Time{}
	}
	c.SetDeadline(deadline)
	// Reply: magic, errno, origin, message length, message; the descriptor rides with the
	// first bytes.
	head := make([]byte, 16)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, flags, _, err := c.ReadMsgUnix(head, oob)
	if err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	var file *os.File
	if msgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
		for _, m := range msgs {
			if fds, err := unix.ParseUnixRights(&m); err == nil {
				for _, fd := range fds {
					if file == nil {
						unix.CloseOnExec(fd)
						file = os.NewFile(uintptr(fd), path)
					} else {
						unix.Close(fd)
					}
				}
			}
		}
	}
	fail := func(err error) (*os.File, uint32, error) {
		if file != nil {
			file.Close()
		}
		return nil, 0, err
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return fail(fmt.Errorf("%w: truncated control message", ErrUnavailable))
	}
	if _, err := io.ReadFull(c, head[n:]); err != nil {
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
	if errno := syscall.Errno(int32(le.Uint32(head[4:8]))); errno != 0 {
		return fail(&ErrnoError{Errno: errno, Message: string(msg)})
	}
	if file == nil {
		return nil, 0, fmt.Errorf("%w: a reply without its descriptor", ErrUnavailable)
	}
	return file, le.Uint32(head[8:12]), nil
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
