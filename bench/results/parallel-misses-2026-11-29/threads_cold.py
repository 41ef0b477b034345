# Cold reads by T threads of one process from a page-cached source: CPU per file (this process
# and the server) and, under strace, connects to the node socket.
import os, sys, time, tempfile, shutil, subprocess, resource
from concurrent.futures import ThreadPoolExecutor
import fitcache
root, T, N = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = fitcache.list_files(root)[:N]
for n in names:
    with open(os.path.join(root, n), "rb") as f: f.read()
work = tempfile.mkdtemp(prefix="fc-thr-"); tier = tempfile.mkdtemp(prefix="fc-thr-", dir="/dev/shm")
run = os.path.join(work, "run")
def cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")
try:
    with fitcache.Client(root, runtime_dir=run, tiers=f"memory:{tier}:2GiB") as c:
        c.read(names[0])
        spid = int(open(os.path.join(run, "server.lock")).read().strip())
        s0, r0, t0 = cpu_of(spid), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        with ThreadPoolExecutor(T) as pool:
            list(pool.map(lambda n: len(c.read(n)), names[1:]))
        time.sleep(0.3)  # the server records the last fills
        wall = time.perf_counter() - t0
        r1, s1 = resource.getrusage(resource.RUSAGE_SELF), cpu_of(spid)
        me = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        n = len(names) - 1
        st = c.stats()["client"]
        print(f"T={T} files {n}: reader {me / n * 1e6:.0f} us/file, server {(s1 - s0) / n * 1e6:.0f} us/file, fills {st['reader_fills']}, wall {wall:.2f}s")
    subprocess.run(["env", f"FITCACHE_RUNTIME_DIR={run}", os.environ.get("FITCACHE_CMD", "fitcache"), "stop"], capture_output=True)
finally:
    shutil.rmtree(work, ignore_errors=True); shutil.rmtree(tier, ignore_errors=True)
