#!/usr/bin/env python3
"""What FitCacheDataset.__getitems__ with a transform costs per file against __getitem__ and a
plain read of a /dev/shm copy, warm, in one process: the batch a DataLoader of PyTorch 2 asks
for at once (--batch files) is read and transformed by

  plain        open(p, 'rb').read() of the /dev/shm copy, then the transform
  getitem      [ds[i] for i in batch]
  getitems     ds.__getitems__(batch): read and transformed a chunk of files at a time
  whole-batch  the whole batch read in one native call, then transformed (how __getitems__
               read before: Client.read_each of the batch, then the transform of each)

The transform is zlib.crc32 of every byte, as the issue's DataLoader runs did. CPU time (user +
system of this process; the server does no work on a warm hit) per file, median over
--repeats passes, modes interleaved; "vs plain" divides by plain's figure of the same repeat.

  .venv/bin/python bench/bench_getitems.py --files 5000 --size 112640 --repeats 7
"""
import argparse
import json
import os
import statistics
import sys
import time
import zlib

from privatecache import WarmFiles


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--size", type=int, default=110 << 10, help="bytes per file")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    warm = WarmFiles("fc-bench-getitems-", args.files, args.size)
    src, shm, names, cache = warm.src, warm.shm, warm.names, warm.cache
    try:
        import fitcache

        ds = fitcache.FitCacheDataset(src, transform=zlib.crc32, files=names, prefetch=False, **cache.options)
        client = ds._get_client()
        batches = [list(range(s, min(args.files, s + args.batch))) for s in range(0, args.files, args.batch)]
        plain_paths = [os.path.join(shm, n) for n in names]

        def plain():
            for b in batches:
                out = []
                for i in b:
                    with open(plain_paths[i], "rb") as f:
                        out.append(zlib.crc32(f.read()))

        def getitem():
            for b in batches:
                [ds[i] for i in b]

        def getitems():
            for b in batches:
                ds.__getitems__(b)

        def whole_batch():
            for b in batches:
                views = client.read_each([ds.path(i) for i in b])
                [zlib.crc32(v) for v in views]

        modes = {"plain": plain, "getitem": getitem, "getitems": getitems, "whole-batch": whole_batch}
        want = [zlib.crc32(open(p, "rb").read()) for p in plain_paths]
        got = [c for b in batches for c in ds.__getitems__(b)]
        if got != want:
            sys.exit("getitems returned other bytes than the source's")
        for f in modes.values():  # warm: the copies, the session's checks, the page cache
            f()
        cpu = {m: [] for m in modes}
        for r in range(args.repeats):
            order = list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]
            for m in order:
                c0 = time.process_time()
                modes[m]()
                cpu[m].append((time.process_time() - c0) / args.files * 1e6)
        result = {"cores": os.cpu_count(), "files": args.files, "size": args.size, "batch": args.batch,
                  "repeats": args.repeats, "modes": {}}
        print(f"{os.cpu_count()} cores, {args.files} files of {args.size} bytes, batches of {args.batch}, "
              f"{args.repeats} repeats")
        print(f"{'mode':12} {'CPU us/file':>12} {'vs plain':>9}")
        for m in modes:
            ratios = [c / p for c, p in zip(cpu[m], cpu["plain"])]
            result["modes"][m] = {"cpu_us": round(statistics.median(cpu[m]), 2),
                                  "vs_plain": round(statistics.median(ratios), 3),
                                  "cpu_us_each": [round(c, 2) for c in cpu[m]]}
            print(f"{m:12} {statistics.median(cpu[m]):12.1f} {statistics.median(ratios):9.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        client.close()
    finally:
        warm.remove()


if __name__ == "__main__":
    main()
