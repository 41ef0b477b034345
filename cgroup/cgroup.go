package cgroup

import (
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strconv"
)

// ErrNoController is returned when no memory controller is mounted, or the process's memory
// cgroup is not visible in this mount namespace. Test for it with errors.Is.
var ErrNoController = errors.New("no memory cgroup controller")

// NoLimit is Usage.Limit when neither the cgroup nor any ancestor within the mount has a
// memory limit.
const NoLimit int64 = math.MaxInt64

// v1Unlimited: v1 reports "no limit" as a huge page-aligned number (9223372036854771712 on
// 4 KiB pages); anything this large is taken to mean none.
const v1Unlimited = 1 << 62

// Usage is one reading of a memory cgroup, in bytes except for the counters.
type Usage struct {
	// Limit is the effective limit: the smallest of the cgroup's and its ancestors'
	// (within the mount); NoLimit when there is none. On v2 both memory.max and
	// memory.high count, since going over memory.high throttles the job.
	Limit int64
	// Usage is the memory charged to the cgroup: v1 memory.usage_in_bytes, v2
	// memory.current.
	Usage int64
	// File is reclaimable page cache: active_file + inactive_file (v1: the total_ ones).
	// shmem and tmpfs pages sit on the anon LRU and are not in it.
	File int64
	// Shmem is shmem and tmpfs pages charged to the cgroup: v1 total_shmem, v2 shmem.
	Shmem int64
	// LimitHits counts the times this cgroup's own limit was hit: v1 memory.failcnt, v2
	// memory.events "max". Hits of a limit set only on an ancestor are counted in the
	// ancestor, not here.
	LimitHits uint64
	// OOMKills counts processes OOM-killed in the cgroup: v1 memory.oom_control
	// "oom_kill", v2 memory.events "oom_kill". Zero on kernels that do not report it.
	OOMKills uint64
}

// Limited reports whether the cgroup has a memory limit.
func (u Usage) Limited() bool { return u.Limit != NoLimit }

// Unreclaimable is the charged memory the kernel cannot drop without swap: Usage less
// reclaimable page cache, never negative (the counters are read one after another, so
// they can disagree by a little).
func (u Usage) Unreclaimable() int64 { return max(u.Usage-u.File, 0) }

// Memory is the memory controller of one cgroup. It is safe for concurrent use: it is
// read-only after Find or Open.
type Memory struct {
	version int
	dir     string
	// v1 and v2
	usage string // memory.usage_in_bytes or memory.current
	stat  string // memory.stat
	// v1
	limit   string // memory.limit_in_bytes
	failcnt string // memory.failcnt
	oomCtl  string // memory.oom_control
	// v2
	events string   // memory.events
	limits []string // memory.max and memory.high of dir and its ancestors within the mount
}

// Self returns the memory cgroup of this process, or an error wrapping ErrNoController
// when no memory controller is mounted or visible.
func Self() (*Memory, error) { return Find("/proc", os.Getpid()) }

// ForPID returns the memory cgroup of process pid. Its directory is found through that
// process's mountinfo, so the process must share this process's mount namespace.
func ForPID(pid int) (*Memory, error) { return Find("/proc", pid) }

// Find returns the memory cgroup of process pid from procRoot/PID/cgroup and
// procRoot/PID/mountinfo; procRoot is "/proc" except in tests. It returns an error wrapping
// ErrNoController when no hierarchy with a memory controller holds the process's cgroup.
func Find(procRoot string, pid int) (*Memory, error) {
	base := filepath.Join(procRoot, strconv.Itoa(pid))
	cgData, err := os.ReadFile(filepath.Join(base, "cgroup"))
	if err != nil {
		return nil, fmt.Errorf("cgroup of pid %d: %w", pid, err)
	}
	miData, err := os.ReadFile(filepath.Join(base, "mountinfo"))
	if err != nil {
		return nil, fmt.Errorf("cgroup of pid %d: %w", pid, err)
	}
	paths, err := parseProcCgroup(cgData)
	if err != nil {
		return nil, fmt.Errorf("cgroup of pid %d: %s: %w", pid, filepath.Join(base, "cgroup"), err)
	}
	mounts, err := parseMountinfo(miData)
	if err != nil {
		return nil, fmt.Errorf("cgroup of pid %d: %s: %w", pid, filepath.Join(base, "mountinfo"), err)
	}
	// v1 first: on a hybrid host the memory controller is a v1 hierarchy and the cgroup2
	// mount has none; where both are listed, whichever has the controller wins.
	if paths.hasV1 {
		if dir, _, ok := resolve(mounts, "cgroup", paths.v1); ok {
			m, err := openV1(dir)
			if !errors.Is(err, ErrNoController) {
				return m, err
			}
		}
	}
	if paths.hasV2 {
		if dir, point, ok := resolve(mounts, "cgroup2", paths.v2); ok {
			m, err := openV2(dir, point)
			if !errors.Is(err, ErrNoController) {
				return m, err
			}
		}
	}
	return nil, fmt.Errorf("pid %d: %w", pid, ErrNoController)
}

// Open returns the memory controller of the cgroup at dir, a directory in a mounted cgroup
// fs, whichever its version. On v2 the limits of the ancestors up to the first without
// memory.max count, as the mount root is not known here.
func Open(dir string) (*Memory, error) {
	if exists(filepath.Join(dir, "memory.max")) {
		return openV2(dir, "")
	}
	return openV1(dir)
}

func openV1(dir string) (*Memory, error) {
	if !exists(filepath.Join(dir, "memory.usage_in_bytes")) {
		return nil, fmt.Errorf("cgroup %s: %w", dir, ErrNoController)
	}
	return &Memory{
		version: 1,
		dir:     dir,
		usage:   filepath.Join(dir, "memory.usage_in_bytes"),
		stat:    filepath.Join(dir, "memory.stat"),
		limit:   filepath.Join(dir, "memory.limit_in_bytes"),
		failcnt: filepath.Join(dir, "memory.failcnt"),
		oomCtl:  filepath.Join(dir, "memory.oom_control"),
	}, nil
}

// openV2 opens the nearest cgroup at or above dir, and not above stop (the mount point;
// "" for no bound), that has the memory controller: where the controller is not enabled
// for a cgroup, its memory is charged to that ancestor.
func openV2(dir, stop string) (*Memory, error) {
	d := dir
	for !exists(filepath.Join(d, "memory.max")) {
		if d == stop || filepath.Dir(d) == d {
			return nil, fmt.Errorf("cgroup %s: %w", dir, ErrNoController)
		}
		d = filepath.Dir(d)
	}
	m := &Memory{
		version: 2,
		dir:     d,
		usage:   filepath.Join(d, "memory.current"),
		stat:    filepath.Join(d, "memory.stat"),
		events:  filepath.Join(d, "memory.events"),
	}
	// The ancestors are fixed for the cgroup's life; only their limits change, so the list
	// of files is made once and the files are read on every Read.
	for a := d; exists(filepath.Join(a, "memory.max")); a = filepath.Dir(a) {
		m.limits = append(m.limits, filepath.Join(a, "memory.max"))
		if high := filepath.Join(a, "memory.high"); exists(high) {
			m.limits = append(m.limits, high)
		}
		if a == stop || filepath.Dir(a) == a {
			break
		}
	}
	return m, nil
}

// Version is the cgroup version of the hierarchy: 1 or 2.
func (m *Memory) Version() int { return m.version }

// Dir is the cgroup's directory in the mounted cgroup fs. On v2 it is the nearest
// ancestor with the memory controller when the process's own cgroup does not have it.
func (m *Memory) Dir() string { return m.dir }

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// optional turns a missing file into no error: files such as memory.events are absent on
// older kernels and their counters read as zero.
func optional(err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}
