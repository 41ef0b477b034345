//go:build !linux

package membership

import "net/netip"

// holderOf names nobody outside Linux.
func holderOf(addr netip.AddrPort) string { return "" }
