// The reading side of cluster mode on a node that runs servers of the job: one read path for
// every reader. A reader looks files up in the tiers of its node's servers itself (their
// mapped indexes, no round trip), and hands everything else to one of them over its node
// socket (package nodesock), which answers for every file of the job: its own, another local
// server's, or a file another node owns, which it fetches from the owner and keeps as a
// node-local copy where it has room (see package server, readers.go). Only servers talk to
// other servers: a reader makes no connection to another node, says hello to its node's
// servers only (at once, not one after another), and routing, failure detection and gossip
// live in the servers. The C hit path of libfitcache reads the same way without Go, also in a
// process forked after the library was loaded.
//
// A node that runs no server of the job (a login node), or whose servers' node sockets this
// user cannot use (servers run by another user), keeps the direct path: the reader routes over
// the ring and reads from the servers itself (direct.go, package routing).

package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/fitcache/fitcache/routing"
	"io"
	"log/slog"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/edsrzf/mmap-go"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/ring"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// nodeRouter holds a reader's connections to the servers of the job on its node.
type nodeRouter struct {
	cfg     config.Config
	log     *slog.Logger
	members []ring.Member // every server of the job (for Stats)
	token   string
	servers []*localServer // the job's servers on this node, by address

	mu        sync.Mutex    // protects downUntil and backoff
	downUntil time.Time     // before then, misses go around the node's server: it did not answer
	backoff   time.Duration // the next back-off

	// fingerprint names the job's ring as this reader builds it (ring.Fingerprint), which
	// the servers' hellos name theirs beside; ringWarned is set once one differed.
	fingerprint string
	ringWarned  atomic.Bool

	ringMu    sync.Mutex      // protects ring and ringRetry
	ring      *routing.Router // the job's other servers, for reads around the node's (see overRing)
	ringRetry time.Time       // before then, no new attempt to make ring
}

// localServer is a server of the job on the reader's node, as its hello described it.
type localServer struct {
	id  string
	rpc *rpc.Client

	mu         sync.Mutex  // protects dirs, session, nodeSocket and answered
	dirs       []tiers.Dir // its tiers, for the reader's session there
	session    uint32
	nodeSocket string
	answered   bool
	// blockBytes is the size of its blocks, as its last hello said (0: none).
	blockBytes atomic.Int64
}

// newNodeRouter says hello to the job's servers on this node (all at once) and returns the
// router, or nil when there is no server of the job on this node, none of them answered the
// first hello, or none serves a node socket of this user's: the caller then takes the direct
// path, whose start asks the job's other servers whether the node's are dead and waits for
// them if they may still be starting (see routing/startwait.go; Open comes back here if they answer).
// The node's servers that did not answer while others did are waited for as the direct path
// waits. It fails only when the servers refused the client or could not prove the job token.
func newNodeRouter(cfg config.Config, log *slog.Logger, members []ring.Member, token string) (*nodeRouter, error) {
	r := &nodeRouter{cfg: cfg, log: log, members: members, token: token,
		fingerprint: routing.RingFingerprint(cfg, members)}
	for _, m := range members {
		if m.Node != cfg.Node {
			continue
		}
		c, err := rpc.Dial(m.ID, rpc.ClientConfig{Token: token, Job: cfg.Job, ConnectTimeout: cfg.RPCTimeout,
			CallTimeout: cfg.RPCTimeout, ReadTimeout: cfg.RPCTimeout})
		if err != nil {
			r.close()
			return nil, err
		}
		r.servers = append(r.servers, &localServer{id: m.ID, rpc: c})
	}
	if len(r.servers) == 0 {
		return nil, nil
	}
	sort.Slice(r.servers, func(i, j int) bool { return r.servers[i].id < r.servers[j].id })
	w := routing.NewStartWait(cfg.WaitTimeout)
	w.AskAgain() // the first round asks everyone
	byID := map[string]*localServer{}
	for _, s := range r.servers {
		byID[s.id] = s
	}
	alive := func(id string) bool { s, ok := byID[id]; return ok && s.hasAnswered() }
	for {
		again := w.AskAgain()
		var asked []*localServer
		for _, s := range r.servers {
			if _, named := w.Named[s.id]; !named && (again || !s.hasAnswered()) {
				asked = append(asked, s)
			}
		}
		replies := make([]*fitcachepb.HelloReply, len(asked))
		errs := make([]error, len(asked))
		var wg sync.WaitGroup
		for i, s := range asked {
			wg.Add(1)
			go func() {
				defer wg.Done()
				replies[i], errs[i] = s.hello(cfg, log)
			}()
		}
		wg.Wait()
		unproven := 0
		for i, err := range errs {
			if err == nil {
				w.Answered(asked[i].id, replies[i].Dead, replies[i].Alive, alive)
				// Its reads go through the node's server, but around it over the ring when
				// that server dies (overRing): the rings must agree.
				routing.WarnOtherRing(log, &r.ringWarned, asked[i].id, replies[i].Ring, r.fingerprint)
				continue
			}
			w.Errs[asked[i].id] = err
			if routing.RefusedBy(err) {
				r.close()
				return nil, fmt.Errorf("the fitcache servers of this node refused this client: %w", err)
			}
			if errors.Is(err, rpc.ErrUnproven) {
				unproven++
			}
		}
		if unproven == len(r.servers) {
			r.close()
			return nil, routing.TokenRefused(errs[0])
		}
		var answered, waiting []string
		for _, s := range r.servers {
			switch {
			case s.hasAnswered():
				answered = append(answered, s.id)
			case w.Decide(s.id, true, true) == routing.WaitOn:
				waiting = append(waiting, s.id)
			}
		}
		if len(answered) == 0 {
			log.Info("no fitcache server of the job on this node answered; asking the job's other servers",
				"servers", strings.Join(r.ids(), ", "), "err", errs[0])
			r.close()
			return nil, nil
		}
		if len(waiting) == 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if r.socket() == "" {
		log.Warn("the fitcache servers of this node serve no node socket of this user's; reading through the cluster directly",
			"servers", r.ids())
		r.close()
		return nil, nil
	}
	return r, nil
}

// hello asks the server to describe itself, with the reader's job (see rpc.Client.Hello).
// It returns the server's reply.
func (s *localServer) hello(cfg config.Config, log *slog.Logger) (*fitcachepb.HelloReply, error) {
	ctx, cancel := context.WithTimeout(context.Background(), min(cfg.RPCTimeout, 2*time.Second))
	defer cancel()
	reply, err := s.rpc.Hello(ctx)
	if err != nil {
		return nil, err
	}
	session := routing.SessionOf(reply)
	dirs := routing.TierDirs(reply.Tiers, session, log)
	s.blockBytes.Store(reply.BlockBytes)
	s.mu.Lock()
	defer s.mu.Unlock()
	routing.CloseDirs(s.dirs)
	s.dirs, s.session, s.nodeSocket, s.answered = dirs, session, reply.NodeSocket, true
	return reply, nil
}

func (s *localServer) hasAnswered() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.answered
}

// ids returns the ids of the node's servers.
func (r *nodeRouter) ids() []string {
	ids := make([]string, len(r.servers))
	for i, s := range r.servers {
		ids[i] = s.id
	}
	return ids
}

// home returns the server whose node socket readers use (the first by address that serves one
// of this user's), or nil.
func (r *nodeRouter) home() *localServer {
	for _, s := range r.servers {
		s.mu.Lock()
		path := s.nodeSocket
		s.mu.Unlock()
		if path != "" && routing.OwnSocket(path) {
			return s
		}
	}
	return nil
}

// socket returns the node socket readers use, or "".
func (r *nodeRouter) socket() string {
	if s := r.home(); s != nil {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.nodeSocket
	}
	return ""
}

// dirs returns the tier directories of the node's servers that answered, for the reader's
// session at each.
func (r *nodeRouter) dirs() []tiers.Dir {
	var dirs []tiers.Dir
	for _, s := range r.servers {
		s.mu.Lock()
		dirs = append(dirs, s.dirs...)
		s.mu.Unlock()
	}
	return dirs
}

// down reports whether misses should skip the node's server for now (it did not answer).
func (r *nodeRouter) down() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return time.Now().Before(r.downUntil)
}

// markDown makes misses go around the node's server (see Client.readAround) for a back-off
// that doubles while the server stays unusable.
func (r *nodeRouter) markDown(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.backoff = min(max(2*r.backoff, minBackoff), maxBackoff)
	r.downUntil = time.Now().Add(r.backoff)
	r.log.Warn("the fitcache server of this node did not answer; reading from the job's other servers", "err", err, "retry_in", r.backoff)
}

// ringRetryAfter is how long a reader whose node's servers do not answer waits before it
// tries again to reach the job's other servers, after no other server answered either.
const ringRetryAfter = 10 * time.Second

// overRing returns a router over the job's servers that starts with the node's servers dead,
// for the reads that go around them while they do not answer (see Client.readAround): made at
// the first such read, so that a reader whose node's server died (a long-lived reader: a
// persistent DataLoader worker, a process that forks its workers) reads the other nodes'
// files from their servers, as a reader that starts after the death does, instead of from
// the source. nil when no other server answered (the source is read, and the router is
// tried again after ringRetryAfter). The router keeps probing the node's servers, and
// routes to them again over RPC once they answer.
func (r *nodeRouter) overRing() *routing.Router {
	r.ringMu.Lock()
	defer r.ringMu.Unlock()
	if r.ring != nil || time.Now().Before(r.ringRetry) {
		return r.ring
	}
	ring, err := routing.New(r.cfg, r.log, r.members, r.token, routing.Options{Dead: r.ids()})
	if err != nil {
		r.ringRetry = time.Now().Add(ringRetryAfter)
		r.log.Warn("no server of the job answered either; reading from the source", "err", err, "retry_in", ringRetryAfter)
		return nil
	}
	r.ring = ring
	return ring
}

// answering reports whether the node's server whose node socket readers use (home) answers
// a hello within nodesock.ProbeTimeout: the C hit path sends its misses to that socket.
func (r *nodeRouter) answering() bool {
	s := r.home()
	if s == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), nodesock.ProbeTimeout)
	defer cancel()
	_, err := s.rpc.Hello(ctx)
	return err == nil
}

// up resets the back-off after the node's server answered.
func (r *nodeRouter) up() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.backoff = 0
}

// stats returns the counters of every server of the job by id ({"dead":true} for one that
// does not answer): a diagnostic, for which the reader connects to each for the call.
func (r *nodeRouter) stats() map[string]json.RawMessage {
	out := map[string]json.RawMessage{}
	var mu sync.Mutex // protects out
	var wg sync.WaitGroup
	for _, m := range r.members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			js := `{"dead":true}`
			if c, err := rpc.Dial(m.ID, rpc.ClientConfig{Token: r.token, ConnectTimeout: r.cfg.RPCTimeout,
				CallTimeout: min(r.cfg.RPCTimeout, 2*time.Second)}); err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), min(r.cfg.RPCTimeout, 2*time.Second))
				if s, err := c.Stats(ctx); err == nil {
					js = s
				}
				cancel()
				c.Close()
			}
			mu.Lock()
			out[m.ID] = json.RawMessage(js)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}

// close frees the connections and the mapped tier indexes, and returns what they could not
// be closed with.
func (r *nodeRouter) close() error {
	var errs []error
	r.ringMu.Lock()
	if r.ring != nil {
		errs = append(errs, r.ring.Close())
	}
	r.ring, r.ringRetry = nil, time.Now().Add(ringRetryAfter) // the client is closing: no new router
	r.ringMu.Unlock()
	for _, s := range r.servers {
		if err := s.rpc.Close(); err != nil {
			errs = append(errs, fmt.Errorf("connection to %s: %w", s.id, err))
		}
		s.mu.Lock()
		errs = append(errs, routing.CloseDirs(s.dirs))
		s.dirs = nil
		s.mu.Unlock()
	}
	return errors.Join(errs...)
}

// readNode serves a read on a node with servers of the job: from their tiers, else through the
// node socket (the server answers with a descriptor of the file), else, while the server does
// not answer, from the source. Without mapTiers, a file found in a tier gives no buffer.
func (c *Client) readNode(path string, mapTiers bool) (Buffer, error) {
	dirs := c.node.dirs()
	if !mapTiers && tiers.Listed(dirs, path) {
		return nil, nil
	}
	if m, err := tiers.Probe(dirs, path); err == nil {
		c.hit(m)
		return m, nil
	}
	socket := c.node.socket()
	if socket == "" || c.node.down() {
		return c.readAround(path)
	}
	ctx, cancel := c.readContext(time.Now().Add(c.cfg.ReadTimeout))
	defer cancel()
	f, _, err := nodesock.Open(ctx, socket, c.root, path)
	if err != nil && c.readsEnded() {
		return nil, core.ErrClosed
	}
	if errors.Is(err, nodesock.ErrUnavailable) {
		c.node.markDown(err)
		return c.readAround(path)
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	c.node.up()
	c.counts.serverReads.Add(1)
	return fileBuffer(f, path)
}

// readAround serves a read that the node's server does not answer: from its tiers when
// they hold the file as it is now at the source (the reader checks it itself, see
// deadTiers), else from the job's other servers over the ring (see nodeRouter.overRing), else
// from the source. Copies that the reader's session allows were looked for already.
func (c *Client) readAround(path string) (Buffer, error) {
	if b, ok := c.fromDeadTiers(c.node.ids(), path); ok {
		return b, nil
	}
	if r := c.node.overRing(); r != nil {
		return c.readOverRing(r, path)
	}
	return c.readDirect(path)
}

// fileBuffer reads the file f (a descriptor the node's server answered with) into a buffer:
// its bytes, or a read-only mapping of a large one (directReadMax), so that no large file is
// held in memory.
func fileBuffer(f *os.File, path string) (Buffer, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if fi.Size() > directReadMax {
		m, err := mmap.MapRegion(f, int(fi.Size()), mmap.RDONLY, 0, 0)
		if err != nil {
			return nil, fmt.Errorf("map %s: %w", path, err)
		}
		return &sourceMapping{m: m}, nil
	}
	data := make([]byte, fi.Size())
	if _, err := io.ReadFull(io.NewSectionReader(f, 0, fi.Size()), data); err != nil {
		return nil, fmt.Errorf("read %s: %w: %w", path, core.ErrChanged, err)
	}
	return heapBuffer(data), nil
}
