package nodesock

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/core"
)

// fileOpener opens the files of dir by their base name: a path ending in "missing" does not
// exist, one ending in "slow" takes a while.
func fileOpener(dir string) Opener {
	return func(ctx context.Context, root, path string) (*os.File, uint32, error) {
		if strings.HasSuffix(path, "missing") {
			return nil, 0, &fs.PathError{Op: "open", Path: path, Err: fs.ErrNotExist}
		}
		if strings.HasSuffix(path, "slow") {
			time.Sleep(2 * AckInterval)
		}
		f, err := os.Open(filepath.Join(dir, filepath.Base(path)))
		return f, uint32(core.OriginPeer), err
	}
}

// checkOpened checks that got answers paths in order: the file's bytes (its name repeated),
// or ENOENT for a missing one only.
func checkOpened(t *testing.T, paths []string, got []Opened) {
	t.Helper()
	if len(got) != len(paths) {
		t.Fatalf("%d answers to %d files", len(got), len(paths))
	}
	for i, p := range paths {
		o := got[i]
		if strings.HasSuffix(p, "missing") {
			if !errors.Is(o.Err, fs.ErrNotExist) || o.File != nil {
				t.Errorf("%s: %v, descriptor %v; want ENOENT and none", p, o.Err, o.File)
			}
			continue
		}
		if o.Err != nil {
			t.Errorf("%s: %v", p, o.Err)
			continue
		}
		b, err := o.Data, error(nil)
		if o.File != nil {
			b, err = io.ReadAll(o.File)
			o.File.Close()
		}
		if want := strings.Repeat(filepath.Base(p), 100); err != nil || string(b) != want || o.Origin != uint32(core.OriginPeer) {
			t.Errorf("%s: %q (%v), origin %d; want its bytes, origin %d", p, b, err, o.Origin, core.OriginPeer)
		}
	}
}

// A batch is answered file by file, in order: a missing file is ENOENT for that file only.
// A server with a ManyOpener hands it the batch (which answers every third file with its
// bytes, sent inline and released once sent); one without opens each file with its Opener; a
// batch longer than MaxBatch goes in several requests.
func TestOpenManyAnswersEachFile(t *testing.T) {
	dir := t.TempDir()
	var paths []string
	for i := range MaxBatch + 3 {
		name := string(rune('a'+i%26)) + string(rune('a'+i/26))
		switch i {
		case 1, MaxBatch + 1:
			name += "missing"
		case 2:
			name += "slow" // the server acknowledges while it works
			fallthrough
		default:
			os.WriteFile(filepath.Join(dir, name), []byte(strings.Repeat(name, 100)), 0o600)
		}
		paths = append(paths, "/d/"+name)
	}
	open := fileOpener(dir)
	var batches, inline, released atomic.Int64
	for name, cfg := range map[string]Config{
		"opener": {Open: open},
		"many opener": {OpenMany: func(ctx context.Context, root string, paths []string) []Opened {
			batches.Add(1)
			out := make([]Opened, len(paths))
			for i, p := range paths {
				out[i].File, out[i].Origin, out[i].Err = open(ctx, root, p)
				if i%3 == 0 && out[i].File != nil {
					out[i].Data, _ = io.ReadAll(out[i].File)
					out[i].File.Close()
					out[i].File = nil
					out[i].Release = func() { released.Add(1) }
					inline.Add(1)
				}
			}
			return out
		}},
	} {
		t.Run(name, func(t *testing.T) {
			cfg.Timeout = 5 * time.Second
			sock := startWith(t, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			got, err := OpenMany(ctx, sock, "/d", paths)
			if err != nil {
				t.Fatal(err)
			}
			checkOpened(t, paths, got)
		})
	}
	if n := batches.Load(); n != 2 {
		t.Errorf("the ManyOpener had %d batches, want 2 (%d files, at most %d a request)", n, len(paths), MaxBatch)
	}
	if n, r := inline.Load(), released.Load(); n == 0 || r != n {
		t.Errorf("%d files answered inline, %d released: want some, all released", n, r)
	}
}

// A server with neither opener answers ENOSYS for each file; a ManyOpener that answers the
// wrong number of files is EIO for each.
func TestOpenManyWithoutAnOpener(t *testing.T) {
	paths := []string{"/d/a", "/d/b"}
	for name, tc := range map[string]struct {
		cfg  Config
		want syscall.Errno
	}{
		"none": {Config{Fetch: func(context.Context, string, string) error { return nil }}, syscall.ENOSYS},
		"short": {Config{OpenMany: func(context.Context, string, []string) []Opened { return make([]Opened, 1) }},
			syscall.EIO},
	} {
		sock := startWith(t, tc.cfg)
		got, err := OpenMany(context.Background(), sock, "/d", paths)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for i, o := range got {
			if !errors.Is(o.Err, tc.want) || o.File != nil {
				t.Errorf("%s: file %d: %v, %v; want %v", name, i, o.Err, o.File, tc.want)
			}
		}
	}
}

// A path list the server cannot take ends the connection before anything is allocated for
// it or opened: a length over the bound, more than MaxBatch paths, an empty or overlong path,
// a list without its final NUL.
func TestOpenManyBoundsTheRequest(t *testing.T) {
	var opened atomic.Int64
	sock := startWith(t, Config{Open: func(context.Context, string, string) (*os.File, uint32, error) {
		opened.Add(1)
		return nil, 0, syscall.ENOENT
	}})
	many := make([]string, MaxBatch+1)
	for i := range many {
		many[i] = "/d/a"
	}
	long := "/d/" + strings.Repeat("x", maxPath)
	le := binary.LittleEndian
	for name, req := range map[string][]byte{
		"huge length": le.AppendUint32(le.AppendUint32(le.AppendUint32([]byte(Magic), OpOpenMany), 2),
			maxBatchBody+1),
		"too many paths": AppendRequest(nil, OpOpenMany, "/d", string(AppendPaths(nil, many))),
		"empty path":     AppendRequest(nil, OpOpenMany, "/d", "/d/a\x00\x00/d/b\x00"),
		"long path":      AppendRequest(nil, OpOpenMany, "/d", long+"\x00"),
		"no final NUL":   AppendRequest(nil, OpOpenMany, "/d", "/d/a\x00/d/b"),
	} {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.Write(req)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := c.Read(make([]byte, 16)); err == nil {
			t.Errorf("%s: got %d bytes back, want the connection closed", name, n)
		}
		c.Close()
	}
	if n := opened.Load(); n != 0 {
		t.Errorf("%d files opened for malformed requests, want none", n)
	}
}

// A server older than OpOpenMany closes the connection at the unknown operation, before any
// ack: OpenMany says so (ErrUnknownOp), and its caller asks for each file alone (Open).
func TestOpenManyFromAnOlderServer(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "a"), []byte(strings.Repeat("a", 100)), 0o600)
	path := filepath.Join(dir, "old.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	open := fileOpener(dir)
	go func() { // the serve loop of a server that knows operations 1 to 5
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				for {
					op, root, p, err := readRequest(c)
					if err != nil || op == OpOpenMany {
						return // "unknown operation 6": the connection ends
					}
					f, origin, err := open(context.Background(), root, p)
					c.Write([]byte(Ack))
					var e syscall.Errno
					if err != nil {
						e = errno(err)
					}
					reply := binary.LittleEndian.AppendUint32([]byte(Magic), uint32(e))
					reply = binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(reply, origin), 0)
					if f == nil {
						c.Write(reply)
						continue
					}
					c.(*net.UnixConn).WriteMsgUnix(reply, unix.UnixRights(int(f.Fd())), nil)
					f.Close()
				}
			}()
		}
	}()
	paths := []string{"/d/a", "/d/missing"}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := OpenMany(ctx, path, "/d", paths); !errors.Is(err, ErrUnknownOp) || errors.Is(err, ErrUnavailable) {
		t.Fatalf("an older server: %v, want ErrUnknownOp", err)
	}
	got := make([]Opened, len(paths))
	for i, p := range paths {
		got[i].File, got[i].Origin, got[i].Err = Open(ctx, path, "/d", p)
	}
	checkOpened(t, paths, got)
}

// A reply whose inline length passes MaxInline, or that names inline bytes beside an error,
// is malformed: the reader gives the server up (ErrUnavailable) without taking the bytes.
func TestOpenManyRefusesAMalformedInlineLength(t *testing.T) {
	le := binary.LittleEndian
	for name, reply := range map[string][]byte{
		"too long":   le.AppendUint32(le.AppendUint32(le.AppendUint32(le.AppendUint32([]byte(Magic), 0), 3), 0), MaxInline+1),
		"with errno": le.AppendUint32(le.AppendUint32(le.AppendUint32(le.AppendUint32([]byte(Magic), 2), 0), 0), 4),
	} {
		sock := silentServer(t, filepath.Join(t.TempDir(), "bad.sock"), func(c net.Conn) {
			if _, _, _, err := readRequest(c); err == nil {
				c.Write([]byte(Ack))
				c.Write(append(reply, "abcd"...))
			}
		})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := OpenMany(ctx, sock, "/d", []string{"/d/a"})
		cancel()
		if !errors.Is(err, ErrUnavailable) {
			t.Errorf("%s: %v, want ErrUnavailable", name, err)
		}
	}
}
