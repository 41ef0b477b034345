// Package config resolves what a FitCache client or server is told: keyword options (from
// Python, the C API or the command line), then FITCACHE_* environment variables, then
// defaults. It also holds the defaults that depend on the user and the machine: the embedded
// server's tiers and its private runtime directory.
//
// It is its own package because clients, servers and commands all read it, while the server
// engine (package core) never does: the engine is configured with core.EngineConfig.
//
// Usage:
//
//	cfg, err := config.Load(map[string]string{"tiers": "memory:/dev/shm/fc:2GiB"})
//	...
//	tierCfgs, _ := cfg.TierConfigs()
package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/discovery"
	"github.com/fitcache/fitcache/membership"
	"github.com/fitcache/fitcache/privdir"
	"github.com/fitcache/fitcache/tiers"
)

// Config is what a client or server is told: keyword options first, then FITCACHE_*
// environment variables, then defaults (see Load).
type Config struct {
	// Tiers of the embedded server: "kind:dir[:budget],..." fastest first. Empty means a
	// memory tier under /dev/shm and a disk tier under the user's cache directory.
	Tiers string
	// RuntimeDir holds the embedded server's socket, locks and log. It must be a private
	// directory (see privdir): a real directory of this user's, mode 0700.
	RuntimeDir string
	// RuntimeDirWarning says why the default runtime directory was replaced by a private
	// stand-in, if it was (see defaultRuntimeDir); not an option.
	RuntimeDirWarning string
	// Verify checks the data checksum of every cached file when a server opens its tiers,
	// and removes the damaged ones (see tiers.Config.Verify).
	Verify bool
	// ServerBin is the fitcache executable a client starts the embedded server with.
	ServerBin string
	// IdleTimeout: the embedded server exits after this long without a request.
	IdleTimeout time.Duration
	// ReadTimeout is the deadline of one read request to a server.
	ReadTimeout time.Duration
	// StartTimeout bounds how long a client waits for the embedded server it started.
	StartTimeout time.Duration
	// Job identifies the caller's job (a training run): the clients of one job share one
	// validation session at each server, in which every cached copy is checked against its
	// source once (see core.Engine.BeginSession). Empty: each client is a job of its own.
	// FitCacheDataset gives its workers one id; `fitcache run` gives its program one in
	// FITCACHE_JOB.
	Job string
	// Prefetch is how many source reads a server's prefetch runs at once (see
	// core.DefaultPrefetch); 0 turns prefetch off. Servers take it from their options; a
	// client passes it to the embedded server it starts.
	Prefetch int
	// BlockBytes is the size of the blocks a server caches ranges of large files in (see
	// core.DefaultBlockBytes); a client passes it to the embedded server it starts.
	BlockBytes int64
	// MemoryAtExit: what a server does with its memory tiers' copies as it exits (see
	// core.MemoryAtExit); default the site's, else clear.
	MemoryAtExit core.MemoryAtExit
	// MemoryReserve: the part of the job's memory limit the memory tiers leave to the job
	// (see core.Limits.Reserve); default the site's, else core.DefaultMemoryReserve.
	MemoryReserve tiers.SizeOrPercent
	// FollowCgroup sizes the memory tiers from the memory cgroup the server runs in (option
	// memory_limit: "cgroup", the default, or "none").
	FollowCgroup bool
	// Site is the site's configuration for this node (see LoadSite), and SiteWarnings what
	// was wrong with it.
	Site Site

	// Cluster mode (Servers set):

	// Servers of the job: "host:port,...", "@HOSTFILE" or "slurm" (see discovery.Spec).
	// Empty means the embedded per-user server.
	Servers string
	// PerNode and BasePort place the servers of hosts named without a port.
	PerNode, BasePort int
	// Token of the job (or TokenFile holding it): clients and servers prove to each other
	// that they know it when they connect, without sending it (see package rpc).
	Token, TokenFile string
	// Policy for a dead server's files: "recache" (their next owner on the ring caches them)
	// or "pfs" (they are read from the source from then on).
	Policy string
	// FailureThreshold: consecutive calls that got no answer (timed out or failed) after which
	// a server is declared dead; a refused connection declares it dead at once.
	FailureThreshold int
	// RPCTimeout is the deadline of a read from a server of the cluster.
	RPCTimeout time.Duration
	// Replicas: copies of each file on distinct nodes (1: no replica).
	Replicas int
	// Node is this machine's name as it appears in Servers, so that the client maps the
	// cached files of servers on its own node. Default: the host name.
	Node string
	// WaitTimeout bounds how long a client waits at start for the servers to answer.
	WaitTimeout time.Duration
	// VirtualNodes per server on the hash ring; 0 (auto, the default): as many as
	// ring.VirtualNodesFor gives for the job's number of servers. Every client and server of a
	// job must use the same.
	VirtualNodes int
	// Topology gives the failure domains of the job's nodes (switches, racks: "re:REGEX" of
	// the host names, or "@FILE", Slurm's topology.conf or HOST DOMAIN lines): replicas go to
	// distinct domains (see discovery.Spec.Topology).
	Topology string
	// GossipPortOffset: the job's servers watch each other (package membership) on their RPC
	// port plus this; 0 turns that off (failures are then found by reads only).
	GossipPortOffset int
	// ProbeInterval paces the servers' membership protocol: each probes another at random
	// this often, and a member that stops answering is declared dead after a suspicion of 4
	// to 24 intervals (fewer as more members confirm it).
	ProbeInterval time.Duration
	// Direct makes a client route over the ring and read from the job's servers itself, even
	// on a node that runs servers of the job (whose node socket readers otherwise go
	// through). Not an option: a cluster server sets it for the clients it reads through.
	Direct bool
}

// The sizes option block_size accepts.
const (
	blockBytesMin = 64 << 10
	blockBytesMax = 256 << 20
)

// maxVirtualNodes bounds the option virtual_nodes: a ring of 1,024 servers at 10,000 points
// each takes seconds to build and 240 MiB in every client.
const maxVirtualNodes = 10000

// Policies for a dead server's files.
const (
	PolicyRecache = "recache"
	PolicyPFS     = "pfs"
)

// configKeys lists the option names, each also read from FITCACHE_<NAME in upper case>.
var configKeys = []string{"tiers", "runtime_dir", "server_bin", "idle_timeout", "read_timeout", "start_timeout",
	"servers", "servers_per_node", "base_port", "token", "token_file", "policy", "failure_threshold",
	"rpc_timeout", "replicas", "node", "wait_timeout", "virtual_nodes", "verify", "prefetch", "job",
	"gossip_port_offset", "probe_interval", "topology", "block_size", "memory_at_exit", "memory_reserve",
	"memory_limit"}

// Load resolves options (keyword arguments from the caller, may be nil) over the
// environment over defaults. Unknown option names are an error, so typos do not go unnoticed.
func Load(options map[string]string) (Config, error) {
	known := make(map[string]bool, len(configKeys))
	for _, k := range configKeys {
		known[k] = true
	}
	for k := range options {
		if !known[k] {
			return Config{}, fmt.Errorf("unknown option %q (known: %s)", k, strings.Join(configKeys, ", "))
		}
	}
	get := func(key string) string {
		if v, ok := options[key]; ok && v != "" {
			return v
		}
		return os.Getenv("FITCACHE_" + strings.ToUpper(key))
	}
	cfg := Config{Tiers: get("tiers"), RuntimeDir: get("runtime_dir"), ServerBin: get("server_bin"),
		Servers: get("servers"), Token: get("token"), TokenFile: get("token_file"), Policy: get("policy"),
		Node: get("node"), Job: get("job"), Topology: get("topology")}
	if cfg.Policy == "" {
		cfg.Policy = PolicyRecache
	}
	if cfg.Policy != PolicyRecache && cfg.Policy != PolicyPFS {
		return Config{}, fmt.Errorf("option policy: %q is neither %q nor %q", cfg.Policy, PolicyRecache, PolicyPFS)
	}
	if cfg.Node == "" {
		cfg.Node, _ = os.Hostname()
	}
	if id := os.Getenv("SLURM_JOB_ID"); cfg.Job == "" && id != "" {
		cfg.Job = "slurm-" + id // the batch job is the cache job: its copies are checked once for it
	}
	site, err := LoadSite(SitePath())
	if err != nil {
		return Config{}, err
	}
	cfg.Site = site
	if err := cfg.loadMemoryOptions(get); err != nil {
		return Config{}, err
	}
	if v := get("verify"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return Config{}, fmt.Errorf("option verify: want 1/true or 0/false, got %q", v)
		}
		cfg.Verify = b
	}
	for _, n := range []struct {
		key  string
		dst  *int
		dflt int
	}{
		{"servers_per_node", &cfg.PerNode, 1}, {"base_port", &cfg.BasePort, 7070},
		{"failure_threshold", &cfg.FailureThreshold, 3}, {"replicas", &cfg.Replicas, 1},
	} {
		*n.dst = n.dflt
		if v := get(n.key); v != "" {
			i, err := strconv.Atoi(v)
			if err != nil || i < 1 {
				return Config{}, fmt.Errorf("option %s: want a positive whole number, got %q", n.key, v)
			}
			*n.dst = i
		}
	}
	if v := get("virtual_nodes"); v != "" && !strings.EqualFold(v, "auto") {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxVirtualNodes {
			return Config{}, fmt.Errorf("option virtual_nodes: want auto or a whole number from 1 to %d, got %q", maxVirtualNodes, v)
		}
		cfg.VirtualNodes = n
	}
	cfg.GossipPortOffset = membership.DefaultPortOffset
	if v := get("gossip_port_offset"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > 65535 {
			return Config{}, fmt.Errorf("option gossip_port_offset: want a whole number from 0 (off) to 65535, got %q", v)
		}
		cfg.GossipPortOffset = n
	}
	cfg.Prefetch = core.DefaultPrefetch
	if v := get("prefetch"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > core.MaxPrefetchReads {
			return Config{}, fmt.Errorf("option prefetch: want a whole number from 0 (off) to %d, got %q", core.MaxPrefetchReads, v)
		}
		cfg.Prefetch = n
	}
	cfg.BlockBytes = core.DefaultBlockBytes
	if v := get("block_size"); v != "" {
		n, err := tiers.ParseSize(v)
		if err != nil || n.Percent != 0 || n.Bytes < blockBytesMin || n.Bytes > blockBytesMax {
			return Config{}, fmt.Errorf("option block_size: want a size from 64KiB to 256MiB (such as 4MiB), got %q", v)
		}
		cfg.BlockBytes = n.Bytes
	}
	if cfg.RuntimeDir == "" {
		cfg.RuntimeDir, cfg.RuntimeDirWarning = defaultRuntimeDir()
	}
	for _, d := range []struct {
		key  string
		dst  *time.Duration
		dflt time.Duration
	}{
		{"idle_timeout", &cfg.IdleTimeout, 15 * time.Minute},
		{"read_timeout", &cfg.ReadTimeout, 60 * time.Second},
		{"start_timeout", &cfg.StartTimeout, 15 * time.Second},
		{"rpc_timeout", &cfg.RPCTimeout, 5 * time.Second},
		{"wait_timeout", &cfg.WaitTimeout, 60 * time.Second},
		{"probe_interval", &cfg.ProbeInterval, time.Second},
	} {
		*d.dst = d.dflt
		if v := get(d.key); v != "" {
			dur, err := parseDuration(v)
			if err != nil {
				return Config{}, fmt.Errorf("option %s: %w", d.key, err)
			}
			*d.dst = dur
		}
	}
	if _, err := cfg.TierConfigs(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// ServerSpec says where the job's servers are (cluster mode), for package discovery.
func (c Config) ServerSpec() discovery.Spec {
	return discovery.Spec{Servers: c.Servers, PerNode: c.PerNode, BasePort: c.BasePort, Topology: c.Topology}
}

// parseDuration accepts Go durations ("90s", "15m") and plain seconds ("30", "0.5").
func parseDuration(s string) (time.Duration, error) {
	if secs, err := strconv.ParseFloat(s, 64); err == nil {
		return time.Duration(secs * float64(time.Second)), nil
	}
	return time.ParseDuration(s)
}

// TierConfigs returns the tiers to use: parsed from Tiers, or the embedded defaults.
func (c Config) TierConfigs() ([]tiers.Config, error) {
	if c.Tiers == "" {
		return DefaultTiers(c.RuntimeDir), nil
	}
	var out []tiers.Config
	for _, item := range strings.Split(c.Tiers, ",") {
		parts := strings.SplitN(strings.TrimSpace(item), ":", 3)
		if len(parts) < 2 || parts[1] == "" {
			return nil, fmt.Errorf("tier %q: want kind:dir[:budget]", item)
		}
		kind, err := tiers.ParseKind(parts[0])
		if err != nil {
			return nil, err
		}
		tc := tiers.Config{Kind: kind, Dir: parts[1]}
		if len(parts) == 3 {
			if _, err := tiers.ParseSize(parts[2]); err != nil {
				return nil, fmt.Errorf("tier %q: %w", item, err)
			}
			tc.Budget = parts[2]
		}
		out = append(out, tc)
	}
	return out, nil
}

// DefaultTiers are the embedded server's tiers: memory under /dev/shm taking a quarter of it
// (tmpfs there is usually half the RAM, so about an eighth of RAM), and a disk tier taking a
// tenth of its file system, so the machine stays usable: in the node-local scratch directory
// of the batch job when it has one (see JobScratch), else under the user's cache directory.
//
// The memory tier's name, /dev/shm/fitcache-UID, is predictable, so another user may have
// created it first: the server then uses a private directory with a random name instead,
// recorded in runtimeDir (see tiers.Config.FallbackRecord), and says so in its warnings.
func DefaultTiers(runtimeDir string) []tiers.Config {
	user := strconv.Itoa(os.Geteuid())
	mem := tiers.Config{Kind: tiers.Memory, Dir: "/dev/shm/fitcache-" + user, Budget: "25%"}
	if runtimeDir != "" {
		mem.FallbackRecord = filepath.Join(runtimeDir, MemoryTierRecord)
	}
	cfgs := []tiers.Config{mem}
	if dir := JobScratch(); dir != "" {
		cfgs = append(cfgs, tiers.Config{Kind: tiers.Disk, Dir: filepath.Join(dir, "fitcache"), Budget: "10%"})
	} else if dir, err := os.UserCacheDir(); err == nil {
		cfgs = append(cfgs, tiers.Config{Kind: tiers.Disk, Dir: filepath.Join(dir, "fitcache"), Budget: "10%", CreateParents: true})
	}
	return cfgs
}

// JobScratch returns the node-local scratch directory that the batch system gave the job:
// $SLURM_TMPDIR, or inside a Slurm job $TMPDIR when its path names the job (sites that give
// each job a directory of its own set it so; a user's TMPDIR on a shared file system is
// not taken for one). It returns "" outside a job, and for a directory that is missing or in
// memory (tmpfs), which would make a "disk" tier take the job's RAM. Copies there go when the
// batch system removes the directory at the job's end.
func JobScratch() string {
	dir := os.Getenv("SLURM_TMPDIR")
	if id := os.Getenv("SLURM_JOB_ID"); dir == "" && id != "" {
		if d := os.Getenv("TMPDIR"); d != "" && strings.Contains(d, id) {
			dir = d
		}
	}
	if dir == "" || !filepath.IsAbs(dir) {
		return ""
	}
	fs, err := tiers.StatFS(dir)
	if err != nil || fs.InMemory() {
		return ""
	}
	return dir
}

// MemoryTierRecord is the file in the runtime directory that names the private stand-in of
// the default memory tier, when there is one.
const MemoryTierRecord = "memory-tier"

// defaultRuntimeDir is $XDG_RUNTIME_DIR/fitcache (the login manager makes that directory
// private), else /tmp/fitcache-UID. The latter is predictable: if another user created it
// first, a private stand-in with a random name is used instead (see privdir.Fallback), and
// its name is recorded in the user's cache directory, per host, so that every process of the
// user on this node finds the same one. The warning says so, for the server to report.
func defaultRuntimeDir() (dir, warning string) {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "fitcache"), ""
	}
	dir = filepath.Join(os.TempDir(), "fitcache-"+strconv.Itoa(os.Geteuid()))
	err := privdir.Inspect(dir)
	if !errors.Is(err, privdir.ErrNotPrivate) {
		return dir, "" // private, or missing: it is created private
	}
	cache, cerr := os.UserCacheDir()
	host, herr := os.Hostname()
	if cerr != nil || herr != nil {
		return dir, "" // refused with a clear error when used (embedded.PrepareDir)
	}
	f, ferr := privdir.Fallback(dir, filepath.Join(cache, "fitcache-run", host))
	if ferr != nil {
		return dir, ""
	}
	defer f.Close()
	return f.Name(), fmt.Sprintf("default runtime directory %s cannot be used (%v): using %s", dir, err, f.Name())
}
