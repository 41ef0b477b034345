package membership

import (
	"bytes"
	"context"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/gate"
	"github.com/hashicorp/memberlist"
)

// The gossip port's own layer, under memberlist's encryption (which stays), so that a peer
// without the job token can make a member hold or log little, and recorded gossip cannot be
// played again.
//
// Streams (TCP) are authenticated before memberlist reads a byte of them, since memberlist
// reads a whole message (up to 20 MB) before it decrypts it:
//
//	acceptor → dialer   "FCG1" | nonce (32 bytes, fresh)
//	dialer → acceptor   HMAC-SHA256(stream key, streamLabel | 0 | nonce | endpoint(acceptor))
//
// where endpoint is the acceptor's address as the dialer connected to it: its IPv6 address
// (16 bytes, IPv4 mapped) and port (2 bytes, big endian). The acceptor reads those 32 bytes
// within handshakeTimeout, checks them in constant time against its own local address, and
// only then hands the stream to memberlist; a peer without the token is closed after sending
// 32 bytes. Binding the proof to the acceptor's address defeats a relay: whoever holds the
// gossip port of a member that is down, and relays a dialer's proof to a live member, offers
// a proof for its own address, which the live member refuses. As on the RPC port, address
// translation between the nodes of a job is therefore not supported. The acceptor does not
// prove itself to the dialer: what the dialer sends is memberlist's encrypted message, of no
// use to a listener without the token, whose answer fails memberlist's decryption.
//
// Streams still authenticating hold places of gate.Pending (16 per peer host or other user of
// this host, 128 in all, and 128 of its own for the member's own user); a new one past its
// share closes the oldest. At most maxStreams streams are open
// at once, authenticating or handed to memberlist: past that, new ones are closed at once.
//
// Packets (UDP) carry a stamp and a MAC, checked before memberlist sees them:
//
//	version (1 byte, 1) | stamp (8 bytes: Unix nanoseconds, big endian) | payload | MAC (32 bytes)
//	MAC = HMAC-SHA256(packet key, packetLabel | 0 | endpoint(destination) | stamp | payload)
//
// The destination is the receiver's gossip address as the sender resolved it (members send
// to the addresses members advertise, which is what a receiver checks against), so that a
// packet recorded on its way to one member is no news to another. A sender's stamps
// increase strictly. A receiver drops a packet whose MAC is wrong, whose stamp is more than
// packetWindow away from its own clock, or that it took already (replays, see replayCache;
// a member that restarts forgets what it took, so a packet recorded within packetWindow
// before could be played to it once more, news at most twice packetWindow old). This
// assumes that the members' clocks agree to well within packetWindow, as NTP keeps the nodes
// of a cluster (to milliseconds); a member whose clock is off by more is heard by nobody and
// declared dead, and the others' logs say by how much its packets were off (see refuse). Dropped packets and refused streams
// are counted (Refused) and logged at most once per peer host per refusalEvery.
const (
	streamMagic      = "FCG1"
	nonceSize        = 32
	macSize          = sha256.Size
	streamLabel      = "fitcache gossip stream v1"
	packetLabel      = "fitcache gossip packet v1"
	packetVersion    = 1
	packetOverhead   = 1 + 8 + macSize
	handshakeTimeout = 2 * time.Second
	packetWindow     = 10 * time.Second
	maxStreams       = 512
	refusalEvery     = 10 * time.Second
	// maxPacket is the largest UDP datagram read.
	maxPacket = 65536
)

// transportKeys are the keys of the gossip port's own layer, derived from the job token apart
// from memberlist's key (Key) and the RPC port's keys, so that no proof of one is valid as
// another.
type transportKeys struct {
	stream, packet []byte
}

func newTransportKeys(token string) (transportKeys, error) {
	derive := func(info string) ([]byte, error) {
		return hkdf.Key(sha256.New, []byte(token), []byte("fitcache job token"), info, sha256.Size)
	}
	s, err := derive("membership stream v1")
	if err != nil {
		return transportKeys{}, err
	}
	p, err := derive("membership packet v1")
	return transportKeys{stream: s, packet: p}, err
}

// transport is memberlist's network transport for a member (memberlist.NodeAwareTransport):
// TCP streams and UDP packets on the gossip address, with the layer described above, and
// counters of what it sent (Sent). It is safe for concurrent use.
type transport struct {
	addrs []netip.AddrPort // where it listens: every address of the member's host name, IPv4 first
	keys  transportKeys
	log   *slog.Logger

	// One TCP listener and one UDP socket per address of addrs, in its order (those of
	// addresses not on this host left out: see bind).
	tcp []*net.TCPListener
	udp []*net.UDPConn

	packetCh chan *memberlist.Packet
	streamCh chan net.Conn
	done     chan struct{}  // closed by Shutdown
	shut     sync.Once      // closes done
	wg       sync.WaitGroup // the listening goroutines

	admit     gate.Admitter // of streams: at most maxStreams open, those authenticating in places
	refusals  gate.RateLog  // of refusals, per peer host
	refused   atomic.Int64  // streams and packets refused
	replays   replayCache   // packets taken
	lastStamp atomic.Int64  // the last stamp sent
	packets   atomic.Int64  // packets sent
	streams   atomic.Int64  // streams dialed
	// capture, if set, sees each packet sent and its destination (tests record gossip).
	capture atomic.Pointer[func(packet []byte, to string)]
}

// pendingKeyOf is what streams still authenticating are counted by: gate.PeerKey, which
// tests replace to see every peer as a host of its own address.
var pendingKeyOf = gate.PeerKey

var _ memberlist.NodeAwareTransport = (*transport)(nil)

// ErrPortInUse reports a gossip port held by another socket (another program, or another
// user's) past Config.BindWait.
var ErrPortInUse = errors.New("gossip port in use")

// listenTransport listens on addrs (TCP and UDP, same port, on each), retrying while the port
// is in use for up to wait: a server restarted at once may find its previous run's sockets
// still closing. It advertises the first address.
func listenTransport(addrs []netip.AddrPort, keys transportKeys, log *slog.Logger, wait time.Duration) (*transport, error) {
	t := &transport{addrs: addrs, keys: keys, log: log,
		packetCh: make(chan *memberlist.Packet), streamCh: make(chan net.Conn), done: make(chan struct{}),
		refusals: gate.RateLog{Every: refusalEvery}}
	t.admit = gate.Admitter{MaxConns: maxStreams, Pending: gate.Pending{Own: gate.OwnUser()},
		KeyOf:  func(c net.Conn) string { return pendingKeyOf(c) },
		Refuse: func(host, reason string) { t.refuse(host, "stream: "+reason) }}
	deadline := time.Now().Add(wait)
	for {
		err := t.bind()
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EADDRINUSE) {
			return nil, err
		}
		if time.Now().After(deadline) {
			var taken *portTakenError
			errors.As(err, &taken)
			return nil, fmt.Errorf("%w: %s (TCP and UDP) still taken after %v%s: %w", ErrPortInUse, taken.addr, wait,
				holderOf(taken.addr), err)
		}
		time.Sleep(min(250*time.Millisecond, max(wait/4, time.Millisecond)))
	}
	for i := range t.tcp {
		t.wg.Add(2)
		go func() {
			defer t.wg.Done()
			t.admit.Serve(t.tcp[i], t.done, t.authenticate)
		}()
		go t.readLoop(t.udp[i], t.addrs[i])
	}
	return t, nil
}

// portTakenError is bind's error for an address whose port another socket holds.
type portTakenError struct {
	addr netip.AddrPort
	err  error
}

func (e *portTakenError) Error() string { return fmt.Sprintf("%s: %v", e.addr, e.err) }
func (e *portTakenError) Unwrap() error { return e.err }

// bind opens a TCP listener and a UDP socket on each address, or none. Every address of the
// host name, not one, as the RPC port does (gate.ListenTCP): another user who took the
// gossip port on the address left free (::1 beside 127.0.0.1) would meet the members that
// resolve the name to it. An address that is not on this host (or of a family it lacks) is
// left out, as long as one is left; a port taken on any address fails the bind.
func (t *transport) bind() error {
	var tcps []*net.TCPListener
	var udps []*net.UDPConn
	var addrs []netip.AddrPort
	closeAll := func() {
		for i := range tcps {
			tcps[i].Close()
			udps[i].Close()
		}
	}
	var skipped []error
	for _, a := range t.addrs {
		tcp, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(a))
		var udp *net.UDPConn
		if err == nil {
			if udp, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(a)); err != nil {
				tcp.Close()
			}
		}
		switch {
		case err == nil:
			udp.SetReadBuffer(2 << 20) // as memberlist's own transport: bursts of gossip are not lost
			tcps, udps, addrs = append(tcps, tcp), append(udps, udp), append(addrs, a)
			continue
		case errors.Is(err, syscall.EADDRNOTAVAIL), errors.Is(err, syscall.EAFNOSUPPORT):
			skipped = append(skipped, err)
			continue
		case errors.Is(err, syscall.EADDRINUSE):
			err = &portTakenError{addr: a, err: err}
		}
		closeAll()
		return err
	}
	if len(tcps) == 0 {
		return fmt.Errorf("no address of the gossip port is on this host: %w", errors.Join(skipped...))
	}
	t.tcp, t.udp, t.addrs = tcps, udps, addrs
	return nil
}

// FinalAdvertiseAddr implements memberlist.Transport: a member advertises the first address
// it listens on (IPv4 where the name has one, as the other members resolve it).
func (t *transport) FinalAdvertiseAddr(string, int) (net.IP, int, error) {
	return net.IP(t.addrs[0].Addr().AsSlice()), int(t.addrs[0].Port()), nil
}

// PacketCh implements memberlist.Transport: the packets that passed the checks.
func (t *transport) PacketCh() <-chan *memberlist.Packet { return t.packetCh }

// StreamCh implements memberlist.Transport: the streams that authenticated.
func (t *transport) StreamCh() <-chan net.Conn { return t.streamCh }

// WriteTo implements memberlist.Transport.
func (t *transport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress implements memberlist.NodeAwareTransport: it sends b stamped and bound to
// its destination.
func (t *transport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	dst, err := net.ResolveUDPAddr("udp", a.Addr)
	if err != nil {
		return time.Time{}, err
	}
	to := unmapped(dst.AddrPort())
	out := make([]byte, 0, packetOverhead+len(b))
	out = append(out, packetVersion)
	out = binary.BigEndian.AppendUint64(out, uint64(t.stamp()))
	out = append(out, b...)
	out = append(out, packetMAC(t.keys.packet, to, out[1:])...)
	t.packets.Add(1)
	if capture := t.capture.Load(); capture != nil {
		(*capture)(out, to.String())
	}
	_, err = t.socketFor(to).WriteToUDPAddrPort(out, to)
	return time.Now(), err
}

// socketFor returns the UDP socket to send to dst from: one of dst's family.
func (t *transport) socketFor(dst netip.AddrPort) *net.UDPConn {
	for i, a := range t.addrs {
		if a.Addr().Is4() == dst.Addr().Is4() {
			return t.udp[i]
		}
	}
	return t.udp[0]
}

// stamp returns the time now in Unix nanoseconds, or one more than the last stamp: a sender's
// stamps increase strictly, so that two packets never look like one replayed.
func (t *transport) stamp() int64 {
	for {
		last := t.lastStamp.Load()
		s := max(now().UnixNano(), last+1)
		if t.lastStamp.CompareAndSwap(last, s) {
			return s
		}
	}
}

// packetMAC returns the MAC of a packet to dst whose stamp and payload are body.
func packetMAC(key []byte, dst netip.AddrPort, body []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(packetLabel))
	m.Write([]byte{0})
	m.Write(endpoint(dst))
	m.Write(body)
	return m.Sum(nil)
}

// endpoint encodes an address for a MAC: IPv6 form (IPv4 mapped), then the port.
func endpoint(a netip.AddrPort) []byte {
	ip := a.Addr().Unmap().As16()
	return binary.BigEndian.AppendUint16(ip[:], a.Port())
}

// unmapped returns a with an IPv4-mapped address as IPv4 and no zone.
func unmapped(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(a.Addr().Unmap().WithZone(""), a.Port())
}

// readLoop reads the packets of udp, bound to local, checks them (see openPacket) and passes
// copies of those that pass to memberlist: junk costs one buffer in all.
func (t *transport) readLoop(udp *net.UDPConn, local netip.AddrPort) {
	defer t.wg.Done()
	buf := make([]byte, maxPacket)
	for {
		n, from, err := udp.ReadFromUDPAddrPort(buf)
		at := time.Now()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // a transient error (ICMP feedback): the next read may work
		}
		payload, reason := t.openPacket(buf[:n], local)
		if reason != "" {
			t.refuse(from.Addr().Unmap().String(), "packet: "+reason)
			continue
		}
		select {
		case t.packetCh <- &memberlist.Packet{Buf: bytes.Clone(payload), From: net.UDPAddrFromAddrPort(from), Timestamp: at}:
		case <-t.done:
			return
		}
	}
}

// openPacket checks a packet received on the socket bound to local and returns its payload,
// or why it is dropped.
func (t *transport) openPacket(p []byte, local netip.AddrPort) (payload []byte, reason string) {
	if len(p) <= packetOverhead || p[0] != packetVersion {
		return nil, "not a gossip packet of this version"
	}
	body, mac := p[1:len(p)-macSize], p[len(p)-macSize:]
	if !hmac.Equal(mac, packetMAC(t.keys.packet, local, body)) {
		return nil, "not authenticated (no job token, another job's, or meant for another address)"
	}
	stamp := int64(binary.BigEndian.Uint64(body))
	if d := time.Duration(now().UnixNano() - stamp); d > packetWindow || d < -packetWindow {
		return nil, fmt.Sprintf("stamped %v away from this member's clock (replayed, or clocks apart)", d.Round(time.Millisecond))
	}
	if !t.replays.take(mac, stamp, now().Add(-packetWindow).UnixNano()) {
		return nil, "taken before (replayed)"
	}
	return body[8:], ""
}

// replayCache remembers the packets taken within the window, by MAC, to drop them when they
// come again. It holds at most maxReplays: past that, the packet taken first is forgotten and
// packets stamped no later than it are refused from then on (floor), so that a forgotten
// packet is never taken again, whatever the rate of valid packets. A member takes some
// hundred packets a second, well under maxReplays per window.
type replayCache struct {
	mu    sync.Mutex // protects the fields below
	seen  map[[16]byte]struct{}
	order [][16]byte // seen's keys, oldest first
	stamp []int64    // their stamps
	floor int64      // packets stamped at or before floor are refused
}

const maxReplays = 1 << 15

// take records a packet of MAC mac and stamp, and reports false if it was taken before (or
// cannot be told from one: stamped at or before the floor). Entries stamped before expired
// are forgotten.
func (r *replayCache) take(mac []byte, stamp, expired int64) bool {
	var k [16]byte
	copy(k[:], mac)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.seen == nil {
		r.seen = make(map[[16]byte]struct{})
	}
	for len(r.order) > 0 && (r.stamp[0] < expired || len(r.order) >= maxReplays) {
		delete(r.seen, r.order[0])
		r.floor = max(r.floor, r.stamp[0])
		r.order, r.stamp = r.order[1:], r.stamp[1:]
	}
	if _, ok := r.seen[k]; ok || stamp <= r.floor {
		return false
	}
	r.seen[k] = struct{}{}
	r.order, r.stamp = append(r.order, k), append(r.stamp, stamp)
	return true
}

// DialTimeout implements memberlist.Transport.
func (t *transport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return t.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout implements memberlist.NodeAwareTransport: it connects and answers the
// acceptor's challenge, within timeout.
func (t *transport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	t.streams.Add(1)
	deadline := time.Now().Add(timeout)
	c, err := net.DialTimeout("tcp", a.Addr, timeout)
	if err != nil {
		return nil, err
	}
	if err := t.answer(c, deadline); err != nil {
		c.Close()
		return nil, fmt.Errorf("gossip stream to %s: %w", a.Addr, err)
	}
	return c, nil
}

// answer is the dialer's side of a stream's authentication.
func (t *transport) answer(c net.Conn, deadline time.Time) error {
	if err := c.SetDeadline(deadline); err != nil {
		return err
	}
	var challenge [len(streamMagic) + nonceSize]byte
	if _, err := io.ReadFull(c, challenge[:]); err != nil {
		return fmt.Errorf("no challenge: %w", err)
	}
	if string(challenge[:len(streamMagic)]) != streamMagic {
		return errors.New("no gossip port of a member: no challenge")
	}
	remote, ok := c.RemoteAddr().(*net.TCPAddr)
	if !ok {
		return errors.New("not a TCP connection")
	}
	if _, err := c.Write(streamProof(t.keys.stream, challenge[len(streamMagic):], unmapped(remote.AddrPort()))); err != nil {
		return err
	}
	return c.SetDeadline(time.Time{})
}

// streamProof returns the dialer's answer to nonce from the acceptor at acceptor.
func streamProof(key, nonce []byte, acceptor netip.AddrPort) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(streamLabel))
	m.Write([]byte{0})
	m.Write(nonce)
	m.Write(endpoint(acceptor))
	return m.Sum(nil)
}

// authenticate is the acceptor's side of a stream's authentication: it hands c to memberlist
// or closes it.
func (t *transport) authenticate(c *gate.Conn, key string) {
	err := t.challenge(c)
	t.admit.Pending.End(key, c)
	if err != nil {
		t.refuse(gate.PeerHost(c.RemoteAddr()), "stream: "+err.Error())
		c.Close()
		return
	}
	select {
	case t.streamCh <- c:
	case <-t.done:
		c.Close()
	}
}

// challenge sends a nonce and checks the answer, reading nothing more.
func (t *transport) challenge(c net.Conn) error {
	if err := c.SetDeadline(time.Now().Add(handshakeTimeout)); err != nil {
		return err
	}
	var nonce [nonceSize]byte
	rand.Read(nonce[:])
	if _, err := c.Write(append([]byte(streamMagic), nonce[:]...)); err != nil {
		return err
	}
	var answer [macSize]byte
	if _, err := io.ReadFull(c, answer[:]); err != nil {
		return fmt.Errorf("no answer to the challenge: %w", err)
	}
	local, ok := c.LocalAddr().(*net.TCPAddr)
	if !ok || !hmac.Equal(answer[:], streamProof(t.keys.stream, nonce[:], unmapped(local.AddrPort()))) {
		return errors.New("not authenticated (no job token, another job's, or a relayed connection)")
	}
	return c.SetDeadline(time.Time{})
}

// refuse counts a refused stream or packet and logs it, at most once per peer host per
// refusalEvery.
func (t *transport) refuse(host, reason string) {
	t.refused.Add(1)
	if write, suppressed := t.refusals.Allow(host); write {
		t.log.Warn("membership: refused a peer on the gossip port", "peer", host, "reason", reason,
			"suppressed_since_last", suppressed)
	}
}

// Shutdown implements memberlist.Transport: it closes the sockets and waits for its loops.
func (t *transport) Shutdown() error {
	t.shut.Do(func() { close(t.done) })
	var errs []error
	for i := range t.tcp {
		errs = append(errs, t.tcp[i].Close(), t.udp[i].Close())
	}
	err := errors.Join(errs...)
	t.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// resolve returns the addresses to gossip on for host and port: host itself if it is an IP
// address, else every address it resolves to, IPv4 first (gate.ListenAddrs, as the RPC port
// takes them). The other members resolve the same name to send to the first.
func resolve(host string, port int) ([]netip.AddrPort, error) {
	if ip, err := netip.ParseAddr(host); err == nil {
		return []netip.AddrPort{netip.AddrPortFrom(ip.Unmap().WithZone(""), uint16(port))}, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ips, err := gate.ListenAddrs(ctx, host, lookupHost)
	if err != nil {
		return nil, fmt.Errorf("resolve %s: %w", host, err)
	}
	out := make([]netip.AddrPort, len(ips))
	for i, ip := range ips {
		out[i] = netip.AddrPortFrom(ip.WithZone(""), uint16(port))
	}
	return out, nil
}

// lookupHost resolves host names for resolve (nil: the system's resolver); tests give a name
// two families.
var lookupHost gate.Lookup

// clockSkew is added to the members' clock (now): tests move every member's clock forward,
// as if the time had passed, to play recorded gossip "later".
var clockSkew atomic.Int64

// now is the members' clock: for packet stamps and for how long news counts as fresh.
func now() time.Time { return time.Now().Add(time.Duration(clockSkew.Load())) }
