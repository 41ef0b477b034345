"""The servers of a cluster job watch each other (package membership: SWIM over
hashicorp/memberlist, encrypted with a key derived from the job token): a hung server is
declared dead by the others without any read reaching it, its files are then read by the
policy without a wait on it, and it rejoins when it answers again."""

import os
import shutil
import signal
import time

import pytest

import fitcache
from conftest import digest
from harness import Cluster, NetnsNodes, cached_names, server_stats, wait_for
from inotify import OpenCounter

NODES3 = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def members_of(client, addr):
    """The membership view of the server at addr: (alive, dead) address lists."""
    view = server_stats(client)[addr].get("members") or {}
    return set(view.get("alive") or []), set(view.get("dead") or [])


def test_a_hung_server_is_found_dead_without_a_read_and_rejoins(request, dataset, tmp_path):
    root, digests = dataset
    c = Cluster(tmp_path, root, nodes=NODES3, serve_options={"probe_interval": "0.1", "rpc_timeout": "2"})
    request.addfinalizer(c.stop)
    first, hung = c.addrs[0], c.addrs[2]
    with fitcache.Client(root, **c.options()) as client:
        wait_for(lambda: members_of(client, first)[0] == set(c.addrs))
        os.kill(c.procs[hung].pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            # A tenth of a second per probe: suspicion lasts 0.4 to 2.4 s with three members.
            wait_for(lambda: hung in members_of(client, first)[1], timeout=20)
            found_in = time.monotonic() - start
            assert hung not in members_of(client, first)[0]
            # Known dead: no read waits on it (a call to it would take the 2 s RPC timeout).
            start = time.monotonic()
            for name in sorted(digests):
                assert digest(client.read(name)) == digests[name]
            reads_took = time.monotonic() - start
        finally:
            os.kill(c.procs[hung].pid, signal.SIGCONT)
        wait_for(lambda: members_of(client, first) == (set(c.addrs), set()), timeout=20)
        for name in sorted(digests):
            assert digest(client.read(name)) == digests[name]
    assert found_in < 15, f"the hung server was declared dead after {found_in:.1f} s"
    assert reads_took < 2, f"reads waited on the hung server: {reads_took:.1f} s for {len(digests)} files"


def test_membership_off(request, dataset, tmp_path):
    """gossip_port_offset 0 turns the membership off: the stats say nothing of it, and reads work."""
    root, digests = dataset
    c = Cluster(tmp_path, root, nodes=NODES3[:2], serve_options={"gossip_port_offset": "0"})
    request.addfinalizer(c.stop)
    with fitcache.Client(root, **c.options()) as client:
        assert "members" not in server_stats(client)[c.addrs[0]]
        for name in sorted(digests)[:4]:
            assert digest(client.read(name)) == digests[name]


@pytest.mark.parametrize("reader", ["server's node", "node without a server"])
def test_what_one_nodes_reads_find_reaches_the_other_servers_at_once(request, dataset, tmp_path, reader):
    """A killed server refuses connections: the first read of the reader's node that reaches it
    finds it dead, and the servers tell the job's others at once, long before their own
    probes (paced here at 30 s) would suspect it: the reader's node's server, or, for a reader
    on a node without a server, the servers its next reads go to."""
    root, digests = dataset
    c = Cluster(tmp_path, root, nodes=NODES3, serve_options={"probe_interval": "30", "rpc_timeout": "2"})
    request.addfinalizer(c.stop)
    other, victim = c.addrs[1], c.addrs[2]
    node = {"server's node": c.node, "node without a server": "127.0.0.9"}[reader]
    with fitcache.Client(root, **c.options(node=node)) as client:
        wait_for(lambda: members_of(client, other)[0] == set(c.addrs), timeout=60)
        names = sorted(digests)
        for name in names[:2]:  # the reader's node starts reading: its server's client is up
            assert digest(client.read(name)) == digests[name]
        c.kill(victim)
        for name in names[2:]:
            assert digest(client.read(name)) == digests[name]
        wait_for(lambda: all(victim in set(server_stats(client)[a]["members"]["reported_dead"])
                             for a in c.addrs[:2]), timeout=10)


def test_a_reader_without_a_server_on_its_node_learns_from_the_servers(request, dataset, tmp_path):
    """A reader on a node without a server of the job (a login node) reads from the servers
    directly: once their membership found a hung server dead, the next reply it gets from any
    server says so, and none of its reads waits on the hung one."""
    root, digests = dataset
    c = Cluster(tmp_path, root, nodes=NODES3, serve_options={"probe_interval": "0.1", "rpc_timeout": "2"})
    request.addfinalizer(c.stop)
    first, hung = c.addrs[0], c.addrs[2]
    names = sorted(digests)
    with fitcache.Client(root, **c.options(node="127.0.0.9")) as client:
        for name in names:
            assert digest(client.read(name)) == digests[name]
        on_first = sorted(n for n in names if os.path.basename(n) in cached_names(c, first))
        os.kill(c.procs[hung].pid, signal.SIGSTOP)
        try:
            wait_for(lambda: hung in members_of(client, first)[1], timeout=20)
            assert digest(client.read(on_first[0])) == digests[on_first[0]]  # its reply carries the news
            start = time.monotonic()
            for name in names:
                assert digest(client.read(name)) == digests[name]
            reads_took = time.monotonic() - start
            learned = client.stats()["client"].get("servers_dead_by_gossip", 0)
        finally:
            os.kill(c.procs[hung].pid, signal.SIGCONT)
    assert learned >= 1, "the reader did not learn of the hung server from the servers"
    assert reads_took < 2, f"reads waited on the hung server: {reads_took:.1f} s for {len(names)} files"


def test_a_partition_heals_without_a_restart(request, dataset, tmp_path):
    """A node cut off the network (its link down, in a network namespace) is declared dead by
    the other servers, which never read from it meanwhile; once its link is back, long after
    the others stopped gossiping to it, it rejoins without a restart, and every server sees
    all of them alive again."""
    if not NetnsNodes.available():
        pytest.skip("cutting a node off the network needs network namespaces")
    root, digests = dataset
    netns = NetnsNodes(3)
    request.addfinalizer(netns.close)
    c = Cluster(tmp_path, root, nodes=NODES3, netns=netns, serve_options={"probe_interval": "0.2", "rpc_timeout": "1"})
    request.addfinalizer(c.stop)
    first, cut = c.addrs[0], c.addrs[2]
    with fitcache.Client(root, **c.options()) as client:
        wait_for(lambda: members_of(client, first)[0] == set(c.addrs), timeout=30)
        netns.cut(cut.split(":")[0])
        try:
            wait_for(lambda: cut in members_of(client, first)[1], timeout=30)
            # Longer than memberlist gossips to the dead (30 probe intervals, 6 s here):
            # only the servers' reconnect brings the node back after that.
            time.sleep(8)
        finally:
            netns.cut(cut.split(":")[0], down=False)
        wait_for(lambda: all(members_of(client, a) == (set(c.addrs), set()) for a in c.addrs), timeout=60)
        for name in sorted(digests):
            assert digest(client.read(name)) == digests[name]


def test_a_replacement_server_joins_a_running_job_and_takes_its_share(request, dataset, tmp_path):
    """A node dies with its tiers, and a replacement server starts at its address (a spare
    node given the address, or a restarted node whose memory is gone) while the job runs: the
    other servers take it in, and the reader's next epoch puts back on it exactly the files it
    held, each read from the source once, the others staying where they are. (The reader is
    on a node without a server, so that every read goes to the file's owner: a reader on a
    server's node would keep node-local copies of every file of this small dataset.)"""
    root, digests = dataset
    c = Cluster(tmp_path, root, nodes=NODES3, serve_options={"probe_interval": "0.1", "rpc_timeout": "1"})
    request.addfinalizer(c.stop)
    first, other, replaced = c.addrs
    names = sorted(digests)
    with fitcache.Client(root, **c.options(node="127.0.0.9")) as client:
        for name in names:
            assert digest(client.read(name)) == digests[name]
        share = cached_names(c, replaced)
        assert share, "the dataset left the third server nothing to hold"
        c.kill(replaced)
        shutil.rmtree(c.tiers(replaced).split(":")[1])
        for name in names:  # its files go to the others, from the source (recache)
            assert digest(client.read(name)) == digests[name]
        assert client.stats()["client"].get("servers_declared_dead") == 1
        c.start(replaced)
        wait_for(lambda: all(members_of(client, a)[0] == set(c.addrs) for a in (first, other)), timeout=30)
        # The reader takes it back when it answers its probe (every second) or a reply of the
        # servers says it joined.
        wait_for(lambda: client.stats()["client"].get("servers_rejoined", 0) == 1, timeout=10)
        with OpenCounter(root) as opens:
            for name in names:
                assert digest(client.read(name)) == digests[name]
            counts = opens.counts()
    assert cached_names(c, replaced) == share
    assert {os.path.basename(n) for n in counts} == share, "source opens other than the replacement's share"
    assert set(counts.values()) == {1}, f"a file of the share read from the source more than once: {counts}"
