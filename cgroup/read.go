package cgroup

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"sync"
	"syscall"
	"unsafe"
)

// maxFile bounds how far a file's buffer grows; memory.stat is a few KiB.
const maxFile = 1 << 20

// scratch is one Read's buffers, pooled so that a poll every 100 ms makes no garbage.
type scratch struct {
	file []byte               // a file's contents
	dirs [maxDepth + 1][]byte // directory entries, one buffer per depth of the walk
}

var scratches = sync.Pool{New: func() any { return &scratch{file: make([]byte, 8192)} }}

// Read reads the binding level (see Usage). It reads each level's limits (v1
// memory.limit_in_bytes; v2 memory.max and memory.high), and for each level with a limit
// its usage and memory.stat; then the counters of the outermost level with a limit (v2
// memory.events), or on v1 each limited level's memory.failcnt and memory.oom_control of
// every cgroup in the outermost one's subtree.
func (m *Memory) Read() (Usage, error) {
	s := scratches.Get().(*scratch)
	defer scratches.Put(s)
	u, err := m.read(s)
	if err != nil {
		return Usage{}, fmt.Errorf("cgroup %s: %w", m.dir, err)
	}
	return u, nil
}

func (m *Memory) read(s *scratch) (Usage, error) {
	best := Usage{Limit: NoLimit}
	var room int64 = math.MaxInt64
	outer := -1 // the outermost level with a limit
	var hits uint64
	for i := range m.levels {
		lv := &m.levels[i]
		limit, err := readLimit(lv.limits, &s.file)
		if err != nil {
			return Usage{}, err
		}
		u := Usage{Limit: limit}
		if lv.above || limit != NoLimit {
			if err := m.readLevel(lv, &s.file, &u); err != nil {
				return Usage{}, err
			}
		}
		if u.Limit == NoLimit {
			continue
		}
		// Ties go to the outer level: its usage includes the inner one's.
		if r := u.Limit - u.Unreclaimable(); r <= room {
			best, room = u, r
		}
		outer = i
		if m.version == 1 {
			n, err := readInt(lv.events, &s.file)
			if optional(err) != nil {
				return Usage{}, err
			}
			hits += uint64(n)
		}
	}
	if outer < 0 {
		outer = 0
		if err := m.readLevel(&m.levels[0], &s.file, &best); err != nil {
			return Usage{}, err
		}
		best.Limit = NoLimit
		if m.version == 1 {
			n, err := readInt(m.levels[0].events, &s.file)
			if optional(err) != nil {
				return Usage{}, err
			}
			hits = uint64(n)
		}
	}
	best.LimitHits = hits
	if err := m.readCounters(&m.levels[outer], s, &best); err != nil {
		return Usage{}, err
	}
	return best, nil
}

// readLevel reads lv's usage, File and Shmem into u, and lowers u.Limit to the
// hierarchical limit where lv.above.
func (m *Memory) readLevel(lv *level, bp *[]byte, u *Usage) error {
	u.Level = lv.dir
	var err error
	if u.Usage, err = readInt(lv.usage, bp); err != nil {
		return err
	}
	k := stat2Keys
	if m.version == 1 {
		k = stat1Keys
		if !lv.above {
			k.limit = ""
		}
	}
	return readStat(lv.stat, bp, u, k)
}

// readCounters reads u's OOMKills (and on v2 LimitHits) for the subtree of lv.
func (m *Memory) readCounters(lv *level, s *scratch, u *Usage) error {
	count := func(key string, val uint64) {
		switch key {
		case "max":
			u.LimitHits += val
		case "oom_kill":
			u.OOMKills += val
		}
	}
	switch {
	case m.version == 1:
		return walk(lv.dir, oomControl, s, count, "oom_kill")
	case m.local:
		return walk(lv.dir, memoryEvents, s, count, "max", "oom_kill")
	}
	data, err := readFile(lv.events, &s.file)
	if err != nil {
		return optional(err)
	}
	if err := eachLine(data, count, "max", "oom_kill"); err != nil {
		return fmt.Errorf("%s: %w", lv.events.name, err)
	}
	return nil
}

// readLimit returns the smallest of the limits in files, NoLimit when none has one: "max"
// (v2) or v1's huge "no limit" number.
func readLimit(files []file, bp *[]byte) (int64, error) {
	limit := NoLimit
	for _, f := range files {
		data, err := readFile(f, bp)
		if err != nil {
			return 0, err
		}
		data = bytes.TrimSpace(data)
		if string(data) == "max" {
			continue
		}
		n, ok := parseUint(data)
		if !ok {
			return 0, fmt.Errorf("%s: malformed %q", f.name, data)
		}
		if n < v1Unlimited {
			limit = min(limit, int64(n))
		}
	}
	return limit, nil
}

// statKeys are the memory.stat keys Read wants, which differ by version; limit is ""
// where it is not wanted.
type statKeys struct{ limit, activeFile, inactiveFile, shmem string }

var (
	// v1's total_ counters include the descendants, as v2's do; its plain ones do not.
	stat1Keys = statKeys{"hierarchical_memory_limit", "total_active_file", "total_inactive_file", "total_shmem"}
	stat2Keys = statKeys{"", "active_file", "inactive_file", "shmem"}
)

// readStat reads memory.stat into u's File and Shmem, and lowers u.Limit to the
// hierarchical limit where k.limit is set.
func readStat(f file, bp *[]byte, u *Usage, k statKeys) error {
	data, err := readFile(f, bp)
	if err != nil {
		return err
	}
	var active, inactive int64
	keys := []string{k.activeFile, k.inactiveFile, k.shmem, k.limit}
	if k.limit == "" {
		keys = keys[:3]
	}
	err = eachLine(data, func(key string, val uint64) {
		switch key {
		case k.activeFile:
			active = clampInt(val)
		case k.inactiveFile:
			inactive = clampInt(val)
		case k.shmem:
			u.Shmem = clampInt(val)
		case k.limit:
			if val < v1Unlimited {
				u.Limit = min(u.Limit, int64(val))
			}
		}
	}, keys...)
	u.File = active + inactive
	if err != nil {
		return fmt.Errorf("%s: %w", f.name, err)
	}
	return nil
}

// readFile reads the whole of a small file into *bp, growing it if need be. The result
// is valid until the next readFile with bp.
func readFile(f file, bp *[]byte) ([]byte, error) {
	fd, err := openat(atFDCWD, &f.c[0], syscall.O_RDONLY)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: f.name, Err: err}
	}
	defer syscall.Close(fd)
	data, err := readAll(fd, bp)
	if err != nil {
		return nil, &fs.PathError{Op: "read", Path: f.name, Err: err}
	}
	return data, nil
}

// readAll reads fd to its end into *bp, growing it up to maxFile.
func readAll(fd int, bp *[]byte) ([]byte, error) {
	buf, n := *bp, 0
	for {
		if n == len(buf) {
			if len(buf) >= maxFile {
				return nil, fmt.Errorf("larger than %d bytes", maxFile)
			}
			buf = append(buf, make([]byte, len(buf))...)
			*bp = buf
		}
		r, err := syscall.Read(fd, buf[n:])
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if r == 0 {
			return buf[:n], nil
		}
		n += r
	}
}

// atFDCWD is AT_FDCWD: openat's dirfd for a path relative to the working directory.
const atFDCWD = -100

// openat opens the NUL-terminated name relative to dirfd with the raw system call:
// syscall.Open would copy the name to the heap, and os.Open would also allocate a File
// and try to register it with the poller.
func openat(dirfd int, name *byte, flags int) (int, error) {
	for {
		fd, _, e := syscall.Syscall6(syscall.SYS_OPENAT, uintptr(dirfd), uintptr(unsafe.Pointer(name)),
			uintptr(flags|syscall.O_CLOEXEC), 0, 0, 0)
		switch e {
		case 0:
			return int(fd), nil
		case syscall.EINTR:
			continue
		}
		return -1, e
	}
}

// readInt reads a file holding one non-negative number.
func readInt(f file, bp *[]byte) (int64, error) {
	data, err := readFile(f, bp)
	if err != nil {
		return 0, err
	}
	n, ok := parseUint(bytes.TrimSpace(data))
	if !ok {
		return 0, fmt.Errorf("%s: malformed %q", f.name, bytes.TrimSpace(data))
	}
	return clampInt(n), nil
}

// eachLine calls fn for each "KEY VALUE" line of a flat-keyed file whose key is one of
// keys; the values of other lines are not parsed, so a kernel's new or odd keys do no harm.
// The error does not name the file.
func eachLine(data []byte, fn func(key string, val uint64), keys ...string) error {
	for len(data) > 0 {
		line, rest, _ := bytes.Cut(data, []byte("\n"))
		data = rest
		key, val, ok := bytes.Cut(line, []byte(" "))
		if !ok {
			continue
		}
		for _, k := range keys {
			if string(key) != k {
				continue
			}
			n, ok := parseUint(bytes.TrimSpace(val))
			if !ok {
				return fmt.Errorf("malformed line %q", line)
			}
			fn(k, n) // k, not string(key), which would allocate
			break
		}
	}
	return nil
}

// parseUint parses decimal digits without allocating, rejecting overflow.
func parseUint(b []byte) (uint64, bool) {
	if len(b) == 0 {
		return 0, false
	}
	var n uint64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		d := uint64(c - '0')
		if n > (math.MaxUint64-d)/10 {
			return 0, false
		}
		n = n*10 + d
	}
	return n, true
}

func clampInt(n uint64) int64 {
	if n > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(n)
}
