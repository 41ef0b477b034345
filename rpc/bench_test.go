package rpc

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cloudwego/kitex/pkg/remote"
	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// BenchmarkRemoteRead reads a cached file over loopback TCP from a server with a token (the
// handshake, then this package's transport), as another server of the job does, into the
// caller's buffer (ReadInto) and into a new one (Read). Both sides run in this process:
// cpu-µs/op is the CPU time of both per read.
func BenchmarkRemoteRead(b *testing.B) {
	QuietKitexLogs()
	for _, size := range []int{110 << 10, 256 << 10, 4 << 20} {
		for _, into := range []bool{true, false} {
			name := fmt.Sprintf("%dKiB/new-buffer", size>>10)
			if into {
				name = fmt.Sprintf("%dKiB/into", size>>10)
			}
			b.Run(name, func(b *testing.B) {
				addr, _, _ := serveTCP(b, ServerConfig{Token: "t"})
				root := b.TempDir()
				path := filepath.Join(root, "f")
				os.WriteFile(path, make([]byte, size), 0o644)
				c, _ := Dial(addr, ClientConfig{Token: "t"})
				defer c.Close()
				ctx := context.Background()
				req := &fitcachepb.ReadRequest{Root: root, Path: path}
				var buf []byte
				if into {
					buf = make([]byte, size)
				}
				if _, err := c.ReadInto(ctx, req, buf); err != nil { // cached from now on
					b.Fatal(err)
				}
				b.SetBytes(int64(size))
				b.ReportAllocs()
				cpu0 := processCPU()
				b.ResetTimer()
				for b.Loop() {
					if r, err := c.ReadInto(ctx, req, buf); err != nil || len(r.Data) != size {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
			})
		}
	}
}

// BenchmarkRemoteReadBatch reads cached 110 KiB files from a server over loopback TCP with
// ReadBatch, as a node's server asks an owner: one file a call (a reader's item), or 16 (a
// batch), into the caller's buffer; CPU per file of client and server together.
func BenchmarkRemoteReadBatch(b *testing.B) {
	QuietKitexLogs()
	const size = 110 << 10
	for _, files := range []int{1, 16} {
		b.Run(fmt.Sprintf("%d-files", files), func(b *testing.B) {
			addr, _, _ := serveTCP(b, ServerConfig{Token: "t"})
			root := b.TempDir()
			var paths []string
			for i := range files {
				paths = append(paths, filepath.Join(root, fmt.Sprintf("f%d", i)))
				os.WriteFile(paths[i], make([]byte, size), 0o644)
			}
			c, _ := Dial(addr, ClientConfig{Token: "t"})
			defer c.Close()
			ctx := context.Background()
			req := &fitcachepb.ReadBatchRequest{Root: root, Paths: paths}
			buf := make([]byte, files*size)
			if _, err := c.ReadBatch(ctx, req, buf, nil); err != nil { // cached from now on
				b.Fatal(err)
			}
			b.SetBytes(int64(files * size))
			cpu0 := processCPU()
			b.ResetTimer()
			for b.Loop() {
				if r, err := c.ReadBatch(ctx, req, buf, nil); err != nil || len(r.Data) != files*size {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N*files), "cpu-µs/file")
		})
	}
}

// processCPU is the CPU time this process has used.
func processCPU() time.Duration {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_PROCESS_CPUTIME_ID, &ts)
	return time.Duration(ts.Nano())
}

// BenchmarkConnect is the set-up of a connection to a server with a token over loopback TCP:
// "dial" is what a client's dialer does for each new connection (connect, then the handshake)
// and the connection closed; "first-call" is a new client's first call, which makes one.
func BenchmarkConnect(b *testing.B) {
	QuietKitexLogs()
	addr, _, _ := serveTCP(b, ServerConfig{Token: "t"})
	b.Run("dial", func(b *testing.B) {
		d := dialer{inner: newHandshakeDialer(remote.NewDefaultDialer(), newJobKeys("t"))}
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
