package rpc

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb/fitcache"
	"github.com/fitcache/fitcache/tiers"
)

func serve(t *testing.T, token string) string {
	t.Helper()
	sock, _ := serveEngine(t, token)
	return sock
}

func serveEngine(t *testing.T, token string) (string, *core.Engine) {
	t.Helper()
	e, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: "16MiB"}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, _, _ := Serve(e, ln, ServerConfig{Token: token})
	t.Cleanup(func() { srv.Stop(); e.Close() })
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm()&0o077 != 0 {
		t.Errorf("socket mode %v (%v): others must not connect", fi.Mode(), err)
	}
	return sock, e
}

// TestTokenIsRequired: a client without the token is refused by the server; one with another
// token finds that the server does not prove its token (ErrUnproven), which it takes for a
// server that is down; both are refusals for the server.
func TestTokenIsRequired(t *testing.T) {
	sock, e := serveEngine(t, "secret")
	for _, tc := range []struct {
		token        string
		ok, unproven bool
	}{{"", false, false}, {"wrong", false, true}, {"secret", true, false}} {
		c, err := Dial(sock, ClientConfig{Token: tc.token})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Hello(context.Background())
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrUnavailable)) {
			t.Errorf("token %q: %v, want success %v or else ErrUnavailable", tc.token, err, tc.ok)
		}
		if got := errors.Is(err, ErrUnproven); got != tc.unproven || got && !IsRefused(err) {
			t.Errorf("token %q: %v: unproven %v, want %v (and then refused)", tc.token, err, got, tc.unproven)
		}
		c.Close()
	}
	waitFor(t, "2 refusals", func() bool { return e.Stats().Refusals >= 2 })
	if n := e.Stats().Refusals; n != 2 {
		t.Errorf("refusals counted: %d, want 2", n)
	}
}

func TestReadRepliesWithBytesOrTierFile(t *testing.T) {
	sock := serve(t, "")
	root := t.TempDir()
	want := bytes.Repeat([]byte{1, 2, 3}, 5000)
	path := filepath.Join(root, "a.bin")
	os.WriteFile(path, want, 0o644)
	c, _ := Dial(sock, ClientConfig{})
	ctx := context.Background()

	r, err := c.Read(ctx, root, path, false)
	// The origin by name too: clients older than the enum read only that.
	if err != nil || !bytes.Equal(r.Data, want) || r.Origin != fitcachepb.Origin_SOURCE || r.OriginName != "source" {
		t.Fatalf("remote read: origin %q (%q), %d bytes, err %v", r.GetOrigin(), r.GetOriginName(), len(r.GetData()), err)
	}
	// The first read answered before the data mover published the file: wait for it.
	for i := 0; i < 500; i++ {
		if r, err = c.Read(ctx, root, path, true); err != nil || r.CachedPath != "" {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil || r.CachedPath == "" || len(r.Data) != 0 {
		t.Fatalf("local read of a cached file: origin %q, cached path %q, %d bytes, err %v",
			r.GetOrigin(), r.GetCachedPath(), len(r.GetData()), err)
	}
	d, err := tiers.OpenDir(filepath.Dir(filepath.Dir(filepath.Dir(r.CachedPath))), tiers.Memory)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	m, err := d.Open(path)
	if err != nil || !bytes.Equal(m.Bytes(), want) {
		t.Fatalf("mapping the named tier file: %v", err)
	}
	m.Release()
	r, err = c.Read(ctx, root, path, false)
	if err != nil || !bytes.Equal(r.Data, want) || r.Origin != fitcachepb.Origin_MEMORY {
		t.Errorf("remote read of a cached file: origin %q, err %v", r.GetOrigin(), err)
	}

	_, err = c.Read(ctx, root, filepath.Join(root, "missing"), false)
	if !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrUnavailable) {
		t.Errorf("missing file: got %v, want ErrNotExist from the server", err)
	}
	js, err := c.Stats(ctx)
	if err != nil || !bytes.Contains([]byte(js), []byte(`"source_reads":1`)) {
		t.Errorf("stats %s, %v", js, err)
	}
}

func TestDeadServerIsUnavailable(t *testing.T) {
	c, _ := Dial(filepath.Join(t.TempDir(), "nobody.sock"), ClientConfig{})
	if _, err := c.Hello(context.Background()); !errors.Is(err, ErrUnavailable) || !IsRefused(err) {
		t.Errorf("no server: got %v, want ErrUnavailable and refused", err)
	}
}

func TestMembership(t *testing.T) {
	var passedOn []string
	h := newHandler(nil, ServerConfig{OnReportedDead: func(id string) { passedOn = append(passedOn, id) }})
	h.heard([]string{"n2:7070", "n3:7070"}, nil)
	h.heard([]string{"n2:7070", "n4:7070"}, []string{"n3:7070"})
	version, dead := h.Membership()
	if version != 4 || !slices.Equal(dead, []string{"n2:7070", "n4:7070"}) {
		t.Errorf("got version %d, dead %v; want 4, [n2:7070 n4:7070]", version, dead)
	}
	// Every report goes on, n2's second too (the membership drops repeats).
	if !slices.Equal(passedOn, []string{"n2:7070", "n3:7070", "n2:7070", "n4:7070"}) {
		t.Errorf("deaths passed on to the membership: %v, want every one reported", passedOn)
	}
}

// TestWrongTokenRunsNothing: a client with the wrong token gets no connection, as the server
// cannot prove that it knows the client's token, and the server reads no request; every call
// fails as for a server that is down, and nothing runs.
func TestWrongTokenRunsNothing(t *testing.T) {
	sock, e := serveEngine(t, "secret")
	root := t.TempDir()
	os.WriteFile(filepath.Join(root, "a"), []byte("data"), 0o600)
	c, err := Dial(sock, ClientConfig{Token: "wrong"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	calls := map[string]func() error{
		"Hello":      func() error { _, err := c.Hello(ctx); return err },
		"Read":       func() error { _, err := c.Read(ctx, root, filepath.Join(root, "a"), true); return err },
		"ReportHits": func() error { return c.ReportHits(ctx, map[string]int64{"memory": 1}, 1) },
		"Store":      func() error { return c.Store(ctx, root, filepath.Join(root, "a"), []byte("x"), Stamp{}) },
		"Stats":      func() error { _, err := c.Stats(ctx); return err },
		"Prefetch": func() error {
			_, err := c.Prefetch(ctx, core.PrefetchRequest{Root: root, Owner: "o", Paths: []string{filepath.Join(root, "a")}})
			return err
		},
		"Usage": func() error { _, err := c.Usage(ctx); return err },
		"Clear": func() error { _, err := c.Clear(ctx, root, true); return err },
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, ErrUnproven) || !IsRefused(err) {
			t.Errorf("%s with the wrong token: %v, want ErrUnproven (refused)", name, err)
		}
	}
	waitFor(t, "every refusal to be counted", func() bool { return e.Stats().Refusals >= int64(len(calls)) })
	s := e.Stats()
	if s.Refusals != int64(len(calls)) || s.Misses != 0 || s.Stored != 0 || s.SourceReads != 0 {
		t.Errorf("after refused requests: %d refusals (want %d), %d misses, %d stored, %d source reads",
			s.Refusals, len(calls), s.Misses, s.Stored, s.SourceReads)
	}
}

// TestMiddlewareChecksEveryMethod: authenticate, in front of every handler, refuses a call
// without its request (EINVAL) with its own method's reply, and lets a call with its request
// through; requests carry no token any more (connections are authenticated). Methods are
// taken from the generated service, so a new method is tested too.
func TestMiddlewareChecksEveryMethod(t *testing.T) {
	_, e := serveEngine(t, "secret")
	h := newHandler(e, ServerConfig{Token: "secret"})
	ran := 0
	mw := h.authenticate(func(ctx context.Context, req, resp any) error { ran++; return nil })
	call := func(name string, withRequest bool) (errno int64) {
		t.Helper()
		m := fitcache.NewServiceInfo().Methods[name]
		args, result := m.NewArgs(), m.NewResult()
		if withRequest {
			req := reflect.ValueOf(args).Elem().FieldByName("Req")
			req.Set(reflect.New(req.Type().Elem()))
		}
		if err := mw(context.Background(), args, result); err != nil {
			t.Fatalf("%s: middleware error %v, want a reply", name, err)
		}
		success := reflect.ValueOf(result).Elem().FieldByName("Success")
		if success.IsNil() {
			return 0
		}
		return success.Elem().FieldByName("Errno").Int()
	}
	methods := fitcache.NewServiceInfo().Methods
	if len(methods) < 9 {
		t.Fatalf("%d methods in the service info, want at least 9", len(methods))
	}
	for name := range methods {
		if got := call(name, false); got != int64(syscall.EINVAL) || ran != 0 {
			t.Errorf("%s without its request: errno %d, handler ran %d times; want EINVAL and none", name, got, ran)
		}
		if call(name, true); ran != 1 {
			t.Errorf("%s with its request: the handler ran %d times, want once", name, ran)
		}
		ran = 0
	}
}

// The wire's Reason (rpc/fitcache.thrift) and core.Reason are converted by value: they must
// name the same causes with the same numbers, and the IDL must have no value core lacks.
func TestReasonsMatchTheIDL(t *testing.T) {
	pairs := []struct {
		core core.Reason
		wire fitcachepb.Reason
	}{
		{core.ReasonUnspecified, fitcachepb.Reason_UNSPECIFIED},
		{core.ReasonOutsideRoot, fitcachepb.Reason_OUTSIDE_ROOT},
		{core.ReasonBadPath, fitcachepb.Reason_BAD_PATH},
		{core.ReasonTooLarge, fitcachepb.Reason_TOO_LARGE},
		{core.ReasonCacheFull, fitcachepb.Reason_CACHE_FULL},
		{core.ReasonChanged, fitcachepb.Reason_CHANGED},
		{core.ReasonClosed, fitcachepb.Reason_CLOSED},
		{core.ReasonBadCopy, fitcachepb.Reason_BAD_COPY},
	}
	for _, p := range pairs {
		if int32(p.core) != int32(p.wire) {
			t.Errorf("core reason %d is wire reason %s (%d)", p.core, p.wire, p.wire)
		}
	}
	if next := fitcachepb.Reason(len(pairs)); next.String() != "<UNSET>" {
		t.Errorf("the IDL has reason %s, which core.Reason lacks", next)
	}
}

// The wire's Origin and core.Origin are converted by value (rpc/origin.go): every value
// either has is the other's too, under the same name (the IDL's in capitals, "_" for "-").
func TestOriginsMatchTheIDL(t *testing.T) {
	named := 0
	for v := range 64 {
		c, w := core.Origin(v).String(), fitcachepb.Origin(v).String()
		cNamed, wNamed := !strings.HasPrefix(c, "origin("), w != "<UNSET>"
		if cNamed != wNamed || (cNamed && strings.ToUpper(strings.ReplaceAll(c, "-", "_")) != w) {
			t.Errorf("origin %d: %q in core, %q on the wire", v, c, w)
		}
		if cNamed {
			named++
		}
	}
	if named < 5+tiers.NumKinds {
		t.Errorf("%d origins named, want every tier kind's and 5 others", named)
	}
	for _, c := range []struct {
		reply *fitcachepb.ReadReply
		want  core.Origin
	}{
		{&fitcachepb.ReadReply{Origin: fitcachepb.Origin_DISK, OriginName: "disk"}, core.OriginDisk},
		{&fitcachepb.ReadReply{OriginName: "source"}, core.OriginSource}, // a server older than the enum
		{&fitcachepb.ReadReply{OriginName: "peer"}, core.OriginPeer},
		{&fitcachepb.ReadReply{}, core.OriginNone},
		{&fitcachepb.ReadReply{Origin: -1}, core.OriginNone},
		{&fitcachepb.ReadReply{Origin: 5}, core.OriginNone}, // no origin has 5
		{&fitcachepb.ReadReply{Origin: 1 << 32, OriginName: "inflight"}, core.OriginInflight},
		{&fitcachepb.ReadReply{OriginName: "tier"}, core.OriginNone},
	} {
		if got := OriginOf(c.reply); got != c.want {
			t.Errorf("OriginOf(origin %d, name %q) = %v, want %v", c.reply.Origin, c.reply.OriginName, got, c.want)
		}
	}
}

// A block travels as a file does: bytes to a caller on another node, the tier file to map to
// one on this node; Hello says how large blocks are, and a block's reply carries no stamp
// (a replica must never take a block for the file).
func TestReadBlockRepliesWithTheBlock(t *testing.T) {
	sock, e := serveEngine(t, "")
	root := t.TempDir()
	want := bytes.Repeat([]byte("0123456789abcdef"), (core.DefaultBlockBytes+100)/16)
	path := filepath.Join(root, "big.bin")
	os.WriteFile(path, want, 0o644)
	c, _ := Dial(sock, ClientConfig{})
	defer c.Close()
	ctx := context.Background()
	hello, err := c.Hello(ctx)
	if err != nil || hello.BlockBytes != e.BlockBytes() {
		t.Fatalf("hello: block bytes %d (%v), want %d", hello.GetBlockBytes(), err, e.BlockBytes())
	}
	r, err := c.ReadBlock(ctx, root, path, e.BlockBytes(), 1, false)
	if err != nil || !bytes.Equal(r.Data, want[core.DefaultBlockBytes:]) || len(r.Stamp) != 0 {
		t.Fatalf("block 1: %d bytes (want %d), stamp %d bytes, err %v", len(r.GetData()), len(want)-core.DefaultBlockBytes, len(r.GetStamp()), err)
	}
	r, err = c.ReadBlock(ctx, root, path, e.BlockBytes(), 0, true)
	if err != nil || r.CachedPath == "" || r.Size != core.DefaultBlockBytes {
		t.Fatalf("local block 0: cached path %q, size %d, err %v", r.GetCachedPath(), r.GetSize(), err)
	}
	if got, _ := os.ReadFile(r.CachedPath); !bytes.Equal(got, want[:core.DefaultBlockBytes]) {
		t.Fatal("the tier file named for block 0 does not hold it")
	}
	if r, err = c.ReadBlock(ctx, root, path, e.BlockBytes(), 2, false); err != nil || r.Size != 0 || len(r.Data) != 0 {
		t.Fatalf("block past the end: %d bytes, err %v", r.GetSize(), err)
	}
	// A range of a block: only its bytes travel, fewer at the block's end.
	r, err = c.ReadBlockRange(ctx, root, path, e.BlockBytes(), 1, 90, 1000, false)
	if err != nil || !bytes.Equal(r.Data, want[core.DefaultBlockBytes+90:]) {
		t.Fatalf("range of block 1: %d bytes, err %v", len(r.GetData()), err)
	}
	// Another block size numbers blocks otherwise: refused, never served as another block.
	if _, err := c.ReadBlockRange(ctx, root, path, e.BlockBytes()/2, 1, 0, 10, false); !errors.Is(err, core.ErrBadPath) {
		t.Errorf("a block of another size: %v, want EINVAL", err)
	}
	if _, err := c.ReadBlock(ctx, root, path, e.BlockBytes()*2, 0, false); !errors.Is(err, core.ErrBadPath) {
		t.Errorf("a block of another size: %v, want EINVAL", err)
	}
}
