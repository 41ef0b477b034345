"""A private FitCache set-up for a benchmark: its own runtime directory and tiers, so that the
embedded server it starts serves this run alone, and a wipe that stops that server (by the PID
in its runtime directory's server.lock) and removes everything between rounds."""

import os
import shutil
import signal
import tempfile
import time


class PrivateCache:
    """Options for a private cache (``options``), its server's PID, and ``wipe()``.

    run is the runtime directory, tiers the tier specification (``kind:dir[:budget],...``)
    whose directories dirs lists, to be removed by wipe."""

    def __init__(self, run, tiers, dirs):
        self.run = run
        self.dirs = [run, *dirs]
        self.options = {"runtime_dir": run, "tiers": tiers}

    def server_pid(self):
        """The PID of the embedded server this cache's runtime directory holds, or 0."""
        try:
            with open(os.path.join(self.run, "server.lock")) as f:
                pid = int(f.read().strip() or 0)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"fitcache" not in f.read():
                    return 0  # the PID came round to some other process
            return pid
        except (OSError, ValueError):
            return 0

    def wipe(self):
        """Stops the server (waiting up to 5 s for it to exit) and removes the directories."""
        pid = self.server_pid()
        if pid:
            os.kill(pid, signal.SIGTERM)
            for _ in range(500):
                try:
                    os.kill(pid, 0)
                    time.sleep(0.01)
                except ProcessLookupError:
                    break
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


class WarmFiles:
    """A dataset of files random files of size bytes under a temporary directory (src, their
    names in names), their copy on /dev/shm (shm: what plain reads read), and a PrivateCache
    (cache) whose memory tier of budget (twice the dataset by default) sits beside that copy;
    remove() stops its server and removes all of it. The cache's options go to FitCacheDataset
    or Client: FITCACHE_* set from Python after start would not reach the library (its Go
    runtime reads the environment the process started with)."""

    def __init__(self, prefix, files, size, budget=None):
        self.work = tempfile.mkdtemp(prefix=prefix)
        self.shm = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm")
        self.cache = None
        self.src = os.path.join(self.work, "src")
        os.makedirs(self.src)
        self.names = [f"f{i:06d}.bin" for i in range(files)]
        for n in self.names:
            with open(os.path.join(self.src, n), "wb") as f:
                f.write(os.urandom(size))
            shutil.copy(os.path.join(self.src, n), os.path.join(self.shm, n))
        self.budget = budget or str(2 * files * size)
        tier = os.path.join(self.shm, "tier")
        self.cache = PrivateCache(os.path.join(self.work, "run"), f"memory:{tier}:{self.budget}", [tier])

    def remove(self):
        if self.cache is not None:
            self.cache.wipe()
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)
