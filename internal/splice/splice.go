// Package splice moves a file's bytes from one socket to another through a pipe, without them
// entering the process: a node's server relays the files that servers on other nodes send
// (over TCP) to the readers on its node (over its node socket) this way. Read into memory and
// written out again, each file was copied twice by the relaying server; spliced, the pipe
// takes references to the pages that hold the received bytes, and the Unix socket takes
// them from the pipe, by reference too: the reader's read is their one copy.
//
// A Pipe holds the bytes of one file at most Max long, taken in whole before any is sent
// on, so that the connection they came on is free for its next reply whatever the reader
// does. Pipes are kept for reuse (Get, Put): creating one and sizing it costs system calls.
package splice

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// Max is the largest file a Pipe holds: its capacity. A larger file is read into memory.
const Max = 256 << 10

// Each pipe's pages count against its user's (/proc/sys/fs/pipe-user-pages-soft, 16,384
// pages by default): past that, every new pipe of the user gets two pages, those of the job
// that runs as the same user too. So at most liveMax pipes exist at once (a quarter of the
// default), and idleMax of them wait unused; beyond that the bytes go through memory.
const (
	liveMax = 64
	idleMax = 32
)

var (
	idle = make(chan *Pipe, idleMax) // empty pipes, for Get
	live atomic.Int32                // pipes open
	gets atomic.Int64                // pipes handed out by Get
)

// Counts returns how many pipes Get has handed out, and how many of them are not back.
func Counts() (got int64, inUse int) { return gets.Load(), int(live.Load()) - len(idle) }

// Pipe is a pipe that holds the bytes of one file on their way from one socket to another.
// It is used by one goroutine at a time.
type Pipe struct {
	r, w  int
	n     int    // bytes in the pipe
	spill []byte // bytes after those, in memory (see ReadFrom)
}

// ErrTooMany is Get's error when liveMax pipes are in use.
var ErrTooMany = errors.New("splice: every pipe is in use")

// errOff is Get's error once splice was refused: a kernel without it for these descriptors,
// or a sandbox (seccomp) that forbids it.
var errOff = errors.New("splice: refused by the kernel")

// spliceCall is splice(2) (a test refuses it).
var spliceCall = unix.Splice

// off is set once a splice was refused: the bytes of that file, and of every later one, go
// through memory.
var off atomic.Bool

// refused turns splice off (see Get) when err says that it cannot be used here at all.
func refused(err error) {
	if err == unix.EINVAL || err == unix.ENOSYS || err == unix.EOPNOTSUPP || err == unix.EPERM {
		off.Store(true)
	}
}

// Get returns an empty pipe with room for Max bytes, or an error when none can be had
// (liveMax in use, the process out of descriptors, its user out of pipe pages): the caller
// reads the bytes into memory.
func Get() (*Pipe, error) {
	if off.Load() {
		for { // none will be used again
			select {
			case p := <-idle:
				p.close()
			default:
				return nil, errOff
			}
		}
	}
	select {
	case p := <-idle:
		gets.Add(1)
		return p, nil
	default:
	}
	if live.Add(1) > liveMax {
		live.Add(-1)
		return nil, ErrTooMany
	}
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		live.Add(-1)
		return nil, fmt.Errorf("splice: a pipe: %w", err)
	}
	p := &Pipe{r: fds[0], w: fds[1]}
	if size, err := unix.FcntlInt(uintptr(p.w), unix.F_SETPIPE_SZ, Max); err != nil || size < Max {
		p.close()
		if err == nil {
			err = fmt.Errorf("%d bytes of room", size)
		}
		return nil, fmt.Errorf("splice: sizing a pipe to %d bytes: %w", Max, err)
	}
	gets.Add(1)
	return p, nil
}

// Put gives p back once its bytes are sent (or not wanted): an empty pipe waits for the
// next file, one that still holds bytes is closed.
func Put(p *Pipe) {
	if p == nil {
		return
	}
	if p.n != 0 || len(p.spill) != 0 || off.Load() {
		p.close()
		return
	}
	p.spill = nil
	select {
	case idle <- p:
	default:
		p.close()
	}
}

func (p *Pipe) close() {
	if p.r < 0 {
		return
	}
	unix.Close(p.r)
	unix.Close(p.w)
	p.r, p.w, p.n = -1, -1, -1
	live.Add(-1)
}

// Len returns the bytes p holds.
func (p *Pipe) Len() int { return p.n + len(p.spill) }

// Write puts b (the first bytes of a file, already read into memory) into p; it must fit.
func (p *Pipe) Write(b []byte) error {
	if p.Len()+len(b) > Max {
		return fmt.Errorf("splice: %d bytes more in a pipe holding %d of %d", len(b), p.Len(), Max)
	}
	if len(p.spill) > 0 { // after those
		p.spill = append(p.spill, b...)
		return nil
	}
	for len(b) > 0 {
		k, err := unix.Write(p.w, b)
		if err != nil {
			return fmt.Errorf("splice: writing into a pipe: %w", err)
		}
		b = b[k:]
		p.n += k
	}
	return nil
}

// ReadFrom moves the next n bytes of the socket conn into p; they must fit. It waits for
// them as a read of conn does (its read deadline holds). A pipe has a slot per page of its
// room, and a socket's bytes arrive in pieces (packets) that take a slot each however small:
// when its slots are taken before its room, the rest of the bytes are read into memory, as
// they are where splice fails (a read then reports the socket's own error, if it was one).
func (p *Pipe) ReadFrom(conn syscall.RawConn, n int) error {
	if n < 0 || p.Len()+n > Max {
		return fmt.Errorf("splice: %d bytes more in a pipe holding %d of %d", n, p.Len(), Max)
	}
	var err error
	inMemory := len(p.spill) > 0 || off.Load() // bytes go after those in memory
	if !inMemory {
		again := false // a splice that found no bytes is tried once more when the peek finds some
		if rerr := conn.Read(func(fd uintptr) bool {
			for n > 0 {
				var k int64
				k, err = spliceCall(int(fd), nil, p.w, nil, n, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
				switch {
				case err == unix.EINTR:
					continue
				case err == unix.EAGAIN: // no bytes on the socket, or no slot left in the pipe
					err = nil
					var b [1]byte
					if _, _, perr := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT); perr == unix.EAGAIN {
						return false // no bytes: wait for them
					}
					if !again { // they may have come after the splice looked
						again = true
						continue
					}
					// Bytes, the connection's end, or its error, twice: the pipe has no slot
					// left for them, and a read into memory takes or reports them.
					inMemory = true
					return true
				case err != nil:
					// Refused, or failed on either end: a read into memory goes on, and
					// reports the socket's error if it was the socket's.
					refused(err)
					err, inMemory = nil, true
					return true
				case k == 0:
					err = errors.New("splice: the connection ended in a file's bytes")
					return true
				}
				p.n += int(k)
				n -= int(k)
				again = false
			}
			return true
		}); rerr != nil {
			return rerr
		}
	}
	if err == nil && inMemory && n > 0 {
		p.spill = slices.Grow(p.spill, n)
		want := len(p.spill) + n
		if rerr := conn.Read(func(fd uintptr) bool {
			k, done, e := moveAll(int(fd), p.spill[len(p.spill):want], unix.Read)
			p.spill, err = p.spill[:len(p.spill)+k], e
			return done
		}); rerr != nil {
			return rerr
		}
	}
	if err != nil {
		return fmt.Errorf("splice: from a socket: %w", err)
	}
	return nil
}

// unpipe moves the bytes in the pipe into memory, before those already there.
func (p *Pipe) unpipe() error {
	b := make([]byte, p.n, p.n+len(p.spill))
	if k, _, err := moveAll(p.r, b, unix.Read); k < len(b) {
		return fmt.Errorf("splice: reading a pipe back: %d of %d bytes (%v)", k, len(b), err)
	}
	p.spill, p.n = append(b, p.spill...), 0
	return nil
}

// moveAll calls op, a read or write of the non-blocking descriptor fd, until all of b has
// moved (n), within a syscall.RawConn callback: done is what the callback returns, false when
// fd has no bytes or no room yet (the poller waits for it). An error is op's, or
// io.ErrUnexpectedEOF when a read finds the connection's end.
func moveAll(fd int, b []byte, op func(int, []byte) (int, error)) (n int, done bool, err error) {
	for n < len(b) {
		k, err := op(fd, b[n:])
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return n, false, nil
		case err != nil:
			return n, true, err
		case k == 0:
			return n, true, io.ErrUnexpectedEOF
		}
		n += k
	}
	return n, true, nil
}

// WriteTo sends every byte p holds on the socket conn, waiting for room as a write of conn
// does (its write deadline holds). p is empty once it returns nil.
func (p *Pipe) WriteTo(conn syscall.RawConn) error {
	var err error
	werr := conn.Write(func(fd uintptr) bool {
		for p.n > 0 {
			var k int64
			k, err = spliceCall(p.r, nil, int(fd), nil, p.n, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN: // the socket has no room (the pipe has bytes)
				err = nil
				return false
			case err != nil:
				// Refused, or failed on either end: the pipe's bytes are read out and
				// written, which reports the socket's error if it was the socket's.
				refused(err)
				if err = p.unpipe(); err != nil {
					return true
				}
				continue
			case k == 0:
				err = fmt.Errorf("splice: a pipe said to hold %d bytes gave none", p.n)
				return true
			}
			p.n -= int(k)
		}
		k, done, e := moveAll(int(fd), p.spill, unix.Write)
		p.spill, err = p.spill[k:], e
		return done
	})
	if werr != nil {
		return werr
	}
	if err != nil {
		return fmt.Errorf("splice: to a socket: %w", err)
	}
	p.spill = nil
	return nil
}
