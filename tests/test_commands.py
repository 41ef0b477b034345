"""The commands next to warmup and stats: `fitcache ls`, `fitcache clear` and `fitcache stop`,
run as users run them, with and without a running embedded server."""

import json
import os
import shutil
import subprocess

import fitcache
from conftest import server_pid


def fitcache_cli(cache_options, *args):
    env = {**os.environ, **{"FITCACHE_" + k.upper(): v for k, v in cache_options.items()}}
    return subprocess.run([fitcache._native.server_binary(), *args], capture_output=True, text=True,
                          timeout=120, env=env)


def ok(cache_options, *args):
    out = fitcache_cli(cache_options, *args)
    assert out.returncode == 0, f"fitcache {' '.join(args)}: {out.stderr}"
    return out


def ls(cache_options):
    return {(u["root"], u["tier"]): u for u in json.loads(ok(cache_options, "ls", "--json").stdout)["usage"]}


def tier_files(cache_options, kind="memory"):
    """The cached data files a tier directory holds, counted on disk."""
    spec = dict(t.split(":")[:2] for t in cache_options["tiers"].split(","))
    return sum(1 for _, _, names in os.walk(spec[kind]) for n in names if "-" in n and not n.startswith("."))


def two_datasets(tmp_path, dataset):
    """The dataset fixture as train, and a copy as val, both under one parent."""
    root, digests = dataset
    parent = tmp_path / "datasets"
    parent.mkdir()
    train, val = str(parent / "train"), str(parent / "val")
    shutil.copytree(root, train)
    shutil.copytree(root, val)
    return str(parent), train, val, len(digests)


def test_ls_and_clear_through_the_server(tmp_path, dataset, cache_options):
    parent, train, val, n = two_datasets(tmp_path, dataset)
    ok(cache_options, "warmup", "--quiet", train)
    ok(cache_options, "warmup", "--quiet", val)
    pid = server_pid(cache_options["runtime_dir"])
    usage = ls(cache_options)
    assert {k: u["files"] for k, u in usage.items()} == {(train, "memory"): n, (val, "memory"): n}
    assert all(u["bytes"] >= 4096 * u["files"] for u in usage.values())
    text = ok(cache_options, "ls").stdout
    assert f"server pid {pid}" in text and train in text and val in text

    dry = json.loads(ok(cache_options, "clear", "--dry-run", "--json", val).stdout)
    assert dry["dry_run"] and [(c["root"], c["files"]) for c in dry["cleared"]] == [(val, n)]
    assert ls(cache_options)[(val, "memory")]["files"] == n, "a dry run removed files"
    assert tier_files(cache_options) == 2 * n

    out = ok(cache_options, "clear", val).stdout
    assert out.startswith(f"removed {n} files"), out
    assert set(ls(cache_options)) == {(train, "memory")}
    assert tier_files(cache_options) == n, "the cleared files are still in the tier directory"
    stats = fitcache.server_stats(**cache_options)
    assert stats["tiers"][0]["files"] == n and stats["tiers"][0]["used_bytes"] == usage[(train, "memory")]["bytes"]

    # The server keeps serving: a cleared dataset is read from the source and cached again.
    ok(cache_options, "warmup", "--quiet", val)
    assert ls(cache_options)[(val, "memory")]["files"] == n
    assert server_pid(cache_options["runtime_dir"]) == pid

    # A parent directory clears the datasets under it; --all everything.
    assert ok(cache_options, "clear", parent).stdout.startswith(f"removed {2 * n} files")
    assert ls(cache_options) == {}
    ok(cache_options, "warmup", "--quiet", train)
    assert ok(cache_options, "clear", "--all").stdout.startswith(f"removed {n} files")
    assert tier_files(cache_options) == 0
    assert ok(cache_options, "clear", "--all").stdout.strip() == "nothing cached"


def test_stop_then_ls_and_clear_without_a_server(tmp_path, dataset, cache_options):
    cache_options["memory_at_exit"] = "keep"  # the copies outlive the server
    parent, train, val, n = two_datasets(tmp_path, dataset)
    ok(cache_options, "warmup", "--quiet", train)
    ok(cache_options, "warmup", "--quiet", val)
    pid = server_pid(cache_options["runtime_dir"])
    assert pid
    out = ok(cache_options, "stop").stdout
    assert out.startswith(f"stopped the embedded server (pid {pid})"), out
    assert not server_pid(cache_options["runtime_dir"])
    assert ok(cache_options, "stop").stdout.startswith("no embedded server runs")

    # Without a server: ls reads the records, a dry run changes nothing, clear opens the tiers.
    assert "no server runs" in ok(cache_options, "ls").stdout
    assert {k: u["files"] for k, u in ls(cache_options).items()} == {(train, "memory"): n, (val, "memory"): n}
    dry = json.loads(ok(cache_options, "clear", "--dry-run", "--json", train).stdout)
    assert [(c["root"], c["files"]) for c in dry["cleared"]] == [(train, n)]
    assert tier_files(cache_options) == 2 * n
    assert ok(cache_options, "clear", train).stdout.startswith(f"removed {n} files")
    assert tier_files(cache_options) == n
    assert not server_pid(cache_options["runtime_dir"]), "clear started a server"

    # A server starting afterwards finds the tier as clear left it, and serves the rest warm.
    with fitcache.Client(val, **cache_options) as c:
        for name in sorted(os.listdir(val))[:3]:
            if os.path.isfile(os.path.join(val, name)):
                c.read(name)
    stats = fitcache.server_stats(**cache_options)
    assert stats["tiers"][0]["files"] == n and stats["source_reads"] == 0
    assert set(ls(cache_options)) == {(val, "memory")}


def test_clear_usage_errors(cache_options):
    assert fitcache_cli(cache_options, "clear").returncode == 2, "neither DIR nor --all"
    assert fitcache_cli(cache_options, "clear", "--all", "/x").returncode == 2, "both DIR and --all"
    assert ok(cache_options, "clear", "/no/such/dataset").stdout.startswith("nothing cached for /no/such/dataset")


def test_stop_refuses_a_process_that_is_not_a_fitcache_server(cache_options):
    # A lock held by another program (the pid's command is not `... serve --embedded`).
    run = cache_options["runtime_dir"]
    os.makedirs(run, mode=0o700)
    holder = subprocess.Popen(["flock", os.path.join(run, "server.lock"), "sh", "-c",
                               f"echo $$ > {run}/server.lock.pid; sleep 30"])
    try:
        for _ in range(200):
            if os.path.exists(os.path.join(run, "server.lock.pid")):
                break
            subprocess.run(["sleep", "0.02"])
        with open(os.path.join(run, "server.lock"), "w") as f:
            f.write(f"{holder.pid}\n")
        out = fitcache_cli(cache_options, "stop")
        assert out.returncode == 1 and "not an embedded fitcache server" in out.stderr, out.stderr
        assert holder.poll() is None, "stop signalled a process that is not a fitcache server"
    finally:
        holder.kill()
        holder.wait()
