package tiers

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// Ceil sets the most the tier may hold to n bytes, for why (a short reason that Info reports:
// "cgroup memory limit", "site memory_per_node"...), and evicts the oldest files while it
// holds more, handing each to spill as MakeRoom does. The budget in force is the configured
// budget or n, whichever is lower (n <= 0 allows nothing), and never more than the tier held
// when its file system last said it was full; a later Ceil with a larger n raises it again,
// up to the configured budget. It returns the budget now in force.
//
// Limits that come from outside the tier's configuration (the memory the job may use, the
// site's limits, the file system's free space) change while the server runs: the server
// calls Ceil with each new reading (see core.Limits).
func (t *Tier) Ceil(n int64, why string, spill func(*Mapping)) (int64, error) {
	t.mu.Lock()
	budget := min(max(n, 0), t.configured)
	t.limitedBy = ""
	if budget < t.configured {
		t.limitedBy = why
	}
	if t.fullCap > 0 && t.fullCap < budget {
		budget, t.limitedBy = t.fullCap, "file system full"
	}
	t.budget = budget
	if t.nextIndex != nil && t.nextIndex.ix.buckets > indexCeiling(budget) {
		t.dropNextIndex()
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

// Drop removes everything the tier holds but its index and its lock: the entries, the bins,
// the readers' fill files and marks. A server calls it as it exits when the tier's copies must
// not outlive it (a memory tier at the end of a batch job). The tier takes no file
// afterwards. Readers that mapped a file keep a valid mapping until they let it go; a reader
// that looks next finds nothing. The index stays, listing nothing (its slots' pages are given
// back to the file system: a tmpfs frees them), so that readers holding it see the copies
// gone, and the next server retires it and numbers its sessions on as usual.
func (t *Tier) Drop() error {
	t.mu.Lock()
	t.budget, t.limitedBy = 0, "server exiting"
	t.dropNextIndex()
	t.mu.Unlock()
	t.Clear(nil, false)
	return withFd(t.dirFile, func(dirfd int) error {
		root, err := openSame(dirfd, t.Path)
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
		errs := []error{punchSlots(dirfd)}
		for _, name := range names {
			if name == lockName || name == indexName {
				continue
			}
			if err := root.RemoveAll(name); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	})
}

// openSame opens an os.Root on the directory open at dirfd, never on what its path names
// now (the name may have been replaced, by a link to somewhere else say): through
// /proc/self/fd, else by path when that is still the same directory.
func openSame(dirfd int, path string) (*os.Root, error) {
	if root, err := os.OpenRoot(fmt.Sprintf("/proc/self/fd/%d", dirfd)); err == nil {
		return root, nil
	}
	root, err := os.OpenRoot(path)
	if err != nil {
		return nil, err
	}
	var want unix.Stat_t
	fi, err := root.Stat(".")
	if err == nil {
		err = unix.Fstat(dirfd, &want)
	}
	if err == nil {
		if got, ok := fi.Sys().(*syscall.Stat_t); !ok || got.Dev != want.Dev || got.Ino != want.Ino {
			err = errors.New("the directory was replaced")
		}
	}
	if err != nil {
		root.Close()
		return nil, fmt.Errorf("tier %s: %w", path, err)
	}
	return root, nil
}

// punchSlots gives back the pages of the slots of the index in the directory open at dirfd
// (emptied by Clear), which read as zeros afterwards: empty slots.
func punchSlots(dirfd int) error {
	fd, err := unix.Openat(dirfd, indexName, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("index: %w", err)
	}
	defer unix.Close(fd)
	return punchSlotsOf(fd)
}

// punchSlotsOf gives back the pages of the slots of the index open at fd, keeping its header
// and hit counters.
func punchSlotsOf(fd int) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("index: %w", err)
	}
	if st.Size <= indexSlots {
		return nil
	}
	err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, indexSlots, st.Size-indexSlots)
	if errors.Is(err, unix.EOPNOTSUPP) {
		return nil // a file system without holes keeps the pages; a tmpfs has them
	}
	if err != nil {
		return fmt.Errorf("index: give back the slots' pages: %w", err)
	}
	return nil
}
