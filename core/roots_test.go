package core

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestSymlinkOutOfServerRootIsRefused: an engine restricted to a dataset root serves nothing
// reached through a symbolic link inside that root pointing outside it, whether the caller
// names the link as its root or as a directory of its path, to Read or to Store.
func TestSymlinkOutOfServerRootIsRefused(t *testing.T) {
	base := t.TempDir()
	serverRoot := filepath.Join(base, "data")
	outside := filepath.Join(base, "home")
	for _, d := range []string{filepath.Join(serverRoot, "train"), outside} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	secret := filepath.Join(outside, "token")
	inside := filepath.Join(serverRoot, "train", "a.bin")
	os.WriteFile(secret, []byte("job token"), 0o600)
	os.WriteFile(inside, []byte("sample"), 0o644)
	link := filepath.Join(serverRoot, "escape") // data/escape -> ../home
	if err := os.Symlink(outside, link); err != nil {
		t.Fatal(err)
	}
	// The server's root reached through a link of its own is fine: it is resolved at start.
	alias := filepath.Join(base, "alias")
	if err := os.Symlink(serverRoot, alias); err != nil {
		t.Fatal(err)
	}
	for _, configured := range []string{serverRoot, alias} {
		t.Run(filepath.Base(configured), func(t *testing.T) {
			checkRootEscapes(t, configured, serverRoot, alias, link, outside)
		})
	}
}

func checkRootEscapes(t *testing.T, configured, serverRoot, alias, link, outside string) {
	t.Helper()
	secret := filepath.Join(outside, "token")
	inside := filepath.Join(serverRoot, "train", "a.bin")
	e, err := NewEngine(EngineConfig{Roots: []string{configured}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()

	ctx := context.Background()
	for _, tc := range []struct {
		name, root, path string
		want             error // nil: served
	}{
		{"file inside", serverRoot, inside, nil},
		{"file inside, root named through the server root's alias", filepath.Join(alias, "train"), filepath.Join(alias, "train", "a.bin"), nil},
		{"link as the root", link, filepath.Join(link, "token"), ErrOutsideRoot},
		{"link in the path", serverRoot, filepath.Join(link, "token"), ErrOutsideRoot},
		{"root outside", outside, secret, ErrOutsideRoot},
	} {
		res, err := e.Read(ctx, tc.root, tc.path, false)
		if !errors.Is(err, tc.want) || (tc.want != nil && Errno(err) != syscall.EACCES) {
			t.Errorf("Read, %s: got %v, want %v (EACCES)", tc.name, err, tc.want)
		}
		if err == nil {
			res.Release()
		}
	}
	for _, root := range []string{link, outside} {
		if err := e.Store(StoreRequest{Root: root, Path: filepath.Join(root, "token"), Data: []byte("x")}); !errors.Is(err, ErrOutsideRoot) {
			t.Errorf("Store under %s: got %v, want ErrOutsideRoot", root, err)
		}
	}
	if got := e.Stats().SourceReads; got != 2 {
		t.Errorf("source reads: got %d, want 2 (the files inside)", got)
	}
}

// TestRememberedRootCannotBeSwapped: a root that was a real directory when first served
// and is then replaced by a link to elsewhere serves nothing from elsewhere.
func TestRememberedRootCannotBeSwapped(t *testing.T) {
	base := t.TempDir()
	serverRoot := filepath.Join(base, "data")
	sub := filepath.Join(serverRoot, "sub")
	outside := filepath.Join(base, "home")
	for _, d := range []string{sub, outside} {
		os.MkdirAll(d, 0o755)
	}
	os.WriteFile(filepath.Join(sub, "f"), []byte("sample"), 0o644)
	os.WriteFile(filepath.Join(outside, "f"), []byte("secret"), 0o600)
	e, err := NewEngine(EngineConfig{Roots: []string{serverRoot}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, err := e.Read(context.Background(), sub, filepath.Join(sub, "f"), false); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(sub, filepath.Join(serverRoot, "old")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, sub); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(outside, "g"), []byte("secret"), 0o600)
	if _, err := e.Read(context.Background(), sub, filepath.Join(sub, "g"), false); !errors.Is(err, ErrOutsideRoot) {
		t.Errorf("read through the swapped root: got %v, want ErrOutsideRoot", err)
	}
}

func TestMissingServerRootIsAnError(t *testing.T) {
	if _, err := NewEngine(EngineConfig{Roots: []string{filepath.Join(t.TempDir(), "none")}}, nil); err == nil {
		t.Error("engine started with a dataset root that does not exist")
	}
}
