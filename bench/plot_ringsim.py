#!/usr/bin/env python3
"""Plots bench/ringsim's JSON like Fig. 6b of the hash-ring paper (Lee et al., "Fault-Tolerant
Deep Learning Cache with Hash Ring for Load Balancing in HPC Systems"): receivers of a failed server's files
(bars, left axis) and files per receiver (line, right axis), with standard deviations.

    python bench/plot_ringsim.py bench/results/ringsim-2026-11-22.json docs/ringsim.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    rows = json.load(open(src))
    labels = [str(r["virtual_nodes"]) for r in rows]
    fig, left = plt.subplots(figsize=(7, 4))
    left.bar(labels, [r["receivers_mean"] for r in rows], yerr=[r["receivers_std"] for r in rows],
             color="#4c72b0", capsize=4, label="receiver servers")
    left.set_xlabel("virtual nodes per server (1,024 servers, 524,288 files)")
    left.set_ylabel("servers receiving the failed server's files")
    right = left.twinx()
    right.errorbar(labels, [r["files_per_receiver_mean"] for r in rows], yerr=[r["files_per_receiver_std"] for r in rows],
                   color="#dd8452", marker="o", capsize=4, label="files per receiver")
    right.set_ylabel("files per receiving server")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.92))
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
