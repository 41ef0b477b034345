package routing

import (
	"bytes"
	"context"
	"errors"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// ErrReadSource is what Route returns when the file is to be read from the source: no
// server answered, the policy sends it there, or it is too large for its owner to cache or
// send.
var ErrReadSource = errors.New("read the source")

// Route calls try with the servers a read of key goes to, in order (see Targets), until one
// answers; rest are the servers after it, to which a file it read from the source is copied
// (replicas). It returns nil when one did, the file's own error as a server saw it, or
// ErrReadSource. A server that fails the call with rpc.ErrUnavailable is counted as failing
// (see Failed); under recache, one that died meanwhile hands its files to the next one, so
// the walk is made again.
func (r *Router) Route(key string, try func(p *Peer, rest []*Peer) error) error {
	for attempt := 0; attempt < 2; attempt++ {
		targets := r.Targets(key)
		died := false
		for i, p := range targets {
			err := try(p, targets[i+1:])
			if err == nil {
				r.Succeeded(p)
				return nil
			}
			if errors.Is(err, core.ErrTooLarge) {
				return ErrReadSource // too large for the owner to cache or send
			}
			if !errors.Is(err, rpc.ErrUnavailable) {
				return err
			}
			died = r.Failed(p, err) || died
		}
		if !died || r.cfg.Policy != config.PolicyRecache {
			break
		}
	}
	return ErrReadSource
}

// Ask asks one server for the file at path under root over RPC (naming the tier file when
// the server is on this node and has it cached), exchanging membership gossip with it. The
// file's bytes are read into buf when they fit in it (see rpc.Client.ReadInto): the reply's
// Data is then buf's, for the caller to use before it lends buf again; buf may be nil.
func (r *Router) Ask(ctx context.Context, p *Peer, root, path string, buf []byte) (*fitcachepb.ReadReply, error) {
	version, dead, alive := p.news.Take()
	reply, err := p.rpc.ReadInto(ctx, &fitcachepb.ReadRequest{Root: root, Path: path,
		Local: p.local, MembershipVersion: version, Dead: dead, Alive: alive}, buf)
	if reply != nil {
		r.learn(p, reply.MembershipVersion, reply.Dead)
	}
	if err != nil {
		if errors.Is(err, rpc.ErrUnavailable) {
			p.untold(dead, alive)
		}
		return nil, err
	}
	return reply, nil
}

// AskBatch asks one server for the files of req in one ReadBatch call (see
// rpc.Client.ReadBatch, which reads the reply into buf, and into sink's pipes when sink is
// not nil), exchanging membership gossip with it
// as Ask does. It neither counts a failure nor a success: the caller says (Failed, Succeeded).
func (r *Router) AskBatch(ctx context.Context, p *Peer, req *fitcachepb.ReadBatchRequest, buf []byte,
	sink *rpc.PipeSink) (*fitcachepb.ReadBatchReply, error) {
	version, dead, alive := p.news.Take()
	req.MembershipVersion, req.Dead, req.Alive = version, dead, alive
	reply, err := p.rpc.ReadBatch(ctx, req, buf, sink)
	if reply != nil {
		r.learn(p, reply.MembershipVersion, reply.Dead)
	}
	if errors.Is(err, rpc.ErrUnavailable) {
		p.untold(dead, alive)
	}
	return reply, err
}

// untold queues again the news that a call to p did not get through, for the next one.
func (p *Peer) untold(dead, alive []string) {
	for _, id := range dead {
		p.news.Tell(id, true)
	}
	for _, id := range alive {
		p.news.Tell(id, false)
	}
}

// Replica copies are sent in the background and hold a copy of the file meanwhile: they are
// bounded in size and in bytes in flight, and skipped beyond the bounds (a replica is an
// optimisation; the file's owner holds it).
const (
	replicaMaxFile       = 32 << 20
	replicaBytesInFlight = 128 << 20
)

// Replicate sends a file just read from the source (path under root) to the other servers
// meant to hold it, with the stamp its owner gave it (which the replicas check), in the
// background: a replica copy must not slow the read down. data is copied; Close waits for
// the copies.
func (r *Router) Replicate(to []*Peer, root, path string, data []byte, stamp rpc.Stamp) {
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
			if err := p.rpc.Store(context.Background(), root, path, data, stamp); err != nil {
				r.log.Debug("replica copy failed", "server", p.member.ID, "path", path, "err", err)
			}
		}()
	}
}

// AskBlock asks the server that owns block n (of bb bytes) of the file at path under root on
// the ring (the next live one if it is dead, see Route) for length bytes of it at off,
// caching the block there (a length of 0 only caches it); with whole, for the whole block.
// fromOtherNode says that the server that answered is on another node. A server asked this
// way never forwards the request again.
func (r *Router) AskBlock(ctx context.Context, root, path string, bb, n, off, length int64, whole bool) (
	reply *fitcachepb.ReadReply, fromOtherNode bool, err error) {
	if whole {
		off, length = 0, bb
	}
	err = r.Route(tiers.BlockName(path, bb, n), func(p *Peer, _ []*Peer) error {
		fromOtherNode = !p.local
		var err error
		reply, err = p.rpc.ReadBlockRange(ctx, root, path, bb, n, off, length, false)
		return err
	})
	return reply, fromOtherNode, err
}
