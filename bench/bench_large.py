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

With --drop-caches, the plain run and FitCache's first read a cold file instead (the page
cache dropped before each): for a file on a parallel file system (--data /mnt/pfs/...).

With --tier-bytes smaller than the file, no tier takes it whole: the program gets its source,
and the shim serves its reads from the blocks the server caches (preload/ranges.c). Each run
of the program is then a pass over the same ranges, --passes of them (fitcache-cold, then
fitcache-warm, fitcache-pass3...), each once the server's block fills settled.

With --servers N (N >= 2), the same in cluster mode instead: N servers on loopback addresses
127.0.0.1..N (`fitcache serve --servers ...`, memory tiers of --size + 1 GiB), the program on
the first one's node under `fitcache run` with the job's servers (FITCACHE_SERVERS), a new
cluster per round (so the file's owner, on the ring, changes with the servers' ports). Each
round says whether the owner was the reader's node or another; "warm" is the next open once
the owner has cached the file (a file over 64 MiB of another node is then still read from
the source: it is too large to send whole).

--workload h5py reads slices of an HDF5 dataset with h5py instead (--ranges slices of
--range-bytes: 184 of 1 MiB read 9% of 2 GiB, as in the issue); --workload shards reads 8
tar shards of 256 MiB (100 KiB samples) in order with tarfile, as WebDataset does.

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

# --workload h5py: the file is an HDF5 file of one 2-D dataset "x" (rows of 64 KiB of
# float32); the program opens it with h5py and reads --ranges random slices of whole rows,
# --range-bytes each, as a training loop over an HDF5 dataset does.
READER_H5 = r'''
import json, random, sys, time
import h5py
path, ranges, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = time.perf_counter()
f = h5py.File(path, "r")
x = f["x"]
opened = time.perf_counter() - t
rows = max(1, length // (x.shape[1] * x.dtype.itemsize))
rng = random.Random(1)
t = time.perf_counter()
got = 0
for _ in range(ranges):
    start = rng.randrange(0, x.shape[0] - rows)
    got += x[start:start + rows].nbytes
took = time.perf_counter() - t
f.close()
print(json.dumps({"open_s": opened, "ranges_s": took, "bytes": got}))
'''

# --workload shards: the "file" is a directory of tar shards of 100 KiB samples, as
# WebDataset stores a dataset; the program reads every sample of every shard in order with
# tarfile, as WebDataset's reader does (--ranges and --range-bytes are unused).
READER_SHARDS = r'''
import json, os, sys, tarfile, time
path = sys.argv[1]
opened, got = None, 0
t = time.perf_counter()
for name in sorted(os.listdir(path)):
    t0 = time.perf_counter()
    with tarfile.open(os.path.join(path, name), "r|") as tar:
        if opened is None:
            opened = time.perf_counter() - t0
        for member in tar:
            if member.isfile():
                got += len(tar.extractfile(member).read())
took = time.perf_counter() - t
print(json.dumps({"open_s": opened, "ranges_s": took, "bytes": got}))
'''

READERS = {"ranges": READER, "h5py": READER_H5, "shards": READER_SHARDS}


def make_h5(path, size):
    """Writes an HDF5 file of about size bytes (dataset "x", rows of 64 KiB of random float32)
    unless one is there already."""
    import h5py
    import numpy as np
    if path.exists() and path.stat().st_size >= size:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    cols = (64 << 10) // 4
    rows = size // (64 << 10)
    rng = np.random.default_rng(1)
    with h5py.File(tmp, "w") as f:
        x = f.create_dataset("x", shape=(rows, cols), dtype="float32")
        for start in range(0, rows, 1024):
            n = min(1024, rows - start)
            x[start:start + n] = rng.random((n, cols), dtype=np.float32)
    tmp.rename(path)


def make_shards(path, size, shard_bytes=256 << 20, sample_bytes=100 << 10):
    """Writes tar shards of random 100 KiB samples, about size bytes in all, under the
    directory path unless they are there already; returns their paths."""
    import io
    import tarfile
    shards = max(1, size // shard_bytes)
    names = [path / f"shard-{i:05d}.tar" for i in range(shards)]
    if all(n.exists() for n in names):
        return names
    path.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        tmp = name.with_suffix(".partial")
        with tarfile.open(tmp, "w") as tar:
            for j in range(shard_bytes // sample_bytes):
                data = os.urandom(sample_bytes)
                info = tarfile.TarInfo(f"{i:05d}-{j:06d}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        tmp.rename(name)
    return names


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


def drop_caches():
    """Empties the page cache (clean pages only; tmpfs keeps its pages): the next reads of the
    file go to its file system."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def warm(path):
    for p in sorted(path.iterdir()) if path.is_dir() else [path]:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def run_reader(cmd_prefix, path, args, env=None):
    out = subprocess.run([*cmd_prefix, sys.executable, "-c", READERS[args.workload], str(path), str(args.ranges),
                          str(args.range_bytes)], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"reader failed: {out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def server_stats(fc, env):
    out = subprocess.run([fc, "stats", "--json"], env=env, capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else None


def published(fc, env, files=1):
    stats = server_stats(fc, env)
    return stats is not None and stats["published"] >= files


def settle(fc, env, timeout=300):
    """Waits until the server published nothing new for a second (its block fills ended)."""
    last, deadline = -1, time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server_stats(fc, env)
        now = stats["published"] if stats else -1
        if now == last:
            return stats
        last = now
        time.sleep(1)
    sys.exit(f"block fills did not settle in {timeout} s")


def pass_name(i):
    return ["fitcache-cold", "fitcache-warm"][i] if i < 2 else f"fitcache-pass{i + 1}"


def fitcache_round(path, args, work):
    """One cold and one warm run on a new private cache; returns both rows."""
    fc = fitcache._native.server_binary()
    tier = Path(tempfile.mkdtemp(prefix="fitcache-bench-large-", dir=args.tier_parent))
    runtime = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    budget = args.tier_bytes or f"{(args.size >> 20) + 1024}MiB"
    env = {**os.environ, "FITCACHE_RUNTIME_DIR": str(runtime), "FITCACHE_TIERS": f"memory:{tier}:{budget}"}
    if args.block_size:
        env["FITCACHE_BLOCK_SIZE"] = args.block_size
    data = path if path.is_dir() else path.parent
    files = len(list(path.iterdir())) if path.is_dir() else 1
    prefix = [fc, "run", "--data", str(data), "--prefetch", "0", "--"]
    rows = {}
    try:
        with OpenCounter(str(data)) as opens:
            seen = 0
            if args.drop_caches:
                drop_caches()
            for i in range(args.passes):
                if i > 0 and args.tier_bytes:
                    settle(fc, env)
                elif i > 0:
                    deadline = time.monotonic() + 300
                    while not published(fc, env, files):
                        if time.monotonic() > deadline:
                            sys.exit("the copy was not published in 300 s")
                        time.sleep(0.1)
                row = rows[pass_name(i)] = run_reader(prefix, path, args, env)
                row["source_opens"] = sum(opens.counts().values()) - seen
                seen += row["source_opens"]
                stats = server_stats(fc, env) or {}
                row["server"] = {k: stats.get(k) for k in ("published", "bytes_served", "source_reads", "uncached")}
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
    ap.add_argument("--tier-bytes", help="the memory tier's size (default: the file's and 1 GiB)")
    ap.add_argument("--block-size", help="the server's block_size (default: its own)")
    ap.add_argument("--passes", type=int, default=2, help="runs of the program on one cache (see above)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="cold: drop the page cache (root) before the plain run and before FitCache's first "
                         "(instead of reading the file into it), for a file on a parallel file system")
    ap.add_argument("--workload", choices=sorted(READERS), default="ranges",
                    help="ranges: os.pread of one file; h5py: slices of an HDF5 dataset; shards: tar "
                         "shards read in order, as WebDataset reads them")
    ap.add_argument("--out", help="JSON results")
    args = ap.parse_args()
    if args.workload == "h5py":
        path = Path(args.data) / f"h5-{args.size}" / "large.h5"
        make_h5(path, args.size)
    elif args.workload == "shards":
        path = Path(args.data) / f"shards-{args.size}" / "shards"
        make_shards(path, args.size)
    else:
        path = Path(args.data) / f"large-{args.size}" / "large.bin"
        make_file(path, args.size)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="fitcache-bench-large-") as work:
        for r in range(args.repeats):
            if args.drop_caches:
                drop_caches()
            else:
                warm(path)
            row = {"plain": run_reader([], path, args)}
            row.update(cluster_round(path, args, work) if args.servers >= 2 else fitcache_round(path, args, work))
            rounds.append(row)
            print(json.dumps(row), flush=True)
    configs = ["plain"] + [pass_name(i) for i in range(args.passes if args.servers < 2 else 2)]
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
