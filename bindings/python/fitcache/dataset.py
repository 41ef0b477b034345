"""FitCacheDataset: a map-style PyTorch dataset whose reads go through FitCache."""

from __future__ import annotations

import errno
import json
import logging
import mmap
import multiprocessing.util
import operator
import os
import secrets
import stat
import subprocess
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Union

from . import _native

PathLike = Union[str, "os.PathLike[str]"]
# A filter keeps a path when it is a callable returning true for it, or a suffix / tuple of suffixes.
Filter = Union[Callable[[str], bool], str, tuple, None]

# _open_lock protects the opening of a dataset's client (see _get_client). A thread of the
# parent may hold it at fork: the child gets a new one.
_open_lock = threading.Lock()


def _new_open_lock():
    global _open_lock
    _open_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_open_lock)

# What users should see (the fork fallback, a prefetch that could not start) goes to this
# logger. No handler is added: without logging configured, Python prints warnings on stderr.
log = logging.getLogger("fitcache")

try:  # torch is optional: without it the dataset is a plain sequence.
    from torch.utils.data import Dataset as _Base
except ImportError:  # pragma: no cover - exercised only where torch is missing
    _Base = object  # type: ignore[misc,assignment]


def list_files(root: PathLike, filter: Filter = None) -> list[str]:
    """Sorted paths, relative to root, of the regular files under root (recursively; links to
    directories are not followed). A symbolic link to a file inside root is listed; one that
    leads outside root (its real path is outside the real path of root) is left out, since
    reading it would be refused. ``filter`` keeps a path when it is a callable returning true
    for it, or a suffix (or tuple of suffixes) it ends with."""
    if isinstance(filter, (str, tuple)):
        suffixes = filter
        filter = lambda rel: rel.endswith(suffixes)  # noqa: E731
    real_root = os.path.realpath(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False: stays in root
        dirnames.sort()
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if not os.path.isfile(full) or (filter is not None and not filter(rel)):
                continue
            # Only a link can lead out: the directories walked are real ones under root.
            if os.path.islink(full) and not _within(os.path.realpath(full), real_root):
                continue
            out.append(rel)
    out.sort()
    return out


def _opener(ref):
    """The before-fork hook of the dataset ref refers to (see FitCacheDataset._open_before_fork)."""
    def hook():
        ds = ref()
        if ds is not None:
            ds._open_before_fork()
    return hook


def _within(path, root):
    """True if the normalised absolute path is root or under it (lexically)."""
    return path == root or path.startswith(root if root.endswith("/") else root + "/")


class FitCacheDataset(_Base):
    """The files under ``root`` as a map-style dataset, read through FitCache.

    ``ds[i]`` is the i-th file (in sorted order of relative path) as a read-only, zero-copy
    ``memoryview``, or ``transform(view)`` when a transform is given. A memoryview cannot be
    sent from a DataLoader worker to the main process, so with ``num_workers > 0`` give a
    transform that decodes the bytes (for example into a tensor or a numpy array).

    The native library is loaded lazily in each process that reads, so the dataset pickles
    and works with DataLoader workers under fork, forkserver and spawn. Options (``tiers``,
    ``read_timeout``, ...; see the README) take precedence over FITCACHE_* variables.

    Workers forked from the process that made the dataset (the DataLoader's default on
    Linux, fresh workers every epoch) share its client: with ``open_before_fork`` (the
    default), the first fork of that process opens the client there first. A forked worker
    then reads with no library of its own to load: hits, its own fills of misses and the
    server's answers are all C (see the README, Many cores). Loading the library and opening
    a client cost each fresh worker 20-40 ms of CPU on a 2-core machine, about 100 ms on a
    16-core one. In cluster mode, when no server of the job on the node answers before a fork
    (a node without one, or one whose server died), the process serves its workers a node
    socket of its own, through which they read the other nodes' files from their servers.

    Only files inside ``root`` are read, also after symbolic links are followed: the listing
    leaves out links that lead outside ``root`` (links inside it stay listed, links to
    directories are not followed), and reading any other path outside ``root`` raises
    PermissionError, also in a process forked after loading the library, whose plain reads of
    the source apply the native library's checks.

    Prefetch: with ``prefetch=True`` (the default), each process that reads hands the cache
    server the dataset's file list when it opens its client (at its first read), so that the
    server reads the files from the source ahead of the readers, several at once, and the
    first epoch runs at the file system's pace rather than the readers'. The list is in the
    order given to :meth:`prefetch` (say, the sampler's), else in list order; processes
    handing over the same list share one job. ``prefetch=False`` (or ``0``) hands nothing
    over; an integer sets the server's option ``prefetch`` (source reads it runs at once) for
    a server the dataset starts.

    Ranges: with ``ranges``, a sequence of ``(path, offset, length)`` (path relative to
    ``root`` or absolute inside it), item i is that range of that file instead of a whole
    file, as indexed and sharded formats store samples: ``ds[i]`` is a read-only memoryview of
    its bytes (fewer at the end of the file). Large files are then cached in blocks as their
    ranges are read (see the README, Ranges of large files), also files larger than the
    cache. Prefetch is off by default for ranges: prefetch reads whole files, and large files
    are cached by the blocks read.

    Consistency: the dataset is one job (option ``job``, a new id per dataset object unless
    given or set in FITCACHE_JOB; inside a Slurm job, the batch job: ``slurm-$SLURM_JOB_ID``),
    shared by every process that reads it, DataLoader workers included. The server checks each cached copy against its source file (size, times, inode)
    once per job, ahead of the readers, so a file rewritten since an earlier run is read anew;
    a file changed while the job runs is not noticed.
    """

    def __init__(self, root: PathLike, transform: Callable[[memoryview], Any] | None = None, *,
                 filter: Filter = None, files: Iterable[str] | None = None,
                 ranges: Iterable[tuple[str, int, int]] | None = None, prefetch: bool | int | None = None,
                 open_before_fork: bool | None = True, **options: Any) -> None:
        root = os.fsdecode(_native._fs(root))  # ValueError for a NUL byte, as open() raises
        root = os.path.abspath(root)
        if not os.path.exists(root):
            raise FileNotFoundError(errno.ENOENT, "dataset root does not exist", root)
        if not os.path.isdir(root):
            raise NotADirectoryError(errno.ENOTDIR, "dataset root is not a directory", root)
        self.root = root
        self._real_root = os.path.realpath(root)  # the fork fallback checks reads against it
        self.transform = transform
        self.ranges = _check_ranges(ranges, files, filter) if ranges is not None else None
        if prefetch is None:
            prefetch = self.ranges is None
        if not isinstance(prefetch, bool):
            reads = operator.index(prefetch)
            if reads < 0:
                raise ValueError(f"prefetch: want True, False or a number of reads >= 0, got {prefetch!r}")
            options = {**options, "prefetch": reads}
            prefetch = reads > 0
        if "job" not in options and not os.environ.get("FITCACHE_JOB") and not os.environ.get("SLURM_JOB_ID"):
            # Workers get the id with the options (pickled, or inherited by fork): one check of
            # the cache against the source for all of them, and a new one for the next dataset.
            options = {**options, "job": "dataset-" + secrets.token_hex(12)}
        self.options = options
        if self.ranges is not None:
            self.files = list(dict.fromkeys(path for path, _, _ in self.ranges))  # in order of first use
        else:
            self.files = list(files) if files is not None else list_files(root, filter)
        self._prefetch = prefetch
        # Indices in the order they will be read; None: list order.
        self._prefetch_order: list[int] | None = None
        # The list as the native library takes it, made once here: DataLoader workers forked
        # from this process (every epoch, by default) inherit it instead of building it anew.
        self._prefetch_encoded = self._encode_prefetch_list() if prefetch else None
        self._client = None
        self._client_pid = None
        self._handover = None  # the thread handing the prefetch list over (see _get_client)
        if open_before_fork is None:  # the default's spelling before cluster mode shared it too
            open_before_fork = True
        self._made_in = os.getpid() if open_before_fork else None
        if open_before_fork:
            # A weak reference: the hook cannot be removed, and must not keep the dataset.
            os.register_at_fork(before=_opener(weakref.ref(self)))

    def __len__(self) -> int:
        return len(self.ranges) if self.ranges is not None else len(self.files)

    def path(self, index: int) -> str:
        """The absolute path of item ``index`` (of its file, for a range)."""
        if self.ranges is not None:
            return os.path.join(self.root, self.ranges[index][0])
        return os.path.join(self.root, self.files[index])

    def __getitem__(self, index: int) -> Any:
        if not isinstance(index, int) and hasattr(index, "__index__"):
            index = index.__index__()  # numpy and torch integers, as samplers yield them
        if self.ranges is not None:
            data = self._read_range(index)
        else:
            data = self._read(self.path(index))
        return self.transform(data) if self.transform is not None else data

    def _read_range(self, index):
        """Item index of a dataset of ranges: its bytes, read through the file's blocks."""
        path, offset, length = self.ranges[index]
        path = os.path.join(self.root, path)
        try:
            return memoryview(self._get_client().pread(path, length, offset)).toreadonly()
        except _native.ForkedAfterLoad as err:
            _warn_forked(err)
            return _read_source(path, self.root, self._real_root, offset, length)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items at indices, as ``[self[i] for i in indices]`` but read in one native call
        (see fc_read_many). PyTorch 2's DataLoader calls it for a whole batch."""
        indices = [i.__index__() if not isinstance(i, int) and hasattr(i, "__index__") else i for i in indices]
        if self.ranges is not None:
            return [self[i] for i in indices]
        paths = [self.path(i) for i in indices]
        if self.transform is None:
            return self._read_batch(paths)
        # With a transform, the batch is read and transformed a chunk at a time: a transform
        # that reads every byte (a decoder, a checksum) then finds each file's bytes still in
        # the CPU's caches, where a whole batch (256 files of 110 KiB: 28 MB) read first had
        # left them (7-8% more CPU per file, measured: docs/BENCHMARKS.md section 8d), and each
        # chunk's buffers are released before the next is read.
        out: list[Any] = []
        chunk = self._transform_chunk()
        for start in range(0, len(paths), chunk):
            out.extend(self.transform(v) for v in self._read_batch(paths[start:start + chunk]))
        return out

    def _transform_chunk(self):
        """Files __getitems__ reads and transforms at a time (see _TRANSFORM_CHUNK)."""
        try:
            cluster = self._get_client().cluster
        except _native.ForkedAfterLoad:
            cluster = False
        return _CLUSTER_TRANSFORM_CHUNK if cluster else _TRANSFORM_CHUNK

    def _read_batch(self, paths):
        """The files at paths, read in one native call (Client.read_each)."""
        try:
            views = self._get_client().read_each(paths)
        except _native.ForkedAfterLoad as err:
            views = [err] * len(paths)
        for i, v in enumerate(views):
            if isinstance(v, _native.ForkedAfterLoad):
                _warn_forked(v)
                views[i] = _read_source(paths[i], self.root, self._real_root)
            elif isinstance(v, Exception):
                views.clear()  # releases what was read
                self._read(paths[i])  # raises the error with the native message
                raise v
        return views

    def _read(self, path):
        try:
            return self._get_client().read(path)
        except _native.ForkedAfterLoad as err:
            _warn_forked(err)
            return _read_source(path, self.root, self._real_root)

    def _open_before_fork(self):
        """Opens the client in the process that made the dataset, before it forks (see the
        class's documentation); a failure here is left to the forked readers."""
        if self._made_in != os.getpid() or _native.forked():
            return
        try:
            # Workers forked every epoch cannot restart a server that died, nor route around
            # one (no Go after fork): it is checked here, before each fork (a Hello: well
            # under a millisecond, against the 5-20 ms a fork of a PyTorch process takes). In
            # cluster mode, when no server of this node answers, this process then serves the
            # workers a node socket of its own (see _native.Client.check_server).
            self._get_client().check_server()
        except Exception as err:  # noqa: BLE001 -- a fork must not fail for it
            logging.getLogger("fitcache").debug("client not opened before fork: %s", err)

    def _get_client(self):
        # Per read: no lock and no system call (the threads of a loader read at once).
        client = self._client
        if client is not None and (self._client_pid == _native.pid or _native.forked()):
            # Forked after this client was opened, it still serves cached files (the hit path
            # of the library is C); misses raise ForkedAfterLoad, read from the source here.
            return client
        with _open_lock:  # threads reading at once open one client
            return self._open_client()

    def _open_client(self):
        pid = _native.pid
        if self._client is None or self._client_pid != pid:
            self._client = None  # a parent's client is unusable after fork
            client = _native.Client(self.root, **self.options)
            self._client, self._client_pid = client, pid
            # Workers exit through multiprocessing, which runs these finalizers (not atexit):
            # closing reports the worker's cache hits to the server.
            multiprocessing.util.Finalize(self, client.close, exitpriority=10)
            if self._prefetch:
                # In the background: the first reads need not wait for the hand-over (the
                # native call releases the GIL), which fresh workers pay every epoch.
                self._handover = threading.Thread(target=self._send_prefetch, args=(client,), daemon=True,
                                                  name="fitcache-prefetch")
                self._handover.start()
        return self._client

    def prefetch(self, indices: Iterable[int] | None = None, wait: bool = False) -> dict | None:
        """Hands the cache server the files in the order they will be read, to read from the
        source ahead of the readers: ``indices`` is any iterable of item indices (for example
        ``list(sampler)`` for a sampler with a seeded generator, or one rank's share), None for
        every file in list order. In cluster mode the dataset's other files follow the ones
        given: each node's server keeps copies where it has room, and a rank of a
        ``DistributedSampler`` reads another part of the dataset every epoch. The order is kept: every process that opens its client later
        (DataLoader workers) hands over the same list, which keeps the job alive while they
        read. With ``wait=True`` it returns when the server has dealt with every file (or its
        tiers are full: prefetch never evicts).

        In a process that has not loaded the native library (the main process of a forking
        DataLoader, before it reads) the list goes through the ``fitcache prefetch`` command, so
        that workers forked later can still load the library; it starts the server if none runs.
        Returns the job's state as a dict when it went through the command (always with
        ``wait=True``), else None. Progress is in ``ds.stats()["server"]["prefetch"]``."""
        if indices is not None:
            n = len(self)
            order = []
            for i in indices:
                i = operator.index(i)
                if not -n <= i < n:
                    raise IndexError(f"prefetch: index {i} out of range for {n} items")
                order.append(i % n)
            self._prefetch_order = order
            # Encoded here, in the process that forks the workers, which then inherit it.
            self._prefetch_encoded = self._encode_prefetch_list()
        self._prefetch = True
        if not wait:
            if self._client is not None and self._client_pid == os.getpid():
                self._send_prefetch(self._client)
                return None
            if _native.loaded_here():
                self._get_client()  # hands the list over
                return None
        paths, this_epoch = self._prefetch_paths()
        return prefetch_files(self.root, paths, wait=wait, this_epoch=this_epoch, **self.options)

    def _prefetch_paths(self):
        """The prefetch list, and how many of its paths are read in this epoch (0: all)."""
        if self._prefetch_order is None:
            return [os.path.join(self.root, f) for f in self.files], 0
        paths = [self.path(i) for i in self._prefetch_order]
        if self.ranges is not None:
            paths = list(dict.fromkeys(paths))  # ranges share files
        if self.options.get("servers") or os.environ.get("FITCACHE_SERVERS"):
            # Cluster mode: the node's server keeps copies of what its readers read, where it
            # has room. With one rank's share given (a DistributedSampler), the other files come
            # after it, for later epochs: the rank reads another part every epoch, and a node
            # with room for the whole dataset then reads all of it locally. The server brings
            # them in once this epoch's files are in, a few at a time.
            given = set(paths)
            rest = [p for p in (os.path.join(self.root, f) for f in self.files) if p not in given]
            if rest:
                return paths + rest, len(paths)
        return paths, 0

    def _encode_prefetch_list(self):
        """The prefetch list as the native library takes it (a _native.PathList: encoded once,
        here, for every process forked from this one), and how many of its paths are read in
        this epoch."""
        paths, this_epoch = self._prefetch_paths()
        # A path with a NUL byte names no file (reading its item raises ValueError): it is
        # left out of the list, not made to fail the dataset's construction.
        return _native.PathList(p for p in paths if "\0" not in p), this_epoch

    def _send_prefetch(self, client):
        """Hands the list over through client; a failure is a warning, never a failed read."""
        if self._prefetch_encoded is None:
            self._prefetch_encoded = self._encode_prefetch_list()
        paths, this_epoch = self._prefetch_encoded
        try:
            client.prefetch(paths, this_epoch=this_epoch)
        except (_native.FitCacheError, ValueError) as err:
            log.warning("prefetch not started: %s", err)

    def stats(self) -> dict:
        """Counters of the cache as a dict: ``server`` (hits per tier, misses, source reads,
        bytes, evictions, errors, tiers, ``prefetch``: jobs, files fetched, skipped, bytes, jobs
        stopped at the budget or abandoned) and, when this process has read, ``client``.

        Hits that DataLoader workers served themselves reach the server when the worker
        exits, or within a second for persistent workers. In a process that has not loaded
        the native library this asks the ``fitcache`` command, so that workers forked later
        can still load it. ``server`` is None while no server runs (nothing read yet)."""
        if self._client is not None and self._client_pid == os.getpid():
            return self._client.stats()
        return {"server": server_stats(**self.options)}

    def close(self) -> None:
        """Closes this process's client (idempotent); the dataset reopens one if used again."""
        client, self._client = self._client, None
        if client is not None and self._client_pid == os.getpid():
            client.close()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_client"] = None
        state["_client_pid"] = None
        state["_handover"] = None  # a thread of this process
        return state

    def __enter__(self) -> FitCacheDataset:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


_EXIT_NO_SERVER = 3  # `fitcache stats` exit status when no server runs
# Files of a batch read and transformed at a time by __getitems__ with a transform: a few
# hundred KiB of 110 KiB images, which the CPU's caches still hold when the transform reads
# them. Each file of a chunk is read into a buffer of its own, which a fresh DataLoader worker
# touches first and so pays page faults for (28 for 110 KiB) once per epoch: 16 files a chunk
# cost a forked child that reads 312 files (a worker's share of 20,000 with 64 workers) about
# 1 ms of CPU more than item by item, 4 files 0.3 ms, with the same CPU per file once warm
# (docs/BENCHMARKS.md section 33). On one node the reader copies a chunk's misses in itself:
# one after the other from a fast source, side by side from a slow one, so a chunk of 4
# overlaps 4 of a slow file system's round trips (section 34).
# In cluster mode each read of a chunk is one request to the node's server for the files
# other nodes hold, and one to each of their owners (with 4 nodes, about one file per owner in
# a chunk of 4, four in a chunk of 16): there chunks of 16 cost the servers 92 µs of CPU per
# file where chunks of 4 cost 129, an epoch 0.57 s against 0.75 (same section).
_TRANSFORM_CHUNK = 4
_CLUSTER_TRANSFORM_CHUNK = 16


def server_stats(**options: Any) -> dict | None:
    """The embedded server's counters as a dict (in cluster mode, the totals of the job's
    servers, with each server's under "servers"), or None when no server runs. Asked through
    the ``fitcache`` command (a separate process, so the caller never loads the Go runtime)."""
    out = subprocess.run([_native.server_binary(), "stats", "--json"], env=_command_env(options),
                         capture_output=True, text=True, timeout=30)
    if out.returncode == _EXIT_NO_SERVER:
        return None
    if out.returncode != 0:
        raise _native.FitCacheError(errno.EIO, out.stderr.strip() or "fitcache stats failed")
    stats = json.loads(out.stdout)
    if "total" in stats:  # a cluster: the job's totals, with each server's counters beside them
        return {**stats["total"], "servers": stats["servers"], "unreachable": stats.get("unreachable", {})}
    return stats


def prefetch_files(root: PathLike, paths: Iterable[str], wait: bool = False, this_epoch: int = 0,
                   **options: Any) -> dict | None:
    """Hands the server of the dataset under root the files at paths (absolute, or relative to
    root), in that order, to read ahead of the readers, through the ``fitcache prefetch``
    command (a separate process, so the caller never loads the Go runtime); it starts the
    server if none runs. Without ``wait`` the job lives while readers that hand over the same
    list renew it, and at least 10 s; with it, the call returns when the job ended. Returns
    the job's state as a dict (``state``: running, done, budget, off...; files, fetched,
    skipped_cached, skipped_inflight, failed, bytes, errors), or None for an empty list. In
    cluster mode, with ``this_epoch``, only the first this_epoch paths are read in this epoch
    (see fc_prefetch_epochs in fitcache.h)."""
    data = b"".join(_native._fs(p) + b"\0" for p in paths)
    if not data:
        return None
    cmd = [_native.server_binary(), "prefetch", "-0", "--json", "--quiet"] + (["--wait"] if wait else []) + (
        [f"--this-epoch={this_epoch}"] if this_epoch else [])
    out = subprocess.run(cmd + [os.fsdecode(_native._fs(root))], input=data, env=_command_env(options),
                         capture_output=True, timeout=None if wait else 120)
    if out.returncode != 0:
        msg = out.stderr.decode(errors="replace").strip() or "fitcache prefetch failed"
        raise _native.FitCacheError(errno.EIO, msg)
    return json.loads(out.stdout)


def _command_env(options):
    """The environment for the fitcache command: ours, with the options as FITCACHE_*."""
    env = dict(os.environ)
    for key, value in options.items():
        env["FITCACHE_" + key.upper()] = str(value)
    return env


_warned_forked = False


def _warn_forked(err):
    global _warned_forked
    if not _warned_forked:
        _warned_forked = True
        log.warning("%s. Cached files are still read from the cache; files not cached yet are read "
                    "from the source in this process", err.strerror)


def _check_ranges(ranges, files, filter):
    """The dataset's ranges as a list of (path, offset, length), checked."""
    if files is not None or filter is not None:
        raise ValueError("give ranges, or files and filter, not both")
    out = []
    for i, item in enumerate(ranges):
        try:
            path, offset, length = item
            offset, length = operator.index(offset), operator.index(length)
        except (TypeError, ValueError):
            raise ValueError(f"range {i}: want (path, offset, length), got {item!r}") from None
        if offset < 0 or length < 0:
            raise ValueError(f"range {i}: offset and length must be >= 0, got {item!r}")
        out.append((os.fsdecode(_native._fs(path)), offset, length))
    return out


def _read_source(path, root, real_root, offset=None, length=None):
    """The fallback read: the source file's bytes (or length bytes of it at offset), uncached,
    with the checks of the native library's source read (core.OpenSource): path (absolute, or
    relative to root) must stay under root once normalised, and its real path under
    real_root; it must be a regular file (a FIFO is refused without waiting for a writer).
    Raises the exceptions the native path raises: NotFound, PermissionDenied, IsADirectory,
    or FitCacheError with EINVAL."""
    path = os.fsdecode(_native._fs(path))
    full = os.path.normpath(os.path.join(root, path))
    if not _within(full, root):
        raise _native.PermissionDenied(errno.EACCES, f"path outside the dataset root: {full} "
                                       f"is not under {root}", path)
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        cls = _native._ERRORS.get(err.errno, _native.FitCacheError)
        raise cls(err.errno, err.strerror, path) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _native.IsADirectory(errno.EISDIR, "is a directory", path)
        if not stat.S_ISREG(st.st_mode):
            raise _native.FitCacheError(errno.EINVAL, "not a regular file", path)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = None  # no /proc: the lexical check stands, as in the native library
        if real is not None and not _within(real, real_root):
            raise _native.PermissionDenied(errno.EACCES, f"path outside the dataset root: {full} "
                                           f"resolves to {real}, outside {real_root}", path)
        if offset is not None:
            return memoryview(os.pread(fd, length, offset)).toreadonly()
        if st.st_size > _DIRECT_READ_MAX:  # mapped, as the native library does: never copied whole
            return memoryview(mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)).toreadonly()
        data = os.pread(fd, st.st_size, 0)
        now = os.fstat(fd)
        if len(data) != st.st_size or _stamp(now) != _stamp(st):
            raise _native.FitCacheError(errno.EAGAIN, "source file changed while being read", path)
    finally:
        os.close(fd)
    return memoryview(data).toreadonly()


_DIRECT_READ_MAX = 1 << 20  # larger files are mapped rather than read into memory


def _stamp(st):
    """What identifies one version of a file: its change would make a read mix two versions."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
