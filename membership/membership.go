// Package membership is how the servers of a cluster job watch each other: SWIM, the protocol
// of hashicorp/memberlist (random probes, indirect probes through other members, suspicion
// before a member is declared dead, news spread by gossip), as Consul, Nomad and Serf run it.
//
// Each server is a member named by its RPC address (host:port, as the job's server list
// gives it) and gossips on the same host at that port plus an offset (GossipAddr), TCP and
// UDP; a port that stays taken (Config.BindWait) fails Start (ErrPortInUse), as a server
// without its membership would be taken for dead by the others. Every packet and stream is
// encrypted and authenticated (AES-GCM) with a key derived from the job token, so a host
// without the token can neither join nor forge news about the members. Beneath that, the
// gossip port has a layer of its own (see transport.go), with keys derived from the token
// too: a stream is authenticated by a challenge before memberlist reads a byte of it (which
// would read up to 20 MB first), with bounded places for streams authenticating (per peer
// host and in all, as the RPC port: package gate); a packet carries a stamp and a MAC bound
// to its destination, and one that is stale, replayed, or not authenticated is dropped before
// memberlist sees it. Refusals are logged at most once per peer host per 10 s, with a count.
//
// Clocks: packets are stamped with the sender's clock and refused more than 10 s
// (packetWindow) away from the receiver's, so the members' clocks must agree to within a few
// seconds, as NTP keeps the nodes of a cluster (to milliseconds). A member whose clock is off
// by more is refused by the others (their logs say by how much) and declared dead.
//
// A member that stops answering probes is suspected first and keeps its files; only once the
// suspicion times out (SuspicionMult * log10(N) probe intervals at least, less as other
// members confirm it) is it declared dead, and, once it does not answer a ping of this
// server's own either (confirmDead), the server's reads skip it (see OnChange). A
// member that answers again, or a server started later at an address of the list, rejoins.
// What a server's reads learn at once (a refused connection, replies past their deadline:
// see package routing) it tells the others (Tell), who act on it without waiting for the
// protocol's own probes; a server wrongly taken for dead that way is asked again within a
// second by each (routing's probe loop).
package membership

import (
	"crypto/hkdf"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fitcache/fitcache/gate"
	"github.com/hashicorp/memberlist"
)

// DefaultPortOffset is the default of the gossip_port_offset option: a server gossips on its
// RPC port plus this (7070 -> 8070), clear of the ports of several servers per node (7070,
// 7071, ...).
const DefaultPortOffset = 1000

// DefaultProbeInterval is how often a member probes another at random (memberlist's LAN
// default); the probe timeout is half of it, and gossip runs five times as often, or every
// 200 ms at least.
const DefaultProbeInterval = time.Second

// DefaultBindWait is how long Start waits for its gossip port while another socket holds it:
// long enough for a restarted server's previous sockets to close.
const DefaultBindWait = 10 * time.Second

// Config configures a server's membership.
type Config struct {
	Self       string   // this server's RPC address (host:port): its name
	Servers    []string // the job's servers' RPC addresses, Self included or not
	PortOffset int      // gossip port = RPC port + PortOffset (see DefaultPortOffset)
	Token      string   // the job token: the gossip keys are derived from it
	// BindWait is how long Start waits for a gossip port held by another socket before it
	// fails with ErrPortInUse (0: DefaultBindWait).
	BindWait time.Duration
	// ProbeInterval paces the protocol (0: DefaultProbeInterval); tests shorten it.
	ProbeInterval time.Duration
	// OnChange is called, one call at a time, when a member was declared dead (alive false)
	// or joined or rejoined (alive true). Members never heard of are neither.
	OnChange func(id string, alive bool)
	// NeverJoinedAfter: a listed server not heard of this long after Start is taken for dead
	// (OnChange, Dead) until it joins: it never started, or its host is gone. Servers name
	// their dead to new clients, which then wait for none of them: only the clients that start
	// with the job wait for a server that may still be starting. 0: never.
	NeverJoinedAfter time.Duration
	Log              *slog.Logger
}

// Membership is a running member. Close it to leave.
type Membership struct {
	cfg  Config
	list *memberlist.Memberlist
	log  *slog.Logger

	mu    sync.Mutex      // protects known, notes, reported and closed
	known map[string]bool // member -> alive, for the members heard of
	// notes counts memberlist's notifications per member, so that a death confirmed late
	// (confirmDead) is not recorded over a newer notification.
	notes map[string]uint64
	// recording orders record's calls (see there); never held with mu by anyone else.
	recording sync.Mutex
	// reported: servers other servers' reads found dead (Tell), when the news arrived.
	reported map[string]time.Time
	// closed stops the join loop.
	closed bool
	events chan event
	done   chan struct{}
	news   *memberlist.TransmitLimitedQueue // what this server's reads found (see Tell)
	net    *transport
}

// Traffic is what a member sent since it started: UDP packets (probes, acks, gossip) and TCP
// streams (fallback probes, state exchanges, joins).
type Traffic struct {
	Packets, Streams int64
}

// Sent returns what this member sent since it started.
func (m *Membership) Sent() Traffic {
	return Traffic{Packets: m.net.packets.Load(), Streams: m.net.streams.Load()}
}

// Refused returns how many streams and packets the gossip port refused since it started:
// not authenticated, stale or replayed, or past the limits on streams.
func (m *Membership) Refused() int64 { return m.net.refused.Load() }

type event struct {
	id    string
	alive bool
}

// GossipAddr returns the gossip address of the server at RPC address id.
func GossipAddr(id string, offset int) (string, error) {
	host, port, err := net.SplitHostPort(id)
	if err != nil {
		return "", err
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return "", fmt.Errorf("%s: port %q: %w", id, port, err)
	}
	if offset <= 0 || p+offset > 65535 {
		return "", fmt.Errorf("%s: gossip port %d (port + %d) out of range", id, p+offset, offset)
	}
	return net.JoinHostPort(host, strconv.Itoa(p+offset)), nil
}

// Key derives the gossip key from the job token: 32 bytes (AES-256), HKDF-SHA256.
func Key(token string) ([]byte, error) {
	if token == "" {
		return nil, errors.New("membership needs a job token")
	}
	return hkdf.Key(sha256.New, []byte(token), nil, "fitcache membership v1", 32)
}

// Start makes this server a member and starts joining the others (in the background, until
// one answers: servers start in any order).
func Start(cfg Config) (*Membership, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.ProbeInterval <= 0 {
		cfg.ProbeInterval = DefaultProbeInterval
	}
	key, err := Key(cfg.Token)
	if err != nil {
		return nil, err
	}
	if cfg.BindWait <= 0 {
		cfg.BindWait = DefaultBindWait
	}
	keys, err := newTransportKeys(cfg.Token)
	if err != nil {
		return nil, err
	}
	gossip, err := GossipAddr(cfg.Self, cfg.PortOffset)
	if err != nil {
		return nil, err
	}
	host, portText, _ := net.SplitHostPort(gossip)
	port, _ := strconv.Atoi(portText)
	addrs, err := resolve(host, port)
	if err != nil {
		return nil, fmt.Errorf("membership on %s: %w", gossip, err)
	}
	m := &Membership{cfg: cfg, log: cfg.Log, known: map[string]bool{}, notes: map[string]uint64{},
		reported: map[string]time.Time{},
		events:   make(chan event, 256), done: make(chan struct{})}

	c := memberlist.DefaultLANConfig()
	c.Name = cfg.Self
	c.BindAddr, c.BindPort = addrs[0].Addr().String(), port
	c.AdvertiseAddr, c.AdvertisePort = addrs[0].Addr().String(), port
	c.UDPBufferSize -= packetOverhead // the transport's layer fits in the same datagrams
	c.SecretKey = key
	c.GossipVerifyIncoming, c.GossipVerifyOutgoing = true, true
	c.ProbeInterval = cfg.ProbeInterval
	c.ProbeTimeout = cfg.ProbeInterval / 2
	c.GossipInterval = min(cfg.ProbeInterval/5, 200*time.Millisecond) // news (Tell) travels with gossip
	c.PushPullInterval = 30 * cfg.ProbeInterval
	c.GossipToTheDeadTime = 30 * cfg.ProbeInterval // then reconnect alone brings a cut-off member back
	c.DeadNodeReclaimTime = cfg.ProbeInterval      // a server restarted at its address rejoins at once
	c.Events = (*events)(m)
	c.Delegate = (*delegate)(m)
	jobSize := max(len(cfg.Servers), 1) // for how often news is retransmitted
	m.news = &memberlist.TransmitLimitedQueue{RetransmitMult: c.RetransmitMult, NumNodes: func() int { return jobSize }}
	c.Logger = log.New(&logWriter{log: cfg.Log, lines: gate.RateLog{Every: refusalEvery}}, "", 0)
	if m.net, err = listenTransport(addrs, keys, cfg.Log, cfg.BindWait); err != nil {
		return nil, fmt.Errorf("membership on %s: %w", gossip, err)
	}
	c.Transport = m.net
	list, err := memberlist.Create(c)
	if err != nil {
		m.net.Shutdown()
		return nil, fmt.Errorf("membership on %s: %w", gossip, err)
	}
	m.list = list
	go m.deliver()
	go m.join()
	go m.reconnect()
	if cfg.NeverJoinedAfter > 0 {
		go m.neverJoined(cfg.NeverJoinedAfter)
	}
	return m, nil
}

// neverJoined takes the listed servers not heard of after wait for dead (see
// Config.NeverJoinedAfter). reconnect asks them to join from then on, as it asks the dead.
func (m *Membership) neverJoined(wait time.Duration) {
	select {
	case <-m.done:
		return
	case <-time.After(wait):
	}
	for _, id := range m.cfg.Servers {
		if id == m.cfg.Self {
			continue
		}
		// Checked and recorded under recording, as record does: a join recorded meanwhile must
		// not be overwritten.
		m.recording.Lock()
		m.mu.Lock()
		_, heard := m.known[id]
		fresh := !heard && !m.closed
		if fresh {
			m.known[id] = false
		}
		m.mu.Unlock()
		if fresh && !m.listed(id) {
			m.log.Warn("listed server never joined the servers' membership: taken for dead until it joins",
				"server", id, "after", wait)
			select {
			case m.events <- event{id, false}:
			case <-m.done:
			}
		} else if fresh { // memberlist holds it: its join is being recorded
			m.mu.Lock()
			delete(m.known, id)
			m.mu.Unlock()
		}
		m.recording.Unlock()
	}
}

// reconnect asks the members declared dead, every reconnectEvery probe intervals, to join
// again. A member cut off by a partition is declared dead on both sides, and memberlist
// gossips to the dead only for a while (GossipToTheDeadTime): without this, a healed
// partition would leave two groups that never hear of each other again (as Serf's reconnect
// does for it). A member that answers exchanges state with this one, learns it was declared
// dead, refutes it, and is alive again on every member.
func (m *Membership) reconnect() {
	tick := time.NewTicker(reconnectEvery * m.cfg.ProbeInterval)
	defer tick.Stop()
	for {
		select {
		case <-m.done:
			return
		case <-tick.C:
		}
		for _, id := range m.Dead() {
			if addr, err := m.seed(id); err == nil {
				m.list.Join([]string{addr}) // a member still down refuses or times out: tried again later
			}
		}
	}
}

// seed returns the gossip address to join the member id at: the first address its host name
// resolves to (see resolve), which is where that member advertises itself, rather than the
// name, which memberlist would resolve by itself, maybe to another address first.
func (m *Membership) seed(id string) (string, error) {
	gossip, err := GossipAddr(id, m.cfg.PortOffset)
	if err != nil {
		return "", err
	}
	host, port, _ := net.SplitHostPort(gossip)
	p, _ := strconv.Atoi(port)
	addrs, err := resolve(host, p)
	if err != nil {
		return "", err
	}
	return addrs[0].String(), nil
}

// reconnectEvery: how many probe intervals apart reconnect asks the dead members.
const reconnectEvery = 5

// join contacts the other servers until one answers (then gossip does the rest), or the
// member closes. A lone server waits for the others to contact it.
func (m *Membership) join() {
	var seeds []string
	for _, id := range m.cfg.Servers {
		if id == m.cfg.Self {
			continue
		}
		if addr, err := m.seed(id); err == nil {
			seeds = append(seeds, addr)
		}
	}
	if len(seeds) == 0 {
		return
	}
	// A server that found none up waits at most a few probe intervals before it tries again:
	// no other member knows of it until it joins (with a 30-interval cap, one of 64
	// servers started at once took 80 s to be seen by all: bench/membership).
	for wait := m.cfg.ProbeInterval; ; wait = min(2*wait, 4*m.cfg.ProbeInterval) {
		// One member that answers is enough: gossip and the state exchange with it bring the
		// rest (memberlist's Join with every seed exchanges state with each: N-1 streams per
		// member, N squared for the job). Every server tries the job's servers in the list's
		// order, so that all join through the first that is up and none forms a group of
		// its own with others that the rest never hear of.
		for _, seed := range seeds {
			m.mu.Lock()
			closed := m.closed
			m.mu.Unlock()
			if closed {
				return
			}
			if n, err := m.list.Join([]string{seed}); err == nil && n > 0 {
				return
			}
		}
		select {
		case <-m.done:
			return
		case <-time.After(wait):
		}
	}
}

// events receives memberlist's notifications (on its own goroutines) and queues them, so
// that OnChange runs one call at a time and never blocks the protocol.
type events Membership

func (e *events) NotifyJoin(n *memberlist.Node)   { (*Membership)(e).note(n, true) }
func (e *events) NotifyLeave(n *memberlist.Node)  { (*Membership)(e).note(n, false) }
func (e *events) NotifyUpdate(n *memberlist.Node) {}

// note records that memberlist took a member for alive or dead (or left). A death is acted on
// only once this member's own ping gets no answer (see confirmDead), in the background:
// memberlist calls note from its protocol's goroutines, which must not wait.
func (m *Membership) note(n *memberlist.Node, alive bool) {
	if n.Name == m.cfg.Self {
		return
	}
	m.mu.Lock()
	m.notes[n.Name]++
	note := m.notes[n.Name]
	m.mu.Unlock()
	if alive {
		m.record(n.Name, true, 0)
		return
	}
	go m.confirmDead(n.Name, &net.UDPAddr{IP: n.Addr, Port: int(n.Port)}, note)
}

// confirmDead acts on memberlist's word that a member is dead (or left) once the member does
// not answer a ping of this one. The word can be stale: a member cut off by a partition
// declares the others dead one after another, and once the network heals its last
// declarations still wait in its gossip queue; memberlist applies them as they arrive, and a
// healthy server is dead everywhere until it hears of it and refutes it (one of 16 healthy
// servers went so at a healed partition, its files read from the source meanwhile:
// docs/BENCHMARKS.md section 11). While the member answers, this asks again every probe
// interval, until memberlist takes it back (it refuted) or a later notification came; a
// member that left answers until it has shut down. One that answers but stays dead is asked
// for a state exchange (which makes it refute), and after a minute left alive here. A
// member really gone costs this member one probe timeout more.
func (m *Membership) confirmDead(id string, addr net.Addr, note uint64) {
	for tries := 0; ; tries++ {
		if _, err := m.list.Ping(id, addr); err != nil {
			break
		}
		switch {
		case tries == 0:
			m.log.Info("server declared dead by another member answers this one: kept", "server", id)
		case tries == confirmJoinAfter:
			// It answers pings but has not refuted its death: it may not have heard of it.
			// A state exchange tells it (it refutes) or brings it back here.
			m.list.Join([]string{addr.String()})
		case tries == confirmGiveUp:
			m.log.Warn("server declared dead answers pings but never came back: kept; reads find it if it is gone",
				"server", id)
			return
		}
		select {
		case <-m.done:
			return
		case <-time.After(m.cfg.ProbeInterval):
		}
		m.mu.Lock()
		newer := m.notes[id] != note
		m.mu.Unlock()
		if newer || m.listed(id) {
			return
		}
	}
	if !m.listed(id) { // memberlist may have taken it back while the ping waited
		m.record(id, false, note)
	}
}

// Bounds of confirmDead for a member declared dead that goes on answering pings, in probe
// intervals: when it is asked for a state exchange, and when it is left alone.
const (
	confirmJoinAfter = 3
	confirmGiveUp    = 60
)

// listed reports whether memberlist holds the member alive (or suspected).
func (m *Membership) listed(id string) bool {
	return slices.ContainsFunc(m.list.Members(), func(n *memberlist.Node) bool { return n.Name == id })
}

// record notes a member's state and, if it changed, logs it and queues it for OnChange. A
// death confirmed in the background (note not 0) is dropped if memberlist said anything of
// the member since.
func (m *Membership) record(id string, alive bool, note uint64) {
	// One record at a time, from its check to its event: a death confirmed late must not
	// reach OnChange after the rejoin that came after it.
	m.recording.Lock()
	defer m.recording.Unlock()
	m.mu.Lock()
	if note != 0 && m.notes[id] != note {
		m.mu.Unlock()
		return
	}
	was, heard := m.known[id]
	m.known[id] = alive
	closed := m.closed
	m.mu.Unlock()
	if closed || (heard && was == alive) {
		return
	}
	if alive {
		m.log.Info("server joined", "server", id)
	} else {
		m.log.Warn("server declared dead by the servers' membership", "server", id)
	}
	select {
	case m.events <- event{id, alive}:
	case <-m.done:
	}
}

// Tell spreads what this server's reads found: the server id is dead. The others act on it at
// once (OnChange), without waiting for their probes to suspect it.
func (m *Membership) Tell(id string) {
	if id == m.cfg.Self {
		return
	}
	m.news.QueueBroadcast(deadNews(id))
}

// deadNews is a broadcast that a server's reads found the server dead.
type deadNews string

const deadNewsTag = 'D'

func (n deadNews) Message() []byte { return append([]byte{deadNewsTag}, n...) }
func (n deadNews) Finished()       {}
func (n deadNews) Invalidates(other memberlist.Broadcast) bool {
	o, ok := other.(deadNews)
	return ok && o == n
}

// delegate carries Tell's news in memberlist's gossip (encrypted like the rest).
type delegate Membership

func (d *delegate) NodeMeta(limit int) []byte { return nil }
func (d *delegate) NotifyMsg(b []byte) {
	if len(b) > 1 && b[0] == deadNewsTag {
		(*Membership)(d).heard(string(b[1:]))
	}
}
func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte {
	return d.news.GetBroadcasts(overhead, limit)
}
func (d *delegate) LocalState(join bool) []byte            { return nil }
func (d *delegate) MergeRemoteState(buf []byte, join bool) {}

// heard passes on another server's news that id is dead, if it is a server of the job.
func (m *Membership) heard(id string) {
	if id == m.cfg.Self || !slices.Contains(m.cfg.Servers, id) {
		return
	}
	m.mu.Lock()
	closed := m.closed
	last, again := m.reported[id]
	fresh := !again || now().Sub(last) > reportedFor/2
	if fresh {
		m.reported[id] = now()
	}
	m.mu.Unlock()
	if closed || !fresh {
		return // heard lately: passed on already
	}
	m.log.Warn("server found dead by another server's reads", "server", id)
	// Pass it on, as memberlist passes on its own news: a member sends a broadcast only a
	// few times (retransmitMult * log10(N+1)), to random members.
	m.news.QueueBroadcast(deadNews(id))
	select {
	case m.events <- event{id, false}:
	case <-m.done:
	}
}

// deliver calls OnChange for each queued event, in order.
func (m *Membership) deliver() {
	for {
		select {
		case ev := <-m.events:
			if m.cfg.OnChange != nil {
				m.cfg.OnChange(ev.id, ev.alive)
			}
		case <-m.done:
			return
		}
	}
}

// Dead returns the members heard of that are dead now, sorted.
func (m *Membership) Dead() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for id, alive := range m.known {
		if !alive {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

// Reported returns the servers other servers' reads found dead (see Tell) in the last
// reportedFor, sorted.
func (m *Membership) Reported() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for id, at := range m.reported {
		if now().Sub(at) < reportedFor {
			out = append(out, id)
		} else {
			delete(m.reported, id)
		}
	}
	slices.Sort(out)
	return out
}

// reportedFor is how long Reported lists a server after the last news of it.
const reportedFor = time.Minute

// Alive returns the members alive now, this one included, sorted.
func (m *Membership) Alive() []string {
	var out []string
	for _, n := range m.list.Members() {
		out = append(out, n.Name)
	}
	slices.Sort(out)
	return out
}

// Halt stops this member without telling the others, as a crashed or hung server stops
// answering: for benchmarks and tests of failure detection.
func (m *Membership) Halt() {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return
	}
	m.closed = true
	m.mu.Unlock()
	close(m.done)
	m.list.Shutdown()
}

// Close leaves the job (the others learn it at once instead of suspecting this member) and
// stops.
func (m *Membership) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	m.mu.Unlock()
	close(m.done)
	err := m.list.Leave(m.cfg.ProbeInterval)
	return errors.Join(err, m.list.Shutdown())
}

// logWriter passes memberlist's log lines to slog: its warnings and errors at warning level,
// at most one line of a kind per refusalEvery (lines are of a kind when they differ only in
// numbers: addresses, ports, sizes), with the number of lines of that kind left out since;
// the rest (debug) at debug level.
type logWriter struct {
	log   *slog.Logger
	lines gate.RateLog
}

func (w *logWriter) Write(p []byte) (int, error) {
	line := strings.TrimSpace(string(p))
	switch {
	case strings.Contains(line, "[ERR]"), strings.Contains(line, "[WARN]"):
		if write, suppressed := w.lines.Allow(kindOf(line)); write {
			w.log.Warn("membership: "+line, "suppressed_since_last", suppressed)
		}
	default:
		w.log.Debug("membership: " + line)
	}
	return len(p), nil
}

// kindOf returns line without its digits, at most 80 bytes of it: what lines of a kind share.
func kindOf(line string) string {
	k := strings.Map(func(r rune) rune {
		if r >= '0' && r <= '9' {
			return -1
		}
		return r
	}, line)
	return k[:min(len(k), 80)]
}

var _ io.Writer = (*logWriter)(nil)
