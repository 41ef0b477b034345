"""A batch read through the node's server in cluster mode (fc_read_many, what a DataLoader
worker's __getitems__ calls): four servers on loopback "nodes" (127.0.0.1-4), the reader on
the first one's node. The batch's misses go to the node's server in one request
(FC_NODE_OP_OPEN_MANY), which asks each owner on another node for its files in one ReadBatch
call; each file comes back with its bytes or its own error, read in C."""

import array
import os
import socket
import struct
import threading

import pytest

import fitcache
from conftest import digest
from harness import Cluster, cached_names


@pytest.mark.parametrize("budget", ["256MiB", "1MiB"])
def test_a_batch_across_servers_comes_with_each_files_bytes(request, dataset, tmp_path, budget):
    """With room on the node for node-local copies (256MiB) and without (1MiB: the other
    nodes' files come as memory files). A missing file fails alone, with FileNotFoundError."""
    root, digests = dataset
    c = Cluster(tmp_path, root, budget=budget, serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    request.addfinalizer(c.stop)
    names = sorted(digests)
    batch = names[:5] + ["class0/missing.bin"] + names[5:]
    with fitcache.Client(root, **c.options()) as client:
        for _ in range(2):  # the second time, the node's copies serve what the first kept
            results = client.read_each(batch)
            assert isinstance(results[5], FileNotFoundError), results[5]
            views = results[:5] + results[6:]
            bad = [n for n, v in zip(names, views) if isinstance(v, Exception) or digest(v) != digests[n]]
            assert not bad, f"{len(bad)} of {len(names)} files of the batch without their bytes: {bad[:5]}"
            through_go = [n for n, v in zip(names, views) if v.nbytes and v.obj._fitcache_owner._id < 1 << 62]
            assert not through_go, f"{len(through_go)} of {len(names)} files of the batch were read through Go"
            del views, results
    # Each server cached the files it owns (the others' owners read them from the source for
    # this batch): the batch spanned the job's servers.
    owners = [a for a in c.addrs if {os.path.basename(n) for n in names} & cached_names(c, a)]
    assert len(owners) >= 3, f"the batch's files are cached on {owners} only: the test proves nothing"


def test_a_cluster_client_says_so_also_in_a_forked_reader(request, dataset, tmp_path):
    """fc_cluster answers in C: a DataLoader worker forked after load learns that its client
    reads in cluster mode, and FitCacheDataset's __getitems__ then transforms its batches in
    the chunks that suit a request to the node's server per chunk."""
    import fitcache.dataset as dataset_module

    root, _ = dataset
    c = Cluster(tmp_path, root, serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    request.addfinalizer(c.stop)
    ds = fitcache.FitCacheDataset(root, transform=len, **c.options())
    assert ds._get_client().cluster
    assert ds._transform_chunk() == dataset_module._CLUSTER_TRANSFORM_CHUNK
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover -- the child reports through the pipe
        try:
            os.write(w, b"%d %d" % (ds._get_client().cluster, ds._transform_chunk()))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read()
    os.waitpid(pid, 0)
    assert answer == b"1 %d" % dataset_module._CLUSTER_TRANSFORM_CHUNK
    ds.close()


class OlderNodeServer:
    """A node socket in front of a server's, as a server older than FC_NODE_OP_OPEN_MANY
    answers it: it closes the connection at that request's header, unacknowledged ("unknown
    operation"); every other request it passes on, with the acks, the reply and its
    descriptor. It counts the batch requests it refused and the opens it passed on."""

    def __init__(self, real, path):
        self.real, self.batches, self.opens = real, 0, 0
        self.ln = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ln.bind(path)
        self.ln.listen(64)
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                conn, _ = self.ln.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn):
        up = None
        try:
            while True:
                head = recv_exact(conn, 16)
                if head is None:
                    return
                op, root_len, path_len = struct.unpack("<III", head[4:])
                if op == 6:
                    self.batches += 1
                    return
                body = recv_exact(conn, root_len + path_len)
                if up is None:
                    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    up.connect(self.real)
                up.sendall(head + body)
                self.opens += op == 2
                if not self.relay(up, conn, op):
                    return
        finally:
            conn.close()
            if up is not None:
                up.close()

    @staticmethod
    def relay(up, conn, op):
        """Passes the acks of one request on, each alone, then its reply with its descriptor."""
        buf, fds = b"", []
        while True:
            data, anc, _, _ = up.recvmsg(4096, socket.CMSG_SPACE(4 * struct.calcsize("i")))
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", cdata[:len(cdata) - len(cdata) % 4])
            if not data:
                return False
            buf += data
            while buf[:4] == b"FCA3":
                conn.sendall(b"FCA3")
                buf = buf[4:]
            fixed = 16 if op == 2 else 12
            if len(buf) >= fixed and buf[:4] == b"FCN3":
                need = fixed + struct.unpack("<I", buf[fixed - 4:fixed])[0]
                if len(buf) >= need:
                    socket.send_fds(conn, [buf[:need]], fds) if fds else conn.sendall(buf[:need])
                    for fd in fds:
                        os.close(fd)
                    return True


def recv_exact(s, n):
    b = b""
    while len(b) < n:
        chunk = s.recv(n - len(b))
        if not chunk:
            return None
        b += chunk
    return b


def test_a_server_older_than_batches_is_asked_for_each_file(request, dataset, tmp_path):
    """The node's server closes a batch request unacknowledged, as one older than batches
    does: the reader asks it for each file alone (FC_NODE_OP_OPEN), gets every file's bytes
    in C, and sends no batch again for a while (single reads neither)."""
    root, digests = dataset
    c = Cluster(tmp_path, root, serve_options={"rpc_timeout": "2", "wait_timeout": "5"})
    request.addfinalizer(c.stop)
    host = c.addrs[0].replace(":", "_")
    [sock] = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "run") for f in files
              if f.endswith(".node") and host in f]
    os.rename(sock, sock + ".real")
    older = OlderNodeServer(sock + ".real", sock)
    request.addfinalizer(older.ln.close)
    names = sorted(digests)
    with fitcache.Client(root, **c.options()) as client:
        for _ in range(2):
            views = client.read_each(names[:20] + ["class0/missing.bin"])
            assert isinstance(views[-1], FileNotFoundError), views[-1]
            views = views[:-1]
            bad = [n for n, v in zip(names, views) if isinstance(v, Exception) or digest(v) != digests[n]]
            assert not bad, f"{len(bad)} files without their bytes: {bad[:5]}"
            through_go = [n for n, v in zip(names, views) if v.nbytes and v.obj._fitcache_owner._id < 1 << 62]
            assert not through_go, f"{len(through_go)} files were read through Go"
            del views
        for name in names[20:24]:  # single reads ask as batches of one (inline bytes), or alone
            assert digest(client.read(name)) == digests[name]
    assert older.batches == 1, f"{older.batches} batch requests, want 1 (then each file alone for a while)"
    assert older.opens >= 24, f"{older.opens} files asked for alone, want each of the 24 and the missing one"
