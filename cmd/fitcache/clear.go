package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/discovery"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// The running server owns its tiers (their accounting, FIFO order and index), so ls and
// clear go through it when it runs. Without one, ls reads the tiers' records (changing
// nothing) and clear opens the tiers itself, under their locks, as a starting server would,
// while it keeps a server from starting (embedded.HoldOff). In cluster mode (FITCACHE_SERVERS
// set, no --socket) ls and clear ask every server of the job, whose tiers hold the job's
// cache.

// lsCmd prints what the tiers hold per dataset root.
func lsCmd(args []string) error {
	rpc.QuietKitexLogs()
	fset := flag.NewFlagSet("ls", flag.ExitOnError)
	asJSON := fset.Bool("json", false, "print JSON")
	socket := fset.String("socket", "", "server socket (default: the embedded server's)")
	nf := addNodeFlags(fset)
	fset.Usage = func() {
		fmt.Fprintln(fset.Output(), "usage: fitcache ls [--json] [--socket PATH]\n"+
			"       fitcache ls --node [--dir DIR]... [--json]\n\n"+
			"Prints what the cache holds per dataset root and tier: files and the room they take.\n"+
			"With FITCACHE_SERVERS set (and no --socket), what every server of the job holds.\n"+
			"With --node, the memory tiers of every user on this node (fitcache-* in /dev/shm): owner,\n"+
			"files, size, and whether a live server holds each or it was left behind.")
		fset.PrintDefaults()
	}
	fset.Parse(args)
	if fset.NArg() != 0 || (nf.node && *socket != "") || (!nf.node && nf.dirs != nil) {
		fset.Usage()
		os.Exit(2)
	}
	if nf.node {
		return lsNode(nf, *asJSON)
	}
	if *socket == "" {
		cfg, err := config.Load(nil)
		if err != nil {
			return err
		}
		if cfg.Servers != "" {
			return clusterLs(cfg, *asJSON)
		}
	}
	cfg, c, pid, err := serverFor(*socket)
	if err != nil {
		return err
	}
	var us []core.CacheUsage
	if c != nil {
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if us, err = c.Usage(ctx); err != nil {
			return err
		}
	} else if us, err = tierUsage(cfg); err != nil {
		return err
	}
	if *asJSON {
		return printJSON(struct {
			ServerPID int               `json:"server_pid,omitempty"`
			Usage     []core.CacheUsage `json:"usage"`
		}{pid, nonNil(us)})
	}
	fmt.Println(source(cfg, c, pid))
	if len(us) == 0 {
		fmt.Println("nothing cached")
		return nil
	}
	printUsage(os.Stdout, us)
	return nil
}

// clusterLs prints what every server of a cluster job (FITCACHE_SERVERS) holds, asked over
// RPC as clusterStats asks for their counters: the job's cache is in their tiers, not in the
// embedded server's that ls lists otherwise. It fails when no server answers.
func clusterLs(cfg config.Config, asJSON bool) error {
	out, err := askJob(cfg, func(c *rpc.Client) ([]core.CacheUsage, error) { return c.Usage(context.Background()) })
	if err != nil {
		return err
	}
	if asJSON {
		if err := printJSON(out); err != nil {
			return err
		}
	} else {
		fmt.Printf("servers of the job (FITCACHE_SERVERS=%s): %d answered, %d unreachable\n", cfg.Servers, len(out.Servers), len(out.Down))
		files, bytes := printJob(out)
		fmt.Printf("\njob total: %d files, %s\n", files, tiers.FormatBytes(bytes))
	}
	return out.answered(cfg)
}

// clusterClear removes from every server of a cluster job (FITCACHE_SERVERS) the cached files
// of the datasets read with root (or under it; "" for all), as clear does with the embedded
// server's tiers. It fails when no server answers.
func clusterClear(cfg config.Config, root string, dryRun, asJSON bool) error {
	out, err := askJob(cfg, func(c *rpc.Client) ([]core.CacheUsage, error) {
		return c.Clear(context.Background(), root, dryRun)
	})
	if err != nil {
		return err
	}
	if asJSON {
		if err := printJSON(struct {
			DryRun bool `json:"dry_run"`
			jobAnswers
		}{dryRun, out}); err != nil {
			return err
		}
	} else {
		verb := "cleared"
		if dryRun {
			verb = "would clear (dry run)"
		}
		fmt.Printf("servers of the job (FITCACHE_SERVERS=%s): %d %s, %d unreachable\n", cfg.Servers, len(out.Servers), verb, len(out.Down))
		files, bytes := printJob(out)
		fmt.Printf("\njob total %s: %d files, %s\n", verb, files, tiers.FormatBytes(bytes))
	}
	return out.answered(cfg)
}

// jobAnswers is what the servers of a cluster job answered (askJob), by server address.
type jobAnswers struct {
	Servers map[string][]core.CacheUsage `json:"servers"`
	Down    map[string]string            `json:"unreachable,omitempty"`
}

// answered is an error naming the job's servers when none answered.
func (a jobAnswers) answered(cfg config.Config) error {
	if len(a.Servers) == 0 {
		return fmt.Errorf("no server of the job (FITCACHE_SERVERS=%s) answered", cfg.Servers)
	}
	return nil
}

// askJob calls ask with a client of every server of the job, 32 at a time, so that a large
// job answers in seconds.
func askJob(cfg config.Config, ask func(*rpc.Client) ([]core.CacheUsage, error)) (jobAnswers, error) {
	members, token, err := discovery.Job(cfg.ServerSpec(), cfg.Token, cfg.TokenFile)
	if err != nil {
		return jobAnswers{}, err
	}
	out := jobAnswers{Servers: map[string][]core.CacheUsage{}, Down: map[string]string{}}
	var mu sync.Mutex // protects out
	slots := make(chan struct{}, 32)
	var wg sync.WaitGroup
	for _, m := range members {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer func() { <-slots; wg.Done() }()
			us, err := askServer(m.ID, token, ask)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				out.Down[m.ID] = err.Error()
			} else {
				out.Servers[m.ID] = nonNil(us)
			}
		}()
	}
	wg.Wait()
	return out, nil
}

// askServer calls ask with a client of the cluster server at addr.
func askServer(addr, token string, ask func(*rpc.Client) ([]core.CacheUsage, error)) ([]core.CacheUsage, error) {
	c, err := rpc.Dial(addr, rpc.ClientConfig{Token: token, CallTimeout: 10 * time.Second})
	if err != nil {
		return nil, err
	}
	defer c.Close()
	return ask(c)
}

// printJob prints each server's answer and returns their totals.
func printJob(out jobAnswers) (files int, bytes int64) {
	var all []core.CacheUsage
	for _, id := range sortedKeys(out.Down) {
		fmt.Printf("  unreachable %s: %s\n", id, out.Down[id])
	}
	for _, id := range sortedKeys(out.Servers) {
		us := out.Servers[id]
		fmt.Printf("\nserver %s\n", id)
		if len(us) == 0 {
			fmt.Println("nothing cached")
			continue
		}
		printUsage(os.Stdout, us)
		all = append(all, us...)
	}
	return total(all)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// clearCmd removes the cached files of a dataset, or of all.
func clearCmd(args []string) error {
	rpc.QuietKitexLogs()
	fset := flag.NewFlagSet("clear", flag.ExitOnError)
	all := fset.Bool("all", false, "remove every cached file, of every dataset")
	dryRun := fset.Bool("dry-run", false, "remove nothing: print what would be removed")
	asJSON := fset.Bool("json", false, "print JSON")
	socket := fset.String("socket", "", "server socket (default: the embedded server's)")
	nf := addNodeFlags(fset)
	who := fset.String("user", "", "with --node: the tiers of this user (name or uid) only; as a user other than root, only your own")
	fset.Usage = func() {
		fmt.Fprintln(fset.Output(), "usage: fitcache clear [--dry-run] [--json] [--socket PATH] (DIR | --all)\n"+
			"       fitcache clear --node [--user NAME|UID] [--dir DIR]... [--dry-run] [--json]\n\n"+
			"Removes from every tier the cached files of the datasets read with DIR, or a directory under it,\n"+
			"as their root (the path they were opened with), or with --all every cached file.\n"+
			"With FITCACHE_SERVERS set (and no --socket), from every server of the job.\n"+
			"With --node, removes the memory tiers on this node (fitcache-* in /dev/shm) that no live server\n"+
			"holds: left behind by servers that were killed. For a job epilog, as root:\n"+
			"  fitcache clear --node --user \"$SLURM_JOB_USER\"")
		fset.PrintDefaults()
	}
	fset.Parse(args)
	if nf.node {
		if fset.NArg() != 0 || *all || *socket != "" {
			fset.Usage()
			os.Exit(2)
		}
		return clearNode(nf, *who, *dryRun, *asJSON)
	}
	if fset.NArg() > 1 || (fset.NArg() == 1) == *all || nf.dirs != nil || *who != "" {
		fset.Usage()
		os.Exit(2)
	}
	root := ""
	if !*all {
		abs, err := filepath.Abs(fset.Arg(0))
		if err != nil {
			return err
		}
		root = abs // a dataset removed since keeps its cache: DIR need not exist
	}
	if *socket == "" {
		cfg, err := config.Load(nil)
		if err != nil {
			return err
		}
		if cfg.Servers != "" {
			return clusterClear(cfg, root, *dryRun, *asJSON)
		}
	}
	cfg, c, pid, err := serverFor(*socket)
	if err != nil {
		return err
	}
	var cleared []core.CacheUsage
	if c != nil {
		defer c.Close()
		cleared, err = c.Clear(context.Background(), root, *dryRun)
	} else {
		cleared, err = clearTiers(cfg, root, *dryRun)
	}
	if *asJSON {
		if jerr := printJSON(struct {
			ServerPID int               `json:"server_pid,omitempty"`
			DryRun    bool              `json:"dry_run"`
			Cleared   []core.CacheUsage `json:"cleared"`
		}{pid, *dryRun, nonNil(cleared)}); jerr != nil {
			return jerr
		}
		return err
	}
	what := "every dataset"
	if root != "" {
		what = root
	}
	files, bytes := total(cleared)
	switch {
	case len(cleared) == 0 && err == nil && root == "":
		fmt.Println("nothing cached")
	case len(cleared) == 0 && err == nil:
		fmt.Printf("nothing cached for %s or a directory under it\n", root)
	case *dryRun:
		fmt.Printf("would remove %d files, %s, of %s (dry run):\n", files, tiers.FormatBytes(bytes), what)
	default:
		fmt.Printf("removed %d files, %s, of %s:\n", files, tiers.FormatBytes(bytes), what)
	}
	if len(cleared) > 0 {
		printUsage(os.Stdout, cleared)
	}
	return err
}

// serverFor loads the configuration and returns it with a client of the server at socket
// (default: the embedded server of its runtime directory) and its pid, or a nil client when
// no embedded server runs. A server that holds its lock but does not answer is an error: its
// tiers are not ours to touch.
func serverFor(socket string) (config.Config, *rpc.Client, int, error) {
	cfg, err := config.Load(nil)
	if err != nil {
		return cfg, nil, 0, err
	}
	explicit := socket != ""
	if !explicit {
		if err := embedded.CheckSocket(cfg.RuntimeDir); err != nil { // talk only to our own server
			return cfg, nil, 0, err
		}
		socket = embedded.SocketPath(cfg.RuntimeDir)
	}
	c, err := rpc.Dial(socket, rpc.ClientConfig{})
	if err != nil {
		return cfg, nil, 0, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	hello, err := c.Hello(ctx)
	if err == nil {
		return cfg, c, int(hello.Pid), nil
	}
	c.Close()
	pid := embedded.RunningPID(cfg.RuntimeDir)
	switch {
	case explicit:
		return cfg, nil, 0, fmt.Errorf("no fitcache server answers at %s: %w", socket, err)
	case !errors.Is(err, rpc.ErrUnavailable):
		return cfg, nil, 0, err
	case pid != 0:
		return cfg, nil, 0, fmt.Errorf("the embedded server (pid %d) holds %s but does not answer (starting, or hung): "+
			"try again, or 'fitcache stop' first", pid, cfg.RuntimeDir)
	}
	return cfg, nil, 0, nil
}

// source says where a listing comes from.
func source(cfg config.Config, c *rpc.Client, pid int) string {
	if c == nil {
		return "no server runs in " + cfg.RuntimeDir + ": read from the tiers' records"
	}
	return fmt.Sprintf("server pid %d at %s", pid, c.Addr())
}

// existingTiers returns the configured tiers that exist (their private stand-ins where a
// server would use one); a missing tier directory holds nothing.
func existingTiers(cfg config.Config) ([]tiers.Config, error) {
	tcs, err := cfg.TierConfigs()
	if err != nil {
		return nil, err
	}
	var out []tiers.Config
	for _, tc := range tcs {
		dir, err := tiers.Existing(tc)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%s tier: %w", tc.Kind, err)
		}
		tc.Dir, tc.FallbackRecord = dir, ""
		out = append(out, tc)
	}
	return out, nil
}

// tierUsage reads what the configured tiers hold from their records, changing nothing.
func tierUsage(cfg config.Config) ([]core.CacheUsage, error) {
	tcs, err := existingTiers(cfg)
	if err != nil {
		return nil, err
	}
	dirs := make([]tiers.Dir, len(tcs))
	for i, tc := range tcs {
		dirs[i] = tiers.Dir{Path: tc.Dir, Kind: tc.Kind}
	}
	return core.DirUsage(dirs)
}

// clearTiers clears the configured tiers without a server: a dry run reads their records;
// otherwise each tier is opened under its lock, with no server allowed to start meanwhile,
// and cleared like a server would clear it (index and records kept right). A tier another
// server holds (one with another runtime directory) is left alone, with an error naming it.
func clearTiers(cfg config.Config, root string, dryRun bool) ([]core.CacheUsage, error) {
	match := func(group string) bool { return root == "" || core.Within(group, root) }
	if dryRun {
		us, err := tierUsage(cfg)
		var out []core.CacheUsage
		for _, u := range us {
			if match(u.Root) {
				out = append(out, u)
			}
		}
		return out, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.StartTimeout)
	defer cancel()
	release, err := embedded.HoldOff(ctx, cfg.RuntimeDir)
	if errors.Is(err, embedded.ErrAlreadyRunning) {
		return nil, fmt.Errorf("an embedded server started meanwhile: try again (%w)", err)
	}
	if err != nil {
		return nil, err
	}
	defer release()
	tcs, err := existingTiers(cfg)
	if err != nil {
		return nil, err
	}
	var out []core.CacheUsage
	var errs []error
	for _, tc := range tcs {
		// The whole file system as budget: opening the tier must not evict what it holds
		// beyond the configured budget (a server starting with that budget would).
		tc.Budget, tc.Holder = "100%", "fitcache clear, runtime dir "+cfg.RuntimeDir
		t, err := tiers.New(tc, nil)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s tier %s not cleared: %w", tc.Kind, tc.Dir, err))
			continue
		}
		out = core.AppendUsage(out, t.Dir, t.Clear(match, false))
		t.Close()
	}
	return out, errors.Join(errs...)
}

// printUsage prints one line per dataset root and tier, and a total.
func printUsage(w io.Writer, us []core.CacheUsage) {
	width := len("DATASET ROOT")
	for _, u := range us {
		width = max(width, len(u.Root))
	}
	fmt.Fprintf(w, "%-*s  %-6s  %8s  %10s  %s\n", width, "DATASET ROOT", "TIER", "FILES", "SIZE", "TIER DIRECTORY")
	for _, u := range us {
		fmt.Fprintf(w, "%-*s  %-6s  %8d  %10s  %s\n", width, u.Root, u.Kind, u.Files, tiers.FormatBytes(u.Bytes), u.Dir)
	}
	files, bytes := total(us)
	fmt.Fprintf(w, "%-*s  %-6s  %8d  %10s\n", width, "total", "", files, tiers.FormatBytes(bytes))
}

func total(us []core.CacheUsage) (files int, bytes int64) {
	for _, u := range us {
		files += u.Files
		bytes += u.Bytes
	}
	return files, bytes
}

func nonNil(us []core.CacheUsage) []core.CacheUsage {
	if us == nil {
		return []core.CacheUsage{}
	}
	return us
}

func printJSON(v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	fmt.Println(string(b))
	return nil
}
