package rpc

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"syscall"

	"github.com/cloudwego/kitex/server"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb/fitcache"
)

// ServerConfig configures the protocol side of a server.
type ServerConfig struct {
	// Token every request must carry; empty accepts any (a per-user server on a private
	// Unix socket).
	Token string
	// ID names the server in replies and logs.
	ID string
	// OnRequest, if set, is called at the start of every request (idle tracking).
	OnRequest func()
	Log       *slog.Logger
}

// Handler implements the FitCache service over an engine.
type Handler struct {
	engine  *core.Engine
	cfg     ServerConfig
	members membership
}

var _ fitcachepb.FitCache = (*Handler)(nil)

// NewHandler returns a handler serving e.
func NewHandler(e *core.Engine, cfg ServerConfig) *Handler {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Handler{engine: e, cfg: cfg}
}

// Serve starts serving e on ln in the background and returns the running server; Stop it to
// end. The server ignores SIGINT and SIGTERM (Kitex's default would take them over from the
// host process); the host decides when to stop.
func Serve(e *core.Engine, ln net.Listener, cfg ServerConfig) (server.Server, *Handler, <-chan error) {
	never := func() <-chan error { return make(chan error) }
	h := NewHandler(e, cfg)
	srv := fitcache.NewServer(h, server.WithListener(ln), server.WithExitSignal(never))
	done := make(chan error, 1)
	go func() { done <- srv.Run() }()
	return srv, h, done
}

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

func (h *Handler) begin(token string) error {
	if h.cfg.OnRequest != nil {
		h.cfg.OnRequest()
	}
	if h.cfg.Token != "" && subtle.ConstantTimeCompare([]byte(token), []byte(h.cfg.Token)) != 1 {
		h.engine.CountRefusal()
		h.cfg.Log.Warn("refused request with a wrong or missing job token")
		return &core.ErrnoError{Errno: syscall.EACCES, Message: "fitcache: wrong or missing job token"}
	}
	return nil
}

func errnoOf(err error) (int32, string) {
	if err == nil {
		return 0, ""
	}
	return int32(core.Errno(err)), err.Error()
}

// Hello describes the server: its id, pid and tier directories (fastest first).
func (h *Handler) Hello(ctx context.Context, req *fitcachepb.HelloRequest) (*fitcachepb.HelloReply, error) {
	if err := h.begin(req.Token); err != nil {
		errno, msg := errnoOf(err)
		return &fitcachepb.HelloReply{Errno: errno, Message: msg}, nil
	}
	reply := &fitcachepb.HelloReply{ServerId: h.cfg.ID, Pid: int32(os.Getpid()), GenerationFile: h.engine.GenerationFile()}
	for _, d := range h.engine.TierDirs() {
		reply.Tiers = append(reply.Tiers, &fitcachepb.TierInfo{Dir: d.Path, Kind: d.Kind.String()})
	}
	return reply, nil
}

// Read serves a file: the tier file to map for local callers when it is cached, else the bytes.
func (h *Handler) Read(ctx context.Context, req *fitcachepb.ReadRequest) (*fitcachepb.ReadReply, error) {
	if err := h.begin(req.Token); err != nil {
		errno, msg := errnoOf(err)
		return &fitcachepb.ReadReply{Errno: errno, Message: msg}, nil
	}
	h.members.apply(req.Dead, req.Alive)
	version, dead := h.members.since(req.MembershipVersion)
	res, err := h.engine.Read(ctx, req.Root, req.Path, req.Local)
	if err != nil {
		errno, msg := errnoOf(err)
		return &fitcachepb.ReadReply{Errno: errno, Message: msg, MembershipVersion: version, Dead: dead}, nil
	}
	defer res.Release()
	reply := &fitcachepb.ReadReply{Size: int64(len(res.Bytes())), Origin: res.Origin, MtimeNanos: res.MTimeNanos,
		MembershipVersion: version, Dead: dead}
	switch {
	case req.Local && res.Mapping != nil:
		reply.CachedPath = res.Mapping.Path
	case res.Mapping != nil:
		reply.Data = bytes.Clone(res.Bytes()) // the mapping is released before the reply is sent
	default:
		reply.Data = res.Data
	}
	return reply, nil
}

// Store caches bytes a client read from the file's owner (this server is a replica).
func (h *Handler) Store(ctx context.Context, req *fitcachepb.StoreRequest) (*fitcachepb.StoreReply, error) {
	if err := h.begin(req.Token); err != nil {
		errno, msg := errnoOf(err)
		return &fitcachepb.StoreReply{Errno: errno, Message: msg}, nil
	}
	errno, msg := errnoOf(h.engine.Store(req.Root, req.Path, req.Data, req.MtimeNanos))
	return &fitcachepb.StoreReply{Errno: errno, Message: msg}, nil
}

// ReportHits adds hits that a client served from this server's tier files itself.
func (h *Handler) ReportHits(ctx context.Context, req *fitcachepb.HitReport) (*fitcachepb.HitReportReply, error) {
	if err := h.begin(req.Token); err != nil {
		errno, msg := errnoOf(err)
		return &fitcachepb.HitReportReply{Errno: errno, Message: msg}, nil
	}
	h.engine.AddClientHits(req.HitsByTier, req.Bytes)
	return &fitcachepb.HitReportReply{}, nil
}

// Stats returns the engine's counters as JSON.
func (h *Handler) Stats(ctx context.Context, req *fitcachepb.StatsRequest) (*fitcachepb.StatsReply, error) {
	if err := h.begin(req.Token); err != nil {
		errno, msg := errnoOf(err)
		return &fitcachepb.StatsReply{Errno: errno, Message: msg}, nil
	}
	b, err := json.Marshal(h.engine.Stats())
	if err != nil {
		return nil, err
	}
	return &fitcachepb.StatsReply{Json: string(b)}, nil
}
