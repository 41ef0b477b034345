// Package nodetiers finds, measures and removes the FitCache memory tiers left on a node: the
// directories named fitcache-* (the default fitcache-UID and the private stand-ins
// fitcache-UID-xxxx) directly inside /dev/shm or another directory. A server that was killed
// (SIGKILL, the OOM killer) leaves its memory tier behind, holding RAM after the job; a site's
// job epilog removes it with Clear.
//
// A live server holds an exclusive flock on fitcache.lock in its tier (see package tiers);
// List reports such a tier as held and Clear never touches it. Clear is meant to run as root
// in a world-writable sticky directory whose entries other users control, so it works through
// descriptors only: an entry must be a real directory (never a link) on the same file system,
// owned by the user asked for; Clear takes the tier's lock itself before removing, so that no
// server starts using it meanwhile, and removes with openat/unlinkat relative to descriptors,
// never following a link and never entering another file system. Every walk stops after
// Options.MaxEntries entries and says so.
//
// Usage:
//
//	tiers, err := nodetiers.List(nodetiers.Options{}) // the fitcache-* directories in /dev/shm
//	for _, t := range tiers {
//		fmt.Println(t.Path, t.User, t.Bytes, t.Held)
//	}
//	// In a job epilog, as root: remove what no live server holds of one user.
//	results, err := nodetiers.Clear(nodetiers.Options{}, uid, false)
package nodetiers
