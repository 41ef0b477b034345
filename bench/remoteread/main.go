// Command remoteread measures reads of cached files from a FitCache server over Kitex (TCP on
// loopback, with the job token's handshake, as between the servers of a job) against two
// baselines measured in the same run: a minimal plain-TCP server sending the same bytes from
// memory, and a plain local read (open, read, close) of a page-cached file of the same size.
// Both baselines read into a buffer that each reader reuses, the least they can cost.
//
// Each server runs in a process of its own, so that the CPU time of each side is measured
// apart: for every path, size and number of reads in flight (one client reading
// sequentially, and several reads at once, as a DataLoader batch asks), it reports p50/p99
// latency, throughput and the CPU time per read of the client and of the server, as medians
// over rounds (the paths alternate within each round).
//
//	go run ./bench/remoteread -sizes 112640,262144,4194304 -inflight 1,8 -rounds 5
//	go run ./bench/remoteread -pprof /tmp/prof   # and CPU profiles of the FitCache reads
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// config is what a run measures.
type config struct {
	Sizes    []int // file sizes, bytes
	InFlight []int // reads in flight at once: 1 is one client reading sequentially
	MaxFiles int   // files per size, at most
	MaxBytes int64 // bytes of files per size, at most (fewer large files)
	Reads    int   // reads per path and round
	Rounds   int
	Only     string // measure only this path beside the baselines ("" for all)
	Profile  string // a directory for CPU profiles of FitCache reads (client and server), or ""
	// ProfileBytes is what the profiled reads read at least (as many reads as it takes,
	// Reads at least), for enough samples at 100 Hz.
	ProfileBytes int64
}

// Paths measured.
const (
	pathLocal    = "plain read"
	pathTCP      = "plain TCP"
	pathFitCache = "FitCache over Kitex"
	pathBatch    = "FitCache, ReadBatch" // the reads in flight as one batch
)

// remotePaths are the paths measured at k reads in flight.
func remotePaths(cfg config, k int) []string {
	paths := []string{pathTCP, pathFitCache}
	if k > 1 {
		paths = append(paths, pathBatch)
	}
	if cfg.Only != "" {
		paths = []string{pathTCP, cfg.Only}
	}
	return paths
}

// result is one path's figures at one size and number of reads in flight: medians over rounds.
type result struct {
	Size      int     `json:"size"`
	InFlight  int     `json:"in_flight"`
	Path      string  `json:"path"`
	P50ms     float64 `json:"p50_ms"`
	P99ms     float64 `json:"p99_ms"`
	MBps      float64 `json:"mb_per_s"`
	ClientCPU float64 `json:"client_cpu_us"` // per read
	ServerCPU float64 `json:"server_cpu_us"` // per read; 0 for a local read
}

// CPU returns the CPU time per read of both sides together, µs.
func (r result) CPU() float64 { return r.ClientCPU + r.ServerCPU }

func main() {
	if runChild() {
		return
	}
	sizes := flag.String("sizes", "112640,262144,4194304", "file sizes in bytes")
	inflight := flag.String("inflight", "1,8", "reads in flight at once")
	files := flag.Int("files", 400, "files per size, at most")
	maxBytes := flag.Int64("max-bytes", 256<<20, "bytes of files per size, at most")
	reads := flag.Int("reads", 400, "reads per path and round")
	rounds := flag.Int("rounds", 5, "rounds; figures are medians over rounds")
	profile := flag.String("pprof", "", "directory for CPU profiles of the FitCache reads")
	only := flag.String("only", "", "measure only this path beside the baselines: \""+pathFitCache+"\" or \""+pathBatch+"\"")
	jsonOut := flag.String("json", "", "also write the results as JSON to this file")
	flag.Parse()
	cfg := config{MaxFiles: *files, MaxBytes: *maxBytes, Reads: *reads, Rounds: *rounds, Profile: *profile,
		ProfileBytes: 2 << 30, Only: *only}
	var err error
	if cfg.Sizes, err = intList(*sizes); err == nil {
		cfg.InFlight, err = intList(*inflight)
	}
	if err != nil {
		log.Fatal(err)
	}
	rpc.QuietKitexLogs()
	results, err := run(cfg, os.Stdout)
	if err != nil {
		log.Fatal(err)
	}
	if *jsonOut != "" {
		b, _ := json.MarshalIndent(map[string]any{"config": cfg, "results": results}, "", "  ")
		if err := os.WriteFile(*jsonOut, append(b, '\n'), 0o644); err != nil {
			log.Fatal(err)
		}
	}
}

func intList(s string) ([]int, error) {
	var l []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("bad number %q in %q", f, s)
		}
		l = append(l, n)
	}
	return l, nil
}

// run measures every size and prints a Markdown table of the results to out.
func run(cfg config, out io.Writer) ([]result, error) {
	work, err := os.MkdirTemp("", "fitcache-remoteread-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	shm := filepath.Join("/dev/shm", filepath.Base(work))
	if err := os.Mkdir(shm, 0o700); err != nil {
		return nil, err
	}
	defer os.RemoveAll(shm)
	fmt.Fprintln(out, "| size | in flight | path | p50 ms | p99 ms | MB/s | vs plain TCP | CPU µs/read client | server | both vs plain read |")
	fmt.Fprintln(out, "|---|---|---|---|---|---|---|---|---|---|")
	var all []result
	for _, size := range cfg.Sizes {
		rs, err := runSize(cfg, size, filepath.Join(work, strconv.Itoa(size)), filepath.Join(shm, strconv.Itoa(size)))
		if err != nil {
			return all, fmt.Errorf("%s files: %w", tiers.FormatBytes(int64(size)), err)
		}
		printSize(out, rs)
		all = append(all, rs...)
	}
	return all, nil
}

// runSize measures the reads of files of one size.
func runSize(cfg config, size int, data, tier string) ([]result, error) {
	n := max(1, min(cfg.MaxFiles, int(cfg.MaxBytes/int64(size))))
	paths, err := writeFiles(data, n, size)
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(data)
	defer os.RemoveAll(tier)
	fc, err := startChild("fitcache", data, tier)
	if err != nil {
		return nil, err
	}
	defer fc.stop()
	plain, err := startChild("plain", data, "")
	if err != nil {
		return nil, err
	}
	defer plain.stop()
	client, err := rpc.Dial(fc.addr, rpc.ClientConfig{Token: benchJob})
	if err != nil {
		return nil, err
	}
	defer client.Close()
	fitcache := fitcacheReader{c: client, root: data}
	if err := fitcache.warm(paths, size); err != nil {
		return nil, err
	}

	samples := map[string][]sample{} // by path and reads in flight: one per round
	key := func(path string, k int) string { return path + "/" + strconv.Itoa(k) }
	for r := 0; r < cfg.Rounds; r++ {
		s, err := measure(paths, cfg.Reads, 1, nil, localRead(size))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", pathLocal, err)
		}
		samples[key(pathLocal, 1)] = append(samples[key(pathLocal, 1)], s)
		for _, k := range cfg.InFlight {
			tcp, err := newTCPReaders(plain.addr, k, size)
			if err != nil {
				return nil, err
			}
			order := remotePaths(cfg, k)
			if r%2 == 1 {
				slices.Reverse(order)
			}
			for _, path := range order {
				var s sample
				switch path {
				case pathTCP:
					s, err = measure(paths, cfg.Reads, k, plain, tcp.read)
				case pathFitCache:
					s, err = measure(paths, cfg.Reads, k, fc, fitcache.read(size))
				default:
					s, err = measureBatches(paths, cfg.Reads, k, fc, fitcache.readBatch(size, k))
				}
				if err != nil {
					tcp.close()
					return nil, fmt.Errorf("%s: %w", path, err)
				}
				samples[key(path, k)] = append(samples[key(path, k)], s)
			}
			tcp.close()
		}
	}
	if cfg.Profile != "" {
		for _, k := range cfg.InFlight {
			if err := profileReads(cfg, fc, paths, k, fitcache.read(size), size); err != nil {
				return nil, err
			}
		}
	}

	results := []result{summarize(samples[key(pathLocal, 1)], size, 1, pathLocal)}
	for _, k := range cfg.InFlight {
		for _, path := range remotePaths(cfg, k) {
			results = append(results, summarize(samples[key(path, k)], size, k, path))
		}
	}
	return results, nil
}

// writeFiles writes n files of size bytes under dir, each identified by its first 8 bytes.
func writeFiles(dir string, n, size int) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var paths []string
	for i := 0; i < n; i++ {
		p := filepath.Join(dir, fmt.Sprintf("f%05d.bin", i))
		if err := os.WriteFile(p, content(i, size), 0o644); err != nil {
			return nil, err
		}
		paths = append(paths, p)
	}
	return paths, nil
}

// content returns the bytes of file i: its number, then pseudo-random bytes.
func content(i, size int) []byte {
	b := make([]byte, size)
	x := uint64(i)*0x9e3779b97f4a7c15 + 1
	for j := 0; j+8 <= size; j += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b[j:], x)
	}
	if size >= 8 {
		binary.LittleEndian.PutUint64(b, uint64(i))
	}
	return b
}

// check verifies a read's length and the file number it starts with (the whole content is
// compared once, when the server is warmed).
func check(b []byte, i, size int) error {
	if len(b) != size || (size >= 8 && binary.LittleEndian.Uint64(b) != uint64(i)) {
		return fmt.Errorf("file %d: %d bytes, not the file's %d", i, len(b), size)
	}
	return nil
}

// sample is one path's figures over one round.
type sample struct {
	lat       []time.Duration
	wall      time.Duration
	bytes     int64
	clientCPU time.Duration
	serverCPU time.Duration
}

// maxInFlight bounds the reads in flight at once.
const maxInFlight = 64

// readFunc reads file i (paths[i]) for worker w.
type readFunc func(w, i int, path string) (int, error)

// measure runs reads reads of the files in turn, k at a time (worker w reads the w-th, the
// w+k-th... of the sequence), and the CPU time this process (the client) and server (nil for
// a local read) used meanwhile.
func measure(paths []string, reads, k int, server *child, read readFunc) (sample, error) {
	lat := make([]time.Duration, reads)
	errs := make([]error, k)
	var total [maxInFlight]int64 // bytes per worker
	if k > maxInFlight {
		return sample{}, fmt.Errorf("at most %d reads in flight", maxInFlight)
	}
	self := selfCPU()
	var srv0 time.Duration
	if server != nil {
		srv0 = server.cpu.now()
	}
	cli0, start := self.now(), time.Now()
	var wg sync.WaitGroup
	for w := 0; w < k; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < reads; i += k {
				t := time.Now()
				n, err := read(w, i%len(paths), paths[i%len(paths)])
				if err != nil {
					errs[w] = err
					return
				}
				lat[i] = time.Since(t)
				total[w] += int64(n)
			}
		}()
	}
	wg.Wait()
	s := sample{lat: lat, wall: time.Since(start), clientCPU: self.now() - cli0}
	if server != nil {
		s.serverCPU = server.cpu.now() - srv0
	}
	for w := 0; w < k; w++ {
		s.bytes += total[w]
	}
	return s, errors.Join(errs...)
}

// batchFunc reads the files first, first+1, ... first+len(lat)-1 (modulo len(paths)) in
// one call.
type batchFunc func(first int, paths []string) (int, error)

// measureBatches runs reads reads of the files in turn, k at a time in one call: each read
// takes as long as its batch.
func measureBatches(paths []string, reads, k int, server *child, read batchFunc) (sample, error) {
	lat := make([]time.Duration, reads)
	self := selfCPU()
	srv0, cli0, start := server.cpu.now(), self.now(), time.Now()
	var total int64
	for i := 0; i < reads; i += k {
		t := time.Now()
		n, err := read(i, paths)
		if err != nil {
			return sample{}, err
		}
		total += int64(n)
		for j := i; j < min(i+k, reads); j++ {
			lat[j] = time.Since(t)
		}
	}
	return sample{lat: lat, wall: time.Since(start), bytes: total, clientCPU: self.now() - cli0,
		serverCPU: server.cpu.now() - srv0}, nil
}

// summarize returns the medians over rounds of a path's figures.
func summarize(rounds []sample, size, k int, path string) result {
	var p50, p99, mbps, cli, srv []float64
	for _, s := range rounds {
		l := slices.Clone(s.lat)
		slices.Sort(l)
		reads := float64(len(l))
		p50 = append(p50, ms(l[len(l)/2]))
		p99 = append(p99, ms(l[len(l)*99/100]))
		mbps = append(mbps, float64(s.bytes)/s.wall.Seconds()/1e6)
		cli = append(cli, float64(s.clientCPU.Microseconds())/reads)
		srv = append(srv, float64(s.serverCPU.Microseconds())/reads)
	}
	return result{Size: size, InFlight: k, Path: path, P50ms: median(p50), P99ms: median(p99), MBps: median(mbps),
		ClientCPU: median(cli), ServerCPU: median(srv)}
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

func median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}

// printSize prints the rows of one size; ratios are against the plain TCP server at the same
// number of reads in flight, and CPU against the plain local read.
func printSize(out io.Writer, rs []result) {
	local := rs[0]
	var tcp result
	for _, r := range rs {
		label := tiers.FormatBytes(int64(r.Size))
		vs, cpu := "", fmt.Sprintf("%.2fx", r.CPU()/local.CPU())
		switch r.Path {
		case pathLocal:
			vs = "(local)"
		case pathTCP:
			tcp, vs = r, "1.00"
		default:
			vs = fmt.Sprintf("%.2fx throughput, %.2fx p50", r.MBps/tcp.MBps, r.P50ms/tcp.P50ms)
		}
		server := fmt.Sprintf("%.1f", r.ServerCPU)
		if r.Path == pathLocal {
			server = "-"
		}
		fmt.Fprintf(out, "| %s | %d | %s | %.3f | %.3f | %.0f | %s | %.1f | %s | %s |\n",
			label, r.InFlight, r.Path, r.P50ms, r.P99ms, r.MBps, vs, r.ClientCPU, server, cpu)
	}
}

// localRead opens, reads and closes a page-cached file, into a buffer of the worker's: the
// plain read that a remote read's CPU is compared with.
func localRead(size int) readFunc {
	var bufs [maxInFlight][]byte
	return func(w, i int, path string) (int, error) {
		f, err := os.Open(path)
		if err != nil {
			return 0, err
		}
		if bufs[w] == nil {
			bufs[w] = make([]byte, size)
		}
		n, err := io.ReadFull(f, bufs[w])
		f.Close()
		if err != nil {
			return n, err
		}
		return n, check(bufs[w], i, size)
	}
}

// fitcacheReader reads files from a FitCache server as another server of the job would.
type fitcacheReader struct {
	c    *rpc.Client
	root string
}

// warm reads every file once (the server caches it), checks its bytes, and checks that a
// second read finds it in the server's memory tier.
func (f fitcacheReader) warm(paths []string, size int) error {
	for pass := 0; pass < 2; pass++ {
		for i, p := range paths {
			reply, err := f.c.Read(context.Background(), f.root, p, false)
			if err != nil {
				return fmt.Errorf("warm read %s: %w", p, err)
			}
			switch {
			case pass == 0 && string(reply.Data) != string(content(i, size)):
				return fmt.Errorf("warm read %s: wrong bytes", p)
			case pass == 1 && rpc.OriginOf(reply) != core.OriginMemory:
				return fmt.Errorf("warm read %s: served from %q, not the memory tier", p, reply.Origin)
			}
		}
	}
	return nil
}

// read reads into a buffer of the worker's, as the baselines do.
func (f fitcacheReader) read(size int) readFunc {
	var bufs [maxInFlight][]byte
	return func(w, i int, path string) (int, error) {
		if bufs[w] == nil {
			bufs[w] = make([]byte, size)
		}
		reply, err := f.c.ReadInto(context.Background(), &fitcachepb.ReadRequest{Root: f.root, Path: path}, bufs[w])
		if err != nil {
			return 0, err
		}
		return len(reply.Data), check(reply.Data, i, size)
	}
}

// readBatch reads k files in one call, into a buffer it reuses.
func (f fitcacheReader) readBatch(size, k int) batchFunc {
	buf := make([]byte, size*k)
	return func(first int, paths []string) (int, error) {
		req := &fitcachepb.ReadBatchRequest{Root: f.root}
		for i := first; i < first+k; i++ {
			req.Paths = append(req.Paths, paths[i%len(paths)])
		}
		r, err := f.c.ReadBatch(context.Background(), req, buf, nil)
		if err != nil {
			return 0, err
		}
		n := 0
		for j, reply := range r.Replies {
			if reply.Errno != 0 {
				return n, fmt.Errorf("%s: errno %d: %s", req.Paths[j], reply.Errno, reply.Message)
			}
			if err := check(reply.Data, (first+j)%len(paths), size); err != nil {
				return n, err
			}
			n += len(reply.Data)
		}
		return n, nil
	}
}

// tcpReaders are connections to the plain TCP server, one per worker.
type tcpReaders struct {
	conns []net.Conn
	bufs  [][]byte // the workers' buffers, reused
	size  int
}

func newTCPReaders(addr string, k, size int) (*tcpReaders, error) {
	t := &tcpReaders{size: size}
	for w := 0; w < k; w++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.close()
			return nil, err
		}
		t.conns = append(t.conns, c)
		t.bufs = append(t.bufs, make([]byte, size))
	}
	return t, nil
}

func (t *tcpReaders) read(w, i int, path string) (int, error) {
	if _, err := io.WriteString(t.conns[w], path+"\n"); err != nil {
		return 0, err
	}
	var hdr [8]byte
	if _, err := io.ReadFull(t.conns[w], hdr[:]); err != nil { // unbuffered: the bytes are read once
		return 0, err
	}
	n := binary.LittleEndian.Uint64(hdr[:])
	if n > uint64(cap(t.bufs[w])) {
		return 0, fmt.Errorf("%d bytes announced for a file of %d", n, t.size)
	}
	b := t.bufs[w][:n]
	if _, err := io.ReadFull(t.conns[w], b); err != nil {
		return 0, err
	}
	return len(b), check(b, i, t.size)
}

func (t *tcpReaders) close() {
	for _, c := range t.conns {
		c.Close()
	}
}

// profileReads profiles FitCache reads, k in flight, on both sides: client-SIZE-kK.pprof
// and server-SIZE-kK.pprof in cfg.Profile.
func profileReads(cfg config, server *child, paths []string, k int, read readFunc, size int) error {
	if err := os.MkdirAll(cfg.Profile, 0o755); err != nil {
		return err
	}
	name := func(side string) string {
		return filepath.Join(cfg.Profile, fmt.Sprintf("%s-%d-k%d.pprof", side, size, k))
	}
	f, err := os.Create(name("client"))
	if err != nil {
		return err
	}
	defer f.Close()
	if err := server.profile(name("server")); err != nil {
		return err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		return err
	}
	_, err = measure(paths, max(cfg.Reads, int(cfg.ProfileBytes/int64(size))), k, server, read)
	pprof.StopCPUProfile()
	if perr := server.profile(""); err == nil {
		err = perr
	}
	return err
}
