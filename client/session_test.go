package client

import (
	"os"
	"testing"
	"time"
)

// A dataset file rewritten between two runs is read anew by the second run's client, while
// the clients of one run (fresh DataLoader workers) share one check and go on hitting their
// mapped tiers without asking the server.
func TestRewrittenFileIsReadAnewByTheNextJob(t *testing.T) {
	cfg, _ := startServer(t)
	root := t.TempDir()
	path := writeFile(t, root, "f.bin", []byte("first version"))
	cfg.Job = "run-1"
	open := func() *Client {
		t.Helper()
		c, err := Open(root, cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	if got := readBytes(t, open(), "f.bin"); string(got) != "first version" {
		t.Fatalf("first read: %q", got)
	}
	// Same size, the mtime set back: only ctime and the bytes tell.
	st, _ := os.Stat(path)
	time.Sleep(10 * time.Millisecond)
	if err := os.WriteFile(path, []byte("SECOND version"[:13]), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chtimes(path, st.ModTime(), st.ModTime())

	worker := open() // another client of run 1
	if got := readBytes(t, worker, "f.bin"); string(got) != "first version" {
		t.Errorf("same job: %q, want the copy it checked (no check per read)", got)
	}
	if n := worker.counts.localHits.Load(); n != 1 {
		t.Errorf("same job: %d local hits, want 1: the copy is served from the tier without asking", n)
	}
	cfg.Job = "run-2"
	next := open()
	if got := readBytes(t, next, "f.bin"); string(got) != "SECOND versio" {
		t.Errorf("next job: %q, want the rewritten bytes", got)
	}
	if got := readBytes(t, next, "f.bin"); string(got) != "SECOND versio" || next.counts.localHits.Load() != 1 {
		t.Errorf("next job, second read: %q with %d local hits; want the new copy from the tier", got,
			next.counts.localHits.Load())
	}
}
