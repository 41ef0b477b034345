"""Prefetch through the dataset: the server reads the files ahead of the readers, each file
from the source once (opens counted with inotify, outside FitCache), and the reads that
follow are all hits."""

import os
import pickle
import random
import subprocess
import time

import pytest

import fitcache
from conftest import digest
from harness import NODES, Cluster, server_stats, wait_for
from inotify import OpenCounter


def wait_prefetch_idle(ds, timeout=60):
    """Waits until the server runs no prefetch job; returns its prefetch counters. The dataset
    hands its list over in a background thread when it opens its client: wait for it first."""
    if ds._handover is not None:
        ds._handover.join(timeout)
    deadline = time.monotonic() + timeout
    while True:
        stats = ds.stats()["server"]["prefetch"]
        if stats["jobs_active"] == 0:
            return stats
        assert time.monotonic() < deadline, f"prefetch still running after {timeout}s: {stats}"
        time.sleep(0.05)


def test_prefetch_then_every_read_hits(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    with OpenCounter(root) as opens:
        info = ds.prefetch(wait=True)
        assert not fitcache._native.loaded_here(), "prefetch loaded the Go runtime in this process"
        assert info["state"] == "done" and info["fetched"] == len(ds), info
        for i in range(len(ds)):
            assert digest(ds[i]) == digests[ds.files[i]]
        counts = opens.counts()
    assert set(counts) == set(digests), "every file read from the source"
    assert all(n == 1 for n in counts.values()), f"files read more than once: {counts}"
    stats = ds.stats()["server"]
    assert stats["misses"] == 0, stats
    assert stats["source_reads"] == len(ds)
    assert stats["prefetch"]["fetched"] == len(ds)
    ds.close()


def test_prefetch_in_sampler_order_reads_only_those_files(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    indices = random.Random(3).sample(range(len(ds)), len(ds) // 2)
    with OpenCounter(root) as opens:
        info = ds.prefetch(indices + indices[:3], wait=True)  # repeated indices are skipped
        counts = opens.counts()
    assert info["state"] == "done" and info["files"] == len(indices) + 3, info
    assert info["fetched"] == len(indices) and info["skipped_cached"] == 3, info
    assert set(counts) == {ds.files[i] for i in indices}
    assert all(n == 1 for n in counts.values())
    with pytest.raises(IndexError):
        ds.prefetch([len(ds)])
    assert ds.prefetch([]) is None


def test_prefetch_order_is_encoded_where_the_workers_fork(dataset, cache_options):
    """ds.prefetch(order), called in the process that forks the DataLoader's workers, encodes
    the list there, once: every fresh worker then hands it over with no work per path."""
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    order = random.Random(5).sample(range(len(ds)), len(ds))
    ds.prefetch(order, wait=True)
    assert not fitcache._native.loaded_here()
    encoded, this_epoch = ds._prefetch_encoded
    assert encoded.paths == [os.fsencode(ds.path(i)) for i in order] and this_epoch == 0
    assert pickle.loads(pickle.dumps(encoded)).paths == encoded.paths  # spawned workers
    with OpenCounter(root) as opens:
        assert digest(ds[order[0]]) == digests[ds.files[order[0]]]  # opens a client: hands it over
        stats = wait_prefetch_idle(ds)
        assert stats["jobs"] == 1, "the reader's list did not join the one handed over first"
        assert not opens.counts(), "files read again from the source"
    with pytest.raises(PermissionError):
        ds._get_client().prefetch(fitcache._native.PathList(["/etc/passwd"]))
    ds.close()


def test_dataset_hands_its_list_over_at_first_read(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, **cache_options)
    with OpenCounter(root) as opens:
        assert digest(ds[0]) == digests[ds.files[0]]  # opens the client, which hands the list over
        stats = wait_prefetch_idle(ds)
        assert stats["jobs"] == 1 and stats["fetched"] + stats["skipped_inflight"] + stats["skipped_cached"] == len(ds)
        for i in range(len(ds)):
            assert digest(ds[i]) == digests[ds.files[i]]
        counts = opens.counts()
    assert all(n == 1 for n in counts.values()) and set(counts) == set(digests), counts
    server = ds.stats()["server"]
    assert server["source_reads"] == len(ds) and server["misses"] <= 1, server
    ds.close()


def test_prefetch_off(dataset, cache_options):
    root, digests = dataset
    ds = fitcache.FitCacheDataset(root, prefetch=False, **cache_options)
    assert digest(ds[1]) == digests[ds.files[1]]
    assert ds.stats()["server"]["prefetch"]["jobs"] == 0
    ds.close()
    off = fitcache.FitCacheDataset(root, prefetch=0, **cache_options)  # also the server's option
    assert off.options["prefetch"] == 0


def test_warmup_is_a_prefetch_job(dataset, cache_options):
    root, digests = dataset
    env = {**os.environ, **{"FITCACHE_" + k.upper(): v for k, v in cache_options.items()}}
    with OpenCounter(root) as opens:
        out = subprocess.run([fitcache._native.server_binary(), "warmup", root], env=env, capture_output=True,
                             text=True, timeout=120)
        counts = opens.counts()
    assert out.returncode == 0, out.stderr
    assert f"{len(digests)}/{len(digests)} files" in out.stderr and "done:" in out.stderr, out.stderr
    assert set(counts) == set(digests) and all(n == 1 for n in counts.values()), counts
    stats = fitcache.server_stats(**cache_options)
    assert stats["prefetch"]["fetched"] == len(digests) and stats["source_reads"] == len(digests), stats


def test_cluster_servers_prefetch_the_files_they_own(dataset, tmp_path):
    root, digests = dataset
    cluster = Cluster(tmp_path, root, nodes=NODES[:3])
    try:
        with fitcache.Client(root, **cluster.options()) as client, OpenCounter(root) as opens:
            client.prefetch(sorted(digests))
            wait_for(lambda: all(s["prefetch"]["jobs_active"] == 0 for s in server_stats(client).values())
                     and sum(s["prefetch"]["fetched"] for s in server_stats(client).values()) == len(digests))
            for name in sorted(digests):
                assert digest(client.read(name)) == digests[name]
            counts = opens.counts()
            stats = server_stats(client)
        assert set(counts) == set(digests) and all(n == 1 for n in counts.values()), counts
        for addr, s in stats.items():
            # Each server read what it owns, from its own list: nothing was a miss.
            assert s["prefetch"]["fetched"] == s["source_reads"] and s["misses"] == 0, (addr, s)
        assert sum(1 for s in stats.values() if s["prefetch"]["fetched"] > 0) >= 2, stats
    finally:
        cluster.stop()
