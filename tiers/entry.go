package tiers

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// A cached file is the source file's bytes followed by a trailer:
//
//	data        [size]byte   the source file's bytes, at offset 0 so they map page-aligned
//	path        [n]byte      the cleaned source path
//	n           uint32       length of path
//	size        uint64       length of data
//	mtime       int64        the source file's modification time, Unix nanoseconds
//	checksum    uint32       CRC-32C of data
//	crc         uint32       CRC-32C of path, n, size, mtime and checksum
//	version     uint32       trailerVersion
//	magic       [8]byte      "FCENTRY\x01"
//
// All integers are little-endian. The trailer sits at the end so that a truncated file loses
// its magic and is recognised as damaged. Version 1 had no checksum; its entries are misses
// (a rescan removes them). The version always sits just before the magic.

const (
	trailerVersion   = 2
	trailerFixedSize = 4 + 8 + 8 + 4 + 4 + 4 + 8
	trailerMagic     = "FCENTRY\x01"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Entry describes a cached file as recorded in its trailer.
type Entry struct {
	SourcePath string
	Size       int64
	MTimeNanos int64
	// Checksum is the CRC-32C (Castagnoli) of the data. Publish and PublishFrom compute it;
	// a value the caller sets is ignored. A rescan with Config.Verify checks it.
	Checksum uint32
}

// errDamaged reports a cached file whose trailer is missing, inconsistent or for another path.
var errDamaged = errors.New("damaged cache entry")

// errOldVersion reports an entry written with another trailer version: a miss, removed by a
// rescan.
var errOldVersion = fmt.Errorf("%w: written by another version of FitCache", errDamaged)

// errChecksum reports an entry whose data no longer matches the checksum of its trailer.
var errChecksum = fmt.Errorf("%w: data does not match its checksum", errDamaged)

// appendTrailer appends e's trailer to b.
func appendTrailer(b []byte, e Entry) []byte {
	start := len(b)
	b = append(b, e.SourcePath...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(e.SourcePath)))
	b = binary.LittleEndian.AppendUint64(b, uint64(e.Size))
	b = binary.LittleEndian.AppendUint64(b, uint64(e.MTimeNanos))
	b = binary.LittleEndian.AppendUint32(b, e.Checksum)
	b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(b[start:], castagnoli))
	b = binary.LittleEndian.AppendUint32(b, trailerVersion)
	return append(b, trailerMagic...)
}

// trailerSize is the number of bytes appendTrailer adds for a source path.
func trailerSize(sourcePath string) int64 { return int64(len(sourcePath)) + trailerFixedSize }

// parseTrailer reads the trailer at the end of a whole cached file and checks that it is
// consistent with the file's length. It copies the path out, so the result outlives file.
func parseTrailer(file []byte) (Entry, error) {
	n := len(file)
	le := binary.LittleEndian
	if n < 12 || string(file[n-8:]) != trailerMagic {
		return Entry{}, errDamaged
	}
	if le.Uint32(file[n-12:n-8]) != trailerVersion {
		return Entry{}, errOldVersion
	}
	if n < trailerFixedSize {
		return Entry{}, errDamaged
	}
	fixed := file[n-trailerFixedSize:]
	pathLen := int(le.Uint32(fixed[0:4]))
	size := int64(le.Uint64(fixed[4:12]))
	mtime := int64(le.Uint64(fixed[12:20]))
	checksum := le.Uint32(fixed[20:24])
	crc := le.Uint32(fixed[24:28])
	if pathLen > n-trailerFixedSize || size < 0 || size != int64(n-trailerFixedSize-pathLen) {
		return Entry{}, errDamaged
	}
	covered := file[n-trailerFixedSize-pathLen : n-trailerFixedSize+24]
	if crc32.Checksum(covered, castagnoli) != crc {
		return Entry{}, errDamaged
	}
	path := string(file[n-trailerFixedSize-pathLen : n-trailerFixedSize])
	return Entry{SourcePath: path, Size: size, MTimeNanos: mtime, Checksum: checksum}, nil
}

// checkData reports errChecksum if the data of a whole cached file, whose trailer parsed as
// e, does not match e.Checksum.
func checkData(file []byte, e Entry) error {
	if crc32.Checksum(file[:e.Size], castagnoli) != e.Checksum {
		return errChecksum
	}
	return nil
}

// crc32c returns the CRC-32C of b, the checksum an entry records for its data.
func crc32c(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }
