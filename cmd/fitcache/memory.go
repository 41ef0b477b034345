package main

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/fitcache/fitcache/cgroup"
	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/tiers"
)

// memoryCgroup returns the reader of the memory cgroup this server runs in (the batch job's,
// when the job started it), for core.Limits.Memory; nil when there is none to follow. A
// server started outside the job (by hand, or by another job of the user) follows its own
// cgroup, not the job's: see docs/batch-jobs.md.
func memoryCgroup(log *slog.Logger) func() (core.MemoryReading, error) {
	m, err := cgroup.Self()
	if errors.Is(err, cgroup.ErrNoController) {
		return nil
	}
	if err != nil {
		log.Warn("cannot find this server's memory cgroup: the memory tier is not sized from a job's memory limit", "err", err)
		return nil
	}
	if u, err := m.Read(); err == nil && u.Limited() {
		log.Info("memory tier follows the memory cgroup", "cgroup", m.Dir(), "version", m.Version(), "limit", u.Limit,
			"unreclaimable", u.Unreclaimable())
	}
	return func() (core.MemoryReading, error) {
		u, err := m.Read()
		if err != nil {
			return core.MemoryReading{}, err
		}
		return core.MemoryReading{Limit: u.Limit, Unreclaimable: u.Unreclaimable(), OOMKills: u.OOMKills}, nil
	}
}

// limitsReport is what `fitcache info` says of the limits a server started here would keep:
// the memory cgroup of this process (a server started by it runs in the same one) and the
// site's configuration.
type limitsReport struct {
	Cgroup        string      `json:"memory_cgroup,omitempty"`
	CgroupVersion int         `json:"memory_cgroup_version,omitempty"`
	CgroupLimit   int64       `json:"memory_limit_bytes,omitempty"`
	Unreclaimable int64       `json:"memory_unreclaimable_bytes,omitempty"`
	FollowCgroup  bool        `json:"follow_cgroup"`
	Reserve       string      `json:"memory_reserve"`
	AtExit        string      `json:"memory_at_exit"`
	Site          config.Site `json:"site"`
}

func inspectLimits(cfg config.Config) limitsReport {
	atExit, _ := cfg.ExitPolicy()
	r := limitsReport{FollowCgroup: cfg.FollowCgroup, Reserve: cfg.MemoryReserve.String(), AtExit: string(atExit), Site: cfg.Site}
	if m, err := cgroup.Self(); err == nil {
		r.Cgroup, r.CgroupVersion = m.Dir(), m.Version()
		if u, err := m.Read(); err == nil && u.Limited() {
			r.CgroupLimit, r.Unreclaimable = u.Limit, u.Unreclaimable()
		}
	}
	return r
}

func printLimits(r limitsReport) {
	switch {
	case r.Cgroup == "":
		fmt.Printf("limits   no memory cgroup\n")
	case r.CgroupLimit == 0:
		fmt.Printf("limits   memory cgroup %s (v%d), no limit\n", r.Cgroup, r.CgroupVersion)
	default:
		follow := fmt.Sprintf("the memory tier takes at most the limit less %s less the job's use", r.Reserve)
		if !r.FollowCgroup {
			follow = "not followed (memory_limit=none)"
		}
		fmt.Printf("limits   memory cgroup %s (v%d): limit %s, %s used besides page cache; %s\n", r.Cgroup,
			r.CgroupVersion, tiers.FormatBytes(r.CgroupLimit), tiers.FormatBytes(r.Unreclaimable), follow)
	}
	s := r.Site
	where := "no site configuration (" + config.SitePath() + ")"
	if s.Path != "" {
		where = "site " + s.Path
	}
	fmt.Printf("         %s: memory per user %s, per node %s, disk per user %s, keep free %s; memory at exit: %s\n",
		where, orNone(s.MemoryPerUser), orNone(s.MemoryPerNode), orNone(s.DiskPerUser), s.KeepFree, r.AtExit)
}

func orNone(n int64) string {
	if n == 0 {
		return "no limit"
	}
	return tiers.FormatBytes(n)
}
