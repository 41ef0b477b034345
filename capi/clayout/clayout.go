// Package clayout gives Go tests the C side of the tier layout: capi/fclookup.c, the code
// with which libfitcache's hit path and the preload shim find cached files without Go,
// compiled here as they compile it. The tier layout and index are written by Go (package
// tiers) and read by that C code; this package's tests hold the two to one layout: path
// cleaning, the data files' names, the hashes, and lookups in indexes Go wrote. They hold the
// numbers of the node socket protocol in capi/fcnode.h to package nodesock's and core's too.
//
// Nothing else imports it.
package clayout

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter
#define _GNU_SOURCE
#include <stdlib.h>
// The C files are included through links in this directory (fclookup_c.h is ../fclookup.c):
// the go command rebuilds a package when its own files change, and would not see a change
// of files included from another directory. Module zips leave links out, so the package
// builds from a checkout of the repository only, which is where its tests run.
#include "fclookup_c.h"
#include "fcnode.h"
#include "fclimits.h"
#include "crc32c.h" // crc32c.c, a link too, is compiled as this package's own

// rel_path is static in fclookup.c: this file includes it to reach it.
static int clayout_rel_path(const char *path, size_t len, char *rel, size_t cap) {
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	return rel_path(path, len, key, rel, cap);
}

// clayout_open opens the tier directory dir into *t (allocated here; NULL if it could not be
// opened) and returns its index, or NULL with a negated errno in *rc. clayout_close closes
// and frees *t.
static struct fc_index *clayout_open(const char *dir, struct fc_tier **t, int *rc) {
	*t = calloc(1, sizeof **t);
	if (!*t) {
		*rc = -ENOMEM;
		return NULL;
	}
	if ((*rc = fc_tier_open(*t, dir, 0, 0)) != 0) {
		free(*t);
		*t = NULL;
		return NULL;
	}
	struct fc_index *ix = current_index(*t);
	if (!ix)
		*rc = -ENOENT;
	return ix;
}

static void clayout_close(struct fc_tier *t) {
	if (t)
		fc_tier_close(t);
	free(t);
}

// clayout_count_as claims a counter line of dir's index as process pid would (claim_line),
// and counts n hits of bytes each on it through fc_count_hit. Returns the line's number, or
// a negated errno.
static int clayout_count_as(const char *dir, pid_t pid, int n, int64_t bytes) {
	struct fc_tier *t;
	int rc;
	struct fc_index *ix = clayout_open(dir, &t, &rc);
	if (ix) {
		ix->line = claim_line(ix->counters, pid);
		ix->line_pid = getpid(); // so that the index checks of fc_count_hit keep it
		for (int i = 0; i < n; i++)
			fc_count_hit(t, bytes);
		rc = (int)(((uint8_t *)ix->line - ix->counters) / COUNTER_LINE);
	}
	clayout_close(t);
	return rc;
}

// clayout_count_loop counts n hits of 4 KiB through fc_count_hit in dir's index, on the line
// claim_line gives process pid, in a tier of its own (a mapping of its own, as another
// process has). Returns 0 or a negated errno.
static int clayout_count_loop(const char *dir, pid_t pid, long n) {
	struct fc_tier *t;
	int rc;
	struct fc_index *ix = clayout_open(dir, &t, &rc);
	if (ix) {
		ix->line = claim_line(ix->counters, pid);
		ix->line_pid = getpid();
		for (long i = 0; i < n; i++)
			fc_count_hit(t, 4096);
	}
	clayout_close(t);
	return rc;
}

// clayout_set_owners marks every counter line of dir's index as claimed by pid.
static int clayout_set_owners(const char *dir, pid_t pid) {
	struct fc_tier *t;
	int rc;
	struct fc_index *ix = clayout_open(dir, &t, &rc);
	for (int i = 0; ix && i < FC_COUNTER_LINES; i++)
		__atomic_store_n((uint32_t *)(ix->counters + i * COUNTER_LINE), (uint32_t)pid, __ATOMIC_RELAXED);
	clayout_close(t);
	return rc;
}
*/
import "C"

import (
	"syscall"
	"unsafe"
)

// The node socket protocol as capi/fcnode.h numbers it (see package nodesock).
const (
	NodeMagic      = C.FC_NODE_MAGIC
	NodeAck        = C.FC_NODE_ACK
	NodeMaxMessage = C.FC_NODE_MAX_MESSAGE

	NodeOpFetch      = C.FC_NODE_OP_FETCH
	NodeOpOpen       = C.FC_NODE_OP_OPEN
	NodeOpForget     = C.FC_NODE_OP_FORGET
	NodeOpFetchBlock = C.FC_NODE_OP_FETCH_BLOCK
	NodeOpCacheBlock = C.FC_NODE_OP_CACHE_BLOCK

	NodeOpOpenMany = C.FC_NODE_OP_OPEN_MANY
	NodeMaxBatch   = C.FC_NODE_MAX_BATCH
	NodeMaxInline  = C.FC_NODE_MAX_INLINE
	NodeInlineNone = C.FC_NODE_INLINE_NONE

	NodeOpRecord        = C.FC_NODE_OP_RECORD
	NodeRecordBytes     = C.FC_NODE_RECORD_BYTES
	NodeRecordModeBits  = C.FC_NODE_RECORD_MODE_BITS
	NodeRecordHasCRC    = C.FC_NODE_RECORD_HAS_CRC
	NodeRecordCRCOffset = C.FC_NODE_RECORD_CRC_OFFSET

	OriginSource            = C.FC_ORIGIN_SOURCE
	OriginPeer              = C.FC_ORIGIN_PEER
	OriginSourceWhileCached = C.FC_ORIGIN_SOURCE_WHILE_CACHED
	OriginTierFirst         = C.FC_ORIGIN_TIER_FIRST
)

// The limits capi/fclimits.h gives the C code (the hit path, the preload shim), which must be
// the Go side's: core.ReadNowBytes and client.sourceKeep.
const (
	ReadNowBytes = C.FC_READ_NOW_BYTES
	SourceKeepMs = C.FC_SOURCE_KEEP_MS
)

// OriginName is fc_origin_name: the name C code gives an origin in its diagnostics.
func OriginName(origin uint32) string {
	return C.GoString(C.fc_origin_name(C.uint32_t(origin)))
}

// CRC32C is fc_crc32c (capi/crc32c.c) of b following bytes whose CRC-32C is crc: the
// hardware way where the CPU has it, or with portable the tables alone.
func CRC32C(crc uint32, b []byte, portable bool) uint32 {
	if portable {
		return uint32(C.fc_crc32c_portable(C.uint32_t(crc), unsafe.Pointer(cbytes(b)), C.size_t(len(b))))
	}
	return uint32(C.fc_crc32c(C.uint32_t(crc), unsafe.Pointer(cbytes(b)), C.size_t(len(b))))
}

// CleanPath is fc_clean_path: the lexically cleaned form of the absolute path in, and false
// when C refuses it (a relative path, or one longer than FC_PATH_MAX).
func CleanPath(in string) (string, bool) {
	cin := C.CString(in)
	defer C.free(unsafe.Pointer(cin))
	out := make([]byte, C.FC_PATH_MAX)
	n := C.fc_clean_path(cin, (*C.char)(unsafe.Pointer(&out[0])), C.size_t(len(out)))
	if n < 0 {
		return "", false
	}
	return string(out[:n]), true
}

// Hashes is fc_hashes: the key and check of a clean path (tiers.KeyOf and tiers.CheckOf).
func Hashes(path string) (key, check uint64) {
	var k, c C.uint64_t
	p := []byte(path)
	C.fc_hashes(cbytes(p), C.size_t(len(p)), &k, &c)
	return uint64(k), uint64(c)
}

// RelPath is the name C gives the data file of path's cached copy, relative to a tier
// directory (tiers.RelPath), and false when it does not fit FC_PATH_MAX.
func RelPath(path string) (string, bool) {
	p := []byte(path)
	out := make([]byte, C.FC_PATH_MAX)
	n := C.clayout_rel_path(cbytes(p), C.size_t(len(p)), (*C.char)(unsafe.Pointer(&out[0])), C.size_t(len(out)))
	if n < 0 {
		return "", false
	}
	return string(out[:n]), true
}

// BlockName is fc_block_name: the name C gives block n (of bb bytes) of the clean path
// (tiers.BlockName).
func BlockName(path string, bb, n int64) string {
	buf := make([]byte, len(path)+48)
	copy(buf, path)
	k := C.fc_block_name((*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(path)), C.int64_t(bb), C.int64_t(n))
	return string(buf[:k])
}

// Hit is what Lookup found.
type Hit struct {
	Tier      int   // index of the tier in the directories given
	Size      int64 // the copy's size, as the index records it
	MTimeNano int64 // the source's modification time, as the index records it
	Ino       uint64
	Dev       uint64 // the copy's device, as fstat of the descriptor gave it
	// The source's inode number and change time, as the index records them.
	SrcIno       uint64
	SrcCTimeNano int64
}

// Tiers are tier directories opened by the C code, as a reader holds them: its mappings of
// their indexes follow the servers' indexes for as long as it is open.
type Tiers struct {
	c *C.struct_fc_tier
	n int
}

// OpenTiers opens the tier directories dirs (fastest first) for session (see fc_tier_open).
// Close it when done.
func OpenTiers(dirs []string, session uint32) (*Tiers, error) {
	ts := &Tiers{c: (*C.struct_fc_tier)(C.calloc(C.size_t(len(dirs)), C.sizeof_struct_fc_tier))}
	all := unsafe.Slice(ts.c, len(dirs))
	for i, d := range dirs {
		cd := C.CString(d)
		rc := C.fc_tier_open(&all[i], cd, C.int(i), C.uint32_t(session))
		C.free(unsafe.Pointer(cd))
		if rc != 0 {
			ts.Close()
			return nil, syscall.Errno(-rc)
		}
		ts.n++
	}
	return ts, nil
}

// Close closes the tiers.
func (ts *Tiers) Close() {
	all := unsafe.Slice(ts.c, ts.n)
	for i := range all {
		C.fc_tier_close(&all[i])
	}
	C.free(unsafe.Pointer(ts.c))
	ts.c, ts.n = nil, 0
}

// Lookup is fc_lookup of the clean path in the tiers, with or without requiring a copy
// checked in their session: the hit, or an error wrapping syscall.ENOENT for a miss.
func (ts *Tiers) Lookup(requireSession bool, path string) (Hit, error) {
	req := C.int(0)
	if requireSession {
		req = 1
	}
	p := []byte(path)
	return ts.look(func(hit *C.struct_fc_hit) C.int {
		rc := C.fc_lookup(ts.c, C.int(ts.n), cbytes(p), C.size_t(len(p)), C.O_CLOEXEC, req, hit)
		if rc == 0 {
			syscall.Close(int(hit.fd))
		}
		return rc
	})
}

// CountHit is fc_count_hit of a hit of n bytes in the first tier.
func (ts *Tiers) CountHit(n int64) { C.fc_count_hit(ts.c, C.int64_t(n)) }

// look calls fn with a hit to fill and returns the hit, or the error of the negated errno fn
// returned.
func (ts *Tiers) look(fn func(*C.struct_fc_hit) C.int) (Hit, error) {
	var hit C.struct_fc_hit
	if rc := fn(&hit); rc != 0 {
		return Hit{}, syscall.Errno(-rc)
	}
	return Hit{Tier: int(hit.tier), Size: int64(hit.size), MTimeNano: int64(hit.mtime_ns), Ino: uint64(hit.ino),
		Dev: uint64(hit.dev), SrcIno: uint64(hit.src_ino), SrcCTimeNano: int64(hit.src_ctime_ns)}, nil
}

// Lookup is fc_lookup of the clean path in the tier directories dirs (fastest first), each
// opened for session (see fc_tier_open), with or without requiring a copy checked in it:
// the hit, or an error wrapping syscall.ENOENT for a miss.
func Lookup(dirs []string, session uint32, requireSession bool, path string) (Hit, error) {
	ts, err := OpenTiers(dirs, session)
	if err != nil {
		return Hit{}, err
	}
	defer ts.Close()
	return ts.Lookup(requireSession, path)
}

// LookupFd is fc_lookup_fd: whether fd is the copy of the clean path that the index of one
// of the tier directories dirs lists (the hit), or an error wrapping syscall.ENOENT.
func LookupFd(dirs []string, path string, fd int) (Hit, error) {
	ts, err := OpenTiers(dirs, 0)
	if err != nil {
		return Hit{}, err
	}
	defer ts.Close()
	p := []byte(path)
	return ts.look(func(hit *C.struct_fc_hit) C.int {
		return C.fc_lookup_fd(ts.c, C.int(ts.n), cbytes(p), C.size_t(len(p)), C.int(fd), hit)
	})
}

// cbytes points C at b's bytes (no terminator: every function here takes a length), or at a
// byte of its own for an empty b.
func cbytes(b []byte) *C.char {
	if len(b) == 0 {
		var zero byte
		return (*C.char)(unsafe.Pointer(&zero))
	}
	return (*C.char)(unsafe.Pointer(&b[0]))
}

// CounterLines is FC_COUNTER_LINES: the lines of hit counters in a tier's index.
const CounterLines = C.FC_COUNTER_LINES

// CountHitsAs counts n hits of bytes each through fc_count_hit in the tier directory dir, on
// the counter line that C gives a process of the given pid, and returns that line's number.
func CountHitsAs(dir string, pid, n int, bytes int64) (line int, err error) {
	cd := C.CString(dir)
	defer C.free(unsafe.Pointer(cd))
	rc := C.clayout_count_as(cd, C.pid_t(pid), C.int(n), C.int64_t(bytes))
	if rc < 0 {
		return 0, syscall.Errno(-rc)
	}
	return int(rc), nil
}

// SetCounterOwners marks every counter line of the index in the tier directory dir as
// claimed by the process pid.
func SetCounterOwners(dir string, pid int) error {
	cd := C.CString(dir)
	defer C.free(unsafe.Pointer(cd))
	if rc := C.clayout_set_owners(cd, C.pid_t(pid)); rc < 0 {
		return syscall.Errno(-rc)
	}
	return nil
}

// CountHitsLoop counts n hits of 4 KiB each through fc_count_hit in the tier directory dir, in
// a mapping of its own, on the counter line that C gives a process of the given pid.
func CountHitsLoop(dir string, pid int, n int64) error {
	cd := C.CString(dir)
	defer C.free(unsafe.Pointer(cd))
	if rc := C.clayout_count_loop(cd, C.pid_t(pid), C.long(n)); rc < 0 {
		return syscall.Errno(-rc)
	}
	return nil
}
