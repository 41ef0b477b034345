package main

import (
	"context"
	"flag"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/discovery"
	"github.com/fitcache/fitcache/ring"
	"github.com/fitcache/fitcache/routing"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// size applies the server sizing rule of the FITCACHE paper (Hu et al., "FITCACHE: A
// Transparent Drop-In Framework for Multi-Tier Caching to Accelerate Distributed Deep
// Learning Workloads", section III-E):
//
//	S = ceil(V_epoch / (eta * B_srv * T_budget)),  T_budget = beta * T_comp
//
// V_epoch is the dataset's size, B_srv the sustained throughput of one server measured here,
// through the real read path (a server with a memory tier, Kitex over TCP, warm files).
func size(args []string) error {
	fset := flag.NewFlagSet("size", flag.ExitOnError)
	compute := fset.Duration("compute-time", 0, "compute time of one epoch, T_comp (required), e.g. 10m")
	eta := fset.Float64("eta", 0.75, "safety factor eta in (0, 1]")
	beta := fset.Float64("beta", 1.0, "I/O budget as a fraction of compute time: T_budget = beta * T_comp")
	duration := fset.Duration("duration", 5*time.Second, "how long to measure the server's throughput")
	readers := fset.Int("readers", 4, "concurrent readers driving the server")
	sample := fset.Int("sample", 256, "dataset files used for the measurement (at most 1 GiB)")
	volumeFlag := fset.String("volume", "", "per-epoch data volume V_epoch (e.g. 2TB) instead of the size of DATASET_DIR, whose files are then only the measurement's sample")
	serversFlag := fset.String("servers", "", "the job's servers (as the option servers: a list, @hostfile or slurm), or their number, for each server's share of the dataset; default: the option's, else S")
	fset.Parse(args)
	if fset.NArg() != 1 || *compute <= 0 || *eta <= 0 || *eta > 1 || *beta <= 0 {
		return fmt.Errorf("usage: fitcache size --compute-time DURATION [--eta 0.75] [--beta 1] [--volume V] [--servers LIST|N] DATASET_DIR")
	}
	root, err := filepath.Abs(fset.Arg(0))
	if err != nil {
		return err
	}
	files, volume, err := walkSizes(root)
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return fmt.Errorf("no files under %s", root)
	}
	if *volumeFlag != "" {
		v, err := tiers.ParseSize(*volumeFlag)
		if err != nil || v.Percent > 0 {
			return fmt.Errorf("--volume %q: want a size such as 2TB", *volumeFlag)
		}
		volume = v.Bytes
	}
	fmt.Printf("dataset   %s: %d files, V_epoch = %s\n", root, len(files), tiers.FormatBytes(volume))
	bsrv, err := measureServer(root, pickSample(files, *sample, 1<<30), *duration, *readers)
	if err != nil {
		return err
	}
	budget := *beta * compute.Seconds()
	s := math.Ceil(float64(volume) / (*eta * bsrv * budget))
	fmt.Printf("measured  B_srv = %s/s (one server, %d readers over Kitex/TCP, warm memory tier, %s)\n",
		tiers.FormatBytes(int64(bsrv)), *readers, *duration)
	fmt.Printf("budget    T_budget = beta x T_comp = %.2f x %s = %.1fs, eta = %.2f\n", *beta, *compute, budget, *eta)
	fmt.Printf("servers   S = ceil(V_epoch / (eta x B_srv x T_budget)) = ceil(%.3f) = %d\n",
		float64(volume)/(*eta*bsrv*budget), int(math.Max(s, 1)))
	if *volumeFlag != "" {
		fmt.Printf("tiers     not estimated: the files under %s are only the measurement's sample (--volume)\n", root)
		return nil
	}
	out, err := tierShares(files, *serversFlag, int(math.Max(s, 1)))
	fmt.Print(out)
	return err
}

// tierShares says what each server's tiers must hold for the whole dataset to stay cached:
// the share of the busiest server, which the ring makes larger than an even share (a
// server's excess is read from the source every epoch). With the job's servers (spec, else
// the option servers) it is that ring's exact share; with a number of servers (spec a
// number, else n), the median and the 90th percentile over typical jobs of that many servers
// named at random, as the ring depends on the names.
func tierShares(files []sizedFile, spec string, n int) (string, error) {
	if k, err := strconv.Atoi(spec); err == nil && k > 0 {
		spec, n = "", k
	}
	cfg, err := config.Load(map[string]string{"servers": spec})
	if err != nil {
		return "", err
	}
	var total int64
	for _, f := range files {
		total += f.size
	}
	if cfg.Servers != "" {
		members, err := discovery.Discover(cfg.ServerSpec())
		if err != nil {
			return "", err
		}
		vnodes := routing.VirtualNodes(cfg, members)
		most := busiestShare(files, members, vnodes)
		return fmt.Sprintf("tiers     %d servers, %d virtual nodes each: the busiest owns %s, %.2fx an even share (%s); give each\n"+
			"          server's tiers at least that, and room for node-local copies of other nodes' files beside it\n",
			len(members), vnodes, tiers.FormatBytes(most),
			float64(most)/(float64(total)/float64(len(members))), tiers.FormatBytes(total/int64(len(members)))), nil
	}
	if n == 1 {
		return fmt.Sprintf("tiers     one server owns the whole dataset: %s (--servers N: the share of each of N)\n",
			tiers.FormatBytes(total)), nil
	}
	// Enough jobs for a median and a 90th percentile, at most about 20 million lookups.
	jobs := max(10, min(100, 20_000_000/len(files)))
	rng := rand.New(rand.NewPCG(uint64(len(files)), uint64(n)))
	var over []float64
	vnodes := ring.VirtualNodesFor(n)
	for range jobs {
		members := make([]ring.Member, n)
		first, port := rng.IntN(10000), 7000+rng.IntN(1000)
		for i := range members {
			node := fmt.Sprintf("node%05d", first+i)
			members[i] = ring.Member{ID: node + ":" + strconv.Itoa(port), Node: node}
		}
		over = append(over, float64(busiestShare(files, members, vnodes))/(float64(total)/float64(n)))
	}
	sort.Float64s(over)
	even := float64(total) / float64(n)
	return fmt.Sprintf("tiers     %d servers (name them with --servers for this job's exact figure), %d virtual nodes each: the\n"+
		"          busiest owns %.2fx an even share (%s) in the median of %d jobs, %.2fx (%s) in 9 of 10; give each\n"+
		"          server's tiers at least that, and room for node-local copies of other nodes' files beside it\n",
		n, vnodes, over[len(over)/2], tiers.FormatBytes(int64(even*over[len(over)/2])), jobs,
		over[len(over)*9/10], tiers.FormatBytes(int64(even*over[len(over)*9/10]))), nil
}

// busiestShare is the bytes of files that the busiest of members owns on their ring (keys are
// the files' absolute paths, as readers route them).
func busiestShare(files []sizedFile, members []ring.Member, vnodes int) int64 {
	r := ring.New(vnodes, nil)
	r.Add(members...)
	owned := map[string]int64{}
	for _, f := range files {
		m, _ := r.Lookup(f.path)
		owned[m.ID] += f.size
	}
	var most int64
	for _, b := range owned {
		most = max(most, b)
	}
	return most
}

type sizedFile struct {
	path string
	size int64
}

func walkSizes(root string) ([]sizedFile, int64, error) {
	var out []sizedFile
	var total int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			out = append(out, sizedFile{p, fi.Size()})
			total += fi.Size()
		}
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].path < out[j].path })
	return out, total, err
}

// pickSample takes up to n files spread evenly over the dataset, at most maxBytes in all.
func pickSample(files []sizedFile, n int, maxBytes int64) []string {
	step := max(len(files)/max(n, 1), 1)
	var out []string
	var total int64
	for i := 0; i < len(files) && len(out) < n; i += step {
		if total+files[i].size > maxBytes && len(out) > 0 {
			break
		}
		out = append(out, files[i].path)
		total += files[i].size
	}
	return out
}

// measureServer runs a server on loopback with a temporary memory tier, caches the sample
// (one source read each), then reads it over and over from several readers for d.
func measureServer(root string, sample []string, d time.Duration, readers int) (float64, error) {
	rpc.QuietKitexLogs()
	shm, err := os.MkdirTemp("/dev/shm", "fitcache-size-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(shm)
	engine, err := core.NewEngine(core.EngineConfig{Tiers: []tiers.Config{{Dir: filepath.Join(shm, "tier"), Kind: tiers.Memory, Budget: "2GiB"}}}, nil)
	if err != nil {
		return 0, err
	}
	defer engine.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	srv, _, _ := rpc.Serve(engine, ln, rpc.ServerConfig{Token: "size"})
	defer srv.Stop()
	c, err := rpc.Dial(ln.Addr().String(), rpc.ClientConfig{Token: "size"})
	if err != nil {
		return 0, err
	}
	ctx := context.Background()
	for _, p := range sample {
		if _, err := c.Read(ctx, root, p, false); err != nil {
			return 0, fmt.Errorf("warming %s: %w", p, err)
		}
	}
	var bytes atomic.Int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(d)
	start := time.Now()
	errs := make(chan error, readers)
	for r := 0; r < readers; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := r; time.Now().Before(deadline); i++ {
				reply, err := c.Read(ctx, root, sample[i%len(sample)], false)
				if err != nil {
					errs <- err
					return
				}
				bytes.Add(int64(len(reply.Data)))
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, err
	}
	return float64(bytes.Load()) / time.Since(start).Seconds(), nil
}
