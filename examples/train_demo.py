#!/usr/bin/env python3
"""A short PyTorch training run over a generated dataset, read through FitCache.

It writes a dataset of random "images" (files of raw bytes) unless --data names an existing
directory, then trains a small CNN for a few epochs with a multi-worker DataLoader and prints,
per epoch: wall time, files/s, the cache's hit rate per tier and the reads that went to the
source. The first epoch fills the cache; the next ones read from memory.

    python examples/train_demo.py                      # generated dataset, 3 epochs
    python examples/train_demo.py --data /lustre/ds --epochs 5 --workers 8
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from fitcache import FitCacheDataset

IMAGE = (3, 64, 64)  # the first 12 KiB of each file become a 3x64x64 image


def make_dataset(root, files, size):
    """Writes files of random bytes (skipping those already there); returns root."""
    rng = np.random.default_rng(0)
    for i in range(files):
        path = os.path.join(root, f"class{i % 10}", f"img_{i:06d}.bin")
        if os.path.exists(path) and os.path.getsize(path) == size:
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        os.rename(path + ".tmp", path)
    return root


class Decode:
    """Turns a file's bytes (a zero-copy view) into an image tensor and its class label."""

    def __init__(self, root):
        self.root = root

    def __call__(self, view):
        n = int(np.prod(IMAGE))
        pixels = np.frombuffer(view, dtype=np.uint8, count=min(n, len(view)))
        image = torch.zeros(n, dtype=torch.float32)
        image[: len(pixels)] = torch.from_numpy(pixels.astype(np.float32) / 255.0)
        return image.view(IMAGE), sum(view[:64]) % 10


def model():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


ZERO = {"misses": 0, "inflight_hits": 0, "source_reads": 0, "source_bytes": 0, "hits": {}}


def delta(after, before):
    after, before = after or ZERO, before or ZERO
    keys = ("misses", "inflight_hits", "source_reads", "source_bytes")
    out = {k: after[k] - before[k] for k in keys}
    out["hits"] = {t: n - before["hits"].get(t, 0) for t, n in after["hits"].items()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="dataset directory (default: generate one)")
    ap.add_argument("--generate-in", default=os.path.join(os.path.expanduser("~"), ".cache", "fitcache-demo", "data"),
                    help="where to generate the dataset when --data is not given")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--file-size", type=int, default=128 << 10)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()

    root = args.data
    if root is None:
        t = time.perf_counter()
        root = make_dataset(args.generate_in, args.files, args.file_size)
        print(f"dataset: {args.files} files of {args.file_size >> 10} KiB in {root} "
              f"(ready in {time.perf_counter() - t:.1f}s)")
    ds = FitCacheDataset(root, transform=Decode(root))
    print(f"FitCacheDataset: {len(ds)} files under {ds.root}")
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    net, loss_fn = model(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    before = ds.stats()["server"]
    print(f"{'epoch':>5} {'time':>8} {'files/s':>9} {'loss':>7}  {'hit rate':>8}  {'hits by tier':<28} {'source reads':>12}")
    for epoch in range(args.epochs):
        t, seen, total = time.perf_counter(), 0, 0.0
        for images, labels in loader:
            opt.zero_grad()
            loss = loss_fn(net(images), labels)
            loss.backward()
            opt.step()
            seen += len(labels)
            total += loss.item() * len(labels)
        secs = time.perf_counter() - t
        after = ds.stats()["server"]
        d = delta(after, before)
        before = after
        reads = sum(d["hits"].values()) + d["misses"] + d["inflight_hits"]
        rate = sum(d["hits"].values()) / reads if reads else 0.0
        tiers = ", ".join(f"{k} {v}" for k, v in d["hits"].items() if v) or "-"
        print(f"{epoch + 1:>5} {secs:>7.2f}s {seen / secs:>9.0f} {total / seen:>7.3f}  {rate:>8.1%}  {tiers:<28} {d['source_reads']:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
