#!/usr/bin/env python3
"""A server killed between two epochs of fresh DataLoader workers, as a new user runs cluster
mode from the README (issue 32): 4 servers on loopback addresses 127.0.0.1-4 (`fitcache serve
--listen ... --servers ...`, every option at its default: wait_timeout 60 s), --files small
files (default 5,000, 1-16 KiB), a reader with FitCacheDataset and a DataLoader of --workers
(default 2) forked workers, fresh each epoch (the default), every item's crc32 checked against
the source's. Each case runs --epochs epochs on fresh servers, once without a kill and once
with a server killed (SIGKILL) after epoch --kill-after (default 2), the next epoch starting at
once; reported: each epoch's seconds and the median of the epochs after the kill against the
same epochs of the run without one.

Cases (--cases):

  login   the reader on a node without a server of the job (node "login"); the last server
          is killed
  own     the reader on the first server's node (it reads through that server's node socket
          and tiers); that server is killed

    python bench/bench_startwait.py                       # both cases, 5,000 files, 5 epochs
    python bench/bench_startwait.py --cases login --epochs 4 --out bench/results/startwait.json
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import fitcache  # noqa: E402
from harness import Cluster  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class CRC:
    """Transform: the item's crc32 (picklable, for workers)."""

    def __call__(self, view):
        return zlib.crc32(view)


class Indexed(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return i, self.ds[i]


def generate(root, files, seed):
    """files small files under root; {relative path: crc32}."""
    rng = random.Random(seed)
    manifest = {}
    for i in range(files):
        rel = f"d{i % 50:02d}/f{i:05d}.bin"
        data = rng.randbytes(rng.randint(1024, 16384))
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        manifest[rel] = zlib.crc32(data)
    return manifest


def epoch(ds, workers, manifest):
    """Seconds of one epoch, and the number of items whose bytes were wrong."""
    loader = DataLoader(Indexed(ds), batch_size=None, num_workers=workers, multiprocessing_context="fork")
    start = time.monotonic()
    bad = sum(1 for i, crc in loader if manifest[ds.files[i]] != crc)
    return time.monotonic() - start, bad


def run(case, kill, root, manifest, args, work):
    cluster = Cluster(Path(tempfile.mkdtemp(dir=work)), root, serve_options={})
    try:
        victim = cluster.addrs[0] if case == "own" else cluster.addrs[-1]
        node = cluster.addrs[0].split(":")[0] if case == "own" else "login"
        # The servers' runtime directory, as the readers of a node share it by default: there
        # the readers find the tiers of the node's servers, also of one that died.
        ds = fitcache.FitCacheDataset(root, CRC(), servers=",".join(cluster.addrs), token_file=cluster.token_file,
                                      node=node, runtime_dir=str(cluster.tmp / "run"), **args.dataset_options)
        rows = []
        for e in range(args.epochs):
            if kill and e == args.kill_after:
                cluster.kill(victim)
            secs, bad = epoch(ds, args.workers, manifest)
            rows.append({"case": case, "kill": kill, "epoch": e + 1, "seconds": secs, "bad": bad})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        cluster.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--kill-after", type=int, default=2, help="epochs before the kill")
    ap.add_argument("--cases", default="login,own")
    ap.add_argument("--open-before-fork", choices=["default", "off"], default="default",
                    help="FitCacheDataset's open_before_fork: its default, or off (each fresh worker opens "
                         "a client of its own, as before the stand-in node socket)")
    ap.add_argument("--out", help="JSON results")
    args = ap.parse_args()
    args.dataset_options = {"open_before_fork": False} if args.open_before_fork == "off" else {}
    work = tempfile.mkdtemp(prefix="fitcache-startwait-")
    root = os.path.join(work, "data")
    manifest = generate(root, args.files, args.seed)
    results = []
    try:
        for case in args.cases.split(","):
            for kill in (False, True):
                results += run(case, kill, root, manifest, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.files} files, 4 servers on loopback, DataLoader with {args.workers} fresh forked workers per "
          f"epoch, a server killed after epoch {args.kill_after} (fitcache {fitcache.__version__})\n")
    print("| reader | epochs (s), no kill | epochs (s), kill | after the kill: median, no kill | kill | ratio | bad items |")
    print("|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        base = [r["seconds"] for r in results if r["case"] == case and not r["kill"]]
        hit = [r["seconds"] for r in results if r["case"] == case and r["kill"]]
        bad = sum(r["bad"] for r in results if r["case"] == case)
        b, k = statistics.median(base[args.kill_after:]), statistics.median(hit[args.kill_after:])
        print(f"| {case} | {', '.join(f'{s:.1f}' for s in base)} | {', '.join(f'{s:.1f}' for s in hit)} "
              f"| {b:.2f} | {k:.2f} | {k / b:.1f}x | {bad} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
