import os, sys, time, zlib, tempfile, pathlib, secrets, resource, statistics, random
sys.path.insert(0, "/work/main/bench"); sys.path.insert(0, "/work/main/tests")
import bench_scale
from harness import Cluster, NODES
import fitcache, fitcache.dataset as fd  # noqa: E401
from torch.utils.data import DataLoader, Dataset, BatchSampler, Sampler
FILES, WORKERS, EPOCHS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
CHUNKS = [int(x) for x in sys.argv[4].split(",")]
SHARE = sys.argv[5] == "share"
src, manifest, _ = bench_scale.generate("/tmp/fcb/cdata", FILES, 1)
names = [r for r, _, _ in manifest]
fp = sum(-(-size // 4096) * 4096 + 4096 for _, size, _ in manifest)
tmp = pathlib.Path(tempfile.mkdtemp(prefix="fc-share-"))
cl = Cluster(tmp, src, budget=str(int(fp / 4 * 1.1) if SHARE else int(fp * 1.1) + (64 << 20)), serve_options={})
def crc(v): return zlib.crc32(v), len(v)
class Batched(Dataset):
    def __init__(s, ds, chunk): s.ds, s.chunk = ds, chunk
    def __len__(s): return len(s.ds)
    def __getitem__(s, idx):
        if s.chunk: fd._TRANSFORM_CHUNK = fd._CLUSTER_TRANSFORM_CHUNK = s.chunk
        return s.ds.__getitems__(idx)
class Ep(Sampler):
    def __init__(s, n): s.n, s.e = n, 0
    def __len__(s): return s.n
    def __iter__(s):
        o = list(range(s.n)); random.Random(s.e).shuffle(o); s.e += 1; return iter(o)
def proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f: x = f.read().rsplit(")", 1)[1].split()
    return (int(x[11]) + int(x[12])) / os.sysconf("SC_CLK_TCK")
try:
    opts = {**cl.options(node=NODES[0]), "job": secrets.token_hex(4), "runtime_dir": str(tmp / "run")}
    ds = fitcache.FitCacheDataset(src, files=names, transform=crc, **opts)
    dls = {c: DataLoader(Batched(ds, c), batch_size=None, sampler=BatchSampler(Ep(FILES), 64, False), num_workers=WORKERS,
                         multiprocessing_context="fork", collate_fn=lambda b: b) for c in CHUNKS}
    for e in range(2):
        n = sum(len(b) for b in dls[CHUNKS[0]])
    res = {c: [] for c in CHUNKS}
    pids = [p.pid for p in cl.procs.values()]
    for e in range(EPOCHS):
        order = list(CHUNKS); random.Random(e).shuffle(order)
        for c in order:
            s0 = sum(proc_cpu(p) for p in pids); r0 = resource.getrusage(resource.RUSAGE_CHILDREN); m0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter(); n = sum(len(b) for b in dls[c]); t = time.perf_counter() - t0
            s1 = sum(proc_cpu(p) for p in pids); r1 = resource.getrusage(resource.RUSAGE_CHILDREN); m1 = resource.getrusage(resource.RUSAGE_SELF)
            rd = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) + (m1.ru_utime + m1.ru_stime - m0.ru_utime - m0.ru_stime)
            res[c].append((t, (s1 - s0) / n * 1e6, rd / n * 1e6))
    for c in CHUNKS:
        v = res[c]
        print(f"{'share' if SHARE else 'fits'} chunk {c:3d}: s/epoch {statistics.median(x[0] for x in v):.3f}  servers us/file {statistics.median(x[1] for x in v):6.1f}  reader us/file {statistics.median(x[2] for x in v):6.1f}   all s {[round(x[0],3) for x in v]}")
finally:
    cl.stop()
