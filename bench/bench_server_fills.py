#!/usr/bin/env python3
"""What a fill costs the embedded server: its CPU per file (user + system, /proc/PID/stat)
when it reads the files from the source itself (a prefetch of --files files, `prefetch(wait=True)`,
no reader reading), and when readers fill their own misses and it only records their copies
(prefetch off, one process reading every file once). Each round starts a fresh server over
empty tiers for each way; the readers' own CPU per file is reported beside the server's.

The dataset is bench_scale.py's (the first --files files of its 20,000-file set, generated
under --data when missing). For comparing builds, run it with each build's Python,
interleaved, and compare the JSON lines it prints:

    for v in old new; do /path/to/$v/.venv/bin/python bench/bench_server_fills.py --tag $v; done

Only the servers this script starts are stopped (by the PID in their runtime directory's
server.lock), and their runtime directories and tiers are removed.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fitcache  # noqa: E402
from bench_preload import process_cpu  # noqa: E402
from bench_scale import generate  # noqa: E402

WAYS = ("server fills", "reader fills")


def own_cpu():
    """CPU seconds of this process so far."""
    t = os.times()
    return t.user + t.system


def one_fill_run(src, names, way):
    """Fills names from empty tiers one way; returns (server, reader) CPU µs per file."""
    work = tempfile.mkdtemp(prefix="fitcache-fills-")
    tier = f"/dev/shm/{os.path.basename(work)}"
    pid = 0
    try:
        ds = fitcache.FitCacheDataset(src, zlib.crc32, files=names, prefetch=False,
                                      runtime_dir=os.path.join(work, "run"), tiers=f"memory:{tier}:4GiB")
        ds[0]  # starts the server: its start is not measured
        with open(os.path.join(work, "run", "server.lock")) as f:
            pid = int(f.read().split()[0])
        server0, reader0 = process_cpu(pid), own_cpu()
        if way == "server fills":
            ds.prefetch(wait=True)
        else:
            for i in range(1, len(names)):
                ds[i]
        time.sleep(0.5)  # the last reports recorded
        n = len(names) - 1
        return (process_cpu(pid) - server0) / n * 1e6, (own_cpu() - reader0) / n * 1e6
    finally:
        if pid:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if not os.path.exists(f"/proc/{pid}"):
                    break
                time.sleep(0.05)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True, help="names this build in the output")
    ap.add_argument("--files", type=int, default=6000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-scale", help="where generated datasets are kept")
    args = ap.parse_args()
    src, manifest, _ = generate(args.data, 20000, 1)
    names = [rel for rel, _, _ in manifest][:args.files]
    rounds = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            rounds[way].append(one_fill_run(src, names, way))
    out = {"tag": args.tag, "files": len(names) - 1, "fitcache": os.path.dirname(fitcache.__file__)}
    for way, rows in rounds.items():
        out[way] = {"server_cpu_us_per_file": statistics.median(s for s, _ in rows),
                    "reader_cpu_us_per_file": statistics.median(c for _, c in rows),
                    "rounds": [[round(s), round(c)] for s, c in rows]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
