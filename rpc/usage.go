package rpc

import (
	"context"
	"syscall"

	"github.com/cloudwego/kitex/client/callopt"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// Usage is the generated client's typed call (see typed.go).
func (t typedClient) Usage(ctx context.Context, req *fitcachepb.UsageRequest, opts ...callopt.Option) (*fitcachepb.UsageReply, error) {
	return invoke(ctx, t, "Usage", &fitcachepb.FitCacheUsageArgs{Req: req}, &fitcachepb.FitCacheUsageResult{}, opts)
}

// Clear is the generated client's typed call (see typed.go).
func (t typedClient) Clear(ctx context.Context, req *fitcachepb.ClearRequest, opts ...callopt.Option) (*fitcachepb.ClearReply, error) {
	return invoke(ctx, t, "Clear", &fitcachepb.FitCacheClearArgs{Req: req}, &fitcachepb.FitCacheClearResult{}, opts)
}

// Usage reports what the server's tiers hold per dataset root (core.Engine.Usage).
func (h *Handler) Usage(ctx context.Context, req *fitcachepb.UsageRequest) (*fitcachepb.UsageReply, error) {
	return &fitcachepb.UsageReply{Usage: toWire(h.engine.Usage())}, nil
}

// Clear removes the cached files of a dataset root, or of all (core.Engine.Clear). A request
// with neither a root nor all is refused (EINVAL), so that an empty root never means all.
func (h *Handler) Clear(ctx context.Context, req *fitcachepb.ClearRequest) (*fitcachepb.ClearReply, error) {
	root := req.Root
	switch {
	case req.All:
		root = ""
	case root == "":
		return &fitcachepb.ClearReply{Errno: int32(syscall.EINVAL), Reason: fitcachepb.Reason_BAD_PATH, Message: "fitcache: clear: no dataset root given (and not all)"}, nil
	}
	cleared, err := h.engine.Clear(root, req.DryRun)
	if err != nil {
		errno, msg, reason := errnoOf(err)
		return &fitcachepb.ClearReply{Errno: errno, Message: msg, Reason: reason}, nil
	}
	return &fitcachepb.ClearReply{Cleared: toWire(cleared)}, nil
}

func toWire(us []core.CacheUsage) []*fitcachepb.CacheUsage {
	out := make([]*fitcachepb.CacheUsage, len(us))
	for i, u := range us {
		out[i] = &fitcachepb.CacheUsage{Root: u.Root, Tier: u.Kind, Dir: u.Dir, Files: int64(u.Files), Bytes: u.Bytes}
	}
	return out
}

func fromWire(us []*fitcachepb.CacheUsage) []core.CacheUsage {
	out := make([]core.CacheUsage, len(us))
	for i, u := range us {
		out[i] = core.CacheUsage{Root: u.Root, Kind: u.Tier, Dir: u.Dir, Files: int(u.Files), Bytes: u.Bytes}
	}
	return out
}

// Usage asks the server what its tiers hold per dataset root.
func (c *Client) Usage(ctx context.Context) ([]core.CacheUsage, error) {
	var r *fitcachepb.UsageReply
	err := c.call(ctx, c.cfg.CallTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.Usage(ctx, &fitcachepb.UsageRequest{}, c.target())
		return err
	})
	if err != nil {
		return nil, c.failed(err)
	}
	return fromWire(r.Usage), core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
}

// Clear asks the server to remove the cached files of the dataset roots at or under root, or
// of every root when root is "", and returns what it removed (with dryRun: would remove).
func (c *Client) Clear(ctx context.Context, root string, dryRun bool) ([]core.CacheUsage, error) {
	var r *fitcachepb.ClearReply
	err := c.call(ctx, c.cfg.ReadTimeout, func(ctx context.Context) (err error) { // unlinking many files takes a while
		r, err = c.kc.Clear(ctx, &fitcachepb.ClearRequest{Root: root, All: root == "", DryRun: dryRun},
			c.target())
		return err
	})
	if err != nil {
		return nil, c.failed(err)
	}
	return fromWire(r.Cleared), core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
}
