#!/usr/bin/env python3
"""A server of a large cluster fails during a DataLoader epoch and comes back: --servers
(default 16) servers on loopback addresses 127.0.0.1..N (`fitcache serve --listen ...
--servers ...`, as the README starts them), or with --netns each in a network namespace of its
own (a node with its own address on a bridge: root), the ImageNet-like dataset of
bench_scale.py (--files, default 30,000), a reader on the node of the first server (with
--netns: inside its namespace) with FitCacheDataset and a DataLoader of --workers fresh
workers per epoch (forked), every item's crc32 checked against the manifest. Each server's
memory tier holds --budget (default: the dataset's footprint / N, plus 25%: its own share and
a few of other nodes' files), so most reads cross to other nodes every epoch.

For each failure, on fresh servers: epoch 1 cold, epoch 2 warm, and in epoch 3 a server of
another node (the one that holds the most files the reader's node does not) fails once the
epoch is --at (default 40%) through (timed from epoch 2); epoch 4 runs without it; before
epoch 5 it comes back. The failures and their recoveries:

  kill        SIGKILL; before epoch 5 a replacement (empty tiers) starts at its address
  hang        SIGSTOP; SIGCONT before epoch 5
  partition   (--netns only) its node's link goes down; up again before epoch 5

Reported per epoch: seconds, ratio against plain reads of the page-cached source by the same
loader (measured in the same run, before each failure case), source opens (inotify) and bad
items; the time from the failure to the first server declaring the failed one dead, and from
its return to the first other server seeing it join again (from the servers' logs). Servers
are given rpc_timeout 0.5 s and failure_threshold 3.

    python bench/bench_cluster_faults.py                        # 16 servers, 30,000 files
    python bench/bench_cluster_faults.py --netns --servers 32   # 32 nodes in namespaces
    python bench/bench_cluster_faults.py --files 2000 --servers 4   # a quick look
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import fitcache  # noqa: E402
from bench_scale import Check, EpochSampler, FitCacheCRC, PlainCRC, generate, loader, warm_page_cache  # noqa: E402
from harness import Cluster, NetnsNodes, cached_names  # noqa: E402
from inotify import OpenCounter  # noqa: E402

EPOCHS = 5
FAIL_EPOCH = 2  # the third epoch (0-based)


def plain_epoch(src, names, manifest, args):
    """Seconds of one epoch of plain reads of the source (page cache warm), same loader."""
    sampler = EpochSampler(len(names), args.seed)
    check = Check(manifest)
    t = time.perf_counter()
    check.epoch(loader(PlainCRC(src, names), sampler, args, args.workers))
    return time.perf_counter() - t, check.bad


def logged_at(cluster, what, victim, after):
    """The earliest time after `after` a log of a server other than victim says `what` of
    victim, or None."""
    first = None
    for log in Path(cluster.tmp).glob("server-*.log"):
        if log.name == f"server-{victim}.log":
            continue
        for line in log.read_text(errors="replace").splitlines():
            if what in line and victim in line and (m := re.match(r"time=(\S+)", line)):
                t = datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
                if t >= after:
                    first = t if first is None else min(first, t)
    return first


def wait_logged(cluster, what, victim, after, timeout=30):
    """Waits (at most timeout seconds) for logged_at; returns its time or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (t := logged_at(cluster, what, victim, after)) is not None:
            return t
        time.sleep(0.1)
    return None


class Failure:
    """One failure of a server and its recovery, by kind (see the module's text)."""

    def __init__(self, kind, cluster, netns, victim):
        self.kind, self.cluster, self.netns, self.victim = kind, cluster, netns, victim
        self.pid = cluster.procs[victim].pid
        self.failed = False

    def fail(self):
        if self.kind == "kill":
            self.cluster.kill(self.victim)
        elif self.kind == "hang":
            os.kill(self.pid, signal.SIGSTOP)
        else:
            self.netns.cut(self.victim.split(":")[0])
        self.failed = True

    def recover(self):
        if not self.failed:
            return
        if self.kind == "kill":  # a replacement: the node's tiers are gone with it
            shutil.rmtree(self.cluster.tiers(self.victim).split(":")[1], ignore_errors=True)
            self.cluster.start(self.victim)
        elif self.kind == "hang":
            os.kill(self.pid, signal.SIGCONT)
        else:
            self.netns.cut(self.victim.split(":")[0], down=False)
        self.failed = False


def run_case(kind, src, names, manifest, work, args, netns):
    tmp = Path(work) / f"cluster-{kind}"
    tmp.mkdir(parents=True)
    nodes = [f"127.0.0.{i + 1}" for i in range(args.servers)]
    cluster = Cluster(tmp, src, nodes=nodes, budget=args.budget, netns=netns,
                      serve_options={"rpc_timeout": "0.5", "failure_threshold": "3"})
    row = {"failure": kind, "epochs": []}
    failure = None
    try:
        opts = cluster.options(rpc_timeout="5", job=f"faults-{os.getpid()}-{kind}",
                               node=cluster.addrs[0].split(":")[0])
        ds = fitcache.FitCacheDataset(src, files=names, prefetch=False, **opts)
        sampler = EpochSampler(len(names), args.seed)
        check = Check(manifest)
        ds[0]  # loads the library before the workers fork, as a training script's first look would
        with OpenCounter(src) as opens:
            batches = 0

            def drain():  # the inotify queue holds 16,384 events: read it every 20 batches
                nonlocal batches
                batches += 1
                if batches % 20 == 0:
                    opens.counts()
            seen = 0
            for epoch in range(EPOCHS):
                timer = None
                if epoch == FAIL_EPOCH:
                    home = set(cached_names(cluster, cluster.addrs[0]))
                    victim = max(cluster.addrs[1:], key=lambda a: len(set(cached_names(cluster, a)) - home))
                    row["victim_files"] = len(cached_names(cluster, victim))
                    failure = Failure(kind, cluster, netns, victim)
                    fired = {}

                    def fail():
                        fired["at"] = time.time()
                        failure.fail()
                    timer = threading.Timer(args.at * row["epochs"][-1]["seconds"], fail)
                if epoch == EPOCHS - 1:
                    back = time.time()
                    failure.recover()
                    # "server joined" (the membership), "rejoined" (a client's probe or the
                    # membership's news): the first server to take it back
                    joined = wait_logged(cluster, "joined", victim, back)
                    row["rejoin_s"] = None if joined is None else joined - back
                bad0 = check.bad
                sampler.set_epoch(epoch)
                dl = loader(FitCacheCRC(ds), sampler, args, args.workers)
                t = time.perf_counter()
                if timer:
                    timer.start()
                check.epoch(dl, on_batch=drain)
                seconds = time.perf_counter() - t
                if timer:
                    timer.join()
                total = sum(opens.counts().values())
                row["epochs"].append({"seconds": seconds, "source_opens": total - seen, "bad": check.bad - bad0})
                seen = total
                if epoch == FAIL_EPOCH:
                    dead = logged_at(cluster, "declared dead", victim, fired["at"])
                    row["detect_s"] = None if dead is None else dead - fired["at"]
    finally:
        if failure:
            failure.recover()
        cluster.stop()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=30000)
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-scale", help="where generated datasets are kept")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--servers", type=int, default=16)
    ap.add_argument("--budget", help="each server's memory tier (default: footprint / servers + 25%%)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--at", type=float, default=0.4, help="how far into the epoch the failure comes")
    ap.add_argument("--netns", action="store_true", help="each server on a node of its own network namespace (root)")
    ap.add_argument("--keep", help="keep the servers' logs in this directory (default: a temporary one, removed)")
    ap.add_argument("--failures", help="comma-separated: kill, hang, partition (default: all the mode allows)")
    ap.add_argument("--out", help="JSON results")
    args = ap.parse_args()
    src, manifest, _ = generate(args.data, args.files, args.seed)
    names = [rel for rel, _, _ in manifest]
    footprint = sum((size + 4095) // 4096 * 4096 + 4096 for _, size, _ in manifest)
    args.budget = args.budget or f"{int(footprint / args.servers * 1.25) >> 20}MiB"
    warm_page_cache(src, names)
    kinds = args.failures.split(",") if args.failures else ["kill", "hang"] + (["partition"] if args.netns else [])
    if "partition" in kinds and not args.netns:
        sys.exit("a partition needs --netns")
    netns = NetnsNodes(args.servers) if args.netns else None
    try:
        if netns:
            netns.enter(netns.addrs[0])  # the reader runs on the first server's node
        results = {"args": vars(args), "loadavg_start": open("/proc/loadavg").read().split()[:3], "cases": []}
        with tempfile.TemporaryDirectory(prefix="fitcache-faults-") as tmp:
            work = args.keep or tmp
            for failure in kinds:
                plain = [plain_epoch(src, names, manifest, args) for _ in range(3)]
                row = run_case(failure, src, names, manifest, work, args, netns)
                row["plain_seconds"] = statistics.median(s for s, _ in plain)
                row["plain_bad"] = sum(b for _, b in plain)
                results["cases"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        if netns:
            netns.close()
    results["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    where = "in network namespaces" if args.netns else "on loopback"
    print(f"\n{len(names)} files, {args.servers} servers {where}, {args.budget} each, DataLoader with "
          f"{args.workers} fresh workers; a server of another node fails {args.at:.0%} into epoch {FAIL_EPOCH + 1} "
          f"and is back before epoch {EPOCHS}\n")
    print("| failure | files on it | declared dead after | back after | epoch | seconds | vs plain reads "
          "| source opens | bad items |")
    print("|---|---|---|---|---|---|---|---|---|")

    def secs(v):
        return "-" if v is None else f"{v:.3f} s"
    for r in results["cases"]:
        for i, e in enumerate(r["epochs"]):
            print(f"| {r['failure']} | {r['victim_files']} | {secs(r.get('detect_s'))} | {secs(r.get('rejoin_s'))} "
                  f"| {i + 1} | {e['seconds']:.2f} | {r['plain_seconds'] / e['seconds']:.2f}x | {e['source_opens']} "
                  f"| {e['bad']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
