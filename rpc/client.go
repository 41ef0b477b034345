package rpc

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/cloudwego/kitex/client"
	"github.com/cloudwego/kitex/client/callopt"
	"github.com/cloudwego/kitex/pkg/kerrors"
	"github.com/cloudwego/kitex/pkg/klog"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb/fitcache"
)

// ClientConfig configures a Client. Zero durations take the defaults shown.
type ClientConfig struct {
	Token          string
	ConnectTimeout time.Duration // 1s
	CallTimeout    time.Duration // 2s: deadline of Hello, ReportHits and Stats
	ReadTimeout    time.Duration // 60s: deadline of Read, which may read a large source file
}

// Client calls one FitCache server. Every call has a deadline. It is safe for concurrent use.
type Client struct {
	addr string
	cfg  ClientConfig
	kc   fitcache.Client
}

// ErrUnavailable wraps failures to reach a server or get its answer in time, as opposed to
// errors the server answered with.
var ErrUnavailable = errors.New("fitcache server unavailable")

// IsRefused reports a failure to reach the server at all (nothing listens there, the
// connection was refused or closed while connecting), as opposed to a call that timed out:
// a server that refuses connections is certainly down.
func IsRefused(err error) bool {
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
		return true
	}
	var timeout interface{ Timeout() bool }
	if errors.As(err, &timeout) && timeout.Timeout() {
		return false
	}
	return errors.Is(err, kerrors.ErrGetConnection)
}

// Dial returns a client of the server at addr: a Unix socket path or host:port. No
// connection is made until the first call.
func Dial(addr string, cfg ClientConfig) (*Client, error) {
	if cfg.ConnectTimeout <= 0 {
		cfg.ConnectTimeout = time.Second
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = 2 * time.Second
	}
	if cfg.ReadTimeout <= 0 {
		cfg.ReadTimeout = 60 * time.Second
	}
	kc, err := fitcache.NewClient("fitcache", client.WithHostPorts(addr),
		client.WithConnectTimeout(cfg.ConnectTimeout), client.WithRPCTimeout(cfg.CallTimeout))
	if err != nil {
		return nil, fmt.Errorf("fitcache client for %s: %w", addr, err)
	}
	return &Client{addr: addr, cfg: cfg, kc: kc}, nil
}

// Addr returns the server's address.
func (c *Client) Addr() string { return c.addr }

// target pins a call to this client's server. Without it Kitex resolves the address itself
// and retries a refused connection several times, delaying the failure we want to see.
func (c *Client) target() callopt.Option { return callopt.WithHostPort(c.addr) }

// QuietKitexLogs keeps Kitex's own log lines (connection retries and the like) out of the
// host process's stderr: the client reports what matters through its errors and counters.
func QuietKitexLogs() { klog.SetLevel(klog.LevelFatal) }

func (c *Client) unavailable(err error) error {
	return fmt.Errorf("%w: %s: %w", ErrUnavailable, c.addr, err)
}

// Hello asks the server to describe itself.
func (c *Client) Hello(ctx context.Context) (*fitcachepb.HelloReply, error) {
	r, err := c.kc.Hello(ctx, &fitcachepb.HelloRequest{Token: c.cfg.Token}, c.target())
	if err != nil {
		return nil, c.unavailable(err)
	}
	return r, core.NewErrnoError(r.Errno, r.Message)
}

// Read asks the server for a file. With local set, a cached file comes back as the tier file
// to map (CachedPath) rather than as bytes.
func (c *Client) Read(ctx context.Context, root, path string, local bool) (*fitcachepb.ReadReply, error) {
	return c.ReadGossip(ctx, &fitcachepb.ReadRequest{Root: root, Path: path, Local: local})
}

// ReadGossip is Read with a request that may carry membership gossip (see the IDL).
func (c *Client) ReadGossip(ctx context.Context, req *fitcachepb.ReadRequest) (*fitcachepb.ReadReply, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.ReadTimeout)
	defer cancel()
	req.Token = c.cfg.Token
	r, err := c.kc.Read(ctx, req, c.target(), callopt.WithRPCTimeout(c.cfg.ReadTimeout))
	if err != nil {
		return nil, c.unavailable(err)
	}
	return r, core.NewErrnoError(r.Errno, r.Message)
}

// ReportHits reports hits served from this server's tier files by the caller.
func (c *Client) ReportHits(ctx context.Context, byTier map[string]int64, bytes int64) error {
	r, err := c.kc.ReportHits(ctx, &fitcachepb.HitReport{Token: c.cfg.Token, HitsByTier: byTier, Bytes: bytes}, c.target())
	if err != nil {
		return c.unavailable(err)
	}
	return core.NewErrnoError(r.Errno, r.Message)
}

// Store sends a file's bytes to a replica server, which caches them.
func (c *Client) Store(ctx context.Context, root, path string, data []byte, mtimeNanos int64) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.ReadTimeout)
	defer cancel()
	r, err := c.kc.Store(ctx, &fitcachepb.StoreRequest{Token: c.cfg.Token, Root: root, Path: path, Data: data,
		MtimeNanos: mtimeNanos}, c.target(), callopt.WithRPCTimeout(c.cfg.ReadTimeout))
	if err != nil {
		return c.unavailable(err)
	}
	return core.NewErrnoError(r.Errno, r.Message)
}

// Stats returns the server's counters as JSON.
func (c *Client) Stats(ctx context.Context) (string, error) {
	r, err := c.kc.Stats(ctx, &fitcachepb.StatsRequest{Token: c.cfg.Token}, c.target())
	if err != nil {
		return "", c.unavailable(err)
	}
	return r.Json, core.NewErrnoError(r.Errno, r.Message)
}
