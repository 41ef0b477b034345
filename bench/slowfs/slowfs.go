// Command slowfs mounts a directory as a slow shared file system, for the benchmarks to read
// datasets from when no parallel file system is at hand:
//
//	slowfs [--rtt 1ms] [--rate 1gbit] SOURCE MOUNTPOINT
//
// The files of SOURCE appear at MOUNTPOINT (FUSE, read and write), as a client node of a
// parallel file system sees its servers:
//
//   - every request that goes to a server costs a round trip (--rtt): a lookup, an attribute
//     fetch, an open, a directory listing, each read and write (the kernel asks for at most
//     128 KiB at a time, several at once when it reads ahead);
//   - the bytes of reads and writes share one link (--rate, in tc's units: 10gbit, 800mbit;
//     0: no limit), one after the other;
//   - names and attributes are kept a second (as GlusterFS's client does); file data is not
//     kept across opens: each open of a file reads it from the servers again, so each epoch of
//     a training job does (the GlusterFS emulation of the development machines mounts with
//     the same choice).
//
// It runs until SIGINT or SIGTERM, or until the mount is unmounted (umount MOUNTPOINT), then
// prints what went over the link, and the most opens it served at once. It mounts as root (mount(2), or fusermount3 otherwise), and
// only the user who mounted it reads through it. bench/README.md says how the benchmarks use it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

func main() {
	rtt := flag.Duration("rtt", time.Millisecond, "round trip of each request to the servers")
	rate := flag.String("rate", "1gbit", "the link's rate (tc units: bit, kbit, mbit, gbit; 0: no limit)")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: slowfs [--rtt D] [--rate R] SOURCE MOUNTPOINT\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 2 {
		flag.Usage()
		os.Exit(2)
	}
	bytesPerSec, err := parseRate(*rate)
	if err != nil || *rtt < 0 {
		fmt.Fprintf(os.Stderr, "slowfs: --rate %q, --rtt %v: %v\n", *rate, *rtt, err)
		os.Exit(2)
	}
	l := &link{rtt: *rtt, bytesPerSec: bytesPerSec}
	m, err := mount(flag.Arg(0), flag.Arg(1), l)
	if err != nil {
		fmt.Fprintf(os.Stderr, "slowfs: %v\n", err)
		os.Exit(1)
	}
	fmt.Fprintf(os.Stderr, "slowfs: %s at %s: round trip %v, rate %s\n", flag.Arg(0), flag.Arg(1), *rtt, *rate)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	if err := serve(m, stop); err != nil { // busy: a program has a file open there
		fmt.Fprintf(os.Stderr, "slowfs: %v: unmount %s once nothing uses it (umount -l)\n", err, flag.Arg(1))
	}
	fmt.Fprintf(os.Stderr, "slowfs: %d requests, %d bytes, at most %d opens at once\n", l.requests.Load(), l.bytes.Load(),
		l.mostOpening.Load())
}

// serve returns once the mount of m is unmounted, from outside or, at a signal from stop,
// by serve itself: the error of that unmount.
func serve(m *fuse.Server, stop <-chan os.Signal) error {
	unmounted := make(chan struct{})
	go func() { m.Wait(); close(unmounted) }()
	select {
	case <-unmounted:
		return nil
	case <-stop:
		return m.Unmount()
	}
}

// mount serves source at mountpoint through l until the returned server is unmounted.
func mount(source, mountpoint string, l *link) (*fuse.Server, error) {
	source, err := filepath.Abs(source)
	if err != nil {
		return nil, err
	}
	if st, err := os.Stat(source); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("source %s: not a directory (%v)", source, err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(source, &st); err != nil {
		return nil, err
	}
	root := &slowNode{LoopbackNode: &fs.LoopbackNode{RootData: &fs.LoopbackRoot{Path: source, Dev: st.Dev}}, link: l}
	root.RootData.RootNode = root
	second := time.Second
	return fs.Mount(mountpoint, root, &fs.Options{
		EntryTimeout: &second,
		AttrTimeout:  &second,
		MountOptions: fuse.MountOptions{FsName: source, Name: "slowfs", DirectMount: true},
	})
}

// link is the network between the client node and the file system's servers.
type link struct {
	rtt         time.Duration
	bytesPerSec float64 // 0: no limit

	mu   sync.Mutex
	free time.Time // when the link has sent every byte asked for so far

	requests, bytes atomic.Int64 // what went over it

	// Opens waiting on the servers now, and the most ever at once: readers that open files
	// side by side show here (tests/test_parallel_misses.py checks a batch's misses so).
	opening, mostOpening atomic.Int64
}

// open waits as the request of an open does, counted among the opens at once.
func (l *link) open(ctx context.Context) {
	now := l.opening.Add(1)
	defer l.opening.Add(-1)
	for most := l.mostOpening.Load(); now > most && !l.mostOpening.CompareAndSwap(most, now); most = l.mostOpening.Load() {
	}
	l.request(ctx, 0)
}

// request waits as a request to the servers that moves n bytes does: half a round trip
// there, the bytes after those of earlier requests, half a round trip back. It returns
// early when ctx ends (the program was interrupted).
func (l *link) request(ctx context.Context, n int) {
	l.requests.Add(1)
	l.bytes.Add(int64(n))
	arrive := time.Now().Add(l.rtt)
	if l.bytesPerSec > 0 && n > 0 {
		send := time.Duration(float64(n) / l.bytesPerSec * float64(time.Second))
		l.mu.Lock()
		start := time.Now().Add(l.rtt / 2)
		if l.free.After(start) {
			start = l.free
		}
		l.free = start.Add(send)
		arrive = l.free.Add(l.rtt / 2)
		l.mu.Unlock()
	}
	t := time.NewTimer(time.Until(arrive))
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// slowNode is a file or directory of the source, each of its requests sent over the link.
// Operations not listed here are the loopback's, at no cost.
type slowNode struct {
	*fs.LoopbackNode
	link *link
}

var (
	_ fs.NodeWrapChilder     = (*slowNode)(nil)
	_ fs.NodeLookuper        = (*slowNode)(nil)
	_ fs.NodeGetattrer       = (*slowNode)(nil)
	_ fs.NodeOpener          = (*slowNode)(nil)
	_ fs.NodeCreater         = (*slowNode)(nil)
	_ fs.NodeOpendirHandler  = (*slowNode)(nil)
	_ fs.NodeMkdirer         = (*slowNode)(nil)
	_ fs.NodeUnlinker        = (*slowNode)(nil)
	_ fs.NodeRenamer         = (*slowNode)(nil)
	_ fs.FileReader          = (*slowFile)(nil)
	_ fs.FileWriter          = (*slowFile)(nil)
	_ fs.FilePassthroughFder = (*slowFile)(nil)
)

// WrapChild makes the loopback's nodes for the files below slowNodes too.
func (n *slowNode) WrapChild(ctx context.Context, ops fs.InodeEmbedder) fs.InodeEmbedder {
	return &slowNode{LoopbackNode: ops.(*fs.LoopbackNode), link: n.link}
}

func (n *slowNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	n.link.request(ctx, 0)
	return n.LoopbackNode.Lookup(ctx, name, out)
}

func (n *slowNode) Getattr(ctx context.Context, f fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	n.link.request(ctx, 0)
	return n.LoopbackNode.Getattr(ctx, f, out)
}

func (n *slowNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	n.link.open(ctx)
	fh, fuseFlags, errno := n.LoopbackNode.Open(ctx, flags)
	return n.wrap(fh), fuseFlags, errno
}

func (n *slowNode) Create(ctx context.Context, name string, flags, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	n.link.request(ctx, 0)
	inode, fh, fuseFlags, errno := n.LoopbackNode.Create(ctx, name, flags, mode, out)
	return inode, n.wrap(fh), fuseFlags, errno
}

func (n *slowNode) OpendirHandle(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	n.link.request(ctx, 0)
	return n.LoopbackNode.OpendirHandle(ctx, flags)
}

func (n *slowNode) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	n.link.request(ctx, 0)
	return n.LoopbackNode.Mkdir(ctx, name, mode, out)
}

func (n *slowNode) Unlink(ctx context.Context, name string) syscall.Errno {
	n.link.request(ctx, 0)
	return n.LoopbackNode.Unlink(ctx, name)
}

func (n *slowNode) Rename(ctx context.Context, name string, newParent fs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	n.link.request(ctx, 0)
	return n.LoopbackNode.Rename(ctx, name, newParent, newName, flags)
}

// wrap sends the reads and writes of an open file over the link.
func (n *slowNode) wrap(fh fs.FileHandle) fs.FileHandle {
	if lf, ok := fh.(*fs.LoopbackFile); ok {
		return &slowFile{LoopbackFile: lf, link: n.link}
	}
	return fh
}

// slowFile is an open file of the source whose reads and writes go over the link.
type slowFile struct {
	*fs.LoopbackFile
	link *link
}

// Read sends the bytes the read returns over the link: the kernel asks for whole pages, and
// the result (spliced from the source file) knows only the size asked for, so the bytes are
// what the file has from off.
func (f *slowFile) Read(ctx context.Context, buf []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	res, errno := f.LoopbackFile.Read(ctx, buf, off)
	n := 0
	var attr fuse.AttrOut
	if errno == 0 && f.LoopbackFile.Getattr(ctx, &attr) == 0 {
		n = int(max(0, min(int64(len(buf)), int64(attr.Size)-off)))
	}
	f.link.request(ctx, n)
	return res, errno
}

func (f *slowFile) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	f.link.request(ctx, len(data))
	return f.LoopbackFile.Write(ctx, data, off)
}

// PassthroughFd declines the kernel's passthrough, which would read the source file without
// asking this process, and so without the link's costs.
func (f *slowFile) PassthroughFd() (int, bool) { return 0, false }

// parseRate reads a rate in tc's units (bits per second: "1gbit", "800mbit", "100kbit",
// "64bit"; a bare number is bits too) as bytes per second; "0" is no limit.
func parseRate(s string) (float64, error) {
	units := []struct {
		suffix string
		bits   float64
	}{{"gbit", 1e9}, {"mbit", 1e6}, {"kbit", 1e3}, {"bit", 1}, {"", 1}}
	for _, u := range units {
		num, ok := strings.CutSuffix(strings.ToLower(s), u.suffix)
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(num, 64)
		if err != nil || v < 0 {
			return 0, errors.New("want a rate such as 1gbit, 800mbit or 0")
		}
		return v * u.bits / 8, nil
	}
	return 0, errors.New("want a rate such as 1gbit")
}
