package rpc

import (
	"context"

	"github.com/cloudwego/kitex/client"
	"github.com/cloudwego/kitex/client/callopt"

	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb/fitcache"
)

// typedClient is the generated client's typed methods over a Kitex client that we keep, so
// that it can be closed (the generated client hides it).
type typedClient struct{ c client.Client }

// invoke calls method with args and returns the reply Kitex decoded into res. On error it
// returns no reply and does not read res: Kitex may still decode a late answer into the result
// of a call that gave up at its deadline, and reading it then would race with that write.
func invoke[R any](ctx context.Context, t typedClient, method string, args any, res interface{ GetSuccess() R },
	opts []callopt.Option) (R, error) {
	if err := t.c.Call(client.NewCtxWithCallOptions(ctx, opts), method, args, res); err != nil {
		var none R
		return none, err
	}
	return res.GetSuccess(), nil
}

func (t typedClient) Hello(ctx context.Context, req *fitcachepb.HelloRequest, opts ...callopt.Option) (*fitcachepb.HelloReply, error) {
	return invoke(ctx, t, "Hello", &fitcachepb.FitCacheHelloArgs{Req: req}, &fitcachepb.FitCacheHelloResult{}, opts)
}

func (t typedClient) Read(ctx context.Context, req *fitcachepb.ReadRequest, opts ...callopt.Option) (*fitcachepb.ReadReply, error) {
	return invoke(ctx, t, "Read", &fitcachepb.FitCacheReadArgs{Req: req}, &fitcachepb.FitCacheReadResult{}, opts)
}

func (t typedClient) ReportHits(ctx context.Context, req *fitcachepb.HitReport, opts ...callopt.Option) (*fitcachepb.HitReportReply, error) {
	return invoke(ctx, t, "ReportHits", &fitcachepb.FitCacheReportHitsArgs{Req: req}, &fitcachepb.FitCacheReportHitsResult{}, opts)
}

func (t typedClient) Stats(ctx context.Context, req *fitcachepb.StatsRequest, opts ...callopt.Option) (*fitcachepb.StatsReply, error) {
	return invoke(ctx, t, "Stats", &fitcachepb.FitCacheStatsArgs{Req: req}, &fitcachepb.FitCacheStatsResult{}, opts)
}

func (t typedClient) Store(ctx context.Context, req *fitcachepb.StoreRequest, opts ...callopt.Option) (*fitcachepb.StoreReply, error) {
	return invoke(ctx, t, "Store", &fitcachepb.FitCacheStoreArgs{Req: req}, &fitcachepb.FitCacheStoreResult{}, opts)
}

var _ fitcache.Client = typedClient{}
