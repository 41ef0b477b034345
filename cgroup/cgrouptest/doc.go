// Package cgrouptest makes real memory cgroups for tests: a fresh cgroup with a memory
// limit, programs started inside it, and its usage and OOM kills. It needs root (or a
// delegated v2 subtree) and skips the test, saying why, where that is not possible.
//
// It works on cgroup v1 (the cgroup is made under the test process's own memory cgroup)
// and on v2 (as a sibling of the test process's cgroup, since a v2 cgroup with processes
// cannot also have children with controllers).
//
//	g := cgrouptest.New(t, 64<<20)
//	cmd := g.Command("dd", "if=/dev/zero", "of=/dev/shm/x", "bs=1M", "count=16")
//	if err := cmd.Run(); err != nil {
//		t.Fatal(err)
//	}
//	if u := g.Usage(); u.Shmem < 16<<20 {
//		t.Errorf("Shmem %d, want at least 16 MiB", u.Shmem)
//	}
package cgrouptest
