package privdir

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/privdir/privdirtest"
)

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode()
}

func TestMakeCreatesAndFixes(t *testing.T) {
	base := t.TempDir()
	for _, tc := range []struct {
		name    string
		prepare func(dir string)
		parents bool
	}{
		{"missing", func(string) {}, false},
		{"missing parents", func(string) {}, true},
		{"ours with a loose mode", func(dir string) { os.Mkdir(dir, 0o700); os.Chmod(dir, 0o777) }, false},
		{"ours with no access for others already", func(dir string) { os.Mkdir(dir, 0o700) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(base, strings.ReplaceAll(tc.name, " ", "-"))
			if tc.parents {
				dir = filepath.Join(dir, "a", "b")
			}
			tc.prepare(dir)
			d, err := Make(dir, tc.parents)
			if err != nil {
				t.Fatalf("Make: %v", err)
			}
			d.Close()
			for p := dir; p != base; p = filepath.Dir(p) {
				if got := mode(t, p); got != os.ModeDir|0o700 {
					t.Errorf("%s: got mode %v, want drwx------", p, got)
				}
			}
		})
	}
	if _, err := Make(filepath.Join(base, "no", "parent"), false); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Make without parents under a missing one: got %v, want ErrNotExist", err)
	}
}

func TestOpenRefusesLinksAndFiles(t *testing.T) {
	base := t.TempDir()
	target := filepath.Join(base, "target")
	os.Mkdir(target, 0o755)
	link := filepath.Join(base, "link")
	os.Symlink(target, link)
	file := filepath.Join(base, "file")
	os.WriteFile(file, nil, 0o600)
	for _, tc := range []struct{ path, reason string }{
		{link, "symbolic link"}, {file, "not a directory"},
	} {
		_, err := Make(tc.path, false)
		if !errors.Is(err, ErrNotPrivate) || !strings.Contains(err.Error(), tc.reason) ||
			!strings.Contains(err.Error(), tc.path) {
			t.Errorf("Make(%s): got %v, want ErrNotPrivate naming the path and %q", tc.path, err, tc.reason)
		}
	}
	if got := mode(t, target); got != os.ModeDir|0o755 {
		t.Errorf("the link's target was changed to %v", got)
	}
}

func TestOpenRefusesAnotherUsersDirectory(t *testing.T) {
	shared := privdirtest.SharedDir(t)
	planted := filepath.Join(shared, "fitcache-0")
	privdirtest.AsNobody(t, "mkdir -m 777 "+planted)
	_, err := Make(planted, false)
	var npe *NotPrivateError
	if !errors.As(err, &npe) || npe.Owner != 65534 || !strings.Contains(err.Error(), "nobody") ||
		!strings.Contains(err.Error(), planted) {
		t.Fatalf("Make on nobody's directory: got %v, want a NotPrivateError naming nobody and the path", err)
	}
	if got := mode(t, planted); got != os.ModeDir|0o777 {
		t.Errorf("another user's directory was chmodded to %v", got)
	}
	// A parent planted by nobody where Make would have created one is refused as well.
	privdirtest.AsNobody(t, "mkdir -m 777 "+filepath.Join(shared, "cache"))
	if _, err := Make(filepath.Join(shared, "cache", "x", "fitcache"), true); !errors.Is(err, ErrNotPrivate) {
		t.Errorf("Make under nobody's parent: got %v, want ErrNotPrivate", err)
	}
}

func TestFallbackIsPrivateAndReused(t *testing.T) {
	shared := privdirtest.SharedDir(t)
	planted := filepath.Join(shared, "fitcache-0")
	privdirtest.AsNobody(t, "mkdir -m 777 "+planted)
	record := filepath.Join(t.TempDir(), "run", "memory-tier")

	d, err := Fallback(planted, record)
	if err != nil {
		t.Fatal(err)
	}
	d.Close()
	first := d.Name()
	if filepath.Dir(first) != shared || !strings.HasPrefix(filepath.Base(first), "fitcache-0-") {
		t.Errorf("stand-in %s: want a fitcache-0-* directory beside %s", first, planted)
	}
	if got := mode(t, first); got != os.ModeDir|0o700 {
		t.Errorf("stand-in mode %v, want drwx------", got)
	}
	again, err := Fallback(planted, record)
	if err != nil {
		t.Fatal(err)
	}
	again.Close()
	if again.Name() != first {
		t.Errorf("restart got %s, want the recorded %s", again.Name(), first)
	}

	// The recorded stand-in was removed (by a reboot, say) and nobody took its name: the
	// directory of theirs is not reused.
	os.Remove(first)
	privdirtest.AsNobody(t, "mkdir -m 777 "+first)
	third, err := Fallback(planted, record)
	if err != nil {
		t.Fatal(err)
	}
	third.Close()
	if third.Name() == first {
		t.Errorf("reused %s after another user took its name", first)
	}
}

// Another user's directory counts as not ours whatever its mode, also when this user cannot
// even open it (mode 0700: EACCES): it is refused with ErrNotPrivate naming its owner, and
// Fallback stands in for it. Run as nobody, with root's directories (root opens anything).
// Before, a directory this user could not open was an EACCES error, not ErrNotPrivate: no
// fallback, and a non-root user lost the memory tier or the server.
func TestAnotherUsersDirectoryOfAnyModeIsNotOurs(t *testing.T) {
	if arg, ok := privdirtest.Victim(); ok {
		for _, dir := range strings.Split(arg, ":") {
			var npe *NotPrivateError
			if _, err := Make(dir, false); !errors.As(err, &npe) || npe.Owner != 0 || !strings.Contains(err.Error(), dir) {
				t.Errorf("Make(%s): got %v, want a NotPrivateError naming root and the path", dir, err)
			}
			if err := Inspect(dir); !errors.Is(err, ErrNotPrivate) {
				t.Errorf("Inspect(%s): got %v, want ErrNotPrivate", dir, err)
			}
			d, err := Fallback(dir, filepath.Join(t.TempDir(), "run", "record"))
			if err != nil {
				t.Errorf("Fallback(%s): %v", dir, err)
				continue
			}
			d.Close()
			if filepath.Dir(d.Name()) != filepath.Dir(dir) || mode(t, d.Name()) != os.ModeDir|0o700 {
				t.Errorf("stand-in for %s: %s, mode %v", dir, d.Name(), mode(t, d.Name()))
			}
		}
		return
	}
	shared := privdirtest.SharedDir(t)
	var dirs []string
	for _, perm := range []os.FileMode{0o700, 0o000, 0o711, 0o755} {
		dir := filepath.Join(shared, fmt.Sprintf("fitcache-%04o", perm))
		if err := os.Mkdir(dir, perm); err != nil {
			t.Fatal(err)
		}
		os.Chmod(dir, perm) // past the umask
		dirs = append(dirs, dir)
	}
	privdirtest.RunAsNobody(t, strings.Join(dirs, ":"))
	// Root, who opens anything, refuses nobody's closed directory the same way.
	closed := filepath.Join(shared, "nobodys")
	privdirtest.AsNobody(t, "mkdir -m 700 "+closed)
	if _, err := Make(closed, false); !errors.Is(err, ErrNotPrivate) || !strings.Contains(err.Error(), "nobody") {
		t.Errorf("Make on nobody's 0700 directory: got %v, want ErrNotPrivate naming nobody", err)
	}
}
