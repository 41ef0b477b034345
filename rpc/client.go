package rpc

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/cloudwego/kitex/client"
	"github.com/cloudwego/kitex/client/callopt"
	"github.com/cloudwego/kitex/pkg/kerrors"
	"github.com/cloudwego/kitex/pkg/klog"
	"github.com/cloudwego/kitex/pkg/remote"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb/fitcache"
)

// ClientConfig configures a Client. Zero values take the defaults shown.
type ClientConfig struct {
	// Token of the job. When set, every new connection starts with the handshake (see
	// handshake.go), in which the server must prove that it knows the token before this
	// client sends anything else or reads a reply; the token itself never travels.
	Token string
	// Job identifies the caller's job (a training run) in Hello: the job's clients share one
	// validation session at each server (see core.Engine.BeginSession).
	Job            string
	ConnectTimeout time.Duration // 1s: also bounds the handshake
	CallTimeout    time.Duration // 2s: deadline of Hello, ReportHits and Stats
	ReadTimeout    time.Duration // 60s: deadline of Read, which may read a large source file
	// MaxFrameBytes is the largest request or reply: DefaultMaxFrameBytes with a token, else
	// no limit (the per-user server on a private Unix socket). Whatever the limit, every
	// length in a reply is checked against the bytes of its frame before it is decoded (see
	// checkFrame).
	MaxFrameBytes int
}

// Client calls one FitCache server. Every call has a deadline. It is safe for concurrent use.
type Client struct {
	addr string
	cfg  ClientConfig
	kc   typedClient
	// closer closes the Kitex client's connections; the generated client hides it.
	closer interface{ Close() error }

	mu     sync.RWMutex // protects closed; held for reading during calls
	closed bool
}

// ErrUnavailable wraps failures to reach a server or get its answer in time, as opposed to
// errors the server answered with.
var ErrUnavailable = errors.New("fitcache server unavailable")

// IsRefused reports a failure to reach the server at all (nothing listens there, the
// connection was refused or closed while connecting, or what listens there did not prove that
// it knows the job token: ErrUnproven), as opposed to a call that timed out: such a server is
// certainly down.
func IsRefused(err error) bool {
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) || errors.Is(err, ErrUnproven) {
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
	if cfg.MaxFrameBytes <= 0 && cfg.Token != "" {
		cfg.MaxFrameBytes = DefaultMaxFrameBytes
	}
	// This package's transport (transport.go), whose connections are authenticated by the
	// handshake before Kitex gets them.
	var d remote.Dialer = remote.NewDefaultDialer()
	if cfg.Token != "" {
		d = newHandshakeDialer(d, newJobKeys(cfg.Token))
	}
	opts := []client.Option{client.WithDestService("fitcache"), client.WithHostPorts(addr),
		client.WithConnectTimeout(cfg.ConnectTimeout),
		client.WithCodec(newFramedCodec(cfg.MaxFrameBytes)), client.WithDialer(dialer{inner: d}),
		client.WithTransHandlerFactory(cliTransHandlerFactory{})}
	kc, err := client.NewClient(fitcache.NewServiceInfoForClient(), opts...)
	if err != nil {
		return nil, fmt.Errorf("fitcache client for %s: %w", addr, err)
	}
	closer, _ := kc.(interface{ Close() error })
	return &Client{addr: addr, cfg: cfg, kc: typedClient{kc}, closer: closer}, nil
}

// Close closes the client's connections. Calls in flight finish first; later calls fail
// with core.ErrClosed. Closing again does nothing.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	if c.closer == nil {
		return nil
	}
	return c.closer.Close()
}

// call runs f unless the client is closed, with a context that gives the call at most
// timeout. The deadline and the cancellation of ctx are the transport's to enforce (see
// callState): Kitex gets neither, so that it runs the call in this goroutine.
func (c *Client) call(ctx context.Context, timeout time.Duration, f func(ctx context.Context) error) error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return fmt.Errorf("fitcache client for %s: %w", c.addr, core.ErrClosed)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	st := &callState{ctx: ctx}
	err := f(context.WithValue(context.WithoutCancel(ctx), callKey{}, st))
	st.end()
	if err == nil {
		return nil
	}
	cause := ctx.Err()
	if d, ok := ctx.Deadline(); cause == nil && ok && !time.Now().Before(d) {
		cause = context.DeadlineExceeded // the connection's deadline came first
	}
	if cause != nil {
		err = fmt.Errorf("%w: %w", err, cause)
	}
	return err
}

// Addr returns the server's address.
func (c *Client) Addr() string { return c.addr }

// target pins a call to this client's server. Without it Kitex resolves the address itself
// and retries a refused connection several times, delaying the failure we want to see.
func (c *Client) target() callopt.Option { return callopt.WithHostPort(c.addr) }

// QuietKitexLogs keeps Kitex's own log lines (connection retries and the like) out of the
// host process's stderr: the client reports what matters through its errors and counters.
func QuietKitexLogs() { klog.SetLevel(klog.LevelFatal) }

// failed turns a call's error into ours: anything but a closed client means the server was
// not reached (ErrUnavailable), a listener that did not prove the job token included (see
// IsRefused).
func (c *Client) failed(err error) error {
	if errors.Is(err, core.ErrClosed) {
		return err
	}
	return fmt.Errorf("%w: %s: %w", ErrUnavailable, c.addr, err)
}

// Hello asks the server to describe itself.
func (c *Client) Hello(ctx context.Context) (*fitcachepb.HelloReply, error) {
	var r *fitcachepb.HelloReply
	err := c.call(ctx, c.cfg.CallTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.Hello(ctx, &fitcachepb.HelloRequest{Job: c.cfg.Job}, c.target())
		return err
	})
	if err != nil {
		return nil, c.failed(err)
	}
	return r, core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
}

// BeginJob tells the server that job began on another server of the cluster (a Hello
// relayed, see ServerConfig.OnNewJob), so that it checks its copies for the job's readers
// too, whichever node they read from.
func (c *Client) BeginJob(ctx context.Context, job string) error {
	var r *fitcachepb.HelloReply
	err := c.call(ctx, c.cfg.CallTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.Hello(ctx, &fitcachepb.HelloRequest{Job: job, Relayed: true}, c.target())
		return err
	})
	if err != nil {
		return c.failed(err)
	}
	return core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
}

// Read asks the server for a file. With local set, a cached file comes back as the tier file
// to map (CachedPath) rather than as bytes.
func (c *Client) Read(ctx context.Context, root, path string, local bool) (*fitcachepb.ReadReply, error) {
	return c.ReadGossip(ctx, &fitcachepb.ReadRequest{Root: root, Path: path, Local: local})
}

// ReadBlock asks the server for block n, of blockBytes, of a file (see
// core.Engine.ReadBlock); local is as for Read. The reply's Size is 0 for a block past the
// end of the file. A server of another block size refuses it.
func (c *Client) ReadBlock(ctx context.Context, root, path string, blockBytes, n int64, local bool) (*fitcachepb.ReadReply, error) {
	return c.ReadGossip(ctx, &fitcachepb.ReadRequest{Root: root, Path: path, Local: local, Block: &n, BlockBytes: &blockBytes})
}

// ReadBlockRange asks the server for length bytes at off of block n of a file (fewer at the
// block's end); a length of 0 has the block cached and sends nothing (see
// ReadRequest.range_length). local is set for a caller on the server's node: the server
// then forwards the request to the block's owner on the ring when that is another server.
//
// The reply is checked: a server that knows no ranges (older than them) answers with the
// whole block, which is refused (EPROTO) rather than taken for the range.
func (c *Client) ReadBlockRange(ctx context.Context, root, path string, blockBytes, n, off, length int64, local bool) (*fitcachepb.ReadReply, error) {
	reply, err := c.ReadGossip(ctx, &fitcachepb.ReadRequest{Root: root, Path: path, Local: local, Block: &n,
		RangeOffset: &off, RangeLength: &length, BlockBytes: &blockBytes})
	if err == nil && (int64(len(reply.Data)) > length || reply.CachedPath != "") {
		return nil, fmt.Errorf("%w: the server answered a range of %d bytes with %d bytes (or a tier file): it knows no ranges",
			syscall.EPROTO, length, len(reply.Data))
	}
	return reply, err
}

// ReadGossip is Read with a request that may carry membership gossip (see the IDL).
func (c *Client) ReadGossip(ctx context.Context, req *fitcachepb.ReadRequest) (*fitcachepb.ReadReply, error) {
	return c.ReadInto(ctx, req, nil)
}

// ReadInto is ReadGossip into the caller's buffer: the bytes of a file that fits in buf are
// read from the connection into buf, and the reply's Data is buf[:Size] (else a new buffer,
// as with Read). The buffer is the caller's again when ReadInto returns, whatever it returns.
func (c *Client) ReadInto(ctx context.Context, req *fitcachepb.ReadRequest, buf []byte) (*fitcachepb.ReadReply, error) {
	dest := newBulkDest(buf)
	var r *fitcachepb.ReadReply
	err := c.call(ctx, c.cfg.ReadTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.Read(context.WithValue(ctx, bulkDestKey{}, dest), req, c.target())
		return err
	})
	dest.abandon() // no decode writes to buf from now on (see bulkDest)
	if err != nil {
		return nil, c.failed(err)
	}
	return r, core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
}

// ReportHits reports hits served from this server's tier files by the caller.
func (c *Client) ReportHits(ctx context.Context, byTier map[string]int64, bytes int64) error {
	var r *fitcachepb.HitReportReply
	err := c.call(ctx, c.cfg.CallTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.ReportHits(ctx, &fitcachepb.HitReport{HitsByTier: byTier, Bytes: bytes}, c.target())
		return err
	})
	if err != nil {
		return c.failed(err)
	}
	return core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
}

// Store sends a file's bytes to a replica server, which caches them if they match the stamp
// their owner gave them in its Read reply (see StampOf) and the source as the replica sees it;
// else it fails with EBADMSG (core.ErrBadCopy) or EAGAIN (core.ErrChanged).
func (c *Client) Store(ctx context.Context, root, path string, data []byte, s Stamp) error {
	var r *fitcachepb.StoreReply
	err := c.call(ctx, c.cfg.ReadTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.Store(ctx, &fitcachepb.StoreRequest{Root: root, Path: path, Data: data, MtimeNanos: s.MTimeNanos,
			CtimeNanos: s.CTimeNanos, Inode: int64(s.Ino), Checksum: int64(s.Checksum), Stamp: s.MAC},
			c.target())
		return err
	})
	if err != nil {
		return c.failed(err)
	}
	return core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
}

// Stats returns the server's counters as JSON.
func (c *Client) Stats(ctx context.Context) (string, error) {
	var r *fitcachepb.StatsReply
	err := c.call(ctx, c.cfg.CallTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.Stats(ctx, &fitcachepb.StatsRequest{}, c.target())
		return err
	})
	if err != nil {
		return "", c.failed(err)
	}
	return r.Json, core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
}
