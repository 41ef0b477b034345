#!/usr/bin/env python3
"""Source reads caused by an embedded server's restart while readers read: a warm private
cache of --files files (bench_scale.py's dataset), --readers processes forked from the main
process (as DataLoader workers are), each with --threads threads, reading every file over and
over through the C hit path, the server killed (SIGKILL) and then restarted by the main process (Client.check_server, as
FitCacheDataset does before each fork), --restarts times. A restarted server rescans its tiers
and writes a new index, which the readers move to at once; every file is cached, so every
source open counted after the first kill (inotify, from outside FitCache) is a read that the
restart caused. Reported: source opens, reads, reads that returned wrong bytes, and the
seconds each restart took.

Compare builds with FITCACHE_LIBRARY and FITCACHE_SERVER_BIN:

    python bench/bench_restart_reads.py --files 20000 --readers 2 --restarts 5
    python bench/bench_restart_reads.py --files 20000 --readers 2 --threads 4 --restarts 10
"""

import argparse
import fcntl
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fitcache  # noqa: E402
from bench_scale import generate  # noqa: E402
from inotify import OpenCounter  # noqa: E402
from privatecache import PrivateCache  # noqa: E402


def read_until(ds, crcs, stop_at, seed, totals):
    """Reads every file in a shuffled order until stop_at (time.monotonic()); adds its reads
    and bad reads to totals."""
    order = list(range(len(crcs)))
    random.Random(seed).shuffle(order)
    reads = bad = 0
    while time.monotonic() < stop_at:
        for i in order:
            if zlib.crc32(ds[i]) != crcs[i]:
                bad += 1
            reads += 1
            if reads % 256 == 0 and time.monotonic() >= stop_at:
                break
    totals.append((reads, bad))


def reader(ds, crcs, stop_at, seed, threads, out):
    """One reader process: threads threads (read_until); writes their reads and bad reads
    to out (a pipe) as JSON."""
    totals = []
    pool = [threading.Thread(target=read_until, args=(ds, crcs, stop_at, seed * threads + j, totals))
            for j in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    os.write(out, json.dumps({"reads": sum(r for r, _ in totals), "bad": sum(b for _, b in totals)}).encode())


def wait_unlocked(path, timeout=10):
    """Waits until no process holds the lock file at path: a killed server's threads exit
    after its main thread shows as a zombie, and it holds its lock (and its socket, which
    then resets a client's hello) until the last one has."""
    deadline = time.monotonic() + timeout
    with open(path) as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} still locked after {timeout} s")
                time.sleep(0.001)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="reading threads per reader process")
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds of reading between restarts")
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-scale", help="where generated datasets are kept")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args()

    src, manifest, _ = generate(args.data, 20000, 1)
    manifest = manifest[:args.files]
    names, crcs = [rel for rel, _, _ in manifest], [crc for _, _, crc in manifest]
    work = tempfile.mkdtemp(prefix="fitcache-restart-")
    tier = tempfile.mkdtemp(prefix="fitcache-restart-", dir="/dev/shm")
    cache = PrivateCache(os.path.join(work, "run"), f"memory:{tier}:{2 * 120 * args.files}KiB", [work, tier])
    pids = []
    try:
        ds = fitcache.FitCacheDataset(src, files=names, prefetch=False, **cache.options)
        for i in range(len(ds)):  # cached; this process's client open (its readers share it)
            assert zlib.crc32(ds[i]) == crcs[i]
        restarts = []
        with OpenCounter(src) as opens:
            stop_at = time.monotonic() + args.gap * (args.restarts + 1)
            pipes = []
            for k in range(args.readers):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(r)
                    try:
                        reader(ds, crcs, stop_at, k, args.threads, w)
                    finally:
                        os._exit(0)
                os.close(w)
                pids.append(pid)
                pipes.append(r)
            client = ds._get_client()
            for _ in range(args.restarts):
                time.sleep(args.gap)
                pid = cache.server_pid()
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    wait_unlocked(os.path.join(cache.run, "server.lock"))
                t0 = time.monotonic()
                client.check_server()  # restarts it: it rescans the tier
                restarts.append(time.monotonic() - t0)
            results = []
            for pid, r in zip(pids, pipes):
                os.waitpid(pid, 0)
                data = b""
                while chunk := os.read(r, 4096):
                    data += chunk
                os.close(r)
                results.append(json.loads(data or b'{"reads": 0, "bad": 0}'))
            pids.clear()
            time.sleep(0.2)
            source_opens = sum(opens.counts().values())
        result = {"files": args.files, "readers": args.readers, "threads": args.threads, "restarts": args.restarts,
                  "library": os.environ.get("FITCACHE_LIBRARY", "installed"),
                  "source_opens": source_opens, "reads": sum(x["reads"] for x in results),
                  "bad": sum(x["bad"] for x in results), "restart_seconds": restarts}
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        cache.wipe()


if __name__ == "__main__":
    main()
