package gate

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// PeerUID returns the user owning the other end of c, a connection accepted by this host, if
// that end is on this host too: for a Unix socket the kernel's credentials of the peer
// (SO_PEERCRED); for TCP between two addresses of this host the owner of the peer's socket,
// found by an exact lookup of its four-tuple in the kernel's socket diagnostics
// (NETLINK_SOCK_DIAG, the source of `ss -e`). ok is false for a peer on another host, or
// when the kernel does not say.
func PeerUID(c net.Conn) (uid uint32, ok bool) {
	if uc, isUnix := c.(*net.UnixConn); isUnix {
		return unixPeerUID(uc)
	}
	local, lok := addrPort(c.LocalAddr())
	remote, rok := addrPort(c.RemoteAddr())
	if !lok || !rok || !onThisHost(remote.Addr(), local.Addr()) {
		return 0, false
	}
	uid, err := tcpPeerUID(local, remote)
	return uid, err == nil
}

func unixPeerUID(c *net.UnixConn) (uint32, bool) {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, false
	}
	var cred *unix.Ucred
	cerr := raw.Control(func(fd uintptr) { cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
	if cerr != nil || err != nil {
		return 0, false
	}
	return cred.Uid, true
}

// onThisHost reports whether addr is an address of this host: a loopback address, the
// connection's own local address, or an address of one of its interfaces.
func onThisHost(addr, local netip.Addr) bool {
	if addr.IsLoopback() || addr == local {
		return true
	}
	return hostAddrs.has(addr)
}

// hostAddrs caches the addresses of this host's interfaces, read again at most every
// few seconds.
var hostAddrs localAddrs

type localAddrs struct {
	mu    sync.Mutex // protects addrs and read
	addrs map[netip.Addr]bool
	read  time.Time
}

func (l *localAddrs) has(a netip.Addr) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if time.Since(l.read) > 10*time.Second {
		l.read = time.Now()
		l.addrs = map[netip.Addr]bool{}
		ifaddrs, _ := net.InterfaceAddrs()
		for _, ia := range ifaddrs {
			if n, ok := ia.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok {
					l.addrs[ip.Unmap()] = true
				}
			}
		}
	}
	return l.addrs[a]
}

// Sizes of the kernel's structures (linux/netlink.h, linux/inet_diag.h).
const (
	nlmsghdrLen      = 16
	inetDiagReqV2Len = 56 // family, protocol, ext, pad, states, inet_diag_sockid (48)
	inetDiagMsgLen   = 72 // family, state, timer, retrans, sockid, expires, rqueue, wqueue, uid, inode
	inetDiagUIDAt    = 64 // offset of idiag_uid in inet_diag_msg
)

// tcpPeerUID asks the kernel who owns the TCP socket whose own end is remote and whose peer
// is local (the other end of a connection this host accepted at local from remote).
func tcpPeerUID(local, remote netip.AddrPort) (uint32, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	tv := unix.NsecToTimeval((100 * time.Millisecond).Nanoseconds())
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)

	family := byte(unix.AF_INET6)
	if remote.Addr().Is4() && local.Addr().Is4() {
		family = unix.AF_INET
	}
	req := make([]byte, nlmsghdrLen+inetDiagReqV2Len)
	ne := binary.NativeEndian
	ne.PutUint32(req[0:], uint32(len(req)))
	ne.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(req[6:], unix.NLM_F_REQUEST)
	ne.PutUint32(req[8:], 1) // sequence number
	r := req[nlmsghdrLen:]
	r[0], r[1] = family, unix.IPPROTO_TCP
	ne.PutUint32(r[4:], 0xffffffff) // any state
	id := r[8:]
	binary.BigEndian.PutUint16(id[0:], remote.Port()) // the peer socket's own end
	binary.BigEndian.PutUint16(id[2:], local.Port())
	putDiagAddr(id[4:20], remote.Addr(), family)
	putDiagAddr(id[20:36], local.Addr(), family)
	ne.PutUint32(id[40:], 0xffffffff) // INET_DIAG_NOCOOKIE
	ne.PutUint32(id[44:], 0xffffffff)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, err
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return 0, err
	}
	buf = buf[:n]
	if len(buf) < nlmsghdrLen {
		return 0, errors.New("short sock_diag answer")
	}
	switch ne.Uint16(buf[4:]) {
	case unix.NLMSG_ERROR:
		if len(buf) >= nlmsghdrLen+4 {
			if errno := int32(ne.Uint32(buf[nlmsghdrLen:])); errno < 0 {
				return 0, syscall.Errno(-errno)
			}
		}
		return 0, errors.New("sock_diag error")
	case unix.SOCK_DIAG_BY_FAMILY:
		if len(buf) < nlmsghdrLen+inetDiagMsgLen {
			return 0, errors.New("short sock_diag answer")
		}
		return ne.Uint32(buf[nlmsghdrLen+inetDiagUIDAt:]), nil
	}
	return 0, fmt.Errorf("sock_diag answered with message type %d", ne.Uint16(buf[4:]))
}

// putDiagAddr writes a into an inet_diag_sockid address (four 32-bit words, network order):
// IPv4 in the first word for AF_INET, else the IPv6 form (IPv4 mapped).
func putDiagAddr(dst []byte, a netip.Addr, family byte) {
	if family == unix.AF_INET {
		v4 := a.As4()
		copy(dst, v4[:])
		return
	}
	v6 := a.As16()
	copy(dst, v6[:])
}

// addrPort returns a TCP address as a netip.AddrPort with IPv4-mapped addresses unmapped;
// false for other addresses.
func addrPort(a net.Addr) (netip.AddrPort, bool) {
	t, ok := a.(*net.TCPAddr)
	if !ok {
		return netip.AddrPort{}, false
	}
	ap := t.AddrPort()
	return netip.AddrPortFrom(ap.Addr().Unmap().WithZone(""), ap.Port()), ap.Addr().IsValid()
}
