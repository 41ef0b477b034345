package main

import (
	"errors"
	"log/slog"

	"github.com/fitcache/fitcache/cgroup"
	"github.com/fitcache/fitcache/core"
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
