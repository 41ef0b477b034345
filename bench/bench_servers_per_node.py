#!/usr/bin/env python3
"""Servers per node: the ablation of the FITCACHE paper (section IV-F, Fig. 9: 1 to 16 servers
per compute node, the first epoch and a warm one) on one node of this machine.

S servers (--per-node, default 1,2,4,8,16) run on one loopback node (127.0.0.2, `fitcache serve
--servers` listing the S of them, as `servers_per_node` starts them); the files are spread
over them by the hash ring. One reader on that node (a DataLoader, --workers fresh workers
per epoch, fork, every item's bytes consumed with zlib.crc32 and checked) reads the whole
dataset each epoch, and finds every server's files itself: the node's tier index lookup
covers the tiers of all S servers, and the node socket of its home server answers for every
file (README, Cluster mode). Each server's memory tier holds the dataset (fits).

Per S and round, on fresh servers with empty tiers (bench_cluster.py's machinery):

  cold              epoch 0 from the page-cached source, the reader handing its list over to
                    prefetch; source opens counted with inotify
  warm-fresh        epochs 1..E-1, fresh workers
  warm-persistent   persistent workers: one untimed epoch, then epochs 1..E-1
  pfs-cold          with --pfs DIR (a slow file system mounted there: bench/README.md), epoch
                    0 of a dataset there, page cache dropped first with --drop-caches: where
                    the paper sees more servers absorb the first epoch's burst

against baselines measured in each round: plain reads of a /dev/shm copy (fresh and
persistent workers), of the source (cold's baseline) and, with --pfs, of the PFS (pfs-cold's).
The paper's servers each had cores of their own; here every server shares the machine's
cores with the reader, so the figures show what more servers cost or gain on one node, not
what they gain on a node of Frontier.

    python bench/bench_servers_per_node.py --files 2000 --per-node 1,4 --repeats 1   # a quick look
    python bench/bench_servers_per_node.py --pfs /mnt/pfs/fitcache-cluster --drop-caches
"""

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import sys
import time
import types

import bench_cluster as bc
from bench_cluster import Recorder, epochs, fold
from bench_scale import drop_caches, log

HOST = "127.0.0.2"


class OneNode:
    """bench_cluster's nodes, all S servers on one loopback host."""

    def __init__(self, servers):
        self.variant, self.netns, self.network = "loopback", None, {"variant": "loopback"}
        self.server_hosts = [HOST] * servers
        self.client_host = "127.0.0.1"

    def prefix(self, host):
        return []

    def delay_cpu(self):
        return 0.0


def pfs_epoch(run, rec, key, p, cluster_budget=None):
    """Epoch 0 over the PFS dataset p: plain reads, or FitCache on fresh servers."""
    agents, hosts = run.readers("server")
    if run.args.drop_caches:
        drop_caches()
    with bc.OpenCounter(p["src"]) as opens:
        if cluster_budget is None:
            run.load(agents, "plain", p["src"], False, manifest=p["manifest_path"])
            row = run.check(epochs(agents, [0], [], opens.counts))[0]
        else:
            cluster, job = run.cluster(p["src"], cluster_budget)
            try:
                options = [{**cluster.options(node=h), "job": job, "runtime_dir": os.path.join(run.work, "run")}
                           for h in hosts]
                run.load(agents, "fitcache", p["src"], False, options, manifest=p["manifest_path"])
                row = run.check(epochs(agents, [0], [x.pid for x in cluster.procs.values()], opens.counts,
                                       prefetch=True))[0]
                run.drop(agents)
            finally:
                cluster.stop()
                run.cleanup.remove(cluster.stop)
        row["source_opens"] = sum(opens.counts().values())
    rec.add(key, **row)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-node", default="1,2,4,8,16", help="servers on the node, one run each")
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-scale")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3, help="1 cold + the rest warm (at least 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pfs", help="dataset directory on a mounted slow file system (bench/README.md)")
    ap.add_argument("--pfs-files", type=int, default=2000)
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each PFS epoch (root)")
    ap.add_argument("--out", help="JSON results (default bench/results/servers-per-node-<date>.json)")
    args = ap.parse_args()
    if args.epochs < 2:
        ap.error("--epochs must be at least 2")
    per_node = [int(s) for s in args.per_node.split(",") if s]
    out = args.out or str(bc.HERE / "results" / f"servers-per-node-{datetime.date.today()}.json")
    signal.signal(signal.SIGTERM, bc.bench_scale._stop)
    work = f"/tmp/fitcache-per-node-{os.getpid()}"
    os.makedirs(work)
    cleanup = [lambda: shutil.rmtree(work, ignore_errors=True)]
    t0 = time.monotonic()
    results = {"machine": {"cpus": os.cpu_count(), "loadavg_start": open("/proc/loadavg").read().split()[:3]},
               "args": vars(args)}
    base, by_s = Recorder(), {s: Recorder() for s in per_node}
    bad = 0
    try:
        data = bc.prepare(args, work, cleanup)
        pfs = bc.prepare_pfs(types.SimpleNamespace(pfs=args.pfs, pfs_files=args.pfs_files, seed=args.seed)) \
            if args.pfs else None
        results["dataset"] = {"dir": data["src"], "files": len(data["manifest"]), "bytes": data["bytes"]}
        run = bc.Run(args, work, cleanup, OneNode(1), data)
        try:
            for r in range(args.repeats):
                t = time.monotonic()
                run.rec = base
                run.baselines("server")
                if pfs:
                    pfs_epoch(run, base, "server/pfs/plain", pfs)
                for s in per_node:
                    run.nodes, run.k, run.rec = OneNode(s), s, by_s[s]
                    run.fitcache("fits", "server")
                    if pfs:
                        pfs_epoch(run, by_s[s], "server/fits/pfs-cold", pfs, "fits")
                log(f"round {r + 1}/{args.repeats} in {time.monotonic() - t:.0f} s; crc mismatches so far {run.bad}")
        finally:
            bad = run.bad
            run.close()
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception as err:
                log(f"cleanup: {err}")
    b = base.summary()
    rows = []
    for s in per_node:
        res = by_s[s].summary()
        for what, against in (("cold", "source/cold"), ("warm-fresh", "shm/fresh"),
                              ("warm-persistent", "shm/persistent"), ("pfs-cold", "pfs/plain")):
            c, ref = res.get(f"server/fits/{what}"), b.get(f"server/{against}")
            if c is None or ref is None:
                continue
            c["ratio"] = ref["seconds_median"] / c["seconds_median"]
            rows.append({"servers": s, "what": what, "against": against, **c})
    results.update(baselines=b, rows=rows, crc_mismatches=bad, seconds=time.monotonic() - t0)
    results["machine"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    lines = [f"{len(data['manifest'])} files, {data['bytes'] / 1e9:.2f} GB; one node, one reader, "
             f"{args.workers} workers; medians over {args.repeats} rounds; crc mismatches: {bad}", "",
             "| servers on the node | epoch | median s | files/s | against | ratio | CPU µs/file servers + reader "
             "| source opens |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        opens = ", ".join(str(x["source_opens"]) for x in row["rounds"]) if "source_opens" in row["rounds"][0] else ""
        lines.append(f"| {row['servers']} | {row['what']} | {row['seconds_median']:.3f} | {row['files_per_s']:.0f} | "
                     f"plain {row['against']} | {row['ratio']:.2f}x | "
                     f"{row.get('server_cpu_us_per_file', 0):.0f} + {row.get('client_cpu_us_per_file', 0):.0f} | {opens} |")
    lines += ["", "Baselines: " + "; ".join(f"{k.split('/', 1)[1]} {v['seconds_median']:.3f} s" for k, v in b.items())]
    results["table"] = "\n".join(lines) + "\n"
    print(results["table"])
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    log(f"wrote {out} ({results['seconds']:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
