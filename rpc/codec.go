package rpc

import (
	"context"
	"errors"

	"github.com/cloudwego/kitex/pkg/remote"
	"github.com/cloudwego/kitex/pkg/remote/codec"
	"github.com/cloudwego/kitex/pkg/remote/codec/perrors"
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
type framedCodec struct {
	inner interface {
		remote.Codec
		remote.MetaDecoder
	}
}

func newFramedCodec(maxBytes int) framedCodec {
	return framedCodec{inner: codec.NewDefaultCodecWithSizeLimit(maxBytes).(interface {
		remote.Codec
		remote.MetaDecoder
	})}
}

// Encode implements remote.Codec.
func (c framedCodec) Encode(ctx context.Context, msg remote.Message, out remote.ByteBuffer) error {
	return c.inner.Encode(ctx, msg, out)
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
// call fails.
func (c framedCodec) DecodePayload(ctx context.Context, msg remote.Message, in remote.ByteBuffer) error {
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
