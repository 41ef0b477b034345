// Package tiers manages cache tiers: directories on fast node-local storage (memory via tmpfs,
// persistent memory, NVMe, disk) that hold cached copies of dataset files.
//
// A tier has two faces:
//
//   - [Dir] is the read side. It knows the layout and opens cached files as read-only
//     memory mappings. It holds no state, so any process on the node (a cache server or a
//     client mapping files itself) can use it concurrently.
//   - [Tier] is the write side, owned by exactly one cache server (it holds a lock file in
//     the directory until Close). It adds a byte budget, publication (write to a temporary
//     file, then rename), FIFO eviction (unlink) and a rescan at start that rebuilds usage and
//     FIFO order, removes leftover temporary files and whatever must not be served, and with
//     Config.Verify checks every entry's data checksum.
//
// Both use a tier directory only if it is private to the user (see package privdir) and
// follow no symbolic link below it: every open, create and remove goes through a directory
// descriptor with O_NOFOLLOW, so a link planted as a bin or an entry is never followed.
//
// Layout: the 64-bit [Key] of the cleaned source path names the file, and its two low bytes
// name two nested hex directories, so millions of files spread over 65,536 bins:
//
//	TIER/ab/cd/<key>-<base name>
//
// Every cached file ends with a trailer recording the source path, size and the CRC-32C of
// the data (see entry.go), so a hash collision or a damaged file is reported as a miss and
// never returned as data.
// A cached file is immutable: it is never truncated or rewritten in place, because a reader's
// mapping of it would die with SIGBUS.
//
// Usage:
//
//	t, err := tiers.New(tiers.Config{Dir: "/dev/shm/fitcache", Kind: tiers.Memory, Budget: "4GiB"}, nil)
//	...
//	defer t.Close()
//	err = t.PublishFrom(tiers.Entry{SourcePath: "/data/train/0001.jpg", Size: size, MTimeNanos: mtime}, file)
//	m, err := t.Open("/data/train/0001.jpg")
//	defer m.Release()
//	use(m.Bytes())
package tiers
