package tiers

import (
	"errors"
	"fmt"
	"golang.org/x/sys/unix"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/fitcache/fitcache/privdir"
)

// ErrNotCached reports that a tier holds no valid copy of the requested file.
var ErrNotCached = errors.New("not cached")

// ErrDamaged reports a cached file that exists but does not match its record or index entry
// (truncated, replaced, changed). It is always returned together with ErrNotCached: a
// damaged file is a miss, never data.
var ErrDamaged = errDamaged

// Dir is the read side of a tier: a directory with the hash-bin layout and its index. It
// is safe for concurrent use, and a client can open the files of a server's tier itself.
//
// A Dir made by OpenDir holds the directory open, checked once, and the index mapped: a hit
// then costs a lookup in memory and the system calls of a plain read. A Dir literal only
// names the directory (for Check); its Open always misses.
type Dir struct {
	Path string // the tier directory
	Kind Kind

	dir  *os.File   // the directory, opened and checked by OpenDir
	view *indexView // the tier's index
	// session: copies not checked against their source in this validation session or a
	// later one are misses (see WithSession); 0 serves every copy.
	session uint32
}

// Session returns the validation session d reads for (see WithSession).
func (d Dir) Session() uint32 { return d.session }

// WithSession returns d for a reader of validation session s (see Tier.Validate): a copy the
// server has not found to match its source in that session or a later one is a miss, which
// the reader takes to the server, which checks it. The server hands out sessions: the
// session of a client is the one it was given when it said hello.
func (d Dir) WithSession(s uint32) Dir {
	d.session = s
	return d
}

// OpenDir opens the tier directory at path for reading, following no symbolic link, checks
// once that it is private to this user (see privdir) and maps its index (or will, once a
// server made one). Close it when done; a Close while other goroutines Open files is safe
// (they get misses).
func OpenDir(path string, kind Kind) (Dir, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return Dir{}, &fs.PathError{Op: "open tier", Path: path, Err: err}
	}
	if err := privdir.Check(fd, path, false); err != nil {
		unix.Close(fd)
		return Dir{}, err
	}
	d := Dir{Path: path, Kind: kind, dir: os.NewFile(uintptr(fd), path), view: &indexView{}}
	d.view.reopen(fd)
	return d, nil
}

// Close closes a directory held by OpenDir and unmaps its index; it does nothing for other
// Dirs.
func (d Dir) Close() error {
	if d.dir == nil {
		return nil
	}
	d.view.close()
	return d.dir.Close()
}

// CachedPath returns where the cached copy of sourcePath lives in d.
func (d Dir) CachedPath(sourcePath string) string {
	return filepath.Join(d.Path, RelPath(sourcePath))
}

// Open maps the cached copy of sourcePath. It returns an error wrapping ErrNotCached when d
// has no copy (its index has no entry for the path), or when the file in its place is not
// the one the index describes (another inode or size: damaged, or replaced meanwhile). It
// follows no symbolic link at any level. The caller must Release the mapping.
func (d Dir) Open(sourcePath string) (*Mapping, error) {
	var m *Mapping
	err := d.withEntry(sourcePath, func(dirfd int, p string) (err error) {
		m, err = openAt(dirfd, d, p)
		return err
	})
	return m, err
}

// OpenToSend is Open for a caller that sends the copy's bytes elsewhere (a server answering
// another node): it returns the cached file, open, for sendfile, and a mapping of it that is
// made only when its bytes are asked for (Mapping.Map), while the file is open: a reply sent
// with sendfile maps nothing. The caller closes the file once done with the mapping, and
// releases the mapping.
func (d Dir) OpenToSend(sourcePath string) (*Mapping, *os.File, error) {
	var m *Mapping
	var f *os.File
	err := d.withEntry(sourcePath, func(dirfd int, p string) error {
		var s slot
		var ino uint64
		var err error
		if f, s, ino, err = openChecked(dirfd, d, p); err != nil {
			return err
		}
		m = &Mapping{Entry: s.entry(p), Tier: d.Kind, Path: filepath.Join(d.Path, RelPath(p)), ino: ino}
		if m.Size > 0 {
			m.lazy = f
		}
		return nil
	})
	return m, f, err
}

// OpenFile opens the cached copy of sourcePath read-only, checked as Open checks it, for a
// caller that hands the descriptor to a reader in place of the source (the node socket's
// answer to the preload shim). The caller closes it.
func (d Dir) OpenFile(sourcePath string) (*os.File, error) {
	var f *os.File
	err := d.withEntry(sourcePath, func(dirfd int, p string) (err error) {
		f, _, _, err = openChecked(dirfd, d, p)
		return err
	})
	return f, err
}

// CopyIdentity returns the identity of the source version that the copy m holds, from the
// copy's record in whichever of dirs mapped it (the index gives a reader the source's size
// and mtime only): an open and a read of a small file, for a reader that serves pieces of
// several copies in one read (a range that spans blocks) and must know that they are of
// one version of the file. A record that is not that of the mapped file is an error.
func CopyIdentity(dirs []Dir, m *Mapping) (Identity, error) {
	for _, d := range dirs {
		if d.dir == nil || !strings.HasPrefix(m.Path, d.Path+string(filepath.Separator)) {
			continue
		}
		var s stored
		err := withFd(d.dir, func(dirfd int) error {
			binfd, name, err := openBin(dirfd, RelPath(m.SourcePath), false)
			if err != nil {
				return err
			}
			defer unix.Close(binfd)
			s, err = readRecord(binfd, name)
			return err
		})
		if err != nil {
			return Identity{}, fmt.Errorf("record of %s: %w", m.Path, err)
		}
		if s.ino != m.ino || s.SourcePath != m.SourcePath || s.Size != m.Size {
			return Identity{}, fmt.Errorf("%w: %s: the record is not the mapped file's", errDamaged, m.Path)
		}
		return s.Identity(), nil
	}
	return Identity{}, fmt.Errorf("%w: %s is in none of the tiers given", ErrNotCached, m.Path)
}

// withEntry runs open with the directory's descriptor and the clean sourcePath, and makes
// every error a miss (ErrNotCached): a tier not opened, or closed meanwhile, has no copy.
func (d Dir) withEntry(sourcePath string, open func(dirfd int, sourcePath string) error) error {
	if d.dir == nil {
		return fmt.Errorf("%w: tier %s not opened", ErrNotCached, d.Path)
	}
	err := withFd(d.dir, func(dirfd int) error { return open(dirfd, filepath.Clean(sourcePath)) })
	if err != nil && !errors.Is(err, ErrNotCached) {
		err = fmt.Errorf("%w: %w", ErrNotCached, err)
	}
	return err
}

// OpenVersion is Open for a reader that checked the source itself: it maps the copy of
// sourcePath if its index slot says that the copy holds the source version cur (size,
// modification and change times, inode: see Identity), whatever validation session the copy
// was last checked in. Sessions say that a server checked a copy for the reader's job; a
// reader whose server is dead has no one to ask (see OpenServed), and the copy's own record
// of its source's version is what it checks instead. A copy of another version is a miss.
func (d Dir) OpenVersion(sourcePath string, cur Identity) (*Mapping, error) {
	d.session = 0
	var m *Mapping
	err := d.withEntry(sourcePath, func(dirfd int, p string) error {
		f, s, ino, err := openChecked(dirfd, d, p)
		if err != nil {
			return err
		}
		defer f.Close()
		if !s.source().matches(cur) {
			return fmt.Errorf("%w: the copy of %s holds another version of it", ErrNotCached, p)
		}
		m, err = mapData(f, filepath.Join(d.Path, RelPath(p)), d.Kind, s.entry(p), ino)
		return err
	})
	return m, err
}

// openAt maps the cached copy of the clean sourcePath in the tier d open at dirfd.
func openAt(dirfd int, d Dir, sourcePath string) (*Mapping, error) {
	m, f, err := openMapped(dirfd, d, sourcePath)
	if err != nil {
		return nil, err
	}
	f.Close()
	return m, nil
}

// openMapped opens and maps the cached copy of the clean sourcePath in the tier d open at
// dirfd, and returns the mapping and the file, open.
func openMapped(dirfd int, d Dir, sourcePath string) (*Mapping, *os.File, error) {
	f, s, ino, err := openChecked(dirfd, d, sourcePath)
	if err != nil {
		return nil, nil, err
	}
	m, err := mapData(f, filepath.Join(d.Path, RelPath(sourcePath)), d.Kind, s.entry(sourcePath), ino)
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return m, f, nil
}

// openChecked opens the cached copy of the clean sourcePath in the tier d open at dirfd and
// checks that it is the file the index describes; it returns the file, its index slot and
// its inode number.
func openChecked(dirfd int, d Dir, sourcePath string) (*os.File, slot, uint64, error) {
	s, ok := d.view.lookup(dirfd, idOf(sourcePath))
	if !ok || s.checked < d.session {
		return nil, s, 0, ErrNotCached
	}
	rel := RelPath(sourcePath)
	path := filepath.Join(d.Path, rel)
	f, err := openEntry(dirfd, rel)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, s, 0, ErrNotCached // evicted since the lookup
	}
	if err != nil {
		return nil, s, 0, fmt.Errorf("%w: %s: %w", ErrNotCached, path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, s, 0, fmt.Errorf("%w: %s: %w", ErrNotCached, path, err)
	}
	switch {
	case st.Ino != s.ino:
		f.Close()
		return nil, s, 0, ErrNotCached // replaced or evicted since the lookup
	case st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != euid || st.Size != s.size:
		f.Close()
		return nil, s, 0, fmt.Errorf("%w: %w: %s is not the file the index describes (%d bytes, want %d)",
			ErrNotCached, errDamaged, path, st.Size, s.size)
	}
	return f, s, st.Ino, nil
}

// mapData maps the data of the cached file f, at path, described by e; the caller has
// checked that f has e.Size bytes (an fstat of f: a file truncated since is what every
// mapping guards against, see Mapping.CopyAt).
func mapData(f *os.File, path string, kind Kind, e Entry, ino uint64) (*Mapping, error) {
	m := &Mapping{Entry: e, Tier: kind, Path: path, ino: ino}
	if e.Size == 0 {
		return m, nil // nothing to map
	}
	mm, err := mapFirst(f, e.Size)
	if err != nil {
		return nil, fmt.Errorf("%w: map %s: %w", ErrNotCached, path, err)
	}
	m.m = mm
	return m, nil
}
