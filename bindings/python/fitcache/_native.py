"""ctypes binding of libfitcache (see capi/fitcache.h for the contract).

The library is loaded lazily, once per process. A Go runtime does not survive fork(), so in a
process forked after loading, the inherited library serves only cached files (its hit path
is C); everything else fails at once with ECHILD, raised as :class:`ForkedAfterLoad`, which
the dataset turns into plain reads of the source. Nothing can hang.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Optional, Union, cast

#: A path as the binding takes it: text, bytes or a path-like object.
PathArg = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

_HERE = os.path.dirname(os.path.abspath(__file__))

_lock = threading.Lock()  # protects _lib and _lib_pid
_lib = None
_lib_pid = None

#: This process's pid, kept across fork (os.register_at_fork), so that what runs per read
#: needs no system call to tell a forked process from its parent.
pid = os.getpid()


def _forked_child():
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_forked_child)


class FitCacheError(OSError):
    """A FitCache call failed; ``errno`` and the native message say why."""


class NotFound(FitCacheError, FileNotFoundError):
    """The file does not exist (ENOENT)."""


class PermissionDenied(FitCacheError, PermissionError):
    """The path is outside the dataset root, or the source refused access (EACCES)."""


class IsADirectory(FitCacheError, IsADirectoryError):
    """The path names a directory (EISDIR)."""


class NotADirectory(FitCacheError, NotADirectoryError):
    """The dataset root is not a directory (ENOTDIR)."""


class ForkedAfterLoad(FitCacheError):
    """This process was forked after it loaded libfitcache, so it cannot use it (ECHILD)."""


_ERRORS = {
    errno.ENOENT: NotFound,
    errno.EACCES: PermissionDenied,
    errno.EPERM: PermissionDenied,
    errno.EISDIR: IsADirectory,
    errno.ENOTDIR: NotADirectory,
    errno.ECHILD: ForkedAfterLoad,
}


def library_path() -> str:
    """Where libfitcache.so is loaded from: $FITCACHE_LIBRARY, else beside this package."""
    return os.environ.get("FITCACHE_LIBRARY") or os.path.join(_HERE, "libfitcache.so")


def server_binary() -> str:
    """The fitcache executable installed with the package."""
    return os.environ.get("FITCACHE_SERVER_BIN") or os.path.join(_HERE, "bin", "fitcache")


def library() -> ctypes.CDLL:
    """Returns the loaded library, loading it in this process on first use. In a process
    forked after its parent loaded it, this is the parent's copy: it serves cached files of
    the parent's clients (see :func:`forked`) and fails with ForkedAfterLoad otherwise."""
    global _lib, _lib_pid
    lib = _lib
    if lib is not None:
        return lib
    with _lock:
        if _lib is None:
            path = library_path()
            if not os.path.exists(path):
                raise FitCacheError(errno.ENOENT, f"libfitcache not found at {path}: "
                                    "reinstall the package (pip install .) or set FITCACHE_LIBRARY")
            _lib = _declare(ctypes.CDLL(path))
            _lib_pid = os.getpid()
        return _lib


def loaded_here() -> bool:
    """True if this very process has loaded the library."""
    return _lib is not None and _lib_pid == pid


def forked() -> bool:
    """True if the library was loaded by a parent of this process, before it forked."""
    return _lib is not None and _lib_pid != pid


def _declare(lib):
    i64, p = ctypes.c_int64, ctypes.POINTER
    # int fc_open(const char *root, const char *options_json, int64_t *handle);
    lib.fc_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, p(i64)]
    lib.fc_open.restype = ctypes.c_int
    # int fc_close(int64_t handle);
    lib.fc_close.argtypes = [i64]
    lib.fc_close.restype = ctypes.c_int
    # int fc_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer);
    lib.fc_read.argtypes = [i64, ctypes.c_char_p, p(ctypes.c_void_p), p(i64), p(i64)]
    lib.fc_read.restype = ctypes.c_int
    # int fc_read_many(int64_t handle, int count, const char *const *paths, const void **data,
    #                  int64_t *sizes, int64_t *buffers, int *results);
    lib.fc_read_many.argtypes = [i64, ctypes.c_int, p(ctypes.c_char_p), p(ctypes.c_void_p), p(i64), p(i64),
                                 p(ctypes.c_int)]
    lib.fc_read_many.restype = ctypes.c_int
    # int fc_prefetch(int64_t handle, int count, const char *const *paths);
    lib.fc_prefetch.argtypes = [i64, ctypes.c_int, p(ctypes.c_char_p)]
    lib.fc_prefetch.restype = ctypes.c_int
    # int fc_prefetch_epochs(int64_t handle, int count, const char *const *paths, int this_epoch);
    lib.fc_prefetch_epochs.argtypes = [i64, ctypes.c_int, p(ctypes.c_char_p), ctypes.c_int]
    lib.fc_prefetch_epochs.restype = ctypes.c_int
    # int fc_release(int64_t buffer);
    lib.fc_release.argtypes = [i64]
    lib.fc_release.restype = ctypes.c_int
    # int64_t fc_pread(int64_t handle, const char *path, void *buf, int64_t len, int64_t off);
    lib.fc_pread.argtypes = [i64, ctypes.c_char_p, ctypes.c_void_p, i64, i64]
    lib.fc_pread.restype = i64
    # int fc_size(int64_t handle, const char *path, int64_t *size);
    lib.fc_size.argtypes = [i64, ctypes.c_char_p, p(i64)]
    lib.fc_size.restype = ctypes.c_int
    # int fc_stats(int64_t handle, char *buf, size_t len, size_t *needed);
    # int fc_check_server(int64_t handle);
    lib.fc_check_server.argtypes = [i64]
    lib.fc_check_server.restype = ctypes.c_int
    # int fc_cluster(int64_t handle);
    lib.fc_cluster.argtypes = [i64]
    lib.fc_cluster.restype = ctypes.c_int
    lib.fc_stats.argtypes = [i64, ctypes.c_void_p, ctypes.c_size_t, p(ctypes.c_size_t)]
    lib.fc_stats.restype = ctypes.c_int
    # int fc_debug_open_handles(int64_t *clients, int64_t *buffers);
    lib.fc_debug_open_handles.argtypes = [p(i64), p(i64)]
    lib.fc_debug_open_handles.restype = ctypes.c_int
    # int fc_errmsg(char *buf, size_t len);
    lib.fc_errmsg.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.fc_errmsg.restype = ctypes.c_int
    # const char *fc_version(void);
    lib.fc_version.argtypes = []
    lib.fc_version.restype = ctypes.c_char_p
    return lib


_ErrBuf = ctypes.c_char * 4096  # one type, kept (see _ARRAY_TYPES): a forked worker raises per miss


def _raise(lib, rc, path=None):
    """Raises the exception for a negative return code, with the native message."""
    buf = _ErrBuf()
    lib.fc_errmsg(buf, len(buf))
    code = -rc
    cls = _ERRORS.get(code, FitCacheError)
    msg = buf.value.decode(errors="replace") or os.strerror(code)
    if path is not None:
        raise cls(code, msg, path)
    raise cls(code, msg)


_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def _fs(path: PathArg) -> bytes:
    """The path as bytes for C. A NUL byte would end the C string early and name another file
    ("a.bin\\0.jpg" is "a.bin"), so it is refused as open() refuses it."""
    # os.fsencode, without its Python-level calls for the common case of a str
    path = path.encode(_FS_ENCODING, _FS_ERRORS) if type(path) is str else os.fsencode(path)
    if b"\0" in path:
        raise ValueError("embedded null byte")
    return path


class PathList:
    """Paths encoded for the native library once: a prefetch list that many processes hand
    over, as the fresh DataLoader workers of every epoch do, made before they fork, costs
    each of them no work per path (10,000 paths encoded cost a forked worker 5 ms of CPU,
    most of it copying the pages whose objects it touched). Pickles as its paths."""

    __slots__ = ("paths", "_array")

    def __init__(self, paths: Iterable[PathArg]) -> None:
        self.paths = [_fs(p) for p in paths]
        self._array = _batch_array(ctypes.c_char_p, len(self.paths))
        self._array[:] = self.paths

    def __len__(self) -> int:
        return len(self.paths)

    def __reduce__(self):
        return (PathList, (self.paths,))


class _Owner:
    """Owns one buffer from fc_read and releases it when the last view of it is gone."""

    __slots__ = ("_lib", "_id")

    def __init__(self, lib, buf_id):
        self._lib, self._id = lib, buf_id

    def release(self):
        buf_id, self._id = self._id, 0
        if buf_id:  # in a forked child, only buffers of the C hit path can be released
            self._lib.fc_release(buf_id)

    __del__ = release


# The ctypes byte-array types a view is made from: one per power of two, made once and kept.
# ctypes keeps an array type it made only while something uses it (its cache holds weak
# proxies), and a type is a cycle of objects that only the cyclic garbage collector frees: a
# type per read was made, became garbage with the read's views, and filled the collector's
# youngest generation (about ten objects each), so that collections ran every few dozen
# reads, and each one freed the types the next reads made again. In a DataLoader worker
# forked from a large main process, those collections reached its oldest generation and
# walked every object inherited from the parent, copying their pages (BENCHMARKS section 29).
# Made here, at import, in the process that forks the workers: a worker makes none. An array
# type may claim up to twice the bytes a buffer holds; a view is cut to the buffer's size,
# and nothing reads past it but a caller that reaches the whole array through the view's
# .obj (as it could write to it).
_ARRAY_TYPES = [ctypes.c_ubyte * (1 << k) for k in range(31)]  # 1 B to 1 GiB: 0.3-0.7 ms
_LARGE_ARRAY_TYPES: dict = {}  # past 1 GiB, by power of two, kept at their first use


def _array_type(size):
    """The ctypes byte-array type at least size long, of at most twice its size."""
    k = max(size - 1, 0).bit_length()
    if k < len(_ARRAY_TYPES):
        return _ARRAY_TYPES[k]
    t = _LARGE_ARRAY_TYPES.get(k)
    # setdefault: threads that make their first read of such a file at once keep one type
    return t if t is not None else _LARGE_ARRAY_TYPES.setdefault(k, ctypes.c_ubyte * (1 << k))


# The array types of read_each's arguments, by element type and length, kept for the same
# reason (a batch's five arrays made five types). A loader's batches have a few lengths; a
# program that reads many lengths drops them all now and then.
_BATCH_TYPES: dict = {}
_BATCH_TYPES_MAX = 256


def _batch_array(ctype, n):
    """A new array of n ctype elements, of a type kept in _BATCH_TYPES."""
    t = _BATCH_TYPES.get((ctype, n))
    if t is None:
        if len(_BATCH_TYPES) >= _BATCH_TYPES_MAX:
            _BATCH_TYPES.clear()
        t = _BATCH_TYPES[ctype, n] = ctype * n
    return t()


_c_void_p, _c_int64, _byref = ctypes.c_void_p, ctypes.c_int64, ctypes.byref


def _view(lib, address, size, buf_id):
    """A read-only memoryview of size bytes at address, owning buffer buf_id: the buffer is
    released when the last view derived from it is gone."""
    owner = _Owner(lib, buf_id)
    if size == 0:
        owner.release()
        return memoryview(b"")
    arr = _array_type(size).from_address(address)
    arr._fitcache_owner = owner  # the array keeps the buffer; every view keeps the array
    return memoryview(arr).cast("B")[:size].toreadonly()


class Client:
    """A client of FitCache for one dataset root. Use ``with`` or call :meth:`close`."""

    def __init__(self, root: PathArg, **options: Any) -> None:
        root = _fs(root)  # ValueError for a NUL byte, before anything is loaded
        lib = library()
        self._lib = lib
        self._fc_read = lib.fc_read
        self.root = os.fsdecode(os.path.abspath(root))
        handle = ctypes.c_int64()
        opts = json.dumps({k: str(v) for k, v in options.items() if v is not None}).encode()
        rc = lib.fc_open(_fs(self.root), opts, ctypes.byref(handle))
        if rc < 0:
            _raise(lib, rc, self.root)
        self._handle: Optional[int] = handle.value

    def read(self, path: PathArg) -> memoryview:
        """Returns the whole file as a read-only memoryview; zero copy when it is cached. The
        mapping behind it lives as long as the view (or any view derived from it)."""
        # Per read: no lock (the native call releases the GIL; the library takes no lock that
        # other threads take on a hit), and few lookups: it runs with the GIL held.
        handle = self._handle
        if handle is None:
            raise ValueError("I/O operation on a closed fitcache.Client")
        data, size, buf = _c_void_p(), _c_int64(), _c_int64()
        rc = self._fc_read(handle, _fs(path), _byref(data), _byref(size), _byref(buf))
        if rc < 0:
            _raise(self._lib, rc, path)
        return _view(self._lib, data.value, size.value, buf.value)

    def read_many(self, paths: Iterable[PathArg]) -> list[memoryview]:
        """Returns the files at paths as read-only memoryviews, like :meth:`read` for each, in
        one native call (in cluster mode, the files that miss the node's tiers are one request
        to its server; see fc_read_many). If a file
        fails, the exception :meth:`read` would raise for the first failing one is raised, and
        the files already read are released."""
        paths = list(paths)
        results = self.read_each(paths)
        for i, r in enumerate(results):
            if isinstance(r, FitCacheError):
                results.clear()  # releases what was read
                if not isinstance(r, ForkedAfterLoad):
                    # Read the failing file alone for its exception with the native message;
                    # should it succeed this time, report the error the batch got.
                    self.read(paths[i])
                raise r
        return cast("list[memoryview]", results)  # no error among them

    def read_each(self, paths: Iterable[PathArg]) -> list[Union[memoryview, FitCacheError]]:
        """Like :meth:`read_many`, but returns for each path its memoryview or the
        FitCacheError that reading it raised (without the native message), and raises only
        when the call as a whole fails."""
        paths = list(paths)
        n = len(paths)
        if n == 0:
            return []
        lib = self._lib
        c_paths = _batch_array(ctypes.c_char_p, n)
        c_paths[:] = [_fs(p) for p in paths]
        data, sizes = _batch_array(ctypes.c_void_p, n), _batch_array(ctypes.c_int64, n)
        bufs, results = _batch_array(ctypes.c_int64, n), _batch_array(ctypes.c_int, n)
        rc = lib.fc_read_many(self._checked(), n, c_paths, data, sizes, bufs, results)
        if rc < 0:
            _raise(lib, rc)
        out = []
        for i in range(n):
            if results[i] == 0:
                out.append(_view(lib, data[i], sizes[i], bufs[i]))
            else:
                code = -results[i]
                out.append(_ERRORS.get(code, FitCacheError)(code, os.strerror(code), paths[i]))
        return out

    def prefetch(self, paths: Union[Iterable[PathArg], PathList], this_epoch: int = 0) -> None:
        """Hands the server the files this client's readers are about to read, in the order
        they will read them, for the server to read from the source ahead of them (see
        fc_prefetch in fitcache.h). A new list replaces the client's earlier one; the job lives
        while the client is open. In cluster mode, with this_epoch, only the first this_epoch
        paths are read in this epoch, the rest in later ones (see fc_prefetch_epochs). Raises
        PermissionError for a path outside the root (then nothing is sent)."""
        if this_epoch < 0:
            raise ValueError(f"this_epoch {this_epoch} is negative")
        if not isinstance(paths, PathList):
            paths = PathList(paths)
        if not len(paths):
            return
        rc = self._lib.fc_prefetch_epochs(self._checked(), len(paths), paths._array, this_epoch)
        if rc < 0:
            _raise(self._lib, rc)

    def pread(self, path: PathArg, length: int, offset: int = 0) -> bytes:
        """Returns up to length bytes of the file from offset, copied into new bytes."""
        if length < 0:
            raise ValueError(f"length {length} is negative")
        out = bytearray(length)
        n = self.pread_into(path, out, offset)
        del out[n:]
        return bytes(out)

    def pread_into(self, path: PathArg, buffer: Any, offset: int = 0) -> int:
        """Reads up to len(buffer) bytes of the file from offset into buffer, a writable
        contiguous bytes-like object (bytearray, memoryview, numpy array), and returns how
        many it read: 0 at or past the end of the file. Nothing is allocated or copied
        besides the read itself, as with os.preadv."""
        view = memoryview(buffer)
        if view.readonly or not view.c_contiguous:
            raise TypeError("pread_into needs a writable contiguous buffer")
        length = view.nbytes
        if length == 0:
            n = self._lib.fc_pread(self._checked(), _fs(path), None, 0, offset)
        else:
            # The first byte as a ctypes object holds an export of the buffer (as view does):
            # the buffer cannot be resized or freed while the call writes into it.
            anchor = ctypes.c_char.from_buffer(view)
            n = self._lib.fc_pread(self._checked(), _fs(path), ctypes.addressof(anchor), length, offset)
        if n < 0:
            _raise(self._lib, n, path)
        return n

    def size(self, path: PathArg) -> int:
        """Returns the file's size in bytes."""
        size = ctypes.c_int64()
        rc = self._lib.fc_size(self._checked(), _fs(path), ctypes.byref(size))
        if rc < 0:
            _raise(self._lib, rc, path)
        return size.value

    def check_server(self) -> None:
        """Makes sure the server answers, restarting an embedded server that died (see
        fc_check_server): processes forked from this one cannot restart it themselves. In
        cluster mode, when no server of the job on this node answers, this process serves the
        processes it forks next a node socket of its own (a stand-in), which reads for them as
        this client reads."""
        rc = self._lib.fc_check_server(self._checked())
        if rc < 0:
            _raise(self._lib, rc)

    @property
    def cluster(self) -> bool:
        """True if this client reads in cluster mode (the files its node's tiers lack come
        through its node's server, one request per :meth:`read_each`); False with the embedded
        server, or where its reads go through Go. Answered in C: also in a process forked
        after load (fc_cluster)."""
        return self._lib.fc_cluster(self._checked()) == 1

    def stats(self) -> dict[str, Any]:
        """Returns this client's and its server's counters as a dict."""
        needed = ctypes.c_size_t(1 << 14)
        while True:
            buf = _array_type(needed.value)()  # a kept type (see _ARRAY_TYPES), zeroed
            rc = self._lib.fc_stats(self._checked(), buf, len(buf), ctypes.byref(needed))
            if rc == -errno.ERANGE and needed.value > len(buf):
                continue
            if rc < 0:
                _raise(self._lib, rc)
            return json.loads(ctypes.string_at(buf))

    def _checked(self) -> int:
        if self._handle is None:
            raise ValueError("I/O operation on a closed fitcache.Client")
        return self._handle

    def close(self) -> None:
        """Reports pending counters and closes the client; idempotent. Buffers already read
        stay valid."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None and _lib_pid == os.getpid():
            self._lib.fc_close(handle)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def open_handles() -> tuple[int, int]:
    """Diagnostic for leak tests: (open clients, unreleased buffers) in this process's library."""
    lib, clients, buffers = library(), ctypes.c_int64(), ctypes.c_int64()
    rc = lib.fc_debug_open_handles(ctypes.byref(clients), ctypes.byref(buffers))
    if rc < 0:
        _raise(lib, rc)
    return clients.value, buffers.value


def version() -> str:
    """The native library's version."""
    return library().fc_version().decode()
