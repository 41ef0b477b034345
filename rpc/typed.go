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

func (t typedClient) Hello(ctx context.Context, req *fitcachepb.HelloRequest, opts ...callopt.Option) (*fitcachepb.HelloReply, error) {
	args, res := fitcachepb.FitCacheHelloArgs{Req: req}, fitcachepb.FitCacheHelloResult{}
	err := t.c.Call(client.NewCtxWithCallOptions(ctx, opts), "Hello", &args, &res)
	return res.GetSuccess(), err
}

func (t typedClient) Read(ctx context.Context, req *fitcachepb.ReadRequest, opts ...callopt.Option) (*fitcachepb.ReadReply, error) {
	args, res := fitcachepb.FitCacheReadArgs{Req: req}, fitcachepb.FitCacheReadResult{}
	err := t.c.Call(client.NewCtxWithCallOptions(ctx, opts), "Read", &args, &res)
	return res.GetSuccess(), err
}

func (t typedClient) ReportHits(ctx context.Context, req *fitcachepb.HitReport, opts ...callopt.Option) (*fitcachepb.HitReportReply, error) {
	args, res := fitcachepb.FitCacheReportHitsArgs{Req: req}, fitcachepb.FitCacheReportHitsResult{}
	err := t.c.Call(client.NewCtxWithCallOptions(ctx, opts), "ReportHits", &args, &res)
	return res.GetSuccess(), err
}

func (t typedClient) Stats(ctx context.Context, req *fitcachepb.StatsRequest, opts ...callopt.Option) (*fitcachepb.StatsReply, error) {
	args, res := fitcachepb.FitCacheStatsArgs{Req: req}, fitcachepb.FitCacheStatsResult{}
	err := t.c.Call(client.NewCtxWithCallOptions(ctx, opts), "Stats", &args, &res)
	return res.GetSuccess(), err
}

func (t typedClient) Store(ctx context.Context, req *fitcachepb.StoreRequest, opts ...callopt.Option) (*fitcachepb.StoreReply, error) {
	args, res := fitcachepb.FitCacheStoreArgs{Req: req}, fitcachepb.FitCacheStoreResult{}
	err := t.c.Call(client.NewCtxWithCallOptions(ctx, opts), "Store", &args, &res)
	return res.GetSuccess(), err
}

var _ fitcache.Client = typedClient{}
