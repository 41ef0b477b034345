package tiers

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/privdir"
)

// A cluster server records the tiers it serves in a file of its private runtime directory,
// so that a reader on its node still finds them when the server is dead: a reader learns its
// node's tiers from the server's hello otherwise, and a fresh process (a DataLoader worker of
// a later epoch) would have no way to reach copies the node holds and would read their files
// from the source again. The file is only a pointer: a reader opens each tier it names as it
// opens a tier a hello named (OpenDir: private to this user, no link followed) and serves a
// copy from it only after checking the copy against its source itself (Dir.OpenVersion).
//
// Layout: JSON, {"tiers":[{"dir":"/dev/shm/fitcache","kind":"memory"}, ...]}, fastest first.

// servedMax bounds the size of a record of served tiers a reader reads.
const servedMax = 64 << 10

type servedFile struct {
	Tiers []servedTier `json:"tiers"`
}

type servedTier struct {
	Dir  string `json:"dir"`
	Kind string `json:"kind"`
}

// ServedName returns the name of the file, in the runtime directory, that records the tiers
// of the server with id (host:port, as the job's server list names it).
func ServedName(id string) string {
	return "server-" + strings.NewReplacer(":", "_", "/", "_").Replace(id) + ".tiers"
}

// WriteServed records dirs as the tiers served by the server whose file is name (see
// ServedName) in runtimeDir, which must be a private directory of this user (the server's
// runtime directory, checked at its start). The file is written whole, then renamed into
// place: a reader sees the old record or the new one. It stays when the server stops: the
// tiers stay too, and their readers check every copy they take from them.
func WriteServed(runtimeDir, name string, dirs []Dir) error {
	var rec servedFile
	for _, d := range dirs {
		rec.Tiers = append(rec.Tiers, servedTier{Dir: d.Path, Kind: d.Kind.String()})
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(runtimeDir, "."+name+".tmp-*") // O_EXCL, 0600
	if err != nil {
		return fmt.Errorf("record of the tiers: %w", err)
	}
	tmp := f.Name()
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, filepath.Join(runtimeDir, name))
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("record of the tiers: %w", err)
	}
	return nil
}

// OpenServed opens the tiers that the file name in runtimeDir records (see WriteServed) for
// reading, each with OpenDir, which checks that it is private to this user. The runtime
// directory must be private to this user, and the file a regular file of this user that no
// one else may write, reached through no symbolic link: readers assume hostile neighbours,
// as they do for the tiers themselves. A tier that cannot be opened is skipped (an error
// comes back only when none could be). Close the Dirs when done; their session is 0: serve
// from them with OpenVersion only.
func OpenServed(runtimeDir, name string) ([]Dir, error) {
	dirfd, err := unix.Open(runtimeDir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open runtime directory", Path: runtimeDir, Err: err}
	}
	defer unix.Close(dirfd)
	if err := privdir.Check(dirfd, runtimeDir, false); err != nil {
		return nil, err
	}
	path := filepath.Join(runtimeDir, name)
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != euid || st.Mode&0o022 != 0 || st.Size > servedMax {
		return nil, fmt.Errorf("%s: not a regular file of this user that only this user may write, of at most %d bytes",
			path, servedMax)
	}
	data, err := io.ReadAll(io.LimitReader(f, servedMax+1))
	if err != nil {
		return nil, &os.PathError{Op: "read", Path: path, Err: err}
	}
	var rec servedFile
	if err := json.Unmarshal(data, &rec); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var dirs []Dir
	var errs []error
	for _, t := range rec.Tiers {
		kind, err := ParseKind(t.Kind)
		var d Dir
		if err == nil && !filepath.IsAbs(t.Dir) {
			err = fmt.Errorf("%q is not an absolute path", t.Dir)
		}
		if err == nil {
			d, err = OpenDir(t.Dir, kind)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		dirs = append(dirs, d)
	}
	if len(dirs) == 0 && len(errs) > 0 {
		return nil, fmt.Errorf("%s: no tier could be opened: %w", path, errs[0])
	}
	return dirs, nil
}
