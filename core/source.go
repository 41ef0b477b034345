package core

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/edsrzf/mmap-go"
	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/tiers"
)

// Within reports whether path is root or inside it. Both must be clean and absolute.
func Within(path, root string) bool {
	if root == "/" {
		return strings.HasPrefix(path, "/")
	}
	return path == root || strings.HasPrefix(path, root+"/")
}

// DatasetRoot returns the directory root absolute and clean, and with its symbolic links
// resolved (real, for opens of its sources beneath it), for a reader of the dataset under it.
func DatasetRoot(root string) (abs, real string, err error) {
	abs, err = filepath.Abs(root)
	if err != nil {
		return "", "", err
	}
	fi, err := os.Stat(abs)
	if err != nil {
		return "", "", err
	}
	if !fi.IsDir() {
		return "", "", &os.PathError{Op: "open dataset", Path: abs, Err: syscall.ENOTDIR}
	}
	real, err = filepath.EvalSymlinks(abs)
	if err != nil {
		return "", "", err
	}
	return abs, real, nil
}

// ResolveIn returns path (absolute, or relative to root, which is absolute and clean) absolute
// and clean, or an error wrapping ErrOutsideRoot for a path outside root (ErrBadPath for one
// with a NUL byte).
func ResolveIn(root, path string) (string, error) {
	if strings.IndexByte(path, 0) >= 0 {
		return "", fmt.Errorf("%w: %q has a NUL byte", ErrBadPath, path)
	}
	if !filepath.IsAbs(path) {
		path = filepath.Join(root, path)
	}
	path = filepath.Clean(path)
	if !Within(path, root) {
		return "", fmt.Errorf("%w: %s is not under %s", ErrOutsideRoot, path, root)
	}
	return path, nil
}

// CheckPath validates a request: root and path absolute and clean, without a NUL byte (no
// file name has one, and a cached block's name does: see tiers.BlockName), path inside root.
func CheckPath(root, path string) error {
	for _, p := range []string{root, path} {
		if !filepath.IsAbs(p) || filepath.Clean(p) != p {
			return fmt.Errorf("%w: %q is not an absolute clean path", ErrBadPath, p)
		}
		if strings.IndexByte(p, 0) >= 0 {
			return fmt.Errorf("%w: %q has a NUL byte", ErrBadPath, p)
		}
	}
	if !Within(path, root) {
		return fmt.Errorf("%w: %s is not under %s", ErrOutsideRoot, path, root)
	}
	return nil
}

// Source is an open source file that lies inside its dataset root, also after symbolic links
// are followed. It remembers the file's identity when it was opened (device, inode, size,
// modification and change times), so that a reader can tell whether the file changed while
// it was being read: bytes read across a change may mix two versions and must never be
// cached (see Unchanged).
type Source struct {
	f     *os.File
	path  string
	stamp sourceStamp
}

// sourceStamp is what identifies one version of a source file.
type sourceStamp struct {
	dev, ino    uint64
	size        int64
	mtime, ctim syscall.Timespec
	mode        uint32
}

func stampOf(st *syscall.Stat_t) sourceStamp {
	return sourceStamp{dev: uint64(st.Dev), ino: st.Ino, size: st.Size, mtime: st.Mtim, ctim: st.Ctim, mode: st.Mode}
}

// OpenSource opens the source file at path for reading. path lies lexically under root,
// whose symbolic links resolve to realRoot; the file opened must lie inside realRoot also
// after every link is followed, so a link inside the dataset that points outside it is
// refused (ErrOutsideRoot) before anything outside is opened: the kernel resolves the path
// beneath the root (openat2 with RESOLVE_BENEATH). Directories, FIFOs, devices and sockets
// are refused without blocking.
func OpenSource(root, realRoot, path string) (*Source, error) {
	rel, err := filepath.Rel(root, path)
	if err != nil || !filepath.IsLocal(rel) && rel != "." {
		return nil, fmt.Errorf("%w: %s is not under %s", ErrOutsideRoot, path, root)
	}
	f, err := openBeneath(realRoot, rel, path, sourceOpenFlags)
	if err != nil {
		return nil, err
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, pathError("stat", path, err)
	}
	switch st.Mode & syscall.S_IFMT {
	case syscall.S_IFREG:
	case syscall.S_IFDIR:
		f.Close()
		return nil, pathError("read", path, syscall.EISDIR)
	default:
		f.Close()
		return nil, pathError("read", path, syscall.EINVAL)
	}
	return &Source{f: f, path: path, stamp: stampOf(&st)}, nil
}

// lookSource opens the source file at path, which lies lexically under root, whose symbolic
// links resolve to realRoot, to look at it but not to read it (O_PATH): it is found beneath
// the root as OpenSource finds it, so a link out of the root is refused the same way, and on
// a parallel file system the look is a metadata lookup only. The caller closes the file.
func lookSource(root, realRoot, path string) (*os.File, error) {
	rel, err := filepath.Rel(root, path)
	if err != nil || !filepath.IsLocal(rel) {
		return nil, fmt.Errorf("%w: %s is not under %s", ErrOutsideRoot, path, root)
	}
	return openBeneath(realRoot, rel, path, unix.O_PATH|unix.O_CLOEXEC)
}

// sourceOpenFlags: O_NONBLOCK so that opening a FIFO does not wait for a writer (it is
// refused after the open).
const sourceOpenFlags = unix.O_RDONLY | unix.O_NONBLOCK | unix.O_CLOEXEC

// openBeneath opens rel inside realRoot with flags without ever leaving it. A path through an absolute
// link, or a link that leaves the root, fails in the kernel with EXDEV; such a path is then
// resolved here, and opened if it stays inside the root (an absolute link to another file of
// the dataset, say), again beneath the root, so that a link swapped meanwhile is refused.
func openBeneath(realRoot, rel, path string, flags int) (*os.File, error) {
	// realRoot has its links resolved: one that has a link in it now was swapped since.
	dirfd, err := unix.Openat2(unix.AT_FDCWD, realRoot, &unix.OpenHow{
		Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_NO_SYMLINKS})
	switch {
	case errors.Is(err, unix.ENOSYS): // a kernel older than 5.6
		return openChecked(path, realRoot, flags)
	case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR):
		return nil, fmt.Errorf("%w: %s is no longer the directory it was (a link now)", ErrOutsideRoot, realRoot)
	case err != nil:
		return nil, pathError("open", realRoot, err)
	}
	defer unix.Close(dirfd)
	how := unix.OpenHow{Flags: uint64(flags), Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS}
	fd, err := unix.Openat2(dirfd, rel, &how)
	if errors.Is(err, unix.EXDEV) {
		real, rerr := filepath.EvalSymlinks(path)
		if rerr != nil {
			return nil, rerr
		}
		if !Within(real, realRoot) {
			return nil, fmt.Errorf("%w: %s resolves to %s, outside %s", ErrOutsideRoot, path, real, realRoot)
		}
		resolved, _ := filepath.Rel(realRoot, real)
		if fd, err = unix.Openat2(dirfd, resolved, &how); errors.Is(err, unix.EXDEV) {
			return nil, fmt.Errorf("%w: %s changed to leave %s while being opened", ErrOutsideRoot, path, realRoot)
		}
	}
	if err != nil {
		return nil, pathError("open", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// openChecked opens path and then checks the opened file's real path against realRoot, for
// kernels without openat2. It refuses when the real path cannot be learnt (no /proc).
func openChecked(path, realRoot string, flags int) (*os.File, error) {
	f, err := os.OpenFile(path, flags, 0)
	if err != nil {
		return nil, err
	}
	real, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(int(f.Fd())))
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%w: cannot check where %s leads (no /proc): %v", ErrOutsideRoot, path, err)
	}
	if !Within(real, realRoot) {
		f.Close()
		return nil, fmt.Errorf("%w: %s resolves to %s, outside %s", ErrOutsideRoot, path, real, realRoot)
	}
	return f, nil
}

// Size returns the file's size when it was opened.
func (s *Source) Size() int64 { return s.stamp.size }

// Identity returns the identity of the file's version that was opened.
func (s *Source) Identity() tiers.Identity {
	return tiers.Identity{Size: s.stamp.size, MTimeNanos: s.stamp.mtime.Nano(), CTimeNanos: s.stamp.ctim.Nano(), Ino: s.stamp.ino}
}

// MTimeNanos returns the file's modification time when it was opened, in Unix nanoseconds.
func (s *Source) MTimeNanos() int64 { return s.stamp.mtime.Nano() }

// CTimeNanos returns the file's change time when it was opened, in Unix nanoseconds.
func (s *Source) CTimeNanos() int64 { return s.stamp.ctim.Nano() }

// Ino returns the file's inode number.
func (s *Source) Ino() uint64 { return s.stamp.ino }

// Mode returns the file's permission bits.
func (s *Source) Mode() fs.FileMode { return fs.FileMode(s.stamp.mode).Perm() }

// Close closes the file.
func (s *Source) Close() error { return s.f.Close() }

// Unchanged checks that the file is still the version that was opened: same size and times
// through the open descriptor, and the path still names the same file (not replaced by a
// rename). It returns an error wrapping ErrChanged otherwise.
func (s *Source) Unchanged() error {
	var st syscall.Stat_t
	if err := syscall.Fstat(int(s.f.Fd()), &st); err != nil {
		return pathError("stat", s.path, err)
	}
	now := stampOf(&st)
	if now != s.stamp {
		return fmt.Errorf("%w: %s (size %d -> %d)", ErrChanged, s.path, s.stamp.size, now.size)
	}
	if err := syscall.Stat(s.path, &st); err != nil || uint64(st.Dev) != s.stamp.dev || st.Ino != s.stamp.ino {
		return fmt.Errorf("%w: %s was replaced", ErrChanged, s.path)
	}
	return nil
}

// testHookSourceRead, when set by a test, runs after a source file's bytes were read and
// before the check that the file did not change meanwhile.
var testHookSourceRead func(path string)

// ReadAll reads the whole file into memory and checks that it did not change meanwhile.
func (s *Source) ReadAll() ([]byte, error) {
	data := make([]byte, s.stamp.size)
	if _, err := s.f.ReadAt(data, 0); err != nil {
		if err == io.EOF {
			return nil, fmt.Errorf("%w: %s shrank while being read", ErrChanged, s.path)
		}
		return nil, err
	}
	if testHookSourceRead != nil {
		testHookSourceRead(s.path)
	}
	if err := s.Unchanged(); err != nil {
		return nil, err
	}
	return data, nil
}

// Reader returns a reader of the file's bytes from the start. When it has delivered the
// last byte it checks that the file did not change meanwhile, and fails with ErrChanged if
// it did, so that a writer copying it (into a tier) discards the copy.
func (s *Source) Reader() io.Reader { return s.RangeReader(0, s.stamp.size) }

// RangeReader is Reader for the n bytes at off (a block of the file), which must lie
// inside the file as it was opened: after the last of them it checks the file as Reader does.
func (s *Source) RangeReader(off, n int64) io.Reader {
	return &checkedReader{s: s, r: io.NewSectionReader(s.f, off, n), want: n}
}

type checkedReader struct {
	s       *Source
	r       *io.SectionReader
	want    int64 // bytes to deliver
	n       int64 // bytes delivered
	checked bool  // the file was checked after the last byte
	err     error // the change found after the last byte, returned by every later Read
}

func (c *checkedReader) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.r.Read(p)
	c.n += int64(n)
	if err == io.EOF && c.n < c.want {
		return n, fmt.Errorf("%w: %s shrank while being read", ErrChanged, c.s.path)
	}
	// Checked once: a caller that reads on to see the end (tiers' copyExactly does) gets
	// io.EOF, not a second look at the source (an fstat and a stat by path per file).
	if c.n == c.want && !c.checked && (err == nil || err == io.EOF) {
		c.checked = true
		if testHookSourceRead != nil {
			testHookSourceRead(c.s.path)
		}
		if cerr := c.s.Unchanged(); cerr != nil {
			c.err = cerr
			return n, cerr
		}
	}
	return n, err
}

// Map maps the whole file read-only, so that a file too large to cache or to hold in memory
// can still be served without a copy. An empty file gives an empty mapping. The caller
// must Unmap it. A reader of the mapping takes a SIGBUS if the file is truncated meanwhile;
// Go code reading it must run under debug.SetPanicOnFault.
func (s *Source) Map() (mmap.MMap, error) {
	if s.stamp.size == 0 {
		return nil, nil
	}
	m, err := mmap.MapRegion(s.f, int(s.stamp.size), mmap.RDONLY, 0, 0)
	if err != nil {
		return nil, fmt.Errorf("map %s: %w", s.path, err)
	}
	return m, nil
}
