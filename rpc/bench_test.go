package rpc

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cloudwego/kitex/pkg/remote/trans/netpoll"
)

// BenchmarkRemoteRead reads a cached file over loopback TCP from a server without a token
// (Kitex's netpoll transport on both sides) and with one (the handshake, then Kitex's Go net
// transport on the server, netpoll on the client).
func BenchmarkRemoteRead(b *testing.B) {
	QuietKitexLogs()
	for _, size := range []int{256 << 10, 4 << 20} {
		for _, tc := range []struct{ name, token string }{{"tokenless-netpoll", ""}, {"token-gonet-server", "t"}} {
			b.Run(fmt.Sprintf("%dKiB/%s", size>>10, tc.name), func(b *testing.B) {
				addr, _, _ := serveTCP(b, ServerConfig{Token: tc.token})
				root := b.TempDir()
				path := filepath.Join(root, "f")
				os.WriteFile(path, make([]byte, size), 0o644)
				c, _ := Dial(addr, ClientConfig{Token: tc.token})
				defer c.Close()
				ctx := context.Background()
				if _, err := c.Read(ctx, root, path, false); err != nil {
					b.Fatal(err)
				}
				b.SetBytes(int64(size))
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					if _, err := c.Read(ctx, root, path, false); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkConnect is the set-up of a connection to a server with a token over loopback TCP:
// "dial" is what a client's dialer does for each new connection (connect, then the handshake)
// and the connection closed; "first-call" is a new client's first call, which makes one.
func BenchmarkConnect(b *testing.B) {
	QuietKitexLogs()
	addr, _, _ := serveTCP(b, ServerConfig{Token: "t"})
	b.Run("dial", func(b *testing.B) {
		d := handshakeDialer{inner: netpoll.NewDialer(), keys: newJobKeys("t")}
		b.ReportAllocs()
		for b.Loop() {
			c, err := d.DialTimeout("tcp", addr, time.Second)
			if err != nil {
				b.Fatal(err)
			}
			c.Close()
		}
	})
	b.Run("first-call", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			c, _ := Dial(addr, ClientConfig{Token: "t"})
			if _, err := c.Hello(context.Background()); err != nil {
				b.Fatal(err)
			}
			c.Close()
		}
	})
}
