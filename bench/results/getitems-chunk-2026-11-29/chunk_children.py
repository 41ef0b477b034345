import os, statistics, sys, zlib, random, time, resource
sys.path.insert(0, "/work/main/bench")
from privatecache import WarmFiles
import fitcache, fitcache.dataset as fd
FILES, CHILDREN = int(sys.argv[1]), int(sys.argv[2])
CHUNKS = [int(x) for x in sys.argv[3].split(",")]
warm = WarmFiles("fc-ch-", FILES, 110 << 10, None)
src, shm, names, cache = warm.src, warm.shm, warm.names, warm.cache
def crc(v): return zlib.crc32(v), len(v)
try:
    dt = fitcache.FitCacheDataset(src, files=names, prefetch=False, transform=crc, **cache.options)
    for i in range(len(dt)): dt[i]
    def item_t(idx):
        for i in idx: dt[i]
    def batched(ch):
        def f(idx):
            fd._TRANSFORM_CHUNK = ch
            for s in range(0, len(idx), 64): dt.__getitems__(idx[s:s + 64])
        return f
    kinds = {"item_t": item_t, **{f"chunk{c}": batched(c) for c in CHUNKS}}
    for c in CHUNKS: batched(c)(list(range(64)))  # types made in the parent
    # steady state, in this process
    res = {k: [] for k in kinds}
    rng = random.Random(1)
    for r in range(11):
        idx = rng.sample(range(FILES), 640)
        order = list(kinds.items()); rng.shuffle(order)
        for k, fn in order:
            t0 = time.process_time(); fn(idx); res[k].append((time.process_time() - t0) / len(idx) * 1e6)
    # fresh children, 312 files each (20,000 files / 64 workers)
    ch = {k: [] for k in kinds}
    for c in range(CHILDREN):
        idx = rng.sample(range(FILES), 312)
        order = list(kinds.items()); rng.shuffle(order)
        for k, fn in order:
            pid = os.fork()
            if pid == 0:
                fn(idx); os._exit(0)
            _, _, ru = os.wait4(pid, 0)
            ch[k].append(((ru.ru_utime + ru.ru_stime) * 1e3, ru.ru_minflt))
    for k in kinds:
        print(f"{k:8s} steady us/file {statistics.median(res[k]):5.1f}   child of 312 files: cpu ms {statistics.median(x[0] for x in ch[k]):6.2f} faults {statistics.median(x[1] for x in ch[k]):5.0f}")
finally:
    warm.remove()
