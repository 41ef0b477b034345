package nodesock

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/core"
)

func errno(err error) syscall.Errno {
	var e syscall.Errno
	if errors.As(err, &e) {
		return e
	}
	if errors.Is(err, fs.ErrNotExist) {
		return syscall.ENOENT
	}
	return syscall.EIO
}

func startServer(t *testing.T, fetch Fetcher) string {
	t.Helper()
	return startWith(t, Config{Fetch: fetch})
}

func startWith(t *testing.T, cfg Config) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "s.sock.node")
	cfg.Errno = errno
	if cfg.Timeout == 0 {
		cfg.Timeout = time.Second
	}
	s, err := Listen(path, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return path
}

// ask sends one fetch request on c and returns the reply's errno and message.
func ask(t *testing.T, c net.Conn, root, path string) (syscall.Errno, string) {
	t.Helper()
	return askOp(t, c, OpFetch, root, path)
}

func TestFetchRepliesWithErrnoAndMessage(t *testing.T) {
	var asked []string
	sock := startServer(t, func(ctx context.Context, root, path string) error {
		asked = append(asked, root+"|"+path)
		if path == "/d/missing" {
			return &fs.PathError{Op: "open", Path: path, Err: fs.ErrNotExist}
		}
		return nil
	})
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, tc := range []struct {
		path    string
		want    syscall.Errno
		wantMsg string
	}{
		{"/d/a", 0, ""},
		{"/d/missing", syscall.ENOENT, "open /d/missing: file does not exist"},
		{"/d/b", 0, ""}, // the connection serves request after request
	} {
		got, msg := ask(t, c, "/d", tc.path)
		if got != tc.want || msg != tc.wantMsg {
			t.Errorf("%s: got errno %d %q, want %d %q", tc.path, got, msg, tc.want, tc.wantMsg)
		}
	}
	if len(asked) != 3 || asked[0] != "/d|/d/a" {
		t.Errorf("fetcher got %v", asked)
	}
}

func TestBadRequestClosesTheConnection(t *testing.T) {
	sock := startServer(t, func(context.Context, string, string) error { return nil })
	for name, req := range map[string][]byte{
		"bad magic":   append([]byte("XXXX"), AppendRequest(nil, OpFetch, "/d", "/d/a")[4:]...),
		"version 1":   append([]byte("FCN1"), AppendRequest(nil, OpFetch, "/d", "/d/a")[4:]...), // no ack: refused
		"huge length": binary.LittleEndian.AppendUint32(append([]byte(Magic), 1, 0, 0, 0, 1, 0, 0, 0), 1<<30),
	} {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.Write(req)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := c.Read(make([]byte, 16)); err == nil {
			t.Errorf("%s: got a %d-byte reply, want the connection closed", name, n)
		}
		c.Close()
	}
}

// askOpen sends an OpOpen request on c and returns the reply's errno, origin, message and the
// descriptor that came with it (nil for none).
func askOpen(t *testing.T, c *net.UnixConn, root, path string) (syscall.Errno, uint32, string, *os.File) {
	t.Helper()
	if _, err := c.Write(AppendRequest(nil, OpOpen, root, path)); err != nil {
		t.Fatal(err)
	}
	if err := ReadAck(c); err != nil {
		t.Fatal(err)
	}
	// The descriptor rides with the first bytes: read the fixed part with room for control data.
	hdr := make([]byte, 16)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(hdr, oob)
	if err != nil || n != len(hdr) {
		t.Fatalf("read reply: %d bytes, %v", n, err)
	}
	var file *os.File
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil || len(msgs) != 1 {
			t.Fatalf("control message: %v %v", msgs, err)
		}
		fds, err := unix.ParseUnixRights(&msgs[0])
		if err != nil || len(fds) != 1 {
			t.Fatalf("rights: %v %v", fds, err)
		}
		file = os.NewFile(uintptr(fds[0]), "received")
	}
	le := binary.LittleEndian
	msg := make([]byte, le.Uint32(hdr[12:]))
	if _, err := io.ReadFull(c, msg); err != nil {
		t.Fatal(err)
	}
	return syscall.Errno(int32(le.Uint32(hdr[4:8]))), le.Uint32(hdr[8:12]), string(msg), file
}

func TestOpenAnswersWithADescriptor(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "a")
	if err := os.WriteFile(data, []byte("cached bytes"), 0o600); err != nil {
		t.Fatal(err)
	}
	var forgotten []string
	sock := startWith(t, Config{
		Open: func(ctx context.Context, root, path string) (*os.File, uint32, error) {
			if path != "/d/a" {
				return nil, 0, &fs.PathError{Op: "open", Path: path, Err: fs.ErrNotExist}
			}
			f, err := os.Open(data)
			return f, uint32(core.OriginMemory), err
		},
		Forget: func(root, path string) error { forgotten = append(forgotten, path); return nil },
	})
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got, origin, msg, f := askOpen(t, c, "/d", "/d/a")
	if got != 0 || origin != uint32(core.OriginMemory) || msg != "" || f == nil {
		t.Fatalf("open /d/a: errno %d, origin %d, %q, file %v", got, origin, msg, f)
	}
	b, err := io.ReadAll(f)
	f.Close()
	if err != nil || string(b) != "cached bytes" {
		t.Errorf("read the descriptor: %q, %v", b, err)
	}
	// An error comes without a descriptor, and the connection goes on.
	got, origin, msg, f = askOpen(t, c, "/d", "/d/missing")
	if got != syscall.ENOENT || origin != 0 || msg == "" || f != nil {
		t.Errorf("open /d/missing: errno %d, origin %d, %q, file %v", got, origin, msg, f)
	}
	if got, _ := askOp(t, c, OpForget, "/d", "/d/a"); got != 0 || len(forgotten) != 1 {
		t.Errorf("forget: errno %d, forgotten %v", got, forgotten)
	}
	// A server without a fetcher refuses the operation, and still answers.
	if got, _ := askOp(t, c, OpFetch, "/d", "/d/a"); got != syscall.ENOSYS {
		t.Errorf("fetch without a fetcher: errno %d, want ENOSYS", got)
	}
}

// askOp sends a request of an operation with a plain reply and returns its errno and message.
func askOp(t *testing.T, c net.Conn, op uint32, root, path string) (syscall.Errno, string) {
	t.Helper()
	if _, err := c.Write(AppendRequest(nil, op, root, path)); err != nil {
		t.Fatal(err)
	}
	if err := ReadAck(c); err != nil {
		t.Fatal(err)
	}
	var hdr [12]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		t.Fatal(err)
	}
	msg := make([]byte, binary.LittleEndian.Uint32(hdr[8:]))
	if _, err := io.ReadFull(c, msg); err != nil {
		t.Fatal(err)
	}
	return syscall.Errno(int32(binary.LittleEndian.Uint32(hdr[4:8]))), string(msg)
}

// A request is acknowledged as soon as it is read, while the answer may take long (a large
// source file read): a client tells a live server from a hung one by the ack, in a short
// probe time, without waiting for the answer.
func TestRequestIsAcknowledgedBeforeItsAnswer(t *testing.T) {
	release := make(chan struct{})
	sock := startWith(t, Config{Fetch: func(ctx context.Context, root, path string) error {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}})
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for range 2 { // each request of a kept connection
		if _, err := c.Write(AppendRequest(nil, OpFetch, "/d", "/d/a")); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(ProbeTimeout))
		ack := make([]byte, 16)
		n, err := c.Read(ack)
		if err != nil || string(ack[:n]) != Ack {
			t.Fatalf("while the fetch runs: read %q, %v; want the ack %q within %s", ack[:n], err, Ack, ProbeTimeout)
		}
		release <- struct{}{}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		var hdr [12]byte
		if _, err := io.ReadFull(c, hdr[:]); err != nil || string(hdr[:4]) != Magic || binary.LittleEndian.Uint32(hdr[4:]) != 0 {
			t.Fatalf("answer: %q, %v", hdr, err)
		}
	}
}

// OpFetchBlock goes to FetchBlock with the block's name as sent (a NUL byte inside), and a
// server without it answers ENOSYS.
func TestFetchBlockGoesToItsFetcher(t *testing.T) {
	var asked []string
	sock := startWith(t, Config{FetchBlock: func(ctx context.Context, root, name string) error {
		asked = append(asked, name)
		return nil
	}})
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	name := "/d/big.bin\x004194304:7"
	if got, msg := askOp(t, c, OpFetchBlock, "/d", name); got != 0 || msg != "" {
		t.Fatalf("fetch block: errno %d %q", got, msg)
	}
	if got, _ := askOp(t, c, OpFetch, "/d", "/d/a"); got != syscall.ENOSYS {
		t.Errorf("fetch without a fetcher: errno %d, want ENOSYS", got)
	}
	if len(asked) != 1 || asked[0] != name {
		t.Errorf("FetchBlock got %q", asked)
	}
}

// OpCacheBlock is answered with nothing: the client sends it and closes, and the block goes
// to FetchBlock in the background, also once the connection is gone; while the workers are
// busy the asks wait (up to the queue), and the connection is free at once for the next
// request.
func TestCacheBlockNeedsNoAnswer(t *testing.T) {
	release := make(chan struct{})
	asked := make(chan string, 16)
	sock := startWith(t, Config{FetchBlock: func(ctx context.Context, root, name string) error {
		asked <- name
		<-release
		return nil
	}})
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	names := []string{"/d/big.bin\x001048576:0", "/d/big.bin\x001048576:1", "/d/big.bin\x001048576:2",
		"/d/big.bin\x001048576:3", "/d/big.bin\x001048576:4", "/d/big.bin\x001048576:5"}
	for _, name := range names {
		if _, err := c.Write(AppendRequest(nil, OpCacheBlock, "/d", name)); err != nil {
			t.Fatal(err)
		}
	}
	// The same connection serves a request with an answer at once, although every worker
	// is busy with a block.
	if got, _ := askOp(t, c, OpFetch, "/d", "/d/a"); got != syscall.ENOSYS {
		t.Errorf("a fetch after the asks: errno %d, want ENOSYS (no fetcher)", got)
	}
	c.Close()
	got := map[string]bool{}
	for range askWorkers {
		select {
		case name := <-asked:
			got[name] = true
		case <-time.After(10 * time.Second):
			t.Fatalf("%d blocks asked of FetchBlock, want %d at once", len(got), askWorkers)
		}
	}
	close(release)
	for len(got) < len(names) {
		select {
		case name := <-asked:
			got[name] = true
		case <-time.After(10 * time.Second):
			t.Fatalf("blocks asked of FetchBlock: %d of %d", len(got), len(names))
		}
	}
}

// readRequest is what other processes of the node reach: whatever bytes come, it returns a
// request or an error, never panics nor reads past the lengths it checked, and a request it
// accepts is the one AppendRequest writes for it. `go test -fuzz FuzzReadRequest` explores
// further; the seeds run with the tests.
func FuzzReadRequest(f *testing.F) {
	f.Add(AppendRequest(nil, OpOpen, "/data", "/data/a.bin"))
	f.Add(AppendRequest(nil, OpCacheBlock, "/d", "/d/big.bin\x004194304:7"))
	f.Add(AppendRecord(nil, "/d", "/d/a.bin", FillReport{Size: 3, FillIno: 9}))
	f.Add(AppendRequest(nil, OpOpenMany, "/d", string(AppendPaths(nil, []string{"/d/a", "/d/b"}))))
	f.Add([]byte("FCN2\x09\x00\x00\x00\x01\x00\x00\x00\x01\x00\x00\x00ab"))
	f.Add([]byte("FCN1"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		op, root, path, err := readRequest(bytes.NewReader(b))
		if err != nil {
			return
		}
		if want := AppendRequest(nil, op, root, path); !bytes.HasPrefix(b, want) {
			t.Fatalf("accepted %q as op %d, root %q, path %q, which is written %q", b, op, root, path, want)
		}
	})
}

// A server working on a request repeats its ack every AckInterval until it replies, each ack
// 4 bytes of a write of its own: a client waiting for the reply of a request in flight sees
// within ProbeTimeout that the server lives, whatever the reply takes.
func TestServerRepeatsTheAckWhileItWorks(t *testing.T) {
	sock := startWith(t, Config{Timeout: 10 * time.Second, Fetch: func(ctx context.Context, root, path string) error {
		time.Sleep(3 * ProbeTimeout)
		return nil
	}})
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(AppendRequest(nil, OpFetch, "/d", "/d/a")); err != nil {
		t.Fatal(err)
	}
	acks := 0
	for {
		c.SetReadDeadline(time.Now().Add(ProbeTimeout))
		var b [4]byte
		if _, err := io.ReadFull(c, b[:]); err != nil {
			t.Fatalf("after %d acks: %v; want an ack or the reply within %s", acks, err, ProbeTimeout)
		}
		if string(b[:]) != Ack {
			if string(b[:]) != Magic {
				t.Fatalf("after %d acks: %q, want the reply's magic", acks, b)
			}
			break
		}
		acks++
	}
	if want := int(3 * ProbeTimeout / AckInterval); acks < want-2 {
		t.Errorf("%d acks while a fetch of %s ran, want about %d", acks, 3*ProbeTimeout, want)
	}
	var rest [8]byte
	if _, err := io.ReadFull(c, rest[:]); err != nil || binary.LittleEndian.Uint32(rest[:4]) != 0 {
		t.Errorf("reply: %v, errno %d", err, binary.LittleEndian.Uint32(rest[:4]))
	}
}

// OpRecord is answered with nothing: its report reaches Record whole, in the background, and
// the connection serves the next request at once. A report that is not one closes the
// connection.
func TestRecordReachesTheRecorderWithoutAnAnswer(t *testing.T) {
	got := make(chan fillAsk, 4)
	sock := startWith(t, Config{Record: func(root, path string, r FillReport) error {
		got <- fillAsk{root, path, r}
		return nil
	}})
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	want := FillReport{Size: 110_000, MTimeNanos: 1_700_000_000_123_456_789, CTimeNanos: -5, Ino: 1 << 40,
		FillIno: 77, Mode: 0o644 | RecordHasChecksum, Checksum: 0xdeadbeef}
	if _, err := c.Write(AppendRecord(nil, "/d", "/d/x\x00y.bin", want)); err != nil {
		t.Fatal(err)
	}
	if code, _ := askOp(t, c, OpFetch, "/d", "/d/a"); code != syscall.ENOSYS {
		t.Errorf("a fetch after the report: errno %d, want ENOSYS (no fetcher)", code)
	}
	select {
	case a := <-got:
		if a.root != "/d" || a.path != "/d/x\x00y.bin" || a.report != want {
			t.Errorf("recorded %q %q %+v, want /d /d/x\\x00y.bin %+v", a.root, a.path, a.report, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the report did not reach Record")
	}
	// A report without its NUL byte and fields: the connection is closed.
	c2, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	c2.Write(AppendRequest(nil, OpRecord, "/d", "/d/a.bin"))
	c2.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c2.Read(make([]byte, 1)); err == nil {
		t.Errorf("read %d bytes after a bad report, want the connection closed", n)
	}
}

// Reports are recorded askWorkers at a time: by the connection that read one while fewer are
// being recorded, else queued for the workers, and a connection whose report is queued serves
// its next request at once.
func TestReportsAreRecordedAskWorkersAtATime(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex // protects in, most, done
	in, most, done := 0, 0, 0
	sock := startWith(t, Config{Record: func(root, path string, r FillReport) error {
		mu.Lock()
		in++
		most = max(most, in)
		mu.Unlock()
		<-release
		mu.Lock()
		in--
		done++
		mu.Unlock()
		return nil
	}})
	dial := func() net.Conn {
		t.Helper()
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	report := func(c net.Conn, i int) {
		t.Helper()
		if _, err := c.Write(AppendRecord(nil, "/d", fmt.Sprintf("/d/%d", i), FillReport{Size: 1, FillIno: 1})); err != nil {
			t.Fatal(err)
		}
	}
	for i := range askWorkers {
		report(dial(), i)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		n := in
		mu.Unlock()
		if n == askWorkers {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d reports being recorded, want %d", n, askWorkers)
		}
	}
	c := dial()
	report(c, askWorkers)
	report(c, askWorkers+1)
	if code, _ := askOp(t, c, OpFetch, "/d", "/d/a"); code != syscall.ENOSYS {
		t.Errorf("a fetch after queued reports: errno %d, want ENOSYS (no fetcher)", code)
	}
	close(release)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		d, m := done, most
		mu.Unlock()
		if d == askWorkers+2 {
			if m != askWorkers {
				t.Errorf("at most %d reports recorded at once, want %d", m, askWorkers)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d reports recorded, want %d", d, askWorkers+2)
		}
	}
}
