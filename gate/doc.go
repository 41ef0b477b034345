// Package gate is a server's listening ports at their edge: how they are opened, and what
// they do with peers that have not authenticated yet.
//
// Opening: ListenTCP listens on every address a host name resolves to (ListenAddrs), so that
// no other user can take the same port on another of the name's addresses (::1 beside
// 127.0.0.1) and meet the job's clients there.
//
// Peers not authenticated yet: whoever reaches a port without the job token can make the
// server hold little and log little: a bounded number of places for connections still
// authenticating, per peer and in all (Pending, counted by PeerKey: a host, or a user on this
// host), and a log whose lines about refused peers are rate-limited per peer (RateLog). The
// RPC port (package rpc) and the servers' gossip port (package membership) share them.
//
// Usage, on accept:
//
//	key := gate.PeerKey(c)
//	if victim, _ := pending.Start(key, c); victim != nil {
//		victim.Close() // the oldest connection still authenticating there
//	}
//	err := authenticate(c) // with a deadline
//	pending.End(key, c)
//	if err != nil {
//		if ok, n := refusals.Allow(gate.PeerHost(c.RemoteAddr())); ok {
//			log.Warn("refused", "suppressed_since_last", n)
//		}
//	}
package gate
