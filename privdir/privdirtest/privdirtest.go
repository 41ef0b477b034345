// Package privdirtest helps tests play a second user: it runs shell commands as nobody (a
// hostile user planting things), reruns a test as nobody (a victim that, unlike root, cannot
// open another user's closed directory), and makes directories that nobody can plant things
// in.
//
// Usage:
//
//	shared := privdirtest.SharedDir(t) // skips the test when not root
//	privdirtest.AsNobody(t, "mkdir -m 777 "+shared+"/tier")
//
//	func TestX(t *testing.T) {
//		if dir, ok := privdirtest.Victim(); ok { // the rerun, as nobody
//			... use dir ...
//			return
//		}
//		dir := ... // prepared as root
//		privdirtest.RunAsNobody(t, dir)
//	}
package privdirtest

import (
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// SharedDir returns a new world-writable directory (mode 1777, like /tmp) whose parents
// nobody can traverse. It skips the test when the process is not root, since only root can
// act as another user.
func SharedDir(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to act as a second user (nobody)")
	}
	d := t.TempDir()
	for p := filepath.Dir(d); p != "/" && p != os.TempDir(); p = filepath.Dir(p) {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(d, 0o1777); err != nil {
		t.Fatal(err)
	}
	return d
}

// AsNobody runs script with sh as the user nobody and fails the test if it fails.
func AsNobody(t *testing.T, script string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to act as a second user (nobody)")
	}
	out, err := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
		"sh", "-ec", script).CombinedOutput()
	if err != nil {
		t.Fatalf("as nobody: %s: %v\n%s", script, err, out)
	}
}

// victimEnv carries the argument of a test rerun by RunAsNobody.
const victimEnv = "FITCACHE_TEST_VICTIM"

// Victim reports whether this process is a test rerun as nobody by RunAsNobody, and the
// argument it was given.
func Victim() (arg string, ok bool) { return os.LookupEnv(victimEnv) }

// RunAsNobody reruns the top-level test t in a copy of the test binary as the user nobody,
// with arg for Victim, and fails t with the rerun's output unless it ran and passed. It
// skips the test when the process is not root.
func RunAsNobody(t *testing.T, arg string) {
	t.Helper()
	bin := filepath.Join(SharedDir(t), "victim.test") // the build directory is closed to nobody
	self, err := os.Open("/proc/self/exe")
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	out, err := os.OpenFile(bin, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	_, err = io.Copy(out, self)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
		bin, "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), victimEnv+"="+arg, "TMPDIR=/tmp")
	got, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(got), "--- PASS: "+t.Name()) {
		t.Fatalf("as nobody: %v\n%s", err, got)
	}
}
