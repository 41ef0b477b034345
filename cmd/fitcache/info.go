package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"github.com/klauspost/cpuid/v2"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/embedded"
	"github.com/fitcache/fitcache/internal/mountinfo"
	"github.com/fitcache/fitcache/privdir"
	"github.com/fitcache/fitcache/tiers"
)

// tierReport is what info finds for one configured tier.
type tierReport struct {
	Kind     string `json:"kind"`
	Dir      string `json:"dir"`
	Usable   bool   `json:"usable"`
	Problem  string `json:"problem,omitempty"`
	FSType   string `json:"fs_type,omitempty"`
	Capacity int64  `json:"capacity_bytes,omitempty"`
	Free     int64  `json:"free_bytes,omitempty"`
	Budget   int64  `json:"budget_bytes,omitempty"`
	// HugePages is a memory tier's tmpfs's huge= mount option, "never" without one: with
	// one, copies are written into large pages (Linux 6.14 and later for small files).
	HugePages string `json:"tmpfs_huge,omitempty"`
	// Warning: the directory is not private (a server uses a stand-in or skips it) or
	// another server holds it.
	Warning string `json:"warning,omitempty"`
}

type hardware struct {
	CPU        string   `json:"cpu"`
	Vendor     string   `json:"vendor"`
	Cores      int      `json:"physical_cores"`
	Threads    int      `json:"logical_cpus"`
	GoMaxProcs int      `json:"gomaxprocs"`
	Features   []string `json:"features"`
	MemTotal   int64    `json:"mem_total_bytes"`
}

func info(args []string) error {
	fs := flag.NewFlagSet("info", flag.ExitOnError)
	asJSON := fs.Bool("json", false, "print JSON")
	fs.Parse(args)
	cfg, err := config.Load(nil)
	if err != nil {
		return err
	}
	tierCfgs, err := cfg.TierConfigs()
	if err != nil {
		return err
	}
	report := struct {
		Hardware   hardware     `json:"hardware"`
		Tiers      []tierReport `json:"tiers"`
		RuntimeDir string       `json:"runtime_dir"`
		ServerPID  int          `json:"embedded_server_pid,omitempty"`
		Limits     limitsReport `json:"limits"`
		Warnings   []string     `json:"warnings,omitempty"`
	}{Hardware: detectHardware(), RuntimeDir: cfg.RuntimeDir, Limits: inspectLimits(cfg)}
	if err := privdir.Inspect(cfg.RuntimeDir); err != nil && !errors.Is(err, os.ErrNotExist) {
		report.Warnings = append(report.Warnings, "runtime directory: "+err.Error())
	}
	for _, tc := range tierCfgs {
		r := inspectTier(tc)
		report.Tiers = append(report.Tiers, r)
		if r.Warning != "" {
			report.Warnings = append(report.Warnings, fmt.Sprintf("%s tier %s: %s", r.Kind, r.Dir, r.Warning))
		}
	}
	report.ServerPID = embedded.RunningPID(cfg.RuntimeDir)
	if *asJSON {
		b, _ := json.MarshalIndent(report, "", "  ")
		fmt.Println(string(b))
		return nil
	}
	h := report.Hardware
	fmt.Printf("cpu      %s (%s), %d cores, %d logical CPUs\n", h.CPU, h.Vendor, h.Cores, h.Threads)
	fmt.Printf("features %s\n", strings.Join(h.Features, " "))
	fmt.Printf("memory   %s\n", tiers.FormatBytes(h.MemTotal))
	for _, t := range report.Tiers {
		if !t.Usable {
			fmt.Printf("tier %-6s %s: skipped (%s)\n", t.Kind, t.Dir, t.Problem)
			continue
		}
		fs := t.FSType
		if t.HugePages != "" {
			fs += " (huge=" + t.HugePages + ")"
		}
		fmt.Printf("tier %-6s %s: %s, %s capacity, %s free, budget %s\n", t.Kind, t.Dir, fs,
			tiers.FormatBytes(t.Capacity), tiers.FormatBytes(t.Free), tiers.FormatBytes(t.Budget))
	}
	printLimits(report.Limits)
	for _, w := range report.Warnings {
		fmt.Printf("warning  %s\n", w)
	}
	if report.ServerPID != 0 {
		fmt.Printf("embedded server running, pid %d, in %s\n", report.ServerPID, cfg.RuntimeDir)
	} else {
		fmt.Printf("embedded server not running (runtime directory %s)\n", cfg.RuntimeDir)
	}
	return nil
}

// inspectTier reports what a tier would be, without creating it: the file system of its
// directory, or of the nearest existing parent.
func inspectTier(tc tiers.Config) tierReport {
	r := tierReport{Kind: tc.Kind.String(), Dir: tc.Dir}
	dir := tc.Dir
	for {
		if _, err := os.Stat(dir); err == nil {
			break
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			break
		}
		dir = parent
	}
	fsi, err := tiers.StatFS(dir)
	if err != nil {
		r.Problem = err.Error()
		return r
	}
	size, err := tc.BudgetSize()
	if err != nil {
		r.Problem = err.Error()
		return r
	}
	if tc.Kind == tiers.Memory && !fsi.InMemory() {
		r.Problem = "not on tmpfs: files there would not be in memory"
	}
	r.Usable = r.Problem == ""
	r.FSType, r.Capacity, r.Free, r.Budget = fsi.Type, fsi.Capacity, fsi.Free, size.Resolve(fsi.Capacity)
	r.Warning = privacyWarning(tc)
	if fsi.Type == "tmpfs" {
		r.HugePages = hugeOption(dir)
	}
	return r
}

// hugeOption returns the huge= option of the tmpfs that holds dir ("never" without one), or
// "" when the mount cannot be found.
func hugeOption(dir string) string {
	m, err := mountinfo.Holding(dir)
	if err != nil || m.FSType != "tmpfs" {
		return ""
	}
	if v, ok := m.Option("huge"); ok {
		return v
	}
	return "never"
}

// privacyWarning says what a server will do about a tier directory that is not private
// (another user's, a link) or that another server holds, or is "".
func privacyWarning(tc tiers.Config) string {
	err := privdir.Inspect(tc.Dir)
	var npe *privdir.NotPrivateError
	switch {
	case errors.As(err, &npe) && npe.Owner == -1 && strings.HasPrefix(npe.Reason, "has mode"):
		return "" // ours: a server sets it to 0700
	case errors.Is(err, privdir.ErrNotPrivate) && tc.FallbackRecord != "":
		return err.Error() + "; a server uses a private directory elsewhere in " + filepath.Dir(tc.Dir) +
			" (recorded in " + tc.FallbackRecord + ")"
	case errors.Is(err, privdir.ErrNotPrivate):
		return err.Error() + "; a server skips this tier"
	}
	if h := tiers.Holder(tc.Dir); h != "" {
		return "held by " + h + " (another server using it skips it)"
	}
	return ""
}

func detectHardware() hardware {
	c := cpuid.CPU
	h := hardware{CPU: c.BrandName, Vendor: c.VendorString, Cores: c.PhysicalCores,
		Threads: runtime.NumCPU(), GoMaxProcs: runtime.GOMAXPROCS(0)}
	for _, f := range []cpuid.FeatureID{cpuid.SSE42, cpuid.AVX, cpuid.AVX2, cpuid.AVX512F, cpuid.AESNI,
		cpuid.CLMUL, cpuid.SHA, cpuid.ERMS, cpuid.FSRM, cpuid.ASIMD, cpuid.CRC32} {
		if c.Supports(f) {
			h.Features = append(h.Features, f.String())
		}
	}
	h.MemTotal = memTotal()
	return h
}

func memTotal() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kb, _ := strconv.ParseInt(fields[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}
