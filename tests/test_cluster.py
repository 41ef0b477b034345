"""Cluster mode end to end: four servers, each on its own loopback address (a "node"), a
client reading a dataset for several epochs, one server killed with SIGKILL after the first
epoch. Source reads are counted from outside with inotify."""

import os
import signal
import subprocess

import pytest

import fitcache
from conftest import digest
from harness import NODES, Cluster, NetnsNodes, cached_names, server_stats, wait_for
from inotify import OpenCounter

EPOCHS = 4


@pytest.fixture(params=["netns", "loopback"])
def cluster(request, dataset, tmp_path):
    """Four servers, each on its own node: a network namespace with its own address (as root),
    or a 127.0.0.x address. On loopback the client shares the first server's node, so it
    also maps that server's cached files itself."""
    root, _ = dataset
    netns = None
    if request.param == "netns":
        if not NetnsNodes.available():
            pytest.skip("network namespaces need root and iproute2")
        netns = NetnsNodes()
        request.addfinalizer(netns.close)
    c = Cluster(tmp_path, root, netns=netns)
    yield c
    c.stop()


def run_epochs(client, digests, epochs, after_first=None):
    names = sorted(digests)
    for epoch in range(epochs):
        for name in names:
            assert digest(client.read(name)) == digests[name], f"epoch {epoch}: wrong bytes for {name}"
        if epoch == 0 and after_first:
            after_first()


@pytest.mark.parametrize("policy", ["recache", "pfs"])
def test_killed_server_costs_what_the_policy_says(cluster, dataset, policy):
    root, digests = dataset
    victim = cluster.addrs[2]
    with fitcache.Client(root, **cluster.options(policy=policy)) as client, OpenCounter(root) as opens:
        lost = []

        def kill_victim():
            # The files the victim holds are those it published.
            wait_for(lambda: sum(s["published"] for s in server_stats(client).values()) == len(digests))
            lost.append(server_stats(client)[victim]["published"])
            cluster.kill(victim)

        run_epochs(client, digests, EPOCHS, after_first=kill_victim)
        counts = opens.counts()
        stats = client.stats()["client"]
    assert lost[0] > 0, "the victim held no file: the ring gave it nothing"
    reads = sorted(counts.values())
    assert set(counts) == set(digests)
    extra = sum(counts.values()) - len(digests)
    if policy == "recache":
        assert extra == lost[0], f"recache: {extra} extra source reads, want one per lost file ({lost[0]})"
        assert max(reads) == 2
    else:
        assert extra == lost[0] * (EPOCHS - 1), f"pfs: {extra} extra source reads, want {lost[0]} x {EPOCHS - 1}"
    assert stats.get("servers_declared_dead") == 1


def test_replicas_make_a_failure_cost_no_source_read(cluster, dataset):
    root, digests = dataset
    victim = cluster.addrs[1]
    with fitcache.Client(root, **cluster.options(replicas=2)) as client, OpenCounter(root) as opens:
        def kill_victim():
            wait_for(lambda: sum(s["published"] for s in server_stats(client).values()) == 2 * len(digests))
            cluster.kill(victim)

        run_epochs(client, digests, EPOCHS, after_first=kill_victim)
        counts = opens.counts()
    assert sorted(set(counts.values())) == [1], f"with replicas every file is read from the source once: {counts}"


def test_restarted_server_rejoins(cluster, dataset):
    root, digests = dataset
    victim = cluster.addrs[3]
    with fitcache.Client(root, **cluster.options()) as client:
        run_epochs(client, digests, 1)
        cluster.kill(victim)
        run_epochs(client, digests, 1)
        assert client.stats()["client"].get("servers_declared_dead") == 1
        cluster.start(victim)
        wait_for(lambda: client.stats()["client"].get("servers_rejoined", 0) == 1)
        before = server_stats(client)[victim]
        run_epochs(client, digests, 1)
        after = server_stats(client)[victim]
        served = sum(after["hits"].values()) + after["misses"] - sum(before["hits"].values()) - before["misses"]
        assert served > 0, "the rejoined server serves its files again"


def test_wrong_token_and_paths_outside_the_roots_are_refused(cluster, dataset, tmp_path):
    root, digests = dataset
    with pytest.raises(PermissionError, match="token"):
        fitcache.Client(root, **{**cluster.options(), "token_file": "", "token": "wrong"})
    other = tmp_path / "other"
    other.mkdir()
    (other / "f").write_bytes(b"not in the dataset")
    with fitcache.Client(str(other), **cluster.options()) as client:
        with pytest.raises(PermissionError, match="dataset root"):
            for _ in range(len(NODES) * 4):  # whichever server owns it refuses it
                client.read("f")
    with fitcache.Client(root, **cluster.options()) as client:
        with pytest.raises(PermissionError):
            client.read("../other/f")
        refusals = sum(s["refusals"] for s in server_stats(client).values())
    assert refusals >= 1


def test_hung_server_is_detected_by_timeouts_and_other_clients_learn_it(cluster, dataset):
    root, digests = dataset
    threshold = 3
    opts = cluster.options(rpc_timeout="0.5", failure_threshold=str(threshold))
    with fitcache.Client(root, **opts) as a, fitcache.Client(root, **opts) as b, OpenCounter(root) as opens:
        run_epochs(a, digests, 1)
        wait_for(lambda: sum(s["published"] for s in server_stats(a).values()) == len(digests))
        # Every file is at its owner only if no server was taken for dead meanwhile (a file
        # of a server wrongly declared dead would be cached by the next one, the victim say).
        assert a.stats()["client"].get("servers_declared_dead", 0) == 0, a.stats()["client"]
        # The victim: the server of another node holding the most files (the servers' ports,
        # and so the placement, change from run to run).
        victim = max(cluster.addrs[1:], key=lambda addr: len(cached_names(cluster, addr)))
        held = cached_names(cluster, victim)
        # A server's tier may also hold node-local copies of files other servers own (see
        # test_cluster_node): the files only the victim holds are read first.
        elsewhere = set().union(*(cached_names(cluster, addr) for addr in cluster.addrs if addr != victim))
        only = held - elsewhere
        victim_files = [n for n in sorted(digests) if os.path.basename(n) in only]
        assert len(victim_files) >= threshold, f"the victim alone holds {len(victim_files)} files"
        os.kill(cluster.procs[victim].pid, signal.SIGSTOP)  # it stops answering, connections stay open
        try:
            for name in victim_files[:threshold]:  # a read that reaches it times out: served from the source
                assert digest(a.read(name)) == digests[name]
            run_epochs(a, digests, 1)
            # a took the victim for dead after threshold timeouts of its own, or sooner when
            # the servers found it first (their replies carry it): either way, no more.
            sa = a.stats()["client"]
            own, told = sa.get("servers_declared_dead", 0), sa.get("servers_dead_by_gossip", 0)
            failures = sa.get("server_failures", 0)
            assert own + told == 1 and failures <= threshold and (own == 0 or failures == threshold), str(sa)
            # b reads files the victim does not hold first: the servers answering them pass on
            # what a found, so b never waits for the hung server.
            for name in sorted(digests, key=lambda n: os.path.basename(n) in held):
                assert digest(b.read(name)) == digests[name]
            sb = b.stats()["client"]
            assert sb.get("servers_dead_by_gossip") == 1
            assert sb.get("servers_declared_dead", 0) == 0 and sb.get("server_failures", 0) == 0
        finally:
            os.kill(cluster.procs[victim].pid, signal.SIGCONT)
        counts = opens.counts()
    # While suspected, each read that timed out went to the source (the one that made a
    # declare the victim dead went to its next owner); then each of the victim's files was
    # re-cached once at most by its next owner (not if that one held a copy already).
    again = sum(counts.values()) - len(digests) - (failures - own)
    assert 0 <= again <= len(held), (again, len(held))


def test_job_stats_and_metrics(cluster, dataset):
    import json
    import urllib.request
    root, digests = dataset
    with fitcache.Client(root, **cluster.options()) as client:
        run_epochs(client, digests, 2)
        local_hits = client.stats()["client"]["local_hits"]
    if cluster.netns is None:  # the client shares the first server's node: it maps its files
        assert local_hits > 0
    else:
        assert local_hits == 0
    env = {**os.environ, "FITCACHE_SERVERS": ",".join(cluster.addrs), "FITCACHE_TOKEN_FILE": cluster.token_file}
    out = subprocess.run([fitcache._native.server_binary(), "stats", "--json"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    assert len(job["servers"]) == len(NODES)
    assert job["total"]["source_reads"] == len(digests)
    assert sum(job["total"]["hits"].values()) + job["total"]["inflight_hits"] >= len(digests)
    with urllib.request.urlopen(f"http://{cluster.metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    first = job["servers"][cluster.addrs[0]]
    assert f"fitcache_source_reads_total {first['source_reads']}\n" in text
    assert "# TYPE fitcache_tier_used_bytes gauge" in text


def test_partitioned_node_is_dropped_and_rejoins(cluster, dataset):
    if cluster.netns is None:
        pytest.skip("cutting a node off the network needs network namespaces")
    root, digests = dataset
    victim = cluster.addrs[1]
    with fitcache.Client(root, **cluster.options(rpc_timeout="0.5")) as client:
        run_epochs(client, digests, 1)
        cluster.netns.cut(victim.split(":")[0])
        try:
            run_epochs(client, digests, 2)  # every read is still right
            stats = client.stats()["client"]
            assert stats.get("servers_declared_dead") == 1 and stats.get("server_failures", 0) >= 3
        finally:
            cluster.netns.cut(victim.split(":")[0], down=False)
        wait_for(lambda: client.stats()["client"].get("servers_rejoined", 0) == 1)
        run_epochs(client, digests, 1)


def test_tcp_server_without_root_refuses_to_start(tmp_path):
    token_file = str(tmp_path / "token")
    subprocess.run([fitcache._native.server_binary(), "token", token_file], check=True)
    proc = subprocess.run([fitcache._native.server_binary(), "serve", "--listen", "127.0.0.1:0", "--token-file",
                           token_file, "--tiers", f"memory:{tmp_path / 'tier'}"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "--root" in proc.stderr, proc.stderr
