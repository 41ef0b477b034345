package tiers

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"

	"golang.org/x/sys/unix"
)

// A cached file holds exactly the source file's bytes: same size, end of file at the same
// place, so that its descriptor can be handed to any program. What FitCache knows about it
// lives beside it, in two places:
//
//   - the record, a small file named recordPrefix + the data file's name in the same bin,
//     holds the full entry: source path, the identity of the source version it copies
//     (size, modification and change times, inode number: see Identity), data checksum, the
//     inode of the data file it describes and the publication sequence number. A rescan reads the
//     records to restore usage and FIFO order, and to know which source a file holds.
//   - the tier's index (index.go) repeats what a reader checks on every hit, in a table that
//     readers map: no file is read besides the data.
//
// Record layout (all integers little-endian):
//
//	magic       [8]byte   "FCRECORD"
//	version     uint32    recordVersion
//	n           uint32    length of path
//	path        [n]byte   the cleaned source path
//	g           uint32    length of group
//	group       [g]byte   Entry.Group
//	size        uint64    length of the data
//	mtime       int64     the source file's modification time, Unix nanoseconds
//	ctime       int64     the source file's change time, Unix nanoseconds (0: unknown)
//	srcIno      uint64    the source file's inode number (0: unknown)
//	ino         uint64    inode number of the data file
//	seq         uint64    publication sequence number of the tier (FIFO order)
//	checksum    uint32    CRC-32C of the data
//	crc         uint32    CRC-32C of every byte above
//
// A record describes one data file only: its inode number must match, so a record left
// from an older copy of the same source (a crash between the two renames of publication)
// is never taken for the new one.
//
// The preload shim reads records too (preload/copies.c: fstat of a cached copy reports the
// source's inode and change time, from the index for a copy the shim opened, from the record
// for another descriptor of one); it leaves a record of another version alone.

const (
	recordVersion = 4
	recordMagic   = "FCRECORD"
	// recordFixed is the size of a record without its path and group.
	recordFixed = 8 + 4 + 4 + 4 + 8 + 8 + 8 + 8 + 8 + 8 + 4 + 4
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Entry describes a cached file.
type Entry struct {
	SourcePath string
	Size       int64
	MTimeNanos int64
	// SourceCTimeNanos and SourceIno complete the identity of the source version the copy
	// holds (see Identity); 0 where unknown (a replica's copy sent by another server).
	SourceCTimeNanos int64
	SourceIno        uint64
	// Session is the validation session in which the source was read (see Tier.Validate):
	// readers of that session and earlier ones serve the copy without asking the server.
	// It is not recorded: a rescan marks every copy unchecked.
	Session uint32
	// Checksum is the CRC-32C (Castagnoli) of the data. Publish and PublishFrom compute it;
	// a value the caller sets is ignored. A rescan with Config.Verify checks it.
	Checksum uint32
	// Group is the dataset root the file was read for: making room for a file never evicts
	// files of its own group (see Tier.MakeRoom).
	Group string
	// Mode holds the source's permission bits, given to the cached copy (with read
	// permission for its owner added), so that fstat of a cached copy a reader was handed
	// in place of the source (the preload shim) shows the source's mode. 0 means 0600. It is
	// not recorded: a rescan keeps what the data file has.
	Mode fs.FileMode
}

// Identity identifies one version of a source file: a cached copy is served only while its
// source still has the identity the copy was made from (see Tier.Validate). The device is
// left out on purpose: a parallel file system mounted anew may give another one.
type Identity struct {
	Size       int64
	MTimeNanos int64
	CTimeNanos int64 // 0 where unknown
	Ino        uint64
}

// Identity returns the identity of the source version e copies.
func (e Entry) Identity() Identity {
	return Identity{Size: e.Size, MTimeNanos: e.MTimeNanos, CTimeNanos: e.SourceCTimeNanos, Ino: e.SourceIno}
}

// matches reports whether a copy made from version id may serve the source whose identity is
// now cur. Fields the copy did not record (0: a replica's copy) are not compared.
func (id Identity) matches(cur Identity) bool {
	return id.Size == cur.Size && id.MTimeNanos == cur.MTimeNanos &&
		(id.CTimeNanos == 0 || id.CTimeNanos == cur.CTimeNanos) && (id.Ino == 0 || id.Ino == cur.Ino)
}

// stored is an Entry as a tier recorded it.
type stored struct {
	Entry
	ino uint64 // inode number of the data file
	seq uint64 // publication sequence number
}

// errDamaged reports a cached file whose record is missing, inconsistent or for another file.
var errDamaged = errors.New("damaged cache entry")

// errChecksum reports an entry whose data no longer matches the checksum of its record.
var errChecksum = fmt.Errorf("%w: data does not match its checksum", errDamaged)

// appendRecord appends the record of s to b.
func appendRecord(b []byte, s stored) []byte {
	start := len(b)
	le := binary.LittleEndian
	b = append(b, recordMagic...)
	b = le.AppendUint32(b, recordVersion)
	b = le.AppendUint32(b, uint32(len(s.SourcePath)))
	b = append(b, s.SourcePath...)
	b = le.AppendUint32(b, uint32(len(s.Group)))
	b = append(b, s.Group...)
	b = le.AppendUint64(b, uint64(s.Size))
	b = le.AppendUint64(b, uint64(s.MTimeNanos))
	b = le.AppendUint64(b, uint64(s.SourceCTimeNanos))
	b = le.AppendUint64(b, s.SourceIno)
	b = le.AppendUint64(b, s.ino)
	b = le.AppendUint64(b, s.seq)
	b = le.AppendUint32(b, s.Checksum)
	return le.AppendUint32(b, crc32.Checksum(b[start:], castagnoli))
}

// recordSize is the number of bytes appendRecord writes for an entry.
func recordSize(e Entry) int64 { return int64(len(e.SourcePath)+len(e.Group)) + recordFixed }

// maxRecordBytes bounds the record a scan reads: a path and a group are at most PATH_MAX
// (4096) bytes each.
const maxRecordBytes = 2*4096 + recordFixed

// parseRecord reads a whole record file. It copies the path out, so the result outlives b.
func parseRecord(b []byte) (stored, error) {
	le := binary.LittleEndian
	if len(b) < recordFixed || string(b[:8]) != recordMagic {
		return stored{}, fmt.Errorf("%w: no record", errDamaged)
	}
	if v := le.Uint32(b[8:12]); v != recordVersion {
		return stored{}, fmt.Errorf("%w: record version %d, want %d", errDamaged, v, recordVersion)
	}
	n := int(le.Uint32(b[12:16]))
	if n > len(b)-recordFixed {
		return stored{}, fmt.Errorf("%w: record of %d bytes for a path of %d", errDamaged, len(b), n)
	}
	g := int(le.Uint32(b[16+n : 20+n]))
	if n+g != len(b)-recordFixed {
		return stored{}, fmt.Errorf("%w: record of %d bytes for a path of %d and a group of %d", errDamaged, len(b), n, g)
	}
	if crc32.Checksum(b[:len(b)-4], castagnoli) != le.Uint32(b[len(b)-4:]) {
		return stored{}, fmt.Errorf("%w: record checksum", errDamaged)
	}
	p := b[20+n+g:]
	s := stored{
		Entry: Entry{SourcePath: string(b[16 : 16+n]), Group: string(b[20+n : 20+n+g]), Size: int64(le.Uint64(p[0:8])),
			MTimeNanos: int64(le.Uint64(p[8:16])), SourceCTimeNanos: int64(le.Uint64(p[16:24])),
			SourceIno: le.Uint64(p[24:32]), Checksum: le.Uint32(p[48:52])},
		ino: le.Uint64(p[32:40]), seq: le.Uint64(p[40:48]),
	}
	if s.Size < 0 {
		return stored{}, fmt.Errorf("%w: negative size", errDamaged)
	}
	return s, nil
}

// crc32c returns the CRC-32C of b, the checksum an entry records for its data.
func crc32c(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// readRecord reads and parses the record of the data file name in the bin binfd, following
// no link; the file must be a regular file of this user.
func readRecord(binfd int, name string) (stored, error) {
	fd, err := unix.Openat(binfd, recordPrefix+name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return stored{}, fmt.Errorf("%w: record: %w", errDamaged, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return stored{}, fmt.Errorf("%w: record: %w", errDamaged, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != euid || st.Size > maxRecordBytes {
		return stored{}, fmt.Errorf("%w: record is not a regular file of this user, or too large", errDamaged)
	}
	b := make([]byte, st.Size)
	if n, err := unix.Pread(fd, b, 0); err != nil || n != len(b) {
		return stored{}, fmt.Errorf("%w: record: short read (%v)", errDamaged, err)
	}
	return parseRecord(b)
}
