package rpc

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/cloudwego/gopkg/protocol/thrift"
	"github.com/cloudwego/kitex/pkg/remote"
	"github.com/cloudwego/kitex/pkg/remote/codec"
	"github.com/cloudwego/kitex/pkg/remote/codec/perrors"
	"github.com/cloudwego/kitex/transport"

	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// DefaultMaxFrameBytes is the largest Thrift frame a server or client with a job token
// accepts unless configured otherwise: a request or reply larger than this fails (a file
// larger than this cannot travel as bytes in one reply).
const DefaultMaxFrameBytes = 64 << 20

// errUnframed reports a request without a length prefix, whose size cannot be checked
// before it is read.
var errUnframed = errors.New("fitcache: unframed requests are refused")

// framedCodec is Kitex's default codec with a frame-size limit (0: none) that also refuses
// messages that do not announce their size (Thrift "buffered" transport, no TTHeader or
// frame), and that checks every frame before it is decoded (checkFrame): Kitex checks the
// limit against the announced size before reading the body, but a message without one could
// make the decoder buffer a field of any length, and the generated decoders allocate what a
// container claims before reading it. Servers and clients use it whether they have a job
// token or not.
//
// Over this package's transport, the bytes of files skip the copies a codec makes: a Read
// reply's data (and a Store request's) is written to the socket from where it is (see
// encodeBulk), and a Read reply's data is read from the socket into the buffer it is
// returned in (see decodeRead).
type framedCodec struct {
	inner interface {
		remote.Codec
		remote.MetaDecoder
	}
	max int // the frame-size limit, 0 for none
}

func newFramedCodec(maxBytes int) framedCodec {
	return framedCodec{max: maxBytes, inner: codec.NewDefaultCodecWithSizeLimit(maxBytes).(interface {
		remote.Codec
		remote.MetaDecoder
	})}
}

// bulkMin is the smallest field sent without a copy (Kitex's own threshold for no-copy
// writes of binary fields).
const bulkMin = 4 << 10

// Encode implements remote.Codec.
func (c framedCodec) Encode(ctx context.Context, msg remote.Message, out remote.ByteBuffer) error {
	b, ok := out.(*buffer)
	if !ok {
		return c.inner.Encode(ctx, msg, out)
	}
	ok = msg.RPCInfo().Config().TransportProtocol() == transport.Framed
	if r, batch := msg.Data().(*fitcachepb.FitCacheReadBatchResult); batch && b.req != nil && b.req.batch != nil {
		if !ok || msg.MessageType() != remote.Reply || r.Success == nil {
			return errors.New("fitcache: a ReadBatch reply's data can only be sent over a Framed transport")
		}
		return c.encodeBatch(msg, b)
	}
	if bulk := bulkOf(msg); ok && len(bulk) >= bulkMin {
		return c.encodeBulk(msg, b)
	}
	return c.inner.Encode(ctx, msg, out)
}

// bulkOf returns the file's bytes that msg carries: a server's Read reply's, a client's
// Store request's; nil for other messages.
func bulkOf(msg remote.Message) []byte {
	switch d := msg.Data().(type) {
	case *fitcachepb.FitCacheReadResult:
		if msg.RPCRole() == remote.Server && msg.MessageType() == remote.Reply && d.Success != nil {
			return d.Success.Data
		}
	case *fitcachepb.FitCacheStoreArgs:
		if msg.RPCRole() == remote.Client && msg.MessageType() == remote.Call && d.Req != nil {
			return d.Req.Data
		}
	}
	return nil
}

// encodeBulk writes msg as Kitex would (a Framed transport frame: its size, then the Thrift
// binary message the generated code writes), but its binary fields of bulkMin bytes or more,
// which Kitex's codec copies into the frame, are handed to the connection's writer as they
// are: the generated code leaves them out of the bytes it writes (a no-copy write, see
// splitter), and they are written where they belong. A server's reply sends them from the
// file they came from when the handler said so (see request.sendFrom).
func (c framedCodec) encodeBulk(msg remote.Message, out *buffer) error {
	inv := msg.RPCInfo().Invocation()
	body, ok := msg.Data().(thrift.FastCodec)
	if !ok {
		return fmt.Errorf("rpc: no fast codec for %T", msg.Data())
	}
	method := inv.MethodName()
	size := thrift.Binary.MessageBeginLength(method) + body.BLength()
	if c.max > 0 && size > c.max {
		return perrors.NewProtocolErrorWithType(perrors.InvalidData,
			fmt.Sprintf("invalid data: payload size(%d) larger than the limit(%d)", size, c.max))
	}
	// The frame without the bulk: the generated code writes every field but the bulk into
	// it, and no more bytes than this.
	head := make([]byte, 4+size-len(bulkOf(msg)))
	binary.BigEndian.PutUint32(head, uint32(size))
	n := 4 + thrift.Binary.WriteMessageBegin(head[4:], method, thrift.TMessageType(msg.MessageType()), inv.SeqID())
	s := splitter{size: len(head)}
	n += body.FastWriteNocopy(head[n:], &s)
	at, sent := 0, n
	for _, d := range s.direct {
		if _, err := out.WriteBinary(head[at:d.at]); err != nil {
			return err
		}
		if err := out.writeBulk(d.b); err != nil {
			return err
		}
		at, sent = d.at, sent+len(d.b)
	}
	if sent != 4+size || at > n {
		return fmt.Errorf("rpc: encoding %s wrote %d bytes, want %d", method, sent, 4+size)
	}
	_, err := out.WriteBinary(head[at:n])
	return err
}

// encodeBatch writes a ReadBatch reply as Kitex would, with its data (field 7, left unset in
// the reply: the files' bytes, in out.req.batch) as the reply's last field: the client reads
// every other field before the bytes (see decodeRead). The bytes are written as encodeBulk
// writes a Read reply's.
func (c framedCodec) encodeBatch(msg remote.Message, out *buffer) error {
	inv := msg.RPCInfo().Invocation()
	body := msg.Data().(*fitcachepb.FitCacheReadBatchResult)
	method := inv.MethodName()
	total := 0
	for _, p := range out.req.batch {
		total += p.n
	}
	data := thrift.Binary.FieldBeginLength() + thrift.Binary.BinaryLengthNocopy(nil) // its header and length
	size := thrift.Binary.MessageBeginLength(method) + body.BLength() + data + total
	if c.max > 0 && size > c.max {
		return perrors.NewProtocolErrorWithType(perrors.InvalidData,
			fmt.Sprintf("invalid data: payload size(%d) larger than the limit(%d)", size, c.max))
	}
	head := make([]byte, 4+size-total)
	binary.BigEndian.PutUint32(head, uint32(size))
	n := 4 + thrift.Binary.WriteMessageBegin(head[4:], method, thrift.TMessageType(msg.MessageType()), inv.SeqID())
	n += body.FastWriteNocopy(head[n:], nil)
	// The result ends with the reply's STOP and its own: the data goes before them.
	if n < 2 || head[n-2] != byte(thrift.STOP) || head[n-1] != byte(thrift.STOP) || n+data != len(head) {
		return fmt.Errorf("rpc: encoding %s: the result does not end as expected", method)
	}
	stops := [2]byte{head[n-2], head[n-1]}
	n -= 2
	n += thrift.Binary.WriteFieldBegin(head[n:], thrift.STRING, 7)
	binary.BigEndian.PutUint32(head[n:], uint32(total))
	if _, err := out.WriteBinary(head[:n+4]); err != nil {
		return err
	}
	for _, p := range out.req.batch {
		if err := out.writePart(p); err != nil {
			return err
		}
	}
	_, err := out.WriteBinary(stops[:])
	return err
}

// splitter is the no-copy writer (thrift.NocopyWriter) given to the generated code's
// FastWriteNocopy, which passes it the binary and string fields of 4 KiB or more instead of
// writing them into the frame.
type splitter struct {
	size   int // of the buffer given to FastWriteNocopy, counted from the frame's start
	direct []directBytes
}

// directBytes are bytes written without a copy, at offset at of the frame written.
type directBytes struct {
	at int
	b  []byte
}

// WriteDirect implements thrift.NocopyWriter: b goes before the bytes that the remainCap
// bytes left in the buffer will hold.
func (s *splitter) WriteDirect(b []byte, remainCap int) error {
	s.direct = append(s.direct, directBytes{at: s.size - remainCap, b: b})
	return nil
}

// Decode implements remote.Codec.
func (c framedCodec) Decode(ctx context.Context, msg remote.Message, in remote.ByteBuffer) error {
	if err := c.DecodeMeta(ctx, msg, in); err != nil {
		return err
	}
	return c.DecodePayload(ctx, msg, in)
}

// DecodeMeta implements remote.MetaDecoder: the header, the announced size and its limit.
func (c framedCodec) DecodeMeta(ctx context.Context, msg remote.Message, in remote.ByteBuffer) error {
	if err := c.inner.DecodeMeta(ctx, msg, in); err != nil {
		return err
	}
	if msg.PayloadLen() <= 0 {
		return errUnframed
	}
	return nil
}

// DecodePayload implements remote.MetaDecoder: the frame is checked (checkFrame), then
// decoded. A frame refused is a protocol error: a server closes the connection, a client's
// call fails. A client reads a Read reply's data into its buffer (see decodeRead).
func (c framedCodec) DecodePayload(ctx context.Context, msg remote.Message, in remote.ByteBuffer) error {
	if b, ok := in.(*buffer); ok && msg.RPCRole() == remote.Client {
		if field := dataField(msg); field != 0 {
			if done, err := c.decodeRead(ctx, msg, b, field); done {
				return err
			}
		}
	}
	frame, err := in.Peek(msg.PayloadLen())
	if err != nil {
		return perrors.NewProtocolErrorWithErrMsg(err, "fitcache: reading a frame: "+err.Error())
	}
	if err := checkFrame(frame); err != nil {
		return perrors.NewProtocolErrorWithType(perrors.InvalidData, err.Error())
	}
	return c.inner.DecodePayload(ctx, msg, in)
}

// Name implements remote.Codec.
func (c framedCodec) Name() string { return "fitcache-framed" }

// readWindow is how much of a Read reply is looked at for its data's place before the data
// is read: the fields before it (errno, size, times, checksum, inode, message) take a few
// hundred bytes.
const readWindow = 4 << 10

// firstReadWindow is the window looked at first: it holds the fields before a Read reply's
// data but for a long message.
const firstReadWindow = 512

// dataField returns the field of the reply struct that holds the files' bytes in the reply
// msg a client awaits (Read: data, 5; ReadBatch: data, 7), or 0 for other replies.
func dataField(msg remote.Message) uint16 {
	switch msg.Data().(type) {
	case *fitcachepb.FitCacheReadResult:
		return 5
	case *fitcachepb.FitCacheReadBatchResult:
		return batchDataField
	}
	return 0
}

// batchDataField is the field of a ReadBatch reply that holds its files' bytes.
const batchDataField = 7

// decodeRead decodes a Read or ReadBatch reply on a client, its data (the binary field of
// the reply struct given) straight from the socket into the buffer of the call, or a
// batch's files into the call's pipes (see bulkDest): the frame's other bytes are set aside, checked as any frame (checkFrame, with
// the data's length as 0) and decoded by Kitex's codec. It reads nothing and reports false
// when the data does not start within readWindow bytes (the caller decodes the frame as any
// other).
func (c framedCodec) decodeRead(ctx context.Context, msg remote.Message, in *buffer, field uint16) (bool, error) {
	size := msg.PayloadLen()
	dest := bulkDestOf(ctx)
	// The fields before the data are looked at in a small window first, a larger one only
	// when they do not fit in it: what is peeked at beyond them is data read into the
	// connection's buffer, which is copied a second time (see replyReadAhead).
	var at, n int
	ok := false
	for _, w := range []int{firstReadWindow, readWindow} {
		win, err := in.Peek(min(size, w+dest.window))
		if err != nil {
			return true, perrors.NewProtocolErrorWithErrMsg(err, "fitcache: reading a frame: "+err.Error())
		}
		if at, n, ok = findData(win, msg.RPCInfo().Invocation().MethodName(), field); ok || len(win) == size {
			break
		}
	}
	if !ok {
		return false, nil
	}
	if n < 0 || n > size-at {
		return true, perrors.NewProtocolErrorWithType(perrors.InvalidData,
			fmt.Sprintf("%v: data of %d bytes at offset %d of a frame of %d", errBadFrame, n, at, size))
	}
	head, err := in.Next(at)
	if err != nil {
		return true, perrors.NewProtocolErrorWithErrMsg(err, "fitcache: reading a frame: "+err.Error())
	}
	frame := make([]byte, at, size-n)
	copy(frame, head)
	binary.BigEndian.PutUint32(frame[at-4:], 0)
	var data []byte
	if dest.sink != nil && field == batchDataField && in.c.sock != nil {
		data, err = dest.sink.read(in, frame, n, dest)
	} else {
		data = dest.take(n)
		err = in.readDirect(data)
		dest.give()
	}
	if err != nil {
		return true, perrors.NewProtocolErrorWithErrMsg(err, "fitcache: reading a file's bytes: "+err.Error())
	}
	tail, err := in.Next(size - at - n)
	if err != nil {
		return true, perrors.NewProtocolErrorWithErrMsg(err, "fitcache: reading a frame: "+err.Error())
	}
	frame = append(frame, tail...)
	if err := checkFrame(frame); err != nil {
		return true, perrors.NewProtocolErrorWithType(perrors.InvalidData, err.Error())
	}
	msg.SetPayloadLen(len(frame))
	in.setReplay(frame)
	if err := c.inner.DecodePayload(ctx, msg, in); err != nil {
		return true, err
	}
	switch r := msg.Data().(type) {
	case *fitcachepb.FitCacheReadResult:
		if r.Success != nil {
			r.Success.Data = data
		}
	case *fitcachepb.FitCacheReadBatchResult:
		if r.Success != nil {
			r.Success.Data = data
		}
	}
	return true, nil
}

// findData returns where the data of a reply starts in b, the first bytes of its frame, and
// its length as the frame says, if b holds them: a strict binary REPLY message to method
// whose result's success (field 0) has a binary field of id field.
func findData(b []byte, method string, field uint16) (at, n int, ok bool) {
	c := &frameCheck{b: b}
	v, err := c.u32()
	if err != nil || v != 0x80010000|uint32(thrift.REPLY) {
		return 0, 0, false
	}
	name, err := c.u32()
	if err != nil || name != uint32(len(method)) {
		return 0, 0, false
	}
	if p, err := c.take(int(name)); err != nil || string(p) != method {
		return 0, 0, false
	}
	if _, err := c.take(4); err != nil { // sequence id
		return 0, 0, false
	}
	for _, want := range []struct {
		tt thrift.TType
		id uint16
	}{{thrift.STRUCT, 0}, {thrift.STRING, field}} { // the result's success, then its data
		for {
			h, err := c.take(3)
			if err != nil || thrift.TType(h[0]) == thrift.STOP {
				return 0, 0, false
			}
			if thrift.TType(h[0]) == want.tt && binary.BigEndian.Uint16(h[1:]) == want.id {
				break
			}
			if err := c.value(thrift.TType(h[0]), nil, 1); err != nil {
				return 0, 0, false
			}
		}
	}
	l, err := c.u32()
	if err != nil {
		return 0, 0, false
	}
	return c.off, int(int32(l)), true
}

// bulkDestKey is the context key of a call's bulkDest.
type bulkDestKey struct{}

// bulkDest is where a Read call wants the file's bytes: in the caller's buffer, when they
// fit, else in a new one; for a ReadBatch with a sink, the files that fit in pipes in pipes
// (see PipeSink). The buffer (and the sink) is lent to one decode at a time, and the caller
// takes it back (abandon) once no decode writes to it: calls run in the caller's goroutine (see
// Client.call), so a decode has ended when its call returns, and should Kitex ever leave
// one running past its call (as it did with an RPC timeout of its own), abandon waits for it
// (the connection's deadline ends it).
type bulkDest struct {
	window int        // bytes to look at for the data's place beyond readWindow (a batch's replies)
	sink   *PipeSink  // where a batch's files go into pipes, if not nil
	mu     sync.Mutex // protects state and done
	buf    []byte
	state  int           // destFree, destLent, destDone
	done   chan struct{} // closed when a lent buffer is given back
}

const (
	destFree = iota // buf may be lent
	destLent        // a decode holds buf
	destDone        // buf is not to be lent (the decode gave it back, or the caller took it)
)

func newBulkDest(buf []byte) *bulkDest { return &bulkDest{buf: buf} }

// bulkDestOf returns the bulkDest of a call, or one that allocates.
func bulkDestOf(ctx context.Context) *bulkDest {
	if d, ok := ctx.Value(bulkDestKey{}).(*bulkDest); ok {
		return d
	}
	return &bulkDest{state: destDone}
}

// lendAll lends the call's sink and buffer (which may be too small, or nil) to one decode, as
// take lends the buffer; false once the caller took them back (abandon): the decode then
// uses neither. give ends the loan.
func (d *bulkDest) lendAll() ([]byte, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.state != destFree {
		return nil, false
	}
	d.state, d.done = destLent, make(chan struct{})
	return d.buf, true
}

// take returns a buffer of n bytes: the caller's if it is free and large enough.
func (d *bulkDest) take(n int) []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.state != destFree || cap(d.buf) < n {
		return make([]byte, n)
	}
	d.state, d.done = destLent, make(chan struct{})
	return d.buf[:n]
}

// give ends what take began: the bytes are in the buffer, or will never be.
func (d *bulkDest) give() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.state == destLent {
		d.state = destDone
		close(d.done)
	}
}

// abandon takes the caller's buffer back: no decode writes to it once abandon returns.
func (d *bulkDest) abandon() {
	d.mu.Lock()
	lent := d.state == destLent
	if !lent {
		d.state = destDone
	}
	d.mu.Unlock()
	if lent {
		<-d.done
	}
}
