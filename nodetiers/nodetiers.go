package nodetiers

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"golang.org/x/sys/unix"
)

// Prefix starts the name of every FitCache memory tier directory: fitcache-UID, and the
// private stand-ins fitcache-UID-xxxx.
const Prefix = "fitcache-"

// lockName is the lock file a live server holds in its tier (see package tiers).
const lockName = "fitcache.lock"

// DefaultMaxEntries is the bound on the entries one walk visits when Options.MaxEntries is 0.
const DefaultMaxEntries = 2_000_000

// Options says where to look. The zero value looks in /dev/shm.
type Options struct {
	// Dirs are the directories whose fitcache-* entries are tiers; nil means /dev/shm.
	Dirs []string
	// MaxEntries bounds the entries read in each of Dirs and walked in each tier; 0 means
	// DefaultMaxEntries.
	MaxEntries int
	// UserName names a uid; nil means os/user, and the uid itself where it has no name.
	UserName func(uid int) string
}

func (o Options) dirs() []string {
	if len(o.Dirs) == 0 {
		return []string{"/dev/shm"}
	}
	return o.Dirs
}

func (o Options) maxEntries() int {
	if o.MaxEntries <= 0 {
		return DefaultMaxEntries
	}
	return o.MaxEntries
}

func (o Options) userName(uid int) string {
	if o.UserName != nil {
		return o.UserName(uid)
	}
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil {
		return u.Username
	}
	return strconv.Itoa(uid)
}

// Tier is a memory tier directory found on the node.
type Tier struct {
	Path string `json:"path"`
	UID  int    `json:"uid"`
	User string `json:"user"`
	// Readable is false where this user may not read the directory (another user's, not
	// root): then only Path, UID, User and Newest (the directory's own mtime) are known.
	Readable bool `json:"readable"`
	// Files and Bytes count the regular files under it and their st_blocks*512.
	Files int64 `json:"files"`
	Bytes int64 `json:"bytes"`
	// Held says that a live server holds the tier's lock; HolderPID is its pid, and Holder
	// what it wrote in the lock file ("pid 42, embedded server ...").
	Held      bool   `json:"held"`
	HolderPID int    `json:"holder_pid,omitempty"`
	Holder    string `json:"holder,omitempty"`
	// Newest is the newest mtime of the directory and what is under it.
	Newest time.Time `json:"newest"`
	// Note says why the figures are incomplete: the walk's bound, a file system mounted
	// inside, an entry that could not be read. Empty when they are complete.
	Note string `json:"note,omitempty"`
}

// List returns the tier directories in o's directories, by path. It changes nothing, takes no
// lock a server would wait on for long (a shared one, to tell whether one is held), and fails
// only when a directory of o cannot be read.
func List(o Options) ([]Tier, error) {
	var out []Tier
	var errs []error
	for _, dir := range o.dirs() {
		err := eachTier(dir, o.maxEntries(), func(parent int, name string, st *unix.Stat_t) {
			out = append(out, measure(o, parent, dir, name, st))
		})
		if err != nil {
			errs = append(errs, err)
		}
	}
	slices.SortFunc(out, func(a, b Tier) int { return strings.Compare(a.Path, b.Path) })
	return out, errors.Join(errs...)
}

// eachTier calls visit for each fitcache-* entry of dir that is a real directory on dir's file
// system (no link, no mount point), with dir open at parent and the entry's lstat.
func eachTier(dir string, bound int, visit func(parent int, name string, st *unix.Stat_t)) error {
	parent, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: dir, Err: err}
	}
	defer unix.Close(parent)
	var pst unix.Stat_t
	if err := unix.Fstat(parent, &pst); err != nil {
		return fmt.Errorf("stat %s: %w", dir, err)
	}
	f, err := reader(parent)
	if err != nil {
		return fmt.Errorf("read %s: %w", dir, err)
	}
	defer f.Close()
	var names []string
	for read := 0; read < bound; {
		some, err := f.Readdirnames(batch)
		read += len(some)
		for _, n := range some {
			if strings.HasPrefix(n, Prefix) {
				names = append(names, n)
			}
		}
		if len(some) < batch || err != nil {
			break
		}
	}
	slices.Sort(names)
	for _, name := range names {
		var st unix.Stat_t
		if unix.Fstatat(parent, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil ||
			st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Dev != pst.Dev {
			continue
		}
		visit(parent, name, &st)
	}
	return nil
}

// measure describes the tier directory name in dir (open at parent), lstat st.
func measure(o Options, parent int, dir, name string, st *unix.Stat_t) Tier {
	t := Tier{Path: filepath.Join(dir, name), UID: int(st.Uid), User: o.userName(int(st.Uid)),
		Newest: time.Unix(0, st.Mtim.Nano())}
	fd, err := openDir(parent, name, st)
	if errors.Is(err, unix.EACCES) {
		t.Note = "unreadable"
		return t
	}
	if err != nil {
		t.Note = err.Error()
		return t
	}
	defer unix.Close(fd)
	t.Readable = true
	if lock, err := unix.Openat(fd, lockName, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0); err == nil {
		if regular(lock) && errors.Is(unix.Flock(lock, unix.LOCK_SH|unix.LOCK_NB), unix.EWOULDBLOCK) {
			t.Held = true
			t.Holder, t.HolderPID = holder(lock)
		}
		unix.Close(lock) // releases a shared lock taken
	}
	if err := t.walk(o, fd, st, false); err != nil {
		t.Note = err.Error()
	}
	return t
}

// walk measures, or removes, what is in the tier open at fd, lstat st, but its lock file,
// and sets t's Files, Bytes and Newest from what it found.
func (t *Tier) walk(o Options, fd int, st *unix.Stat_t, remove bool) error {
	w := walker{dev: st.Dev, left: o.maxEntries(), remove: remove, newest: st.Mtim.Nano()}
	w.dir(fd, t.Path, lockName, 0) // the lock file is no cached file
	t.Files, t.Bytes, t.Newest = w.files, w.bytes, time.Unix(0, w.newest)
	return w.err()
}

// regular reports whether fd is open on a regular file.
func regular(fd int) bool {
	var st unix.Stat_t
	return unix.Fstat(fd, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFREG
}

// holder reads what a server wrote in the lock file open at fd, "pid N, holder text", and
// the pid. The file is the tier owner's to write: anything but printable characters is
// replaced, so that it cannot write control sequences into root's epilog log.
func holder(fd int) (string, int) {
	b := make([]byte, 1024)
	n, _ := unix.Pread(fd, b, 0)
	text := strings.Map(func(r rune) rune {
		if unicode.IsPrint(r) {
			return r
		}
		return '?'
	}, strings.TrimSpace(strings.ToValidUTF8(string(b[:max(n, 0)]), "?")))
	pid := 0
	if rest, ok := strings.CutPrefix(text, "pid "); ok {
		digits, _, _ := strings.Cut(rest, ",")
		pid, _ = strconv.Atoi(digits)
	}
	return text, pid
}
