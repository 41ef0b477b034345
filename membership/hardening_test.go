package membership

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fitcache/fitcache/gate"
)

// warnings is a slog handler that counts warnings (and worse).
type warnings struct{ n atomic.Int64 }

func (w *warnings) Enabled(context.Context, slog.Level) bool { return true }
func (w *warnings) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		w.n.Add(1)
	}
	return nil
}
func (w *warnings) WithAttrs([]slog.Attr) slog.Handler { return w }
func (w *warnings) WithGroup(string) slog.Handler      { return w }

func gossipAddr(t *testing.T, id string) string {
	t.Helper()
	a, err := GossipAddr(id, DefaultPortOffset)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

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

// Memberlist's own warnings of a kind (differing only in addresses and numbers) are written
// at most once per interval, with the number left out.
func TestMemberlistWarningsAreRateLimited(t *testing.T) {
	var logs warnings
	w := &logWriter{log: slog.New(&logs), lines: gate.RateLog{Every: time.Hour}}
	for i := range 100 {
		w.Write([]byte("[WARN] memberlist: Got ping for unexpected node from=10.0.0." + string(rune('0'+i%10)) + ":8070\n"))
	}
	w.Write([]byte("[ERR] memberlist: Failed to send something else\n"))
	if got := logs.n.Load(); got != 2 {
		t.Errorf("got %d lines, want 2 (one per kind)", got)
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

// A gossip port that another socket holds fails Start once BindWait has passed, with an error
// that names the port and its holder; one freed meanwhile is taken. Before, Start failed at
// once, and the server ran without its membership.
func TestATakenGossipPortFailsStart(t *testing.T) {
	ids := names(t, 1)
	addr := gossipAddr(t, ids[0])
	taken, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	cfg := Config{Self: ids[0], Servers: ids, Token: "token", PortOffset: DefaultPortOffset, ProbeInterval: probe,
		BindWait: 300 * time.Millisecond, Log: slog.New(slog.DiscardHandler)}
	if m, err := Start(cfg); err == nil {
		m.Close()
		t.Fatal("Start on a taken port")
	} else if !errors.Is(err, ErrPortInUse) || !strings.Contains(err.Error(), addr) ||
		!strings.Contains(err.Error(), "held by uid "+strconv.Itoa(os.Getuid())) {
		t.Errorf("got %v, want ErrPortInUse naming %s and uid %d", err, addr, os.Getuid())
	}

	cfg.BindWait = 10 * time.Second
	freed := time.AfterFunc(200*time.Millisecond, func() { taken.Close() })
	defer freed.Stop()
	m, err := Start(cfg)
	if err != nil {
		t.Fatalf("Start on a port freed within BindWait: %v", err)
	}
	m.Close()
}

// Members named by host name (as a job's server list names them) gossip on the address the
// name resolves to. Before, memberlist took the name for an address it could not parse, and
// no member started.
func TestMembersNamedByHostNameJoin(t *testing.T) {
	ips, err := net.DefaultResolver.LookupNetIP(t.Context(), "ip4", "localhost")
	if err != nil || len(ips) == 0 || !ips[0].IsLoopback() {
		t.Skipf("localhost does not resolve to a loopback IPv4 address here: %v %v", ips, err)
	}
	ids := names(t, 2)
	for i, id := range ids {
		ids[i] = strings.Replace(id, "127.0.0.1", "localhost", 1)
	}
	recs := []*recorder{{}, {}}
	a := start(t, ids[0], ids, "token", recs[0])
	defer a.Close()
	b := start(t, ids[1], ids, "token", recs[1])
	defer b.Close()
	waitFor(t, "both members alive at both", func() bool { return recs[0].is(ids[1], true) && recs[1].is(ids[0], true) })
}

// A member named by a host name of two families (::1 and 127.0.0.1) holds its gossip port on
// both, so that no other user can take it on the one left free and meet the members that
// resolve the name to it; a port already taken on either fails the start. Before, the member
// bound the first IPv4 address alone.
func TestANameOfTwoFamiliesIsHeldOnBoth(t *testing.T) {
	if ln, err := net.Listen("tcp", "[::1]:0"); err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	} else {
		ln.Close()
	}
	lookupHost = func(context.Context, string) ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("::1"), netip.MustParseAddr("127.0.0.1")}, nil
	}
	defer func() { lookupHost = nil }()
	ids := names(t, 2)
	for i, id := range ids {
		ids[i] = strings.Replace(id, "127.0.0.1", "twofamilies.invalid", 1)
	}
	recs := []*recorder{{}, {}}
	a := start(t, ids[0], ids, "token", recs[0])
	defer a.Close()
	_, port, _ := net.SplitHostPort(gossipAddr(t, ids[0]))
	v6 := net.JoinHostPort("::1", port)
	if ln, err := net.Listen("tcp", v6); err == nil {
		ln.Close()
		t.Errorf("another socket bound %s (TCP), the member's gossip port on the name's IPv6 address", v6)
	}
	if c, err := net.ListenPacket("udp", v6); err == nil {
		c.Close()
		t.Errorf("another socket bound %s (UDP), the member's gossip port on the name's IPv6 address", v6)
	}
	b := start(t, ids[1], ids, "token", recs[1])
	defer b.Close()
	waitFor(t, "both members alive at both", func() bool { return recs[0].is(ids[1], true) && recs[1].is(ids[0], true) })

	// A third member whose port another socket holds on the IPv6 address does not start.
	third := names(t, 1)[0]
	third = strings.Replace(third, "127.0.0.1", "twofamilies.invalid", 1)
	_, tport, _ := net.SplitHostPort(gossipAddr(t, third))
	squatter, err := net.ListenPacket("udp", net.JoinHostPort("::1", tport))
	if err != nil {
		t.Fatal(err)
	}
	defer squatter.Close()
	cfg := Config{Self: third, Servers: append(ids, third), Token: "token", PortOffset: DefaultPortOffset,
		ProbeInterval: probe, BindWait: 300 * time.Millisecond, Log: slog.New(slog.DiscardHandler)}
	if m, err := Start(cfg); err == nil {
		m.Close()
		t.Error("Start while another socket holds the gossip port on the name's IPv6 address")
	} else if !errors.Is(err, ErrPortInUse) || !strings.Contains(err.Error(), "[::1]:"+tport) {
		t.Errorf("got %v, want ErrPortInUse naming [::1]:%s", err, tport)
	}
}
