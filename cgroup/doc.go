// Package cgroup reads the memory cgroup of a process, on cgroup v1, v2 and hybrid hosts.
//
// Inside an HPC batch job (Slurm's ConstrainRAMSpace) the job runs in a memory cgroup, and
// the tmpfs pages the cache server writes are charged to it: without swap they cannot be
// reclaimed, so the server sizes its memory tier from what the cgroup has left. It polls
// often, so Find does the work once (which hierarchy, which directory, which files hold the
// limits of the cgroup and its ancestors) and Read only reads those few small files.
//
// Read reports the binding level: of the cgroup and its ancestors within the mounted
// hierarchy, those with a limit (v1 memory.limit_in_bytes; v2 memory.max or memory.high)
// are read, and the one with the least headroom, limit less unreclaimable usage, wins. In
// a Slurm job (job_J/step_S/task_N) the limit is on the job and the step, not on the task,
// and the job's usage includes every task's: reading the task alone would miss its
// siblings. OOM kills are counted over the whole subtree of the outermost limited level.
// Limits are read again on every Read, not cached, because they can change while a job
// runs (scontrol update).

// On a hybrid host (v1 controllers beside a cgroup2 mount with no memory controller) the
// hierarchy that actually has the memory controller is used.
//
//	m, err := cgroup.Self()
//	if errors.Is(err, cgroup.ErrNoController) {
//		// not in a memory cgroup: size the tier from the machine's memory instead
//	}
//	u, err := m.Read()
//	if err == nil && u.Limited() {
//		free := u.Limit - reserve - u.Unreclaimable()
//		budget := tierUsed + free
//	}
package cgroup
