"""Counts opens of the files under a directory with Linux inotify, from outside FitCache.

The tests use it to check that the source (the slow file system) is read exactly as often as
FitCache promises, without trusting FitCache's own counters.

The kernel merges an event with the last one queued when they are the same and that one is
not read yet, so that opens of one file in a row would count as one. Close events are watched
too (and not counted) to come between them: two opens of one file count as one only when the
second comes while the first is open and nothing else happened to the directory between."""

import collections
import ctypes
import ctypes.util
import os
import select
import struct
import threading

IN_OPEN = 0x00000020
IN_CLOSE_WRITE = 0x00000008
IN_CLOSE_NOWRITE = 0x00000010
IN_Q_OVERFLOW = 0x00004000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]


class OpenCounter:
    """Counts IN_OPEN events per regular file in every directory under root (directories
    existing when it starts). Use as a context manager; read ``counts()`` at any time.

    A thread of its own reads the events as they come: the kernel's queue holds
    max_queued_events (16,384 here), which a server's prefetch opening thousands of files a
    second fills between two calls of a reader's loop. Events lost all the same (a queue
    overflow) make counts() raise rather than report fewer opens than there were."""

    def __init__(self, root):
        self.root = root
        self._fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._dirs = {}
        for dirpath, _, _ in os.walk(root):
            wd = _libc.inotify_add_watch(self._fd, os.fsencode(dirpath),
                                             IN_OPEN | IN_CLOSE_WRITE | IN_CLOSE_NOWRITE)
            if wd < 0:
                raise OSError(ctypes.get_errno(), "inotify_add_watch", dirpath)
            self._dirs[wd] = dirpath
        self._counts = collections.Counter()
        self._lock = threading.Lock()  # one reader of the queue at a time; guards _counts and _lost
        self._lost = False
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._follow, name="OpenCounter", daemon=True)
        self._thread.start()

    def _follow(self):
        while True:
            ready = select.select([self._fd, self._stop_r], [], [])[0]
            if self._stop_r in ready:
                return
            with self._lock:
                self._drain()

    def _drain(self):
        while select.select([self._fd], [], [], 0)[0]:
            try:
                buf = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                break
            off = 0
            while off < len(buf):
                wd, mask, _, length = _EVENT.unpack_from(buf, off)
                name = buf[off + _EVENT.size: off + _EVENT.size + length].rstrip(b"\0")
                off += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    self._lost = True
                    continue
                if mask & IN_OPEN and not mask & IN_ISDIR and name:
                    rel = os.path.relpath(os.path.join(self._dirs[wd], os.fsdecode(name)), self.root)
                    self._counts[rel] += 1

    def counts(self):
        """Opens seen so far, by path relative to root."""
        with self._lock:
            self._drain()
            if self._lost:  # a count that misses opens would pass for a good one
                raise RuntimeError("inotify dropped events (the queue holds /proc/sys/fs/inotify/max_queued_events)")
            return collections.Counter(self._counts)

    def close(self):
        if self._fd >= 0:
            os.write(self._stop_w, b"x")
            self._thread.join()
            for fd in (self._fd, self._stop_r, self._stop_w):
                os.close(fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
