#!/usr/bin/env python3
"""The first epoch with server-side prefetch: files/s against the prefetch concurrency.

Reads every file of a dataset once, as a training's first epoch does, through a DataLoader
with --workers workers (default 4) in a shuffled order, and compares, in one run:

  plain-threads   plain reads with --threads threads (default 16), each file once: the file
                  system's own limit, the baseline of the ratios
  plain-loader    plain reads through the same DataLoader
  prefetch-N      FitCacheDataset over a fresh private cache (memory tier sized to hold the
                  dataset, a new embedded server started before the clock, with option
                  prefetch N) for each N of --concurrency (default 0,1,2,4,8,16,32). For N > 0
                  the epoch's order is handed to the server first (ds.prefetch(order), inside
                  the timed epoch, as a training script would); N = 0 is FitCache without
                  prefetch (readers' misses only)

With --batched, each DataLoader item is a whole batch that FitCacheDataset reads with
__getitems__, as PyTorch 2's DataLoader reads (plain reads stay item by item, as a dataset
without __getitems__ is read). Without prefetch, a batch's misses are then the readers' only
concurrency beyond their number: on a slow source they are read side by side (capi/miss.c).

Configurations are interleaved within each of --repeats rounds (default 3); figures are
medians over rounds, and ratios the medians of the ratios within each round (which resists
load that changes between rounds). Each item is consumed in the worker (zlib.crc32), and every crc is
checked against the first plain read. Source opens during each FitCache epoch are counted
with inotify on --data (on a FUSE mount: every open made on this node), so that "each file
read from the source once" is checked from outside the library; the server's own counters
(source reads, prefetch fetched / skipped) are recorded too. --drop-caches (root) drops the
page cache before each configuration, which also empties the emulated PFS servers' caches.

The dataset is every regular file under --data; with --files N and fewer files there, N
files of random bytes with lognormal sizes (median 105 KiB, sigma 0.3, as bench_scale.py) are
generated first. Only the embedded servers it started are stopped (by the PID in its own
runtime directory), and its tiers are removed, also on Ctrl-C.

    python bench/bench_prefetch.py --data /mnt/pfs/fitcache-prefetch --files 2000 --drop-caches
"""

import argparse
import concurrent.futures
import datetime
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
import warnings
import zlib
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

import fitcache
from bench_scale import Batched, FitCacheCRC, PlainCRC, write_results  # the same readers as the scale benchmark
from privatecache import PrivateCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from inotify import OpenCounter  # noqa: E402

MEDIAN_SIZE, SIGMA = 105 << 10, 0.3


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def generate(data, files, seed):
    """Writes files random files under data, in 1 directory per 100 files."""
    rng = random.Random(seed)
    mu = math.log(MEDIAN_SIZE)
    for i in range(files):
        size = min(4 << 20, max(4 << 10, int(rng.lognormvariate(mu, SIGMA))))
        path = os.path.join(data, f"c{i // 100:04d}", f"f{i:06d}.bin")
        if os.path.exists(path) and os.path.getsize(path) == size:
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(random.Random(seed * 1_000_003 + i).randbytes(size))
        os.rename(path + ".tmp", path)
        if (i + 1) % 500 == 0:
            log(f"generated {i + 1}/{files}")


def list_files(data):
    return fitcache.list_files(data, filter=lambda rel: not rel.endswith(".tmp"))


class Order(Sampler):
    def __init__(self, order):
        self.order = order

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)


def collate(batch):
    return tuple(zip(*batch))


def loader(ds, order, args):
    if args.batched:  # a batch per __getitems__ call, as PyTorch 2's DataLoader reads
        return DataLoader(Batched(ds), batch_size=None, sampler=BatchSampler(Order(order), args.batch_size, False),
                          collate_fn=collate, num_workers=args.workers, multiprocessing_context="fork")
    return DataLoader(ds, batch_size=args.batch_size, sampler=Order(order), collate_fn=collate,
                      num_workers=args.workers, multiprocessing_context="fork")


class Checker:
    """The crc and size of every file, from the first plain read; counts mismatches."""

    def __init__(self, n):
        self.want = [None] * n
        self.bad = 0

    def see(self, i, crc, size):
        if self.want[i] is None:
            self.want[i] = (crc, size)
        elif self.want[i] != (crc, size):
            self.bad += 1

    def epoch(self, batches, on_batch=None):
        seen, nbytes = 0, 0
        for idx, crcs, sizes in batches:
            for i, c, s in zip(idx, crcs, sizes):
                self.see(i, c, s)
            seen += len(idx)
            nbytes += sum(sizes)
            if on_batch:
                on_batch()
        return seen, nbytes


def drop_caches():
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class Cache(PrivateCache):
    """A private runtime directory and memory tier holding the dataset, with option prefetch."""

    def __init__(self, work, name, budget_bytes, reads):
        tier = f"/dev/shm/fitcache-prefetch-{os.getpid()}-{name}"
        super().__init__(os.path.join(work, name, "run"), f"memory:{tier}:{int(budget_bytes * 1.1 / 2**20) + 64}MiB", [tier])
        self.options["prefetch"] = str(reads)

    def start(self, root):
        """Starts the embedded server from a separate process (this one must not load the
        library before the DataLoader forks)."""
        code = ("import json, sys, fitcache\n"
                "c = fitcache._native.Client(sys.argv[1], **json.loads(sys.argv[2]))\n"
                "c.stats()\nc.close()\n")
        subprocess.run([sys.executable, "-c", code, root, json.dumps(self.options)], check=True, timeout=120)

    def server_stats(self):
        return fitcache.server_stats(**self.options)


def run(args, work, cleanup):
    names = list_files(args.data)
    n = len(names)
    total = sum(os.path.getsize(os.path.join(args.data, r)) for r in names)
    log(f"dataset {args.data}: {n} files, {total / 1e6:.1f} MB")
    order = list(range(n))
    random.Random(args.seed).shuffle(order)
    check = Checker(n)
    configs = ["plain-threads", "plain-loader"] + [f"prefetch-{c}" for c in args.concurrency]
    times = {k: [] for k in configs}
    extra = {k: [] for k in configs if k.startswith("prefetch-")}

    def threads_epoch():
        def one(i):
            with open(os.path.join(args.data, names[i]), "rb") as f:
                data = f.read()
            return i, zlib.crc32(data), len(data)
        with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
            for i, c, s in pool.map(one, order):
                check.see(i, c, s)

    for r in range(args.repeats):
        for config in configs:
            if args.drop_caches:
                drop_caches()
            if config == "plain-threads":
                t = time.perf_counter()
                threads_epoch()
                secs = time.perf_counter() - t
            elif config == "plain-loader":
                dl = loader(PlainCRC(args.data, names), order, args)
                t = time.perf_counter()
                check.epoch(dl)
                secs = time.perf_counter() - t
                del dl
            else:
                reads = int(config.split("-")[1])
                cache = Cache(work, config, total, reads)
                cleanup.append(cache.wipe)
                cache.wipe()
                cache.start(args.data)
                opts = {k: v for k, v in cache.options.items() if k != "prefetch"}
                fds = fitcache.FitCacheDataset(args.data, files=names, prefetch=reads, **opts)
                with OpenCounter(args.data) as opens:
                    drain = opens.counts  # drained every batch: the inotify queue is bounded
                    dl = loader(FitCacheCRC(fds), order, args)
                    t = time.perf_counter()
                    if reads > 0:
                        fds.prefetch(order)  # through the fitcache command: this process has no library
                    check.epoch(dl, drain)
                    secs = time.perf_counter() - t
                    del dl
                    counts = opens.counts()
                stats = cache.server_stats() or {}
                pf = stats.get("prefetch", {})
                extra[config].append({"source_opens": sum(counts.values()), "files_opened_twice": sum(1 for v in counts.values() if v > 1),
                                      "source_reads": stats.get("source_reads"), "misses": stats.get("misses"),
                                      "prefetch_fetched": pf.get("fetched"), "prefetch_skipped_inflight": pf.get("skipped_inflight"),
                                      "prefetch_skipped_cached": pf.get("skipped_cached")})
                cache.wipe()
            times[config].append(secs)
            log(f"round {r + 1}/{args.repeats} {config}: {secs:.2f}s ({n / secs:.0f} files/s)"
                + (f" {extra[config][-1]}" if config in extra else ""))
    res = {}
    for k, v in times.items():
        secs = statistics.median(v)
        # Ratios within each round (the baselines ran minutes apart at most), then the median.
        res[k] = {"seconds": v, "seconds_median": secs, "files_per_s": n / secs, "MB_per_s": total / secs / 1e6,
                  "ratio_vs_threads": statistics.median(b / x for b, x in zip(times["plain-threads"], v)),
                  "ratio_vs_plain_loader": statistics.median(b / x for b, x in zip(times["plain-loader"], v))}
        if k in extra:
            res[k]["runs"] = extra[k]
    return {"dataset": {"dir": args.data, "files": n, "bytes": total}, "configs": res, "crc_mismatches": check.bad}


def markdown(results, args):
    d = results["dataset"]
    lines = [f"First epoch over {d['dir']}: {d['files']} files, {d['bytes'] / 1e6:.0f} MB; readers: DataLoader with "
             f"{args.workers} workers, batch {args.batch_size}{' per __getitems__' if args.batched else ''}, shuffled; "
             f"medians over {args.repeats} rounds"
             f"{', page cache dropped before each configuration' if args.drop_caches else ''}; crc mismatches: "
             f"{results['crc_mismatches']}.", "",
             f"| configuration | median s | files/s | MB/s | vs plain {args.threads} threads | vs plain loader | source opens (max per file) |",
             "|---|---|---|---|---|---|---|"]
    for k, v in results["configs"].items():
        label = {"plain-threads": f"plain reads, {args.threads} threads", "plain-loader": f"plain reads, {args.workers} workers"}.get(
            k, f"FitCache, prefetch {k.split('-')[1]}" + (" (off)" if k == "prefetch-0" else ""))
        opens = ""
        if "runs" in v:
            opens = ", ".join(str(x["source_opens"]) for x in v["runs"])
            twice = max(x["files_opened_twice"] for x in v["runs"])
            opens += f" ({'1' if twice == 0 else f'{twice} files twice'})"
        lines.append(f"| {label} | {v['seconds_median']:.2f} | {v['files_per_s']:.0f} | {v['MB_per_s']:.0f} | "
                     f"{v['ratio_vs_threads']:.2f}x | {v['ratio_vs_plain_loader']:.2f}x | {opens} |")
    return "\n".join(lines) + "\n"


def main():
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than cores: on purpose
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="dataset directory (on the PFS)")
    ap.add_argument("--files", type=int, help="generate this many files under --data if it has fewer")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", default="0,1,2,4,8,16,32", help="prefetch values to measure")
    ap.add_argument("--workers", type=int, default=4, help="DataLoader workers reading")
    ap.add_argument("--threads", type=int, default=16, help="threads of the plain baseline")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--batched", action="store_true",
                    help="each worker reads a whole batch per item (FitCacheDataset.__getitems__), as PyTorch 2's "
                         "DataLoader does; plain reads stay item by item")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each configuration (root)")
    ap.add_argument("--out", help="JSON results (default bench/results/prefetch-<date>.json)")
    args = ap.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.data = os.path.abspath(args.data)
    if args.files and len(list_files(args.data) if os.path.isdir(args.data) else []) < args.files:
        generate(args.data, args.files, args.seed)
    out = args.out or str(Path(__file__).resolve().parent / "results" / f"prefetch-{datetime.date.today()}.json")
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    work = f"/tmp/fitcache-prefetch-bench-{os.getpid()}"
    cleanup = [lambda: shutil.rmtree(work, ignore_errors=True)]
    results = {"machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "torch": torch.__version__,
               "args": vars(args)}
    try:
        results.update(run(args, work, cleanup))
    finally:
        for fn in reversed(cleanup):
            fn()
    return write_results(results, markdown(results, args), out)


if __name__ == "__main__":
    sys.exit(main())
