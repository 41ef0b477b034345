// Package discovery finds the cache servers of a job: from an explicit list, a hostfile, or
// Slurm's SLURM_JOB_NODELIST (hostlist syntax such as "gpu[001-004,010],login1") with a number
// of servers per node and a base port. Every client of the job computes the same list, and so
// the same hash ring, with no coordination. Job also loads the job's token (given, or read
// from a private file), which every request to the servers carries.
//
//	servers, err := discovery.Discover(discovery.Spec{Servers: "slurm", PerNode: 2, BasePort: 7070})
//	servers, token, err := discovery.Job(spec, "", os.Getenv("FITCACHE_TOKEN_FILE"))
package discovery
