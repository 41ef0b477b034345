package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/client"
	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/privdir"
	"github.com/fitcache/fitcache/rpc"
)

// The transparent mode: `fitcache run` makes an unmodified program read its dataset through
// the cache. It finds or starts the embedded server, starts a companion process that
// prefetches the data directories and keeps the server alive while the program runs, puts
// the preload shim (preload/) in LD_PRELOAD with its configuration, and execs the program,
// which keeps this process's pid (so that srun, shells and signals see the program itself).
//
// In cluster mode (FITCACHE_SERVERS set) it starts no server: the job's servers on this node
// (config.Config.Node) give the shim their tier directories, where it finds the files they
// hold, and one of them its node socket, which answers the shim's misses for every file of
// the job (see server/nodesocket.go): the servers must know the job's servers themselves (serve
// --servers, or FITCACHE_SERVERS in their environment). The companion hands each server
// the files it owns to prefetch (client.Client.Prefetch).
//
// The shim's configuration is the environment (see preload/fitcache_preload.c):
// FITCACHE_PRELOAD_ROOTS, FITCACHE_PRELOAD_TIERS, FITCACHE_PRELOAD_SESSIONS,
// FITCACHE_PRELOAD_SOCKET, FITCACHE_PRELOAD_TIMEOUT_MS, FITCACHE_PRELOAD_BLOCK_BYTES and
// FITCACHE_PRELOAD_HEAT; FITCACHE_PRELOAD_DEBUG, the user's, is passed on.
//
// The run is one job (FITCACHE_JOB, made up unless set): the companion's clients begin its
// validation session at each server, in which every cached copy is checked against its
// source once, ahead of the program by the prefetch of the data directories; the shim serves
// from the tiers only copies checked in it (FITCACHE_PRELOAD_SESSIONS) and asks the server
// for the others. FitCacheDataset in the program joins the same job.

// runUsage is printed by `fitcache run -h`.
const runUsage = `usage: fitcache run --data DIR [--data DIR]... [--prefetch N]
                    [--prefetch-only PATTERN]... [--prefetch-exclude PATTERN]... -- CMD [ARGS...]

Runs CMD with its reads of files under each DIR served from FitCache: opens of those files
return the cached copy (the first read of a file caches it), with no change to CMD. The
embedded server is started if none runs; a prefetch of every file under each DIR starts at
once, so that the first epoch already reads from the cache. CMD inherits this process (its
pid, signals and exit status). Under SLURM: srun fitcache run --data DIR -- python train.py

The prefetch reads every file under each DIR, also files CMD never reads (index files, a
validation split): --prefetch-only and --prefetch-exclude choose which. A PATTERN (shell
syntax: *, ?, [a-z]) without '/' matches a file's name; one with '/' matches its path
relative to DIR, or a directory it is under (train/* is every file under DIR/train). Files
left out are still served from the cache when CMD reads them, cached at their first read.

In cluster mode (FITCACHE_SERVERS set) CMD reads through the job's servers on this node,
started with --servers (or FITCACHE_SERVERS): files cached on this node are opened there,
the others come from their owners through the local server.

Programs that open files through the C library's open and fopen functions are served
(Python, PyTorch, NumPy, PIL, h5py, LMDB, coreutils...); statically linked programs and
setuid programs read the source. See README.md, "Transparent mode".
`

func run(args []string) error {
	fset := flag.NewFlagSet("run", flag.ExitOnError)
	var dirs stringList
	fset.Var(&dirs, "data", "a dataset directory `DIR` whose files CMD reads through the cache (repeatable)")
	var only, exclude stringList
	fset.Var(&only, "prefetch-only", "prefetch only the files that match `PATTERN` (repeatable: any of them); see above")
	fset.Var(&exclude, "prefetch-exclude", "do not prefetch the files that match `PATTERN` (repeatable), even those --prefetch-only names")
	var prefetch optionalInt
	fset.Var(&prefetch, "prefetch", fmt.Sprintf("the server's prefetch runs `N` source reads at once; 0: no prefetch of the data directories (default: FITCACHE_PREFETCH, else %d)", core.DefaultPrefetch))
	fset.Usage = func() {
		fmt.Fprint(fset.Output(), runUsage+"\nflags:\n")
		fset.PrintDefaults()
	}
	fset.Parse(args)
	argv := fset.Args()
	if len(argv) == 0 || len(dirs) == 0 {
		fset.Usage()
		os.Exit(2)
	}
	roots, err := datasetRoots(dirs)
	if err != nil {
		return err
	}
	filter := prefetchFilter{only: only, exclude: exclude}
	if err := filter.check(); err != nil {
		return err
	}
	lib, err := preloadLibrary()
	if err != nil {
		return err
	}
	cmdPath, err := exec.LookPath(argv[0])
	if err != nil {
		return err
	}

	if os.Getenv("FITCACHE_JOB") == "" { // the companion, the program and its children share it
		os.Setenv("FITCACHE_JOB", "run-"+client.NewJobID())
	}
	cfg, err := config.Load(nil)
	if err != nil {
		return err
	}
	// The companion opens the client, so that a server it starts is its child, not the
	// program's: a program that waits for all its children would wait for the server.
	prefetchReads := -1 // unset: the server's own setting
	if prefetch.set {
		prefetchReads = prefetch.n
	}
	server, err := startCompanion(os.Getpid(), roots, prefetchReads, filter, cfg.StartTimeout+cfg.WaitTimeout+5*time.Second)
	switch {
	case err != nil:
		fmt.Fprintf(os.Stderr, "fitcache run: %v: the program reads the source\n", err)
	case cfg.Servers != "" && len(server.LocalServers) == 0:
		return fmt.Errorf("no server of the job runs on this node (%q) among FITCACHE_SERVERS=%s: start one per node "+
			"(fitcache serve --listen HOST:PORT --servers ...), or set FITCACHE_NODE to this node's name in that list", cfg.Node, cfg.Servers)
	case cfg.Servers != "" && server.NodeSocket == "":
		fmt.Fprintf(os.Stderr, "fitcache run: the job's servers on this node (%s) do not answer, or serve no node socket "+
			"(start them with --servers or FITCACHE_SERVERS): the program reads what they do not hold from the source\n",
			strings.Join(server.LocalServers, ", "))
	case server.NodeSocket == "" && cfg.Servers == "":
		fmt.Fprintln(os.Stderr, "fitcache run: the embedded server could not be reached: the program reads the source, "+
			"and neither it nor the processes it starts ask that server (see `fitcache stats`)")
	}
	for _, d := range server.TierDirs {
		if strings.Contains(d, ":") {
			return fmt.Errorf("tier directory %s: a path with ':' cannot be passed to the preload library", d)
		}
	}
	env := preloadEnviron(os.Environ(), lib, roots, server, cfg.ReadTimeout)
	return syscall.Exec(cmdPath, argv, env)
}

// A datasetRoot is a data directory as the user named it (absolute, clean) and with its
// symbolic links resolved.
type datasetRoot struct{ name, real string }

// datasetRoots checks the data directories and resolves them.
func datasetRoots(dirs []string) ([]datasetRoot, error) {
	var roots []datasetRoot
	for _, d := range dirs {
		name, err := filepath.Abs(d)
		if err != nil {
			return nil, err
		}
		real, err := filepath.EvalSymlinks(name)
		if err != nil {
			return nil, fmt.Errorf("--data %s: %w", d, err)
		}
		if st, err := os.Stat(real); err != nil {
			return nil, fmt.Errorf("--data %s: %w", d, err)
		} else if !st.IsDir() {
			return nil, fmt.Errorf("--data %s: not a directory", d)
		}
		if real == "/" {
			return nil, fmt.Errorf("--data %s: the whole file system cannot be a dataset", d)
		}
		if strings.ContainsAny(name+real, ":=") {
			return nil, fmt.Errorf("--data %s: a path with ':' or '=' cannot be passed to the preload library", d)
		}
		roots = append(roots, datasetRoot{name: name, real: real})
	}
	return roots, nil
}

// preloadEnviron returns env with the preload shim first in LD_PRELOAD and its configuration.
func preloadEnviron(env []string, lib string, roots []datasetRoot, server companionReport, timeout time.Duration) []string {
	var rootList []string
	for _, r := range roots {
		if r.name == r.real {
			rootList = append(rootList, r.real)
		} else {
			rootList = append(rootList, r.name+"="+r.real)
		}
	}
	var sessions []string
	for _, s := range server.Sessions {
		sessions = append(sessions, strconv.FormatUint(uint64(s), 10))
	}
	out := embedded.ServerEnviron(env) // drops an earlier run's shim and configuration
	preload := lib
	for _, kv := range out {
		if v, ok := strings.CutPrefix(kv, "LD_PRELOAD="); ok {
			preload += " " + v
		}
	}
	out = slices.DeleteFunc(out, func(kv string) bool { return strings.HasPrefix(kv, "LD_PRELOAD=") })
	for _, kv := range env { // the user's switch for the shim's diagnostics, passed on
		if strings.HasPrefix(kv, "FITCACHE_PRELOAD_DEBUG=") {
			out = append(out, kv)
		}
	}
	return append(out,
		"LD_PRELOAD="+preload,
		"FITCACHE_PRELOAD_ROOTS="+strings.Join(rootList, ":"),
		"FITCACHE_PRELOAD_TIERS="+strings.Join(server.TierDirs, ":"),
		"FITCACHE_PRELOAD_SESSIONS="+strings.Join(sessions, ":"),
		"FITCACHE_PRELOAD_SOCKET="+server.NodeSocket,
		"FITCACHE_PRELOAD_TIMEOUT_MS="+strconv.FormatInt(timeout.Milliseconds(), 10),
		"FITCACHE_PRELOAD_BLOCK_BYTES="+strconv.FormatInt(server.BlockBytes, 10),
		"FITCACHE_PRELOAD_HEAT="+server.HeatFile)
}

// heatFile returns where the processes of the user's runs share how much of each block of a
// large file they read from the source (see preload/ranges.c): a file the shim makes in the
// user's private runtime directory, or "" when that directory is not private (the shim then
// shares it only with the processes it forks).
func heatFile() string {
	cfg, err := config.Load(nil)
	if err != nil || privdir.Inspect(cfg.RuntimeDir) != nil {
		return ""
	}
	return filepath.Join(cfg.RuntimeDir, "preload.heat")
}

// preloadLibrary returns the path of the preload shim: FITCACHE_PRELOAD_LIB, else beside the
// package this program was installed with (fitcache/bin/fitcache, fitcache/libfitcache_preload.so),
// else preload/ of a source tree this program was built in.
func preloadLibrary() (string, error) {
	if p := os.Getenv("FITCACHE_PRELOAD_LIB"); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("FITCACHE_PRELOAD_LIB: %w", err)
		}
		return filepath.Abs(p)
	}
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	if exe, err = filepath.EvalSymlinks(exe); err != nil {
		return "", err
	}
	dir := filepath.Dir(exe)
	for _, p := range []string{
		filepath.Join(dir, "..", embedded.PreloadLibrary),
		filepath.Join(dir, embedded.PreloadLibrary),
		filepath.Join(dir, "preload", embedded.PreloadLibrary),
	} {
		if _, err := os.Stat(p); err == nil {
			return filepath.Clean(p), nil
		}
	}
	return "", fmt.Errorf("%s not found beside %s: install the Python package (pip install fitcache), or build it with `make -C preload` and set FITCACHE_PRELOAD_LIB", embedded.PreloadLibrary, exe)
}

// preloadPath prints the path of the preload shim, for users who set LD_PRELOAD themselves.
func preloadPath(args []string) error {
	if len(args) != 0 {
		return errors.New("usage: fitcache preload-path")
	}
	p, err := preloadLibrary()
	if err != nil {
		return err
	}
	fmt.Println(p)
	return nil
}

// companionReport is what the companion tells `fitcache run` about the server, once it
// reached it: what the preload shim needs.
type companionReport struct {
	TierDirs []string `json:"tier_dirs"`
	// Sessions holds the run's validation session at the server of each tier directory.
	Sessions     []uint32 `json:"sessions"`
	NodeSocket   string   `json:"node_socket"`
	LocalServers []string `json:"local_servers"` // cluster mode: the job's servers on this node
	// BlockBytes is the size of the blocks the server caches ranges of large files in (0:
	// none), which the shim reads large files through.
	BlockBytes int64 `json:"block_bytes"`
	// HeatFile is where the shim shares what it read of blocks from the source (heatFile).
	HeatFile string `json:"heat_file"`
}

// startCompanion starts the companion of the program run by `fitcache run` (see companion),
// detached: an intermediate process starts it and exits at once, so that the companion is
// not a child of the program (which would have to reap it). It returns the companion's
// report on the server, read from a pipe within wait.
func startCompanion(pid int, roots []datasetRoot, prefetch int, filter prefetchFilter, wait time.Duration) (companionReport, error) {
	var report companionReport
	self, err := os.Executable()
	if err != nil {
		return report, err
	}
	args := []string{"run-companion", "--pid", strconv.Itoa(pid), "--prefetch=" + strconv.FormatBool(prefetch != 0)}
	for _, p := range filter.only {
		args = append(args, "--only", p)
	}
	for _, p := range filter.exclude {
		args = append(args, "--exclude", p)
	}
	for _, r := range roots {
		args = append(args, r.real)
	}
	rd, wr, err := os.Pipe()
	if err != nil {
		return report, err
	}
	defer rd.Close()
	cmd := exec.Command(self, args...)
	cmd.Env = append(embedded.ServerEnviron(os.Environ()), "FITCACHE_COMPANION_DETACH=1")
	if prefetch > 0 { // for a server the companion starts (0 only skips this program's prefetch)
		cmd.Env = append(cmd.Env, "FITCACHE_PREFETCH="+strconv.Itoa(prefetch))
	}
	cmd.Stdout, cmd.Stderr = wr, os.Stderr
	cmd.Dir = "/"
	err = cmd.Run()
	wr.Close()
	if err != nil {
		return report, fmt.Errorf("start the companion: %w", err)
	}
	rd.SetReadDeadline(time.Now().Add(wait))
	line, err := bufio.NewReader(rd).ReadBytes('\n')
	if err != nil {
		return report, fmt.Errorf("the companion did not reach the server: %w", err)
	}
	if err := json.Unmarshal(line, &report); err != nil {
		return report, fmt.Errorf("the companion's report: %w", err)
	}
	return report, nil
}

// companionKeepAlive: how often the companion reminds the embedded server that a program
// reads through it (hits from the shim send the server no request, and an idle server exits).
const companionKeepAlive = time.Minute

// companion runs beside a program run by `fitcache run` until the program exits. It opens a
// client for each data directory (starting the embedded server if none runs), reports the
// server's tier directories and node socket as one line of JSON on standard output, which
// it then closes; it hands the server the list of every file under the directories to
// prefetch (and keeps the job alive), and keeps the server from stopping for idleness. It
// is quiet but for errors.
func companion(args []string) error {
	rpc.QuietKitexLogs()
	fset := flag.NewFlagSet("run-companion", flag.ExitOnError)
	pid := fset.Int("pid", 0, "the process to accompany")
	prefetch := fset.Bool("prefetch", true, "prefetch the data directories")
	var filter prefetchFilter
	fset.Var((*stringList)(&filter.only), "only", "prefetch only the files that match this pattern (repeatable)")
	fset.Var((*stringList)(&filter.exclude), "exclude", "do not prefetch the files that match this pattern (repeatable)")
	fset.Parse(args)
	if *pid <= 0 || fset.NArg() == 0 {
		return errors.New("usage: fitcache run-companion --pid PID [--prefetch=false] [--only P]... [--exclude P]... DIRS")
	}
	if err := filter.check(); err != nil {
		return err
	}
	if os.Getenv("FITCACHE_COMPANION_DETACH") == "1" { // the intermediate: start the companion, leave
		cmd := exec.Command(os.Args[0], os.Args[1:]...)
		cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "FITCACHE_COMPANION_DETACH=") })
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		cmd.Dir = "/"
		return cmd.Start()
	}
	gone, err := watchProcess(*pid)
	if errors.Is(err, unix.ESRCH) {
		return nil // the program ended already
	}
	if err != nil {
		return err
	}
	var clients []*client.Client
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()
	for _, root := range fset.Args() {
		c, err := openClient(root)
		if err != nil {
			return err
		}
		clients = append(clients, c)
	}
	report := companionReport{NodeSocket: clients[0].NodeSocket(), LocalServers: clients[0].LocalServers(),
		BlockBytes: clients[0].BlockBytes(), HeatFile: heatFile()}
	if report.LocalServers == nil && !clients[0].ServerUp() {
		// An embedded server that could not be reached (stopped, hung) would cost each
		// process of the program a probe on its first miss: they are given no node socket,
		// and read the source.
		report.NodeSocket = ""
	}
	for _, d := range clients[0].TierDirs() {
		report.TierDirs = append(report.TierDirs, d.Path)
		report.Sessions = append(report.Sessions, d.Session())
	}
	line, _ := json.Marshal(report)
	os.Stdout.Write(append(line, '\n'))
	os.Stdout.Close()
	if *prefetch {
		for _, c := range clients {
			files, err := datasetFiles(c.Root(), filter)
			if err == nil {
				err = c.Prefetch(files)
			}
			if err != nil {
				fmt.Fprintf(os.Stderr, "fitcache run: prefetch of %s: %v\n", c.Root(), err)
			}
		}
	}
	// Cluster servers do not stop when idle unless told to (serve --idle-timeout), and a
	// reminder would be a call to every server of the job: none is sent in cluster mode.
	var keepAlive <-chan time.Time
	if clients[0].LocalServers() == nil {
		tick := time.NewTicker(companionKeepAlive)
		defer tick.Stop()
		keepAlive = tick.C
	}
	for {
		select {
		case <-gone:
			return nil
		case <-keepAlive:
			clients[0].Stats() // a request: the server is not idle
		}
	}
}

// datasetFiles lists the regular files under root that filter takes, sorted.
func datasetFiles(root string, filter prefetchFilter) ([]string, error) {
	var files []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			if rel, err := filepath.Rel(root, p); err == nil && filter.takes(rel) {
				files = append(files, p)
			}
		}
		return nil
	})
	sort.Strings(files)
	return files, err
}

// prefetchFilter chooses the files of a data directory that `fitcache run` prefetches
// (--prefetch-only, --prefetch-exclude): a dataset directory often holds files the program
// never reads (index files, another split), which a prefetch of everything would read from
// the source and let take the room of the files it does read. The zero value takes every file.
type prefetchFilter struct {
	only, exclude []string // patterns (filepath.Match)
}

// check refuses a malformed pattern, before anything starts.
func (f prefetchFilter) check() error {
	for _, p := range append(slices.Clone(f.only), f.exclude...) {
		if _, err := filepath.Match(p, ""); err != nil || p == "" {
			return fmt.Errorf("prefetch pattern %q: want a shell pattern (*, ?, [a-z])", p)
		}
	}
	return nil
}

// takes reports whether the file at rel, relative to its data directory, is prefetched: it
// matches an --only pattern (if any) and no --exclude pattern.
func (f prefetchFilter) takes(rel string) bool {
	return (len(f.only) == 0 || matchesAny(f.only, rel)) && !matchesAny(f.exclude, rel)
}

// matchesAny reports whether a pattern matches rel: one without '/' its file name, one with
// '/' the path itself or a directory it is under ("train/*" takes everything under train).
func matchesAny(patterns []string, rel string) bool {
	for _, p := range patterns {
		if !strings.Contains(p, "/") {
			if ok, _ := filepath.Match(p, filepath.Base(rel)); ok {
				return true
			}
			continue
		}
		p = strings.Trim(p, "/")
		for dir := rel; dir != "." && dir != "/"; dir = filepath.Dir(dir) {
			if ok, _ := filepath.Match(p, dir); ok {
				return true
			}
		}
	}
	return false
}

// watchProcess returns a channel closed when the process pid exits.
func watchProcess(pid int) (<-chan struct{}, error) {
	gone := make(chan struct{})
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil && !errors.Is(err, unix.ENOSYS) {
		return nil, fmt.Errorf("watch process %d: %w", pid, err)
	}
	go func() {
		defer close(gone)
		if pidfd >= 0 && err == nil {
			fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
			for {
				if _, err := unix.Poll(fds, -1); err != unix.EINTR {
					return
				}
			}
		}
		for unix.Kill(pid, 0) == nil { // kernels before 5.3
			time.Sleep(time.Second)
		}
	}()
	return gone, nil
}
