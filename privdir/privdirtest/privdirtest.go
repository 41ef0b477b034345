// Package privdirtest helps tests play a hostile second user: it runs shell commands as
// nobody and makes directories that nobody can plant things in.
//
// Usage:
//
//	shared := privdirtest.SharedDir(t) // skips the test when not root
//	privdirtest.AsNobody(t, "mkdir -m 777 "+shared+"/tier")
package privdirtest

import (
	"os"
	"os/exec"
	"path/filepath"
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
