// Package server runs a FitCache server: the engine (package core) with its tiers, the RPC
// server (package rpc) on a TCP address or a Unix socket, the node socket (package nodesock)
// where this node's C readers ask for misses, the Prometheus metrics (package metrics), a
// ready file for launchers, and, for the per-user embedded server, its lock (package
// embedded). In cluster mode, its node socket answers for every file of the job through a
// reader per dataset root that routes over the ring (nodesocket.go, readers.go).
//
// Start opens all of it in order and closes what it opened when a step fails; Close owns
// the shutdown order. `fitcache serve` parses flags into a Config and handles signals; tests
// and other hosts start servers the same way.
//
// Usage:
//
//	s, err := server.Start(server.Config{
//		Listen: "gpu001:7070", Token: token, Roots: []string{"/lustre/imagenet"},
//		Tiers:      []tiers.Config{{Kind: tiers.Memory, Dir: "/dev/shm/fitcache", Budget: "50%"}},
//		RuntimeDir: runtimeDir, Cluster: jobConfig, Log: log,
//	})
//	if err != nil {
//		return err
//	}
//	defer s.Close()
//	select {
//	case <-s.Done(): // idle, socket replaced, or the RPC server ended: s.Reason() says which
//	case <-signals:
//	}
package server
