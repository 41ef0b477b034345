"""Transparent mode in cluster mode: unmodified programs (a Python script, md5sum) run under
`fitcache run` on a node of a loopback cluster of three servers, each on its own 127.0.0.x
"node"; the program runs on the first server's node. Files that server holds are opened in
its tier by the preload shim itself; the others come through its node socket from their
owners (as memory files). Every byte is compared with the source, and the source's opens are
counted from outside with inotify: once per file over several runs, and when a server is
killed, as the failure policy says."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

import fitcache
from harness import NODES, Cluster, cached_names, wait_for
from inotify import OpenCounter

PYTHON = sys.executable
# The program itself, not the Python package's launcher of it (which imports the package
# first, half a second per run).
FITCACHE = fitcache._native.server_binary()

# The program under test: it reads every file under a directory with plain open() and prints,
# per file, the SHA-256 of what it read and what /proc says its descriptor is.
READER = r'''
import hashlib, json, os, sys
root = sys.argv[1]
out = {}
for d, _, names in os.walk(root):
    for n in names:
        p = os.path.join(d, n)
        with open(p, "rb") as f:
            data = f.read()
            out[os.path.relpath(p, root)] = [hashlib.sha256(data).hexdigest(), os.readlink(f"/proc/self/fd/{f.fileno()}")]
print(json.dumps(out))
'''

# Short timeouts: a run (and its companion, which holds the run's standard error open) waits
# wait_timeout for a dead server when it opens its client; live servers answer in
# milliseconds on loopback.
TIMEOUTS = {"rpc_timeout": "2", "wait_timeout": "0.5"}


def start_cluster(request, tmp_path, root, policy="recache", serve_options=True):
    cluster = Cluster(tmp_path, root, nodes=NODES[:3],
                      serve_options={"policy": policy, **TIMEOUTS} if serve_options else None)
    request.addfinalizer(cluster.stop)
    return cluster


def run_env(cluster, tmp_path, policy="recache", **extra):
    """The environment of a job step on the first server's node: the cluster's options as
    FITCACHE_*, nothing inherited that could change what the shim does."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("FITCACHE_")}
    env.update({"FITCACHE_SERVERS": ",".join(cluster.addrs), "FITCACHE_TOKEN_FILE": cluster.token_file,
                "FITCACHE_NODE": cluster.node, "FITCACHE_POLICY": policy,
                "FITCACHE_RUNTIME_DIR": str(tmp_path / "client-run"),
                **{"FITCACHE_" + k.upper(): v for k, v in TIMEOUTS.items()}, **extra})
    return env


def fitcache_run(env, root, cmd, prefetch=None):
    extra = [] if prefetch is None else ["--prefetch", str(prefetch)]
    out = subprocess.run([FITCACHE, "run", "--data", root, *extra, "--", *cmd], env=env, capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout: {out.stdout[-2000:]}\nstderr: {out.stderr[-3000:]}"
    return out


def read_all(env, root, tmp_path, digests, prefetch=None):
    """Runs READER under `fitcache run`; checks every file's bytes; returns {rel: fd target}."""
    script = tmp_path / "reader.py"
    script.write_text(READER)
    got = json.loads(fitcache_run(env, root, [PYTHON, str(script), root], prefetch).stdout.strip().splitlines()[-1])
    assert set(got) == set(digests)
    wrong = sorted(rel for rel, (sha, _) in got.items() if sha != digests[rel])
    assert not wrong, f"wrong bytes for {wrong}"
    return {rel: target for rel, (_, target) in got.items()}


def tier_dir(cluster, addr):
    return os.path.realpath(cluster.tiers(addr).split(":")[1])


def held_by(cluster, digests):
    """{server: relative paths of the files it holds}, once every file is held. The first
    server, on the program's node, also holds node-local copies of the others' files."""
    def held():
        return {addr: {rel for rel in digests if os.path.basename(rel) in cached_names(cluster, addr)}
                for addr in cluster.addrs}
    wait_for(lambda: set().union(*held().values()) == set(digests))
    return held()


def test_every_file_comes_from_its_owner_and_the_source_is_read_once(request, dataset, tmp_path):
    root, digests = dataset
    md5 = {}
    for rel in digests:
        with open(os.path.join(root, rel), "rb") as f:
            md5[rel] = hashlib.md5(f.read()).hexdigest()
    cluster = start_cluster(request, tmp_path, root)
    env = run_env(cluster, tmp_path)
    local, remote = cluster.addrs[0], cluster.addrs[1:]
    with OpenCounter(root) as opens:
        read_all(env, root, tmp_path, digests)
        held = held_by(cluster, digests)
        assert all(held[addr] for addr in cluster.addrs), f"a server holds no file: the ring gave it nothing {held}"

        # An unmodified C program: md5sum of every file, in one process.
        rels = sorted(digests)
        out = fitcache_run(env, root, ["md5sum", *[os.path.join(root, rel) for rel in rels]])
        sums = {os.path.relpath(line.split(None, 1)[1], root): line.split()[0] for line in out.stdout.splitlines()}
        assert sums == md5

        # Every file is opened in the local server's tier by the shim: its own, and the node-
        # local copies it keeps of the other servers' files (it has room), which it fetched
        # from them through its node socket the first time.
        targets = read_all(env, root, tmp_path, digests)
        theirs = set().union(*(held[addr] for addr in remote))
        assert held[local] == set(digests) and theirs, held
        for rel in digests:
            assert targets[rel].startswith(tier_dir(cluster, local) + os.sep), (rel, targets[rel])
        counts = opens.counts()
    assert set(counts) == set(digests)
    again = {rel: n for rel, n in counts.items() if n != 1}
    assert not again, f"source files opened more than once over 3 runs: {again}"

    # No server of the job on this node: a clear error, and the program is not run.
    out = subprocess.run([FITCACHE, "run", "--data", root, "--", "true"], env={**env, "FITCACHE_NODE": "elsewhere"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no server of the job runs on this node" in out.stderr, out.stderr


@pytest.mark.parametrize("policy", ["recache", "pfs"])
def test_a_killed_server_costs_what_the_policy_says(request, dataset, tmp_path, policy):
    root, digests = dataset
    cluster = start_cluster(request, tmp_path, root, policy=policy)
    env = run_env(cluster, tmp_path, policy=policy)
    victim = cluster.addrs[2]
    runs_after = 2
    with OpenCounter(root) as opens:
        read_all(env, root, tmp_path, digests)
        lost = held_by(cluster, digests)[victim]
        assert lost, "the victim holds no file: the ring gave it nothing"
        cluster.kill(victim)
        for _ in range(runs_after):
            targets = read_all(env, root, tmp_path, digests)
            for rel in lost:  # the node-local copy the local server kept, whatever the policy
                assert targets[rel].startswith(tier_dir(cluster, cluster.addrs[0]) + os.sep), (rel, targets[rel])
        counts = opens.counts()
    # The program's node kept copies of the victim's files: its death costs no source read,
    # under either policy (what each policy does without such copies: server/readers_test.go).
    assert set(counts) == set(digests)
    again = {rel: n for rel, n in counts.items() if n != 1}
    assert not again, f"{policy}: source files read again after the kill, though this node kept copies: {again}"

    # The local server dies too: the program reads the source, and is told so.
    cluster.kill(cluster.addrs[0])
    out = subprocess.run([FITCACHE, "run", "--data", root, "--", "md5sum", os.path.join(root, sorted(digests)[0])],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "do not answer" in out.stderr, out.stderr
    with open(os.path.join(root, sorted(digests)[0]), "rb") as f:
        assert out.stdout.split()[0] == hashlib.md5(f.read()).hexdigest()


def test_servers_without_the_job_list_serve_only_what_this_node_holds(request, dataset, tmp_path):
    root, digests = dataset
    cluster = start_cluster(request, tmp_path, root, serve_options=False)
    rel = sorted(digests)[-1]
    out = subprocess.run([FITCACHE, "run", "--data", root, "--", "sha256sum", os.path.join(root, rel)],
                         env=run_env(cluster, tmp_path), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "serve no node socket" in out.stderr, out.stderr
    assert out.stdout.split()[0] == digests[rel]


def test_large_files_are_read_from_their_source_while_they_come_to_the_node(request, tmp_path):
    """A large file (8 MiB or more) is not waited for, whichever server owns it: the first
    run's program reads each from its source, opened once for it, while the file's owner
    caches it and (for another node's file) this node keeps a copy; the next run reads every
    one on this node. The source is opened at most twice per file: the program's first
    open, and the owner's copy when the owner is on another node."""
    root = tmp_path / "large"
    root.mkdir()
    digests = {}
    for i in range(6):  # one of three servers owns each: some are surely another node's
        data = os.urandom((9 << 20) + i)
        (root / f"l{i}.bin").write_bytes(data)
        digests[f"l{i}.bin"] = hashlib.sha256(data).hexdigest()
    cluster = start_cluster(request, tmp_path, str(root))
    env = run_env(cluster, tmp_path)
    with OpenCounter(str(root)) as opens:
        first = read_all(env, str(root), tmp_path, digests, prefetch=0)
        assert first == {rel: str(root / rel) for rel in digests}, f"first run: {first}"
        wait_for(lambda: set(digests) <= cached_names(cluster, cluster.addrs[0]), timeout=60)
        second = read_all(env, str(root), tmp_path, digests, prefetch=0)
        counts = opens.counts()
    tier = cluster.tiers(cluster.addrs[0]).split(":")[1]
    assert all(target.startswith(tier + os.sep) for target in second.values()), f"second run: {second}"
    assert set(counts) == set(digests) and max(counts.values()) <= 2, f"source opens: {counts}"
