"""A batch's misses from a slow source are read side by side (capi/miss.c, serve_misses).

A reader fills its own misses one after the other while its source answers from memory; once
two fills in a row have waited on the source (a parallel file system's round trips), the
misses of its batches are read by several threads at once. The slow source here is the repository's
bench/slowfs (FUSE, as root), which counts the most opens it served at once."""

import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import fitcache
from conftest import digest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES, SIZE, BATCH = 16, 64 << 10, 4


def write_files(root):
    digests = {}
    for i in range(FILES):
        rel = f"d{i % 2}/f{i:02d}.bin"
        data = os.urandom(SIZE)
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


class SlowFS:
    """bench/slowfs serving source at mountpoint with round trips of rtt and no rate limit."""

    def __init__(self, binary, source, mountpoint, rtt="20ms"):
        self.mountpoint = mountpoint
        self.proc = subprocess.Popen([binary, "--rtt", rtt, "--rate", "0", source, mountpoint],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while not os.path.ismount(mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"slowfs did not mount: {self.proc.communicate()[1]}")
            time.sleep(0.02)

    def stop(self):
        """Unmounts it; returns the most opens it served at once."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=20)
        found = re.search(r"at most (\d+) opens at once", err)
        assert found, f"slowfs said: {err}"
        return int(found.group(1))

    def kill(self):
        """Stops it whatever state the test left it in, and never leaves its mount behind (the
        mount of a killed FUSE daemon stays until unmounted, and os.path.ismount cannot see it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # it unmounts itself
            try:
                self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate(timeout=10)
        if is_mounted(self.mountpoint):
            subprocess.run(["umount", "-l", self.mountpoint], check=False)


def is_mounted(path):
    """Whether path is a mount point in /proc/self/mountinfo (a dead FUSE mount too)."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


@pytest.fixture
def slow_source(tmp_path):
    """A source of FILES files behind slowfs: (mountpoint, digests, the SlowFS)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("slowfs mounts as root, through /dev/fuse")
    go = shutil.which("go")
    if not go:
        pytest.skip("no Go toolchain to build bench/slowfs")
    binary = tmp_path / "slowfs"
    subprocess.run([go, "build", "-o", str(binary), "./bench/slowfs"], cwd=REPO, check=True, timeout=600)
    source, mnt = tmp_path / "source", tmp_path / "mnt"
    source.mkdir()
    mnt.mkdir()
    digests = write_files(str(source))
    fs = SlowFS(str(binary), str(source), str(mnt))
    yield str(mnt), digests, fs
    fs.kill()


def read_in_batches(client, names):
    got = {}
    for at in range(0, len(names), BATCH):
        batch = names[at:at + BATCH]
        for name, view in zip(batch, client.read_many(batch)):
            got[name] = digest(view)
    return got


def test_a_batchs_misses_from_a_slow_source_are_read_side_by_side(slow_source, cache_options):
    root, digests, fs = slow_source
    names = sorted(digests)
    with fitcache.Client(root, **cache_options) as c:
        assert read_in_batches(c, names) == digests
        mine = c.stats()["client"]
        assert read_in_batches(c, names) == digests  # cached now
    at_once = fs.stop()
    assert mine["reader_fills"] == FILES, mine
    # The first two misses wait on the source alone; every later one is read beside others.
    assert mine["parallel_misses"] >= FILES - 2, mine
    assert at_once >= 2, f"slowfs served at most {at_once} open at once"


def test_a_forked_readers_batches_are_read_side_by_side(slow_source, cache_options):
    root, digests, fs = slow_source
    names = sorted(digests)
    with fitcache.Client(root, **cache_options) as c:
        c.stats()  # the server up, in this process; the child reads without Go
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if read_in_batches(c, names) == digests else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the forked reader read wrong bytes, or failed"
        assert read_in_batches(c, names) == digests
    assert fs.stop() >= 2


def test_a_batchs_misses_from_memory_are_read_in_turn(dataset, cache_options):
    root, digests = dataset
    names = sorted(n for n in digests if os.path.getsize(os.path.join(root, n)) <= 512 << 10)
    with fitcache.Client(root, **cache_options) as c:
        assert read_in_batches(c, names) == {n: digests[n] for n in names}
        mine = c.stats()["client"]
    assert mine["reader_fills"] == len(names), mine
    assert mine["parallel_misses"] == 0, mine


def test_threads_that_fill_at_once_keep_their_connections(tmp_path, cache_options):
    """Threads of one process that fill misses at once report them on connections the process
    keeps (up to 4, capi/nodesock.c), not on a new connection whenever the one it kept was
    busy: 16 threads filling 800 files made the server accept 283-508 connections then, 1-33
    now (on 2 cores)."""
    root = tmp_path / "many"
    root.mkdir()
    names = []
    for i in range(800):
        (root / f"f{i:03d}.bin").write_bytes(os.urandom(32 << 10))
        names.append(f"f{i:03d}.bin")
    with fitcache.Client(str(root), **cache_options) as c:
        c.read(names[0])  # the server up
        before = c.stats()["server"].get("node_connections", 0)
        with ThreadPoolExecutor(16) as pool:
            sizes = list(pool.map(lambda n: len(c.read(n)), names[1:]))
        mine, server = c.stats()["client"], c.stats()["server"]
    assert sizes == [32 << 10] * (len(names) - 1)
    assert mine["reader_fills"] >= len(names) - 16, mine  # a few may go to the server meanwhile
    accepted = server["node_connections"] - before
    assert 1 <= accepted <= 100, f"{accepted} node-socket connections for {mine['reader_fills']} fills by 16 threads"
