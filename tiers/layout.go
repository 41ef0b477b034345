package tiers

import (
	"fmt"
	"hash/fnv"
	"path/filepath"
	"strconv"
	"strings"
)

// Key is the 64-bit FNV-1a hash of a cleaned source path. It names a cached file and, through
// its two low bytes, the two hash-bin directories that hold it.
type Key uint64

// KeyOf returns the key of a source path; the path is cleaned first, so "a//b/../c" and "a/c"
// share a key.
func KeyOf(sourcePath string) Key {
	h := fnv.New64a()
	h.Write([]byte(filepath.Clean(sourcePath)))
	return Key(h.Sum64())
}

// BlockName names block n of a large file cached in blocks of blockBytes (see
// core.Engine.ReadBlock): the cleaned source path, a NUL byte, the block size and n in
// decimal, "path\x00<blockBytes>:<n>". Every part of a tier treats it as the source path of
// an entry of its own (key, index slot, record, FIFO order, eviction); no real path has a NUL
// byte (core.CheckPath refuses one), so it never names a whole file. The block size is part
// of the name so that a server started with another block_size never takes a block of the
// old layout for one of the new. The data file's name shows it as "<base name>#<bb>:<n>"
// (see RelPath).
func BlockName(sourcePath string, blockBytes, n int64) string {
	return filepath.Clean(sourcePath) + "\x00" + strconv.FormatInt(blockBytes, 10) + ":" + strconv.FormatInt(n, 10)
}

// SplitBlockName returns the source path, block size and block number of a name made by
// BlockName, and ok false for a source path.
func SplitBlockName(name string) (sourcePath string, blockBytes, n int64, ok bool) {
	i := strings.IndexByte(name, 0)
	if i < 0 {
		return name, 0, 0, false
	}
	size, number, found := strings.Cut(name[i+1:], ":")
	blockBytes, err1 := strconv.ParseInt(size, 10, 64)
	n, err2 := strconv.ParseInt(number, 10, 64)
	return name[:i], blockBytes, n, found && err1 == nil && err2 == nil && blockBytes > 0 && n >= 0
}

// maxNameBytes bounds the base-name part of a cached file name, well inside NAME_MAX (255).
const maxNameBytes = 120

// RelPath returns the path of a source file's cached copy relative to a tier directory:
// "ab/cd/<key as 16 hex digits>-<base name>", where ab is the key's lowest byte and cd the next.
// The base name only helps people reading the directory; the key and the entry trailer decide.
func RelPath(sourcePath string) string {
	k := KeyOf(sourcePath)
	return fmt.Sprintf("%02x/%02x/%016x-%s", byte(k), byte(k>>8), uint64(k), safeName(filepath.Base(sourcePath)))
}

// safeName keeps a base name readable while making sure it cannot be mistaken for a temporary
// file or exceed maxNameBytes.
// A block's NUL byte (see BlockName) becomes '#', which file names may hold.
func safeName(name string) string {
	name = strings.TrimLeft(name, ".")
	if len(name) > maxNameBytes {
		name = name[:maxNameBytes]
	}
	return strings.ReplaceAll(name, "\x00", "#")
}

// tempPrefix starts the name of every file being written; a rescan deletes such leftovers.
const tempPrefix = ".tmp-"

func isTempName(name string) bool { return strings.HasPrefix(name, tempPrefix) }

// recordPrefix starts the name of an entry's record, beside its data file in the same bin:
// ".rec-" + the data file's name. Data file names never start with a dot (see safeName).
const recordPrefix = ".rec-"

func isRecordName(name string) bool { return strings.HasPrefix(name, recordPrefix) }
