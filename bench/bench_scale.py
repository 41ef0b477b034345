#!/usr/bin/env python3
"""FitCache at ImageNet scale, as users run it: a DataLoader over tens of thousands of files,
more than a worker keeps mappings for, in one run against plain reads measured alongside.

The dataset is generated once and kept under --data (default /var/tmp/fitcache-bench-scale),
in a directory named by a stamp of its parameters: --files files (default 30,000) of random
(incompressible) bytes in min(1000, files/30) class directories, lognormal sizes with a median
of 105 KiB and sigma 0.3 (mean about 110 KB, 3.4 GB at 30,000 files; a lognormal's mean exceeds
its median, so "median 110 KiB" and "3.3 GB" cannot both hold), from a fixed seed. A manifest
beside it holds each file's size and crc32.

Every configuration goes through a torch DataLoader (--workers, default 2; --batch-size,
default 64) over the same shuffled orders (epoch e is shuffled with seed --seed + e, the same
for every configuration). Each item is consumed in the worker (zlib.crc32 of its bytes); the
collate function returns only indices, crcs and sizes, which the main process checks against
the manifest. Configurations, interleaved within each of --repeats rounds:

  source                    plain reads of the source directory (page cache warm), epoch 0:
                            the baseline for cold epochs
  shm                       plain reads of a /dev/shm copy, epochs 1..E-1, fresh workers: the
                            limit, the baseline for warm epochs
  fitcache-cold             FitCacheDataset over the source with empty private tiers (a memory
                            tier under /dev/shm sized to hold the dataset, no disk tier), epoch 0;
                            the embedded server is started first and its start timed apart
  fitcache-warm-fresh       epochs 1..E-1, fresh workers each epoch (the DataLoader default)
  fitcache-warm-persistent  persistent_workers=True: one untimed epoch starts the workers, then
                            epochs 1..E-1
  shm-one-process           one fresh process, num_workers=0, each file of the /dev/shm copy
                            read once (epoch 1's order): the baseline of the next line
  shm-batched               plain /dev/shm reads, each worker's item a whole batch (a
                            BatchSampler), as PyTorch 2's DataLoader fetches with __getitems__
  fitcache-warm-batched     the same over FitCache: one __getitems__ (fc_read_many) per batch
  fitcache-next-run         a new FitCacheDataset over the warm cache (a new job: the next
                            training run), its first epoch, fresh workers: every cached copy is
                            checked against its source once (a stat), ahead of the readers by
                            the job's prefetch; the source checks it made are recorded
  fitcache-one-process      one fresh process, num_workers=0, each file of the warm cache read
                            once (the client is opened before the clock starts, timed apart)
  fitcache-half-budget      a memory tier of half what the dataset takes in a tier, --epochs
                            epochs from empty, fresh workers; the median of epochs 1..E-1 against
                            the source baseline, with source opens per epoch (inotify)

Epoch figures are medians over a round's epochs, then medians over rounds; ratios divide the
baseline's median time by the configuration's. Source opens during the FitCache
configurations are counted with inotify on the source directory (from outside the library).

With --pfs DIR, a second section measures the first epoch over a slow file system mounted
there (bench/slowfs, or your cluster's parallel file system: see bench/README.md; this
script never brings one up). --pfs-files (default 2,000) files of the same kind are
generated under DIR, then, per round:

  pfs-plain                 plain reads, DataLoader with --pfs-workers (default 4) workers
  pfs-threads               plain reads with --pfs-threads (default 16) threads, each file once:
                            the file system's own limit
  fitcache-pfs-cold         FitCacheDataset cold over DIR, --pfs-workers workers

Source opens are counted with inotify on DIR (on the FUSE mount: every open made on this node)
and, with --bricks BRICK[,BRICK...], on the dataset's directory inside each brick (the
GlusterFS client absorbs some opens, so bricks may undercount).
--drop-caches (root) drops the page cache before each PFS configuration, which also empties
the emulated servers' caches.

Everything the run makes in /dev/shm and its runtime directories are removed at the end, also
on Ctrl-C or SIGTERM, and only the embedded servers it started are stopped (by the PID in its
own runtime directory's server.lock). Prints a Markdown table and writes JSON to --out
(default bench/results/scale-<date>.json).

    python bench/bench_scale.py                                    # 30,000 files, 3 rounds
    python bench/bench_scale.py --files 3000 --repeats 1 --out /tmp/scale.json
    python bench/bench_scale.py --pfs /mnt/pfs/fitcache-scale --drop-caches   # PFS up first
"""

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

import fitcache
from privatecache import PrivateCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from inotify import OpenCounter  # noqa: E402

MEDIAN_SIZE = 105 << 10
SIGMA = 0.3
MIN_SIZE, MAX_SIZE = 4 << 10, 4 << 20
GENERATOR_VERSION = 1  # bump when the generator changes: the stamp changes with it


_stopping = False  # set by SIGTERM; checked between batches in case the exception was swallowed


def _stop(signum, frame):
    global _stopping
    _stopping = True
    raise KeyboardInterrupt


def checkpoint():
    if _stopping:
        raise KeyboardInterrupt


# ---- the dataset ----

def dataset_spec(files, seed):
    return {"version": GENERATOR_VERSION, "files": files, "classes": max(1, min(1000, files // 30)),
            "seed": seed, "median": MEDIAN_SIZE, "sigma": SIGMA, "min": MIN_SIZE, "max": MAX_SIZE}


def generate(data, files, seed):
    """The dataset for these parameters under data (generated unless a complete one is there):
    its source directory and its manifest (a list of [relative path, size, crc32])."""
    spec = dataset_spec(files, seed)
    stamp = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    top = os.path.join(data, f"imagenet-like-{files}-{stamp}")
    src, manifest_path = os.path.join(top, "train"), os.path.join(top, "manifest.json")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest["spec"] == spec and all(
                os.path.getsize(os.path.join(src, rel)) == size for rel, size, _ in manifest["files"]):
            return src, manifest["files"], False
    except (OSError, ValueError, KeyError):
        pass
    rng = random.Random(seed)
    mu = math.log(MEDIAN_SIZE)
    sizes = [min(MAX_SIZE, max(MIN_SIZE, int(rng.lognormvariate(mu, SIGMA)))) for _ in range(files)]
    entries = []
    t = time.perf_counter()
    for i, size in enumerate(sizes):
        cls = i % spec["classes"]
        rel = f"n{cls:08d}/n{cls:08d}_{i:07d}.bin"
        path = os.path.join(src, rel)
        data_bytes = random.Random(seed * 1_000_003 + i).randbytes(size)
        if not (os.path.exists(path) and os.path.getsize(path) == size):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                f.write(data_bytes)
            os.rename(path + ".tmp", path)
        entries.append([rel, size, zlib.crc32(data_bytes)])
        if (i + 1) % 5000 == 0:
            log(f"generated {i + 1}/{files} files ({time.perf_counter() - t:.0f} s)")
    entries.sort()
    with open(manifest_path + ".tmp", "w") as f:
        json.dump({"spec": spec, "stamp": stamp, "files": entries}, f)
    os.rename(manifest_path + ".tmp", manifest_path)
    return src, entries, True


# ---- what the workers run ----

class PlainCRC(Dataset):
    """Plain open().read() of root/names[i]; yields (i, crc32, size)."""

    def __init__(self, root, names):
        self.root, self.names = root, names

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        with open(os.path.join(self.root, self.names[i]), "rb") as f:
            data = f.read()
        return i, zlib.crc32(data), len(data)


def crc_and_size(view):
    """A FitCacheDataset transform: what the bench keeps of an item (the view is dropped)."""
    return zlib.crc32(view), len(view)


class FitCacheCRC(Dataset):
    """FitCacheDataset items; yields (i, crc32, size). The crc is taken by the dataset's
    transform, as users give it their decoder: __getitems__ then reads and transforms a batch a
    chunk at a time, while the bytes are still in the CPU's caches (a dataset made with
    another transform is an error)."""

    def __init__(self, ds):
        if ds.transform not in (None, crc_and_size):
            raise ValueError("FitCacheCRC needs a FitCacheDataset without a transform")
        ds.transform = crc_and_size
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return (i, *self.ds[i])


class Batched(Dataset):
    """Item b is a whole batch (a list of indices from a BatchSampler), read with the wrapped
    dataset's __getitems__ when it has one: what PyTorch 2's DataLoader does for each batch
    (1.13 reads item by item), here with any version."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, indices):
        if isinstance(self.inner, FitCacheCRC):
            return [(i, *r) for i, r in zip(indices, self.inner.ds.__getitems__(indices))]
        return [self.inner[i] for i in indices]


def collate(batch):
    """Only indices, crcs and sizes go through the worker queue."""
    return tuple(zip(*batch))


class EpochSampler(Sampler):
    """A shuffled order per epoch, from seed + epoch: the same orders for every configuration.
    It runs in the main process, so set_epoch works with persistent workers too."""

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def order(self, epoch):
        order = list(range(self.n))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def __iter__(self):
        return iter(self.order(self.epoch))

    def __len__(self):
        return self.n


def loader(ds, sampler, args, workers, persistent=False, batched=False):
    if batched:
        return DataLoader(Batched(ds), batch_size=None, sampler=BatchSampler(sampler, args.batch_size, False),
                          collate_fn=collate, num_workers=workers, persistent_workers=persistent and workers > 0,
                          multiprocessing_context="fork" if workers > 0 else None)
    return DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                      num_workers=workers, persistent_workers=persistent and workers > 0,
                      multiprocessing_context="fork" if workers > 0 else None)


class Check:
    """Checks every item against the manifest: each index once per epoch (each index of part,
    when given: one reader's share), its crc and size."""

    def __init__(self, manifest):
        self.crcs = [crc for _, _, crc in manifest]
        self.sizes = [size for _, size, _ in manifest]
        self.bad = 0

    def epoch(self, batches, on_batch=None, part=None):
        seen = bytearray(len(self.crcs))
        files = nbytes = 0
        for idx, crcs, sizes in batches:
            for i, c, s in zip(idx, crcs, sizes):
                if c != self.crcs[i] or s != self.sizes[i] or seen[i]:
                    self.bad += 1
                seen[i] = 1
            files += len(idx)
            nbytes += sum(sizes)
            if on_batch is not None:
                on_batch()
            checkpoint()
        if part is None:
            self.bad += len(self.crcs) - sum(seen)
        else:  # every index of part seen, and none other
            missing = sum(1 for i in part if not seen[i])
            self.bad += missing + sum(seen) - (len(part) - missing)
        return files, nbytes


def timed_epoch(dl, sampler, epoch, check, on_batch=None):
    checkpoint()
    sampler.set_epoch(epoch)
    t = time.perf_counter()
    files, nbytes = check.epoch(dl, on_batch)
    return time.perf_counter() - t, files, nbytes


# ---- FitCache set-up ----

class Cache(PrivateCache):
    """A private runtime directory and memory tier sized to hold the dataset, with the
    server started apart from the timed epochs."""

    def __init__(self, work, name, budget_bytes, exact=False, parent="/dev/shm"):
        tier = os.path.join(parent, f"fitcache-scale-{os.getpid()}-{name}")
        budget_mib = int(budget_bytes / 2**20) if exact else int(budget_bytes * 1.1 / 2**20) + 64
        super().__init__(os.path.join(work, name, "run"), f"memory:{tier}:{budget_mib}MiB", [tier])
        self.tier = tier

    def start(self, root):
        """Starts the embedded server from a separate process (this one must not load the
        library before the DataLoader forks) and returns the seconds it took."""
        code = ("import json, sys, fitcache\n"
                "c = fitcache._native.Client(sys.argv[1], **json.loads(sys.argv[2]))\n"
                "c.stats()\nc.close()\n")
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code, root, json.dumps(self.options)], check=True, timeout=120)
        return time.perf_counter() - t

    def source_reads(self):
        stats = fitcache.dataset.server_stats(**self.options)
        return None if stats is None else stats.get("source_reads")


# ---- one configuration in a fresh process ----

def run_one(spec, args):
    """Reads each file once with num_workers=0 in this (fresh) process and prints RESULT."""
    with open(spec["manifest"]) as f:
        manifest = json.load(f)["files"]
    names = [rel for rel, _, _ in manifest]
    out = {}
    if spec["kind"] == "fitcache":
        fds = fitcache.FitCacheDataset(spec["root"], files=names, **spec["options"])
        t = time.perf_counter()
        fds._get_client()  # loads the library and connects: timed apart
        out["open_seconds"] = time.perf_counter() - t
        ds = FitCacheCRC(fds)
    else:
        ds = PlainCRC(spec["root"], names)
    sampler = EpochSampler(len(names), args.seed)
    check = Check(manifest)
    secs, files, nbytes = timed_epoch(loader(ds, sampler, args, 0), sampler, spec["epoch"], check)
    out.update(seconds=secs, files=files, bytes=nbytes, bad=check.bad)
    print("RESULT " + json.dumps(out), flush=True)


def fresh_process(kind, root, manifest_path, options, epoch, args):
    checkpoint()
    spec = {"kind": kind, "root": root, "manifest": manifest_path, "options": options, "epoch": epoch}
    cmd = [sys.executable, os.path.abspath(__file__), "--run-one", json.dumps(spec),
           "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        raise SystemExit(f"{kind} one-process run failed:\n{out.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT "):])


# ---- the run ----

def log(msg):
    print(msg, file=sys.stderr, flush=True)


def summarize(samples, files, nbytes):
    secs = statistics.median(samples)
    return {"seconds_median": secs, "seconds": samples, "files_per_s": files / secs, "MB_per_s": nbytes / secs / 1e6}


def copy_tree(src, dst, names):
    for rel in names:
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copyfile(os.path.join(src, rel), os.path.join(dst, rel))


def read_with_threads(src, entries, threads):
    """Reads each file of entries ([relative path, size, crc32], in their order) under src
    once, whole, with threads readers, as the file system's own limit is measured; returns
    (seconds, bytes read, files whose bytes did not match)."""
    def one(entry):
        rel, size, crc = entry
        with open(os.path.join(src, rel), "rb") as f:
            data = f.read()
        return len(data), (len(data), zlib.crc32(data)) != (size, crc)

    start, nbytes, bad = time.perf_counter(), 0, 0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for n, wrong in pool.map(one, entries, chunksize=16):
            nbytes += n
            bad += wrong
    return time.perf_counter() - start, nbytes, bad


def warm_page_cache(src, names):
    for rel in names:
        with open(os.path.join(src, rel), "rb") as f:
            while f.read(1 << 20):
                pass


def drop_caches():
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def bench_local(args, work, cleanup):
    src, manifest, made = generate(args.data, args.files, args.seed)
    manifest_path = os.path.join(os.path.dirname(src), "manifest.json")
    names = [rel for rel, _, _ in manifest]
    total = sum(size for _, size, _ in manifest)
    n = len(names)
    log(f"dataset {src}: {n} files, {total / 1e9:.2f} GB, median "
        f"{statistics.median(s for _, s, _ in manifest) / 1024:.0f} KiB ({'generated' if made else 'reused'})")
    shm = f"/dev/shm/fitcache-scale-{os.getpid()}-copy"
    cleanup.append(lambda: shutil.rmtree(shm, ignore_errors=True))
    copy_tree(src, shm, names)
    warm_page_cache(src, names)  # "page cache warm" for the source baseline

    check = Check(manifest)
    sampler = EpochSampler(n, args.seed)
    warm_epochs = list(range(1, args.epochs))
    cache = Cache(work, "local", total)
    cleanup.append(cache.wipe)
    plain_src, plain_shm = PlainCRC(src, names), PlainCRC(shm, names)
    times = {k: [] for k in ("source", "shm", "fitcache-cold", "fitcache-warm-fresh",
                              "fitcache-warm-persistent", "shm-batched", "fitcache-warm-batched",
                              "fitcache-next-run", "shm-one-process", "fitcache-one-process", "fitcache-half-budget")}
    extra = {"server_start_seconds": [], "client_open_seconds": [], "source_reads_cold": [],
             "source_reads_after_warm": [], "source_opens": [], "half_budget_epochs": [],
             "next_run_source_checks": []}
    # What the dataset takes in a tier (data and record, each in 4 KiB blocks): half of it
    # is the budget of the half-budget configuration.
    footprint = sum(-(-size // 4096) * 4096 + 4096 for _, size, _ in manifest)
    half = Cache(work, "half", footprint // 2, exact=True)
    cleanup.append(half.wipe)
    for r in range(args.repeats):
        times["source"].append(timed_epoch(loader(plain_src, sampler, args, args.workers), sampler, 0, check)[0])
        dl = loader(plain_shm, sampler, args, args.workers)
        times["shm"].append(statistics.median(timed_epoch(dl, sampler, e, check)[0] for e in warm_epochs))
        del dl

        cache.wipe()
        extra["server_start_seconds"].append(cache.start(src))
        fds = FitCacheCRC(fitcache.FitCacheDataset(src, files=names, **cache.options))
        with OpenCounter(src) as opens:
            drain = opens.counts  # drained every batch: the inotify queue holds 16,384 events
            dl = loader(fds, sampler, args, args.workers)
            times["fitcache-cold"].append(timed_epoch(dl, sampler, 0, check, drain)[0])
            cold_opens = sum(opens.counts().values())
            extra["source_reads_cold"].append(cache.source_reads())
            times["fitcache-warm-fresh"].append(
                statistics.median(timed_epoch(dl, sampler, e, check, drain)[0] for e in warm_epochs))
            del dl
            dl = loader(fds, sampler, args, args.workers, persistent=True)
            timed_epoch(dl, sampler, 0, check, drain)  # starts the workers: not counted
            times["fitcache-warm-persistent"].append(
                statistics.median(timed_epoch(dl, sampler, e, check, drain)[0] for e in warm_epochs))
            del dl
            dl = loader(plain_shm, sampler, args, args.workers, batched=True)
            times["shm-batched"].append(statistics.median(timed_epoch(dl, sampler, e, check)[0] for e in warm_epochs))
            dl = loader(fds, sampler, args, args.workers, batched=True)
            times["fitcache-warm-batched"].append(
                statistics.median(timed_epoch(dl, sampler, e, check, drain)[0] for e in warm_epochs))
            del dl
            checks = fitcache.dataset.server_stats(**cache.options).get("source_checks", 0)
            next_run = FitCacheCRC(fitcache.FitCacheDataset(src, files=names, **cache.options))
            dl = loader(next_run, sampler, args, args.workers)
            times["fitcache-next-run"].append(timed_epoch(dl, sampler, 1, check, drain)[0])
            del dl, next_run
            extra["next_run_source_checks"].append(
                fitcache.dataset.server_stats(**cache.options).get("source_checks", 0) - checks)
            one = fresh_process("shm", shm, manifest_path, {}, 1, args)
            times["shm-one-process"].append(one["seconds"])
            check.bad += one["bad"]
            one = fresh_process("fitcache", src, manifest_path, cache.options, 1, args)
            times["fitcache-one-process"].append(one["seconds"])
            extra["client_open_seconds"].append(one["open_seconds"])
            check.bad += one["bad"]
            warm_opens = sum(opens.counts().values()) - cold_opens
        extra["source_reads_after_warm"].append(cache.source_reads())
        extra["source_opens"].append({"cold": cold_opens, "warm": warm_opens})
        cache.wipe()

        # A dataset twice the cache: every epoch, fresh workers, source opens per epoch.
        half.wipe()
        half.start(src)
        hds = FitCacheCRC(fitcache.FitCacheDataset(src, files=names, **half.options))
        epochs = []
        with OpenCounter(src) as opens:
            dl = loader(hds, sampler, args, args.workers)
            seen = 0
            for e in range(args.epochs):
                secs = timed_epoch(dl, sampler, e, check, opens.counts)[0]
                total_opens = sum(opens.counts().values())
                epochs.append({"epoch": e, "seconds": secs, "source_opens": total_opens - seen})
                seen = total_opens
            del dl
        stats = fitcache.dataset.server_stats(**half.options)
        extra["half_budget_epochs"].append({"epochs": epochs, "tier_files": sum(t["files"] for t in stats["tiers"]),
                                            "evictions": stats["evictions"]})
        times["fitcache-half-budget"].append(statistics.median(x["seconds"] for x in epochs[1:]))
        half.wipe()
        log(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items())
            + f"; source opens cold {cold_opens}, warm {warm_opens}; crc mismatches so far {check.bad}")
    cache.wipe()
    shutil.rmtree(shm, ignore_errors=True)

    res = {k: summarize(v, n, total) for k, v in times.items()}
    baseline = {"source": None, "shm": None, "fitcache-cold": "source", "fitcache-warm-fresh": "shm",
                "fitcache-warm-persistent": "shm", "shm-one-process": None,
                "fitcache-one-process": "shm-one-process", "fitcache-half-budget": "source",
                "shm-batched": "shm", "fitcache-warm-batched": "shm", "fitcache-next-run": "shm"}
    for k, b in baseline.items():
        res[k]["baseline"] = b
        res[k]["ratio"] = res[b]["seconds_median"] / res[k]["seconds_median"] if b else 1.0
    res["fitcache-one-process"]["ratio_vs_shm_loader"] = res["shm"]["seconds_median"] / res["fitcache-one-process"]["seconds_median"]
    return {"dataset": {"dir": src, "files": n, "bytes": total, "classes": dataset_spec(args.files, args.seed)["classes"],
                        "median_size": statistics.median(s for _, s, _ in manifest)},
            "configs": res, **extra, "crc_mismatches": check.bad}


def bench_pfs(args, work, cleanup):
    src, manifest, made = generate(args.pfs, args.pfs_files, args.seed)
    names = [rel for rel, _, _ in manifest]
    total = sum(size for _, size, _ in manifest)
    n = len(names)
    log(f"PFS dataset {src}: {n} files, {total / 1e9:.2f} GB ({'generated' if made else 'reused'})")
    check = Check(manifest)
    sampler = EpochSampler(n, args.seed)
    cache = Cache(work, "pfs", total)
    cleanup.append(cache.wipe)
    watch = [src] + [brick_dir(b, src) for b in args.bricks.split(",") if b] if args.bricks else [src]
    order = [names[i] for i in sampler.order(0)]

    by_name = {entry[0]: entry for entry in manifest}

    def threads_epoch():
        secs, _, bad = read_with_threads(src, [by_name[rel] for rel in order], args.pfs_threads)
        check.bad += bad
        return secs

    times = {k: [] for k in ("pfs-plain", "pfs-threads", "fitcache-pfs-cold")}
    opens = {k: [] for k in times}
    server_start = []
    for r in range(args.repeats):
        for config in times:
            if args.drop_caches:
                drop_caches()
            if config == "fitcache-pfs-cold":
                cache.wipe()
                server_start.append(cache.start(src))
            counters = [OpenCounter(d) for d in watch]
            try:
                drain = lambda: [c.counts() for c in counters]  # noqa: E731
                if config == "pfs-threads":
                    secs = threads_epoch()
                else:
                    ds = PlainCRC(src, names) if config == "pfs-plain" else \
                        FitCacheCRC(fitcache.FitCacheDataset(src, files=names, **cache.options))
                    secs = timed_epoch(loader(ds, sampler, args, args.pfs_workers), sampler, 0, check, drain)[0]
                counts = [sum(c.counts().values()) for c in counters]
            finally:
                for c in counters:
                    c.close()
            times[config].append(secs)
            opens[config].append(dict(zip(["mount"] + [f"brick{i}" for i in range(len(watch) - 1)], counts)))
            log(f"[pfs] round {r + 1}/{args.repeats} {config}: {secs:.2f}s, opens {opens[config][-1]}")
    cache.wipe()
    res = {k: summarize(v, n, total) for k, v in times.items()}
    for k in res:
        res[k]["ratio_vs_threads"] = res["pfs-threads"]["seconds_median"] / res[k]["seconds_median"]
        res[k]["ratio_vs_plain"] = res["pfs-plain"]["seconds_median"] / res[k]["seconds_median"]
        res[k]["source_opens"] = opens[k]
    return {"dataset": {"dir": src, "files": n, "bytes": total}, "configs": res,
            "server_start_seconds": server_start, "crc_mismatches": check.bad,
            "drop_caches": args.drop_caches}


def brick_dir(brick, src):
    """The directory inside a brick that holds src (its path below the mount point)."""
    mount = os.path.abspath(src)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    return os.path.join(brick, os.path.relpath(os.path.abspath(src), mount))


def markdown(results, args):
    loc = results.get("local")
    lines = []
    if loc:
        d = loc["dataset"]
        lines += [f"{d['files']} files in {d['classes']} classes, {d['bytes'] / 1e9:.2f} GB, median "
                  f"{d['median_size'] / 1024:.0f} KiB; {args.workers} workers, batch {args.batch_size}, "
                  f"{args.epochs} epochs (1 cold + {args.epochs - 1} warm), medians over {args.repeats} rounds; "
                  f"crc mismatches: {loc['crc_mismatches']}.", "",
                  "| configuration | workers | median s | files/s | MB/s | vs baseline |",
                  "|---|---|---|---|---|---|"]
        for k, v in loc["configs"].items():
            w = "1 process" if k.endswith("one-process") else f"{args.workers}" + (", persistent" if "persistent" in k else "")
            ratio = f"{v['ratio']:.2f}x {v['baseline']}" if v["baseline"] else "1.00 (baseline)"
            if k == "fitcache-one-process":
                ratio += f" ({v['ratio_vs_shm_loader']:.2f}x shm)"
            lines.append(f"| {k} | {w} | {v['seconds_median']:.3f} | {v['files_per_s']:.0f} | "
                         f"{v['MB_per_s']:.0f} | {ratio} |")
        lines += ["", f"Embedded server start from a fresh Python process (interpreter, imports of fitcache "
                  f"and torch, server start; median, not in the cold epoch): "
                  f"{statistics.median(loc['server_start_seconds']) * 1e3:.0f} ms; client open in the one-process "
                  f"run (not in its epoch): {statistics.median(loc['client_open_seconds']) * 1e3:.0f} ms.",
                  f"Server source reads after the cold epoch: {loc['source_reads_cold']}, after the warm "
                  f"configurations: {loc['source_reads_after_warm']}; source opens seen by inotify: {loc['source_opens']}."]
        for r, h in enumerate(loc.get("half_budget_epochs", [])):
            lines.append(f"Half budget, round {r + 1}: " + ", ".join(
                f"epoch {x['epoch']} {x['seconds']:.2f}s with {x['source_opens']} source opens" for x in h["epochs"])
                + f"; {h['tier_files']} files cached, {h['evictions']} evictions.")
    pfs = results.get("pfs")
    if pfs:
        d = pfs["dataset"]
        lines += ["", f"First epoch over {d['dir']}: {d['files']} files, {d['bytes'] / 1e9:.2f} GB, medians over "
                  f"{args.repeats} rounds{', page cache dropped before each' if pfs['drop_caches'] else ''}; "
                  f"crc mismatches: {pfs['crc_mismatches']}.", "",
                  "| configuration | readers | median s | files/s | MB/s | vs threads (the limit) | vs plain loader | source opens |",
                  "|---|---|---|---|---|---|---|---|"]
        readers = {"pfs-plain": f"{args.pfs_workers} workers", "pfs-threads": f"{args.pfs_threads} threads",
                   "fitcache-pfs-cold": f"{args.pfs_workers} workers"}
        for k, v in pfs["configs"].items():
            lines.append(f"| {k} | {readers[k]} | {v['seconds_median']:.3f} | {v['files_per_s']:.0f} | "
                         f"{v['MB_per_s']:.0f} | {v['ratio_vs_threads']:.2f}x | {v['ratio_vs_plain']:.2f}x | "
                         f"{v['source_opens'][0]} |")
    return "\n".join(lines) + "\n"


def write_results(results, table, out):
    """Prints the Markdown table, writes the results with it as JSON to out, and returns the
    exit status: 1 if any item's bytes did not match the manifest."""
    print(table)
    results["table"] = table
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    log(f"wrote {out}")
    bad = sum(results.get(part, {}).get("crc_mismatches", 0) for part in ("local", "pfs"))
    bad += results.get("crc_mismatches", 0)
    return 1 if bad else 0


def add_scale_arguments(ap, name):
    """The options of a benchmark at scale (this one and bench_preload.py): the generated
    dataset, the DataLoader, the rounds, the PFS section; results go to
    bench/results/NAME-<date>.json by default."""
    ap.add_argument("--files", type=int, default=30000, help="files in the dataset")
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-scale", help="where generated datasets are kept")
    ap.add_argument("--seed", type=int, default=1, help="seed of the dataset and of the epochs' orders")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3, help="epochs per round: 1 cold, the rest warm (at least 2)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians over rounds")
    ap.add_argument("--out", help=f"JSON results (default bench/results/{name}-<date>.json)")
    ap.add_argument("--pfs", help="dataset directory on a mounted slow file system (bench/README.md)")
    ap.add_argument("--pfs-files", type=int, default=2000)
    ap.add_argument("--pfs-workers", type=int, default=4)
    ap.add_argument("--pfs-threads", type=int, default=16)
    ap.add_argument("--bricks", help="brick directories (comma-separated) to count source opens on")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each PFS epoch (root)")
    ap.add_argument("--no-local", action="store_true", help="only the --pfs section")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scale_arguments(ap, "scale")
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_one:
        return run_one(json.loads(args.run_one), args)
    if args.epochs < 2:
        ap.error("--epochs must be at least 2 (one cold, then warm)")
    out = args.out or str(Path(__file__).resolve().parent / "results" / f"scale-{datetime.date.today()}.json")

    signal.signal(signal.SIGTERM, _stop)
    work = f"/tmp/fitcache-scale-{os.getpid()}"
    cleanup = [lambda: shutil.rmtree(work, ignore_errors=True)]
    results = {"machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "torch": torch.__version__,
               "args": {k: v for k, v in vars(args).items() if k != "run_one"}}
    try:
        if not args.no_local:
            results["local"] = bench_local(args, work, cleanup)
        if args.pfs:
            results["pfs"] = bench_pfs(args, work, cleanup)
    finally:
        for fn in reversed(cleanup):
            fn()
    return write_results(results, markdown(results, args), out)


if __name__ == "__main__":
    sys.exit(main())
