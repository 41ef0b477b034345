package rpc

// Membership returns the version of the ring membership this server's clients reported
// (one per change: a server found dead or back) and the servers they report dead (see
// package gossip).
func (h *Handler) Membership() (version int64, dead []string) { return h.members.Since(-1) }
