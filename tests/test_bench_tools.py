"""The benchmarks' own tools: bench/netdelay, the link delay of the netns nodes
(bench_cluster.py) on kernels without netem."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from harness import NetnsNodes, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ECHO = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
while data := conn.recv(1):
    conn.sendall(data)
"""


def build_netdelay(tmp_path):
    exe = tmp_path / "netdelay"
    out = subprocess.run(["gcc", "-O2", "-o", str(exe), os.path.join(REPO, "bench", "netdelay", "netdelay.c"),
                          "-lnetfilter_queue", "-lnfnetlink"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, "apt-get install libnetfilter-queue-dev (scripts/setup-env.sh does): " + out.stderr
    return str(exe)


def test_netdelay_holds_what_a_node_sends(tmp_path):
    """A node shaped with netdelay (NetnsNodes.shape) sends every packet delay_us late: each
    1-byte round trip from the caller's namespace (not delayed) to the node takes at least
    that long, and no byte is lost; close() stops the program."""
    if not NetnsNodes.available() or shutil.which("iptables-legacy") is None:
        pytest.skip("needs root, network namespaces and iptables-legacy (scripts/setup-env.sh installs it)")
    exe = build_netdelay(tmp_path)
    nodes = NetnsNodes(1)
    echo = None
    try:
        delay_us = 30_000
        nodes.shape(delay_us=delay_us, delay_program=exe)
        assert len(nodes.delay_pids) == 1
        echo = subprocess.Popen(["nsenter", f"--net=/run/netns/{nodes.namespaces[0]}", sys.executable, "-c", ECHO,
                                 nodes.addrs[0]], stdout=subprocess.PIPE, text=True)
        port = int(echo.stdout.readline())
        with socket.create_connection((nodes.addrs[0], port), timeout=10) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            trips = []
            for i in range(5):
                start = time.monotonic()
                conn.sendall(bytes([i]))
                assert conn.recv(1) == bytes([i])
                trips.append(time.monotonic() - start)
        assert min(trips) >= delay_us / 1e6, trips
        pid = nodes.delay_pids[0]
    finally:
        if echo is not None:
            echo.kill()
            echo.wait(timeout=10)
        nodes.close()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or " Z " in open(f"/proc/{pid}/stat").read(), timeout=10)


SEND_ONE = """
import socket, sys
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.sendto(b"held", (sys.argv[1], int(sys.argv[2])))
"""


def test_netdelay_lets_held_packets_go_when_stopped(tmp_path):
    """Stopped (SIGTERM) while it holds a packet, netdelay lets it go: the kernel would drop
    the packets still queued when the queue closes."""
    if not NetnsNodes.available() or shutil.which("iptables-legacy") is None:
        pytest.skip("needs root, network namespaces and iptables-legacy (scripts/setup-env.sh installs it)")
    exe = build_netdelay(tmp_path)
    nodes = NetnsNodes(1)
    try:
        nodes.shape(delay_us=10_000_000, delay_program=exe)  # 10 s: longer than the test waits
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
            rx.bind((nodes.client_addr, 0))
            rx.settimeout(5)
            subprocess.run(["nsenter", f"--net=/run/netns/{nodes.namespaces[0]}", sys.executable, "-c", SEND_ONE,
                            nodes.client_addr, str(rx.getsockname()[1])], check=True, timeout=30)
            time.sleep(0.3)  # the datagram is held
            os.kill(nodes.delay_pids[0], signal.SIGTERM)
            assert rx.recv(16) == b"held"
    finally:
        nodes.close()


def test_netdelay_refuses_bad_arguments(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    exe = build_netdelay(tmp_path)
    for args in ([], ["0"], ["x", "100"], ["0", "100ms"], ["70000", "100"], ["0", "20000000"]):
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=10)
        assert out.returncode == 2 and out.stderr, (args, out)
