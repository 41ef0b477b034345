// Package rpc carries FitCache's client-server protocol over CloudWeGo Kitex with Thrift.
//
// fitcache.thrift is the contract; kitex_gen holds the code generated from it (regenerate with
// generate.sh, never edit by hand). [Handler] serves the protocol over a [core.Engine]: it
// only validates, calls the engine and maps errors to errno codes. [Client] calls one server
// with a deadline on every call.
//
// Both sides run over this package's transport for Kitex (transport.go, buffer.go): Kitex's
// protocol handlers, codecs and client connection pool, over connections and buffers of its
// own, so that a file's bytes skip the copies a codec makes. A server answering a Read from
// another node sends the file from its cached copy once the reply's other fields are written
// (sendfile under 1 MiB, the mapping written to the socket above, see encodeBulk), and
// releases the copy once the reply is out; the client checks the frame's other bytes and
// reads the file's bytes from the socket straight into its buffer ([Client.ReadInto]: the
// caller's; see decodeRead). [Client.ReadBatch] reads several files in one call, their bytes
// after every other field of the reply. A client's calls run in its goroutine, their
// deadline and cancellation enforced by the connection (see callState).
//
// What a server and a client with a job token guarantee each other:
//
//   - Mutual authentication without the token on the wire (handshake.go). Each new
//     connection starts with a handshake in which each side proves, with an HMAC-SHA256 over
//     fresh nonces of both sides and the connection's two endpoints, that it holds a key
//     derived from the token. The client sends nothing but a nonce before the server has
//     proved itself, and takes a listener that cannot (another user's process at the
//     address of a server that is not up, or died; a relay to a real server) for a server
//     that is down ([ErrUnproven], [IsRefused]). The server reads no request before the
//     client has proved itself. Requests carry no token: a connection is authenticated, so
//     every request on it, Store, Forget and Clear included, comes from the job. Serve wraps
//     the listener to run the handshake, cap connections and refuse the rest before Kitex
//     sees them, and Dial runs it in its dialer before Kitex gets the connection.
//   - Bounded decoding (frame.go). Both sides use a codec that checks a frame's size against
//     [DefaultMaxFrameBytes] (configurable) before reading its body, and then every length in
//     it against the bytes it holds before Kitex's generated decoders, which allocate what a
//     list claims, see it. A Read or ReadBatch reply is checked without its file bytes: the
//     rest of the frame, with the bytes' length as 0, is checked and decoded as any frame, and
//     the bytes, which no decoder walks, must fit in the frame.
//   - Checked replica copies (stamp.go). A Read reply carries the file's CRC-32C and its
//     owner's stamp, which a client passes on to a replica's Store; the replica checks both,
//     and the source's size and times with its own stat, before it keeps a copy.
//
// What they do not: the connection is not encrypted. Whoever can read the traffic between
// nodes sees the files and requests, and whoever can modify it can change them after the
// handshake; such a network attacker is out of scope (run the job on a trusted network, or
// under a tunnel). Both sides must see the same endpoints: address translation between the
// nodes of a job is not supported. Any holder of the token is a member of the job.
//
// Servers and clients without a token (the per-user server on a private Unix socket, which
// only its user reaches) send and expect no handshake, and have no frame-size limit; their
// frames are checked all the same.
//
// Usage:
//
//	srv, handler, done := rpc.Serve(engine, ln, rpc.ServerConfig{Token: token})
//	...
//	c, err := rpc.Dial("node7:7070", rpc.ClientConfig{Token: token})
//	defer c.Close()
//	reply, err := c.Read(ctx, "/data", "/data/train/0001.jpg", false)
//	reply, err = c.ReadInto(ctx, &fitcachepb.ReadRequest{Root: "/data", Path: p}, buf) // reply.Data in buf
package rpc
