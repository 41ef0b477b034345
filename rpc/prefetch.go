package rpc

import (
	"context"
	"math"

	"github.com/cloudwego/kitex/client/callopt"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// Prefetch is the generated client's typed call (see typed.go).
func (t typedClient) Prefetch(ctx context.Context, req *fitcachepb.PrefetchRequest, opts ...callopt.Option) (*fitcachepb.PrefetchReply, error) {
	return invoke(ctx, t, "Prefetch", &fitcachepb.FitCachePrefetchArgs{Req: req}, &fitcachepb.FitCachePrefetchResult{}, opts)
}

// Prefetch queues a prefetch job, takes the next chunk of its list, or renews it, and
// reports its progress (see core.Engine.Prefetch).
func (h *Handler) Prefetch(ctx context.Context, req *fitcachepb.PrefetchRequest) (*fitcachepb.PrefetchReply, error) {
	info, err := h.engine.Prefetch(core.PrefetchRequest{Root: req.Root, Owner: req.Owner, ListID: req.ListId,
		Offset: int(req.Offset), Total: int(req.Total), Paths: req.Paths, Session: sessionOf(req.Session),
		ForNode: req.ForNode, ThisEpoch: thisEpochOf(req.ThisEpoch)})
	if err != nil {
		errno, msg, reason := errnoOf(err)
		return &fitcachepb.PrefetchReply{Errno: errno, Message: msg, Reason: reason}, nil
	}
	return &fitcachepb.PrefetchReply{State: info.State, Joined: info.Joined, Accepted: int64(info.Accepted),
		Files: int64(info.Files), Received: int64(info.Received), Done: int64(info.Done), Fetched: int64(info.Fetched),
		SkippedCached: int64(info.SkippedCached), SkippedInflight: int64(info.SkippedInflight), Failed: int64(info.Failed),
		Bytes: info.Bytes, Owners: int64(info.Owners), Errors: info.Errors}, nil
}

// thisEpochOf converts PrefetchRequest.this_epoch from the wire; a number out of range is
// taken for the whole list (0).
func thisEpochOf(n int64) int {
	if n < 0 || n > math.MaxInt32 {
		return 0
	}
	return int(n)
}

// sessionOf converts a session number from the wire, where it is an i64; a number outside
// the engine's range joins any job (0).
func sessionOf(n int64) uint32 {
	if n < 0 || n > math.MaxUint32 {
		return 0
	}
	return uint32(n)
}

// Prefetch sends a prefetch request (a chunk of a list, or a renewal without paths) and
// returns the job's state and progress.
func (c *Client) Prefetch(ctx context.Context, req core.PrefetchRequest) (core.PrefetchInfo, error) {
	var r *fitcachepb.PrefetchReply
	err := c.call(ctx, c.cfg.ReadTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.Prefetch(ctx, &fitcachepb.PrefetchRequest{Root: req.Root, Owner: req.Owner,
			ListId: req.ListID, Offset: int64(req.Offset), Total: int64(req.Total), Paths: req.Paths,
			Session: int64(req.Session), ForNode: req.ForNode, ThisEpoch: int64(req.ThisEpoch)},
			c.target())
		return err
	})
	if err != nil {
		return core.PrefetchInfo{}, c.failed(err)
	}
	if err := core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message); err != nil {
		return core.PrefetchInfo{}, err
	}
	return core.PrefetchInfo{State: r.State, Joined: r.Joined, Accepted: int(r.Accepted), Files: int(r.Files),
		Received: int(r.Received), Done: int(r.Done), Fetched: int(r.Fetched), SkippedCached: int(r.SkippedCached),
		SkippedInflight: int(r.SkippedInflight), Failed: int(r.Failed), Bytes: r.Bytes, Owners: int(r.Owners),
		Errors: r.Errors}, nil
}
