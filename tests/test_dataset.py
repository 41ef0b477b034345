"""FitCacheDataset end to end: bytes, source-read counts (seen from outside with inotify),
DataLoader start methods, samplers, errors, fork orders and server death."""

import errno
import gc
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest

import fitcache
import fitcache.dataset as dataset_module
from conftest import digest, server_pid, wait_gone, wait_published
from inotify import OpenCounter

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402


class Digest:
    """Transform that turns a zero-copy view into its sha256 (picklable for spawn)."""

    def __call__(self, view):
        return digest(view)


def indexed(ds):
    """A dataset of (index, digest) so that results can be matched whatever the order."""

    class Indexed(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            return i, ds[i]

    return Indexed()


class IndexedDigests(torch.utils.data.Dataset):
    """Picklable wrapper: item i is (i, sha256 of file i)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return i, digest(self.ds[i])


def check_epoch(loader, ds, digests):
    seen = {}
    for idx, dig in loader:
        for i, d in zip(idx.tolist(), dig):
            seen[i] = d
    assert len(seen) == len(ds)
    for i, d in seen.items():
        assert d == digests[ds.files[i]], f"wrong bytes for {ds.files[i]}"


def test_items_are_exact_readonly_zero_copy_views(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    assert ds.files == sorted(digests)
    assert len(ds) == len(digests)
    for epoch in range(2):
        for i in range(len(ds)):
            view = ds[i]
            assert isinstance(view, memoryview) and view.readonly
            assert digest(view) == digests[ds.files[i]]
    with pytest.raises(TypeError):
        ds[len(ds) - 1][0:1] = b"x"
    assert digest(ds[-1]) == digests[ds.files[-1]]
    with pytest.raises(IndexError):
        ds[len(ds)]
    stats = ds.stats()
    assert stats["client"]["local_hits"] >= len(ds)  # the second epoch never asked the server
    assert stats["server"]["source_reads"] == len(ds)
    ds.close()


def test_each_file_read_from_source_once_across_epochs_and_workers(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    with OpenCounter(root) as opens:
        for method, workers, persistent in (("fork", 2, False), ("spawn", 2, True), ("forkserver", 2, False)):
            loader = DataLoader(IndexedDigests(ds), batch_size=4, shuffle=True, num_workers=workers,
                                multiprocessing_context=method, persistent_workers=persistent)
            for _ in range(2):
                check_epoch(loader, ds, digests)
            del loader
        counts = opens.counts()
    assert set(counts) == set(digests), "every file read from the source"
    assert all(n == 1 for n in counts.values()), f"files read more than once: {counts}, {ds.stats()}"
    # The first fork opened the client here (open_before_fork): the forked workers read with
    # no library of their own to load.
    assert fitcache._native.loaded_here(), "the main process should have opened its client before forking"
    stats = ds.stats()["server"]
    assert stats["source_reads"] == len(ds)
    hits = sum(stats["hits"].values())
    assert hits >= 5 * len(ds), f"later epochs should be hits: {stats}"


def test_workers_with_transform_to_tensor_and_distributed_sampler(dataset, cache_options):
    root, digests = dataset
    to_len = lambda v: torch.tensor(len(v))  # noqa: E731
    ds = fitcache.FitCacheDataset(root, transform=to_len, **cache_options)
    covered = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        covered += list(sampler)
        loader = DataLoader(ds, batch_size=None, sampler=sampler, num_workers=1, multiprocessing_context="fork")
        lengths = [int(x) for x in loader]
        assert lengths == [os.path.getsize(ds.path(i)) for i in sampler]
    assert set(covered) == set(range(len(ds)))


def test_filter_and_explicit_file_list(dataset, cache_options):
    root, digests = dataset
    only = fitcache.FitCacheDataset(root, filter=lambda rel: rel.startswith("class1"), **cache_options)
    assert only.files == sorted(f for f in digests if f.startswith("class1"))
    by_suffix = fitcache.FitCacheDataset(root, filter=(".nothing",), **cache_options)
    assert len(by_suffix) == 0
    chosen = fitcache.FitCacheDataset(root, files=["class0/sub0/sample_000.bin"], **cache_options)
    assert digest(chosen[0]) == digests["class0/sub0/sample_000.bin"]


def test_dataset_pickles_and_reads_after_unpickling(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._client is None
    assert digest(clone[1]) == digests[clone.files[1]]


def test_bad_inputs_raise_clear_errors(dataset, cache_options, tmp_path):
    root, digests = dataset
    with pytest.raises(FileNotFoundError):
        fitcache.FitCacheDataset(str(tmp_path / "missing"), **cache_options)
    with pytest.raises(NotADirectoryError):
        fitcache.FitCacheDataset(os.path.join(root, sorted(digests)[0]), **cache_options)

    ds = fitcache.FitCacheDataset(root, **cache_options)
    os.remove(ds.path(3))  # deleted after listing
    with pytest.raises(FileNotFoundError) as err:
        ds[3]
    assert err.value.errno == errno.ENOENT and ds.files[3] in str(err.value)
    assert isinstance(err.value, fitcache.NotFound)

    client = ds._get_client()
    with pytest.raises(PermissionError, match="outside the dataset root"):
        client.read("/etc/hostname")
    with pytest.raises(PermissionError):
        client.read("../../etc/hostname")
    with pytest.raises(IsADirectoryError):
        client.read("class0")
    outside = tmp_path / "secret"
    outside.write_bytes(b"secret")
    os.symlink(outside, os.path.join(root, "escape"))
    with pytest.raises(PermissionError, match="outside"):
        client.read("escape")
    with pytest.raises(fitcache.FitCacheError, match="unknown option"):
        fitcache.Client(root, no_such_option=1)
    with pytest.raises(fitcache.FitCacheError, match="kind"):
        fitcache.Client(root, **{**cache_options, "tiers": "ssd:/tmp/x"})
    client.close()
    client.close()  # idempotent
    with pytest.raises(ValueError):
        client.read("class0/sub0/sample_000.bin")


def test_pread_size_and_views_outlive_client(dataset, cache_options):
    root, digests = dataset
    rel = "class1/sub1/sample_007.bin"  # 256 KiB
    with fitcache.Client(root, **cache_options) as client:
        with open(os.path.join(root, rel), "rb") as f:
            want = f.read()
        assert client.size(rel) == len(want)
        assert client.pread(rel, 100, 5) == want[5:105]
        assert client.pread(rel, 100, len(want)) == b""
        view = client.read(rel)
    assert bytes(view) == want  # the mapping outlives the client


def test_reads_leave_nothing_for_the_cyclic_garbage_collector(dataset, cache_options):
    """A read, a batch, a miss, stats and a prefetch list make no garbage that only the cyclic
    collector frees (a ctypes array type per read did): in DataLoader workers forked from a large main process, the collections it
    caused walked every object inherited from the parent (docs/BENCHMARKS.md, section 29)."""
    root, digests = dataset
    rels = sorted(digests)
    with fitcache.Client(root, **cache_options) as client:
        for rel in rels:  # cached, and every kind of call made once
            client.read(rel)
        client.read_many(rels)
        with pytest.raises(FileNotFoundError):
            client.read("class0/missing.bin")
        client.stats()
        fitcache._native.PathList(rels)
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                for rel in rels:
                    assert digest(client.read(rel)) == digests[rel]
                for n in (1, 5, 7, len(rels)):
                    for view, rel in zip(client.read_many(rels[:n]), rels):
                        assert digest(view) == digests[rel]
                with pytest.raises(FileNotFoundError):
                    client.read("class0/missing.bin")
                assert client.stats()["client"]  # as a training loop may log, every step
                client.prefetch(fitcache._native.PathList(rels))  # a list per epoch
            found = gc.collect()
        finally:
            gc.enable()
    assert found == 0, f"reads left {found} objects that only the cyclic garbage collector frees"


def tier_mappings():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/fitcache-test-" in line or "/disk/" in line)


def test_hits_are_copies_or_mappings_released_with_their_views(tmp_path, cache_options):
    """Cached files up to 1 MiB come back as copies (one copy, like read(): no mapping is left
    behind), larger ones as mappings that live exactly as long as their views."""
    root = tmp_path / "mixed"
    root.mkdir()
    small, large = os.urandom(100_000), os.urandom(3 << 20)
    (root / "small.bin").write_bytes(small)
    (root / "large.bin").write_bytes(large)
    ds = fitcache.FitCacheDataset(str(root), **cache_options)
    for i in range(len(ds)):
        ds[i]  # misses: cached by the server
    wait_published(cache_options, len(ds))
    gc.collect()
    before = tier_mappings()
    views = {name: ds[ds.files.index(name)] for name in ("small.bin", "large.bin")}
    assert bytes(views["small.bin"]) == small and bytes(views["large.bin"]) == large
    assert ds.stats()["client"]["local_hits"] >= 2, "both reads were hits"
    assert tier_mappings() == before + 1, "only the large file is mapped"
    derived = views["large.bin"][10:20]
    del views
    gc.collect()
    assert tier_mappings() == before + 1, "the derived view keeps the large file mapped"
    del derived
    gc.collect()
    assert tier_mappings() == before
    ds.close()
    assert fitcache._native.open_handles()[1] == 0, "every buffer released"


def test_damaged_cache_entry_is_never_returned(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    rel = "class1/sub1/sample_007.bin"
    i = ds.files.index(rel)
    ds[i]
    wait_published(cache_options, 1)
    shm = cache_options["tiers"].split(",")[0].split(":")[1]
    cached = [os.path.join(d, f) for d, _, fs in os.walk(shm) for f in fs
              if f.endswith("sample_007.bin") and not f.startswith(".")]  # not its record
    assert len(cached) == 1
    with open(cached[0], "r+b") as f:
        f.truncate(1000)
    assert digest(ds[i]) == digests[rel]


def test_killing_the_server_mid_epoch_loses_nothing(dataset, cache_options):
    root, digests = dataset
    # Without prefetch, so that the reads after the kill still miss (with it, the server has
    # cached every file by then and the reads are hits that need no server).
    ds = fitcache.FitCacheDataset(root, prefetch=False, **cache_options)
    loader = DataLoader(IndexedDigests(ds), batch_size=2, shuffle=True, num_workers=2,
                        multiprocessing_context="fork")
    seen, killed = {}, 0
    for batch, (idx, dig) in enumerate(loader):
        seen.update(zip(idx.tolist(), dig))
        if batch == 3:
            killed = server_pid(cache_options["runtime_dir"])
            assert killed
            os.kill(killed, signal.SIGKILL)
            assert wait_gone(killed)
    assert len(seen) == len(ds)
    for i, d in seen.items():
        assert d == digests[ds.files[i]]
    # The workers forked after the first fork read through the client opened then (C only),
    # which cannot restart the server: their misses read the source. The next epoch's fork
    # restarts it (open_before_fork checks the server before each fork).
    check_epoch(loader, ds, digests)
    restarted = server_pid(cache_options["runtime_dir"])
    assert restarted and restarted != killed


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_fork_after_load_is_served_by_the_cache_without_go(dataset, cache_options):
    """A process forked after its parent loaded the library cannot run Go, yet reads through
    the cache: hits come from the tiers (C), misses are cached by the server through its node
    socket. Everything that needs Go fails at once with ForkedAfterLoad, never a hang."""
    root, digests = dataset
    code = f"""
import os, hashlib, logging, fitcache
ds = fitcache.FitCacheDataset({root!r}, **{cache_options!r})
ds[0]  # loads the Go runtime in this process
pid = os.fork()
if pid == 0:
    class Records(logging.Handler):
        seen = []
        def emit(self, record):
            self.seen.append(record)
    logging.getLogger("fitcache").addHandler(Records())
    ok = all(hashlib.sha256(ds[i]).hexdigest() == {digests!r}[ds.files[i]] for i in range(len(ds)))
    ok = ok and all(hashlib.sha256(v).hexdigest() == {digests!r}[ds.files[i]]
                    for i, v in enumerate(ds.__getitems__(range(len(ds)))))
    ok = ok and not Records.seen  # nothing fell back to the source
    try:
        fitcache.Client({root!r})
        ok = False
    except fitcache.ForkedAfterLoad:
        pass
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print("child status", status)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    with OpenCounter(root) as opens:
        out = run_python(code)
        counts = opens.counts()
    assert out.returncode == 0, out.stdout + out.stderr
    assert counts == {name: 1 for name in digests}, "each file read from the source once"


class _FailOnFallback(logging.Handler):
    """Turns what the package logs (a fallback to the source, say) into an error in the process
    that logs it, a DataLoader worker included: the read fails, and so does the epoch."""

    def emit(self, record):
        raise AssertionError(f"fitcache logged: {record.getMessage()}")


fail_on_fallback = _FailOnFallback()


def test_dataloader_forked_after_a_read_in_the_main_process_uses_the_cache(dataset, cache_options):
    """Users look at a sample before training: the main process loads the library, then the
    DataLoader forks its workers. Their reads still go through the cache: the first epoch
    reads each file from the source once, the next ones not at all."""
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    loader = DataLoader(IndexedDigests(ds), batch_size=4, shuffle=True, num_workers=2,
                        multiprocessing_context="fork")
    with OpenCounter(root) as opens:
        ds[0]  # loads the library here (and hands the server the file list to prefetch)
        logger = logging.getLogger("fitcache")
        logger.addHandler(fail_on_fallback)  # forked workers inherit it
        try:
            check_epoch(loader, ds, digests)
            first = opens.counts()
            for _ in range(2):
                check_epoch(loader, ds, digests)
        finally:
            logger.removeHandler(fail_on_fallback)
        later = opens.counts() - first
    assert first == {name: 1 for name in digests}, first
    assert not later, f"source opens after the first epoch: {later}"


def test_fork_before_load_uses_the_cache(dataset, cache_options):
    root, digests = dataset
    code = f"""
import os, hashlib, fitcache
ds = fitcache.FitCacheDataset({root!r}, open_before_fork=False, **{cache_options!r})
pid = os.fork()
if pid == 0:
    ok = all(hashlib.sha256(ds[i]).hexdigest() == {digests!r}[ds.files[i]] for i in range(len(ds)))
    ok = ok and ds.stats()["client"]["direct_reads"] == 0
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    out = run_python(code)
    assert out.returncode == 0, out.stdout + out.stderr


def test_getitems_returns_what_getitem_does(dataset, cache_options):
    """__getitems__ (PyTorch 2's DataLoader calls it for a batch) gives the items __getitem__
    gives, in order, with the transform applied, in one native call; a failing file raises its
    own error, and nothing it read is left open."""
    import fitcache._native as native
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    order = list(range(len(ds)))[::-1] + [0, 0]  # reversed, with a repeat
    one_by_one = [digest(ds[i]) for i in order]
    batched = ds.__getitems__(order)
    assert [digest(v) for v in batched] == one_by_one
    assert all(v.readonly for v in batched)
    del batched
    assert native.open_handles()[1] == 0
    sized = fitcache.FitCacheDataset(root, transform=len, **cache_options)
    assert sized.__getitems__([1, 2]) == [sized[1], sized[2]] == [len(ds[1]), len(ds[2])]
    # The embedded server: the chunks of one node, here and in a forked reader.
    assert not sized._get_client().cluster
    assert sized._transform_chunk() == dataset_module._TRANSFORM_CHUNK
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover -- the child reports through the pipe
        try:
            os.write(w, b"%d" % sized._transform_chunk())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        assert f.read() == b"%d" % dataset_module._TRANSFORM_CHUNK
    os.waitpid(pid, 0)
    # A batch of several chunks (a transform is applied a chunk at a time): every item, in
    # order, and a file failing in a later chunk raises its own error.
    long_order = (order * 8)[:3 * dataset_module._TRANSFORM_CHUNK + 5]
    assert sized.__getitems__(long_order) == [len(ds[i]) for i in long_order]
    late = fitcache.FitCacheDataset(root, transform=len, files=ds.files[:1] * 40 + ["no-such-file.bin"],
                                    **cache_options)
    with pytest.raises(FileNotFoundError):
        late.__getitems__(list(range(41)))
    assert ds.__getitems__([]) == []
    broken = fitcache.FitCacheDataset(root, files=[ds.files[0], "no-such-file.bin"], **cache_options)
    with pytest.raises(FileNotFoundError):
        broken.__getitems__([0, 1])
    import gc
    gc.collect()
    assert native.open_handles()[1] == 0


def test_dataset_twice_the_cache_is_read_from_the_source_once_per_epoch(tmp_path, cache_options):
    """A memory tier of half the dataset and no other: the files cached first stay, none is
    evicted for another of the same dataset, and each epoch reads the others from the source
    once (the C layer reads them itself: the server is not asked again for a second). Every
    byte is right, and a link leading out of the dataset is still refused."""
    import random
    root = tmp_path / "twice"
    root.mkdir()
    size, n = 60_000, 40
    want = {}
    for i in range(n):
        data = os.urandom(size)
        (root / f"f{i:02d}.bin").write_bytes(data)
        want[f"f{i:02d}.bin"] = digest(data)
    (root / "escape.bin").symlink_to("/etc/hostname")
    shm = cache_options["tiers"].split(",")[0].split(":")[1]
    footprint = -(-size // 4096) * 4096 + 4096  # data and record, in 4 KiB blocks
    options = {**cache_options, "tiers": f"memory:{shm}:{n // 2 * footprint}"}
    # Without prefetch: its reads racing a reader's miss for the last room of the tier can
    # cost one more open of that file (the miss opens the source, then finds the room taken,
    # and the reader opens it again); see the README's Limits. This test is about readers.
    ds = fitcache.FitCacheDataset(str(root), files=sorted(want), prefetch=False, **options)
    per_epoch = []
    with OpenCounter(str(root)) as opens:
        for epoch in range(3):
            order = list(range(n))
            random.Random(epoch).shuffle(order)
            for i in order:
                assert digest(ds[i]) == want[ds.files[i]]
            per_epoch.append(sum(opens.counts().values()) - sum(per_epoch))
    server = ds.stats()["server"]
    assert server["evictions"] == 0
    assert sum(t["files"] for t in server["tiers"]) == n // 2
    assert per_epoch[0] == n and per_epoch[1:] == [n // 2, n // 2], per_epoch
    assert ds.stats()["client"]["direct_reads"] >= n // 2
    with pytest.raises(PermissionError):
        ds._get_client().read("escape.bin")
    ds.close()


def test_torch2_dataloader_reads_batches_through_getitems(dataset, cache_options):
    """PyTorch 2's DataLoader fetches a batch with one __getitems__ call (fc_read_many): the
    items, in the sampler's order, are the files' bytes. Debian's torch 1.13 has no such call:
    this runs under scripts/test-torch2.sh, which installs PyPI's torch in its own venv."""
    torch = pytest.importorskip("torch")
    if int(torch.__version__.split(".")[0]) < 2:
        pytest.skip(f"torch {torch.__version__} calls __getitem__ per item; see scripts/test-torch2.sh")
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    calls = []

    class Counted(fitcache.FitCacheDataset):
        def __getitems__(self, indices):
            calls.append(len(indices))
            return [bytes(v) for v in super().__getitems__(indices)]

    counted = Counted(root, **cache_options)
    loader = DataLoader(counted, batch_size=8, shuffle=False, num_workers=0, collate_fn=lambda batch: batch)
    got = [item for batch in loader for item in batch]
    assert calls and all(n <= 8 for n in calls), f"__getitems__ calls {calls}"
    assert [digest(v) for v in got] == [digests[f] for f in ds.files]


def test_forked_readers_count_hits_on_lines_of_their_own(dataset, cache_options):
    """Each reader process counts its hits on a 64-byte line of the tier index's counters that
    no other process writes (tiers/index.go): a child forked after its parent read through the
    cache claims its own line, and the server's hits are the sum of the lines."""
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    for i in range(len(ds)):
        ds[i]
    wait_published(cache_options, len(ds))
    ds.close()
    code = f"""
import os, fitcache
ds = fitcache.FitCacheDataset({root!r}, **{cache_options!r})
for i in range(len(ds)):
    ds[i]
children = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        for _ in range(3):
            for i in range(len(ds)):
                ds[i]
        os._exit(0)
    children.append(pid)
for pid in children:
    assert os.waitpid(pid, 0)[1] == 0
print(*children)
"""
    out = run_python(code)
    assert out.returncode == 0, out.stdout + out.stderr
    children = [int(p) for p in out.stdout.split()]
    shm = cache_options["tiers"].split(",")[0].split(":")[1]
    with open(os.path.join(shm, "fitcache.index"), "rb") as f:
        counters = f.read(4096 + 256 * 64)[4096:]
    lines = {}
    for i in range(256):
        owner, hits = struct.unpack_from("<I4xQ", counters, i * 64)
        if owner:
            lines[owner] = lines.get(owner, 0) + hits
    for pid in children:
        assert lines.get(pid, 0) > 0, f"child {pid} counted no hit on a line of its own: {lines}"
    stats = fitcache.server_stats(**cache_options)
    assert stats["hits"]["memory"] >= sum(lines.values()) >= 2 * 3 * len(ds), (stats["hits"], lines)


class _CountingLock:
    """A lock that counts its acquisitions."""

    def __init__(self):
        self.lock, self.taken = threading.Lock(), 0

    def __enter__(self):
        self.taken += 1
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_threads_open_one_client_and_read_without_a_lock(dataset, cache_options, monkeypatch):
    """Eight threads of a loader read a fresh dataset at once: they open one client between
    them (the opening takes a while: the threads overlap in it), and once it is open, reads
    take no Python lock. Before, each thread that came first opened a client of its own."""
    root, digests = dataset
    opened = []
    real_client = fitcache._native.Client

    def slow_client(*args, **kwargs):
        client = real_client(*args, **kwargs)
        opened.append(client)
        time.sleep(0.2)  # the other threads come in meanwhile
        return client

    monkeypatch.setattr(fitcache._native, "Client", slow_client)
    counting = _CountingLock()
    monkeypatch.setattr(dataset_module, "_open_lock", counting, raising=False)
    ds = fitcache.FitCacheDataset(root, prefetch=False, **cache_options)
    start = threading.Barrier(8)
    errors = []

    def read():
        start.wait()
        try:
            for i in range(len(ds)):
                assert digest(ds[i]) == digests[ds.files[i]]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(opened) == 1, f"8 threads opened {len(opened)} clients"
    taken = counting.taken
    for i in range(len(ds)):
        ds[i]
    assert counting.taken == taken, "reads took the dataset's lock"
    ds.close()


def test_pid_follows_fork():
    """The pid the bindings check per read (instead of a system call) is the child's after fork."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if fitcache._native.pid == os.getpid() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fitcache._native.pid == os.getpid()

def test_workers_forked_without_open_before_fork_load_the_library_themselves(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, open_before_fork=False, **cache_options)
    loader = DataLoader(IndexedDigests(ds), batch_size=4, shuffle=True, num_workers=2)
    for _ in range(2):
        check_epoch(loader, ds, digests)
    assert not fitcache._native.loaded_here(), "the main process should not have loaded the Go runtime"
    assert ds.stats()["server"]["source_reads"] == len(ds)
