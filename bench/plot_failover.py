#!/usr/bin/env python3
"""Plots bench_failover.py's JSON: seconds and source reads per epoch, one line per policy.

    python bench/plot_failover.py bench/results/failover-netns-2026-11-22.json docs/failover.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    rows = json.load(open(src))
    fig, (t, r) = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        label = f"{row['policy']} ({row['failure']})"
        epochs = range(1, len(row["seconds_per_epoch"]) + 1)
        t.plot(epochs, row["seconds_per_epoch"], marker="o", label=label)
        r.plot(epochs, row["source_reads_per_epoch"], marker="o", label=label)
    for ax in (t, r):
        ax.set_xticks(list(epochs))
    t.set_title("epoch time (failure during epoch 2)")
    t.set_xlabel("epoch")
    t.set_ylabel("seconds")
    r.set_title("files read from the PFS")
    r.set_xlabel("epoch")
    r.set_ylabel("source reads")
    r.set_yscale("symlog")
    r.set_ylim(bottom=0)
    t.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
