package tiers

import (
	"fmt"
	"hash/fnv"
	"path/filepath"
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
func safeName(name string) string {
	name = strings.TrimLeft(name, ".")
	if len(name) > maxNameBytes {
		name = name[:maxNameBytes]
	}
	return name
}

// tempPrefix starts the name of every file being written; a rescan deletes such leftovers.
const tempPrefix = ".tmp-"

func isTempName(name string) bool { return strings.HasPrefix(name, tempPrefix) }

// recordPrefix starts the name of an entry's record, beside its data file in the same bin:
// ".rec-" + the data file's name. Data file names never start with a dot (see safeName).
const recordPrefix = ".rec-"

func isRecordName(name string) bool { return strings.HasPrefix(name, recordPrefix) }
