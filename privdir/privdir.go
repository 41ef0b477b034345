package privdir

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// ErrNotPrivate reports a directory that is not private to the effective user: a symbolic
// link, not a directory, or owned by another user.
var ErrNotPrivate = errors.New("not a private directory")

// NotPrivateError says why a directory is not private. It wraps ErrNotPrivate.
type NotPrivateError struct {
	Path   string
	Reason string // "is a symbolic link", "is owned by uid 65534 (nobody)", ...
	Owner  int    // the owner's uid, or -1 when the reason is not ownership
}

func (e *NotPrivateError) Error() string {
	return fmt.Sprintf("%s %s, not a private directory of this user (uid %d)", e.Path, e.Reason, os.Geteuid())
}

func (e *NotPrivateError) Unwrap() error { return ErrNotPrivate }

// Open opens the existing directory dir without following a symbolic link in its last
// component and checks that it is private (see Check); a directory of ours with a mode other
// than 0700 is set to 0700 through the descriptor. The caller closes the result.
func Open(dir string) (*os.File, error) {
	fd, err := openNoFollow(dir)
	if err != nil {
		return nil, err
	}
	if err := Check(fd, dir, true); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return os.NewFile(uintptr(fd), dir), nil
}

// Inspect reports whether the existing directory dir is private like Check without fix,
// changing nothing: for reports.
func Inspect(dir string) error {
	fd, err := openNoFollow(dir)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return Check(fd, dir, false)
}

// openNoFollow opens the directory dir, explaining a link or a file in its place, or another
// user's directory that this user cannot open (mode 0700, say: EACCES): whatever its mode,
// it is not ours, and callers that fall back from a planted directory must see it so.
func openNoFollow(dir string) (int, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err == nil {
		return fd, nil
	}
	var st unix.Stat_t
	if lerr := unix.Lstat(dir, &st); lerr == nil {
		switch {
		case st.Mode&unix.S_IFMT == unix.S_IFLNK:
			return -1, &NotPrivateError{Path: dir, Reason: "is a symbolic link", Owner: -1}
		case st.Mode&unix.S_IFMT != unix.S_IFDIR:
			return -1, &NotPrivateError{Path: dir, Reason: "is not a directory", Owner: -1}
		case int(st.Uid) != os.Geteuid():
			return -1, ownedBy(dir, int(st.Uid))
		}
	}
	return -1, &fs.PathError{Op: "open", Path: dir, Err: err}
}

// Check verifies that the open descriptor fd, named dir in messages, is a directory owned
// by the effective user. With fix, a mode other than 0700 is set to 0700 (with fchmod, so
// through no link); without it, such a mode is refused too.
func Check(fd int, dir string, fix bool) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return &fs.PathError{Op: "stat", Path: dir, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return &NotPrivateError{Path: dir, Reason: "is not a directory", Owner: -1}
	}
	if int(st.Uid) != os.Geteuid() {
		return ownedBy(dir, int(st.Uid))
	}
	if perm := st.Mode & 0o7777; perm != 0o700 {
		if !fix {
			return &NotPrivateError{Path: dir, Reason: fmt.Sprintf("has mode %#o", perm), Owner: -1}
		}
		if err := unix.Fchmod(fd, 0o700); err != nil {
			return &fs.PathError{Op: "chmod", Path: dir, Err: err}
		}
	}
	return nil
}

// Make is Open, creating dir with mode 0700 first if it is missing. With parents, missing
// parent directories are created too, each 0700 and checked like dir before the next one is
// created inside it; parents that exist already are left as they are.
func Make(dir string, parents bool) (*os.File, error) {
	dir = filepath.Clean(dir)
	if parents {
		if err := makeParents(filepath.Dir(dir)); err != nil {
			return nil, err
		}
	}
	if err := mkdir(dir); err != nil {
		return nil, err
	}
	return Open(dir)
}

// mkdir creates dir with mode 0700 unless something exists at that name. It refuses to
// create it in a directory that belongs to another user than us or root: that user could
// rename it away and put theirs in its place.
func mkdir(dir string) error {
	if _, err := os.Lstat(dir); err == nil {
		return nil
	}
	parent := filepath.Dir(dir)
	var st unix.Stat_t
	if err := unix.Stat(parent, &st); err != nil {
		return &fs.PathError{Op: "stat", Path: parent, Err: err}
	}
	if uid := int(st.Uid); uid != os.Geteuid() && uid != 0 {
		return &NotPrivateError{Path: parent, Reason: "is owned by " + describeUID(uid) +
			" (refusing to create " + filepath.Base(dir) + " in it)", Owner: uid}
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return nil
}

// makeParents creates the missing directories of path, outermost first, checking each.
func makeParents(path string) error {
	if _, err := os.Lstat(path); err == nil || !errors.Is(err, fs.ErrNotExist) {
		return nil // exists (a link or not a directory fails later, at the child's mkdir)
	}
	if parent := filepath.Dir(path); parent != path {
		if err := makeParents(parent); err != nil {
			return err
		}
	}
	if err := mkdir(path); err != nil {
		return err
	}
	d, err := Open(path)
	if err != nil {
		return err
	}
	return d.Close()
}

// ownedBy is the error for dir, owned by the user uid.
func ownedBy(dir string, uid int) *NotPrivateError {
	return &NotPrivateError{Path: dir, Reason: "is owned by " + describeUID(uid), Owner: uid}
}

// describeUID returns "uid N (name)", or "uid N" when the name is unknown.
func describeUID(uid int) string {
	s := "uid " + strconv.Itoa(uid)
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil {
		s += " (" + u.Username + ")"
	}
	return s
}
