package nodesock

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Memory files: the bytes of a file that no tier on the node holds (another node's server
// sent them) handed to a reader as a descriptor.

// memfdName bounds the name of a memory file (the kernel takes 249 bytes).
const memfdName = 200

// MemFile returns a memory file (memfd) holding data, named after path (a reader sees
// /memfd:fitcache:NAME in /proc/self/fd), read-only to everyone it is handed to: it is
// sealed against writes and size changes, and its mode is 0444. Its modification time is
// the source's when known, so that fstat agrees with the source on size and time. Closing
// the last descriptor frees it.
func MemFile(path string, data []byte, mtimeNanos int64) (*os.File, error) {
	name := "fitcache:" + filepath.Base(path)
	if len(name) > memfdName {
		name = name[:memfdName]
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memory file for %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), "memfd:"+name)
	if err := fillMemFile(f, data, mtimeNanos); err != nil {
		f.Close()
		return nil, fmt.Errorf("memory file for %s: %w", path, err)
	}
	return f, nil
}

func fillMemFile(f *os.File, data []byte, mtimeNanos int64) error {
	fd := int(f.Fd())
	if _, err := f.Write(data); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, 0o444); err != nil {
		return err
	}
	if mtimeNanos != 0 {
		ts := unix.NsecToTimespec(mtimeNanos)
		unix.UtimesNanoAt(fd, "", []unix.Timespec{ts, ts}, unix.AT_EMPTY_PATH) // best effort
	}
	seals := unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		return err
	}
	_, err := f.Seek(0, io.SeekStart) // the reader shares the offset: it starts at 0
	return err
}
