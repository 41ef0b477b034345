// Package gate is what a server's listening ports do with peers that have not authenticated
// yet, so that whoever reaches a port without the job token can make the server hold little
// and log little: a bounded number of places for connections still authenticating, per peer
// and in all (Pending, counted by PeerKey: a host, or a user on this host), and a log whose
// lines about refused peers are rate-limited per peer (RateLog). The RPC port (package rpc)
// and the servers' gossip port (package membership) share them.
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
