#!/usr/bin/env python3
"""Fault tolerance in cluster mode, measured: four servers (on loopback addresses, or in
network namespaces with --netns), one client reading a dataset for several epochs, one server
killed (SIGKILL) or hung (SIGSTOP) at a random point of the second epoch. For each policy it
reports the time and the source reads (counted with inotify, from outside FitCache) of each
epoch, the files the failed server held, and the time from the failure to the client's
declaring the server dead.

    python bench/bench_failover.py --files 400 --epochs 5
    python bench/bench_failover.py --netns --source /mnt/pfs/fitcache-failover   # the hash-ring paper, sec. V
"""

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fitcache  # noqa: E402
from harness import Cluster, NetnsNodes, cached_names, server_stats, wait_for  # noqa: E402
from inotify import OpenCounter  # noqa: E402


def make_dataset(root, files, size):
    rng = random.Random(0)
    names = []
    for i in range(files):
        p = Path(root, f"d{i % 10}", f"f{i:05d}.bin")
        p.parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(size)
        if not (p.exists() and p.stat().st_size == size):
            p.write_bytes(data)
        names.append(str(p.relative_to(root)))
    return sorted(names)


def run(policy, failure, epochs, work, root, names, netns, seed, servers):
    run_dir = Path(work) / f"run-{policy}-{failure}"
    run_dir.mkdir()
    nodes = NetnsNodes(servers) if netns else None
    cluster = Cluster(run_dir, root, nodes=[f"127.0.0.{i}" for i in range(1, servers + 1)], netns=nodes)
    # The reader is on a node without a server (the bridge in the namespaces, 127.0.0.254 on
    # loopback): it reads from the servers itself and declares the failed one dead itself,
    # which the detection time below counts (a reader on a server's node reads through that
    # server, which does).
    opts = {"policy": "recache" if policy == "replicas=2" else policy, "rpc_timeout": "0.5",
            "failure_threshold": "3", **({} if netns else {"node": "127.0.0.254"})}
    if policy == "replicas=2":
        opts["replicas"] = "2"
    victim = cluster.addrs[2]
    row = {"policy": policy, "failure": failure}
    rng = random.Random(seed)
    try:
        with fitcache.Client(root, **cluster.options(**opts)) as client, OpenCounter(root) as opens:
            per_epoch, seconds, seen = [], [], 0
            kill_at = rng.randrange(len(names))  # a random point of the second epoch
            for epoch in range(epochs):
                order = list(names)
                rng.shuffle(order)
                t0, paused = time.perf_counter(), 0.0
                for i, n in enumerate(order):
                    client.read(n)
                    if epoch == 1 and i == kill_at:
                        p0 = time.perf_counter()
                        fail_now()
                        paused += time.perf_counter() - p0
                seconds.append(time.perf_counter() - t0 - paused)
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

                    def fail_now():
                        t = time.perf_counter()
                        if failure == "kill":
                            cluster.kill(victim)
                        else:
                            os.kill(pid, signal.SIGSTOP)
                        # Time the reads that run into the failure (not the stats calls in
                        # between, which also wait for a hung server).
                        elapsed, i = time.perf_counter() - t, 0
                        deadline = time.monotonic() + 120  # bounded: a detection never seen is an error
                        while not client.stats()["client"].get("servers_declared_dead"):
                            if time.monotonic() > deadline:
                                raise RuntimeError(f"{victim} not declared dead in 120 s")
                            t = time.perf_counter()
                            client.read(victim_files[i % len(victim_files)])
                            elapsed += time.perf_counter() - t
                            i += 1
                        row["detect_ms"], row["detect_reads"] = elapsed * 1e3, i
            row["source_reads_per_epoch"] = per_epoch
            row["seconds_per_epoch"] = seconds
            if failure == "hang":
                os.kill(pid, signal.SIGCONT)
    finally:
        cluster.stop()
        if nodes:
            nodes.close()
    return row


def median_row(rows):
    """Medians over rounds of every per-epoch figure and of the detection time."""
    out = dict(rows[0])
    for key in ("held", "detect_ms", "detect_reads"):
        out[key] = statistics.median(r[key] for r in rows)
    for key in ("source_reads_per_epoch", "seconds_per_epoch"):
        out[key] = [statistics.median(r[key][i] for r in rows) for i in range(len(rows[0][key]))]
    out["rounds"] = rows
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--size", type=int, default=64 << 10)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--source", help="directory for the dataset (for example on the PFS); default: a temporary one")
    ap.add_argument("--netns", action="store_true", help="one network namespace per node (root)")
    ap.add_argument("--servers", type=int, default=4, help="servers, one per node")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="rounds (a new random failure point each); figures are medians")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fitcache-failover-") as work:
        root = args.source or os.path.join(work, "data")
        names = make_dataset(root, args.files, args.size)
        cases = (("recache", "kill"), ("pfs", "kill"), ("replicas=2", "kill"), ("recache", "hang"))
        rounds = {c: [] for c in cases}
        for rnd in range(args.repeats):
            for p, f in cases:
                rounds[(p, f)].append(run(p, f, args.epochs, work, root, names, args.netns, args.seed + rnd,
                                          args.servers))
                shutil.rmtree(Path(work) / f"run-{p}-{f}", ignore_errors=True)
        rows = [median_row(rs) for rs in rounds.values()]
    where = "network namespaces" if args.netns else "loopback addresses"
    print(f"\n{args.files} files of {args.size >> 10} KiB in {root}, {args.servers} servers on {where}, failure at a random "
          f"point of epoch 2, rpc_timeout 0.5 s, threshold 3, medians over {args.repeats} rounds\n")
    print("| policy | failure | files on the failed server | failure to declared dead (reads) | source reads per epoch | seconds per epoch | total s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['failure']} | {r['held']:g} | {r['detect_ms']:.1f} ms ({r['detect_reads']:g}) | "
              f"{', '.join(f'{x:g}' for x in r['source_reads_per_epoch'])} | "
              f"{', '.join(f'{x:.2f}' for x in r['seconds_per_epoch'])} | {sum(r['seconds_per_epoch']):.2f} |")
    if args.out:
        Path(args.out).write_text(__import__("json").dumps(rows, indent=2))


if __name__ == "__main__":
    main()
