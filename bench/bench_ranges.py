#!/usr/bin/env python3
"""Ranges of a large file through the API (issue 19, blocks): a program reads --ranges
(default 6,000) random ranges of --range-bytes (default 64 KiB) of one file of --size bytes
(default 3 GiB, random bytes, kept under --data) with `fitcache.Client.pread_into` (fc_pread)
into one buffer, as an indexed or sharded dataset reader does, and the same ranges with
os.preadv of the file opened once (plain; the file is in the page cache, read once first).
--api pread compares Client.pread with os.pread instead (new bytes per range).

FitCache's embedded server gets a memory tier under --tier-parent (default /dev/shm) of
--tier-bytes (default 2.5 GiB: smaller than the file) and caches the file in blocks of
--block-size (a list to compare: "1MiB,4MiB,16MiB"). Each round starts a new private cache
and reads the ranges in passes: pass 1 finds nothing cached (the source is read at once and
the blocks read are cached in the background), passes 2 and 3 are warm. Between passes the
bench waits for the server's block fills to end. Source opens are counted by inotify on
the file's directory, from outside FitCache.

    python bench/bench_ranges.py --out bench/results/ranges-2026-11-26.json

With --drop-caches the plain pass and FitCache's first pass read a cold file (on a parallel
file system: --data /mnt/pfs/..., see bench/README.md). With --workers N each pass is read by
N processes forked after the client was opened, as DataLoader workers are (they cannot run
Go: the library's C hit path serves them), against N forked processes reading plainly.

Reported per block size: each pass's time as a ratio of plain's (plain / FitCache: above 1
is faster), medians over --repeats rounds; source opens in all; blocks cached.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import fitcache  # noqa: E402
from bench_large import make_file, warm  # noqa: E402
from inotify import OpenCounter  # noqa: E402


def offsets(args):
    rng = random.Random(1)
    return [rng.randrange(0, args.size - args.range_bytes) for _ in range(args.ranges)]


def in_workers(workers, read_share):
    """Runs read_share(i, workers) in workers processes forked from this one, as a DataLoader
    forks its workers (after the parent loaded the library: they cannot run Go), and returns
    the seconds until the last ended and the bytes they read in all."""
    t = time.perf_counter()
    pipes = []
    for i in range(workers):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                os.write(w, str(read_share(i, workers)).encode())
            finally:
                os._exit(0)
        os.close(w)
        pipes.append((pid, r))
    got = 0
    for pid, r in pipes:
        out = os.read(r, 64)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not out:
            sys.exit(f"a worker failed (status {status})")
        got += int(out)
    return time.perf_counter() - t, got


def plain_pass(path, offs, length, api, workers=0):
    if workers:
        def share(i, n):
            fd = os.open(path, os.O_RDONLY)
            buf = [bytearray(length)]
            return sum(os.preadv(fd, buf, o) for o in offs[i::n])
        return in_workers(workers, share)
    fd = os.open(path, os.O_RDONLY)
    try:
        if api == "pread":
            t = time.perf_counter()
            got = sum(len(os.pread(fd, length, o)) for o in offs)
        else:
            buf = [bytearray(length)]
            t = time.perf_counter()
            got = sum(os.preadv(fd, buf, o) for o in offs)
        return time.perf_counter() - t, got
    finally:
        os.close(fd)


def drop_caches():
    """Empties the page cache (clean pages only; tmpfs keeps its pages): the next reads of the
    file go to its file system."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def fitcache_pass(client, path, offs, length, api, workers=0):
    if workers:
        def share(i, n):
            buf = bytearray(length)
            return sum(client.pread_into(path, buf, o) for o in offs[i::n])
        return in_workers(workers, share)
    if api == "pread":
        t = time.perf_counter()
        got = sum(len(client.pread(path, length, o)) for o in offs)
    else:
        buf = bytearray(length)
        t = time.perf_counter()
        got = sum(client.pread_into(path, buf, o) for o in offs)
    return time.perf_counter() - t, got


def servers_total(stats, key):
    """A counter of the server, or summed over the servers of a cluster."""
    if "servers" in stats:
        return sum(s.get(key, 0) for s in stats["servers"].values() if isinstance(s, dict))
    return (stats.get("server") or {}).get(key, 0)


def settled(client):
    """Waits until the servers' block fills end (published stops growing); returns the stats."""
    last, deadline = -1, time.monotonic() + 300
    while time.monotonic() < deadline:
        s = client.stats()
        if servers_total(s, "published") == last:
            return s
        last = servers_total(s, "published")
        time.sleep(0.5)
    sys.exit("block fills did not settle in 300 s")


def passes(client, opens, path, offs, args):
    """Reads the ranges --passes times through client, waiting for the block fills after
    each pass; returns a row per pass."""
    rows = []
    for p in range(1, args.passes + 1):
        took, got = fitcache_pass(client, path, offs, args.range_bytes, args.api, args.workers)
        if got != len(offs) * args.range_bytes:
            sys.exit(f"pass {p}: {got} bytes read, want {len(offs) * args.range_bytes}")
        stats = settled(client)
        rows.append({"pass": p, "seconds": took, "source_opens": sum(opens.counts().values()),
                     "client": stats["client"], "published": servers_total(stats, "published"),
                     "source_reads": servers_total(stats, "source_reads")})
    return rows


def fresh_process(fn, *fn_args):
    """Runs fn(*fn_args) in a new interpreter (multiprocessing's spawn) and returns its result:
    each round starts with what a new program has, the library included (the heat of blocks
    it keeps for its processes would otherwise carry over from the rounds before)."""
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, fn_args)


def fitcache_round(path, offs, args, block_size):
    tier = Path(tempfile.mkdtemp(prefix="fitcache-bench-ranges-", dir=args.tier_parent))
    runtime = Path(tempfile.mkdtemp(prefix="fitcache-bench-run-"))
    rows = []  # when the round fails before its passes
    try:
        with OpenCounter(str(path.parent)) as opens, fitcache.Client(
                path.parent, tiers=f"memory:{tier}:{args.tier_bytes}", runtime_dir=str(runtime),
                block_size=block_size, prefetch="0") as client:
            rows = passes(client, opens, path, offs, args)
    finally:
        subprocess.run([fitcache._native.server_binary(), "stop"], capture_output=True, timeout=60,
                       env={**os.environ, "FITCACHE_RUNTIME_DIR": str(runtime)})
        shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
    return rows


def cluster_round(path, offs, args, block_size):
    """fitcache_round with --servers servers on loopback nodes 127.0.0.1..N (memory tiers of
    --tier-bytes each, node sockets on): the reader on the first node reads through its
    node's server, which forwards the ranges of blocks other servers own."""
    from harness import Cluster  # tests/harness.py
    work = Path(tempfile.mkdtemp(prefix="fitcache-bench-ranges-cluster-"))
    cluster = Cluster(work, str(path.parent), nodes=[f"127.0.0.{i + 1}" for i in range(args.servers)],
                      budget=args.tier_bytes,
                      serve_options={"rpc_timeout": "5", "wait_timeout": "5", "block_size": block_size, "prefetch": "0"})
    rows = []  # when the round fails before its passes
    try:
        with OpenCounter(str(path.parent)) as opens, fitcache.Client(path.parent, **cluster.options()) as client:
            rows = passes(client, opens, path, offs, args)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=3 << 30, help="bytes of the large file")
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-ranges", help="where the file is kept")
    ap.add_argument("--ranges", type=int, default=6000)
    ap.add_argument("--range-bytes", type=int, default=64 << 10)
    ap.add_argument("--tier-bytes", default="2560MiB", help="the memory tier's budget")
    ap.add_argument("--tier-parent", default="/dev/shm")
    ap.add_argument("--block-size", default="4MiB", help="comma-separated block sizes to compare")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--servers", type=int, default=0,
                    help="cluster mode: this many servers on loopback nodes, each with a tier of --tier-bytes")
    ap.add_argument("--api", choices=("pread_into", "pread"), default="pread_into",
                    help="Client.pread_into into one buffer against os.preadv, or Client.pread "
                         "(new bytes per range) against os.pread")
    ap.add_argument("--workers", type=int, default=0,
                    help="read each pass in this many processes forked from the reader after it opened "
                         "the client (DataLoader workers: C only, no Go), each a share of the ranges; "
                         "plain reads the same way")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true",
                    help="cold: drop the page cache (root) before the plain pass and before FitCache's "
                         "first, instead of reading the file into it")
    ap.add_argument("--out", help="JSON results")
    args = ap.parse_args()

    path = Path(args.data) / f"large-{args.size}.bin"
    make_file(path, args.size)
    offs = offsets(args)
    results = {"args": vars(args), "rounds": []}
    for r in range(args.repeats):
        for bs in args.block_size.split(","):
            if args.drop_caches:
                drop_caches()
            else:
                warm(path)
            plain, _ = plain_pass(path, offs, args.range_bytes, args.api, args.workers)
            if args.drop_caches:
                drop_caches()
            rows = fresh_process(cluster_round if args.servers else fitcache_round, path, offs, args, bs)
            results["rounds"].append({"round": r, "block_size": bs, "plain_s": plain, "passes": rows})
            print(f"round {r} block {bs}: plain {plain:.3f} s; " + "; ".join(
                f"pass {x['pass']} {x['seconds']:.3f} s ({plain / x['seconds']:.2f}x), "
                f"{x['client']['source_ranges']} ranges from the source, opens so far {x['source_opens']}"
                for x in rows), flush=True)
    summary = {}
    for bs in args.block_size.split(","):
        rounds = [x for x in results["rounds"] if x["block_size"] == bs]
        summary[bs] = {
            f"pass {p}": round(statistics.median(x["plain_s"] / x["passes"][p - 1]["seconds"] for x in rounds), 2)
            for p in range(1, args.passes + 1)}
        summary[bs]["source opens (max)"] = max(x["passes"][-1]["source_opens"] for x in rounds)
        summary[bs]["blocks cached (min)"] = min(x["passes"][-1]["published"] for x in rounds)
        summary[bs]["blocks in the file"] = -(-args.size // fitcache_block_bytes(bs))
    results["summary"] = summary
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def fitcache_block_bytes(s):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[:-len(u)]) * m)
    return int(s)


if __name__ == "__main__":
    main()
