"""A batch read through the node's server in cluster mode (fc_read_many, what a DataLoader
worker's __getitems__ calls): four servers on loopback "nodes" (127.0.0.1-4), the reader on
the first one's node. The batch's misses go to the node's server in one request
(FC_NODE_OP_OPEN_MANY), which asks each owner on another node for its files in one ReadBatch
call; each file comes back with its bytes or its own error, read in C."""

import os

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
