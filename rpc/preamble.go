package rpc

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/cloudwego/kitex/pkg/remote"
)

// The authentication preamble a client sends on every new connection to a server that has a
// job token, before any Thrift frame:
//
//	"FCT1" | token length (uint16, big endian) | token
//
// The server answers one byte, preambleOK or preambleRefused, and closes the connection after
// a refusal. A server without a token expects no preamble, and a client without a token sends
// none.
const (
	preambleMagic    = "FCT1"
	maxTokenBytes    = 1024 // longest token a preamble carries
	preambleOK       = 'A'
	preambleRefused  = 'R'
	preambleOverhead = len(preambleMagic) + 2
)

// ErrTokenRefused reports a connection the server closed because the job token in its
// preamble was wrong or missing.
var ErrTokenRefused = errors.New("fitcache: the server refused the job token")

// errBadPreamble reports a connection that did not start with a well-formed preamble.
var errBadPreamble = errors.New("no authentication preamble")

// writePreamble sends the preamble for token on conn.
func writePreamble(conn io.Writer, token string) error {
	if len(token) > maxTokenBytes {
		return fmt.Errorf("job token longer than %d bytes", maxTokenBytes)
	}
	b := make([]byte, 0, preambleOverhead+len(token))
	b = append(b, preambleMagic...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(token)))
	b = append(b, token...)
	_, err := conn.Write(b)
	return err
}

// readPreamble reads a preamble from conn (at most preambleOverhead+maxTokenBytes bytes) and
// reports whether it carries the token whose SHA-256 digest is want.
func readPreamble(conn io.Reader, want [sha256.Size]byte) (bool, error) {
	var head [preambleOverhead]byte
	if _, err := io.ReadFull(conn, head[:]); err != nil {
		return false, fmt.Errorf("%w: %w", errBadPreamble, err)
	}
	if string(head[:len(preambleMagic)]) != preambleMagic {
		return false, errBadPreamble
	}
	n := int(binary.BigEndian.Uint16(head[len(preambleMagic):]))
	if n > maxTokenBytes {
		return false, fmt.Errorf("%w: token of %d bytes", errBadPreamble, n)
	}
	token := make([]byte, n)
	if _, err := io.ReadFull(conn, token); err != nil {
		return false, fmt.Errorf("%w: %w", errBadPreamble, err)
	}
	// Digests have the same length whatever the token's: the comparison leaks nothing.
	got := sha256.Sum256(token)
	return subtle.ConstantTimeCompare(got[:], want[:]) == 1, nil
}

// preambleDialer dials with inner and authenticates each new connection with the preamble.
type preambleDialer struct {
	inner remote.Dialer
	token string
}

// DialTimeout implements remote.Dialer: timeout bounds the connection and the preamble.
func (d preambleDialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
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
	if err := handshake(conn, d.token, deadline); err != nil {
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

// handshakeError is a failed preamble exchange. Its Timeout method lets os.IsTimeout, which
// Kitex applies to a dialer's error without unwrapping it, tell a server that did not answer
// in time (hung: count a timeout) from one that closed the connection.
type handshakeError struct {
	addr string
	err  error
}

func (e *handshakeError) Error() string { return "authenticate to " + e.addr + ": " + e.err.Error() }

func (e *handshakeError) Unwrap() error { return e.err }

// Timeout reports whether the failure is of the kind that counts towards declaring the
// server dead (see client's failure threshold) rather than proving it dead at once: the
// server did not answer the preamble in time, or closed the connection without answering
// (it had too many connections, or was stopping). A refused token is not a timeout; a
// server that is down refuses the connection before any preamble is sent.
func (e *handshakeError) Timeout() bool {
	return !errors.Is(e.err, ErrTokenRefused)
}

func handshake(conn net.Conn, token string, deadline time.Time) error {
	if err := conn.SetDeadline(deadline); err != nil {
		return err
	}
	if err := writePreamble(conn, token); err != nil {
		return err
	}
	var ack [1]byte
	if _, err := io.ReadFull(conn, ack[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return fmt.Errorf("server closed the connection during authentication: %w", err)
		}
		return err
	}
	if ack[0] != preambleOK {
		return ErrTokenRefused
	}
	return conn.SetDeadline(time.Time{})
}
