// The direct path of cluster mode: a reader on a node without a server of the job (or whose
// servers' node sockets it cannot use) routes its reads over the ring itself (package
// routing) and reads from the servers, mapping the tier files of those on its node.

package client

import (
	"context"
	"errors"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/routing"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// readCluster serves a read in cluster mode: from the tiers of this node's dead servers
// when they hold the file as it is now at the source, else from the servers the ring gives.
func (c *Client) readCluster(path string) (Buffer, error) {
	if b, ok := c.fromDeadTiers(c.cluster.DeadLocal(), path); ok {
		return b, nil
	}
	return c.readOverRing(c.cluster, path)
}

// readOverRing reads the file at path from the servers that r's ring gives, in turn, or from
// the source when r says so (a large file, or no live server for it under the pfs policy).
func (c *Client) readOverRing(r *routing.Router, path string) (Buffer, error) {
	var buf Buffer
	err := r.Route(path, func(p *routing.Peer, rest []*routing.Peer) error {
		b, reply, err := c.readFromPeer(r, p, path)
		if err != nil {
			return err
		}
		if reply != nil && reply.Origin == core.OriginSource && len(rest) > 0 {
			r.Replicate(rest, c.root, path, b.Bytes(), reply.Stamp)
		}
		buf = b
		return nil
	})
	if errors.Is(err, routing.ErrReadSource) {
		return c.readDirect(path) // a large file is mapped
	}
	return buf, err
}

// readFromPeer reads from one server of r: from its tier files directly when it is on this
// node and has the file, else over RPC. reply is nil for a local hit.
func (c *Client) readFromPeer(r *routing.Router, p *routing.Peer, path string) (Buffer, *readReply, error) {
	dirs, _ := p.State()
	if p.Local() {
		if m, err := tiers.Probe(dirs, path); err == nil {
			c.hit(m)
			return m, nil, nil
		}
	}
	reply, err := c.askPeer(context.Background(), r, p, path)
	if err != nil {
		return nil, nil, err
	}
	buf, err := c.replyBuffer(context.Background(), p.RPC(), reply, dirs, path)
	if err != nil {
		return nil, nil, err
	}
	return buf, &readReply{Origin: rpc.OriginOf(reply), Stamp: rpc.StampOf(reply)}, nil
}

// askPeer asks one server of r for a file over RPC (see routing.Router.Ask).
func (c *Client) askPeer(ctx context.Context, r *routing.Router, p *routing.Peer, path string) (*fitcachepb.ReadReply, error) {
	reply, err := r.Ask(ctx, p, c.root, path, nil)
	if err == nil {
		c.counts.serverReads.Add(1)
	}
	return reply, err
}

type readReply struct {
	Origin core.Origin
	Stamp  rpc.Stamp // what the owner vouched for, for replica copies
}

// Owner returns the id of the server a read of path goes to first in cluster mode: its
// owner on the ring or, under recache, the next live server; "" when it is read from the
// source (pfs policy and a dead owner) or outside cluster mode.
func (c *Client) Owner(path string) string {
	if c.cluster == nil {
		return ""
	}
	path, err := c.Resolve(path)
	if err != nil {
		return ""
	}
	if t := c.cluster.Targets(path); len(t) > 0 {
		return t[0].ID()
	}
	return ""
}

// LocalServers returns the ids of the job's servers on this node (config.Config.Node), alive
// or not, sorted (not nil, if empty); nil outside cluster mode.
func (c *Client) LocalServers() []string {
	if c.node != nil {
		return c.node.ids()
	}
	if c.cluster == nil {
		return nil
	}
	return c.cluster.LocalIDs()
}
