"""Compiles the C test programs against the installed libfitcache and runs them."""

import os
import subprocess

import pytest


def compile_c(tmp_path, source, lib, *extra):
    libdir = os.path.dirname(lib)
    exe = tmp_path / os.path.basename(source).replace(".c", "")
    here = os.path.join(os.path.dirname(__file__), "c", source)
    cmd = ["cc", "-std=c11", "-Wall", "-Werror", "-o", str(exe), here, f"-I{libdir}", *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return str(exe)


@pytest.fixture
def c_dataset(tmp_path):
    root = tmp_path / "cdata"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(os.urandom(300_000))
    (root / "empty.bin").write_bytes(b"")
    return str(root)


def c_env(cache_options):
    return {**os.environ, **{"FITCACHE_" + k.upper(): v for k, v in cache_options.items()}}


def test_c_interface(tmp_path, native_library, c_dataset, cache_options):
    libdir = os.path.dirname(native_library)
    exe = compile_c(tmp_path, "capi_test.c", native_library, f"-L{libdir}", "-lfitcache",
                    f"-Wl,-rpath,{libdir}")
    out = subprocess.run([exe, c_dataset], capture_output=True, text=True, timeout=120, env=c_env(cache_options))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout


def test_c_fork_before_load(tmp_path, native_library, c_dataset, cache_options):
    exe = compile_c(tmp_path, "fork_before_load.c", native_library, "-ldl")
    out = subprocess.run([exe, native_library, c_dataset], capture_output=True, text=True, timeout=120,
                         env=c_env(cache_options))
    assert out.returncode == 0, out.stdout + out.stderr


def test_readers_follow_many_index_replacements(tmp_path):
    """Four threads looking files up while the index is replaced 40 times (a server restarted
    that often): the tier follows to the last index (tests/c/index_remap_test.c, built with
    capi/fclookup.c, the lookup code the library and the preload shim share)."""
    capi = os.path.join(os.path.dirname(__file__), "..", "capi")
    here = os.path.join(os.path.dirname(__file__), "c", "index_remap_test.c")
    exe = tmp_path / "index_remap_test"
    subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", "-O2", "-pthread", "-o", str(exe), here,
                    os.path.join(capi, "fclookup.c"), f"-I{capi}"], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout


def test_version_has_one_source(native_library):
    """capi/fitcache.h defines the version; the library, the installed header and the Python
    package report that one."""
    import re

    import fitcache
    with open(os.path.join(os.path.dirname(native_library), "fitcache.h")) as f:
        header = re.search(r'#define FITCACHE_VERSION "([^"]+)"', f.read()).group(1)
    assert fitcache.version() == header
    assert fitcache.__version__ == header


SLOW_NODE_MISSES = r'''
import contextlib, json, os, socket, sys, threading, time
import fitcache

root, runtime_dir, tiers = sys.argv[1:4]
DELAY = 0.3


def serve(conn):
    """Answers each request after DELAY, acknowledged at once, with ENOENT."""
    with conn, contextlib.suppress(OSError):  # the client closed it
        while True:
            head = conn.recv(16, socket.MSG_WAITALL)
            if len(head) < 16:
                return
            rootlen, pathlen = (int.from_bytes(head[i:i + 4], "little") for i in (8, 12))
            conn.recv(rootlen + pathlen, socket.MSG_WAITALL)
            conn.sendall(b"FCA3")
            time.sleep(DELAY)
            message = b"slow server: no such file"
            conn.sendall(b"FCN3" + (2).to_bytes(4, "little") + len(message).to_bytes(4, "little") + message)


def accept(listener):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


c = fitcache.Client(root, runtime_dir=runtime_dir, tiers=tiers, read_timeout="10")  # up: misses go to its node socket
node = os.path.join(runtime_dir, "server.sock.node")
os.unlink(node)  # replaced by a slow one of ours, before a miss connects to the server's
listener = socket.socket(socket.AF_UNIX)
listener.bind(node)
listener.listen(64)
threading.Thread(target=accept, args=(listener,), daemon=True).start()

stop = threading.Event()
misses = [0] * 4


def miss(i):
    while not stop.is_set():
        try:
            c.read(f"missing-{i}.bin")
        except FileNotFoundError:
            misses[i] += 1
        except (ValueError, fitcache.FitCacheError):  # closed meanwhile
            return


threads = [threading.Thread(target=miss, args=(i,)) for i in range(len(misses))]
for t in threads:
    t.start()
time.sleep(1.5)  # every thread is in a miss, most of the time
result = {"misses before": sum(misses)}
start = time.monotonic()
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
result["fork"] = time.monotonic() - start
start = time.monotonic()
c.close()
result["close"] = time.monotonic() - start
stop.set()
for t in threads:
    t.join()
print(json.dumps(result))
'''


def test_close_and_fork_do_not_wait_for_misses(tmp_path, c_dataset, cache_options):
    """Four threads in misses that the server answers slowly (0.3 s each, back to back):
    fork() returns at once, and so does fc_close (the misses in flight stop waiting). Before, the hit path held
    a read lock across each miss's wait for the server, and fork and fc_close, which take it
    for writing, waited for a moment with no miss in flight (glibc's rwlock prefers readers):
    here, where the gaps between a thread's misses are long (Python), fork took about 10 s;
    C threads that miss back to back block them for good."""
    import json
    import sys
    script = tmp_path / "slow_misses.py"
    script.write_text(SLOW_NODE_MISSES)
    try:
        out = subprocess.run([sys.executable, str(script), c_dataset, cache_options["runtime_dir"],
                              cache_options["tiers"]], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("fork and fc_close with 4 threads in misses did not return within 60 s")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    # The threads did miss through the slow socket, and nowhere else.
    assert 4 <= result["misses before"] <= 4 * 1.5 / 0.3 + 4, result
    assert result["fork"] < 2, f"fork took {result['fork']:.1f} s with 4 threads in misses"
    assert result["close"] < 5, f"fc_close took {result['close']:.1f} s with 4 threads in misses"


BUSY_NODE_MISS = r'''
import contextlib, json, os, socket, sys, threading, time
import fitcache

root, runtime_dir, tiers = sys.argv[1:4]


def serve(conn):
    """Acknowledges each request at once and again every quarter second, and never answers:
    a live server busy with a long copy."""
    with conn, contextlib.suppress(OSError):  # the client closed it
        head = conn.recv(16, socket.MSG_WAITALL)
        rootlen, pathlen = (int.from_bytes(head[i:i + 4], "little") for i in (8, 12))
        conn.recv(rootlen + pathlen, socket.MSG_WAITALL)
        while True:
            conn.sendall(b"FCA3")
            time.sleep(0.25)


def accept(listener):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


c = fitcache.Client(root, runtime_dir=runtime_dir, tiers=tiers, read_timeout="30")  # up: misses go to its node socket
node = os.path.join(runtime_dir, "server.sock.node")
os.unlink(node)  # replaced by a busy one of ours
listener = socket.socket(socket.AF_UNIX)
listener.bind(node)
listener.listen(8)
threading.Thread(target=accept, args=(listener,), daemon=True).start()
result = {}


def miss():
    start = time.monotonic()
    try:
        c.read("missing.bin")
        result["read"] = "bytes"
    except (ValueError, fitcache.FitCacheError) as e:  # closed meanwhile
        result["read"] = type(e).__name__
    result["read seconds"] = time.monotonic() - start


reader = threading.Thread(target=miss)
reader.start()
time.sleep(2)  # past the probe time: the miss waits on the busy server
start = time.monotonic()
c.close()
result["close"] = time.monotonic() - start
reader.join()
print(json.dumps(result))
'''


def test_close_stops_a_miss_waiting_on_a_live_server(tmp_path, c_dataset, cache_options):
    """fc_close while a miss waits for a server that lives but does not answer yet (it keeps
    acknowledging: a long copy) returns at once, and the miss ends with an error: the
    process reads nothing more through the client. Before, fc_close waited for the miss, up
    to the read timeout (30 s here)."""
    import json
    import sys
    script = tmp_path / "busy_miss.py"
    script.write_text(BUSY_NODE_MISS)
    out = subprocess.run([sys.executable, str(script), c_dataset, cache_options["runtime_dir"],
                          cache_options["tiers"]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["read"] == "FitCacheError", result  # it was still waiting when closed
    assert result["close"] < 3, f"fc_close took {result['close']:.1f} s with a miss in flight"
    assert result["read seconds"] < 5, result
