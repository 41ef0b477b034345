#!/usr/bin/env python3
"""A training job inside a memory cgroup, as a batch system runs it (Slurm's
ConstrainRAMSpace): --files files of 110 KiB read --epochs times by FitCacheDataset through a
DataLoader (2 fresh workers, shuffled, crc32 of every item checked), with the embedded
server's default tier sizes (memory: 25% of /dev/shm; a disk tier of 4 GiB), in a new cgroup
v1 memory cgroup of --limit bytes. Prints one JSON line: exit status, OOM kills, the cgroup's
peak, epoch seconds, the memory tier's budget and why. --memory-limit none sizes the tier as if
no cgroup were followed. Needs root and a cgroup v1 memory controller.

  python bench/bench_batch_job.py --limit 1GiB                      # the tier follows the job
  python bench/bench_batch_job.py --limit 1GiB --memory-limit none  # OOM-killed
  python bench/bench_batch_job.py --limit 64GiB                     # a job the dataset fits
"""
import argparse
import json
import os
import pathlib
import secrets
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_batch_job as tb  # noqa: E402  (the job and the dataset of the tests)

V1 = "/sys/fs/cgroup/memory"


class Cgroup(tb.MemoryCgroup):
    """tests/test_batch_job.py's cgroup, made outside pytest (v1 only)."""

    def __init__(self, limit):  # noqa: super().__init__ skips through pytest
        if not os.path.isfile(os.path.join(V1, "memory.limit_in_bytes")):
            raise SystemExit("needs a cgroup v1 memory controller at " + V1)
        self.version, self.dir = 1, os.path.join(V1, f"fitcache-bench-{os.getpid()}-{secrets.token_hex(3)}")
        self.limit, self.started, self.children = limit, [], []
        os.mkdir(self.dir)
        with open(os.path.join(self.dir, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))


def size(s):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[:-len(u)]) * m)
    return int(s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=size, default=1 << 30, help="the job's memory limit (1GiB, 64GiB, bytes)")
    ap.add_argument("--memory-limit", default="cgroup", choices=["cgroup", "none"])
    ap.add_argument("--files", type=int, default=15_000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-batch-job")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root to make a memory cgroup")

    manifest_path = pathlib.Path(f"{args.data}-{args.files}.json")
    data = f"{args.data}-{args.files}"
    if not manifest_path.exists():
        manifest_path.write_text(json.dumps(tb.make_dataset(data, args.files, 110 << 10)))
    manifest = json.loads(manifest_path.read_text())
    work = pathlib.Path(tempfile.mkdtemp(prefix="fitcache-bench-batch-job-"))
    shm = f"/dev/shm/fitcache-bench-{os.getpid()}-{secrets.token_hex(3)}"
    options = {"runtime_dir": str(work / "run"), "tiers": f"memory:{shm}:25%,disk:{work / 'disk'}:4GiB",
               "idle_timeout": "300", "memory_limit": args.memory_limit}
    cg = Cgroup(args.limit)
    try:
        start = time.perf_counter()
        rc, out, err = tb.run_job(cg, data, manifest, options, args.epochs, work)
        result = json.loads(out.strip().splitlines()[-1]) if rc == 0 else {}
        tiers = result.get("tiers", [{}])
        print(json.dumps({
            "tag": args.tag, "limit_bytes": args.limit, "memory_limit": args.memory_limit, "files": args.files,
            "exit_status": rc, "oom_kills": cg.oom_kills(), "peak_mib": cg.peak() >> 20,
            "epochs_s": [round(x, 2) for x in result.get("seconds", [])], "job_s": round(time.perf_counter() - start, 1),
            "bad_items": result.get("bad"), "memory_budget_mib": tiers[0].get("budget_bytes", 0) >> 20,
            "memory_used_mib": tiers[0].get("used_bytes", 0) >> 20, "limited_by": tiers[0].get("limited_by"),
            "disk_files": tiers[-1].get("files") if len(tiers) > 1 else None}), flush=True)
        if rc != 0:
            print(err[-2000:], file=sys.stderr)
    finally:
        pid = tb.server_pid(options["runtime_dir"])
        if pid:
            os.kill(pid, signal.SIGTERM)
            tb.wait_gone(pid, 30)
        cg.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
