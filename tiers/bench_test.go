package tiers

import (
	"fmt"
	"os"
	"testing"
)

// BenchmarkOpen maps a cached file and touches one byte per page, then unmaps it: the cost
// of a read that does not reuse a mapping, through a Dir opened by path each time and through
// one held open (OpenDir), as readers use it.
func BenchmarkOpen(b *testing.B) {
	for _, size := range []int{256 << 10, 8 << 20} {
		for _, held := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/held=%v", FormatBytes(int64(size)), held), func(b *testing.B) {
				tier, err := New(Config{Dir: b.TempDir(), Kind: Memory, Budget: "64MiB"}, nil)
				if err != nil {
					b.Fatal(err)
				}
				src := fmt.Sprintf("/bench/%d", size)
				if err := tier.Publish(Entry{SourcePath: src, Size: int64(size)}, make([]byte, size)); err != nil {
					b.Fatal(err)
				}
				dir := tier.Dir
				if held {
					if dir, err = OpenDir(tier.Path, Memory); err != nil {
						b.Fatal(err)
					}
					defer dir.Close()
				}
				b.ReportAllocs()
				b.SetBytes(int64(size))
				for b.Loop() {
					m, err := dir.Open(src)
					if err != nil {
						b.Fatal(err)
					}
					data := m.Bytes()
					for i := 0; i < len(data); i += 4096 {
						_ = data[i]
					}
					m.Release()
				}
			})
		}
	}
}

// BenchmarkIndexGrowth measures how long growing the index holds the tier's lock (publishing
// waits meanwhile), from an index of n entries in n buckets to one of twice the buckets,
// with the new file made ahead (as once a bucket is full) or made then (a growth that comes
// before that file is ready). Run it with -benchtime 3x: each growth
// starts from a tier filled anew (a million buckets take 640 MiB of /dev/shm, removed after).
func BenchmarkIndexGrowth(b *testing.B) {
	for _, n := range []int{16384, 131072, 524288} {
		for _, ahead := range []bool{true, false} {
			b.Run(fmt.Sprintf("entries=%d/made-ahead=%v", n, ahead), func(b *testing.B) {
				for b.Loop() {
					b.StopTimer()
					tier := indexOfEntries(b, n, ahead)
					b.StartTimer()
					tier.mu.Lock()
					err := tier.growIndex()
					tier.mu.Unlock()
					b.StopTimer()
					if err != nil {
						b.Fatal(err)
					}
					tier.Close()
					os.RemoveAll(tier.Path) // up to 1 GiB of /dev/shm
					b.StartTimer()
				}
			})
		}
	}
}

// indexOfEntries returns a memory tier (under /dev/shm) whose index lists n entries in n
// buckets (and no files), with the file of its next growth made ahead or not.
func indexOfEntries(b *testing.B, n int, ahead bool) *Tier {
	b.Helper()
	tier, err := New(Config{Dir: memoryDir(b), Kind: Memory, Budget: "100GiB"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	tier.mu.Lock()
	defer tier.mu.Unlock()
	err = withFd(tier.dirFile, func(dirfd int) error {
		ix, _, err := createIndex(dirfd, uint32(n), func(ix *index) {
			for i := range n {
				p := fmt.Sprintf("/data/f%d", i)
				ix.put(slotOf(stored{Entry: Entry{SourcePath: p, Size: 1}}, idOf(p)))
			}
		}, tier.view.replace)
		if err != nil {
			return err
		}
		tier.ix = ix
		if ahead {
			tier.nextIndex, err = newIndexFile(dirfd, uint32(2*n))
		}
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	return tier
}
