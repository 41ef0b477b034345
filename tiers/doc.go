// Package tiers manages cache tiers: directories on fast node-local storage (memory via tmpfs,
// persistent memory, NVMe, disk) that hold cached copies of dataset files.
//
// A tier has two faces:
//
//   - [Dir] is the read side. It knows the layout, maps the tier's index and opens cached
//     files as read-only memory mappings. Any process on the node (a cache server or a
//     client mapping files itself) can use it concurrently; the C hit path of libfitcache
//     (capi/fclookup.c) reads the same layout and index without Go.
//   - [Tier] is the write side, owned by exactly one cache server (it holds a lock file in
//     the directory until Close). It adds a byte budget, publication (write to a temporary
//     file, then rename), FIFO eviction (unlink) and a rescan at start that rebuilds usage,
//     FIFO order and the index, removes leftover temporary files and whatever must not be
//     served, and with Config.Verify checks every entry's data checksum.
//
// Both use a tier directory only if it is private to the user (see package privdir) and
// follow no symbolic link below it: every open, create and remove goes through a directory
// descriptor with O_NOFOLLOW, so a link planted as a bin or an entry is never followed.
//
// Layout: the 64-bit [Key] of the cleaned source path names the file, and its two low bytes
// name two nested hex directories, so millions of files spread over 65,536 bins:
//
//	TIER/ab/cd/<key>-<base name>        the data: exactly the source's bytes, mtime and mode
//	TIER/ab/cd/.rec-<key>-<base name>   its record: source path, size, mtime, checksum
//	TIER/fitcache.index                 the index readers look entries up in
//	TIER/fitcache.lock                  held by the server owning the tier
//
// A cached file is byte-exact, so its descriptor can be handed to any program. The record
// (record.go) and the index (index.go) make sure that a hash collision, a truncated or a
// replaced file is a miss, never data. A cached file is immutable: it is never truncated or
// rewritten in place, because a reader's mapping of it would die with SIGBUS.
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
