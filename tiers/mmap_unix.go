//go:build unix

package tiers

import (
	"os"
	"syscall"

	"github.com/edsrzf/mmap-go"
)

// mapFile maps the whole of f read-only and shared: pages come straight from the page cache
// (or tmpfs), with no copy. The mapping outlives f.
func mapFile(f *os.File) (mmap.MMap, error) {
	return mmap.Map(f, mmap.RDONLY, 0)
}

// mapFirst maps the first n bytes of f as mapFile maps it all, for a caller that has just
// checked f's size (mapFile learns it with an fstat of its own).
func mapFirst(f *os.File, n int64) (mmap.MMap, error) {
	return mmap.MapRegion(f, int(n), mmap.RDONLY, 0, 0)
}

// statFile returns the inode number and size of the file at path (of a link itself, not
// of what it points to).
func statFile(path string) (ino uint64, size int64, err error) {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return 0, 0, err
	}
	return st.Ino, st.Size, nil
}
