package rpc

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/cloudwego/kitex/client/callopt"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// ReadBatch reads several files in one call: a DataLoader batch that another node's server
// reads from this one pays one round trip, one request to decode and one reply to write
// (see the IDL). Over this package's transport the files' bytes are sent from the cached
// files after every other field of the reply (encodeBatch), and read by the client straight
// into its buffer (decodeRead).

func (t typedClient) ReadBatch(ctx context.Context, req *fitcachepb.ReadBatchRequest, opts ...callopt.Option) (*fitcachepb.ReadBatchReply, error) {
	return invoke(ctx, t, "ReadBatch", &fitcachepb.FitCacheReadBatchArgs{Req: req}, &fitcachepb.FitCacheReadBatchResult{}, opts)
}

// batchPart is one file's bytes in a ReadBatch reply: n bytes in memory (data), or, over this
// package's transport, of an open cached file (file) and its mapping, which is made only if
// the bytes cannot be sent from the file (see buffer.writePart).
type batchPart struct {
	n       int
	data    []byte
	file    *os.File
	mapping *tiers.Mapping
}

// bytes returns the part's bytes in memory, its mapping made now if it was not.
func (p batchPart) bytes() ([]byte, error) {
	if p.mapping == nil {
		return p.data, nil
	}
	if err := p.mapping.Map(); err != nil {
		return nil, err
	}
	b := p.mapping.Bytes()
	if len(b) != p.n {
		return nil, fmt.Errorf("rpc: %s: %d bytes mapped of %d", p.mapping.Path, len(b), p.n)
	}
	return b, nil
}

// batchPart returns the part of a ReadBatch reply for res. Over this package's transport a
// file in a tier stays in its cached file, to be sent from it, and res is released once the
// reply is out; otherwise its bytes are taken as replyBytes takes them.
func (h *Handler) batchPart(ctx context.Context, res core.Result) batchPart {
	r := requestOf(ctx)
	if r == nil || res.Mapping == nil {
		return batchPart{n: int(res.Size()), data: h.replyBytes(ctx, res)}
	}
	r.afterReply(res.Release) // closes its file too
	return batchPart{n: int(res.Size()), file: res.File, mapping: res.Mapping}
}

// replyOverhead bounds what a file's reply in a batch takes in the frame beside its bytes
// and its message (errno, size, origin, times, checksum, stamp and their headers).
const replyOverhead = 256

// ReadBatch serves the files of a batch, in the order asked, as Read serves each to a caller
// on another node; their bytes go together in the reply's data. A file whose bytes do not fit
// in the room the reply has left has errno ENOBUFS (the caller reads it alone), one that
// does not fit in a reply at all EFBIG.
func (h *Handler) ReadBatch(ctx context.Context, req *fitcachepb.ReadBatchRequest) (*fitcachepb.ReadBatchReply, error) {
	h.heard(req.Dead, req.Alive)
	version, dead := h.members.Since(req.MembershipVersion)
	reply := &fitcachepb.ReadBatchReply{MembershipVersion: version, Dead: dead,
		Replies: make([]*fitcachepb.ReadReply, len(req.Paths))}
	room := int64(h.cfg.MaxFrameBytes) - frameSlack - int64(len(req.Paths))*replyOverhead
	var parts []batchPart
	for i, path := range req.Paths {
		start := time.Now()
		r := &fitcachepb.ReadReply{}
		reply.Replies[i] = r
		res, err := h.read(ctx, req.Root, path, false)
		n := int(res.Size())
		switch {
		case err != nil:
		case h.tooLarge(n):
			err = h.errTooLarge(path, n)
		case h.cfg.MaxFrameBytes > 0 && int64(n) > room:
			err = core.NewErrnoError(int32(syscall.ENOBUFS), core.ReasonUnspecified, fmt.Sprintf(
				"fitcache: %s: %d bytes do not fit in the %d bytes left in the batch's reply: read it alone", path, n, max(room, 0)))
		}
		if err != nil {
			res.Release()
			r.Errno, r.Message, r.Reason = errnoOf(err)
			continue
		}
		room -= int64(n)
		r.Size, r.MtimeNanos = int64(n), res.MTimeNanos
		setOrigin(r, res.Origin)
		h.stampReply(path, res, r)
		parts = append(parts, h.batchPart(ctx, res))
		if h.cfg.OnRead != nil {
			h.cfg.OnRead(false, res.Origin, time.Since(start), int64(n))
		}
	}
	if rq := requestOf(ctx); rq != nil {
		rq.batch = parts // written after the reply's other fields (see encodeBatch)
	} else {
		reply.Data = []byte{}
		for _, p := range parts {
			reply.Data = append(reply.Data, p.data...)
		}
	}
	return reply, nil
}

// ReadBatch reads the files of req in one call, into buf when they fit in it (else into a new
// buffer): the reply has a reply per path, in order, with its errno (see core.NewErrnoError)
// or its Data, a slice of that buffer. With sink not nil, the files that fit in a pipe are
// in one instead, their Data nil: the caller takes each (sink.Take) and closes the sink
// (whatever the call returned). A file with errno ENOBUFS did not fit in the reply with the
// others: read it alone. The error is the call's (the server not reached, or the request
// refused as a whole).
func (c *Client) ReadBatch(ctx context.Context, req *fitcachepb.ReadBatchRequest, buf []byte, sink *PipeSink) (
	*fitcachepb.ReadBatchReply, error) {
	dest := newBulkDest(buf)
	dest.window = 2 * len(req.Paths) * replyOverhead // the files' replies (and messages) come before their data
	dest.sink = sink
	var r *fitcachepb.ReadBatchReply
	err := c.call(ctx, c.cfg.ReadTimeout, func(ctx context.Context) (err error) {
		r, err = c.kc.ReadBatch(context.WithValue(ctx, bulkDestKey{}, dest), req, c.target())
		return err
	})
	dest.abandon()
	if err != nil {
		return nil, c.failed(err)
	}
	if err := core.NewErrnoError(r.Errno, core.Reason(r.Reason), r.Message); err != nil {
		return r, err
	}
	if len(r.Replies) != len(req.Paths) {
		return nil, c.failed(fmt.Errorf("%w: %d replies to a batch of %d files", errBadFrame, len(r.Replies), len(req.Paths)))
	}
	at := int64(0)
	for i, f := range r.Replies {
		if f == nil || f.Errno != 0 {
			continue
		}
		if sink.Piped(i) {
			if f.Size != int64(sink.pipes[i].Len()) {
				return nil, c.failed(fmt.Errorf("%w: a file of %d bytes, %d in its pipe", errBadFrame, f.Size, sink.pipes[i].Len()))
			}
			continue
		}
		if f.Size < 0 || f.Size > int64(len(r.Data))-at {
			return nil, c.failed(fmt.Errorf("%w: the batch's data holds %d bytes, not the files' %d and more", errBadFrame,
				len(r.Data), at+f.Size))
		}
		f.Data = r.Data[at : at+f.Size : at+f.Size]
		at += f.Size
	}
	if at != int64(len(r.Data)) {
		return nil, c.failed(fmt.Errorf("%w: the batch's data holds %d bytes, the files %d", errBadFrame, len(r.Data), at))
	}
	return r, nil
}
