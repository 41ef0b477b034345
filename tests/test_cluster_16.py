"""Sixteen servers, each on its own loopback "node" (127.0.0.1-16), as a user runs a job: a
reader on the first node reads 2,000 files with a DataLoader of 2 forked workers for five
shuffled epochs, and in the middle of the third two servers of other nodes are killed
(SIGKILL) and a third is hung (SIGSTOP, resumed only at the end). Every item's bytes are
checked, no read fails, each file is opened on the source once, and again only if a failed
server held it (policy recache; about once more per such file), and the epochs after the
faults take about what the epochs before them took: the servers' membership finds the hung
one dead, so that nothing waits on it again (it took 12 times longer before the servers
watched each other)."""

import hashlib
import os
import random
import signal
import time

import pytest

import fitcache
from harness import Cluster, cached_names
from inotify import OpenCounter

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402
from test_cluster_node import Digest, Indexed  # noqa: E402

NODES16 = [f"127.0.0.{i}" for i in range(1, 17)]
FILES = 2000
EPOCHS = 5


def small_dataset(root):
    rng = random.Random(16)
    digests = {}
    for i in range(FILES):
        rel = os.path.join(f"d{i % 20:02d}", f"f{i:04d}.bin")
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        data = rng.randbytes(rng.randrange(1, 16 << 10))
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


def test_sixteen_servers_lose_three_during_an_epoch(request, tmp_path):
    root = str(tmp_path / "data")
    digests = small_dataset(root)
    # Each tier holds its server's share and little more: most of the reader's files come from
    # other nodes at every epoch (its node keeps few node-local copies), the hung one's too.
    c = Cluster(tmp_path, root, nodes=NODES16, budget="3MiB",
                serve_options={"rpc_timeout": "1", "wait_timeout": "10", "probe_interval": "0.2"})
    request.addfinalizer(c.stop)
    killed, hung = c.addrs[5:7], c.addrs[9]
    lost = set()
    request.addfinalizer(lambda: hung in c.procs and os.kill(c.procs[hung].pid, signal.SIGCONT))
    ds = fitcache.FitCacheDataset(root, Digest(), prefetch=False, **c.options(rpc_timeout="1"))
    seconds = []
    with OpenCounter(root) as opens:
        for epoch in range(EPOCHS):
            g = torch.Generator()
            g.manual_seed(epoch)
            loader = DataLoader(Indexed(ds), batch_size=32, shuffle=True, generator=g, num_workers=2,
                                multiprocessing_context="fork", collate_fn=lambda batch: batch)
            got = {}
            start = time.monotonic()
            for b, batch in enumerate(loader):
                for i, d in batch:
                    got[ds.files[i]] = d
                if epoch == 2 and b == len(loader) // 2:
                    lost = set().union(*(cached_names(c, a) for a in (*killed, hung)))
                    for addr in killed:
                        c.kill(addr)
                    os.kill(c.procs[hung].pid, signal.SIGSTOP)
            seconds.append(time.monotonic() - start)
            assert got == digests, f"epoch {epoch + 1}: wrong bytes"
        counts = opens.counts()
    # A failed server's file is read again by the server that takes it over (recache), and
    # may have been read from the source once more by a read that the failure met. A file can
    # meet two of the failures: a killed server's file taken over by the server that hangs
    # next (which read it, then hung with it, before its own taker reads it again) is opened
    # up to five times. That is seldom: in four runs beside two busy loops, 3-6 files of
    # 2,000 were opened 3 times and none 4 times; one CI run saw a file opened 4 times. Over
    # all files, about one open more per file the failed servers held (363-375 for 371-381).
    again = {os.path.basename(k) for k, n in counts.items() if n > 1}
    assert set(counts) == set(digests), "files never opened on the source"
    assert again <= lost, f"files opened more than once that no failed server held: {sorted(again - lost)[:10]}"
    assert max(counts.values()) <= 5, f"a file opened {max(counts.values())} times"
    more = sum(n - 1 for n in counts.values())
    assert more <= 2 * len(lost), f"{more} opens more than once per file, for {len(lost)} files the failed servers held"
    warm = seconds[1]
    assert max(seconds[3:]) < 3 * warm + 5, f"epochs after the faults took {seconds[3:]} s, before {seconds[:3]} s"
