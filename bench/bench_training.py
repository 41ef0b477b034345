#!/usr/bin/env python3
"""A real PyTorch training loop over a dataset on the PFS, with each way of reading it, in one
run: per epoch wall time, files/s, MB/s, source reads (inotify on the dataset directory, from
outside the readers), FitCache's hits per tier, and peak RSS. Writes a Markdown table, JSON
and a PNG plot.

Configurations:
  pfs            plain Dataset reading the files on the PFS (the baseline)
  shm            plain Dataset reading a /dev/shm copy (the limit)
  fitcache       FitCacheDataset, memory + disk tiers
  fitcache-disk  FitCacheDataset, disk tier only (the single-tier design of earlier caches)
  fsspec         plain Dataset reading through fsspec's simplecache (local disk copies)

    python bench/bench_training.py --source /mnt/pfs/fitcache-train --out bench/results/training
"""

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CONFIGS = ["pfs", "shm", "fitcache", "fitcache-disk", "fsspec"]
SIZES = {"256KiB": 256 << 10, "8MiB": 8 << 20}


# ---- the training job (runs in a child process per configuration) ----

def decode(data):
    """Bytes to a 3x32x32 image and a label, as a real decoder would touch the bytes."""
    import numpy as np
    import torch
    view = memoryview(data)
    checksum = int(np.frombuffer(view, dtype=np.uint8)[::4096].sum())  # touch every page
    n = 3 * 32 * 32
    pixels = np.frombuffer(view, dtype=np.uint8, count=min(n, len(view))).astype(np.float32) / 255
    image = torch.zeros(n)
    image[: len(pixels)] = torch.from_numpy(pixels)
    return image.view(3, 32, 32), checksum % 10


class PlainFiles:
    """A map-style dataset of plain reads (the baselines)."""

    def __init__(self, paths, opener=None):
        self.paths, self.opener = paths, opener

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        if self.opener is None:
            with open(self.paths[i], "rb") as f:
                return decode(f.read())
        with self.opener(self.paths[i]) as f:
            return decode(f.read())


class SimpleCacheOpener:
    """Opens through fsspec's simplecache (picklable: the filesystem is made per process)."""

    def __init__(self, storage):
        self.storage, self.fs = storage, None

    def __call__(self, path):
        if self.fs is None:
            import fsspec
            self.fs = fsspec.filesystem("simplecache", target_protocol="file", cache_storage=self.storage)
        return self.fs.open(path, "rb")

    def __getstate__(self):
        return {"storage": self.storage, "fs": None}


def run_config(args):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    import fitcache
    from inotify import OpenCounter

    spec = json.loads(args.run_one)
    src, names, config, work = spec["source"], spec["names"], spec["config"], spec["work"]
    paths = [os.path.join(src, n) for n in names]
    server_pid = None
    if config == "pfs":
        ds = PlainFiles(paths)
    elif config == "shm":
        ds = PlainFiles([os.path.join(spec["shm"], n) for n in names])
    elif config == "fsspec":
        ds = PlainFiles(paths, SimpleCacheOpener(os.path.join(work, "fsspec-cache")))
    else:
        tiers = f"disk:{work}/disk:64GiB"
        if config == "fitcache":
            tiers = f"memory:/dev/shm/fitcache-training-{os.getpid()}:8GiB," + tiers
        options = {"runtime_dir": os.path.join(work, "run"), "tiers": tiers}
        ds = fitcache.FitCacheDataset(src, transform=decode, files=names, **options)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(0), persistent_workers=args.persistent)
    epochs = []
    zero = {"hits": {}, "misses": 0, "inflight_hits": 0}
    stats_before = (ds.stats()["server"] or zero) if hasattr(ds, "stats") else None
    with OpenCounter(src) as opens:
        for epoch in range(args.epochs):
            if args.drop_caches and epoch > 0:
                subprocess.run(["sync"])
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            seen_opens = sum(opens.counts().values())
            t = time.perf_counter()
            n = 0
            for images, labels in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(images), labels).backward()
                opt.step()
                time.sleep(args.compute_ms / 1000)  # the rest of a GPU step
                n += len(labels)
            secs = time.perf_counter() - t
            row = {"epoch": epoch + 1, "seconds": secs, "files_per_s": n / secs,
                   "MB_per_s": n * spec["size"] / secs / 1e6,
                   "source_reads": sum(opens.counts().values()) - seen_opens}
            if stats_before is not None:
                time.sleep(1.2)  # persistent workers report their hits every second
                after = ds.stats()["server"] or zero
                hits = {k: v - stats_before["hits"].get(k, 0) for k, v in after["hits"].items()}
                total = sum(hits.values()) + after["misses"] - stats_before["misses"] + \
                    after["inflight_hits"] - stats_before["inflight_hits"]
                row["hit_rate"] = {k: v / total for k, v in hits.items() if v} if total else {}
                stats_before = after
                server_pid = int(Path(options["runtime_dir"], "server.lock").read_text().strip() or 0)
            epochs.append(row)
    del loader
    rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
    out = {"config": config, "epochs": epochs, "peak_rss_bytes": rss}
    if server_pid:
        out["server_peak_rss_bytes"] = vm_hwm(server_pid)
        os.kill(server_pid, signal.SIGTERM)
    print("RESULT " + json.dumps(out), flush=True)


def vm_hwm(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- the driver ----

def make_files(directory, count, size):
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(size)
    names = []
    for i in range(count):
        name = f"c{i % 10}/f{i:06d}.bin"
        p = os.path.join(directory, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        if not (os.path.exists(p) and os.path.getsize(p) == size):
            with open(p + ".tmp", "wb") as f:
                f.write(rng.randbytes(size))
            os.rename(p + ".tmp", p)
        names.append(name)
    return names


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    for ax, (label, runs) in zip(axes if len(results) > 1 else [axes], results.items()):
        configs = [r["config"] for r in runs]
        epochs = len(runs[0]["epochs"])
        width = 0.8 / epochs
        for e in range(epochs):
            ax.bar([i + e * width for i in range(len(configs))], [r["epochs"][e]["files_per_s"] for r in runs],
                   width, label=f"epoch {e + 1}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], configs, rotation=20)
        ax.set_ylabel("files/s (higher is better)")
        ax.set_yscale("log")
        ax.set_title(f"{label} files")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", help="dataset directory on the PFS (files are generated there)")
    ap.add_argument("--small-files", type=int, default=2000)
    ap.add_argument("--large-files", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--persistent", action="store_true", help="persistent DataLoader workers")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--compute-ms", type=float, default=10, help="extra time per batch, mimicking a GPU step")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache between epochs (root)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all configurations; each epoch's figures are medians over rounds")
    ap.add_argument("--out", help="write OUT.json, OUT.md and OUT.png")
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_one:
        return run_config(args)
    if not args.source:
        ap.error("--source is required")
    results = {}
    work = Path(f"/tmp/fitcache-training-{os.getpid()}")
    try:
        for label, count in (("256KiB", args.small_files), ("8MiB", args.large_files)):
            size = SIZES[label]
            src = os.path.join(args.source, label)
            print(f"[{label}] preparing {count} files in {src}", file=sys.stderr, flush=True)
            names = make_files(src, count, size)
            shm = f"/dev/shm/fitcache-training-copy-{os.getpid()}"
            for n in names:
                os.makedirs(os.path.dirname(os.path.join(shm, n)), exist_ok=True)
                shutil.copyfile(os.path.join(src, n), os.path.join(shm, n))
            rounds = {c: [] for c in args.configs.split(",")}
            for rnd in range(args.repeats):
                for config in args.configs.split(","):
                    rounds[config].append(run_one(args, label, config, rnd, src, names, shm, size, work))
            shutil.rmtree(shm, ignore_errors=True)
            results[label] = [median_run(rs) for rs in rounds.values()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = markdown(results, args)
    print(table)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
        Path(args.out + ".md").write_text(table)
        plot(results, args.out + ".png")


def run_one(args, label, config, rnd, src, names, shm, size, work):
    """Runs one configuration in a fresh process, with the page cache dropped first."""
    cwork = work / f"{label}-{config}-{rnd}"
    cwork.mkdir(parents=True)
    subprocess.run(["sync"])
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    spec = {"source": src, "names": names, "config": config, "work": str(cwork), "shm": shm, "size": size}
    cmd = [sys.executable, __file__, "--run-one", json.dumps(spec), *passthrough(args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        raise SystemExit(f"{config} failed:\n{out.stderr[-3000:]}")
    run = json.loads(line[0][7:])
    print(f"[{label}] round {rnd + 1} {config}: " + ", ".join(f"{e['seconds']:.2f}s" for e in run["epochs"]),
          file=sys.stderr, flush=True)
    shutil.rmtree(cwork, ignore_errors=True)
    for d in Path("/dev/shm").glob("fitcache-training-[0-9]*"):
        shutil.rmtree(d, ignore_errors=True)
    return run


def median_run(runs):
    """One run whose every per-epoch figure is the median over rounds (source reads and hit
    rates from the first round: they do not vary)."""
    import statistics
    out = json.loads(json.dumps(runs[0]))
    for i, e in enumerate(out["epochs"]):
        for key in ("seconds", "files_per_s", "MB_per_s"):
            e[key] = statistics.median(r["epochs"][i][key] for r in runs)
        e["seconds_all"] = [r["epochs"][i]["seconds"] for r in runs]
    out["rounds"] = len(runs)
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
    return out


def passthrough(args):
    out = ["--epochs", str(args.epochs), "--workers", str(args.workers), "--batch-size", str(args.batch_size),
           "--compute-ms", str(args.compute_ms)]
    if args.persistent:
        out.append("--persistent")
    if args.drop_caches:
        out.append("--drop-caches")
    return out


def markdown(results, args):
    lines = [f"{args.workers} workers{' (persistent)' if args.persistent else ''}, batch {args.batch_size}, "
             f"{args.compute_ms:g} ms compute per batch, {args.epochs} shuffled epochs, medians over {args.repeats} rounds"
             f"{', page cache dropped between epochs' if args.drop_caches else ''}.", "",
             "| files | reader | epoch | s | files/s | MB/s | vs pfs | source reads | hit rate | peak RSS |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, runs in results.items():
        base = {e["epoch"]: e["seconds"] for e in runs[0]["epochs"]} if runs[0]["config"] == "pfs" else {}
        for r in runs:
            for e in r["epochs"]:
                hit = ", ".join(f"{k} {v:.0%}" for k, v in e.get("hit_rate", {}).items()) or ("-" if "hit_rate" in e else "")
                ratio = f"{base[e['epoch']] / e['seconds']:.2f}x" if base else ""
                rss = r["peak_rss_bytes"] / 2**20
                srv = f" + server {r['server_peak_rss_bytes'] / 2**20:.0f}" if r.get("server_peak_rss_bytes") else ""
                lines.append(f"| {label} | {r['config']} | {e['epoch']} | {e['seconds']:.2f} | {e['files_per_s']:.0f} | "
                             f"{e['MB_per_s']:.0f} | {ratio} | {e['source_reads']} | {hit} | {rss:.0f}{srv} MiB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
