#!/usr/bin/env python3
"""One installed FitCache against plain reads, for comparing two versions of FitCache on one
machine: run it with each version's Python (a virtualenv per version), interleaved, and
compare the JSON lines. A single run measures, on bench_scale.py's ImageNet-like dataset
(--files files; generated once under --data):

  cold   the first epoch of FitCacheDataset from a fresh embedded server and empty tiers
         (a memory tier; the server is started before the clock), against plain reads of the
         page-cached source in the same run
  warm   --epochs epochs with fresh workers (the DataLoader's default) over the warm cache,
         each against a plain epoch over a /dev/shm copy just before it

through a DataLoader (--workers workers, batch 64, shuffled, fork), zlib.crc32 of every item
in the worker and checked against the manifest. CPU is user + system of every process per
file: this process, its workers (reaped), and the server. Ratios are plain's seconds over
FitCache's; warm figures are medians over the epochs. --prefetch 0 turns prefetch off.

  for v in old new; do /path/to/$v/.venv/bin/python bench/bench_versions.py --tag $v; done
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import fitcache  # noqa: E402
from bench_scale import copy_tree, generate  # noqa: E402


class Crc(Dataset):
    """Item i: (i, crc32 of file i) read by read(path)."""

    def __init__(self, names, read):
        self.names, self.read = names, read

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        return i, zlib.crc32(self.read(i))


def plain_reader(base, names):
    def read(i):
        with open(os.path.join(base, names[i]), "rb") as f:
            return f.read()
    return read


def process_cpu(pid):
    """User + system seconds of process pid so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def epoch(dataset, workers, seed, want, server=None):
    """One shuffled epoch: (seconds, CPU microseconds per file of every process)."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    server_before = process_cpu(server) if server else 0.0
    before, start = os.times(), time.perf_counter()
    for idx, crc in DataLoader(dataset, batch_size=64, num_workers=workers, shuffle=True, generator=gen):
        for i, c in zip(idx.tolist(), crc.tolist()):
            if c != want[i]:
                raise SystemExit(f"item {i}: crc {c:#x}, manifest says {want[i]:#x}")
    seconds, after = time.perf_counter() - start, os.times()
    cpu = sum(getattr(after, k) - getattr(before, k) for k in ("user", "system", "children_user", "children_system"))
    if server:
        cpu += process_cpu(server) - server_before
    return seconds, cpu / len(dataset) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True, help="names this version in the output")
    ap.add_argument("--files", type=int, default=6000)
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-scale")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=1, help="1: FitCacheDataset's default; 0: off")
    args = ap.parse_args()

    src, manifest, _ = generate(args.data, args.files, args.seed)
    names = [rel for rel, _, _ in manifest]
    want = [crc for _, _, crc in manifest]
    work = tempfile.mkdtemp(prefix="fitcache-versions-")
    shm, tiers = tempfile.mkdtemp(dir="/dev/shm"), tempfile.mkdtemp(dir="/dev/shm")
    runtime = os.path.join(work, "run")
    server = None
    try:
        copy_tree(src, shm, names)
        src_s, src_cpu = epoch(Crc(names, plain_reader(src, names)), args.workers, 0, want)
        options = {"tiers": f"memory:{tiers}:4GiB", "runtime_dir": runtime}
        subprocess.run([sys.executable, "-c", f"import fitcache; fitcache.Client({src!r}, **{options!r}).close()"],
                       check=True)
        with open(os.path.join(runtime, "server.lock")) as f:
            server = int(f.read().strip())
        ds = fitcache.FitCacheDataset(src, files=names, prefetch=bool(args.prefetch), **options)
        cold_s, cold_cpu = epoch(Crc(names, ds.__getitem__), args.workers, 0, want, server)
        warm, plain = [], []
        for e in range(1, args.epochs + 1):
            plain.append(epoch(Crc(names, plain_reader(shm, names)), args.workers, e, want))
            warm.append(epoch(Crc(names, ds.__getitem__), args.workers, e, want, server))
        time.sleep(0.5)  # readers' reports are recorded in the background
        stats = ds.stats()["server"]
        ds.close()

        def med(rows, k):
            return statistics.median(r[k] for r in rows)
        print(json.dumps({
            "tag": args.tag, "version": fitcache.__version__ if hasattr(fitcache, "__version__") else None,
            "cores": os.cpu_count(), "workers": args.workers, "files": args.files, "prefetch": args.prefetch,
            "cold_vs_source": round(src_s / cold_s, 3), "cold_cpu_us": round(cold_cpu, 1),
            "source_cpu_us": round(src_cpu, 1),
            "warm_vs_shm": round(statistics.median(p[0] / w[0] for p, w in zip(plain, warm)), 3),
            "warm_cpu_us": round(med(warm, 1), 1), "shm_cpu_us": round(med(plain, 1), 1),
            "source_reads": stats["source_reads"], "reader_fills": stats.get("reader_fills", 0)}), flush=True)
    finally:
        if server:
            try:
                os.kill(server, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for d in (shm, tiers, work):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
