package cgroup_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/fitcache/fitcache/cgroup"
	"github.com/fitcache/fitcache/cgroup/cgrouptest"
)

// helperEnv makes the test binary a helper process: "report" prints what Self reads,
// "shmem" first writes 16 MiB to the tmpfs file named by shmemEnv, "oom" touches more
// memory than the test cgroup allows.
const (
	helperEnv = "FITCACHE_CGROUP_HELPER"
	shmemEnv  = "FITCACHE_CGROUP_SHMEM"
)

// report is what a helper process prints.
type report struct {
	Version int
	Dir     string
	Usage   cgroup.Usage
}

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		if err := helper(mode); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func helper(mode string) error {
	switch mode {
	case "shmem":
		f, err := os.Create(os.Getenv(shmemEnv))
		if err != nil {
			return err
		}
		buf := make([]byte, 1<<20)
		for i := range buf {
			buf[i] = byte(i) | 1
		}
		for range 16 {
			if _, err := f.Write(buf); err != nil {
				return err
			}
		}
		if err := f.Close(); err != nil {
			return err
		}
	case "oom":
		var hold [][]byte
		for range 64 { // 256 MiB in 4 MiB pieces, each page touched
			b := make([]byte, 4<<20)
			for i := 0; i < len(b); i += 4096 {
				b[i] = 1
			}
			hold = append(hold, b)
		}
		return fmt.Errorf("touched %d MiB and was not OOM-killed", 4*len(hold))
	}
	m, err := cgroup.Self()
	if err != nil {
		return err
	}
	u, err := m.Read()
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(report{m.Version(), m.Dir(), u})
}

// runHelper runs the test binary as a helper in g and returns its report.
func runHelper(t *testing.T, g *cgrouptest.Group, mode string, env ...string) report {
	t.Helper()
	cmd := g.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), append(env, helperEnv+"="+mode)...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helper %s: %v", mode, err)
	}
	var r report
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("helper %s printed %q: %v", mode, out, err)
	}
	return r
}

const mib = 1 << 20

// TestRealCgroup runs helpers in a real 64 MiB cgroup and checks what they and the test
// read. It needs root, or a delegated v2 subtree, and skips otherwise.
func TestRealCgroup(t *testing.T) {
	self, err := cgroup.Self()
	if errors.Is(err, cgroup.ErrNoController) {
		t.Skipf("no memory cgroup controller: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	selfUsage, err := self.Read()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("this process: cgroup v%d %s, %+v", self.Version(), self.Dir(), selfUsage)
	g := cgrouptest.New(t, 64*mib)

	r := runHelper(t, g, "report")
	t.Logf("helper: %+v", r)
	if r.Dir != g.Dir() || r.Version != self.Version() {
		t.Errorf("helper's cgroup: v%d %s, want v%d %s", r.Version, r.Dir, self.Version(), g.Dir())
	}
	// The new cgroup sits under this process's (v1) or beside it (v2), so a smaller
	// limit above it would win.
	if want := min(64*mib, selfUsage.Limit); r.Usage.Limit != want {
		t.Errorf("helper's Limit = %d, want %d", r.Usage.Limit, want)
	}
	if r.Usage.Usage <= 0 {
		t.Errorf("helper's Usage = %d, want > 0 while it runs", r.Usage.Usage)
	}

	t.Run("tmpfs", func(t *testing.T) {
		var fs syscall.Statfs_t
		if err := syscall.Statfs("/dev/shm", &fs); err != nil || fs.Type != 0x01021994 {
			t.Skipf("/dev/shm is not a tmpfs (%v)", err)
		}
		path := filepath.Join("/dev/shm", fmt.Sprintf("fitcache-cgroup-test-%d", os.Getpid()))
		t.Cleanup(func() { os.Remove(path) })
		before := g.Usage()
		r := runHelper(t, g, "shmem", shmemEnv+"="+path)
		if r.Usage.Shmem < 16*mib {
			t.Errorf("helper's Shmem = %d, want at least 16 MiB", r.Usage.Shmem)
		}
		// The helper has exited: its own memory is uncharged, the tmpfs pages stay.
		after := g.Usage()
		t.Logf("before %+v\nafter  %+v", before, after)
		if after.Shmem < 16*mib {
			t.Errorf("Shmem = %d, want at least 16 MiB", after.Shmem)
		}
		if grew := after.Unreclaimable() - before.Unreclaimable(); grew < 15*mib || grew > 24*mib {
			t.Errorf("Unreclaimable grew by %d, want about 16 MiB", grew)
		}
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		if gone := g.Usage(); gone.Shmem > before.Shmem+mib {
			t.Errorf("Shmem = %d after the file was removed, want about %d", gone.Shmem, before.Shmem)
		}
	})

	t.Run("oom", func(t *testing.T) {
		if swaps, err := os.ReadFile("/proc/swaps"); err != nil || strings.Count(string(swaps), "\n") > 1 {
			t.Skip("swap is on (or /proc/swaps unreadable): the helper might swap, not be OOM-killed")
		}
		before := g.Usage()
		cmd := g.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), helperEnv+"=oom")
		err := cmd.Run()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("oom helper: %v, want killed by SIGKILL", err)
		}
		after := g.Usage()
		if after.OOMKills <= before.OOMKills {
			t.Errorf("OOMKills = %d, want more than %d", after.OOMKills, before.OOMKills)
		}
		if g.OOMKills() != after.OOMKills {
			t.Errorf("OOMKills() = %d, Usage().OOMKills = %d", g.OOMKills(), after.OOMKills)
		}
		if after.LimitHits <= before.LimitHits {
			t.Errorf("LimitHits = %d, want more than %d", after.LimitHits, before.LimitHits)
		}
	})
}

// TestRealSiblings checks that a process in child B of a limited cgroup reads the parent,
// charged with what its sibling A wrote to tmpfs: the server in one Slurm task sees the
// whole job.
func TestRealSiblings(t *testing.T) {
	var fs syscall.Statfs_t
	if err := syscall.Statfs("/dev/shm", &fs); err != nil || fs.Type != 0x01021994 {
		t.Skipf("/dev/shm is not a tmpfs (%v)", err)
	}
	parent := cgrouptest.New(t, 64*mib)
	a, b := parent.Child("a"), parent.Child("b")
	path := filepath.Join("/dev/shm", fmt.Sprintf("fitcache-cgroup-siblings-%d", os.Getpid()))
	t.Cleanup(func() { os.Remove(path) })
	runHelper(t, a, "shmem", shmemEnv+"="+path)
	r := runHelper(t, b, "report")
	t.Logf("helper in b: %+v", r)
	if r.Dir != b.Dir() {
		t.Errorf("helper's Dir = %s, want %s", r.Dir, b.Dir())
	}
	if r.Usage.Level != parent.Dir() {
		t.Errorf("Level = %s, want the parent %s", r.Usage.Level, parent.Dir())
	}
	if r.Usage.Limit != 64*mib {
		t.Errorf("Limit = %d, want %d", r.Usage.Limit, 64*mib)
	}
	if got := r.Usage.Unreclaimable(); got < 16*mib {
		t.Errorf("Unreclaimable = %d, want at least 16 MiB (the sibling's tmpfs pages)", got)
	}
	if own := b.Usage(); own.Level != parent.Dir() {
		t.Errorf("b.Usage().Level = %s, want %s", own.Level, parent.Dir())
	}
}
