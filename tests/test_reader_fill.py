"""Readers' fills: a reader that misses a small file reads it from the source itself, writes
its copy into the server's first tier and reports it; the server records it (see
tiers/fill.go, capi/fill.c). The source is still read once per file, whoever reads it: readers
at once, the server's prefetch, readers killed half-way."""

import glob
import hashlib
import os
import subprocess
import sys
import time

import fitcache
from conftest import digest

READER = """
import sys, time, hashlib, fitcache
root, start_at = sys.argv[1], float(sys.argv[2])
options = dict(runtime_dir=sys.argv[3], tiers=sys.argv[4])
names = sys.argv[5:]
with fitcache.Client(root, **options) as c:
    while time.time() < start_at:
        pass
    for name in names:
        print(name, hashlib.sha256(c.read(name)).hexdigest())
    print("fills", c.stats()["client"]["reader_fills"])
"""


def server(cache_options, want_reads, timeout=30):
    """The server's statistics once it has recorded want_reads source reads (the readers'
    reports are recorded in the background), or after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        stats = fitcache.server_stats(**cache_options)
        if stats["source_reads"] >= want_reads or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def leftover_fills(cache_options):
    memory = cache_options["tiers"].split(",")[0].split(":")[1]
    return glob.glob(os.path.join(memory, "*", "*", ".tmp-*"))


def test_a_readers_misses_are_its_own_fills(dataset, cache_options):
    root, digests = dataset
    with fitcache.Client(root, **cache_options) as c:
        for name, want in digests.items():
            assert digest(c.read(name)) == want, name
        mine = c.stats()["client"]
        stats = server(cache_options, len(digests))
        for name, want in digests.items():  # all cached now
            assert digest(c.read(name)) == want, name
        again = c.stats()["client"]
    small = sum(1 for n in digests if os.path.getsize(os.path.join(root, n)) <= 512 << 10)
    assert mine["reader_fills"] == small, mine
    assert stats["reader_fills"] == small and stats["fills_refused"] == 0, stats
    assert stats["source_reads"] == len(digests), stats
    assert again["local_hits"] - mine["local_hits"] == len(digests), again
    assert not leftover_fills(cache_options)


def test_readers_at_once_read_each_file_once(tmp_path, cache_options):
    root = tmp_path / "data"
    names = []
    for i in range(200):
        p = root / f"d{i % 4}" / f"f{i:03d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(1000 + 97 * i))
        names.append(os.path.relpath(p, root))
    want = {n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in names}
    # Start the server first, so that every reader finds it.
    with fitcache.Client(str(root), **cache_options):
        pass
    start_at = time.time() + 1.0
    procs = []
    for k in range(6):  # each reader its own order, all at the same moment
        order = names[k * 33:] + names[:k * 33]
        procs.append(subprocess.Popen([sys.executable, "-c", READER, str(root), str(start_at),
                                       cache_options["runtime_dir"], cache_options["tiers"], *order],
                                      stdout=subprocess.PIPE, text=True))
    fills = 0
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        lines = out.splitlines()
        fills += int(lines[-1].split()[1])
        assert dict(line.split() for line in lines[:-1]) == want
    stats = server(cache_options, len(names))
    time.sleep(0.5)  # a second read of a file would be recorded by now
    stats = fitcache.server_stats(**cache_options)
    assert stats["source_reads"] == len(names), stats
    assert stats["reader_fills"] == fills and 0 < fills <= len(names), (fills, stats)
    assert not leftover_fills(cache_options)


def test_a_claim_left_by_a_dead_reader_is_taken_over(dataset, cache_options):
    root, digests = dataset
    name = next(n for n in sorted(digests) if 0 < os.path.getsize(os.path.join(root, n)) < 100_000)
    with fitcache.Client(root, **cache_options) as c:
        c.read(sorted(digests)[0] if sorted(digests)[0] != name else sorted(digests)[1])
        # A reader that claimed the file and died: its fill file, not written for a while.
        memory = cache_options["tiers"].split(",")[0].split(":")[1]
        path = os.path.join(root, name)
        fill = os.path.join(memory, fitcache_fill_name(path))
        os.makedirs(os.path.dirname(fill), mode=0o700, exist_ok=True)
        with open(fill, "wb") as f:
            f.write(b"half")
        old = time.time() - 60
        os.utime(fill, (old, old))
        start = time.monotonic()
        assert digest(c.read(name)) == digests[name]
        assert time.monotonic() - start < 30
    assert not os.path.exists(fill)


def fitcache_fill_name(path):
    """tiers.FillName: "ab/cd/.tmp-fill-<key>", the key FNV-1a of the clean path."""
    h = 0xcbf29ce484222325
    for b in os.path.normpath(path).encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h & 0xff:02x}/{(h >> 8) & 0xff:02x}/.tmp-fill-{h:016x}"


def test_a_reader_fills_into_bins_that_exist(dataset, cache_options):
    """A reader's fill opens its bin ("ab/cd" of the first tier) with one openat2 where it
    exists (capi/fill.c open_bin), and makes it where it does not: with every bin made
    beforehand, each miss is still the reader's own fill."""
    root, digests = dataset
    memory = cache_options["tiers"].split(",")[0].split(":")[1]
    with fitcache.Client(root, **cache_options) as c:
        names = sorted(n for n in digests if 0 < os.path.getsize(os.path.join(root, n)) < 1_000_000)
        for name in names:
            bin_dir = os.path.dirname(os.path.join(memory, fitcache_fill_name(os.path.join(root, name))))
            os.makedirs(bin_dir, mode=0o700, exist_ok=True)
        for name in names:
            assert digest(c.read(name)) == digests[name], name
        assert c.stats()["client"]["reader_fills"] == len(names)
    assert server(cache_options, len(names))["reader_fills"] == len(names)
    assert not leftover_fills(cache_options)


def test_a_new_jobs_unchecked_copies_are_not_opened_at_the_source(dataset, cache_options):
    """A new job's first reads of cached copies are misses until the server has checked each
    against its source (a stat): the reader must leave them to the server, not open the
    source to fill them."""
    from inotify import OpenCounter
    root, digests = dataset
    first = fitcache.FitCacheDataset(root, prefetch=False, **cache_options)
    for i in range(len(first)):
        first[i]
    server(cache_options, len(digests))
    time.sleep(0.5)  # every report recorded
    second = fitcache.FitCacheDataset(root, prefetch=False, **cache_options)  # a new job
    with OpenCounter(root) as opens:
        for i in range(len(second)):
            assert digest(second[i]) == digests[second.files[i]]
        counts = opens.counts()
    assert not counts, f"sources opened for copies the server only had to check: {counts}"
    assert fitcache.server_stats(**cache_options)["source_reads"] == len(digests)


def test_a_readers_copy_is_recorded_as_it_wrote_it(tmp_path, cache_options):
    """The reader computes its copy's checksum and sets its mode and times itself (the server
    records the copy without reading it, capi/fill.c): the copies then hold the source's mode
    (read permission for the owner added) and modification time, and every one passes the
    checksum check of `fitcache verify`."""
    root = tmp_path / "modes"
    root.mkdir()
    files = {}
    for i, (size, mode) in enumerate([(1, 0o644), (7, 0o444), (4096, 0o755), ((110 << 10) + 3, 0o600),
                                      (8, 0o640), (65537, 0o604)]):
        name = f"f{i}.bin"
        path = root / name
        path.write_bytes(os.urandom(size))
        os.chmod(path, mode)
        mtime_ns = 1_700_000_000_000_000_000 + i * 1_000_000_007
        os.utime(path, ns=(mtime_ns, mtime_ns))
        files[name] = (hashlib.sha256(path.read_bytes()).hexdigest(), mode, mtime_ns)
    with fitcache.Client(str(root), **cache_options) as c:
        for name, (want, _, _) in files.items():
            assert hashlib.sha256(c.read(name)).hexdigest() == want, name
        assert c.stats()["client"]["reader_fills"] == len(files)
    stats = server(cache_options, len(files))
    assert stats["reader_fills"] == len(files) and stats["fills_refused"] == 0, stats
    memory = cache_options["tiers"].split(",")[0].split(":")[1]
    for name, (_, mode, mtime_ns) in files.items():
        copies = glob.glob(os.path.join(memory, "*", "*", "*-" + name))
        assert len(copies) == 1, (name, copies)
        st = os.stat(copies[0])
        assert (st.st_mode & 0o7777, st.st_mtime_ns) == (mode | 0o400, mtime_ns), name
    assert not leftover_fills(cache_options)
    verify = subprocess.run([sys.executable, "-m", "fitcache", "verify", "--tiers", cache_options["tiers"]],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"{len(files)} entries valid, 0 damaged" in verify.stdout, verify.stdout


def test_a_dataset_that_stops_fitting_is_said_once(tmp_path, cache_options):
    """Readers fill a memory tier of 1 MiB with a dataset of 4 MB: the server says once, in
    its stats' warnings, that the dataset does not fit (its other files are read from the
    source every epoch), and every read is right."""
    root = tmp_path / "data"
    root.mkdir()
    want = {}
    for i in range(40):
        data = os.urandom(100_000)
        (root / f"f{i:02d}").write_bytes(data)
        want[f"f{i:02d}"] = data
    shm = cache_options["tiers"].split(",")[0].rsplit(":", 1)[0]
    options = dict(cache_options, tiers=f"{shm}:1MiB")
    with fitcache.Client(str(root), **options) as c:
        for _ in range(2):
            for name, data in want.items():
                assert bytes(c.read(name)) == data, name
        warnings = c.stats()["server"].get("warnings", [])
    full = [w for w in warnings if "full of the dataset " + str(root) in w]
    assert len(full) == 1, warnings
