package core

import (
	"context"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestLatencies(t *testing.T) {
	e := newEngine(t, "1MiB")
	root, paths := dataset(t, 100, 200)
	ctx := context.Background()
	for _, p := range []string{paths[0], paths[0], paths[0]} { // a miss, then two memory hits
		res, err := e.Read(ctx, root, p, true)
		if err != nil {
			t.Fatal(err)
		}
		res.Release()
	}
	for _, p := range []string{paths[1], paths[1]} { // a miss, then a memory hit
		if err := e.Fetch(ctx, root, p); err != nil {
			t.Fatal(err)
		}
	}
	type key struct {
		op     string
		origin Origin
	}
	got := map[key][2]int64{}
	for _, l := range e.Latencies() {
		if len(l.Buckets) != len(LatencyBuckets()) || (len(l.Buckets) > 0 && l.Buckets[len(l.Buckets)-1] > l.Count) {
			t.Errorf("%s %s: buckets %v, count %d", l.Op, l.Origin, l.Buckets, l.Count)
		}
		if l.Count > 0 {
			got[key{l.Op, l.Origin}] = [2]int64{int64(l.Count), l.Bytes}
		}
		if l.Count > 0 && l.Seconds <= 0 {
			t.Errorf("%s %s: %d requests in %gs", l.Op, l.Origin, l.Count, l.Seconds)
		}
	}
	want := map[key][2]int64{
		{"read", OriginSource}: {1, 100}, {"read", OriginMemory}: {2, 200},
		{"fetch", OriginSource}: {1, 0}, {"fetch", OriginMemory}: {1, 0},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("requests and bytes by op and origin (-want +got):\n%s", diff)
	}
}

func TestHistogramBuckets(t *testing.T) {
	var l latencies
	for _, d := range []time.Duration{10 * time.Microsecond, 25 * time.Microsecond, 3 * time.Millisecond, time.Minute} {
		l.observe(opRead, OriginSource, d, 1)
	}
	l.observe(opRead, OriginPeer, time.Second, 1) // no request of the engine has it: dropped
	for _, lat := range l.snapshot() {
		if lat.Op != "read" || lat.Origin != OriginSource {
			if lat.Count != 0 {
				t.Errorf("%s %s: got %d requests, want 0", lat.Op, lat.Origin, lat.Count)
			}
			continue
		}
		// Bounds: 25µs 50µs 100µs 250µs 500µs 1ms 2.5ms 5ms ... 10s; a minute is past them all.
		want := []uint64{2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3}
		if diff := cmp.Diff(want, lat.Buckets); diff != "" || lat.Count != 4 || lat.Bytes != 4 {
			t.Errorf("count %d, bytes %d, buckets (-want +got):\n%s", lat.Count, lat.Bytes, diff)
		}
	}
}

// BenchmarkLatencyObserve measures what timing a request adds to it: the clock read and the
// observation.
func BenchmarkLatencyObserve(b *testing.B) {
	var l latencies
	for _, origin := range []Origin{OriginMemory, OriginDisk, OriginSource} {
		b.Run(origin.String(), func(b *testing.B) {
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					start := time.Now()
					l.observe(opRead, origin, time.Since(start), 4096)
				}
			})
		})
	}
}

// TestTimedOriginsIndexTheirHistograms: each origin the engine times finds its own
// histogram, and the snapshot names it.
func TestTimedOriginsIndexTheirHistograms(t *testing.T) {
	for i, o := range timedOrigins {
		if got := timedIndex(o); got != i {
			t.Errorf("%v: histogram %d, want %d", o, got, i)
		}
	}
	for _, o := range []Origin{OriginNone, OriginPeer, OriginSourceWhileCached, Origin(99)} {
		if got := timedIndex(o); got != -1 {
			t.Errorf("%v: histogram %d, want none", o, got)
		}
	}
}
