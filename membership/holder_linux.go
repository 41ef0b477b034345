package membership

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"os/user"
	"strconv"
	"strings"
)

// holderOf names who holds addr, if the kernel's socket tables say (a listening TCP socket or
// a bound UDP socket at its address or at any address, on its port): ", held by uid N
// (name)", or "".
func holderOf(addr netip.AddrPort) string {
	port := fmt.Sprintf(":%04X", addr.Port())
	// The tables write an IPv4 address as one 32-bit word in host order.
	var ip4 string
	if a := addr.Addr(); a.Is4() {
		b := a.As4()
		ip4 = fmt.Sprintf("%08X", binary.NativeEndian.Uint32(b[:]))
	}
	for _, table := range []string{"tcp", "udp", "tcp6", "udp6"} {
		f, err := os.Open("/proc/net/" + table)
		if err != nil {
			continue
		}
		s := bufio.NewScanner(f)
		s.Scan() // the header
		for s.Scan() {
			// sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
			fields := strings.Fields(s.Text())
			if len(fields) < 8 || !strings.HasSuffix(fields[1], port) ||
				strings.HasPrefix(table, "tcp") && fields[3] != "0A" { // TCP: listening only
				continue
			}
			if ip := strings.TrimSuffix(fields[1], port); len(ip) == 8 && ip != ip4 && ip != "00000000" {
				continue // IPv4, another address (IPv6 sockets of the port are taken as holders)
			}
			f.Close()
			holder := ", held by uid " + fields[7]
			if u, err := user.LookupId(fields[7]); err == nil {
				holder += " (" + u.Username + ")"
			}
			if uid, _ := strconv.Atoi(fields[7]); uid == os.Getuid() {
				holder += ", this server's user: another server of the job on this node, or a previous run"
			}
			return holder
		}
		f.Close()
	}
	return ""
}
