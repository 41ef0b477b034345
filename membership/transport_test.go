package membership

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"github.com/fitcache/fitcache/gate"
)

// heapObjects returns the bytes of live heap objects, after a collection.
func heapObjects() uint64 {
	runtime.GC()
	sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(sample)
	return sample[0].Value.Uint64()
}

// Streams that announce a 20 MB message (memberlist's limit) and send 19 MiB of it, as
// anyone who reaches the gossip port can, make the member hold nothing: each is closed after
// its first 32 bytes, which do not answer the challenge. Before, memberlist read each into
// memory before it tried to decrypt it (5 such streams cost the member 144 MB, 40 killed it).
func TestStreamsAnnouncing20MBAreClosedBeforeTheyAreRead(t *testing.T) {
	ids := names(t, 1)
	m := start(t, ids[0], ids, "token", &recorder{})
	defer m.Close()
	const streams, announced, sent = 5, 20 << 20, 19 << 20
	before := heapObjects()
	var wg sync.WaitGroup
	var mu sync.Mutex // protects conns
	var conns []net.Conn
	chunk := make([]byte, 1<<20)
	for range streams {
		wg.Go(func() {
			c, err := net.DialTimeout("tcp", gossipAddr(t, ids[0]), 2*time.Second)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			c.SetWriteDeadline(time.Now().Add(5 * time.Second))
			header := binary.BigEndian.AppendUint32([]byte{10}, announced) // memberlist's encryptMsg and a length
			if _, err := c.Write(header); err != nil {
				return
			}
			for n := 0; n < sent; n += len(chunk) {
				if _, err := c.Write(chunk); err != nil {
					return // closed by the member: what should happen
				}
			}
		})
	}
	wg.Wait()
	grown := int64(heapObjects()) - int64(before) // with the streams still open
	for _, c := range conns {
		c.Close()
	}
	if grown > 16<<20 {
		t.Errorf("the member's heap grew by %d MiB for %d streams announcing %d MiB", grown>>20, streams, announced>>20)
	}
	if got := m.Refused(); got < streams {
		t.Errorf("refused streams: got %d, want %d", got, streams)
	}
}

// Streams that never authenticate take only the places of their host (gate.Pending): past
// them, the oldest is closed at once, not after the challenge's deadline; and a member of the
// job on the same host still joins and stays alive meanwhile. Before, every stream was
// handed to memberlist, which held each for 10 s.
func TestUnauthenticatedStreamsTakeOnlyTheirHostsPlaces(t *testing.T) {
	pendingKeyOf = func(c net.Conn) string { return gate.PeerHost(c.RemoteAddr()) } // peers by host, not by user
	t.Cleanup(func() { pendingKeyOf = gate.PeerKey })
	ids := names(t, 2)
	recs := []*recorder{{}, {}}
	a := start(t, ids[0], ids, "token", recs[0])
	defer a.Close()
	addr := gossipAddr(t, ids[0])
	dial := func() net.Conn {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(time.Second))
		var challenge [len(streamMagic) + nonceSize]byte
		if _, err := io.ReadFull(c, challenge[:]); err != nil { // accepted: the member spoke first
			t.Fatalf("no challenge: %v", err)
		}
		return c
	}
	var flood []net.Conn
	defer func() {
		for _, c := range flood {
			c.Close()
		}
	}()
	for range 2 * gate.MaxPendingPerPeer {
		flood = append(flood, dial()) // silent
	}
	for i, c := range flood[:gate.MaxPendingPerPeer] {
		c.SetReadDeadline(time.Now().Add(time.Second)) // well within the challenge's 2 s
		if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("stream %d of the flood is still open past its host's places: %v", i, err)
		}
	}
	if got := a.net.admit.Pending.Len(); got > gate.MaxPendingPerPeer {
		t.Errorf("streams authenticating: got %d, want at most %d", got, gate.MaxPendingPerPeer)
	}

	// The flood goes on while a member joins from the same host.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for range 1000 {
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
			if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
				defer c.Close()
			}
		}
	})
	b := start(t, ids[1], ids, "token", recs[1])
	defer b.Close()
	waitFor(t, "the member joined during the flood", func() bool { return recs[0].is(ids[1], true) && recs[1].is(ids[0], true) })
	time.Sleep(20 * probe) // probes and state exchanges go on
	close(stop)
	wg.Wait()
	if len(a.Dead()) != 0 || len(b.Dead()) != 0 {
		t.Errorf("members declared dead during the flood: %v, %v", a.Dead(), b.Dead())
	}
}

// Junk sent to the gossip port (packets without the job token) writes at most a line per
// host per interval, with a count. Before, each packet wrote a warning: 5 s of junk wrote
// 15 to 32 MB of log.
func TestJunkPacketsAreLoggedOncePerHostPerInterval(t *testing.T) {
	ids := names(t, 1)
	var logs warnings
	m, err := Start(Config{Self: ids[0], Servers: ids, Token: "token", PortOffset: DefaultPortOffset,
		ProbeInterval: probe, Log: slog.New(&logs)})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	conn, err := net.Dial("udp", gossipAddr(t, ids[0]))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	const junk = 500
	r := rand.New(rand.NewPCG(1, 2))
	for i := range junk {
		p := make([]byte, 1+r.IntN(1400))
		for j := range p {
			p[j] = byte(r.Uint32())
		}
		p[0] = byte(i % 16) // memberlist's message types among them, and the layer's version
		if _, err := conn.Write(p); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the junk refused", func() bool { return m.Refused() >= junk })
	if got := logs.n.Load(); got > 2 {
		t.Errorf("%d warnings for %d junk packets, want at most 2", got, junk)
	}
}

// Gossip recorded on its way to a member and played again to it, at once or later (here 31 s
// later, as every member's clock is moved on), is dropped and changes nothing: the news of a
// server's reads that a healthy member is dead, which took that member out again each time
// it was played (every 30 s, after which a member takes the same news as fresh), and every
// probe and ack with it.
func TestReplayedGossipIsDroppedAndTakesNoHealthyMemberOut(t *testing.T) {
	ids, recs, ms := startJob(t, 3)
	t.Cleanup(func() { clockSkew.Store(0) })
	waitFor(t, "every member alive at every member", func() bool {
		return len(ms[0].Alive()) == 3 && len(ms[1].Alive()) == 3 && len(ms[2].Alive()) == 3
	})

	// Record what member 0 sends to member 1 while it spreads news that member 2 is dead.
	toB := gossipAddr(t, ids[1])
	var mu sync.Mutex // protects recorded
	var recorded [][]byte
	capture := func(p []byte, to string) {
		if to == toB {
			mu.Lock()
			recorded = append(recorded, bytes.Clone(p))
			mu.Unlock()
		}
	}
	ms[0].net.capture.Store(&capture)
	ms[0].Tell(ids[2])
	waitFor(t, "the news at member 1", func() bool { return recs[1].is(ids[2], false) })
	waitFor(t, "the news spread and no longer sent", func() bool {
		return ms[0].news.NumQueued() == 0 && ms[1].news.NumQueued() == 0 && ms[2].news.NumQueued() == 0
	})
	ms[0].net.capture.Store(nil)
	recs[1].change(ids[2], true) // member 2 was healthy all along: as its client would find
	mu.Lock()
	replay := recorded
	mu.Unlock()
	if len(replay) == 0 {
		t.Fatal("nothing recorded")
	}

	conn, err := net.Dial("udp", toB)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, when := range []struct {
		name string
		skew time.Duration
	}{{"at once", 0}, {"31 s later", 31 * time.Second}} {
		clockSkew.Store(int64(when.skew))
		refused := ms[1].Refused()
		for _, p := range replay {
			conn.Write(p)
		}
		waitFor(t, "the replayed packets refused "+when.name, func() bool {
			return ms[1].Refused() >= refused+int64(len(replay))
		})
		time.Sleep(5 * probe) // for anything that got through to act
		if !recs[1].is(ids[2], true) {
			t.Errorf("gossip played again %s took a healthy member out", when.name)
		}
	}
	if got := len(ms[1].Alive()); got != 3 {
		t.Errorf("member 1 sees %d members alive, want 3", got)
	}
}
