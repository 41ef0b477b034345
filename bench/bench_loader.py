#!/usr/bin/env python3
"""Warm-epoch throughput through a PyTorch DataLoader with worker processes: FitCacheDataset
against a plain Dataset reading a /dev/shm copy of the same files, in one run.

Each item is consumed in the worker (zlib.crc32 of its bytes); epochs are shuffled. With
persistent workers a worker keeps the mappings it made in earlier epochs, so a file it reads
again costs no system call (with W workers and shuffling, about 1 - (1 - 1/W)^(e-1) of the
files in epoch e); with fresh workers every epoch (the DataLoader default) each epoch maps
its files anew. Both are reported. The cache is warmed first with `fitcache warmup`.

    python bench/bench_loader.py --source /mnt/pfs/fitcache-bench    # after bench_epochs.py made the files
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import zlib

import torch
from torch.utils.data import DataLoader, Dataset

import fitcache


class PlainFiles(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return zlib.crc32(f.read())


class CRC:
    def __call__(self, view):
        return zlib.crc32(view)


def epochs(ds, workers, persistent, count):
    """Times count epochs, shuffled anew each epoch (the same sequence of orders for every
    dataset, from a seeded generator)."""
    loader = DataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1),
                        num_workers=workers, persistent_workers=persistent, multiprocessing_context="fork")
    out = []
    for _ in range(count):
        t = time.perf_counter()
        for _ in loader:
            pass
        out.append(time.perf_counter() - t)
    del loader
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    work = f"/tmp/fitcache-bench-loader-{os.getpid()}"
    shm_tier = f"/dev/shm/fitcache-bench-loader-{os.getpid()}"
    options = {"runtime_dir": os.path.join(work, "run"), "tiers": f"memory:{shm_tier}:8GiB"}
    env = {**os.environ, **{"FITCACHE_" + k.upper(): v for k, v in options.items()}}
    results = {}
    try:
        for label in ("256KiB", "8MiB"):
            src = os.path.join(args.source, label)
            names = sorted(f for f in os.listdir(src) if f.endswith(".bin"))
            copy = f"/dev/shm/fitcache-bench-loader-copy-{os.getpid()}"
            os.makedirs(copy, exist_ok=True)
            for n in names:
                shutil.copyfile(os.path.join(src, n), os.path.join(copy, n))
            subprocess.run([fitcache._native.server_binary(), "warmup", "--quiet", src], env=env, check=True)
            plain = PlainFiles([os.path.join(copy, n) for n in names])
            cached = fitcache.FitCacheDataset(src, transform=CRC(), files=names, **options)
            res = {}
            for persistent in (False, True):
                key = "persistent" if persistent else "fresh-workers"
                t = {"shm": [], "fitcache": []}
                for _ in range(args.repeats):
                    for name, ds in (("shm", plain), ("fitcache", cached)):
                        e = epochs(ds, args.workers, persistent, args.epochs)
                        # With persistent workers the first epoch starts them: count the rest.
                        t[name].append(statistics.median(e[1:] if persistent else e))
                med = {k: statistics.median(v) for k, v in t.items()}
                res[key] = {"seconds": t, "files_per_s": {k: len(names) / v for k, v in med.items()},
                            "fitcache_vs_shm": med["shm"] / med["fitcache"]}
                print(f"[{label}] {key}: shm {med['shm']:.3f}s, fitcache {med['fitcache']:.3f}s "
                      f"-> {res[key]['fitcache_vs_shm']:.2f}x", file=sys.stderr, flush=True)
            results[label] = res
            shutil.rmtree(copy, ignore_errors=True)
    finally:
        try:
            with open(os.path.join(options["runtime_dir"], "server.lock")) as f:
                os.kill(int(f.read().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_tier, ignore_errors=True)
    print(f"\n| files | workers | shm files/s | fitcache files/s | fitcache / shm |")
    print("|---|---|---|---|---|")
    for label, res in results.items():
        for key, r in res.items():
            print(f"| {label} | {args.workers}, {key} | {r['files_per_s']['shm']:.0f} | "
                  f"{r['files_per_s']['fitcache']:.0f} | {r['fitcache_vs_shm']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
