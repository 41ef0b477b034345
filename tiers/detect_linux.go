//go:build linux

package tiers

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// FSInfo describes the file system under a tier directory.
type FSInfo struct {
	Type     string // "tmpfs" or the file system's magic number in hex
	Capacity int64  // total bytes
	Free     int64  // bytes available to unprivileged users
}

// InMemory reports whether the file system keeps its files in memory (tmpfs, ramfs): what a
// memory tier needs.
func (f FSInfo) InMemory() bool { return f.Type == "tmpfs" || f.Type == "ramfs" }

var fsNames = map[int64]string{
	unix.TMPFS_MAGIC: "tmpfs", unix.EXT4_SUPER_MAGIC: "ext4", unix.XFS_SUPER_MAGIC: "xfs",
	unix.BTRFS_SUPER_MAGIC: "btrfs", unix.NFS_SUPER_MAGIC: "nfs", unix.FUSE_SUPER_MAGIC: "fuse",
	unix.OVERLAYFS_SUPER_MAGIC: "overlay", unix.RAMFS_MAGIC: "ramfs",
}

// StatFS reports the file system that holds dir.
func StatFS(dir string) (FSInfo, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return FSInfo{}, err
	}
	return fsInfo(&st), nil
}

// fstatFS reports the file system that holds the open directory dirfd.
func fstatFS(dirfd int) (FSInfo, error) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(dirfd, &st); err != nil {
		return FSInfo{}, err
	}
	return fsInfo(&st), nil
}

func fsInfo(st *unix.Statfs_t) FSInfo {
	name, ok := fsNames[int64(st.Type)]
	if !ok {
		name = fmt.Sprintf("%#x", uint64(st.Type))
	}
	return FSInfo{Type: name, Capacity: int64(st.Blocks) * st.Bsize, Free: int64(st.Bavail) * st.Bsize}
}
