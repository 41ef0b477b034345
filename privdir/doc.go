// Package privdir opens and creates private directories: real directories (the last path
// component is never a symbolic link) owned by the effective user with mode 0700. FitCache
// keeps its tiers and its runtime directory in such directories, so that no other user can
// plant files there, redirect writes through links, or read cached bytes.
//
// A directory that is missing is created 0700. One that belongs to another user (whatever its
// mode, also one this user cannot open), or that is a symbolic link or not a directory, is
// refused with an error wrapping ErrNotPrivate that names the path and the owner; it is never
// chmodded. A directory of ours with a looser mode
// is fixed through a descriptor opened with O_NOFOLLOW|O_DIRECTORY, so a link swapped in
// meanwhile cannot redirect the chmod.
//
// Usage:
//
//	d, err := privdir.Make("/dev/shm/fitcache-1000", false)
//	if errors.Is(err, privdir.ErrNotPrivate) {
//		// someone else planted it: use privdir.Fallback
//	}
//	defer d.Close()
//	// create files relative to d with openat(d.Fd(), name, O_NOFOLLOW|O_EXCL|O_CREAT, 0600)
package privdir
