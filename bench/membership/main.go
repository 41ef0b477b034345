// Command membership measures the servers' membership (package membership: SWIM over
// hashicorp/memberlist, as FitCache's servers run it) at N members on loopback, all in this
// process, each with its own gossip port: how long N members take to know each other, what
// each member sends per second when nothing happens, how long a halted member (crashed or
// hung: it answers nothing and says nothing) takes to be declared dead by every other
// member, how long news from a server's reads (Tell) takes to reach every member, and what
// a lookup on the ring costs with a dead member, the ring FitCache never rebuilds (dead
// members are walked past). For 1,024 and 10,000 members, which one machine cannot run, it
// computes the detection bounds and per-member traffic from memberlist's formulas with the
// same settings, next to the measured sizes.
//
//	go run ./bench/membership -sizes 16,32,64 -rounds 3 -out bench/results/membership.json
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"math"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fitcache/fitcache/membership"
	"github.com/fitcache/fitcache/ring"
)

// Settings of memberlist's LAN profile that FitCache keeps (membership.Start).
const (
	suspicionMult    = 4 // suspicion lasts SuspicionMult * log10(max(N,10)) probe intervals at least,
	suspicionMaxMult = 6 // and this many times that at most, less as other members confirm it
	retransmitMult   = 4 // news is retransmitted RetransmitMult * ceil(log10(N+1)) times by each member
)

type round struct {
	N              int     `json:"n"`
	ConvergeS      float64 `json:"converge_s"`         // until every member sees N alive
	PacketsPerS    float64 `json:"packets_per_node_s"` // UDP, steady state, per member
	StreamsPerS    float64 `json:"streams_per_node_s"` // TCP, steady state, per member
	DetectMedianS  float64 `json:"detect_median_s"`    // halt -> a member declares it dead
	DetectMaxS     float64 `json:"detect_max_s"`       // halt -> the last member declares it dead
	DetectPackets  float64 `json:"detect_packets_per_node"`
	NewsMaxS       float64 `json:"news_max_s"` // Tell -> the last member hears it
	LookupNs       float64 `json:"lookup_ns"`
	LookupDeadNs   float64 `json:"lookup_one_dead_ns"`
	ProbeIntervalS float64 `json:"probe_interval_s"`
}

func main() {
	sizes := flag.String("sizes", "16,32,64", "members per run")
	rounds := flag.Int("rounds", 3, "rounds per size; figures are medians")
	probe := flag.Duration("probe", membership.DefaultProbeInterval, "probe interval (the probe_interval option)")
	steady := flag.Duration("steady", 10*time.Second, "how long traffic is counted with nothing happening")
	out := flag.String("out", "", "JSON results file")
	flag.Parse()
	var all []round
	for _, f := range strings.Split(*sizes, ",") {
		n, err := strconv.Atoi(f)
		if err != nil || n < 3 {
			log.Fatalf("size %q: want a number of members from 3", f)
		}
		for r := range *rounds {
			res, err := measure(n, *probe, *steady)
			for try := 1; err != nil && strings.Contains(err.Error(), "address already in use") && try < 3; try++ {
				// A port found free was taken meanwhile (an outgoing connection's): again.
				log.Printf("%d members, round %d: %v; again", n, r+1, err)
				res, err = measure(n, *probe, *steady)
			}
			if err != nil {
				log.Fatalf("%d members: %v", n, err)
			}
			log.Printf("%d members, round %d: %+v", n, r+1, res)
			all = append(all, res)
		}
	}
	table := markdown(all, *probe)
	fmt.Print(table)
	if *out != "" {
		b, _ := json.MarshalIndent(map[string]any{"rounds": all, "table": table}, "", "  ")
		if err := os.WriteFile(*out, b, 0o644); err != nil {
			log.Fatal(err)
		}
	}
}

// measure runs one round at n members.
func measure(n int, probe, steady time.Duration) (round, error) {
	res := round{N: n, ProbeIntervalS: probe.Seconds()}
	ids, err := names(n)
	if err != nil {
		return res, err
	}
	type change struct {
		at    time.Time
		alive bool
	}
	var mu sync.Mutex
	seen := make([]map[string]change, n) // by member: what it was told of each other member
	ms := make([]*membership.Membership, n)
	start := time.Now()
	for i, id := range ids {
		seen[i] = map[string]change{}
		m, err := membership.Start(membership.Config{Self: id, Servers: ids, Token: "bench",
			PortOffset: membership.DefaultPortOffset, ProbeInterval: probe, Log: slog.New(slog.DiscardHandler),
			OnChange: func(other string, alive bool) {
				mu.Lock()
				defer mu.Unlock()
				if _, ok := seen[i][other]; !ok || !alive {
					seen[i][other] = change{time.Now(), alive}
				}
			}})
		if err != nil {
			return res, err
		}
		ms[i] = m
	}
	defer func() {
		for _, m := range ms {
			m.Close()
		}
	}()
	if !waitFor(2*time.Minute, func() bool {
		for _, m := range ms {
			if len(m.Alive()) != n {
				return false
			}
		}
		return true
	}) {
		return res, fmt.Errorf("members did not converge")
	}
	res.ConvergeS = time.Since(start).Seconds()

	sent := func() (p, s int64) {
		for _, m := range ms[1:] {
			t := m.Sent()
			p, s = p+t.Packets, s+t.Streams
		}
		return p, s
	}
	p0, s0 := sent()
	time.Sleep(steady)
	p1, s1 := sent()
	res.PacketsPerS = float64(p1-p0) / float64(n-1) / steady.Seconds()
	res.StreamsPerS = float64(s1-s0) / float64(n-1) / steady.Seconds()

	// A halted member: every other one must declare it dead.
	halted := ids[0]
	p0, _ = sent()
	haltedAt := time.Now()
	ms[0].Halt()
	if !waitFor(5*time.Minute, func() bool {
		mu.Lock()
		defer mu.Unlock()
		for i := 1; i < n; i++ {
			if c, ok := seen[i][halted]; !ok || c.alive || c.at.Before(haltedAt) {
				return false
			}
		}
		return true
	}) {
		return res, fmt.Errorf("the halted member was not declared dead by every member")
	}
	var detect []float64
	mu.Lock()
	for i := 1; i < n; i++ {
		detect = append(detect, seen[i][halted].at.Sub(haltedAt).Seconds())
	}
	mu.Unlock()
	p1, _ = sent()
	res.DetectMedianS, res.DetectMaxS = median(detect), slices.Max(detect)
	res.DetectPackets = float64(p1-p0) / float64(n-1)

	// News from reads: member 1 tells that member 2 (alive) is dead.
	told := ids[2]
	toldAt := time.Now()
	ms[1].Tell(told)
	if !waitFor(time.Minute, func() bool {
		mu.Lock()
		defer mu.Unlock()
		for i := 3; i < n; i++ {
			if c, ok := seen[i][told]; !ok || c.alive || c.at.Before(toldAt) {
				return false
			}
		}
		return true
	}) {
		return res, fmt.Errorf("news did not reach every member")
	}
	var news []float64
	mu.Lock()
	for i := 3; i < n; i++ {
		news = append(news, seen[i][told].at.Sub(toldAt).Seconds())
	}
	mu.Unlock()
	res.NewsMaxS = slices.Max(news)

	res.LookupNs, res.LookupDeadNs = lookupCost(n)
	return res, nil
}

// lookupCost measures the placement of a key (the owner, walking past dead members) on a ring
// of n members with 100 virtual nodes each: with none dead, and with one.
func lookupCost(n int) (none, one float64) {
	r := ring.New(100, nil)
	var members []ring.Member
	for i := range n {
		members = append(members, ring.Member{ID: fmt.Sprintf("node%05d:7070", i), Node: fmt.Sprintf("node%05d", i)})
	}
	r.Add(members...)
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = fmt.Sprintf("/data/train/%06d.jpg", i)
	}
	cost := func(dead string) float64 {
		b := testing.Benchmark(func(b *testing.B) {
			for i := range b.N {
				ring.Choose(r, keys[i%len(keys)], 1, true, func(m ring.Member) (string, ring.Choice) {
					if m.ID == dead {
						return "", ring.Pass
					}
					return m.ID, ring.Take
				})
			}
		})
		return float64(b.NsPerOp())
	}
	return cost(""), cost(members[0].ID)
}

// names returns n member names on loopback whose gossip ports were free a moment ago.
func names(n int) ([]string, error) {
	var out []string
	for tries := 0; len(out) < n; tries++ {
		if tries > 100*n {
			return nil, fmt.Errorf("no free ports")
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		u, uerr := net.ListenPacket("udp", fmt.Sprintf("127.0.0.1:%d", port))
		l.Close()
		if uerr != nil || port <= membership.DefaultPortOffset {
			continue
		}
		u.Close()
		out = append(out, fmt.Sprintf("127.0.0.1:%d", port-membership.DefaultPortOffset))
	}
	return out, nil
}

func waitFor(limit time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// markdown prints the medians per size, then the computed figures for larger jobs.
func markdown(all []round, probe time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, "| members | converge s | packets/s per member, idle | streams/s per member | declared dead after s: median / last | packets per member during detection | news from reads, last member s | ring lookup ns: none dead / one dead |\n")
	fmt.Fprintf(&b, "|---|---|---|---|---|---|---|---|\n")
	bySize := map[int][]round{}
	var sizes []int
	for _, r := range all {
		if _, ok := bySize[r.N]; !ok {
			sizes = append(sizes, r.N)
		}
		bySize[r.N] = append(bySize[r.N], r)
	}
	med := func(rs []round, f func(round) float64) float64 {
		var v []float64
		for _, r := range rs {
			v = append(v, f(r))
		}
		return median(v)
	}
	for _, n := range sizes {
		rs := bySize[n]
		fmt.Fprintf(&b, "| %d | %.2f | %.1f | %.2f | %.2f / %.2f | %.0f | %.2f | %.0f / %.0f |\n", n,
			med(rs, func(r round) float64 { return r.ConvergeS }), med(rs, func(r round) float64 { return r.PacketsPerS }),
			med(rs, func(r round) float64 { return r.StreamsPerS }),
			med(rs, func(r round) float64 { return r.DetectMedianS }), med(rs, func(r round) float64 { return r.DetectMaxS }),
			med(rs, func(r round) float64 { return r.DetectPackets }), med(rs, func(r round) float64 { return r.NewsMaxS }),
			med(rs, func(r round) float64 { return r.LookupNs }), med(rs, func(r round) float64 { return r.LookupDeadNs }))
	}
	fmt.Fprintf(&b, "\nComputed from memberlist's formulas with the same settings (probe interval %s):\n\n", probe)
	fmt.Fprintf(&b, "| members | suspicion before dead: shortest / longest s | retransmissions of one piece of news per member | ring lookup ns: none dead / one dead (measured) |\n|---|---|---|---|\n")
	for _, n := range []int{16, 32, 1024, 10000} {
		lo := suspicionMult * math.Log10(math.Max(float64(n), 10)) * probe.Seconds()
		none, one := lookupCost(n)
		fmt.Fprintf(&b, "| %d | %.1f / %.1f | %d | %.0f / %.0f |\n", n, lo, lo*suspicionMaxMult,
			retransmitMult*int(math.Ceil(math.Log10(float64(n+1)))), none, one)
	}
	return b.String()
}
