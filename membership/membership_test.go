package membership

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/fitcache/fitcache/gate"
)

// probe paces the tests' members: a crashed member is declared dead within a few seconds.
const probe = 100 * time.Millisecond

// names returns n member names on loopback whose gossip ports (name's port + DefaultPortOffset)
// were free a moment ago, TCP and UDP.
func names(t *testing.T, n int) []string {
	t.Helper()
	var out []string
	for len(out) < n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		u, uerr := net.ListenPacket("udp", fmt.Sprintf("127.0.0.1:%d", port))
		l.Close()
		if uerr != nil || port <= DefaultPortOffset {
			continue
		}
		u.Close()
		out = append(out, fmt.Sprintf("127.0.0.1:%d", port-DefaultPortOffset))
	}
	return out
}

// recorder keeps the changes a member reported.
type recorder struct {
	mu    sync.Mutex
	state map[string]bool
}

func (r *recorder) change(id string, alive bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state == nil {
		r.state = map[string]bool{}
	}
	r.state[id] = alive
}

func (r *recorder) is(id string, alive bool) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	a, ok := r.state[id]
	return ok && a == alive
}

func (r *recorder) heard(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.state[id]
	return ok
}

func start(t *testing.T, self string, servers []string, token string, r *recorder) *Membership {
	t.Helper()
	m, err := Start(Config{Self: self, Servers: servers, Token: token, PortOffset: DefaultPortOffset,
		ProbeInterval: probe, OnChange: r.change,
		Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// startJob starts a job of n members with the token "token" and closes them at the end of
// the test (those in ms then: a test may replace one).
func startJob(t *testing.T, n int) (ids []string, recs []*recorder, ms []*Membership) {
	t.Helper()
	ids = names(t, n)
	for _, id := range ids {
		recs = append(recs, &recorder{})
		ms = append(ms, start(t, id, ids, "token", recs[len(recs)-1]))
	}
	t.Cleanup(func() {
		for _, m := range ms {
			m.Close()
		}
	})
	return ids, recs, ms
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not in 15 s: %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func gossipAddr(t *testing.T, id string) string {
	t.Helper()
	a, err := GossipAddr(id, DefaultPortOffset)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

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

// Three servers find each other from the job's list, started in any order; one that crashes
// (stops without leaving) is declared dead by the others; started again at its address, it
// rejoins.
func TestMembersJoinAreDeclaredDeadAndRejoin(t *testing.T) {
	ids := names(t, 3)
	recs := make([]*recorder, 3)
	ms := make([]*Membership, 3)
	for i, id := range ids {
		recs[i] = &recorder{}
		ms[i] = start(t, id, ids, "token", recs[i])
	}
	defer func() {
		for _, m := range ms {
			m.Close()
		}
	}()
	waitFor(t, "every member alive at every member", func() bool {
		for i := range ms {
			if !slices.Equal(ms[i].Alive(), slices.Sorted(slices.Values(ids))) {
				return false
			}
		}
		return true
	})

	ms[2].Halt() // no leave message: the others must find out
	waitFor(t, "the crashed member declared dead", func() bool { return recs[0].is(ids[2], false) && recs[1].is(ids[2], false) })
	if got := ms[0].Dead(); !slices.Equal(got, ids[2:]) {
		t.Errorf("dead members: got %v, want %v", got, ids[2:])
	}

	ms[2] = start(t, ids[2], ids, "token", &recorder{})
	waitFor(t, "the restarted member alive again", func() bool { return recs[0].is(ids[2], true) && recs[1].is(ids[2], true) })
}

// A member whose key comes from another token can neither join nor be heard of, nor change
// what the job's members know with news of its own.
func TestAMemberWithoutTheTokenCannotJoin(t *testing.T) {
	ids := names(t, 3)
	recs := []*recorder{{}, {}, {}}
	a := start(t, ids[0], ids, "token", recs[0])
	defer a.Close()
	b := start(t, ids[1], ids, "token", recs[1])
	defer b.Close()
	waitFor(t, "the two members of the job alive", func() bool { return len(a.Alive()) == 2 && len(b.Alive()) == 2 })
	stranger := start(t, ids[2], ids, "another token", recs[2])
	defer stranger.Close()
	// Forged news, as a host without the token can only send it: b is dead, in a plain
	// memberlist user message (type 8) to a's gossip port.
	gossipOfA, err := GossipAddr(ids[0], DefaultPortOffset)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("udp", gossipOfA)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write(append([]byte{8}, deadNews(ids[1]).Message()...)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * probe) // time for the stranger's joins and gossip, and the forgery, to arrive
	if recs[0].heard(ids[2]) || recs[1].heard(ids[2]) || len(a.Alive()) != 2 || len(b.Alive()) != 2 {
		t.Errorf("the job's members took in a member without the token: %v, %v", a.Alive(), b.Alive())
	}
	if recs[0].is(ids[1], false) || len(a.Reported()) != 0 {
		t.Errorf("a member took the stranger's news: %v reported dead", a.Reported())
	}
	if got := stranger.Alive(); !slices.Equal(got, ids[2:]) {
		t.Errorf("the stranger sees %v", got)
	}
}

func TestGossipAddr(t *testing.T) {
	for _, tc := range []struct {
		id, want string
		offset   int
		ok       bool
	}{
		{"gpu001:7070", "gpu001:8070", DefaultPortOffset, true},
		{"10.0.0.1:7071", "10.0.0.1:7171", 100, true},
		{"[::1]:7070", "[::1]:8070", DefaultPortOffset, true},
		{"gpu001:65000", "", DefaultPortOffset, false},
		{"gpu001:7070", "", 0, false},
		{"gpu001", "", DefaultPortOffset, false},
	} {
		got, err := GossipAddr(tc.id, tc.offset)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("GossipAddr(%q, %d) = %q, %v", tc.id, tc.offset, got, err)
		}
	}
	if _, err := Key(""); err == nil {
		t.Error("a key without a token")
	}
	k1, _ := Key("a")
	k2, _ := Key("b")
	if len(k1) != 32 || string(k1) == string(k2) {
		t.Errorf("keys: %x, %x", k1, k2)
	}
}

// What one server's reads found (Tell) reaches the others at once, long before their probes
// would suspect anything (the member is in fact alive here).
func TestNewsFromReadsReachesTheOthers(t *testing.T) {
	ids := names(t, 3)
	recs := []*recorder{{}, {}, {}}
	var ms []*Membership
	for i, id := range ids {
		m, err := Start(Config{Self: id, Servers: ids, Token: "token", PortOffset: DefaultPortOffset,
			ProbeInterval: time.Second, OnChange: recs[i].change, Log: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		ms = append(ms, m)
	}
	waitFor(t, "every member alive at every member", func() bool {
		return len(ms[0].Alive()) == 3 && len(ms[1].Alive()) == 3 && len(ms[2].Alive()) == 3
	})
	ms[0].Tell(ids[2])
	ms[0].Tell("127.0.0.1:1") // not a server of the job: ignored
	waitFor(t, "the news at the second member", func() bool { return recs[1].is(ids[2], false) })
	if got := ms[1].Reported(); !slices.Equal(got, ids[2:]) {
		t.Errorf("reported dead at the second member: %v", got)
	}
	if recs[1].heard("127.0.0.1:1") {
		t.Error("news of a server outside the job was passed on")
	}
}

// Memberlist's word that a member is dead can be stale (a member cut off by a partition
// declared it dead, and its gossip arrives once the network heals): a member that answers
// this one's ping is kept, one that does not is declared dead, one that left is out at once.
func TestADeathIsActedOnOnlyIfTheMemberDoesNotAnswer(t *testing.T) {
	ids, recs, ms := startJob(t, 3)
	waitFor(t, "every member alive at member 0", func() bool { return len(ms[0].Alive()) == 3 })
	nodes := map[string]*memberlist.Node{}
	for _, n := range ms[0].list.Members() {
		nodes[n.Name] = n
	}

	(*events)(ms[0]).NotifyLeave(nodes[ids[1]]) // stale: member 1 runs and answers
	time.Sleep(5 * probe)                       // more than the ping's timeout
	if recs[0].is(ids[1], false) || len(ms[0].Dead()) != 0 {
		t.Errorf("a member that answers was taken for dead: %v", ms[0].Dead())
	}

	ms[2].Halt()
	(*events)(ms[0]).NotifyLeave(nodes[ids[2]]) // true, ahead of memberlist's own suspicion
	waitFor(t, "the halted member declared dead", func() bool { return recs[0].is(ids[2], false) })

	// One that leaves (Close) says so itself: out at once, though it may still answer a
	// ping while it shuts down.
	ms[1].Close()
	waitFor(t, "the member that left out", func() bool { return recs[0].is(ids[1], false) })
}

// A listed server that never joins is taken for dead once the members have been up for
// NeverJoinedAfter (so that the job's servers name it dead to new clients, which then wait
// for it no more), not before; started at last, it joins and is alive.
func TestAListedServerThatNeverJoinedIsDeadAfterAWhile(t *testing.T) {
	ids := names(t, 3)
	const after = 1500 * time.Millisecond
	recs := []*recorder{{}, {}}
	var ms []*Membership
	for i := range 2 {
		m, err := Start(Config{Self: ids[i], Servers: ids, Token: "token", PortOffset: DefaultPortOffset,
			ProbeInterval: probe, OnChange: recs[i].change, NeverJoinedAfter: after, Log: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, m)
	}
	defer func() {
		for _, m := range ms {
			m.Close()
		}
	}()
	begun := time.Now()
	waitFor(t, "the two members alive at each other", func() bool { return recs[0].is(ids[1], true) && recs[1].is(ids[0], true) })
	if d := time.Since(begun); d < after && len(ms[0].Dead()) > 0 {
		t.Errorf("dead after %s, before NeverJoinedAfter (%s): %v", d, after, ms[0].Dead())
	}
	waitFor(t, "the listed server that never started taken for dead", func() bool {
		return recs[0].is(ids[2], false) && recs[1].is(ids[2], false)
	})
	if d := time.Since(begun); d < after {
		t.Errorf("taken for dead after %s, before NeverJoinedAfter (%s)", d, after)
	}
	for i := range ms {
		if got := ms[i].Dead(); !slices.Equal(got, ids[2:]) {
			t.Errorf("member %d: dead %v, want %v", i, got, ids[2:])
		}
	}
	ms = append(ms, start(t, ids[2], ids, "token", &recorder{}))
	waitFor(t, "the late server alive at both", func() bool { return recs[0].is(ids[2], true) && recs[1].is(ids[2], true) })
	if got := ms[0].Dead(); len(got) != 0 {
		t.Errorf("dead after the late server joined: %v", got)
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
