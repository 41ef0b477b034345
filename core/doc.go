// Package core is the cache engine that runs inside a FitCache server.
//
// An [Engine] serves reads of dataset files: it probes all tiers at once and answers from the
// first that has the file; on a miss it reads the source (the parallel file system) exactly
// once however many readers ask at the same time, answers, and hands the bytes to a
// background data mover that publishes them into the fastest tier with room, evicting FIFO
// and spilling evicted files to the next tier. Files larger than every tier are served
// uncached. With prefetch on ([PrefetchConfig]), [Engine.Prefetch] takes the list of files
// readers are about to read and reads them ahead, through the same miss path, with bounded
// concurrency that gives way to readers' misses, and only into room the tiers have without
// eviction.
//
// Usage:
//
//	e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: "/dev/shm/fc", Kind: tiers.Memory}}}, log)
//	...
//	defer e.Close()
//	res, err := e.Read(ctx, "/data", "/data/train/0001.jpg", false)
//	defer res.Release()
//	use(res.Bytes())
package core
