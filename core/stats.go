package core

import (
	"sync"
	"sync/atomic"

	"github.com/fitcache/fitcache/tiers"
)

// Stats counts what an engine did. The zero value is ready; it is safe for concurrent use.
type Stats struct {
	hits          [tiers.NumKinds]atomic.Int64 // reads served from each tier kind
	inflightHits  atomic.Int64                 // reads served from a file being read or published
	misses        atomic.Int64                 // reads that found the file in no tier
	sourceReads   atomic.Int64                 // files read from the source
	sourceBytes   atomic.Int64
	bytesServed   atomic.Int64
	published     atomic.Int64 // files written into a tier
	spilled       atomic.Int64 // evicted files moved to a slower tier
	evictions     atomic.Int64 // files removed from a tier to make room
	uncached      atomic.Int64 // files too large for every tier, served uncached
	errors        atomic.Int64 // reads that failed
	publishErrors atomic.Int64 // publications that failed (the read itself succeeded)
	clientHits    atomic.Int64 // of the hits, those clients served themselves and reported
	stored        atomic.Int64 // files received from clients for a replica copy
	storeRefused  atomic.Int64 // replica copies refused: not what their owner vouched for, or stale
	guests        atomic.Int64 // node-local copies of other servers' files kept (see StoreGuest)
	refusals      atomic.Int64 // connections refused: no handshake or a wrong proof of the job token, or too many
	sourceChecks  atomic.Int64 // cached copies compared with their source (see validate)
	staleCopies   atomic.Int64 // of those, copies dropped: the source changed or is gone
	readerFills   atomic.Int64 // files readers read from the source and this engine recorded (see RecordFill)
	fillsRefused  atomic.Int64 // readers' fills not recorded: not what their reader said, or no room
	serverFills   atomic.Int64 // files this engine read into their claim's fill file (see fillWhole); tests read it

	mu       sync.Mutex // protects warnings
	warnings []string   // problems the user should see (a tier skipped or moved)
}

// StatsSnapshot is a point-in-time copy of the counters, as reported in JSON.
type StatsSnapshot struct {
	Hits          map[string]int64 `json:"hits"`
	InflightHits  int64            `json:"inflight_hits"`
	Misses        int64            `json:"misses"`
	SourceReads   int64            `json:"source_reads"`
	SourceBytes   int64            `json:"source_bytes"`
	BytesServed   int64            `json:"bytes_served"`
	Published     int64            `json:"published"`
	Spilled       int64            `json:"spilled"`
	Evictions     int64            `json:"evictions"`
	Uncached      int64            `json:"uncached"`
	Errors        int64            `json:"errors"`
	PublishErrors int64            `json:"publish_errors"`
	ClientHits    int64            `json:"client_hits"`
	Stored        int64            `json:"stored"`
	StoreRefused  int64            `json:"store_refused"`
	// Guests counts node-local copies of files other servers own that this server kept for
	// the readers of its node (see Engine.StoreGuest).
	Guests   int64 `json:"guests"`
	Refusals int64 `json:"refusals"`
	// SourceChecks counts cached copies compared with their source's identity (once per
	// file per job, see Engine.BeginSession), StaleCopies those dropped because the source
	// had changed or was gone.
	SourceChecks int64 `json:"source_checks"`
	StaleCopies  int64 `json:"stale_copies"`
	// ReaderFills counts the files that readers read from the source themselves and this
	// server recorded as cached (see Engine.RecordFill; they are in SourceReads too),
	// FillsRefused the fills it did not record (no room, or not what the reader said).
	ReaderFills  int64 `json:"reader_fills"`
	FillsRefused int64 `json:"fills_refused"`
	// ReaderSourceRanges counts the ranges of large files that programs under `fitcache
	// run` read from the source because no block held them (the preload shim counts them in
	// the tiers' indexes), ReaderSourceBytes their bytes. The source reads of the API's
	// clients are in their own statistics (client.ClientStats.SourceRanges).
	ReaderSourceRanges int64        `json:"reader_source_ranges"`
	ReaderSourceBytes  int64        `json:"reader_source_bytes"`
	Tiers              []tiers.Info `json:"tiers"`
	// Prefetch counts what prefetch jobs did (see Engine.Prefetch).
	Prefetch PrefetchStats `json:"prefetch"`
	// Warnings are problems the user should see: a tier skipped (another user's directory,
	// another server holding it) or moved to a private stand-in, damaged entries removed.
	Warnings []string `json:"warnings,omitempty"`
}

// Snapshot copies the counters.
func (s *Stats) Snapshot() StatsSnapshot {
	hits := make(map[string]int64)
	for k := range s.hits {
		hits[tiers.Kind(k).String()] = s.hits[k].Load()
	}
	s.mu.Lock()
	warnings := append([]string(nil), s.warnings...)
	s.mu.Unlock()
	return StatsSnapshot{Warnings: warnings,
		Hits: hits, InflightHits: s.inflightHits.Load(), Misses: s.misses.Load(),
		SourceReads: s.sourceReads.Load(), SourceBytes: s.sourceBytes.Load(),
		BytesServed: s.bytesServed.Load(), Published: s.published.Load(), Spilled: s.spilled.Load(),
		Evictions: s.evictions.Load(), Uncached: s.uncached.Load(), Errors: s.errors.Load(),
		PublishErrors: s.publishErrors.Load(), ClientHits: s.clientHits.Load(), Stored: s.stored.Load(),
		StoreRefused: s.storeRefused.Load(), Guests: s.guests.Load(), Refusals: s.refusals.Load(),
		SourceChecks: s.sourceChecks.Load(), StaleCopies: s.staleCopies.Load(),
		ReaderFills: s.readerFills.Load(), FillsRefused: s.fillsRefused.Load(),
	}
}

// Warn records a problem for the user to see in the snapshot's Warnings.
func (s *Stats) Warn(msg string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.warnings = append(s.warnings, msg)
}

// AddClientHits records hits that clients on this node served from tier files themselves.
func (s *Stats) AddClientHits(byKind map[string]int64, bytes int64) {
	for name, n := range byKind {
		if k, err := tiers.ParseKind(name); err == nil && n > 0 {
			s.hits[k].Add(n)
			s.clientHits.Add(n)
		}
	}
	if bytes > 0 {
		s.bytesServed.Add(bytes)
	}
}

// Add adds o's counters (and tiers) to s, to total the servers of a job.
func (s *StatsSnapshot) Add(o StatsSnapshot) {
	if s.Hits == nil {
		s.Hits = map[string]int64{}
	}
	for k, v := range o.Hits {
		s.Hits[k] += v
	}
	s.InflightHits += o.InflightHits
	s.Misses += o.Misses
	s.SourceReads += o.SourceReads
	s.SourceBytes += o.SourceBytes
	s.BytesServed += o.BytesServed
	s.Published += o.Published
	s.Spilled += o.Spilled
	s.Evictions += o.Evictions
	s.Uncached += o.Uncached
	s.Errors += o.Errors
	s.PublishErrors += o.PublishErrors
	s.ClientHits += o.ClientHits
	s.Stored += o.Stored
	s.StoreRefused += o.StoreRefused
	s.Guests += o.Guests
	s.Refusals += o.Refusals
	s.SourceChecks += o.SourceChecks
	s.StaleCopies += o.StaleCopies
	s.ReaderFills += o.ReaderFills
	s.FillsRefused += o.FillsRefused
	s.ReaderSourceRanges += o.ReaderSourceRanges
	s.ReaderSourceBytes += o.ReaderSourceBytes
	s.Prefetch.Add(o.Prefetch)
	s.Tiers = append(s.Tiers, o.Tiers...)
	s.Warnings = append(s.Warnings, o.Warnings...)
}
