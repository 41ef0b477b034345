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

// timedOrigins are the origins of the engine's requests, in the order of their histograms:
// the tiers, a file another request was reading, the source.
var timedOrigins = [...]Origin{OriginMemory, OriginPMem, OriginNVMe, OriginDisk, OriginInflight, OriginSource}

const numOrigins = len(timedOrigins)

// timedIndex returns the index of origin's histograms, or -1 for an origin no request of the
// engine has.
func timedIndex(origin Origin) int {
	if k, ok := origin.Tier(); ok {
		return int(k)
	}
	switch origin {
	case OriginInflight:
		return int(tiers.NumKinds)
	case OriginSource:
		return int(tiers.NumKinds) + 1
	}
	return -1
}

// Kinds of request an engine times, as the first index of its histograms: Read (the bytes or a mapping) and Fetch (into a tier,
// for a caller on this node that reads it there).
const (
	opRead = iota
	opFetch
	numOps
)

var opNames = [numOps]string{"read", "fetch"}

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
	Origin Origin // a tier, inflight or the source
	// Count is the number of requests; Buckets the cumulative counts, one per bound of
	// LatencyBuckets() (requests that took at most that long).
	Count   uint64
	Buckets []uint64
	Seconds float64 // the sum of the requests' durations
	Bytes   int64   // bytes served (a Fetch serves none: its caller reads the tier itself)
}

// latencies holds an engine's histograms. The zero value is ready; it is safe for concurrent use.
type latencies [numOps][numOrigins]histogram

func (l *latencies) observe(op int, origin Origin, d time.Duration, bytes int64) {
	if o := timedIndex(origin); o >= 0 {
		l[op][o].observe(d, bytes)
	}
}

// snapshot copies the histograms, every op and origin included (those without requests too).
func (l *latencies) snapshot() []Latency {
	out := make([]Latency, 0, numOps*numOrigins)
	for op := range l {
		for o := range l[op] {
			h := &l[op][o]
			lat := Latency{Op: opNames[op], Origin: timedOrigins[o], Buckets: make([]uint64, len(latencyBuckets)),
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
