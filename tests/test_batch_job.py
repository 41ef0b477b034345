"""FitCache inside a batch job with a memory limit (a memory cgroup, as Slurm's
ConstrainRAMSpace makes): the memory tier never gets the job killed, its copies leave RAM when
the job ends, and users sharing a node stay within the site's limit.

The jobs run in real memory cgroups (v1 or v2) that the tests make; they need root and a
writable memory controller, and are skipped with the reason otherwise."""

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest

from conftest import server_pid, wait_gone

MIB = 1 << 20

# The job: FitCacheDataset through a DataLoader with the default settings (fresh workers each
# epoch), the crc32 of every item checked against the manifest, over two epochs.
JOB = r"""
import json, sys, time, zlib
import torch
from torch.utils.data import DataLoader
import fitcache
root, manifest, options, epochs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
with open(manifest) as f:
    want = json.load(f)
names = sorted(want)
ds = fitcache.FitCacheDataset(root, transform=zlib.crc32, files=names, **options)
seconds, bad = [], 0
for epoch in range(epochs):
    start = time.perf_counter()
    loader = DataLoader(ds, batch_size=64, num_workers=2, shuffle=True,
                        generator=torch.Generator().manual_seed(epoch))
    got = [c for batch in loader for c in batch.tolist()]
    seconds.append(time.perf_counter() - start)
    # shuffled: compare as multisets of (crc) against the manifest's
    bad += sum(1 for a, b in zip(sorted(got), sorted(want.values())) if a != b) + abs(len(got) - len(names))
stats = fitcache.server_stats(**{k: v for k, v in options.items() if k in ("runtime_dir", "tiers")})
ds.close()
print(json.dumps({"seconds": seconds, "bad": bad, "tiers": stats["tiers"], "warnings": stats.get("warnings", [])}))
"""


class MemoryCgroup:
    """A memory cgroup made for a test, v1 or v2, with a limit: run() starts a program inside
    it from its first instruction. Removed at close, after the processes the test started
    in it (and only those) are gone."""

    def __init__(self, limit):
        v1 = "/sys/fs/cgroup/memory"
        v2 = "/sys/fs/cgroup"
        name = f"fitcache-test-{os.getpid()}-{secrets.token_hex(3)}"
        if os.geteuid() != 0:
            pytest.skip("needs root to make a memory cgroup")
        if os.path.isfile(os.path.join(v1, "memory.limit_in_bytes")):
            self.version, self.dir = 1, os.path.join(v1, name)
            limit_file = "memory.limit_in_bytes"
        elif "memory" in _read(os.path.join(v2, "cgroup.subtree_control")).split():
            self.version, self.dir = 2, os.path.join(v2, name)
            limit_file = "memory.max"
        else:
            pytest.skip("no writable memory cgroup controller (v1 memory, or v2 with memory delegated at the root)")
        try:
            os.mkdir(self.dir)
            with open(os.path.join(self.dir, limit_file), "w") as f:
                f.write(str(limit))
        except OSError as e:
            self.close()
            pytest.skip(f"cannot make a memory cgroup with a limit: {e}")
        self.limit = limit
        self.started = []
        self.children = []

    def child(self, name):
        """Makes a cgroup inside this one, without a limit of its own (as Slurm makes a task's
        inside its job's), and returns its name."""
        os.mkdir(os.path.join(self.dir, name))
        self.children.append(name)
        return name

    def start(self, args, child=None, **kw):
        """Starts args inside the cgroup, or its child, joined by a shell before exec."""
        procs = os.path.join(self.dir, child or "", "cgroup.procs")
        p = subprocess.Popen(["sh", "-c", f'echo $$ > {procs} && exec "$0" "$@"', *args], **kw)
        self.started.append(p.pid)
        return p

    def run(self, args, child=None, **kw):
        """Runs args inside the cgroup (or its child) and waits for it."""
        p = self.start(args, child, **kw)
        out, err = p.communicate(timeout=600)
        return p.returncode, out, err

    def oom_kills(self):
        if self.version == 1:
            text = _read(os.path.join(self.dir, "memory.oom_control"))
        else:
            text = _read(os.path.join(self.dir, "memory.events"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def peak(self):
        return int(_read(os.path.join(self.dir, "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")) or 0)

    def close(self):
        if not os.path.isdir(getattr(self, "dir", "")):
            return
        for name in getattr(self, "children", []):
            for _ in range(100):  # bounded: 10 s
                try:
                    os.rmdir(os.path.join(self.dir, name))
                    break
                except OSError:
                    time.sleep(0.1)
        for _ in range(100):  # bounded: 10 s
            try:
                os.rmdir(self.dir)
                return
            except OSError:
                time.sleep(0.1)
        left = _read(os.path.join(self.dir, "cgroup.procs")).split()
        raise AssertionError(f"cgroup {self.dir} not removed: processes {left} are still in it")


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def tree_bytes(path):
    """The bytes the files under path take (st_blocks), links not followed."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def copies(tier):
    """The files in the bins of a tier (copies and their records: not the tier's index or
    lock, which lie at its top), as {path: bytes they take}; claims being filled left out."""
    found = {}
    for dirpath, _, files in os.walk(tier):
        if os.path.samefile(dirpath, tier):
            continue
        for name in files:
            try:
                if not name.startswith(".tmp-fill-"):
                    found[os.path.join(dirpath, name)] = os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return found


def make_dataset(root, files, size, seed=3):
    """files files of size bytes (each different) in 100 class directories; returns
    {relative path: crc32}."""
    rng = random.Random(seed)
    block = rng.randbytes(size)
    manifest = {}
    for i in range(files):
        rel = f"c{i % 100:03d}/s{i:06d}.bin"
        data = i.to_bytes(8, "little") + block[8:]
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        manifest[rel] = zlib.crc32(data)
    return manifest


def stop_server(options):
    """Stops the server the test's jobs left (by its pid), so that its cgroup can go."""
    pid = server_pid(options["runtime_dir"])
    if pid:
        os.kill(pid, signal.SIGTERM)
        wait_gone(pid, 30)


@pytest.fixture
def job_setup(tmp_path):
    """A runtime directory and tiers as the embedded defaults make them (memory: a quarter of
    /dev/shm; a disk tier), private to the test; stops the server the job left, by pid."""
    shm = f"/dev/shm/fitcache-test-{os.getpid()}-{secrets.token_hex(4)}"
    options = {"runtime_dir": str(tmp_path / "run"), "tiers": f"memory:{shm}:25%,disk:{tmp_path / 'disk'}:4GiB",
               "idle_timeout": "300"}
    yield options, shm
    stop_server(options)
    shutil.rmtree(shm, ignore_errors=True)
    # pytest keeps the temporary directories of the last three runs: this file's datasets and
    # disk tiers left 4 GB in each, enough to take a shared machine's disk below what FitCache
    # leaves free in a tier's file system (keep_free, 10%), where a later run's disk tiers then
    # took nothing and its tests failed.
    for big in ("data", "disk"):
        shutil.rmtree(tmp_path / big, ignore_errors=True)


def run_job(cg, root, manifest, options, epochs, tmp_path, child=None):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    rc, out, err = cg.run([sys.executable, "-c", JOB, root, str(path), json.dumps(options), str(epochs)],
                          child=child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return rc, out, err


def test_a_1gib_job_reads_1_6gb_twice_and_leaves_no_ram(tmp_path, job_setup):
    """The issue's job: limited to 1 GiB, 15,000 files (1.6 GB) read twice with the default
    tier settings. The memory tier is sized from the limit and follows the job's use: the job
    finishes with every byte right and no OOM kill. At the job's end (SIGTERM to the server,
    as the batch system sends) no copy is left in RAM."""
    options, shm = job_setup
    cg = MemoryCgroup(1 << 30)
    try:
        root = str(tmp_path / "data")
        manifest = make_dataset(root, 15_000, 110 << 10)
        rc, out, err = run_job(cg, root, manifest, options, 2, tmp_path)
        assert rc == 0, f"job exit status {rc} (OOM kills: {cg.oom_kills()}):\n{err[-3000:]}"
        result = json.loads(out.strip().splitlines()[-1])
        assert result["bad"] == 0
        assert cg.oom_kills() == 0
        memory = result["tiers"][0]
        assert memory["kind"] == "memory" and memory["limited_by"] == "cgroup memory limit", memory
        assert 0 < memory["budget_bytes"] < 1 << 30
        print(f"\nepochs {result['seconds']}, memory tier {memory}, cgroup peak {cg.peak() >> 20} MiB")

        server = server_pid(options["runtime_dir"])
        assert server, "the job's server is not running after the job"
        held = tree_bytes(shm)
        assert held > 50 * MIB, f"the memory tier held only {held} bytes"
        os.kill(server, signal.SIGTERM)  # the job ends
        assert wait_gone(server, 30)
        # The lock (a pid line) and the emptied index (its header: the slots' pages are given
        # back) are left.
        assert sorted(os.listdir(shm)) == ["fitcache.index", "fitcache.lock"]
        assert tree_bytes(shm) <= 64 << 10, tree_bytes(shm)
    finally:
        stop_server(options)  # a server in the cgroup keeps it from being removed
        cg.close()


# Holds size bytes of anonymous memory until its standard input closes.
HOG = r"""
import sys
hog = bytearray(int(sys.argv[1]))
for i in range(0, len(hog), 4096):
    hog[i] = 1
print("ready", flush=True)
sys.stdin.read()
"""


def test_ranks_in_task_cgroups_share_the_jobs_limit(tmp_path, job_setup):
    """Slurm puts each task of a job (a training rank) in a cgroup of its own inside the job's,
    with the limit on the job's: the server, in one task's cgroup, keeps its tier within what
    the whole job leaves, not what its own task uses. Another task holds 350 MiB here; a
    server that counted its own task alone took the job past its 1 GiB."""
    options, shm = job_setup
    cg = MemoryCgroup(1 << 30)
    hog = None
    try:
        root = str(tmp_path / "data")
        manifest = make_dataset(root, 8000, 110 << 10)
        hog = cg.start([sys.executable, "-c", HOG, str(350 * MIB)], child=cg.child("task_1"),
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert hog.stdout.readline().strip() == "ready"
        rc, out, err = run_job(cg, root, manifest, options, 1, tmp_path, child=cg.child("task_0"))
        assert rc == 0, f"job exit status {rc} (OOM kills: {cg.oom_kills()}):\n{err[-3000:]}"
        assert json.loads(out.strip().splitlines()[-1])["bad"] == 0
        assert cg.oom_kills() == 0
        assert hog.poll() is None, "the other task was killed"
    finally:
        if hog is not None:
            hog.stdin.close()
            hog.wait(timeout=30)
        stop_server(options)
        cg.close()


@pytest.mark.parametrize("policy", ["keep", "disk"])
def test_memory_kept_or_moved_to_disk_at_the_jobs_end_when_asked(tmp_path, job_setup, policy):
    """memory_at_exit=keep leaves the copies in RAM for the next job; disk moves them to the
    disk tier, from which the next job's first epoch reads them without the source."""
    options, shm = job_setup
    options = {**options, "memory_at_exit": policy}
    cg = MemoryCgroup(1 << 30)
    try:
        root = str(tmp_path / "data")
        manifest = make_dataset(root, 300, 100 << 10)
        rc, out, err = run_job(cg, root, manifest, options, 1, tmp_path)
        assert rc == 0, err[-3000:]
        server = server_pid(options["runtime_dir"])
        held = copies(shm)
        os.kill(server, signal.SIGTERM)
        assert wait_gone(server, 30)
        after = tree_bytes(shm)
        if policy == "keep":
            # Every copy and record is still there, whole (the index's own pages are the
            # server's business: not counted).
            kept = copies(shm)
            assert len(held) >= 2 * len(manifest)
            assert not [p for p, n in held.items() if kept.get(p) != n], "copies gone or changed at the exit"
        else:
            assert after <= 64 << 10, os.listdir(shm)
            disk = options["tiers"].split(",")[1].split(":")[1]
            assert tree_bytes(disk) >= len(manifest) * (100 << 10)
        # The next job finds them: no source read.
        rc, out, err = run_job(cg, root, manifest, options, 1, tmp_path)
        assert rc == 0, err[-3000:]
        import fitcache
        stats = fitcache.server_stats(**{k: options[k] for k in ("runtime_dir", "tiers")})
        assert stats["source_reads"] == 0, stats
    finally:
        stop_server(options)  # a server in the cgroup keeps it from being removed
        cg.close()


def test_two_users_stay_under_the_sites_memory_limit(tmp_path):
    """Two users (root and nobody) read 400 MB each on a node whose site configuration allows
    all FitCache memory tiers together 300 MiB more than /dev/shm holds now: together they
    never hold more (sampled while they read), and each is told why its tier is small."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a second user (nobody)")
    if subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-c", "import fitcache, torch"],
                      capture_output=True).returncode != 0:
        pytest.skip("user nobody cannot import fitcache and torch from this Python")
    import pathlib
    import tempfile
    base = pathlib.Path(tempfile.mkdtemp(prefix="fitcache-two-users-", dir="/tmp"))  # pytest's is 0700
    os.chmod(base, 0o755)
    st = os.statvfs("/dev/shm")
    in_use = (st.f_blocks - st.f_bfree) * st.f_frsize
    site = base / "fitcache.conf"
    site.write_text(f"memory_per_node = {in_use + 300 * MIB}\n")
    os.chmod(site, 0o644)
    root = str(base / "data")
    manifest = make_dataset(root, 4000, 100 << 10)
    for dirpath, dirs, files in os.walk(base):
        for n in dirs + files:
            os.chmod(os.path.join(dirpath, n), 0o755)
    env = {**os.environ, "FITCACHE_SITE_CONFIG": str(site)}
    (base / "manifest.json").write_text(json.dumps(manifest))
    os.chmod(base / "manifest.json", 0o644)
    users, procs = {"root": None, "nobody": None}, {}
    shms = {}
    try:
        for user in users:
            shms[user] = f"/dev/shm/fitcache-test-{user}-{os.getpid()}-{secrets.token_hex(3)}"
            options = {"runtime_dir": f"/tmp/fitcache-test-{user}-{os.getpid()}-{secrets.token_hex(3)}",
                       "tiers": f"memory:{shms[user]}:2GiB", "idle_timeout": "60", "memory_at_exit": "clear"}
            users[user] = options
            cmd = [sys.executable, "-c", JOB, root, str(base / "manifest.json"), json.dumps(options), "2"]
            if user != "root":
                cmd = ["runuser", "-u", user, "--", *cmd]
            procs[user] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        peak = 0
        deadline = time.monotonic() + 300
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            st = os.statvfs("/dev/shm")
            peak = max(peak, (st.f_blocks - st.f_bfree) * st.f_frsize - in_use)
            time.sleep(0.05)
        results = {}
        for user, p in procs.items():
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, f"{user}: {err[-3000:]}"
            results[user] = json.loads(out.strip().splitlines()[-1])
            assert results[user]["bad"] == 0
        # The limit, plus the readers' fill files in flight (at most 512 KiB per reader) and
        # what the servers write between two readings of the file system (every 100 ms).
        assert peak <= 300 * MIB + 64 * MIB, f"memory tiers together held {peak >> 20} MiB, limit 300"
        limited = [r["tiers"][0].get("limited_by") for r in results.values()]
        assert "site memory_per_node" in limited, results
        print(f"\npeak of both users' memory tiers: {peak >> 20} MiB (limit 300 MiB); tiers {limited}")
    finally:
        for user, options in users.items():
            if options:
                pid = server_pid(options["runtime_dir"])
                if pid:
                    os.kill(pid, signal.SIGTERM)
                    wait_gone(pid)
                shutil.rmtree(options["runtime_dir"], ignore_errors=True)
        for d in shms.values():
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
