package rpc

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/cloudwego/gopkg/protocol/thrift"
	"github.com/cloudwego/kitex/pkg/remote"
	"github.com/cloudwego/kitex/pkg/rpcinfo"
	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/internal/splice"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// pattern returns n bytes that differ with their offset and with seed.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7+i>>8) ^ seed
	}
	return b
}

// TestReadRepliesCarryTheFilesBytes: files of every size around the thresholds reach the
// client whole, sent from the cached file (sendfile, over TCP), from its mapping (over a
// Unix socket, or with sendFromFiles off), or from the source's bytes in memory, and read into
// a new buffer, into the caller's, or into a new one when the caller's is too small.
func TestReadRepliesCarryTheFilesBytes(t *testing.T) {
	for _, tc := range []struct {
		unix, fromFiles bool
	}{{false, true}, {false, false}, {true, true}} {
		fromFiles := tc.fromFiles
		sendFromFiles = fromFiles
		t.Cleanup(func() { sendFromFiles = true })
		addr, _ := serveEngine(t, testToken)
		if !tc.unix {
			addr, _, _ = serveTCP(t, ServerConfig{Token: testToken})
		}
		c, _ := Dial(addr, ClientConfig{Token: testToken})
		defer c.Close()
		root := t.TempDir()
		for i, size := range []int{0, 1, bulkMin - 1, bulkMin, readWindow + 1, 110 << 10, 1<<20 + 3} {
			path := filepath.Join(root, "f"+string(rune('a'+i)))
			want := pattern(size, byte(i))
			os.WriteFile(path, want, 0o644)
			req := &fitcachepb.ReadRequest{Root: root, Path: path}
			for round := range 2 { // a miss (read from the source, then the tier), then a hit
				for _, bufSize := range []int{-1, size, size/2 - 1} {
					var buf []byte
					if bufSize >= 0 {
						buf = make([]byte, bufSize, bufSize+1)
					}
					r, err := c.ReadInto(context.Background(), req, buf)
					if err != nil {
						t.Fatalf("files %v, %d bytes, round %d, buffer of %d: %v", fromFiles, size, round, bufSize, err)
					}
					if !bytes.Equal(r.Data, want) || r.Size != int64(size) {
						t.Errorf("files %v, %d bytes, round %d, buffer of %d: got %d bytes, not the file's", fromFiles, size, round,
							bufSize, len(r.Data))
					}
					if inBuf := size > 0 && bufSize >= size && &r.Data[0] == &buf[0]; inBuf != (size > 0 && bufSize >= size) {
						t.Errorf("files %v, %d bytes, buffer of %d: read into the caller's buffer %v", fromFiles, size, bufSize, inBuf)
					}
					if round == 1 && r.Origin != fitcachepb.Origin_MEMORY {
						t.Errorf("%d bytes: second read from %q, want the memory tier", size, r.Origin)
					}
				}
			}
		}
	}
}

// openFiles returns the number of descriptors this process has open, and of mappings of
// files under dir.
func openFiles(t *testing.T, dir string) (fds, maps int) {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip(err)
	}
	m, _ := os.ReadFile("/proc/self/maps")
	return len(entries), strings.Count(string(m), dir)
}

// TestRepliesReleaseTheirFiles: a reply's cached file (opened to be sent) and its mapping
// are released once the reply is written, however many replies are sent.
func TestRepliesReleaseTheirFiles(t *testing.T) {
	tiers := t.TempDir()
	addr, _, _ := serveTCPWithTiers(t, ServerConfig{Token: testToken}, tiers)
	c, _ := Dial(addr, ClientConfig{Token: testToken})
	defer c.Close()
	root := t.TempDir()
	path := filepath.Join(root, "f")
	os.WriteFile(path, pattern(64<<10, 1), 0o644)
	req := &fitcachepb.ReadRequest{Root: root, Path: path}
	if _, err := c.ReadInto(context.Background(), req, nil); err != nil {
		t.Fatal(err)
	}
	fds0, maps0 := openFiles(t, tiers)
	for range 200 {
		if _, err := c.ReadInto(context.Background(), req, nil); err != nil {
			t.Fatal(err)
		}
	}
	// The server releases a file once its reply is out, which may be just after the client
	// has read it: the last reply's file is given a moment.
	fds, maps := openFiles(t, tiers)
	for deadline := time.Now().Add(2 * time.Second); (fds > fds0+2 || maps > maps0) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		fds, maps = openFiles(t, tiers)
	}
	if fds > fds0+2 || maps > maps0 {
		t.Errorf("after 200 reads: %d descriptors (%d before), %d mappings of tier files (%d before)", fds, fds0, maps, maps0)
	}
}

// silentServer accepts connections on a TCP port, runs the handshake, reads whatever comes
// and never answers.
func silentServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				if serverHandshake(c, newJobKeys(testToken)) == nil {
					c.SetReadDeadline(time.Now().Add(10 * time.Second))
					io.Copy(io.Discard, c)
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// TestUnansweredReadEndsWithItsContext: a read that gets no answer ends when its context is
// canceled, or at the read timeout, with an error that is no refusal (the server may only be
// slow), and leaves the caller's buffer alone.
func TestUnansweredReadEndsWithItsContext(t *testing.T) {
	addr := silentServer(t)
	c, _ := Dial(addr, ClientConfig{Token: testToken, ReadTimeout: 300 * time.Millisecond})
	defer c.Close()
	buf := make([]byte, 100)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	_, err := c.ReadInto(ctx, &fitcachepb.ReadRequest{Root: "/r", Path: "/r/f"}, buf)
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, context.Canceled) || IsRefused(err) {
		t.Errorf("canceled read: %v, want ErrUnavailable, context.Canceled, and no refusal", err)
	}
	_, err = c.ReadInto(context.Background(), &fitcachepb.ReadRequest{Root: "/r", Path: "/r/f"}, buf)
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) || IsRefused(err) {
		t.Errorf("read past its timeout: %v, want ErrUnavailable, context.DeadlineExceeded, and no refusal", err)
	}
	if !bytes.Equal(buf, make([]byte, 100)) {
		t.Errorf("the caller's buffer was written to")
	}
}

// TestIdleConnectionOfAStoppedServerIsNotReused: a client whose idle connection the server
// closed when it stopped (a restart) makes its next call on a new connection: the call does
// not fail.
func TestIdleConnectionOfAStoppedServerIsNotReused(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	e := newTestEngine(t, t.TempDir())
	srv, _, _ := Serve(e, ln, ServerConfig{Token: testToken})
	c, _ := Dial(addr, ClientConfig{Token: testToken})
	defer c.Close()
	if _, err := c.Hello(context.Background()); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	ln2, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("cannot listen at %s again: %v", addr, err)
	}
	srv2, _, _ := Serve(e, ln2, ServerConfig{Token: testToken})
	defer srv2.Stop()
	if _, err := c.Hello(context.Background()); err != nil {
		t.Errorf("first call after the server restarted: %v", err)
	}
}

// memConn is a connection that reads r and discards what is written.
type memConn struct {
	net.Conn // nil: only the methods below are used
	r        *bytes.Reader
}

func (c memConn) Read(p []byte) (int, error)       { return c.r.Read(p) }
func (c memConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c memConn) Close() error                     { return nil }
func (c memConn) SetDeadline(time.Time) error      { return nil }
func (c memConn) SetReadDeadline(time.Time) error  { return nil }
func (c memConn) SetWriteDeadline(time.Time) error { return nil }

// decodeReadReply decodes f, a framed reply to a Read call with sequence id 1, as a client
// of this transport does, into buf when its data fits.
func decodeReadReply(f, buf []byte) (*fitcachepb.ReadReply, error) {
	return decodeReadReplyOn(newConn(memConn{r: bytes.NewReader(f)}, 0), buf)
}

// decodeReadReplyOn decodes the next reply on c as decodeReadReply does.
func decodeReadReplyOn(c *conn, buf []byte) (*fitcachepb.ReadReply, error) {
	m := fuzzService.Methods["Read"]
	ink := rpcinfo.NewInvocation("FitCache", "Read")
	ink.SetSeqID(1)
	ink.SetMethodInfo(m)
	ri := rpcinfo.NewRPCInfo(rpcinfo.EmptyEndpointInfo(), rpcinfo.EmptyEndpointInfo(), ink, rpcinfo.NewRPCConfig(),
		rpcinfo.NewRPCStats())
	res := m.NewResult().(*fitcachepb.FitCacheReadResult)
	msg := remote.NewMessage(res, ri, remote.Reply, remote.Client)
	in := newBuffer(c, remote.BitReadable, nil)
	defer in.Release(nil)
	ctx := context.WithValue(context.Background(), bulkDestKey{}, newBulkDest(buf))
	err := newFramedCodec(DefaultMaxFrameBytes).Decode(ctx, msg, in)
	return res.Success, err
}

// directConn is a memConn that counts the bytes read straight into dest.
type directConn struct {
	memConn
	dest   []byte
	direct *int
}

func (c directConn) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	at, lo := uintptr(unsafe.Pointer(unsafe.SliceData(p))), uintptr(unsafe.Pointer(unsafe.SliceData(c.dest)))
	if len(p) > 0 && at >= lo && at < lo+uintptr(len(c.dest)) {
		*c.direct += n
	}
	return n, err
}

// A client's connection reads a Read reply's data straight into the caller's buffer: at most
// replyReadAhead bytes of it come through the connection's own buffer (and are copied
// twice), also when whole replies have arrived at once, one after another.
func TestAReplysDataSkipsTheConnectionsBuffer(t *testing.T) {
	data := pattern(110<<10, 5)
	f, _ := readReply(data, "")
	buf := make([]byte, len(data))
	direct := 0
	c := newConn(directConn{memConn{r: bytes.NewReader(bytes.Repeat(f, 3))}, buf, &direct}, replyReadAhead)
	for i := range 3 {
		r, err := decodeReadReplyOn(c, buf)
		if err != nil || !bytes.Equal(r.Data, data) || &r.Data[0] != &buf[0] {
			t.Fatalf("reply %d: %v", i, err)
		}
	}
	if want := 3 * (len(data) - replyReadAhead); direct < want {
		t.Errorf("%d bytes of the data read straight into the caller's buffer, want %d or more", direct, want)
	}
}

// readReply returns a framed Read reply with data, and the offset of data in its payload.
func readReply(data []byte, message string) ([]byte, int) {
	r := &fitcachepb.FitCacheReadResult{Success: &fitcachepb.ReadReply{Size: int64(len(data)), Data: data,
		Message: message, Origin: fitcachepb.Origin_MEMORY, Dead: []string{"a", "b"}, Stamp: []byte{1, 2, 3}}}
	f := frame("Read", thrift.REPLY, 1, encode(r))
	return f, bytes.Index(f, data) - 4
}

// TestReadReplyDataIsFoundAndChecked: the client finds a Read reply's data after the fields
// before it and reads it into the caller's buffer, checks the rest of the frame as any other,
// and decodes a frame whose data it cannot find within readWindow as any other.
func TestReadReplyDataIsFoundAndChecked(t *testing.T) {
	data := pattern(10000, 3)
	f, at := readReply(data, "")
	if gotAt, n, ok := findData(f[4:], "Read", 5); !ok || gotAt != at || n != len(data) {
		t.Errorf("findData: %d, %d, %v; want %d, %d, true", gotAt, n, ok, at, len(data))
	}
	buf := make([]byte, len(data))
	r, err := decodeReadReply(f, buf)
	if err != nil || !bytes.Equal(r.Data, data) || &r.Data[0] != &buf[0] || r.Origin != fitcachepb.Origin_MEMORY || len(r.Dead) != 2 {
		t.Errorf("decode: %v, %+v", err, r)
	}
	// A long message before the data: found beyond the window only by decoding the frame.
	long, longAt := readReply(data, strings.Repeat("m", readWindow))
	if _, _, ok := findData(long[4:4+readWindow], "Read", 5); ok {
		t.Errorf("findData found data at %d beyond a window of %d", longAt, readWindow)
	}
	if r, err := decodeReadReply(long, buf); err != nil || !bytes.Equal(r.Data, data) {
		t.Errorf("decode with a long message: %v", err)
	}
	// Data said to be longer than the frame, and a frame damaged after the data.
	over := bytes.Clone(f)
	binary.BigEndian.PutUint32(over[4+at-4:], uint32(len(data)+100))
	tail := bytes.Clone(f)
	tail[len(tail)-1] = 0x0b // a string where the reply's STOP belongs
	for name, bad := range map[string][]byte{"data longer than its frame": over, "damaged after the data": tail} {
		if _, err := decodeReadReply(bad, buf); err == nil || !strings.Contains(err.Error(), "malformed frame") {
			t.Errorf("%s: %v, want a malformed frame", name, err)
		}
	}
	for name, notRead := range map[string][]byte{"exception": frame("Read", thrift.EXCEPTION, 1, []byte{0}),
		"Hello reply": frame("Hello", thrift.REPLY, 1, []byte{0}), "no data": frame("Read", thrift.REPLY, 1, []byte{12, 0, 0, 0, 0})} {
		if _, _, ok := findData(notRead[4:], "Read", 5); ok {
			t.Errorf("%s: findData found data", name)
		}
	}
}

// FuzzDecodeReadReply feeds frames (with their length prefix set to their length) to a
// client's decoding of Read replies through this transport: whatever the frame, the decode
// allocates no more than decodeBound and does not crash, and data it returns is the frame's.
func FuzzDecodeReadReply(f *testing.F) {
	_, replies := fullMessages()
	f.Add(replies["Read"][4:])
	r, _ := readReply(pattern(5000, 1), "")
	f.Add(r[4:])
	f.Add(hugeListReply[4:])
	f.Fuzz(func(t *testing.T, payload []byte) {
		fr := append(binary.BigEndian.AppendUint32(nil, uint32(len(payload))), payload...)
		var r *fitcachepb.ReadReply
		var err error
		if n := allocated(func() { r, err = decodeReadReply(fr, nil) }); n > decodeBound(len(fr)) {
			t.Fatalf("decoding a Read reply of %d bytes allocated %d bytes (%v)", len(fr), n, err)
		}
		if err == nil && r != nil && len(r.Data) > 0 && !bytes.Contains(payload, r.Data) {
			t.Fatalf("decoded data that is not in the frame")
		}
	})
}

// TestReadBatch: a batch's files come back in order, each with its bytes or its error (a
// missing file, one too large for any reply, ones that no longer fit in this reply), into the
// caller's buffer, a new one, or pipes (those of at most splice.Max bytes, the others in
// the buffer), sent from the cached files or from their mappings.
func TestReadBatch(t *testing.T) {
	const frame = 1 << 20
	for _, fromFiles := range []bool{true, false} {
		sendFromFiles = fromFiles
		t.Cleanup(func() { sendFromFiles = true })
		addr, _, _ := serveTCP(t, ServerConfig{Token: testToken, MaxFrameBytes: frame})
		c, _ := Dial(addr, ClientConfig{Token: testToken, MaxFrameBytes: frame})
		defer c.Close()
		root := t.TempDir()
		sizes := []int{0, 100, 5000, 200 << 10, -1, 2 * frame, 300 << 10, 300 << 10, 300 << 10, 7}
		var paths []string
		want := map[string][]byte{}
		for i, size := range sizes {
			p := filepath.Join(root, fmt.Sprintf("f%d", i))
			paths = append(paths, p)
			if size >= 0 {
				want[p] = pattern(size, byte(i))
				os.WriteFile(p, want[p], 0o644)
			}
		}
		// 200 KiB and two of 300 KiB fit in the 1 MiB reply (with its slack); the third 300 KiB no longer.
		wantErr := map[int]syscall.Errno{4: syscall.ENOENT, 5: syscall.EFBIG, 8: syscall.ENOBUFS}
		for round := range 2 {
			for _, into := range []string{"new buffer", "caller's buffer", "pipes"} {
				var buf []byte
				if into != "new buffer" {
					buf = make([]byte, 1<<20)
				}
				var sink *PipeSink
				if into == "pipes" {
					sink = &PipeSink{}
				}
				r, err := c.ReadBatch(context.Background(), &fitcachepb.ReadBatchRequest{Root: root, Paths: paths}, buf, sink)
				if err != nil {
					t.Fatalf("files %v, round %d: %v", fromFiles, round, err)
				}
				for i, f := range r.Replies {
					err := core.NewErrnoError(f.Errno, core.Reason(f.Reason), f.Message)
					if got := core.Errno(err); got != wantErr[i] {
						t.Errorf("files %v, round %d, file %d: errno %v (%v), want %v", fromFiles, round, i, got, err, wantErr[i])
					}
					if piped := sink.Piped(i); piped != (into == "pipes" && err == nil && sizes[i] > 0 && sizes[i] <= splice.Max) {
						t.Errorf("files %v, round %d, into %s, file %d of %d bytes: in a pipe %v", fromFiles, round, into, i, sizes[i], piped)
					} else if piped {
						f.Data = drain(t, sink.Take(i))
					}
					if err == nil && !bytes.Equal(f.Data, want[paths[i]]) {
						t.Errorf("files %v, round %d, file %d: %d bytes, not the file's %d", fromFiles, round, i, len(f.Data), sizes[i])
					}
					if err == nil && cap(f.Data) != len(f.Data) {
						t.Errorf("file %d: its data reaches into the next file's (capacity %d)", i, cap(f.Data))
					}
				}
				if into != "new buffer" && len(r.Data) > 0 && &r.Data[0] != &buf[0] {
					t.Errorf("files %v, round %d: the batch's bytes were not read into the caller's buffer", fromFiles, round)
				}
				sink.Close()
			}
		}
	}
}

// drain returns the bytes of the pipe p, sent through a socket pair, and gives p back.
func drain(t *testing.T, p *splice.Pipe) []byte {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	out, in := os.NewFile(uintptr(fds[0]), "out"), os.NewFile(uintptr(fds[1]), "in")
	defer in.Close()
	got := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(in)
		got <- b
	}()
	rc, err := out.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.WriteTo(rc); err != nil {
		t.Fatal(err)
	}
	out.Close()
	splice.Put(p)
	b := <-got
	return b[:len(b):len(b)]
}

// A batch's cached files that cannot be sent with sendfile (over a Unix socket; from 1 MiB
// up, where the mapping costs less) are sent from their mappings, made as the reply is
// written: the bytes are the files', in order, cached or not yet.
func TestReadBatchSendsFromMappingsMadeWhenWritten(t *testing.T) {
	unixAddr, _ := serveEngine(t, testToken)
	tcpAddr, _, _ := serveTCP(t, ServerConfig{Token: testToken})
	root := t.TempDir()
	sizes := []int{100 << 10, sendFileMax + 4096, 7, 300 << 10}
	var paths []string
	want := map[string][]byte{}
	for i, size := range sizes {
		p := filepath.Join(root, fmt.Sprintf("f%d", i))
		paths = append(paths, p)
		want[p] = pattern(size, byte(i+1))
		os.WriteFile(p, want[p], 0o644)
	}
	for _, addr := range []string{unixAddr, tcpAddr} {
		c, err := Dial(addr, ClientConfig{Token: testToken})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		for round := range 2 { // the source's bytes, then the cached copies'
			r, err := c.ReadBatch(context.Background(), &fitcachepb.ReadBatchRequest{Root: root, Paths: paths}, nil, nil)
			if err != nil {
				t.Fatalf("%s, round %d: %v", addr, round, err)
			}
			for i, f := range r.Replies {
				if f.Errno != 0 || !bytes.Equal(f.Data, want[paths[i]]) {
					t.Errorf("%s, round %d, file %d: errno %d, %d bytes, want the file's %d", addr, round, i, f.Errno, len(f.Data), sizes[i])
				}
			}
		}
	}
}
