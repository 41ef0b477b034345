package server

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/discovery"
	"github.com/fitcache/fitcache/membership"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/ring"
	"github.com/fitcache/fitcache/routing"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// The node socket of a server (package nodesock) answers the preload shim of the
// transparent mode, and the hit path of libfitcache in forked processes, on the server's
// node. A per-user server answers with its own engine. A cluster server (Config.Listen)
// given the job's servers (Config.Cluster: `fitcache serve --servers` or FITCACHE_SERVERS,
// with the other cluster options from FITCACHE_*) answers for every file of the job: it routes
// each dataset root's requests over the ring (rootReader, readers.go; package routing), so
// that a file keeps one owner on the ring whichever node opens it. Its own files come from its engine, the files of other servers
// on its node as their tier files, those of other nodes as memory files holding the bytes
// their owners sent over Kitex, and dead servers' files as the failure policy says; a batch
// (OpOpenMany) asks each owner on another node for its files in one ReadBatch call, and hands
// the bytes of those the node keeps no copy of inline. A write-open of a dataset file
// (OpForget) drops the copies at the servers a read of the file goes to and at every server
// on this node (rootReader.forget). A cluster server that does not know the job's servers has no node socket (see Start): answering with its own engine,
// it would cache on its node every file the node reads.

// nodeServer returns the node socket configuration of a server: routed through the cluster
// when cn is not nil, else served by the engine. touch is called on every request (idle
// tracking); onOpen, if not nil, with every open answered, its origin and the time it took
// (metrics.Server.ObserveNodeOpen).
func nodeServer(engine *core.Engine, cn *clusterNode, log *slog.Logger, touch func(),
	onOpen func(core.Origin, time.Duration)) nodesock.Config {
	cfg := nodesock.Config{Log: log, Errno: core.Errno,
		Fetch: func(ctx context.Context, root, path string) error {
			touch()
			return engine.Fetch(ctx, root, path)
		},
		Open: func(ctx context.Context, root, path string) (*os.File, uint32, error) {
			touch()
			f, origin, err := engine.OpenForReader(ctx, root, path)
			return f, uint32(origin), err
		},
		Forget: func(root, path string) error {
			touch()
			return engine.Forget(root, path)
		}}
	if cn == nil { // a cluster server's readers open through it (OpOpen): they do not fill
		cfg.Record = func(root, path string, r nodesock.FillReport) error {
			touch()
			return engine.RecordFill(root, path, core.FillReport{FillIno: r.FillIno,
				Mode:     fs.FileMode(r.Mode & nodesock.RecordModeBits),
				Checksum: r.Checksum, HasChecksum: r.Mode&nodesock.RecordHasChecksum != 0,
				Identity: tiers.Identity{Size: r.Size, MTimeNanos: r.MTimeNanos, CTimeNanos: r.CTimeNanos, Ino: r.Ino}})
		}
		cfg.Noted = func(_, path string) { engine.NoteReport(path) }
	}
	cfg.FetchBlock = func(ctx context.Context, root, name string) error {
		touch()
		return fetchBlock(ctx, engine, cn, root, name)
	}
	if cn != nil {
		cfg.Fetch = func(ctx context.Context, root, path string) error {
			touch()
			return cn.fetch(ctx, root, path)
		}
		cfg.Open = func(ctx context.Context, root, path string) (*os.File, uint32, error) {
			touch()
			f, origin, err := cn.open(ctx, root, path)
			return f, uint32(origin), err
		}
		cfg.Forget = func(root, path string) error {
			touch()
			return cn.forget(root, path)
		}
		cfg.OpenMany = func(ctx context.Context, root string, paths []string) []nodesock.Opened {
			touch()
			return cn.openMany(ctx, root, paths)
		}
	}
	if onOpen != nil {
		open := cfg.Open
		cfg.Open = func(ctx context.Context, root, path string) (*os.File, uint32, error) {
			start := time.Now()
			f, origin, err := open(ctx, root, path)
			if err == nil {
				onOpen(core.Origin(origin), time.Since(start))
			}
			return f, origin, err
		}
		if openMany := cfg.OpenMany; openMany != nil {
			cfg.OpenMany = func(ctx context.Context, root string, paths []string) []nodesock.Opened {
				start := time.Now()
				res := openMany(ctx, root, paths)
				for _, r := range res {
					if r.Err == nil {
						onOpen(core.Origin(r.Origin), time.Since(start))
					}
				}
				return res
			}
		}
	}
	return cfg
}

// Bounds of a cluster node: the dataset roots it keeps a client for (a request for another
// root fails, and the reader reads the source), how long a new client waits for the job's
// servers (those that do not answer start dead and are probed every second), and how long a
// client that could not be made is not tried again.
const (
	nodeMaxRoots    = 64
	nodeClientWait  = 5 * time.Second
	nodeClientRetry = 10 * time.Second
)

// clusterNode answers the node socket of a cluster server through the cluster (see above).
// It is safe for concurrent use.
type clusterNode struct {
	engine *core.Engine
	cfg    config.Config // the job's: Node is this server's node
	self   string        // this server's id on the ring, "" if it is not found there
	log    *slog.Logger
	// jobWait is the job's wait_timeout: how long its clients wait at start for a server that
	// may still be starting. A listed server that has not joined the membership by then is
	// named dead to new clients (membership.Config.NeverJoinedAfter).
	jobWait time.Duration

	members []ring.Member // the job's servers
	// watch is this server's part in the servers' membership (package membership), nil when
	// it is off or could not start: what it finds is passed to every client (see told).
	watch *membership.Membership

	mu sync.Mutex // protects clients, peers, relay and closed
	// relay, if set, passes what the membership found on to this server's RPC clients (see
	// rpc.Handler.Learn); set once the RPC server runs.
	relay   func(id string, alive bool)
	clients map[string]*rootClient
	peers   map[string]*rpc.Client // the job's other servers, for announce
	closed  bool
}

// rootClient is the reader of one dataset root (see rootReader), made by the first request
// for it.
type rootClient struct {
	ready chan struct{} // closed when c, err and made are set
	c     *rootReader
	err   error
	made  time.Time
}

// newClusterNode prepares the routed node socket of the cluster server listening on listen,
// in the job that cfg describes (cfg.Servers set), authenticated with token. It fails when
// the job's servers cannot be listed. The servers' membership starts apart (startMembership).
func newClusterNode(engine *core.Engine, cfg config.Config, token, listen string, log *slog.Logger) (*clusterNode, error) {
	members, err := discovery.Discover(cfg.ServerSpec())
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cfg.Token, cfg.TokenFile = token, ""
	jobWait := cfg.WaitTimeout
	cfg.WaitTimeout = min(cfg.WaitTimeout, nodeClientWait)
	cfg.Direct = true // the server reads from the job's servers itself, never through a node socket
	cn := &clusterNode{engine: engine, cfg: cfg, log: log, clients: map[string]*rootClient{}, members: members,
		jobWait: jobWait}
	if self, ok := selfMember(members, listen, cfg.Node); ok {
		cn.self, cn.cfg.Node = self.ID, self.Node
	} else {
		log.Warn("this server is not among the job's servers: its node socket reads its own files over RPC too",
			"listen", listen, "node", cfg.Node, "servers", cfg.Servers)
	}
	return cn, nil
}

// ring returns the fingerprint of the job's ring (ring.Fingerprint), as this server's clients
// build it; "" without a cluster.
func (n *clusterNode) ring() string {
	if n == nil {
		return ""
	}
	return routing.RingFingerprint(n.cfg, n.members)
}

// startMembership makes this server a member of the servers' membership (gossip_port_offset
// not 0, and the server among the job's): the servers watch each other, and a server found
// dead is skipped by this node's reads at once, whether they read it or not. A membership
// that cannot start (its port still taken after membership.DefaultBindWait, say) fails the
// server's start: the others would take a server outside the membership for dead and keep it
// so, while its own reads went on. bindWait is membership.Config.BindWait.
func (n *clusterNode) startMembership(bindWait time.Duration) error {
	if n.self == "" || n.cfg.GossipPortOffset == 0 {
		return nil
	}
	ids := make([]string, len(n.members))
	for i, m := range n.members {
		ids[i] = m.ID
	}
	w, err := membership.Start(membership.Config{Self: n.self, Servers: ids, PortOffset: n.cfg.GossipPortOffset,
		Token: n.cfg.Token, ProbeInterval: n.cfg.ProbeInterval, BindWait: bindWait, OnChange: n.told, NeverJoinedAfter: n.jobWait, Log: n.log})
	if err != nil {
		return fmt.Errorf("the servers' membership (gossip_port_offset %d; 0 turns it off): %w",
			n.cfg.GossipPortOffset, err)
	}
	n.watch = w
	return nil
}

// foundDead passes on what the reads of one of this node's clients found: the server id is
// dead. The node's other clients (of other dataset roots) and the job's other servers act on
// it at once.
func (n *clusterNode) foundDead(id string) {
	if n.watch != nil {
		n.watch.Tell(id)
	}
	n.told(id, false)
}

// reportedDead passes on what a client on a node without a server of the job reported of a
// server in its requests to this one (rpc.ServerConfig.OnReportedDead): the servers'
// membership spreads it as it spreads what this node's own reads find.
func (n *clusterNode) reportedDead(id string) {
	if n == nil || id == n.self || !slices.ContainsFunc(n.members, func(m ring.Member) bool { return m.ID == id }) {
		return // not news this server can act on: itself, or not a server of the job
	}
	n.foundDead(id)
}

// relayTo makes f hear what the membership finds from now on (see relay).
func (n *clusterNode) relayTo(f func(id string, alive bool)) {
	if n == nil {
		return
	}
	n.mu.Lock()
	n.relay = f
	n.mu.Unlock()
	if n.watch != nil {
		for _, id := range n.watch.Dead() { // found before
			f(id, false)
		}
	}
}

// told passes what the membership found of a server to every client of this node, and to
// this server's RPC clients (relay).
func (n *clusterNode) told(id string, alive bool) {
	n.mu.Lock()
	relay := n.relay
	var clients []*rootReader
	for _, rc := range n.clients {
		select {
		case <-rc.ready:
			if rc.c != nil {
				clients = append(clients, rc.c)
			}
		default: // being made: it takes the membership's view when ready (see client)
		}
	}
	n.mu.Unlock()
	for _, c := range clients {
		c.cluster.Told(id, alive)
	}
	if relay != nil {
		relay(id, alive)
	}
}

// Members returns the servers the membership knows alive and dead, and those other servers'
// reads found dead lately; nil lists without a membership.
func (n *clusterNode) Members() (alive, dead, reported []string) {
	if n == nil || n.watch == nil {
		return nil, nil, nil
	}
	return n.watch.Alive(), n.watch.Dead(), n.watch.Reported()
}

// selfMember finds the server listening on listen among the job's servers: the one whose id
// is the listen address, else the one on node with its port (a server listening on
// 0.0.0.0:7070 or :7070 on a node the job names by its host name).
func selfMember(members []ring.Member, listen, node string) (ring.Member, bool) {
	for _, m := range members {
		if m.ID == listen {
			return m, true
		}
	}
	_, port, err := net.SplitHostPort(listen)
	if err != nil {
		return ring.Member{}, false
	}
	for _, m := range members {
		if _, p, err := net.SplitHostPort(m.ID); err == nil && p == port && m.Node == node {
			return m, true
		}
	}
	return ring.Member{}, false
}

// client returns the cluster client of root, making it on first use.
func (n *clusterNode) client(ctx context.Context, root string) (*rootReader, error) {
	n.mu.Lock()
	rc := n.clients[root]
	if rc != nil {
		select {
		case <-rc.ready:
			if rc.err != nil && time.Since(rc.made) > nodeClientRetry {
				delete(n.clients, root)
				rc = nil
			}
		default:
		}
	}
	mine := false
	switch {
	case rc != nil:
	case n.closed:
		n.mu.Unlock()
		return nil, core.ErrClosed
	case len(n.clients) >= nodeMaxRoots:
		n.mu.Unlock()
		return nil, &core.ErrnoError{Errno: syscall.EMFILE, Message: fmt.Sprintf(
			"fitcache: the node socket serves at most %d dataset roots through the cluster", nodeMaxRoots)}
	default:
		rc = &rootClient{ready: make(chan struct{})}
		n.clients[root] = rc
		mine = true
	}
	n.mu.Unlock()
	if mine {
		var dead []string
		if n.watch != nil {
			dead = n.watch.Dead() // not waited for at start
		}
		rc.c, rc.err = newRootReader(root, n.cfg, n.log, n.engine, n.self,
			routing.Options{Dead: dead, OnDead: n.foundDead})
		if rc.err == nil && n.watch != nil {
			for _, id := range n.watch.Dead() { // found while the client started
				rc.c.cluster.Told(id, false)
			}
		}
		if rc.err != nil {
			n.log.Warn("node socket: no cluster client for a dataset root; its misses read the source",
				"root", root, "err", rc.err, "retry_in", nodeClientRetry)
		}
		rc.made = time.Now()
		close(rc.ready)
	}
	select {
	case <-rc.ready:
		return rc.c, rc.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// open answers OpOpen: see rootReader.open. Roots outside the server's are refused
// before any client is made.
func (n *clusterNode) open(ctx context.Context, root, path string) (*os.File, core.Origin, error) {
	if err := n.engine.CheckRoot(root, path); err != nil {
		return nil, 0, err
	}
	c, err := n.client(ctx, root)
	if err != nil {
		return nil, 0, err
	}
	defer n.engine.ReaderWaits(path)() // prefetch gives way (see core.Engine.ReaderWaits)
	return c.open(ctx, path)
}

// openMany answers OpOpenMany: see rootReader.openMany. A path outside the server's roots
// is refused (that file only), and a root outside them before any client is made.
func (n *clusterNode) openMany(ctx context.Context, root string, paths []string) []nodesock.Opened {
	out := make([]nodesock.Opened, len(paths))
	var asked []string
	var at []int
	for i, path := range paths {
		if err := n.engine.CheckRoot(root, path); err != nil {
			out[i].Err = err
			continue
		}
		asked, at = append(asked, path), append(at, i)
	}
	if len(asked) == 0 {
		return out
	}
	c, err := n.client(ctx, root)
	if err != nil {
		for _, i := range at {
			out[i].Err = err
		}
		return out
	}
	for _, path := range asked { // prefetch gives way (see core.Engine.ReaderWaits)
		done := n.engine.ReaderWaits(path)
		defer done()
	}
	for k, r := range c.openMany(ctx, asked, nodesock.MaxInline) {
		out[at[k]] = nodesock.Opened{File: r.File, Data: r.Data, Pipe: r.Pipe, Origin: uint32(r.Origin), Err: r.Err,
			Release: r.Release}
	}
	return out
}

// forget answers OpForget: see rootReader.forget (the copies of the servers a read goes to and of
// every server on this node). Roots outside the server's are refused before any client is
// made.
func (n *clusterNode) forget(root, path string) error {
	if err := n.engine.CheckRoot(root, path); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), n.cfg.RPCTimeout)
	defer cancel()
	c, err := n.client(ctx, root)
	if err != nil {
		return err
	}
	return c.forget(ctx, path)
}

// forwardBlock serves a ranged request for a block from a reader of this node (see
// rpc.ServerConfig.ForwardBlock): through this server's cluster client of the root, from the
// block's owner on the ring. ok is false when this server owns it, or has no cluster (nil):
// the engine serves it then.
func (n *clusterNode) forwardBlock(ctx context.Context, root, path string, block, off, length int64) ([]byte, bool, error) {
	if n == nil || n.self == "" {
		return nil, false, nil
	}
	if err := n.engine.CheckRoot(root, path); err != nil {
		return nil, false, err
	}
	c, err := n.client(ctx, root)
	if err != nil {
		return nil, false, nil
	}
	return c.forwardBlock(ctx, path, block, off, length)
}

// cacheBlockAtOwner has block n of the file at path cached by the server that owns it on the
// ring (with ask), for this server's prefetch (core.EngineConfig.BlockOwner): mine when that
// is this server, which caches it itself.
func (n *clusterNode) cacheBlockAtOwner(ctx context.Context, root, path string, block int64, ask bool) (mine bool, err error) {
	if n == nil || n.self == "" {
		return true, nil
	}
	if err := n.engine.CheckRoot(root, path); err != nil {
		return false, err
	}
	c, err := n.client(ctx, root)
	if err != nil {
		return false, err
	}
	return c.cacheBlockAtOwner(ctx, path, block, ask)
}

// fetch answers OpFetch, which promises the caller the file in a tier of this node (see
// rootReader.fetch): this server's own, another server's of this node, or a node-local
// copy of a file another node owns. When no tier of the node takes it, the error (ENOSPC or
// EFBIG) sends the caller to OpOpen.
func (n *clusterNode) fetch(ctx context.Context, root, path string) error {
	defer n.engine.ReaderWaits(path)() // prefetch gives way (see core.Engine.ReaderWaits)
	return n.bring(ctx, root, path)
}

// bring brings path into a tier of this node, for a reader (fetch) or for prefetch.
func (n *clusterNode) bring(ctx context.Context, root, path string) error {
	if err := n.engine.CheckRoot(root, path); err != nil {
		return err
	}
	c, err := n.client(ctx, root)
	if err != nil {
		return err
	}
	return c.fetch(ctx, path)
}

// fetchForPrefetch brings a file of a node's readers' list into a tier of this node (see
// core.EngineConfig.NodeFetch), and reports whether a copy was here already.
func (n *clusterNode) fetchForPrefetch(ctx context.Context, root, path string) (cached bool, err error) {
	if f, _, ok := n.engine.OpenCached(root, path); ok {
		f.Close()
		return true, nil
	}
	return false, n.bring(ctx, root, path)
}

// announce passes a job that began with a reader of this node on to the job's other servers
// (see rpc.ServerConfig.OnNewJob), all at once, each waited for no longer than the RPC
// timeout: each checks its copies for the job's session from then on, so that a copy this
// node's readers get from another node, or keep, is as fresh as one of this node's. A server
// that does not answer checks its copies for its next session anyway (a restart begins one).
func (n *clusterNode) announce(ctx context.Context, job string) {
	ctx, cancel := context.WithTimeout(ctx, n.cfg.RPCTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for _, c := range n.peerClients() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.BeginJob(ctx, job); err != nil {
				n.log.Debug("job not passed on", "server", c.Addr(), "err", err)
			}
		}()
	}
	wg.Wait()
}

// peerClients returns RPC clients of the job's other servers, made on first use.
func (n *clusterNode) peerClients() []*rpc.Client {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.peers == nil && !n.closed {
		n.peers = map[string]*rpc.Client{}
		for _, m := range n.members {
			if m.ID == n.self {
				continue
			}
			c, err := rpc.Dial(m.ID, rpc.ClientConfig{Token: n.cfg.Token, ConnectTimeout: n.cfg.RPCTimeout,
				CallTimeout: n.cfg.RPCTimeout})
			if err == nil {
				n.peers[m.ID] = c
			}
		}
	}
	out := make([]*rpc.Client, 0, len(n.peers))
	for _, c := range n.peers {
		out = append(out, c)
	}
	return out
}

// Close leaves the servers' membership and closes the readers of each root, after their
// requests in progress, and the connections to the job's other servers. It returns what they
// could not be closed with.
func (n *clusterNode) Close() error {
	var errs []error
	if n.watch != nil {
		if err := n.watch.Close(); err != nil {
			errs = append(errs, fmt.Errorf("leave the servers' membership: %w", err))
		}
	}
	n.mu.Lock()
	n.closed = true
	clients, peers := n.clients, n.peers
	n.clients, n.peers = nil, nil
	n.mu.Unlock()
	for root, rc := range clients {
		<-rc.ready
		if rc.c != nil {
			if err := rc.c.close(); err != nil {
				errs = append(errs, fmt.Errorf("the readers of %s: %w", root, err))
			}
		}
	}
	for id, c := range peers {
		if err := c.Close(); err != nil {
			errs = append(errs, fmt.Errorf("connection to %s: %w", id, err))
		}
	}
	return errors.Join(errs...)
}

// fetchBlock brings the block named name (tiers.BlockName) into a tier of engine, for
// OpFetchBlock: in a cluster (cn not nil), a block another server owns is fetched from it and
// kept on this node where there is room (see clusterNode.forwardBlock). A name of another
// block size than the engine's is refused (EINVAL): its sender numbers blocks otherwise. A
// file under core.ReadNowBytes is refused with EFBIG: it is cached whole (the C caller then
// asks for the whole file), as a Go reader of its ranges has it, so that it is not cached
// twice.
func fetchBlock(ctx context.Context, engine *core.Engine, cn *clusterNode, root, name string) error {
	path, blockBytes, n, ok := tiers.SplitBlockName(name)
	if !ok || blockBytes != engine.BlockBytes() {
		return fmt.Errorf("%w: %q is no block of %d bytes", core.ErrBadPath, name, engine.BlockBytes())
	}
	if err := engine.CheckRoot(root, path); err != nil {
		return err
	}
	if st, err := os.Stat(path); err == nil && st.Size() < core.ReadNowBytes { // its size only: read beneath the root
		return core.NewErrnoError(int32(syscall.EFBIG), core.ReasonUnspecified,
			fmt.Sprintf("%s has %d bytes: it is cached whole, not in blocks", path, st.Size()))
	}
	if _, forwarded, err := cn.forwardBlock(ctx, root, path, n, 0, 0); forwarded || err != nil {
		return err
	}
	res, err := engine.ReadBlock(ctx, root, path, n, true)
	if err == nil {
		res.Release()
	}
	return err
}
