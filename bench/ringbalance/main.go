// Command ringbalance measures how evenly the hash ring spreads a dataset's bytes over a job's
// servers, for each number of virtual nodes: the busiest server's bytes over the mean, which
// is the headroom each server's tiers need above an even share for the whole dataset to stay
// cached (a server whose share exceeds its budget reads the rest from the source every epoch).
// Each ring is built from the names of a job drawn at random (node names and ports), as jobs
// get different nodes; files are named like an ImageNet-style tree, with lognormal sizes
// around 110 KiB. It also times the ring's build, which every client pays once per dataset.
//
//	go run ./bench/ringbalance -out bench/results/ringbalance-2026-11-28.json
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fitcache/fitcache/ring"
)

type result struct {
	Servers      int     `json:"servers"`
	VirtualNodes int     `json:"virtual_nodes"` // per server; what ring.VirtualNodesFor gives for "auto"
	Auto         bool    `json:"auto"`
	Rings        int     `json:"rings"`
	Median       float64 `json:"busiest_over_mean_median"`
	P90          float64 `json:"busiest_over_mean_p90"`
	Worst        float64 `json:"busiest_over_mean_worst"`
	Over10       float64 `json:"rings_over_10pct"` // fraction of rings whose busiest server exceeds 1.1x the mean
	Over25       float64 `json:"rings_over_25pct"`
	BuildMillis  float64 `json:"build_ms_median"`
}

func main() {
	serversFlag := flag.String("servers", "4,16,64,256,1024", "servers in the job")
	vnodesFlag := flag.String("vnodes", "100,250,500,1000,auto", "virtual nodes per server (auto: ring.VirtualNodesFor)")
	rings := flag.Int("rings", 100, "rings (jobs) drawn per configuration")
	files := flag.Int("files", 100000, "files in the dataset")
	out := flag.String("out", "", "write JSON here")
	flag.Parse()

	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]string, *files)
	sizes := make([]float64, *files)
	for i := range keys {
		keys[i] = fmt.Sprintf("/lustre/imagenet/train/n%08d/n%08d_%07d.JPEG", i%1000, i%1000, i)
		sizes[i] = 110 << 10 * math.Exp(0.5*rng.NormFloat64()-0.125) // mean 110 KiB
	}
	fmt.Printf("%d files, %d rings per row; busiest server's bytes over the mean share\n\n", *files, *rings)
	fmt.Println("| servers | virtual nodes | median | p90 | worst | rings over 1.1x | rings over 1.25x | build (median) |")
	fmt.Println("|---|---|---|---|---|---|---|---|")
	var results []result
	for _, ss := range strings.Split(*serversFlag, ",") {
		n, err := strconv.Atoi(ss)
		if err != nil {
			log.Fatal(err)
		}
		for _, vs := range strings.Split(*vnodesFlag, ",") {
			res := result{Servers: n, Rings: *rings, Auto: vs == "auto"}
			if res.Auto {
				res.VirtualNodes = ring.VirtualNodesFor(n)
			} else if res.VirtualNodes, err = strconv.Atoi(vs); err != nil {
				log.Fatal(err)
			}
			var busiest, builds []float64
			for range *rings {
				ms := make([]ring.Member, n)
				first := rng.IntN(10000)
				port := 7000 + rng.IntN(1000)
				for s := range ms {
					node := fmt.Sprintf("gpu%05d", first+s)
					ms[s] = ring.Member{ID: node + ":" + strconv.Itoa(port), Node: node}
				}
				start := time.Now()
				r := ring.New(res.VirtualNodes, nil)
				r.Add(ms...)
				builds = append(builds, float64(time.Since(start).Microseconds())/1000)
				bytes := map[string]float64{}
				total := 0.0
				for i, k := range keys {
					m, _ := r.Lookup(k)
					bytes[m.ID] += sizes[i]
					total += sizes[i]
				}
				most := 0.0
				for _, b := range bytes {
					most = max(most, b)
				}
				busiest = append(busiest, most/(total/float64(n)))
			}
			slices.Sort(busiest)
			slices.Sort(builds)
			res.Median, res.P90, res.Worst = busiest[len(busiest)/2], busiest[len(busiest)*9/10], busiest[len(busiest)-1]
			res.Over10, res.Over25 = share(busiest, 1.1), share(busiest, 1.25)
			res.BuildMillis = builds[len(builds)/2]
			results = append(results, res)
			name := strconv.Itoa(res.VirtualNodes)
			if res.Auto {
				name = "auto (" + name + ")"
			}
			fmt.Printf("| %d | %s | %.3f | %.3f | %.3f | %.0f%% | %.0f%% | %.1f ms |\n", n, name, res.Median, res.P90,
				res.Worst, 100*res.Over10, 100*res.Over25, res.BuildMillis)
		}
	}
	if *out != "" {
		b, _ := json.MarshalIndent(results, "", "  ")
		if err := os.WriteFile(*out, b, 0o644); err != nil {
			log.Fatal(err)
		}
	}
}

// share is the fraction of the sorted values xs above limit.
func share(xs []float64, limit float64) float64 {
	i, _ := slices.BinarySearch(xs, limit)
	for i < len(xs) && xs[i] <= limit {
		i++
	}
	return float64(len(xs)-i) / float64(len(xs))
}
