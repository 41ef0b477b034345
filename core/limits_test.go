package core

import (
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

// waitFor polls cond every 5 ms for at most 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("not within 5 s: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// fakeJob is a memory cgroup whose unreclaimable use is the job's own (other) plus what the
// memory tier holds, as tmpfs pages are charged to the job.
type fakeJob struct {
	limit, other atomic.Int64
	oomKills     atomic.Uint64
	tier         atomic.Pointer[tiers.Tier] // the memory tier, once the engine is made
}

func (j *fakeJob) read() (MemoryReading, error) {
	used := int64(0)
	if t := j.tier.Load(); t != nil {
		used = t.Info().Used
	}
	return MemoryReading{Limit: j.limit.Load(), Unreclaimable: j.other.Load() + used, OOMKills: j.oomKills.Load()}, nil
}

func TestTheMemoryTierFollowsTheJobsMemoryLimit(t *testing.T) {
	const mib = 1 << 20
	sizes := make([]int, 40)
	for i := range sizes {
		sizes[i] = mib
	}
	root, paths := dataset(t, sizes...)
	job := &fakeJob{}
	job.limit.Store(100 * mib)
	job.other.Store(30 * mib)
	e, err := NewEngine(EngineConfig{Tiers: testTiers(t, "64MiB", "64MiB"),
		Limits: Limits{Memory: job.read, Interval: 5 * time.Millisecond}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	mem, disk := e.tiers[0], e.tiers[1]
	job.tier.Store(mem)

	// 100 MiB limit, 25 MiB reserve, 30 MiB used by the job: the memory tier may hold 45,
	// less the slack of a quarter of the reserve.
	const budget = 45*mib - 25*mib/4
	waitFor(t, "the memory budget set from the limit", func() bool { return mem.Info().Budget == budget })
	for _, p := range paths {
		readAll(t, e, root, p)
	}
	settle(e)
	if got := mem.Info(); got.Used > budget || got.LimitedBy != "cgroup memory limit" || got.ConfiguredBudget != 64*mib {
		t.Fatalf("memory tier after 40 MiB read: %+v", got)
	}

	// The job grows by 30 MiB: the tier gives back what it must, to the disk tier.
	job.other.Store(60 * mib)
	waitFor(t, "the memory tier down to 15 MiB", func() bool { return mem.Info().Used <= 15*mib })
	if d := disk.Info(); d.Files < 20 {
		t.Fatalf("disk tier holds %d files, want the evicted ones moved there (memory: %+v)", d.Files, mem.Info())
	}
	before := e.Stats().SourceReads
	for _, p := range paths {
		origin, got := readAll(t, e, root, p)
		wantBytes(t, p, got)
		if origin != OriginMemory && origin != OriginDisk {
			t.Fatalf("%s read from %v, want a tier", p, origin)
		}
	}
	if n := e.Stats().SourceReads - before; n != 0 {
		t.Fatalf("%d source reads after the tier shrank, want 0", n)
	}

	// The job shrinks again: the budget rises back to the configured one.
	job.other.Store(0)
	waitFor(t, "the configured budget back", func() bool { i := mem.Info(); return i.Budget == 64*mib && i.LimitedBy == "" })

	// The kernel kills a process of the job: the server says so.
	job.oomKills.Add(1)
	waitFor(t, "an OOM kill reported", func() bool {
		return slices.ContainsFunc(e.Stats().Warnings, func(w string) bool { return strings.Contains(w, "OOM kill") })
	})
}

func TestTheMemoryTierNeverGrowsPastAnExhaustedLimit(t *testing.T) {
	root, paths := dataset(t, 1<<20, 1<<20)
	job := &fakeJob{}
	job.limit.Store(100 << 20)
	job.other.Store(90 << 20) // more than the limit less its reserve
	e, err := NewEngine(EngineConfig{Tiers: testTiers(t, "64MiB"), Limits: Limits{Memory: job.read}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for _, p := range paths {
		_, got := readAll(t, e, root, p)
		wantBytes(t, p, got)
	}
	settle(e)
	if i := e.tiers[0].Info(); i.Budget != 0 || i.Used != 0 {
		t.Fatalf("memory tier with no room left in the job: %+v", i)
	}
}

func TestSiteLimitsAndFreeSpaceLowerTheBudgets(t *testing.T) {
	const mib = 1 << 20
	keepFree, _ := tiers.ParseSize("10%")
	for _, tc := range []struct {
		name    string
		limits  Limits
		fsTotal int64 // the fake file system of both tiers
		fsUsed  int64 // besides the tiers
		memory  int64 // the memory tier's budget expected (configured: 64 MiB)
		disk    int64 // the disk tier's (configured: 64 MiB)
		why     string
	}{
		{name: "memory_per_user", limits: Limits{MemoryPerUser: 8 * mib}, fsTotal: 1 << 40,
			memory: 8 * mib, disk: 64 * mib, why: "site memory_per_user"},
		{name: "disk_per_user", limits: Limits{DiskPerUser: 4 * mib}, fsTotal: 1 << 40,
			memory: 64 * mib, disk: 4 * mib, why: "site disk_per_user"},
		{name: "memory_per_node", limits: Limits{MemoryPerNode: 1000 * mib}, fsTotal: 4000 * mib, fsUsed: 990 * mib,
			memory: 5 * mib, disk: 64 * mib, why: "site memory_per_node"}, // half the room: others read it too
		{name: "memory_per_node exceeded by others", limits: Limits{MemoryPerNode: 1000 * mib}, fsTotal: 4000 * mib,
			fsUsed: 1200 * mib, memory: 0, disk: 64 * mib, why: "site memory_per_node"},
		{name: "keep_free", limits: Limits{KeepFree: keepFree}, fsTotal: 1000 * mib, fsUsed: 880 * mib,
			memory: 10 * mib, disk: 10 * mib, why: "file system free space"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var e *Engine
			tc.limits.StatFS = func(dir string) (int64, int64, error) {
				var held int64
				if e != nil {
					for _, tier := range e.tiers {
						held += tier.Info().Used
					}
				}
				return tc.fsTotal, tc.fsTotal - tc.fsUsed - held, nil
			}
			tc.limits.Interval = time.Hour // applied once, at start
			var err error
			e, err = NewEngine(EngineConfig{Tiers: testTiers(t, "64MiB", "64MiB"), Limits: tc.limits}, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			mem, disk := e.tiers[0].Info(), e.tiers[1].Info()
			if mem.Budget != tc.memory || disk.Budget != tc.disk {
				t.Fatalf("budgets: memory %d, disk %d; want %d, %d", mem.Budget, disk.Budget, tc.memory, tc.disk)
			}
			if got := mem.LimitedBy + disk.LimitedBy; !strings.Contains(got, tc.why) {
				t.Fatalf("limited by %q and %q, want %q", mem.LimitedBy, disk.LimitedBy, tc.why)
			}
		})
	}
}

func TestNoLimitsChangeNothing(t *testing.T) {
	unlimited := func() (MemoryReading, error) { return MemoryReading{Limit: math.MaxInt64, Unreclaimable: 1 << 40}, nil }
	e, err := NewEngine(EngineConfig{Tiers: testTiers(t, "64MiB"), Limits: Limits{Memory: unlimited}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if i := e.tiers[0].Info(); i.Budget != 64<<20 || i.LimitedBy != "" {
		t.Fatalf("memory tier of a server in a cgroup without a limit: %+v", i)
	}
}

// tierFiles lists the names in a tier directory.
func tierFiles(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// dirBlocks returns the bytes the files directly in dir take (their blocks).
func dirBlocks(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	for _, name := range tierFiles(t, dir) {
		var st syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(dir, name), &st); err != nil {
			t.Fatal(err)
		}
		n += st.Blocks * 512
	}
	return n
}

func TestMemoryAtExit(t *testing.T) {
	root, paths := dataset(t, 100<<10, 200<<10, 300<<10)
	for _, policy := range []MemoryAtExit{MemoryClear, MemoryToDisk, MemoryKeep} {
		t.Run(string(policy), func(t *testing.T) {
			cfgs := testTiers(t, "64MiB", "64MiB")
			e, err := NewEngine(EngineConfig{Tiers: cfgs, MemoryAtExit: policy}, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range paths {
				readAll(t, e, root, p)
			}
			settle(e)
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
			left := tierFiles(t, cfgs[0].Dir)
			if policy == MemoryKeep {
				if len(left) < 2 {
					t.Fatalf("memory tier kept only %v", left)
				}
			} else {
				if !slices.Equal(left, []string{"fitcache.index", "fitcache.lock"}) {
					t.Fatalf("memory tier after the server exited holds %v, want only its index and lock", left)
				}
				if held := dirBlocks(t, cfgs[0].Dir); held > 64<<10 {
					t.Fatalf("memory tier after the server exited takes %d bytes", held)
				}
			}

			// The next server: files kept or moved are read without the source.
			e2, err := NewEngine(EngineConfig{Tiers: cfgs}, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer e2.Close()
			want := map[MemoryAtExit]Origin{MemoryClear: OriginSource, MemoryToDisk: OriginDisk, MemoryKeep: OriginMemory}[policy]
			for _, p := range paths {
				origin, got := readAll(t, e2, root, p)
				wantBytes(t, p, got)
				if origin != want {
					t.Fatalf("%s after %s: read from %v, want %v", p, policy, origin, want)
				}
			}
		})
	}
}
