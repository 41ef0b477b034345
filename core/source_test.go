package core

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A source file that changes while it is read is neither served nor cached; once it is
// stable, its new bytes are. In a build without it, a same-size rewrite
// during the first read was cached as a mix of both versions.
func TestSourceChangedDuringReadIsNotCached(t *testing.T) {
	for _, size := range []int{4096, 3 << 20} { // read into memory; copied into a tier
		root, paths := dataset(t, size)
		e := newEngine(t, "64MiB")
		newBytes := make([]byte, size)
		for i := range newBytes {
			newBytes[i] = 0xAB
		}
		testHookSourceRead = func(path string) {
			testHookSourceRead = nil
			// File times advance with the kernel's clock tick (a few ms): a rewrite within
			// the same tick as the previous write cannot be told from stat, so wait one.
			time.Sleep(20 * time.Millisecond)
			if err := os.WriteFile(path, newBytes, 0o644); err != nil { // same size, new bytes
				t.Error(err)
			}
		}
		_, err := e.Read(context.Background(), root, paths[0], true)
		testHookSourceRead = nil
		if !errors.Is(err, ErrChanged) {
			t.Fatalf("size %d: read during a rewrite: got %v, want ErrChanged", size, err)
		}
		settle(e)
		if s := e.Stats(); s.Published != 0 {
			t.Errorf("size %d: %d files published from a changing source, want 0", size, s.Published)
		}
		res, err := e.Read(context.Background(), root, paths[0], true)
		if err != nil {
			t.Fatal(err)
		}
		if got := res.Bytes(); len(got) != size || got[0] != 0xAB || got[size-1] != 0xAB {
			t.Errorf("size %d: after the rewrite got old or mixed bytes", size)
		}
		res.Release()
	}
}

// A file replaced by a rename while it is read is not cached either.
func TestSourceReplacedDuringReadIsNotCached(t *testing.T) {
	root, paths := dataset(t, 4096)
	e := newEngine(t, "64MiB")
	testHookSourceRead = func(path string) {
		testHookSourceRead = nil
		tmp := path + ".new"
		os.WriteFile(tmp, make([]byte, 4096), 0o644)
		os.Rename(tmp, path)
	}
	_, err := e.Read(context.Background(), root, paths[0], false)
	testHookSourceRead = nil
	if !errors.Is(err, ErrChanged) {
		t.Fatalf("read during a replacement: got %v, want ErrChanged", err)
	}
}

// A directory inside the root swapped back and forth with a link to a directory outside it,
// while reads run, never lets a read return the outside file's bytes.
func TestSymlinkSwapRaceNeverEscapes(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	os.WriteFile(filepath.Join(outside, "f"), []byte("secret"), 0o644)
	real := filepath.Join(root, "real")
	os.Mkdir(real, 0o755)
	os.WriteFile(filepath.Join(real, "f"), []byte("public"), 0o644)
	os.Symlink(outside, filepath.Join(root, "evil"))
	dir := filepath.Join(root, "dir")
	os.Symlink(real, dir)
	e, err := NewEngine(EngineConfig{}, nil) // no tier: every read goes to the source
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	stop := make(chan struct{})
	swapped := make(chan int)
	go func() { // swap dir between the link to real and a link to outside
		n := 0
		defer func() { swapped <- n }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			tmp := filepath.Join(root, ".swap")
			target := real
			if n%2 == 0 {
				target = outside
			}
			os.Remove(tmp)
			os.Symlink(target, tmp)
			os.Rename(tmp, dir)
			n++
		}
	}()
	deadline := time.Now().Add(2 * time.Second)
	reads, good := 0, 0
	for time.Now().Before(deadline) {
		res, err := e.Read(context.Background(), root, filepath.Join(dir, "f"), false)
		reads++
		if err != nil {
			if !errors.Is(err, ErrOutsideRoot) && !errors.Is(err, os.ErrNotExist) && !errors.Is(err, ErrChanged) {
				t.Fatalf("unexpected error: %v", err)
			}
			continue
		}
		if got := string(res.Bytes()); got != "public" {
			t.Fatalf("read %d returned %q through the swapped link", reads, got)
		}
		good++
		res.Release()
	}
	close(stop)
	n := <-swapped
	t.Logf("%d reads (%d served) during %d swaps", reads, good, n)
	if n < 100 || reads < 100 {
		t.Errorf("only %d swaps and %d reads: the race was not exercised", n, reads)
	}
}

// A link out of the dataset is refused before the file it points to is opened (opening can
// have effects: a device, a FIFO, a file's access time); an absolute link to another file of
// the dataset still reads. In a build without it, the outside file was opened
// and only then refused.
func TestLinkOutOfTheRootIsNotOpened(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	os.WriteFile(filepath.Join(outside, "secret"), []byte("secret"), 0o644)
	os.WriteFile(filepath.Join(root, "b"), []byte("inside"), 0o644)
	os.Symlink(filepath.Join(outside, "secret"), filepath.Join(root, "out"))
	os.Symlink(filepath.Join(root, "b"), filepath.Join(root, "abs")) // absolute, stays inside
	ifd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Skip("no inotify:", err)
	}
	defer unix.Close(ifd)
	if _, err := unix.InotifyAddWatch(ifd, outside, unix.IN_OPEN); err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, "1MiB")
	if _, err := e.Read(context.Background(), root, filepath.Join(root, "out"), false); !errors.Is(err, ErrOutsideRoot) {
		t.Errorf("link out of the root: got %v, want ErrOutsideRoot", err)
	}
	buf := make([]byte, 4096)
	if n, _ := unix.Read(ifd, buf); n > 0 {
		t.Errorf("the file outside the root was opened (%d bytes of inotify events)", n)
	}
	if _, got := readAll(t, e, root, filepath.Join(root, "abs")); string(got) != "inside" {
		t.Errorf("absolute link inside the root: got %q", got)
	}
}
