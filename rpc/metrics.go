package rpc

import (
	"fmt"
	"io"
	"net/http"
	"sort"
)

// WriteMetrics writes the server's counters in the Prometheus text exposition format.
func (h *Handler) WriteMetrics(w io.Writer) {
	s := h.engine.Stats()
	counter := func(name, help string, v int64) {
		fmt.Fprintf(w, "# HELP fitcache_%s %s\n# TYPE fitcache_%s counter\nfitcache_%s %d\n", name, help, name, name, v)
	}
	fmt.Fprintf(w, "# HELP fitcache_hits_total Reads served from a tier, by tier kind.\n# TYPE fitcache_hits_total counter\n")
	kinds := make([]string, 0, len(s.Hits))
	for k := range s.Hits {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		fmt.Fprintf(w, "fitcache_hits_total{tier=%q} %d\n", k, s.Hits[k])
	}
	counter("inflight_hits_total", "Reads served from a file being read or published.", s.InflightHits)
	counter("misses_total", "Reads that found the file in no tier.", s.Misses)
	counter("source_reads_total", "Files read from the source file system.", s.SourceReads)
	counter("source_bytes_total", "Bytes read from the source file system.", s.SourceBytes)
	counter("served_bytes_total", "Bytes served to clients.", s.BytesServed)
	counter("published_total", "Files written into a tier.", s.Published)
	counter("spilled_total", "Evicted files moved to a slower tier.", s.Spilled)
	counter("evictions_total", "Files removed from a tier to make room.", s.Evictions)
	counter("uncached_total", "Files too large for every tier, served uncached.", s.Uncached)
	counter("errors_total", "Reads that failed.", s.Errors)
	counter("publish_errors_total", "Publications that failed.", s.PublishErrors)
	counter("stored_total", "Replica copies received from clients.", s.Stored)
	counter("refusals_total", "Connections and requests refused: wrong or missing job token, or too many connections.", s.Refusals)
	writePrefetchMetrics(w, s.Prefetch)
	version, dead := h.members.since(-1)
	counter("ring_changes_total", "Membership changes (servers found dead or back) reported by clients.", version)
	fmt.Fprintf(w, "# HELP fitcache_dead_servers Servers this server's clients report dead.\n# TYPE fitcache_dead_servers gauge\nfitcache_dead_servers %d\n", len(dead))
	for _, g := range []struct {
		name, help string
		value      func(i int) int64
	}{
		{"tier_used_bytes", "Bytes held by a tier.", func(i int) int64 { return s.Tiers[i].Used }},
		{"tier_budget_bytes", "Byte budget of a tier.", func(i int) int64 { return s.Tiers[i].Budget }},
		{"tier_files", "Files held by a tier.", func(i int) int64 { return int64(s.Tiers[i].Files) }},
	} {
		fmt.Fprintf(w, "# HELP fitcache_%s %s\n# TYPE fitcache_%s gauge\n", g.name, g.help, g.name)
		for i, t := range s.Tiers {
			fmt.Fprintf(w, "fitcache_%s{tier=%q,dir=%q} %d\n", g.name, t.Kind, t.Dir, g.value(i))
		}
	}
}

// MetricsHandler serves WriteMetrics over HTTP at /metrics.
func (h *Handler) MetricsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		h.WriteMetrics(w)
	})
	return mux
}
