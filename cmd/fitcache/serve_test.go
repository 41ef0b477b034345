package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// serveEnv points the server's tiers and runtime directory into the test's temporary
// directory and gives it a job token.
func serveEnv(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("FITCACHE_TIERS", "memory:"+filepath.Join(dir, "tier"))
	t.Setenv("FITCACHE_RUNTIME_DIR", filepath.Join(dir, "run"))
	t.Setenv("FITCACHE_TOKEN", "job-token")
	return dir
}

// TestServeRefusesUnsafeSetups: the refusals happen before the server starts, so serve
// returns at once (a server that started would block: the test gives it 5 seconds).
func TestServeRefusesUnsafeSetups(t *testing.T) {
	dir := serveEnv(t)
	victim := filepath.Join(dir, "victim")
	os.WriteFile(victim, []byte("keep"), 0o600)
	link := filepath.Join(dir, "ready")
	if err := os.Symlink(victim, link); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"TCP without a root", []string{"--listen", "127.0.0.1:0"}, "needs --root"},
		{"frame limit beyond 2GiB", []string{"--socket", filepath.Join(dir, "s.sock"), "--max-frame", "4GiB"}, "--max-frame"},
		{"ready file planted as a link", []string{"--socket", filepath.Join(dir, "s.sock"), "--ready-file", link}, "symbolic link"},
	} {
		done := make(chan error, 1)
		go func() { done <- serve(tc.args) }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: got %v, want an error containing %q", tc.name, err, tc.want)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("%s: the server started", tc.name)
		}
	}
	if b, _ := os.ReadFile(victim); string(b) != "keep" {
		t.Errorf("the ready file's link target was overwritten: %q", b)
	}
}
