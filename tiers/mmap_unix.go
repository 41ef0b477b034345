//go:build unix

package tiers

import (
	"os"

	"github.com/edsrzf/mmap-go"
)

// mapFile maps the whole of f read-only and shared: pages come straight from the page cache
// (or tmpfs), with no copy. The mapping outlives f.
func mapFile(f *os.File) (mmap.MMap, error) {
	return mmap.Map(f, mmap.RDONLY, 0)
}
