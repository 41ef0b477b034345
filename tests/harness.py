"""Starts and stops a FitCache cluster on loopback addresses, for tests and benchmarks: each
server listens on its own 127.0.0.x address (a "node") with its own memory tier, all sharing a
job token. Every process it starts it also stops, by pid."""

import os
import shutil
import signal
import socket
import subprocess
import time

import fitcache

NODES = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]


def free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Cluster:
    """Servers started by the test (and stopped by it, by pid)."""

    def __init__(self, tmp_path, root, nodes=NODES):
        self.tmp, self.root = tmp_path, root
        self.token_file = str(tmp_path / "token")
        subprocess.run([fitcache._native.server_binary(), "token", self.token_file], check=True)
        self.addrs = [f"{host}:{free_port(host)}" for host in nodes]
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
        return {"servers": ",".join(self.addrs), "token_file": self.token_file, "node": self.addrs[0].split(":")[0],
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


def cached_names(cluster, addr):
    """Base names of the files a server holds in its memory tier (the cached file names end
    with the source's base name)."""
    tier = cluster.tiers(addr).split(":")[1]
    return {name.split("-", 1)[1] for _, _, files in os.walk(tier) for name in files}


def wait_for(cond, timeout=20):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def server_stats(client):
    """Counters of the servers a cluster client sees alive, by address."""
    return {addr: s for addr, s in client.stats()["servers"].items() if not s.get("dead")}
