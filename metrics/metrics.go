package metrics

import (
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/tiers"
)

// Engine is what a server's engine metrics are read from (a *core.Engine).
type Engine interface {
	Stats() core.StatsSnapshot
	Latencies() []core.Latency
}

// Membership is what the ring metrics are read from (an *rpc.Handler): the version of the
// membership the server's clients reported (one change each) and the servers they report dead.
type Membership interface {
	Membership() (version int64, dead []string)
}

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
	newStatMetric("source_checks_total", "Cached copies compared with their source's identity (once per file per job).", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.SourceChecks }),
	newStatMetric("stale_copies_total", "Cached copies dropped because their source had changed or was gone.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.StaleCopies }),
	newStatMetric("reader_source_ranges_total", "Ranges of large files programs under fitcache run read from the source (no block held them).", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.ReaderSourceRanges }),
	newStatMetric("reader_source_bytes_total", "Bytes of those ranges.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.ReaderSourceBytes }),
	newStatMetric("store_refused_total", "Replica copies refused: not what their owner stamped, or not the source's version.", prometheus.CounterValue,
		func(s *core.StatsSnapshot) int64 { return s.StoreRefused }),
	newStatMetric("refusals_total", "Connections refused: no handshake or a wrong proof of the job token, or too many connections.", prometheus.CounterValue,
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
	{prometheus.NewDesc("fitcache_tier_index_bytes", "Size of a tier's index, outside its budget: it grows with the files the tier holds.", []string{"tier", "dir"}, nil),
		prometheus.GaugeValue, func(t *tiers.Info) int64 { return t.IndexBytes }},
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

// engineCollector exports an engine's statistics and request latencies, read at each
// scrape. It is safe for concurrent use if its engine is.
type engineCollector struct{ e Engine }

// Describe implements prometheus.Collector.
func (c engineCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range statMetrics {
		ch <- m.desc
	}
	for _, m := range tierMetrics {
		ch <- m.desc
	}
	for _, d := range []*prometheus.Desc{hitsDesc, requestDurationDesc, requestBytesDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c engineCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.e.Stats()
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
	for _, l := range c.e.Latencies() {
		buckets := make(map[float64]uint64, len(bounds))
		for i, b := range bounds {
			buckets[b] = l.Buckets[i]
		}
		ch <- prometheus.MustNewConstHistogram(requestDurationDesc, l.Count, l.Seconds, buckets, l.Op, l.Origin.String())
		if l.Op == "read" {
			ch <- prometheus.MustNewConstMetric(requestBytesDesc, prometheus.CounterValue, float64(l.Bytes), l.Origin.String())
		}
	}
}

// membershipCollector exports the ring membership a server's clients report.
type membershipCollector struct{ m Membership }

// Describe implements prometheus.Collector.
func (c membershipCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- ringChangesDesc
	ch <- deadServersDesc
}

// Collect implements prometheus.Collector.
func (c membershipCollector) Collect(ch chan<- prometheus.Metric) {
	version, dead := c.m.Membership()
	ch <- prometheus.MustNewConstMetric(ringChangesDesc, prometheus.CounterValue, float64(version))
	ch <- prometheus.MustNewConstMetric(deadServersDesc, prometheus.GaugeValue, float64(len(dead)))
}

// Server holds the metrics of one server in a registry of its own. It is safe for
// concurrent use.
type Server struct {
	reg              *prometheus.Registry
	rpcReadDuration  *prometheus.HistogramVec // by caller and origin
	rpcReadBytes     *prometheus.CounterVec   // by caller
	nodeOpenDuration *prometheus.HistogramVec // by origin
}

// New returns the metrics of a server over e: its engine's, the Read RPCs' and the node
// socket's (listed once observed), and the Go runtime and process collectors.
func New(e Engine) *Server {
	s := &Server{
		reg: prometheus.NewRegistry(),
		rpcReadDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "fitcache_rpc_read_duration_seconds",
			Help: "Time this server took to answer a Read RPC, reply included, by caller (local: a client on this node, " +
				"which maps cached files itself; remote: a client on another node, sent the bytes) and origin (a tier kind, " +
				"inflight, source; peer: a range another node's server sent). Failed reads are not counted.",
			Buckets: core.LatencyBuckets(),
		}, []string{"caller", "origin"}),
		rpcReadBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fitcache_rpc_read_bytes_total",
			Help: "Bytes of the files Read RPCs answered, by caller (local: mapped by the caller; remote: sent).",
		}, []string{"caller"}),
		nodeOpenDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "fitcache_node_open_duration_seconds",
			Help: "Time the node socket took to answer an open of a reader on this node (the preload shim), by origin " +
				"(tier: a tier file of this node, filled first on a miss; remote: bytes another node's server sent; " +
				"source: the source file itself; source-while-cached: the source of a large file, handed over while it is " +
				"copied). Failed opens are not counted.",
			Buckets: core.LatencyBuckets(),
		}, []string{"origin"}),
	}
	s.reg.MustRegister(engineCollector{e}, s.rpcReadDuration, s.rpcReadBytes, s.nodeOpenDuration,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return s
}

// WatchMembership adds the ring metrics, read from m at each scrape. Call it once.
func (s *Server) WatchMembership(m Membership) {
	s.reg.MustRegister(membershipCollector{m})
}

// ObserveRead records a Read RPC answered in d with a file of n bytes from origin, for a
// caller on this node (local) or another one (see rpc.ServerConfig.OnRead).
func (s *Server) ObserveRead(local bool, origin core.Origin, d time.Duration, n int64) {
	caller := "remote"
	if local {
		caller = "local"
	}
	s.rpcReadDuration.WithLabelValues(caller, origin.String()).Observe(d.Seconds())
	s.rpcReadBytes.WithLabelValues(caller).Add(float64(n))
}

// ObserveNodeOpen records an open the node socket answered in d with a descriptor of origin.
// Its labels are those the README gives, older than core.Origin's names: "tier" for a tier of
// any kind, "remote" for a memory file holding the bytes another node's server sent, else the
// origin's name ("source", "source-while-cached").
func (s *Server) ObserveNodeOpen(origin core.Origin, d time.Duration) {
	label := origin.String()
	if _, ok := origin.Tier(); ok {
		label = "tier"
	} else if origin == core.OriginPeer {
		label = "remote"
	}
	s.nodeOpenDuration.WithLabelValues(label).Observe(d.Seconds())
}

// Registry returns the server's registry, for the host to add collectors of its own.
func (s *Server) Registry() *prometheus.Registry { return s.reg }

// Handler serves the registry over HTTP at /metrics, in the Prometheus exposition formats.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{}))
	return mux
}
