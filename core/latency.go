package core

import (
	"sync/atomic"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

// latencyBuckets are the upper bounds, in seconds, of the buckets of the request latencies
// an engine records (see Engine.Latencies): from a tier hit (tens of microseconds) to a
// slow source (seconds).
var latencyBuckets = [...]float64{25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
	50e-3, 100e-3, 250e-3, 500e-3, 1, 2.5, 5, 10}

// LatencyBuckets returns the upper bounds, in seconds, of the buckets of Latency.Buckets.
func LatencyBuckets() []float64 { return latencyBuckets[:] }

// Where a request was served from, as the index of its latency histogram: a tier kind
// (below tiers.NumKinds), then these.
const (
	originInflight = tiers.NumKinds + iota // a file being read or published by another request
	originSource                           // read from the source by this request
	numOrigins
)

// Kinds of request an engine times, as the first index of its histograms: Read (the bytes or a mapping) and Fetch (into a tier,
// for a caller on this node that reads it there).
const (
	opRead = iota
	opFetch
	numOps
)

var opNames = [numOps]string{"read", "fetch"}

// originName names an origin index as Result.Origin does.
func originName(o int) string {
	switch o {
	case originInflight:
		return "inflight"
	case originSource:
		return "source"
	}
	return tiers.Kind(o).String()
}

// histogram counts durations in LatencyBuckets. The zero value is ready; it is safe for
// concurrent use (an observation is a few atomic adds, no lock).
type histogram struct {
	counts [len(latencyBuckets) + 1]atomic.Int64 // per bucket, the last one past the largest bound (+Inf)
	sum    atomic.Int64                          // nanoseconds
	bytes  atomic.Int64                          // bytes served by the requests counted
}

func (h *histogram) observe(d time.Duration, bytes int64) {
	s := d.Seconds()
	i := 0
	for i < len(latencyBuckets) && s > latencyBuckets[i] {
		i++
	}
	h.counts[i].Add(1)
	h.sum.Add(int64(d))
	if bytes > 0 {
		h.bytes.Add(bytes)
	}
}

// Latency is a copy of the latency histogram of one kind of request from one origin.
type Latency struct {
	Op     string // "read" or "fetch"
	Origin string // a tier kind, "inflight" or "source"
	// Count is the number of requests; Buckets the cumulative counts, one per bound of
	// LatencyBuckets() (requests that took at most that long).
	Count   uint64
	Buckets []uint64
	Seconds float64 // the sum of the requests' durations
	Bytes   int64   // bytes served (a Fetch serves none: its caller reads the tier itself)
}

// latencies holds an engine's histograms. The zero value is ready; it is safe for concurrent use.
type latencies [numOps][numOrigins]histogram

func (l *latencies) observe(op int, origin string, d time.Duration, bytes int64) {
	o := -1
	switch origin {
	case "inflight":
		o = originInflight
	case "source":
		o = originSource
	default:
		if k, err := tiers.ParseKind(origin); err == nil {
			o = int(k)
		}
	}
	if o >= 0 && o < numOrigins {
		l[op][o].observe(d, bytes)
	}
}

// snapshot copies the histograms, every op and origin included (those without requests too).
func (l *latencies) snapshot() []Latency {
	out := make([]Latency, 0, numOps*numOrigins)
	for op := range l {
		for o := range l[op] {
			h := &l[op][o]
			lat := Latency{Op: opNames[op], Origin: originName(o), Buckets: make([]uint64, len(latencyBuckets)),
				Seconds: time.Duration(h.sum.Load()).Seconds(), Bytes: h.bytes.Load()}
			for i := range h.counts {
				lat.Count += uint64(h.counts[i].Load())
				if i < len(latencyBuckets) {
					lat.Buckets[i] = lat.Count
				}
			}
			out = append(out, lat)
		}
	}
	return out
}
