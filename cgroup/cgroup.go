package cgroup

import (
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
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
//
// It is the reading of the binding level: of the cgroup and its ancestors within the mount,
// those with a limit are read, and the one with the least headroom (Limit less
// Unreclaimable) is reported, since it is the one the kernel will enforce first. In a
// Slurm job (job_J/step_S/task_N) that is usually the job, whose usage includes every
// task's, not the task the process runs in.
type Usage struct {
	// Level is the directory of the binding level: the cgroup whose limit and usage
	// these are. Without any limit it is the process's cgroup (Memory.Dir).
	Level string
	// Limit is the binding level's limit, NoLimit when no level has one. On v2 it is the
	// smaller of memory.max and memory.high, since going over memory.high throttles the
	// job.
	Limit int64
	// Usage is the memory charged to the binding level and its descendants: v1
	// memory.usage_in_bytes (with use_hierarchy), v2 memory.current.
	Usage int64
	// File is reclaimable page cache: active_file + inactive_file (v1: the total_ ones).
	// shmem and tmpfs pages sit on the anon LRU and are not in it.
	File int64
	// Shmem is shmem and tmpfs pages charged to the binding level: v1 total_shmem, v2
	// shmem.
	Shmem int64
	// LimitHits counts the times a limit was hit within the job: v2 memory.events "max"
	// of the outermost level with a limit (hierarchical, so a hit on any limit in its
	// subtree counts); v1 memory.failcnt summed over the levels with a limit (v1 counts
	// a hit only in the cgroup whose limit was hit). Without a limit, the cgroup's own.
	LimitHits uint64
	// OOMKills counts processes OOM-killed within the job: in the outermost level with a
	// limit and all its descendants, so that a kill in a sibling task is seen. v2 reads
	// that level's memory.events "oom_kill", which is hierarchical; v1's
	// memory.oom_control "oom_kill" counts only kills of the cgroup's own processes, so it
	// is summed over the subtree (and so is v2's when mounted with memory_localevents).
	// A cgroup removed between two readings takes its kills with it. Zero on kernels that
	// do not report it.
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
	// levels are dir and its ancestors up to the mount root, without the hierarchy's
	// root cgroup (which has no limit). The list is fixed for the cgroup's life; the
	// limits are read on every Read, since they can change.
	levels []level
	// local: memory.oom_control (v1) or memory.events (v2 with memory_localevents) count
	// only the cgroup's own processes, so OOM kills are summed over a subtree.
	local bool
}

// level is one cgroup on the way up, with the files Read may read.
type level struct {
	dir    string
	usage  file   // memory.usage_in_bytes or memory.current
	stat   file   // memory.stat
	limits []file // v1 memory.limit_in_bytes; v2 memory.max and memory.high
	events file   // v1 memory.failcnt; v2 memory.events
	// above: v1 at a mount root that is not the hierarchy's root (a container): limits
	// above the mount cannot be read, but memory.stat's hierarchical_memory_limit shows
	// them, and they count as this level's.
	above bool
}

// file is a file's name, also NUL-terminated for open(2), so that reading it allocates
// nothing.
type file struct {
	name string
	c    []byte
}

func newFile(dir, name string) file {
	p := filepath.Join(dir, name)
	return file{p, append([]byte(p), 0)}
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
		if dir, mt, ok := resolve(mounts, "cgroup", paths.v1); ok {
			m, err := openV1(dir, mt.point, mt.root == "/")
			if !errors.Is(err, ErrNoController) {
				return m, err
			}
		}
	}
	if paths.hasV2 {
		if dir, mt, ok := resolve(mounts, "cgroup2", paths.v2); ok {
			m, err := openV2(dir, mt.point, slices.Contains(mt.super, "memory_localevents"))
			if !errors.Is(err, ErrNoController) {
				return m, err
			}
		}
	}
	return nil, fmt.Errorf("pid %d: %w", pid, ErrNoController)
}

// Open returns the memory controller of the cgroup at dir, a directory in a mounted cgroup
// fs, whichever its version. As the mount is not known here, the levels read are dir and
// its ancestors up to the first without memory files or below the hierarchy's root.
func Open(dir string) (*Memory, error) {
	if exists(filepath.Join(dir, "memory.max")) {
		return openV2(dir, "", false)
	}
	return openV1(dir, "", false)
}

// openV1 opens the v1 cgroup at dir, whose levels go up to stop (the mount point; "" for
// no bound); hierRoot says that stop is the hierarchy's root cgroup.
func openV1(dir, stop string, hierRoot bool) (*Memory, error) {
	if !exists(filepath.Join(dir, "memory.usage_in_bytes")) {
		return nil, fmt.Errorf("cgroup %s: %w", dir, ErrNoController)
	}
	m := &Memory{version: 1, dir: dir, local: true}
	for d := dir; ; d = filepath.Dir(d) {
		// The root cgroup (which alone has cgroup.sane_behavior) takes no limit.
		root := (d == stop && hierRoot) || exists(filepath.Join(d, "cgroup.sane_behavior"))
		if d != dir && root {
			break
		}
		if !exists(filepath.Join(d, "memory.usage_in_bytes")) {
			m.levels[len(m.levels)-1].above = true // a mount root within the hierarchy
			break
		}
		m.levels = append(m.levels, level{
			dir:    d,
			usage:  newFile(d, "memory.usage_in_bytes"),
			stat:   newFile(d, "memory.stat"),
			limits: []file{newFile(d, "memory.limit_in_bytes")},
			events: newFile(d, "memory.failcnt"),
			above:  d == stop && !hierRoot,
		})
		if d == stop || root || filepath.Dir(d) == d {
			break
		}
	}
	return m, nil
}

// openV2 opens the nearest cgroup at or above dir, and not above stop (the mount point;
// "" for no bound), that has the memory controller: where the controller is not enabled
// for a cgroup, its memory is charged to that ancestor. local says that memory.events is
// not hierarchical (the memory_localevents mount option).
func openV2(dir, stop string, local bool) (*Memory, error) {
	d := dir
	for !exists(filepath.Join(d, "memory.max")) {
		if d == stop || filepath.Dir(d) == d {
			return nil, fmt.Errorf("cgroup %s: %w", dir, ErrNoController)
		}
		d = filepath.Dir(d)
	}
	m := &Memory{version: 2, dir: d, local: local}
	// The root cgroup has no memory.max, so the walk ends below it.
	for a := d; exists(filepath.Join(a, "memory.max")); a = filepath.Dir(a) {
		lv := level{
			dir:    a,
			usage:  newFile(a, "memory.current"),
			stat:   newFile(a, "memory.stat"),
			limits: []file{newFile(a, "memory.max")},
			events: newFile(a, "memory.events"),
		}
		if exists(filepath.Join(a, "memory.high")) {
			lv.limits = append(lv.limits, newFile(a, "memory.high"))
		}
		m.levels = append(m.levels, lv)
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
