package clayout

import (
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"testing"
)

// The CRC-32C a reader computes of its fill (capi/crc32c.c) is the one Go computes of the
// same bytes (tiers' checksums), both ways (the crc32 instruction, the tables), whatever the
// length and the alignment of the bytes, and continued across calls.
func TestCRC32CMatchesGo(t *testing.T) {
	castagnoli := crc32.MakeTable(crc32.Castagnoli)
	rng := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 1<<20+64)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	sizes := []int{0, 1, 7, 8, 9, 15, 16, 255, 256, 767, 768, 769, 4096, 3*8192 - 1, 3 * 8192, 3*8192 + 1,
		110 << 10, 110<<10 + 3, 1 << 20}
	for _, portable := range []bool{false, true} {
		for _, size := range sizes {
			for _, align := range []int{0, 1, 3, 7, 8, 13} {
				name := fmt.Sprintf("portable=%v/%d bytes at %d", portable, size, align)
				b := buf[align : align+size]
				want := crc32.Checksum(b, castagnoli)
				if got := CRC32C(0, b, portable); got != want {
					t.Errorf("%s: got %08x, want %08x", name, got, want)
				}
				// In two calls, split where the parts have odd lengths.
				cut := size / 3
				if got := CRC32C(CRC32C(0, b[:cut], portable), b[cut:], portable); got != want {
					t.Errorf("%s in two calls (cut at %d): got %08x, want %08x", name, cut, got, want)
				}
			}
		}
	}
	if got, want := CRC32C(0, []byte("123456789"), false), uint32(0xe3069283); got != want {
		t.Errorf("check value: got %08x, want %08x", got, want)
	}
}
