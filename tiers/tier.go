package tiers

import (
	"container/list"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"time"
)

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
	// OnRemove, if set, is called after a published file was unlinked (evicted or damaged),
	// so that readers keeping mappings can learn of it (see Generation).
	OnRemove func()
}

// Info is a snapshot of a tier's state, for statistics and reports.
type Info struct {
	Dir      string `json:"dir"`
	Kind     string `json:"kind"`
	FSType   string `json:"fs_type"`
	Capacity int64  `json:"capacity_bytes"`
	Budget   int64  `json:"budget_bytes"`
	Used     int64  `json:"used_bytes"`
	Files    int    `json:"files"`
}

// Tier is the write side of a tier directory, owned by one cache server: it publishes files,
// keeps the byte budget and evicts in FIFO order. It is safe for concurrent use.
type Tier struct {
	Dir
	fsType   string
	capacity int64
	log      *slog.Logger
	onRemove func()

	mu     sync.Mutex // protects budget, used, fifo and byRel
	budget int64
	used   int64                    // bytes of published files, plus reservations being written
	fifo   list.List                // of *record, oldest first
	byRel  map[string]*list.Element // relative path -> element of fifo
}

type record struct {
	rel  string // path relative to the tier directory
	size int64  // file size, trailer included
}

// New opens the tier described by cfg: it creates the directory (0700) if needed, checks that
// it is writable, resolves the budget against the file system and rescans existing content.
// A nil logger discards messages.
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
	budgetText := cfg.Budget
	if budgetText == "" {
		budgetText = cfg.Kind.DefaultBudget()
	}
	size, err := ParseSize(budgetText)
	if err != nil {
		return nil, fmt.Errorf("tier %s budget: %w", dir, err)
	}
	mkdir := os.Mkdir
	if cfg.CreateParents {
		mkdir = os.MkdirAll
	}
	if err := mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("create tier %s: %w", dir, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("tier %s: %w", dir, err)
	}
	if err := checkWritable(dir); err != nil {
		return nil, fmt.Errorf("tier %s is not writable: %w", dir, err)
	}
	fsi, err := StatFS(dir)
	if err != nil {
		return nil, fmt.Errorf("tier %s: %w", dir, err)
	}
	t := &Tier{
		Dir:      Dir{Path: dir, Kind: cfg.Kind},
		fsType:   fsi.Type,
		capacity: fsi.Capacity,
		log:      log.With("tier", cfg.Kind.String(), "dir", dir),
		onRemove: cfg.OnRemove,
		budget:   size.Resolve(fsi.Capacity),
		byRel:    make(map[string]*list.Element),
	}
	if t.budget <= 0 {
		return nil, fmt.Errorf("tier %s: budget %s resolves to %d bytes", dir, size, t.budget)
	}
	if (cfg.Kind == Memory) != (fsi.Type == "tmpfs" || fsi.Type == "ramfs") {
		t.log.Warn("tier kind does not match its file system: reads will not run at the expected speed",
			"fs", fsi.Type)
	}
	if err := t.rescan(); err != nil {
		return nil, fmt.Errorf("rescan tier %s: %w", dir, err)
	}
	t.log.Info("tier ready", "fs", t.fsType, "budget", FormatBytes(t.budget),
		"used", FormatBytes(t.used), "files", t.fifo.Len())
	return t, nil
}

func checkWritable(dir string) error {
	f, err := os.CreateTemp(dir, tempPrefix+"probe-")
	if err != nil {
		return err
	}
	f.Close()
	return os.Remove(f.Name())
}

// Info returns a snapshot of the tier's state.
func (t *Tier) Info() Info {
	t.mu.Lock()
	defer t.mu.Unlock()
	return Info{Dir: t.Path, Kind: t.Kind.String(), FSType: t.fsType, Capacity: t.capacity,
		Budget: t.budget, Used: t.used, Files: t.fifo.Len()}
}

// EntrySize returns the bytes a source file of dataSize bytes takes in a tier.
func EntrySize(sourcePath string, dataSize int64) int64 {
	return dataSize + trailerSize(filepath.Clean(sourcePath))
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
func (t *Tier) Open(sourcePath string) (*Mapping, error) {
	m, err := t.Dir.Open(sourcePath)
	if err != nil && errors.Is(err, ErrDamaged) {
		t.log.Warn("removing damaged cache entry", "source", sourcePath, "err", err)
		t.remove(RelPath(filepath.Clean(sourcePath)))
	}
	return m, err
}

// MakeRoom evicts files oldest first until n more bytes fit in the budget. Each victim is
// mapped and handed to spill (when not nil) before it is unlinked, so that a caller can move
// it to a slower tier; spill must not keep the mapping. Readers that mapped a victim keep a
// valid mapping. It returns ErrNoRoom if n exceeds the whole budget.
func (t *Tier) MakeRoom(n int64, spill func(*Mapping)) error {
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
		front := t.fifo.Front()
		if front == nil { // everything left is being written right now
			t.mu.Unlock()
			return fmt.Errorf("%w: %s in flight", ErrNoRoom, FormatBytes(t.used))
		}
		rec := t.fifo.Remove(front).(*record)
		delete(t.byRel, rec.rel)
		t.mu.Unlock()

		path := filepath.Join(t.Path, rec.rel)
		if spill != nil {
			if m, err := t.openRecord(path); err == nil {
				spill(m)
				m.Release()
			}
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.log.Warn("evict", "file", path, "err", err)
		}
		t.removed()
		t.mu.Lock()
		t.used -= rec.size
		t.mu.Unlock()
	}
}

// openRecord maps a file by its path in the tier, whatever source it holds.
func (t *Tier) openRecord(path string) (*Mapping, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	m, err := mapFile(f)
	if err != nil {
		return nil, err
	}
	e, err := readTrailer(m)
	if err != nil {
		m.Unmap()
		return nil, err
	}
	return &Mapping{Entry: e, Tier: t.Kind, Path: path, m: m}, nil
}

// Publish writes data as the cached copy of e.SourcePath: to a temporary file first, then
// renamed into place, so readers see either no file or the whole file. It returns ErrNoRoom
// when the entry does not fit without eviction (see MakeRoom). A full file system lowers the
// budget to what the tier holds, so later files go elsewhere.
func (t *Tier) Publish(e Entry, data []byte) error {
	e.SourcePath = filepath.Clean(e.SourcePath)
	if int64(len(data)) != e.Size {
		return fmt.Errorf("publish %s: have %d bytes, entry says %d", e.SourcePath, len(data), e.Size)
	}
	rel := RelPath(e.SourcePath)
	n := EntrySize(e.SourcePath, e.Size)

	t.mu.Lock()
	if t.used+n > t.budget {
		t.mu.Unlock()
		return ErrNoRoom
	}
	t.used += n // reserved while writing
	t.mu.Unlock()

	err := t.write(rel, e, data)
	t.mu.Lock()
	defer t.mu.Unlock()
	if err != nil {
		t.used -= n
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
			t.log.Warn("file system full: lowering budget to current use", "budget", FormatBytes(t.used))
			t.budget = t.used
			return fmt.Errorf("%w: %w", ErrNoRoom, err)
		}
		return err
	}
	if old, ok := t.byRel[rel]; ok { // replaced an older copy of the same file
		t.used -= old.Value.(*record).size
		t.fifo.Remove(old)
	}
	t.byRel[rel] = t.fifo.PushBack(&record{rel: rel, size: n})
	return nil
}

func (t *Tier) write(rel string, e Entry, data []byte) error {
	final := filepath.Join(t.Path, rel)
	binDir := filepath.Dir(final)
	if err := os.MkdirAll(binDir, 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(binDir, tempPrefix)
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, err = f.Write(data)
	if err == nil {
		_, err = f.Write(appendTrailer(nil, e))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, final)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("publish %s in %s: %w", e.SourcePath, t.Path, err)
	}
	return nil
}

// remove deletes a cached file and its accounting.
func (t *Tier) remove(rel string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := os.Remove(filepath.Join(t.Path, rel)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.log.Warn("remove", "file", rel, "err", err)
	}
	if el, ok := t.byRel[rel]; ok {
		t.used -= el.Value.(*record).size
		t.fifo.Remove(el)
		delete(t.byRel, rel)
	}
	t.removed()
}

func (t *Tier) removed() {
	if t.onRemove != nil {
		t.onRemove()
	}
}

// rescan rebuilds usage and FIFO order (by modification time, the time of publication) from
// the directory, deletes leftover temporary files, and evicts the oldest files if the content
// exceeds the budget (after the budget was lowered, say).
func (t *Tier) rescan() error {
	type found struct {
		rel   string
		size  int64
		mtime time.Time
	}
	var files []found
	temps := 0
	bins1, err := os.ReadDir(t.Path)
	if err != nil {
		return err
	}
	for _, b1 := range bins1 {
		if isTempName(b1.Name()) {
			os.Remove(filepath.Join(t.Path, b1.Name()))
			temps++
			continue
		}
		if !b1.IsDir() || !isBinName(b1.Name()) {
			continue
		}
		bins2, err := os.ReadDir(filepath.Join(t.Path, b1.Name()))
		if err != nil {
			return err
		}
		for _, b2 := range bins2 {
			if !b2.IsDir() || !isBinName(b2.Name()) {
				continue
			}
			binRel := filepath.Join(b1.Name(), b2.Name())
			ents, err := os.ReadDir(filepath.Join(t.Path, binRel))
			if err != nil {
				return err
			}
			for _, ent := range ents {
				rel := filepath.Join(binRel, ent.Name())
				if isTempName(ent.Name()) {
					os.Remove(filepath.Join(t.Path, rel))
					temps++
					continue
				}
				fi, err := ent.Info()
				if err != nil || !fi.Mode().IsRegular() {
					continue
				}
				files = append(files, found{rel, fi.Size(), fi.ModTime()})
			}
		}
	}
	sort.Slice(files, func(i, j int) bool {
		if !files[i].mtime.Equal(files[j].mtime) {
			return files[i].mtime.Before(files[j].mtime)
		}
		return files[i].rel < files[j].rel
	})
	for _, f := range files {
		t.byRel[f.rel] = t.fifo.PushBack(&record{rel: f.rel, size: f.size})
		t.used += f.size
	}
	if temps > 0 {
		t.log.Info("removed leftover temporary files", "count", temps)
	}
	if t.used > t.budget {
		t.log.Info("content exceeds budget: evicting oldest", "used", FormatBytes(t.used))
		return t.MakeRoom(0, nil)
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
