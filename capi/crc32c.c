/*
 * crc32c.c -- CRC-32C (see crc32c.h). The hardware way runs three streams of the crc32
 * instruction at once (its latency is three times its throughput) over consecutive parts of
 * the bytes and joins their CRCs with tables that shift a CRC past a part's length of zeros,
 * as Mark Adler's crc32c.c does; the portable way takes eight bytes a step from tables
 * (slicing by 8). The tables are made, and the CPU asked, when the library is loaded: no
 * first-use check or lock on the way of a fill, and nothing half made in a forked child.
 */
#include "crc32c.h"

#include <string.h>

#define POLY 0x82f63b78u /* Castagnoli, reflected */

// The parts of the three streams: LONG bytes each while the input lasts, then SHORT.
#define LONG 8192
#define SHORT 256

static uint32_t slice[8][256];      // slice[k][b]: the CRC of byte b followed by k zero bytes
static uint32_t long_shift[4][256]; // shift_by(long_shift, crc): crc past LONG zero bytes
static uint32_t short_shift[4][256];
#if defined(__x86_64__)
static int hw; // whether the CPU has the crc32 instruction
#endif

// gf2_times returns the 32x32 matrix over GF(2) mat (its columns) times the vector v.
static uint32_t gf2_times(const uint32_t *mat, uint32_t v) {
	uint32_t sum = 0;
	for (; v; v >>= 1, mat++)
		if (v & 1)
			sum ^= *mat;
	return sum;
}

// gf2_square sets sq to mat times mat.
static void gf2_square(uint32_t *sq, const uint32_t *mat) {
	for (int n = 0; n < 32; n++)
		sq[n] = gf2_times(mat, mat[n]);
}

// make_shift fills t so that shift_by(t, crc) is crc followed by len zero bytes (len a power
// of two): the operator of one zero bit, squared up to len bytes.
static void make_shift(uint32_t t[4][256], size_t len) {
	uint32_t odd[32], even[32], *op;
	odd[0] = POLY;
	for (int n = 1; n < 32; n++)
		odd[n] = 1u << (n - 1);
	gf2_square(even, odd); // 2 bits
	gf2_square(odd, even); // 4 bits
	gf2_square(even, odd); // 1 byte
	op = even;
	for (; len > 1; len >>= 1) {
		gf2_square(op == even ? odd : even, op);
		op = op == even ? odd : even;
	}
	for (uint32_t b = 0; b < 256; b++)
		for (int k = 0; k < 4; k++)
			t[k][b] = gf2_times(op, b << (8 * k));
}

static uint32_t shift_by(uint32_t t[4][256], uint32_t crc) {
	return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
}

__attribute__((constructor)) static void make_tables(void) {
	for (uint32_t b = 0; b < 256; b++) {
		uint32_t c = b;
		for (int k = 0; k < 8; k++)
			c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
		slice[0][b] = c;
	}
	for (uint32_t b = 0; b < 256; b++)
		for (int k = 1; k < 8; k++)
			slice[k][b] = (slice[k - 1][b] >> 8) ^ slice[0][slice[k - 1][b] & 0xff];
	make_shift(long_shift, LONG);
	make_shift(short_shift, SHORT);
#if defined(__x86_64__)
	__builtin_cpu_init();
	hw = __builtin_cpu_supports("sse4.2") != 0;
#endif
}

static uint64_t load64(const unsigned char *p) {
	uint64_t v;
	memcpy(&v, p, 8);
	return v; // little-endian: the only byte order the library builds for (x86-64, arm64)
}

uint32_t fc_crc32c_portable(uint32_t crc, const void *buf, size_t n) {
	const unsigned char *p = buf;
	uint32_t c = ~crc;
	for (; n >= 8; n -= 8, p += 8) {
		uint64_t v = load64(p) ^ c;
		c = slice[7][v & 0xff] ^ slice[6][(v >> 8) & 0xff] ^ slice[5][(v >> 16) & 0xff] ^
		    slice[4][(v >> 24) & 0xff] ^ slice[3][(v >> 32) & 0xff] ^ slice[2][(v >> 40) & 0xff] ^
		    slice[1][(v >> 48) & 0xff] ^ slice[0][v >> 56];
	}
	for (; n > 0; n--)
		c = (c >> 8) ^ slice[0][(c ^ *p++) & 0xff];
	return ~c;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

// THREE_WAY runs the crc32 instruction over three consecutive parts of len bytes from p,
// their CRCs joined into c, for as long as n holds three parts.
#define THREE_WAY(len, shift)                                                                          \
	while (n >= 3 * (len)) {                                                                       \
		uint64_t c0 = c, c1 = 0, c2 = 0;                                                       \
		for (const unsigned char *end = p + (len); p < end; p += 8) {                          \
			c0 = _mm_crc32_u64(c0, load64(p));                                             \
			c1 = _mm_crc32_u64(c1, load64(p + (len)));                                     \
			c2 = _mm_crc32_u64(c2, load64(p + 2 * (len)));                                 \
		}                                                                                      \
		c = shift_by(shift, shift_by(shift, (uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;      \
		p += 2 * (len);                                                                        \
		n -= 3 * (len);                                                                        \
	}

__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *buf, size_t n) {
	const unsigned char *p = buf;
	uint64_t c = ~crc;
	for (; n > 0 && ((uintptr_t)p & 7); n--)
		c = _mm_crc32_u8((uint32_t)c, *p++);
	THREE_WAY(LONG, long_shift)
	THREE_WAY(SHORT, short_shift)
	for (; n >= 8; n -= 8, p += 8)
		c = _mm_crc32_u64(c, load64(p));
	for (; n > 0; n--)
		c = _mm_crc32_u8((uint32_t)c, *p++);
	return ~(uint32_t)c;
}

uint32_t fc_crc32c(uint32_t crc, const void *p, size_t n) {
	return hw ? crc32c_hw(crc, p, n) : fc_crc32c_portable(crc, p, n);
}
#else
uint32_t fc_crc32c(uint32_t crc, const void *p, size_t n) { return fc_crc32c_portable(crc, p, n); }
#endif
