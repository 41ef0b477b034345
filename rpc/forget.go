package rpc

import (
	"context"

	"github.com/cloudwego/kitex/client/callopt"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// Forget is the generated client's typed call (see typed.go).
func (t typedClient) Forget(ctx context.Context, req *fitcachepb.ForgetRequest, opts ...callopt.Option) (*fitcachepb.ForgetReply, error) {
	return invoke(ctx, t, "Forget", &fitcachepb.FitCacheForgetArgs{Req: req}, &fitcachepb.FitCacheForgetResult{}, opts)
}

// Forget drops the cached copies of one file from the server's tiers (core.Engine.Forget).
func (h *Handler) Forget(ctx context.Context, req *fitcachepb.ForgetRequest) (*fitcachepb.ForgetReply, error) {
	errno, msg, reason := errnoOf(h.engine.Forget(req.Root, req.Path))
	return &fitcachepb.ForgetReply{Errno: errno, Message: msg, Reason: reason}, nil
}

// Forget asks the server to drop its cached copies of the file at path (inside root), whose
// source is being written.
func (c *Client) Forget(ctx context.Context, root, path string) error {
	var r *fitcachepb.ForgetReply
	err := c.call(ctx, c.cfg.CallTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.Forget(ctx, &fitcachepb.ForgetRequest{Root: root, Path: path}, c.target())
		return err
	})
	if err != nil {
		return c.failed(err)
	}
	return core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
}
