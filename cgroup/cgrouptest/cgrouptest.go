package cgrouptest

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/cgroup"
)

// seq numbers the cgroups this process makes, so that parallel tests get distinct ones.
var seq atomic.Int64

// Group is a memory cgroup made for one test and removed when it ends.
type Group struct {
	t   testing.TB
	dir string
	mem *cgroup.Memory

	mu   sync.Mutex  // protects cmds
	cmds []*exec.Cmd // made by Command; the only processes cleanup may kill
}

// New makes a memory cgroup limited to limitBytes and registers its removal with
// t.Cleanup. It skips the test when that is impossible: no memory controller, not
// permitted to make or fill a cgroup, or on v2 no delegated parent with the controller.
func New(t testing.TB, limitBytes int64) *Group {
	t.Helper()
	self, err := cgroup.Self()
	if errors.Is(err, cgroup.ErrNoController) {
		t.Skipf("cgrouptest: no memory cgroup controller: %v", err)
	}
	if err != nil {
		t.Fatalf("cgrouptest: %v", err)
	}
	parent, limitFile := self.Dir(), "memory.limit_in_bytes"
	if self.Version() == 2 {
		// A v2 cgroup that holds processes cannot have children with controllers, so
		// the new cgroup is a sibling; its parent must hand the memory controller down.
		parent, limitFile = filepath.Dir(self.Dir()), "memory.max"
		ctl, err := os.ReadFile(filepath.Join(parent, "cgroup.subtree_control"))
		if err != nil || !slices.Contains(strings.Fields(string(ctl)), "memory") {
			t.Skipf("cgrouptest: v2 parent %s does not delegate the memory controller (%v)", parent, err)
		}
	}
	dir := filepath.Join(parent, fmt.Sprintf("fitcache-test-%d-%d", os.Getpid(), seq.Add(1)))
	if err := os.Mkdir(dir, 0o755); err != nil {
		if errors.Is(err, fs.ErrPermission) || errors.Is(err, syscall.EROFS) {
			t.Skipf("cgrouptest: cannot make a cgroup (need root or delegation): %v", err)
		}
		t.Fatalf("cgrouptest: %v", err)
	}
	g := &Group{t: t, dir: dir}
	t.Cleanup(g.cleanup)
	limit := filepath.Join(dir, limitFile)
	if err := os.WriteFile(limit, []byte(strconv.FormatInt(limitBytes, 10)), 0); err != nil {
		if errors.Is(err, fs.ErrPermission) {
			t.Skipf("cgrouptest: cannot set the limit: %v", err)
		}
		t.Fatalf("cgrouptest: %v", err)
	}
	// Moving a process in needs write access to cgroup.procs here and, on v2, in the
	// common ancestor; check the first now so that a test skips rather than fails later.
	if err := syscall.Access(filepath.Join(dir, "cgroup.procs"), 2 /* W_OK */); err != nil {
		t.Skipf("cgrouptest: cannot move processes into %s: %v", dir, err)
	}
	if g.mem, err = cgroup.Open(dir); err != nil {
		t.Fatalf("cgrouptest: %v", err)
	}
	return g
}

// Child makes a cgroup named name inside g, without a limit of its own, removed when the
// test ends (before g). On v2 it fails the test once a process has been started in g,
// since a v2 cgroup with processes cannot have children with controllers.
func (g *Group) Child(name string) *Group {
	g.t.Helper()
	if g.mem.Version() == 2 {
		ctl := filepath.Join(g.dir, "cgroup.subtree_control")
		if err := os.WriteFile(ctl, []byte("+memory"), 0); err != nil {
			g.t.Fatalf("cgrouptest: %v", err)
		}
	}
	dir := filepath.Join(g.dir, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		g.t.Fatalf("cgrouptest: %v", err)
	}
	c := &Group{t: g.t, dir: dir}
	g.t.Cleanup(c.cleanup)
	var err error
	if c.mem, err = cgroup.Open(dir); err != nil {
		g.t.Fatalf("cgrouptest: %v", err)
	}
	return c
}

// Dir is the cgroup's directory in the mounted cgroup fs.
func (g *Group) Dir() string { return g.dir }

// Command returns a command that runs name with args inside the cgroup from its first
// instruction: a shell moves itself in, then execs the program in its place, so the
// command's process is the program's. Cleanup kills the commands' processes that are
// still running.
func (g *Group) Command(name string, args ...string) *exec.Cmd {
	script := "echo $$ > " + quote(filepath.Join(g.dir, "cgroup.procs")) + ` && exec "$0" "$@"`
	cmd := exec.Command("/bin/sh", append([]string{"-c", script, name}, args...)...)
	g.mu.Lock()
	g.cmds = append(g.cmds, cmd)
	g.mu.Unlock()
	return cmd
}

// Usage reads the cgroup's usage, failing the test on an error. Call it from the test's
// goroutine.
func (g *Group) Usage() cgroup.Usage {
	g.t.Helper()
	u, err := g.mem.Read()
	if err != nil {
		g.t.Fatalf("cgrouptest: %v", err)
	}
	return u
}

// OOMKills is the number of processes OOM-killed in the cgroup.
func (g *Group) OOMKills() uint64 {
	g.t.Helper()
	return g.Usage().OOMKills
}

// cleanup kills the processes Command started that still run, waits for the cgroup to
// empty, and removes it. It kills nothing else: a process left in the cgroup that Command
// did not start (a grandchild a test leaked) is reported and the cgroup is left behind.
func (g *Group) cleanup() {
	g.mu.Lock()
	cmds := g.cmds
	g.mu.Unlock()
	for _, cmd := range cmds {
		// os.Process signals through a pidfd where it can, so a recycled PID is never hit.
		if cmd.Process != nil && cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait() // reap it; its error is the kill
		}
	}
	var err error
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; i < 200 && time.Now().Before(deadline); i++ {
		// rmdir fails with EBUSY while processes remain, and the kernel may take a moment
		// to let go of one that has just exited.
		if err = os.Remove(g.dir); err == nil || errors.Is(err, fs.ErrNotExist) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	procs, _ := os.ReadFile(filepath.Join(g.dir, "cgroup.procs"))
	g.t.Errorf("cgrouptest: cgroup %s left behind (processes %q): %v",
		g.dir, strings.Fields(string(procs)), err)
}

// quote quotes s for the shell.
func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
