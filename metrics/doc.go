// Package metrics exposes a FitCache server's metrics to Prometheus, through the Prometheus
// Go client, in a registry of the server's own (never the global default one, so that several
// servers in one process, tests among them, do not collide).
//
// The engine's counters, its request latency histograms and the ring membership its clients
// report are read at each scrape from what the engine and the RPC handler keep anyway
// (core.Engine.Stats, core.Engine.Latencies, rpc.Handler.Membership): nothing is counted twice.
// What only the host sees, the Read RPCs by caller and the node socket's opens, is observed
// once a request through ObserveRead and ObserveNodeOpen. The package is apart from rpc so
// that libfitcache, which links rpc's client, does not link the Prometheus client.
//
// Usage:
//
//	m := metrics.New(engine)
//	srv, handler, done := rpc.Serve(engine, ln, rpc.ServerConfig{OnRead: m.ObserveRead})
//	m.WatchMembership(handler)
//	go http.Serve(mln, m.Handler())
package metrics
