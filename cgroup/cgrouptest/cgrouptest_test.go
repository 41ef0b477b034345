package cgrouptest

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestQuote(t *testing.T) {
	for _, s := range []string{"/sys/fs/cgroup/a b", "it's", `"$0" $(x) \`} {
		out, err := exec.Command("/bin/sh", "-c", "printf %s "+quote(s)).Output()
		if err != nil {
			t.Fatal(err)
		}
		if string(out) != s {
			t.Errorf("sh printed %q for quote(%q), want it back", out, s)
		}
	}
}

// TestCommand checks that a command runs inside the group from the start, and that
// cleanup kills one still running and removes the cgroup.
func TestCommand(t *testing.T) {
	var dir string
	var sleep *exec.Cmd
	t.Run("group", func(t *testing.T) {
		g := New(t, 32<<20)
		dir = g.Dir()
		out, err := g.Command("cat", "/proc/self/cgroup").Output()
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(out), "/"+filepath.Base(dir)+"\n") {
			t.Errorf("cat's /proc/self/cgroup:\n%s\nwant a line ending in %s", out, filepath.Base(dir))
		}
		if got := g.Usage().Limit; got != 32<<20 {
			t.Errorf("Limit = %d, want %d", got, 32<<20)
		}
		sleep = g.Command("sleep", "60")
		if err := sleep.Start(); err != nil {
			t.Fatal(err)
		}
	})
	if sleep == nil {
		return // skipped or failed
	}
	if sleep.ProcessState == nil {
		t.Errorf("sleep %d still running after cleanup", sleep.Process.Pid)
	}
	if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("cgroup %s still there after cleanup: %v", dir, err)
	}
}
