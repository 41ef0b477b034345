package privdir

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// MakeTemp creates a new private directory in parent whose name is prefix followed by random
// characters. Like mkdtemp, it never reuses an existing name, so another user cannot have
// prepared it. The caller closes the result, whose Name is the directory's path.
func MakeTemp(parent, prefix string) (*os.File, error) {
	dir, err := os.MkdirTemp(parent, prefix)
	if err != nil {
		return nil, err
	}
	return Open(dir)
}

// Fallback opens the private directory that stands in for dir when dir cannot be used (it
// belongs to another user, say). The stand-in lives beside dir with a random name starting
// with dir's base name and "-". Its path is recorded in the file record, inside a private
// directory (the runtime directory), so that a restarted server finds it again; a recorded
// directory is reused only if it is still private and named like a stand-in for dir.
func Fallback(dir, record string) (*os.File, error) {
	dir = filepath.Clean(dir)
	prefix := filepath.Base(dir) + "-"
	if b, err := readRecord(record); err == nil {
		prev := strings.TrimSpace(string(b))
		if filepath.Dir(prev) == filepath.Dir(dir) && strings.HasPrefix(filepath.Base(prev), prefix) {
			if d, err := Open(prev); err == nil {
				return d, nil
			}
		}
	}
	d, err := MakeTemp(filepath.Dir(dir), prefix)
	if err != nil {
		return nil, fmt.Errorf("private stand-in for %s: %w", dir, err)
	}
	if err := writeRecord(record, d.Name()); err != nil {
		d.Close()
		os.Remove(d.Name())
		return nil, fmt.Errorf("record private stand-in for %s: %w", dir, err)
	}
	return d, nil
}

// readRecord reads a record file in a private directory, following no link.
func readRecord(record string) ([]byte, error) {
	d, err := Open(filepath.Dir(record))
	if err != nil {
		return nil, err
	}
	defer d.Close()
	fd, err := unix.Openat(int(d.Fd()), filepath.Base(record), unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), record)
	defer f.Close()
	b := make([]byte, 4096)
	n, err := f.Read(b)
	return b[:n], err
}

// writeRecord replaces a record file in a private directory (created if missing) with text.
func writeRecord(record, text string) error {
	d, err := Make(filepath.Dir(record), true)
	if err != nil {
		return err
	}
	defer d.Close()
	tmp := "." + filepath.Base(record) + ".new"
	unix.Unlinkat(int(d.Fd()), tmp, 0)
	fd, err := unix.Openat(int(d.Fd()), tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return &fs.PathError{Op: "create", Path: filepath.Join(d.Name(), tmp), Err: err}
	}
	f := os.NewFile(uintptr(fd), tmp)
	_, err = f.WriteString(text + "\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = unix.Renameat(int(d.Fd()), tmp, int(d.Fd()), filepath.Base(record))
	}
	if err != nil {
		unix.Unlinkat(int(d.Fd()), tmp, 0)
		return fmt.Errorf("write %s: %w", record, err)
	}
	return nil
}
