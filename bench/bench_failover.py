#!/usr/bin/env python3
"""Fault tolerance in cluster mode, measured: four servers on loopback addresses, one client
reading a dataset for several epochs, one server killed (SIGKILL) or hung (SIGSTOP) after the
first epoch. For each policy it reports the source reads per epoch (counted with inotify,
from outside FitCache), the files the failed server held, and the time from the failure to
the client's declaring the server dead.

    python bench/bench_failover.py --files 400 --epochs 5
"""

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fitcache  # noqa: E402
from harness import Cluster, cached_names, server_stats, wait_for  # noqa: E402
from inotify import OpenCounter  # noqa: E402


def make_dataset(root, files, size):
    rng = random.Random(0)
    for i in range(files):
        p = Path(root, f"d{i % 10}", f"f{i:05d}.bin")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(size))
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*.bin"))


def run(policy, failure, files, epochs, work, names):
    root = os.path.join(work, "data")
    run_dir = Path(work) / f"run-{policy}-{failure}"
    run_dir.mkdir()
    cluster = Cluster(run_dir, root)
    opts = {"policy": "recache" if policy == "replicas=2" else policy, "rpc_timeout": "0.5",
            "failure_threshold": "3"}
    if policy == "replicas=2":
        opts["replicas"] = "2"
    victim = cluster.addrs[2]
    row = {"policy": policy, "failure": failure}
    try:
        with fitcache.Client(root, **cluster.options(**opts)) as client, OpenCounter(root) as opens:
            per_epoch, seen = [], 0
            for epoch in range(epochs):
                for n in names:
                    client.read(n)
                total = sum(opens.counts().values())
                per_epoch.append(total - seen)
                seen = total
                if epoch == 0:
                    copies = 2 if policy == "replicas=2" else 1
                    wait_for(lambda: sum(s["published"] for s in server_stats(client).values()) == copies * len(names))
                    held = cached_names(cluster, victim)
                    row["held"] = len(held)
                    victim_files = [n for n in names if os.path.basename(n) in held]
                    pid = cluster.procs[victim].pid
                    t = time.perf_counter()
                    if failure == "kill":
                        cluster.kill(victim)
                    else:
                        os.kill(pid, signal.SIGSTOP)
                    # Time the reads that run into the failure (not the stats calls in between,
                    # which also wait for the hung server).
                    elapsed, i = time.perf_counter() - t, 0
                    while not client.stats()["client"].get("servers_declared_dead"):
                        t = time.perf_counter()
                        client.read(victim_files[i % len(victim_files)])
                        elapsed += time.perf_counter() - t
                        i += 1
                    row["detect_ms"], row["detect_reads"] = elapsed * 1e3, i
            row["source_reads_per_epoch"] = per_epoch
            if failure == "hang":
                os.kill(pid, signal.SIGCONT)
    finally:
        cluster.stop()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--size", type=int, default=64 << 10)
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fitcache-failover-") as work:
        names = make_dataset(os.path.join(work, "data"), args.files, args.size)
        rows = [run(p, f, args.files, args.epochs, work, names)
                for p, f in (("recache", "kill"), ("pfs", "kill"), ("replicas=2", "kill"), ("recache", "hang"))]
    print(f"\n{args.files} files, 4 servers on loopback addresses, failure after epoch 1, rpc_timeout 0.5 s, threshold 3\n")
    print("| policy | failure | files on the failed server | failure to declared dead (reads) | source reads per epoch |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['failure']} | {r['held']} | {r['detect_ms']:.1f} ms ({r['detect_reads']}) | "
              f"{', '.join(map(str, r['source_reads_per_epoch']))} |")


if __name__ == "__main__":
    main()
