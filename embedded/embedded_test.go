package embedded

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fitcache/fitcache/privdir"
	"github.com/fitcache/fitcache/privdir/privdirtest"
)

func TestPrepareDir(t *testing.T) {
	base := t.TempDir()
	target := filepath.Join(base, "target")
	os.Mkdir(target, 0o755)
	os.WriteFile(filepath.Join(target, spawnLock), nil, 0o644)
	link := filepath.Join(base, "link")
	os.Symlink(target, link)
	loose := filepath.Join(base, "loose")
	os.Mkdir(loose, 0o700)
	os.Chmod(loose, 0o755)
	for _, tc := range []struct {
		name, dir string
		wantErr   bool
	}{
		{"missing with parents", filepath.Join(base, "a", "b"), false},
		{"ours with a loose mode", loose, false},
		{"symbolic link", link, true},
	} {
		err := PrepareDir(tc.dir)
		if tc.wantErr {
			if !errors.Is(err, privdir.ErrNotPrivate) || !strings.Contains(err.Error(), "FITCACHE_RUNTIME_DIR") {
				t.Errorf("%s: got %v, want ErrNotPrivate with a hint", tc.name, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
		} else if fi, _ := os.Lstat(tc.dir); fi.Mode() != os.ModeDir|0o700 {
			t.Errorf("%s: mode %v, want drwx------", tc.name, fi.Mode())
		}
	}
	if fi, _ := os.Stat(target); fi.Mode().Perm() != 0o755 {
		t.Errorf("the link's target was chmodded to %v", fi.Mode().Perm())
	}
}

func TestPrepareDirRefusesAnotherUsersDirectory(t *testing.T) {
	planted := filepath.Join(privdirtest.SharedDir(t), "fitcache-0")
	privdirtest.AsNobody(t, "mkdir -m 777 "+planted)
	if err := PrepareDir(planted); !errors.Is(err, privdir.ErrNotPrivate) || !strings.Contains(err.Error(), "nobody") {
		t.Fatalf("got %v, want ErrNotPrivate naming nobody", err)
	}
	if fi, _ := os.Stat(planted); fi.Mode().Perm() != 0o777 {
		t.Errorf("nobody's directory was chmodded to %v", fi.Mode().Perm())
	}
}

// A client checks the runtime directory before it talks to the socket in it: another user's
// directory is refused, and a socket another user left in a directory of ours is removed.
// On the main branch before this change a client connected to whatever answered there.
func TestCheckSocket(t *testing.T) {
	shared := privdirtest.SharedDir(t)
	foreign := filepath.Join(shared, "foreign")
	privdirtest.AsNobody(t, "mkdir -m 777 "+foreign)
	if err := CheckSocket(foreign); !errors.Is(err, privdir.ErrNotPrivate) {
		t.Errorf("another user's runtime directory: got %v, want ErrNotPrivate", err)
	}
	if err := CheckSocket(filepath.Join(shared, "missing")); err != nil {
		t.Errorf("missing runtime directory: %v", err)
	}
	ours := filepath.Join(shared, "ours")
	if err := PrepareDir(ours); err != nil {
		t.Fatal(err)
	}
	os.Chmod(ours, 0o777) // open to others for a while, as after a careless chmod
	privdirtest.AsNobody(t, "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\""+SocketPath(ours)+"\")'")
	os.Chmod(ours, 0o700)
	if err := CheckSocket(ours); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(SocketPath(ours)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a socket of another user was left in place: %v", err)
	}
}

func TestServerEnvironDropsOnlyThePreloadShim(t *testing.T) {
	for _, tc := range []struct{ in, want []string }{
		{[]string{"A=1", "LD_PRELOAD=/x/libfitcache_preload.so", "FITCACHE_PRELOAD_ROOTS=/d"}, []string{"A=1"}},
		{[]string{"LD_PRELOAD=/x/libfitcache_preload.so:/y/libother.so"}, []string{"LD_PRELOAD=/y/libother.so"}},
		{[]string{"LD_PRELOAD=/y/libother.so", "FITCACHE_TIERS=t"}, []string{"LD_PRELOAD=/y/libother.so", "FITCACHE_TIERS=t"}},
	} {
		if got := ServerEnviron(tc.in); !slices.Equal(got, tc.want) {
			t.Errorf("ServerEnviron(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestHoldOffExcludesAServer(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "rt")
	release, err := HoldOff(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := LockServer(dir, 0); !errors.Is(err, ErrAlreadyRunning) {
		t.Errorf("a server locking while held off: got %v, want ErrAlreadyRunning", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := lockSpawn(ctx, dir); err == nil {
		t.Error("a client took the spawn lock while held off")
	}
	release()
	lock, err := LockServer(dir, 0)
	if err != nil {
		t.Fatalf("a server after release: %v", err)
	}
	if _, err := HoldOff(context.Background(), dir); !errors.Is(err, ErrAlreadyRunning) {
		t.Errorf("HoldOff while a server runs: got %v, want ErrAlreadyRunning", err)
	}
	lock.Close()
}

// A runtime directory of another user that this user cannot even open (mode 0700) is refused
// as not private, naming its owner, like one it can open. Run as nobody, with root's
// directory. Before, the refusal was a bare EACCES.
func TestPrepareDirRefusesAClosedDirectoryOfAnotherUser(t *testing.T) {
	if planted, ok := privdirtest.Victim(); ok {
		if err := PrepareDir(planted); !errors.Is(err, privdir.ErrNotPrivate) || !strings.Contains(err.Error(), "root") {
			t.Fatalf("got %v, want ErrNotPrivate naming root", err)
		}
		return
	}
	planted := filepath.Join(privdirtest.SharedDir(t), "fitcache-65534")
	if err := os.Mkdir(planted, 0o700); err != nil {
		t.Fatal(err)
	}
	privdirtest.RunAsNobody(t, planted)
}
