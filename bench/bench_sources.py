#!/usr/bin/env python3
"""Slow file systems compared: plain reads of the same dataset from each directory given, for
choosing a stand-in for a parallel file system (bench/README.md, "A slow file system to read
from"): the GlusterFS emulation of the development machines against bench/slowfs, say.

Each directory gets the ImageNet-like dataset of bench_scale.py (--files, default 4,000,
lognormal around 105 KiB; generated there unless present). Per round and directory, with the
page cache dropped first (root), every file is read once, whole, by --threads readers (each
count in turn: default 1 and 16), and its crc32 checked against the manifest. Reported: files
and MB per second, medians over --repeats rounds, and each directory's speed against the
first directory's in the same round (the first's time over its time).

    python bench/bench_sources.py /mnt/pfs/fitcache-sources /mnt/slowfs/fitcache-sources
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import bench_scale


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="a directory on each file system (the first is the baseline)")
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--threads", default="1,16", help="reader counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=f"bench/results/sources-{datetime.date.today()}.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: the page cache is dropped before each pass")
    threads = [int(t) for t in args.threads.split(",")]
    sets = [bench_scale.generate(d, args.files, args.seed)[:2] for d in args.dirs]
    nbytes = sum(size for _, size, _ in sets[0][1])
    seconds = {(d, t): [] for d in args.dirs for t in threads}
    ratios = {(d, t): [] for d in args.dirs for t in threads}
    bad = 0
    for r in range(args.repeats):
        for t in threads:
            base = None
            for d, (src, manifest) in zip(args.dirs, sets):
                bench_scale.drop_caches()
                s, _, mismatched = bench_scale.read_with_threads(src, manifest, t)
                bad += mismatched
                base = base or s
                seconds[d, t].append(s)
                ratios[d, t].append(base / s)
                print(f"round {r + 1}/{args.repeats}, {t} threads, {d}: {s:.2f} s", file=sys.stderr)
    rows = []
    print(f"\n{args.files} files, {nbytes / 1e6:.0f} MB, each read once per pass, page cache dropped; "
          f"medians of {args.repeats} rounds; crc mismatches: {bad}\n")
    print("| directory | threads | seconds | files/s | MB/s | speed vs the first |")
    print("|---|---|---|---|---|---|")
    for t in threads:
        for d in args.dirs:
            s = statistics.median(seconds[d, t])
            row = {"dir": d, "threads": t, "seconds_median": s, "seconds": seconds[d, t],
                   "ratio_vs_first_median": statistics.median(ratios[d, t])}
            rows.append(row)
            print(f"| {d} | {t} | {s:.2f} | {args.files / s:.0f} | {nbytes / s / 1e6:.1f} | "
                  f"{row['ratio_vs_first_median']:.2f}x |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"files": args.files, "bytes": nbytes, "repeats": args.repeats, "crc_mismatches": bad,
                   "loadavg": os.getloadavg(), "rows": rows}, f, indent=1)
    print(f"\nwrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
