package client

import (
	"context"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/fitcache/fitcache/tiers"
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

// BenchmarkHit reads files the memory tier holds through the client's hit path (the tier's
// index, then a mapping of the cached file; no server round trip), against plain reads of
// the same cached copies on /dev/shm. Both consume every byte (a CRC), as a reader does: a
// mapping that is never touched would flatter the cache.
func BenchmarkHit(b *testing.B) {
	const size = 110 << 10
	const n = 1000
	root := b.TempDir()
	data := make([]byte, size)
	for i := range n {
		data[0] = byte(i)
		os.WriteFile(filepath.Join(root, fmt.Sprintf("f%05d", i)), data, 0o644)
	}
	shm, err := os.MkdirTemp("/dev/shm", "fitcache-bench-")
	if err != nil {
		b.Skip("no /dev/shm:", err)
	}
	defer os.RemoveAll(shm)
	cfg, _ := startServerWithTier(b, shm, "1GiB")
	c, err := Open(root, cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	cached := make([]string, n) // the cached copies, for the plain reads
	for i := range n {
		path := filepath.Join(root, fmt.Sprintf("f%05d", i))
		buf, err := c.Read(path)
		if err != nil {
			b.Fatal(err)
		}
		buf.Release()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			m, err := tiers.Probe(c.localDirs(), path)
			if err == nil {
				cached[i] = m.Path
				m.Release()
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("%s not cached after 10 s", path)
			}
		}
	}
	b.Run("plain", func(b *testing.B) {
		b.SetBytes(size)
		i := 0
		for b.Loop() {
			p, err := os.ReadFile(cached[i%n])
			if err != nil {
				b.Fatal(err)
			}
			crc32.ChecksumIEEE(p)
			i++
		}
	})
	b.Run("fitcache", func(b *testing.B) {
		b.SetBytes(size)
		i := 0
		for b.Loop() {
			buf, err := c.Read(fmt.Sprintf("f%05d", i%n))
			if err != nil {
				b.Fatal(err)
			}
			crc32.ChecksumIEEE(buf.Bytes())
			buf.Release()
			i++
		}
	})
}

// BenchmarkRangesOfCachedBlocks reads random 64 KiB ranges of a 64 MiB file whose blocks
// are all cached (the tier is on the file system of the test's temporary directory), with
// ReadAt, against preads of the page-cached file: what a range served from a block costs
// beyond the pread itself.
func BenchmarkRangesOfCachedBlocks(b *testing.B) {
	const size, length = 64 << 20, 64 << 10
	root := b.TempDir()
	path := filepath.Join(root, "big.bin")
	os.WriteFile(path, make([]byte, size), 0o644)
	offsets := make([]int64, 1024)
	for i := range offsets {
		offsets[i] = int64(i*7919*4096) % (size - length)
	}
	p := make([]byte, length)
	b.Run("plain", func(b *testing.B) {
		f, _ := os.Open(path)
		defer f.Close()
		i := 0
		for b.Loop() {
			f.ReadAt(p, offsets[i%len(offsets)])
			i++
		}
	})
	b.Run("fitcache", func(b *testing.B) {
		cfg, _ := startServerWithTier(b, b.TempDir(), "1GiB")
		c, err := Open(root, cfg, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		for n := int64(0); n < size>>22; n++ { // every block, cached
			conn, _ := c.current()
			if _, err := conn.rpc.ReadBlock(context.Background(), c.root, path, conn.blockBytes, n, true); err != nil {
				b.Fatal(err)
			}
		}
		i := 0
		for b.Loop() {
			if _, err := c.ReadAt("big.bin", p, offsets[i%len(offsets)]); err != nil {
				b.Fatal(err)
			}
			i++
		}
		if c.counts.sourceRanges.Load() != 0 {
			b.Fatalf("%d ranges read from the source", c.counts.sourceRanges.Load())
		}
	})
}

// BenchmarkRangesOfUncachedBlocks is BenchmarkRangesOfCachedBlocks with a tier too small for
// any block: every range is read from the source, through the client.
func BenchmarkRangesOfUncachedBlocks(b *testing.B) {
	const size, length = 64 << 20, 64 << 10
	root := b.TempDir()
	path := filepath.Join(root, "big.bin")
	os.WriteFile(path, make([]byte, size), 0o644)
	p := make([]byte, length)
	cfg, _ := startServerWithTier(b, b.TempDir(), "1MiB")
	c, err := Open(root, cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	i := 0
	for b.Loop() {
		if _, err := c.ReadAt("big.bin", p, int64(i*7919*4096)%(size-length)); err != nil {
			b.Fatal(err)
		}
		i++
	}
}
