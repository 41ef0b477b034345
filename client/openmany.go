package client

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// Batches of the node socket (nodesock.OpOpenMany): the misses of one DataLoader batch that
// a reader on this node sends its server at once. The files other nodes own are asked of
// each owner in one ReadBatch call, so a batch costs its server a call per owner, not a call
// per file; the others are opened as OpenForReader opens them, a few at a time.

// Opened is what OpenManyForReader answers for one file: its descriptor and what it holds, or
// the bytes another node's server sent (Data, core.OriginPeer), or the file's own error.
// Release, if set, is to be called once Data is no longer used.
type Opened struct {
	File    *os.File
	Data    []byte
	Origin  core.Origin
	Err     error
	Release func()
}

// openManyWorkers is how many files of a batch that go to no other node's server are opened
// at once (as fc_read_many's Go side reads a batch's misses).
const openManyWorkers = 8

// batchBufferSize is the size of the pooled buffers ReadBatch replies are read into: a
// DataLoader batch's share of one owner (a batch of 64 files of about 100 KiB over 4
// servers); a larger reply gets a buffer of its own.
const batchBufferSize = 4 << 20

// batchBuffers hold the bytes of a ReadBatch reply while they are copied into node-local
// copies or memory files (see transferBuffers).
var batchBuffers = sync.Pool{New: func() any { b := make([]byte, batchBufferSize); return &b }}

// OpenManyForReader opens the files at paths (absolute, or relative to the root) for readers
// on this node as OpenForReader opens each, and returns one Opened per path, in order (the
// caller closes the files). A file's error is that file's only. A file of at most inlineMax
// bytes that a server on another node sends, and that this node keeps no copy of, comes as
// its bytes (Data, with its Release) rather than as a memory file that would copy them. The files that servers on
// other nodes own are asked of each owner in one ReadBatch call, all owners at once; an owner
// that does not answer is counted as failing once for its batch, and its files go as a failed
// read of each would: to the new owner once it is dead (recache), else to the source. It works
// in cluster mode only.
func (c *Client) OpenManyForReader(ctx context.Context, paths []string, inlineMax int) []Opened {
	out := make([]Opened, len(paths))
	c.life.RLock()
	defer c.life.RUnlock()
	var fail error
	switch {
	case c.closed.Load():
		fail = core.ErrClosed
	case c.cluster == nil:
		fail = fmt.Errorf("client OpenManyForReader outside cluster mode: %w", errors.ErrUnsupported)
	}
	if fail != nil {
		for i := range out {
			out[i].Err = fail
		}
		return out
	}
	resolved := make([]string, len(paths))
	owners := map[*peer][]int{} // files of servers on other nodes, by owner
	var alone []int             // the others, opened one at a time
	for i, p := range paths {
		path, err := c.Resolve(p)
		if err != nil {
			out[i].Err = err
			continue
		}
		resolved[i] = path
		if c.own != nil {
			if f, origin, ok := c.own.engine.OpenCached(c.root, path); ok {
				out[i] = Opened{File: f, Origin: origin}
				continue
			}
			if f, ok := c.openLargeNow(path); ok {
				out[i] = Opened{File: f, Origin: core.OriginSourceWhileCached}
				continue
			}
		}
		if targets := c.cluster.targets(path); len(targets) > 0 && !targets[0].local &&
			(c.own == nil || targets[0].member.ID != c.own.id) {
			owners[targets[0]] = append(owners[targets[0]], i)
			continue
		}
		alone = append(alone, i)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex // protects alone once the owners' batches run
	for p, idx := range owners {
		wg.Go(func() {
			if again := c.openBatchFromPeer(ctx, p, resolved, idx, out, inlineMax); len(again) > 0 {
				mu.Lock()
				alone = append(alone, again...)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	next := make(chan int, len(alone))
	for _, i := range alone {
		next <- i
	}
	close(next)
	for range min(len(alone), openManyWorkers) {
		wg.Go(func() {
			for i := range next {
				f, origin, err := c.openForReader(ctx, resolved[i])
				out[i] = Opened{File: f, Origin: origin, Err: err}
			}
		})
	}
	wg.Wait()
	return out
}

// openBatchFromPeer opens the files paths[i] (i in idx) that p, a server on another node,
// owns, with one ReadBatch call, into out; it returns the files to open one at a time (see
// OpenForReader): those whose bytes did not fit in the reply, and all of them when p did not
// answer and is dead now (their new owner, or the source, has them) or refused the call as a
// whole (each file then gets its own answer).
func (c *Client) openBatchFromPeer(ctx context.Context, p *peer, paths []string, idx []int, out []Opened,
	inlineMax int) (again []int) {
	var session uint32
	if c.own != nil {
		session = c.own.engine.Session()
	}
	req := &fitcachepb.ReadBatchRequest{Root: c.root, Paths: make([]string, len(idx))}
	for k, i := range idx {
		req.Paths[k] = paths[i]
	}
	version, dead, alive := p.news.Take()
	req.MembershipVersion, req.Dead, req.Alive = version, dead, alive
	// The buffer goes back to the pool once the files handed out inline from it are released.
	buf := batchBuffers.Get().(*[]byte)
	var refs atomic.Int32
	refs.Store(1)
	release := func() {
		if refs.Add(-1) == 0 {
			batchBuffers.Put(buf)
		}
	}
	defer release()
	reply, err := p.rpc.ReadBatch(ctx, req, *buf)
	if reply != nil {
		c.cluster.learn(p, reply.MembershipVersion, reply.Dead)
	}
	if errors.Is(err, rpc.ErrUnavailable) {
		for _, id := range dead { // the news did not get through: tell it next time
			p.news.Tell(id, true)
		}
		for _, id := range alive {
			p.news.Tell(id, false)
		}
		if c.cluster.failed(p, err) {
			return idx // dead: each goes to its new owner (recache) or the source (pfs)
		}
		for _, i := range idx { // not dead yet: its reads are served from the source meanwhile
			f, origin, err := c.openSource(paths[i])
			out[i] = Opened{File: f, Origin: origin, Err: err}
		}
		return nil
	}
	if err != nil {
		return idx
	}
	c.cluster.succeeded(p)
	c.counts.serverReads.Add(int64(len(idx)))
	for k, i := range idx {
		r := reply.Replies[k]
		err := core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message)
		switch {
		case err == nil:
			out[i] = c.openReplied(ctx, paths[i], r, session, inlineMax)
			if out[i].Data != nil {
				refs.Add(1)
				out[i].Release = release
			}
		case errors.Is(err, syscall.ENOBUFS): // did not fit in the reply with the others
			again = append(again, i)
		case errors.Is(err, core.ErrTooLarge): // too large for the owner to cache or send
			f, origin, err := c.openSource(paths[i])
			out[i] = Opened{File: f, Origin: origin, Err: err}
		default:
			c.counts.errors.Add(1)
			out[i].Err = err
		}
	}
	return again
}

// openReplied hands out the bytes of path that its owner on another node sent in reply r (as
// openFromPeer does): copied to the servers that hold replicas when the owner read them from
// the source, kept as a node-local copy where there is room and opened there, else as they
// are (Data) when they are inlineMax bytes or fewer, else a memory file. session is this
// client's server's session taken before the owner was asked.
func (c *Client) openReplied(ctx context.Context, path string, r *fitcachepb.ReadReply, session uint32, inlineMax int) Opened {
	if rpc.OriginOf(r) == core.OriginSource {
		if targets := c.cluster.targets(path); len(targets) > 1 {
			c.replicate(targets[1:], path, r.Data, rpc.StampOf(r))
		}
	}
	if c.own != nil && c.keepGuest(ctx, path, r, session) == nil {
		if f, d, err := openTier(anySession(c.own.engine.TierDirs()), path); err == nil {
			return Opened{File: f, Origin: core.TierOrigin(d.Kind)}
		}
	}
	if len(r.Data) <= inlineMax {
		if r.Data == nil {
			r.Data = []byte{}
		}
		return Opened{Data: r.Data, Origin: core.OriginPeer}
	}
	f, err := memFile(path, r.Data, r.MtimeNanos)
	if err != nil {
		return Opened{Err: err}
	}
	return Opened{File: f, Origin: core.OriginPeer}
}
