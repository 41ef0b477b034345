// Package rpc carries FitCache's client-server protocol over CloudWeGo Kitex with Thrift.
//
// fitcache.thrift is the contract; kitex_gen holds the code generated from it (regenerate with
// generate.sh, never edit by hand). [Handler] serves the protocol over a [core.Engine]: it
// only authenticates, validates, calls the engine and maps errors to errno codes. [Client]
// calls one server with a deadline on every call.
//
// Usage:
//
//	srv, err := rpc.Serve(engine, ln, rpc.ServerConfig{Token: token})
//	...
//	c, err := rpc.Dial("/run/user/1000/fitcache/server.sock", rpc.ClientConfig{Token: token})
//	reply, err := c.Read(ctx, "/data", "/data/train/0001.jpg", true)
package rpc
