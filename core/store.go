package core

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/tiers"
)

// StoreRequest is a replica copy of a file that a client read from the file's owner (see
// Engine.Store), with what the owner said of it.
type StoreRequest struct {
	Root, Path string
	Data       []byte
	// MTimeNanos is the source's modification time as the owner saw it.
	MTimeNanos int64
	// CTimeNanos and Ino are the source's change time and inode number as the owner saw them
	// (when it read the source, or made the copy it served from a tier); 0 where unknown.
	CTimeNanos int64
	Ino        uint64
	// Checksum is the CRC-32C of the data, as the owner recorded it.
	Checksum uint32
}

// Store caches a file's bytes that a client read from the file's owner, so that this server,
// a replica, holds a copy without reading the source. A copy is kept only if its bytes match
// their checksum (else ErrBadCopy) and the source, as this server's own stat sees it, is the
// version the owner read: same size and modification time, and same change time and inode
// number where the owner gave them (else ErrChanged). The source is looked up beneath the
// dataset root and must be a regular file this server may read; it is not opened for reading
// (the source is read once per file, by its owner). Refusals are counted
// (StatsSnapshot.StoreRefused). A file already cached or on its way is left alone.
func (e *Engine) Store(req StoreRequest) error {
	if e.closed.Load() {
		return ErrClosed
	}
	if err := e.checkRoot(req.Root, req.Path); err != nil {
		return err
	}
	if m, err := tiers.Probe(e.tiers, req.Path); err == nil {
		m.Release()
		return nil
	}
	session := e.sessions.current() // before the look at the source, as for a source read
	st, err := e.checkCopy(req)
	if err != nil {
		return e.RefuseStore(err)
	}
	f, leader := e.join(req.Path)
	if !leader {
		return nil
	}
	f.data, f.mtime, f.ctime, f.ino = req.Data, req.MTimeNanos, req.CTimeNanos, req.Ino
	close(f.done)
	e.stats.stored.Add(1)
	id := identityOf(st)
	e.mover.enqueue(job{entry: tiers.Entry{SourcePath: req.Path, Size: int64(len(req.Data)), MTimeNanos: req.MTimeNanos,
		SourceCTimeNanos: id.CTimeNanos, SourceIno: id.Ino, Session: session, Group: req.Root,
		Mode: fs.FileMode(st.Mode).Perm()}, flight: f})
	return nil
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// checkCopy checks a replica copy against its checksum and against this server's own look at
// the source (see Store), and returns that look: the copy records the source's identity and
// permission bits from it.
func (e *Engine) checkCopy(req StoreRequest) (*unix.Stat_t, error) {
	if got := crc32.Checksum(req.Data, castagnoli); got != req.Checksum {
		return nil, fmt.Errorf("%w: %s: checksum %08x of the bytes sent, %08x stamped", ErrBadCopy, req.Path, got, req.Checksum)
	}
	realRoot, err := e.realRoot(req.Root)
	if err != nil {
		return nil, err
	}
	st, err := statBeneath(req.Root, realRoot, req.Path)
	if err != nil {
		return nil, err
	}
	var what string
	switch {
	case st.Size != int64(len(req.Data)):
		what = fmt.Sprintf("%d bytes, the copy %d", st.Size, len(req.Data))
	case st.Mtim.Nano() != req.MTimeNanos:
		what = fmt.Sprintf("modification time %d, the copy's %d", st.Mtim.Nano(), req.MTimeNanos)
	case req.CTimeNanos != 0 && st.Ctim.Nano() != req.CTimeNanos:
		what = fmt.Sprintf("change time %d, the copy's %d", st.Ctim.Nano(), req.CTimeNanos)
	case req.Ino != 0 && st.Ino != req.Ino:
		what = fmt.Sprintf("inode %d, the copy's %d", st.Ino, req.Ino)
	default:
		return st, nil
	}
	return nil, fmt.Errorf("%w: the replica copy of %s is not of the source's version: the source has %s", ErrChanged, req.Path, what)
}

// RefuseStore counts a replica copy refused (see Store), also one refused before it reached
// the engine (a copy without its owner's stamp), and returns err.
func (e *Engine) RefuseStore(err error) error {
	e.stats.storeRefused.Add(1)
	e.log.Debug("replica copy refused", "err", err)
	return err
}

// statBeneath returns the status of the source file at path, which lies lexically under root,
// whose symbolic links resolve to realRoot, without opening it for reading (see lookSource).
// It must be a regular file that this process may read.
func statBeneath(root, realRoot, path string) (*unix.Stat_t, error) {
	f, err := lookSource(root, realRoot, path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, pathError("stat", path, err)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
	case unix.S_IFDIR:
		return nil, pathError("read", path, unix.EISDIR)
	default:
		return nil, pathError("read", path, unix.EINVAL)
	}
	// May this process read it? (AT_EMPTY_PATH needs Linux 5.8: before, the check is skipped.)
	if err := unix.Faccessat2(int(f.Fd()), "", unix.R_OK, unix.AT_EMPTY_PATH|unix.AT_EACCESS); err != nil &&
		!errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
		return nil, pathError("read", path, err)
	}
	return &st, nil
}
