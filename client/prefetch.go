package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/fitcache/fitcache/routing"
	"sync"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
)

// A prefetch list goes to a server in chunks of at most this many paths and bytes, so that a
// list of millions of files neither exceeds a server's frame limit nor is built whole in one
// request; a client whose list the server holds already stops after the first chunk.
// (Variables for tests.)
var (
	prefetchChunkPaths = 8192
	prefetchChunkBytes = 4 << 20
)

// prefetchJobs are a client's prefetch jobs, at most one per server, which the report loop
// renews every second while the server holds them (a job whose owners stop renewing it
// stops: see core.DefaultPrefetchLease).
type prefetchJobs struct {
	mu     sync.Mutex // protects owner, jobs and failed
	owner  string     // this client's owner id, made on first use
	jobs   map[*rpc.Client]core.PrefetchInfo
	failed map[*rpc.Client]int // renewals in a row that got no answer
}

// maxRenewFailures: a server that did not answer this many renewals in a row (a second
// apart) is taken to have lost the job, so that whoever follows it stops waiting.
const maxRenewFailures = 5

// renewed records the answer to a renewal, or its failure.
func (j *prefetchJobs) renewed(server *rpc.Client, info core.PrefetchInfo, err error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.failed == nil {
		j.failed = map[*rpc.Client]int{}
	}
	switch {
	case err == nil:
		j.jobs[server] = info
		delete(j.failed, server)
	case errors.Is(err, core.ErrClosed): // the connection was replaced: the job went with it
		j.jobs[server] = core.PrefetchInfo{State: core.PrefetchUnknown}
	default:
		if j.failed[server]++; j.failed[server] >= maxRenewFailures {
			lost := j.jobs[server]
			lost.State = core.PrefetchUnknown
			lost.Errors = append(lost.Errors, fmt.Sprintf("%s: no answer to %d renewals: %v", server.Addr(), maxRenewFailures, err))
			j.jobs[server] = lost
			delete(j.failed, server)
		}
	}
}

// ownerID returns the client's owner id for prefetch jobs.
func (j *prefetchJobs) ownerID() string {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.owner == "" {
		b := make([]byte, 12)
		rand.Read(b)
		j.owner = hex.EncodeToString(b)
	}
	return j.owner
}

func (j *prefetchJobs) set(server *rpc.Client, info core.PrefetchInfo) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.jobs == nil {
		j.jobs = map[*rpc.Client]core.PrefetchInfo{}
	}
	j.jobs[server] = info
}

// held returns the servers that hold a job of ours: running, or ended and kept for its
// owners. A finished job is renewed too, so that the clients that hand over the same list
// later (the DataLoader's fresh workers of the next epoch) share it instead of starting a
// job that looks up every file again.
func (j *prefetchJobs) held() []*rpc.Client {
	j.mu.Lock()
	defer j.mu.Unlock()
	var out []*rpc.Client
	for s, info := range j.jobs {
		switch info.State {
		case core.PrefetchRunning, core.PrefetchDone, core.PrefetchBudget:
			out = append(out, s)
		}
	}
	return out
}

// Prefetch hands the servers a list of files that this client's readers are about to read,
// in the order they will read them, for the servers to read from the source ahead of them
// (see core.Engine.Prefetch): the embedded server, or in cluster mode each file's owner,
// which is sent the files it owns. Paths are absolute or relative to the root. A new list
// replaces the client's earlier one. The client keeps its jobs alive until they end or it
// closes; a server whose prefetch is off takes nothing, which is no error. An error says
// which servers could not take the list; reads work regardless.
func (c *Client) Prefetch(paths []string) error { return c.PrefetchEpochs(paths, 0) }

// PrefetchEpochs is Prefetch for a node's readers whose list holds more than this epoch's
// files: its first thisEpoch paths are read now, the others only in later epochs (with a
// DistributedSampler, the other ranks' parts), which the node's server brings in after those,
// a few at a time (see core.PrefetchRequest.ThisEpoch). 0 means all of them are read
// now. Only a node's server tells them apart; other servers get the whole list.
func (c *Client) PrefetchEpochs(paths []string, thisEpoch int) error {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return core.ErrClosed
	}
	abs := make([]string, len(paths))
	for i, p := range paths {
		var err error
		if abs[i], err = c.Resolve(p); err != nil {
			return err
		}
	}
	if len(abs) == 0 {
		return nil
	}
	type target struct {
		server  *rpc.Client
		session uint32 // our job's validation session at the server
	}
	groups := map[target][]string{}
	forNode := false
	if c.node != nil { // the node's server brings the files into the node, from their owners
		s := c.node.home()
		if s == nil {
			return errors.New("prefetch: no server of this node answered")
		}
		s.mu.Lock()
		groups[target{s.rpc, s.session}] = abs
		s.mu.Unlock()
		forNode = true
	} else if c.cluster != nil {
		// The files the tiers of this node's dead servers hold are read from there (see
		// deadTiers): their new owners would read them from the source ahead of readers that
		// never ask them for them.
		for p, owned := range owners(c.cluster, c.deadTiers.unlisted(c.cluster.DeadLocal(), abs)) {
			groups[target{p.RPC(), p.Session()}] = owned
		}
	} else {
		conn, err := c.ensureConn(nil, c.cfg.ReadTimeout)
		if err != nil {
			return fmt.Errorf("prefetch: %w", err)
		}
		groups[target{conn.rpc, conn.session}] = abs
	}
	owner := c.pf.ownerID()
	var mu sync.Mutex // protects errs
	var errs []error
	var wg sync.WaitGroup
	for to, list := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			split := 0
			if forNode {
				split = thisEpoch
			}
			if err := c.sendPrefetch(to.server, to.session, forNode, split, owner, list); err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("prefetch on %s: %w", to.server.Addr(), err))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// sendPrefetch sends one server its list, chunk by chunk, unless the server holds it already:
// a probe with the list's id comes first, so that the fresh DataLoader workers of every
// epoch join the list in one small call instead of sending its first chunk each. The job is
// one of our validation session at the server (see core.PrefetchRequest.Session).
func (c *Client) sendPrefetch(server *rpc.Client, session uint32, forNode bool, thisEpoch int, owner string, paths []string) error {
	id := core.ListDigest(paths)
	if thisEpoch > 0 && thisEpoch < len(paths) {
		id += fmt.Sprintf("/%d", thisEpoch) // the same files read now and later in other parts: another job
	}
	info, err := server.Prefetch(context.Background(), core.PrefetchRequest{Root: c.root, Owner: owner, ListID: id,
		Total: len(paths), Session: session, ForNode: forNode, ThisEpoch: thisEpoch})
	if err != nil {
		return err
	}
	if info.Joined || info.State == core.PrefetchOff {
		c.pf.set(server, info)
		return nil
	}
	for off := 0; off < len(paths); {
		end, size := off, 0
		for end < len(paths) && end-off < prefetchChunkPaths && (end == off || size+len(paths[end]) <= prefetchChunkBytes) {
			size += len(paths[end])
			end++
		}
		info, err := server.Prefetch(context.Background(), core.PrefetchRequest{Root: c.root, Owner: owner, ListID: id,
			Offset: off, Total: len(paths), Paths: paths[off:end], Session: session, ForNode: forNode, ThisEpoch: thisEpoch})
		if err != nil {
			return err
		}
		c.pf.set(server, info)
		if info.Joined || info.State == core.PrefetchOff || info.Terminal() {
			return nil // held already, or not taken at all
		}
		off = end
	}
	return nil
}

// renewPrefetch renews the client's prefetch jobs and records their progress.
func (c *Client) renewPrefetch() {
	owner := c.pf.ownerID()
	for _, server := range c.pf.held() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		info, err := server.Prefetch(ctx, core.PrefetchRequest{Root: c.root, Owner: owner})
		cancel()
		c.pf.renewed(server, info, err)
	}
}

// prefetchStates orders the states of a client's jobs for PrefetchStatus: the first one any
// job is in is the state of the whole.
var prefetchStates = []string{core.PrefetchRunning, core.PrefetchBudget, core.PrefetchAbandoned,
	core.PrefetchReplaced, core.PrefetchUnknown, core.PrefetchDone, core.PrefetchOff}

// PrefetchStatus renews the client's prefetch jobs and returns their progress, added
// over the servers holding them. The state is "running" while any job runs; once all ended,
// the worst end ("budget" before "done"); "unknown" when the client has no job.
func (c *Client) PrefetchStatus() core.PrefetchInfo {
	c.renewPrefetch()
	c.pf.mu.Lock()
	defer c.pf.mu.Unlock()
	total := core.PrefetchInfo{State: core.PrefetchUnknown}
	seen := map[string]bool{}
	for _, info := range c.pf.jobs {
		seen[info.State] = true
		total.Files += info.Files
		total.Received += info.Received
		total.Done += info.Done
		total.Fetched += info.Fetched
		total.SkippedCached += info.SkippedCached
		total.SkippedInflight += info.SkippedInflight
		total.Failed += info.Failed
		total.Bytes += info.Bytes
		total.Owners = max(total.Owners, info.Owners)
		total.Errors = append(total.Errors, info.Errors...)
	}
	for _, s := range prefetchStates {
		if seen[s] {
			total.State = s
			break
		}
	}
	return total
}

// owners splits paths by the server that owns each (the first live server on the ring for
// it, the one reads go to), keeping their order; files no live server owns are left out
// (they are read from the source).
func owners(r *routing.Router, paths []string) map[*routing.Peer][]string {
	out := map[*routing.Peer][]string{}
	for _, p := range paths {
		if t := r.Targets(p); len(t) > 0 {
			out[t[0]] = append(out[t[0]], p)
		}
	}
	return out
}
