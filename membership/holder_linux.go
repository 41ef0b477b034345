package membership

import (
	"bufio"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"strings"
)

// holderOf names who holds local port port, if the kernel's socket tables say (a listening
// TCP socket or a bound UDP socket, of any address): ", held by uid N (name)", or "".
func holderOf(port uint16) string {
	want := fmt.Sprintf(":%04X", port)
	for _, table := range []string{"tcp", "tcp6", "udp", "udp6"} {
		f, err := os.Open("/proc/net/" + table)
		if err != nil {
			continue
		}
		s := bufio.NewScanner(f)
		s.Scan() // the header
		for s.Scan() {
			// sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
			fields := strings.Fields(s.Text())
			if len(fields) < 8 || !strings.HasSuffix(fields[1], want) ||
				strings.HasPrefix(table, "tcp") && fields[3] != "0A" { // TCP: listening only
				continue
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
