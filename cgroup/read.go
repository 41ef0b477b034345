package cgroup

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"sync"
	"syscall"
)

// maxFile bounds how far a file's buffer grows; memory.stat is a few KiB.
const maxFile = 1 << 20

// bufs holds read buffers, so that a poll every 100 ms makes no garbage.
var bufs = sync.Pool{New: func() any { b := make([]byte, 8192); return &b }}

// Read reads the cgroup's usage and its effective limit: on v1 five small files, on v2
// three plus memory.max and memory.high of the cgroup and each ancestor.
func (m *Memory) Read() (Usage, error) {
	bp := bufs.Get().(*[]byte)
	defer bufs.Put(bp)
	var u Usage
	var err error
	if m.version == 1 {
		err = m.read1(bp, &u)
	} else {
		err = m.read2(bp, &u)
	}
	if err != nil {
		return Usage{}, fmt.Errorf("cgroup %s: %w", m.dir, err)
	}
	return u, nil
}

func (m *Memory) read1(bp *[]byte, u *Usage) error {
	var err error
	if u.Usage, err = readInt(m.usage, bp); err != nil {
		return err
	}
	limit, err := readInt(m.limit, bp)
	if err != nil {
		return err
	}
	u.Limit = limit
	if err := readStat(m.stat, bp, u, stat1Keys); err != nil {
		return err
	}
	if u.Limit >= v1Unlimited {
		u.Limit = NoLimit
	}
	hits, err := readInt(m.failcnt, bp)
	if optional(err) != nil {
		return err
	}
	u.LimitHits = uint64(hits)
	data, err := readFile(m.oomCtl, bp)
	if optional(err) != nil {
		return err
	}
	return eachLine(m.oomCtl, data, func(key string, val uint64) {
		if key == "oom_kill" {
			u.OOMKills = val
		}
	}, "oom_kill")
}

func (m *Memory) read2(bp *[]byte, u *Usage) error {
	var err error
	if u.Usage, err = readInt(m.usage, bp); err != nil {
		return err
	}
	u.Limit = NoLimit
	for _, name := range m.limits {
		data, err := readFile(name, bp)
		if err != nil {
			return err
		}
		data = bytes.TrimSpace(data)
		if string(data) == "max" {
			continue
		}
		n, ok := parseUint(data)
		if !ok {
			return fmt.Errorf("%s: malformed %q", name, data)
		}
		u.Limit = min(u.Limit, clampInt(n))
	}
	if err := readStat(m.stat, bp, u, stat2Keys); err != nil {
		return err
	}
	data, err := readFile(m.events, bp)
	if optional(err) != nil {
		return err
	}
	return eachLine(m.events, data, func(key string, val uint64) {
		switch key {
		case "max":
			u.LimitHits = val
		case "oom_kill":
			u.OOMKills = val
		}
	}, "max", "oom_kill")
}

// statKeys are the memory.stat keys Read wants, which differ by version; limit is ""
// where memory.stat has none.
type statKeys struct{ limit, activeFile, inactiveFile, shmem string }

var (
	// v1's total_ counters include the descendants, as v2's do; its plain ones do not.
	stat1Keys = statKeys{"hierarchical_memory_limit", "total_active_file", "total_inactive_file", "total_shmem"}
	stat2Keys = statKeys{"", "active_file", "inactive_file", "shmem"}
)

// readStat reads memory.stat into u's File and Shmem, and lowers u.Limit to the
// hierarchical limit where there is one.
func readStat(name string, bp *[]byte, u *Usage, k statKeys) error {
	data, err := readFile(name, bp)
	if err != nil {
		return err
	}
	var active, inactive int64
	keys := []string{k.activeFile, k.inactiveFile, k.shmem, k.limit}
	if k.limit == "" {
		keys = keys[:3]
	}
	err = eachLine(name, data, func(key string, val uint64) {
		switch key {
		case k.activeFile:
			active = clampInt(val)
		case k.inactiveFile:
			inactive = clampInt(val)
		case k.shmem:
			u.Shmem = clampInt(val)
		case k.limit:
			u.Limit = min(u.Limit, clampInt(val))
		}
	}, keys...)
	u.File = active + inactive
	return err
}

// readFile reads the whole of a small file into *bp, growing it if need be, with raw
// system calls: os.Open would allocate a File and try to register it with the poller.
// The result is valid until the next readFile with bp.
func readFile(name string, bp *[]byte) ([]byte, error) {
	fd, err := syscall.Open(name, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: name, Err: err}
	}
	defer syscall.Close(fd)
	buf, n := *bp, 0
	for {
		if n == len(buf) {
			if len(buf) >= maxFile {
				return nil, fmt.Errorf("%s: larger than %d bytes", name, maxFile)
			}
			buf = append(buf, make([]byte, len(buf))...)
			*bp = buf
		}
		r, err := syscall.Read(fd, buf[n:])
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return nil, &fs.PathError{Op: "read", Path: name, Err: err}
		}
		if r == 0 {
			return buf[:n], nil
		}
		n += r
	}
}

// readInt reads a file holding one non-negative number.
func readInt(name string, bp *[]byte) (int64, error) {
	data, err := readFile(name, bp)
	if err != nil {
		return 0, err
	}
	n, ok := parseUint(bytes.TrimSpace(data))
	if !ok {
		return 0, fmt.Errorf("%s: malformed %q", name, bytes.TrimSpace(data))
	}
	return clampInt(n), nil
}

// eachLine calls fn for each "KEY VALUE" line of a flat-keyed file whose key is one of
// keys; the values of other lines are not parsed, so a kernel's new or odd keys do no harm.
func eachLine(name string, data []byte, fn func(key string, val uint64), keys ...string) error {
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
				return fmt.Errorf("%s: malformed line %q", name, line)
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
