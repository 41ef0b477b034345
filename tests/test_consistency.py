"""Consistency with the source: a dataset file rewritten, replaced or removed between two runs is
never served stale by the next run, whichever way it reads (FitCacheDataset with DataLoader
workers, Client, `fitcache run`), also across a restart of the server; and a run checks each
cached copy against its source once, not at every read."""

import os
import signal
import subprocess
import time

import pytest

import fitcache
from conftest import server_pid, wait_gone, wait_published
from test_preload import FITCACHE_BIN, command_env, describe, fitcache_run

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

OLD_MTIME = 1_700_000_000  # a fixed mtime, set back after each rewrite


def write(path, data, mtime=OLD_MTIME):
    """Writes data at path in place (same inode) and sets its mtime back, so that only the
    change time and the bytes tell the new version from the old one when the size is kept."""
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.truncate(0)
        f.write(data)
    os.utime(path, (mtime, mtime))


@pytest.fixture
def small_dataset(tmp_path):
    """Eight files of 1-8 KiB, with fixed mtimes; returns the root and {name: bytes}."""
    root = tmp_path / "data"
    root.mkdir()
    files = {}
    for i in range(8):
        name = f"f{i}.bin"
        files[name] = bytes([65 + i]) * (1024 * (i + 1))
        write(str(root / name), files[name])
    return str(root), files


def change(root, files):
    """Changes three files in the three ways that keep a name: rewritten in place with the
    same size and mtime (only ctime and the bytes differ), replaced by a rename (os.replace,
    as `sed -i` and `mv` do) and rewritten with another size. Returns the new {name: bytes}."""
    time.sleep(0.02)  # ctime moves with the kernel's clock tick
    new = dict(files)
    new["f0.bin"] = b"z" * len(files["f0.bin"])
    write(os.path.join(root, "f0.bin"), new["f0.bin"])
    new["f1.bin"] = b"replaced by a rename"
    tmp = os.path.join(root, ".f1.tmp")
    write(tmp, new["f1.bin"])
    os.replace(tmp, os.path.join(root, "f1.bin"))
    new["f2.bin"] = b"longer than before " * 200
    write(os.path.join(root, "f2.bin"), new["f2.bin"])
    return new


class Bytes:
    """Transform: the item's bytes (picklable, for DataLoader workers)."""

    def __call__(self, view):
        return bytes(view)


def read_with_loader(ds, workers=2):
    """Every item of ds through a DataLoader with fresh workers; {name: bytes}."""
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    return {ds.files[i]: data for i, data in enumerate(loader)}


def test_dataset_of_the_next_run_reads_changed_files_anew(small_dataset, cache_options):
    root, files = small_dataset
    first = fitcache.FitCacheDataset(root, Bytes(), **cache_options)
    assert read_with_loader(first) == files
    new = change(root, files)
    os.remove(os.path.join(root, "f3.bin"))
    del new["f3.bin"]

    second = fitcache.FitCacheDataset(root, Bytes(), files=sorted(new), **cache_options)
    checks = fitcache.server_stats(**cache_options)["source_checks"]
    for epoch in range(3):  # fresh DataLoader workers at every epoch, as by default
        assert read_with_loader(second) == new, f"epoch {epoch + 1} of the next run"
    stats = fitcache.server_stats(**cache_options)
    # Every copy the next run found was checked once for the whole run, not per epoch or
    # per worker: 7 files, of which f0-f2 were stale.
    assert stats["source_checks"] - checks <= len(new), stats
    assert stats["stale_copies"] >= 3, stats
    # The file removed at the source no longer opens through the cache.
    with pytest.raises(FileNotFoundError):
        fitcache.FitCacheDataset(root, files=["f3.bin"], **cache_options)[0]


def test_client_of_the_next_run_reads_changed_files_anew(small_dataset, cache_options):
    root, files = small_dataset
    with fitcache.Client(root, **cache_options) as c:
        assert {n: bytes(c.read(n)) for n in files} == files
    new = change(root, files)
    with fitcache.Client(root, **cache_options) as c:
        assert {n: bytes(c.read(n)) for n in files} == new
        assert bytes(c.read("f0.bin")) == new["f0.bin"], "second read of the rewritten file"


def test_a_restarted_server_checks_the_copies_it_kept(small_dataset, cache_options):
    root, files = small_dataset
    cache_options["memory_at_exit"] = "keep"  # the copies outlive the server
    options = {**cache_options, "job": "one-long-job"}  # even the same job: the server is new
    with fitcache.Client(root, **options) as c:
        assert {n: bytes(c.read(n)) for n in files} == files
    wait_published(cache_options, len(files))  # readers' copies are recorded after their reads
    pid = server_pid(cache_options["runtime_dir"])
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    new = change(root, files)
    with fitcache.Client(root, **options) as c:
        assert {n: bytes(c.read(n)) for n in files} == new
    stats = fitcache.server_stats(**cache_options)
    assert stats["source_reads"] == 3, "the unchanged copies were kept, the three changed ones read anew"


def test_fitcache_run_of_the_next_run_reads_changed_files_anew(small_dataset, cache_options):
    root, files = small_dataset
    names = sorted(files)
    cat = ["python3", "-c", "import sys\nfor p in sys.argv[1:]: sys.stdout.buffer.write(open(p, 'rb').read())",
           *[os.path.join(root, n) for n in names]]
    out = fitcache_run(cache_options, [root], cat)
    assert out.returncode == 0, describe(out)
    assert out.stdout == b"".join(files[n] for n in names)
    # Let the first run's prefetch finish, so that every file is cached before the change.
    deadline = time.monotonic() + 30
    while fitcache.server_stats(**cache_options)["published"] < len(files):
        assert time.monotonic() < deadline, "the first run's files were not all cached"
        time.sleep(0.05)
    new = change(root, files)
    out = fitcache_run(cache_options, [root], cat, prefetch=0)  # no prefetch: the shim asks
    assert out.returncode == 0, describe(out)
    assert out.stdout == b"".join(new[n] for n in names), "the next `fitcache run` read stale bytes"
    # With its prefetch (the default), the copies are checked for the run, as it goes.
    new = change(root, new)
    checks = fitcache.server_stats(**cache_options)["source_checks"]
    out = fitcache_run(cache_options, [root], cat)
    assert out.returncode == 0, describe(out)
    assert out.stdout == b"".join(new[n] for n in names)
    deadline = time.monotonic() + 30
    while fitcache.server_stats(**cache_options)["source_checks"] - checks < len(files):
        assert time.monotonic() < deadline, "the run's prefetch did not check every cached copy"
        time.sleep(0.05)


def test_fitcache_run_gives_its_program_one_job(small_dataset, cache_options):
    root, _ = small_dataset
    env = command_env(cache_options)
    show = ["python3", "-c", "import os; print(os.environ.get('FITCACHE_JOB', ''))"]
    out = subprocess.run([FITCACHE_BIN, "run", "--data", root, "--", *show], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, describe(out)
    job = out.stdout.strip()
    assert job.startswith("run-"), f"FITCACHE_JOB under fitcache run: {job!r}"
    out = subprocess.run([FITCACHE_BIN, "run", "--data", root, "--", *show], env={**env, "FITCACHE_JOB": "mine"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "mine", "a job set by the caller is kept"
