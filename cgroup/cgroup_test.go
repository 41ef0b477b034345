package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const v1None = "9223372036854771712" // v1's "no limit" on 4 KiB pages

// fakeTree writes files under a temporary root; "ROOT" in a file's text (a mountinfo's
// mount points) becomes that root.
func fakeTree(t testing.TB, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for name, text := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(strings.ReplaceAll(text, "ROOT", root)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// Mount lines as this machine's mountinfo has them, with the cgroup fs under ROOT.
const (
	mountTmpfs   = "31 23 0:28 / ROOT/sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
	mountCPU     = "32 31 0:29 / ROOT/sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
	mountMemory  = "35 31 0:32 / ROOT/sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
	mountUnified = "41 31 0:38 / ROOT/sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
	mountV2      = "29 23 0:26 / ROOT/sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
)

// stat1 is a v1 memory.stat; the cgroup's own (non-total) counters differ from the
// hierarchical totals, so a test sees which were read.
func stat1(hier, activeFile, inactiveFile, shmem string) string {
	return "cache 86016\nrss 1646592\nshmem 1\nactive_file 2\ninactive_file 3\n" +
		"hierarchical_memory_limit " + hier + "\nhierarchical_memsw_limit " + v1None + "\n" +
		"total_cache 86016\ntotal_rss 1646592\ntotal_shmem " + shmem + "\n" +
		"total_inactive_file " + inactiveFile + "\ntotal_active_file " + activeFile + "\ntotal_unevictable 0\n"
}

// stat2 is a v2 memory.stat, with the keys that only look like the wanted ones.
func stat2(activeFile, inactiveFile, shmem string) string {
	return "anon 1646592\nfile 86016\nkernel 0\nshmem " + shmem + "\nfile_mapped 0\n" +
		"shmem_thp 0\nfile_thp 0\ninactive_anon 5\nactive_anon 6\ninactive_file " + inactiveFile +
		"\nactive_file " + activeFile + "\nworkingset_refault_file 9\n"
}

func v1Files(dir, usage, limit, hier string) map[string]string {
	return map[string]string{
		dir + "/memory.usage_in_bytes": usage + "\n",
		dir + "/memory.limit_in_bytes": limit + "\n",
		dir + "/memory.stat":           stat1(hier, "100", "200", "300"),
		dir + "/memory.failcnt":        "7\n",
		dir + "/memory.oom_control":    "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
	}
}

func v2Files(dir, current, max, high string) map[string]string {
	return map[string]string{
		dir + "/memory.current": current + "\n",
		dir + "/memory.max":     max + "\n",
		dir + "/memory.high":    high + "\n",
		dir + "/memory.stat":    stat2("100", "200", "300"),
		dir + "/memory.events":  "low 0\nhigh 3\nmax 5\noom 1\noom_kill 1\noom_group_kill 0\n",
	}
}

func merge(ms ...map[string]string) map[string]string {
	out := map[string]string{}
	for _, m := range ms {
		for k, v := range m {
			out[k] = v
		}
	}
	return out
}

func proc(cgroup, mountinfo string) map[string]string {
	return map[string]string{"proc/42/cgroup": cgroup, "proc/42/mountinfo": mountinfo}
}

const (
	v1Mounts     = mountTmpfs + mountCPU + mountMemory + mountUnified
	v1Cgroup     = "9:name=systemd:/\n4:memory:/slurm/uid_0/job_1\n1:cpu:/\n0::/\n"
	v1Dir        = "sys/fs/cgroup/memory/slurm/uid_0/job_1"
	v2Cgroup     = "0::/system.slice/slurm/job_1\n"
	v2Dir        = "sys/fs/cgroup/system.slice/slurm/job_1"
	v2Parent     = "sys/fs/cgroup/system.slice/slurm"
	v2GrandParnt = "sys/fs/cgroup/system.slice"
)

func TestFindRead(t *testing.T) {
	v1Want := Usage{Limit: 64 << 20, Usage: 1000000, File: 300, Shmem: 300, LimitHits: 7, OOMKills: 2}
	v2Want := Usage{Limit: 1000, Usage: 900, File: 300, Shmem: 300, LimitHits: 5, OOMKills: 1}
	with := func(u Usage, f func(*Usage)) Usage { f(&u); return u }
	tests := []struct {
		name    string
		files   map[string]string
		version int
		dir     string
		level   string // the binding level, if not dir
		want    Usage
	}{{
		name:    "v1 limited",
		files:   merge(proc(v1Cgroup, v1Mounts), v1Files(v1Dir, "1000000", "67108864", "67108864")),
		version: 1, dir: v1Dir, want: v1Want,
	}, {
		name:    "v1 unlimited",
		files:   merge(proc(v1Cgroup, v1Mounts), v1Files(v1Dir, "1000000", v1None, v1None)),
		version: 1, dir: v1Dir, want: with(v1Want, func(u *Usage) { u.Limit = NoLimit }),
	}, {
		name: "v1 limit on an ancestor only, combined controller list",
		files: merge(proc("4:memory,foo:/slurm/uid_0/job_1\n",
			mountTmpfs+"35 31 0:32 / ROOT/sys/fs/cgroup/memory rw - cgroup cgroup rw,foo,memory\n"),
			v1Files(v1Dir, "1000000", v1None, "1073741824")),
		// uid_0 has no memory files here: as at a mount root, hierarchical_memory_limit counts
		version: 1, dir: v1Dir, want: with(v1Want, func(u *Usage) { u.Limit = 1 << 30 }),
	}, {
		name:    "v1 own limit below the hierarchical one",
		files:   merge(proc(v1Cgroup, v1Mounts), v1Files(v1Dir, "1000000", "4096", "1073741824")),
		version: 1, dir: v1Dir, want: with(v1Want, func(u *Usage) { u.Limit = 4096 }),
	}, {
		name: "v1 old kernel: no failcnt, no oom_kill line",
		files: merge(proc(v1Cgroup, v1Mounts), v1Files(v1Dir, "1000000", "67108864", "67108864"), map[string]string{
			v1Dir + "/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\n",
		}),
		version: 1, dir: v1Dir, want: with(v1Want, func(u *Usage) { u.OOMKills = 0 }),
	}, {
		name: "v1 container: cgroup path under the mount's root",
		files: merge(proc("4:memory:/docker/abc\n", mountTmpfs+
			"35 31 0:32 /docker/abc ROOT/sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"),
			v1Files("sys/fs/cgroup/memory", "1000000", "67108864", "67108864")),
		version: 1, dir: "sys/fs/cgroup/memory", want: v1Want,
	}, {
		name: "v1 mount point with a space",
		files: merge(proc(v1Cgroup, `35 31 0:32 / ROOT/cg\040fs rw - cgroup cgroup rw,memory`+"\n"),
			v1Files("cg fs/slurm/uid_0/job_1", "1000000", "67108864", "67108864")),
		version: 1, dir: "cg fs/slurm/uid_0/job_1", want: v1Want,
	}, {
		name:    "v2 limited by memory.max",
		files:   merge(proc(v2Cgroup, mountV2), v2Files(v2Dir, "900", "1000", "max"), v2Files(v2Parent, "900", "max", "max")),
		version: 2, dir: v2Dir, want: v2Want,
	}, {
		name:    "v2 limited by memory.high",
		files:   merge(proc(v2Cgroup, mountV2), v2Files(v2Dir, "900", "5000", "1000"), v2Files(v2Parent, "900", "max", "max")),
		version: 2, dir: v2Dir, want: v2Want,
	}, {
		name: "v2 limited by an ancestor",
		files: merge(proc(v2Cgroup, mountV2), v2Files(v2Dir, "900", "max", "max"),
			v2Files(v2Parent, "900", "max", "max"), v2Files(v2GrandParnt, "900", "max", "1000")),
		version: 2, dir: v2Dir, level: v2GrandParnt, want: v2Want,
	}, {
		name: "v2 no limit, no memory.events",
		files: merge(proc(v2Cgroup, mountV2), v2Files(v2Dir, "900", "max", "max"), v2Files(v2Parent, "900", "max", "max"),
			map[string]string{v2Dir + "/memory.events": ""}),
		version: 2, dir: v2Dir, want: with(v2Want, func(u *Usage) { u.Limit, u.LimitHits, u.OOMKills = NoLimit, 0, 0 }),
	}, {
		name: "v2 controller not enabled for the cgroup: its parent is charged",
		files: merge(proc(v2Cgroup, mountV2), v2Files(v2Parent, "900", "1000", "max"),
			map[string]string{v2Dir + "/cgroup.procs": "42\n"}),
		version: 2, dir: v2Parent, want: v2Want,
	}, {
		name: "v2 container: limits above the mount are not read",
		files: merge(proc("0::/\n", "29 23 0:26 / ROOT/sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"),
			v2Files("sys/fs/cgroup", "900", "1000", "max"), v2Files("sys/fs", "900", "10", "10")),
		version: 2, dir: "sys/fs/cgroup", want: v2Want,
	}, {
		name: "hybrid: v1 memory, cgroup2 without it",
		files: merge(proc("4:memory:/a\n0::/a\n", v1Mounts), v1Files("sys/fs/cgroup/memory/a", "1000000", "67108864", "67108864"),
			map[string]string{"sys/fs/cgroup/unified/a/cgroup.procs": "42\n", "sys/fs/cgroup/unified/a/memory.pressure": ""}),
		version: 1, dir: "sys/fs/cgroup/memory/a", want: v1Want,
	}, {
		name: "hybrid: v1 memory listed but not mounted, cgroup2 with it",
		files: merge(proc("4:memory:/a\n0::/a\n", mountTmpfs+mountCPU+mountUnified),
			v2Files("sys/fs/cgroup/unified/a", "900", "1000", "max")),
		version: 2, dir: "sys/fs/cgroup/unified/a", want: v2Want,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := fakeTree(t, tt.files)
			m, err := Find(filepath.Join(root, "proc"), 42)
			if err != nil {
				t.Fatalf("Find: %v", err)
			}
			if got, want := m.Version(), tt.version; got != want {
				t.Errorf("Version() = %d, want %d", got, want)
			}
			if got, want := m.Dir(), filepath.Join(root, tt.dir); got != want {
				t.Errorf("Dir() = %q, want %q", got, want)
			}
			got, err := m.Read()
			if err != nil {
				t.Fatalf("Read: %v", err)
			}
			if tt.level == "" {
				tt.level = tt.dir
			}
			tt.want.Level = filepath.Join(root, tt.level)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Read() (-want +got):\n%s", diff)
			}
		})
	}
}

// TestReadRereadsLimits checks that a limit changed after Find (scontrol update) is seen.
func TestReadRereadsLimits(t *testing.T) {
	root := fakeTree(t, merge(proc(v2Cgroup, mountV2), v2Files(v2Dir, "900", "max", "max"), v2Files(v2Parent, "900", "max", "max")))
	m, err := Find(filepath.Join(root, "proc"), 42)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, v2Parent, "memory.max"), []byte("2048\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	u, err := m.Read()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := u.Limit, int64(2048); got != want {
		t.Errorf("Limit = %d, want %d", got, want)
	}
}

func TestNoController(t *testing.T) {
	tests := []struct {
		name  string
		files map[string]string
	}{
		{"no cgroup mounts", proc(v1Cgroup, mountTmpfs)},
		{"v1 without memory, no v2 line", proc("1:cpu:/\n", mountTmpfs+mountCPU)},
		{"hybrid without memory anywhere", merge(proc("1:cpu:/\n0::/a\n", mountTmpfs+mountCPU+mountUnified),
			map[string]string{"sys/fs/cgroup/unified/a/cgroup.procs": ""})},
		{"v2 root cgroup", merge(proc("0::/\n", mountV2), map[string]string{"sys/fs/cgroup/memory.stat": stat2("1", "2", "3")})},
		{"v1 cgroup not under the mount's root", proc("4:memory:/elsewhere\n",
			"35 31 0:32 /docker/abc ROOT/sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n")},
		{"v1 directory missing", proc(v1Cgroup, v1Mounts)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := fakeTree(t, tt.files)
			m, err := Find(filepath.Join(root, "proc"), 42)
			if !errors.Is(err, ErrNoController) {
				t.Fatalf("Find() = %v, %v; want ErrNoController", m, err)
			}
		})
	}
}

func TestMalformed(t *testing.T) {
	good1 := merge(proc(v1Cgroup, v1Mounts), v1Files(v1Dir, "1000000", "67108864", "67108864"))
	good2 := merge(proc(v2Cgroup, mountV2), v2Files(v2Dir, "900", "1000", "max"))
	tests := []struct {
		name  string
		files map[string]string
		want  string // in the error
	}{
		{"cgroup line", merge(good1, proc("garbage\n", v1Mounts)), `line 1: malformed "garbage"`},
		{"cgroup path", merge(good1, proc("4:memory:relative\n", v1Mounts)), `malformed "4:memory:relative"`},
		{"mountinfo line", merge(good1, proc(v1Cgroup, "1 2 3\n")), `mountinfo: line 1: malformed "1 2 3"`},
		{"v1 usage", merge(good1, map[string]string{v1Dir + "/memory.usage_in_bytes": "-1\n"}), `memory.usage_in_bytes: malformed "-1"`},
		{"v1 usage empty", merge(good1, map[string]string{v1Dir + "/memory.usage_in_bytes": ""}), `memory.usage_in_bytes: malformed ""`},
		{"v1 stat", merge(good1, map[string]string{v1Dir + "/memory.stat": "total_shmem 12k\n"}), `memory.stat: malformed line "total_shmem 12k"`},
		{"v1 stat missing", merge(good1, map[string]string{v1Dir + "/memory.stat": "MISSING"}), "memory.stat: no such file"},
		{"v1 oom_control", merge(good1, map[string]string{v1Dir + "/memory.oom_control": "oom_kill x\n"}), `malformed line "oom_kill x"`},
		{"v2 current", merge(good2, map[string]string{v2Dir + "/memory.current": "99999999999999999999999\n"}), `memory.current: malformed`},
		{"v2 max", merge(good2, map[string]string{v2Dir + "/memory.max": "1G\n"}), `memory.max: malformed "1G"`},
		{"v2 events", merge(good2, map[string]string{v2Dir + "/memory.events": "max -1\n"}), `memory.events: malformed line "max -1"`},
		{"v2 stat", merge(good2, map[string]string{v2Dir + "/memory.stat": "shmem\t1\n"}), ""}, // no space: not a key we know
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for name, text := range tt.files {
				if text == "MISSING" {
					delete(tt.files, name)
				}
			}
			root := fakeTree(t, tt.files)
			m, err := Find(filepath.Join(root, "proc"), 42)
			if err == nil {
				_, err = m.Read()
			}
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("got %v, want no error", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("got error %v, want one containing %q", err, tt.want)
			case err != nil && !strings.Contains(err.Error(), root):
				t.Errorf("error %v does not name the directory", err)
			}
		})
	}
}

func TestFindMissingProcess(t *testing.T) {
	_, err := Find(t.TempDir(), 42)
	if err == nil || errors.Is(err, ErrNoController) {
		t.Errorf("Find of a missing process = %v, want an error other than ErrNoController", err)
	}
}

func TestOpen(t *testing.T) {
	root := fakeTree(t, merge(v2Files(v2Dir, "900", "max", "max"), v2Files(v2Parent, "900", "1000", "max"),
		v1Files("v1", "1000000", "67108864", "67108864")))
	for _, tt := range []struct {
		dir     string
		version int
		want    Usage
	}{
		{v2Parent, 2, Usage{Limit: 1000, Usage: 900, File: 300, Shmem: 300, LimitHits: 5, OOMKills: 1}},
		{"v1", 1, Usage{Limit: 64 << 20, Usage: 1000000, File: 300, Shmem: 300, LimitHits: 7, OOMKills: 2}},
	} {
		m, err := Open(filepath.Join(root, v2Dir))
		if tt.version == 1 {
			m, err = Open(filepath.Join(root, tt.dir))
		}
		if err != nil {
			t.Fatal(err)
		}
		got, err := m.Read()
		if err != nil {
			t.Fatal(err)
		}
		if m.Version() != tt.version {
			t.Errorf("Open(%s).Version() = %d, want %d", tt.dir, m.Version(), tt.version)
		}
		tt.want.Level = filepath.Join(root, tt.dir)
		if diff := cmp.Diff(tt.want, got); diff != "" {
			t.Errorf("Open(%s).Read() (-want +got):\n%s", tt.dir, diff)
		}
	}
	if _, err := Open(root); !errors.Is(err, ErrNoController) {
		t.Errorf("Open of a plain directory: %v, want ErrNoController", err)
	}
}

func TestUsageMethods(t *testing.T) {
	tests := []struct {
		u       Usage
		limited bool
		unrecl  int64
	}{
		{Usage{Limit: NoLimit, Usage: 100, File: 30}, false, 70},
		{Usage{Limit: 1000, Usage: 100, File: 130}, true, 0},
		{Usage{Limit: 0}, true, 0},
	}
	for _, tt := range tests {
		if got := tt.u.Limited(); got != tt.limited {
			t.Errorf("%+v.Limited() = %v, want %v", tt.u, got, tt.limited)
		}
		if got := tt.u.Unreclaimable(); got != tt.unrecl {
			t.Errorf("%+v.Unreclaimable() = %d, want %d", tt.u, got, tt.unrecl)
		}
	}
}

func TestParseUint(t *testing.T) {
	tests := []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"0", 0, true}, {"18446744073709551615", 1<<64 - 1, true}, {"18446744073709551616", 0, false},
		{"", 0, false}, {"-1", 0, false}, {"1 ", 0, false}, {"max", 0, false},
	}
	for _, tt := range tests {
		got, ok := parseUint([]byte(tt.in))
		if got != tt.want || ok != tt.ok {
			t.Errorf("parseUint(%q) = %d, %v, want %d, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

// TestReadLargeFile checks a memory.stat bigger than the pooled buffer.
func TestReadLargeFile(t *testing.T) {
	pad := strings.Repeat("padding_key 1\n", 2000)
	root := fakeTree(t, merge(proc(v2Cgroup, mountV2), v2Files(v2Dir, "900", "1000", "max"),
		map[string]string{v2Dir + "/memory.stat": pad + stat2("100", "200", "300")}))
	m, err := Find(filepath.Join(root, "proc"), 42)
	if err != nil {
		t.Fatal(err)
	}
	u, err := m.Read()
	if err != nil {
		t.Fatal(err)
	}
	if u.File != 300 || u.Shmem != 300 {
		t.Errorf("File, Shmem = %d, %d; want 300, 300", u.File, u.Shmem)
	}
}

// slurm1 and slurm2 are 3-level Slurm trees, job (limited), step, task, with a sibling task.
var (
	slurm1 = merge(proc("4:memory:/job_1/step_0/task_0\n", v1Mounts), lv1("sys/fs/cgroup/memory/job_1", 900, 100, 1000, 3, 0),
		lv1("sys/fs/cgroup/memory/job_1/step_0", 850, 100, 0, 0, 0), lv1("sys/fs/cgroup/memory/job_1/step_0/task_0", 10, 0, 0, 0, 0),
		lv1("sys/fs/cgroup/memory/job_1/step_0/task_1", 840, 100, 0, 0, 2))
	slurm2 = merge(proc("0::/job_1/step_0/task_0\n", mountV2), lv2("sys/fs/cgroup/job_1", 900, 100, 1000, 0, 3, 0),
		lv2("sys/fs/cgroup/job_1/step_0", 850, 100, 0, 0, 0, 0), lv2("sys/fs/cgroup/job_1/step_0/task_0", 10, 0, 0, 0, 0, 0),
		lv2("sys/fs/cgroup/job_1/step_0/task_1", 840, 100, 0, 0, 0, 2))
)

func BenchmarkRead(b *testing.B) {
	fake := func(files map[string]string) func(b *testing.B) (*Memory, error) {
		return func(b *testing.B) (*Memory, error) {
			return Find(filepath.Join(fakeTree(b, files), "proc"), 42)
		}
	}
	for _, bb := range []struct {
		name string
		find func(b *testing.B) (*Memory, error)
	}{
		{"v1", fake(merge(proc(v1Cgroup, v1Mounts), v1Files(v1Dir, "1000000", "67108864", "67108864")))},
		{"v2", fake(merge(proc(v2Cgroup, mountV2), v2Files(v2Dir, "900", "1000", "max"), v2Files(v2Parent, "900", "max", "max")))},
		{"v1 slurm job/step/task", fake(slurm1)},
		{"v2 slurm job/step/task", fake(slurm2)},
		{"self", func(*testing.B) (*Memory, error) { return Self() }},
	} {
		b.Run(bb.name, func(b *testing.B) {
			m, err := bb.find(b)
			if err != nil {
				b.Skip(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := m.Read(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// lv1 and lv2 are one level of a fake tree: usage and file pages in MiB, the limit in MiB
// (0 for none), and the level's own counters.
func lv1(dir string, usage, file, limit int64, failcnt, oomKill int) map[string]string {
	lim := v1None
	if limit > 0 {
		lim = fmt.Sprint(limit * mib)
	}
	return map[string]string{
		dir + "/memory.usage_in_bytes": fmt.Sprintln(usage * mib),
		dir + "/memory.limit_in_bytes": lim + "\n",
		dir + "/memory.stat":           stat1(v1None, fmt.Sprint(file*mib), "0", fmt.Sprint(usage*mib/2)),
		dir + "/memory.failcnt":        fmt.Sprintln(failcnt),
		dir + "/memory.oom_control":    fmt.Sprintf("oom_kill_disable 0\nunder_oom 0\noom_kill %d\n", oomKill),
	}
}

func lv2(dir string, usage, file, max, high int64, maxEvents, oomKill int) map[string]string {
	lim := func(n int64) string {
		if n == 0 {
			return "max\n"
		}
		return fmt.Sprintln(n * mib)
	}
	return map[string]string{
		dir + "/memory.current": fmt.Sprintln(usage * mib),
		dir + "/memory.max":     lim(max),
		dir + "/memory.high":    lim(high),
		dir + "/memory.stat":    stat2(fmt.Sprint(file*mib), "0", fmt.Sprint(usage*mib/2)),
		dir + "/memory.events":  fmt.Sprintf("low 0\nhigh 0\nmax %d\noom 0\noom_kill %d\n", maxEvents, oomKill),
	}
}

const mib = 1 << 20

// findRead finds pid 42's cgroup in the fake tree at root and reads it.
func findRead(t *testing.T, root string) Usage {
	t.Helper()
	m, err := Find(filepath.Join(root, "proc"), 42)
	if err != nil {
		t.Fatalf("Find: %v", err)
	}
	u, err := m.Read()
	if err != nil {
		t.Fatalf("Read: %v", err)
	}
	return u
}

// TestSlurmJob reads from task_0 of a Slurm job whose limit is on the job (and step)
// cgroup, while a sibling task holds most of the memory.
func TestSlurmJob(t *testing.T) {
	const (
		v1Job  = "sys/fs/cgroup/memory/slurm/uid_0/job_1"
		v1Step = v1Job + "/step_0"
		v2Job  = "sys/fs/cgroup/system.slice/slurmstepd.scope/job_1"
		v2Step = v2Job + "/step_0"
	)
	v1Proc := proc("4:memory:/slurm/uid_0/job_1/step_0/task_0\n", v1Mounts)
	v2Proc := proc("0::/system.slice/slurmstepd.scope/job_1/step_0/task_0\n", mountV2)
	// Outside the job: a big host usage, no limit, counters that must not be counted.
	v1Host := merge(lv1("sys/fs/cgroup/memory/slurm", 5000, 0, 0, 9, 9), lv1("sys/fs/cgroup/memory/slurm/uid_0", 5000, 0, 0, 9, 9),
		lv1("sys/fs/cgroup/memory/slurm/uid_0/job_2", 500, 0, 600, 9, 9))
	v2Host := merge(lv2("sys/fs/cgroup/system.slice", 5000, 0, 0, 0, 9, 9), lv2("sys/fs/cgroup/system.slice/slurmstepd.scope", 5000, 0, 0, 0, 9, 9))
	tests := []struct {
		name  string
		files map[string]string
		want  Usage // Level relative to the tree's root
	}{{
		name: "v1 job binds",
		files: merge(v1Proc, v1Host, lv1(v1Job, 900, 100, 1000, 3, 0), lv1(v1Step, 850, 100, 1000, 1, 0),
			lv1(v1Step+"/task_0", 10, 0, 0, 0, 0), lv1(v1Step+"/task_1", 840, 100, 0, 0, 2),
			lv1(v1Job+"/step_batch", 5, 0, 0, 0, 0), lv1(v1Job+"/step_batch/task_0", 5, 0, 0, 0, 1)),
		// job: 1000 - (900-100) = 200 MiB; step: 1000 - 750 = 250 MiB
		want: Usage{Level: v1Job, Limit: 1000 * mib, Usage: 900 * mib, File: 100 * mib, Shmem: 450 * mib, LimitHits: 3 + 1, OOMKills: 3},
	}, {
		name: "v1 step binds",
		files: merge(v1Proc, v1Host, lv1(v1Job, 900, 100, 1000, 3, 0), lv1(v1Step, 850, 100, 800, 1, 0),
			lv1(v1Step+"/task_0", 10, 0, 0, 0, 0), lv1(v1Step+"/task_1", 840, 100, 0, 0, 2)),
		// step: 800 - 750 = 50 MiB
		want: Usage{Level: v1Step, Limit: 800 * mib, Usage: 850 * mib, File: 100 * mib, Shmem: 425 * mib, LimitHits: 3 + 1, OOMKills: 2},
	}, {
		name: "v1 no limit: the task's own reading",
		files: merge(v1Proc, v1Host, lv1(v1Job, 900, 100, 0, 3, 0), lv1(v1Step, 850, 100, 0, 1, 0),
			lv1(v1Step+"/task_0", 10, 0, 0, 0, 0), lv1(v1Step+"/task_1", 840, 100, 0, 0, 2)),
		want: Usage{Level: v1Step + "/task_0", Limit: NoLimit, Usage: 10 * mib, Shmem: 5 * mib},
	}, {
		name: "v2 job binds by memory.high",
		files: merge(v2Proc, v2Host, lv2(v2Job, 900, 100, 2000, 1000, 4, 2), lv2(v2Step, 850, 100, 0, 0, 1, 2),
			lv2(v2Step+"/task_0", 10, 0, 0, 0, 0, 0), lv2(v2Step+"/task_1", 840, 100, 0, 0, 0, 2)),
		want: Usage{Level: v2Job, Limit: 1000 * mib, Usage: 900 * mib, File: 100 * mib, Shmem: 450 * mib, LimitHits: 4, OOMKills: 2},
	}, {
		name: "v2 step binds; counters of the job",
		files: merge(v2Proc, v2Host, lv2(v2Job, 900, 100, 1000, 0, 4, 2), lv2(v2Step, 850, 100, 800, 0, 1, 2),
			lv2(v2Step+"/task_0", 10, 0, 0, 0, 0, 0)),
		want: Usage{Level: v2Step, Limit: 800 * mib, Usage: 850 * mib, File: 100 * mib, Shmem: 425 * mib, LimitHits: 4, OOMKills: 2},
	}, {
		name: "v2 no limit",
		files: merge(v2Proc, v2Host, lv2(v2Job, 900, 100, 0, 0, 4, 2), lv2(v2Step, 850, 100, 0, 0, 1, 2),
			lv2(v2Step+"/task_0", 10, 0, 0, 0, 1, 1)),
		want: Usage{Level: v2Step + "/task_0", Limit: NoLimit, Usage: 10 * mib, Shmem: 5 * mib, LimitHits: 1, OOMKills: 1},
	}, {
		name: "v2 memory_localevents: kills summed over the job",
		files: merge(proc("0::/system.slice/slurmstepd.scope/job_1/step_0/task_0\n",
			"29 23 0:26 / ROOT/sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate,memory_localevents\n"),
			v2Host, lv2(v2Job, 900, 100, 1000, 0, 4, 0), lv2(v2Step, 850, 100, 0, 0, 0, 0),
			lv2(v2Step+"/task_0", 10, 0, 0, 0, 0, 0), lv2(v2Step+"/task_1", 840, 100, 0, 0, 0, 2)),
		want: Usage{Level: v2Job, Limit: 1000 * mib, Usage: 900 * mib, File: 100 * mib, Shmem: 450 * mib, LimitHits: 4, OOMKills: 2},
	}, {
		name: "v1 container: a limit above the mount root, seen in hierarchical_memory_limit",
		files: merge(proc("4:memory:/docker/abc/step\n", mountTmpfs+
			"35 31 0:32 /docker/abc ROOT/sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"),
			lv1("sys/fs/cgroup/memory", 300, 0, 0, 0, 0), lv1("sys/fs/cgroup/memory/step", 100, 0, 0, 0, 0),
			map[string]string{"sys/fs/cgroup/memory/memory.stat": stat1(fmt.Sprint(512*mib), "0", "0", "0")}),
		want: Usage{Level: "sys/fs/cgroup/memory", Limit: 512 * mib, Usage: 300 * mib},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := fakeTree(t, tt.files)
			got := findRead(t, root)
			tt.want.Level = filepath.Join(root, tt.want.Level)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Read() (-want +got):\n%s", diff)
			}
		})
	}
}
