package tiers

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Fills by readers. A reader that misses a small file reads it from the source itself (it
// needs the bytes anyway), writes the copy into the first tier, and tells the server, which
// only records it (Adopt): the source is read and the copy written where the cores are, in
// the readers, and the reader waits for no server. Whoever reads a file from the source, a
// reader or the server, first claims it: it creates the file's fill file, named by FillName
// in the file's bin of the first tier, with O_EXCL. The kernel lets one process make it, so
// one process reads the source per file (invariant 3); a reader that finds the claim taken
// asks the server, which waits for the claim's holder. A reader writes the copy into the
// fill file itself, computing its CRC-32C as it writes it, gives it the copy's mode and
// times, and reports the checksum with the fill (nodesock.RecordHasChecksum); Adopt links
// the file into place and records it without reading it (a Fill). The server's own fill of
// a small file goes the same way (Claim.Fill, then Adopt): it keeps its fill file open,
// reserves the copy's room in the tier, writes the source's bytes into it with their
// checksum, and links it into place; a larger file, or one the tier has no room for now, is
// written as before (Publish), and the fill file only holds the claim. A reader holds an open file
// description lock on its fill file until it has reported it (ClaimState), and the kernel
// drops the lock when the reader dies: a claim that is neither locked nor reported is
// abandoned, and the server takes it over (TakeAbandonedClaim). The fill file's name starts with tempPrefix: a rescan removes
// one a crash left behind.
//
// capi/fill.c makes the same names: FillName and RelPath must agree with it.

// fillPrefix starts the name of a fill file: ".tmp-fill-" and the file's key in 16 hex digits.
const fillPrefix = tempPrefix + "fill-"

// AbandonedAfter is how long a claim must have been seen unlocked, and not reported, before
// it is taken for abandoned (core's claimSource): a reader unlocks its fill file only after it
// has sent its report, which the server notes as soon as it reads it, so an unlocked claim
// not noted that long is one whose reader died before it could report. The time is counted
// from when the claim was first seen unlocked, not from the fill file's last write: a reader
// descheduled between its last write and its report would look abandoned otherwise.
const AbandonedAfter = 3 * time.Second

// ErrClaimed reports that another process is reading the file from the source.
var ErrClaimed = errors.New("claimed by another reader of the source")

// FillName returns the path, relative to a tier directory, of the fill file that claims the
// source file at sourcePath: in the bin of its copy (see RelPath).
func FillName(sourcePath string) string {
	k := KeyOf(sourcePath)
	return fmt.Sprintf("%02x/%02x/%s%016x", byte(k), byte(k>>8), fillPrefix, uint64(k))
}

// A Claim is the right, held by this process, to read a file from the source (see Claim).
// It keeps the claim's fill file open, so that the server can write its own copy into it
// (Claim.Fill) as a reader does. It is not safe for concurrent use.
type Claim struct {
	t    *Tier
	fill *Fill // the fill file, open for reading and writing, and its bin, until Release
}

// Claim claims the file at sourcePath for a read of the source by this process. It returns
// ErrClaimed when another process (a reader, or a fill of this server) holds it.
func (t *Tier) Claim(sourcePath string) (Claim, error) {
	rel := FillName(sourcePath)
	f := &Fill{binfd: -1, fd: -1}
	err := withFd(t.dirFile, func(dirfd int) (err error) {
		f.binfd, f.name, err = openBin(dirfd, rel, true)
		return err
	})
	if err != nil {
		return Claim{}, err
	}
	fd, err := unix.Openat(f.binfd, f.name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, entryMode)
	if err != nil {
		f.Close()
		if errors.Is(err, unix.EEXIST) {
			return Claim{}, ErrClaimed
		}
		return Claim{}, err
	}
	f.fd, f.own = fd, true
	return Claim{t: t, fill: f}, nil
}

// Release gives a claim up: its fill file is removed, unless Adopt published it or another
// has taken its name since (TakeAbandonedClaim), and the room Fill reserved for it is given
// back. A zero Claim releases nothing.
func (c Claim) Release() {
	f := c.fill
	if f == nil {
		return
	}
	if !f.adopted && (f.st.Ino != 0 || unix.Fstat(f.fd, &f.st) == nil) {
		var st unix.Stat_t
		if unix.Fstatat(f.binfd, f.name, &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Ino == f.st.Ino {
			unix.Unlinkat(f.binfd, f.name, 0)
		}
	}
	if f.reserved > 0 {
		c.t.unreserve(f.reserved)
		f.reserved = 0
	}
	f.Close()
}

// ErrNoClaimFile reports a Fill of a zero Claim: there is no fill file to write into.
var ErrNoClaimFile = errors.New("no fill file claimed")

// Fill writes the copy of e.SourcePath into the claim's fill file, as a reader writes its
// own (see the package comment on fills): the e.Size bytes that r gives (exactly; see
// PublishFrom), their CRC-32C computed on the way, then the mode and times Publish gives a
// copy. The tier's room for the copy is reserved first, as Publish reserves it, so that the
// fill file never takes memory beyond the budget: without room now, Fill writes nothing and
// returns ErrNoRoom (a full file system too, as Publish does). The Fill it returns is for
// Adopt in this tier (which uses the reservation) or PublishFill in another; it belongs to
// the claim, and Release closes it and gives back a reservation Adopt did not use.
func (c Claim) Fill(e Entry, r io.Reader) (*Fill, error) {
	f := c.fill
	if f == nil {
		return nil, ErrNoClaimFile
	}
	if f.reserved > 0 || f.HasChecksum {
		return nil, fmt.Errorf("fill %s: written already", e.SourcePath)
	}
	n := EntrySize(filepath.Clean(e.SourcePath), e.Size)
	if !c.t.reserve(n) {
		return nil, ErrNoRoom
	}
	f.reserved = n
	crc, err := copyExactly(fdWriter(f.fd), r, e.Size)
	if err == nil {
		err = finishDataStat(f.fd, e.MTimeNanos, e.Mode, &f.st)
	}
	if err != nil {
		unix.Ftruncate(f.fd, 0) // its memory goes back with its reservation; Release removes it
		c.t.unreserve(n)
		f.reserved = 0
		if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
			c.t.noSpace()
			return nil, fmt.Errorf("%w: %w", ErrNoRoom, err)
		}
		return nil, fmt.Errorf("fill %s in %s: %w", e.SourcePath, c.t.Path, err)
	}
	f.Checksum, f.HasChecksum = crc, true
	return f, nil
}

// fdWriter writes to a file descriptor (io.Writer), all of each buffer.
type fdWriter int

func (w fdWriter) Write(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		k, err := unix.Write(int(w), p[n:])
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return n, err
		}
		n += k
	}
	return n, nil
}

// removeFill removes the fill file rel if it is still the file with inode ino.
func (t *Tier) removeFill(rel string, ino uint64) {
	t.inFillBin(rel, func(binfd int, name string, st *unix.Stat_t) {
		if st.Ino == ino {
			unix.Unlinkat(binfd, name, 0)
		}
	})
}

// inFillBin calls fn with the bin of the fill file rel, the file's name there and its
// status, if it exists.
func (t *Tier) inFillBin(rel string, fn func(binfd int, name string, st *unix.Stat_t)) {
	withFd(t.dirFile, func(dirfd int) error {
		binfd, name, err := openBin(dirfd, rel, false)
		if err != nil {
			return err
		}
		defer unix.Close(binfd)
		var st unix.Stat_t
		if err := unix.Fstatat(binfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		fn(binfd, name, &st)
		return nil
	})
}

// ClaimState is what ClaimStateOf finds of a file's claim.
type ClaimState int

// The states of a claim.
const (
	Unclaimed ClaimState = iota // no fill file
	Held                        // a live process locks it: it is reading the source or writing the copy
	Left                        // nobody locks it: reported (waiting to be recorded), or abandoned
)

// ClaimStateOf returns the state of the claim of the file at sourcePath, and how long ago its
// fill file was last modified: a reader that has written its copy gives it the source's
// modification time (capi/fill.c fc_fill_finish), so only the state tells a live claim.
func (t *Tier) ClaimStateOf(sourcePath string) (state ClaimState, idle time.Duration) {
	t.inFillBin(FillName(sourcePath), func(binfd int, name string, st *unix.Stat_t) {
		state, idle = Left, time.Since(time.Unix(st.Mtim.Unix()))
		if locked(binfd, name) {
			state = Held
		}
	})
	return state, idle
}

// locked reports whether a process holds a lock on the file name in the directory binfd.
func locked(binfd int, name string) bool {
	fd, err := unix.Openat(binfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart}
	return unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &lk) == nil && lk.Type != unix.F_UNLCK
}

// TakeAbandonedClaim removes the claim of the file at sourcePath unless a process locks its
// fill file, and reports whether it did. The caller has seen it unlocked and not reported
// for AbandonedAfter: its reader died.
func (t *Tier) TakeAbandonedClaim(sourcePath string) bool {
	taken := false
	t.inFillBin(FillName(sourcePath), func(binfd int, name string, _ *unix.Stat_t) {
		if !locked(binfd, name) {
			taken = unix.Unlinkat(binfd, name, 0) == nil
		}
	})
	if taken {
		t.log.Warn("took over a claim its reader left", "file", sourcePath)
	}
	return taken
}

// FullMarkName returns the name, in a tier directory, of the mark that says the tiers have no
// room left for the dataset at root (MarkFull): ".full-" and the key of the root in 16 hex
// digits (capi/miss.c makes the same).
func FullMarkName(root string) string { return fmt.Sprintf(".full-%016x", uint64(KeyOf(root))) }

// MarkFull marks, for the readers of the dataset at root, that the tiers have no room left
// for another of its files: readers then stop filling its misses for a while (they read them
// from the source and keep them), rather than write copies the server does not record. The
// mark's modification time is when the tiers were last found full.
func (t *Tier) MarkFull(root string) {
	withFd(t.dirFile, func(dirfd int) error {
		fd, err := unix.Openat(dirfd, FullMarkName(root), unix.O_WRONLY|unix.O_CREAT|unix.O_NOFOLLOW|unix.O_CLOEXEC, entryMode)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return unix.Futimes(fd, nil) // now
	})
}

// ErrBadFill reports a reader's fill that does not hold what its record says.
var ErrBadFill = errors.New("the reader's copy does not match its record")

// A Fill is a reader's fill file, found and checked by OpenFill, for Adopt. It is not safe
// for concurrent use.
type Fill struct {
	binfd   int         // the fill file's bin, open until Close
	name    string      // the fill file's name in it
	st      unix.Stat_t // the fill file's status as OpenFill found it
	fd      int         // the fill file, opened for reading only where needed (open), or -1
	adopted bool        // Adopt published it and ended its claim
	// reserved is the room of the tier that Claim.Fill reserved for the copy, which Adopt
	// takes over: it is 0 for a reader's fill, which Adopt reserves for.
	reserved int64
	// own says that this process made the fill file (Claim) and holds it open: nobody takes
	// its name over (only the server takes a claim over, in a fill of the file, and it runs
	// one fill of a file at a time), so Adopt does not look whether the name is still the
	// file's.
	own bool

	// Checksum is the CRC-32C of the bytes the reader wrote into the fill file, as it
	// computed them while writing them, when HasChecksum: Adopt records it as the copy's
	// checksum instead of reading the copy. A wrong one is a copy that fails its check
	// (Verify) and is removed, as one whose bytes changed: the reader runs as this user,
	// who could write any bytes into the copy as well.
	Checksum    uint32
	HasChecksum bool
}

// OpenFill finds the fill file that a reader wrote for the file at sourcePath, and checks it
// against what the reader says it wrote: its inode ino, size bytes, a regular file of this
// user with one name (not a link to one). The file is opened only if it must be read (a
// report without a checksum, a copy placed in another tier). The caller closes the Fill, and
// removes the fill file with RemoveFill unless Adopt published it (Adopted).
func (t *Tier) OpenFill(sourcePath string, ino uint64, size int64) (*Fill, error) {
	f := &Fill{binfd: -1, fd: -1}
	err := withFd(t.dirFile, func(dirfd int) (err error) {
		f.binfd, f.name, err = openBin(dirfd, FillName(sourcePath), false)
		return err
	})
	if err != nil {
		return nil, err
	}
	st := &f.st
	if err := unix.Fstatat(f.binfd, f.name, st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		f.Close()
		return nil, err
	}
	if st.Ino != ino || st.Size != size || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink != 1 || int(st.Uid) != euid {
		f.Close()
		return nil, fmt.Errorf("%w: %s (inode %d, %d bytes, mode %o, %d links, uid %d; said inode %d, %d bytes)",
			ErrBadFill, sourcePath, st.Ino, st.Size, st.Mode, st.Nlink, st.Uid, ino, size)
	}
	return f, nil
}

// open opens the fill file for reading, once, and checks that it is the file OpenFill found.
func (f *Fill) open() error {
	if f.fd >= 0 {
		return nil
	}
	fd, err := unix.Openat(f.binfd, f.name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Ino != f.st.Ino || st.Size != f.st.Size {
		unix.Close(fd)
		return fmt.Errorf("%w: %s was replaced", ErrBadFill, f.name)
	}
	f.fd = fd
	return nil
}

// ReadAt reads the fill file's bytes at off (io.ReaderAt).
func (f *Fill) ReadAt(p []byte, off int64) (int, error) {
	if err := f.open(); err != nil {
		return 0, err
	}
	n := 0
	for n < len(p) {
		k, err := unix.Pread(f.fd, p[n:], off+int64(n))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return n, err
		}
		if k == 0 {
			return n, io.EOF
		}
		n += k
	}
	return n, nil
}

// Close closes what the Fill holds open; it is idempotent.
func (f *Fill) Close() error {
	var err error
	if f.fd >= 0 {
		err = unix.Close(f.fd)
	}
	if f.binfd >= 0 {
		unix.Close(f.binfd)
	}
	f.fd, f.binfd = -1, -1
	return err
}

// Adopted reports whether Adopt published the fill file and ended its claim: there is
// nothing left to remove.
func (f *Fill) Adopted() bool { return f.adopted }

// RemoveFill removes the fill file of the file at sourcePath if it is the file with inode ino.
func (t *Tier) RemoveFill(sourcePath string, ino uint64) { t.removeFill(FillName(sourcePath), ino) }

// Adopt publishes a reader's fill file f (see OpenFill), of this tier, as the cached copy of
// e.SourcePath: the copy's checksum is the one its reader reported (f.HasChecksum), else
// read from it; its times and mode are set as Publish sets them, unless its reader set them
// already (OpenFill's look shows them); it is linked into place, in the bin OpenFill opened
// (FillName and RelPath share it), and recorded. The fill file keeps its name, and so the
// file stays claimed, until the index lists the copy: a process that claims it next finds
// it cached. Then Adopt removes that name, ending the claim (Adopted); on failure the
// caller removes the fill file (RemoveFill). It returns ErrNoRoom as Publish does.
func (t *Tier) Adopt(e Entry, f *Fill) error {
	reserved := f.reserved
	f.reserved = 0 // publishWith takes it over, used or given back
	err := t.publishWith(e, reserved, func(_ int, rel string, s stored) (stored, error) {
		var err error
		if s.Checksum = f.Checksum; !f.HasChecksum {
			if s.Checksum, err = checksumOf(f, e.Size); err != nil {
				return s, err
			}
		}
		if s.ino = f.st.Ino; !finished(&f.st, s.MTimeNanos, s.Mode) {
			if err := f.open(); err != nil {
				return s, err
			}
			if _, err := finishData(f.fd, s.MTimeNanos, s.Mode); err != nil {
				return s, err
			}
		}
		binfd, name := f.binfd, rel[strings.LastIndexByte(rel, '/')+1:]
		if f.fd >= 0 && !f.own {
			// Read or changed through a descriptor: the name must still be that file's (it
			// was when OpenFill looked, which is all a copy not opened needs).
			var st unix.Stat_t
			if err := unix.Fstatat(binfd, f.name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Ino != s.ino {
				return s, fmt.Errorf("%w: %s was taken over", ErrBadFill, e.SourcePath)
			}
		}
		// Linked into place; over an older copy, linked under a temporary name and renamed,
		// as write does.
		if err := unix.Linkat(binfd, f.name, binfd, name, 0); errors.Is(err, unix.EEXIST) {
			tmp := fmt.Sprintf("%s%016x", tempPrefix, rand.Uint64())
			if err := unix.Linkat(binfd, f.name, binfd, tmp, 0); err != nil {
				return s, err
			}
			if err := unix.Renameat(binfd, tmp, binfd, name); err != nil {
				unix.Unlinkat(binfd, tmp, 0)
				return s, err
			}
		} else if err != nil {
			return s, err
		}
		return s, writeRecord(binfd, name, s)
	})
	if err != nil {
		return err
	}
	// Listed: the claim ends, if the name is still the fill's.
	var st unix.Stat_t
	if f.own || unix.Fstatat(f.binfd, f.name, &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Ino == f.st.Ino {
		unix.Unlinkat(f.binfd, f.name, 0)
	}
	f.adopted = true
	return nil
}

// PublishFill publishes a reader's fill file f of another tier (see OpenFill) as the cached
// copy of e.SourcePath in this one, as PublishFrom does: copied. A copy whose bytes do not
// have the checksum its reader reported (f.HasChecksum) is not published: ErrBadFill.
func (t *Tier) PublishFill(e Entry, f *Fill) error {
	return t.publish(e, func(w io.Writer) (uint32, error) {
		crc, err := copyExactly(w, io.NewSectionReader(f, 0, e.Size+1), e.Size)
		if err == nil && f.HasChecksum && crc != f.Checksum {
			return 0, fmt.Errorf("%w: %s: its bytes' checksum is %08x, its reader's %08x", ErrBadFill, e.SourcePath, crc, f.Checksum)
		}
		return crc, err
	})
}

// checksumOf returns the CRC-32C of the n bytes of f, which must hold exactly n.
func checksumOf(f *Fill, n int64) (uint32, error) {
	return copyExactly(io.Discard, io.NewSectionReader(f, 0, n+1), n)
}
