package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/gossip"
	"github.com/fitcache/fitcache/ring"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// probeInterval is how often a client asks a dead server whether it is back.
const probeInterval = time.Second

// peer is one server of the cluster as this client sees it.
type peer struct {
	member ring.Member
	rpc    *rpc.Client
	local  bool // on this node: its tier files can be mapped
	// news is the membership gossip with this server (see package gossip); it locks itself.
	news gossip.Outbox

	mu          sync.Mutex // protects dirs, session, nodeSocket, failedCalls and dead
	dirs        []tiers.Dir
	session     uint32 // our job's validation session there, as its last hello said
	nodeSocket  string // its node socket, as its last hello said (local servers only)
	failedCalls int    // consecutive calls that got no answer (timeouts and refusals alike)
	dead        bool
	// knownDead: the job's servers knew it dead when this client started (see KnownDead):
	// the client waited for no hello from it. Set once, before the router is shared.
	knownDead bool
}

func (p *peer) state() (dirs []tiers.Dir, dead bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dirs, p.dead
}

// clusterRouter routes reads over the servers of a job with a consistent hash ring, detects
// dead servers and applies the failure policy:
//
//   - recache: a dead server is skipped when walking the ring, exactly as if it had been
//     removed, so each of its files goes to the next live server clockwise, which reads it
//     from the source once and caches it. When the server answers again it is walked again,
//     and placement is what it was before.
//   - pfs: a dead server's files are read from the source by the clients.
//
// A server is dead after FailureThreshold consecutive failed calls, or at once when its
// connection is refused; until then a read it fails is served from the source.
type clusterRouter struct {
	cfg   config.Config
	log   *slog.Logger
	ring  *ring.Ring // every server of the job; never changes
	peers map[string]*peer
	// stamper stamps the files this client's own server serves it (see SetOwnServer) for
	// their replicas, as a server stamps its Read replies.
	stamper rpc.Stamper

	deaths   atomic.Int64 // servers this client declared dead
	gossiped atomic.Int64 // servers declared dead because a server said its clients found them dead
	rejoins  atomic.Int64 // dead servers that answered again
	failures atomic.Int64 // calls that failed for want of an answer

	replicas        sync.WaitGroup // replica copies in flight
	replicaBytes    atomic.Int64   // bytes they hold
	replicasSkipped atomic.Int64   // replica copies not sent for the bounds above
	stop            chan struct{}
	stopped         chan struct{}
	// onDead, if set, is told of the servers this client's calls found dead (OnServerDead).
	onDead func(id string)
	// blockBytes is the size of the servers' blocks, as the last hello said (0: none).
	blockBytes atomic.Int64
}

// newClusterRouter discovers the servers, connects, and waits up to WaitTimeout for them to
// answer. Servers that do not answer by then start dead (and are probed); if none answers,
// it fails with a message naming them.
func newClusterRouter(cfg config.Config, log *slog.Logger, members []ring.Member, token string, o options) (*clusterRouter, error) {
	r := &clusterRouter{cfg: cfg, log: log, ring: ring.New(cfg.VirtualNodes, nil), peers: map[string]*peer{},
		stamper: rpc.NewStamper(token), stop: make(chan struct{}), stopped: make(chan struct{}), onDead: o.onDead}
	r.ring.Add(members...)
	// On failure, what was opened is closed: the connections dialled, the tiers of the
	// servers that answered.
	abandon := func(err error) (*clusterRouter, error) {
		for _, p := range r.peers {
			p.rpc.Close()
			p.mu.Lock()
			closeDirs(p.dirs)
			p.mu.Unlock()
		}
		return nil, err
	}
	for _, m := range members {
		c, err := rpc.Dial(m.ID, rpc.ClientConfig{Token: token, Job: cfg.Job, ConnectTimeout: cfg.RPCTimeout,
			CallTimeout: cfg.RPCTimeout, ReadTimeout: cfg.RPCTimeout})
		if err != nil {
			return abandon(err)
		}
		r.peers[m.ID] = &peer{member: m, rpc: c, local: m.Node == cfg.Node, dead: true, knownDead: o.dead[m.ID]}
	}
	if err := r.waitForServers(); err != nil {
		return abandon(err)
	}
	go r.probeLoop()
	return r, nil
}

// waitForServers says hello to every server, all at once, until each answered or is not
// waited for (see startwait.go): servers known dead (KnownDead) or named dead by a server
// that answered are not; one that refuses connections is dead at once when others answer;
// one that does not answer is waited for up to WaitTimeout. With no server answering, it
// fails after the start grace, naming every server and why.
func (r *clusterRouter) waitForServers() error {
	w := newStartWait(r.cfg.WaitTimeout)
	w.askAgain() // the first round asks everyone
	alive := func(id string) bool { _, dead := r.peers[id].state(); return !dead }
	waited := 0 // servers not known dead
	for _, p := range r.peers {
		if !p.knownDead {
			waited++
		}
	}
	// Hellos run in the background, at most one per server: one that hangs holds up no
	// decision about the others (a server named dead is not waited for, answered or not).
	type result struct {
		p     *peer
		reply *fitcachepb.HelloReply
		err   error
	}
	results := make(chan result, len(r.peers))
	inflight := map[*peer]bool{}
	for {
		again := w.askAgain()
		for id, p := range r.peers {
			_, dead := p.state()
			if _, named := w.named[id]; p.knownDead || inflight[p] || (dead && named) {
				continue
			}
			// Answering servers are asked again for their view of the dead; not those on this
			// node, whose hello maps their tiers again.
			if dead || (again && !p.local) {
				inflight[p] = true
				go func() {
					reply, err := r.helloReply(p)
					results <- result{p, reply, err}
				}()
			}
		}
		tick := time.NewTimer(100 * time.Millisecond)
		var got []result
		select {
		case res := <-results:
			got = append(got, res)
		case <-tick.C:
		}
		tick.Stop()
	drain:
		for {
			select {
			case res := <-results:
				got = append(got, res)
			default:
				break drain
			}
		}
		for _, res := range got {
			p := res.p
			delete(inflight, p)
			if res.err == nil {
				w.answered(p.member.ID, res.reply.Dead, res.reply.Alive, alive)
				p.news.Heard(res.reply.MembershipVersion)
				continue
			}
			w.errs[p.member.ID] = res.err
			if refusedBy(res.err) {
				return fmt.Errorf("fitcache server %s refused this client: %w", p.member.ID, res.err)
			}
		}
		unproven, lastUnproven := 0, error(nil)
		for _, err := range w.errs {
			if errors.Is(err, rpc.ErrUnproven) {
				unproven, lastUnproven = unproven+1, err
			}
		}
		var answered, waiting, named, gone []string
		for id := range r.peers {
			if alive(id) {
				answered = append(answered, id)
			}
		}
		for id, p := range r.peers {
			if alive(id) || p.knownDead {
				continue
			}
			_, failed := w.errs[id]
			if _, named := w.named[id]; !named && !failed && inflight[p] {
				waiting = append(waiting, id) // its first hello has not returned (bounded by its timeout)
				continue
			}
			switch w.decide(id, len(answered) > 0, p.local) {
			case waitOn:
				waiting = append(waiting, id)
			case waitNamed:
				named = append(named, id)
			default:
				gone = append(gone, id)
			}
		}
		if len(answered) == 0 && waited > 0 && unproven == waited {
			return tokenRefused(lastUnproven)
		}
		if len(waiting) > 0 {
			continue
		}
		if len(answered) == 0 && waited > 0 {
			return w.noServerError(gone)
		}
		sort.Strings(named)
		sort.Strings(gone)
		if len(named) > 0 {
			r.gossiped.Add(int64(len(named)))
			r.log.Info("fitcache servers the job's servers hold dead: not waited for", "servers", named)
		}
		if len(gone) > 0 {
			reasons := make([]string, len(gone))
			for i, id := range gone {
				reasons[i] = id + ": " + whyNoAnswer(w.errs[id])
			}
			r.log.Warn("fitcache servers not answering; starting without them", "servers", strings.Join(reasons, "; "),
				"waited", time.Since(w.begun).Round(100*time.Millisecond))
			r.deaths.Add(int64(len(gone)))
			// Only those waited for in vain are news for the servers' membership: one that
			// refused at once may be binding its port as the job starts, and the membership
			// finds a dead one itself.
			for _, id := range gone {
				if r.onDead != nil && w.decide(id, true, false) == waitGone {
					r.onDead(id)
				}
			}
		}
		return nil
	}
}

// tokenRefused is the error of a client that no server proved the job token to. A client
// cannot tell a token that differs from the servers' from listeners that are not the job's
// servers; with every server failing to prove the token, the first is far likelier.
func tokenRefused(last error) error {
	return &core.ErrnoError{Errno: syscall.EACCES, Message: fmt.Sprintf("no fitcache server of the job proved "+
		"that it knows this client's job token: the token differs from the servers' (or what listens at their "+
		"addresses is not the job's servers): %v", last)}
}

// hello asks a server to describe itself and marks it alive if it answers.
func (r *clusterRouter) hello(p *peer) error {
	_, err := r.helloReply(p)
	return err
}

// helloReply is hello, with the server's reply.
func (r *clusterRouter) helloReply(p *peer) (*fitcachepb.HelloReply, error) {
	ctx, cancel := context.WithTimeout(context.Background(), min(r.cfg.RPCTimeout, time.Second))
	defer cancel()
	reply, err := p.rpc.Hello(ctx)
	if err != nil {
		return nil, err
	}
	session := sessionOf(reply)
	if reply.BlockBytes > 0 {
		r.blockBytes.Store(reply.BlockBytes)
	}
	var dirs []tiers.Dir
	if p.local {
		dirs = tierDirs(reply.Tiers, session, r.log)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.session = session
	if p.local {
		closeDirs(p.dirs) // of an earlier hello; readers still using them get misses
		p.dirs = dirs
		p.nodeSocket = reply.NodeSocket
	}
	p.failedCalls, p.dead = 0, false
	return reply, nil
}

// targets returns the servers to read key from, in order: the first Replicas servers on
// distinct nodes walking clockwise, passing over dead ones under the recache policy; under the
// pfs policy a dead one keeps its slot (its files come from the source).
func (r *clusterRouter) targets(key string) []*peer {
	return ring.Choose(r.ring, key, r.cfg.Replicas, true, func(m ring.Member) (*peer, ring.Choice) {
		p := r.peers[m.ID]
		if _, dead := p.state(); !dead {
			return p, ring.Take
		}
		if r.cfg.Policy == config.PolicyPFS {
			return nil, ring.Hold
		}
		return nil, ring.Pass
	})
}

// failed records a failed call; it reports whether the server is now dead.
func (r *clusterRouter) failed(p *peer, err error) bool {
	r.failures.Add(1)
	p.mu.Lock()
	if p.dead {
		p.mu.Unlock()
		return true
	}
	p.failedCalls++
	died := rpc.IsRefused(err) || p.failedCalls >= r.cfg.FailureThreshold
	if died {
		p.dead = true
	}
	p.mu.Unlock()
	if died {
		r.deaths.Add(1)
		r.log.Warn("fitcache server declared dead", "server", p.member.ID, "policy", r.cfg.Policy, "err", err)
		r.spread(p.member.ID, true)
		if r.onDead != nil {
			r.onDead(p.member.ID)
		}
	}
	return died
}

// spread queues news about a server for every other server, which pass it on to their
// other clients.
func (r *clusterRouter) spread(id string, dead bool) {
	for other, p := range r.peers {
		if other != id {
			p.news.Tell(id, dead)
		}
	}
}

// learn applies a server's membership view from a read reply: servers its clients found dead
// are dead for this client too, without waiting for its own timeouts.
func (r *clusterRouter) learn(from *peer, version int64, dead []string) {
	if !from.news.Heard(version) {
		return
	}
	for _, id := range dead {
		if p, ok := r.peers[id]; ok && p != from {
			r.deadByNews(p, "its peers' clients", from.member.ID)
		}
	}
}

// deadByNews marks p dead on news from others (who: the source of the news, by its told).
func (r *clusterRouter) deadByNews(p *peer, who, by string) {
	p.mu.Lock()
	wasAlive := !p.dead
	p.dead = true
	p.mu.Unlock()
	if wasAlive {
		r.gossiped.Add(1)
		r.log.Warn("fitcache server declared dead by "+who, "server", p.member.ID, "told_by", by, "policy", r.cfg.Policy)
	}
}

// told applies what the servers' membership says of a server (see package membership): dead,
// it is skipped at once, as if this client had found it dead itself; alive (it joined, or
// rejoined), it is said hello to and walked again, without waiting for the next probe.
func (r *clusterRouter) told(id string, alive bool) {
	p, ok := r.peers[id]
	if !ok {
		return
	}
	if alive {
		if _, dead := p.state(); dead && r.hello(p) == nil {
			r.rejoins.Add(1)
			r.log.Info("fitcache server rejoined, by the servers' membership", "server", id)
		}
		return
	}
	r.deadByNews(p, "the servers' membership", "membership")
}

func (r *clusterRouter) succeeded(p *peer) {
	p.mu.Lock()
	p.failedCalls = 0
	p.mu.Unlock()
}

// probeLoop asks dead servers whether they are back, so that they rejoin.
func (r *clusterRouter) probeLoop() {
	defer close(r.stopped)
	tick := time.NewTicker(probeInterval)
	defer tick.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-tick.C:
			for _, p := range r.peers {
				if _, dead := p.state(); dead && r.hello(p) == nil {
					r.rejoins.Add(1)
					r.log.Info("fitcache server answers again: rejoined", "server", p.member.ID)
					r.spread(p.member.ID, false)
				}
			}
		}
	}
}

// close stops probing and frees the connections and the mapped tier indexes.
func (r *clusterRouter) close() {
	close(r.stop)
	<-r.stopped
	r.replicas.Wait()
	for _, p := range r.peers {
		p.rpc.Close()
		p.mu.Lock()
		closeDirs(p.dirs)
		p.dirs = nil
		p.mu.Unlock()
	}
}

// localServer returns the server on this node that hits on its tier files are reported to
// (the first by address), or nil.
func (r *clusterRouter) localServer() *rpc.Client {
	var best *peer
	for _, p := range r.peers {
		if p.local && (best == nil || p.member.ID < best.member.ID) {
			best = p
		}
	}
	if best == nil {
		return nil
	}
	return best.rpc
}

// localAnswered reports whether a server on this node is alive and serves a node socket of
// this user's (see nodeRouter.home).
func (r *clusterRouter) localAnswered() bool {
	for _, p := range r.peers {
		p.mu.Lock()
		ok := p.local && !p.dead && p.nodeSocket != "" && ownSocket(p.nodeSocket)
		p.mu.Unlock()
		if ok {
			return true
		}
	}
	return false
}

// deadLocal returns the ids of the servers on this node that are dead, by address.
func (r *clusterRouter) deadLocal() []string {
	var ids []string
	for id, p := range r.peers {
		if _, dead := p.state(); p.local && dead {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids
}

// localDirs returns the tier directories of the live servers on this node.
func (r *clusterRouter) localDirs() []tiers.Dir {
	var dirs []tiers.Dir
	for _, p := range r.peers {
		if d, dead := p.state(); p.local && !dead {
			dirs = append(dirs, d...)
		}
	}
	return dirs
}

// errReadSource is what route returns when the file is to be read from the source: no
// server answered, the policy sends it there, or it is too large for its owner to cache or
// send.
var errReadSource = errors.New("read the source")

// route calls try with the servers a read of path goes to, in order (see targets), until one
// answers; rest are the servers after it, to which a file it read from the source is copied
// (replicas). It returns nil when one did, the file's own error as a server saw it, or
// errReadSource. A server that fails the call is counted as failing (see failed); under
// recache, one that died meanwhile hands its files to the next one, so the walk is made
// again.
func (c *Client) route(path string, try func(p *peer, rest []*peer) error) error {
	r := c.cluster
	for attempt := 0; attempt < 2; attempt++ {
		targets := r.targets(path)
		died := false
		for i, p := range targets {
			err := try(p, targets[i+1:])
			if err == nil {
				r.succeeded(p)
				return nil
			}
			if errors.Is(err, core.ErrTooLarge) {
				return errReadSource // too large for the owner to cache or send
			}
			if !errors.Is(err, rpc.ErrUnavailable) {
				return err
			}
			died = r.failed(p, err) || died
		}
		if !died || r.cfg.Policy != config.PolicyRecache {
			break
		}
	}
	return errReadSource
}

// readCluster serves a read in cluster mode: from the tiers of this node's dead servers
// when they hold the file as it is now at the source, else from the servers the ring gives.
func (c *Client) readCluster(path string) (Buffer, error) {
	if b, ok := c.fromDeadTiers(c.cluster.deadLocal(), path); ok {
		return b, nil
	}
	var buf Buffer
	err := c.route(path, func(p *peer, rest []*peer) error {
		b, reply, err := c.readFromPeer(p, path)
		if err != nil {
			return err
		}
		if reply != nil && reply.Origin == core.OriginSource && len(rest) > 0 {
			c.replicate(rest, path, b.Bytes(), reply.Stamp)
		}
		buf = b
		return nil
	})
	if errors.Is(err, errReadSource) {
		return c.readDirect(path) // a large file is mapped
	}
	return buf, err
}

// readFromPeer reads from one server: from its tier files directly when it is on this node
// and has the file, else over RPC. reply is nil for a local hit.
func (c *Client) readFromPeer(p *peer, path string) (Buffer, *readReply, error) {
	dirs, _ := p.state()
	if p.local {
		if m, err := tiers.Probe(dirs, path); err == nil {
			c.hit(m)
			return m, nil, nil
		}
	}
	reply, err := c.askPeer(context.Background(), p, path)
	if err != nil {
		return nil, nil, err
	}
	buf, err := c.replyBuffer(context.Background(), p.rpc, reply, dirs, path)
	if err != nil {
		return nil, nil, err
	}
	return buf, &readReply{Origin: rpc.OriginOf(reply), Stamp: rpc.StampOf(reply)}, nil
}

// askPeer asks one server for a file over RPC (naming the tier file when the server is on
// this node and has it cached), exchanging membership gossip with it.
func (c *Client) askPeer(ctx context.Context, p *peer, path string) (*fitcachepb.ReadReply, error) {
	return c.askPeerInto(ctx, p, path, nil)
}

// askPeerInto is askPeer with the file's bytes read into buf when they fit in it (see
// rpc.Client.ReadInto): the reply's Data is then buf's, for the caller to use before it
// lends buf again.
func (c *Client) askPeerInto(ctx context.Context, p *peer, path string, buf []byte) (*fitcachepb.ReadReply, error) {
	version, dead, alive := p.news.Take()
	reply, err := p.rpc.ReadInto(ctx, &fitcachepb.ReadRequest{Root: c.root, Path: path,
		Local: p.local, MembershipVersion: version, Dead: dead, Alive: alive}, buf)
	if reply != nil {
		c.cluster.learn(p, reply.MembershipVersion, reply.Dead)
	}
	if err != nil {
		if errors.Is(err, rpc.ErrUnavailable) { // the news did not get through: tell it next time
			for _, id := range dead {
				p.news.Tell(id, true)
			}
			for _, id := range alive {
				p.news.Tell(id, false)
			}
		}
		return nil, err
	}
	c.counts.serverReads.Add(1)
	return reply, nil
}

type readReply struct {
	Origin core.Origin
	Stamp  rpc.Stamp // what the owner vouched for, for replica copies
}

// Replica copies are sent in the background and hold a copy of the file meanwhile: they are
// bounded in size and in bytes in flight, and skipped beyond the bounds (a replica is an
// optimisation; the file's owner holds it).
const (
	replicaMaxFile       = 32 << 20
	replicaBytesInFlight = 128 << 20
)

// replicate sends a file just read from the source to the other servers meant to hold it,
// with the stamp its owner gave it (which the replicas check), in the background: a replica
// copy must not slow the read down. Close waits for them.
func (c *Client) replicate(to []*peer, path string, data []byte, stamp rpc.Stamp) {
	r := c.cluster
	need := int64(len(data)) * int64(len(to))
	if len(data) > replicaMaxFile || r.replicaBytes.Add(need) > replicaBytesInFlight {
		if len(data) <= replicaMaxFile {
			r.replicaBytes.Add(-need)
		}
		r.replicasSkipped.Add(int64(len(to)))
		return
	}
	data = bytes.Clone(data) // the caller may release its buffer
	r.replicas.Add(len(to))
	for _, p := range to {
		go func() {
			defer r.replicas.Done()
			defer r.replicaBytes.Add(-int64(len(data)))
			if err := p.rpc.Store(context.Background(), c.root, path, data, stamp); err != nil {
				c.log.Debug("replica copy failed", "server", p.member.ID, "path", path, "err", err)
			}
		}()
	}
}

// stats asks every live server for its counters.
func (r *clusterRouter) stats() map[string]json.RawMessage {
	out := map[string]json.RawMessage{}
	for id, p := range r.peers {
		if _, dead := p.state(); dead {
			out[id] = json.RawMessage(`{"dead":true}`)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), min(r.cfg.RPCTimeout, 2*time.Second))
		if js, err := p.rpc.Stats(ctx); err == nil {
			out[id] = json.RawMessage(js)
		}
		cancel()
	}
	return out
}
