"""Attacks on the Python binding and the C handles: reads that try to leave the dataset root
(also in a process forked after loading the library, where reads fall back to plain reads of
the source), NUL bytes in paths, symbolic links in listings, and handles of the wrong kind."""

import errno
import gc
import multiprocessing
import os

import pytest

import fitcache
from fitcache import _native
from conftest import digest


def outcome(ds, i):
    """What reading item i gives: ("ok", sha256) or (exception class names, errno)."""
    try:
        return "ok", digest(ds[i])
    except Exception as err:  # noqa: BLE001 - the test compares exceptions
        return [c.__name__ for c in type(err).__mro__], getattr(err, "errno", None)


def outcomes(ds):
    return {name: outcome(ds, i) for i, name in enumerate(ds.files)}


def outcomes_after_fork(ds, timeout=30):
    """The outcomes of reading every item in a child forked after this process loaded the
    library (so the child reads through the plain fallback). A read that blocks fails the test
    after timeout seconds instead of hanging it."""
    ds[ds.files.index("good.bin")]  # loads the Go runtime here, before the fork
    assert _native.loaded_here()
    with multiprocessing.get_context("fork").Pool(1) as pool:
        try:
            return pool.apply_async(outcomes, (ds,)).get(timeout=timeout)
        except multiprocessing.TimeoutError:
            pytest.fail(f"a read in the forked child blocked for {timeout}s")


@pytest.fixture
def hostile_root(tmp_path):
    """A dataset root holding a good file, links inside and outside, a FIFO and a directory,
    beside a secret outside it. Returns (root, secret path, secret dir, good bytes)."""
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    good = os.urandom(5000)
    (root / "good.bin").write_bytes(good)
    secret_dir = tmp_path / "private"
    secret_dir.mkdir()
    secret = secret_dir / "secret.bin"
    secret.write_bytes(b"secret bytes")
    os.symlink(secret, root / "escape.bin")               # a link to a file outside
    os.symlink(secret_dir, root / "escape_dir")           # a link to a directory outside
    os.symlink(root / "good.bin", root / "inside.bin")    # a link that stays inside
    os.symlink("../good.bin", root / "sub" / "relative_inside.bin")
    os.mkfifo(root / "fifo")
    return str(root), str(secret), str(secret_dir), good


def test_fork_fallback_refuses_paths_outside_the_root(hostile_root, cache_options):
    root, secret, secret_dir, good = hostile_root
    outside = [os.path.relpath(secret, root),  # ../private/secret.bin
               secret,                         # an absolute path
               "sub/../../private/secret.bin",
               "escape.bin",                   # a symlink to a file outside
               "escape_dir/secret.bin"]        # through a symlinked directory
    files = ["good.bin", "inside.bin", "sub/relative_inside.bin", *outside]
    ds = fitcache.FitCacheDataset(root, files=files, **cache_options)
    native, forked = outcomes(ds), outcomes_after_fork(ds)
    want_good = ("ok", digest(good))
    for name in ("good.bin", "inside.bin", "sub/relative_inside.bin"):
        assert native[name] == want_good and forked[name] == want_good, (name, native[name], forked[name])
    for name in outside:
        assert "PermissionError" in forked[name][0] and forked[name][1] == errno.EACCES, \
            f"fork fallback read {name}: {forked[name]}"
        assert forked[name] == native[name], f"{name}: forked {forked[name]}, native {native[name]}"


def test_fork_fallback_fifo_does_not_block_and_errors_match_native(hostile_root, cache_options):
    root, _, _, good = hostile_root
    ds = fitcache.FitCacheDataset(root, files=["good.bin", "fifo", "sub", "missing.bin"], **cache_options)
    forked = outcomes_after_fork(ds, timeout=20)
    assert forked["good.bin"] == ("ok", digest(good))
    assert "OSError" in forked["fifo"][0] and forked["fifo"][1] == errno.EINVAL, forked["fifo"]
    assert "IsADirectoryError" in forked["sub"][0] and forked["sub"][1] == errno.EISDIR, forked["sub"]
    assert "FileNotFoundError" in forked["missing.bin"][0] and forked["missing.bin"][1] == errno.ENOENT
    for name in ("fifo", "sub", "missing.bin"):  # the same classes as the native path raises
        assert forked[name] == outcome(ds, ds.files.index(name)), name


def test_nul_byte_in_a_path_is_refused(dataset, cache_options):
    root, digests = dataset
    rel = sorted(digests)[1]
    with fitcache.Client(root, **cache_options) as client:
        assert digest(client.read(rel)) == digests[rel]
        for call in (lambda p: client.read(p), lambda p: client.pread(p, 10), lambda p: client.size(p)):
            with pytest.raises(ValueError, match="embedded null byte"):
                call(rel + "\0.jpg")
            with pytest.raises(ValueError, match="embedded null byte"):
                call(os.fsencode(rel) + b"\0.jpg")
    with pytest.raises(ValueError, match="embedded null byte"):
        fitcache.Client(root + "\0/elsewhere", **cache_options)
    with pytest.raises(ValueError, match="embedded null byte"):
        fitcache.FitCacheDataset(root + "\0/elsewhere", **cache_options)
    ds = fitcache.FitCacheDataset(root, files=[rel + "\0.jpg"], **cache_options)
    with pytest.raises(ValueError, match="embedded null byte"):
        ds[0]


def test_fork_fallback_refuses_a_nul_byte(hostile_root, cache_options):
    root, _, _, _ = hostile_root
    ds = fitcache.FitCacheDataset(root, files=["good.bin", "good.bin\0.jpg"], **cache_options)
    forked = outcomes_after_fork(ds)
    assert "ValueError" in forked["good.bin\0.jpg"][0], forked


def test_listing_leaves_out_links_that_leave_the_root(hostile_root, cache_options):
    root, _, _, good = hostile_root
    os.symlink(os.path.join(root, "sub"), os.path.join(root, "linked_sub"))  # not followed
    ds = fitcache.FitCacheDataset(root, **cache_options)
    assert ds.files == ["good.bin", "inside.bin", "sub/relative_inside.bin"]
    assert fitcache.list_files(root) == ds.files
    for i in range(len(ds)):  # every listed file reads: nothing fails mid-epoch
        assert digest(ds[i]) == digest(good)


def test_listing_through_a_linked_root(hostile_root, cache_options, tmp_path):
    root, _, _, _ = hostile_root
    linked = tmp_path / "linked_root"
    os.symlink(root, linked)  # links inside the real root stay inside when it is reached by a link
    ds = fitcache.FitCacheDataset(str(linked), **cache_options)
    assert ds.files == ["good.bin", "inside.bin", "sub/relative_inside.bin"]
    assert all(outcome(ds, i)[0] == "ok" for i in range(len(ds)))


def test_handles_of_one_kind_are_not_valid_as_the_other(dataset, cache_options):
    root, digests = dataset
    rel = sorted(digests)[5]
    lib = _native.library()
    with fitcache.Client(root, **cache_options) as client:
        view = client.read(rel)
        buf_id = view.obj._fitcache_owner._id
        assert lib.fc_close(buf_id) == -errno.EBADF, "a buffer handle closed a client"
        assert lib.fc_release(client._handle) == -errno.EBADF
        assert digest(client.read(rel)) == digests[rel], "the client still works"
        assert digest(view) == digests[rel], "the buffer is still mapped"
        assert _native.open_handles() == (1, 1)
        del view
        gc.collect()
        assert _native.open_handles() == (1, 0)


def test_no_handle_left_after_close_and_release(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    views = [ds[i] for i in range(len(ds))]
    other = fitcache.Client(root, **cache_options)
    more = [other.read(f) for f in ds.files[:5]]
    buffers = sum(1 for v in views + more if len(v))  # an empty file's view holds no buffer
    assert _native.open_handles() == (2, buffers)
    ds.close()
    other.close()
    assert _native.open_handles() == (0, buffers), "buffers outlive their client"
    assert [digest(v) for v in views] == [digests[f] for f in ds.files]
    del views, more
    gc.collect()
    assert _native.open_handles() == (0, 0)


LARGE_READER = """
import hashlib, json, sys, fitcache
root, runtime_dir, tiers, name = sys.argv[1:5]

def rss_anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

before = rss_anon_kib()  # what the interpreter and its imports hold (torch 2 alone: ~300 MiB)
with fitcache.Client(root, runtime_dir=runtime_dir, tiers=tiers) as c:
    view = c.read(name)
    print(json.dumps({"size": len(view), "sha256": hashlib.sha256(view).hexdigest(),
                      "tail": bytes(view[-4:]).decode(), "rss_anon_kib": rss_anon_kib() - before}))
"""


def rss_anon_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


@pytest.mark.parametrize("size_mib,cached", [(300, True), (1024, False)])
def test_large_files_are_never_held_whole_in_memory(tmp_path, cache_options, size_mib, cached):
    """A 300 MiB file fits the disk tier: the server copies it there through a small buffer and
    the client maps it. A 1 GiB file fits no tier: the client maps the source. Neither process
    holds the file in its own memory (before: an uncached 300 MB file cost the client 2.4 GB,
    and a 10 GiB file got the server OOM-killed)."""
    import hashlib
    root = tmp_path / "data"
    root.mkdir()
    path = root / "big.bin"
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(size_mib - 1):
            f.write(chunk)
        f.write(chunk[:-4] + b"tail")
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    try:
        check_large_file(root, cache_options, size_mib, cached, want)
    finally:
        path.unlink()  # pytest keeps old temporary directories: do not leave a GiB in each


def check_large_file(root, cache_options, size_mib, cached, want):
    import subprocess
    import sys
    from conftest import server_pid
    out = subprocess.run([sys.executable, "-c", LARGE_READER, str(root), cache_options["runtime_dir"],
                          cache_options["tiers"], "big.bin"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = __import__("json").loads(out.stdout)
    assert got["size"] == size_mib << 20 and got["sha256"] == want and got["tail"] == "tail"
    assert got["rss_anon_kib"] < 150 << 10, f"client's anonymous memory grew by {got['rss_anon_kib'] >> 10} MiB"
    server = server_pid(cache_options["runtime_dir"])
    assert rss_anon_kib(server) < 150 << 10, f"server holds {rss_anon_kib(server) >> 10} MiB"
    stats = fitcache.server_stats(**cache_options)
    assert stats["uncached"] == (0 if cached else 1)
    assert sum(t["files"] for t in stats["tiers"]) == (1 if cached else 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the attack as another user (nobody)")
def test_other_users_cannot_reach_the_embedded_server(dataset, cache_options, tmp_path):
    """The embedded server's runtime directory is 0700: another user can neither connect to
    its socket nor read its files, even where the directory sits in a shared place (/tmp)."""
    import shutil
    import subprocess
    import sys
    runtime_dir = f"/tmp/fitcache-test-{os.getpid()}-{tmp_path.name}"
    options = {**cache_options, "runtime_dir": runtime_dir}
    root, digests = dataset
    try:
        with fitcache.Client(root, **options) as c:
            name = sorted(digests)[0]
            assert digest(c.read(name)) == digests[name]
        attack = ("import socket, sys\n"
                  "s = socket.socket(socket.AF_UNIX)\n"
                  "try:\n"
                  "    s.connect(sys.argv[1])\n"
                  "except PermissionError:\n"
                  "    print('refused')\n"
                  "else:\n"
                  "    print('connected')\n")
        out = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-c", attack,
                              os.path.join(runtime_dir, "server.sock")], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "refused", out.stdout + out.stderr
    finally:
        from conftest import server_pid, wait_gone
        import signal
        pid = server_pid(runtime_dir)
        if pid:
            os.kill(pid, signal.SIGTERM)
            wait_gone(pid)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_fork_fallback_maps_large_files(tmp_path):
    """The fallback read of a file over 1 MiB maps it instead of reading it into memory, as
    the native library does (before: a 10 GiB file was read whole)."""
    import hashlib
    import mmap
    from fitcache.dataset import _read_source
    root = tmp_path / "data"
    root.mkdir()
    big = root / "big.bin"
    payload = os.urandom(3 << 20)
    big.write_bytes(payload)
    (root / "small.bin").write_bytes(b"small")
    view = _read_source("big.bin", str(root), os.path.realpath(root))
    assert isinstance(view.obj, mmap.mmap)
    assert hashlib.sha256(view).hexdigest() == hashlib.sha256(payload).hexdigest()
    assert bytes(_read_source("small.bin", str(root), os.path.realpath(root))) == b"small"


STRAY_WRITE_READER = r"""
import os, struct, sys
import fitcache
root, index, runtime_dir, tiers = sys.argv[1:5]
names = sys.argv[5:]
with fitcache.Client(root, runtime_dir=runtime_dir, tiers=tiers) as c:
    first = {n: bytes(c.read(n)) for n in names}  # every file cached and the index mapped
    fd = os.open(index, os.O_WRONLY)
    os.pwrite(fd, struct.pack("<I", 1 << 31), 16)  # a stray write: 2^31 buckets
    os.close(fd)
    again = {n: bytes(c.read(n)) for n in names}
print("same" if first == again else "different")
"""


def test_a_stray_write_to_the_index_header_harms_no_reader(dataset, cache_options, tmp_path):
    # Readers map the tiers' index. A process of the same user that writes garbage into its
    # header (here the bucket count) must not make them read outside the mapping: they read
    # the geometry once, when they map it, and map the header read-only.
    import subprocess
    import sys
    root, digests = dataset
    memory = cache_options["tiers"].split(",")[0].split(":")[1]
    out = subprocess.run([sys.executable, "-c", STRAY_WRITE_READER, root, os.path.join(memory, "fitcache.index"),
                          cache_options["runtime_dir"], cache_options["tiers"], *sorted(digests)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the reader died (exit {out.returncode}): {out.stderr[-2000:]}"
    assert out.stdout.strip() == "same"
