package chitpath

import (
	"bytes"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

const (
	root    = "/data"
	session = 5
)

// files publishes files in a memory tier (64 MiB, closed at the end of the test): small ones,
// one of 100 KiB, and one past FC_READ_MAX_BYTES (512 KiB), which the hit path maps rather
// than copies; an empty one too. It tells the harness about them and returns the tier's
// directory and the files.
func files(tb testing.TB) (string, []File) {
	tb.Helper()
	dir := filepath.Join(tb.TempDir(), "memory")
	tier, err := tiers.New(tiers.Config{Dir: dir, Kind: tiers.Memory, Budget: "64MiB", CreateParents: true}, nil)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { tier.Close() })
	sizes := []int{0, 1, 100 << 10, 600 << 10}
	for i := 0; len(sizes) < 24; i++ {
		sizes = append(sizes, 512+i*331)
	}
	var fs []File
	for i, n := range sizes {
		data := make([]byte, n)
		for k := range data {
			data[k] = byte(i*131 + k*7 + k>>9)
		}
		path := fmt.Sprintf("%s/f%02d.bin", root, i)
		e := tiers.Entry{SourcePath: path, Size: int64(n), MTimeNanos: int64(1000 + i), Session: session, Group: root}
		if err := tier.Publish(e, data); err != nil {
			tb.Fatal(err)
		}
		if i%2 == 1 {
			path = path[len(root)+1:] // relative to the root
		}
		fs = append(fs, File{Path: path, Data: data})
	}
	SetFiles(fs)
	return dir, fs
}

// open registers client handle with the tier dir, closed at the end of the test.
func open(tb testing.TB, handle int64, dir string) {
	tb.Helper()
	if err := Open(handle, root, session, dir); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { Close(handle) })
}

func checkNoBuffers(t *testing.T) {
	t.Helper()
	if n := Buffers(); n != 0 {
		t.Errorf("hit_buffers() = %d after every buffer was released, want 0", n)
	}
}

// 16 threads of one process read 20,000 files each (200 at a time), and release them, or
// their neighbour's: every byte is the file's, no two live buffers share a handle, a handle
// released once (and one whose slot was handed out again) is EBADF, every read counts as a
// hit, and no buffer is left.
func TestThreadsReadAndRelease(t *testing.T) {
	dir, _ := files(t)
	for i, cross := range []bool{false, true} {
		t.Run(map[bool]string{false: "own", true: "cross"}[cross], func(t *testing.T) {
			handle := int64(10 + i)
			open(t, handle, dir)
			threads, rounds, perRound := 16, 100, 200
			if testing.Short() {
				rounds = 10
			}
			got, err := HammerRun(handle, threads, rounds, perRound, cross, false)
			if err != nil {
				t.Fatal(err)
			}
			want := Hammer{Reads: int64(threads * rounds * perRound)}
			if got != want {
				t.Errorf("got %+v, want %+v", got, want)
			}
			if hits := Hits(handle); hits != want.Reads {
				t.Errorf("fcHitCounts: %d hits, want %d", hits, want.Reads)
			}
			checkNoBuffers(t)
		})
	}
}

// A hit takes no lock that another thread takes: threads reading and releasing their own
// buffers share none (the hit path's locks are recorded per thread). Before, every read and
// release took one lock shared by all threads of the process, four times, and a read lock
// (an atomic write on one line) to find the client.
func TestThreadsShareNoLock(t *testing.T) {
	dir, _ := files(t)
	open(t, 20, dir)
	got, err := HammerRun(20, 8, 5, 50, false, true)
	if err != nil {
		t.Fatal(err)
	}
	if got.BadRC != 0 || got.BadBytes != 0 {
		t.Fatalf("reads failed: %+v", got)
	}
	if got.SharedLock {
		t.Error("two threads reading and releasing their own buffers took one lock")
	}
	checkNoBuffers(t)
}

// Threads that come and go (a loader's pool made anew each epoch) take the shard a thread
// that exited gave back: 100 threads one after another, each holding 40 buffers of up to 8 KiB
// at once, use one shard, and the pools keep no more than one such thread held. Shards taken
// in turn, never given back, would have kept 64 pools of them.
func TestThreadsThatComeAndGoReuseShards(t *testing.T) {
	dir, _ := files(t)
	open(t, 60, dir)
	shards, pooled, err := Churn(60, 100, 40)
	if err != nil {
		t.Fatal(err)
	}
	if shards != 1 {
		t.Errorf("100 threads one after another used %d shards, want 1", shards)
	}
	if limit := int64(40 * 8 << 10); pooled > limit {
		t.Errorf("the pools keep %d bytes more, want at most %d (what one thread held)", pooled, limit)
	}
	checkNoBuffers(t)
}

// fork() while 4 threads read and release: each child (the pthread_atfork handlers held and
// reset the hit path's locks) reads every file and releases it, with its bytes right, and
// hangs on no lock a thread of the parent held. The parent's readers carry on.
func TestForkWhileThreadsRead(t *testing.T) {
	dir, _ := files(t)
	open(t, 30, dir)
	loop := LoopStart(30, 4)
	failed, err := loop.ForkWhileReading(20)
	counts := loop.Stop()
	if err != nil {
		t.Fatal(err)
	}
	if failed != 0 {
		t.Errorf("%d of 20 children forked while threads read failed", failed)
	}
	if counts.Reads == 0 || counts.Misses != 0 || counts.BadBytes != 0 || counts.BadRC != 0 {
		t.Errorf("the parent's readers: %+v", counts)
	}
	checkNoBuffers(t)
}

// fcHitClose waits for a thread that holds a reference to the client (as a read does) to let
// it go, and the client is then gone: a read misses.
func TestCloseWaitsForReferences(t *testing.T) {
	dir, _ := files(t)
	if err := Open(40, root, session, dir); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	waited, err := CloseWhileHeld(40, 100)
	if err != nil {
		t.Fatal(err)
	}
	if !waited {
		t.Errorf("fcHitClose returned after %v, while a thread held a reference to the client", time.Since(start))
	}
	if _, err := Read(40, "f02.bin"); err == nil {
		t.Error("a closed client read a file")
	}
}

// Clients open and close, one after another in one slot, while 8 threads read through them:
// a read of a closed client misses, one of an open client gets the file's bytes, a client
// counts its own hits only, and no buffer is left.
func TestCloseWhileThreadsRead(t *testing.T) {
	dir, fs := files(t)
	const slot = 256 // handles h and h + 256 share a slot of the hit path's clients
	loop := LoopStart(50, 8)
	for k := range int64(30) {
		h := 50 + k*slot
		if err := Open(h, root, session, dir); err != nil {
			loop.Stop()
			t.Fatal(err)
		}
		if n := Hits(h); n != 0 {
			t.Errorf("client %d: %d hits when opened, want 0", h, n)
		}
		loop.SetHandle(h)
		time.Sleep(2 * time.Millisecond)
		Close(h)
	}
	counts := loop.Stop()
	if counts.Reads == 0 || counts.BadBytes != 0 || counts.BadRC != 0 {
		t.Errorf("readers: %+v", counts)
	}
	checkNoBuffers(t)
	if err := Open(99, root, session, dir); err != nil {
		t.Fatal(err)
	}
	defer Close(99)
	if b, err := Read(99, "f02.bin"); err != nil || !bytes.Equal(b, fs[2].Data) {
		t.Errorf("a read after the others: %d bytes (want %d), %v", len(b), len(fs[2].Data), err)
	}
}
