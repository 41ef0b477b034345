/*
 * crc32c.h -- the CRC-32C (Castagnoli) of bytes: the value Go's hash/crc32 gives with
 * crc32.MakeTable(crc32.Castagnoli), which a tier's index keeps as each copy's checksum
 * (tiers.Entry.Checksum). A reader computes it of the copy it writes into its fill file
 * (capi/fill.c) and reports it, so that the server need not read the copy again.
 */
#ifndef FITCACHE_CRC32C_H
#define FITCACHE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Returns the CRC-32C of the n bytes at p following bytes whose CRC-32C is crc (0 before the
 * first bytes), as Go's crc32.Update(crc, castagnoli, p[:n]): with the CPU's crc32
 * instruction where it has SSE4.2, else from tables. */
uint32_t fc_crc32c(uint32_t crc, const void *p, size_t n);

/* fc_crc32c from tables alone, whatever the CPU: for tests of both ways. */
uint32_t fc_crc32c_portable(uint32_t crc, const void *p, size_t n);

#endif
