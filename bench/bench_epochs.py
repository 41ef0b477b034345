#!/usr/bin/env python3
"""Epoch throughput of FitCacheDataset against plain Python reads, in one run.

For each file size (256 KiB and 8 MiB by default) it times, interleaved over --repeats
rounds, one epoch (every file once, in a fixed shuffled order) of:

  source        plain open/read/close of the files on the source (the PFS)
  shm           plain reads of a /dev/shm copy of the same files: the limit
  fitcache-cold FitCacheDataset on an empty cache (a fresh server and tiers each round; the
                server's start, once per node, is timed apart and not in the epoch)
  fitcache-warm FitCacheDataset once everything is cached

Every item is consumed with zlib.crc32, so each read's bytes are really touched (a mapping
that is never touched would cost nothing). It prints medians and ratios against the
baselines of the same run as a Markdown table, and writes everything to --out as JSON.

    python bench/bench_epochs.py --source /mnt/pfs/fitcache-bench --drop-caches
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import zlib

import fitcache
from privatecache import PrivateCache

SIZES = {"256KiB": 256 << 10, "8MiB": 8 << 20}


def make_files(directory, count, size):
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(size)
    for i in range(count):
        path = os.path.join(directory, f"f{i:06d}.bin")
        if os.path.exists(path) and os.path.getsize(path) == size:
            continue
        with open(path + ".tmp", "wb") as f:
            f.write(rng.randbytes(size))
        os.rename(path + ".tmp", path)
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".bin"))


def drop_caches():
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def plain_epoch(paths):
    t = time.perf_counter()
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        zlib.crc32(data)
        n += len(data)
    return time.perf_counter() - t, n


def fitcache_epoch(ds, order):
    t = time.perf_counter()
    n = 0
    for i in order:
        view = ds[i]
        zlib.crc32(view)
        n += len(view)
    return time.perf_counter() - t, n


def private_cache(work, name):
    """A private cache with a memory tier under /dev/shm and a disk tier under work."""
    shm = f"/dev/shm/fitcache-bench-{os.getpid()}-{name}"
    disk = os.path.join(work, name, "disk")
    return PrivateCache(os.path.join(work, name, "run"), f"memory:{shm}:8GiB,disk:{disk}:16GiB", [shm, disk])


def median_rate(samples, nbytes, nfiles):
    secs = statistics.median(samples)
    return {"seconds_median": secs, "seconds": samples, "files_per_s": nfiles / secs, "MB_per_s": nbytes / secs / 1e6}


def bench_size(label, size, count, args, work):
    src_dir = os.path.join(args.source, label)
    print(f"[{label}] preparing {count} files of {size} bytes in {src_dir}", file=sys.stderr, flush=True)
    paths = make_files(src_dir, count, size)[:count]
    shm_dir = f"/dev/shm/fitcache-bench-copy-{os.getpid()}/{label}"
    os.makedirs(shm_dir, exist_ok=True)
    shm_paths = []
    for p in paths:
        q = os.path.join(shm_dir, os.path.basename(p))
        shutil.copyfile(p, q)
        shm_paths.append(q)
    order = list(range(len(paths)))
    random.Random(1).shuffle(order)
    src_order = [paths[i] for i in order]
    shm_order = [shm_paths[i] for i in order]
    nbytes = size * len(paths)

    cache = private_cache(work, label)
    times = {k: [] for k in ("source", "shm", "fitcache-cold", "fitcache-warm")}
    startup = []
    try:
        for r in range(args.repeats):
            if args.drop_caches:
                drop_caches()
            times["source"].append(plain_epoch(src_order)[0])

            cache.wipe()
            if args.drop_caches:
                drop_caches()
            ds = fitcache.FitCacheDataset(src_dir, files=[os.path.basename(p) for p in paths], **cache.options)
            t = time.perf_counter()
            ds._get_client()  # starts the embedded server: timed on its own, once per node
            startup.append(time.perf_counter() - t)
            times["fitcache-cold"].append(fitcache_epoch(ds, order)[0])
            warm = [fitcache_epoch(ds, order)[0] for _ in range(args.warm_epochs)]
            times["fitcache-warm"].append(statistics.median(warm))
            ds.close()

            times["shm"].append(statistics.median(plain_epoch(shm_order)[0] for _ in range(args.warm_epochs)))
            print(f"[{label}] round {r + 1}/{args.repeats}: " + ", ".join(
                f"{k} {v[-1]:.3f}s" for k, v in times.items()), file=sys.stderr, flush=True)
        stats = ds.stats()
    finally:
        cache.wipe()
        shutil.rmtree(os.path.dirname(shm_dir), ignore_errors=True)
    res = {k: median_rate(v, nbytes, len(paths)) for k, v in times.items()}
    med = {k: v["seconds_median"] for k, v in res.items()}
    res["ratios"] = {
        "warm_vs_shm": med["shm"] / med["fitcache-warm"],
        "warm_vs_source": med["source"] / med["fitcache-warm"],
        "cold_vs_source": med["source"] / med["fitcache-cold"],
    }
    res["files"], res["file_size"], res["last_round_stats"] = len(paths), size, stats
    res["server_start_seconds_median"] = statistics.median(startup)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, help="directory on the source file system (the PFS) for the datasets")
    ap.add_argument("--small-files", type=int, default=1000, help="number of 256 KiB files")
    ap.add_argument("--large-files", type=int, default=48, help="number of 8 MiB files")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; medians are over rounds")
    ap.add_argument("--warm-epochs", type=int, default=3, help="warm epochs per round (their median counts)")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before cold epochs (root)")
    ap.add_argument("--work", default="/tmp/fitcache-bench", help="where the caches' disk tiers and runtime live")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    results = {"machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "source": args.source,
               "repeats": args.repeats, "sizes": {}}
    for label, count in (("256KiB", args.small_files), ("8MiB", args.large_files)):
        results["sizes"][label] = bench_size(label, SIZES[label], count, args, args.work)

    print("\n| files | epoch | median s | files/s | MB/s | ratio |")
    print("|---|---|---|---|---|---|")
    for label, res in results["sizes"].items():
        r = res["ratios"]
        ratio = {"source": "1.00 (baseline)", "shm": "limit",
                 "fitcache-cold": f"{r['cold_vs_source']:.2f}x source",
                 "fitcache-warm": f"{r['warm_vs_shm']:.2f}x shm, {r['warm_vs_source']:.1f}x source"}
        for k in ("source", "shm", "fitcache-cold", "fitcache-warm"):
            v = res[k]
            print(f"| {res['files']} x {label} | {k} | {v['seconds_median']:.3f} | {v['files_per_s']:.0f} | {v['MB_per_s']:.0f} | {ratio[k]} |")
    for label, res in results["sizes"].items():
        print(f"\n{label}: embedded server start (median) {res['server_start_seconds_median'] * 1e3:.0f} ms; "
              f"source reads in the last round: {res['last_round_stats']['server']['source_reads']} "
              f"for {res['files']} files")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
