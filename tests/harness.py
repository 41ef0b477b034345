"""Starts and stops a FitCache cluster on loopback addresses, for tests and benchmarks: each
server listens on its own 127.0.0.x address (a "node") with its own memory tier, all sharing a
job token. Every process it starts it also stops, by pid."""

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time

import fitcache

NODES = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]


class NetnsNodes:
    """Test hosts in network namespaces: one namespace per node, each with its own address on
    a bridge in the caller's namespace, which keeps the bridge's address (the client's node,
    with no server). Needs root and iproute2; everything is removed by close()."""

    def __init__(self, count=4):
        tag = f"fc{os.getpid() % 100000}"
        self.subnet = 200 + os.getpid() % 50  # 10.231.<subnet>.0/24: private to this test
        self.bridge = f"{tag}br"
        self.client_addr = f"10.231.{self.subnet}.254"
        self.namespaces, self.links, self.addrs = [], [], []
        self.delay_pids = []  # the delay program's processes (see shape), stopped by close()
        # The namespace the bridge and the nodes' links live in: the links are managed there
        # even after this process moved into a node's namespace (enter).
        self._home_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        self._home = ["nsenter", f"--net=/proc/{os.getpid()}/fd/{self._home_fd}"]
        try:
            self._ip("link", "add", self.bridge, "type", "bridge")
            self.links.append(self.bridge)
            self._ip("addr", "add", f"{self.client_addr}/24", "dev", self.bridge)
            self._ip("link", "set", self.bridge, "up")
            for i in range(1, count + 1):
                ns, veth = f"{tag}n{i}", f"{tag}v{i}"
                self._ip("netns", "add", ns)
                self.namespaces.append(ns)
                self._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self.links.append(veth)
                self._ip("link", "set", veth, "master", self.bridge, "up")
                addr = f"10.231.{self.subnet}.{i}"
                self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                self._ip("-n", ns, "link", "set", "eth0", "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                self.addrs.append(addr)
        except Exception:
            self.close()
            raise

    @staticmethod
    def available():
        if os.geteuid() != 0 or shutil.which("ip") is None or os.environ.get("FITCACHE_TEST_NO_NETNS"):
            return False
        probe = f"fcprobe{os.getpid()}"
        ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return ok

    def namespace_of(self, addr):
        return self.namespaces[self.addrs.index(addr)]

    def enter(self, addr):
        """Moves this process into the namespace of the node at addr, as a program started
        on that node. A namespace is a thread's: the process must have no other thread yet
        (before FitCache's library is loaded, before torch starts its own)."""
        threads = len(os.listdir("/proc/self/task"))
        assert threads == 1, f"cannot enter a node's namespace with {threads} threads"
        with open(f"/run/netns/{self.namespace_of(addr)}") as ns:
            if ctypes.CDLL(None, use_errno=True).setns(ns.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns")

    def cut(self, addr, down=True):
        """Cuts a node off the network (its link goes down) or restores it."""
        veth = self.links[1 + self.addrs.index(addr)]
        self._ip("link", "set", veth, "down" if down else "up")

    def shape(self, rate=None, delay_us=0, delay_program=None, burst="1mb"):
        """Shapes every node's link, both ways. rate (tc syntax, "10gbit"): a token bucket
        (tbf) on both ends of each node's veth. delay_us with delay_program (an NFQUEUE delay
        program taking QUEUE DELAY_US PIDFILE, bench/netdelay, for kernels without netem): every packet a node sends is held delay_us in its namespace (iptables
        OUTPUT, one program per namespace), so a round trip between nodes gains 2 x delay_us.
        Undone by close()."""
        def run(*cmd):
            subprocess.run(cmd, check=True, capture_output=True)

        tbf = ["root", "tbf", "rate", str(rate), "burst", burst, "latency", "5ms"]
        for i, ns in enumerate(self.namespaces):
            enter = ["nsenter", f"--net=/run/netns/{ns}"]  # not `ip netns exec`: see Cluster.start
            if rate:
                run(*enter, "tc", "qdisc", "replace", "dev", "eth0", *tbf)  # what the node sends
                run(*self._home, "tc", "qdisc", "replace", "dev", self.links[1 + i], *tbf)  # what it receives
            if delay_us:
                run(*enter, "iptables-legacy", "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE",
                    "--queue-num", "0", "--queue-bypass")
                pidfile = f"/run/fitcache-delay-{ns}.pid"
                # It daemonizes, keeping its standard descriptors: none of them may be a pipe
                # of ours. Its pid comes in the pidfile after the parent has exited.
                subprocess.run([*enter, delay_program, "0", str(int(delay_us)), pidfile], check=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                wait_for(lambda: os.path.exists(pidfile) and open(pidfile).read().endswith("\n"), timeout=10)
                with open(pidfile) as f:
                    self.delay_pids.append(int(f.read()))
                os.unlink(pidfile)

    def _ip(self, *args, check=True):
        subprocess.run([*self._home, "ip", *args], check=check, capture_output=True)

    def close(self):
        for pid in self.delay_pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.delay_pids = []
        for ns in self.namespaces:
            self._ip("netns", "del", ns, check=False)
        for link in reversed(self.links):
            self._ip("link", "del", link, check=False)
        self.namespaces, self.links = [], []
        if self._home_fd is not None:
            os.close(self._home_fd)
            self._home_fd = None


GOSSIP_OFFSET = 1000  # membership.DefaultPortOffset


def _ports_no_connection_takes(gossip_offset):
    """Ports below the kernel's ephemeral range, gossip port included: every outgoing
    connection on the machine (this suite's clients make thousands) binds a local port from
    that range, so a port picked there and checked free could be taken before its server
    starts, which then does not start. Above 10000, clear of the well-known services."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    return range(10000, low - gossip_offset)


def free_port(host, gossip_offset=0):
    """A TCP port free on host a moment ago, below the ephemeral range; with gossip_offset,
    one whose gossip port (port + gossip_offset) was free too, TCP and UDP: a cluster server
    whose gossip port is taken does not start."""
    ports = _ports_no_connection_takes(gossip_offset)
    for _ in range(100):
        port = secrets.choice(ports)  # not random.choice: a test may seed that one
        try:
            for p in {port, port + gossip_offset}:
                with socket.socket() as t, socket.socket(type=socket.SOCK_DGRAM) as u:
                    t.bind((host, p))
                    u.bind((host, p))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port on {host} with its gossip port free")


class Cluster:
    """Servers started by the test (and stopped by it, by pid)."""

    def __init__(self, tmp_path, root, nodes=NODES, netns=None, serve_options=None, budget="256MiB"):
        """Servers on nodes (addresses); with netns (a NetnsNodes), each runs inside the
        namespace that owns its address (on the first len(nodes) of them when nodes is given)
        and the client is on the bridge. Each server has a memory tier of budget. With serve_options
        (a dict of cluster options, possibly empty), the servers are also given the job's
        server list and those options (as FITCACHE_*), so that their node sockets serve
        `fitcache run` on their node with every file of the job."""
        self.tmp, self.root, self.netns = tmp_path, root, netns
        self.serve_options = serve_options
        self.run_id = secrets.token_hex(4)
        self.token_file = str(tmp_path / "token")
        subprocess.run([fitcache._native.server_binary(), "token", self.token_file], check=True)
        self.budget = budget
        if netns:
            self.addrs = [f"{host}:7070" for host in netns.addrs[:len(nodes)]]
            self.node = netns.client_addr
        else:
            self.addrs = [f"{host}:{free_port(host, GOSSIP_OFFSET)}" for host in nodes]
            self.node = nodes[0]
        first = self.addrs[0].split(":")[0]
        self.metrics = f"{first}:7071" if netns else f"{first}:{free_port(first)}"  # the first server's metrics
        self.procs = {}
        for addr in self.addrs:
            self.start(addr)

    def tiers(self, addr):
        # A random part: pids come round again, and a tier left by an interrupted run must
        # not be rescanned into this one.
        return f"memory:/dev/shm/fitcache-test-{os.getpid()}-{self.run_id}-{addr.replace(':', '_')}:{self.budget}"

    def start(self, addr):
        ready = self.tmp / f"ready-{addr}"
        env = {**os.environ, "FITCACHE_RUNTIME_DIR": str(self.tmp / "run")}
        if self.serve_options is not None:
            env.update({"FITCACHE_" + k.upper(): str(v)
                        for k, v in {"servers": ",".join(self.addrs), **self.serve_options}.items()})
        log = open(self.tmp / f"server-{addr}.log", "a")
        extra = ["--metrics", self.metrics] if addr == self.addrs[0] else []
        # nsenter, not `ip netns exec`: that one also makes a mount namespace, which would pin
        # FUSE mounts (such as the benchmark PFS) for the server's lifetime.
        prefix = ["nsenter", f"--net=/run/netns/{self.netns.namespace_of(addr.split(':')[0])}"] if self.netns else []
        proc = subprocess.Popen([*prefix, fitcache._native.server_binary(), "serve", "--listen", addr, "--token-file",
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
        return {"servers": ",".join(self.addrs), "token_file": self.token_file, "node": self.node,
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
    """Base names of the files a server holds in its memory tier (the cached file names, in
    the hash-bin directories, are the key, a dash and the source's base name; each has a
    record beside it, named with a leading dot)."""
    tier = cluster.tiers(addr).split(":")[1]
    return {name.split("-", 1)[1] for dirpath, _, files in os.walk(tier) if dirpath != tier
            for name in files if "-" in name and not name.startswith(".")}


def wait_for(cond, timeout=20):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def server_stats(client):
    """Counters of the servers a cluster client sees alive, by address."""
    return {addr: s for addr, s in client.stats()["servers"].items() if not s.get("dead")}
