import os, sys, time, zlib, tempfile, statistics, shutil
sys.path.insert(0, "/work/main/bench")
import bench_scale
from privatecache import PrivateCache
import fitcache, fitcache.dataset as fd
N, ROUNDS = int(sys.argv[1]), int(sys.argv[2])
src0, manifest, _ = bench_scale.generate("/var/tmp/pfs-source", N, 1)
src = src0.replace("/var/tmp/pfs-source", "/mnt/pfs")
names = [r for r, _, _ in manifest][:N]
def crc(v): return zlib.crc32(v), len(v)
res = {4: [], 16: []}
for r in range(ROUNDS):
    for chunk in ((4, 16) if r % 2 == 0 else (16, 4)):
        work = tempfile.mkdtemp(prefix="fc-coldmain-"); tier = tempfile.mkdtemp(prefix="fc-coldmain-", dir="/dev/shm")
        cache = PrivateCache(os.path.join(work, "run"), f"memory:{tier}:2GiB", [work, tier])
        try:
            fd._TRANSFORM_CHUNK = chunk
            ds = fitcache.FitCacheDataset(src, files=names, transform=crc, prefetch=os.environ.get("PF") == "1", **cache.options)
            ds[0]  # the client and server up before the clock
            t0 = time.perf_counter()
            for s in range(1, N, 64):
                ds.__getitems__(list(range(s, min(s + 64, N))))
            res[chunk].append(time.perf_counter() - t0)
            ds.close()
        finally:
            cache.wipe()
for c, v in res.items():
    print(f"chunk {c:2d}: cold epoch in the main process, {N} files over slowfs (1 ms): median {statistics.median(v):.2f} s  all {[round(x, 2) for x in v]}")
