package rpc

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/cloudwego/kitex/pkg/remote"

	"github.com/fitcache/fitcache/internal/splice"
)

// buffer is the remote.ByteBuffer of one message on a conn of this transport (transport.go):
// reads go through the connection's reader, or first through a frame the codec set aside
// (replay); writes go through its writer, which passes slices of 4 KiB or more on to the
// socket without copying them (bufiox.DefaultWriter), and the codec may send bytes from a
// file (writeBulk) or read them into a buffer of its own (readDirect).
type buffer struct {
	c      *conn
	status int        // remote.BitReadable, remote.BitWritable
	req    *request   // a server's request, whose reply may send bytes from files; nil on clients
	replay []byte     // read before the connection
	rn     int        // bytes read from replay and directly (see ReadLen)
	corked bool       // the socket holds partial segments back until Flush (see writeBulk)
	call   *callState // a client's call: its reply read, or its request failed, ends its use of c
}

var buffers = sync.Pool{New: func() any { return new(buffer) }}

func newBuffer(c *conn, status int, req *request) *buffer {
	b := buffers.Get().(*buffer)
	*b = buffer{c: c, status: status, req: req}
	return b
}

var (
	errNotReadable = errors.New("rpc: buffer not readable")
	errNotWritable = errors.New("rpc: buffer not writable")
)

func (b *buffer) readable() error {
	if b.status&remote.BitReadable == 0 {
		return errNotReadable
	}
	return nil
}

func (b *buffer) writable() error {
	if b.status&remote.BitWritable == 0 {
		return errNotWritable
	}
	return nil
}

// setReplay makes the next reads return p (a whole frame, which they must not read past)
// before anything from the connection.
func (b *buffer) setReplay(p []byte) { b.replay = p }

// fromReplay takes n bytes of the replayed frame, if there is one.
func (b *buffer) fromReplay(n int, advance bool) (p []byte, ok bool, err error) {
	if b.replay == nil {
		return nil, false, nil
	}
	if n < 0 || n > len(b.replay) {
		return nil, true, fmt.Errorf("rpc: %d bytes wanted of a frame with %d left", n, len(b.replay))
	}
	p = b.replay[:n:n]
	if advance {
		b.replay = b.replay[n:]
		b.rn += n
	}
	return p, true, nil
}

// Next implements remote.ByteBuffer.
func (b *buffer) Next(n int) ([]byte, error) { return b.next(n, true) }

// Peek implements remote.ByteBuffer.
func (b *buffer) Peek(n int) ([]byte, error) { return b.next(n, false) }

// next returns the next n bytes, and moves past them if advance is set.
func (b *buffer) next(n int, advance bool) ([]byte, error) {
	if err := b.readable(); err != nil {
		return nil, err
	}
	if p, ok, err := b.fromReplay(n, advance); ok {
		return p, err
	}
	if advance {
		return b.c.r.Next(n)
	}
	return b.c.r.Peek(n)
}

// Skip implements remote.ByteBuffer.
func (b *buffer) Skip(n int) error {
	_, err := b.Next(n)
	return err
}

// ReadableLen implements remote.ByteBuffer: the bytes buffered (more may be on their way).
func (b *buffer) ReadableLen() int {
	if b.replay != nil {
		return len(b.replay)
	}
	return b.c.r.Buffered()
}

// ReadLen implements remote.ByteBuffer.
func (b *buffer) ReadLen() int { return b.rn + b.c.r.ReadLen() }

// ReadString implements remote.ByteBuffer.
func (b *buffer) ReadString(n int) (string, error) {
	p, err := b.Next(n)
	return string(p), err
}

// ReadBinary implements remote.ByteBuffer: it fills p.
func (b *buffer) ReadBinary(p []byte) (int, error) {
	if err := b.readable(); err != nil {
		return 0, err
	}
	if q, ok, err := b.fromReplay(len(p), true); ok {
		return copy(p, q), err
	}
	return b.c.r.ReadBinary(p)
}

// Read implements io.Reader.
func (b *buffer) Read(p []byte) (int, error) {
	if err := b.readable(); err != nil {
		return 0, err
	}
	if b.replay != nil {
		if len(b.replay) == 0 {
			return 0, io.EOF
		}
		q, _, _ := b.fromReplay(min(len(p), len(b.replay)), true)
		return copy(p, q), nil
	}
	return b.c.r.Read(p)
}

// readDirect fills p with the connection's next bytes: those its reader holds, then straight
// from the socket, so that they are copied once (the reader would buffer them, and grow its
// buffer to the size of the largest messages).
func (b *buffer) readDirect(p []byte) error {
	if err := b.readable(); err != nil {
		return err
	}
	n := min(len(p), b.c.r.Buffered())
	if _, err := b.c.r.ReadBinary(p[:n]); err != nil {
		return err
	}
	m, err := io.ReadFull(b.c.Conn, p[n:])
	b.rn += m
	return err
}

// readDirectPipe moves the connection's next n bytes into the pipe p, as readDirect reads
// them into memory: those its reader holds are written into the pipe, the rest spliced
// from the socket, without entering this process.
func (b *buffer) readDirectPipe(p *splice.Pipe, n int) error {
	if err := b.readable(); err != nil {
		return err
	}
	if b.c.sock == nil {
		return errors.New("rpc: a pipe for the bytes of a connection without a socket")
	}
	held, err := b.c.r.Next(min(n, b.c.r.Buffered()))
	if err != nil {
		return err
	}
	if err := p.Write(held); err != nil {
		return err
	}
	rc, err := b.c.sock.SyscallConn()
	if err != nil {
		return err
	}
	if err := p.ReadFrom(rc, n-len(held)); err != nil {
		return err
	}
	b.rn += n - len(held)
	return nil
}

// Malloc implements remote.ByteBuffer.
func (b *buffer) Malloc(n int) ([]byte, error) {
	if err := b.writable(); err != nil {
		return nil, err
	}
	return b.c.w.Malloc(n)
}

// WrittenLen implements remote.ByteBuffer.
func (b *buffer) WrittenLen() int { return b.c.w.WrittenLen() }

// WriteString implements remote.ByteBuffer.
func (b *buffer) WriteString(s string) (int, error) { return b.WriteBinary([]byte(s)) }

// WriteBinary implements remote.ByteBuffer: p of 4 KiB or more is not copied, and must stay
// unchanged until Flush.
func (b *buffer) WriteBinary(p []byte) (int, error) {
	if err := b.writable(); err != nil {
		return 0, err
	}
	return b.c.w.WriteBinary(p)
}

// Write implements io.Writer, as WriteBinary.
func (b *buffer) Write(p []byte) (int, error) { return b.WriteBinary(p) }

// writeBulk writes p, which a server's reply may send from a file instead (see
// request.sendFrom): the bytes written so far are sent first.
func (b *buffer) writeBulk(p []byte) error {
	f, ok := b.req.fileOf(p)
	if !ok || !b.sendsFiles(len(p)) {
		_, err := b.WriteBinary(p)
		return err
	}
	return b.sendFile(f, len(p))
}

// writePart writes a ReadBatch reply's part: from its cached file where the connection sends
// files, else from memory (a file's mapping made now).
func (b *buffer) writePart(p batchPart) error {
	if p.file != nil && b.sendsFiles(p.n) {
		return b.sendFile(p.file, p.n)
	}
	data, err := p.bytes()
	if err != nil {
		return err
	}
	_, err = b.WriteBinary(data)
	return err
}

// sendsFiles reports whether n bytes of a file are sent from the file (see sendFileMax).
func (b *buffer) sendsFiles(n int) bool { return b.c.canSendFile() && n < sendFileMax }

// sendFile sends n bytes of f, after the bytes written so far.
func (b *buffer) sendFile(f *os.File, n int) error {
	// The frame's first bytes, the file's and the last ones leave in as few segments as
	// they fill, and wake the reader once (see Flush).
	b.corked = b.corked || b.c.cork(true)
	if err := b.c.w.Flush(); err != nil {
		return err
	}
	return b.c.sendFile(f, int64(n))
}

// sendFileMax is the size from which a file's bytes are written from its mapping rather than
// sent from the file: sendfile costs less CPU time below it and more above it, on loopback
// TCP (BenchmarkRemoteRead, both sides together, medians of 5 to 7 alternated runs: 110 KiB
// 110 µs against 115 µs, 512 KiB 188 against 212, 1 MiB 470 against 448, 2 MiB 1051 against
// 747, 4 MiB 2090 against 1583). Above it, two other ways cost the server more than the
// mapping for 4 MiB files (bench/remoteread, 3 alternated rounds each, 2026-11-26): the file
// read through a pooled 1 MiB buffer (1,296-1,395 µs against 1,185-1,255) and a mapping
// with its page tables filled at once, MAP_POPULATE (1,352-1,409 against 1,089-1,285).
const sendFileMax = 1 << 20

// Flush implements remote.ByteBuffer.
func (b *buffer) Flush() error {
	if err := b.writable(); err != nil {
		return err
	}
	err := b.c.w.Flush()
	if b.corked {
		b.c.cork(false)
		b.corked = false
	}
	return err
}

// Release implements remote.ByteBuffer.
func (b *buffer) Release(e error) error {
	if b.status&remote.BitReadable != 0 {
		b.c.r.Release(e)
	}
	if b.corked {
		b.c.cork(false)
	}
	if b.call != nil && (b.status&remote.BitReadable != 0 || e != nil) {
		b.call.detach()
	}
	*b = buffer{}
	buffers.Put(b)
	return nil
}

// NewBuffer implements remote.ByteBuffer; Kitex's protocol handlers do not use it.
func (b *buffer) NewBuffer() remote.ByteBuffer { panic("rpc: buffer.NewBuffer is not supported") }

// AppendBuffer implements remote.ByteBuffer; Kitex's protocol handlers do not use it.
func (b *buffer) AppendBuffer(remote.ByteBuffer) error {
	return errors.New("rpc: buffer.AppendBuffer is not supported")
}

// Bytes implements remote.ByteBuffer; Kitex's protocol handlers do not use it.
func (b *buffer) Bytes() ([]byte, error) {
	return nil, errors.New("rpc: buffer.Bytes is not supported")
}
