#!/usr/bin/env python3
"""Where mapping a cached file starts to pay over copying it: the threshold of the C hit path.

A hit of a file up to the threshold is read into memory the caller owns (one copy, as read()
makes); a larger one is mapped (no copy, but mmap, page faults and an munmap whose TLB
shootdown reaches every CPU the process's threads ran on). This benchmark measures both for
file sizes from 64 KiB to 16 MiB, as a DataLoader worker meets them: a fresh process with the
library loaded (and so the Go runtime's threads) reads each cached file of one size once and
consumes every byte (zlib.crc32), with FITCACHE_READ_MAX_BYTES forcing copies (a huge value) or
mappings (0). Per size, --files files totalling about --mib MiB, read in a shuffled order;
the modes alternate within each of --repeats rounds, and the figures are medians.

    python bench/bench_crossover.py                  # prints a table, writes JSON to --out
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from privatecache import PrivateCache  # noqa: E402

SIZES = [64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]

READER = r"""
import json, os, random, sys, time, zlib
import fitcache
root, order_seed, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
names = sorted(os.listdir(root))
random.Random(order_seed).shuffle(names)
with fitcache.Client(root, **options) as c:
    c.read(names[0])  # the client's start is not what is measured
    start = time.perf_counter()
    total = 0
    for name in names:
        view = c.read(name)
        zlib.crc32(view)  # consumed: every byte read once
        total += len(view)
        del view
    elapsed = time.perf_counter() - start
    hits = c.stats()["client"]["local_hits"]
print(json.dumps({"seconds": elapsed, "bytes": total, "files": len(names), "hits": hits}))
"""


def make_files(root, size, count):
    os.makedirs(root, exist_ok=True)
    rng = random.Random(size)
    for i in range(count):
        path = os.path.join(root, f"f{i:05d}.bin")
        if not os.path.exists(path) or os.path.getsize(path) != size:
            with open(path, "wb") as f:
                f.write(rng.randbytes(size))


def run_reader(root, options, mode, seed):
    env = dict(os.environ, FITCACHE_READ_MAX_BYTES=str(1 << 62 if mode == "copy" else 0))
    out = subprocess.run([sys.executable, "-c", READER, root, str(seed), json.dumps(options)],
                         env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"reader failed: {out.stderr}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="MiB of files per size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-crossover")
    ap.add_argument("--out", default=os.path.join(HERE, "results", time.strftime("crossover-%Y-%m-%d.json")))
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="fitcache-crossover-")
    tier = f"/dev/shm/{os.path.basename(work)}"
    total = sum(max(4, (args.mib << 20) // s) * s for s in SIZES)
    cache = PrivateCache(os.path.join(work, "run"), f"memory:{tier}:{int(total * 1.2) >> 20}MiB", [tier])
    rows = []
    try:
        for size in SIZES:
            count = max(4, (args.mib << 20) // size)
            root = os.path.join(args.data, f"size-{size}")
            make_files(root, size, count)
            run_reader(root, cache.options, "copy", 0)  # the cold pass caches every file
            times = {"copy": [], "map": []}
            for r in range(args.repeats):
                for mode in (("copy", "map") if r % 2 == 0 else ("map", "copy")):
                    got = run_reader(root, cache.options, mode, r + 1)
                    if got["hits"] < count:
                        raise SystemExit(f"size {size}: {got['hits']} hits of {count} reads: not warm")
                    times[mode].append(got["seconds"])
            copy, mapped = statistics.median(times["copy"]), statistics.median(times["map"])
            rows.append({"size": size, "files": count, "copy_s": copy, "map_s": mapped,
                         "copy_files_per_s": count / copy, "map_files_per_s": count / mapped,
                         "map_vs_copy": copy / mapped, "runs": times})
            print(f"{size >> 10:>6} KiB x {count:>5}: copy {count / copy:>8.0f} files/s, "
                  f"map {count / mapped:>8.0f} files/s, map/copy {copy / mapped:.2f}x", flush=True)
    finally:
        cache.wipe()
        shutil.rmtree(work, ignore_errors=True)
    first = next((r["size"] for r in rows if r["map_vs_copy"] >= 1.0), None)
    print(f"\nsmallest size where mapping is at least as fast as copying: "
          f"{'none measured' if first is None else f'{first >> 10} KiB'}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats, "mib_per_size": args.mib,
                   "rows": rows, "crossover_bytes": first}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
