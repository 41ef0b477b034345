"""FitCacheDataset: a map-style PyTorch dataset whose reads go through FitCache."""

import errno
import json
import mmap
import multiprocessing.util
import os
import stat
import subprocess
import warnings

from . import _native

try:  # torch is optional: without it the dataset is a plain sequence.
    from torch.utils.data import Dataset as _Base
except ImportError:  # pragma: no cover - exercised only where torch is missing
    _Base = object


def list_files(root, filter=None):
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

    Only files inside ``root`` are read, also after symbolic links are followed: the listing
    leaves out links that lead outside ``root`` (links inside it stay listed, links to
    directories are not followed), and reading any other path outside ``root`` raises
    PermissionError, also in a process forked after loading the library, whose plain reads of
    the source apply the native library's checks.
    """

    def __init__(self, root, transform=None, *, filter=None, files=None, **options):
        root = os.fsdecode(_native._fs(root))  # ValueError for a NUL byte, as open() raises
        root = os.path.abspath(root)
        if not os.path.exists(root):
            raise FileNotFoundError(errno.ENOENT, "dataset root does not exist", root)
        if not os.path.isdir(root):
            raise NotADirectoryError(errno.ENOTDIR, "dataset root is not a directory", root)
        self.root = root
        self._real_root = os.path.realpath(root)  # the fork fallback checks reads against it
        self.transform = transform
        self.options = options
        self.files = list(files) if files is not None else list_files(root, filter)
        self._client = None
        self._client_pid = None

    def __len__(self):
        return len(self.files)

    def path(self, index):
        """The absolute path of item ``index``."""
        return os.path.join(self.root, self.files[index])

    def __getitem__(self, index):
        if not isinstance(index, int) and hasattr(index, "__index__"):
            index = index.__index__()  # numpy and torch integers, as samplers yield them
        path = self.path(index)
        data = self._read(path)
        return self.transform(data) if self.transform is not None else data

    def __getitems__(self, indices):
        """The items at indices, as ``[self[i] for i in indices]`` but read in one native call
        (misses fetched concurrently). PyTorch 2's DataLoader calls it for a whole batch."""
        indices = [i.__index__() if not isinstance(i, int) and hasattr(i, "__index__") else i for i in indices]
        paths = [self.path(i) for i in indices]
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
        if self.transform is None:
            return views
        return [self.transform(v) for v in views]

    def _read(self, path):
        try:
            return self._get_client().read(path)
        except _native.ForkedAfterLoad as err:
            _warn_forked(err)
            return _read_source(path, self.root, self._real_root)

    def _get_client(self):
        pid = os.getpid()
        if self._client is not None and self._client_pid != pid and _native.forked():
            # Forked after this client was opened: it still serves cached files (the hit path
            # of the library is C); misses raise ForkedAfterLoad, read from the source here.
            return self._client
        if self._client is None or self._client_pid != pid:
            self._client = None  # a parent's client is unusable after fork
            client = _native.Client(self.root, **self.options)
            self._client, self._client_pid = client, pid
            # Workers exit through multiprocessing, which runs these finalizers (not atexit):
            # closing reports the worker's cache hits to the server.
            multiprocessing.util.Finalize(self, client.close, exitpriority=10)
        return self._client

    def stats(self):
        """Counters of the cache as a dict: ``server`` (hits per tier, misses, source reads,
        bytes, evictions, errors, tiers) and, when this process has read, ``client``.

        Hits that DataLoader workers served themselves reach the server when the worker
        exits, or within a second for persistent workers. In a process that has not loaded
        the native library this asks the ``fitcache`` command, so that workers forked later
        can still load it. ``server`` is None while no server runs (nothing read yet)."""
        if self._client is not None and self._client_pid == os.getpid():
            return self._client.stats()
        return {"server": server_stats(**self.options)}

    def close(self):
        """Closes this process's client (idempotent); the dataset reopens one if used again."""
        client, self._client = self._client, None
        if client is not None and self._client_pid == os.getpid():
            client.close()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_client"] = None
        state["_client_pid"] = None
        return state

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_EXIT_NO_SERVER = 3  # `fitcache stats` exit status when no server runs


def server_stats(**options):
    """The embedded server's counters as a dict (in cluster mode, the totals of the job's
    servers, with each server's under "servers"), or None when no server runs. Asked through
    the ``fitcache`` command (a separate process, so the caller never loads the Go runtime)."""
    env = dict(os.environ)
    for key, value in options.items():
        env["FITCACHE_" + key.upper()] = str(value)
    out = subprocess.run([_native.server_binary(), "stats", "--json"], env=env,
                         capture_output=True, text=True, timeout=30)
    if out.returncode == _EXIT_NO_SERVER:
        return None
    if out.returncode != 0:
        raise _native.FitCacheError(errno.EIO, out.stderr.strip() or "fitcache stats failed")
    stats = json.loads(out.stdout)
    if "total" in stats:  # a cluster: the job's totals, with each server's counters beside them
        return {**stats["total"], "servers": stats["servers"], "unreachable": stats.get("unreachable", {})}
    return stats


_warned_forked = False


def _warn_forked(err):
    global _warned_forked
    if not _warned_forked:
        _warned_forked = True
        warnings.warn(f"FitCache: {err.strerror}. Cached files are still read from the cache; "
                      "files not cached yet are read from the source in this process",
                      RuntimeWarning, stacklevel=4)


def _read_source(path, root, real_root):
    """The fallback read: the source file's bytes, uncached, with the checks of the native
    library's source read (core.OpenSource): path (absolute, or relative to root) must stay
    under root once normalised, and its real path under real_root; it must be a regular file
    (a FIFO is refused without waiting for a writer). Raises the exceptions the native path
    raises: NotFound, PermissionDenied, IsADirectory, or FitCacheError with EINVAL."""
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
