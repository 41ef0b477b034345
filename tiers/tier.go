package tiers

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/privdir"
)

// euid is this process's effective user id, which owns every file of its tiers (a server
// never changes it): read once, as os.Geteuid is a system call and copies are opened at
// every read.
var euid = os.Geteuid()

// ErrNoRoom reports that a file does not fit in a tier without eviction (Publish), or at all.
var ErrNoRoom = errors.New("no room in tier")

// Config configures a tier.
type Config struct {
	Dir    string
	Kind   Kind
	Budget string // bytes ("4GiB") or percent of the file system ("80%"); "" = the kind's default
	// CreateParents creates missing parent directories of Dir. Without it the parent must
	// exist, so that a tier configured on a device that is not mounted on this node is
	// skipped instead of silently landing on the root file system.
	CreateParents bool
	// Verify checks the data checksum of every entry at start (rescan) and removes the
	// entries that fail it, so that bytes changed in a tier file are never served.
	Verify bool
	// Holder describes this server (its runtime directory or address) in the tier's lock
	// file, so that a second server can say who holds the directory.
	Holder string
	// FallbackRecord, if set, lets New use a private stand-in directory when Dir is not
	// private (another user created it first, or it is a link): a new directory with a random
	// name beside Dir, whose path is kept in the file FallbackRecord (in the runtime
	// directory) so that a restart finds it again. See privdir.Fallback and Tier.Warning.
	FallbackRecord string
}

// BudgetSize parses the configured budget, or the kind's default when none is given.
func (c Config) BudgetSize() (SizeOrPercent, error) {
	if c.Budget == "" {
		return ParseSize(c.Kind.DefaultBudget())
	}
	return ParseSize(c.Budget)
}

// Info is a snapshot of a tier's state, for statistics and reports.
type Info struct {
	Dir      string `json:"dir"`
	Kind     string `json:"kind"`
	FSType   string `json:"fs_type"`
	Capacity int64  `json:"capacity_bytes"`
	Budget   int64  `json:"budget_bytes"`
	// ConfiguredBudget and LimitedBy, when the budget in force is lower than the configured
	// one, give the configured budget and what lowers it (see Tier.Ceil): "cgroup memory
	// limit", "site memory_per_user", "file system free space"...
	ConfiguredBudget int64  `json:"configured_budget_bytes,omitempty"`
	LimitedBy        string `json:"limited_by,omitempty"`
	Used             int64  `json:"used_bytes"`
	// Writing is the part of Used reserved for files being written, not in the file
	// system yet.
	Writing int64 `json:"writing_bytes,omitempty"`
	Files   int   `json:"files"`
	// IndexEvictions counts files evicted because their bucket of the index was full and the
	// index had grown to its ceiling (see indexBytesPerSlot): many more files than the
	// budget's size suggests.
	IndexEvictions int64 `json:"index_evictions"`
	// IndexBytes is the size of the tier's index file, outside the budget: it grows with the
	// files the tier holds (see indexBytesPerSlot). It includes the next index while one is
	// made ahead of a growth (see Tier.makeNextIndex).
	IndexBytes int64 `json:"index_bytes"`
	// Guests and GuestBytes are the node-local copies of other servers' files it holds
	// (see guest.go), included in Files and Used.
	Guests     int   `json:"guests,omitempty"`
	GuestBytes int64 `json:"guest_bytes,omitempty"`
}

// Tier is the write side of a tier directory, owned by one cache server: it publishes files,
// keeps the byte budget and evicts in FIFO order. It is safe for concurrent use.
type Tier struct {
	Dir
	fsType   string
	capacity int64
	log      *slog.Logger
	verify   bool
	warning  string   // why the tier is not at Config.Dir, or ""
	damaged  []Damage // what the rescan removed
	dirFile  *os.File // the tier directory: every file operation is relative to it (also Dir.dir)
	lock     *os.File // holds the tier's lock (flock) until Close
	closed   sync.Once

	// mu protects budget, configured, fullCap, limitedBy, used, writing, fifo, nextSeq, the
	// index's slots and the fields below that say so.
	mu     sync.Mutex
	budget int64 // the budget in force: the configured one, or lower (see Ceil)
	// configured is the budget of the tier's Config, resolved at start; fullCap, when not
	// 0, is what the tier held when its file system said it was full (ENOSPC, EDQUOT), which
	// it never exceeds again; limitedBy says what lowers the budget in force below the
	// configured one ("" when nothing does).
	configured, fullCap int64
	limitedBy           string
	writing             int64  // bytes of used reserved by files being written (see publishWith)
	used                int64  // bytes of published entries, plus reservations being written
	fifo                fifo   // the entries in publication order
	nextSeq             uint64 // publication sequence number of the next entry
	ix                  *index // the tier's index, written under mu
	shut                bool   // set by Close under mu: ix is unmapped, nothing may write it
	// indexEvictions counts entries evicted because their index bucket was full.
	indexEvictions int64
	// growRetry: the index does not try to grow again before then (a growth failed); nor
	// is its next file made ahead before aheadRetry (that failed). Under mu.
	growRetry, aheadRetry time.Time
	// nextIndex is an index of twice the buckets of ix, made ahead by a goroutine (see
	// aheadOfGrowth) for growIndex to fill and put in place, or nil; makingNext is set while
	// that goroutine runs. Both under mu.
	nextIndex  *indexFile
	makingNext bool
	// background counts the goroutines Close waits for (see inBackground); closing is closed
	// when Close begins, for them to finish at once.
	background sync.WaitGroup
	closing    chan struct{}
	// lastSession is the last validation session the index found at start recorded (see
	// LastSession).
	lastSession uint32
}

// New opens the tier described by cfg: it creates the directory (0700) if needed, refuses
// one that is not private (a link, another user's: see privdir) unless cfg.FallbackRecord
// allows a stand-in, takes the tier's lock (ErrLocked if another server holds it), checks
// that it is writable, resolves the budget against the file system and rescans existing
// content. The caller must Close the tier. A nil logger discards messages.
func New(cfg Config, log *slog.Logger) (*Tier, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.Dir == "" {
		return nil, errors.New("tier directory not set")
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, err
	}
	size, err := cfg.BudgetSize()
	if err != nil {
		return nil, fmt.Errorf("tier %s budget: %w", dir, err)
	}
	d, warning, err := openDir(dir, cfg)
	if err != nil {
		return nil, err
	}
	if warning != "" {
		log.Warn(warning)
		dir = d.Name()
	}
	t := &Tier{
		Dir:     Dir{Path: dir, Kind: cfg.Kind},
		log:     log.With("tier", cfg.Kind.String(), "dir", dir),
		verify:  cfg.Verify,
		warning: warning,
		dirFile: d,
		fifo:    newFIFO(),
		closing: make(chan struct{}),
	}
	if err := t.init(size, cfg.Holder); err != nil {
		t.Close()
		return nil, fmt.Errorf("tier %s: %w", dir, err)
	}
	t.log.Info("tier ready", "fs", t.fsType, "budget", FormatBytes(t.budget),
		"used", FormatBytes(t.used), "files", t.fifo.len())
	return t, nil
}

// openDir opens (creating it if needed) the private tier directory, or its stand-in.
func openDir(dir string, cfg Config) (d *os.File, warning string, err error) {
	d, err = privdir.Make(dir, cfg.CreateParents)
	if err == nil {
		return d, "", nil
	}
	if cfg.FallbackRecord == "" || !errors.Is(err, privdir.ErrNotPrivate) {
		return nil, "", fmt.Errorf("tier %s: %w", dir, err)
	}
	alt, ferr := privdir.Fallback(dir, cfg.FallbackRecord)
	if ferr != nil {
		return nil, "", fmt.Errorf("tier %s: %w; no private stand-in either: %w", dir, err, ferr)
	}
	return alt, fmt.Sprintf("%s tier: %v; using the private directory %s instead", cfg.Kind, err, alt.Name()), nil
}

// init locks the tier, checks it and rescans it.
func (t *Tier) init(size SizeOrPercent, holder string) error {
	err := withFd(t.dirFile, func(dirfd int) error {
		var err error
		if t.lock, err = lockDir(dirfd, t.Path, holder); err != nil {
			return err
		}
		if err := checkWritable(dirfd); err != nil {
			return fmt.Errorf("not writable: %w", err)
		}
		fsi, err := fstatFS(dirfd)
		t.fsType, t.capacity = fsi.Type, fsi.Capacity
		return err
	})
	if err != nil {
		return err
	}
	t.budget = size.Resolve(t.capacity)
	if t.budget <= 0 {
		return fmt.Errorf("budget %s resolves to %d bytes", size, t.budget)
	}
	t.configured = t.budget
	if (t.Kind == Memory) != (FSInfo{Type: t.fsType}).InMemory() {
		t.log.Warn("tier kind does not match its file system: reads will not run at the expected speed",
			"fs", t.fsType)
	}
	if err := t.rescan(); err != nil {
		return fmt.Errorf("rescan: %w", err)
	}
	return nil
}

func checkWritable(dirfd int) error {
	f, name, err := createTemp(dirfd, tempPrefix+"probe-")
	if err != nil {
		return err
	}
	f.Close()
	return unix.Unlinkat(dirfd, name, 0)
}

// Close releases the tier's lock, so that another server may take the directory, and its
// descriptor. The tier must not be used afterwards: Publish fails and Open misses. Close is
// idempotent. The index stays in the directory: readers keep serving what it lists.
func (t *Tier) Close() error {
	var err error
	t.closed.Do(func() {
		t.mu.Lock()
		t.shut = true // before the index is unmapped: writers check it under mu
		t.mu.Unlock()
		close(t.closing)
		t.background.Wait() // started under mu before shut: none starts after it
		t.mu.Lock()
		next := t.nextIndex
		t.nextIndex = nil
		t.mu.Unlock()
		if next != nil {
			withFd(t.dirFile, func(dirfd int) error { next.discard(dirfd); return nil })
		}
		if t.view != nil {
			t.view.close()
		}
		if t.lock != nil {
			err = t.lock.Close()
		}
		if cerr := t.dirFile.Close(); err == nil {
			err = cerr
		}
	})
	return err
}

// Warning says why the tier is not where it was configured (another user's directory was
// there, say), or is "".
func (t *Tier) Warning() string { return t.warning }

// Damaged lists the entries the start-up rescan found unusable and removed: links or
// other users' files planted in the tier, entries of an older format, damaged entries and,
// with Config.Verify, entries whose data no longer match their checksum.
func (t *Tier) Damaged() []Damage { return t.damaged }

// Info returns a snapshot of the tier's state.
func (t *Tier) Info() Info {
	t.mu.Lock()
	defer t.mu.Unlock()
	info := Info{Dir: t.Path, Kind: t.Kind.String(), FSType: t.fsType, Capacity: t.capacity,
		Budget: t.budget, Used: t.used, Writing: t.writing, Files: t.fifo.len(), IndexEvictions: t.indexEvictions}
	if t.ix != nil {
		info.IndexBytes = indexLen(t.ix.buckets)
	}
	if t.nextIndex != nil {
		info.IndexBytes += indexLen(t.nextIndex.ix.buckets)
	}
	if t.budget < t.configured {
		info.ConfiguredBudget, info.LimitedBy = t.configured, t.limitedBy
	}
	for g, l := range t.fifo.groups {
		if _, guest := groupRoot(g); guest {
			info.Guests += l.Len()
		}
	}
	info.GuestBytes = t.fifo.guestBytes
	return info
}

// EntrySize returns the bytes a source file of dataSize bytes takes in a tier: its data and
// its record, each rounded up to whole 4 KiB blocks, as tmpfs and disk file systems store
// them. (The tier's index is outside the budget: see indexBytesPerSlot.)
func EntrySize(sourcePath string, dataSize int64) int64 {
	return blocks(dataSize) + blocks(recordSize(Entry{SourcePath: filepath.Clean(sourcePath)}))
}

func blocks(n int64) int64 { return (n + 4095) &^ 4095 }

// Hits returns the reads, and their bytes, that readers outside the server served from the
// tier themselves (counted in the tier's index).
func (t *Tier) Hits() (n, bytes int64) {
	if t.view == nil {
		return 0, 0
	}
	return t.view.hits()
}

// SourceReads returns the ranges, and their bytes, that readers outside the server read from
// the source of large files because no block held them (counted in the tier's index by the
// preload shim, in the first tier of its server).
func (t *Tier) SourceReads() (n, bytes int64) {
	if t.view == nil {
		return 0, 0
	}
	return t.view.sourceReads()
}

// CanHold reports whether an entry of n bytes fits in the budget at all.
func (t *Tier) CanHold(n int64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return n <= t.budget
}

// HasRoom reports whether an entry of n bytes fits now, without eviction.
func (t *Tier) HasRoom(n int64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.used+n <= t.budget
}

// Open maps the cached copy of sourcePath like Dir.Open, and deletes the copy if it is damaged.
// The mapping's entry also has the identity of the source version the copy holds (the
// change time and inode number that readers' indexes do not carry).
func (t *Tier) Open(sourcePath string) (*Mapping, error) {
	m, err := t.Dir.Open(sourcePath)
	t.opened(sourcePath, m, err)
	return m, err
}

// OpenToSend opens the cached copy of sourcePath like Dir.OpenToSend, and completes and
// checks it as Open does.
func (t *Tier) OpenToSend(sourcePath string) (*Mapping, *os.File, error) {
	m, f, err := t.Dir.OpenToSend(sourcePath)
	t.opened(sourcePath, m, err)
	return m, f, err
}

// opened completes the mapping m of sourcePath with what the tier knows of the source (its
// change time and inode), or deletes the copy if err, the open's, says it is damaged.
func (t *Tier) opened(sourcePath string, m *Mapping, err error) {
	t.removeIfDamaged(sourcePath, err)
	if err != nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if el, ok := t.fifo.byID[idOf(filepath.Clean(sourcePath))]; ok {
		src := el.Value.(*record).source
		m.SourceCTimeNanos, m.SourceIno = src.CTimeNanos, src.Ino
	}
}

// OpenFile opens the cached copy of sourcePath like Dir.OpenFile, and deletes the copy if
// it is damaged.
func (t *Tier) OpenFile(sourcePath string) (*os.File, error) {
	f, err := t.Dir.OpenFile(sourcePath)
	t.removeIfDamaged(sourcePath, err)
	return f, err
}

// removeIfDamaged deletes the copy of sourcePath when err, an open's, says it is damaged.
func (t *Tier) removeIfDamaged(sourcePath string, err error) {
	if errors.Is(err, ErrDamaged) {
		sourcePath = filepath.Clean(sourcePath)
		t.log.Warn("removing damaged cache entry", "source", sourcePath, "err", err)
		t.remove(idOf(sourcePath))
	}
}

// Forget removes the cached copy of sourcePath, if the tier has one: its source is being
// written (a write-open through the preload shim), so the copy is stale or about to be.
func (t *Tier) Forget(sourcePath string) {
	t.remove(idOf(filepath.Clean(sourcePath)))
}

// ForgetBlocks removes the cached blocks of sourcePath (see BlockName), as Forget removes a
// whole copy.
func (t *Tier) ForgetBlocks(sourcePath string) {
	t.mu.Lock()
	ids := t.fifo.blocksOf(filepath.Clean(sourcePath))
	t.mu.Unlock()
	for _, id := range ids {
		t.remove(id)
	}
}

// DropBlocksNotOf removes the cached blocks cut in another size than blockBytes (a server
// started before with another block_size made them) and returns how many it removed: no
// reader asks for them any more, and they would hold their dataset's share of the budget,
// since a dataset's blocks never evict one another.
func (t *Tier) DropBlocksNotOf(blockBytes int64) int {
	var ids []entryID
	t.mu.Lock()
	for _, blocks := range t.fifo.blocks {
		for id := range blocks {
			if t.fifo.byID[id].Value.(*record).blockBytes != blockBytes {
				ids = append(ids, id)
			}
		}
	}
	t.mu.Unlock()
	for _, id := range ids {
		t.remove(id)
	}
	return len(ids)
}

// LastSession returns the last validation session that the server before this one recorded
// in the tier (see NoteSession), or 0: a restarted server numbers its sessions on from it,
// so that a reader of an earlier session never waits for numbers to catch up.
func (t *Tier) LastSession() uint32 { return t.lastSession }

// NoteSession records in the tier's index that validation session was begun.
func (t *Tier) NoteSession(session uint32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.shut {
		t.ix.noteSession(session)
	}
}

// Checked reports whether the tier lists sourcePath and, if it does, whether its copy was
// found to match the source in validation session or a later one (see Validate). It asks
// the index and maps nothing.
func (t *Tier) Checked(sourcePath string, session uint32) (listed, checked bool) {
	s, ok := t.Dir.lookupSlot(idOf(filepath.Clean(sourcePath)))
	return ok, ok && s.checked >= session
}

// Validate compares the identity of the source version the copy of sourcePath holds with
// current, the source's identity now. When they match, the copy is marked checked in
// session (readers of that session, and of earlier ones, then serve it without asking) and
// Validate returns true. When they differ the copy is stale: it is removed, and Validate
// returns false. A tier without a copy returns false.
//
// Sessions are numbered by the server (see core.Engine.BeginSession); a mark never moves
// back to an earlier session.
func (t *Tier) Validate(sourcePath string, current Identity, session uint32) bool {
	id := idOf(filepath.Clean(sourcePath))
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.shut {
		return false
	}
	el, ok := t.fifo.byID[id]
	if !ok {
		return false
	}
	rec := el.Value.(*record)
	if !rec.source.matches(current) {
		t.fifo.remove(id)
		t.ix.remove(id)
		t.used -= rec.size
		t.unlink(rec.rel, rec.ino)
		return false
	}
	t.ix.mark(id, session)
	return true
}

// ValidateBlocks is Validate for every block of the file at sourcePath the tier holds, with
// current the identity of the whole file now: a block that copies that version is marked
// checked in session, one that does not is removed. It returns whether one was removed.
// The blocks of a file are so checked at once, against one look at the file, and a reader
// asks for the check of one block per file and session, not of each.
func (t *Tier) ValidateBlocks(sourcePath string, current Identity, session uint32) (removed bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.shut {
		return false
	}
	for _, id := range t.fifo.blocksOf(filepath.Clean(sourcePath)) {
		rec := t.fifo.byID[id].Value.(*record)
		want := current
		want.Size = max(0, min(rec.blockBytes, current.Size-rec.block*rec.blockBytes))
		if rec.source.matches(want) {
			t.ix.mark(id, session)
			continue
		}
		t.fifo.remove(id)
		t.ix.remove(id)
		t.used -= rec.size
		t.unlink(rec.rel, rec.ino)
		removed = true
	}
	if removed {
	}
	return removed
}

// FullFor reports whether the tier has no room for another file of group: less than two
// blocks are free and every file it holds is of group, which MakeRoom never evicts for it. A
// tier whose room is all taken by files being written is not full: they may fail.
func (t *Tier) FullFor(group string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.used+2*4096 <= t.budget {
		return false
	}
	_, ours := t.fifo.groups[group]
	return ours && len(t.fifo.groups) == 1 // nothing of another group to evict
}

// RoomFor reports whether the tier could take n more bytes of a file of group: they fit in
// its budget, or it holds files of another group, which MakeRoom may evict for them.
// FullFor is the same for a file of a page or two.
func (t *Tier) RoomFor(group string, n int64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.used+n <= t.budget {
		return true
	}
	_, ours := t.fifo.groups[group]
	return len(t.fifo.groups) > 1 || (len(t.fifo.groups) == 1 && !ours)
}

// Listed reports whether the tier's index lists sourcePath (a reader opening it will find
// it, unless it is evicted meanwhile). It maps nothing.
func (t *Tier) Listed(sourcePath string) bool {
	_, ok := t.CachedSize(sourcePath)
	return ok
}

// CachedSize reports whether the tier's index lists sourcePath, and its size. It maps
// nothing.
func (t *Tier) CachedSize(sourcePath string) (int64, bool) {
	return t.Dir.lookup(idOf(filepath.Clean(sourcePath)))
}

// MakeRoom evicts files oldest first until n more bytes fit in the budget, taking none of
// group keep (see Entry.Group; "" protects nothing). Each victim is mapped and handed to
// spill (when not nil) before it is unlinked, so that a caller can move it to a slower tier;
// spill must not keep the mapping. Readers that mapped a victim keep a valid mapping. It
// returns ErrNoRoom if n exceeds the whole budget, or if what is left belongs to keep.
//
// Sparing the group being read is what keeps a dataset larger than the cache from
// thrashing: training reads every file once per epoch, in a new random order, so any set of
// cached files gives the same hits, and replacing them (FIFO, LRU) only adds writes. With
// a fixed order, FIFO would even hit nothing. So the files cached first stay, the others
// are read from the source, once per epoch.
func (t *Tier) MakeRoom(n int64, keep string, spill func(*Mapping)) error {
	for {
		t.mu.Lock()
		if n > t.budget {
			t.mu.Unlock()
			return fmt.Errorf("%w: %s needed, budget %s", ErrNoRoom, FormatBytes(n), FormatBytes(t.budget))
		}
		if t.used+n <= t.budget {
			t.mu.Unlock()
			return nil
		}
		if t.shut {
			t.mu.Unlock()
			return fmt.Errorf("%w: tier closed", ErrNoRoom)
		}
		rec := t.fifo.popOldest(keep)
		if rec == nil { // everything left is being written right now, or is keep's
			t.mu.Unlock()
			return fmt.Errorf("%w: %s in flight or of the dataset being read", ErrNoRoom, FormatBytes(t.used))
		}
		s, _ := t.ix.lookup(rec.id)
		t.ix.remove(rec.id) // readers stop finding it before it goes
		t.mu.Unlock()

		if _, guest := groupRoot(rec.group); spill != nil && !guest { // its owner has a guest's file
			if m, err := t.openRecord(rec.rel); err == nil {
				m.Entry.Session = s.checked // a copy moved keeps its last check
				// The slower tier records a new checksum of what it is given: check the
				// old one first, so that damage is dropped rather than made valid.
				if err := verifyData(m.Bytes(), m.Entry); err == nil {
					spill(m)
				} else {
					t.log.Warn("not spilling a damaged entry", "file", rec.rel, "err", err)
				}
				m.Release()
			}
		}
		t.unlink(rec.rel, rec.ino)
		t.mu.Lock()
		t.used -= rec.size
		t.mu.Unlock()
	}
}

// openRecord maps an entry's data by the path of its data file relative to the tier, with
// what its record says, whatever source it holds.
func (t *Tier) openRecord(rel string) (*Mapping, error) {
	var m *Mapping
	err := withFd(t.dirFile, func(dirfd int) error {
		binfd, name, err := openBin(dirfd, rel, false)
		if err != nil {
			return err
		}
		defer unix.Close(binfd)
		s, err := readRecord(binfd, name)
		if err != nil {
			return err
		}
		f, err := openEntry(dirfd, rel)
		if err != nil {
			return err
		}
		defer f.Close()
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			return err
		}
		if st.Ino != s.ino || st.Size != s.Size {
			return fmt.Errorf("%w: %s does not match its record", errDamaged, rel)
		}
		m, err = mapData(f, filepath.Join(t.Path, rel), t.Kind, s.Entry, st.Ino)
		return err
	})
	return m, err
}

// unlink removes an entry's data file and record by the data file's path relative to the
// tier, unless the file there now is another one than inode ino (a newer copy of the same
// source published meanwhile; ino 0 removes whatever is there); files already gone are no
// error.
func (t *Tier) unlink(rel string, ino uint64) {
	err := withFd(t.dirFile, func(dirfd int) error {
		binfd, name, err := openBin(dirfd, rel, false)
		if err != nil {
			return err
		}
		defer unix.Close(binfd)
		var st unix.Stat_t
		if ino != 0 && unix.Fstatat(binfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Ino != ino {
			return nil
		}
		err = unix.Unlinkat(binfd, name, 0)
		if rerr := unix.Unlinkat(binfd, recordPrefix+name, 0); err == nil || errors.Is(err, fs.ErrNotExist) {
			err = rerr
		}
		return err
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.log.Warn("remove cache entry", "file", rel, "err", err)
	}
}

// Publish writes data as the cached copy of e.SourcePath: to a temporary file first, then
// renamed into place, so readers see either no file or the whole file. It returns ErrNoRoom
// when the entry does not fit without eviction (see MakeRoom). A full file system lowers the
// budget to what the tier holds, so later files go elsewhere.
func (t *Tier) Publish(e Entry, data []byte) error {
	if int64(len(data)) != e.Size {
		return fmt.Errorf("publish %s: have %d bytes, entry says %d", e.SourcePath, len(data), e.Size)
	}
	return t.publish(e, func(w io.Writer) (uint32, error) {
		_, err := w.Write(data)
		return crc32c(data), err
	})
}

// PublishFrom is Publish with the data read from r, which must give exactly e.Size bytes:
// it is copied into the temporary file at most copyChunk bytes at a time, so a large file is
// never held whole in memory. If r gives fewer or more bytes, or fails, nothing is published.
func (t *Tier) PublishFrom(e Entry, r io.Reader) error {
	return t.publish(e, func(w io.Writer) (uint32, error) { return copyExactly(w, r, e.Size) })
}

// copyChunk bounds the memory PublishFrom uses for a file.
const copyChunk = 1 << 20

// copyBuffers holds the buffers of copyExactly: a miss then allocates nothing the garbage
// collector has to scan and free.
var copyBuffers = sync.Pool{New: func() any { b := make([]byte, copyChunk); return &b }}

// copyExactly copies exactly n bytes from r to w and returns their CRC-32C; it fails if r
// ends before n bytes or still has bytes after them.
func copyExactly(w io.Writer, r io.Reader, n int64) (uint32, error) {
	bp := copyBuffers.Get().(*[]byte)
	defer copyBuffers.Put(bp)
	buf := *bp
	var crc uint32
	for done := int64(0); done < n; {
		k, err := io.ReadFull(r, buf[:min(int64(len(buf)), n-done)])
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				return 0, fmt.Errorf("%w: source ended after %d bytes", ErrShortSource, done+int64(k))
			}
			return 0, err
		}
		crc = crc32.Update(crc, castagnoli, buf[:k])
		if _, err := w.Write(buf[:k]); err != nil {
			return 0, err
		}
		done += int64(k)
	}
	switch k, err := io.ReadFull(r, buf[:1]); {
	case k > 0:
		return 0, fmt.Errorf("%w: source has more than %d bytes", ErrShortSource, n)
	case err != nil && !errors.Is(err, io.EOF):
		return 0, err
	}
	return crc, nil
}

// ErrShortSource reports that the reader given to PublishFrom did not give exactly the
// entry's size.
var ErrShortSource = errors.New("source size differs from the entry's")

// publish reserves room for e, writes it with fill (which writes the data and returns its
// checksum), then lists it in the index and the FIFO order.
func (t *Tier) publish(e Entry, fill func(io.Writer) (uint32, error)) error {
	return t.publishWith(e, 0, func(dirfd int, rel string, s stored) (stored, error) { return write(dirfd, rel, s, fill) })
}

// publishWith is publish with the entry's data file and record made by put, which returns s
// with the data file's checksum and inode number (write, or Adopt's rename of a fill file).
// reserved is the room reserved for the entry already (see reserve: Claim.Fill), or 0; it is
// taken over, kept for the entry or given back.
func (t *Tier) publishWith(e Entry, reserved int64, put func(dirfd int, rel string, s stored) (stored, error)) error {
	e.SourcePath = filepath.Clean(e.SourcePath)
	rel := RelPath(e.SourcePath)
	n := EntrySize(e.SourcePath, e.Size)

	t.mu.Lock()
	if reserved > 0 && reserved != n { // the reservation of another size: given back
		t.used -= reserved
		t.writing -= reserved
		reserved = 0
	}
	if t.shut {
		t.used -= reserved
		t.writing -= reserved
		t.mu.Unlock()
		return fmt.Errorf("publish %s in %s: %w", e.SourcePath, t.Path, os.ErrClosed)
	}
	if reserved == 0 && t.used+n > t.budget {
		t.mu.Unlock()
		return ErrNoRoom
	}
	if reserved == 0 {
		t.used += n // reserved while writing
		t.writing += n
	}
	seq := t.nextSeq
	t.nextSeq++
	t.mu.Unlock()

	var s stored
	err := withFd(t.dirFile, func(dirfd int) (err error) {
		s, err = put(dirfd, rel, stored{Entry: e, seq: seq})
		return err
	})
	t.mu.Lock()
	defer t.mu.Unlock()
	t.writing -= n
	if err != nil {
		t.used -= n
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
			t.lowerToUse()
			return fmt.Errorf("%w: %w", ErrNoRoom, err)
		}
		return fmt.Errorf("publish %s in %s: %w", e.SourcePath, t.Path, err)
	}
	if t.shut {
		t.used -= n
		return fmt.Errorf("publish %s in %s: %w", e.SourcePath, t.Path, os.ErrClosed)
	}
	id := idOf(e.SourcePath)
	if old, ok := t.fifo.remove(id); ok { // replaced an older copy of the same file
		t.used -= old.size
	}
	t.fifo.push((&record{rel: rel, id: id, size: n, seq: s.seq, group: e.Group, ino: s.ino,
		source: e.Identity()}).setBlock(e.SourcePath))
	t.index(s, id)
	return nil
}

// lowerToUse lowers the budget to what the tier holds (t.mu held): its file system is full.
func (t *Tier) lowerToUse() {
	t.log.Warn("file system full: lowering budget to current use", "budget", FormatBytes(t.used))
	t.fullCap = max(t.used, 1)
	t.budget, t.limitedBy = t.used, "file system full"
	t.dropNextIndex()
}

// noSpace is lowerToUse for a caller that does not hold t.mu.
func (t *Tier) noSpace() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lowerToUse()
}

// reserve reserves n bytes of the budget for a file about to be written outside publish (a
// fill file: Claim.Fill), as publishWith reserves them, and reports whether they fit.
func (t *Tier) reserve(n int64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.shut || t.used+n > t.budget {
		return false
	}
	t.used += n
	t.writing += n
	return true
}

// unreserve gives back what reserve reserved.
func (t *Tier) unreserve(n int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.used -= n
	t.writing -= n
}

// index lists an entry in the index (t.mu held). When the entry's bucket is full, the index
// grows (see indexBytesPerSlot); at its ceiling, the bucket's oldest entry is evicted to make
// way.
func (t *Tier) index(s stored, id entryID) {
	for !t.ix.fits(id) && t.ix.buckets < indexCeiling(t.budget) && time.Now().After(t.growRetry) {
		if err := t.growIndex(); err != nil {
			t.growRetry = time.Now().Add(growRetry)
			t.log.Warn("could not grow the tier's index: a full bucket evicts its oldest file", "err", err,
				"buckets", t.ix.buckets, "retry_in", growRetry)
		}
	}
	victim, evicted := t.ix.put(slotOf(s, id))
	t.aheadOfGrowth()
	if !evicted {
		return
	}
	rec, ok := t.fifo.remove(victim.id)
	if !ok {
		return
	}
	t.used -= rec.size
	t.indexEvictions++
	t.unlink(rec.rel, rec.ino)
}

// slotOf returns the index slot that lists s under id.
func slotOf(s stored, id entryID) slot {
	return slot{id: id, size: s.Size, mtime: s.MTimeNanos, ino: s.ino, checksum: s.Checksum, checked: s.Session,
		pubSeq: s.seq, srcIno: s.SourceIno, srcCtime: s.SourceCTimeNanos}
}

// listFound puts into ix each entry of found (in publication order) that its bucket has room
// for, newest first, before ix is renamed into place: readers move to a new index as soon as
// it is there, and one that found it empty while rescan listed the entries one by one missed
// every cached file and read it from the source again. An entry older than the entries of
// its full bucket is not listed: rescan evicts it, as a full bucket evicts its oldest.
func listFound(ix *index, found []found) {
	for i := len(found) - 1; i >= 0; i-- {
		if id := idOf(found[i].SourcePath); ix.fits(id) {
			ix.put(slotOf(found[i].stored, id))
		}
	}
}

// bucketsToList returns the buckets of an index that lists the entries found at a start: the
// fewest, from one per entry (bucketsFor) up to the ceiling, that leave no bucket more
// entries than its slots (at the ceiling some may have more).
func bucketsToList(found []found, ceiling uint32) uint32 {
	keys := make([]Key, len(found))
	for i, f := range found {
		keys[i] = KeyOf(f.SourcePath)
	}
	buckets := bucketsFor(int64(len(found)), ceiling)
	for ; buckets < ceiling; buckets *= 2 {
		ix, counts := index{buckets: buckets}, make([]uint8, buckets)
		over := false
		for _, k := range keys {
			b := ix.bucketOf(k)
			if counts[b]++; counts[b] > indexWays {
				over = true
				break
			}
		}
		if !over {
			break
		}
	}
	return buckets
}

// growRetry is how long a tier whose index could not grow (its file system full, say) waits
// before it tries again; meanwhile full buckets evict.
const growRetry = time.Minute

// growIndex replaces the index by one of twice the buckets listing the same entries (t.mu
// held, so that nothing is published meanwhile). Readers move to it as they do to a
// restarted server's (see indexFile.install). Publishing waits meanwhile, so the new file is made
// ahead where it can be (see aheadOfGrowth) and the old one's pages are given back after:
// growing then copies the entries and renames the file: on the 2-core VM 3.3 ms for 16,384
// entries, 26 ms for 131,072 and 109 ms for 524,288 (BenchmarkIndexGrowth, medians), against
// 14, 111 and 429 ms with the file made then, and 17, 120 and 476 ms when the growth made it
// and gave back the old one's pages with the lock held (docs/BENCHMARKS.md section 31).
func (t *Tier) growIndex() error {
	old := t.ix
	next := t.nextIndex
	t.nextIndex = nil
	if next != nil && next.ix.buckets != old.buckets*2 {
		t.discardLater(next)
		next = nil
	}
	var retired retiredIndex
	err := withFd(t.dirFile, func(dirfd int) error {
		if next == nil { // none made ahead (not yet, or it could not be)
			var err error
			if next, err = newIndexFile(dirfd, old.buckets*2); err != nil {
				return err
			}
		}
		old.copyTo(next.ix)
		var err error
		// The server's own view moves before the old index is retired: a lookup of its own
		// that met the flag first would map the new file a second time, read-only.
		_, retired, err = next.install(dirfd, t.view.replace)
		return err
	})
	if err != nil {
		return err
	}
	t.ix = next.ix
	t.log.Debug("tier index grew", "buckets", t.ix.buckets, "files", t.fifo.len())
	t.inBackground(func() { retired.giveBackAfter(t.dirFile, t.closing) }) // 70 ms for 335 MB
	return nil
}

// aheadOfGrowth starts making the file of the index's next growth (see makeNextIndex) once
// a bucket is full (t.mu held): the next put to that bucket makes the index grow. Making the
// file is the most of a growth's time (its memory: 315 ms of 450 for a million buckets),
// and publishing need not wait for it. A bucket first fills at 0.5 to 2.8 entries per bucket
// (1,024 to a million buckets, three runs each), and first overflows at 1.0 to 2.1 times
// that load: the file made ahead waits that long, at twice the index's size, and a growth
// that comes first makes its file then, as all did before.
func (t *Tier) aheadOfGrowth() {
	buckets := t.ix.buckets
	if !t.ix.sawFull || t.nextIndex != nil || t.makingNext || buckets >= indexCeiling(t.budget) ||
		!time.Now().After(t.growRetry) || !time.Now().After(t.aheadRetry) {
		return
	}
	t.makingNext = true
	t.inBackground(func() { t.makeNextIndex(buckets * 2) })
}

// makeNextIndex makes an index file of the given buckets, not yet in place, and keeps it as
// t.nextIndex if the index still has half its buckets. It makes none where the file system
// has less free room than twice the file: allocating it takes the room for a moment even
// when it fails, and a copy written meanwhile would find none. One it does not make is
// tried again a minute later, and meanwhile left to growIndex.
func (t *Tier) makeNextIndex(buckets uint32) {
	var next *indexFile
	err := withFd(t.dirFile, func(dirfd int) error {
		var st unix.Statfs_t
		if err := unix.Fstatfs(dirfd, &st); err != nil {
			return err
		}
		if free, size := int64(st.Bavail)*st.Bsize, indexLen(buckets); free < 2*size {
			return fmt.Errorf("%s free, want twice the index's %s: %w", FormatBytes(free), FormatBytes(size), unix.ENOSPC)
		}
		var err error
		next, err = newIndexFile(dirfd, buckets)
		return err
	})
	t.mu.Lock()
	t.makingNext = false
	unwanted := err != nil || buckets > indexCeiling(t.budget) || time.Now().Before(t.aheadRetry) // see dropNextIndex
	keep := !unwanted && !t.shut && t.ix.buckets*2 == buckets
	if keep {
		t.nextIndex = next
	}
	if unwanted {
		t.aheadRetry = time.Now().Add(growRetry)
	} else if !keep && !t.shut {
		t.aheadOfGrowth() // the index outgrew it: one for its size, if a bucket is full
	}
	t.mu.Unlock()
	switch {
	case err != nil:
		t.log.Debug("could not make the tier's next index ahead of its growth", "err", err, "buckets", buckets)
	case !keep:
		withFd(t.dirFile, func(dirfd int) error { next.discard(dirfd); return nil })
	}
}

// dropNextIndex discards the next index made ahead, if any, and makes none for a minute
// (t.mu held): its file system is full, or the budget no longer lets the index grow to it
// (and a budget that moves about that ceiling would make and drop one again and again).
func (t *Tier) dropNextIndex() {
	if t.nextIndex != nil && !t.shut {
		t.discardLater(t.nextIndex)
		t.nextIndex = nil
	}
	t.aheadRetry = time.Now().Add(growRetry)
}

// discardLater discards n in a goroutine (t.mu held, the tier open): unmapping and removing
// a file of up to 640 MiB takes tens of milliseconds that publishing need not wait for.
func (t *Tier) discardLater(n *indexFile) {
	t.inBackground(func() {
		withFd(t.dirFile, func(dirfd int) error { n.discard(dirfd); return nil })
	})
}

// inBackground runs fn in a goroutine that Close waits for. It must be called with t.mu held
// and the tier open (not t.shut), so that no such goroutine starts after Close's wait.
func (t *Tier) inBackground(fn func()) {
	t.background.Add(1)
	go func() {
		defer t.background.Done()
		fn()
	}()
}

// write creates the entry rel below dirfd: the data into a new temporary file (0600,
// O_EXCL, in bins opened without following links) whose times are set to the source's
// modification time, renamed into place, then its record beside it. It returns s with the
// data file's checksum and inode number.
func write(dirfd int, rel string, s stored, fill func(io.Writer) (uint32, error)) (stored, error) {
	binfd, name, err := openBin(dirfd, rel, true)
	if err != nil {
		return s, err
	}
	defer unix.Close(binfd)
	f, tmp, err := createTemp(binfd, tempPrefix)
	if err != nil {
		return s, err
	}
	s.Checksum, err = fill(f)
	if err == nil {
		s.ino, err = finishData(int(f.Fd()), s.MTimeNanos, s.Mode)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		unix.Unlinkat(binfd, tmp, 0)
		return s, err
	}
	if err = unix.Renameat(binfd, tmp, binfd, name); err != nil {
		return s, err
	}
	return s, writeRecord(binfd, name, s)
}

// writeRecord writes the record of the data file name in the bin binfd. The record is
// written in place, after the data: readers never read it (they use the index), and one that
// a crash left short or stale fails its checksum or names another inode, so a rescan removes
// the entry. On failure the data file is removed too.
func writeRecord(binfd int, name string, s stored) error {
	fd, err := unix.Openat(binfd, recordPrefix+name, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, entryMode)
	if err != nil {
		unix.Unlinkat(binfd, name, 0)
		return err
	}
	rec := appendRecord(nil, s)
	n, err := unix.Write(fd, rec)
	if cerr := unix.Close(fd); err == nil {
		err = cerr
	}
	if err == nil && n != len(rec) {
		err = io.ErrShortWrite
	}
	if err != nil {
		unix.Unlinkat(binfd, name, 0)
		unix.Unlinkat(binfd, recordPrefix+name, 0)
	}
	return err
}

// finishData sets a written data file's access and modification times to the source's
// modification time and its permission bits to the source's (so that fstat of the cached
// copy agrees with stat of the source; the tier directory keeps it private whatever its
// mode) and returns its inode number.
func finishData(fd int, mtimeNanos int64, mode fs.FileMode) (ino uint64, err error) {
	var st unix.Stat_t
	err = finishDataStat(fd, mtimeNanos, mode, &st)
	return st.Ino, err
}

// finishDataStat is finishData returning the data file's whole status in st.
func finishDataStat(fd int, mtimeNanos int64, mode fs.FileMode, st *unix.Stat_t) error {
	ts := unix.NsecToTimespec(mtimeNanos)
	if perm := dataPerm(mode); perm != entryMode { // created with entryMode
		if err := unix.Fchmod(fd, perm); err != nil {
			return fmt.Errorf("set mode: %w", err)
		}
	}
	if err := unix.UtimesNanoAt(fd, "", []unix.Timespec{ts, ts}, unix.AT_EMPTY_PATH); err != nil {
		if err := unix.Futimes(fd, []unix.Timeval{unix.NsecToTimeval(mtimeNanos), unix.NsecToTimeval(mtimeNanos)}); err != nil {
			return fmt.Errorf("set times: %w", err)
		}
	}
	return unix.Fstat(fd, st)
}

// dataPerm returns the permission bits finishData gives a data file of a source with mode:
// the source's, with read permission for its owner added; entryMode for a mode of 0.
func dataPerm(mode fs.FileMode) uint32 {
	if mode == 0 {
		return entryMode
	}
	return uint32(mode.Perm()) | 0o400
}

// finished reports whether a data file whose status is st has the modification time and
// permission bits finishData would give it (a reader's fill file whose reader set them:
// capi/fill.c fc_fill_finish).
func finished(st *unix.Stat_t, mtimeNanos int64, mode fs.FileMode) bool {
	return st.Mtim.Nano() == mtimeNanos && uint32(st.Mode)&0o7777 == dataPerm(mode)
}

// remove deletes a cached entry and its accounting.
func (t *Tier) remove(id entryID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.shut {
		return
	}
	rec, ok := t.fifo.remove(id)
	if !ok {
		return
	}
	t.ix.remove(id)
	t.used -= rec.size
	t.unlink(rec.rel, 0) // what is there is damaged, whatever its inode
}

// rescan rebuilds usage and FIFO order (by publication sequence number) from the records in
// the directory, removes leftover temporary files and whatever must not be served (see
// scan), writes a new index listing the entries (readers of the old one move to it), and
// evicts the oldest entries if the content exceeds the budget (after the budget was
// lowered, say).
func (t *Tier) rescan() error {
	s := scan{root: t.Path, verify: t.verify, fix: true}
	var found []found
	var retired retiredIndex
	err := withFd(t.dirFile, func(dirfd int) error {
		if err := s.run(dirfd); err != nil {
			return err
		}
		found = s.sorted()
		// Sized to list them all where the ceiling allows: the index does not grow while it
		// is being listed, and what it cannot list is evicted.
		least, buckets := bucketsFor(int64(len(found)), indexCeiling(t.budget)), bucketsToList(found, indexCeiling(t.budget))
		next, err := newIndexFile(dirfd, buckets)
		for b := buckets / 2; err != nil && b >= least; b /= 2 {
			// No room for that many beside the old index: the largest that fits, which does
			// not try to grow before growRetry (its full buckets evict their oldest meanwhile).
			t.log.Warn("no room for the tier's index: full buckets evict their oldest file", "err", err,
				"buckets", buckets, "retry_in", growRetry)
			t.growRetry = time.Now().Add(growRetry)
			next, err = newIndexFile(dirfd, b)
		}
		if err != nil {
			return err
		}
		listFound(next.ix, found)
		sessions, old, err := next.install(dirfd, nil)
		if err != nil {
			return err
		}
		t.ix, t.lastSession, retired = next.ix, sessions, old
		return nil
	})
	if err != nil {
		return err
	}
	t.Dir.dir, t.Dir.view = t.dirFile, &indexView{cur: t.ix}
	t.mu.Lock()
	t.inBackground(func() { retired.giveBackAfter(t.dirFile, t.closing) })
	for _, f := range found {
		id := idOf(f.SourcePath)
		if _, listed := t.ix.lookup(id); !listed {
			// Older than every entry of its full bucket, in an index that cannot grow for it:
			// evicted, as a full bucket evicts its oldest.
			t.indexEvictions++
			t.unlink(f.rel, f.ino)
			continue
		}
		t.fifo.push((&record{rel: f.rel, id: id, size: f.size, seq: f.seq, group: f.Group, ino: f.ino,
			source: f.Identity()}).setBlock(f.SourcePath))
		t.used += f.size
		t.nextSeq = max(t.nextSeq, f.seq+1)
	}
	t.aheadOfGrowth()
	t.mu.Unlock()
	t.damaged = s.damaged
	if s.temps > 0 {
		t.log.Info("removed leftover temporary files", "count", s.temps)
	}
	for _, d := range s.damaged {
		t.log.Warn("removed unusable cache entry", "file", d.Rel, "err", d.Err)
	}
	if t.used > t.budget {
		t.log.Info("content exceeds budget: evicting oldest", "used", FormatBytes(t.used))
		return t.MakeRoom(0, "", nil)
	}
	return nil
}

// isBinName reports whether name is a two-hex-digit hash-bin directory name.
func isBinName(name string) bool {
	if len(name) != 2 {
		return false
	}
	_, err := strconv.ParseUint(name, 16, 8)
	return err == nil
}
