package discovery

import (
	"fmt"
	"io"
	"os"
	"syscall"
)

// maxFileBytes bounds a hostfile or topology file: 100,000 lines (maxHosts) of 80 bytes.
// Every client process of the job reads these files at start, so one that someone else can
// write must not cost each of them more than that.
const maxFileBytes = 8 << 20

// openListFile opens a hostfile or topology file (what names it in errors) for reading, and
// returns a reader of at most maxFileBytes, which the caller closes. It is opened with O_NONBLOCK, so that a FIFO (or
// a device) put at path cannot hang the open, and refused unless it is a regular file; one
// larger than maxFileBytes is refused from its size, before a byte is read. The reader stops
// at maxFileBytes and fails if the file grew past it since.
func openListFile(what, path string) (io.ReadCloser, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	fi, err := f.Stat()
	switch {
	case err != nil:
		f.Close()
		return nil, fmt.Errorf("%s: %w", what, err)
	case !fi.Mode().IsRegular():
		f.Close()
		return nil, fmt.Errorf("%s %s: not a regular file (%s)", what, path, fileKind(fi.Mode()))
	case fi.Size() > maxFileBytes:
		f.Close()
		return nil, fmt.Errorf("%s %s: %d bytes, more than the %d a %s may hold", what, path, fi.Size(),
			maxFileBytes, what)
	}
	return &boundedFile{f: f, left: maxFileBytes, what: what, path: path}, nil
}

// boundedFile reads at most left bytes of f, and fails rather than stop short when there
// are more (a file that grew after its size was checked).
type boundedFile struct {
	f          *os.File
	left       int64
	what, path string
}

func (b *boundedFile) Close() error { return b.f.Close() }

func (b *boundedFile) Read(p []byte) (int, error) {
	if b.left <= 0 {
		var one [1]byte
		if n, _ := b.f.Read(one[:]); n > 0 {
			return 0, fmt.Errorf("%s %s: grew past the %d bytes a %s may hold", b.what, b.path, maxFileBytes, b.what)
		}
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.f.Read(p)
	b.left -= int64(n)
	return n, err
}

// fileKind names the type of a file that is not a regular one, for errors.
func fileKind(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&os.ModeNamedPipe != 0:
		return "a FIFO"
	case m&os.ModeSocket != 0:
		return "a socket"
	case m&os.ModeCharDevice != 0:
		return "a character device"
	case m&os.ModeDevice != 0:
		return "a device"
	}
	return m.Type().String()
}
