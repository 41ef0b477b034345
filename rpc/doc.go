// Package rpc carries FitCache's client-server protocol over CloudWeGo Kitex with Thrift.
//
// fitcache.thrift is the contract; kitex_gen holds the code generated from it (regenerate with
// generate.sh, never edit by hand). [Handler] serves the protocol over a [core.Engine]: it
// only authenticates, validates, calls the engine and maps errors to errno codes. [Client]
// calls one server with a deadline on every call.
//
// A server with a job token trusts no byte before a connection has sent the authentication
// preamble (see preamble.go) carrying the token: Serve wraps the listener to read it, cap
// connections and refuse the rest before Kitex sees them (such a server uses Kitex's Go net
// transport: netpoll takes no wrapped listener), and Dial sends it through its dialer before
// Kitex gets the connection. Both sides use a codec that checks a frame's size against
// [DefaultMaxFrameBytes] (configurable) before reading its body. Servers and clients without
// a token (the per-user server on a private Unix socket) send and expect no preamble. Every
// request still carries the token, compared in constant time.
//
// Usage:
//
//	srv, handler, done := rpc.Serve(engine, ln, rpc.ServerConfig{Token: token})
//	...
//	c, err := rpc.Dial("/run/user/1000/fitcache/server.sock", rpc.ClientConfig{Token: token})
//	defer c.Close()
//	reply, err := c.Read(ctx, "/data", "/data/train/0001.jpg", true)
package rpc
