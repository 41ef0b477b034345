"""Shared fixtures: a generated dataset with known digests, and a private FitCache setup
(runtime directory, tiers, embedded server) per test, torn down by killing the server the
test's reads started."""

import hashlib
import os
import random
import secrets
import signal
import time

import pytest

import fitcache

@pytest.hookimpl(trylast=True)  # after pytest's own, which makes the factory
def pytest_configure(config):
    """Makes the run's temporary directory (pytest-of-USER/pytest-N) in this process, before
    any test forks (pytest.ini: --forked): each forked test would otherwise make one of its
    own, and pytest, which keeps the last three runs' directories, would keep every test's
    datasets and tiers (tens of GB over a few hundred runs)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        factory.getbasetemp()


# Sizes that probe the edges: empty, one byte, page boundaries, and typical samples.
EDGE_SIZES = [0, 1, 4095, 4096, 4097, 65537, 256 << 10, (1 << 20) + 3]


def make_dataset(root, n_random=24, seed=7):
    """Writes files of EDGE_SIZES plus n_random random sizes in nested directories; returns
    {relative path: sha256 hex digest}."""
    rng = random.Random(seed)
    sizes = EDGE_SIZES + [rng.randrange(1, 300_000) for _ in range(n_random)]
    digests = {}
    for i, size in enumerate(sizes):
        rel = os.path.join(f"class{i % 3}", f"sub{i % 2}", f"sample_{i:03d}.bin")
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = rng.randbytes(size)
        with open(path, "wb") as f:
            f.write(data)
        digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "dataset"
    root.mkdir()
    digests = make_dataset(str(root))
    return str(root), digests


def server_pid(runtime_dir):
    """The pid of the embedded server running in runtime_dir, or 0."""
    try:
        with open(os.path.join(runtime_dir, "server.lock")) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return 0
    return pid if _is_fitcache(pid) else 0


def _is_fitcache(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"fitcache" in f.read()
    except OSError:
        return False


def wait_gone(pid, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.02)
    return False


@pytest.fixture
def cache_options(tmp_path):
    """Options for a private cache: its own runtime directory and tiers (memory under
    /dev/shm, disk under tmp). Kills the embedded server the test started, at teardown."""
    shm = f"/dev/shm/fitcache-test-{os.getpid()}-{secrets.token_hex(4)}"  # pids come round again
    opts = {
        "runtime_dir": str(tmp_path / "run"),
        "tiers": f"memory:{shm}:256MiB,disk:{tmp_path / 'disk'}:512MiB",
        "idle_timeout": "120",
    }
    yield opts
    pid = server_pid(opts["runtime_dir"])
    if pid:
        os.kill(pid, signal.SIGTERM)
        assert wait_gone(pid), f"fitcache server {pid} did not stop on SIGTERM"
    import shutil
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(tmp_path / "disk", ignore_errors=True)  # pytest keeps old temporary directories


def wait_published(cache_options, count, timeout=30):
    """Waits until the cache's server has published count files: a miss of a small file is
    answered before the data mover has written it into a tier."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = fitcache.server_stats(**cache_options)
        if stats and stats["published"] >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server did not publish {count} files within {timeout}s")


def digest(view):
    return hashlib.sha256(view).hexdigest()


@pytest.fixture
def native_library():
    """Path of the installed libfitcache.so and its header directory."""
    lib = fitcache._native.library_path()
    assert os.path.exists(lib), f"libfitcache.so not installed at {lib}"
    return lib
