package routing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/membership"
	"github.com/fitcache/fitcache/ring"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// probeInterval is how often a router asks a dead server whether it is back.
const probeInterval = time.Second

// Peer is one server of the cluster as a router sees it. It is safe for concurrent use.
type Peer struct {
	member ring.Member
	rpc    *rpc.Client
	local  bool // on this node: its tier files can be mapped
	// news is what this reader tells this server of the others, and heard from it (see
	// membership.Outbox); it locks itself.
	news membership.Outbox

	mu          sync.Mutex // protects dirs, session, nodeSocket, failedCalls and dead
	dirs        []tiers.Dir
	session     uint32 // our job's validation session there, as its last hello said
	nodeSocket  string // its node socket, as its last hello said (local servers only)
	failedCalls int    // consecutive calls that got no answer (timeouts and refusals alike)
	dead        bool
	// knownDead: the job's servers knew it dead when the router started (see Options.Dead):
	// the router waited for no hello from it. Set once, before the router is shared.
	knownDead bool
}

// ID returns the server's id on the ring (its address).
func (p *Peer) ID() string { return p.member.ID }

// Local reports whether the server is on the router's node: its tier files can be mapped.
func (p *Peer) Local() bool { return p.local }

// RPC returns the router's connection to the server.
func (p *Peer) RPC() *rpc.Client { return p.rpc }

// Session returns the validation session of the router's job at the server, as its last
// hello said.
func (p *Peer) Session() uint32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.session
}

// State returns the server's tier directories (for the router's job, local servers only) and
// whether it is dead.
func (p *Peer) State() (dirs []tiers.Dir, dead bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dirs, p.dead
}

// Router routes reads over the servers of a job with a consistent hash ring, detects
// dead servers and applies the failure policy:
//
//   - recache: a dead server is skipped when walking the ring, exactly as if it had been
//     removed, so each of its files goes to the next live server clockwise, which reads it
//     from the source once and caches it. When the server answers again it is walked again,
//     and placement is what it was before.
//   - pfs: a dead server's files are read from the source by the clients.
//
// A server is dead after FailureThreshold consecutive failed calls, or at once when its
// connection is refused; until then a read it fails is served from the source. A Router is
// safe for concurrent use.
type Router struct {
	cfg   config.Config
	log   *slog.Logger
	ring  *ring.Ring // every server of the job; never changes
	peers map[string]*Peer
	// stamper stamps the files a server reads itself for their replicas, as a server stamps
	// its Read replies (see Stamp).
	stamper rpc.Stamper

	deaths   atomic.Int64 // servers this router declared dead
	gossiped atomic.Int64 // servers declared dead because a server said its clients found them dead
	rejoins  atomic.Int64 // dead servers that answered again
	failures atomic.Int64 // calls that failed for want of an answer

	replicas        sync.WaitGroup // replica copies in flight
	replicaBytes    atomic.Int64   // bytes they hold
	replicasSkipped atomic.Int64   // replica copies not sent for the bounds above
	stop            chan struct{}
	stopped         chan struct{}
	// onDead, if set, is told of the servers the router's calls found dead (Options.OnDead).
	onDead func(id string)
	// blockBytes is the size of the servers' blocks, as the last hello said (0: none).
	blockBytes atomic.Int64
	// fingerprint names this router's ring (ring.Fingerprint), which the servers' hellos
	// name theirs beside; ringWarned is set once a server's differed (said once).
	fingerprint string
	ringWarned  atomic.Bool
}

// Options are the replaceable parts of a Router; the zero value is usable.
type Options struct {
	// Dead are the servers the job's servers know to be dead (see package membership): the
	// router starts with them dead, says no hello to them and waits for none of them (it
	// still asks them every second whether they are back).
	Dead []string
	// OnDead, if set, is called when the router's own calls find a server dead (a refused
	// connection, FailureThreshold calls without an answer): a server passes it on to the
	// job's other servers.
	OnDead func(id string)
}

// New connects to the job's servers (members, authenticated with token) and waits up to
// cfg.WaitTimeout for them to answer. Servers that do not answer by then start dead (and are
// probed every second); if none answers, it fails with a message naming them. log may be nil.
func New(cfg config.Config, log *slog.Logger, members []ring.Member, token string, o Options) (*Router, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	known := map[string]bool{}
	for _, id := range o.Dead {
		known[id] = true
	}
	vnodes := VirtualNodes(cfg, members)
	r := &Router{cfg: cfg, log: log, ring: ring.New(vnodes, nil), fingerprint: RingFingerprint(cfg, members),
		peers: map[string]*Peer{}, stamper: rpc.NewStamper(token), stop: make(chan struct{}), stopped: make(chan struct{}),
		onDead: o.OnDead}
	r.ring.Add(members...)
	// On failure, what was opened is closed: the connections dialled, the tiers of the
	// servers that answered.
	abandon := func(err error) (*Router, error) {
		for _, p := range r.peers {
			p.rpc.Close()
			p.mu.Lock()
			CloseDirs(p.dirs)
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
		r.peers[m.ID] = &Peer{member: m, rpc: c, local: m.Node == cfg.Node, dead: true, knownDead: known[m.ID]}
	}
	if err := r.waitForServers(); err != nil {
		return abandon(err)
	}
	go r.probeLoop()
	return r, nil
}

// waitForServers says hello to every server, all at once, until each answered or is not
// waited for (see startwait.go): servers known dead (Options.Dead) or named dead by a server
// that answered are not; one that refuses connections is dead at once when others answer;
// one that does not answer is waited for up to WaitTimeout. With no server answering, it
// fails after the start grace, naming every server and why.
func (r *Router) waitForServers() error {
	w := NewStartWait(r.cfg.WaitTimeout)
	w.AskAgain() // the first round asks everyone
	alive := func(id string) bool { _, dead := r.peers[id].State(); return !dead }
	waited := 0 // servers not known dead
	for _, p := range r.peers {
		if !p.knownDead {
			waited++
		}
	}
	// Hellos run in the background, at most one per server: one that hangs holds up no
	// decision about the others (a server named dead is not waited for, answered or not).
	type result struct {
		p     *Peer
		reply *fitcachepb.HelloReply
		err   error
	}
	results := make(chan result, len(r.peers))
	inflight := map[*Peer]bool{}
	for {
		again := w.AskAgain()
		for id, p := range r.peers {
			_, dead := p.State()
			if _, named := w.Named[id]; p.knownDead || inflight[p] || (dead && named) {
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
				w.Answered(p.member.ID, res.reply.Dead, res.reply.Alive, alive)
				p.news.Heard(res.reply.MembershipVersion)
				continue
			}
			w.Errs[p.member.ID] = res.err
			if RefusedBy(res.err) {
				return fmt.Errorf("fitcache server %s refused this client: %w", p.member.ID, res.err)
			}
		}
		unproven, lastUnproven := 0, error(nil)
		for _, err := range w.Errs {
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
			_, failed := w.Errs[id]
			if _, named := w.Named[id]; !named && !failed && inflight[p] {
				waiting = append(waiting, id) // its first hello has not returned (bounded by its timeout)
				continue
			}
			switch w.Decide(id, len(answered) > 0, p.local) {
			case WaitOn:
				waiting = append(waiting, id)
			case WaitNamed:
				named = append(named, id)
			default:
				gone = append(gone, id)
			}
		}
		if len(answered) == 0 && waited > 0 && unproven == waited {
			return TokenRefused(lastUnproven)
		}
		if len(waiting) > 0 {
			continue
		}
		if len(answered) == 0 && waited > 0 {
			return w.NoServerError(gone)
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
				reasons[i] = id + ": " + whyNoAnswer(w.Errs[id])
			}
			r.log.Warn("fitcache servers not answering; starting without them", "servers", strings.Join(reasons, "; "),
				"waited", time.Since(w.begun).Round(100*time.Millisecond))
			r.deaths.Add(int64(len(gone)))
			// Only those waited for in vain are news for the servers' membership: one that
			// refused at once may be binding its port as the job starts, and the membership
			// finds a dead one itself.
			for _, id := range gone {
				if r.onDead != nil && w.Decide(id, true, false) == WaitGone {
					r.onDead(id)
				}
			}
		}
		return nil
	}
}

// TokenRefused is the error of a client that no server proved the job token to. A client
// cannot tell a token that differs from the servers' from listeners that are not the job's
// servers; with every server failing to prove the token, the first is far likelier.
func TokenRefused(last error) error {
	return &core.ErrnoError{Errno: syscall.EACCES, Message: fmt.Sprintf("no fitcache server of the job proved "+
		"that it knows this client's job token: the token differs from the servers' (or what listens at their "+
		"addresses is not the job's servers): %v", last)}
}

// WarnOtherRing logs, once for warned, that the server id places files on another ring
// (theirs, as its hello named it) than the client's (mine, see ring.Fingerprint): the client
// still reads correctly, but files are cached twice and read from the source more often.
// Nothing when the rings agree or the server names none.
func WarnOtherRing(log *slog.Logger, warned *atomic.Bool, id, theirs, mine string) {
	if theirs == "" || theirs == mine || !warned.CompareAndSwap(false, true) {
		return
	}
	log.Warn("fitcache server places files on another ring than this client: its files are cached "+
		"twice and read from the source more often; give every client and server of the job the same "+
		"servers and virtual_nodes", "server", id, "server_ring", theirs, "client_ring", mine)
}

// RingFingerprint names the ring of the job of members that cfg describes (ring.Fingerprint
// at VirtualNodes): what a server's hello says, and what its clients compare with it.
func RingFingerprint(cfg config.Config, members []ring.Member) string {
	return ring.Fingerprint(VirtualNodes(cfg, members), members)
}

// VirtualNodes is the number of points per server on the ring of the job of members that cfg
// describes: its virtual_nodes, else (auto) ring.VirtualNodesFor the job's number of servers
// (distinct ids, as the ring counts them), the same in every client and server, which list
// the same servers.
func VirtualNodes(cfg config.Config, members []ring.Member) int {
	if cfg.VirtualNodes > 0 {
		return cfg.VirtualNodes
	}
	ids := make(map[string]struct{}, len(members))
	for _, m := range members {
		ids[m.ID] = struct{}{}
	}
	return ring.VirtualNodesFor(len(ids))
}

// hello asks a server to describe itself and marks it alive if it answers.
func (r *Router) hello(p *Peer) error {
	_, err := r.helloReply(p)
	return err
}

// helloReply is hello, with the server's reply.
func (r *Router) helloReply(p *Peer) (*fitcachepb.HelloReply, error) {
	ctx, cancel := context.WithTimeout(context.Background(), min(r.cfg.RPCTimeout, time.Second))
	defer cancel()
	reply, err := p.rpc.Hello(ctx)
	if err != nil {
		return nil, err
	}
	session := SessionOf(reply)
	WarnOtherRing(r.log, &r.ringWarned, p.member.ID, reply.Ring, r.fingerprint)
	if reply.BlockBytes > 0 {
		r.blockBytes.Store(reply.BlockBytes)
	}
	var dirs []tiers.Dir
	if p.local {
		dirs = TierDirs(reply.Tiers, session, r.log)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.session = session
	if p.local {
		CloseDirs(p.dirs) // of an earlier hello; readers still using them get misses
		p.dirs = dirs
		p.nodeSocket = reply.NodeSocket
	}
	p.failedCalls, p.dead = 0, false
	return reply, nil
}

// Targets returns the servers to read key from, in order: the first Replicas servers on
// distinct nodes walking clockwise, passing over dead ones under the recache policy; under the
// pfs policy a dead one keeps its slot (its files come from the source).
func (r *Router) Targets(key string) []*Peer {
	return ring.Choose(r.ring, key, r.cfg.Replicas, true, func(m ring.Member) (*Peer, ring.Choice) {
		p := r.peers[m.ID]
		if _, dead := p.State(); !dead {
			return p, ring.Take
		}
		if r.cfg.Policy == config.PolicyPFS {
			return nil, ring.Hold
		}
		return nil, ring.Pass
	})
}

// Replicas returns how many servers hold each file (the option replicas): its owner, and
// those a copy read from the source is sent to.
func (r *Router) Replicas() int { return r.cfg.Replicas }

// Failed records a failed call; it reports whether the server is now dead.
func (r *Router) Failed(p *Peer, err error) bool {
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
func (r *Router) spread(id string, dead bool) {
	for other, p := range r.peers {
		if other != id {
			p.news.Tell(id, dead)
		}
	}
}

// learn applies a server's membership view from a read reply: servers its clients found dead
// are dead for this router too, without waiting for its own timeouts.
func (r *Router) learn(from *Peer, version int64, dead []string) {
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
func (r *Router) deadByNews(p *Peer, who, by string) {
	p.mu.Lock()
	wasAlive := !p.dead
	p.dead = true
	p.mu.Unlock()
	if wasAlive {
		r.gossiped.Add(1)
		r.log.Warn("fitcache server declared dead by "+who, "server", p.member.ID, "told_by", by, "policy", r.cfg.Policy)
	}
}

// Told applies what the servers' membership says of a server (see package membership): dead,
// it is skipped at once, as if the router had found it dead itself; alive (it joined, or
// rejoined), it is said hello to and walked again, without waiting for the next probe.
func (r *Router) Told(id string, alive bool) {
	p, ok := r.peers[id]
	if !ok {
		return
	}
	if alive {
		if _, dead := p.State(); dead && r.hello(p) == nil {
			r.rejoins.Add(1)
			r.log.Info("fitcache server rejoined, by the servers' membership", "server", id)
		}
		return
	}
	r.deadByNews(p, "the servers' membership", "membership")
}

// Succeeded records a call the server answered: its count of failed calls starts again.
func (r *Router) Succeeded(p *Peer) {
	p.mu.Lock()
	p.failedCalls = 0
	p.mu.Unlock()
}

// probeLoop asks dead servers whether they are back, so that they rejoin.
func (r *Router) probeLoop() {
	defer close(r.stopped)
	tick := time.NewTicker(probeInterval)
	defer tick.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-tick.C:
			for _, p := range r.peers {
				if _, dead := p.State(); dead && r.hello(p) == nil {
					r.rejoins.Add(1)
					r.log.Info("fitcache server answers again: rejoined", "server", p.member.ID)
					r.spread(p.member.ID, false)
				}
			}
		}
	}
}

// Close stops probing, waits for the replica copies in flight and frees the connections and
// the mapped tier indexes. It returns what they could not be closed with. Call it once.
func (r *Router) Close() error {
	close(r.stop)
	<-r.stopped
	r.replicas.Wait()
	var errs []error
	for _, p := range r.peers {
		if err := p.rpc.Close(); err != nil {
			errs = append(errs, fmt.Errorf("connection to %s: %w", p.member.ID, err))
		}
		p.mu.Lock()
		errs = append(errs, CloseDirs(p.dirs))
		p.dirs = nil
		p.mu.Unlock()
	}
	return errors.Join(errs...)
}

// Peers returns the job's servers, by id. The map is the router's: do not change it.
func (r *Router) Peers() map[string]*Peer { return r.peers }

// LocalIDs returns the ids of the job's servers on the router's node, alive or not, sorted
// (not nil, if empty).
func (r *Router) LocalIDs() []string {
	ids := []string{}
	for id, p := range r.peers {
		if p.local {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids
}

// LocalServer returns the server on this node that hits on its tier files are reported to
// (the first by address), or nil.
func (r *Router) LocalServer() *rpc.Client {
	var best *Peer
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

// LocalAnswered reports whether a server on this node is alive and serves a node socket of
// this user's.
func (r *Router) LocalAnswered() bool {
	for _, p := range r.peers {
		p.mu.Lock()
		ok := p.local && !p.dead && p.nodeSocket != "" && OwnSocket(p.nodeSocket)
		p.mu.Unlock()
		if ok {
			return true
		}
	}
	return false
}

// DeadLocal returns the ids of the servers on this node that are dead, by address.
func (r *Router) DeadLocal() []string {
	var ids []string
	for id, p := range r.peers {
		if _, dead := p.State(); p.local && dead {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids
}

// LocalDirs returns the tier directories of the live servers on this node.
func (r *Router) LocalDirs() []tiers.Dir {
	var dirs []tiers.Dir
	for _, p := range r.peers {
		if d, dead := p.State(); p.local && !dead {
			dirs = append(dirs, d...)
		}
	}
	return dirs
}

// NodeSocket returns the node socket of the first live server on this node (by address)
// that announced one and whose socket is this user's, or "".
func (r *Router) NodeSocket() string {
	for _, id := range r.LocalIDs() {
		p := r.peers[id]
		p.mu.Lock()
		path, dead := p.nodeSocket, p.dead
		p.mu.Unlock()
		if !dead && path != "" && OwnSocket(path) {
			return path
		}
	}
	return ""
}

// OwnSocket reports whether path is a Unix socket of this user (not a link): a reader hands
// its opens to whoever listens there and trusts the descriptors that come back.
func OwnSocket(path string) bool {
	var st syscall.Stat_t
	return syscall.Lstat(path, &st) == nil && st.Mode&syscall.S_IFMT == syscall.S_IFSOCK && int(st.Uid) == os.Geteuid()
}

// BlockBytes returns the size of the servers' blocks, as the last hello said (0: none).
func (r *Router) BlockBytes() int64 { return r.blockBytes.Load() }

// Stamp stamps a file a server read itself (res) for its replicas, as a server stamps its
// Read replies.
func (r *Router) Stamp(path string, res core.Result) rpc.Stamp { return r.stamper.Stamp(path, res) }

// Counts are the router's counters since New.
type Counts struct {
	Deaths          int64 // servers the router declared dead
	Gossiped        int64 // servers declared dead because the job's servers said so
	Rejoins         int64 // dead servers that answered again
	Failures        int64 // calls that failed for want of an answer
	ReplicasSkipped int64 // replica copies not sent for their bounds (see Replicate)
}

// Counts returns the router's counters.
func (r *Router) Counts() Counts {
	return Counts{Deaths: r.deaths.Load(), Gossiped: r.gossiped.Load(), Rejoins: r.rejoins.Load(),
		Failures: r.failures.Load(), ReplicasSkipped: r.replicasSkipped.Load()}
}

// Stats asks every live server for its counters, by id ({"dead":true} for a dead one).
func (r *Router) Stats() map[string]json.RawMessage {
	out := map[string]json.RawMessage{}
	for id, p := range r.peers {
		if _, dead := p.State(); dead {
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
