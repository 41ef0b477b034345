#!/usr/bin/env python3
"""How FitCache scales with cores: DataLoader workers and reader threads swept, plain reads
measured against FitCache point by point in the same run, with the CPU time of every process
involved.

The dataset is bench_scale.py's ImageNet-like one (--files, default 20,000 files of ~105 KiB
of random bytes, generated once under --data, with a manifest of crc32s); every item is read
whole, its crc32 taken where it was read (a DataLoader worker or a thread), and checked
against the manifest. Sections (--sections, default all four):

  warm     for each worker count of --workers (default 1,2,4,8,16,32,64), a DataLoader (batch
           --batch-size, fork) over a /dev/shm copy (plain) against FitCacheDataset over a warm
           private cache (a memory tier under /dev/shm that holds the dataset, filled by one
           prefetch before the section), each mode in turn:
             fresh       fresh workers each epoch (the DataLoader default)
             persistent  persistent_workers=True (one untimed epoch starts them)
             batched     each worker's item a whole batch (a BatchSampler): plain reads item
                         by item against one FitCacheDataset.__getitems__ per batch, as
                         bench_scale's shm-batched and fitcache-warm-batched
             run         a plain Dataset in a fresh process (bench_preload.py's reader, fresh
                         workers) over the /dev/shm copy, against the same program under
                         `fitcache run --data SRC -- python ...` (the preload shim) over SRC
           Every FitCache reader of the section shares one job id, so that the server checks
           the cached copies against the source once, in the fill, and the section measures
           warm epochs only.
  cold     the first epoch, per worker count: plain reads of the source (page cache warm)
           against FitCacheDataset over fresh empty tiers and a fresh server (started before
           the clock, its start recorded apart), fresh workers.
  threads  for each thread count of --threads (default 1,2,4,8,16), one process
           (ThreadPoolExecutor) reading every file of the warm cache once: plain
           open().read() of the /dev/shm copy, FitCacheDataset.__getitem__ (prefetch off: the
           per-read cost) and fitcache.Client.read. One fresh process per round runs every
           point, the three readers interleaved; its clients are opened before the clock.
  cluster  bench_cluster.py run as it is (a subprocess per worker count of --cluster-workers,
           default 2,8,32): four servers on loopback addresses, the reader on the first
           server's node, tiers that hold the dataset on every node ("fits") and tiers that
           hold a node's share and 10% ("share"), cold and warm epochs against plain reads of
           the source and of a /dev/shm copy in the same run (--cluster-files files, default
           10,000; --cluster-repeats rounds; two epochs per job: one cold, one warm), for each
           way of reading of --cluster-reads (default both): "item", item by item as torch
           1.13's DataLoader reads, and "batched", a batch per __getitems__ call as PyTorch 2's
           DataLoader reads any dataset that has one (FitCacheDataset does).

Figures per point: files/s from the median seconds over --repeats rounds (each round runs
--epochs timed epochs per configuration, their median), "vs plain" the median over rounds of
plain's seconds divided by FitCache's in the same round (plain and FitCache run back to back,
their order swapped every round: the machine is shared, its speed drifts), and CPU µs per file
of every process: this one and its DataLoader workers, alive or reaped (/proc, as
bench_cluster.py counts them), the reader process of the run mode and its workers, and the
embedded server (/proc/PID/stat deltas). In the run mode the reader's CPU is its epochs' and
the server's that of the whole reader run (the prefetch hand-over of `fitcache run`
included). The cluster section reports bench_cluster.py's own figures (ratios of medians;
CPU of the servers and of the reader with its workers).

Every table is printed with the machine's core counts (os.cpu_count() and the CPUs this
process may run on), CPU model, memory, torch version and load average. Results go to
--out, by default bench/results/<machine tag>/cores-<date>.json, the tag being
cores<usable CPUs>-<short CPU model> (for example cores2-amd-epyc).

--tier-parent puts the memory tiers of the warm and cold sections on another tmpfs (say one
mounted with huge=within_size); the plain copy stays on /dev/shm, and the tables name the
tier's mount options.

--gc-log FILE appends a line for every collection of Python's garbage collector in this
process and its DataLoader workers, with the configuration measured (see GCLog).

Everything the run makes (the /dev/shm copy, tiers, runtime directories) is removed at the end,
also on Ctrl-C or SIGTERM; only the embedded servers it started are stopped (by the PID in
their runtime directory's server.lock), and only the processes it started are killed, by PID.
Whether this process loaded libfitcache (FitCacheDataset may open its client here before the
DataLoader forks, so that its workers share it) is recorded in the JSON.

    python bench/bench_cores.py --quick                         # a smoke run: 1,000 files
    python bench/bench_cores.py                                 # everything, defaults
    python bench/bench_cores.py --sections warm,threads --workers 1,2,4,8,16 --threads 1,2,4,8
"""

import argparse
import concurrent.futures
import datetime
import gc
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import types
import warnings
import zlib
from pathlib import Path

import torch

import bench_scale
from bench_cluster import tree_cpu
from bench_preload import Runner, process_cpu
from bench_scale import (Cache, Check, EpochSampler, FitCacheCRC, PlainCRC, checkpoint, copy_tree, generate,
                         loader, log, timed_epoch, warm_page_cache)
from privatecache import PrivateCache

import fitcache

HERE = Path(__file__).resolve().parent
SECTIONS = ("warm", "cold", "threads", "cluster")
WARM_MODES = ("fresh", "persistent", "batched", "run")
THREAD_READERS = ("plain", "dataset", "client")
QUICK = {"files": 1000, "workers": "1,2", "threads": "1,2", "repeats": 1, "cluster_workers": "2",
         "cluster_files": 500, "cluster_repeats": 1}
DEFAULTS = {"files": 20000, "workers": "1,2,4,8,16,32,64", "threads": "1,2,4,8,16", "repeats": 3,
            "cluster_workers": "2,8,32", "cluster_files": 10000, "cluster_repeats": None}
CLUSTER_TIMEOUT = 3600  # seconds one bench_cluster.py run may take
THREADS_TIMEOUT = 1800  # seconds the threads section's process may take per round


# ---- the machine ----

def machine():
    """What the figures depend on: core counts, CPU model, memory, versions, load."""
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "cpu_model": model or platform.processor() or "unknown",
            "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            "torch": torch.__version__, "python": platform.python_version(), "uname": " ".join(os.uname()),
            "loadavg_start": open("/proc/loadavg").read().split()[:3]}


def machine_tag(m):
    """cores<usable CPUs>-<CPU model without vendor marks, clock and "processor">: results of
    different machines go to directories of their own."""
    model = re.sub(r"\((r|tm)\)|@.*$|\bprocessor\b|\bcpu\b|\b\d+-core\b", " ", m["cpu_model"].lower())
    short = "-".join(re.findall(r"[a-z0-9]+", model))[:32].strip("-") or "unknown"
    return f"cores{m['usable_cpus']}-{short}"


def header(m):
    return (f"Machine: {m['cpu_count']} CPUs (os.cpu_count()), {m['usable_cpus']} usable (sched_getaffinity), "
            f"{m['cpu_model']}, {m['memory_gib']:.0f} GiB; torch {m['torch']}, Python {m['python']}; "
            f"load average at start {' '.join(m['loadavg_start'])}.")


# ---- samples ----

class Samples:
    """Per key ("<point>/<mode>/<reader>"), one row per round: seconds, files, CPU seconds of
    every process; ratios are taken within rounds."""

    def __init__(self):
        self.rows = {}

    def add(self, key, row):
        self.rows.setdefault(key, []).append(row)
        checkpoint()

    def summary(self, key, base=None):
        rounds = self.rows[key]
        secs = statistics.median(r["seconds"] for r in rounds)
        out = {"seconds_median": secs, "files_per_s": rounds[0]["files"] / secs,
               "cpu_us_per_file": statistics.median(r["cpu"] / r["files"] * 1e6 for r in rounds), "rounds": rounds}
        if base is not None:
            pairs = [b["seconds"] / r["seconds"] for b, r in zip(self.rows[base], rounds)]
            out.update(baseline=base, round_ratios=pairs, ratio=statistics.median(pairs))
        return out


def fold(rows, server_cpu=0.0, restarted=False):
    """One round's figure from several epochs: the median seconds, CPU per epoch (all epochs'
    CPU and server_cpu, spread over them), whether the server was replaced meanwhile."""
    return {"seconds": statistics.median(r["seconds"] for r in rows), "files": rows[0]["files"],
            "cpu": (sum(r["cpu"] for r in rows) + server_cpu) / len(rows), "epochs": rows,
            "server_restarted": restarted or any(r.get("server_restarted") for r in rows)}


class ServerCPU:
    """CPU seconds of a cache's embedded server over a span (``with``), found by the PID in its
    runtime directory at the start and again at the end: a server replaced in between (it
    exited, and a reader started another over the same tiers) is counted from the new one's
    start, and the span is marked ``restarted``. No cache: no server, 0 seconds."""

    def __init__(self, cache):
        self.cache = cache
        self.seconds, self.restarted = 0.0, False

    def __enter__(self):
        self.pid = self.cache.server_pid() if self.cache else 0
        self.start = process_cpu(self.pid) if self.pid else 0.0
        return self

    def __exit__(self, *exc):
        pid = self.cache.server_pid() if self.cache else 0
        self.restarted = pid != self.pid
        self.seconds = process_cpu(pid) - (0.0 if self.restarted else self.start) if pid else 0.0
        if self.restarted:
            log(f"the server was replaced during a measurement: PID {self.pid} before, {pid or 'none'} after")


class GCLog:
    """With --gc-log FILE: a line for every collection of Python's cyclic garbage collector in
    this process and in the DataLoader workers it forks (the callback is inherited), with the
    configuration then measured: "<workers>/<mode>/<plain|fitcache> <pid> gen<N> <µs>
    collected=<objects>". A worker forked from a large main process that runs a collection
    of the oldest generation walks every object it inherited, copying their pages
    (BENCHMARKS section 29)."""

    tag = "set-up"

    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self.started = 0
        gc.callbacks.append(self.callback)

    def callback(self, phase, info):
        if phase == "start":
            self.started = time.perf_counter_ns()
            return
        us = (time.perf_counter_ns() - self.started) / 1e3
        os.write(self.fd, f"{GCLog.tag} {os.getpid()} gen{info['generation']} {us:.0f} "
                          f"collected={info['collected']}\n".encode())


def measured(epoch, cache):
    """Runs epoch() (returning seconds and files) and adds the CPU seconds it took this process,
    its children (DataLoader workers, alive or reaped) and cache's server.

    This process's garbage is collected first, outside the measurement: whether a fresh
    worker runs a collection of the oldest generation, which walks and copies every object it
    inherits (100-400 ms each here), depends on where this process's collector stood at the
    fork, and it fell on plain's workers in one configuration and on FitCache's in the next
    (BENCHMARKS section 29): each epoch now starts from the same state."""
    gc.collect()
    cpu0 = tree_cpu(os.getpid())
    with ServerCPU(cache) as server:
        secs, files = epoch()
    return {"seconds": secs, "files": files, "cpu": tree_cpu(os.getpid()) - cpu0 + server.seconds,
            "server_restarted": server.restarted}


def in_order(pair, r):
    """The pair (plain, FitCache) in round r's order: swapped every other round."""
    return pair if r % 2 == 0 else pair[::-1]


# ---- set-up shared by the sections ----

class Bench:
    """The dataset, the /dev/shm copy, the warm cache (made once, for warm and threads) and
    what must be removed at the end."""

    def __init__(self, args, work, cleanup):
        self.args, self.work, self.cleanup = args, work, cleanup
        self.src, self.manifest, made = generate(args.data, args.files, args.seed)
        self.manifest_path = os.path.join(os.path.dirname(self.src), "manifest.json")
        self.names = [rel for rel, _, _ in self.manifest]
        self.n = len(self.names)
        self.bytes = sum(size for _, size, _ in self.manifest)
        log(f"dataset {self.src}: {self.n} files, {self.bytes / 1e9:.2f} GB ({'generated' if made else 'reused'})")
        self.shm = f"/dev/shm/fitcache-cores-{os.getpid()}-copy"
        cleanup.append(lambda: shutil.rmtree(self.shm, ignore_errors=True))
        copy_tree(self.src, self.shm, self.names)
        warm_page_cache(self.src, self.names)  # the cold baseline reads a page-cached source
        self.check = Check(self.manifest)
        self.sampler = EpochSampler(self.n, args.seed)
        self.warm_epochs = list(range(1, args.epochs + 1))
        self.warm = None  # (Cache, options with the section's job), once filled
        self.server_starts = []

    def warm_cache(self):
        """A private cache holding every file, filled by one prefetch under a job id that every
        warm reader shares (the source checks happen here, not in the timed epochs)."""
        if self.warm is None:
            cache = Cache(self.work, "warm", self.bytes, parent=self.args.tier_parent)
            self.cleanup.append(cache.wipe)
            cache.wipe()
            self.server_starts.append(cache.start(self.src))
            options = {**cache.options, "job": f"bench-cores-{os.getpid()}-warm"}
            t = time.perf_counter()
            fitcache.prefetch_files(self.src, self.names, wait=True, **options)
            stats = fitcache.server_stats(**cache.options) or {}
            cached = sum(t["files"] for t in stats.get("tiers", []))
            log(f"warm cache filled in {time.perf_counter() - t:.1f} s: {cached} of {self.n} files")
            if cached < self.n:
                raise SystemExit(f"the warm cache holds {cached} of {self.n} files")
            self.warm = (cache, options)
        return self.warm

    def epochs(self, ds, workers, cache, persistent=False, batched=False):
        """--epochs timed warm epochs of a DataLoader over ds, folded into one round's row."""
        dl = loader(ds, self.sampler, self.args, workers, persistent=persistent, batched=batched)
        if persistent:
            timed_epoch(dl, self.sampler, 0, self.check)  # starts the workers: not counted
        rows = [measured(lambda e=e: timed_epoch(dl, self.sampler, e, self.check)[:2], cache)
                for e in self.warm_epochs]
        del dl  # persistent workers exit here, before the next configuration
        return fold(rows)


# ---- sections ----

def bench_warm(b, args, runner):
    cache, options = b.warm_cache()
    fds = FitCacheCRC(fitcache.FitCacheDataset(b.src, files=b.names, **options))
    plain = PlainCRC(b.shm, names=b.names)
    shim_cache = types.SimpleNamespace(options=options, server_pid=cache.server_pid)  # what Runner needs
    before = (fitcache.server_stats(**cache.options) or {}).get("source_reads")
    s = Samples()

    def run_mode(mode, which, w):
        GCLog.tag = f"{w}/{mode}/{which}"
        if mode != "run":
            return b.epochs(plain if which == "plain" else fds, w, cache, persistent=mode == "persistent",
                            batched=mode == "batched")
        with ServerCPU(cache) as server:  # the whole reader run's: Runner's own figure misses a replaced server
            res = runner.run("plain", b.shm, b.manifest_path, b.warm_epochs, w, []) if which == "plain" else \
                runner.run("plain", b.src, b.manifest_path, b.warm_epochs, w, [], shim_cache, under_run=True)
        b.check.bad += res["bad"]
        return fold([{"seconds": e["seconds"], "files": e["files"], "cpu": e["cpu_seconds"]} for e in res["epochs"]],
                    server.seconds, server.restarted)

    for r in range(args.repeats):
        t = time.monotonic()
        for w in args.workers:
            for mode in WARM_MODES:
                for which in in_order(("plain", "fitcache"), r):
                    s.add(f"{w}/{mode}/{which}", run_mode(mode, which, w))
        log(f"[warm] round {r + 1}/{args.repeats} in {time.monotonic() - t:.0f} s; crc mismatches so far {b.check.bad}")
    after = (fitcache.server_stats(**cache.options) or {}).get("source_reads")
    try:  # why a server was replaced, if one was: its log (appended to by the next)
        with open(os.path.join(cache.run, "server.log"), errors="replace") as f:
            log_tail = f.read()[-6000:]
    except OSError:
        log_tail = None
    points = {}
    for w in args.workers:
        for mode in WARM_MODES:
            points[f"{w}/{mode}/plain"] = s.summary(f"{w}/{mode}/plain")
            points[f"{w}/{mode}/fitcache"] = s.summary(f"{w}/{mode}/fitcache", f"{w}/{mode}/plain")
    return {"points": points, "source_reads": {"after_fill": before, "after_warm": after}, "server_log_tail": log_tail}


def bench_cold(b, args):
    cache = Cache(b.work, "cold", b.bytes, parent=args.tier_parent)
    b.cleanup.append(cache.wipe)
    plain = PlainCRC(b.src, b.names)
    s = Samples()
    starts = []

    def run(which, w):
        GCLog.tag = f"{w}/cold/{which}"
        if which == "plain":
            return measured(lambda: timed_epoch(loader(plain, b.sampler, args, w), b.sampler, 0, b.check)[:2], None)
        cache.wipe()
        starts.append(cache.start(b.src))
        ds = FitCacheCRC(fitcache.FitCacheDataset(b.src, files=b.names, **cache.options))
        row = measured(lambda: timed_epoch(loader(ds, b.sampler, args, w), b.sampler, 0, b.check)[:2], cache)
        cache.wipe()
        return row

    for r in range(args.repeats):
        t = time.monotonic()
        for w in args.workers:
            for which in in_order(("plain", "fitcache"), r):
                s.add(f"{w}/cold/{which}", run(which, w))
        log(f"[cold] round {r + 1}/{args.repeats} in {time.monotonic() - t:.0f} s; crc mismatches so far {b.check.bad}")
    points = {}
    for w in args.workers:
        points[f"{w}/cold/plain"] = s.summary(f"{w}/cold/plain")
        points[f"{w}/cold/fitcache"] = s.summary(f"{w}/cold/fitcache", f"{w}/cold/plain")
    return {"points": points, "server_start_seconds": starts}


def bench_threads(b, args):
    cache, options = b.warm_cache()
    s = Samples()
    for r in range(args.repeats):
        spec = {"src": b.src, "shm": b.shm, "manifest": b.manifest_path, "threads": args.threads,
                "options": options, "seed": args.seed, "round": r}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--threads-run", json.dumps(spec)],
                             capture_output=True, text=True, timeout=THREADS_TIMEOUT)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode != 0 or not line:
            raise SystemExit(f"threads section's process failed ({out.returncode}):\n{out.stderr[-3000:]}")
        res = json.loads(line[0][len("RESULT "):])
        b.check.bad += res["bad"]
        for key, row in res["rows"].items():
            s.add(key, row)
        log(f"[threads] round {r + 1}/{args.repeats}; crc mismatches so far {b.check.bad}")
    points = {}
    for t in args.threads:
        points[f"{t}/threads/plain"] = s.summary(f"{t}/threads/plain")
        for which in THREAD_READERS[1:]:
            points[f"{t}/threads/{which}"] = s.summary(f"{t}/threads/{which}", f"{t}/threads/plain")
    return {"points": points}


def threads_run(spec):
    """The threads section's process: each thread count, each reader in turn (rotated by
    round), every file once in epoch 1's order; prints RESULT with each one's seconds and the
    CPU of this process and of the server."""
    with open(spec["manifest"]) as f:
        manifest = json.load(f)["files"]
    names = [rel for rel, _, _ in manifest]
    check = Check(manifest)
    order = EpochSampler(len(names), spec["seed"]).order(1)
    ds = fitcache.FitCacheDataset(spec["src"], files=names, prefetch=False, **spec["options"])
    client = fitcache.Client(spec["src"], **spec["options"])
    server = PrivateCache(spec["options"]["runtime_dir"], spec["options"]["tiers"], [])  # its PID; never wiped
    paths = [os.path.join(spec["src"], rel) for rel in names]

    def plain(i):
        with open(os.path.join(spec["shm"], names[i]), "rb") as f:
            return f.read()

    read = {"plain": plain, "dataset": ds.__getitem__, "client": lambda i: client.read(paths[i])}
    read["dataset"](0)  # the clients are opened (library loaded, connected) before any clock
    read["client"](0)

    def one(fn, i):
        data = fn(i)
        return zlib.crc32(data), len(data)

    rows = {}
    readers = list(THREAD_READERS)
    for t in spec["threads"]:
        k = spec["round"] % len(readers)
        for which in readers[k:] + readers[:k]:
            cpu0 = os.times()
            with ServerCPU(server) as srv:
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(t) as pool:
                    for i, (crc, size) in zip(order, pool.map(lambda i, fn=read[which]: one(fn, i), order)):
                        if crc != check.crcs[i] or size != check.sizes[i]:
                            check.bad += 1
                secs = time.perf_counter() - start
            cpu1 = os.times()
            rows[f"{t}/threads/{which}"] = {
                "seconds": secs, "files": len(order), "server_restarted": srv.restarted,
                "cpu": cpu1.user + cpu1.system - cpu0.user - cpu0.system + srv.seconds}
    client.close()
    ds.close()
    print("RESULT " + json.dumps({"rows": rows, "bad": check.bad}), flush=True)


CLUSTER_ROWS = (("fits/cold", "source/cold"), ("fits/warm-fresh", "shm/fresh"),
                ("fits/warm-persistent", "shm/persistent"), ("share/cold", "source/cold"),
                ("share/warm-fresh", "shm/fresh"), ("share/warm-persistent", "shm/persistent"))


def free_port_pair(hosts):
    """A port p free, with p + 1, on every host: bench_cluster.py's plain-TCP senders and its
    iperf3 listen there, and its default port may be taken by a run of someone else's."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for host in hosts:
                for p in (port, port + 1):
                    with socket.socket() as s:
                        s.bind((host, p))
            return port
        except OSError:
            continue
    raise SystemExit(f"no free pair of ports on {hosts}")


def bench_cluster_section(args, work):
    """bench_cluster.py per worker count, in a session of its own (a Ctrl-C here reaches it as
    one SIGTERM from this script, which it cleans up after); its rows, as it reports them."""
    points, raw = {}, {}
    for w, reads in [(w, r) for w in args.cluster_workers for r in args.cluster_reads]:
        run = f"{w}" if reads == "item" else f"{w}-{reads}"
        out = os.path.join(work, f"cluster-{run}.json")
        port = free_port_pair([f"127.0.0.{i}" for i in range(1, 6)])  # its client node and 4 server nodes
        cmd = [sys.executable, str(HERE / "bench_cluster.py"), "--variants", "loopback", "--placements", "server",
               "--link-port", str(port), "--workers", str(w), "--files", str(args.cluster_files), "--repeats", str(args.cluster_repeats),
               "--epochs", "2", "--seed", str(args.seed), "--data", args.data, "--batch-size", str(args.batch_size),
               "--out", out] + (["--batched"] if reads == "batched" else [])
        t = time.monotonic()
        with open(os.path.join(work, f"cluster-{run}.stdout"), "w") as table:
            proc = subprocess.Popen(cmd, stdout=table, start_new_session=True)
            try:
                rc = proc.wait(timeout=CLUSTER_TIMEOUT)
            finally:
                if proc.poll() is None:  # ours, by PID: stopped as it asks (SIGTERM), then killed
                    proc.terminate()
                    try:
                        proc.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=30)
        if rc not in (0, 1) or not os.path.exists(out):  # 1 with results: crc mismatches, counted below
            raise SystemExit(f"bench_cluster.py --workers {w} ({reads}) failed ({rc}): see its messages above")
        with open(out) as f:
            res = json.load(f)
        v = res["variants"]["loopback"]
        raw[run] = {"configs": v["configs"], "crc_mismatches": v["crc_mismatches"], "dataset": res["dataset"],
                       "seconds": res["seconds"]}
        c = v["configs"]
        for what, base in CLUSTER_ROWS:
            x, y = c[f"server/{what}"], c[f"server/{base}"]
            points[f"{run}/{what}"] = {
                "baseline": base, "files_per_s": x["files_per_s"], "ratio": y["seconds_median"] / x["seconds_median"],
                "cpu_us_per_file": x.get("server_cpu_us_per_file", 0) + x.get("client_cpu_us_per_file", 0),
                "server_cpu_us_per_file": x.get("server_cpu_us_per_file", 0),
                "baseline_files_per_s": y["files_per_s"],
                "baseline_cpu_us_per_file": y.get("server_cpu_us_per_file", 0) + y.get("client_cpu_us_per_file", 0)}
        log(f"[cluster] {w} workers, {reads} reads, in {time.monotonic() - t:.0f} s, crc mismatches {v['crc_mismatches']}")
    return {"points": points, "runs": raw, "crc_mismatches": sum(x["crc_mismatches"] for x in raw.values())}


# ---- output ----

WARM_LABELS = {"fresh": "fresh workers", "persistent": "persistent workers", "batched": "__getitems__ per batch",
               "run": "`fitcache run`, plain reader"}


def markdown(results, args):
    m, secs = results["machine"], results["sections"]
    head = header(m)
    lines = []
    d = results["dataset"]
    about = (f"{d['files']} files, {d['bytes'] / 1e9:.2f} GB; batch {args.batch_size}; medians over "
             f"{args.repeats} rounds; vs plain: the median over rounds of plain's seconds / FitCache's in the same "
             f"round; CPU: every process (reader, workers, server) per file.")
    if args.tier_parent != "/dev/shm":
        about += f" FitCache's memory tier on {args.tier_parent} ({tmpfs_options(args.tier_parent)})."

    def pair_row(first, p, f):
        return (f"| {first} | {p['files_per_s']:.0f} | {f['files_per_s']:.0f} | {f['ratio']:.2f}x | "
                f"{p['cpu_us_per_file']:.0f} | {f['cpu_us_per_file']:.0f} |")

    if "warm" in secs:
        pts = secs["warm"]["points"]
        lines += ["### Warm epochs: plain /dev/shm copy against FitCache's warm cache", "", head, about, "",
                  "| workers | mode | plain files/s | FitCache files/s | vs plain | CPU µs/file plain | FitCache |",
                  "|---|---|---|---|---|---|---|"]
        for w in args.workers:
            for mode in WARM_MODES:
                lines.append(pair_row(f"{w} | {WARM_LABELS[mode]}", pts[f"{w}/{mode}/plain"], pts[f"{w}/{mode}/fitcache"]))
        reads = secs["warm"]["source_reads"]
        lines += ["", f"Server source reads: {reads['after_fill']} after the fill, {reads['after_warm']} after the warm "
                  f"epochs (a replaced server counts from 0).", ""]
    if "cold" in secs:
        pts = secs["cold"]["points"]
        lines += ["### First epoch: plain reads of the page-cached source against FitCache from empty tiers", "",
                  head, about + " A fresh server and empty tiers for every FitCache epoch.", "",
                  "| workers | plain files/s | FitCache files/s | vs plain | CPU µs/file plain | FitCache |",
                  "|---|---|---|---|---|---|"]
        for w in args.workers:
            lines.append(pair_row(str(w), pts[f"{w}/cold/plain"], pts[f"{w}/cold/fitcache"]))
        starts = secs["cold"]["server_start_seconds"]
        lines += ["", f"Server start (not in the epochs), median: {statistics.median(starts) * 1e3:.0f} ms.", ""]
    if "threads" in secs:
        pts = secs["threads"]["points"]
        lines += ["### Threads of one process, each warm file once", "", head, about, "",
                  "| threads | plain files/s | FitCacheDataset files/s | vs plain | Client.read files/s | vs plain | "
                  "CPU µs/file plain / dataset / client |", "|---|---|---|---|---|---|---|"]
        for t in args.threads:
            p, ds, c = (pts[f"{t}/threads/{x}"] for x in THREAD_READERS)
            lines.append(f"| {t} | {p['files_per_s']:.0f} | {ds['files_per_s']:.0f} | {ds['ratio']:.2f}x | "
                         f"{c['files_per_s']:.0f} | {c['ratio']:.2f}x | {p['cpu_us_per_file']:.0f} / "
                         f"{ds['cpu_us_per_file']:.0f} / {c['cpu_us_per_file']:.0f} |")
        lines.append("")
    if "cluster" in secs:
        pts = secs["cluster"]["points"]
        lines += ["### Cluster: 4 servers on loopback, the reader on server 1's node (bench_cluster.py)", "", head,
                  f"{args.cluster_files} files; {args.cluster_repeats} rounds; one cold and one warm epoch per job; "
                  f"ratios of medians against the plain configuration of the same run; CPU µs per file of the "
                  f"servers + the reader and its workers; crc mismatches: {secs['cluster']['crc_mismatches']}.", "",
                  "| workers | reads | configuration | files/s | vs plain | plain | CPU µs/file servers + reader | plain |",
                  "|---|---|---|---|---|---|---|---|"]
        for w, reads in [(w, r) for w in args.cluster_workers for r in args.cluster_reads]:
            run = f"{w}" if reads == "item" else f"{w}-{reads}"
            for what, base in CLUSTER_ROWS:
                x = pts[f"{run}/{what}"]
                lines.append(f"| {w} | {reads} | {what} | {x['files_per_s']:.0f} | {x['ratio']:.2f}x | {base} | "
                             f"{x['server_cpu_us_per_file']:.0f} + {x['cpu_us_per_file'] - x['server_cpu_us_per_file']:.0f}"
                             f" | {x['baseline_cpu_us_per_file']:.0f} |")
        lines.append("")
    replaced = sum(r.get("server_restarted", False) for sec in secs.values() for p in sec["points"].values()
                   for r in p.get("rounds", []))
    lines.append(f"crc mismatches: {results['crc_mismatches']}; measurements during which the embedded server "
                 f"was replaced (its CPU counted from the new one's start): {replaced}.")
    return "\n".join(lines) + "\n"


# ---- main ----

def tmpfs_options(path):
    """The mount options of the file system that holds path, from /proc/self/mounts."""
    best, opts = "", "?"
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            _, where, _, options = line.split()[:4]
            if (real == where or real.startswith(where.rstrip("/") + "/")) and len(where) > len(best):
                best, opts = where, options
    return opts


def counts(text):
    return [int(x) for x in text.split(",") if x]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS), help="warm, cold, threads, cluster (comma-separated)")
    ap.add_argument("--files", type=int, help=f"files in the dataset (default {DEFAULTS['files']})")
    ap.add_argument("--workers", help=f"DataLoader worker counts (default {DEFAULTS['workers']})")
    ap.add_argument("--threads", help=f"thread counts (default {DEFAULTS['threads']})")
    ap.add_argument("--repeats", type=int, help=f"rounds (default {DEFAULTS['repeats']}); figures are medians")
    ap.add_argument("--epochs", type=int, default=1, help="timed warm epochs per configuration and round")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--cluster-workers", help=f"worker counts of the cluster section (default {DEFAULTS['cluster_workers']})")
    ap.add_argument("--cluster-files", type=int, help=f"files of the cluster section (default {DEFAULTS['cluster_files']})")
    ap.add_argument("--cluster-repeats", type=int, help="rounds of the cluster section (default --repeats)")
    ap.add_argument("--cluster-reads", default="item,batched",
                    help="how the cluster section's readers read: item (item by item), batched (__getitems__)")
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-scale", help="where generated datasets are kept")
    ap.add_argument("--tier-parent", default="/dev/shm",
                    help="the tmpfs where the memory tiers of the warm and cold sections are made (the plain copy stays on /dev/shm)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the dataset and of the epochs' orders")
    ap.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--out", help="JSON results (default bench/results/<machine tag>/cores-<date>.json)")
    ap.add_argument("--gc-log", help="append every collection of Python's garbage collector in this process and the "
                    "DataLoader workers it forks to this file, with the configuration measured (see GCLog)")
    ap.add_argument("--threads-run", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads_run:
        return args
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.cluster_repeats is None:
        args.cluster_repeats = args.repeats
    args.sections = [x for x in args.sections.split(",") if x]
    if set(args.sections) - set(SECTIONS) or args.epochs < 1 or args.repeats < 1:
        ap.error(f"--sections takes {', '.join(SECTIONS)}; --epochs and --repeats at least 1")
    args.workers, args.threads = counts(args.workers), counts(args.threads)
    args.cluster_workers = counts(args.cluster_workers)
    args.cluster_reads = [x for x in args.cluster_reads.split(",") if x]
    if set(args.cluster_reads) - {"item", "batched"}:
        ap.error("--cluster-reads takes item, batched")
    return args


def clean_up(fns):
    """Runs every clean-up function, the newest first; one that fails leaves the rest to run."""
    for fn in reversed(fns):
        try:
            fn()
        except Exception as err:
            log(f"cleanup: {err}")


def main():
    args = parse_args()
    if args.threads_run:
        return threads_run(json.loads(args.threads_run))
    # More workers than cores is what the sweep measures: torch's warning about it, once per
    # DataLoader, would bury the progress lines.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    if args.gc_log:
        GCLog(args.gc_log)
    m = machine()
    out = args.out or str(HERE / "results" / machine_tag(m) / f"cores-{datetime.date.today()}.json")
    # Ctrl-C too sets the flag that checkpoint() tests between batches: a KeyboardInterrupt that
    # lands in a destructor (a DataLoader's, shutting its workers down) is dropped by Python.
    signal.signal(signal.SIGTERM, bench_scale._stop)
    signal.signal(signal.SIGINT, bench_scale._stop)
    work = f"/tmp/fitcache-cores-{os.getpid()}"
    os.makedirs(work)
    cleanup = [lambda: shutil.rmtree(work, ignore_errors=True)]
    runner = Runner(work, types.SimpleNamespace(seed=args.seed, batch_size=args.batch_size, run_prefetch=None))
    t0 = time.monotonic()
    results = {"machine": m, "machine_tag": machine_tag(m), "fitcache": os.path.dirname(fitcache.__file__),
               "args": {k: v for k, v in vars(args).items() if k != "threads_run"}, "sections": {}}
    try:
        local = [x for x in args.sections if x != "cluster"]
        if local:
            b = Bench(args, work, cleanup)
            results["dataset"] = {"dir": b.src, "files": b.n, "bytes": b.bytes}
            for name in local:
                t = time.monotonic()
                results["sections"][name] = bench_warm(b, args, runner) if name == "warm" else \
                    bench_cold(b, args) if name == "cold" else bench_threads(b, args)
                results["sections"][name]["seconds"] = time.monotonic() - t
            results["warm_server_start_seconds"] = b.server_starts
            results["crc_mismatches"] = b.check.bad
        else:
            results["dataset"] = {"dir": None, "files": args.cluster_files, "bytes": 0}
            results["crc_mismatches"] = 0
        if "cluster" in args.sections:
            t = time.monotonic()
            results["sections"]["cluster"] = bench_cluster_section(args, work)
            results["sections"]["cluster"]["seconds"] = time.monotonic() - t
            results["crc_mismatches"] += results["sections"]["cluster"]["crc_mismatches"]
        results["main_process_loaded_libfitcache"] = fitcache._native.loaded_here()
    finally:
        runner.kill()
        clean_up(cleanup)
    results["machine"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    results["seconds"] = time.monotonic() - t0
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return bench_scale.write_results(results, markdown(results, args), out)


if __name__ == "__main__":
    sys.exit(main())
