package tiers

import (
	"encoding/binary"
	"errors"
	"hash/crc32"
)

// A cached file is the source file's bytes followed by a trailer:
//
//	data        [size]byte   the source file's bytes, at offset 0 so they map page-aligned
//	path        [n]byte      the cleaned source path
//	n           uint32       length of path
//	size        uint64       length of data
//	mtime       int64        the source file's modification time, Unix nanoseconds
//	crc         uint32       CRC-32C of path, n, size and mtime
//	version     uint32       trailerVersion
//	magic       [8]byte      "FCENTRY\x01"
//
// All integers are little-endian. The trailer sits at the end so that a truncated file loses
// its magic and is recognised as damaged.

const (
	trailerVersion   = 1
	trailerFixedSize = 4 + 8 + 8 + 4 + 4 + 8
	trailerMagic     = "FCENTRY\x01"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Entry describes a cached file as recorded in its trailer.
type Entry struct {
	SourcePath string
	Size       int64
	MTimeNanos int64
}

// errDamaged reports a cached file whose trailer is missing, inconsistent or for another path.
var errDamaged = errors.New("damaged cache entry")

// appendTrailer appends e's trailer to b.
func appendTrailer(b []byte, e Entry) []byte {
	start := len(b)
	b = append(b, e.SourcePath...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(e.SourcePath)))
	b = binary.LittleEndian.AppendUint64(b, uint64(e.Size))
	b = binary.LittleEndian.AppendUint64(b, uint64(e.MTimeNanos))
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
	if n < trailerFixedSize || string(file[n-8:]) != trailerMagic {
		return Entry{}, errDamaged
	}
	fixed := file[n-trailerFixedSize:]
	le := binary.LittleEndian
	pathLen := int(le.Uint32(fixed[0:4]))
	size := int64(le.Uint64(fixed[4:12]))
	mtime := int64(le.Uint64(fixed[12:20]))
	crc := le.Uint32(fixed[20:24])
	version := le.Uint32(fixed[24:28])
	if version != trailerVersion || pathLen > n-trailerFixedSize || size < 0 ||
		size != int64(n-trailerFixedSize-pathLen) {
		return Entry{}, errDamaged
	}
	covered := file[n-trailerFixedSize-pathLen : n-trailerFixedSize+20]
	if crc32.Checksum(covered, castagnoli) != crc {
		return Entry{}, errDamaged
	}
	path := string(file[n-trailerFixedSize-pathLen : n-trailerFixedSize])
	return Entry{SourcePath: path, Size: size, MTimeNanos: mtime}, nil
}
