// Command remoteread measures reads of cached files from a FitCache server over Kitex (TCP on
// loopback) next to plain TCP reads of the same bytes from a minimal server, in one run:
// p50/p99 latency and throughput, one client reading sequentially.
//
//	go run ./bench/remoteread -files 400 -sizes 262144,4194304 -rounds 5
package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

func main() {
	files := flag.Int("files", 400, "files per size")
	sizesFlag := flag.String("sizes", "262144,4194304", "file sizes in bytes")
	rounds := flag.Int("rounds", 5, "rounds; figures are medians over rounds")
	flag.Parse()
	rpc.QuietKitexLogs()
	work, err := os.MkdirTemp("", "fitcache-remoteread-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(work)
	shm := filepath.Join("/dev/shm", filepath.Base(work))
	defer os.RemoveAll(shm)

	fmt.Println("| size | path | p50 ms | p99 ms | MB/s | vs plain TCP |")
	fmt.Println("|---|---|---|---|---|---|")
	for _, f := range strings.Split(*sizesFlag, ",") {
		size, _ := strconv.Atoi(f)
		root := filepath.Join(work, "data", f)
		os.MkdirAll(root, 0o755)
		var paths []string
		data := map[string][]byte{}
		for i := 0; i < *files; i++ {
			p := filepath.Join(root, fmt.Sprintf("f%05d.bin", i))
			b := make([]byte, size)
			for j := range b {
				b[j] = byte(i + j)
			}
			os.WriteFile(p, b, 0o644)
			paths = append(paths, p)
			data[p] = b
		}
		engine, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: filepath.Join(shm, f), Kind: tiers.Memory, Budget: "8GiB"}}}, nil)
		if err != nil {
			log.Fatal(err)
		}
		ln, _ := net.Listen("tcp", "127.0.0.1:0")
		srv, _, _ := rpc.Serve(engine, ln, rpc.ServerConfig{Token: "t"})
		c, _ := rpc.Dial(ln.Addr().String(), rpc.ClientConfig{Token: "t"})
		for _, p := range paths { // warm: every file cached on the server
			if _, err := c.Read(context.Background(), root, p, false); err != nil {
				log.Fatal(err)
			}
		}
		engine.Close() // drains the data mover; the tiers stay readable
		plain := startPlain(data)

		var kitexLat, plainLat [][]time.Duration
		var kitexSecs, plainSecs []float64
		for r := 0; r < *rounds; r++ {
			lat, secs := measure(paths, func(p string) int {
				reply, err := c.Read(context.Background(), root, p, false)
				if err != nil || len(reply.Data) != size {
					log.Fatalf("kitex read %s: %v", p, err)
				}
				return len(reply.Data)
			})
			kitexLat, kitexSecs = append(kitexLat, lat), append(kitexSecs, secs)
			lat, secs = measure(paths, plain.read)
			plainLat, plainSecs = append(plainLat, lat), append(plainSecs, secs)
		}
		kp50, kp99, kmb := summarize(kitexLat, kitexSecs, size*len(paths))
		pp50, pp99, pmb := summarize(plainLat, plainSecs, size*len(paths))
		label := tiers.FormatBytes(int64(size))
		fmt.Printf("| %s | plain TCP | %.3f | %.3f | %.0f | 1.00 |\n", label, ms(pp50), ms(pp99), pmb)
		fmt.Printf("| %s | FitCache over Kitex | %.3f | %.3f | %.0f | %.2fx throughput, %.2fx p50 latency |\n",
			label, ms(kp50), ms(kp99), kmb, kmb/pmb, ms(kp50)/ms(pp50))
		srv.Stop()
		plain.close()
	}
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

func measure(paths []string, read func(string) int) ([]time.Duration, float64) {
	lat := make([]time.Duration, 0, len(paths))
	start := time.Now()
	for _, p := range paths {
		t := time.Now()
		read(p)
		lat = append(lat, time.Since(t))
	}
	return lat, time.Since(start).Seconds()
}

// summarize returns the medians over rounds of p50, p99 and MB/s.
func summarize(lats [][]time.Duration, secs []float64, bytes int) (time.Duration, time.Duration, float64) {
	var p50s, p99s []time.Duration
	var mbs []float64
	for i, l := range lats {
		sort.Slice(l, func(a, b int) bool { return l[a] < l[b] })
		p50s = append(p50s, l[len(l)/2])
		p99s = append(p99s, l[len(l)*99/100])
		mbs = append(mbs, float64(bytes)/secs[i]/1e6)
	}
	sort.Slice(p50s, func(a, b int) bool { return p50s[a] < p50s[b] })
	sort.Slice(p99s, func(a, b int) bool { return p99s[a] < p99s[b] })
	sort.Float64s(mbs)
	return p50s[len(p50s)/2], p99s[len(p99s)/2], mbs[len(mbs)/2]
}

// plainServer answers "path\n" with an 8-byte length and the bytes, from memory: the least
// any remote read can cost.
type plainServer struct {
	ln   net.Listener
	conn net.Conn
	r    *bufio.Reader
}

func startPlain(data map[string][]byte) *plainServer {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				r := bufio.NewReader(conn)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					b := data[strings.TrimSuffix(line, "\n")]
					var hdr [8]byte
					binary.LittleEndian.PutUint64(hdr[:], uint64(len(b)))
					conn.Write(hdr[:])
					conn.Write(b)
				}
			}()
		}
	}()
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		log.Fatal(err)
	}
	return &plainServer{ln: ln, conn: conn, r: bufio.NewReaderSize(conn, 1<<20)}
}

func (s *plainServer) read(p string) int {
	io.WriteString(s.conn, p+"\n")
	var hdr [8]byte
	io.ReadFull(s.r, hdr[:])
	b := make([]byte, binary.LittleEndian.Uint64(hdr[:]))
	n, err := io.ReadFull(s.r, b)
	if err != nil {
		log.Fatal(err)
	}
	return n
}

func (s *plainServer) close() { s.conn.Close(); s.ln.Close() }
