// The connection to the embedded server: finding it, starting it when none runs, backing off
// while it cannot be used, and the tier directories its hello names (see package embedded).

package client

import (
	"context"
	"fmt"
	"github.com/fitcache/fitcache/routing"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/nodesock"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// Back-off after the embedded server could not be reached or restarted: reads go to the
// source for this long, doubling up to the maximum while the server stays unusable.
const (
	minBackoff = time.Second
	maxBackoff = 30 * time.Second
)

// serverConn is a connection to the embedded server and what it told about itself.
type serverConn struct {
	rpc     *rpc.Client
	dirs    []tiers.Dir // the server's tier directories, fastest first, for our session
	session uint32      // our job's validation session at the server (see tiers.Dir.WithSession)
	// blockBytes is the size of the server's blocks (see ranges.go); 0 for a server
	// without them.
	blockBytes int64
	// readerFills: the server records the fills of its node's readers (see
	// nodesock.OpRecord).
	readerFills bool
}

// tierView returns the tier directories of the last server that answered (none before the
// first).
func (c *Client) tierView() []tiers.Dir {
	if v := c.view.Load(); v != nil {
		return v.dirs
	}
	return nil
}

// connectAttempt is one try at reaching (or starting) the embedded server; readers that need
// the server while it runs wait for it, each no longer than its read timeout.
type connectAttempt struct {
	done chan struct{} // closed when err is set
	err  error
}

// current returns the connection to the embedded server and whether reads should skip it
// for now (it failed recently).
func (c *Client) current() (conn *serverConn, down bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conn, time.Now().Before(c.downUntil)
}

// serverDown reports whether reads skip the embedded server for now (see current).
func (c *Client) serverDown() bool {
	_, down := c.current()
	return down
}

// ensureConn returns a working connection to the embedded server: the current one unless it
// is failed, else the result of a connection attempt (started here, or already running),
// waited for at most wait. While the server is backing off it returns ErrUnavailable at once.
// No lock is held while waiting, so reads of cached files never wait on the server.
func (c *Client) ensureConn(failed *serverConn, wait time.Duration) (*serverConn, error) {
	c.mu.Lock()
	if c.conn != nil && c.conn != failed {
		conn := c.conn
		c.mu.Unlock()
		return conn, nil
	}
	if failed != nil && c.conn == failed {
		c.conn = nil
		go failed.rpc.Close() // it waits for calls still in flight on it
	}
	if time.Now().Before(c.downUntil) {
		c.mu.Unlock()
		return nil, fmt.Errorf("%w: backing off after a failure", rpc.ErrUnavailable)
	}
	a := c.attempt
	if a == nil {
		a = &connectAttempt{done: make(chan struct{})}
		c.attempt = a
		go c.connect(a)
	}
	c.mu.Unlock()

	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-a.done:
	case <-timer.C:
		return nil, fmt.Errorf("%w: no answer within %s", rpc.ErrUnavailable, wait)
	}
	if a.err != nil {
		return nil, a.err
	}
	conn, _ := c.current()
	if conn == nil {
		return nil, fmt.Errorf("%w: connection lost", rpc.ErrUnavailable)
	}
	return conn, nil
}

// connect runs one connection attempt: it reaches the embedded server, starting it if none
// runs (see embedded.EnsureRunning, which gives up at once on a server that holds the lock but
// does not answer), and learns its tiers. On failure reads go to the source for a back-off
// that doubles while the server stays unusable.
func (c *Client) connect(a *connectAttempt) {
	c.counts.connects.Add(1)
	conn, err := c.dial()
	c.mu.Lock()
	if err == nil && c.closed.Load() {
		conn.rpc.Close()
		routing.CloseDirs(conn.dirs)
		err = core.ErrClosed
	}
	if err == nil {
		c.conn, c.downUntil, c.backoff = conn, time.Time{}, 0
		c.tellState(true, 0)
		if old := c.view.Swap(conn); old != nil {
			routing.CloseDirs(old.dirs) // safe while readers use them: a closed directory gives misses
		}
	} else {
		c.backoff = min(max(2*c.backoff, minBackoff), maxBackoff)
		c.downUntil = time.Now().Add(c.backoff)
		c.log.Warn("fitcache server unavailable; reading from the source", "err", err, "retry_in", c.backoff)
		c.tellState(false, c.backoff)
	}
	a.err = err
	c.attempt = nil
	c.mu.Unlock()
	close(a.done)
}

// dial connects to the embedded server, starting it if needed.
func (c *Client) dial() (*serverConn, error) {
	if err := embedded.CheckSocket(c.cfg.RuntimeDir); err != nil {
		return nil, fmt.Errorf("%w: %w", rpc.ErrUnavailable, err)
	}
	server, err := rpc.Dial(embedded.SocketPath(c.cfg.RuntimeDir), rpc.ClientConfig{Job: c.cfg.Job, ReadTimeout: c.cfg.ReadTimeout,
		CallTimeout: min(2*time.Second, c.cfg.ReadTimeout)})
	if err != nil {
		return nil, err
	}
	var hello *fitcachepb.HelloReply
	ping := func(ctx context.Context) error {
		var err error
		hello, err = server.Hello(ctx)
		return err
	}
	if err := embedded.EnsureRunning(context.Background(), c.cfg, ping); err != nil {
		server.Close()
		return nil, fmt.Errorf("%w: %w", rpc.ErrUnavailable, err)
	}
	session := routing.SessionOf(hello)
	return &serverConn{rpc: server, dirs: routing.TierDirs(hello.Tiers, session, c.log), session: session,
		blockBytes: hello.BlockBytes, readerFills: hello.ReaderFills}, nil
}

// MarkUnavailable tells the client that its server did not answer a caller that went around
// it (the node socket of the C hit path): reads go to the source for a back-off, as after a
// failed connection, instead of waiting for the server once more.
func (c *Client) MarkUnavailable() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Now().Before(c.downUntil) {
		return
	}
	c.backoff = min(max(2*c.backoff, minBackoff), maxBackoff)
	c.downUntil = time.Now().Add(c.backoff)
	c.log.Warn("fitcache server did not answer; reading from the source", "retry_in", c.backoff)
	c.tellState(false, c.backoff)
}

// CheckServer makes sure the embedded server answers: it asks the current one, and on no
// answer connects anew as a read would, starting a server (a dead one is restarted; one
// backing off after a failure is left alone). Readers forked from this process, which cannot
// run Go, then find it running. Cluster clients have nothing to check here (nil).
func (c *Client) CheckServer() error {
	if c.node != nil || c.cluster != nil {
		return nil
	}
	conn, down := c.current()
	if conn != nil && !down {
		ctx, cancel := context.WithTimeout(context.Background(), nodesock.ProbeTimeout)
		_, err := conn.rpc.Hello(ctx)
		cancel()
		if err == nil {
			return nil
		}
	}
	_, err := c.ensureConn(conn, c.cfg.StartTimeout+c.cfg.ReadTimeout)
	return err
}

// SetOnServerState gives the client a function to call whenever it connects to its server
// (up) and whenever it decides to read without it for a while (it could not reach or start
// it, or the server did not answer), with the back-off, so that callers going around the
// client (the C hit path's node socket) use the server exactly when the client does. It is
// called at once with the current state.
func (c *Client) SetOnServerState(f func(up bool, backoff time.Duration)) {
	c.onState.Store(&f)
	c.mu.Lock()
	up, left := c.conn != nil, time.Until(c.downUntil)
	c.mu.Unlock()
	f(up && left <= 0, max(left, 0))
}

// tellState calls the SetOnServerState function, if any.
func (c *Client) tellState(up bool, backoff time.Duration) {
	if f := c.onState.Load(); f != nil {
		(*f)(up, backoff)
	}
}

// ServerUp reports whether the client is connected to its embedded server and not backing
// off from it: whether a process started now should ask that server for its misses. It is
// false in cluster mode.
func (c *Client) ServerUp() bool {
	conn, down := c.current()
	return c.cluster == nil && conn != nil && !down
}

// NodeSocket returns the node socket (see package nodesock) where C code on this node
// without Go asks for the files it misses: the embedded server's or, in cluster mode, that
// of the first live server on this node (by address) that announced one in its hello, which
// answers opens for every file of the job (see server/readers.go); "" when there is none.
func (c *Client) NodeSocket() string {
	if c.node != nil {
		return c.node.socket()
	}
	if c.cluster != nil {
		return c.cluster.NodeSocket()
	}
	return nodesock.PathFor(embedded.SocketPath(c.cfg.RuntimeDir))
}
