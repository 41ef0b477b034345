#!/usr/bin/env python3
"""The transparent mode (`fitcache run`) at ImageNet scale, as users run it: an unmodified
ImageFolder-style reader through the preload shim, against the same reader over a /dev/shm
copy and against FitCacheDataset, in one run.

The dataset is bench_scale.py's (generated once under --data, default 30,000 files of ~105
KiB in 1,000 class directories, with a manifest of sizes and crc32s; see that script), and so
are the readers, the epochs' shuffled orders, the DataLoader set-up (--workers, default 2,
fresh workers each epoch; --batch-size 64) and the checks: every item is read whole and
consumed in the worker (zlib.crc32), and the main process checks each index once per epoch
with its crc and size against the manifest.

Every configuration runs in a fresh reader process (this script with --reader), which lists
the files as torchvision's ImageFolder does (class directories from os.scandir, sorted, then
each one's os.walk, sorted), builds its DataLoader, times only its epochs (not the
interpreter, imports, listing or server start) and reports them as JSON. Readers:

  plain     bench_scale's PlainCRC: __getitem__ is open(path, 'rb').read(); an unmodified
            program. Run plainly, or as `fitcache run --data SRC -- python ... --reader`
            (the transparent mode: the shim serves its opens from the cache)
  fitcache  bench_scale's FitCacheCRC over FitCacheDataset(SRC, files=the same list)

Configurations, interleaved within each of --repeats rounds: the three cold ones, then the
three warm ones, each trio back to back in an order that rotates from round to round (the
speed of a shared machine drifts over tens of seconds, so the configurations compared run
close together). Each cold configuration of the cache starts from a fresh private cache
(runtime directory and a memory tier under /dev/shm sized to hold the dataset, no disk tier;
the embedded server started first, its start timed apart); both warm ones read the tiers
the round's last cold configuration filled (each fills every file):

  plain-source            plain reader over the source (page cache warm), epoch 0: the
                          baseline of the cold epochs
  plain-shm               plain reader over a /dev/shm copy, epochs 1..E-1: the limit, the
                          baseline of the warm epochs
  fitcache-dataset-cold   FitCacheDataset, empty tiers, epoch 0
  fitcache-dataset-warm   FitCacheDataset over the filled tiers, epochs 1..E-1
  preload-cold            the plain reader under `fitcache run --data SRC`, empty tiers,
                          epoch 0 (`fitcache run` starts the prefetch of SRC at once)
  preload-warm            the same over the filled tiers (a second training run), epochs
                          1..E-1

`fitcache run` is the console script installed beside this interpreter, as users type it.
Epoch figures are medians over a reader's epochs, then medians over rounds; "vs baseline"
divides the baseline's median by the configuration's, "round ratios" is the median of the
same ratio taken within each round (which resists load that changes between rounds), and
"best epochs" the ratio of the fastest epochs of all rounds (the least disturbed). "CPU
us/file" is the CPU time of the reader and its workers in an epoch (median), per file. For
cold configurations "launch to end" is the time from starting the reader's command (`fitcache
run` included) to the end of its epoch 0, with its own ratios: `fitcache run` starts its
prefetch before the program's interpreter does, so the epoch alone flatters the transparent
mode (over the PFS its prefetch may be done before the epoch starts); launch to end is the
figure to compare first epochs by. Source opens during every configuration are counted with
inotify on the source directory (from outside FitCache); the server's own counters (source
reads, hits per tier: the shim counts its hits in the tiers' index) are recorded after each
configuration of the cache, and each reader reports whether libfitcache_preload.so and
libfitcache.so are mapped in it (the transparent reader must have the shim and never the
library). The machine is often
shared: "others' CPU" is the share of its CPUs used, while a configuration ran, by processes
other than the reader, its workers, the embedded server, this script and the emulated PFS's
processes (/proc/stat less their own CPU time), so that noisy rounds show.

With --pfs DIR, a second section measures the first epoch over a slow file system mounted
there (bench/slowfs, or your cluster's parallel file system: see bench/README.md; this
script never brings one up): --pfs-files
(default 2,000) files generated under DIR by bench_scale's generator, then per round, each
after dropping the page cache with --drop-caches (root; it also empties the emulated servers'
caches):

  pfs-plain                 plain reader, --pfs-workers (default 4) workers
  pfs-threads               plain reads with --pfs-threads (default 16) threads, each file
                            once: the file system's own limit
  fitcache-dataset-pfs-cold FitCacheDataset cold, --pfs-workers workers
  preload-pfs-cold          the plain reader under `fitcache run --data DIR`, cold,
                            --pfs-workers workers
  preload-pfs-cold-prefetch0  the same with `fitcache run --prefetch 0`: no prefetch, every
                            file a miss the shim asks the server for (its miss path)

Source opens are counted with inotify on DIR (the FUSE mount sees every open of this node)
and, with --bricks, on the dataset's directory in each brick (which undercount).

Everything the run makes in /dev/shm and its runtime directories is removed at the end, also
on Ctrl-C or SIGTERM; only the embedded servers it started are stopped (by the PID in its own
runtime directories' server.lock), and only the reader process groups it started are killed.
Prints a Markdown table and writes JSON to --out (default bench/results/preload-<date>.json).

    python bench/bench_preload.py --repeats 3                      # 30,000 files
    python bench/bench_preload.py --files 3000 --repeats 1 --out /tmp/preload.json
    python bench/bench_preload.py --repeats 5 --epochs 4 --pfs /mnt/pfs/fitcache-scale --drop-caches  # PFS up
"""

import argparse
import concurrent.futures
import datetime
import gc
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
import zlib
from pathlib import Path

import torch

import bench_scale
from bench_scale import (Cache, Check, EpochSampler, FitCacheCRC, PlainCRC, brick_dir, copy_tree, drop_caches,
                         generate, loader, log, summarize, timed_epoch, warm_page_cache)
from inotify import OpenCounter  # tests/, put on sys.path by bench_scale

import fitcache

DRAIN_SECONDS = 0.02  # inotify is drained this often while a reader runs: its queue holds 16,384 events


# ---- the reader (a fresh process per configuration) ----

def image_folder_files(root):
    """The files under root, relative to it, in the order torchvision's ImageFolder lists them:
    class directories from os.scandir, sorted, then each class's os.walk, sorted."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    files = []
    for cls in classes:
        for dirpath, _, fnames in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            files += [os.path.relpath(os.path.join(dirpath, f), root) for f in sorted(fnames)]
    return files


def mapped_libraries():
    with open("/proc/self/maps") as f:
        maps = f.read()
    return {"preload": "libfitcache_preload.so" in maps, "libfitcache": "/libfitcache.so" in maps}


def cpu_seconds():
    """CPU time of this process and its reaped children (an epoch's workers are joined at its end)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def threads_epoch(root, names, order, check, threads):
    """Each file of order once with a pool of plain readers; returns the seconds."""
    def one(i):
        with open(os.path.join(root, names[i]), "rb") as f:
            data = f.read()
        return zlib.crc32(data), len(data)
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for i, (crc, size) in zip(order, pool.map(one, order)):
            if crc != check.crcs[i] or size != check.sizes[i]:
                check.bad += 1
    return time.perf_counter() - t


def reader(spec):
    """Runs one configuration's epochs in this process and prints RESULT with their times."""
    root = spec["root"]
    names = image_folder_files(root)
    with open(spec["manifest"]) as f:
        by_name = {rel: (rel, size, crc) for rel, size, crc in json.load(f)["files"]}
    if sorted(names) != sorted(by_name):
        raise SystemExit(f"{root}: the files listed differ from the manifest")
    check = Check([by_name[rel] for rel in names])  # indices in listing order
    sampler = EpochSampler(len(names), spec["seed"])
    out = {"pid": os.getpid(), "libraries": mapped_libraries(), "epochs": []}
    if spec["kind"] == "threads":
        for e in spec["epochs"]:
            start, cpu = time.time(), cpu_seconds()
            secs = threads_epoch(root, names, sampler.order(e), check, spec["workers"])
            out["epochs"].append({"epoch": e, "seconds": secs, "cpu_seconds": cpu_seconds() - cpu,
                                  "files": len(names), "start": start})
    else:
        if spec["kind"] == "plain":
            ds = PlainCRC(root, names)
        else:
            ds = FitCacheCRC(fitcache.FitCacheDataset(root, files=names, **spec["options"]))
        dl = loader(ds, sampler, types.SimpleNamespace(batch_size=spec["batch_size"]), spec["workers"])
        for e in spec["epochs"]:
            # Every epoch forks its workers from a collected process, outside the measurement,
            # as bench_cores.py's measured() does (BENCHMARKS section 29).
            gc.collect()
            start, cpu = time.time(), cpu_seconds()
            secs, files, nbytes = timed_epoch(dl, sampler, e, check)
            out["epochs"].append({"epoch": e, "seconds": secs, "cpu_seconds": cpu_seconds() - cpu,
                                  "files": files, "bytes": nbytes, "start": start})
    out["end"] = time.time()
    out["bad"] = check.bad
    print("RESULT " + json.dumps(out), flush=True)


# ---- the harness ----

def fitcache_command():
    """The `fitcache` command users run: the console script beside this interpreter, else
    the program installed with the package."""
    script = os.path.join(os.path.dirname(sys.executable), "fitcache")
    return script if os.access(script, os.X_OK) else fitcache._native.server_binary()


def machine_cpu():
    """Busy and stolen CPU seconds of the whole machine so far (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq) / hz, steal / hz


def process_cpu(pid):
    """CPU seconds of process pid so far, or 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


PFS_PROCESSES = {"glusterfs", "glusterfsd", "nfq-delay"}  # a GlusterFS volume's processes and a delay program, where the PFS is one


def pfs_pids():
    """The processes of the emulated PFS: its FUSE client, its servers, its delay program."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/comm") as f:
                if f.read().strip() in PFS_PROCESSES:
                    pids.append(int(d))
        except (OSError, ValueError):
            pass
    return pids


class Load:
    """What the machine's CPUs did while a reader ran: the reader with its workers (reaped
    children), the embedded server, this harness (inotify draining), the emulated PFS's
    processes, and the rest (other users of the machine: the noise). Seconds of CPU."""

    def __init__(self, server_pid, pfs=()):
        self.server_pid, self.pfs = server_pid, list(pfs)

    def __enter__(self):
        self.t = time.perf_counter()
        self.busy, self.steal = machine_cpu()
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.children = r.ru_utime + r.ru_stime
        s = os.times()
        self.me = s.user + s.system
        self.server = process_cpu(self.server_pid) if self.server_pid else 0.0
        self.pfs_cpu = sum(process_cpu(p) for p in self.pfs)
        return self

    def __exit__(self, *exc):
        busy, steal = machine_cpu()
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        s = os.times()
        self.result = {"wall": time.perf_counter() - self.t, "busy": busy - self.busy, "steal": steal - self.steal,
                       "reader": r.ru_utime + r.ru_stime - self.children, "harness": s.user + s.system - self.me,
                       "server": process_cpu(self.server_pid) - self.server if self.server_pid else 0.0,
                       "pfs": sum(process_cpu(p) for p in self.pfs) - self.pfs_cpu}
        x = self.result
        x["others"] = max(0.0, x["busy"] - x["reader"] - x["harness"] - x["server"] - x["pfs"])
        x["others_share"] = x["others"] / (x["wall"] * os.cpu_count())


class Runner:
    """Starts reader processes, each in its own process group (killed on interrupt), and
    counts the source opens made while each runs."""

    def __init__(self, work, args):
        self.work, self.args = work, args
        self.proc = None
        self.pfs = []  # the emulated PFS's processes, whose CPU time is counted apart

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def run(self, kind, root, manifest, epochs, workers, watch, cache=None, under_run=False, prefetch=None):
        """One reader (under `fitcache run --prefetch prefetch` with under_run, by default
        --run-prefetch); returns its RESULT with "launch" (time.time() before the command
        started), "source_opens" (one count per watched directory) and the command."""
        bench_scale.checkpoint()
        spec = {"kind": kind, "root": root, "manifest": manifest, "epochs": epochs, "workers": workers,
                "seed": self.args.seed, "batch_size": self.args.batch_size,
                "options": cache.options if cache else {}}
        cmd = [sys.executable, os.path.abspath(__file__), "--reader", json.dumps(spec)]
        env = dict(os.environ)
        if under_run:
            if prefetch is None:
                prefetch = self.args.run_prefetch
            flag = [] if prefetch is None else ["--prefetch", str(prefetch)]
            cmd = [fitcache_command(), "run", "--data", root, *flag, "--"] + cmd
            env.update({"FITCACHE_" + k.upper(): str(v) for k, v in cache.options.items()})
        counters = [OpenCounter(d) for d in watch]
        try:
            with tempfile.TemporaryFile("w+", dir=self.work) as out, \
                    tempfile.TemporaryFile("w+", dir=self.work) as err:
                with Load(cache.server_pid() if cache else 0, self.pfs) as load:
                    launch = time.time()
                    self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
                    while self.proc.poll() is None:
                        for c in counters:
                            c.counts()
                        bench_scale.checkpoint()
                        time.sleep(DRAIN_SECONDS)
                opens = [sum(c.counts().values()) for c in counters]
                out.seek(0)
                err.seek(0)
                stdout, stderr = out.read(), err.read()
        finally:
            self.kill()
            for c in counters:
                c.close()
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        if self.proc.returncode != 0 or not line:
            raise SystemExit(f"reader {kind} {'under fitcache run ' if under_run else ''}failed "
                             f"({self.proc.returncode}):\n{stderr[-3000:]}")
        res = json.loads(line[0][len("RESULT "):])
        libs = res["libraries"]
        if libs["preload"] != under_run or (libs["libfitcache"] and kind != "fitcache"):
            raise SystemExit(f"reader {kind}: unexpected libraries mapped {libs} (under fitcache run: {under_run})")
        res.update(launch=launch, source_opens=opens, load=load.result,
                   command=cmd[:cmd.index("--reader")] + ["--reader", "SPEC"])
        return res


def warm_seconds(res):
    return statistics.median(e["seconds"] for e in res["epochs"])


def server_counters(cache):
    s = fitcache.server_stats(**cache.options)
    if s is None:
        return None
    return {"source_reads": s["source_reads"], "hits": {k: v for k, v in s["hits"].items() if v},
            "misses": s["misses"], "client_hits": s.get("client_hits"), "errors": s["errors"],
            "tier_files": sum(t["files"] for t in s["tiers"]), "prefetch_fetched": s["prefetch"]["fetched"]}


def ratios(res, times, baselines, runs):
    """Ratios against the baselines: of the medians, the median of the ratios within each
    round, and of the best epochs (the fastest of every round's epochs: the least disturbed by
    other work on the machine)."""
    for k in res:
        res[k]["best_epoch_seconds"] = min(e["seconds"] for x in runs if x["config"] == k for e in x["epochs"])
    for k, b in baselines.items():
        res[k]["baseline"] = b
        if b:
            res[k]["ratio"] = res[b]["seconds_median"] / res[k]["seconds_median"]
            res[k]["round_ratios"] = [x / y for x, y in zip(times[b], times[k])]
            res[k]["round_ratio_median"] = statistics.median(res[k]["round_ratios"])
            res[k]["best_epoch_ratio"] = res[b]["best_epoch_seconds"] / res[k]["best_epoch_seconds"]


def add_cpu(res, cpu, files):
    """CPU time of the reader and its workers per epoch (median over rounds), per file, and
    against the configuration's baseline."""
    for k, v in cpu.items():
        res[k]["cpu_seconds"] = v
        res[k]["cpu_seconds_median"] = statistics.median(v)
        res[k]["cpu_us_per_file"] = res[k]["cpu_seconds_median"] / files * 1e6
    for k, v in res.items():
        if v.get("baseline"):
            v["cpu_ratio"] = res[v["baseline"]]["cpu_seconds_median"] / v["cpu_seconds_median"]


def run_record(r, config, res):
    """What the JSON keeps of one reader run: each epoch's seconds and CPU, and the load."""
    return {"round": r, "config": config, "epochs": [{k: e[k] for k in ("epoch", "seconds", "cpu_seconds")}
                                                     for e in res["epochs"]], "load": res["load"]}


def add_load(res, runs):
    """Medians over rounds of the server's CPU seconds and of the share of the machine's CPUs
    that others used while each configuration ran (the noise)."""
    for k in res:
        loads = [x["load"] for x in runs if x["config"] == k]
        res[k]["server_cpu_seconds_median"] = statistics.median(x["server"] for x in loads)
        res[k]["others_share_median"] = statistics.median(x["others_share"] for x in loads)
        res[k]["others_share"] = [x["others_share"] for x in loads]
        res[k]["pfs_cpu_seconds_median"] = statistics.median(x["pfs"] for x in loads)


def add_launch_to_end(res, l2e, baselines):
    """Launch to the end of epoch 0 (the cold configurations): medians over rounds, and
    ratios against the baselines like the epochs'."""
    for k, v in l2e.items():
        if v:
            res[k]["launch_to_end"] = v
            res[k]["launch_to_end_median"] = statistics.median(v)
    for k, b in baselines.items():
        if b and l2e[k] and l2e[b]:
            res[k]["launch_to_end_ratio"] = res[b]["launch_to_end_median"] / res[k]["launch_to_end_median"]
            res[k]["launch_to_end_round_ratio_median"] = statistics.median(x / y for x, y in zip(l2e[b], l2e[k]))


def bench_local(args, work, cleanup, runner):
    src, manifest, made = generate(args.data, args.files, args.seed)
    manifest_path = os.path.join(os.path.dirname(src), "manifest.json")
    names = [rel for rel, _, _ in manifest]
    total = sum(size for _, size, _ in manifest)
    n = len(names)
    log(f"dataset {src}: {n} files, {total / 1e9:.2f} GB ({'generated' if made else 'reused'})")
    shm = f"/dev/shm/fitcache-preload-{os.getpid()}-copy"
    cleanup.append(lambda: shutil.rmtree(shm, ignore_errors=True))
    copy_tree(src, shm, names)
    warm_page_cache(src, names)  # "page cache warm" for the source baseline

    warm, cold = list(range(1, args.epochs)), [0]
    cache = Cache(work, "local", total)
    cleanup.append(cache.wipe)
    configs = ("plain-source", "plain-shm", "fitcache-dataset-cold", "fitcache-dataset-warm",
               "preload-cold", "preload-warm")
    times = {k: [] for k in configs}
    cpu = {k: [] for k in configs}
    l2e = {k: [] for k in configs}
    extra = {k: [] for k in ("source_opens", "startup", "server_start_seconds", "server", "runs")}
    check_bad = [0]

    def record(r, config, res):
        times[config].append(warm_seconds(res))
        cpu[config].append(statistics.median(e["cpu_seconds"] for e in res["epochs"]))
        extra["source_opens"].append({"round": r, "config": config, "opens": res["source_opens"][0]})
        extra["startup"].append({"round": r, "config": config, "seconds": res["epochs"][0]["start"] - res["launch"]})
        if res["epochs"][0]["epoch"] == 0:
            l2e[config].append(res["end"] - res["launch"])
        extra["runs"].append(run_record(r, config, res))
        check_bad[0] += res["bad"]

    # Each round: the three cold configurations, then the three warm ones, each trio back to
    # back in an order that rotates from round to round (the machine's speed drifts over tens
    # of seconds). A cold configuration of the cache starts from empty tiers and fills them; the
    # warm ones read the tiers the last of them filled (both fill every file).
    readers = {"plain-source": ("plain", src, cold, False), "plain-shm": ("plain", shm, warm, False),
               "fitcache-dataset-cold": ("fitcache", src, cold, False), "fitcache-dataset-warm": ("fitcache", src, warm, False),
               "preload-cold": ("plain", src, cold, True), "preload-warm": ("plain", src, warm, True)}
    trios = [["plain-source", "fitcache-dataset-cold", "preload-cold"],
             ["plain-shm", "fitcache-dataset-warm", "preload-warm"]]
    for r in range(args.repeats):
        for trio in trios:
            for config in trio[r % 3:] + trio[:r % 3]:
                kind, root, epochs, under_run = readers[config]
                cached = config not in ("plain-source", "plain-shm")
                if config.endswith("-cold"):
                    cache.wipe()
                    extra["server_start_seconds"].append(cache.start(src))
                record(r, config, runner.run(kind, root, manifest_path, epochs, args.workers, [src],
                                             cache if cached else None, under_run))
                if cached:
                    extra["server"].append({"round": r, "config": config, "counters": server_counters(cache)})
        log(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items())
            + f"; source opens {[(x['config'], x['opens']) for x in extra['source_opens'] if x['round'] == r]}"
            + f"; crc mismatches so far {check_bad[0]}")
        cache.wipe()
    shutil.rmtree(shm, ignore_errors=True)

    res = {k: summarize(v, n, total) for k, v in times.items()}
    baselines = {"plain-source": None, "plain-shm": None,
                 "fitcache-dataset-cold": "plain-source", "fitcache-dataset-warm": "plain-shm",
                 "preload-cold": "plain-source", "preload-warm": "plain-shm"}
    ratios(res, times, baselines, extra["runs"])
    add_launch_to_end(res, l2e, baselines)
    for k in ("cold", "warm"):  # the transparent mode against the library, directly
        res[f"preload-{k}"]["vs_fitcache_dataset"] = (res[f"fitcache-dataset-{k}"]["seconds_median"]
                                                      / res[f"preload-{k}"]["seconds_median"])
    res["preload-cold"]["vs_fitcache_dataset_launch_to_end"] = (
        res["fitcache-dataset-cold"]["launch_to_end_median"] / res["preload-cold"]["launch_to_end_median"])
    add_cpu(res, cpu, n)
    add_load(res, extra["runs"])
    for k in res:
        res[k]["source_opens"] = [x["opens"] for x in extra["source_opens"] if x["config"] == k]
        res[k]["startup_median"] = statistics.median(x["seconds"] for x in extra["startup"] if x["config"] == k)
    return {"dataset": {"dir": src, "files": n, "bytes": total, "median_size": statistics.median(s for _, s, _ in manifest)},
            "configs": res, **extra, "crc_mismatches": check_bad[0]}


def bench_pfs(args, work, cleanup, runner):
    src, manifest, made = generate(args.pfs, args.pfs_files, args.seed)
    manifest_path = os.path.join(os.path.dirname(src), "manifest.json")
    total = sum(size for _, size, _ in manifest)
    n = len(manifest)
    log(f"PFS dataset {src}: {n} files, {total / 1e9:.2f} GB ({'generated' if made else 'reused'})")
    cache = Cache(work, "pfs", total)
    cleanup.append(cache.wipe)
    watch = [src] + ([brick_dir(b, src) for b in args.bricks.split(",") if b] if args.bricks else [])
    runner.pfs = pfs_pids()
    configs = {"pfs-plain": ("plain", args.pfs_workers, False, False, None),
               "pfs-threads": ("threads", args.pfs_threads, False, False, None),
               "fitcache-dataset-pfs-cold": ("fitcache", args.pfs_workers, True, False, None),
               "preload-pfs-cold": ("plain", args.pfs_workers, True, True, None),
               "preload-pfs-cold-prefetch0": ("plain", args.pfs_workers, True, True, 0)}
    times = {k: [] for k in configs}
    cpu = {k: [] for k in configs}
    opens = {k: [] for k in configs}
    l2e = {k: [] for k in configs}
    server, server_start, runs, bad = [], [], [], 0
    for r in range(args.repeats):
        for config, (kind, workers, cached, under_run, prefetch) in configs.items():
            if args.drop_caches:
                drop_caches()
            if cached:
                cache.wipe()
                server_start.append(cache.start(src))
            res = runner.run(kind, src, manifest_path, [0], workers, watch, cache if cached else None, under_run,
                             prefetch)
            bad += res["bad"]
            runs.append(run_record(r, config, res))
            times[config].append(res["epochs"][0]["seconds"])
            cpu[config].append(res["epochs"][0]["cpu_seconds"])
            l2e[config].append(res["end"] - res["launch"])
            opens[config].append(dict(zip(["mount"] + [f"brick{i}" for i in range(len(watch) - 1)], res["source_opens"])))
            if cached:
                server.append({"round": r, "config": config, "counters": server_counters(cache)})
                cache.wipe()
            log(f"[pfs] round {r + 1}/{args.repeats} {config}: {times[config][-1]:.2f}s "
                f"(launch to end {l2e[config][-1]:.2f}s), opens {opens[config][-1]}")
    res = {k: summarize(v, n, total) for k, v in times.items()}
    baselines = {"pfs-plain": None, "pfs-threads": None, "fitcache-dataset-pfs-cold": "pfs-plain",
                 "preload-pfs-cold": "pfs-plain", "preload-pfs-cold-prefetch0": "pfs-plain"}
    ratios(res, times, baselines, runs)
    add_launch_to_end(res, l2e, baselines)
    add_cpu(res, cpu, n)
    add_load(res, runs)
    for k in res:
        res[k]["ratio_vs_threads"] = res["pfs-threads"]["seconds_median"] / res[k]["seconds_median"]
        res[k]["launch_to_end_ratio_vs_threads"] = (res["pfs-threads"]["launch_to_end_median"]
                                                    / res[k]["launch_to_end_median"])
        res[k]["source_opens"] = opens[k]
    res["preload-pfs-cold"]["vs_fitcache_dataset"] = (res["fitcache-dataset-pfs-cold"]["seconds_median"]
                                                      / res["preload-pfs-cold"]["seconds_median"])
    res["preload-pfs-cold"]["vs_fitcache_dataset_launch_to_end"] = (
        res["fitcache-dataset-pfs-cold"]["launch_to_end_median"] / res["preload-pfs-cold"]["launch_to_end_median"])
    return {"dataset": {"dir": src, "files": n, "bytes": total}, "configs": res, "server": server, "runs": runs,
            "server_start_seconds": server_start, "crc_mismatches": bad, "drop_caches": args.drop_caches}


def ratio_cell(v, key, base):
    return f"{v[key]:.2f}x {base}" if key in v else "1.00 (baseline)" if base is None else "-"


def markdown(results, args):
    lines = []
    loc = results.get("local")
    if loc:
        d = loc["dataset"]
        c = loc["configs"]
        lines += [f"{d['files']} files, {d['bytes'] / 1e9:.2f} GB, median {d['median_size'] / 1024:.0f} KiB; "
                  f"{args.workers} workers (fresh each epoch), batch {args.batch_size}; cold: epoch 0, warm: "
                  f"epochs 1..{args.epochs - 1}; medians over {args.repeats} rounds; crc mismatches: "
                  f"{loc['crc_mismatches']}.", "",
                  "| configuration | epoch s | files/s | MB/s | vs baseline (epoch) | round ratios / best epochs | CPU us/file "
                  "| launch to end s | vs baseline (launch to end) | source opens per round | others' CPU |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for k, v in c.items():
            ratio = ratio_cell(v, "ratio", v["baseline"])
            if "vs_fitcache_dataset" in v:
                ratio += f"; {v['vs_fitcache_dataset']:.2f}x fitcache-dataset"
            rr = f"{v['round_ratio_median']:.2f} / {v['best_epoch_ratio']:.2f}" if v["baseline"] else "-"
            l2e = f"{v['launch_to_end_median']:.2f}" if "launch_to_end_median" in v else "-"
            l2e_ratio = ratio_cell(v, "launch_to_end_ratio", v["baseline"]) if "launch_to_end_median" in v else "-"
            if "vs_fitcache_dataset_launch_to_end" in v:
                l2e_ratio += f"; {v['vs_fitcache_dataset_launch_to_end']:.2f}x fitcache-dataset"
            lines.append(f"| {k} | {v['seconds_median']:.3f} | {v['files_per_s']:.0f} | {v['MB_per_s']:.0f} | "
                         f"{ratio} | {rr} | {v['cpu_us_per_file']:.0f} | {l2e} | {l2e_ratio} | {v['source_opens']} | "
                         f"{v['others_share_median']:.0%} |")
        lines += ["", "Reader start (launch to its first epoch: interpreter, imports, listing; for preload also "
                  "`fitcache run`, whose prefetch runs meanwhile): "
                  + ", ".join(f"{k} {v['startup_median']:.2f}s" for k, v in c.items()) + ".",
                  f"Embedded server start (median, apart): {statistics.median(loc['server_start_seconds']) * 1e3:.0f} ms."]
        for s in loc["server"]:
            lines.append(f"Round {s['round'] + 1}, after {s['config']}: server {s['counters']}.")
    pfs = results.get("pfs")
    if pfs:
        d = pfs["dataset"]
        lines += ["", f"First epoch over {d['dir']}: {d['files']} files, {d['bytes'] / 1e9:.2f} GB, medians over "
                  f"{args.repeats} rounds{', page cache dropped before each' if pfs['drop_caches'] else ''}; "
                  f"crc mismatches: {pfs['crc_mismatches']}.", "",
                  "| configuration | readers | epoch s | files/s | vs threads | vs plain loader (epoch) | CPU us/file "
                  "| launch to end s | vs threads (launch to end) | vs plain loader (launch to end) | source opens (round 1) "
                  "| others' CPU |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        readers = {"pfs-threads": f"{args.pfs_threads} threads"}
        plain = pfs["configs"]["pfs-plain"]
        for k, v in pfs["configs"].items():
            vs_plain = ratio_cell(v, "ratio", v["baseline"]) if k != "pfs-threads" else \
                f"{plain['seconds_median'] / v['seconds_median']:.2f}x pfs-plain"
            l2e_plain = ratio_cell(v, "launch_to_end_ratio", v["baseline"]) if k != "pfs-threads" else \
                f"{plain['launch_to_end_median'] / v['launch_to_end_median']:.2f}x pfs-plain"
            if "vs_fitcache_dataset" in v:
                vs_plain += f"; {v['vs_fitcache_dataset']:.2f}x fitcache-dataset"
                l2e_plain += f"; {v['vs_fitcache_dataset_launch_to_end']:.2f}x fitcache-dataset"
            lines.append(f"| {k} | {readers.get(k, f'{args.pfs_workers} workers')} | {v['seconds_median']:.3f} | "
                         f"{v['files_per_s']:.0f} | {v['ratio_vs_threads']:.2f}x | {vs_plain} | {v['cpu_us_per_file']:.0f} | "
                         f"{v['launch_to_end_median']:.2f} | {v['launch_to_end_ratio_vs_threads']:.2f}x | {l2e_plain} | "
                         f"{v['source_opens'][0]} | {v['others_share_median']:.0%} |")
        for s in pfs["server"]:
            lines.append(f"Round {s['round'] + 1} {s['config']}: server {s['counters']}.")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_scale.add_scale_arguments(ap, "preload")
    ap.add_argument("--run-prefetch", type=int, help="pass --prefetch N to fitcache run (default: its own)")
    ap.add_argument("--reader", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        return reader(json.loads(args.reader))
    if args.epochs < 2:
        ap.error("--epochs must be at least 2 (one cold, then warm)")
    out = args.out or str(Path(__file__).resolve().parent / "results" / f"preload-{datetime.date.today()}.json")

    signal.signal(signal.SIGTERM, bench_scale._stop)
    work = f"/tmp/fitcache-preload-{os.getpid()}"
    os.makedirs(work)
    runner = Runner(work, args)
    cleanup = [lambda: shutil.rmtree(work, ignore_errors=True)]
    results = {"machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "torch": torch.__version__,
               "fitcache": os.path.dirname(fitcache.__file__), "fitcache_command": fitcache_command(),
               "args": {k: v for k, v in vars(args).items() if k != "reader"}}
    try:
        if not args.no_local:
            results["local"] = bench_local(args, work, cleanup, runner)
        if args.pfs:
            results["pfs"] = bench_pfs(args, work, cleanup, runner)
    finally:
        runner.kill()
        for fn in reversed(cleanup):
            fn()
    return bench_scale.write_results(results, markdown(results, args), out)


if __name__ == "__main__":
    sys.exit(main())
