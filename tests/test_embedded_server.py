"""The embedded server: started on demand exactly once however many processes start at the
same time, reused by later runs (warm), and restarted after it exits."""

import json
import os
import signal
import subprocess
import sys
import time

import fitcache
from conftest import digest, server_pid, wait_published

READER = """
import sys, time, hashlib, fitcache
root, start_at = sys.argv[1], float(sys.argv[2])
options = dict(runtime_dir=sys.argv[3], tiers=sys.argv[4])
while time.time() < start_at:
    pass
with fitcache.Client(root, **options) as c:
    for name in sys.argv[5:]:
        print(name, hashlib.sha256(c.read(name)).hexdigest())
"""


def test_many_processes_start_exactly_one_server(dataset, cache_options):
    root, digests = dataset
    names = sorted(digests)[:6]
    start_at = time.time() + 1.5  # all readers open their client at the same moment
    procs = [subprocess.Popen([sys.executable, "-c", READER, root, str(start_at), cache_options["runtime_dir"],
                               cache_options["tiers"], *names], stdout=subprocess.PIPE, text=True)
             for _ in range(8)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        got = dict(line.split() for line in out.splitlines())
        assert got == {n: digests[n] for n in names}
    with open(os.path.join(cache_options["runtime_dir"], "server.log")) as f:
        log = f.read()
    assert log.count("fitcache server ready") == 1, log
    assert server_pid(cache_options["runtime_dir"])


def test_second_run_starts_warm(dataset, cache_options):
    root, digests = dataset
    with fitcache.Client(root, **cache_options) as c:
        for name in digests:
            c.read(name)
    stats = fitcache.server_stats(**cache_options)
    assert stats["source_reads"] == len(digests)
    # A later run (another process) finds everything cached: no source read.
    out = subprocess.run([sys.executable, "-c", READER, root, "0", cache_options["runtime_dir"],
                          cache_options["tiers"], *digests], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert fitcache.server_stats(**cache_options)["source_reads"] == len(digests)


def test_server_restarts_warm_after_exit(dataset, cache_options):
    root, digests = dataset
    with fitcache.Client(root, **cache_options) as c:
        for name in digests:
            c.read(name)
    pid = server_pid(cache_options["runtime_dir"])
    os.kill(pid, 15)
    deadline = time.time() + 10
    while server_pid(cache_options["runtime_dir"]) and time.time() < deadline:
        time.sleep(0.02)
    assert fitcache.server_stats(**cache_options) is None
    with fitcache.Client(root, **cache_options) as c:
        for name in digests:
            assert digest(c.read(name)) == digests[name]
    stats = fitcache.server_stats(**cache_options)
    assert stats["source_reads"] == 0, "the restarted server rescanned its tiers and served from them"
    assert sum(t["files"] for t in stats["tiers"]) == len(digests)


def fitcache_cli(cache_options, *args):
    env = {**os.environ, **{"FITCACHE_" + k.upper(): v for k, v in cache_options.items()}}
    return subprocess.run([fitcache._native.server_binary(), *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_warmup_caches_everything_and_reports_progress(dataset, cache_options):
    root, digests = dataset
    out = fitcache_cli(cache_options, "warmup", root)
    assert out.returncode == 0, out.stderr
    assert f"{len(digests)}/{len(digests)} files" in out.stderr
    wait_published(cache_options, len(digests))
    stats = fitcache.server_stats(**cache_options)
    assert stats["source_reads"] == len(digests)
    assert sum(t["files"] for t in stats["tiers"]) == len(digests)
    again = fitcache_cli(cache_options, "warmup", "--quiet", root)
    assert again.returncode == 0
    assert fitcache.server_stats(**cache_options)["source_reads"] == len(digests)


def test_stats_and_info_commands(dataset, cache_options):
    out = fitcache_cli(cache_options, "stats")
    assert out.returncode == 3 and "no fitcache server" in out.stderr
    root, digests = dataset
    fitcache_cli(cache_options, "warmup", "--quiet", root)
    out = fitcache_cli(cache_options, "stats")
    assert out.returncode == 0 and f"source reads {len(digests)}" in out.stdout, out.stdout
    info = fitcache_cli(cache_options, "info", "--json")
    assert info.returncode == 0, info.stderr
    import json
    report = json.loads(info.stdout)
    assert report["hardware"]["logical_cpus"] >= 1 and report["hardware"]["cpu"]
    assert [t["kind"] for t in report["tiers"]] == ["memory", "disk"]
    assert report["embedded_server_pid"] == server_pid(cache_options["runtime_dir"])
    bad = fitcache_cli(cache_options, "frobnicate")
    assert bad.returncode == 2 and "unknown command" in bad.stderr


TIMED_READER = """
import sys, time, hashlib, json, fitcache
root, runtime_dir, tiers, read_timeout = sys.argv[1:5]
start = time.monotonic()
out = {}
with fitcache.Client(root, runtime_dir=runtime_dir, tiers=tiers, read_timeout=read_timeout) as c:
    for name in sys.argv[5:]:
        out[name] = hashlib.sha256(c.read(name)).hexdigest()
    stats = c.stats()["client"]
print(json.dumps({"seconds": time.monotonic() - start, "digests": out, "client": stats}))
"""


def test_stopped_server_is_bypassed_within_the_read_timeout(dataset, cache_options):
    """A server stopped with SIGSTOP holds its lock but answers nothing: a new process, which
    cannot learn the server's tiers, reads every file right from the source within the read
    timeout (before: 77 s for the first read with the defaults, then 17 s stalls)."""
    root, digests = dataset
    names = sorted(digests)
    cached = names[: len(names) // 2]
    with fitcache.Client(root, **cache_options) as c:
        for name in cached:
            c.read(name)
    wait_published(cache_options, len(cached))
    pid = server_pid(cache_options["runtime_dir"])
    os.kill(pid, signal.SIGSTOP)
    try:
        out = subprocess.run([sys.executable, "-c", TIMED_READER, root, cache_options["runtime_dir"],
                              cache_options["tiers"], "3", *names], capture_output=True, text=True, timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["digests"] == digests
    assert result["seconds"] < 3 + 2, f"reads with a stopped server took {result['seconds']:.1f}s"
    assert result["client"]["direct_reads"] == len(names)


STOPPED_LATER = """
import hashlib, json, os, signal, sys, time, fitcache
root, pid_file = sys.argv[1], sys.argv[2]
options = dict(runtime_dir=sys.argv[3], tiers=sys.argv[4], read_timeout=sys.argv[5])
names = sys.argv[6:]
seconds = {}
with fitcache.Client(root, **options) as c:
    c.read(names[0])  # connected: the server is up
    while not os.path.exists(pid_file + ".stopped"):
        time.sleep(0.02)
    for i, name in enumerate(names[1:3]):
        if i:
            time.sleep(3)  # past the back-off: the server is asked again
        start = time.monotonic()
        data = c.read(name)
        seconds[name] = [time.monotonic() - start, hashlib.sha256(data).hexdigest()]
print(json.dumps(seconds))
"""


def test_a_server_stopped_after_connecting_costs_a_short_probe_per_miss(dataset, cache_options):
    """A server that stops answering (SIGSTOP) after the client connected: a miss waits for a
    short probe (the node socket's acknowledgement, or a Hello beside a long read), not the
    whole read timeout, and is read from the source. Before: 30 s per miss with
    read_timeout=30, each time the back-off ended."""
    root, digests = dataset
    names = sorted(digests)[:3]
    run = cache_options["runtime_dir"]
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_LATER, root, os.path.join(run, "server.lock"), run,
                             cache_options["tiers"], "30", *names], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    pid = 0
    try:
        deadline = time.monotonic() + 60
        while not pid and time.monotonic() < deadline and proc.poll() is None:
            pid = server_pid(run)
            time.sleep(0.05)
        assert pid, "no server started"
        time.sleep(1)  # the first read is done
        os.kill(pid, signal.SIGSTOP)
        open(os.path.join(run, "server.lock.stopped"), "w").close()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if pid:
            os.kill(pid, signal.SIGCONT)
    assert proc.returncode == 0, stderr
    result = json.loads(stdout)
    assert {n: d for n, (_, d) in result.items()} == {n: digests[n] for n in names[1:3]}
    slow = {n: round(s, 1) for n, (s, _) in result.items() if s >= 10}
    assert not slow, f"misses with a stopped server took {slow} s (read timeout 30 s)"
