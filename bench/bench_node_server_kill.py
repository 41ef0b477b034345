#!/usr/bin/env python3
"""The reader's own node server killed between two epochs: 4 servers on loopback addresses
(127.0.0.1-4, started as tests/harness.py starts them, with the job's server list), a
FitCacheDataset on the first server's node (its `node` option) with a DataLoader of --workers
fresh workers per epoch (forked), every item's sha256 checked. Epoch 1 reads through the node's
server, which caches its own files and keeps node-local copies of the others; the server is
killed (SIGKILL) before epoch 2. Reported per epoch (a Markdown table, and JSON in
--out): seconds, files opened at the source (inotify, from outside), after the kill how many of
those the killed server's tier held, and bad items.

The readers share the servers' runtime directory, where each server records its tiers, so that
the workers of epoch 2 and later, which start after the kill, find the node's tiers without it.
A worker does not wait for the dead server at its start (README, Cluster mode, Start); before
it waited 2 x --wait-timeout, most of an epoch's time here.

    python bench/bench_node_server_kill.py                   # 5,000 files of 1-64 KB
    python bench/bench_node_server_kill.py --no-prefetch     # without the readers' lists
"""

import argparse
import hashlib
import json
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import fitcache  # noqa: E402
import torch  # noqa: E402
from harness import Cluster, cached_names  # noqa: E402
from inotify import OpenCounter  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class Digest:
    """Transform: the item's sha256 (picklable, for workers)."""

    def __call__(self, view):
        return hashlib.sha256(view).hexdigest()


class Indexed(torch.utils.data.Dataset):
    """(index, digest) items, so that results match whatever the order."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return i, self.ds[i]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--wait-timeout", default="2", help="the readers' wait_timeout, seconds")
    ap.add_argument("--no-prefetch", action="store_true", help="the dataset hands no list over")
    ap.add_argument("--out", default="bench-node-server-kill.json", help="JSON results")
    args = ap.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="fitcache-bench-node-kill-"))
    root = tmp / "data"
    rng = random.Random(1)
    digests = {}
    for i in range(args.files):
        rel = f"c{i % 10}/f{i:06d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randrange(1000, 64000))
        (root / rel).write_bytes(data)
        digests[rel] = hashlib.sha256(data).hexdigest()
    cluster = Cluster(tmp, str(root), serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    try:
        ds = fitcache.FitCacheDataset(str(root), Digest(), prefetch=not args.no_prefetch,
                                      **cluster.options(runtime_dir=str(tmp / "run"), wait_timeout=args.wait_timeout))
        held, rows = None, []
        print("| epoch | seconds | files opened at the source | of those, held by the killed server | bad items |")
        print("|---|---|---|---|---|")
        for e in range(1, args.epochs + 1):
            if e == 2:
                victim = cluster.addrs[0]
                cluster.kill(victim)
                held = cached_names(cluster, victim)
            with OpenCounter(str(root)) as opens:
                start = time.monotonic()
                loader = DataLoader(Indexed(ds), batch_size=None, num_workers=args.workers,
                                    multiprocessing_context="fork")
                got = {ds.files[i]: d for i, d in loader}
                took = time.monotonic() - start
                counts = opens.counts()
            row = {"epoch": e, "seconds": round(took, 2), "source_opens": len(counts),
                   "bad_items": sum(1 for k, d in digests.items() if got.get(k) != d)}
            if held is not None:
                row["held_by_killed_server"] = len(held)
                row["held_opened"] = sum(1 for k in counts if os.path.basename(k) in held)
            rows.append(row)
            held_col = f"{row['held_opened']} of {len(held)}" if held is not None else "-"
            print(f"| {e} | {took:.2f} | {len(counts)} of {args.files} | {held_col} | {row['bad_items']} |", flush=True)
        with open(args.out, "w") as f:
            json.dump({"files": args.files, "workers": args.workers, "prefetch": not args.no_prefetch,
                       "wait_timeout": args.wait_timeout, "epochs": rows}, f, indent=1)
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
