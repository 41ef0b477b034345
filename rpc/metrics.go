package rpc

import (
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/tiers"
)

// A server's metrics live in a registry of its own (Handler.Registry), never in the global
// default one, so that several servers in one process (tests, an embedding program) do not
// collide. The engine's counters are read from its statistics at each scrape (statsCollector)
// rather than kept twice; the RPC read histogram is observed by Handler.Read, once a request.

// metricsNamespace prefixes every FitCache metric.
const metricsNamespace = "fitcache"

// statMetric is a metric read from an engine's statistics.
type statMetric struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(s *core.StatsSnapshot) int64
}

func newStatMetric(name, help string, kind prometheus.ValueType, value func(s *core.StatsSnapshot) int64) statMetric {
	return statMetric{prometheus.NewDesc(metricsNamespace+"_"+name, help, nil, nil), kind, value}
}

// statMetrics are the engine's counters and gauges without labels.
var statMetrics = []statMetric{
	newStatMetric("inflight_hits_total", "Reads served from a file being read or published.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.InflightHits }),
	newStatMetric("misses_total", "Reads that found the file in no tier.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Misses }),
	newStatMetric("client_hits_total", "Of the hits, those that readers on this node served from tier files themselves.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.ClientHits }),
	newStatMetric("source_reads_total", "Files read from the source file system.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.SourceReads }),
	newStatMetric("source_bytes_total", "Bytes read from the source file system.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.SourceBytes }),
	newStatMetric("served_bytes_total", "Bytes served to readers (over RPC, in process and from tier files by the readers themselves).", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.BytesServed }),
	newStatMetric("published_total", "Files written into a tier.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Published }),
	newStatMetric("spilled_total", "Evicted files moved to a slower tier.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Spilled }),
	newStatMetric("evictions_total", "Files removed from a tier to make room.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Evictions }),
	newStatMetric("uncached_total", "Files too large for every tier, served uncached.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Uncached }),
	newStatMetric("errors_total", "Reads that failed.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Errors }),
	newStatMetric("publish_errors_total", "Publications that failed.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.PublishErrors }),
	newStatMetric("stored_total", "Replica copies received from clients.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Stored }),
	newStatMetric("refusals_total", "Connections and requests refused: wrong or missing job token, or too many connections.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Refusals }),

	newStatMetric("prefetch_reads", "Source reads prefetch may run at once (0: off).", prometheus.GaugeValue,
		func(s *core.StatsSnapshot) int64 { return int64(s.Prefetch.Reads) }),
	newStatMetric("prefetch_jobs_active", "Prefetch jobs running.", prometheus.GaugeValue,
		func(s *core.StatsSnapshot) int64 { return int64(s.Prefetch.JobsActive) }),
	newStatMetric("prefetch_files_queued", "Files of running prefetch jobs not yet handled.", prometheus.GaugeValue,
		func(s *core.StatsSnapshot) int64 { return s.Prefetch.FilesQueued }),
	newStatMetric("prefetch_jobs_total", "Prefetch jobs started.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Prefetch.Jobs }),
	newStatMetric("prefetch_fetched_total", "Files prefetch read from the source and cached.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Prefetch.Fetched }),
	newStatMetric("prefetch_fetched_bytes_total", "Bytes of the files prefetch read from the source and cached.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Prefetch.Bytes }),
	newStatMetric("prefetch_skipped_cached_total", "Files prefetch skipped: cached already.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Prefetch.SkippedCached }),
	newStatMetric("prefetch_skipped_inflight_total", "Files prefetch skipped: a reader was reading them already.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Prefetch.SkippedInflight }),
	newStatMetric("prefetch_failed_total", "Files prefetch could not read.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Prefetch.Failed }),
	newStatMetric("prefetch_stopped_budget_total", "Prefetch jobs stopped because the tiers were full (prefetch never evicts).", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Prefetch.StoppedBudget }),
	newStatMetric("prefetch_abandoned_total", "Prefetch jobs stopped because their clients stopped renewing them.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.Prefetch.Abandoned }),
}

// tierMetric is a metric of each tier, labelled by its kind and directory.
type tierMetric struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(t *tiers.Info) int64
}

var tierMetrics = []tierMetric{
	{prometheus.NewDesc("fitcache_tier_used_bytes", "Bytes held by a tier.", []string{"tier", "dir"}, nil),
		prometheus.GaugeValue, func(t *tiers.Info) int64 { return t.Used }},
	{prometheus.NewDesc("fitcache_tier_budget_bytes", "Byte budget of a tier.", []string{"tier", "dir"}, nil),
		prometheus.GaugeValue, func(t *tiers.Info) int64 { return t.Budget }},
	{prometheus.NewDesc("fitcache_tier_capacity_bytes", "Size of the file system holding a tier.", []string{"tier", "dir"}, nil),
		prometheus.GaugeValue, func(t *tiers.Info) int64 { return t.Capacity }},
	{prometheus.NewDesc("fitcache_tier_files", "Files held by a tier.", []string{"tier", "dir"}, nil),
		prometheus.GaugeValue, func(t *tiers.Info) int64 { return int64(t.Files) }},
	{prometheus.NewDesc("fitcache_tier_index_evictions_total", "Files evicted from a tier because their bucket of its index was full.", []string{"tier", "dir"}, nil),
		prometheus.CounterValue, func(t *tiers.Info) int64 { return t.IndexEvictions }},
}

var (
	hitsDesc = prometheus.NewDesc("fitcache_hits_total", "Reads served from a tier, by tier kind.", []string{"tier"}, nil)

	requestDurationDesc = prometheus.NewDesc("fitcache_request_duration_seconds",
		"Time the engine took to serve a request, by kind (read: the bytes or a mapping; fetch: into a tier for a reader on this node) "+
			"and origin (a tier kind, inflight: a file another request was reading, source). Failed requests are not counted.",
		[]string{"op", "origin"}, nil)
	requestBytesDesc = prometheus.NewDesc("fitcache_request_bytes_total",
		"Bytes the engine served to read requests, by origin (a fetch serves none: its reader reads the tier).",
		[]string{"origin"}, nil)

	ringChangesDesc = prometheus.NewDesc("fitcache_ring_changes_total",
		"Membership changes (servers found dead or back) reported by clients.", nil, nil)
	deadServersDesc = prometheus.NewDesc("fitcache_dead_servers", "Servers this server's clients report dead.", nil, nil)
)

// statsCollector exports a handler's engine statistics, request latencies and ring
// membership, read at each scrape. It is safe for concurrent use.
type statsCollector struct{ h *Handler }

// Describe implements prometheus.Collector.
func (c statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range statMetrics {
		ch <- m.desc
	}
	for _, m := range tierMetrics {
		ch <- m.desc
	}
	for _, d := range []*prometheus.Desc{hitsDesc, requestDurationDesc, requestBytesDesc, ringChangesDesc, deadServersDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c statsCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.h.engine.Stats()
	for _, m := range statMetrics {
		ch <- prometheus.MustNewConstMetric(m.desc, m.kind, float64(m.value(&s)))
	}
	for kind, n := range s.Hits {
		ch <- prometheus.MustNewConstMetric(hitsDesc, prometheus.CounterValue, float64(n), kind)
	}
	for i := range s.Tiers {
		for _, m := range tierMetrics {
			ch <- prometheus.MustNewConstMetric(m.desc, m.kind, float64(m.value(&s.Tiers[i])), s.Tiers[i].Kind, s.Tiers[i].Dir)
		}
	}
	bounds := core.LatencyBuckets()
	for _, l := range c.h.engine.Latencies() {
		buckets := make(map[float64]uint64, len(bounds))
		for i, b := range bounds {
			buckets[b] = l.Buckets[i]
		}
		ch <- prometheus.MustNewConstHistogram(requestDurationDesc, l.Count, l.Seconds, buckets, l.Op, l.Origin)
		if l.Op == "read" {
			ch <- prometheus.MustNewConstMetric(requestBytesDesc, prometheus.CounterValue, float64(l.Bytes), l.Origin)
		}
	}
	version, dead := c.h.members.since(-1)
	ch <- prometheus.MustNewConstMetric(ringChangesDesc, prometheus.CounterValue, float64(version))
	ch <- prometheus.MustNewConstMetric(deadServersDesc, prometheus.GaugeValue, float64(len(dead)))
}

// rpcMetrics are the metrics Handler.Read observes itself.
type rpcMetrics struct {
	readDuration *prometheus.HistogramVec // by caller and origin
	readBytes    *prometheus.CounterVec   // by caller
}

func newRPCMetrics() rpcMetrics {
	return rpcMetrics{
		readDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "fitcache_rpc_read_duration_seconds",
			Help: "Time this server took to answer a Read RPC, reply included, by caller (local: a client on this node, " +
				"which maps cached files itself; remote: a client on another node, sent the bytes) and origin (a tier kind, " +
				"inflight, source). Failed reads are not counted.",
			Buckets: core.LatencyBuckets(),
		}, []string{"caller", "origin"}),
		readBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fitcache_rpc_read_bytes_total",
			Help: "Bytes of the files Read RPCs answered, by caller (local: mapped by the caller; remote: sent).",
		}, []string{"caller"}),
	}
}

// observeRead records a Read RPC answered in d with a file of n bytes.
func (m rpcMetrics) observeRead(local bool, origin string, d time.Duration, n int64) {
	caller := "remote"
	if local {
		caller = "local"
	}
	m.readDuration.WithLabelValues(caller, origin).Observe(d.Seconds())
	m.readBytes.WithLabelValues(caller).Add(float64(n))
}

// newRegistry returns the registry of h: its engine's statistics, its RPC metrics, and the
// Go runtime and process collectors.
func newRegistry(h *Handler) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(statsCollector{h}, h.metrics.readDuration, h.metrics.readBytes,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// Registry returns the handler's metrics registry, for the host to add its own collectors
// (the node socket's, say) before serving MetricsHandler.
func (h *Handler) Registry() *prometheus.Registry { return h.registry }

// MetricsHandler serves the handler's registry over HTTP at /metrics, in the Prometheus
// exposition formats.
func (h *Handler) MetricsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(h.registry, promhttp.HandlerOpts{}))
	return mux
}
