package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/fitcache/fitcache/client"
	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// prefetchCmd hands the server a list of files to read ahead of the readers (the
// machinery of core.Engine.Prefetch), read from standard input.
func prefetchCmd(args []string) error {
	rpc.QuietKitexLogs()
	fset := flag.NewFlagSet("prefetch", flag.ExitOnError)
	wait := fset.Bool("wait", false, "keep the job alive, with a progress line, until it ends; without it the job lives while readers that sent the same list renew it, and at least "+core.DefaultPrefetchLease.String())
	null := fset.Bool("0", false, "paths on standard input end with NUL bytes (default: one per line; input holding a NUL byte is read this way too)")
	quiet := fset.Bool("quiet", false, "no progress line")
	asJSON := fset.Bool("json", false, "print the job's state as JSON on standard output")
	thisEpoch := fset.Int("this-epoch", 0, "cluster mode: only the first N files are read in this epoch, the others in later ones (the node's server brings them in after those, a few at a time); 0: all")
	fset.Usage = func() {
		fmt.Fprintln(fset.Output(), "usage: fitcache prefetch [--wait] [-0] [--quiet] [--json] [--this-epoch N] DIR < LIST\n\n"+
			"Hands the server the files listed on standard input (absolute, or relative to the dataset root DIR),\n"+
			"in the order readers will read them, to read from the source ahead of them.")
		fset.PrintDefaults()
	}
	fset.Parse(args)
	if fset.NArg() != 1 {
		fset.Usage()
		os.Exit(2)
	}
	input, err := io.ReadAll(os.Stdin)
	if err != nil {
		return err
	}
	paths := splitList(input, *null)
	if len(paths) == 0 {
		return fmt.Errorf("no paths on standard input")
	}
	if *thisEpoch < 0 {
		return fmt.Errorf("--this-epoch %d: negative", *thisEpoch)
	}
	c, err := openClient(fset.Arg(0))
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.PrefetchEpochs(paths, *thisEpoch); err != nil {
		return err
	}
	info := c.PrefetchStatus()
	if *wait {
		info = follow(c, "prefetch", *quiet)
	}
	if *asJSON {
		b, _ := json.Marshal(info)
		fmt.Println(string(b))
	} else if !*quiet || info.Failed > 0 {
		fmt.Fprintf(os.Stderr, "prefetch: %d files handed over: %s\n", len(paths), describe(info))
	}
	return nil
}

// splitList splits a list of paths: at NUL bytes when told to or when there is one, else at
// line ends. Empty entries are dropped.
func splitList(input []byte, null bool) []string {
	sep := []byte("\n")
	if null || bytes.IndexByte(input, 0) >= 0 {
		sep = []byte{0}
	}
	var out []string
	for _, p := range bytes.Split(input, sep) {
		if sep[0] == '\n' {
			p = bytes.TrimSuffix(p, []byte("\r"))
		}
		if len(p) > 0 {
			out = append(out, string(p))
		}
	}
	return out
}

// openClient opens a client for the dataset under root, starting the embedded server (this
// very program) if needed.
func openClient(root string) (*client.Client, error) {
	cfg, err := config.Load(nil)
	if err != nil {
		return nil, err
	}
	if cfg.ServerBin == "" {
		cfg.ServerBin, _ = os.Executable() // this program is also the server
	}
	return client.Open(root, cfg, logger())
}

// follow keeps the client's prefetch jobs alive and shows their progress on standard error
// (unless quiet) until they end; it returns their final state. It asks ten times a second,
// so that it returns soon after the end, and prints twice a second.
func follow(c *client.Client, label string, quiet bool) core.PrefetchInfo {
	start := time.Now()
	var printed time.Time
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		info := c.PrefetchStatus()
		if !quiet && (info.Terminal() || time.Since(printed) >= 500*time.Millisecond) {
			printed = time.Now()
			fmt.Fprintf(os.Stderr, "\r%s: %s   ", label, progress(info, time.Since(start)))
		}
		if info.Terminal() {
			if !quiet {
				fmt.Fprintln(os.Stderr)
			}
			return info
		}
		<-tick.C
	}
}

// progress describes a job's progress after elapsed: files, bytes, rate and time left.
func progress(info core.PrefetchInfo, elapsed time.Duration) string {
	secs := max(elapsed.Seconds(), 1e-3)
	line := fmt.Sprintf("%d/%d files, %s, %s/s, %.0f files/s", info.Done, info.Files, tiers.FormatBytes(info.Bytes),
		tiers.FormatBytes(int64(float64(info.Bytes)/secs)), float64(info.Done)/secs)
	if info.Failed > 0 {
		line += fmt.Sprintf(", %d failed", info.Failed)
	}
	if !info.Terminal() && info.Done > 0 {
		left := time.Duration(float64(info.Files-info.Done) * elapsed.Seconds() / float64(info.Done) * float64(time.Second))
		line += ", eta " + left.Round(time.Second).String()
	}
	return line
}

// describe says how a job ended, or how far it is.
func describe(info core.PrefetchInfo) string {
	counts := fmt.Sprintf("%d fetched (%s), %d cached already, %d read by readers meanwhile, %d failed",
		info.Fetched, tiers.FormatBytes(info.Bytes), info.SkippedCached, info.SkippedInflight, info.Failed)
	var out string
	switch info.State {
	case core.PrefetchRunning:
		out = fmt.Sprintf("running, %d of %d files done so far: %s", info.Done, info.Files, counts)
	case core.PrefetchDone:
		out = "done: " + counts
	case core.PrefetchBudget:
		out = fmt.Sprintf("stopped when the tiers were full (prefetch never evicts) after %d of %d files: %s; "+
			"the other files are read on demand", info.Done, info.Files, counts)
	case core.PrefetchOff:
		out = "the server does not prefetch (option prefetch 0)"
	default:
		out = fmt.Sprintf("%s after %d of %d files: %s", info.State, info.Done, info.Files, counts)
	}
	for _, e := range info.Errors {
		out += "\n  failed: " + e
	}
	return out
}

// printPrefetchStats is the prefetch line of `fitcache stats`.
func printPrefetchStats(w io.Writer, p core.PrefetchStats) {
	if p.Reads == 0 && p.Jobs == 0 {
		fmt.Fprintf(w, "prefetch     off\n")
		return
	}
	fmt.Fprintf(w, "prefetch     %d reads at once; %d jobs (%d running, %d files queued); %d fetched (%s), "+
		"%d cached already, %d read by readers meanwhile, %d failed; stopped: %d at the budget, %d abandoned\n",
		p.Reads, p.Jobs, p.JobsActive, p.FilesQueued, p.Fetched, tiers.FormatBytes(p.Bytes), p.SkippedCached,
		p.SkippedInflight, p.Failed, p.StoppedBudget, p.Abandoned)
}
