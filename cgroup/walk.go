package cgroup

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"syscall"
)

// The walk of a subtree is bounded: a Slurm job is three or four levels deep and has a few
// dozen cgroups. Cgroups deeper or beyond the count are not read.
const (
	maxDepth   = 8
	maxCgroups = 1024
)

// Counter files read in every cgroup of a subtree, NUL-terminated for openat(2).
var (
	oomControl   = []byte("memory.oom_control\x00")
	memoryEvents = []byte("memory.events\x00")
)

// walk calls fn for the keys of the flat-keyed file name (NUL-terminated) in dir and in
// every cgroup below it. It opens each directory relative to its parent's descriptor, so
// it builds no paths and allocates nothing once s's buffers have grown. A cgroup removed
// meanwhile is skipped.
func walk(dir string, name []byte, s *scratch, fn func(key string, val uint64), keys ...string) error {
	w := walker{name: name, s: s, fn: fn, keys: keys}
	c := append([]byte(dir), 0) // once per Read: dir is the only path built
	fd, err := openat(atFDCWD, &c[0], syscall.O_RDONLY|syscall.O_DIRECTORY)
	if err != nil {
		return &fs.PathError{Op: "open", Path: dir, Err: err}
	}
	defer syscall.Close(fd)
	if err := w.cgroup(fd, 0); err != nil {
		return fmt.Errorf("%s and below: %w", dir, err)
	}
	return nil
}

type walker struct {
	name  []byte
	s     *scratch
	fn    func(key string, val uint64)
	keys  []string
	count int // cgroups read
}

// cgroup reads the counter file in the directory open as fd and descends into its
// subdirectories.
func (w *walker) cgroup(fd, depth int) error {
	w.count++
	if err := w.counters(fd); err != nil {
		return err
	}
	if depth == maxDepth {
		return nil
	}
	buf := w.s.dirs[depth]
	if buf == nil {
		buf = make([]byte, 4096)
		w.s.dirs[depth] = buf
	}
	for {
		n, err := syscall.ReadDirent(fd, buf)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if errors.Is(err, syscall.ENOENT) || n == 0 { // ENOENT: the cgroup was removed
			return nil
		}
		if err != nil {
			return fmt.Errorf("read directory: %w", err)
		}
		// linux_dirent64: ino u64, off s64, reclen u16, type u8, NUL-terminated name.
		for off := 0; off < n; {
			reclen := int(binary.NativeEndian.Uint16(buf[off+16:]))
			typ, name := buf[off+18], buf[off+19:off+reclen]
			off += reclen
			if typ != syscall.DT_DIR && typ != syscall.DT_UNKNOWN ||
				name[0] == '.' && (name[1] == 0 || name[1] == '.' && name[2] == 0) {
				continue
			}
			if w.count >= maxCgroups {
				return nil
			}
			sub, err := openat(fd, &name[0], syscall.O_RDONLY|syscall.O_DIRECTORY)
			if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ENOTDIR) {
				continue
			}
			if err != nil {
				return fmt.Errorf("open directory: %w", err)
			}
			err = w.cgroup(sub, depth+1)
			syscall.Close(sub)
			if err != nil {
				return err
			}
		}
	}
}

// counters reads the counter file in the directory open as fd; a missing one (an old
// kernel, or a cgroup removed meanwhile) counts nothing.
func (w *walker) counters(fd int) error {
	f, err := openat(fd, &w.name[0], syscall.O_RDONLY)
	if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ENODEV) {
		return nil
	}
	if err != nil {
		return &fs.PathError{Op: "open", Path: w.fileName(), Err: err}
	}
	defer syscall.Close(f)
	data, err := readAll(f, &w.s.file)
	if errors.Is(err, syscall.ENODEV) || errors.Is(err, syscall.ENOENT) {
		return nil
	}
	if err != nil {
		return &fs.PathError{Op: "read", Path: w.fileName(), Err: err}
	}
	if err := eachLine(data, w.fn, w.keys...); err != nil {
		return fmt.Errorf("%s: %w", w.fileName(), err)
	}
	return nil
}

func (w *walker) fileName() string { return string(w.name[:len(w.name)-1]) }
