#!/usr/bin/env python3
"""What a warm hit costs a program under `fitcache run`, per file: Python's
open(path, 'rb').read() and close of small files the cache holds, against the same reads of a
/dev/shm copy without FitCache (the limit: a plain read of a file in memory), in one run.

Python's open() fstats every file it opens, and read() of the whole file once more: under
`fitcache run` those are fstats of cached copies, which the shim makes report the source's
identity (preload/copies.c). This measures what that, and the rest of the shim's open path,
adds to a plain read, and can compare builds of FitCache (--variant NAME=BIN:LIB, a
`fitcache` binary and the libfitcache_preload.so it is to use; by default the installed
package's) in the same run.

Each reader is a fresh process (this script with --reader) that reads every file once
untimed (under `fitcache run` that is the run's validation session: the server checks each
copy once per run, see README "Consistency"), checks that every descriptor it was given is a
cached copy in a tier (readlink of /proc/self/fd, untimed), then times --passes passes over
the files: wall time and CPU time (user + system, of the process) per file, median over
passes. Configurations (plain-shm, then each variant) run back to back in each of --rounds
rounds, in an order that rotates from round to round; each variant has its own server and
memory tier, filled before the first round. "vs plain" is the median over rounds of the
configuration's figure divided by plain-shm's of the same round (1.00: as cheap as a plain
read).

With --procs P (a list, such as 2,4,8, runs each), each reader reads its files once untimed,
then forks P - 1 children, as a DataLoader forks its workers, and all P read every file
--passes times at once: the figures are then the CPU time (user + system) of all P processes
per file read, and the wall time of the whole per file read. Several processes hitting the
same warm files at once show what they share: on a hit, a reader writes only its own line of
the index's counters (tiers/index.go), where it once wrote one line shared by all.

  .venv/bin/python bench/bench_open_cost.py --files 2000 --rounds 9 --passes 5 --procs 2,4,8 \\
      --variant old=... --variant new=...

With --strace, one more reader per configuration runs under `strace -f` for one pass, and
the system calls of that pass are counted per file, by name.

  .venv/bin/python bench/bench_open_cost.py --files 2000 --rounds 9 --strace \\
      --variant old=/tmp/old/fitcache:/tmp/old/preload/libfitcache_preload.so \\
      --variant new=/tmp/new/fitcache:/tmp/new/preload/libfitcache_preload.so

where /tmp/old is a build of another commit: `git archive REV | tar -x -C /tmp/old`, then
`go build -o fitcache ./cmd/fitcache && make -C preload` in it (see docs/BENCHMARKS.md,
section 8b).
"""
import argparse
import collections
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

MARK = "/fitcache-bench-open-cost-mark"


def reader(args):
    paths = [line.rstrip("\n") for line in open(args.list)]
    for p in paths:  # warm-up: the run's validation session, the page cache
        with open(p, "rb") as f:
            f.read()
    cached = 0
    for p in paths:
        with open(p, "rb") as f:
            cached += any(os.readlink(f"/proc/self/fd/{f.fileno()}").startswith(t + "/") for t in args.tier)
    if args.procs > 1:
        return concurrent(args, paths, cached)
    walls, cpus = [], []
    for _ in range(args.passes):
        if args.mark:
            os.path.exists(MARK + "-begin")
        c0, t0 = time.process_time(), time.perf_counter()
        for p in paths:
            with open(p, "rb") as f:
                f.read()
        t1, c1 = time.perf_counter(), time.process_time()
        if args.mark:
            os.path.exists(MARK + "-end")
        walls.append((t1 - t0) / len(paths) * 1e6)
        cpus.append((c1 - c0) / len(paths) * 1e6)
    json.dump({"wall_us": statistics.median(walls), "cpu_us": statistics.median(cpus), "cached": cached}, sys.stdout)


def concurrent(args, paths, cached):
    """--procs P: the reader, warm, forks P - 1 children (as a DataLoader forks its workers);
    all P read every file --passes times at once, released together. Prints the CPU time
    (user + system) of the P processes per file read, and the wall time of the whole per file
    read (all processes' reads counted)."""
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    kids = []

    def passes():
        c0 = time.process_time()
        for _ in range(args.passes):
            for p in paths:
                with open(p, "rb") as f:
                    f.read()
        return time.process_time() - c0

    for _ in range(args.procs - 1):
        pid = os.fork()
        if pid == 0:
            os.read(go_r, 1)
            os.write(res_w, f"{passes()!r}\n".encode())
            os._exit(0)
        kids.append(pid)
    time.sleep(0.2)  # the children are waiting
    t0 = time.perf_counter()
    os.write(go_w, b"x" * len(kids))
    cpu = passes()
    for pid in kids:
        if os.waitpid(pid, 0)[1] != 0:
            sys.exit(f"reader child {pid} failed")
    wall = time.perf_counter() - t0
    os.close(res_w)
    with os.fdopen(res_r) as f:
        cpu += sum(float(line) for line in f)
    n = args.procs * args.passes * len(paths)
    json.dump({"wall_us": wall / n * 1e6, "cpu_us": cpu / n * 1e6, "cached": cached}, sys.stdout)


def make_files(root, n, size):
    os.makedirs(root)
    paths = []
    for i in range(n):
        d = os.path.join(root, f"c{i % 20:02d}")
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, f"f{i:05d}.bin")
        with open(p, "wb") as f:
            f.write(os.urandom(size))
        paths.append(p)
    return paths


class Variant:
    """A build of FitCache with a private cache: its server, memory tier and runtime directory."""

    def __init__(self, name, binary, lib, work):
        self.name, self.binary, self.lib = name, os.path.abspath(binary), lib and os.path.abspath(lib)
        self.tier = f"/dev/shm/fitcache-bench-{name}-{secrets.token_hex(4)}"
        self.run_dir = os.path.join(work, f"run-{name}")

    def env(self):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("FITCACHE_")}
        env.update(FITCACHE_RUNTIME_DIR=self.run_dir, FITCACHE_TIERS=f"memory:{self.tier}:512MiB",
                   FITCACHE_IDLE_TIMEOUT="600")
        if self.lib:
            env["FITCACHE_PRELOAD_LIB"] = self.lib
        return env

    def command(self, source, cmd):
        return [self.binary, "run", "--data", source, "--prefetch", "0", "--", *cmd]

    def fill(self, source, n):
        subprocess.run(self.command(source, ["sh", "-c", 'find "$1" -type f -exec cat {} + > /dev/null', "sh",
                                             source]), env=self.env(), check=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # published: data, record, then the index
            recs = sum(f.startswith(".rec-") for _, _, fs in os.walk(self.tier) for f in fs)
            if recs >= n:
                time.sleep(0.5)
                return
            time.sleep(0.2)
        sys.exit(f"{self.name}: {recs} of {n} files cached after 60 s")

    def stop(self):
        try:
            with open(os.path.join(self.run_dir, "server.lock")) as f:
                os.kill(int(f.read().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
        shutil.rmtree(self.tier, ignore_errors=True)


def run_reader(args, listfile, variant, source, strace_out=None, procs=1):
    cmd = [sys.executable, os.path.abspath(__file__), "--reader", "--list", listfile, "--passes",
           "1" if strace_out else str(args.passes), "--procs", str(1 if strace_out else procs)]
    if variant:
        cmd += ["--tier", os.path.realpath(variant.tier)]
    if strace_out:
        cmd = ["strace", "-f", "-qq", "-o", strace_out, *cmd, "--mark"]
    if variant:
        cmd = variant.command(source, cmd)
    out = subprocess.run(cmd, env=variant.env() if variant else None, capture_output=True, check=True)
    return json.loads(out.stdout)


def count_syscalls(trace, n):
    """System calls per file between the marks of the traced reader's pass, by name."""
    counts, inside = collections.Counter(), False
    with open(trace) as f:
        for line in f:
            if MARK + "-begin" in line:
                inside = True
            elif MARK + "-end" in line:
                break
            elif inside:
                m = re.match(r"\d+\s+(\w+)\(", line) or re.match(r"(\w+)\(", line)
                if m:
                    counts[m.group(1)] += 1
    return {k: v / n for k, v in sorted(counts.items())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", type=int, default=4096, help="bytes per file")
    ap.add_argument("--passes", type=int, default=7, help="timed passes per reader")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=BIN:LIB, a fitcache binary and its preload library (LIB empty: the one "
                         "beside BIN); default: the installed package")
    ap.add_argument("--procs", default="1",
                    help="reader processes at once, a comma-separated list to run each (a warm reader and "
                         "the children it forks: CPU of all of them per file)")
    ap.add_argument("--strace", action="store_true", help="count system calls per file")
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--list", help=argparse.SUPPRESS)
    ap.add_argument("--tier", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--mark", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        args.procs = int(args.procs)
        return reader(args)
    procs = [int(p) for p in args.procs.split(",")]
    if not args.variant:
        import fitcache._native
        args.variant = [f"installed={fitcache._native.server_binary()}:"]
    work = tempfile.mkdtemp(prefix="fitcache-bench-open-")
    shm = f"/dev/shm/fitcache-bench-plain-{secrets.token_hex(4)}"
    variants = []
    try:
        source = os.path.join(work, "source")
        paths = make_files(source, args.files, args.size)
        shutil.copytree(source, shm)
        lists = {}
        for name, ps in (("source", paths), ("shm", [shm + p[len(source):] for p in paths])):
            lists[name] = os.path.join(work, f"{name}.list")
            with open(lists[name], "w") as f:
                f.write("".join(p + "\n" for p in ps))
        for spec in args.variant:
            name, _, rest = spec.partition("=")
            binary, _, lib = rest.partition(":")
            v = Variant(name, binary, lib, work)
            variants.append(v)
            v.fill(source, args.files)
        configs = [None] + variants
        rows = collections.defaultdict(list)
        for rnd in range(args.rounds):
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
            for p in procs:
                got = {}
                for v in order:
                    r = run_reader(args, lists["shm" if v is None else "source"], v, source, procs=p)
                    if v is not None and r["cached"] != args.files:
                        sys.exit(f"{v.name}: {r['cached']} of {args.files} descriptors were cached copies")
                    got[("plain-shm" if v is None else v.name, p)] = r
                for key, r in got.items():
                    base = got[("plain-shm", p)]
                    rows[key].append({**r, "wall_vs_plain": r["wall_us"] / base["wall_us"],
                                      "cpu_vs_plain": r["cpu_us"] / base["cpu_us"]})
        syscalls = {}
        if args.strace:
            for v in configs:
                name = "plain-shm" if v is None else v.name
                trace = os.path.join(work, f"strace-{name}")
                run_reader(args, lists["shm" if v is None else "source"], v, source, strace_out=trace)
                syscalls[name] = count_syscalls(trace, args.files)
        print(f"\n{args.files} files of {args.size} bytes, Python open().read() + close, {args.passes} passes per "
              f"reader, {args.rounds} rounds, {os.cpu_count()} cores; medians\n")
        print("| configuration | processes | wall us/file | vs plain | CPU us/file | vs plain | system calls/file |")
        print("|---|---|---|---|---|---|---|")
        summary = {}
        for (name, p), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] != "plain-shm")):
            med = {k: statistics.median(r[k] for r in rs)
                   for k in ("wall_us", "wall_vs_plain", "cpu_us", "cpu_vs_plain")}
            sc = syscalls.get(name) if p == procs[0] else None
            summary[name if len(procs) == 1 else f"{name}/{p}"] = {**med, "procs": p, "rounds": rs,
                                                                    "syscalls_per_file": sc}
            print(f"| {name} | {p} | {med['wall_us']:.1f} | {med['wall_vs_plain']:.2f} | {med['cpu_us']:.1f} | "
                  f"{med['cpu_vs_plain']:.2f} | {f'{sum(sc.values()):.2f}' if sc else '-'} |")
        if syscalls:
            print("\nSystem calls per file, by name:\n")
            for name, sc in syscalls.items():
                print(f"- {name}: " + ", ".join(f"{k} {v:g}" for k, v in sc.items()))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"files": args.files, "size": args.size, "passes": args.passes, "configs": summary}, f,
                          indent=1)
    finally:
        for v in variants:
            v.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
