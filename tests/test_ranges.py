"""Ranges of large files through the API (Client.pread, Client.pread_into, fc_pread): a file
larger than the cache is cached by the blocks that are read, every range has the file's
bytes, the source is opened once per block at most, and a block hit needs no Go (it is
served in a process forked after the library was loaded)."""

import hashlib
import os
import random
import subprocess
import sys
import time

import pytest

import fitcache

BLOCK = 1 << 20


@pytest.fixture
def large_file(tmp_path):
    """A dataset root holding one file of 20 blocks and 5 bytes, larger than the tiers below."""
    root = tmp_path / "dataset"
    root.mkdir()
    data = random.Random(5).randbytes(20 * BLOCK + 5)
    (root / "big.bin").write_bytes(data)
    return str(root), data


@pytest.fixture
def small_tiers(cache_options):
    """cache_options with one memory tier of 12 MiB (12 blocks of the file) and 1 MiB blocks."""
    shm = cache_options["tiers"].split(",")[0].split(":")[1]
    return {**cache_options, "tiers": f"memory:{shm}:12MiB", "block_size": "1MiB", "prefetch": "0"}


def ranges_of(data, n=300, seed=9):
    rng = random.Random(seed)
    out = [(BLOCK - 7, 20), (len(data) - 3, 10), (len(data) + 1, 10), (0, 3 * BLOCK + 11)]
    out += [(rng.randrange(0, len(data)), rng.randrange(1, 300_000)) for _ in range(n)]
    return out


def settle(client, timeout=30):
    """Waits until the server's block fills end; returns the client's statistics."""
    last, deadline = -1, time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats["server"]["published"] == last:
            return stats
        last = stats["server"]["published"]
        time.sleep(0.3)
    raise AssertionError("block fills did not settle")


def test_ranges_of_a_file_larger_than_the_cache_are_cached_by_blocks(large_file, small_tiers):
    root, data = large_file
    with fitcache.Client(root, **small_tiers) as client:
        buf = bytearray(4 * BLOCK)
        from_source = []  # ranges read from the source, by pass
        for p in range(3):
            for off, n in ranges_of(data):
                want = data[off:off + n]
                assert client.pread("big.bin", n, off) == want, (p, off, n)
                view = memoryview(buf)[:n]
                assert client.pread_into("big.bin", view, off) == len(want)
                assert view[:len(want)] == want
            stats = settle(client)
            from_source.append(stats["client"]["source_ranges"] - sum(from_source))
        server, own = stats["server"], stats["client"]
        # 12 of the 21 blocks fit: the others are read from the source at every pass.
        assert 8 <= server["published"] <= 12, server
        assert server["source_reads"] == server["published"], "each block cached read from the source once"
        assert own["source_opens"] <= 2, "the client reads the blocks not cached through one open (kept 5 s)"
        assert from_source[2] < from_source[0], f"ranges from the source by pass: {from_source}"
        assert own["errors"] == 0 and server["errors"] == 0, stats


def test_cached_blocks_are_read_without_go_in_a_forked_process(large_file, small_tiers):
    """A DataLoader worker forked after its parent loaded the library cannot run Go: ranges
    of cached blocks are still served (in C); a range of a block not cached is read from the
    source at once (in C), and the block asked of the server over its node socket once the
    reader reads in sequence (or a quarter of it); what needs Go fails at once with
    ForkedAfterLoad, never a hang."""
    root, data = large_file
    with open(os.path.join(root, "small.bin"), "wb") as f:
        f.write(random.Random(6).randbytes(200_000))
    code = f"""
import os, random, time, fitcache
c = fitcache.Client({root!r}, **{small_tiers!r})
for b in range(4):
    c.pread("big.bin", {BLOCK}, b * {BLOCK})  # read from the source; the server caches blocks 0-3
for _ in range(300):
    if c.stats()["server"]["published"] >= 4:
        break
    time.sleep(0.1)
else:
    raise SystemExit("blocks 0-3 were not cached")
data = open({root!r} + "/big.bin", "rb").read()
small = open({root!r} + "/small.bin", "rb").read()
pid = os.fork()
if pid == 0:
    rng = random.Random(1)
    ok = True
    for _ in range(200):
        off = rng.randrange(0, 4 * {BLOCK} - 100_000)
        ok = ok and c.pread("big.bin", 100_000, off) == data[off:off + 100_000]
    # Block 19 read once (not worth asking for: the reader waits for nothing), block 18 in
    # sequence (asked for at once, in the background).
    for off in (19 * {BLOCK} + 5, 18 * {BLOCK} + 5, 18 * {BLOCK} + 100_005):
        ok = ok and c.pread("big.bin", 100_000, off) == data[off:off + 100_000]
    ok = ok and c.pread("small.bin", 1000, 500) == small[500:1500]  # cached whole, not in blocks
    try:
        fitcache.Client({root!r})
        ok = False
    except fitcache.ForkedAfterLoad:
        pass
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
if os.waitstatus_to_exitcode(status) != 0:
    raise SystemExit("the child failed")
for _ in range(300):  # block 18, asked for in the background
    if c.stats()["server"]["published"] >= 6:
        break
    time.sleep(0.1)
print(c.stats()["server"]["published"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert int(out.stdout.split()[-1]) == 6, "blocks 0-3, block 18 and small.bin whole, which the child had cached"
    shm = small_tiers["tiers"].split(":")[1]
    names = [n for _, _, files in os.walk(shm) for n in files]
    assert any(n.endswith(f"#{BLOCK}:18") for n in names) and not any(n.endswith(f"#{BLOCK}:19") for n in names), names


def test_pread_into_takes_writable_contiguous_buffers(large_file, small_tiers):
    root, data = large_file
    numpy = pytest.importorskip("numpy")
    with fitcache.Client(root, **small_tiers) as client:
        arr = numpy.zeros((4, 8), dtype=numpy.float64)
        assert client.pread_into("big.bin", arr, 100) == 256
        assert arr.tobytes() == data[100:356]
        assert client.pread_into("big.bin", bytearray(0), 0) == 0
        for bad in (b"read-only", memoryview(bytearray(8))[::2]):
            with pytest.raises(TypeError):
                client.pread_into("big.bin", bad, 0)
        with pytest.raises(fitcache.FitCacheError):
            client.pread_into("big.bin", bytearray(4), -1)
        with pytest.raises(fitcache.NotFound):
            client.pread_into("missing.bin", bytearray(4), 0)


def test_a_dataset_of_ranges_reads_them_through_blocks(large_file, small_tiers):
    """Items given as (file, offset, length), as indexed formats store samples: each item is
    its range, in a DataLoader too, and the file is cached by the blocks read."""
    torch = pytest.importorskip("torch")
    root, data = large_file
    small_tiers = {k: v for k, v in small_tiers.items() if k != "prefetch"}  # a parameter of the dataset
    items = [("big.bin", off, n) for off, n in ranges_of(data, n=200)]
    ds = fitcache.FitCacheDataset(root, ranges=items, **small_tiers)
    assert len(ds) == len(items) and ds.files == ["big.bin"]
    for i in (0, 1, 2, 3, 50):
        _, off, n = items[i]
        assert bytes(ds[i]) == data[off:off + n]
    ds = fitcache.FitCacheDataset(root, bytes, ranges=items, **small_tiers)
    assert ds[3] == data[:3 * BLOCK + 11]  # loaded here: the workers forked below cannot run Go,
    # and read the ranges of blocks not cached from the source themselves
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    for epoch in range(2):
        for i, t in enumerate(loader):
            _, off, n = items[i]
            assert t == data[off:off + n], (epoch, i)
    stats = ds.stats()["server"]
    assert stats["published"] >= 1 and stats["errors"] == 0, stats
    with pytest.raises(ValueError):
        fitcache.FitCacheDataset(root, ranges=[("big.bin", -1, 5)], **small_tiers)
    with pytest.raises(ValueError):
        fitcache.FitCacheDataset(root, ranges=[("big.bin", 0)], **small_tiers)
    with pytest.raises(ValueError):
        fitcache.FitCacheDataset(root, ranges=items, files=["big.bin"], **small_tiers)
    with pytest.raises(PermissionError):
        fitcache.FitCacheDataset(root, ranges=[("../outside.bin", 0, 5)], **small_tiers)[0]


def test_ranges_in_cluster_mode_are_served_by_the_blocks_owners(large_file, tmp_path):
    """Four servers on loopback nodes with node sockets; the reader on the first node reads
    ranges through its node's server, which forwards the ranges of blocks other servers own.
    The file's blocks spread over the servers (each owns the blocks whose names the ring gives
    it), each block is read from the source once, and once cached every range comes from the
    blocks. The node's server keeps a copy of each block it forwarded, so that the next
    ranges of it are read from the node's tiers (in C)."""
    from harness import Cluster, cached_names
    root, data = large_file
    (tmp_path / "cluster").mkdir()
    cluster = Cluster(tmp_path / "cluster", root, serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    try:
        with fitcache.Client(root, **cluster.options()) as client:
            def read_all():
                for off in range(0, len(data), BLOCK):  # in sequence: each block is asked for at once
                    assert client.pread("big.bin", BLOCK, off) == data[off:off + BLOCK]
            read_all()
            blocks = -(-len(data) // (4 << 20))

            def holders():
                return {a: sum(1 for n in cached_names(cluster, a) if n.startswith("big.bin#")) for a in cluster.addrs}
            deadline, again = time.monotonic() + 40, time.monotonic() + 11
            while sum(holders().values()) < blocks:
                assert time.monotonic() < deadline, holders()
                if time.monotonic() > again:  # an ask that failed is made again after 10 s
                    read_all()
                    again = time.monotonic() + 11
                time.sleep(0.1)
            # The answers to the asks mark the blocks cached at the reader: a pass may still
            # meet one on its way (a loaded machine); a later one reads nothing from the source.
            for attempt in range(3):
                before = client.stats()["client"]
                for off, n in ranges_of(data, n=100):
                    assert client.pread("big.bin", n, off) == data[off:off + n], (off, n)
                after = client.stats()["client"]
                if after["source_ranges"] == before["source_ranges"]:
                    break
                time.sleep(1)
            assert after["source_ranges"] == before["source_ranges"], "ranges read from the source once cached"
            for off, n in ranges_of(data, n=100, seed=10):  # the node keeps copies of what it forwarded
                assert client.pread("big.bin", n, off) == data[off:off + n], (off, n)
            last = client.stats()["client"]
        spread = holders()
        assert sum(1 for n in spread.values() if n) >= 2, f"blocks not spread: {spread}"
        assert spread[cluster.addrs[0]] == blocks, f"the reader's node does not hold every block: {spread}"
        assert last["server_reads"] - after["server_reads"] <= 1, "ranges still forwarded once the node had copies"
        assert last["source_ranges"] == after["source_ranges"] and last["errors"] == 0, last
    finally:
        cluster.stop()


def test_ranges_of_blocks_the_server_has_no_room_for_are_read_in_c(large_file, cache_options):
    """A tier with room for one block: once the server declined a block, the process reads the
    ranges of blocks not cached from the source itself, in C (a process forked after load
    too, which cannot run Go), every byte right."""
    root, data = large_file
    shm = cache_options["tiers"].split(",")[0].split(":")[1]
    options = {**cache_options, "tiers": f"memory:{shm}:2MiB", "block_size": "1MiB", "prefetch": "0"}
    code = f"""
import os, random, time, fitcache
c = fitcache.Client({root!r}, **{options!r})
data = open({root!r} + "/big.bin", "rb").read()
for b in range(6):
    c.pread("big.bin", {BLOCK}, b * {BLOCK})  # in sequence: each block is asked for at once
for _ in range(300):  # the asks' answers: the tier has room for one block, the others are declined
    if c.stats()["server"]["uncached"] >= 1:
        break
    time.sleep(0.1)
else:
    raise SystemExit("no block was declined")
time.sleep(0.2)
c.pread("big.bin", 10, 10 * {BLOCK})  # hands the source over to the C layer
before = c.stats()["client"]["source_range_bytes"]
pid = os.fork()
if pid == 0:
    rng = random.Random(2)
    ok = True
    for _ in range(300):
        off = rng.randrange(0, len(data) - 100_000)
        ok = ok and c.pread("big.bin", 100_000, off) == data[off:off + 100_000]
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
if os.waitstatus_to_exitcode(status) != 0:
    raise SystemExit("the forked child failed")
rng = random.Random(3)
for _ in range(300):
    off = rng.randrange(0, len(data) - 100_000)
    assert c.pread("big.bin", 100_000, off) == data[off:off + 100_000]
s = c.stats()["client"]
print(s["source_ranges"], s["source_range_bytes"] - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ranges, go_bytes = (int(x) for x in out.stdout.split()[-2:])
    # The Go client counts the bytes it read from the source; the C layer only the ranges.
    assert ranges > 200 and go_bytes < 10 * 100_000, (ranges, go_bytes)


# --- the transparent mode -----------------------------------------------------------------


def run_ranged_reads(exe, root, env=None):
    """Runs tests/c/ranged_reads on big.bin of root, under `fitcache run` with env; returns its
    lines (each read function, the FNV-1a hash of the file as it read it, and its bytes)."""
    from test_preload import FITCACHE_BIN
    cmd = [exe, os.path.join(root, "big.bin"), os.path.join(root, "small.bin")]
    if env is not None:
        cmd = [FITCACHE_BIN, "run", "--data", root, "--prefetch", "0", "--", *cmd]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def test_the_transparent_mode_reads_a_file_larger_than_the_cache_through_blocks(large_file, small_tiers, tmp_path):
    """A program under `fitcache run` opens a file no tier takes whole: it gets the source
    (one open of it, the server's), and its reads -- every read function, with and without
    offsets, in pieces, fortified, after a fork, after dup2 put another file in the
    descriptor's place, from two threads sharing the offset -- read the file's bytes, served
    from the blocks the tiers hold once the server cached them."""
    from test_preload import command_env, compile_program
    from inotify import OpenCounter
    root, data = large_file
    (tmp_path / "dataset" / "small.bin").write_bytes(b"another file " * 10)
    exe = compile_program(tmp_path, "ranged_reads", open(os.path.join(os.path.dirname(__file__), "c",
                                                                       "ranged_reads.c")).read(),
                          ["read", "pread", "pread64", "readv", "preadv", "preadv64", "preadv2", "__read_chk",
                           "__pread_chk", "__pread64_chk"], ["-D_FORTIFY_SOURCE=2", "-pthread"])
    plain = run_ranged_reads(exe, root)
    assert len(plain) == 14 and all(line.split("\t")[2] == str(len(data)) for line in plain[:11]), plain
    assert plain[12].split("\t")[2] == str(len(data)), plain
    env = command_env(small_tiers)
    served = []
    with OpenCounter(root) as opens:
        for run in range(2):
            assert run_ranged_reads(exe, root, env) == plain, f"run {run}"
            stats = fitcache.server_stats(**small_tiers)
            served.append(stats["bytes_served"])
            if run == 0:  # the blocks asked for are cached meanwhile
                deadline, last = time.monotonic() + 30, -1
                while stats["published"] != last and time.monotonic() < deadline:
                    last = stats["published"]
                    time.sleep(0.3)
                    stats = fitcache.server_stats(**small_tiers)
                blocks = stats["published"] - 1  # small.bin is cached whole
        counts = opens.counts()
    assert 8 <= blocks <= 12, stats
    # The second run read each of its 12 passes over the file through the cached blocks.
    assert served[1] - served[0] >= 12 * 8 * BLOCK, (served, blocks)
    # The shim counted what it read from the source: at least the blocks never cached, in
    # each pass of both runs.
    stats = fitcache.server_stats(**small_tiers)
    assert stats["reader_source_bytes"] >= 2 * 12 * (20 - blocks) * BLOCK, stats
    assert stats["reader_source_ranges"] > 0 and stats["errors"] == 0, stats
    # A source open per program open (14 a run: the server's, handed over), and one per block
    # cached; fills that raced for the last room of the tier may each have opened it too
    # (the server runs 8 block fills at once, and checks for room before it opens the source).
    assert counts["big.bin"] <= 2 * 14 + blocks + 8, counts


def test_a_heat_file_planted_in_its_place_is_left_alone(large_file, small_tiers, tmp_path):
    """The shim shares the heat of blocks in a file of the user's runtime directory, which it
    makes itself: a link found in its place (or a file of another size) is not followed nor
    written, and the program reads the same bytes, sharing the heat in memory instead."""
    from test_preload import FITCACHE_BIN, command_env
    root, data = large_file
    run = small_tiers["runtime_dir"]
    os.makedirs(run, mode=0o700, exist_ok=True)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, os.path.join(run, "preload.heat"))
    code = ("import hashlib, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "print(hashlib.sha256(b''.join(os.pread(fd, 300_000, o) for o in range(0, 20 * 2**20, 1_000_000))).hexdigest())\n")
    want = hashlib.sha256(b"".join(data[o:o + 300_000] for o in range(0, 20 * 2**20, 1_000_000))).hexdigest()
    for _ in range(2):
        out = subprocess.run([FITCACHE_BIN, "run", "--data", root, "--prefetch", "0", "--", sys.executable, "-c", code,
                              os.path.join(root, "big.bin")], env=command_env(small_tiers), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.split() == [want], out.stdout + out.stderr
    assert target.stat().st_size == 0 and os.path.islink(os.path.join(run, "preload.heat"))


def test_prefetch_in_cluster_mode_caches_a_large_files_blocks_at_their_owners(large_file, tmp_path):
    """Four servers whose tiers (16 MiB) cannot hold the 20 MiB file whole: the prefetch of a
    reader on a node without a server goes to the file's owner, which caches the blocks it
    owns and asks the other servers for theirs (each block's owner on the ring). The blocks
    spread over the servers, each read from the source once. Blocks of 1 MiB, so that no
    placement on the ring (the servers' ports are random) gives one server more blocks than
    its tier holds: with 4 MiB blocks, 5 runs in 21 gave one server more of the 5 blocks than
    its tier had room for, and it rightly declined the rest (prefetch evicts nothing)."""
    from harness import Cluster, cached_names
    root, data = large_file
    (tmp_path / "cluster").mkdir()
    block = 1 << 20
    cluster = Cluster(tmp_path / "cluster", root,
                      serve_options={"rpc_timeout": "2", "wait_timeout": "5", "block_size": str(block)},
                      budget="16MiB")
    try:
        with fitcache.Client(root, **cluster.options(node="127.0.0.9")) as client:
            client.prefetch(["big.bin"])
            blocks = -(-len(data) // block)

            def holders():
                return {a: sum(1 for n in cached_names(cluster, a) if n.startswith("big.bin#")) for a in cluster.addrs}
            deadline = time.monotonic() + 60
            while sum(holders().values()) < blocks:
                assert time.monotonic() < deadline, holders()
                time.sleep(0.2)
            spread = holders()
            stats = client.stats()["servers"]
        assert sum(1 for n in spread.values() if n) >= 2, f"blocks not spread: {spread}"
        assert sum(s["source_reads"] for s in stats.values() if isinstance(s, dict)) == blocks, stats
    finally:
        cluster.stop()


def test_the_shims_diagnostics_say_what_it_did(large_file, small_tiers):
    """FITCACHE_PRELOAD_DEBUG=1 (passed on by `fitcache run`) makes the shim say, on standard
    error, what it did with each open of a dataset file: here the server's answer for a file
    no tier takes whole, and a file left to libc (opened for writing)."""
    from test_preload import FITCACHE_BIN, command_env
    root, data = large_file
    code = ("import os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY); os.pread(fd, 10, 0); os.close(fd)\n"
            "open(sys.argv[2], 'wb').close()\n")
    out = subprocess.run([FITCACHE_BIN, "run", "--data", root, "--prefetch", "0", "--", sys.executable, "-c", code,
                          os.path.join(root, "big.bin"), os.path.join(root, "written.bin")],
                         env=command_env(small_tiers, FITCACHE_PRELOAD_DEBUG="1"), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("fitcache preload[")]
    assert any("big.bin: the server answered" in line and "origin source" in line for line in lines), out.stderr
    assert any("written.bin: open for writing" in line for line in lines), out.stderr
    quiet = subprocess.run([FITCACHE_BIN, "run", "--data", root, "--prefetch", "0", "--", sys.executable, "-c", code,
                            os.path.join(root, "big.bin"), os.path.join(root, "written.bin")],
                           env=command_env(small_tiers), capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "fitcache preload[" not in quiet.stderr, quiet.stderr


# --- a source rewritten in place while its blocks are read ----------------------------------


def rewrite_in_place(path, data, keep_mtime):
    """Rewrites the file at path in place with data (of its size); with keep_mtime, puts its
    modification time back (as `cp -p` or `touch -r` would), so that only its change time
    tells the versions apart."""
    was = os.stat(path)
    time.sleep(0.02)  # past the kernel's clock tick: the change time moves
    with open(path, "r+b") as f:
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(was.st_atime_ns, was.st_mtime_ns))
    now = os.stat(path)
    assert now.st_size == was.st_size and now.st_ino == was.st_ino and now.st_ctime_ns != was.st_ctime_ns
    assert (now.st_mtime_ns == was.st_mtime_ns) == keep_mtime


def cache_first_blocks(client, blocks):
    """Reads the first blocks of big.bin in sequence through client (each is asked for at
    once) and waits until the server has cached them."""
    for b in range(blocks):
        client.pread("big.bin", BLOCK, b * BLOCK)
    deadline = time.monotonic() + 30
    while client.stats()["server"]["published"] < blocks:
        assert time.monotonic() < deadline, f"blocks 0-{blocks - 1} were not cached"
        time.sleep(0.1)


# A range across the end of block 3 (cached before the rewrite) into block 4 (never cached).
SPAN = (4 * BLOCK - 1000, 2000)


def version_of(got, old, new, off, n):
    """Which version of the file the bytes got of the range (off, n) are: 'old', 'new' or 'mixed'."""
    return "old" if got == old[off:off + n] else "new" if got == new[off:off + n] else "mixed"


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["new-mtime", "same-mtime"])
def test_a_range_never_mixes_blocks_of_a_source_rewritten_in_place(large_file, small_tiers, keep_mtime):
    """Blocks 0-3 of a file are cached, then the source is rewritten in place (same size, same
    inode, with or without its modification time put back): a range that spans cached block 3
    and block 4, read from the source, has the bytes of one version, or fails with EAGAIN --
    through Go (Client.pread) and in C, in a process forked after load. Before, it had block
    3's old bytes followed by block 4's new ones."""
    root, old = large_file
    new = random.Random(7).randbytes(len(old))
    off, n = SPAN
    code = f"""
import errno, os, sys, fitcache
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_ranges import cache_first_blocks, rewrite_in_place, version_of
old = open({root!r} + "/big.bin", "rb").read()
new = __import__("random").Random(7).randbytes(len(old))
c = fitcache.Client({root!r}, **{small_tiers!r})
cache_first_blocks(c, 4)
assert c.pread("big.bin", 100, 3 * {BLOCK}) == old[3 * {BLOCK}:3 * {BLOCK} + 100]
rewrite_in_place({root!r} + "/big.bin", new, {keep_mtime!r})

def outcome():
    try:
        return version_of(c.pread("big.bin", {n}, {off}), old, new, {off}, {n})
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))

r, w = os.pipe()
pid = os.fork()
if pid == 0:  # C alone: cached block 3, block 4 from the source
    os.write(w, outcome().encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
child = os.read(r, 100).decode()
print(child, outcome())  # the parent: Go
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    child, parent = out.stdout.split()[-2:]
    assert (child, parent) in {(a, b) for a in ("old", "new", "EAGAIN") for b in ("old", "new", "EAGAIN")}, \
        f"forked child (C): {child}, parent (Go): {parent}"


def test_the_transparent_mode_never_mixes_blocks_of_a_source_rewritten_in_place(large_file, small_tiers):
    """A program under `fitcache run` reads a range of cached block 3, then another process
    rewrites the file in place, same size and modification time: a read that spans block 3
    and block 4 (not cached) has the new version's bytes, not block 3's old ones followed by
    block 4's new ones."""
    from test_preload import FITCACHE_BIN, command_env
    root, old = large_file
    new = random.Random(7).randbytes(len(old))
    with fitcache.Client(root, **small_tiers) as c:
        cache_first_blocks(c, 4)
    off, n = SPAN
    env = command_env(small_tiers)
    code = f"""
import os, subprocess, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
sys.stdout.write(os.pread(fd, 100, 3 * {BLOCK}).hex() + "\\n")  # block 3, cached and checked
# Rewritten by a process outside the shim, as another job or a person would.
env = {{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}}
subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                "import random, test_ranges; test_ranges.rewrite_in_place(sys.argv[1], "
                "random.Random(7).randbytes({len(old)}), True)", sys.argv[1]], env=env, check=True)
sys.stdout.write(os.pread(fd, {n}, {off}).hex() + "\\n")
"""
    out = subprocess.run([FITCACHE_BIN, "run", "--data", root, "--prefetch", "0", "--", sys.executable, "-c", code,
                          os.path.join(root, "big.bin")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    first, span = out.stdout.split()
    assert bytes.fromhex(first) == old[3 * BLOCK:3 * BLOCK + 100]
    assert version_of(bytes.fromhex(span), old, new, off, n) == "new"


# --- mapped files truncated by another process of the user ----------------------------------


def truncate_mapped(tiers_option, runtime_dir):
    """Truncates, as another process of the user could, what readers keep mapped: the index
    of the memory tier to 4,096 bytes (its header page: the slots and the counter pages are
    cut off), the shim's heat table and the cached blocks of big.bin to nothing."""
    shm = tiers_option.split(",")[0].split(":")[1]
    os.truncate(os.path.join(shm, "fitcache.index"), 4096)
    for bin_dir, _, names in os.walk(shm):
        for name in names:
            if "big.bin#" in name and not name.startswith("."):
                os.truncate(os.path.join(bin_dir, name), 0)
    heat = os.path.join(runtime_dir, "preload.heat")
    if os.path.exists(heat):
        os.truncate(heat, 0)


def test_a_truncated_index_costs_readers_of_the_api_no_sigbus(large_file, small_tiers):
    """A reader through the API (C hit path and Go, and a process forked after load, C alone)
    has the tier's index mapped when another process truncates it to 4,096 bytes: its next
    reads -- of a file cached whole, and of ranges across cached blocks -- have the right
    bytes (or, in the forked process, which cannot run Go, a clear error for a file it no
    longer finds cached), and it is not killed by SIGBUS. Before, touching the cut-off slots
    or counters killed it."""
    root, data = large_file
    small = random.Random(8).randbytes(300_000)
    with open(os.path.join(root, "small.bin"), "wb") as f:
        f.write(small)
    code = f"""
import os, sys, fitcache
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_ranges import cache_first_blocks, truncate_mapped
data = open({root!r} + "/big.bin", "rb").read()
small = open({root!r} + "/small.bin", "rb").read()
c = fitcache.Client({root!r}, **{small_tiers!r})
cache_first_blocks(c, 4)

def check(forked=False):
    try:
        with c.read("small.bin") as b:
            assert bytes(b) == small
    except fitcache.ForkedAfterLoad:
        # A miss, which needs Go, or the server's index whole again: a clear error in a
        # process forked after load.
        assert forked
    for off, n in ((10, 1000), ({BLOCK} - 500, 1000), (2 * {BLOCK} + 7, 2 * {BLOCK})):
        assert c.pread("big.bin", n, off) == data[off:off + n], (off, n)

check()  # small.bin cached whole, the blocks mapped: the index is in use
check()
truncate_mapped({small_tiers["tiers"]!r}, {small_tiers["runtime_dir"]!r})
pid = os.fork()
if pid == 0:
    check(forked=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, f"forked reader: {{os.waitstatus_to_exitcode(status)}}"
for _ in range(3):
    check()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["ok"], (out.returncode, out.stdout + out.stderr)


def test_a_truncated_index_and_heat_table_cost_the_transparent_mode_no_sigbus(large_file, small_tiers):
    """A program under `fitcache run` reads a file through cached blocks and the source (the
    shim has the tier's index and the heat table mapped) while another process truncates the
    index to 4,096 bytes and the heat table to nothing: its reads go on with the right bytes
    and it exits 0, not killed by SIGBUS."""
    from test_preload import FITCACHE_BIN, command_env
    root, data = large_file
    with fitcache.Client(root, **small_tiers) as c:
        cache_first_blocks(c, 4)
    want = hashlib.sha256(b"".join(data[o:o + 300_000] for o in range(0, 20 * BLOCK, 700_000))).hexdigest()
    code = f"""
import hashlib, os, subprocess, sys
fd = os.open(sys.argv[1], os.O_RDONLY)

def digest():  # blocks 0-3 cached, the others read from the source (and their heat counted)
    return hashlib.sha256(b"".join(os.pread(fd, 300_000, o) for o in range(0, 20 * {BLOCK}, 700_000))).hexdigest()

print(digest())
env = {{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}}
subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                "import test_ranges; test_ranges.truncate_mapped(sys.argv[1], sys.argv[2])",
                {small_tiers["tiers"]!r}, {small_tiers["runtime_dir"]!r}], env=env, check=True)
print(digest())
print(digest())
"""
    out = subprocess.run([FITCACHE_BIN, "run", "--data", root, "--prefetch", "0", "--", sys.executable, "-c", code,
                          os.path.join(root, "big.bin")], env=command_env(small_tiers), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stdout + out.stderr)
    assert out.stdout.split() == [want] * 3, out.stdout + out.stderr
