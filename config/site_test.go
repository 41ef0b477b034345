package config

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/tiers"
)

// writeSite writes a site configuration and points FITCACHE_SITE_CONFIG at it.
func writeSite(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fitcache.conf")
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("FITCACHE_SITE_CONFIG", path)
	return path
}

func TestSiteConfiguration(t *testing.T) {
	clearEnv(t)
	path := writeSite(t, `# limits of this node
memory_per_user = 16GiB
memory_per_node = 64GiB   # every user's memory tiers
disk_per_user = 200GiB
keep_free = 5%
memory_reserve = 2GiB
memory_at_exit = disk
allow_keep = no
`)
	cfg, err := Load(nil)
	if err != nil {
		t.Fatal(err)
	}
	want := Site{Path: path, MemoryPerUser: 16 << 30, MemoryPerNode: 64 << 30, DiskPerUser: 200 << 30,
		KeepFree: tiers.SizeOrPercent{Percent: 5}, MemoryReserve: tiers.SizeOrPercent{Bytes: 2 << 30},
		MemoryAtExit: core.MemoryToDisk}
	if cfg.Site != want {
		t.Fatalf("site:\n got %+v\nwant %+v", cfg.Site, want)
	}
	if cfg.MemoryAtExit != core.MemoryToDisk || cfg.MemoryReserve != want.MemoryReserve {
		t.Fatalf("the site's defaults not taken: %+v", cfg)
	}
	l := cfg.Limits(nil)
	if l.MemoryPerUser != 16<<30 || l.MemoryPerNode != 64<<30 || l.DiskPerUser != 200<<30 || l.KeepFree != want.KeepFree {
		t.Fatalf("limits: %+v", l)
	}

	// A user may choose; keep only where the site allows it.
	cfg, err = Load(map[string]string{"memory_at_exit": "keep", "memory_reserve": "30%"})
	if err != nil {
		t.Fatal(err)
	}
	if policy, warning := cfg.ExitPolicy(); policy != core.MemoryClear || !strings.Contains(warning, "allow_keep = no") {
		t.Fatalf("keep on a site that does not allow it: %q, %q", policy, warning)
	}
	if cfg.MemoryReserve != (tiers.SizeOrPercent{Percent: 30}) {
		t.Fatalf("memory_reserve option: %v", cfg.MemoryReserve)
	}
}

func TestSiteConfigurationErrorsNameTheLine(t *testing.T) {
	for text, want := range map[string]string{
		"memory_per_user = lots\n":      "fitcache.conf:1: memory_per_user: want a size",
		"# ok\nmemory_per_nod = 1GiB\n": "fitcache.conf:2: memory_per_nod: unknown key",
		"memory_at_exit = forever\n":    "fitcache.conf:1: memory_at_exit:",
		"allow_keep = perhaps\n":        "fitcache.conf:1: allow_keep: want yes or no",
		"keep_free\n":                   "fitcache.conf:1: want key = value",
		"memory_per_node = 50%\n":       "memory_per_node: want a size",
	} {
		clearEnv(t)
		writeSite(t, text)
		if _, err := Load(nil); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: got %v, want an error with %q", text, err, want)
		}
	}
}

func TestMemoryOptions(t *testing.T) {
	clearEnv(t)
	cfg, err := Load(map[string]string{"memory_limit": "none", "memory_at_exit": "keep"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.FollowCgroup || cfg.Limits(func() (core.MemoryReading, error) { return core.MemoryReading{}, nil }).Memory != nil {
		t.Fatal("memory_limit=none still follows the cgroup")
	}
	if policy, warning := cfg.ExitPolicy(); policy != core.MemoryKeep || warning != "" {
		t.Fatalf("keep without a site file: %q, %q", policy, warning)
	}
	for _, c := range [][2]string{{"memory_limit", "8GiB"}, {"memory_at_exit", "sometimes"}, {"memory_reserve", "x"},
		{"memory_reserve", "0"}} {
		opt, bad := c[0], c[1]
		if _, err := Load(map[string]string{opt: bad}); err == nil || !strings.Contains(err.Error(), opt) {
			t.Errorf("%s=%s: got %v, want an error naming the option", opt, bad, err)
		}
	}
}

func TestInsideASlurmJob(t *testing.T) {
	clearEnv(t)
	scratch := t.TempDir()
	t.Setenv("SLURM_JOB_ID", "4242")
	t.Setenv("SLURM_TMPDIR", scratch)
	cfg, err := Load(nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Job != "slurm-4242" {
		t.Fatalf("job inside Slurm job 4242: %q", cfg.Job)
	}
	if cfg, _ := Load(map[string]string{"job": "mine"}); cfg.Job != "mine" {
		t.Fatalf("an explicit job: %q", cfg.Job)
	}
	tcs := DefaultTiers("")
	if len(tcs) != 2 || tcs[1].Dir != filepath.Join(scratch, "fitcache") {
		t.Fatalf("default tiers in a job with scratch %s: %+v", scratch, tcs)
	}

	// $TMPDIR is the job's scratch inside a job when it names the job, and is not in memory.
	t.Setenv("SLURM_TMPDIR", "")
	jobTmp := filepath.Join(scratch, "job4242")
	os.Mkdir(jobTmp, 0o700)
	t.Setenv("TMPDIR", jobTmp)
	if got := JobScratch(); got != jobTmp {
		t.Fatalf("JobScratch with TMPDIR=%s: %q", jobTmp, got)
	}
	shmJob := filepath.Join("/dev/shm", "fitcache-test-job4242-"+strconv.Itoa(os.Getpid()))
	os.Mkdir(shmJob, 0o700)
	defer os.Remove(shmJob)
	for _, d := range []string{"/tmp", scratch, shmJob, "relative/job4242", filepath.Join(scratch, "missing4242")} {
		t.Setenv("TMPDIR", d)
		if got := JobScratch(); got != "" {
			t.Errorf("JobScratch with TMPDIR=%s: %q, want none", d, got)
		}
	}
	t.Setenv("SLURM_JOB_ID", "")
	t.Setenv("TMPDIR", jobTmp)
	if got := JobScratch(); got != "" {
		t.Fatalf("JobScratch outside a job: %q", got)
	}
}
