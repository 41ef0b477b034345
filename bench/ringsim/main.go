// Command ringsim reproduces the load-distribution simulation of the hash-ring paper (Lee et
// al., "Fault-Tolerant Deep Learning Cache with Hash Ring for Load Balancing in HPC Systems",
// Fig. 6b): on a ring of 1,024 servers, one server fails; how many servers receive its
// files, and how many files does each receive? Repeated over trials (different failed
// servers, and rings built from different server names) for each number of virtual nodes.
//
//	go run ./bench/ringsim -out bench/results/ringsim.json
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"

	"github.com/fitcache/fitcache/ring"
)

type result struct {
	VirtualNodes     int     `json:"virtual_nodes"`
	ReceiversMean    float64 `json:"receivers_mean"`
	ReceiversStd     float64 `json:"receivers_std"`
	FilesPerRecvMean float64 `json:"files_per_receiver_mean"`
	FilesPerRecvStd  float64 `json:"files_per_receiver_std"`
	MaxFilesPerRecv  float64 `json:"max_files_per_receiver_mean"`
	LostFilesMean    float64 `json:"lost_files_mean"`
	Trials           int     `json:"trials"`
}

func main() {
	servers := flag.Int("servers", 1024, "servers on the ring")
	vnodesFlag := flag.String("vnodes", "10,50,100,200,500,1000", "virtual nodes per server")
	trials := flag.Int("trials", 500, "failures simulated per virtual-node count")
	rings := flag.Int("rings", 10, "rings built (from different server names) per count; trials are spread over them")
	files := flag.Int("files", 524288, "files (the paper's cosmoUniverse training set)")
	out := flag.String("out", "", "write JSON here")
	flag.Parse()

	keys := make([]string, *files)
	for i := range keys {
		keys[i] = fmt.Sprintf("/lustre/cosmoUniverse/train/sample_%07d.tfrecord", i)
	}
	var results []result
	fmt.Println("| virtual nodes | receivers (mean ± std) | files per receiver (mean ± std) | most files to one receiver (mean) | files lost (mean) |")
	fmt.Println("|---|---|---|---|---|")
	for _, vs := range strings.Split(*vnodesFlag, ",") {
		vnodes, err := strconv.Atoi(vs)
		if err != nil {
			log.Fatal(err)
		}
		var recv, per, most, lost []float64
		rng := rand.New(rand.NewPCG(uint64(vnodes), 7))
		for r := 0; r < *rings; r++ {
			rg := ring.New(vnodes, nil)
			ms := make([]ring.Member, *servers)
			for s := range ms {
				ms[s] = ring.Member{ID: fmt.Sprintf("ring%02d-node%04d:7070", r, s), Node: fmt.Sprintf("ring%02d-node%04d", r, s)}
			}
			rg.Add(ms...) // one sort for all points
			byOwner := map[string][]string{}
			for _, k := range keys {
				m, _ := rg.Lookup(k)
				byOwner[m.ID] = append(byOwner[m.ID], k)
			}
			members := rg.Members()
			for t := r * *trials / *rings; t < (r+1)**trials / *rings; t++ {
				failed := members[rng.IntN(len(members))].ID
				counts := map[string]int{}
				for _, k := range byOwner[failed] {
					counts[rg.Successors(k, 2, false)[1].ID]++ // its owner once failed is removed
				}
				n := len(byOwner[failed])
				lost = append(lost, float64(n))
				recv = append(recv, float64(len(counts)))
				if len(counts) > 0 {
					per = append(per, float64(n)/float64(len(counts)))
					mx := 0
					for _, c := range counts {
						mx = max(mx, c)
					}
					most = append(most, float64(mx))
				}
			}
		}
		res := result{VirtualNodes: vnodes, Trials: len(recv)}
		res.ReceiversMean, res.ReceiversStd = meanStd(recv)
		res.FilesPerRecvMean, res.FilesPerRecvStd = meanStd(per)
		res.MaxFilesPerRecv, _ = meanStd(most)
		res.LostFilesMean, _ = meanStd(lost)
		results = append(results, res)
		fmt.Printf("| %d | %.1f ± %.1f | %.2f ± %.2f | %.1f | %.0f |\n", vnodes, res.ReceiversMean, res.ReceiversStd,
			res.FilesPerRecvMean, res.FilesPerRecvStd, res.MaxFilesPerRecv, res.LostFilesMean)
	}
	if *out != "" {
		b, _ := json.MarshalIndent(results, "", "  ")
		if err := os.WriteFile(*out, b, 0o644); err != nil {
			log.Fatal(err)
		}
	}
}

func meanStd(xs []float64) (float64, float64) {
	if len(xs) == 0 {
		return 0, 0
	}
	var sum, sq float64
	for _, x := range xs {
		sum += x
	}
	mean := sum / float64(len(xs))
	for _, x := range xs {
		sq += (x - mean) * (x - mean)
	}
	return mean, math.Sqrt(sq / float64(len(xs)))
}
