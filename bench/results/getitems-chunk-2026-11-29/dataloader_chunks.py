import os, statistics, sys, zlib, random, time, resource, subprocess
sys.path.insert(0, "/work/main/bench")
from privatecache import WarmFiles
import fitcache, torch  # noqa: F401
from torch.utils.data import DataLoader, BatchSampler, Dataset, Sampler
FILES, WORKERS, ROUNDS, PERF = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else ""
warm = WarmFiles("fc-dl-", FILES, 110 << 10, None)
src, shm, names, cache = warm.src, warm.shm, warm.names, warm.cache
def crc(v): return zlib.crc32(v), len(v)
class Item(Dataset):
    def __init__(s, ds): s.ds = ds
    def __len__(s): return len(s.ds)
    def __getitem__(s, i): return (i, *s.ds[i])
import fitcache.dataset as fd
class Batched(Dataset):
    def __init__(s, ds, chunk): s.ds, s.chunk = ds, chunk
    def __len__(s): return len(s.ds)
    def __getitem__(s, idx):
        fd._TRANSFORM_CHUNK = s.chunk
        return [(i, *r) for i, r in zip(idx, s.ds.__getitems__(idx))]
class Ep(Sampler):
    def __init__(s, n): s.n, s.e = n, 0
    def __len__(s): return s.n
    def __iter__(s):
        o = list(range(s.n)); random.Random(s.e).shuffle(o); s.e += 1; return iter(o)
def collate(b): return tuple(zip(*b))
def cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f: x = f.read().rsplit(")", 1)[1].split()
    return (int(x[11]) + int(x[12])) / os.sysconf("SC_CLK_TCK")
try:
    ds = fitcache.FitCacheDataset(src, files=names, prefetch=False, transform=crc, **cache.options)
    for i in range(len(ds)): ds[i]
    sampler = Ep(FILES)
    loaders = {"item": DataLoader(Item(ds), batch_size=64, sampler=sampler, collate_fn=collate, num_workers=WORKERS, multiprocessing_context="fork"),
               "batched16": DataLoader(Batched(ds, 16), batch_size=None, sampler=BatchSampler(sampler, 64, False), collate_fn=collate, num_workers=WORKERS, multiprocessing_context="fork"),
               "batched4": DataLoader(Batched(ds, 4), batch_size=None, sampler=BatchSampler(sampler, 64, False), collate_fn=collate, num_workers=WORKERS, multiprocessing_context="fork")}
    spid = cache.server_pid()
    res = {k: [] for k in loaders}
    for r in range(ROUNDS):
        order = list(loaders.items()); random.Random(r).shuffle(order)
        for k, dl in order:
            perf = None
            if PERF:
                perf = subprocess.Popen(["perf", "record", "-a", "-g", "-o", f"{PERF}-{k}-{r}.data", "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); time.sleep(1)
            c0 = resource.getrusage(resource.RUSAGE_CHILDREN); s0 = resource.getrusage(resource.RUSAGE_SELF); sv0 = cpu_of(spid) if spid else 0
            t0 = time.perf_counter(); n = 0
            for b in dl: n += len(b[0])
            t = time.perf_counter() - t0
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN); s1 = resource.getrusage(resource.RUSAGE_SELF); sv1 = cpu_of(spid) if spid else 0
            if perf: perf.send_signal(2); perf.wait()
            cpu = (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) + (s1.ru_utime + s1.ru_stime - s0.ru_utime - s0.ru_stime) + (sv1 - sv0)
            wcpu = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
            res[k].append((t, cpu / n * 1e6, wcpu / n * 1e6, (c1.ru_minflt - c0.ru_minflt) / n))
            assert n == FILES
    for k, v in res.items():
        print(f"{k:8s} s {statistics.median(x[0] for x in v):.2f} cpu us/file {statistics.median(x[1] for x in v):6.1f} workers {statistics.median(x[2] for x in v):6.1f} faults/file {statistics.median(x[3] for x in v):5.2f}  all cpu {[round(x[1]) for x in v]}")
finally:
    warm.remove()
