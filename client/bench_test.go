package client

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkColdMiss reads files that no tier holds yet (110 KiB, the size of an ImageNet
// sample) through an embedded server in this process (a Unix socket, Kitex), against plain
// reads of the same page-cached files: the cost a miss adds. Profile it with -cpuprofile
// to see where the time goes (the data mover's publication runs alongside).
func BenchmarkColdMiss(b *testing.B) {
	const size = 110 << 10
	root := b.TempDir()
	data := make([]byte, size)
	const n = 4000 // run with -benchtime 3000x or less: each fitcache read needs a new file
	for i := range n {
		os.WriteFile(filepath.Join(root, fmt.Sprintf("f%05d", i)), data, 0o644)
	}
	b.Run("plain", func(b *testing.B) {
		b.SetBytes(size)
		i := 0
		for b.Loop() {
			if _, err := os.ReadFile(filepath.Join(root, fmt.Sprintf("f%05d", i%n))); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
	b.Run("fitcache", func(b *testing.B) {
		shm, err := os.MkdirTemp("/dev/shm", "fitcache-bench-") // a real memory tier (tmpfs)
		if err != nil {
			b.Skip("no /dev/shm:", err)
		}
		defer os.RemoveAll(shm)
		cfg, _ := startServerWithTier(b, shm, "4GiB")
		c, err := Open(root, cfg, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		b.SetBytes(size)
		i := 0
		for b.Loop() {
			if i >= n {
				b.Skip("ran out of uncached files")
			}
			buf, err := c.Read(fmt.Sprintf("f%05d", i))
			if err != nil {
				b.Fatal(err)
			}
			buf.Release()
			i++
		}
	})
}
