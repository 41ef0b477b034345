package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/discovery"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// exitNoServer is the exit status of `fitcache stats` when no server runs, so that scripts
// can tell "nothing cached yet" from a failure.
const exitNoServer = 3

func stats(args []string) error {
	fs := flag.NewFlagSet("stats", flag.ExitOnError)
	asJSON := fs.Bool("json", false, "print the raw JSON counters")
	socket := fs.String("socket", "", "server socket (default: the embedded server's)")
	fs.Parse(args)
	cfg, err := config.Load(nil)
	if err != nil {
		return err
	}
	if cfg.Servers != "" && *socket == "" {
		return clusterStats(cfg, *asJSON)
	}
	if *socket == "" {
		if err := embedded.CheckSocket(cfg.RuntimeDir); err != nil { // talk only to our own server
			return err
		}
		*socket = embedded.SocketPath(cfg.RuntimeDir)
	}
	c, err := rpc.Dial(*socket, rpc.ClientConfig{})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	js, err := c.Stats(ctx)
	if errors.Is(err, rpc.ErrUnavailable) {
		fmt.Fprintf(os.Stderr, "fitcache stats: no fitcache server answers at %s\n", *socket)
		os.Exit(exitNoServer)
	}
	if err != nil {
		return err
	}
	if *asJSON {
		var out bytes.Buffer
		if err := json.Indent(&out, []byte(js), "", "  "); err != nil {
			return fmt.Errorf("the server's statistics are no JSON: %w", err)
		}
		fmt.Println(out.String())
		return nil
	}
	var s core.StatsSnapshot
	if err := json.Unmarshal([]byte(js), &s); err != nil {
		return err
	}
	printStats(os.Stdout, s)
	return nil
}

func printStats(w *os.File, s core.StatsSnapshot) {
	hits := int64(0)
	for _, n := range s.Hits {
		hits += n
	}
	total := hits + s.InflightHits + s.Misses
	fmt.Fprintf(w, "reads        %d (hits %d, in-flight %d, misses %d)\n", total, hits, s.InflightHits, s.Misses)
	for _, k := range tiers.Kinds() {
		if n := s.Hits[k.String()]; n > 0 {
			fmt.Fprintf(w, "  %-10s %d hits (%.1f%%)\n", k, n, 100*float64(n)/float64(max(total, 1)))
		}
	}
	fmt.Fprintf(w, "source reads %d (%s)\n", s.SourceReads, tiers.FormatBytes(s.SourceBytes))
	if s.ReaderSourceRanges > 0 {
		fmt.Fprintf(w, "  by readers %d ranges of large files (%s), under fitcache run\n", s.ReaderSourceRanges,
			tiers.FormatBytes(s.ReaderSourceBytes))
	}
	fmt.Fprintf(w, "checked      %d copies against their source, %d stale\n", s.SourceChecks, s.StaleCopies)
	fmt.Fprintf(w, "served       %s\n", tiers.FormatBytes(s.BytesServed))
	fmt.Fprintf(w, "published    %d, spilled %d, evicted %d, uncached %d\n", s.Published, s.Spilled, s.Evictions, s.Uncached)
	fmt.Fprintf(w, "errors       %d read, %d publish\n", s.Errors, s.PublishErrors)
	printPrefetchStats(w, s.Prefetch)
	for _, t := range s.Tiers {
		fmt.Fprintf(w, "tier %-6s  %s  %s of %s used, %d files, index %s (%s)\n", t.Kind, t.Dir,
			tiers.FormatBytes(t.Used), tiers.FormatBytes(t.Budget), t.Files, tiers.FormatBytes(t.IndexBytes), t.FSType)
		if t.LimitedBy != "" {
			fmt.Fprintf(w, "             budget lowered from %s by the %s\n", tiers.FormatBytes(t.ConfiguredBudget), t.LimitedBy)
		}
	}
	for _, msg := range s.Warnings {
		fmt.Fprintf(w, "warning      %s\n", msg)
	}
}

// clusterStats totals the counters of every server of a cluster job (FITCACHE_SERVERS).
func clusterStats(cfg config.Config, asJSON bool) error {
	members, token, err := discovery.Job(cfg.ServerSpec(),
		cfg.Token, cfg.TokenFile)
	if err != nil {
		return err
	}
	out := struct {
		Total   core.StatsSnapshot         `json:"total"`
		Servers map[string]json.RawMessage `json:"servers"`
		Down    map[string]string          `json:"unreachable,omitempty"`
	}{Servers: map[string]json.RawMessage{}, Down: map[string]string{}}
	for _, m := range members {
		c, err := rpc.Dial(m.ID, rpc.ClientConfig{Token: token})
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		js, err := c.Stats(ctx)
		cancel()
		if err != nil {
			out.Down[m.ID] = err.Error()
			continue
		}
		var s core.StatsSnapshot
		if err := json.Unmarshal([]byte(js), &s); err != nil {
			return err
		}
		out.Total.Add(s)
		out.Servers[m.ID] = json.RawMessage(js)
	}
	if asJSON {
		b, _ := json.MarshalIndent(out, "", "  ")
		fmt.Println(string(b))
	} else {
		fmt.Printf("%d servers answered, %d unreachable\n", len(out.Servers), len(out.Down))
		for id, e := range out.Down {
			fmt.Printf("  unreachable %s: %s\n", id, e)
		}
		printStats(os.Stdout, out.Total)
	}
	if len(out.Servers) == 0 {
		os.Exit(exitNoServer)
	}
	return nil
}
