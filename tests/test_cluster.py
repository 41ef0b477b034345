"""Cluster mode end to end: four servers, each on its own loopback address (a "node"), a
client reading a dataset for several epochs, one server killed with SIGKILL after the first
epoch. Source reads are counted from outside with inotify."""

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

import fitcache
from conftest import digest, wait_gone
from inotify import OpenCounter

NODES = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
EPOCHS = 4


def free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Cluster:
    """Servers started by the test (and stopped by it, by pid)."""

    def __init__(self, tmp_path, root):
        self.tmp, self.root = tmp_path, root
        self.token_file = str(tmp_path / "token")
        subprocess.run([fitcache._native.server_binary(), "token", self.token_file], check=True)
        self.addrs = [f"{host}:{free_port(host)}" for host in NODES]
        self.metrics = f"127.0.0.1:{free_port('127.0.0.1')}"  # the first server's metrics
        self.procs = {}
        for addr in self.addrs:
            self.start(addr)

    def tiers(self, addr):
        return f"memory:/dev/shm/fitcache-test-{os.getpid()}-{addr.replace(':', '_')}:256MiB"

    def start(self, addr):
        ready = self.tmp / f"ready-{addr}"
        env = {**os.environ, "FITCACHE_RUNTIME_DIR": str(self.tmp / "run")}
        log = open(self.tmp / f"server-{addr}.log", "a")
        extra = ["--metrics", self.metrics] if addr == self.addrs[0] else []
        proc = subprocess.Popen([fitcache._native.server_binary(), "serve", "--listen", addr, "--token-file",
                                 self.token_file, "--tiers", self.tiers(addr), "--root", self.root,
                                 "--ready-file", str(ready), *extra], stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, f"server {addr} exited: see {log.name}"
            assert time.monotonic() < deadline, f"server {addr} not ready"
            time.sleep(0.02)
        self.procs[addr] = proc

    def kill(self, addr):
        proc = self.procs.pop(addr)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def options(self, **extra):
        return {"servers": ",".join(self.addrs), "token_file": self.token_file, "node": NODES[0],
                "rpc_timeout": "2", "wait_timeout": "10", **extra}

    def stop(self):
        for addr, proc in list(self.procs.items()):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for addr in self.addrs:
            shutil.rmtree(self.tiers(addr).split(":")[1], ignore_errors=True)


@pytest.fixture
def cluster(dataset, tmp_path):
    root, _ = dataset
    c = Cluster(tmp_path, root)
    yield c
    c.stop()


def owner_of(client_stats_before, client, files):
    """Not used: ownership is observed through source reads instead."""


def run_epochs(client, digests, epochs, after_first=None):
    names = sorted(digests)
    for epoch in range(epochs):
        for name in names:
            assert digest(client.read(name)) == digests[name], f"epoch {epoch}: wrong bytes for {name}"
        if epoch == 0 and after_first:
            after_first()


def server_stats(client):
    return {addr: s for addr, s in client.stats()["servers"].items() if not s.get("dead")}


def wait_for(cond, timeout=20):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


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


def cached_names(cluster, addr):
    """Base names of the files a server holds in its memory tier (the cached file names end
    with the source's base name)."""
    tier = cluster.tiers(addr).split(":")[1]
    return {name.split("-", 1)[1] for _, _, files in os.walk(tier) for name in files}


def test_hung_server_is_detected_by_timeouts_and_other_clients_learn_it(cluster, dataset):
    root, digests = dataset
    victim = cluster.addrs[2]
    threshold = 3
    opts = cluster.options(rpc_timeout="0.5", failure_threshold=str(threshold))
    with fitcache.Client(root, **opts) as a, fitcache.Client(root, **opts) as b, OpenCounter(root) as opens:
        run_epochs(a, digests, 1)
        wait_for(lambda: sum(s["published"] for s in server_stats(a).values()) == len(digests))
        held = cached_names(cluster, victim)
        victim_files = [n for n in sorted(digests) if os.path.basename(n) in held]
        assert victim_files
        os.kill(cluster.procs[victim].pid, signal.SIGSTOP)  # it stops answering, connections stay open
        try:
            for i in range(threshold):  # each read times out, then is served from the source
                name = victim_files[i % len(victim_files)]
                assert digest(a.read(name)) == digests[name]
            sa = a.stats()["client"]
            assert sa.get("servers_declared_dead") == 1 and sa.get("server_failures") == threshold
            run_epochs(a, digests, 1)
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
    # While suspected, threshold - 1 reads went to the source; then each of the victim's files
    # was re-cached once by its next owner.
    assert sum(counts.values()) - len(digests) == (threshold - 1) + len(held)


def test_job_stats_and_metrics(cluster, dataset):
    import json
    import urllib.request
    root, digests = dataset
    with fitcache.Client(root, **cluster.options()) as client:
        run_epochs(client, digests, 2)
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
