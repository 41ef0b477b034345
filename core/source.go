package core

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Within reports whether path is root or inside it. Both must be clean and absolute.
func Within(path, root string) bool {
	if root == "/" {
		return strings.HasPrefix(path, "/")
	}
	return path == root || strings.HasPrefix(path, root+"/")
}

// CheckPath validates a request: root and path absolute and clean, path inside root.
func CheckPath(root, path string) error {
	for _, p := range []string{root, path} {
		if !filepath.IsAbs(p) || filepath.Clean(p) != p {
			return fmt.Errorf("%w: %q is not an absolute clean path", ErrBadPath, p)
		}
	}
	if !Within(path, root) {
		return fmt.Errorf("%w: %s is not under %s", ErrOutsideRoot, path, root)
	}
	return nil
}

// ReadSource reads a whole source file that must lie inside the dataset root also after
// symbolic links are followed: the opened file's real path is checked against realRoot (the
// root with its links resolved), so a link inside the dataset that points outside it is
// refused. It returns the bytes and the file's modification time.
func ReadSource(path, realRoot string) (data []byte, mtimeNanos int64, err error) {
	// O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, err
	}
	if fi.IsDir() {
		return nil, 0, pathError("read", path, syscall.EISDIR)
	}
	if !fi.Mode().IsRegular() {
		return nil, 0, pathError("read", path, syscall.EINVAL)
	}
	if err := checkRealPath(f, realRoot); err != nil {
		return nil, 0, err
	}
	data = make([]byte, fi.Size())
	if _, err := io.ReadFull(f, data); err != nil {
		if err == io.ErrUnexpectedEOF || err == io.EOF {
			return nil, 0, fmt.Errorf("%w: %s", ErrChanged, path)
		}
		return nil, 0, err
	}
	return data, fi.ModTime().UnixNano(), nil
}

// checkRealPath refuses a file whose real path (symbolic links resolved) is outside realRoot.
func checkRealPath(f *os.File, realRoot string) error {
	real, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(int(f.Fd())))
	if err != nil {
		return nil // no /proc: the lexical check done by the caller stands
	}
	if !Within(real, realRoot) {
		return fmt.Errorf("%w: %s resolves to %s, outside %s", ErrOutsideRoot, f.Name(), real, realRoot)
	}
	return nil
}
