package rpc

import (
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/cloudwego/kitex/pkg/remote"
)

// The handshake that authenticates every new connection to a server with a job token, in
// both directions, before either side acts on a byte of the other. The token never travels:
// each side proves that it holds the connection key derived from it (see jobKeys) with an
// HMAC-SHA256 over both sides' fresh nonces and the connection's two endpoints as that side
// sees them:
//
//	client → server   "FCH2" | client nonce (32 bytes)
//	server → client   server nonce (32) | HMAC(connection key, "fitcache handshake v2 server" | transcript)
//	client → server   HMAC(connection key, "fitcache handshake v2 client" | transcript)
//
//	transcript = client nonce | server nonce | endpoint(client) | endpoint(server)
//
// An endpoint is 't' | IPv6 address (16 bytes: IPv4 in its IPv4-mapped form, so that both
// spellings of an address agree; no zone) | port (2 bytes) for TCP, and 'u' | length (2 bytes)
// | path for a Unix socket (empty for an unnamed one); integers are big endian. The client
// sends nothing more before it has checked the server's proof, and the server reads no
// request before it has checked the client's; a failed check closes the connection. The two
// proofs differ in their label, so one side's proof is never valid as the other's.
//
// Binding the proofs to the endpoints defeats a relay: whoever listens at an address that a
// client dials (the port of a server that is not up yet, or died) and forwards the exchange
// to a real server gets a server proof over the relay's own connection to that server, which
// the client, who sees other endpoints, refuses. The price is that both sides must see the
// same endpoints: address translation (NAT, a port forwarded by a proxy) between the nodes of
// a job is not supported.
const (
	handshakeMagic = "FCH2"
	nonceSize      = 32
	macSize        = sha256.Size
	helloSize      = len(handshakeMagic) + nonceSize // the client's first message
	challengeSize  = nonceSize + macSize             // the server's answer
	serverLabel    = "fitcache handshake v2 server"
	clientLabel    = "fitcache handshake v2 client"
)

// ErrUnproven reports a listener that answered the handshake without proving that it knows
// the job token: not a server of this job, a relay to one, or a server with another token.
// Nothing but a nonce was sent to it. The client treats it as a server that is down (see
// IsRefused), as if the connection had been refused.
var ErrUnproven = errors.New("fitcache: the server did not prove that it knows the job token (not a server of this job, or the token differs)")

// errClientUnproven reports a client whose proof was wrong: another job token, or a relayed
// or translated connection.
var errClientUnproven = errors.New("client did not prove the job token (wrong token, or a relayed or translated connection)")

// errNoHandshake reports a connection that did not start with a well-formed handshake.
var errNoHandshake = errors.New("no handshake")

// jobKeys are the keys derived from a job token: one for the connection handshake, one for the
// stamps owners put on the files they serve (see stamp.go). Deriving separate keys keeps the
// two uses apart: a handshake proof is never a valid stamp, nor the reverse.
type jobKeys struct {
	conn     []byte
	stamping []byte
}

// newJobKeys derives the job's keys from its token with HKDF-SHA256.
func newJobKeys(token string) *jobKeys {
	derive := func(info string) []byte {
		k, err := hkdf.Key(sha256.New, []byte(token), []byte("fitcache job token"), info, sha256.Size)
		if err != nil {
			panic(err) // only for lengths HKDF cannot give
		}
		return k
	}
	return &jobKeys{conn: derive("connection handshake v2"), stamping: derive("replica stamp v1")}
}

// endpointBytes encodes one end of a connection for the handshake's transcript (see above).
func endpointBytes(a net.Addr) ([]byte, error) {
	switch a := a.(type) {
	case *net.TCPAddr:
		ap := a.AddrPort()
		ip := ap.Addr().Unmap().WithZone("")
		if !ip.IsValid() {
			return nil, fmt.Errorf("no address for %v", a)
		}
		a16 := ip.As16() // IPv4 in its mapped form
		b := append([]byte{'t'}, a16[:]...)
		return binary.BigEndian.AppendUint16(b, ap.Port()), nil
	case *net.UnixAddr:
		name := a.Name
		if name == "@" { // how Go names an unnamed socket on one side and not always on the other
			name = ""
		}
		if len(name) > 0xffff {
			return nil, fmt.Errorf("unix socket name of %d bytes", len(name))
		}
		b := binary.BigEndian.AppendUint16([]byte{'u'}, uint16(len(name)))
		return append(b, name...), nil
	case nil:
		return []byte{'u', 0, 0}, nil // a Unix socket without a name, as some report it
	}
	return nil, fmt.Errorf("no handshake over %s connections", a.Network())
}

// transcript returns what both proofs cover, given the client's and the server's ends.
func transcript(nonces []byte, client, server net.Addr) ([]byte, error) {
	c, err := endpointBytes(client)
	if err != nil {
		return nil, err
	}
	s, err := endpointBytes(server)
	if err != nil {
		return nil, err
	}
	return append(append(append([]byte(nil), nonces...), c...), s...), nil
}

// proof returns the HMAC with key of label (and a separating NUL) followed by transcript.
func proof(key []byte, label string, transcript []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(label))
	m.Write([]byte{0})
	m.Write(transcript)
	return m.Sum(nil)
}

// clientHandshake authenticates conn to the server and the server to this client, within
// deadline. It fails with ErrUnproven when the server's proof is wrong, having sent nothing
// but the magic and a nonce.
func clientHandshake(conn net.Conn, keys *jobKeys, deadline time.Time) error {
	if err := conn.SetDeadline(deadline); err != nil {
		return err
	}
	var nonces [2 * nonceSize]byte
	rand.Read(nonces[:nonceSize])
	hello := append([]byte(handshakeMagic), nonces[:nonceSize]...)
	if _, err := conn.Write(hello); err != nil {
		return err
	}
	var answer [challengeSize]byte
	if _, err := io.ReadFull(conn, answer[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return fmt.Errorf("server closed the connection during the handshake: %w", err)
		}
		return err
	}
	copy(nonces[nonceSize:], answer[:nonceSize])
	t, err := transcript(nonces[:], conn.LocalAddr(), conn.RemoteAddr())
	if err != nil {
		return err
	}
	if !hmac.Equal(answer[nonceSize:], proof(keys.conn, serverLabel, t)) {
		return ErrUnproven
	}
	if _, err := conn.Write(proof(keys.conn, clientLabel, t)); err != nil {
		return err
	}
	return conn.SetDeadline(time.Time{})
}

// serverHandshake authenticates a client on conn, which the caller has given a deadline. It
// reads at most helloSize+macSize bytes, and fails with errNoHandshake or errClientUnproven.
func serverHandshake(conn net.Conn, keys *jobKeys) error {
	var hello [helloSize]byte
	// The magic first, so that a client without a token, which sends a request at once, is
	// refused at once.
	if _, err := io.ReadFull(conn, hello[:len(handshakeMagic)]); err != nil {
		return fmt.Errorf("%w: %w", errNoHandshake, err)
	}
	if string(hello[:len(handshakeMagic)]) != handshakeMagic {
		return fmt.Errorf("%w: the connection starts with %q", errNoHandshake, strings.ToValidUTF8(string(hello[:len(handshakeMagic)]), "?"))
	}
	if _, err := io.ReadFull(conn, hello[len(handshakeMagic):]); err != nil {
		return fmt.Errorf("%w: %w", errNoHandshake, err)
	}
	var nonces [2 * nonceSize]byte
	copy(nonces[:nonceSize], hello[len(handshakeMagic):])
	rand.Read(nonces[nonceSize:])
	t, err := transcript(nonces[:], conn.RemoteAddr(), conn.LocalAddr())
	if err != nil {
		return err
	}
	answer := make([]byte, 0, challengeSize)
	answer = append(append(answer, nonces[nonceSize:]...), proof(keys.conn, serverLabel, t)...)
	if _, err := conn.Write(answer); err != nil {
		return fmt.Errorf("%w: %w", errNoHandshake, err)
	}
	var mac [macSize]byte
	if _, err := io.ReadFull(conn, mac[:]); err != nil {
		// A client with another token stops here, having found the server's proof wrong.
		return fmt.Errorf("%w: %w", errClientUnproven, err)
	}
	if !hmac.Equal(mac[:], proof(keys.conn, clientLabel, t)) {
		return errClientUnproven
	}
	return nil
}

// handshakeDialer dials with inner and authenticates each new connection with the handshake,
// at most maxHandshakes at once (slots, made by newHandshakeDialer).
type handshakeDialer struct {
	inner remote.Dialer
	keys  *jobKeys
	slots chan struct{}
}

// maxHandshakes bounds the connections a client dials and authenticates with its server at
// once. A server lets gate.MaxPendingPerPeer connections from one host authenticate at a time and
// closes the oldest beyond (see guardListener): a burst of calls that each need a new
// connection (a node's prefetch asks up to 16 files at once, and every server of a job on one
// host shares that host's places) had servers close the client's own connections, which
// failed their calls and got the server taken for dead. A handshake takes a round trip.
const maxHandshakes = 4

func newHandshakeDialer(inner remote.Dialer, keys *jobKeys) handshakeDialer {
	return handshakeDialer{inner: inner, keys: keys, slots: make(chan struct{}, maxHandshakes)}
}

// DialTimeout implements remote.Dialer: timeout bounds the connection and the handshake. A
// dial that finds every slot taken waits for one up to timeout, then goes ahead without: the
// slots spread a burst out, and never fail a call of it (the server evicts only beyond its
// places, and a hung server's dials end with their own timeouts).
func (d handshakeDialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	wait := time.NewTimer(timeout)
	select {
	case d.slots <- struct{}{}:
		defer func() { <-d.slots }()
	case <-wait.C:
	}
	wait.Stop()
	deadline := time.Now().Add(timeout)
	conn, err := d.inner.DialTimeout(network, address, timeout)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
			return nil, err // nothing listens: the server is down
		}
		// netpoll reports a refused connection and one closed right after it was accepted
		// (a server at its connection cap) alike, and a connect timeout as an error that
		// is no timeout. Ask the kernel once more: only nothing listening proves the server
		// down; anything else counts as a timeout.
		if perr := probeRefused(network, address, timeout); perr != nil {
			return nil, perr
		}
		return nil, &handshakeError{addr: address, err: err}
	}
	if err := clientHandshake(conn, d.keys, deadline); err != nil {
		conn.Close()
		return nil, &handshakeError{addr: address, err: err}
	}
	return conn, nil
}

// probeRefused connects to address with the standard library and returns its error if the
// connection is refused (nothing listens), else nil. It runs only after a failed dial.
func probeRefused(network, address string, timeout time.Duration) error {
	c, err := net.DialTimeout(network, address, min(timeout, 500*time.Millisecond))
	if err == nil {
		c.Close()
		return nil
	}
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
		return err
	}
	return nil
}

// handshakeError is a failed handshake. Its Timeout method lets os.IsTimeout, which Kitex
// applies to a dialer's error without unwrapping it, tell a server that did not answer in
// time (hung: count a timeout) from one that proved to be no server of the job.
type handshakeError struct {
	addr string
	err  error
}

func (e *handshakeError) Error() string { return "authenticate with " + e.addr + ": " + e.err.Error() }

func (e *handshakeError) Unwrap() error { return e.err }

// Timeout reports whether the failure is of the kind that counts towards declaring the
// server dead (see client's failure threshold) rather than proving it dead at once: the
// server did not answer the handshake in time, or closed the connection without answering
// (it had too many connections, or was stopping). A listener that answered without proving
// the job token (ErrUnproven) is not a timeout: it is not the job's server, which is down.
func (e *handshakeError) Timeout() bool {
	return !errors.Is(e.err, ErrUnproven)
}
