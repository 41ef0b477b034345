package tiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/privdir"
)

// Damage is a cached file (or something in its place) that a scan found unusable.
type Damage struct {
	Rel string // path relative to the tier directory
	Err error  // why; wraps ErrDamaged for a bad entry
}

func (d Damage) String() string { return d.Rel + ": " + d.Err.Error() }

// scan walks a tier directory with lstat semantics: it never follows a link. Each entry is
// checked (a regular data file of ours with a valid record that belongs at its place and
// describes this very file, and with verify its data checksum); the valid ones are
// collected, the others reported. With fix it removes what must not stay: leftover
// temporary files, links and files planted as bins or entries, records without data, and
// damaged entries. Without fix it changes nothing (a running server may own the tier).
type scan struct {
	root        string // the tier directory, for messages
	verify, fix bool
	found       []found
	damaged     []Damage
	temps       int
}

type found struct {
	stored
	rel  string // of the data file
	size int64  // see EntrySize
}

func (s *scan) run(dirfd int) error {
	top, err := unix.Openat(dirfd, ".", dirFlags, 0)
	if err != nil {
		return err
	}
	return s.dir(top, "", 0)
}

// dir scans the directory fd (closing it) at depth 0 (the tier), 1 or 2 (bins).
func (s *scan) dir(fd int, rel string, depth int) error {
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("read %s: %w", rel, err)
	}
	present := make(map[string]bool, len(names))
	for _, name := range names {
		present[name] = true
	}
	for _, name := range names {
		r := filepath.Join(rel, name)
		if isTempName(name) {
			if s.fix && depth == 0 && strings.HasPrefix(name, indexTempPrefix) {
				giveBackLeftover(fd, name) // readers may still map it
				s.temps++
			} else if s.fix && unix.Unlinkat(fd, name, 0) == nil {
				s.temps++
			}
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			continue // gone meanwhile
		}
		if depth == 2 {
			if isRecordName(name) {
				if !present[strings.TrimPrefix(name, recordPrefix)] {
					s.bad(fd, r, name, fmt.Errorf("%w: a record without its data file", errDamaged))
				}
				continue
			}
			s.entry(fd, r, name, &st)
			continue
		}
		if !isBinName(name) {
			continue // the lock file, the index, or something of the user's: not ours to judge
		}
		if err := s.bin(fd, r, name, &st, depth); err != nil {
			return err
		}
	}
	return nil
}

// bin scans a hash-bin directory; a link or a file in its place is removed, never followed,
// and a bin of another user makes the tier unusable.
func (s *scan) bin(parent int, rel, name string, st *unix.Stat_t, depth int) error {
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		s.bad(parent, rel, name, errors.New("a bin that is not a directory (a symbolic link?)"))
		return nil
	case int(st.Uid) != euid:
		err := &privdir.NotPrivateError{Path: filepath.Join(s.root, rel), Reason: "(a bin) belongs to uid " + strconv.Itoa(int(st.Uid)), Owner: int(st.Uid)}
		if s.fix {
			return err
		}
		s.damaged = append(s.damaged, Damage{Rel: rel, Err: err})
		return nil
	}
	fd, err := unix.Openat(parent, name, dirFlags, 0)
	if err != nil {
		return fmt.Errorf("open bin %s: %w", rel, err)
	}
	return s.dir(fd, rel, depth+1)
}

// entry checks one data file and its record.
func (s *scan) entry(binfd int, rel, name string, st *unix.Stat_t) {
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFDIR:
		return // not ours to judge
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		s.bad(binfd, rel, name, fmt.Errorf("%w: not a regular file (a symbolic link?)", errDamaged))
		return
	case int(st.Uid) != euid:
		s.bad(binfd, rel, name, fmt.Errorf("%w: belongs to uid %d", errDamaged, st.Uid))
		return
	}
	rec, err := checkEntry(binfd, rel, name, st, s.verify)
	if err != nil {
		s.bad(binfd, rel, name, err)
		return
	}
	s.found = append(s.found, found{stored: rec, rel: rel, size: EntrySize(rec.SourcePath, rec.Size)})
}

// bad records a damaged entry and, with fix, removes it and its record.
func (s *scan) bad(dirfd int, rel, name string, err error) {
	s.damaged = append(s.damaged, Damage{Rel: rel, Err: err})
	if s.fix {
		unix.Unlinkat(dirfd, name, 0)
		if !isRecordName(name) {
			unix.Unlinkat(dirfd, recordPrefix+name, 0)
		}
	}
}

// sorted returns the valid entries oldest first (by publication sequence number), which is
// FIFO order.
func (s *scan) sorted() []found {
	sort.Slice(s.found, func(i, j int) bool {
		if s.found[i].seq != s.found[j].seq {
			return s.found[i].seq < s.found[j].seq
		}
		return s.found[i].rel < s.found[j].rel
	})
	return s.found
}

// checkEntry reads the record of the data file name (with status st) and checks that its
// source path belongs at rel and that it describes this file (inode number and size), and
// with verify that the data match the checksum.
func checkEntry(binfd int, rel, name string, st *unix.Stat_t, verify bool) (stored, error) {
	rec, err := readRecord(binfd, name)
	if err != nil {
		return stored{}, err
	}
	switch {
	case RelPath(rec.SourcePath) != rel:
		return stored{}, fmt.Errorf("%w: holds %s, which belongs elsewhere", errDamaged, rec.SourcePath)
	case strings.IndexByte(rec.SourcePath, 0) >= 0 && !isBlockName(rec.SourcePath):
		return stored{}, fmt.Errorf("%w: %q is neither a path nor a block's name", errDamaged, rec.SourcePath)
	case rec.ino != st.Ino:
		return stored{}, fmt.Errorf("%w: the record describes another file (an older copy?)", errDamaged)
	case rec.Size != st.Size:
		return stored{}, fmt.Errorf("%w: %d bytes, the record says %d", errDamaged, st.Size, rec.Size)
	}
	if !verify || rec.Size == 0 {
		return rec, nil
	}
	fd, err := unix.Openat(binfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return stored{}, fmt.Errorf("%w: %w", errDamaged, err)
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	m, err := mapFile(f)
	if err != nil {
		return stored{}, fmt.Errorf("%w: map: %w", errDamaged, err)
	}
	defer m.Unmap()
	if int64(len(m)) != rec.Size {
		return stored{}, fmt.Errorf("%w: changed size", errDamaged)
	}
	return rec, verifyData(m, rec.Entry)
}

// verifyData checks a mapped file's data against its checksum; a fault (the file was
// truncated meanwhile) is damage, not a crash.
func verifyData(m []byte, e Entry) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: fault while reading data: %v", errDamaged, r)
		}
	}()
	if crc32c(m[:e.Size]) != e.Checksum {
		return errChecksum
	}
	return nil
}

// Check verifies every entry of the tier directory d, data checksums included, without
// changing any entry (a directory of ours with a loose mode is set to 0700, see
// privdir.Open), and returns how many entries are valid and which are damaged. It is
// for a tier that a running server holds; see Config.Verify for one that can be repaired.
func (d Dir) Check() (valid int, damaged []Damage, err error) {
	dir, err := privdir.Open(d.Path)
	if err != nil {
		return 0, nil, err
	}
	defer dir.Close()
	s := scan{root: d.Path, verify: true}
	if err := s.run(int(dir.Fd())); err != nil {
		return 0, nil, err
	}
	return len(s.found), s.damaged, nil
}
