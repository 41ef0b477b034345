#!/usr/bin/env python3
"""Large files under the transparent mode (issue 19, first part): a program opens one large
file (--size, default 2 GiB, random bytes, kept under --data) and reads --ranges (default
2,000) random ranges of --range-bytes (default 64 KiB) with os.pread, as an indexed or HDF5
reader does. Measured per run: the time of the open, the time of the ranges, and the source
opens (inotify on the file's directory, from outside FitCache).

Configurations, in each of --repeats rounds (medians reported):

  plain           the program alone; the file is in the page cache (read once first)
  fitcache-cold   under `fitcache run --data DIR --prefetch 0` with a new private cache (a
                  memory tier under --tier-parent, default /dev/shm, that holds the file):
                  the first open
  fitcache-warm   the same cache once the file's copy is published: the next open

With --servers N (N >= 2), the same in cluster mode instead: N servers on loopback addresses
127.0.0.1..N (`fitcache serve --servers ...`, memory tiers of --size + 1 GiB), the program on
the first one's node under `fitcache run` with the job's servers (FITCACHE_SERVERS), a new
cluster per round (so the file's owner, on the ring, changes with the servers' ports). Each
round says whether the owner was the reader's node or another; "warm" is the next open once
the owner has cached the file (a file over 64 MiB of another node is then still read from
the source: it is too large to send whole).

    python bench/bench_large.py --out bench/results/large-2026-11-26.json
    python bench/bench_large.py --servers 3 --size 50331648 --out bench/results/large-cluster-2026-11-26.json

The figures are ratios against plain reads measured in the same round.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import fitcache  # noqa: E402
from inotify import OpenCounter  # noqa: E402

# The program under test: one open, then the ranges; one JSON line out.
READER = r'''
import json, os, random, sys, time
path, ranges, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = time.perf_counter()
fd = os.open(path, os.O_RDONLY)
opened = time.perf_counter() - t
size = os.fstat(fd).st_size
rng = random.Random(1)
t = time.perf_counter()
got = 0
for _ in range(ranges):
    got += len(os.pread(fd, length, rng.randrange(0, size - length)))
took = time.perf_counter() - t
os.close(fd)
print(json.dumps({"open_s": opened, "ranges_s": took, "bytes": got}))
'''


def make_file(path, size):
    """Writes size random bytes at path unless a file of that size is there already."""
    if path.exists() and path.stat().st_size == size:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n
    tmp.rename(path)


def warm(path):
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def run_reader(cmd_prefix, path, args, env=None):
    out = subprocess.run([*cmd_prefix, sys.executable, "-c", READER, str(path), str(args.ranges),
                          str(args.range_bytes)], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"reader failed: {out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def published(fc, env):
    out = subprocess.run([fc, "stats", "--json"], env=env, capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and json.loads(out.stdout)["published"] >= 1


def fitcache_round(path, args, work):
    """One cold and one warm run on a new private cache; returns both rows."""
    fc = fitcache._native.server_binary()
    tier = Path(tempfile.mkdtemp(prefix="fitcache-bench-large-", dir=args.tier_parent))
    runtime = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    budget = (args.size >> 20) + 1024
    env = {**os.environ, "FITCACHE_RUNTIME_DIR": str(runtime), "FITCACHE_TIERS": f"memory:{tier}:{budget}MiB"}
    prefix = [fc, "run", "--data", str(path.parent), "--prefetch", "0", "--"]
    rows = {}
    try:
        with OpenCounter(str(path.parent)) as opens:
            rows["fitcache-cold"] = run_reader(prefix, path, args, env)
            rows["fitcache-cold"]["source_opens"] = sum(opens.counts().values())
            deadline = time.monotonic() + 300
            while not published(fc, env):
                if time.monotonic() > deadline:
                    sys.exit("the copy was not published in 300 s")
                time.sleep(0.1)
            seen = sum(opens.counts().values())
            rows["fitcache-warm"] = run_reader(prefix, path, args, env)
            rows["fitcache-warm"]["source_opens"] = sum(opens.counts().values()) - seen
    finally:
        subprocess.run([fc, "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(tier, ignore_errors=True)
    return rows


def cluster_round(path, args, work):
    """One cold and one warm run in a new loopback cluster of args.servers servers."""
    from harness import Cluster, cached_names  # noqa: E402 (tests/harness.py)

    fc = fitcache._native.server_binary()
    tmp = Path(tempfile.mkdtemp(prefix="cluster-", dir=work))
    budget = f"{(args.size >> 20) + 1024}MiB"
    cluster = Cluster(tmp, str(path.parent), nodes=[f"127.0.0.{i + 1}" for i in range(args.servers)],
                      budget=budget, serve_options={"rpc_timeout": "5", "wait_timeout": "5"})
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("FITCACHE_")}
    env.update({"FITCACHE_SERVERS": ",".join(cluster.addrs), "FITCACHE_TOKEN_FILE": cluster.token_file,
                "FITCACHE_NODE": cluster.node, "FITCACHE_RUNTIME_DIR": str(tmp / "client-run")})
    prefix = [fc, "run", "--data", str(path.parent), "--prefetch", "0", "--"]
    rows = {}
    try:
        with OpenCounter(str(path.parent)) as opens:
            rows["fitcache-cold"] = run_reader(prefix, path, args, env)
            holders = []
            deadline = time.monotonic() + 300
            while not holders:
                holders = [a for a in cluster.addrs if path.name in cached_names(cluster, a)]
                if time.monotonic() > deadline:
                    sys.exit("the file was not cached in 300 s")
                time.sleep(0.1)
            time.sleep(1)  # a node-local copy, if any, comes after the owner's
            owner_remote = any(a != cluster.addrs[0] for a in holders)
            seen = sum(opens.counts().values())  # the program's and the copy's
            rows["fitcache-cold"]["source_opens"] = seen
            rows["fitcache-warm"] = run_reader(prefix, path, args, env)
            rows["fitcache-warm"]["source_opens"] = sum(opens.counts().values()) - seen
            for row in rows.values():
                row["owner"] = "another node" if owner_remote else "the reader's node"
    finally:
        cluster.stop()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=2 << 30, help="bytes of the large file")
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-large", help="where the file is kept")
    ap.add_argument("--ranges", type=int, default=2000)
    ap.add_argument("--range-bytes", type=int, default=64 << 10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tier-parent", default="/dev/shm",
                    help="where the memory tier is made (a tmpfs; for example one mounted with huge=within_size)")
    ap.add_argument("--servers", type=int, default=0, help="cluster mode with this many servers (see above)")
    ap.add_argument("--out", help="JSON results")
    args = ap.parse_args()
    path = Path(args.data) / f"large-{args.size}" / "large.bin"
    make_file(path, args.size)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="fitcache-bench-large-") as work:
        for r in range(args.repeats):
            warm(path)
            row = {"plain": run_reader([], path, args)}
            row.update(cluster_round(path, args, work) if args.servers >= 2 else fitcache_round(path, args, work))
            rounds.append(row)
            print(json.dumps(row), flush=True)
    configs = ["plain", "fitcache-cold", "fitcache-warm"]
    med = {c: {k: statistics.median(r[c][k] for r in rounds) for k in ("open_s", "ranges_s")} for c in configs}
    for c in configs[1:]:
        med[c]["source_opens"] = [r[c]["source_opens"] for r in rounds]
    results = {"args": vars(args), "rounds": rounds, "medians": med,
               "loadavg": open("/proc/loadavg").read().split()[:3]}
    print(f"\n{args.size >> 20} MiB file, {args.ranges} random ranges of {args.range_bytes >> 10} KiB, "
          f"medians of {args.repeats} rounds\n")
    print("| configuration | open ms | ranges s | ranges vs plain | source opens per round |")
    print("|---|---|---|---|---|")
    for c in configs:
        m = med[c]
        opens = ", ".join(str(n) for n in m.get("source_opens", [])) or "-"
        print(f"| {c} | {m['open_s'] * 1e3:.3f} | {m['ranges_s']:.3f} | "
              f"{med['plain']['ranges_s'] / m['ranges_s']:.2f}x | {opens} |")
    if args.servers >= 2:
        print("\nper round: " + "; ".join(
            f"owner on {r['fitcache-cold']['owner']}, cold open {r['fitcache-cold']['open_s'] * 1e3:.2f} ms, "
            f"warm open {r['fitcache-warm']['open_s'] * 1e3:.2f} ms" for r in rounds))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
