package nodesock

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"io/fs"
	"net"
	"path/filepath"
	"syscall"
	"testing"
	"time"
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
	path := filepath.Join(t.TempDir(), "s.sock.node")
	s, err := Listen(path, Config{Fetch: fetch, Errno: errno, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return path
}

// ask sends one request on c and returns the reply's errno and message.
func ask(t *testing.T, c net.Conn, root, path string) (syscall.Errno, string) {
	t.Helper()
	if _, err := c.Write(AppendRequest(nil, root, path)); err != nil {
		t.Fatal(err)
	}
	var hdr [12]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		t.Fatal(err)
	}
	if string(hdr[:4]) != Magic {
		t.Fatalf("reply magic %q", hdr[:4])
	}
	msg := make([]byte, binary.LittleEndian.Uint32(hdr[8:]))
	if _, err := io.ReadFull(c, msg); err != nil {
		t.Fatal(err)
	}
	return syscall.Errno(int32(binary.LittleEndian.Uint32(hdr[4:8]))), string(msg)
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
		"bad magic":   append([]byte("XXXX"), AppendRequest(nil, "/d", "/d/a")[4:]...),
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
