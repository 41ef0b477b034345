package core

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/fitcache/fitcache/tiers"
)

// BenchmarkFill is the server's fill of a file no tier holds (110 KiB, an ImageNet sample's
// size) from a page-cached source into a memory tier on /dev/shm, as its prefetch and the
// misses it serves fill them (Engine.Fetch: claim, read, copy, record, publish), against a
// plain read of the same file: what a cold epoch's copy adds per file. Run it with
// -benchtime 3000x or less (each fill needs a file not cached yet), and -cpuprofile to see
// where the time goes.
func BenchmarkFill(b *testing.B) {
	const size, n = 110 << 10, 4000
	root := b.TempDir()
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i * 7)
	}
	paths := make([]string, n)
	for i := range paths {
		paths[i] = filepath.Join(root, fmt.Sprintf("d%02d", i%40), fmt.Sprintf("f%05d.bin", i))
		os.MkdirAll(filepath.Dir(paths[i]), 0o755)
		if err := os.WriteFile(paths[i], data, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("plain", func(b *testing.B) {
		b.SetBytes(size)
		i := 0
		for b.Loop() {
			if _, err := os.ReadFile(paths[i%n]); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
	b.Run("fill", func(b *testing.B) {
		shm, err := os.MkdirTemp(cmp.Or(os.Getenv("FITCACHE_BENCH_TIER_PARENT"), "/dev/shm"), "fitcache-bench-")
		if err != nil {
			b.Skip("no /dev/shm:", err)
		}
		defer os.RemoveAll(shm)
		e, err := NewEngine(EngineConfig{Tiers: []tiers.Config{{Dir: shm, Kind: tiers.Memory, Budget: "2GiB"}}}, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer e.Close()
		b.SetBytes(size)
		i := 0
		for b.Loop() {
			if i >= n {
				b.Skip("ran out of uncached files")
			}
			if err := e.Fetch(b.Context(), root, paths[i]); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
}
