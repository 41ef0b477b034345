package tiers

import (
	"errors"
	"os"
)

// Ceil sets the most the tier may hold to n bytes, for why (a short reason that Info reports:
// "cgroup memory limit", "site memory_per_node"...), and evicts the oldest files while it
// holds more, handing each to spill as MakeRoom does. The budget in force is the configured
// budget or n, whichever is lower (n <= 0 allows nothing); a later Ceil with a larger n raises
// it again, up to the configured budget. It returns the budget now in force.
//
// Limits that come from outside the tier's configuration (the memory the job may use, the
// site's limits, the file system's free space) change while the server runs: the server
// calls Ceil with each new reading (see core.Limits).
func (t *Tier) Ceil(n int64, why string, spill func(*Mapping)) (int64, error) {
	t.mu.Lock()
	budget := min(max(n, 0), t.configured)
	t.budget, t.limitedBy = budget, ""
	if budget < t.configured {
		t.limitedBy = why
	}
	over := t.used > budget
	t.mu.Unlock()
	if !over {
		return budget, nil
	}
	err := t.MakeRoom(0, "", spill)
	if errors.Is(err, ErrNoRoom) {
		err = nil // what is left is being written: it is evicted at the next Ceil
	}
	return budget, err
}

// Drop removes everything the tier holds: its entries, its index and the bins, leaving the
// directory and its lock. A server calls it as it exits when the tier's copies must not
// outlive it (a memory tier at the end of a batch job). Readers that mapped a file or the
// index keep valid mappings until they let them go; a reader that looks next finds nothing.
func (t *Tier) Drop() error {
	t.Clear(nil, false)
	root, err := os.OpenRoot(t.Path)
	if err != nil {
		return err
	}
	defer root.Close()
	d, err := root.Open(".")
	if err != nil {
		return err
	}
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return err
	}
	var errs []error
	for _, name := range names {
		if name == lockName {
			continue
		}
		if err := root.RemoveAll(name); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
