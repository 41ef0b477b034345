package metrics

import (
	"context"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// scrape fetches /metrics from m's handler and parses it.
func scrape(t *testing.T, m *Server) map[string]*dto.MetricFamily {
	t.Helper()
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); resp.StatusCode != 200 || !strings.HasPrefix(ct, "text/plain") {
		t.Fatalf("GET /metrics: status %d, content type %q", resp.StatusCode, ct)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

// sample returns the value of the sample of family name with the given labels (name=value
// pairs): a counter's or gauge's value, a histogram's count. A missing sample fails the test.
func sample(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	t.Helper()
	f := fams[name]
	if f == nil {
		t.Fatalf("no metric family %s", name)
	}
	for _, m := range f.GetMetric() {
		got := map[string]string{}
		for _, l := range m.GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		match := len(got) == len(labels)/2
		for i := 0; match && i+1 < len(labels); i += 2 {
			match = got[labels[i]] == labels[i+1]
		}
		if !match {
			continue
		}
		switch f.GetType() {
		case dto.MetricType_COUNTER:
			return m.GetCounter().GetValue()
		case dto.MetricType_GAUGE:
			return m.GetGauge().GetValue()
		case dto.MetricType_HISTOGRAM:
			return float64(m.GetHistogram().GetSampleCount())
		}
	}
	t.Fatalf("%s has no sample with labels %v", name, labels)
	return 0
}

func TestMetrics(t *testing.T) {
	e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: "16MiB"}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := rpc.ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	m := New(e)
	srv, h, _ := rpc.Serve(e, ln, rpc.ServerConfig{OnRead: m.ObserveRead})
	t.Cleanup(func() { srv.Stop(); e.Close() })
	m.WatchMembership(h)
	root := t.TempDir()
	path := filepath.Join(root, "a.bin")
	os.WriteFile(path, []byte("abc"), 0o644)
	c, _ := rpc.Dial(sock, rpc.ClientConfig{})
	defer c.Close()

	before := scrape(t, m)
	for name, want := range map[string]dto.MetricType{
		"fitcache_hits_total": dto.MetricType_COUNTER, "fitcache_misses_total": dto.MetricType_COUNTER,
		"fitcache_source_reads_total": dto.MetricType_COUNTER, "fitcache_source_bytes_total": dto.MetricType_COUNTER,
		"fitcache_served_bytes_total": dto.MetricType_COUNTER, "fitcache_evictions_total": dto.MetricType_COUNTER,
		"fitcache_errors_total": dto.MetricType_COUNTER, "fitcache_published_total": dto.MetricType_COUNTER,
		"fitcache_request_duration_seconds": dto.MetricType_HISTOGRAM, "fitcache_request_bytes_total": dto.MetricType_COUNTER,
		"fitcache_prefetch_files_queued": dto.MetricType_GAUGE, "fitcache_prefetch_fetched_total": dto.MetricType_COUNTER,
		"fitcache_prefetch_fetched_bytes_total": dto.MetricType_COUNTER, "fitcache_prefetch_failed_total": dto.MetricType_COUNTER,
		"fitcache_tier_used_bytes": dto.MetricType_GAUGE, "fitcache_tier_files": dto.MetricType_GAUGE,
		"fitcache_ring_changes_total": dto.MetricType_COUNTER, "fitcache_dead_servers": dto.MetricType_GAUGE,
		"go_goroutines": dto.MetricType_GAUGE, "process_cpu_seconds_total": dto.MetricType_COUNTER,
	} {
		if f := before[name]; f == nil || f.GetType() != want {
			t.Errorf("%s: got %v, want a %v", name, f.GetType(), want)
		}
	}
	if got := sample(t, before, "fitcache_misses_total"); got != 0 {
		t.Errorf("misses before any read: got %v, want 0", got)
	}
	if got := sample(t, before, "fitcache_request_duration_seconds", "op", "read", "origin", "source"); got != 0 {
		t.Errorf("timed reads from the source before any read: got %v, want 0", got)
	}

	ctx := context.Background()
	for _, local := range []bool{false, false, true} { // a miss, then hits by a remote and a local caller
		if _, err := c.Read(ctx, root, path, local); err != nil {
			t.Fatal(err)
		}
	}

	after := scrape(t, m)
	// The RPC metrics have samples, and so are listed, once a read was answered.
	for name, want := range map[string]dto.MetricType{
		"fitcache_rpc_read_duration_seconds": dto.MetricType_HISTOGRAM, "fitcache_rpc_read_bytes_total": dto.MetricType_COUNTER,
	} {
		if f := after[name]; f == nil || f.GetType() != want {
			t.Errorf("%s: got %v, want a %v", name, f.GetType(), want)
		}
	}
	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"fitcache_misses_total", nil, 1},
		{"fitcache_source_reads_total", nil, 1},
		{"fitcache_source_bytes_total", nil, 3},
		{"fitcache_hits_total", []string{"tier", "memory"}, 2},
		{"fitcache_served_bytes_total", nil, 9},
		{"fitcache_request_duration_seconds", []string{"op", "read", "origin", "source"}, 1},
		{"fitcache_request_duration_seconds", []string{"op", "read", "origin", "memory"}, 2},
		{"fitcache_request_duration_seconds", []string{"op", "fetch", "origin", "memory"}, 0},
		{"fitcache_request_bytes_total", []string{"origin", "source"}, 3},
		{"fitcache_request_bytes_total", []string{"origin", "memory"}, 6},
		{"fitcache_rpc_read_duration_seconds", []string{"caller", "remote", "origin", "source"}, 1},
		{"fitcache_rpc_read_duration_seconds", []string{"caller", "remote", "origin", "memory"}, 1},
		{"fitcache_rpc_read_duration_seconds", []string{"caller", "local", "origin", "memory"}, 1},
		{"fitcache_rpc_read_bytes_total", []string{"caller", "remote"}, 6},
		{"fitcache_rpc_read_bytes_total", []string{"caller", "local"}, 3},
		{"fitcache_tier_files", []string{"tier", "memory", "dir", e.TierDirs()[0].Path}, 1},
		{"fitcache_ring_changes_total", nil, 0},
		{"fitcache_dead_servers", nil, 0},
	} {
		if got := sample(t, after, tc.name, tc.labels...); got != tc.want {
			t.Errorf("%s%v: got %v, want %v", tc.name, tc.labels, got, tc.want)
		}
	}
	// A range of a block is a read too: its bytes and time are the RPC's.
	big := filepath.Join(root, "big.bin")
	os.WriteFile(big, make([]byte, 9<<20), 0o644)
	if reply, err := c.ReadBlockRange(ctx, root, big, e.BlockBytes(), 1, 10, 100, false); err != nil || len(reply.Data) != 100 {
		t.Fatalf("a range of block 1: %v, %v", reply, err)
	}
	ranged := scrape(t, m)
	if got := sample(t, ranged, "fitcache_rpc_read_bytes_total", "caller", "remote"); got != 6+100 {
		t.Errorf("remote bytes after a range of 100: got %v, want %v", got, 6+100)
	}
	if got := sample(t, ranged, "fitcache_rpc_read_duration_seconds", "caller", "remote", "origin", "source"); got != 2 {
		t.Errorf("remote reads from the source after a range: got %v, want 2", got)
	}
	// Each server has a registry of its own: a second one over the same engine registers
	// the same metrics without a conflict, and reports the engine's counters.
	if got := sample(t, scrape(t, New(e)), "fitcache_misses_total"); got != 2 { // the file, the block
		t.Errorf("misses through a second registry: got %v, want 2", got)
	}
}

// fakeEngine and fakeMembers serve fixed statistics.
type fakeEngine struct{ s core.StatsSnapshot }

func (f fakeEngine) Stats() core.StatsSnapshot { return f.s }
func (f fakeEngine) Latencies() []core.Latency { return nil }

type fakeMembers struct {
	version int64
	dead    []string
}

func (f fakeMembers) Membership() (int64, []string) { return f.version, f.dead }

func TestMetricsFollowTheStatistics(t *testing.T) {
	m := New(fakeEngine{core.StatsSnapshot{
		Hits: map[string]int64{"memory": 7, "disk": 2}, Evictions: 3, Refusals: 4, Stored: 5, StoreRefused: 6,
		Prefetch: core.PrefetchStats{Reads: 16, JobsActive: 1, FilesQueued: 40, Jobs: 2, Fetched: 60,
			SkippedCached: 6, SkippedInflight: 2, Failed: 1, Bytes: 1 << 20, StoppedBudget: 1},
		Tiers: []tiers.Info{{Dir: "/dev/shm/fc", Kind: "memory", Used: 1000, Budget: 4096, Files: 3, IndexBytes: 675840}},
	}})
	m.WatchMembership(fakeMembers{version: 3, dead: []string{"n2:7070"}})
	m.ObserveNodeOpen(core.OriginPeer, time.Millisecond)
	m.ObserveNodeOpen(core.OriginNVMe, time.Millisecond)
	m.ObserveNodeOpen(core.OriginMemory, time.Millisecond)
	fams := scrape(t, m)
	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"fitcache_hits_total", []string{"tier", "memory"}, 7},
		{"fitcache_hits_total", []string{"tier", "disk"}, 2},
		{"fitcache_evictions_total", nil, 3},
		{"fitcache_refusals_total", nil, 4},
		{"fitcache_stored_total", nil, 5},
		{"fitcache_store_refused_total", nil, 6},
		{"fitcache_prefetch_reads", nil, 16},
		{"fitcache_prefetch_jobs_active", nil, 1},
		{"fitcache_prefetch_files_queued", nil, 40},
		{"fitcache_prefetch_jobs_total", nil, 2},
		{"fitcache_prefetch_fetched_total", nil, 60},
		{"fitcache_prefetch_skipped_cached_total", nil, 6},
		{"fitcache_prefetch_skipped_inflight_total", nil, 2},
		{"fitcache_prefetch_failed_total", nil, 1},
		{"fitcache_prefetch_fetched_bytes_total", nil, 1 << 20},
		{"fitcache_prefetch_stopped_budget_total", nil, 1},
		{"fitcache_prefetch_abandoned_total", nil, 0},
		{"fitcache_tier_used_bytes", []string{"tier", "memory", "dir", "/dev/shm/fc"}, 1000},
		{"fitcache_tier_budget_bytes", []string{"tier", "memory", "dir", "/dev/shm/fc"}, 4096},
		{"fitcache_tier_files", []string{"tier", "memory", "dir", "/dev/shm/fc"}, 3},
		{"fitcache_tier_index_bytes", []string{"tier", "memory", "dir", "/dev/shm/fc"}, 675840},
		{"fitcache_ring_changes_total", nil, 3},
		{"fitcache_dead_servers", nil, 1},
		{"fitcache_node_open_duration_seconds", []string{"origin", "remote"}, 1},
		{"fitcache_node_open_duration_seconds", []string{"origin", "tier"}, 2},
	} {
		if got := sample(t, fams, tc.name, tc.labels...); got != tc.want {
			t.Errorf("%s%v: got %v, want %v", tc.name, tc.labels, got, tc.want)
		}
	}
}
