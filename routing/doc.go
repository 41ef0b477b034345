// Package routing routes the reads of a FitCache cluster job over its servers: a consistent
// hash ring (package ring) gives each file, and each block of a large file, an owner and its
// replicas on distinct nodes; a [Router] connects to every server, waits for them at start
// (but not for those the job's servers know dead), declares dead a server whose calls fail,
// probes the dead every second until they rejoin, exchanges news of dead servers (membership.Outbox)
// with each server on every read, and applies the failure policy (recache: a dead
// server's files go to the next live one; pfs: they are read from the source).
//
// Both sides of the cluster use it: a reader that routes itself (package client, on a node
// without a server of the job) and a cluster server answering its node's readers for every
// file of the job (package server). It imports neither.
//
// Usage:
//
//	members, token, err := discovery.Job(cfg.ServerSpec(), cfg.Token, cfg.TokenFile)
//	...
//	r, err := routing.New(cfg, log, members, token, routing.Options{})
//	...
//	defer r.Close()
//	err = r.Route(path, func(p *routing.Peer, rest []*routing.Peer) error {
//		reply, err := r.Ask(ctx, p, root, path, nil)
//		if err != nil {
//			return err // rpc.ErrUnavailable: counted as a failure, the next server is tried
//		}
//		if rpc.OriginOf(reply) == core.OriginSource {
//			r.Replicate(rest, root, path, reply.Data, rpc.StampOf(reply))
//		}
//		use(reply.Data)
//		return nil
//	})
//	if errors.Is(err, routing.ErrReadSource) {
//		// read the source
//	}
package routing
