// Package discovery finds the cache servers of a job: from an explicit list, a hostfile, or
// Slurm's SLURM_JOB_NODELIST (hostlist syntax such as "gpu[001-004,010],login1") with a number
// of servers per node and a base port. Every client of the job computes the same list, and so
// the same hash ring, with no coordination.
//
//	servers, err := cluster.Discover(cluster.Spec{Servers: "slurm", PerNode: 2, BasePort: 7070})
package discovery
