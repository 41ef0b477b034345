#!/usr/bin/env python3
"""What a fresh DataLoader worker pays for its first FitCache read, warm: the main process
opens a FitCacheDataset and reads every file (as a DataLoader's main process opens its client
before the first fork), then forks --children children one after the other, as a DataLoader
forks fresh workers each epoch. Each child reads a file plainly first (the first read of a
child pays for the pages of Python's own state it touches first, whichever it is), then
times two plain reads of the /dev/shm copy (open(p, 'rb').read()) and two ds[i] of files it
has not read, the two kinds in an order that alternates from child to child. Other children
read one file of either kind, or nothing, and report their CPU time (user + system, from
wait4) and minor page faults. Last, children that each read --reads files of one kind, as a
fresh worker reads its share of an epoch, report the time and minor page faults of their
reads after the first. Medians over the children.

"fitcache first - second" is what the first FitCache read of a fresh worker costs beyond a
later one: spread over the files a worker reads in an epoch, the per-file price of fresh
workers that the issue's 16-core runs showed.

  .venv/bin/python bench/bench_first_read.py --files 2000 --children 40
"""
import argparse
import json
import os
import resource
import statistics
import time
import zlib

from privatecache import WarmFiles


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", type=int, default=110 << 10, help="bytes per file")
    ap.add_argument("--children", type=int, default=40)
    ap.add_argument("--reads", type=int, default=300, help="files a worker reads (the last table)")
    ap.add_argument("--budget", help="the memory tier's budget, which sizes its index (default: twice the dataset)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    warm = WarmFiles("fc-bench-first-", args.files, args.size, args.budget)
    src, shm, names, cache = warm.src, warm.shm, warm.names, warm.cache
    try:
        budget = warm.budget
        import fitcache

        ds = fitcache.FitCacheDataset(src, files=names, prefetch=False, **cache.options)
        for i in range(len(ds)):  # cached, and the main process's client open
            zlib.crc32(ds[i])

        def plain(i):
            with open(os.path.join(shm, names[i % len(names)]), "rb") as f:
                return zlib.crc32(f.read())

        def cached(i):
            return zlib.crc32(ds[i % len(names)])

        def in_child(body):
            """Runs body() in a forked child; returns what it wrote, its CPU seconds and minor faults."""
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                out = body()
                os.write(w, json.dumps(out).encode())
                os._exit(0)
            os.close(w)
            data = b""
            while chunk := os.read(r, 65536):
                data += chunk
            os.close(r)
            _, _, ru = os.wait4(pid, 0)
            return json.loads(data or b"null"), ru.ru_utime + ru.ru_stime, ru.ru_minflt

        def timed(reads):
            out = []
            for kind, fn, i in reads:
                t0 = time.perf_counter()
                fn(i)
                out.append([kind, time.perf_counter() - t0])
            return out

        firsts = {"plain": [], "fitcache": []}
        seconds = {"plain": [], "fitcache": []}
        cpu = {"nothing": [], "plain": [], "fitcache": []}
        faults = {"nothing": [], "plain": [], "fitcache": []}
        for k in range(args.children):
            base = 5 * k
            kinds = [("plain", plain), ("fitcache", cached)]
            if k % 2:
                kinds.reverse()
            # A plain read first takes the pages of Python's own state that any first read
            # touches; then each kind's first and second read.
            reads = [("warm-up", plain, base)] + [(kind, fn, base + 1 + 2 * j + n)
                                                   for j, (kind, fn) in enumerate(kinds) for n in range(2)]
            out, _, _ = in_child(lambda: timed(reads))
            for kind, _ in kinds:
                times = [t for name, t in out if name == kind]
                firsts[kind].append(times[0])
                seconds[kind].append(times[1])
            for what, fn in (("nothing", None), ("plain", plain), ("fitcache", cached)):
                _, c, f = in_child(lambda: fn(base) if fn else None)
                cpu[what].append(c)
                faults[what].append(f)

        # A worker's reads after its first: time and minor faults per read.
        def worker(fn, start):
            fn(start)
            ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for j in range(1, args.reads):
                fn(start + j)
            t, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            return [t / (args.reads - 1), (ru1.ru_minflt - ru0.ru_minflt) / (args.reads - 1)]

        per_read = {"plain": [], "fitcache": []}
        for k in range(args.children):
            for kind, fn in (("plain", plain), ("fitcache", cached)):
                out, _, _ = in_child(lambda: worker(fn, 97 * k))
                per_read[kind].append(out)

        med = statistics.median
        index = os.path.getsize(os.path.join(shm, "tier", "fitcache.index"))
        result = {"cores": os.cpu_count(), "files": args.files, "size": args.size, "children": args.children,
                  "budget": budget, "index_bytes": index,
                  "first_read_us": {k: med(v) * 1e6 for k, v in firsts.items()},
                  "second_read_us": {k: med(v) * 1e6 for k, v in seconds.items()},
                  "child_cpu_ms": {k: med(v) * 1e3 for k, v in cpu.items()},
                  "child_minor_faults": {k: med(v) for k, v in faults.items()},
                  "reads": args.reads,
                  "later_read_us": {k: med(x[0] for x in v) * 1e6 for k, v in per_read.items()},
                  "later_read_faults": {k: med(x[1] for x in v) for k, v in per_read.items()}}
        print(f"{os.cpu_count()} cores, {args.files} files of {args.size} bytes, {args.children} forked children, "
              f"a memory tier of {budget} (its index {index / 2**20:.1f} MiB); medians\n")
        print("| read in a fresh child | first read, µs | second read, µs | first - second |")
        print("|---|---|---|---|")
        for k in ("plain", "fitcache"):
            f, s = result["first_read_us"][k], result["second_read_us"][k]
            print(f"| {k} | {f:.0f} | {s:.0f} | {f - s:.0f} |")
        print("\n| child that reads | CPU ms (fork to exit) | minor faults |")
        print("|---|---|---|")
        for k in ("nothing", "plain", "fitcache"):
            print(f"| {'one file, ' + k if k != 'nothing' else 'nothing'} | {result['child_cpu_ms'][k]:.2f} | "
                  f"{result['child_minor_faults'][k]:.0f} |")
        print(f"\n| a worker's reads 2 to {args.reads} | µs per read | minor faults per read |")
        print("|---|---|---|")
        for k in ("plain", "fitcache"):
            print(f"| {k} | {result['later_read_us'][k]:.1f} | {result['later_read_faults'][k]:.2f} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        warm.remove()


if __name__ == "__main__":
    main()
