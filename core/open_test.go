package core

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// readFile reads what a descriptor from OpenForReader holds, from its start.
func readFile(t *testing.T, f *os.File) []byte {
	t.Helper()
	b, err := io.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestOpenForReaderHandsOutTheCachedCopyAndReadsTheSourceOnce(t *testing.T) {
	e := newEngine(t, "16MiB")
	root := t.TempDir()
	path := filepath.Join(root, "a.bin")
	data := bytes.Repeat([]byte("fitcache"), 20000)
	if err := os.WriteFile(path, data, 0o640); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		f, origin, err := e.OpenForReader(context.Background(), root, path)
		if err != nil {
			t.Fatal(err)
		}
		got := readFile(t, f)
		var st unix.Stat_t
		unix.Fstat(int(f.Fd()), &st)
		f.Close()
		if origin != OriginMemory || !bytes.Equal(got, data) {
			t.Fatalf("open %d: origin %v, %d bytes, want the tier's copy of %d bytes", i, origin, len(got), len(data))
		}
		if src, _ := os.Stat(path); st.Mode&0o777 != uint32(src.Mode().Perm()) || st.Mtim.Nano() != src.ModTime().UnixNano() {
			t.Errorf("the cached copy has mode %o and mtime %d; the source %o and %d", st.Mode&0o777, st.Mtim.Nano(),
				src.Mode().Perm(), src.ModTime().UnixNano())
		}
	}
	if s := e.Stats(); s.SourceReads != 1 {
		t.Errorf("source read %d times, want once", s.SourceReads)
	}
}

func TestOpenForReaderGivesTheSourceWhenNoTierTakesIt(t *testing.T) {
	e := newEngine(t, "64KiB")
	root := t.TempDir()
	path := filepath.Join(root, "big.bin")
	data := bytes.Repeat([]byte{7}, 1<<20)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	f, origin, err := e.OpenForReader(context.Background(), root, path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	flags, _ := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	if origin != OriginSource || flags&unix.O_NONBLOCK != 0 || flags&unix.O_ACCMODE != unix.O_RDONLY {
		t.Errorf("origin %v, flags %#o: want the source, read-only and blocking", origin, flags)
	}
	if got := readFile(t, f); !bytes.Equal(got, data) {
		t.Errorf("read %d bytes, want the source's %d", len(got), len(data))
	}
	// A large file no tier takes says so too (the preload shim then reads it by blocks),
	// unlike one being cached whole (OriginSourceWhileCached).
	large := sparseFile(t, root, "large.bin", 4*ReadNowBytes)
	for range 2 {
		f, origin, err := e.OpenForReader(context.Background(), root, large)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		if origin != OriginSource {
			t.Errorf("a large file no tier takes: origin %v, want %v", origin, OriginSource)
		}
	}
}

// A large file a tier could hold, but not in the room its dataset left (a dataset never
// evicts its own files), is not being cached either: OriginSource, and no copy is tried.
func TestALargeFileWithoutRoomLeftIsDeclined(t *testing.T) {
	e := newEngine(t, "48MiB")
	root := t.TempDir()
	first := sparseFile(t, root, "first.bin", 4*ReadNowBytes)
	second := sparseFile(t, root, "second.bin", 4*ReadNowBytes)
	if err := e.Fetch(context.Background(), root, first); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		f, origin, err := e.OpenForReader(context.Background(), root, second)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		if origin != OriginSource {
			t.Errorf("no room left for the dataset: origin %v, want %v", origin, OriginSource)
		}
	}
	settle(e)
	if s := e.Stats(); s.SourceReads != 1 || s.Published != 1 {
		t.Errorf("%d source reads, %d published; want the first file's only", s.SourceReads, s.Published)
	}
}

// A reader that opens a large file is not kept waiting for its copy: it gets the source,
// opened once for it and for the copy, which is made meanwhile; readers that open it during
// the copy get the source too; once the copy is published, the next open gets it.
func TestALargeFileIsHandedToItsReaderWhileItIsCached(t *testing.T) {
	e := newEngine(t, "256MiB")
	root := t.TempDir()
	path := filepath.Join(root, "large.bin")
	data := make([]byte, 2*ReadNowBytes+12345)
	for i := range data {
		data[i] = byte(i * 7 % 251)
	}
	if err := os.WriteFile(path, data, 0o640); err != nil {
		t.Fatal(err)
	}
	const readers = 4
	type opened struct {
		origin Origin
		data   []byte
		err    error
	}
	got := make(chan opened, readers)
	for range readers {
		go func() {
			f, origin, err := e.OpenForReader(context.Background(), root, path)
			if err != nil {
				got <- opened{err: err}
				return
			}
			defer f.Close()
			b, err := io.ReadAll(f)
			got <- opened{origin, b, err}
		}()
	}
	for range readers {
		o := <-got
		if o.err != nil || !bytes.Equal(o.data, data) {
			t.Fatalf("a reader got %d bytes, err %v; want the file's %d", len(o.data), o.err, len(data))
		}
		if o.origin != OriginSourceWhileCached && o.origin != OriginMemory {
			t.Errorf("origin %v", o.origin)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, ok := e.cachedSize(path); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the large file was not cached in 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	f, origin, err := e.OpenForReader(context.Background(), root, path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if b := readFile(t, f); origin != OriginMemory || !bytes.Equal(b, data) {
		t.Errorf("after the copy: origin %v, %d bytes; want the tier's copy", origin, len(b))
	}
	if s := e.Stats(); s.SourceReads != 1 || s.Errors != 0 {
		t.Errorf("source reads %d, errors %d; want 1 and 0", s.SourceReads, s.Errors)
	}
}

// The first reader of a large file gets it as the source at once: the open does not wait for
// the copy, which a reader can see by the descriptor (the source file, not a tier's).
func TestTheFirstOpenOfALargeFileIsTheSource(t *testing.T) {
	e := newEngine(t, "256MiB")
	root := t.TempDir()
	path := sparseFile(t, root, "large.bin", 4*ReadNowBytes)
	f, origin, err := e.OpenForReader(context.Background(), root, path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var st, src unix.Stat_t
	unix.Fstat(int(f.Fd()), &st)
	unix.Stat(path, &src)
	if origin != OriginSourceWhileCached || st.Ino != src.Ino || st.Dev != src.Dev {
		t.Errorf("origin %v, inode %d: want the source while it is cached (inode %d)", origin, st.Ino, src.Ino)
	}
	small := filepath.Join(root, "small.bin")
	os.WriteFile(small, []byte("small"), 0o600)
	g, origin, err := e.OpenForReader(context.Background(), root, small)
	if err != nil {
		t.Fatal(err)
	}
	g.Close()
	if origin != OriginMemory {
		t.Errorf("a small file: origin %v, want its copy", origin)
	}
}

func TestOpenForReaderRefusesWhatReadRefuses(t *testing.T) {
	e := newEngine(t, "16MiB")
	root := t.TempDir()
	os.Mkdir(filepath.Join(root, "dir"), 0o755)
	for _, path := range []string{filepath.Join(root, "missing"), filepath.Join(root, "dir"), "/etc/passwd"} {
		if f, _, err := e.OpenForReader(context.Background(), root, path); err == nil {
			f.Close()
			t.Errorf("%s: opened, want an error", path)
		}
	}
}

func TestForgetDropsTheCachedCopy(t *testing.T) {
	e := newEngine(t, "16MiB")
	root := t.TempDir()
	path := filepath.Join(root, "a.bin")
	os.WriteFile(path, []byte("old bytes"), 0o600)
	f, _, err := e.OpenForReader(context.Background(), root, path)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	os.WriteFile(path, []byte("new bytes, longer"), 0o600)
	if err := e.Forget(root, path); err != nil {
		t.Fatal(err)
	}
	f, _, err = e.OpenForReader(context.Background(), root, path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if got := readFile(t, f); string(got) != "new bytes, longer" {
		t.Errorf("after Forget read %q, want the new bytes", got)
	}
	if err := e.Forget(root, "/elsewhere/x"); err == nil {
		t.Error("Forget of a path outside the root succeeded")
	}
}
