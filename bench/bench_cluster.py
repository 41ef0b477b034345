#!/usr/bin/env python3
"""Cluster mode as a job uses it: K servers (--servers, default 4), each a node of its own,
readers on one node or on every node, against plain reads of a /dev/shm copy and against the
network's own limit, all measured in the same run.

Nodes. Two variants (--variants, default both):

  loopback   the servers on 127.0.0.2..K+1 (`fitcache serve --listen ... --servers ...`, as
             tests/harness.py starts them), no shaping; the client node is 127.0.0.1
  netns      one network namespace per node on a bridge (tests/harness.py NetnsNodes): K server
             nodes and one client node without a server, each link shaped: --rate (default
             10gbit, tc tbf on both ends of every veth) and --delay-us (default 100: each
             packet a node sends is held that long; this kernel has no netem, so the delay is
             bench/netdelay, an NFQUEUE program compiled into the run's directory; without
             iptables-legacy and libnetfilter-queue-dev the link is rate-limited only, and the
             results say so). The round trip between nodes is measured and
             reported (a 1-byte TCP ping-pong), as are the delay processes' CPU time.

Dataset: the ImageNet-like one of bench_scale.py (--files, default 10,000, lognormal around 105
KiB, kept under --data), with its manifest of crc32s. Every item's bytes are consumed in the
DataLoader worker (zlib.crc32) and checked against the manifest by its reader.

Readers (--placements, default all three), each a long-lived agent process per node (this
script with --agent, started inside the node's namespace) that runs a torch DataLoader
(--workers, default 2, fork) over its share of each epoch's shuffled order (rank r of W takes
order[r::W], as DistributedSampler splits it, without padding), item by item as torch 1.13's
DataLoader reads, or with --batched a batch per __getitems__ call as PyTorch 2's does:

  client     one reader on the client node (no server there): every read is remote
  server     one reader on the node of server 1: a quarter of the reads local (K=4)
  all        one reader per server node, each its own share, all at once (the job's epoch:
             from the first reader's start to the last reader's end)

Configurations, per placement, interleaved within each of --repeats rounds:

  shm/fresh          plain reads of a /dev/shm copy, same loader and shares, epochs 1..E-1,
                     fresh workers each epoch: the baseline of warm epochs
  shm/persistent     the same with persistent_workers=True (one untimed epoch starts them)
  source/cold        plain reads of the source directory (page cache warm), epoch 0: the
                     baseline of cold epochs
  tcp                the link's own limit: the same bytes that the readers' remote reads move,
                     sent by plain TCP between the same nodes (os.sendfile from the /dev/shm copy
                     on each owner, one connection per reader and owner, all at once), with the
                     files of the placement of the run's first cluster; with iperf3 on PATH
                     also one iperf3 stream per round (server 1 to the client node, -R)
  fits/...           FitCache with a memory tier on each node that holds the whole dataset
  share/...          each node's tier holds its own share and little more: footprint / K + 10%

  and for each budget, on fresh servers with empty tiers (one job: one `job` id shared by
  every reader, as a launcher setting FITCACHE_JOB would):
  .../cold           epoch 0 from the source, fresh workers (the readers hand the servers their
                     share of the epoch's order to prefetch); source opens counted with inotify
  .../warm-fresh     epochs 1..E-1, fresh workers
  .../warm-persistent  persistent workers: one untimed epoch, then epochs 1..E-1

Every epoch also records the CPU time of the server processes and of the reader processes
(utime+stime from /proc/PID/stat of the agent, its reaped children and its live descendants:
the DataLoader workers), so that CPU per file can be compared with plain reads.

With --pfs DIR (on a slow file system mounted there: bench/slowfs, or your cluster's
parallel file system, see bench/README.md; this script never brings one up), a last section measures the first epoch over it with every server node
reading its share (--pfs-files files of the same kind generated under DIR), in the variant
--pfs-variant (default netns when run, else loopback), per round:

  pfs/threads        plain reads with --pfs-threads (default 16) threads, each file once: the
                     file system's own limit
  pfs/plain          plain reads, every node's reader its share, same loader
  pfs/fitcache-cold  FitCache on fresh servers (budget fits), every node's reader its share

Source opens are counted with inotify on DIR (every open of this machine's FUSE client) and,
with --bricks, on the dataset's directory in each brick (a GlusterFS volume's bricks
undercount). --drop-caches (root) drops the page cache before each PFS epoch.

Only the processes this script starts are stopped (agents, servers, iperf3, delay programs, by
PID); the namespaces, links, tiers, the /dev/shm copy and its work directory are removed at the
end, also on Ctrl-C or SIGTERM. Prints Markdown tables and writes JSON to --out (default
bench/results/cluster-<date>.json). Needs root for the netns variant (as the tests do).

    python bench/bench_cluster.py --files 500 --repeats 1 --out /tmp/cluster.json   # a quick look
    python bench/bench_cluster.py                                # 10,000 files, 3 rounds, both variants
    python bench/bench_cluster.py --pfs /mnt/pfs/fitcache-cluster --drop-caches   # PFS up first
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
import types
import zlib
from pathlib import Path

import bench_scale
from bench_scale import (Check, EpochSampler, FitCacheCRC, PlainCRC, brick_dir, checkpoint, copy_tree,
                         drop_caches, generate, loader, log, read_with_threads, warm_page_cache)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import Cluster, NetnsNodes, cached_names  # noqa: E402
from inotify import OpenCounter  # noqa: E402

import fitcache  # noqa: E402
from fitcache.dataset import server_stats  # noqa: E402

LINK_PORT = 7090  # default port of each server node's plain-TCP sender (the tcp baseline); iperf3 the next
PLACEMENTS = ("client", "server", "all")
BUDGETS = ("fits", "share")
REPLY_TIMEOUT = 1800  # seconds an agent may take for one command: every wait is bounded
HERE = Path(__file__).resolve().parent
NETDELAY = HERE / "netdelay" / "netdelay.c"


# ---- CPU time from /proc ----

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # fields from the state on (comm may hold spaces)


def tree_cpu(pid):
    """CPU seconds of pid (utime+stime), of its reaped children (cutime+cstime) and of its live
    descendants: a DataLoader's workers are counted whether they have exited or not."""
    try:
        f = _stat_fields(pid)
    except OSError:
        return 0.0
    total = sum(int(x) for x in f[11:15]) / _TICK
    children = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as c:
                children.update(int(x) for x in c.read().split())
    except OSError:
        pass
    return total + sum(tree_cpu(c) for c in children)


# ---- the agent: one per node, in the node's namespace ----

class PartSampler(EpochSampler):
    """Rank's share of epoch's shuffled order (the same order for every configuration): what
    DistributedSampler gives rank of world, without its padding."""

    def __init__(self, n, seed, rank=0, world=1):
        super().__init__(n, seed)
        self.rank, self.world = rank, world

    def order(self, epoch):
        return super().order(epoch)[self.rank::self.world]

    def __len__(self):
        return len(range(self.rank, self.n, self.world))


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _send_request(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def _link_serve(conn, root):
    """One connection of the plain-TCP sender: a request (length-prefixed JSON) for files, sent
    back as their total size then their bytes (sendfile), or for n 1-byte echoes (round trips)."""
    with conn:
        req = json.loads(_recv_exact(conn, struct.unpack("<I", _recv_exact(conn, 4))[0]))
        if "echo" in req:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(req["echo"]):
                conn.sendall(_recv_exact(conn, 1))
            return
        paths = [os.path.join(root, rel) for rel in req["files"]]
        conn.sendall(struct.pack("<Q", sum(os.path.getsize(p) for p in paths)))
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                size, off = os.fstat(fd).st_size, 0
                while off < size:
                    off += os.sendfile(conn.fileno(), fd, off, size - off)
            finally:
                os.close(fd)


def _link_pull(host, port, names):
    """Asks the sender on host for names and drains the bytes; returns how many came."""
    with socket.create_connection((host, port), timeout=60) as s:
        _send_request(s, {"files": names})
        total = left = struct.unpack("<Q", _recv_exact(s, 8))[0]
        buf = memoryview(bytearray(1 << 20))
        while left:
            n = s.recv_into(buf[:min(left, len(buf))])
            if not n:
                raise ConnectionError("sender closed early")
            left -= n
        return total


class Agent:
    """What an agent process runs: commands (one JSON line each) on stdin, one REPLY line each
    on stdout. It never loads the native library itself: the DataLoader workers it forks do."""

    def __init__(self, seed, batch_size):
        self.seed = seed
        self.args = types.SimpleNamespace(batch_size=batch_size)
        self.manifests = {}
        self.dl = self.ds = self.sampler = self.check = None

    def manifest(self, path):
        if path not in self.manifests:
            with open(path) as f:
                self.manifests[path] = json.load(f)["files"]
        return self.manifests[path]

    def op_loader(self, c):
        """A DataLoader over this reader's share: plain reads of c["root"] or FitCacheDataset."""
        self.op_drop(c)
        manifest = self.manifest(c["manifest"])
        names = [rel for rel, _, _ in manifest]
        self.sampler = PartSampler(len(names), self.seed, c["rank"], c["world"])
        if c["kind"] == "fitcache":
            self.ds = fitcache.FitCacheDataset(c["root"], files=names, **c["options"])
            ds = FitCacheCRC(self.ds)
        else:
            ds = PlainCRC(c["root"], names)
        self.check = Check(manifest)
        self.dl = loader(ds, self.sampler, self.args, c["workers"], persistent=c["persistent"],
                         batched=c.get("batched", False))
        return {}

    def op_epoch(self, c):
        self.sampler.set_epoch(c["epoch"])
        part = self.sampler.order(c["epoch"])
        bad = self.check.bad
        cpu0, t0 = tree_cpu(os.getpid()), time.monotonic()
        if c.get("prefetch") and self.ds is not None:
            # As a training script starts: this reader's share of the epoch handed to the
            # servers to read ahead (through the `fitcache` command: this process has not
            # loaded the library), on the clock.
            self.ds.prefetch(part)
        files, nbytes = self.check.epoch(self.dl, part=part)
        t1, cpu1 = time.monotonic(), tree_cpu(os.getpid())
        return {"start": t0, "end": t1, "files": files, "bytes": nbytes, "bad": self.check.bad - bad,
                "cpu": cpu1 - cpu0}

    def op_drop(self, c):
        """Ends the loader (persistent workers exit) and closes the dataset."""
        self.dl = None
        if self.ds is not None:
            self.ds.close()
        self.ds = None
        return {}

    def op_serve_link(self, c):
        srv = socket.create_server((c["host"], c["port"]), backlog=64)

        def accept():
            while True:
                conn, _ = srv.accept()
                threading.Thread(target=_link_serve, args=(conn, c["root"]), daemon=True).start()
        threading.Thread(target=accept, daemon=True).start()
        return {}

    def op_link(self, c):
        """Pulls each [host, port, names] at once (one connection each) and times it."""
        pulls = [p for p in c["pulls"] if p[2]]
        cpu0, t0 = tree_cpu(os.getpid()), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max(1, len(pulls))) as pool:
            nbytes = sum(pool.map(lambda p: _link_pull(*p), pulls))
        t1, cpu1 = time.monotonic(), tree_cpu(os.getpid())
        return {"start": t0, "end": t1, "bytes": nbytes, "files": sum(len(p[2]) for p in pulls), "cpu": cpu1 - cpu0}

    def op_rtt(self, c):
        with socket.create_connection((c["host"], c["port"]), timeout=30) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_request(s, {"echo": c["n"]})
            times = []
            for _ in range(c["n"]):
                t = time.perf_counter()
                s.sendall(b"x")
                _recv_exact(s, 1)
                times.append(time.perf_counter() - t)
        return {"rtt_us_median": statistics.median(times) * 1e6, "rtt_us_min": min(times) * 1e6}

    def serve(self):
        for line in sys.stdin:
            c = json.loads(line)
            if c["op"] == "exit":
                break
            try:
                out = getattr(self, "op_" + c["op"])(c)
            except Exception:
                out = {"error": traceback.format_exc()}
            print("REPLY " + json.dumps(out), flush=True)
        self.op_drop({})


class AgentProc:
    """The coordinator's end of an agent: started in a node's namespace (prefix), stopped by PID."""

    def __init__(self, name, prefix, work, args):
        self.name = name
        self.log = open(os.path.join(work, f"agent-{name}.log"), "a")
        cmd = [*prefix, sys.executable, os.path.abspath(__file__), "--agent", "--seed", str(args.seed),
               "--batch-size", str(args.batch_size)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.buf = b""

    def send(self, cmd):
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, idle=None, timeout=REPLY_TIMEOUT):
        """The next reply; idle() runs about every 0.1 s while waiting (to drain inotify)."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while (reply := self._reply_ready()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent {self.name}: no reply in {timeout} s")
            checkpoint()
            if select.select([fd], [], [], 0.1)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"agent {self.name} exited: see {self.log.name}")
                self.buf += chunk
            if idle is not None:
                idle()
        line, self.buf = reply
        out = json.loads(line[len(b"REPLY "):])
        if "error" in out:
            raise RuntimeError(f"agent {self.name}: {out['error']}")
        return out

    def _reply_ready(self):
        """(the first REPLY line, the rest) once one is complete; other lines are dropped."""
        while b"\n" in self.buf:
            line, rest = self.buf.split(b"\n", 1)
            if line.startswith(b"REPLY "):
                return line, rest
            self.buf = rest
        return None

    def stop(self):
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def call(agents, cmds, idle=None):
    """Sends each agent its command (all first, then waits for all), returns the replies."""
    for a, c in zip(agents, cmds):
        a.send(c)
    return [a.recv(idle) for a in agents]


# ---- the nodes ----

class Nodes:
    """A variant's nodes: the server hosts, the client node's host, and how to enter each."""

    def __init__(self, variant, k, args, work, cleanup):
        self.variant, self.netns, self.network = variant, None, {"variant": variant}
        if variant == "loopback":
            self.server_hosts = [f"127.0.0.{i + 2}" for i in range(k)]
            self.client_host = "127.0.0.1"
            return
        if not NetnsNodes.available():
            raise SystemExit("the netns variant needs root, iproute2 and network namespaces")
        self.netns = NetnsNodes(k + 1)  # the last one: the client node, without a server
        cleanup.append(self.netns.close)
        self.server_hosts, self.client_host = self.netns.addrs[:k], self.netns.addrs[k]
        program, why = delay_program(work) if args.delay_us else (None, "no delay asked")
        self.netns.shape(args.rate, args.delay_us if program else 0, program)
        self.network.update(rate=args.rate, delay_us=args.delay_us if program else 0,
                            delay="NFQUEUE (bench/netdelay), egress of each node" if program else why)
        if not program:
            log(f"netns: rate {args.rate} only, no delay: {why}")

    def prefix(self, host):
        if self.netns is None:
            return []
        return ["nsenter", f"--net=/run/netns/{self.netns.namespace_of(host)}"]

    def delay_cpu(self):
        return sum(tree_cpu(p) for p in self.netns.delay_pids) if self.netns else 0.0


def delay_program(work):
    """bench/netdelay, compiled into work, or (None, why)."""
    if shutil.which("iptables-legacy") is None:
        return None, "iptables-legacy missing (apt-get install iptables)"
    exe = os.path.join(work, "netdelay")
    out = subprocess.run(["gcc", "-O2", "-o", exe, str(NETDELAY), "-lnetfilter_queue", "-lnfnetlink"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None, "netdelay did not build (apt-get install libnetfilter-queue-dev): " + out.stderr[-300:]
    return exe, ""


# ---- the run ----

class Recorder:
    """Per configuration, one entry per round: seconds, files, bytes, CPU, source opens..."""

    def __init__(self):
        self.rows = {}

    def add(self, key, **row):
        self.rows.setdefault(key, []).append(row)
        checkpoint()

    def summary(self):
        out = {}
        for key, rounds in self.rows.items():
            secs = statistics.median(r["seconds"] for r in rounds)
            files, nbytes = rounds[0]["files"], rounds[0]["bytes"]
            s = {"seconds_median": secs, "files_per_s": files / secs, "MB_per_s": nbytes / secs / 1e6,
                 "files": files, "bytes": nbytes, "rounds": rounds}
            for cpu in ("server_cpu", "client_cpu"):
                if all(cpu in r for r in rounds):
                    s[cpu + "_us_per_file"] = statistics.median(r[cpu] / r["files"] * 1e6 for r in rounds)
            out[key] = s
        return out


def epochs(agents, epoch_list, servers, idle=None, prefetch=False):
    """Runs each epoch on every agent at once; per epoch: the job's seconds (first start to last
    end), files, bytes, crc mismatches, reader and server CPU seconds. With prefetch, each reader
    first hands its share to the servers (FitCacheDataset.prefetch)."""
    rows = []
    for e in epoch_list:
        s0 = {p: tree_cpu(p) for p in servers}
        replies = call(agents, [{"op": "epoch", "epoch": e, "prefetch": prefetch}] * len(agents), idle)
        s1 = {p: tree_cpu(p) for p in servers}
        rows.append({"epoch": e, "seconds": max(r["end"] for r in replies) - min(r["start"] for r in replies),
                     "files": sum(r["files"] for r in replies), "bytes": sum(r["bytes"] for r in replies),
                     "bad": sum(r["bad"] for r in replies), "client_cpu": sum(r["cpu"] for r in replies),
                     "server_cpu": sum(s1[p] - s0[p] for p in servers),
                     "per_reader_seconds": [r["end"] - r["start"] for r in replies]})
    return rows


def fold(rows):
    """One round's figure of several epochs: the median time, CPU over all of them."""
    files = sum(r["files"] for r in rows)
    return {"seconds": statistics.median(r["seconds"] for r in rows), "files": rows[0]["files"],
            "bytes": rows[0]["bytes"], "epochs": rows,
            "client_cpu": sum(r["client_cpu"] for r in rows) * rows[0]["files"] / files,
            "server_cpu": sum(r["server_cpu"] for r in rows) * rows[0]["files"] / files}


class Run:
    """One variant's measurements."""

    def __init__(self, args, work, cleanup, nodes, data):
        self.args, self.work, self.cleanup, self.nodes = args, work, cleanup, nodes
        self.k = len(nodes.server_hosts)
        self.rec = Recorder()
        self.bad = 0
        self.jobs = 0
        self.owners = None  # base name -> server host, from the first cluster's tiers
        self.shares = None  # files each server of that cluster held
        self.data = data
        self.agents = {}

    def agent(self, host):
        if host not in self.agents:
            a = AgentProc(host, self.nodes.prefix(host), self.work, self.args)
            self.cleanup.append(a.stop)
            self.agents[host] = a
        return self.agents[host]

    def readers(self, placement):
        """(agent, node option) for each reader of a placement."""
        if placement == "client":
            hosts = [self.nodes.client_host]
        elif placement == "server":
            hosts = self.nodes.server_hosts[:1]
        else:
            hosts = self.nodes.server_hosts
        return [self.agent(h) for h in hosts], hosts

    def load(self, agents, kind, root, persistent, options=None, manifest=None):
        call(agents, [{"op": "loader", "kind": kind, "root": root, "manifest": manifest or self.data["manifest_path"],
                       "options": opts, "persistent": persistent, "rank": r, "world": len(agents),
                       "workers": self.args.workers, "batched": self.args.batched}
                      for r, opts in enumerate(options or [None] * len(agents))])

    def drop(self, agents):
        call(agents, [{"op": "drop"}] * len(agents))

    def check(self, rows):
        self.bad += sum(r["bad"] for r in rows)
        return rows

    def warm_epochs(self):
        return list(range(1, self.args.epochs))

    def baselines(self, placement):
        agents, _ = self.readers(placement)
        d = self.data
        self.load(agents, "plain", d["src"], False)
        self.rec.add(f"{placement}/source/cold", **self.check(epochs(agents, [0], []))[0])
        self.load(agents, "plain", d["shm"], False)
        self.rec.add(f"{placement}/shm/fresh", **fold(self.check(epochs(agents, self.warm_epochs(), []))))
        self.load(agents, "plain", d["shm"], True)
        self.check(epochs(agents, [0], []))  # starts the workers
        self.rec.add(f"{placement}/shm/persistent", **fold(self.check(epochs(agents, self.warm_epochs(), []))))
        self.drop(agents)

    def budget_bytes(self, budget):
        fp = self.data["footprint"]
        return int(fp * 1.1) + (64 << 20) if budget == "fits" else int(fp / self.k * 1.1)

    def cluster(self, root, budget):
        self.jobs += 1
        tmp = Path(self.work) / f"{self.nodes.variant}-cluster-{self.jobs}"
        tmp.mkdir()
        # The servers know the job's list (`serve --servers`), as the README starts them: their
        # node sockets answer their node's readers for every file of the job.
        c = Cluster(tmp, root, nodes=self.nodes.server_hosts, netns=self.nodes.netns,
                    budget=f"{self.budget_bytes(budget) >> 20}MiB", serve_options={})
        self.cleanup.append(c.stop)
        return c, f"bench-cluster-{os.getpid()}-{self.jobs}"

    def fitcache(self, budget, placement):
        """Fresh servers: the cold epoch, warm epochs with fresh then persistent workers."""
        d = self.data
        cluster, job = self.cluster(d["src"], budget)
        servers = [p.pid for p in cluster.procs.values()]
        agents, hosts = self.readers(placement)
        options = [{**cluster.options(node=h), "job": job, "runtime_dir": os.path.join(self.work, "run"),
                    **self.args.dataset_options} for h in hosts]
        key = f"{placement}/{budget}"
        try:
            with OpenCounter(d["src"]) as opens:
                drain = opens.counts  # the inotify queue holds 16,384 events: drained while waiting
                self.load(agents, "fitcache", d["src"], False, options)
                cold = self.check(epochs(agents, [0], servers, drain, prefetch=True))[0]
                after_cold = opens.counts()
                self.rec.add(f"{key}/cold", **cold, source_opens=sum(after_cold.values()),
                             files_opened_twice=sum(1 for v in after_cold.values() if v > 1))
                if self.owners is None and budget == "fits":
                    self.owners = {name: a.split(":")[0] for a in cluster.addrs for name in cached_names(cluster, a)}
                    self.shares = {a: len(cached_names(cluster, a)) for a in cluster.addrs}
                warm = fold(self.check(epochs(agents, self.warm_epochs(), servers, drain)))
                after_warm = sum(opens.counts().values())
                self.load(agents, "fitcache", d["src"], True, options)
                self.check(epochs(agents, [0], servers, drain))  # starts the workers
                before_pers = sum(opens.counts().values())
                pers = fold(self.check(epochs(agents, self.warm_epochs(), servers, drain)))
                self.drop(agents)
                after_pers = sum(opens.counts().values())
            stats = server_stats(**cluster.options())
            extra = {"tier_files": sum(t["files"] for t in stats["tiers"]), "evictions": stats["evictions"],
                     "source_reads": stats["source_reads"]}
            self.rec.add(f"{key}/warm-fresh", **warm, **extra, source_opens=after_warm - sum(after_cold.values()))
            self.rec.add(f"{key}/warm-persistent", **pers, **extra, source_opens=after_pers - before_pers)
        finally:
            cluster.stop()
            self.cleanup.remove(cluster.stop)

    def link(self, placement):
        """The same remote bytes over plain TCP between the same nodes."""
        agents, hosts = self.readers(placement)
        names = [rel for rel, _, _ in self.data["manifest"]]
        cmds = []
        for r, host in enumerate(hosts):
            part = PartSampler(len(names), self.args.seed, r, len(hosts)).order(1)
            by_owner = {h: [] for h in self.nodes.server_hosts if h != host}
            for i in part:
                owner = self.owners.get(os.path.basename(names[i]))
                if owner is not None and owner != host:
                    by_owner[owner].append(names[i])
            cmds.append({"op": "link", "pulls": [[h, self.args.link_port, v] for h, v in by_owner.items()]})
        # The senders' CPU (where a node both sends and receives, all of it is in the reader's).
        senders = [self.agents[h].proc.pid for h in self.nodes.server_hosts if h not in hosts]
        s0 = {p: tree_cpu(p) for p in senders}
        replies = call(agents, cmds)
        s1 = {p: tree_cpu(p) for p in senders}
        files = sum(r["files"] for r in replies)
        self.rec.add(f"{placement}/tcp", seconds=max(r["end"] for r in replies) - min(r["start"] for r in replies),
                     files=files, bytes=sum(r["bytes"] for r in replies), client_cpu=sum(r["cpu"] for r in replies),
                     server_cpu=sum(s1[p] - s0[p] for p in senders))

    def network_round(self):
        """Round trip client node -> server 1 (1-byte TCP ping-pong) and one iperf3 stream."""
        client = self.agent(self.nodes.client_host)
        s1 = self.nodes.server_hosts[0]
        row = call([client], [{"op": "rtt", "host": s1, "port": self.args.link_port, "n": 500}])[0]
        row["loadavg"] = open("/proc/loadavg").read().split()[:3]  # the machine is shared: how busy
        if shutil.which("iperf3"):
            srv = subprocess.Popen([*self.nodes.prefix(s1), "iperf3", "-s", "-B", s1, "-p", str(self.args.link_port + 1)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                for _ in range(20):  # until it listens
                    time.sleep(0.2)
                    out = subprocess.run([*self.nodes.prefix(self.nodes.client_host), "iperf3", "-c", s1, "-B",
                                          self.nodes.client_host, "-p", str(self.args.link_port + 1), "-R", "-t", "3", "-J"],
                                         capture_output=True, text=True, timeout=60)
                    try:
                        bps = json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"]
                    except (ValueError, KeyError):
                        row["iperf3_error"] = out.stdout[-500:] + out.stderr[-500:]
                        continue
                    row["iperf3_gbit_s"] = bps / 1e9
                    row.pop("iperf3_error", None)
                    break
            finally:
                srv.kill()  # ours, by pid
                srv.wait(timeout=10)
        return row

    def bench(self):
        d, args = self.data, self.args
        for h in self.nodes.server_hosts:
            call([self.agent(h)], [{"op": "serve_link", "host": h, "port": self.args.link_port, "root": d["shm"]}])
        network = []
        delay0 = self.nodes.delay_cpu()
        for r in range(args.repeats):
            t = time.monotonic()
            network.append(self.network_round())
            for budget in BUDGETS:
                for placement in args.placements:
                    self.fitcache(budget, placement)
            for placement in args.placements:
                self.baselines(placement)
                self.link(placement)
            log(f"[{self.nodes.variant}] round {r + 1}/{args.repeats} in {time.monotonic() - t:.0f} s: "
                + ", ".join(f"{k} {v[-1]['seconds']:.2f}s" for k, v in self.rec.rows.items())
                + f"; crc mismatches so far {self.bad}")
        return {"network": {**self.nodes.network, "rounds": network,
                            "rtt_us_median": statistics.median(x["rtt_us_median"] for x in network),
                            **({"iperf3_gbit_s_median": statistics.median(x["iperf3_gbit_s"] for x in network)}
                               if all("iperf3_gbit_s" in x for x in network) else {}),
                            "delay_program_cpu_s": self.nodes.delay_cpu() - delay0},
                "files_per_server": self.shares, "share_budget_bytes": self.budget_bytes("share"),
                "fits_budget_bytes": self.budget_bytes("fits"),
                "configs": ratios(self.rec.summary()), "crc_mismatches": self.bad}

    def bench_pfs(self, p):
        """The first epoch over the PFS, every server node reading its share."""
        args = self.args
        agents, hosts = self.readers("all")
        watch = [p["src"]] + [brick_dir(b, p["src"]) for b in args.bricks.split(",") if b] if args.bricks else [p["src"]]
        names = [rel for rel, _, _ in p["manifest"]]
        by_name = {entry[0]: entry for entry in p["manifest"]}
        rec = Recorder()
        bad0 = self.bad

        def threads_epoch():
            order = [names[i] for i in EpochSampler(len(names), args.seed).order(0)]
            cpu = os.times()
            secs, nbytes, bad = read_with_threads(p["src"], [by_name[rel] for rel in order], args.pfs_threads)
            cpu1 = os.times()
            self.bad += bad
            return {"seconds": secs, "files": len(order), "bytes": nbytes,
                    "client_cpu": cpu1.user + cpu1.system - cpu.user - cpu.system}

        for r in range(args.repeats):
            for config in ("threads", "plain", "fitcache-cold"):
                if args.drop_caches:
                    drop_caches()
                cluster = None
                counters = [OpenCounter(w) for w in watch]
                try:
                    drain = lambda: [c.counts() for c in counters]  # noqa: E731
                    if config == "threads":
                        row = threads_epoch()
                    elif config == "plain":
                        self.load(agents, "plain", p["src"], False, manifest=p["manifest_path"])
                        row = self.check(epochs(agents, [0], [], drain))[0]
                    else:
                        cluster, job = self.cluster(p["src"], "fits")
                        options = [{**cluster.options(node=h), "job": job, "runtime_dir": os.path.join(self.work, "run")}
                                   for h in hosts]
                        self.load(agents, "fitcache", p["src"], False, options, manifest=p["manifest_path"])
                        row = self.check(epochs(agents, [0], [x.pid for x in cluster.procs.values()], drain,
                                                prefetch=True))[0]
                        self.drop(agents)
                    counts = [c.counts() for c in counters]
                finally:
                    for c in counters:
                        c.close()
                    if cluster is not None:
                        cluster.stop()
                        self.cleanup.remove(cluster.stop)
                row["source_opens"] = dict(zip(["mount"] + [f"brick{i}" for i in range(len(watch) - 1)],
                                               (sum(x.values()) for x in counts)))
                row["files_opened_twice"] = sum(1 for v in counts[0].values() if v > 1)
                rec.add(f"pfs/{config}", **row)
                log(f"[pfs] round {r + 1}/{args.repeats} {config}: {row['seconds']:.2f}s, opens {row['source_opens']}")
        res = rec.summary()
        for v in res.values():
            v["ratio_vs_threads"] = res["pfs/threads"]["seconds_median"] / v["seconds_median"]
            v["ratio_vs_plain"] = res["pfs/plain"]["seconds_median"] / v["seconds_median"]
        return {"variant": self.nodes.variant, "dataset": {"dir": p["src"], "files": len(names), "bytes": p["bytes"]},
                "configs": res, "drop_caches": args.drop_caches, "crc_mismatches": self.bad - bad0}

    def close(self):
        for a in self.agents.values():
            a.stop()
            self.cleanup.remove(a.stop)
        self.agents = {}


def ratios(res):
    """Each FitCache configuration against its baselines of the same placement and run."""
    for key, v in res.items():
        placement, what = key.split("/", 1)
        shm = res.get(f"{placement}/shm/persistent" if what.endswith("persistent") else f"{placement}/shm/fresh")
        tcp, source = res.get(f"{placement}/tcp"), res.get(f"{placement}/source/cold")
        if shm and what not in ("shm/fresh", "shm/persistent"):
            v["ratio_vs_shm"] = shm["seconds_median"] / v["seconds_median"]
        if tcp and what != "tcp" and not what.startswith(("shm", "source")):
            v["ratio_vs_link"] = tcp["seconds_median"] / v["seconds_median"]
        if source and what.endswith("cold") and what != "source/cold":
            v["ratio_vs_source"] = source["seconds_median"] / v["seconds_median"]
    return res


# ---- the dataset ----

def prepare(args, work, cleanup):
    src, manifest, made = generate(args.data, args.files, args.seed)
    names = [rel for rel, _, _ in manifest]
    total = sum(size for _, size, _ in manifest)
    log(f"dataset {src}: {len(names)} files, {total / 1e9:.2f} GB ({'generated' if made else 'reused'})")
    shm = f"/dev/shm/fitcache-cluster-{os.getpid()}-copy"
    cleanup.append(lambda: shutil.rmtree(shm, ignore_errors=True))
    copy_tree(src, shm, names)
    warm_page_cache(src, names)
    # What the dataset takes in a tier: data and record, each in 4 KiB blocks.
    footprint = sum(-(-size // 4096) * 4096 + 4096 for _, size, _ in manifest)
    return {"src": src, "shm": shm, "manifest": manifest, "bytes": total, "footprint": footprint,
            "manifest_path": os.path.join(os.path.dirname(src), "manifest.json"),
            "median_size": statistics.median(s for _, s, _ in manifest)}


def prepare_pfs(args):
    mount = os.path.abspath(args.pfs)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    if mount == "/":
        raise SystemExit(f"--pfs {args.pfs}: no file system mounted there; bring it up first "
                         f"(bench/README.md, \"A slow file system to read from\")")
    src, manifest, made = generate(args.pfs, args.pfs_files, args.seed)
    total = sum(size for _, size, _ in manifest)
    log(f"PFS dataset {src}: {len(manifest)} files, {total / 1e9:.2f} GB ({'generated' if made else 'reused'})")
    return {"src": src, "manifest": manifest, "bytes": total,
            "manifest_path": os.path.join(os.path.dirname(src), "manifest.json")}


# ---- output ----

LABELS = {"client": "1, client node (no server)", "server": "1, node of server 1", "all": "{k}, one per server node"}
ORDER = ["shm/fresh", "shm/persistent", "source/cold", "tcp", "fits/cold", "fits/warm-fresh", "fits/warm-persistent",
         "share/cold", "share/warm-fresh", "share/warm-persistent"]


def markdown(results, args):
    lines = []
    d = results["dataset"]
    lines += [f"{d['files']} files, {d['bytes'] / 1e9:.2f} GB, median {d['median_size'] / 1024:.0f} KiB; "
              f"{args.servers} servers; DataLoader with {args.workers} workers, batch {args.batch_size}"
              f"{' (batched: __getitems__)' if args.batched else ''}; "
              f"{args.epochs} epochs (1 cold + {args.epochs - 1} warm); medians over {args.repeats} rounds.", ""]
    for name, v in results["variants"].items():
        net = v["network"]
        desc = "loopback addresses, no shaping" if name == "loopback" else \
            f"network namespaces, {net.get('rate')} per link" + (
                f", {net['delay_us']} µs added to each packet a node sends" if net.get("delay_us") else f" ({net.get('delay')})")
        lines += [f"### {name}: {desc}", "",
                  f"Round trip client node to server 1 (TCP, 1 byte): median {net['rtt_us_median']:.0f} µs"
                  + (f"; iperf3, one stream server 1 to client node: {net['iperf3_gbit_s_median']:.2f} Gbit/s"
                     if "iperf3_gbit_s_median" in net else "")
                  + (f"; delay programs' CPU over the run: {net['delay_program_cpu_s']:.1f} s" if net.get("delay_us") else "")
                  + f"; crc mismatches: {v['crc_mismatches']}.", "",
                  "| readers | configuration | median s | files/s | MB/s | vs plain /dev/shm | vs link (TCP) | "
                  "CPU µs/file server + client | source opens |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for placement in args.placements:
            for what in ORDER:
                c = v["configs"].get(f"{placement}/{what}")
                if c is None:
                    continue
                cpu = ""
                if "client_cpu_us_per_file" in c:
                    cpu = f"{c.get('server_cpu_us_per_file', 0):.0f} + {c['client_cpu_us_per_file']:.0f}"
                opens = ""
                if "source_opens" in c["rounds"][0]:
                    opens = ", ".join(str(r["source_opens"]) for r in c["rounds"])
                shm = f"{c['ratio_vs_shm']:.2f}x" if "ratio_vs_shm" in c else ("1.00" if what.startswith("shm") else "")
                if "ratio_vs_source" in c:
                    shm += f" ({c['ratio_vs_source']:.2f}x source)"
                link = f"{c['ratio_vs_link']:.2f}x" if "ratio_vs_link" in c else ("1.00" if what == "tcp" else "")
                lines.append(f"| {LABELS[placement].format(k=args.servers)} | {what} | {c['seconds_median']:.3f} | "
                             f"{c['files_per_s']:.0f} | {c['MB_per_s']:.0f} | {shm} | {link} | {cpu} | {opens} |")
        lines.append("")
    p = results.get("pfs")
    if p:
        d = p["dataset"]
        lines += [f"### First epoch over {d['dir']} ({p['variant']} nodes): {d['files']} files, {d['bytes'] / 1e9:.2f} GB"
                  f"{', page cache dropped before each' if p['drop_caches'] else ''}; crc mismatches: {p['crc_mismatches']}", "",
                  "| configuration | readers | median s | files/s | MB/s | vs threads (the limit) | vs plain loader | "
                  "CPU µs/file server + client | source opens (per round) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        readers = {"pfs/threads": f"{args.pfs_threads} threads, one process",
                   "pfs/plain": f"{args.servers} nodes x {args.workers} workers",
                   "pfs/fitcache-cold": f"{args.servers} nodes x {args.workers} workers"}
        for k, c in p["configs"].items():
            cpu = f"{c.get('server_cpu_us_per_file', 0):.0f} + {c['client_cpu_us_per_file']:.0f}" \
                if "client_cpu_us_per_file" in c else ""
            lines.append(f"| {k} | {readers[k]} | {c['seconds_median']:.3f} | {c['files_per_s']:.0f} | {c['MB_per_s']:.0f} | "
                         f"{c['ratio_vs_threads']:.2f}x | {c['ratio_vs_plain']:.2f}x | {cpu} | "
                         + "; ".join(", ".join(f"{k2} {v2}" for k2, v2 in r["source_opens"].items()) for r in c["rounds"])
                         + " |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10000, help="files in the dataset")
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-scale", help="where generated datasets are kept")
    ap.add_argument("--seed", type=int, default=1, help="seed of the dataset and of the epochs' orders")
    ap.add_argument("--servers", type=int, default=4, help="servers, one per node")
    ap.add_argument("--variants", default="loopback,netns", help="loopback, netns or both")
    ap.add_argument("--placements", default=",".join(PLACEMENTS), help="readers: client, server, all")
    ap.add_argument("--rate", default="10gbit", help="netns: each link's rate (tc syntax)")
    ap.add_argument("--delay-us", type=int, default=100, help="netns: delay of each packet a node sends (0: none)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--link-port", type=int, default=LINK_PORT,
                    help="port of the plain-TCP senders on each node (iperf3 uses the next): runs at once need their own")
    ap.add_argument("--batched", action="store_true",
                    help="read each batch with one __getitems__ call (as PyTorch 2's DataLoader does), not item by item")
    ap.add_argument("--open-before-fork", choices=["default", "off"], default="default",
                    help="FitCacheDataset's open_before_fork: its default, or off (each fresh worker opens "
                         "a client of its own, as before the stand-in node socket)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per job: 1 cold, the rest warm (at least 2)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians over rounds")
    ap.add_argument("--out", help="JSON results (default bench/results/cluster-<date>.json)")
    ap.add_argument("--pfs", help="dataset directory on a mounted slow file system (bench/README.md)")
    ap.add_argument("--pfs-files", type=int, default=2000)
    ap.add_argument("--pfs-threads", type=int, default=16)
    ap.add_argument("--pfs-variant", help="nodes of the PFS section (default: netns if run, else loopback)")
    ap.add_argument("--bricks", help="brick directories (comma-separated) to count source opens on")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each PFS epoch (root)")
    ap.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.agent:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        return Agent(args.seed, args.batch_size).serve()
    if args.epochs < 2:
        ap.error("--epochs must be at least 2 (one cold, then warm)")
    args.dataset_options = {"open_before_fork": False} if args.open_before_fork == "off" else {}
    args.variants = [v for v in args.variants.split(",") if v]
    args.placements = [p for p in args.placements.split(",") if p]
    if set(args.variants) - {"loopback", "netns"} or set(args.placements) - set(PLACEMENTS):
        ap.error("unknown variant or placement")
    pfs_variant = args.pfs_variant or ("netns" if "netns" in args.variants else "loopback")
    out = args.out or str(HERE / "results" / f"cluster-{datetime.date.today()}.json")

    signal.signal(signal.SIGTERM, bench_scale._stop)
    work = f"/tmp/fitcache-cluster-{os.getpid()}"
    os.makedirs(work)
    cleanup = [lambda: shutil.rmtree(work, ignore_errors=True)]
    t0 = time.monotonic()
    results = {"machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname()),
                           "loadavg_start": open("/proc/loadavg").read().split()[:3]},
               "args": {k: v for k, v in vars(args).items() if k != "agent"}, "variants": {}}
    try:
        import torch
        results["torch"] = torch.__version__
        data = prepare(args, work, cleanup)
        pfs = prepare_pfs(args) if args.pfs else None
        results["dataset"] = {"dir": data["src"], "files": len(data["manifest"]), "bytes": data["bytes"],
                              "footprint": data["footprint"], "median_size": data["median_size"]}
        for variant in args.variants:
            t = time.monotonic()
            nodes = Nodes(variant, args.servers, args, work, cleanup)
            run = Run(args, work, cleanup, nodes, data)
            try:
                results["variants"][variant] = run.bench()
                if pfs and variant == pfs_variant:
                    results["pfs"] = run.bench_pfs(pfs)
            finally:
                run.close()
                if nodes.netns:
                    nodes.netns.close()
                    cleanup.remove(nodes.netns.close)
            results["variants"][variant]["seconds"] = time.monotonic() - t
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception as err:  # the rest of the cleanup still runs
                log(f"cleanup: {err}")
    results["machine"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    results["seconds"] = time.monotonic() - t0
    table = markdown(results, args)
    print(table)
    results["table"] = table
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    log(f"wrote {out} ({results['seconds']:.0f} s)")
    bad = sum(v["crc_mismatches"] for v in results["variants"].values()) + results.get("pfs", {}).get("crc_mismatches", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
