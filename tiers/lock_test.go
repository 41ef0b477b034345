package tiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestSecondServerIsLockedOut(t *testing.T) {
	dir := t.TempDir()
	first, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB", Holder: "runtime dir /run/a"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = New(Config{Dir: dir, Kind: Disk, Budget: "1MiB", Holder: "runtime dir /run/b"}, nil)
	want := fmt.Sprintf("pid %d, runtime dir /run/a", os.Getpid())
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), want) {
		t.Fatalf("second New: got %v, want ErrLocked naming %q", err, want)
	}
	if got := Holder(dir); !strings.Contains(got, want) {
		t.Errorf("Holder = %q, want it to name %q", got, want)
	}
	for range 2 {
		if err := first.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	if got := Holder(dir); got != "" {
		t.Errorf("Holder after Close = %q, want none", got)
	}
	if err := first.Publish(Entry{SourcePath: "/d/x", Size: 1}, []byte("x")); err == nil {
		t.Error("Publish after Close succeeded")
	}
	second, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatalf("New after Close: %v", err)
	}
	second.Close()
}

// A tier whose lock someone holds for a moment (fitcache info reading the holder) is still
// taken by a starting server. In a build without it, the server skipped the
// tier for its whole life.
func TestTierLockWaitsForABriefHolder(t *testing.T) {
	dir := t.TempDir()
	first, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	first.Close()
	f, err := os.Open(filepath.Join(dir, lockName))
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		f.Close()
	}()
	tier, err := New(Config{Dir: dir, Kind: Disk, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatalf("a lock held for 300 ms: %v", err)
	}
	tier.Close()
}
