"""The embedded server: started on demand exactly once however many processes start at the
same time, reused by later runs (warm), and restarted after it exits."""

import glob
import json
import os
import signal
import subprocess
import sys
import threading
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
    """With memory_at_exit=keep the memory tier outlives the server: the next one rescans it.
    (By default it is emptied: tests/test_batch_job.py.)"""
    root, digests = dataset
    cache_options["memory_at_exit"] = "keep"
    with fitcache.Client(root, **cache_options) as c:
        for name in digests:
            c.read(name)
    wait_published(cache_options, len(digests))  # readers' copies are recorded after their reads
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
    # Each tier names its index's size (it grows with the files: 660 KiB for a few).
    assert out.stdout.count(", index 660.0KiB (") == 2, out.stdout
    stats = json.loads(fitcache_cli(cache_options, "stats", "--json").stdout)
    assert [t["index_bytes"] for t in stats["tiers"]] == [675840, 675840], stats["tiers"]
    info = fitcache_cli(cache_options, "info", "--json")
    assert info.returncode == 0, info.stderr
    report = json.loads(info.stdout)
    assert report["hardware"]["logical_cpus"] >= 1 and report["hardware"]["cpu"]
    assert [t["kind"] for t in report["tiers"]] == ["memory", "disk"]
    # The memory tier's tmpfs says whether it has huge pages, as /proc/self/mountinfo does.
    shm_huge = "never"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == "/dev/shm":
                shm_huge = next((o.split("=", 1)[1] for o in fields[-1].split(",") if o.startswith("huge=")), "never")
    assert report["tiers"][0]["tmpfs_huge"] == shm_huge and "tmpfs_huge" not in report["tiers"][1]
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


def _stop_during_a_copy(root, name, options, then):
    """Reads name (a large file) through a client on another thread and stops the server
    (SIGSTOP) while it copies the file into its memory tier, the miss in flight: the server
    has acknowledged the request and has not answered. Calls then(client) once the server is
    stopped, resumes the server in any case, and returns the read's (seconds, bytes or
    exception) and the seconds then took."""
    c = fitcache.Client(root, **options)
    c.read("small")  # the server runs and the client knows its tiers
    run, shm = options["runtime_dir"], options["tiers"].split(":")[1]
    pid = server_pid(run)
    assert pid, "no server runs after a read"
    result = {}

    def read():
        start = time.monotonic()
        try:
            result["data"] = bytes(c.read(name))
        except Exception as e:  # noqa: BLE001 (reported by the caller)
            result["data"] = e
        result["seconds"] = time.monotonic() - start

    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while not glob.glob(os.path.join(shm, "*", "*", ".tmp-*")):
            assert time.monotonic() < deadline, "the server did not start copying"
            time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
        wait_stopped(pid)
        # Still being copied when the server stopped: the miss was in flight.
        assert glob.glob(os.path.join(shm, "*", "*", ".tmp-*")) and "seconds" not in result
        start = time.monotonic()
        then(c)
        then_seconds = time.monotonic() - start
        reader.join(timeout=120)
    finally:
        os.kill(pid, signal.SIGCONT)
        reader.join()
        c.close()
    return result["seconds"], result["data"], then_seconds


def wait_stopped(pid):
    """Waits until process pid is stopped: kill returns once the signal is sent."""
    for _ in range(500):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def _large_file_setup(tmp_path, cache_options):
    """A dataset of a small file and a 256 MiB one (copying it takes the server a while), and
    options whose memory tier (the fixture's, cleaned by it) holds it."""
    root = tmp_path / "large"
    root.mkdir()
    (root / "small").write_bytes(b"small")
    data = os.urandom(256 << 20)
    (root / "big").write_bytes(data)
    shm = cache_options["tiers"].split(":")[1]
    options = dict(cache_options, tiers=f"memory:{shm}:1GiB", read_timeout="30")
    return str(root), data, options


def test_a_read_in_flight_when_the_server_stops_costs_a_short_probe(tmp_path, cache_options):
    """A server stopped (SIGSTOP) while a miss waits for its answer: the server keeps
    acknowledging a request it works on, so the reader finds it hung within about a second
    and reads the source (right bytes), instead of waiting the read timeout (30 s here, 61.6 s
    with the default 60 s before)."""
    root, data, options = _large_file_setup(tmp_path, cache_options)
    seconds, got, _ = _stop_during_a_copy(root, "big", options, lambda c: None)
    assert not isinstance(got, Exception), got
    assert got == data
    assert seconds < 10, f"a read in flight when the server stopped took {seconds:.1f} s (read timeout 30 s)"


def test_close_does_not_wait_for_a_read_in_flight_on_a_stopped_server(tmp_path, cache_options):
    """Closing a client while one of its misses waits on a server that stopped (SIGSTOP)
    returns promptly (before: it waited for the miss, the whole read timeout); the read ends
    with the right bytes or an error, promptly too."""
    root, data, options = _large_file_setup(tmp_path, cache_options)
    seconds, got, close_seconds = _stop_during_a_copy(root, "big", options, lambda c: c.close())
    assert close_seconds < 5, f"close took {close_seconds:.1f} s with a read in flight (read timeout 30 s)"
    assert seconds < 10, f"the read in flight took {seconds:.1f} s (read timeout 30 s)"
    assert isinstance(got, fitcache.FitCacheError) or got == data, got
