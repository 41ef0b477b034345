package main

import (
	"bytes"
	"crypto/rand"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// mounted mounts a new source directory through a link of rtt and bytesPerSec, unmounted at
// the test's end; it skips the test where FUSE cannot be mounted (not root, no /dev/fuse).
func mounted(t *testing.T, rtt time.Duration, bytesPerSec float64) (source, mnt string, l *link) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse")
	}
	source, mnt = t.TempDir(), t.TempDir()
	l = &link{rtt: rtt, bytesPerSec: bytesPerSec}
	server, err := mount(source, mnt, l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := server.Unmount(); err != nil {
			t.Errorf("unmount: %v", err)
		}
	})
	return source, mnt, l
}

// A file of the source reads the same through the mount, no sooner than its bytes take over
// the link, and again over the link at its next open (no data kept across opens).
func TestReadsCostTheLink(t *testing.T) {
	const size = 1 << 20
	source, mnt, l := mounted(t, 2*time.Millisecond, 10e6) // 10 MB/s: 1 MiB takes 105 ms
	data := make([]byte, size)
	rand.Read(data)
	if err := os.WriteFile(filepath.Join(source, "f.bin"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	for open := range 2 {
		before := l.bytes.Load()
		start := time.Now()
		got, err := os.ReadFile(filepath.Join(mnt, "f.bin"))
		took := time.Since(start)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("open %d: %d bytes, right %v, %v", open, len(got), bytes.Equal(got, data), err)
		}
		if sent := l.bytes.Load() - before; sent != size {
			t.Errorf("open %d: %d bytes over the link, want the file's %d", open, sent, size)
		}
		if min := time.Duration(size / 10e6 * float64(time.Second)); took < min {
			t.Errorf("open %d: read in %v, sooner than the link sends it (%v)", open, took, min)
		}
	}
}

// Each request costs a round trip: a lookup of a name never seen, and an open.
func TestRequestsCostARoundTrip(t *testing.T) {
	const rtt = 30 * time.Millisecond
	source, mnt, l := mounted(t, rtt, 0)
	if err := os.WriteFile(filepath.Join(source, "small"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := os.Stat(filepath.Join(mnt, "small")); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < rtt {
		t.Errorf("first stat in %v, sooner than a round trip (%v)", took, rtt)
	}
	before := l.requests.Load()
	f, err := os.Open(filepath.Join(mnt, "small"))
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if got := l.requests.Load() - before; got < 1 {
		t.Errorf("an open sent %d requests", got)
	}
}

// Opens made one after the other count one at once; opens made side by side count more.
func TestOpensAtOnceAreCounted(t *testing.T) {
	source, mnt, l := mounted(t, 100*time.Millisecond, 0) // opens side by side overlap by 100 ms
	for _, name := range []string{"a", "b", "c", "d"} {
		if err := os.WriteFile(filepath.Join(source, name), []byte(name), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	open := func(name string) {
		f, err := os.Open(filepath.Join(mnt, name))
		if err != nil {
			t.Error(err)
			return
		}
		f.Close()
	}
	open("a")
	open("b")
	if got := l.mostOpening.Load(); got != 1 {
		t.Fatalf("two opens in turn: at most %d at once, want 1", got)
	}
	done := make(chan bool)
	for _, name := range []string{"c", "d"} {
		go func() { open(name); done <- true }()
	}
	<-done
	<-done
	if got := l.mostOpening.Load(); got != 2 {
		t.Errorf("two opens side by side: at most %d at once, want 2", got)
	}
}

// Programs write datasets through the mount (the benches generate theirs there): the writes
// land in the source, over the link, and renames and removals work.
func TestWritesReachTheSource(t *testing.T) {
	source, mnt, l := mounted(t, time.Millisecond, 0)
	if err := os.MkdirAll(filepath.Join(mnt, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mnt, "d", "tmp"), []byte("written"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(mnt, "d", "tmp"), filepath.Join(mnt, "d", "final")); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(source, "d", "final")); err != nil || string(got) != "written" {
		t.Errorf("the source has %q, %v", got, err)
	}
	if got := l.bytes.Load(); got != int64(len("written")) {
		t.Errorf("%d bytes over the link, want the write's %d", got, len("written"))
	}
	if err := os.Remove(filepath.Join(mnt, "d", "final")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(source, "d", "final")); !os.IsNotExist(err) {
		t.Errorf("removed through the mount, still in the source: %v", err)
	}
}

// slowfs ends when its mount is unmounted from outside (umount), not only at a signal.
func TestServeEndsWhenUnmounted(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse")
	}
	mnt := t.TempDir()
	server, err := mount(t.TempDir(), mnt, &link{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- serve(server, make(chan os.Signal)) }()
	if err := syscall.Unmount(mnt, 0); err != nil {
		server.Unmount()
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		server.Unmount()
		t.Fatal("serve still runs 10 s after the unmount")
	}
}

func TestParseRate(t *testing.T) {
	for in, want := range map[string]float64{"1gbit": 125e6, "800mbit": 100e6, "8kbit": 1000, "64bit": 8, "80": 10,
		"0": 0, "1GBIT": 125e6} {
		if got, err := parseRate(in); err != nil || got != want {
			t.Errorf("parseRate(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "fast", "-1gbit", "1gbps"} {
		if _, err := parseRate(in); err == nil {
			t.Errorf("parseRate(%q) took it", in)
		}
	}
}
