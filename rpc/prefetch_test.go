package rpc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/tiers"
)

// servePrefetch serves an engine with prefetch on, with a job token.
func servePrefetch(t *testing.T, token string) (string, *core.Engine) {
	t.Helper()
	e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: "16MiB"}},
		Prefetch: core.PrefetchConfig{Reads: 4}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, _, _ := Serve(e, ln, ServerConfig{Token: token})
	t.Cleanup(func() { srv.Stop(); e.Close() })
	return sock, e
}

func TestPrefetchRoundTrip(t *testing.T) {
	sock, e := servePrefetch(t, "secret")
	root := t.TempDir()
	var paths []string
	var total int64
	for i := range 20 {
		p := filepath.Join(root, fmt.Sprintf("f%02d.bin", i))
		data := []byte(strings.Repeat("x", 1000+i))
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
		total += int64(len(data))
	}
	c, _ := Dial(sock, ClientConfig{Token: "secret"})
	defer c.Close()
	ctx := context.Background()
	info, err := c.Prefetch(ctx, core.PrefetchRequest{Root: root, Owner: "o", Paths: paths})
	if err != nil || info.Accepted != len(paths) || info.Files != len(paths) {
		t.Fatalf("prefetch: %+v, %v; want %d accepted", info, err, len(paths))
	}
	for i := 0; !info.Terminal() && i < 3000; i++ { // a bound, not a timing assertion
		time.Sleep(10 * time.Millisecond)
		if info, err = c.Prefetch(ctx, core.PrefetchRequest{Root: root, Owner: "o"}); err != nil {
			t.Fatal(err)
		}
	}
	if info.State != core.PrefetchDone || info.Fetched != len(paths) || info.Bytes != total {
		t.Errorf("job: %+v, want done with %d files and %d bytes fetched", info, len(paths), total)
	}

	js, err := c.Stats(ctx)
	var s core.StatsSnapshot
	if err == nil {
		err = json.Unmarshal([]byte(js), &s)
	}
	if err != nil || s.Prefetch.Fetched != int64(len(paths)) || s.Prefetch.Jobs != 1 || s.SourceReads != int64(len(paths)) {
		t.Errorf("stats: prefetch %+v, source reads %d, %v", s.Prefetch, s.SourceReads, err)
	}
	if p := e.Stats().Prefetch; p.Reads != 4 || p.JobsActive != 0 || p.FilesQueued != 0 || p.Bytes != total {
		t.Errorf("engine's prefetch stats %+v: want 4 reads at once, no job running, none queued, %d bytes", p, total)
	}

	_, err = c.Prefetch(ctx, core.PrefetchRequest{Root: root, Owner: "o", Paths: []string{"/etc/passwd"}})
	if !errors.Is(err, core.ErrOutsideRoot) || errors.Is(err, ErrUnavailable) {
		t.Errorf("path outside the root: got %v, want ErrOutsideRoot from the server", err)
	}
	wrong, _ := Dial(sock, ClientConfig{Token: "wrong"})
	defer wrong.Close()
	if _, err := wrong.Prefetch(ctx, core.PrefetchRequest{Root: root, Owner: "o", Paths: paths}); !errors.Is(err, ErrUnproven) {
		t.Errorf("wrong token: got %v, want ErrUnproven", err)
	}
}
