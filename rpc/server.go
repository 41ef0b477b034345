package rpc

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"os"
	"reflect"
	"syscall"
	"time"

	"github.com/cloudwego/kitex/pkg/endpoint"
	"github.com/cloudwego/kitex/server"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/gate"
	"github.com/fitcache/fitcache/membership"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb/fitcache"
)

// ServerConfig configures the protocol side of a server. Zero values take the defaults shown.
type ServerConfig struct {
	// Token of the job; empty accepts any client (a per-user server on a private Unix
	// socket). With a token, every connection must pass the handshake (see handshake.go), in
	// which client and server prove to each other that they know the token without sending
	// it, before any request is read.
	Token string
	// ID names the server in replies and logs.
	ID string
	// NodeSocket is the server's node socket (package nodesock), announced in Hello to
	// clients on its node; empty for none.
	NodeSocket string
	// ReaderFills says in Hello that readers on the node may report their own fills on the
	// node socket (nodesock.OpRecord): its server records them.
	ReaderFills bool
	// Ring is the fingerprint of the ring the server's cluster places files on
	// (ring.Fingerprint), said in Hello so that clients on another ring are told; empty for
	// a server that does not know the job's list.
	Ring string
	// OnNewJob, if set, is called when a job begins its validation session here with a Hello
	// of a reader (not one relayed by another server), before the Hello is answered: a
	// cluster server passes the job on to the job's other servers, which then check their
	// copies for it too (see Client.BeginJob).
	OnNewJob func(ctx context.Context, job string)
	// OnRequest, if set, is called at the start of every request (idle tracking).
	OnRequest func()
	// OnRead, if set, is called once a Read was answered with a file (not on failure): for
	// a caller on this node (local) or not, the file's origin (a tier, inflight or the
	// source), the time the answer took and the file's size (metrics.Server.ObserveRead).
	OnRead func(local bool, origin core.Origin, d time.Duration, bytes int64)
	// Members, if set, tells what the servers' membership knows (package membership): the
	// servers alive and dead, and those other servers' reads found dead lately, for Stats; nil
	// lists when there is none.
	Members func() (alive, dead, reported []string)
	// NodeConnections, if set, returns the connections the node socket accepted, for Stats.
	NodeConnections func() int64
	// OnReportedDead, if set, is told of each server a client's reads found dead, as its
	// requests report it (a client on a node without a server of the job has no node
	// server to tell): the servers' membership spreads it to the job's other servers.
	OnReportedDead func(id string)
	// ForwardBlock, if set (a cluster server), serves a ranged request for a block (see
	// ReadRequest.range_length) from a reader of this node when another server owns the
	// block on the ring: it returns the range's bytes as the owner sent them, and ok false
	// when this server is the owner, or holds the block, and serves it itself. Local is the
	// caller's word, as for Read: a member of the job that claims it only makes this server
	// forward one hop (a forwarded request never claims it, so none is forwarded twice).
	ForwardBlock func(ctx context.Context, root, path string, n, off, length int64) (data []byte, ok bool, err error)
	Log          *slog.Logger
	// MaxFrameBytes bounds a request or reply: a larger request is refused before its body
	// is read, and a file larger than this cannot be served as bytes (its Read fails with
	// EFBIG). 0 means DefaultMaxFrameBytes (64 MiB) with a token, no limit without one (a
	// private Unix socket, reachable only by its user). Whatever the limit, every length in
	// a request is checked against the bytes of its frame before it is decoded (see
	// checkFrame).
	MaxFrameBytes int
	// MaxConns bounds the open connections of a server with a token (1024); an excess
	// connection is closed at once and counted as a refusal.
	MaxConns int
	// HandshakeTimeout bounds a connection's handshake (2s).
	HandshakeTimeout time.Duration
	// RefusalLogInterval: refusals are logged at most once per client host per interval,
	// with a count of the unlogged ones (10s).
	RefusalLogInterval time.Duration
}

// Handler implements the FitCache service over an engine.
type Handler struct {
	engine   *core.Engine
	cfg      ServerConfig
	keys     *jobKeys // derived from cfg.Token (also without a token: stamps then only check integrity)
	members  membership.DeadView
	refusals *gate.RateLog  // of refused connections and requests, per client host
	guard    *guardListener // nil without a token
	// sendFromFiles: see the variable.
	sendFromFiles bool
}

var _ fitcachepb.FitCache = (*Handler)(nil)

// newHandler returns a handler serving e. It authenticates nothing: Serve puts the handshake
// in front of its connections.
func newHandler(e *core.Engine, cfg ServerConfig) *Handler {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxFrameBytes <= 0 && cfg.Token != "" {
		cfg.MaxFrameBytes = DefaultMaxFrameBytes
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = 1024
	}
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = 2 * time.Second
	}
	if cfg.RefusalLogInterval <= 0 {
		cfg.RefusalLogInterval = 10 * time.Second
	}
	return &Handler{engine: e, cfg: cfg, keys: newJobKeys(cfg.Token), sendFromFiles: sendFromFiles,
		refusals: &gate.RateLog{Every: cfg.RefusalLogInterval}}
}

// Serve starts serving e on ln in the background and returns the running server; Stop it to
// end. The server ignores SIGINT and SIGTERM (Kitex's default would take them over from the
// host process); the host decides when to stop.
//
// With a token, connections are authenticated by the handshake and capped in number before
// Kitex sees them; without one, the server accepts any connection. Either way it runs over
// this package's transport (transport.go), and a request is decoded only once its frame was
// checked (see framedCodec).
func Serve(e *core.Engine, ln net.Listener, cfg ServerConfig) (server.Server, *Handler, <-chan error) {
	never := func() <-chan error { return make(chan error) }
	h := newHandler(e, cfg)
	if cfg.Token != "" {
		h.guard = newGuardListener(ln, h.keys, h.cfg.MaxConns, h.cfg.HandshakeTimeout, h.refuse)
		ln = h.guard
	}
	opts := []server.Option{server.WithExitSignal(never), server.WithMiddleware(h.authenticate),
		server.WithCodec(newFramedCodec(h.cfg.MaxFrameBytes)), server.WithListener(ln),
		server.WithTransServerFactory(transServerFactory{}), server.WithTransHandlerFactory(svrTransHandlerFactory{})}
	srv := fitcache.NewServer(h, opts...)
	done := make(chan error, 1)
	go func() {
		err := srv.Run()
		if errors.Is(err, errStopped) {
			err = nil
		}
		done <- err
	}()
	return srv, h, done
}

// sendFromFiles is whether the replies of handlers made from now on send files' bytes from the
// cached files (sendfile) rather than from their mappings; tests turn it off.
var sendFromFiles = true

// frameSlack is room left in a frame for everything of a reply but the file's bytes.
const frameSlack = 64 << 10

// ListenUnix listens on a Unix socket that only this user can connect to, replacing a stale
// socket file left by a dead server.
func ListenUnix(path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	old := syscall.Umask(0o077)
	ln, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	return ln, nil
}

// Conns returns the number of open connections of a server with a token (authenticated or
// authenticating), or 0 without one.
func (h *Handler) Conns() int {
	if h.guard == nil {
		return 0
	}
	return h.guard.Active()
}

// Membership returns the version of the ring membership this server's clients reported
// (one per change: a server found dead or back) and the servers they report dead (see
// membership.DeadView).
func (h *Handler) Membership() (version int64, dead []string) { return h.members.Since(-1) }

// Learn records what the servers' own membership found of a server (package membership):
// it rides on this server's replies to its clients as their reports do, so that a client on
// a node without a server of the job drops a dead server without waiting for its timeouts.
func (h *Handler) Learn(id string, alive bool) {
	if alive {
		h.members.Apply(nil, []string{id})
	} else {
		h.members.Apply([]string{id}, nil)
	}
}

// heard records what a client's request reports of other servers and passes every death
// it reports on (OnReportedDead), news to this server's view or not: the view may still hold
// a server dead that came back meanwhile (it keeps what clients and the membership said
// last), and the membership drops repeats itself.
func (h *Handler) heard(dead, alive []string) {
	h.members.Apply(dead, alive)
	if h.cfg.OnReportedDead != nil {
		for _, id := range dead {
			h.cfg.OnReportedDead(id)
		}
	}
}

// refuse counts a refused connection or request and logs it, rate-limited per peer.
func (h *Handler) refuse(peer, reason string) {
	h.engine.CountRefusal()
	if write, suppressed := h.refusals.Allow(peer); write {
		h.cfg.Log.Warn("refused a client", "peer", peer, "reason", reason, "suppressed_since_last", suppressed)
	}
}

// authenticate is the Kitex middleware every request goes through before its handler: it
// notes the request for the idle timer (OnRequest) and refuses a call whose request struct is
// missing (a peer can send one without it), which no handler could read, with its method's
// reply and EINVAL. Who may call was settled when the connection was made: with a token, only
// a client that passed the handshake has a connection (see guardListener), so every request
// comes from the job, Store, Forget and Clear included; requests carry no token.
func (h *Handler) authenticate(next endpoint.Endpoint) endpoint.Endpoint {
	return func(ctx context.Context, req, resp any) error {
		if !hasRequest(req) {
			return setFailure(resp, &core.ErrnoError{Errno: syscall.EINVAL, Message: "fitcache: a call without its request"})
		}
		if h.cfg.OnRequest != nil {
			h.cfg.OnRequest()
		}
		return next(ctx, req, resp)
	}
}

// hasRequest reports whether a call carries its request (Kitex's args struct, whose first
// argument is the request).
func hasRequest(args any) bool {
	a, ok := args.(interface{ GetFirstArgument() any })
	if !ok {
		return false
	}
	r := reflect.ValueOf(a.GetFirstArgument())
	return r.Kind() == reflect.Pointer && !r.IsNil()
}

// setFailure makes resp, a Kitex result whose Success field points to the method's reply,
// carry err as that reply's errno, message and reason: every reply struct has those fields
// (rpc/fitcache.thrift).
func setFailure(resp any, err error) error {
	result := reflect.ValueOf(resp)
	if result.Kind() != reflect.Pointer || result.Elem().Kind() != reflect.Struct {
		return err
	}
	success := result.Elem().FieldByName("Success")
	if !success.IsValid() || success.Kind() != reflect.Pointer {
		return err
	}
	reply := reflect.New(success.Type().Elem())
	errno, msg, reason := errnoOf(err)
	reply.Elem().FieldByName("Errno").SetInt(int64(errno))
	reply.Elem().FieldByName("Message").SetString(msg)
	reply.Elem().FieldByName("Reason").Set(reflect.ValueOf(reason))
	success.Set(reply)
	return nil
}

// errnoOf is what a reply says of err: its errno, message and reason (see core.Reason).
func errnoOf(err error) (int32, string, fitcachepb.Reason) {
	if err == nil {
		return 0, "", fitcachepb.Reason_UNSPECIFIED
	}
	return int32(core.Errno(err)), err.Error(), fitcachepb.Reason(core.ReasonOf(err))
}

// Hello describes the server: its id, pid, tier directories (fastest first), removal
// counter and node socket, and the validation session of the caller's job (begun now if the
// job has none).
func (h *Handler) Hello(ctx context.Context, req *fitcachepb.HelloRequest) (*fitcachepb.HelloReply, error) {
	session, began := h.engine.BeginJob(req.Job)
	if began && !req.Relayed && h.cfg.OnNewJob != nil {
		h.cfg.OnNewJob(ctx, req.Job) // before the reply: the job's reads may go to the others
	}
	reply := &fitcachepb.HelloReply{ServerId: h.cfg.ID, Pid: int32(os.Getpid()),
		NodeSocket: h.cfg.NodeSocket, Session: int64(session), BlockBytes: h.engine.BlockBytes(),
		ReaderFills: h.cfg.ReaderFills && h.cfg.NodeSocket != "", Ring: h.cfg.Ring}
	// What this server holds dead, so that a new client waits for none of it (see Learn).
	reply.MembershipVersion, reply.Dead = h.members.Since(-1)
	if h.cfg.Members != nil {
		reply.Alive, _, _ = h.cfg.Members()
	}
	for _, d := range h.engine.TierDirs() {
		reply.Tiers = append(reply.Tiers, &fitcachepb.TierInfo{Dir: d.Path, Kind: d.Kind.String()})
	}
	return reply, nil
}

// Read serves a file: the tier file to map for local callers when it is cached, else the bytes.
func (h *Handler) Read(ctx context.Context, req *fitcachepb.ReadRequest) (*fitcachepb.ReadReply, error) {
	h.heard(req.Dead, req.Alive)
	version, dead := h.members.Since(req.MembershipVersion)
	start := time.Now()
	if req.IsSetBlock() && req.IsSetBlockBytes() && req.GetBlockBytes() != h.engine.BlockBytes() {
		errno, msg, reason := errnoOf(fmt.Errorf("%w: blocks of %d bytes asked of a server of %d-byte blocks",
			core.ErrBadPath, req.GetBlockBytes(), h.engine.BlockBytes()))
		return &fitcachepb.ReadReply{Errno: errno, Message: msg, Reason: reason, MembershipVersion: version, Dead: dead}, nil
	}
	if req.IsSetBlock() && req.IsSetRangeLength() {
		reply := h.readBlockRange(ctx, req, version, dead)
		// Ranges are reads as files are; a request that only caches the block (a length of 0)
		// is none.
		if h.cfg.OnRead != nil && reply.Errno == 0 && req.GetRangeLength() > 0 {
			h.cfg.OnRead(req.Local, OriginOf(reply), time.Since(start), reply.Size)
		}
		return reply, nil
	}
	res, err := h.readWhat(ctx, req)
	if err == nil && res.Mapping != nil && !req.Local {
		// The reply carries the bytes (a slice, for Thrift): a mapping not made yet (see
		// core.Engine.ReadToSend) is made now. Where it cannot be (no address space left for
		// it), the file is read as it would be without sendfile: from another tier or the
		// source.
		if res.Mapping.Map() != nil {
			res.Release()
			res, err = h.engine.Read(ctx, req.Root, req.Path, false)
		}
	}
	if err != nil {
		errno, msg, reason := errnoOf(err)
		return &fitcachepb.ReadReply{Errno: errno, Message: msg, Reason: reason, MembershipVersion: version, Dead: dead}, nil
	}
	reply := &fitcachepb.ReadReply{Size: res.Size(), MtimeNanos: res.MTimeNanos,
		MembershipVersion: version, Dead: dead}
	setOrigin(reply, res.Origin)
	if !req.IsSetBlock() { // a block's bytes are no copy of the file a replica may take
		h.stampReply(req.Path, res, reply)
	}
	switch {
	case req.Local && res.Mapping != nil:
		reply.CachedPath = res.Mapping.Path
		res.Release()
	case h.tooLarge(int(res.Size())):
		res.Release()
		errno, msg, reason := errnoOf(h.errTooLarge(req.Path, int(res.Size())))
		return &fitcachepb.ReadReply{Errno: errno, Reason: reason, Message: msg, MembershipVersion: version, Dead: dead}, nil
	default:
		reply.Data = h.replyBytes(ctx, res)
	}
	if h.cfg.OnRead != nil {
		h.cfg.OnRead(req.Local, res.Origin, time.Since(start), reply.Size)
	}
	return reply, nil
}

// readBlockRange serves a ranged request for a block: forwarded to the block's owner when it
// is another server (ForwardBlock), else the range of the block, cached whole here, as bytes.
func (h *Handler) readBlockRange(ctx context.Context, req *fitcachepb.ReadRequest, version int64, dead []string) *fitcachepb.ReadReply {
	fail := func(err error) *fitcachepb.ReadReply {
		errno, msg, reason := errnoOf(err)
		return &fitcachepb.ReadReply{Errno: errno, Message: msg, Reason: reason, MembershipVersion: version, Dead: dead}
	}
	off, length := req.GetRangeOffset(), req.GetRangeLength()
	if off < 0 || length < 0 {
		return fail(fmt.Errorf("%w: range of %d bytes at %d", core.ErrBadPath, length, off))
	}
	if h.tooLarge(int(min(length, int64(math.MaxInt32)))) { // the caller reads the source
		return fail(fmt.Errorf("%w: a range of %d bytes does not fit in a reply", core.ErrTooLarge, length))
	}
	if h.cfg.ForwardBlock != nil && req.Local {
		data, ok, err := h.cfg.ForwardBlock(ctx, req.Root, req.Path, req.GetBlock(), off, length)
		if err != nil {
			return fail(err)
		}
		if ok {
			reply := &fitcachepb.ReadReply{Size: int64(len(data)), Data: data, MembershipVersion: version, Dead: dead}
			setOrigin(reply, core.OriginPeer)
			return reply
		}
	}
	res, err := h.engine.ReadBlock(ctx, req.Root, req.Path, req.GetBlock(), true)
	if err != nil {
		return fail(err)
	}
	defer res.Release()
	b := res.Bytes()
	lo := min(off, int64(len(b)))
	data := bytes.Clone(b[lo : lo+min(length, int64(len(b))-lo)])
	h.engine.CountSent(int64(len(data)))
	// The identity of the source version the block copies, for a node-local copy of it (see
	// the forwardBlock of package server, readers.go).
	reply := &fitcachepb.ReadReply{Size: int64(len(data)), Data: data, MembershipVersion: version,
		Dead: dead, MtimeNanos: res.MTimeNanos, CtimeNanos: res.CTimeNanos, Inode: int64(res.Ino)}
	setOrigin(reply, res.Origin)
	return reply
}

// readWhat reads what req asks for: the whole file, or one of its blocks.
func (h *Handler) readWhat(ctx context.Context, req *fitcachepb.ReadRequest) (core.Result, error) {
	if req.IsSetBlock() {
		return h.engine.ReadBlock(ctx, req.Root, req.Path, req.GetBlock(), req.Local)
	}
	return h.read(ctx, req.Root, req.Path, req.Local)
}

// read reads a file for a caller on this node (local: it maps tier files) or not; over this
// package's transport, a file in a tier comes with its cached file open to be sent from
// (core.Engine.ReadToSend).
func (h *Handler) read(ctx context.Context, root, path string, local bool) (core.Result, error) {
	if !local && requestOf(ctx) != nil && h.sendFromFiles {
		return h.engine.ReadToSend(ctx, root, path)
	}
	return h.engine.Read(ctx, root, path, local)
}

// tooLarge reports whether n bytes of a file do not fit in a reply.
func (h *Handler) tooLarge(n int) bool {
	return h.cfg.MaxFrameBytes > 0 && int64(n) > int64(h.cfg.MaxFrameBytes)-frameSlack
}

// errTooLarge is the error of a file of n bytes too large for a reply: EFBIG, the caller
// reads the source.
func (h *Handler) errTooLarge(path string, n int) error {
	return core.NewErrnoError(int32(syscall.EFBIG), core.ReasonTooLarge, fmt.Sprintf(
		"fitcache: %s: %d bytes do not fit in a reply of at most %d bytes", path, n, h.cfg.MaxFrameBytes))
}

// replyBytes returns the bytes of res for a reply, and releases res when they are no longer
// needed. Over this package's transport they are sent from the cached file (sendfile), or
// else from its mapping, once the reply's other fields are written (see encodeBulk and
// encodeBatch), and res is released then: the bytes never pass through this process's
// memory. Otherwise a mapping is copied, and released at once.
func (h *Handler) replyBytes(ctx context.Context, res core.Result) []byte {
	r := requestOf(ctx)
	switch {
	case res.Mapping != nil && r != nil:
		b := res.Bytes()
		if res.File != nil {
			r.sendFrom(b, res.File)
			res.File = nil // the request closes it
		}
		r.afterReply(res.Release)
		return b
	case res.Mapping != nil:
		defer res.Release()
		return bytes.Clone(res.Bytes())
	}
	res.Release()
	return res.Data
}

// Store caches bytes a client read from the file's owner (this server is a replica), if the
// owner's stamp vouches for them and the engine finds them to be the source's (see
// core.Engine.Store); else the reply says why, with EBADMSG (core.ErrBadCopy) or EAGAIN
// (core.ErrChanged).
func (h *Handler) Store(ctx context.Context, req *fitcachepb.StoreRequest) (*fitcachepb.StoreReply, error) {
	c := storeRequest(req)
	var err error
	if h.keys.validStamp(req.Path, c, req.Stamp) {
		err = h.engine.Store(c)
	} else {
		err = h.engine.RefuseStore(fmt.Errorf("%w: %s: the stamp is not its owner's for these bytes", core.ErrBadCopy, req.Path))
	}
	errno, msg, reason := errnoOf(err)
	return &fitcachepb.StoreReply{Errno: errno, Message: msg, Reason: reason}, nil
}

// ReportHits adds hits that a client served from this server's tier files itself.
func (h *Handler) ReportHits(ctx context.Context, req *fitcachepb.HitReport) (*fitcachepb.HitReportReply, error) {
	h.engine.AddClientHits(req.HitsByTier, req.Bytes)
	return &fitcachepb.HitReportReply{}, nil
}

// statsReply is what Stats answers: the engine's counters and, on a server of a cluster job,
// the membership's view.
type statsReply struct {
	core.StatsSnapshot
	NodeConnections int64        `json:"node_connections,omitempty"`
	Members         *membersView `json:"members,omitempty"`
}

type membersView struct {
	Alive    []string `json:"alive"`
	Dead     []string `json:"dead"`
	Reported []string `json:"reported_dead"`
}

// Stats returns the engine's counters as JSON.
func (h *Handler) Stats(ctx context.Context, req *fitcachepb.StatsRequest) (*fitcachepb.StatsReply, error) {
	reply := statsReply{StatsSnapshot: h.engine.Stats()}
	if h.cfg.NodeConnections != nil {
		reply.NodeConnections = h.cfg.NodeConnections()
	}
	if h.cfg.Members != nil {
		if alive, dead, reported := h.cfg.Members(); alive != nil {
			reply.Members = &membersView{Alive: alive, Dead: append([]string{}, dead...),
				Reported: append([]string{}, reported...)}
		}
	}
	b, err := json.Marshal(reply)
	if err != nil {
		return nil, err
	}
	return &fitcachepb.StatsReply{Json: string(b)}, nil
}
