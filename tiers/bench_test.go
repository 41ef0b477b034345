package tiers

import (
	"fmt"
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
