package config

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/privdir"
	"github.com/fitcache/fitcache/privdir/privdirtest"
	"github.com/fitcache/fitcache/tiers"
)

// clearEnv unsets every FITCACHE_ variable for the test, so that the machine's environment
// does not leak into what Load returns.
func clearEnv(t *testing.T) {
	t.Helper()
	for _, k := range configKeys {
		t.Setenv("FITCACHE_"+strings.ToUpper(k), "")
	}
	for _, k := range []string{"SLURM_JOB_ID", "SLURM_TMPDIR", "TMPDIR"} {
		t.Setenv(k, "")
	}
	t.Setenv("FITCACHE_SITE_CONFIG", filepath.Join(t.TempDir(), "none.conf"))
}

func TestLoadDefaults(t *testing.T) {
	clearEnv(t)
	cfg, err := Load(map[string]string{"runtime_dir": "/run/x"})
	if err != nil {
		t.Fatal(err)
	}
	host, _ := os.Hostname()
	want := Config{RuntimeDir: "/run/x", Policy: PolicyRecache, Node: host, PerNode: 1, BasePort: 7070,
		FailureThreshold: 3, Replicas: 1, Prefetch: 16, BlockBytes: 4 << 20,
		IdleTimeout: 15 * time.Minute, ReadTimeout: time.Minute, StartTimeout: 15 * time.Second,
		RPCTimeout: 5 * time.Second, WaitTimeout: time.Minute, GossipPortOffset: 1000, ProbeInterval: time.Second,
		MemoryAtExit: core.MemoryClear, MemoryReserve: tiers.SizeOrPercent{Percent: 25}, FollowCgroup: true,
		Site: Site{KeepFree: tiers.SizeOrPercent{Percent: 10}, MemoryReserve: tiers.SizeOrPercent{Percent: 25},
			MemoryAtExit: core.MemoryClear, AllowKeep: true}}
	if cfg != want {
		t.Errorf("defaults:\n got %+v\nwant %+v", cfg, want)
	}
}

// Options win over the environment, and an empty option means "not given".
func TestLoadPrecedence(t *testing.T) {
	clearEnv(t)
	t.Setenv("FITCACHE_POLICY", "pfs")
	t.Setenv("FITCACHE_REPLICAS", "2")
	t.Setenv("FITCACHE_RPC_TIMEOUT", "7")
	cfg, err := Load(map[string]string{"runtime_dir": "/run/x", "replicas": "3", "policy": ""})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Policy != PolicyPFS || cfg.Replicas != 3 || cfg.RPCTimeout != 7*time.Second {
		t.Errorf("got policy %s, replicas %d, rpc timeout %v; want pfs (environment), 3 (option), 7s (environment)",
			cfg.Policy, cfg.Replicas, cfg.RPCTimeout)
	}
}

// virtual_nodes is auto (0: the ring's own choice for the job's size) unless a number is set.
func TestLoadVirtualNodes(t *testing.T) {
	clearEnv(t)
	for value, want := range map[string]int{"": 0, "auto": 0, "Auto": 0, "100": 100, "2000": 2000} {
		cfg, err := Load(map[string]string{"runtime_dir": "/run/x", "virtual_nodes": value})
		if err != nil || cfg.VirtualNodes != want {
			t.Errorf("virtual_nodes=%q: got %d (%v), want %d", value, cfg.VirtualNodes, err, want)
		}
	}
}

func TestLoadRefusesBadOptions(t *testing.T) {
	clearEnv(t)
	for _, tc := range []struct {
		key, value, wantErr string
	}{
		{"tier", "memory:/x", "unknown option \"tier\""},
		{"policy", "drop", "neither"},
		{"replicas", "0", "positive whole number"},
		{"base_port", "7k", "positive whole number"},
		{"virtual_nodes", "0", "auto or a whole number from 1 to 10000"},
		{"virtual_nodes", "lots", "auto or a whole number from 1 to 10000"},
		{"virtual_nodes", "10001", "auto or a whole number from 1 to 10000"},
		{"prefetch", "-1", "from 0 (off) to 1024"},
		{"prefetch", "1025", "from 0 (off) to 1024"},
		{"block_size", "1KiB", "from 64KiB to 256MiB"},
		{"block_size", "10%", "from 64KiB to 256MiB"},
		{"read_timeout", "soon", "read_timeout"},
		{"verify", "yes please", "verify"},
		{"tiers", "memory", "want kind:dir[:budget]"},
		{"tiers", "ram:/dev/shm/x", "ram"},
		{"tiers", "memory:/dev/shm/x:lots", "memory:/dev/shm/x:lots"},
	} {
		_, err := Load(map[string]string{"runtime_dir": "/run/x", tc.key: tc.value})
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%s=%q: error %v, want one containing %q", tc.key, tc.value, err, tc.wantErr)
		}
	}
}

func TestLoadDurationsAndTiers(t *testing.T) {
	clearEnv(t)
	cfg, err := Load(map[string]string{"runtime_dir": "/run/x", "idle_timeout": "0.5", "start_timeout": "90s",
		"prefetch": "0", "tiers": "memory:/dev/shm/a:2GiB, disk:/nvme/b"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.IdleTimeout != 500*time.Millisecond || cfg.StartTimeout != 90*time.Second || cfg.Prefetch != 0 {
		t.Errorf("idle %v, start %v, prefetch %d; want 500ms, 1m30s, 0", cfg.IdleTimeout, cfg.StartTimeout, cfg.Prefetch)
	}
	got, err := cfg.TierConfigs()
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, tc := range got {
		kinds = append(kinds, fmt.Sprintf("%v:%s:%s", tc.Kind, tc.Dir, tc.Budget))
	}
	if want := "memory:/dev/shm/a:2GiB disk:/nvme/b:"; strings.Join(kinds, " ") != want {
		t.Errorf("tiers %q, want %q", kinds, want)
	}
}

func TestConfigVerifyAndDefaultTiers(t *testing.T) {
	for _, tc := range []struct {
		opt, env string
		want     bool
		wantErr  bool
	}{
		{"", "", false, false}, {"", "1", true, false}, {"true", "", true, false},
		{"false", "1", false, false}, {"maybe", "", false, true},
	} {
		t.Setenv("FITCACHE_VERIFY", tc.env)
		cfg, err := Load(map[string]string{"verify": tc.opt, "runtime_dir": "/run/x"})
		if (err != nil) != tc.wantErr || cfg.Verify != tc.want {
			t.Errorf("verify option %q env %q: got %v err %v, want %v (error %v)", tc.opt, tc.env, cfg.Verify, err, tc.want, tc.wantErr)
		}
	}
	mem := DefaultTiers("/run/x")[0]
	if mem.Kind != tiers.Memory || mem.FallbackRecord != "/run/x/"+MemoryTierRecord {
		t.Errorf("default memory tier %+v: want a fallback record in the runtime directory", mem)
	}
}

// When another user created the default runtime directory (/tmp/fitcache-UID) first, a
// private stand-in is used instead, the same one by every process, with a warning. On the
// main branch before this change the planted directory was used.
func TestPlantedDefaultRuntimeDirFallsBack(t *testing.T) {
	shared := privdirtest.SharedDir(t)
	t.Setenv("XDG_RUNTIME_DIR", "")
	t.Setenv("TMPDIR", shared)
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	planted := filepath.Join(shared, "fitcache-"+strconv.Itoa(os.Geteuid()))
	privdirtest.AsNobody(t, "mkdir -m 777 "+planted)
	cfg, err := Load(nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.RuntimeDir == planted || !strings.HasPrefix(cfg.RuntimeDir, planted+"-") {
		t.Fatalf("runtime directory %s, want a stand-in beside the planted %s", cfg.RuntimeDir, planted)
	}
	if err := privdir.Inspect(cfg.RuntimeDir); err != nil {
		t.Errorf("stand-in is not private: %v", err)
	}
	if !strings.Contains(cfg.RuntimeDirWarning, planted) {
		t.Errorf("warning %q does not name the planted directory", cfg.RuntimeDirWarning)
	}
	again, err := Load(nil)
	if err != nil || again.RuntimeDir != cfg.RuntimeDir {
		t.Errorf("a second process gets %s (%v), want the same stand-in %s", again.RuntimeDir, err, cfg.RuntimeDir)
	}
}

// The default runtime directory planted by another user with mode 0700, which this user
// cannot even open, is not ours either: a private stand-in is used. Run as nobody, with
// root's directory. Before, Inspect failed with EACCES, which is not ErrNotPrivate, and the
// planted directory was kept, to be refused when used: no embedded server.
func TestClosedDefaultRuntimeDirFallsBack(t *testing.T) {
	if shared, ok := privdirtest.Victim(); ok {
		t.Setenv("XDG_RUNTIME_DIR", "")
		t.Setenv("TMPDIR", shared)
		t.Setenv("XDG_CACHE_HOME", t.TempDir())
		planted := filepath.Join(shared, "fitcache-"+strconv.Itoa(os.Geteuid()))
		cfg, err := Load(nil)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(cfg.RuntimeDir, planted+"-") || !strings.Contains(cfg.RuntimeDirWarning, "root") {
			t.Fatalf("runtime directory %s (%q), want a stand-in beside root's %s", cfg.RuntimeDir, cfg.RuntimeDirWarning, planted)
		}
		if err := privdir.Inspect(cfg.RuntimeDir); err != nil {
			t.Errorf("stand-in is not private: %v", err)
		}
		return
	}
	shared := privdirtest.SharedDir(t)
	if err := os.Mkdir(filepath.Join(shared, "fitcache-65534"), 0o700); err != nil {
		t.Fatal(err)
	}
	privdirtest.RunAsNobody(t, shared)
}
