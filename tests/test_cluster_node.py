"""Cluster mode through the node's server: four servers on loopback "nodes" (127.0.0.1-4),
started with the job's server list so that their node sockets answer for every file of the job;
the reader runs on the first server's node. Its processes, DataLoader workers forked after the
main process loaded the library included, read the tiers of their node's server themselves and
have that server open everything else: it fetches a file another node owns from its owner and
keeps a node-local copy. Every byte is compared with the source, and the source's opens are
counted from outside with inotify: once per file for the whole job, also when a server that
owns files is killed after the node kept copies of them."""

import os
import signal

import pytest

import fitcache
from conftest import digest
from harness import Cluster, cached_names, server_stats, wait_for
from inotify import OpenCounter

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402


class Digest:
    """Transform: the item's sha256 (picklable, for workers)."""

    def __call__(self, view):
        return digest(view)


class Indexed(torch.utils.data.Dataset):
    """(index, digest) items, so that results match whatever the order."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return i, self.ds[i]


@pytest.fixture
def node_cluster(request, dataset, tmp_path):
    root, _ = dataset
    c = Cluster(tmp_path, root, serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    request.addfinalizer(c.stop)
    return c


def epoch(ds, context, indices=None):
    loader = DataLoader(Indexed(ds), batch_size=None, num_workers=2, multiprocessing_context=context,
                        sampler=indices)
    return {ds.files[i]: d for i, d in loader}


def three_epochs_each_file_opened_once(cluster, dataset, context):
    """Reads the dataset for three epochs through FitCacheDataset and a DataLoader whose
    workers start with context, after the main process read a sample (the library is loaded
    before they fork), and checks every byte and that each file was opened once on the
    source, counted from outside with inotify."""
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, Digest(), prefetch=False, **cluster.options())
    with OpenCounter(root) as opens:
        assert ds[0] == digests[ds.files[0]]
        for e in range(3):
            assert epoch(ds, context) == digests, f"epoch {e}: wrong bytes"
        counts = opens.counts()
    again = {k: n for k, n in counts.items() if n != 1}
    assert len(counts) == len(digests) and not again, f"source opens per file: {again or counts}"


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_read_through_the_node_and_the_source_once(node_cluster, dataset, context):
    three_epochs_each_file_opened_once(node_cluster, dataset, context)
    # The node's server kept a copy of every file another node owns (its tier has room): the
    # later epochs were read from this node's tiers.
    first = server_stats_of(node_cluster, node_cluster.addrs[0])
    assert first["guests"] > 0, first


def server_stats_of(cluster, addr):
    with fitcache.Client(cluster.root, **cluster.options()) as c:
        return server_stats(c)[addr]


def test_a_killed_owners_files_come_from_the_nodes_copies(node_cluster, dataset):
    root, digests = dataset
    opts = node_cluster.options()
    with fitcache.Client(root, **opts) as c:
        names = sorted(digests)
        with OpenCounter(root) as opens:
            for name in names:
                assert digest(c.read(name)) == digests[name]
            victim = node_cluster.addrs[2]  # a server on another node
            node_cluster.kill(victim)
            for name in names:
                assert digest(c.read(name)) == digests[name], f"after the kill: {name}"
            counts = opens.counts()
    assert all(n == 1 for n in counts.values()), (
        "a file of the killed server was read from the source again, though this node kept a copy: "
        f"{ {k: n for k, n in counts.items() if n != 1} }")


def test_a_reader_whose_nodes_server_died_reads_from_the_other_servers(node_cluster, dataset):
    """A reader that lives on after its node's server died (a persistent DataLoader worker, a
    process that forks its workers) reads the other nodes' files from their servers, as a
    reader that starts after the death does: the files are read twice, and each is opened
    at the source once (by its owner, or the killed server's files by their new owners)."""
    root, digests = dataset
    names = sorted(digests)
    with fitcache.Client(root, **node_cluster.options()) as c:
        node_cluster.kill(node_cluster.addrs[0])  # before any read: its tier holds nothing
        with OpenCounter(root) as opens:
            for _ in range(2):
                for name in names:
                    assert digest(c.read(name)) == digests[name]
            counts = opens.counts()
        direct = c.stats()["client"]["direct_reads"]
    again = {k: n for k, n in counts.items() if n != 1}
    assert len(counts) == len(digests) and not again, f"source opens per file: {again or counts}"
    assert direct == 0, f"{direct} reads from the source by the reader itself"


@pytest.mark.parametrize("prefetch", [False, True])
def test_fresh_workers_read_the_tiers_of_their_nodes_killed_server(node_cluster, dataset, tmp_path, prefetch):
    """The reader's own node server killed between two epochs: the next epoch's DataLoader
    workers, fresh processes that cannot learn the node's tiers from that server, find them
    through the record it keeps in the runtime directory (which the readers share with it),
    check each copy against its source (a stat) and serve it: no file the killed server held
    is opened at the source again, and every byte is right. With prefetch, the list the
    workers hand over does not make the new owners read those files ahead either."""
    root, digests = dataset
    opts = node_cluster.options(runtime_dir=str(tmp_path / "run"), wait_timeout="1")
    ds = fitcache.FitCacheDataset(root, Digest(), prefetch=prefetch, open_before_fork=False, **opts)
    assert epoch(ds, "fork") == digests
    victim = node_cluster.addrs[0]
    node_cluster.kill(victim)
    held = cached_names(node_cluster, victim)
    assert len(held) > len(digests) // 2, f"the node's server held {len(held)} of {len(digests)} files"
    with OpenCounter(root) as opens:
        assert epoch(ds, "fork") == digests, "after the kill: wrong bytes"
        counts = opens.counts()
    again = sorted(k for k in counts if os.path.basename(k) in held)
    assert not again, (f"{len(again)} of the {len(held)} files the killed server held were read from the source "
                       f"again, though its tier kept them: {again}")


def test_workers_forked_after_load_read_the_tiers_of_their_nodes_killed_server(node_cluster, dataset, tmp_path):
    """As above, with the main process loading the library after the kill (it reads an item)
    before the DataLoader forks its workers, which cannot enter Go: they read through the
    main process's stand-in node socket, which serves the killed server's copies once a stat
    of the source shows the version each copy holds. A file the killed server owned,
    rewritten in place after the kill (same size, its modification time put back), is read
    anew, not served stale. (A file a live server holds is served as that server checked it
    for the job: a file changed while the job runs is not noticed, see the README.)"""
    root, digests = dataset
    opts = node_cluster.options(runtime_dir=str(tmp_path / "run"), wait_timeout="1")
    # The epoch before the kill waits long for a server: one taken for dead under a loaded
    # machine would have its files cached by the next server too (recache), and the test
    # needs a file that the killed server alone holds.
    before = fitcache.FitCacheDataset(root, Digest(), prefetch=False, open_before_fork=False,
                                      **{**opts, "rpc_timeout": "10"})
    assert epoch(before, "fork") == digests  # this process does not load the library
    ds = fitcache.FitCacheDataset(root, Digest(), prefetch=False, **opts)
    victim = node_cluster.addrs[0]
    node_cluster.kill(victim)
    held = cached_names(node_cluster, victim)
    others = set().union(*(cached_names(node_cluster, a) for a in node_cluster.addrs[1:]))
    alone = [k for k in sorted(digests) if os.path.basename(k) in held - others
             and os.path.getsize(os.path.join(root, k)) > 0]
    assert alone, (f"no file held by {victim} alone: it holds {len(held)}, the others {len(others)}, "
                   f"both {len(held & others)}")
    changed = alone[0]
    path = os.path.join(root, changed)
    st = os.stat(path)
    with open(path, "r+b") as f:
        data = bytes(b ^ 0xFF for b in f.read())
        f.seek(0)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    want = {**digests, changed: digest(data)}
    with OpenCounter(root) as opens:
        assert ds[0] == want[ds.files[0]]  # loads the library here, after the kill
        assert epoch(ds, "fork") == want, "after the kill: wrong bytes"
        counts = opens.counts()
    again = sorted(k for k in counts if os.path.basename(k) in held and k != changed)
    assert not again, (f"{len(again)} of the {len(held)} files the killed server held were read from the source "
                       f"again, though its tier kept them: {again}")


def test_workers_forked_after_their_nodes_server_died_read_through_the_stand_in(node_cluster, dataset, tmp_path):
    """The default: the main process opens its client before the DataLoader's first fork, and
    its workers read through the node's server. That server killed between two epochs, the
    main process finds before the next fork that no server of its node answers and serves
    the workers a node socket of its own: they read the other nodes' files from their
    servers (which cache them), not from the source. The first epoch reads half the files, so
    that the node's tier does not hold the others: after the kill, each of those is read from
    the source once (by its owner) over two epochs, and every byte is right."""
    root, digests = dataset
    opts = node_cluster.options(runtime_dir=str(tmp_path / "run"), wait_timeout="1")
    ds = fitcache.FitCacheDataset(root, Digest(), prefetch=False, **opts)
    half = list(range(0, len(ds), 2))
    assert epoch(ds, "fork", half) == {ds.files[i]: digests[ds.files[i]] for i in half}
    assert fitcache._native.loaded_here(), "the client was not opened before the fork"
    node_cluster.kill(node_cluster.addrs[0])
    before = ds.stats()["client"]
    with OpenCounter(root) as opens:
        for e in range(2):
            assert epoch(ds, "fork") == digests, f"epoch {e} after the kill: wrong bytes"
        counts = opens.counts()
    unread = {ds.files[i] for i in range(len(ds)) if i % 2}
    again = {k: n for k, n in counts.items() if n != 1 or k not in unread}
    assert set(counts) == unread and not again, f"source opens after the kill: {again or sorted(counts)}"
    served = ds.stats()["client"]["server_reads"] - before["server_reads"]
    assert served >= len(unread), f"the workers did not read through this process's stand-in: {served} reads"
    assert any(n.startswith("standin-") for n in os.listdir(tmp_path / "run")), "no stand-in socket"
    ds.close()
    assert not any(n.startswith("standin-") for n in os.listdir(tmp_path / "run")), "the stand-in outlived its client"


def test_a_node_server_slow_to_answer_at_a_fork_costs_a_hop_not_source_reads(node_cluster, dataset, tmp_path):
    """The node's server stopped (SIGSTOP) while the DataLoader forks, so that its hello times
    out and the main process serves its workers a stand-in, then continued: the stand-in reads
    through the node's server, which answers again (not around it, which would have the
    next server on the ring cache the node's server's files), so over that epoch and the
    next, through the node's server again, each file is read from the source once, and every
    byte is right."""
    root, digests = dataset
    opts = node_cluster.options(runtime_dir=str(tmp_path / "run"))
    ds = fitcache.FitCacheDataset(root, Digest(), prefetch=False, **opts)
    half = list(range(0, len(ds), 2))
    with OpenCounter(root) as opens:
        assert epoch(ds, "fork", half) == {ds.files[i]: digests[ds.files[i]] for i in half}
        server = node_cluster.procs[node_cluster.addrs[0]]
        loader = DataLoader(Indexed(ds), batch_size=None, num_workers=2, multiprocessing_context="fork")
        server.send_signal(signal.SIGSTOP)
        try:
            it = iter(loader)  # forks: the hello before it gets no answer
        finally:
            server.send_signal(signal.SIGCONT)
        assert {ds.files[i]: d for i, d in it} == digests, "wrong bytes"
        assert any(n.startswith("standin-") for n in os.listdir(tmp_path / "run")), "no stand-in was served"
        assert epoch(ds, "fork") == digests, "the next epoch, through the node's server again: wrong bytes"
        counts = opens.counts()
    again = {k: n for k, n in counts.items() if n != 1}
    assert len(counts) == len(digests) and not again, f"source opens per file: {again or counts}"
    ds.close()


def test_workers_forked_on_a_node_without_a_server_read_through_the_stand_in(node_cluster, dataset, tmp_path):
    """A reader on a node that runs no server of the job (a login node): its main process
    opens the client (the direct path, over the ring) before the DataLoader's first fork and
    serves its workers a node socket of its own, through which they read from the servers:
    every byte right, each file read from the source once for the job."""
    root, digests = dataset
    opts = node_cluster.options(runtime_dir=str(tmp_path / "run"), node="login-node")
    ds = fitcache.FitCacheDataset(root, Digest(), prefetch=False, **opts)
    with OpenCounter(root) as opens:
        for e in range(2):
            assert epoch(ds, "fork") == digests, f"epoch {e}: wrong bytes"
        counts = opens.counts()
    again = {k: n for k, n in counts.items() if n != 1}
    assert len(counts) == len(digests) and not again, f"source opens per file: {again or counts}"
    assert ds.stats()["client"]["server_reads"] >= 2 * len(digests), "the workers did not read through the stand-in"
    ds.close()


def test_a_batchs_misses_are_read_without_go(node_cluster, dataset):
    """A batch read (DataLoader workers read a batch with one call, __getitems__) whose files
    are not in the node's tiers yet: the node's server opens each, and the library reads what
    it answers in C, as it reads a single file, so no Go buffer holds any of them (C buffers
    have ids from FC_CBUF_BASE, 2**62, on: capi/hitpath.h; an empty file has no buffer)."""
    root, digests = dataset
    names = sorted(digests)
    with fitcache.Client(root, **node_cluster.options()) as c:
        views = c.read_each(names)
        assert [digest(v) for v in views] == [digests[n] for n in names]
        through_go = [n for n, v in zip(names, views) if v.nbytes and v.obj._fitcache_owner._id < 1 << 62]
        del views
    assert not through_go, f"{len(through_go)} of {len(names)} files of the batch were read through Go"


def test_a_ranks_part_comes_first_and_the_other_files_after(node_cluster, dataset):
    """A rank's part handed over for prefetch (a DistributedSampler's): the node's server
    brings it in, then the dataset's other files, which the rank reads in later epochs, as
    node-local copies (its tier has room): every file ends up on the node, read from the
    source once."""
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, prefetch=False, **node_cluster.options())
    with OpenCounter(root) as opens:
        state = ds.prefetch(indices=range(0, len(ds), 4), wait=True)
        counts = opens.counts()
    assert state["state"] == "done" and state["done"] == len(ds) and state["failed"] == 0, state
    on_node = set().union(*(cached_names(node_cluster, a) for a in node_cluster.addrs[:1]))
    assert {os.path.basename(n) for n in digests} <= on_node, "files of the dataset not brought into the node"
    assert len(counts) == len(digests) and all(n == 1 for n in counts.values()), counts


def test_a_reader_connects_to_its_nodes_servers_only(node_cluster, dataset):
    root, digests = dataset
    with fitcache.Client(root, **node_cluster.options()) as c:
        for name in sorted(digests)[:8]:
            assert digest(c.read(name)) == digests[name]
        peers = remote_peers(os.getpid())
    others = {a for a in node_cluster.addrs[1:]}
    assert not peers & others, f"the reader connected to servers of other nodes: {peers & others}"


def test_several_servers_on_one_node_share_its_readers(request, dataset, tmp_path):
    """Two servers on the reader's node (as `servers_per_node=2` starts them) and one on each
    of two other nodes: the reader's processes read both local servers' tiers themselves, and a
    file of the second local server is never copied into the first as a node-local copy; the
    files of other nodes are. Every byte right, every file opened once on the source."""
    root, digests = dataset
    local = "127.0.0.1"
    c = Cluster(tmp_path, root, nodes=[local, local, "127.0.0.2", "127.0.0.3"],
                serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    request.addfinalizer(c.stop)
    three_epochs_each_file_opened_once(c, dataset, "fork")
    peers = remote_peers(os.getpid())
    assert not peers & set(c.addrs[2:]), f"the reader connected to servers of other nodes: {peers & set(c.addrs[2:])}"
    first, second = (cached_names(c, a) for a in c.addrs[:2])
    assert first and second and not first & second, (
        f"node-local copies of the other local server's files: {first & second}")
    remote = cached_names(c, c.addrs[2]) | cached_names(c, c.addrs[3])
    assert remote and remote <= first | second, f"files of other nodes without a copy on this node: {remote - first - second}"
    guests = sorted(server_stats_of(c, a)["guests"] for a in c.addrs[:2])
    # The readers' misses go to one of the two (see client/noderouter.go, home): it keeps the copies.
    assert guests == [0, len(remote)], guests


def test_workers_read_through_the_stand_in_when_the_local_server_they_asked_died(request, dataset, tmp_path):
    """Two servers on the reader's node: the one whose node socket its readers use killed
    between epochs, the other alive. The workers forked next read through the main
    process's stand-in (their node socket's server is dead, whichever other answers): every
    byte right, no file read from the source after the kill but the killed server's own
    files, each once, by their new owners."""
    root, digests = dataset
    local = "127.0.0.1"
    c = Cluster(tmp_path, root, nodes=[local, local, "127.0.0.2", "127.0.0.3"],
                serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    request.addfinalizer(c.stop)
    ds = fitcache.FitCacheDataset(root, Digest(), prefetch=False, **c.options(runtime_dir=str(tmp_path / "run")))
    half = list(range(0, len(ds), 2))
    assert epoch(ds, "fork", half) == {ds.files[i]: digests[ds.files[i]] for i in half}
    guests = [server_stats_of(c, a)["guests"] for a in c.addrs[:2]]
    home = c.addrs[0] if guests[0] else c.addrs[1]  # the readers' misses go to one of the two
    c.kill(home)
    with OpenCounter(root) as opens:
        for e in range(2):
            assert epoch(ds, "fork") == digests, f"epoch {e} after the kill: wrong bytes"
        counts = opens.counts()
    again = {k: n for k, n in counts.items() if n != 1}
    assert not again, f"files read from the source more than once after the kill: {again}"
    assert any(n.startswith("standin-") for n in os.listdir(tmp_path / "run")), "no stand-in socket"
    ds.close()


def test_a_reader_finds_the_files_of_many_servers_on_its_node_itself(request, dataset, tmp_path):
    """Ten servers on the reader's node (the FITCACHE paper runs up to 16 per node): once the
    files are cached, the reader finds every one in its node's tiers itself, whichever
    server holds it, and asks no server for any (its hit path covers all their tiers)."""
    root, digests = dataset
    c = Cluster(tmp_path, root, nodes=["127.0.0.1"] * 10, serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    request.addfinalizer(c.stop)
    names = sorted(digests)
    with fitcache.Client(root, **c.options()) as client:
        for name in names:
            assert digest(client.read(name)) == digests[name]
        holders = [a for a in c.addrs if cached_names(c, a)]
        before = client.stats()["client"]
        for name in names:
            assert digest(client.read(name)) == digests[name]
        after = client.stats()["client"]
    # 32 files on 10 servers whose ring places depend on their random ports: one or two may
    # hold none (more than 8 holders failed about 1 run in 10).
    assert len(holders) >= 6, f"the files are on {len(holders)} servers only: the test needs 6 or more"
    assert after["local_hits"] - before["local_hits"] == len(names), (before, after)
    assert after["server_reads"] == before["server_reads"], (before, after)


def test_node_local_copies_keep_to_the_budget(request, dataset, tmp_path):
    """A tier too small for the dataset: the node's server keeps node-local copies only in the
    room its own files leave, so its own files are never pushed out (each file is opened on
    the source once) and no tier holds more than its budget, counted from the files on disk."""
    root, digests = dataset
    budget = 3 << 20  # the dataset is about 5 MB: this node's share and part of the rest
    c = Cluster(tmp_path, root, budget="3MiB", serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    request.addfinalizer(c.stop)
    three_epochs_each_file_opened_once(c, dataset, "fork")
    for addr in c.addrs:
        # The copies and their records; the index (fitcache.index) is sized apart (README, Layout).
        tier = c.tiers(addr).split(":")[1]
        on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(tier) for f in files
                      if d != tier)
        assert on_disk <= budget, f"{addr}: {on_disk} bytes of copies in its tier, budget {budget}"
    home = server_stats_of(c, c.addrs[0])
    held = sum(t.get("guests", 0) for t in home["tiers"])
    others = len(digests) - (len(cached_names(c, c.addrs[0])) - held)  # files other nodes own
    assert 0 < held < others, f"{held} node-local copies of {others} files of other nodes: {home['tiers']}"


def remote_peers(pid):
    """host:port of the TCP peers of pid's established connections (/proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    peers = set()
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and fields[9] in inodes:  # ESTABLISHED
                ip_hex, port_hex = fields[2].split(":")
                ip = ".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0))
                peers.add(f"{ip}:{int(port_hex, 16)}")
    return peers


@pytest.mark.parametrize("own", [False, True], ids=["node-without-server", "own-server-killed"])
def test_fresh_workers_wait_for_no_server_the_job_knows_dead(dataset, tmp_path, request, own):
    """A server is killed between two epochs of fresh DataLoader workers (the default). Once
    the survivors' membership knows, each new worker starts without waiting for it: on a node
    without a server of the job, and on the killed server's own node. Every item's bytes are
    checked. Before, every later epoch waited the whole wait_timeout (30 s here) for the dead
    server, and twice that on its node (once as the node's server, once on the ring)."""
    import time

    root, digests = dataset
    cluster = Cluster(tmp_path, root, serve_options={"rpc_timeout": "2", "wait_timeout": "30",
                                                     "probe_interval": "0.2"})
    request.addfinalizer(cluster.stop)
    victim = cluster.addrs[0] if own else cluster.addrs[3]
    opts = cluster.options(wait_timeout="30", node=cluster.node if own else "a-node-without-a-server")
    ds = fitcache.FitCacheDataset(root, Digest(), prefetch=False, **opts)
    assert epoch(ds, "fork") == digests
    cluster.kill(victim)
    # Read from the servers' logs: a client in this process would load the library here, and
    # workers forked after that read without a Go client of their own.
    logs = [tmp_path / f"server-{addr}.log" for addr in cluster.addrs if addr != victim]
    wait_for(lambda: all(any("declared dead by the servers' membership" in line and f"server={victim}" in line
                             for line in log.read_text().splitlines()) for log in logs), timeout=30)
    for e in range(2):
        start = time.monotonic()
        assert epoch(ds, "fork") == digests, f"epoch {e} after the kill: wrong bytes"
        took = time.monotonic() - start
        # Generous against a loaded machine; what matters is no wait_timeout (30 s) per worker.
        assert took < 15, f"epoch {e} after the kill took {took:.1f} s: a fresh worker waited for the dead server"
