package server

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWriteReadyFileNeverFollowsLinks(t *testing.T) {
	dir := t.TempDir()
	victim := filepath.Join(dir, "victim")
	for _, tc := range []struct {
		name    string
		plant   func(path string) error
		wantErr error // nil: written
	}{
		{"absent", func(string) error { return nil }, nil},
		{"stale regular file", func(p string) error { return os.WriteFile(p, []byte("old"), 0o600) }, nil},
		{"planted link", func(p string) error { return os.Symlink(victim, p) }, errReadyLink},
		{"planted dangling link", func(p string) error { return os.Symlink(filepath.Join(dir, "none"), p) }, errReadyLink},
	} {
		os.WriteFile(victim, []byte("keep"), 0o600)
		path := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-"))
		if err := tc.plant(path); err != nil {
			t.Fatal(err)
		}
		err := writeReadyFile(path, "127.0.0.1:7070\n")
		if !errors.Is(err, tc.wantErr) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.wantErr)
		}
		if b, _ := os.ReadFile(victim); string(b) != "keep" {
			t.Errorf("%s: the link's target was written: %q", tc.name, b)
		}
		if tc.wantErr != nil {
			continue
		}
		fi, err := os.Lstat(path)
		if b, _ := os.ReadFile(path); err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o600 || string(b) != "127.0.0.1:7070\n" {
			t.Errorf("%s: ready file %v (%v), content %q", tc.name, fi.Mode(), err, b)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".*tmp-*")); len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}
}
