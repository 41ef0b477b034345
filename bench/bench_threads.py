#!/usr/bin/env python3
"""Thread-based loaders: T threads of one process read warm files through FitCache, against
plain reads of the same files, in one run.

Each configuration runs in a fresh process (this script with --reader): plain
open(path, 'rb').read() of the source files, Client.read, and FitCacheDataset[i], at each
thread count of --threads. A reader reads every file once untimed (the page cache, the
dataset's validation session), then its T threads read a share each (every T-th file) in
--passes timed passes: wall time and CPU time (user + system of the whole process, Go's
threads included) per file. Configurations run back to back in each of --rounds rounds, the
order rotating from round to round; figures are medians over rounds, and "vs plain" is the
median of plain's wall time over the configuration's in the same round (files/s against
plain's: 1.00 is as fast as a plain read).

Each variant (--variant NAME=LIBRARY[:PYTHONPATH], a libfitcache.so and optionally the
Python package to load it with; by default the installed package) has its own embedded
server and memory tier, filled before the first round and stopped at the end.

--modes picks what each round runs: plain, client, dataset, and c-loop, the C read loop
bench/threads_read.c (fc_read and fc_release, no Python; after an untimed pass), per variant
and thread count: the library's own CPU time per read.
With --strace 4,8, that loop runs once per variant and thread count under `strace -f -c`, and
its futex calls are counted per read: threads that wait on each other in the library make
futex calls.

  .venv/bin/python bench/bench_threads.py --threads 1,2,4,8,16 --rounds 3 --strace 4,8 \\
      --variant old=/tmp/old/libfitcache.so --variant new=bindings/python/fitcache/libfitcache.so
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = "/var/tmp/fitcache-bench-scale/imagenet-like-10000-4addc11c0688/train"
HERE = os.path.dirname(os.path.abspath(__file__))


def reader(args):
    paths = [line.rstrip("\n") for line in open(args.list)]
    opts = json.loads(args.opts)
    if args.mode == "plain":
        def read(i):
            with open(paths[i], "rb") as f:
                f.read()
    elif args.mode == "client":
        import fitcache
        client = fitcache.Client(args.root, **opts)

        def read(i):
            client.read(paths[i])
    else:
        import fitcache
        rel = [os.path.relpath(p, args.root) for p in paths]
        ds = fitcache.FitCacheDataset(args.root, files=rel, prefetch=False, **opts)

        def read(i):
            ds[i]
    for i in range(len(paths)):  # warm-up: the page cache, the dataset's validation session
        read(i)
    def hits():
        return (client if args.mode == "client" else ds).stats()["client"]["local_hits"] if args.mode != "plain" else 0
    before = hits()
    walls, cpus = [], []
    n, t = len(paths), args.threads
    for _ in range(args.passes):
        start = threading.Barrier(t + 1)

        def work(k):
            start.wait()
            for i in range(k, n, t):
                read(i)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(t)]
        for th in threads:
            th.start()
        c0 = time.process_time()
        start.wait()
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        walls.append((time.perf_counter() - t0) / n)
        cpus.append((time.process_time() - c0) / n)
    if args.mode != "plain" and hits() - before != n * args.passes:
        sys.exit(f"{hits() - before} of {n * args.passes} timed reads were hits")
    print(json.dumps({"wall": statistics.median(walls), "cpu": statistics.median(cpus)}))


def server_pid(runtime_dir):
    try:
        with open(os.path.join(runtime_dir, "server.lock")) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


class Variant:
    def __init__(self, name, lib, pypath, work):
        self.name, self.lib, self.pypath = name, lib, pypath
        self.dir = os.path.join(work, name)
        self.runtime = os.path.join(self.dir, "run")
        os.makedirs(self.runtime)
        self.opts = {"tiers": f"memory:{os.path.join(self.dir, 'tier')}:4GiB", "runtime_dir": self.runtime}
        self.pid = 0

    def env(self):
        env = dict(os.environ)
        if self.lib:
            env["FITCACHE_LIBRARY"] = self.lib
        if self.pypath:
            env["PYTHONPATH"] = self.pypath
        return env


def run_reader(args, listfile, mode, threads, variant=None):
    cmd = [sys.executable, __file__, "--reader", "--mode", mode, "--threads", str(threads), "--list", listfile,
           "--root", args.root, "--passes", str(args.passes), "--opts", json.dumps(variant.opts if variant else {})]
    out = subprocess.run(cmd, capture_output=True, text=True, env=variant.env() if variant else None, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"reader {mode} x{threads} ({variant and variant.name}) failed: {out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def c_loop_command(args, variant, exe, listfile, threads):
    lib = variant.lib
    if not lib:
        import fitcache._native
        lib = fitcache._native.library_path()
    return [exe, lib, args.root, json.dumps(variant.opts), str(threads), str(args.passes), listfile]


def run_c_loop(args, variant, exe, listfile, threads, n):
    out = subprocess.run(c_loop_command(args, variant, exe, listfile, threads), capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        sys.exit(f"threads_read failed: {out.stdout} {out.stderr}")
    r = json.loads(out.stdout)
    return {"wall": r["seconds"] / r["reads"], "cpu": r["cpu_seconds"] / r["reads"]}


def futex_per_read(args, variant, exe, listfile, threads, n):
    trace = os.path.join(variant.dir, f"strace-{threads}.txt")
    cmd = ["strace", "-f", "-c", "-e", "trace=futex", "-o", trace] + c_loop_command(args, variant, exe, listfile,
                                                                                    threads)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"threads_read failed: {out.stdout} {out.stderr}")
    calls = 0
    for line in open(trace):
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?futex$", line)
        if m:
            calls = int(m.group(1))
    return calls / (n * args.passes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=ROOT)
    ap.add_argument("--files", type=int, default=0, help="files to read (0: all under --root)")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--passes", type=int, default=1, help="timed passes per reader")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], help="NAME=LIBRARY[:PYTHONPATH]")
    ap.add_argument("--modes", default="plain,client,dataset", help="of plain, client, dataset, c-loop")
    ap.add_argument("--strace", default="", help="thread counts for the strace of the C read loop")
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--list", help=argparse.SUPPRESS)
    ap.add_argument("--opts", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        args.threads = int(args.threads)
        return reader(args)

    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(args.root) for f in fs)
    if args.files:
        paths = paths[:args.files]
    work = tempfile.mkdtemp(prefix="fitcache-bench-threads-")
    listfile = os.path.join(work, "list")
    with open(listfile, "w") as f:
        f.writelines(p + "\n" for p in paths)
    variants = []
    for spec in args.variant or ["installed="]:
        name, _, rest = spec.partition("=")
        lib, _, pypath = rest.partition(":")
        variants.append(Variant(name, os.path.abspath(lib) if lib else "", os.path.abspath(pypath) if pypath else "",
                                work))
    results = {"files": len(paths), "rounds": args.rounds, "passes": args.passes, "nproc": os.cpu_count(),
               "figures": {}, "futex_per_read": {}}
    exe = os.path.join(work, "threads_read")
    try:
        modes = args.modes.split(",")
        if "c-loop" in modes or args.strace:
            subprocess.run(["cc", "-O2", "-pthread", "-o", exe, os.path.join(HERE, "threads_read.c"), "-ldl"],
                           check=True)
        for v in variants:  # fills its tier (the warm-up of a reader) and starts its server
            run_reader(args, listfile, "client", 1, v)
            v.pid = server_pid(v.runtime)
        configs = [("plain", None)] if "plain" in modes else []
        configs += [(m, v) for v in variants for m in ("client", "dataset", "c-loop") if m in modes]
        for threads in [int(t) for t in args.threads.split(",")]:
            rounds = []
            for r in range(args.rounds):
                order = configs[r % len(configs):] + configs[:r % len(configs)]
                rounds.append({(m, v and v.name): run_c_loop(args, v, exe, listfile, threads, len(paths))
                               if m == "c-loop" else run_reader(args, listfile, m, threads, v) for m, v in order})
            for m, v in configs:
                key = m if v is None else f"{v.name} {m}"
                wall = statistics.median(r[(m, v and v.name)]["wall"] for r in rounds)
                cpu = statistics.median(r[(m, v and v.name)]["cpu"] for r in rounds)
                vs = statistics.median(r[("plain", None)]["wall"] / r[(m, v and v.name)]["wall"] for r in rounds) \
                    if "plain" in modes else float("nan")
                results["figures"].setdefault(key, {})[threads] = {"wall_us": wall * 1e6, "cpu_us": cpu * 1e6,
                                                                  "vs_plain": vs if "plain" in modes else None}
                print(f"{threads:2d} threads  {key:24s} wall {wall * 1e6:7.1f} us/file  cpu {cpu * 1e6:7.1f} us/file"
                      + (f"  vs plain {vs:.2f}x" if "plain" in modes else ""), flush=True)
        if args.strace:
            for v in variants:
                for threads in [int(t) for t in args.strace.split(",")]:
                    f = futex_per_read(args, v, exe, listfile, threads, len(paths))
                    results["futex_per_read"].setdefault(v.name, {})[threads] = f
                    print(f"strace {v.name} x{threads}: {f:.3f} futex calls per read", flush=True)
    finally:
        for v in variants:
            if v.pid:
                os.kill(v.pid, signal.SIGTERM)
        time.sleep(0.5)
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
