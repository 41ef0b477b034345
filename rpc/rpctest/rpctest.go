// Package rpctest gives tests addresses that behave as dead or hung servers do: one where
// nothing listens (connections refused), and one that takes connections and never answers
// (a hung server, or a host whose server is still starting).
//
// Usage:
//
//	refused := rpctest.Refused(t, "127.0.0.1")
//	hung := rpctest.Hang(t, "127.0.0.2") // its connections are closed when the test ends
package rpctest

import (
	"net"
	"sync"
	"testing"
)

// Refused returns an address on host where nothing listens: a moment ago a listener had it,
// so connections to it are refused.
func Refused(t testing.TB, host string) string {
	t.Helper()
	ln, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// Hang listens on host and takes connections that it never answers, until the test ends; it
// returns the address.
func Hang(t testing.TB, host string) string {
	t.Helper()
	ln, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	HoldConns(t, ln)
	return ln.Addr().String()
}

// HoldConns accepts ln's connections and never answers them; when the test ends it closes ln
// and them.
func HoldConns(t testing.TB, ln net.Listener) {
	var mu sync.Mutex // protects conns
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
}
