// Hit statistics: reads a client served from tier files itself never reach the server, so the
// client counts them and reports them to the server in the background (flushHits), and its
// own counters and the server's make up Stats.

package client

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"github.com/fitcache/fitcache/rpc"
)

// hitReport is what a client has served from tier files and not reported yet, by tier kind.
type hitReport struct {
	mu     sync.Mutex // protects byTier and bytes
	byTier map[string]int64
	bytes  int64
}

// ClientStats are a client's own counters.
type ClientStats struct {
	LocalHits   int64 `json:"local_hits"`
	ServerReads int64 `json:"server_reads"`
	DirectReads int64 `json:"direct_reads"`
	// ReaderFills are the misses this client's process read from the source itself and
	// wrote into the server's first tier, for the server to record (see
	// Client.ReaderFills); its server counts them as source reads.
	ReaderFills int64 `json:"reader_fills"`
	// ParallelMisses are the misses of batches (ReadMany) that this client's process served
	// with several threads at once, because its source made its fills wait.
	ParallelMisses int64 `json:"parallel_misses"`
	Connects       int64 `json:"connects"`
	Errors         int64 `json:"errors"`
	// Ranges of large files (ReadAt): opens of their sources by this client, and the ranges
	// (and bytes) read from them because their block was not cached yet.
	SourceOpens      int64 `json:"source_opens"`
	SourceRanges     int64 `json:"source_ranges"`
	SourceRangeBytes int64 `json:"source_range_bytes"`
	// Cluster mode: servers this client declared dead itself, or because a server's other
	// clients had; dead servers that came back; calls that got no answer.
	ServersDead     int64 `json:"servers_declared_dead,omitempty"`
	ServersGossiped int64 `json:"servers_dead_by_gossip,omitempty"`
	ServersRejoined int64 `json:"servers_rejoined,omitempty"`
	ServerFailures  int64 `json:"server_failures,omitempty"`
	// Cluster mode: reads served from the tiers of a server of this node that did not
	// answer, and the sources looked at to check such copies (see deadTiers).
	DeadServerHits int64 `json:"dead_server_hits,omitempty"`
	SourceChecks   int64 `json:"source_checks,omitempty"`
}

// Stats returns this client's counters and, when the server answers, the server's (after
// reporting this client's pending hits to it), as JSON: {"client": {...}, "server": {...}}.
func (c *Client) Stats() (string, error) {
	out := struct {
		Client  ClientStats                `json:"client"`
		Server  json.RawMessage            `json:"server,omitempty"`
		Servers map[string]json.RawMessage `json:"servers,omitempty"`
		Error   string                     `json:"server_error,omitempty"`
	}{Client: ClientStats{
		LocalHits: c.counts.localHits.Load(), ServerReads: c.counts.serverReads.Load(),
		DirectReads: c.counts.directReads.Load(), Connects: c.counts.connects.Load(),
		Errors: c.counts.errors.Load(), SourceOpens: c.counts.sourceOpens.Load(),
		SourceRanges: c.counts.sourceRanges.Load(), SourceRangeBytes: c.counts.sourceRangeBytes.Load(),
	}}
	if f := c.external.Load(); f != nil {
		ext := (*f)()
		out.Client.LocalHits += ext.Hits
		out.Client.ServerReads += ext.Fetches
		out.Client.DirectReads += ext.Direct
		out.Client.ReaderFills += ext.Fills
		out.Client.ParallelMisses += ext.ParallelMisses
		out.Client.SourceRanges += ext.SourceRanges
	}
	if c.deadTiers != nil {
		out.Client.DeadServerHits, out.Client.SourceChecks = c.deadTiers.hits.Load(), c.deadTiers.checks.Load()
	}
	if c.cluster != nil {
		n := c.cluster.Counts()
		out.Client.ServersDead, out.Client.ServersRejoined = n.Deaths, n.Rejoins
		out.Client.ServersGossiped, out.Client.ServerFailures = n.Gossiped, n.Failures
		if server := c.reportTo(); server != nil {
			c.flushHits(server)
		}
		out.Servers = c.cluster.Stats()
		b, err := json.Marshal(out)
		return string(b), err
	}
	if c.node != nil {
		if server := c.reportTo(); server != nil {
			c.flushHits(server)
		}
		out.Servers = c.node.stats()
		b, err := json.Marshal(out)
		return string(b), err
	}
	if server := c.reportTo(); server != nil {
		c.flushHits(server)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if js, err := server.Stats(ctx); err == nil {
			out.Server = json.RawMessage(js)
		} else {
			out.Error = err.Error()
		}
	} else {
		out.Error = "no server"
	}
	b, err := json.Marshal(out)
	return string(b), err
}

func (h *hitReport) add(tier string, bytes int64) {
	h.mu.Lock()
	h.byTier[tier]++
	h.bytes += bytes
	h.mu.Unlock()
}

// take returns the pending report and clears it.
func (h *hitReport) take() (map[string]int64, int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.byTier) == 0 {
		return nil, 0
	}
	by, bytes := h.byTier, h.bytes
	h.byTier, h.bytes = make(map[string]int64), 0
	return by, bytes
}

// flushHits reports pending local hits; a failed report is put back for the next try.
func (c *Client) flushHits(server *rpc.Client) {
	by, bytes := c.pending.take()
	if by == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := server.ReportHits(ctx, by, bytes); err != nil {
		c.pending.mu.Lock()
		for k, v := range by {
			c.pending.byTier[k] += v
		}
		c.pending.bytes += bytes
		c.pending.mu.Unlock()
	}
}

// reportLoop reports local hits to the server once a second, so that server statistics
// count reads the server never saw, drops kept mappings of files the server removed
// meanwhile, so that an idle client does not keep evicted files alive in the tiers, and
// renews the client's prefetch jobs.
func (c *Client) reportLoop() {
	defer close(c.stopped)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-tick.C:
			if server := c.reportTo(); server != nil {
				c.flushHits(server)
			}
			c.renewPrefetch()
			c.ranges.sweep(c.localDirs()) // copies evicted while this process does not read
		}
	}
}

// reportTo returns the server that local hits are reported to: the embedded server, or in
// cluster mode the first server on this node.
func (c *Client) reportTo() *rpc.Client {
	if c.node != nil {
		if s := c.node.home(); s != nil {
			return s.rpc
		}
		return nil
	}
	if c.cluster != nil {
		return c.cluster.LocalServer()
	}
	if conn, _ := c.current(); conn != nil {
		return conn.rpc
	}
	return nil
}

// ExternalCounts are reads that the C layer of libfitcache served without this client.
type ExternalCounts struct {
	Hits    int64 // from the server's tiers (the hit path)
	Fetches int64 // misses the server cached for it (through its node socket)
	Direct  int64 // files it read from the source (no room for them in the tiers)
	// SourceRanges are the ranges it read from the source of a large file whose blocks the
	// server has no room for (see Client.DeclinedSource).
	SourceRanges   int64
	Fills          int64 // misses it read from the source and wrote into a tier (see ReaderFills)
	ParallelMisses int64 // misses of batches it served with several threads (see ClientStats)
}

// SetExternalCounts gives the client a count of the reads served around it (see
// ExternalCounts), which Stats adds to its own. The server counts those hits and fetches
// itself (through the tiers' index and its node socket).
func (c *Client) SetExternalCounts(count func() ExternalCounts) { c.external.Store(&count) }
