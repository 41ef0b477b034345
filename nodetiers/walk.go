package nodetiers

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// maxDepth bounds how deep a walk goes (a tier's layout is a few levels deep); each level
// holds one descriptor.
const maxDepth = 64

// batch is how many names a walk reads from a directory at a time.
const batch = 1024

// errBound reports a walk stopped at its bound of entries.
var errBound = errors.New("stopped at the bound of entries")

// walker measures, or removes, a directory tree through descriptors: it never follows a
// symbolic link and never enters a directory of another file system than dev. It is not safe
// for concurrent use.
type walker struct {
	dev    uint64 // the file system the walk stays on
	left   int    // how many more entries it may visit
	remove bool   // unlink what it visits
	files  int64  // regular files visited (removed, when remove)
	bytes  int64  // their st_blocks*512
	newest int64  // the newest mtime seen, in nanoseconds since the epoch
	errs   []error
}

func (w *walker) fail(err error) {
	if len(w.errs) < 10 {
		w.errs = append(w.errs, err)
	}
}

// err is what went wrong in the walk, nil when nothing did.
func (w *walker) err() error { return errors.Join(w.errs...) }

// seen notes the mtime of an entry.
func (w *walker) seen(st *unix.Stat_t) {
	w.newest = max(w.newest, st.Mtim.Nano())
}

// dir walks the directory open at fd (path names it in errors), leaving the entry keep in it.
// It does not close fd.
func (w *walker) dir(fd int, path, keep string, depth int) {
	if depth > maxDepth {
		w.fail(fmt.Errorf("%s: deeper than %d levels: not entered", path, maxDepth))
		return
	}
	var f *os.File // the reader of the directory's names
	defer func() {
		if f != nil {
			f.Close()
		}
	}()
	for {
		// Removals may reorder a directory: a removing walk reads it again from its start,
		// and lists what is left.
		if f == nil || w.remove {
			if f != nil {
				f.Close()
			}
			var err error
			if f, err = reader(fd); err != nil {
				w.fail(fmt.Errorf("read %s: %w", path, err))
				return
			}
		}
		names, err := f.Readdirnames(batch)
		if err != nil && err != io.EOF {
			w.fail(fmt.Errorf("read %s: %w", path, err))
			return
		}
		done := 0
		for _, name := range names {
			if name == keep {
				continue
			}
			if w.left--; w.left < 0 {
				w.fail(fmt.Errorf("%s: %w", path, errBound))
				return
			}
			if w.entry(fd, path+"/"+name, name, depth) {
				done++
			}
		}
		// Done when read whole, or when a removing walk could remove nothing of a batch.
		if len(names) < batch || (w.remove && done == 0) {
			return
		}
	}
}

// entry visits the entry name of the directory open at fd, and reports whether it was
// removed (or, when not removing, visited).
func (w *walker) entry(fd int, path, name string, depth int) bool {
	var st unix.Stat_t
	if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		w.fail(fmt.Errorf("stat %s: %w", path, err))
		return false
	}
	w.seen(&st)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		if st.Dev != w.dev {
			w.fail(fmt.Errorf("%s: another file system mounted here: not entered", path))
			return false
		}
		sub, err := openDir(fd, name, &st)
		if err != nil {
			w.fail(fmt.Errorf("open %s: %w", path, err))
			return false
		}
		w.dir(sub, path, "", depth+1)
		unix.Close(sub)
		if !w.remove {
			return true
		}
		if err := unix.Unlinkat(fd, name, unix.AT_REMOVEDIR); err != nil {
			w.fail(fmt.Errorf("remove %s: %w", path, err))
			return false
		}
		return true
	case unix.S_IFREG:
		if w.remove {
			if err := unix.Unlinkat(fd, name, 0); err != nil {
				w.fail(fmt.Errorf("remove %s: %w", path, err))
				return false
			}
		}
		w.files++
		w.bytes += st.Blocks * 512
		return true
	default: // a link (removed itself, never followed), a fifo, a socket
		if w.remove {
			if err := unix.Unlinkat(fd, name, 0); err != nil {
				w.fail(fmt.Errorf("remove %s: %w", path, err))
				return false
			}
		}
		return true
	}
}

// openDir opens the directory name in the directory open at fd without following a link,
// and checks that it is the one st describes (not swapped since).
func openDir(fd int, name string, st *unix.Stat_t) (int, error) {
	sub, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	var got unix.Stat_t
	if err := unix.Fstat(sub, &got); err != nil {
		unix.Close(sub)
		return -1, err
	}
	if got.Dev != st.Dev || got.Ino != st.Ino {
		unix.Close(sub)
		return -1, errors.New("replaced while being read")
	}
	return sub, nil
}

// reader opens a reader of the names in the directory open at fd, from their start.
func reader(fd int) (*os.File, error) {
	own, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(own), "."), nil
}
