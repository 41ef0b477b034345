/*
 * fclimits.h -- sizes and times of the Go side that the C code (the hit path, the preload
 * shim) must agree with. Each is checked against its Go constant by the capi/clayout tests.
 */
#ifndef FITCACHE_FCLIMITS_H
#define FITCACHE_FCLIMITS_H

#include <stdint.h>

/* core.ReadNowBytes: the server cuts files of at least this size in blocks (read by ranges
 * through them), and copies smaller ones whole before an open returns. */
#define FC_READ_NOW_BYTES ((int64_t)8 << 20)

/* client.sourceKeep, in milliseconds: how long the source of a large file opened for its
 * ranges is read through one open, so that a file replaced on the source is seen within that
 * long. */
#define FC_SOURCE_KEEP_MS 5000

#endif /* FITCACHE_FCLIMITS_H */
