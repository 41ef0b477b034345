package main

import (
	"bytes"
	"math"
	"os"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/rpc"
)

// TestMain lets the test binary serve as the benchmark's child processes (see runChild).
func TestMain(m *testing.M) {
	if runChild() {
		return
	}
	rpc.QuietKitexLogs()
	os.Exit(m.Run())
}

// TestSmoke runs the benchmark at a CI size: every path at every size and number of reads
// in flight reports figures that make sense (no timing is asserted: the machine may be busy).
func TestSmoke(t *testing.T) {
	cfg := config{Sizes: []int{3000, 300 << 10}, InFlight: []int{1, 3}, MaxFiles: 5, MaxBytes: 1 << 30, Reads: 12,
		Rounds: 2, Profile: t.TempDir()}
	var out bytes.Buffer
	results, err := run(cfg, &out)
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
	want := 0
	for _, k := range cfg.InFlight {
		want += len(remotePaths(cfg, k))
	}
	if got, want := len(results), len(cfg.Sizes)*(1+want); got != want {
		t.Fatalf("%d results, want %d", got, want)
	}
	for _, r := range results {
		ok := r.P50ms > 0 && r.P99ms >= r.P50ms && r.MBps > 0 && !math.IsInf(r.MBps, 0) && r.ClientCPU >= 0 &&
			r.ServerCPU >= 0 && (r.ServerCPU == 0) == (r.Path == pathLocal)
		if !ok {
			t.Errorf("%+v: figures out of range", r)
		}
	}
	if rows := strings.Count("\n"+out.String(), "\n| "); rows != len(results)+1 { // and the header
		t.Errorf("%d table rows, want %d:\n%s", rows, len(results)+1, out.String())
	}
	profiles, _ := os.ReadDir(cfg.Profile)
	if want := 2 * len(cfg.Sizes) * len(cfg.InFlight); len(profiles) != want {
		t.Errorf("%d profiles written, want %d", len(profiles), want)
	}
}
