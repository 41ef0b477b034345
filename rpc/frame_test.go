package rpc

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cloudwego/gopkg/protocol/thrift"
	"github.com/cloudwego/kitex/pkg/remote"
	"github.com/cloudwego/kitex/pkg/rpcinfo"
	"github.com/cloudwego/kitex/pkg/serviceinfo"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb/fitcache"
)

// frame returns a framed Thrift binary message: length prefix, message header, body.
func frame(name string, mt thrift.TMessageType, seq int32, body []byte) []byte {
	payload := thrift.Binary.AppendMessageBegin(nil, name, mt, seq)
	payload = append(payload, body...)
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(payload))), payload...)
}

// encode returns the binary encoding of a generated struct.
func encode(v thrift.FastCodec) []byte {
	b := make([]byte, v.BLength())
	v.FastWriteNocopy(b, nil)
	return b
}

// fill sets every field of the generated struct v points to (recursively): strings "xy",
// numbers 1, binaries of 3 bytes, lists of 2 elements and maps of 2 entries.
func fill(v reflect.Value) {
	switch v.Kind() {
	case reflect.Pointer:
		if v.IsNil() {
			v.Set(reflect.New(v.Type().Elem()))
		}
		fill(v.Elem())
	case reflect.Struct:
		for i := 0; i < v.NumField(); i++ {
			if v.Type().Field(i).IsExported() {
				fill(v.Field(i))
			}
		}
	case reflect.String:
		v.SetString("xy")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(1)
	case reflect.Slice:
		if v.Type().Elem().Kind() == reflect.Uint8 {
			v.SetBytes([]byte{1, 2, 3})
			return
		}
		s := reflect.MakeSlice(v.Type(), 2, 2)
		for i := 0; i < 2; i++ {
			fill(s.Index(i))
		}
		v.Set(s)
	case reflect.Map:
		m := reflect.MakeMap(v.Type())
		for _, k := range []string{"a", "b"} {
			e := reflect.New(v.Type().Elem()).Elem()
			fill(e)
			m.SetMapIndex(reflect.ValueOf(k), e)
		}
		v.Set(m)
	}
}

// methodNames are the service's methods, sorted.
func methodNames() []string {
	var names []string
	for name := range fitcache.NewServiceInfo().Methods {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// fullMessages returns, for every method, a framed call with every field of its request set
// and a framed reply with every field of its reply set, with sequence id 1.
func fullMessages() (calls, replies map[string][]byte) {
	calls, replies = map[string][]byte{}, map[string][]byte{}
	for name, m := range fitcache.NewServiceInfo().Methods {
		args, result := m.NewArgs(), m.NewResult()
		fill(reflect.ValueOf(args))
		fill(reflect.ValueOf(result))
		calls[name] = frame(name, thrift.CALL, 1, encode(args.(thrift.FastCodec)))
		replies[name] = frame(name, thrift.REPLY, 1, encode(result.(thrift.FastCodec)))
	}
	return calls, replies
}

// Hostile frames, each a framed message whose request or reply claims more than it holds.
var (
	// A Read call whose request's dead list claims 2^31-1 strings: 31 bytes in all. Kitex's
	// generated decoder allocated 32 GiB for it: a fatal out-of-memory error.
	hugeListCall = frame("Read", thrift.CALL, 1, []byte{12, 0, 1, 15, 0, 6, 11, 0x7f, 0xff, 0xff, 0xff})
	// A Hello reply whose tiers claim 2^31-1 structs (80 GiB for the generated decoder).
	hugeListReply = frame("Hello", thrift.REPLY, 1, []byte{12, 0, 0, 15, 0, 5, 12, 0x7f, 0xff, 0xff, 0xff})
	// A HitReport whose map claims 2^31-1 entries.
	hugeMapCall = frame("ReportHits", thrift.CALL, 1, []byte{12, 0, 1, 13, 0, 2, 11, 10, 0x7f, 0xff, 0xff, 0xff})
	// A Read call whose root claims 2 GiB.
	hugeStringCall = frame("Read", thrift.CALL, 1, []byte{12, 0, 1, 11, 0, 2, 0x7f, 0xff, 0xff, 0xff})
)

func TestCheckFrameAcceptsEveryMessageOfTheIDL(t *testing.T) {
	calls, replies := fullMessages()
	if len(calls) < 9 {
		t.Fatalf("%d methods, want at least 9", len(calls))
	}
	for name := range calls {
		for kind, f := range map[string][]byte{"call": calls[name], "reply": replies[name]} {
			if err := checkFrame(f[4:]); err != nil {
				t.Errorf("%s %s: %v", name, kind, err)
			}
		}
	}
	exc := frame("Read", thrift.EXCEPTION, 1, encode(thrift.NewApplicationException(1, "boom")))
	if err := checkFrame(exc[4:]); err != nil {
		t.Errorf("exception: %v", err)
	}
}

func TestCheckFrameRefusesWhatDoesNotFit(t *testing.T) {
	// Field 5 of HelloReply (tiers) as a list of n empty TierInfo structs: 1 byte each on the
	// wire, 40 bytes each for the decoder.
	emptyTiers := func(n int, et byte) []byte {
		b := []byte{12, 0, 0, 15, 0, 5, et}
		b = binary.BigEndian.AppendUint32(b, uint32(n))
		for range n {
			b = append(b, 0)
		}
		return append(b, 0, 0)
	}
	nested := []byte{12, 0, 1}
	for range maxFrameDepth {
		nested = append(nested, 12, 0, 99) // unknown fields, structs within structs
	}
	for range maxFrameDepth + 1 {
		nested = append(nested, 0)
	}
	for _, tc := range []struct {
		name  string
		frame []byte
		want  string
	}{
		{"list of 2^31-1 strings", hugeListCall, "container of 2147483647 elements"},
		{"list of 2^31-1 structs", hugeListReply, "container of 2147483647 elements"},
		{"map of 2^31-1 entries", hugeMapCall, "container of 2147483647 elements"},
		{"string of 2 GiB", hugeStringCall, "bytes wanted"},
		{"negative list", frame("Read", thrift.CALL, 1, []byte{12, 0, 1, 15, 0, 6, 11, 0xff, 0xff, 0xff, 0xff, 0, 0}), "container of -1"},
		{"list of strings said to hold booleans", frame("Read", thrift.CALL, 1, []byte{12, 0, 1, 15, 0, 6, 2, 0, 0, 0, 2, 1, 1, 0, 0}), "expected"},
		{"tiers allocating 40 times their bytes", frame("Hello", thrift.REPLY, 1, emptyTiers(200_000, 12)), "would take more than"},
		{"nested too deep", frame("Read", thrift.CALL, 1, nested), "nested deeper"},
		{"unknown type", frame("Read", thrift.CALL, 1, []byte{12, 0, 1, 17, 0, 9, 0, 0}), "unknown type"},
		{"bytes after the message", frame("Stats", thrift.CALL, 1, []byte{12, 0, 1, 0, 0, 7}), "after the message"},
		{"method name of 2 GiB", append(binary.BigEndian.AppendUint32(nil, 0x80010001), 0x7f, 0xff, 0xff, 0xff), "method name"},
		{"not strict", append(binary.BigEndian.AppendUint32(nil, 4), "Read"...), "not a strict"},
		// Found by FuzzDecodeReply: gopkg's exception decoder panicked on the unknown field.
		{"exception with another field", frame("Read", thrift.EXCEPTION, 1, []byte{12, 0x30, 0x30, 0, 0}), "where none is expected"},
	} {
		f := tc.frame
		if binary.BigEndian.Uint32(f) == uint32(len(f)-4) {
			f = f[4:] // the payload
		}
		err := checkFrame(f)
		if !errors.Is(err, errBadFrame) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
	// Just within the budget: the same tiers list, small enough.
	if err := checkFrame(frame("Hello", thrift.REPLY, 1, emptyTiers(1000, 12))[4:]); err != nil {
		t.Errorf("1000 empty tiers: %v", err)
	}
}

// svcSearcher finds the FitCache service for a server-side decode.
type svcSearcher struct{ svc *serviceinfo.ServiceInfo }

func (s svcSearcher) SearchService(svcName, methodName string, strict bool, codecType serviceinfo.PayloadCodec) *serviceinfo.ServiceInfo {
	return s.svc
}

var fuzzService = fitcache.NewServiceInfo()

// decodeRequest decodes a framed request as a server does, through framedCodec.
func decodeRequest(f []byte) error {
	ctx := remote.WithServiceSearcher(context.Background(), svcSearcher{fuzzService})
	ri := rpcinfo.NewRPCInfo(rpcinfo.EmptyEndpointInfo(), rpcinfo.EmptyEndpointInfo(), rpcinfo.NewServerInvocation(),
		rpcinfo.NewRPCConfig(), rpcinfo.NewRPCStats())
	msg := remote.NewMessage(nil, ri, remote.Call, remote.Server)
	return newFramedCodec(DefaultMaxFrameBytes).Decode(ctx, msg, remote.NewReaderBuffer(f))
}

// decodeReply decodes a framed reply to a call of method with sequence id 1 as a client
// does, through framedCodec.
func decodeReply(method string, f []byte) error {
	m := fuzzService.Methods[method]
	ink := rpcinfo.NewInvocation("FitCache", method)
	ink.SetSeqID(1)
	ink.SetMethodInfo(m)
	ri := rpcinfo.NewRPCInfo(rpcinfo.EmptyEndpointInfo(), rpcinfo.EmptyEndpointInfo(), ink, rpcinfo.NewRPCConfig(),
		rpcinfo.NewRPCStats())
	msg := remote.NewMessage(m.NewResult(), ri, remote.Reply, remote.Client)
	return newFramedCodec(DefaultMaxFrameBytes).Decode(context.Background(), msg, remote.NewReaderBuffer(f))
}

// allocated returns the bytes f allocated.
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// decodeBound is the most a decode of a frame of n bytes may allocate: checkFrame's budget
// for containers, the strings and binaries (n), Kitex's own buffers and some slack.
func decodeBound(n int) uint64 { return uint64(allocBudget(n) + 4*n + 4<<20) }

func TestHostileFramesAreRefusedByBothDecoders(t *testing.T) {
	for name, f := range map[string][]byte{"list": hugeListCall, "map": hugeMapCall, "string": hugeStringCall} {
		if err := decodeRequest(f); err == nil || !strings.Contains(err.Error(), "malformed frame") {
			t.Errorf("request with a huge %s: got %v, want a malformed frame", name, err)
		}
	}
	if err := decodeReply("Hello", hugeListReply); err == nil || !strings.Contains(err.Error(), "malformed frame") {
		t.Errorf("reply with a huge list: got %v, want a malformed frame", err)
	}
	calls, replies := fullMessages()
	for name := range calls {
		if err := decodeRequest(calls[name]); err != nil {
			t.Errorf("%s call: %v", name, err)
		}
		if err := decodeReply(name, replies[name]); err != nil {
			t.Errorf("%s reply: %v", name, err)
		}
	}
}

// FuzzDecodeRequest feeds frames to a server's decoding of requests: whatever the frame, the
// decode allocates no more than decodeBound and does not crash.
func FuzzDecodeRequest(f *testing.F) {
	calls, replies := fullMessages()
	for _, name := range methodNames() {
		f.Add(calls[name])
		f.Add(replies[name])
	}
	for _, b := range [][]byte{hugeListCall, hugeMapCall, hugeStringCall, hugeListReply} {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var err error
		if n := allocated(func() { err = decodeRequest(b) }); n > decodeBound(len(b)) {
			t.Fatalf("decoding a request of %d bytes allocated %d bytes (%v)", len(b), n, err)
		}
	})
}

// FuzzDecodeReply feeds frames to a client's decoding of replies (the first byte picks the
// method called): whatever the frame, the decode allocates no more than decodeBound and
// does not crash.
func FuzzDecodeReply(f *testing.F) {
	names := methodNames()
	calls, replies := fullMessages()
	for i, name := range names {
		f.Add(append([]byte{byte(i)}, replies[name]...))
		f.Add(append([]byte{byte(i)}, calls[name]...))
	}
	f.Add(append([]byte{byte(slices.Index(names, "Hello"))}, hugeListReply...))
	f.Add(append([]byte{byte(slices.Index(names, "Read"))}, hugeListCall...))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) == 0 {
			return
		}
		method := names[int(b[0])%len(names)]
		var err error
		if n := allocated(func() { err = decodeReply(method, b[1:]) }); n > decodeBound(len(b)) {
			t.Fatalf("decoding a %s reply of %d bytes allocated %d bytes (%v)", method, len(b), n, err)
		}
	})
}

// hugeThriftCall returns the start of a Thrift "Read" call whose first string field claims
// 2 GiB: framed, the frame's length prefix claims 2 GiB too.
func hugeThriftCall(framed bool) []byte {
	var b []byte
	if framed {
		b = binary.BigEndian.AppendUint32(b, 1<<31-1)
	}
	b = binary.BigEndian.AppendUint32(b, 0x80010001) // binary protocol version 1, CALL
	b = binary.BigEndian.AppendUint32(b, 4)
	b = append(b, "Read"...)
	b = binary.BigEndian.AppendUint32(b, 1)       // sequence id
	b = append(b, 12, 0, 1)                       // field 1: struct ReadRequest
	b = append(b, 11, 0, 1)                       // field 1: string token
	b = binary.BigEndian.AppendUint32(b, 1<<31-1) // of 2 GiB
	return b
}

func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// TestHugeRequestIsRefusedBeforeItsBody: a request claiming 2 GiB, sent by clients with and
// without the job token, gets its connection closed at once and costs the server no memory.
func TestHugeRequestIsRefusedBeforeItsBody(t *testing.T) {
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken})
	for _, tc := range []struct {
		name         string
		token        string // "" makes no handshake
		framed, acks bool
	}{
		{"no handshake, framed", "", true, false},
		{"no handshake, unframed", "", false, false},
		{"wrong token", "guess", true, false},
		{"job token, framed", testToken, true, true},
		{"job token, unframed", testToken, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := heapInUse()
			var wg sync.WaitGroup
			for range 3 {
				c := dialRaw(t, addr)
				if tc.token != "" {
					if got := authenticate(t, c, tc.token) == nil; got != tc.acks {
						t.Fatalf("handshake passed: %v, want %v", got, tc.acks)
					}
				}
				wg.Add(1)
				go func() { // the body, until the server closes the connection
					defer wg.Done()
					c.SetWriteDeadline(time.Now().Add(10 * time.Second))
					c.Write(hugeThriftCall(tc.framed))
					chunk := make([]byte, 1<<20)
					for range 64 {
						if _, err := c.Write(chunk); err != nil {
							return
						}
					}
				}()
				if !closedWithin(c, 5*time.Second) {
					t.Errorf("connection still open 5s after a 2 GiB request")
				}
				c.Close()
			}
			wg.Wait()
			if grown := int64(heapInUse()) - int64(before); grown > 32<<20 {
				t.Errorf("server heap grew by %d MiB", grown>>20)
			}
		})
	}
}

// TestHugeListFrameLeavesTheServerUp: a request whose list claims 2^31-1 strings, sent after
// the handshake, closes that connection and nothing else; the server serves on. In a build without it, the generated decoder allocated 32 GiB for it and the server died
// of a fatal out-of-memory error.
func TestHugeListFrameLeavesTheServerUp(t *testing.T) {
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken})
	root := t.TempDir()
	path := filepath.Join(root, "f")
	os.WriteFile(path, []byte("still here"), 0o644)
	for _, f := range [][]byte{hugeListCall, hugeMapCall} {
		c := dialRaw(t, addr)
		if err := authenticate(t, c, testToken); err != nil {
			t.Fatal(err)
		}
		c.Write(f)
		if !closedWithin(c, 5*time.Second) {
			t.Errorf("connection still open after a %d-byte frame claiming 2^31-1 elements", len(f))
		}
	}
	cl, _ := Dial(addr, ClientConfig{Token: testToken})
	defer cl.Close()
	if r, err := cl.Read(context.Background(), root, path, false); err != nil || string(r.Data) != "still here" {
		t.Errorf("read after the hostile frames: %v", err)
	}
}

// TestHugeListFrameLeavesATokenlessServerUp: the same against the per-user server on a Unix
// socket, which has no token and decodes what its user's processes send.
func TestHugeListFrameLeavesATokenlessServerUp(t *testing.T) {
	sock := serve(t, "")
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(hugeListCall)
	if !closedWithin(c, 5*time.Second) {
		t.Error("connection still open after a frame claiming 2^31-1 strings")
	}
	cl, _ := Dial(sock, ClientConfig{})
	defer cl.Close()
	if _, err := cl.Hello(context.Background()); err != nil {
		t.Errorf("Hello after the hostile frame: %v", err)
	}
}

func TestFileLargerThanAFrameIsRefused(t *testing.T) {
	const frame = 1 << 20
	addr, _, _ := serveTCP(t, ServerConfig{Token: testToken, MaxFrameBytes: frame})
	root := t.TempDir()
	for _, tc := range []struct {
		size int
		want syscall.Errno
	}{{frame / 2, 0}, {2 * frame, syscall.EFBIG}} {
		path := filepath.Join(root, "f"+string(rune('a'+tc.size%26)))
		want := bytes.Repeat([]byte{7}, tc.size)
		os.WriteFile(path, want, 0o644)
		c, _ := Dial(addr, ClientConfig{Token: testToken})
		r, err := c.Read(context.Background(), root, path, false)
		if got := core.Errno(err); got != tc.want {
			t.Errorf("%d bytes: errno %v (%v), want %v", tc.size, got, err, tc.want)
		}
		if tc.want == 0 && !bytes.Equal(r.GetData(), want) {
			t.Errorf("%d bytes: got %d bytes back", tc.size, len(r.GetData()))
		}
		c.Close()
	}
}
