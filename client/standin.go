// The stand-in node socket. A process that opens a client in cluster mode and then forks its
// readers (the main process of a PyTorch DataLoader, whose workers are forked every epoch)
// hands them its client's C hit path, which reads the node's tiers itself and asks a node
// socket for the rest; the readers cannot enter Go (no Go runtime survives fork). While a
// server of the job on the node answers, that is the server's node socket. When none does (a
// node without a server of the job, or one whose servers died), the process serves a node
// socket of its own, the stand-in: it reads what the readers ask for as the client reads it
// (other nodes' files from their servers over the ring, the tiers of the node's dead servers
// once checked, or the node's server after all if it answers again), so that the forked readers fail over as a reader with its own client does
// instead of reading the source. The socket is in the user's private runtime directory, and
// answers processes of this user only (see nodesock.Listen).

package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/nodesock"
)

// standIn is a client's stand-in node socket, served from the first time it is needed until
// the client closes.
type standIn struct {
	mu     sync.Mutex // protects server, path and closed
	server *nodesock.Server
	path   string
	closed bool
}

// standInReads bounds the files of one batch that the stand-in reads at once.
const standInReads = 16

// sunPathMax is the longest path a Unix socket can have (sun_path, with its NUL byte).
const sunPathMax = 107

// ForkedReaders returns the node socket that readers forked from this process are to ask for
// what the tiers do not hold (see fcHitUseStandIn): "" for the node socket of the node's
// server that the client's readers use, when it answers, else the client's stand-in,
// started now if need be. inCluster is false
// outside cluster mode (the embedded server: nothing to choose).
func (c *Client) ForkedReaders() (socket string, inCluster bool, err error) {
	if c.node == nil && c.cluster == nil {
		return "", false, nil
	}
	if c.node != nil && c.node.answering() {
		return "", true, nil
	}
	socket, err = c.standIn.serve(c)
	return socket, true, err
}

// serve starts the stand-in for c unless it runs, and returns its path.
func (s *standIn) serve(c *Client) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.server != nil {
		return s.path, nil
	}
	if s.closed {
		return "", core.ErrClosed
	}
	if err := embedded.PrepareDir(c.cfg.RuntimeDir); err != nil {
		return "", err
	}
	removeStaleStandIns(c.cfg.RuntimeDir)
	var b [6]byte
	rand.Read(b[:])
	path := filepath.Join(c.cfg.RuntimeDir, fmt.Sprintf("standin-%d-%s.node", os.Getpid(), hex.EncodeToString(b[:])))
	if len(path) > sunPathMax {
		return "", fmt.Errorf("stand-in node socket: %s is longer than a socket path can be (%d bytes): set a shorter runtime_dir",
			path, sunPathMax)
	}
	server, err := nodesock.Listen(path, nodesock.Config{OpenMany: c.standInOpenMany, Errno: core.Errno, Log: c.log})
	if err != nil {
		return "", fmt.Errorf("stand-in node socket: %w", err)
	}
	c.log.Warn("no fitcache server of this node answers; readers forked from this process read through it",
		"socket", path)
	s.server, s.path = server, path
	return path, nil
}

// removeStaleStandIns removes the stand-in sockets in dir that nothing listens on any more
// (their process was killed before its client closed, which removes its socket). A socket
// is stale when a connection to it is refused, not when its name's process id is free: the
// runtime directory may be shared by processes of other PID namespaces.
func removeStaleStandIns(dir string) {
	names, _ := filepath.Glob(filepath.Join(dir, "standin-*.node"))
	for _, name := range names {
		conn, err := net.DialTimeout("unix", name, nodesock.ProbeTimeout)
		if err == nil {
			conn.Close()
			continue
		}
		if errors.Is(err, syscall.ECONNREFUSED) {
			os.Remove(name)
		}
	}
}

// close stops the stand-in, waiting for the requests in progress; none starts after it.
func (s *standIn) close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.server == nil {
		return nil
	}
	err := s.server.Close()
	s.server = nil
	return err
}

// standInOpenMany answers a forked reader's batch (nodesock.OpOpenMany): each file as the
// client reads it around the node's servers, its bytes inline, or in a memory file when larger
// than nodesock.MaxInline; a file's error is that file's only.
func (c *Client) standInOpenMany(ctx context.Context, root string, paths []string) []nodesock.Opened {
	out := make([]nodesock.Opened, len(paths))
	if root != c.root {
		err := &core.ErrnoError{Errno: syscall.EACCES, Message: fmt.Sprintf("fitcache: this node socket serves %s only", c.root)}
		for i := range out {
			out[i].Err = err
		}
		return out
	}
	nodesock.Each(len(paths), standInReads, func(i int) {
		if ctx.Err() != nil {
			out[i].Err = ctx.Err()
			return
		}
		out[i] = c.standInOpen(paths[i])
	})
	return out
}

// standInOpen reads one file of a forked reader's batch (see standInOpenMany).
func (c *Client) standInOpen(path string) nodesock.Opened {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed.Load() {
		return nodesock.Opened{Err: core.ErrClosed}
	}
	// As the client reads: through the node's server when it answers after all (a hello
	// that timed out under load makes a stand-in too, which must then cost a hop, not
	// source reads), else around it.
	buf, err := c.read(path)
	if err != nil {
		c.counts.errors.Add(1)
		return nodesock.Opened{Err: err}
	}
	data := buf.Bytes()
	if data == nil {
		data = []byte{} // an empty file: no bytes inline, which is not no answer (nil)
	}
	if len(data) <= nodesock.MaxInline {
		return nodesock.Opened{Data: data, Origin: uint32(core.OriginPeer), Release: func() { buf.Release() }}
	}
	f, err := nodesock.MemFile(path, data, 0)
	buf.Release()
	if err != nil {
		return nodesock.Opened{Err: err}
	}
	return nodesock.Opened{File: f, Origin: uint32(core.OriginPeer)}
}
