package tiers

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math/bits"
	"os"
	"path/filepath"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/edsrzf/mmap-go"
	"golang.org/x/sys/unix"
)

// The index of a tier is the file "fitcache.index" in the tier directory: a hash table of the
// entries the tier holds, with what a reader must check before it serves a cached file. The
// server owning the tier is its only writer; every reader on the node (Go clients, the C hit
// path of libfitcache, the preload shim) maps it, so that a hit costs a lookup in memory plus
// the system calls of a plain read: open the data file below the tier, fstat it, read it.
//
// Layout (integers little-endian, at 8-byte aligned offsets):
//
//	header, page 0 (4096 bytes), written by the server only: readers map it read-only
//	  0  magic    [8]byte  "FCINDEX\x01"
//	  8  version  uint32   indexVersion
//	  12 ways     uint32   slots per bucket (indexWays)
//	  16 buckets  uint32   number of buckets, a power of two
//	  20 slotSize uint32   indexSlotSize
//	  24 retired  uint32   1 once a server replaced this file: readers open the index anew
//	  28 sessions uint32   the last validation session the server began (Tier.NoteSession),
//	                       so that a restarted server numbers its sessions on from it
//	counters, pages 1-4 (counterLines lines of 64 bytes from offset 4096), the only part
//	readers map writable: a reader process adds its counts to a line of its own, so that a
//	hit writes nothing another process writes (one shared line, written by every reader on
//	every hit, went from core to core). The server sums the lines when asked.
//	  0  owner  uint32   the pid of the process that claimed the line, 0 while free (a reader
//	                     claims one with a compare-and-swap at its first count in a mapping;
//	                     see capi/fclookup.c claim_line)
//	  8  hits     uint64 reads that readers outside the server served from the tier
//	  16 hitBytes uint64 their bytes (readers add to both atomically)
//	  24 sourceRanges uint64 ranges such readers read from the source of a large file whose
//	                       blocks were not cached (the preload shim), counted in the first tier
//	  32 sourceBytes  uint64 their bytes
//	A line is never cleared: the counts of a process that exited stay in the sum, and a
//	process that takes over its line (every line claimed, its owner gone) adds to them. With
//	every line held by a live process, a reader shares one, chosen by its pid; the adds are
//	atomic, so the sum is right either way.
//	slots, 80 bytes each, from offset 20480; bucket b holds slots b*ways .. b*ways+ways-1:
//	  0  seq      uint32   seqlock: odd while the server changes the slot
//	  4  used     uint32   1 if the slot holds an entry
//	  8  key      uint64   KeyOf(source path): names the data file, see RelPath
//	  16 check    uint64   CheckOf(source path), a second hash: a key collision is no hit
//	  24 size     uint64   size of the data file
//	  32 mtime    int64    the source's modification time, Unix nanoseconds
//	  40 ino      uint64   inode number of the data file
//	  48 checksum uint32   CRC-32C of the data
//	  52 checked  uint32   the last validation session in which the copy was found to match
//	                       its source (see Tier.Validate); a reader of session s serves the
//	                       copy only if checked >= s, and asks the server otherwise
//	  56 pubSeq   uint64   publication sequence number (the server evicts the oldest of a
//	                       full bucket)
//	  64 srcIno   uint64   the source file's inode number (0: unknown, a replica's copy)
//	  72 srcCtime int64    the source file's change time, Unix nanoseconds (0: unknown)
//
// Readers read the geometry (buckets) once, when they map the index, and check it against the
// mapping's length: a stray write to the header by a process of the same user can make them
// miss, never read outside the mapping. The counters live on pages of their own so that the
// header and the slots can be mapped read-only.
//
// The bucket of a key is (key * 0x9E3779B97F4A7C15) >> (64 - log2(buckets)): the key mixed
// by Fibonacci hashing, top bits taken. FNV-1a mixes the last bytes of a path poorly into
// its middle bits, and paths that differ only there (f1, f2, ... f30000) piled into a few
// buckets when the bucket was taken from them (version 1).
//
// A reader takes a slot only if seq is even and unchanged across its reads of the slot, and
// serves the data file only if the file it opened (following no link, below the tier) is a
// regular file of this user with the slot's inode number and size. Anything else is a miss.
// A full bucket makes the server grow the index (a new file of twice the buckets, renamed over
// this one, which it marks retired), and at its ceiling evict the bucket's oldest entry, so
// the index never refuses a file.
//
// srcIno and srcCtime repeat the record's identity of the source version the copy holds
// (record.go), for the preload shim: fstat of a descriptor it opened as a hit reports the
// source's inode and change time (preload/copies.c), and with them in the slot it needs no
// read of the record to know them.

const (
	indexName     = "fitcache.index"
	indexMagic    = "FCINDEX\x01"
	indexVersion  = 5
	indexWays     = 8
	indexSlotSize = 80
	indexSlots    = 20480 // offset of the first slot, after the header and counter pages

	hdrVersion  = 8
	hdrWays     = 12
	hdrBuckets  = 16
	hdrSlotSize = 20
	hdrRetired  = 24
	hdrSessions = 28

	counterLines     = 256  // lines of counters, one per reader process while there are enough
	counterLine      = 64   // bytes per line: a cache line
	counterBase      = 4096 // offset of the first line
	lineHits         = 8    // offsets within a line
	lineHitBytes     = 16
	lineSourceRanges = 24
	lineSourceBytes  = 32
)

// Index geometry. An index starts small and doubles when an entry's bucket is full, up to a
// ceiling of one slot per indexBytesPerSlot of the tier's budget: its size follows the files
// the tier holds, not the budget. Every reader process maps the index and faults in each page
// its lookups touch: with a dataset's lookups spread over an index sized by the budget alone,
// most hits of a fresh DataLoader worker took a page fault, and each page a lookup touched
// took memory from the tier's file system, outside the budget. 16 processes looking up 1,250
// of 20,000 files each (bench/index_faults.c, 2-core VM): 0.27 faults and 1.3-1.5 µs of CPU per
// lookup in the 20 MiB index of a budget of 1.1 times the dataset, 0.83 and 3.1-3.8 µs in the
// 160 MiB of half a 128 GiB node's /dev/shm, against 0.08-0.14 and 0.4-1.0 µs in the 5-10 MiB
// these files grow their index to (BENCHMARKS section 28).
//
// A server's index starts with enough buckets for the entries it finds at its start, one per
// bucket (minIndexBuckets at least), and grows when a bucket first overflows: Fibonacci
// hashing spreads keys at random over the buckets, and the first of 16,384 buckets of 8
// overflowed at 1.4 to 1.9 entries per bucket on average, the first of 1,024 at 1.5 to 2.6
// (TestIndexBucketsOverflowNearTheLoadsTheDocsGive). Doubling splits each bucket in two (the
// top bits of a mixed key name its bucket, so one more bit splits it), and the index holds
// 0.7 to 1.3 entries per bucket again: about 0.5 to 1 KiB of index per file, and for a while
// before each growth three times that, the next file being made ahead (see Tier.aheadOfGrowth).
//
// At the ceiling a full bucket evicts its oldest entry, as every bucket did before indexes
// grew (Info.IndexEvictions counts it): with one slot per 16 KiB of budget a bucket holds 0.9
// entries on average once the budget is full of files of 110 KiB, and overflows about never;
// a tier full of files much smaller than that still does.
const (
	indexBytesPerSlot = 16 << 10
	minIndexBuckets   = 1 << 10 // 8,192 slots: 660 KiB
	maxIndexBuckets   = 1 << 20 // 8 Mi slots: 640 MiB
)

// indexLen returns the size of an index file of the given number of buckets.
func indexLen(buckets uint32) int64 {
	return indexSlots + int64(buckets)*indexWays*indexSlotSize
}

// indexCeiling returns the most buckets the index of a tier of the given budget grows to.
func indexCeiling(budget int64) uint32 {
	return bucketsFor(budget/indexBytesPerSlot/indexWays, maxIndexBuckets)
}

// bucketsFor returns the buckets of an index that starts with n entries, one per bucket: the
// power of two at or above n, within minIndexBuckets and ceiling.
func bucketsFor(n int64, ceiling uint32) uint32 {
	b := uint32(minIndexBuckets)
	for int64(b) < n && b < ceiling {
		b *= 2
	}
	return b
}

// CheckOf returns the second hash of a cleaned source path that the index keeps beside its
// key: FNV-1a 64 of the path's bytes in reverse order. Two paths share a key and a check
// only by a collision of both hashes.
func CheckOf(sourcePath string) uint64 {
	p := []byte(filepath.Clean(sourcePath))
	for i, j := 0, len(p)-1; i < j; i, j = i+1, j-1 {
		p[i], p[j] = p[j], p[i]
	}
	h := fnv.New64a()
	h.Write(p)
	return h.Sum64()
}

// entryID identifies an entry in a tier: the two hashes of its source path.
type entryID struct {
	key   Key
	check uint64
}

func idOf(sourcePath string) entryID {
	return entryID{KeyOf(sourcePath), CheckOf(sourcePath)}
}

// slot is the content of an index slot.
type slot struct {
	id       entryID
	size     int64
	mtime    int64
	ino      uint64
	checksum uint32
	checked  uint32 // see the layout: the last validation session that found the copy good
	pubSeq   uint64
	srcIno   uint64 // the source's inode and change time (see the layout); 0 where unknown
	srcCtime int64
}

// entry returns what a reader knows of the copy of sourcePath that the slot describes.
func (s slot) entry(sourcePath string) Entry {
	return Entry{SourcePath: sourcePath, Size: s.size, MTimeNanos: s.mtime, Checksum: s.checksum,
		SourceCTimeNanos: s.srcCtime, SourceIno: s.srcIno}
}

// source returns the identity of the source version the copy holds (a whole file's: its
// size is the source's).
func (s slot) source() Identity {
	return Identity{Size: s.size, MTimeNanos: s.mtime, CTimeNanos: s.srcCtime, Ino: s.srcIno}
}

// index is a mapped index file. The server's copy is writable and has one writer (the
// Tier, under its mutex); readers' copies are read-only. Lookups are safe for concurrent use.
type index struct {
	m       mmap.MMap
	buckets uint32
	// sawFull is set when a put filled a bucket's last free slot (writer only): the next put
	// to that bucket makes the index grow (see Tier.aheadOfGrowth).
	sawFull bool
}

func (ix *index) word32(off int) *uint32 { return (*uint32)(unsafe.Pointer(&ix.m[off])) }
func (ix *index) word64(off int) *uint64 { return (*uint64)(unsafe.Pointer(&ix.m[off])) }

func slotOffset(i uint32) int { return indexSlots + int(i)*indexSlotSize }

func (ix *index) bucketOf(k Key) uint32 {
	return uint32((uint64(k) * 0x9E3779B97F4A7C15) >> (64 - bits.TrailingZeros32(ix.buckets)))
}

// lookup returns the slot holding id, if any. It spins a bounded number of times on a slot
// being changed, then reports a miss.
func (ix *index) lookup(id entryID) (slot, bool) {
	first := ix.bucketOf(id.key) * indexWays
	for i := first; i < first+indexWays; i++ {
		off := slotOffset(i)
		if atomic.LoadUint64(ix.word64(off+8)) != uint64(id.key) {
			continue // cheap filter; the seqlock below decides
		}
		for range 100 {
			seq := atomic.LoadUint32(ix.word32(off))
			if seq&1 != 0 {
				continue
			}
			s, used := ix.read(off)
			if atomic.LoadUint32(ix.word32(off)) != seq {
				continue
			}
			if used && s.id == id {
				return s, true
			}
			break
		}
	}
	return slot{}, false
}

// read loads a slot's fields (atomically each; the caller checks the seqlock).
func (ix *index) read(off int) (slot, bool) {
	used := atomic.LoadUint32(ix.word32(off+4)) == 1
	return slot{
		id:       entryID{Key(atomic.LoadUint64(ix.word64(off + 8))), atomic.LoadUint64(ix.word64(off + 16))},
		size:     int64(atomic.LoadUint64(ix.word64(off + 24))),
		mtime:    int64(atomic.LoadUint64(ix.word64(off + 32))),
		ino:      atomic.LoadUint64(ix.word64(off + 40)),
		checksum: atomic.LoadUint32(ix.word32(off + 48)),
		checked:  atomic.LoadUint32(ix.word32(off + 52)),
		pubSeq:   atomic.LoadUint64(ix.word64(off + 56)),
		srcIno:   atomic.LoadUint64(ix.word64(off + 64)),
		srcCtime: int64(atomic.LoadUint64(ix.word64(off + 72))),
	}, used
}

// write stores s in the slot at off (writer only): seq odd, fields, seq even.
func (ix *index) write(off int, s slot, used bool) {
	seq := ix.word32(off)
	atomic.StoreUint32(seq, *seq+1)
	u := uint32(0)
	if used {
		u = 1
	}
	atomic.StoreUint32(ix.word32(off+4), u)
	atomic.StoreUint64(ix.word64(off+8), uint64(s.id.key))
	atomic.StoreUint64(ix.word64(off+16), s.id.check)
	atomic.StoreUint64(ix.word64(off+24), uint64(s.size))
	atomic.StoreUint64(ix.word64(off+32), uint64(s.mtime))
	atomic.StoreUint64(ix.word64(off+40), s.ino)
	atomic.StoreUint32(ix.word32(off+48), s.checksum)
	atomic.StoreUint32(ix.word32(off+52), s.checked)
	atomic.StoreUint64(ix.word64(off+56), s.pubSeq)
	atomic.StoreUint64(ix.word64(off+64), s.srcIno)
	atomic.StoreUint64(ix.word64(off+72), uint64(s.srcCtime))
	atomic.StoreUint32(seq, *seq+1)
}

// put adds or replaces s (writer only). When its bucket is full it replaces the bucket's
// oldest entry and returns it, for the caller to evict.
func (ix *index) put(s slot) (victim slot, evicted bool) {
	first := ix.bucketOf(s.id.key) * indexWays
	free, frees, oldest := -1, 0, -1
	var oldestSeq uint64
	for i := first; i < first+indexWays; i++ { // only the words it decides on: growing puts every entry
		off := slotOffset(i)
		used := atomic.LoadUint32(ix.word32(off+4)) == 1
		switch {
		case used && ix.holds(off, s.id):
			ix.write(off, s, true)
			return slot{}, false
		case !used:
			if free < 0 {
				free = off
			}
			frees++
		default:
			if seq := atomic.LoadUint64(ix.word64(off + 56)); oldest < 0 || seq < oldestSeq {
				oldest, oldestSeq = off, seq
			}
		}
	}
	if free >= 0 {
		ix.write(free, s, true)
		ix.sawFull = ix.sawFull || frees == 1
		return slot{}, false
	}
	victim, _ = ix.read(oldest)
	ix.write(oldest, s, true)
	return victim, true
}

// holds reports whether the slot at off names id (its used flag read already).
func (ix *index) holds(off int, id entryID) bool {
	return atomic.LoadUint64(ix.word64(off+8)) == uint64(id.key) && atomic.LoadUint64(ix.word64(off+16)) == id.check
}

// fits reports whether put of an entry for id would evict none: its bucket holds it already
// or has a free slot.
func (ix *index) fits(id entryID) bool {
	first := ix.bucketOf(id.key) * indexWays
	for i := first; i < first+indexWays; i++ {
		if off := slotOffset(i); atomic.LoadUint32(ix.word32(off+4)) != 1 || ix.holds(off, id) {
			return true
		}
	}
	return false
}

// copyTo puts every entry of ix into to (writer only, with no writes to ix meanwhile). An
// index of twice the buckets never evicts one: each of its buckets takes entries of one
// bucket of ix.
func (ix *index) copyTo(to *index) {
	for i := range ix.buckets * indexWays {
		if off := slotOffset(i); atomic.LoadUint32(ix.word32(off+4)) == 1 {
			s, _ := ix.read(off)
			to.put(s)
		}
	}
}

// mark records in the slot holding id, if any, that its copy was found to match the source in
// validation session (writer only). A later session is never replaced by an earlier one.
func (ix *index) mark(id entryID, session uint32) {
	first := ix.bucketOf(id.key) * indexWays
	for i := first; i < first+indexWays; i++ {
		off := slotOffset(i)
		if cur, used := ix.read(off); used && cur.id == id && cur.checked < session {
			cur.checked = session
			ix.write(off, cur, true)
		}
	}
}

// remove clears the slot holding id, if any (writer only).
func (ix *index) remove(id entryID) {
	first := ix.bucketOf(id.key) * indexWays
	for i := first; i < first+indexWays; i++ {
		off := slotOffset(i)
		if cur, used := ix.read(off); used && cur.id == id {
			ix.write(off, slot{}, false)
		}
	}
}

// retired reports whether a server replaced this index.
func (ix *index) retired() bool { return atomic.LoadUint32(ix.word32(hdrRetired)) != 0 }

// sumLines returns the sums of the two counters at offsets a and b of every counter line.
func (ix *index) sumLines(a, b int) (n, bytes int64) {
	for i := range counterLines {
		off := counterBase + i*counterLine
		n += int64(atomic.LoadUint64(ix.word64(off + a)))
		bytes += int64(atomic.LoadUint64(ix.word64(off + b)))
	}
	return n, bytes
}

// hits returns the reads and bytes that readers outside the server served from the tier.
func (ix *index) hits() (n, bytes int64) { return ix.sumLines(lineHits, lineHitBytes) }

// sourceReads returns the ranges and bytes that readers outside the server read from the
// source (see the layout).
func (ix *index) sourceReads() (n, bytes int64) {
	return ix.sumLines(lineSourceRanges, lineSourceBytes)
}

func (ix *index) unmap() error { return ix.m.Unmap() }

// indexTempPrefix starts the temporary name of an index file: a new one not yet in place, or
// a retired one not yet given back (see indexFile.install).
const indexTempPrefix = tempPrefix + "index-"

// indexFile is a new index not yet in place: a temporary file in the tier directory, mapped.
type indexFile struct {
	ix  *index
	tmp string // its name in the tier directory
}

// newIndexFile makes an empty index of the given buckets in the tier directory dirfd, under a
// temporary name: its memory allocated and mapped in (so that a file system without room for
// it is an error now, not a fault at a later write to it), its header written.
func newIndexFile(dirfd int, buckets uint32) (*indexFile, error) {
	f, tmp, err := createTemp(dirfd, indexTempPrefix)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	size := indexLen(buckets)
	if err := f.Truncate(size); err != nil {
		unix.Unlinkat(dirfd, tmp, 0)
		return nil, err
	}
	if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
		unix.Unlinkat(dirfd, tmp, 0)
		return nil, fmt.Errorf("index of %d bytes: %w", size, err)
	}
	m, err := mmap.Map(f, mmap.RDWR, 0)
	if err != nil {
		unix.Unlinkat(dirfd, tmp, 0)
		return nil, fmt.Errorf("map index: %w", err)
	}
	// Its pages mapped in one call, not a fault at a time as puts touch them: a server fills
	// a grown index with its lock held (see Tier.growIndex). Older kernels lack the call, and
	// then fault as before.
	if err := unix.Madvise(m, unix.MADV_POPULATE_WRITE); err != nil && !errors.Is(err, unix.EINVAL) {
		m.Unmap()
		unix.Unlinkat(dirfd, tmp, 0)
		return nil, fmt.Errorf("index of %d bytes: %w", size, err)
	}
	ix := &index{m: m, buckets: buckets}
	copy(m, indexMagic)
	*ix.word32(hdrVersion) = indexVersion
	*ix.word32(hdrWays) = indexWays
	*ix.word32(hdrBuckets) = buckets
	*ix.word32(hdrSlotSize) = indexSlotSize
	return &indexFile{ix: ix, tmp: tmp}, nil
}

// discard removes an index file that was not installed.
func (n *indexFile) discard(dirfd int) {
	n.ix.unmap()
	unix.Unlinkat(dirfd, n.tmp, 0)
}

// install puts n in place of the tier's index, hands it to installed (nil for none) for the
// caller to make current, and only then marks the old one retired, so that its readers move
// to the new one. It returns the last session the old index recorded (0 for none), which n
// records too, and the old index, whose slots the caller gives back a moment later
// (retiredIndex.giveBackAfter): its readers look in them no more once they have seen the
// flag. The two files swap names (RENAME_EXCHANGE) where the file system can, so that the
// old one keeps n's temporary name until it is given back: a server killed before that
// leaves it for the next one's rescan to give back (see giveBackLeftover), where a file
// renamed over kept its pages for as long as readers mapped it. On an error n is discarded.
func (n *indexFile) install(dirfd int, installed func(*index)) (sessions uint32, old retiredIndex, err error) {
	oldFd, oldErr := unix.Openat(dirfd, indexName, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	name := ""
	if oldErr == nil && unix.Renameat2(dirfd, n.tmp, dirfd, indexName, unix.RENAME_EXCHANGE) == nil {
		name = n.tmp
	} else if err := unix.Renameat(dirfd, n.tmp, dirfd, indexName); err != nil {
		if oldErr == nil {
			unix.Close(oldFd)
		}
		n.discard(dirfd)
		return 0, retiredIndex{fd: -1}, err
	}
	if installed != nil {
		installed(n.ix)
	}
	if oldErr != nil {
		return 0, retiredIndex{fd: -1}, nil
	}
	sessions, ok := retire(oldFd)
	if ok {
		n.ix.noteSession(sessions)
	}
	return sessions, retiredIndex{fd: oldFd, name: name}, nil
}

// retiredIndex is a replaced index, open, whose slots' pages are still to be given back (fd
// -1 for none), with its temporary name in the tier directory ("" for none: renamed over).
type retiredIndex struct {
	fd   int
	name string
}

// giveBack gives back the pages of the slots of the retired index in the tier directory
// dirfd (its header and hit counters stay), closes it and removes its name. A file system
// without holes keeps them until its readers let go.
func (r retiredIndex) giveBack(dirfd int) {
	if r.fd < 0 {
		return
	}
	punchSlotsOf(r.fd)
	unix.Close(r.fd)
	if r.name != "" {
		unix.Unlinkat(dirfd, r.name, 0)
	}
}

// giveBackLeftover gives back an index file left under a temporary name in the tier
// directory dirfd by a server that stopped before it could (see install), or a new index it
// never put in place: retired first, for readers that still map it to move on, then its
// slots given back, then removed.
func giveBackLeftover(dirfd int, name string) {
	fd, err := unix.Openat(dirfd, name, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err == nil {
		retire(fd)
		retiredIndex{fd: fd, name: name}.giveBack(dirfd)
	}
}

// retiredGrace is how long a retired index keeps its slots before they are given back: a
// reader that looked at the retired flag just before it was set reads the slots after, and
// one thread of a C reader goes on with the retired index while another maps the new one
// (capi/fclookup.c current_index). Given back at once, those found zeros, and missed.
const retiredGrace = time.Second

// giveBackAfter gives back the retired index's slots (see giveBack) after retiredGrace, or
// once closing is closed; dir is the tier directory.
func (r retiredIndex) giveBackAfter(dir *os.File, closing <-chan struct{}) {
	if r.fd < 0 {
		return
	}
	timer := time.NewTimer(retiredGrace)
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-closing:
	}
	withFd(dir, func(dirfd int) error { r.giveBack(dirfd); return nil })
}

// retire sets the retired flag of the replaced index open at fd, if it is one (ok), so that
// its readers move to the new one, and returns the last session it recorded.
func retire(fd int) (sessions uint32, ok bool) {
	hdr := make([]byte, hdrSessions+4)
	if n, _ := unix.Pread(fd, hdr, 0); n == len(hdr) && string(hdr[:len(indexMagic)]) == indexMagic {
		unix.Pwrite(fd, []byte{1, 0, 0, 0}, hdrRetired)
		return binary.LittleEndian.Uint32(hdr[hdrSessions:]), true
	}
	return 0, false
}

// noteSession records session as the last one begun (writer only).
func (ix *index) noteSession(session uint32) {
	if p := ix.word32(hdrSessions); atomic.LoadUint32(p) < session {
		atomic.StoreUint32(p, session)
	}
}

// errNoIndex reports a tier directory without a usable index (no server has opened it yet,
// or one of another version did).
var errNoIndex = errors.New("no usable index")

// openIndex maps the index of the tier directory dirfd read-only, for a reader, after
// checking that it is a regular file of this user with a header that matches its size.
func openIndex(dirfd int) (*index, error) {
	fd, err := unix.Openat(dirfd, indexName, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errNoIndex, err)
	}
	f := os.NewFile(uintptr(fd), indexName)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%w: %w", errNoIndex, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != euid || st.Size < indexSlots {
		return nil, fmt.Errorf("%w: not a regular file of this user, or too short", errNoIndex)
	}
	m, err := mmap.Map(f, mmap.RDONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: map: %w", errNoIndex, err)
	}
	ix := &index{m: m, buckets: *(*uint32)(unsafe.Pointer(&m[hdrBuckets]))}
	b := ix.buckets
	if string(m[:8]) != indexMagic || *ix.word32(hdrVersion) != indexVersion || *ix.word32(hdrWays) != indexWays ||
		*ix.word32(hdrSlotSize) != indexSlotSize || b < minIndexBuckets || b > maxIndexBuckets || bits.OnesCount32(b) != 1 ||
		int64(len(m)) != indexLen(b) {
		m.Unmap()
		return nil, fmt.Errorf("%w: bad header", errNoIndex)
	}
	return ix, nil
}

// indexView is a reader's current index of a tier directory. It opens the index again when
// the server replaced it (a restart rebuilt it, or it grew), at once, or when there was none
// yet or it could not be opened, at most every indexRetry. Replaced mappings stay mapped
// until close, because lookups in other goroutines may still be reading them; a server
// replaces its index once per start and once per doubling (a few times as a dataset is
// first read).
type indexView struct {
	mu     sync.RWMutex // held shared by lookups; protects cur, old, failed and closed
	cur    *index       // nil until an index could be opened
	old    []*index     // replaced indexes, unmapped by close
	failed time.Time    // when opening last failed
	closed bool
}

// indexRetry is how often a reader tries again to open an index that was missing or bad.
const indexRetry = time.Second

// lookup finds id in the index of the tier directory dirfd.
func (v *indexView) lookup(dirfd int, id entryID) (slot, bool) {
	for try := 0; try < 2; try++ {
		v.mu.RLock()
		ix := v.cur
		var s slot
		var ok, looked bool
		faulted := ix != nil && !v.closed && !readMapped(func() {
			if looked = try > 0 || !ix.retired(); looked {
				s, ok = ix.lookup(id)
			}
		})
		v.mu.RUnlock()
		if faulted {
			v.drop(ix)
			return slot{}, false
		}
		if looked {
			return s, ok
		}
		if !v.reopen(dirfd) {
			return slot{}, false
		}
	}
	return slot{}, false
}

// readMapped runs read, which reads a mapped index, and reports whether it completed: false
// when it faulted. Another process of the user can truncate an index file (FitCache never
// does: a server writes a new one and renames it over), and a read of a page past the new
// end raises SIGBUS, which debug.SetPanicOnFault turns into a panic of this goroutine,
// recovered here, instead of a crash of the program that reads.
func readMapped(read func()) (ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			if _, fault := r.(interface{ Addr() uintptr }); !fault {
				panic(r)
			}
		}
	}()
	read()
	return true
}

// drop lets go of ix, whose mapping faulted: it is never read again (close unmaps it), and
// the index is opened anew at the next lookup (a truncated file is refused: misses until
// the server writes a new one).
func (v *indexView) drop(ix *index) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.cur == ix {
		v.old = append(v.old, ix)
		v.cur, v.failed = nil, time.Time{}
	}
}

// reopen opens the index anew if the current one is missing or retired; it reports whether
// there is an index to look in.
func (v *indexView) reopen(dirfd int) (ok bool) {
	var retired bool
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return false
	}
	if cur := v.cur; cur != nil && readMapped(func() { retired = cur.retired() }) && !retired {
		return true // another goroutine reopened it
	}
	if time.Since(v.failed) < indexRetry {
		return v.cur != nil
	}
	ix, err := openIndex(dirfd)
	if err != nil {
		v.failed = time.Now()
		return v.cur != nil
	}
	if v.cur != nil {
		v.old = append(v.old, v.cur)
	}
	v.cur = ix
	return true
}

// replace makes ix, which the view's writer made in place of the current index, current
// (the server's own view, whose index grew).
func (v *indexView) replace(ix *index) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.cur != nil {
		v.old = append(v.old, v.cur)
	}
	v.cur = ix
}

// hits returns the hit counters of the view's indexes, the current one and those it
// replaced (0 once closed): readers count on the index they mapped, which may be one that
// has grown since. The server's view holds the indexes of its own start and growth only.
func (v *indexView) hits() (n, bytes int64) {
	return v.sum((*index).hits)
}

// sourceReads returns the source read counters of the view's indexes (see hits).
func (v *indexView) sourceReads() (n, bytes int64) {
	return v.sum((*index).sourceReads)
}

func (v *indexView) sum(counts func(*index) (int64, int64)) (n, bytes int64) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	if v.closed {
		return 0, 0
	}
	for _, ix := range append([]*index{v.cur}, v.old...) {
		if ix != nil {
			readMapped(func() {
				a, b := counts(ix)
				n, bytes = n+a, bytes+b
			})
		}
	}
	return n, bytes
}

// close unmaps every index the view mapped; later lookups miss. It is idempotent.
func (v *indexView) close() {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return
	}
	v.closed = true
	for _, ix := range append(v.old, v.cur) {
		if ix != nil {
			ix.unmap()
		}
	}
	v.cur, v.old = nil, nil
}
