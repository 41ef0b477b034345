"""Transparent mode: unmodified programs (cat, md5sum, dd, sh, Python with PyTorch,
torchvision, NumPy, h5py, lmdb, a small C program) run under `fitcache run` with the preload
shim. Every byte they read is compared with the source, and the source's opens are counted
from outside with inotify: over 3 epochs each file is read from the source once. Programs
that work without the shim must work the same with it: missing files, directories, FIFOs,
write-opens, a dead or stopped server."""

import errno
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import fitcache
from conftest import server_pid, wait_published
from inotify import OpenCounter

PYTHON = sys.executable  # the project's .venv python: it sees the Debian torch, h5py, lmdb...
# The `fitcache` command users run, and the program it execs. Most runs here call the program
# directly: the command imports the Python package (and torch with it), about 1 s per run.
FITCACHE = os.path.join(os.path.dirname(sys.executable), "fitcache")
FITCACHE_BIN = fitcache._native.server_binary()
EPOCHS = 3
# The origins of a copy in a tier, as the shim's debug lines name them (core.Origin's names).
TIER_ORIGINS = (b"memory", b"pmem", b"nvme", b"disk")


# --- helpers ------------------------------------------------------------------------------


def need(module):
    """Skips the test when a Python module the program under test needs is missing (checked
    without importing it here: torch alone takes seconds to import)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def command_env(cache_options, **extra):
    """Our environment with the private cache's options as FITCACHE_* and nothing inherited
    that could change what the shim does (a preload or FITCACHE_* of the caller)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("FITCACHE_")}
    env.update({"FITCACHE_" + k.upper(): str(v) for k, v in cache_options.items()})
    env.update(extra)
    return env


def fitcache_run(cache_options, data, cmd, *, prefetch=None, timeout=90, env=None, command=FITCACHE_BIN, flags=(),
                 **kwargs):
    """Runs cmd under `fitcache run --data D... [flags]`; returns the CompletedProcess."""
    args = [command, "run"]
    for d in data:
        args += ["--data", d]
    if prefetch is not None:
        args += ["--prefetch", str(prefetch)]
    args += list(flags)
    return subprocess.run(args + ["--", *cmd], env=env or command_env(cache_options), capture_output=True,
                          timeout=timeout, **kwargs)


def describe(out):
    """A failed run, for assertion messages."""
    err = out.stderr.decode(errors="replace") if isinstance(out.stderr, bytes) else out.stderr
    std = out.stdout.decode(errors="replace") if isinstance(out.stdout, bytes) else out.stdout
    return f"exit {out.returncode}\nstdout: {std[-2000:]}\nstderr: {err[-3000:]}"


def tier_dirs(cache_options):
    """The tier directories of the private cache, as /proc/self/fd links name them."""
    return [os.path.realpath(spec.split(":")[1]) for spec in cache_options["tiers"].split(",")]


def in_tier(path, tiers):
    return any(path.startswith(t + os.sep) for t in tiers)


def sha(data):
    return hashlib.sha256(data).hexdigest()


def files_under(root):
    """Absolute paths of the regular files under root, sorted."""
    return sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)


def read_all(root):
    """{absolute path: bytes} of the files under root, read by the test without the shim."""
    out = {}
    for p in files_under(root):
        with open(p, "rb") as f:
            out[p] = f.read()
    return out


def some(items, n=4):
    """A few of many items, for assertion messages that stay readable."""
    items = sorted(items.items()) if isinstance(items, dict) else sorted(items)
    return f"{len(items)}: {items[:n]}{' ...' if len(items) > n else ''}"


def assert_each_opened_once(counts, expected):
    """expected: relative paths that the source must have seen opened exactly once each."""
    assert set(counts) == set(expected), (f"files opened at the source: missing {some(set(expected) - set(counts))}, "
                                          f"unexpected {some(set(counts) - set(expected))}")
    again = {k: n for k, n in counts.items() if n != 1}
    assert not again, f"files opened more than once at the source (opens per file) {some(again)}"


# Shared by the scripts the tests run under `fitcache run`: the arguments come as one JSON
# argument, the result goes out as one JSON line on standard output.
PRELUDE = r'''
import hashlib, json, os, subprocess, sys, time

ARGS = json.loads(sys.argv[1])
TIERS = ARGS.get("tiers", [])


def sha(data):
    return hashlib.sha256(data).hexdigest()


def fd_path(fd):
    return os.readlink(f"/proc/self/fd/{fd}")


def in_tier(path):
    return any(path.startswith(t + os.sep) for t in TIERS)


def wait_published(count, timeout=30):
    """Waits until the server has published count files. Asked through the fitcache command
    without the shim in its environment (the command is not what is under test here)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("FITCACHE_PRELOAD_")}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run([ARGS["fitcache"], "stats", "--json"], env=env, capture_output=True, text=True,
                             timeout=30)
        if out.returncode == 0 and json.loads(out.stdout)["published"] >= count:
            return
        time.sleep(0.05)
    sys.exit(f"the server did not publish {count} files within {timeout}s")


def done(result):
    print(json.dumps(result), flush=True)
'''


def write_script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(PRELUDE + body)
    return str(path)


def run_script(cache_options, data, script, args, **kwargs):
    """Runs a script written by write_script under `fitcache run`; returns its JSON result."""
    args = {"fitcache": FITCACHE_BIN, "tiers": tier_dirs(cache_options), **args}
    out = fitcache_run(cache_options, data, [PYTHON, script, json.dumps(args)], **kwargs)
    assert out.returncode == 0, describe(out)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def compile_program(tmp_path, name, source, symbols=(), flags=()):
    """Compiles a C program (skipping the test without a compiler) and checks that it calls
    each of symbols through the dynamic linker, where the shim can interpose it; returns its
    path."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src, exe = tmp_path / f"{name}.c", tmp_path / name
    src.write_text(source)
    build = subprocess.run([cc, "-O2", *flags, "-o", str(exe), str(src)], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    nm = subprocess.run(["nm", "-D", str(exe)], capture_output=True, text=True, timeout=30).stdout
    imported = {line.split()[-1].split("@")[0] for line in nm.splitlines() if line.strip()}
    for symbol in symbols:
        assert symbol in imported, f"the test program does not call {symbol}: the test would not cover it"
    return str(exe)


# --- the command and the library ----------------------------------------------------------


def test_preload_path_names_the_shim_and_alone_it_changes_nothing(dataset, cache_options, tmp_path):
    root, digests = dataset
    out = subprocess.run([FITCACHE, "preload-path"], env=command_env(cache_options), capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, describe(out)
    lib = out.stdout.strip()
    assert os.path.isabs(lib) and os.path.isfile(lib) and os.path.basename(lib) == "libfitcache_preload.so", lib

    # Preloaded without the FITCACHE_PRELOAD_* variables that `fitcache run` sets, the shim
    # has no dataset to redirect: programs read their files as they would without it, and no
    # server is started behind their back.
    env = command_env(cache_options, LD_PRELOAD=lib)
    names = sorted(digests)[:5]
    paths = [os.path.join(root, n) for n in names]
    cat = subprocess.run(["cat", *paths], env=env, capture_output=True, timeout=30)
    assert cat.returncode == 0 and cat.stderr == b"", describe(cat)
    data = read_all(root)
    assert cat.stdout == b"".join(data[p] for p in paths)
    probe = subprocess.run([PYTHON, "-c", "import os, sys; f = open(sys.argv[1], 'rb'); "
                            "print(os.readlink(f'/proc/self/fd/{f.fileno()}'))", paths[0]],
                           env=env, capture_output=True, text=True, timeout=30)
    assert probe.returncode == 0, describe(probe)
    assert probe.stdout.strip() == os.path.realpath(paths[0]), "the shim redirected an open without `fitcache run`"
    assert server_pid(cache_options["runtime_dir"]) == 0, "the shim alone started a server"


def test_run_passes_arguments_input_and_exit_status_through(dataset, cache_options, tmp_path):
    root, _ = dataset
    # Arguments after `--` belong to the command, even ones that look like fitcache's flags;
    # through the `fitcache` command users run, as well as its program.
    for command in (FITCACHE, FITCACHE_BIN):
        out = fitcache_run(cache_options, [root], ["printf", "%s|", "a b", "", "--data", "--prefetch"],
                           command=command)
        assert out.returncode == 0, describe(out)
        assert out.stdout == b"a b||--data|--prefetch|"
    out = fitcache_run(cache_options, [root], ["cat"], input=b"through standard input\n")
    assert out.stdout == b"through standard input\n", describe(out)
    out = fitcache_run(cache_options, [root], ["sh", "-c", "exit 7"])
    assert out.returncode == 7, describe(out)
    out = fitcache_run(cache_options, [root], ["sh", "-c", 'kill -TERM $$'])
    assert out.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), describe(out)  # CMD's own death
    out = fitcache_run(cache_options, [root], [str(tmp_path / "no-such-program")])
    assert out.returncode != 0, describe(out)
    # The command sees the shim in LD_PRELOAD (the path preload-path prints).
    lib = subprocess.run([FITCACHE_BIN, "preload-path"], env=command_env(cache_options), capture_output=True, text=True,
                         timeout=30).stdout.strip()
    out = fitcache_run(cache_options, [root], [PYTHON, "-c", "import os; print(os.environ.get('LD_PRELOAD', ''))"])
    assert out.returncode == 0, describe(out)
    assert lib in out.stdout.decode().replace(":", " ").split(), describe(out)


def test_run_leaves_the_command_no_child_it_did_not_start(dataset, cache_options):
    # `fitcache run` starts the server and then becomes the command (exec). A server left as
    # the command's child would be reaped by a program that waits for any child (a shell
    # script's launcher, `while (wait(NULL) > 0)`), or make it wait until the server exits.
    root, _ = dataset
    out = fitcache_run(cache_options, [root], [PYTHON, "-c", "import os\ntry:\n    print(os.waitpid(-1, os.WNOHANG))\n"
                                               "except ChildProcessError:\n    print('no child')"])
    assert out.returncode == 0, describe(out)
    assert server_pid(cache_options["runtime_dir"]), "fitcache run started no server"
    assert out.stdout.decode().strip() == "no child", f"the command has a child it never started: {describe(out)}"


def test_prefetch_is_on_by_default(dataset, cache_options):
    root, digests = dataset
    with OpenCounter(root) as opens:
        out = fitcache_run(cache_options, [root], ["true"])
        assert out.returncode == 0, describe(out)
        # Nobody reads: only the prefetch job can open the sources, each once.
        deadline = time.monotonic() + 30
        while set(opens.counts()) != set(digests) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # an open more than once would show by now
        counts = opens.counts()
    assert_each_opened_once(counts, digests)
    stats = fitcache.server_stats(**cache_options)
    assert stats["prefetch"]["fetched"] == len(digests), stats["prefetch"]


def test_prefetch_zero_turns_it_off(dataset, cache_options):
    root, digests = dataset
    with OpenCounter(root) as opens:
        out = fitcache_run(cache_options, [root], ["sleep", "0.5"], prefetch=0)
        assert out.returncode == 0, describe(out)
        counts = opens.counts()
    assert not counts, f"sources opened with --prefetch 0 and no reader: {some(counts)}"
    stats = fitcache.server_stats(**cache_options)
    assert stats is not None and stats["prefetch"]["jobs"] == 0, stats


def test_prefetch_patterns_choose_the_files_prefetched(dataset, cache_options):
    """--prefetch-only and --prefetch-exclude keep files the program never reads (a
    CosmoFlow-like set's index files, a split) out of the prefetch: only the files they take
    are read from the source; the others are still served when read."""
    root, digests = dataset
    for d in ("class0", "class1", "class2"):
        with open(os.path.join(root, d, "index.idx"), "wb") as f:
            f.write(b"an index the program never reads\n")
    want = {rel for rel in digests if not rel.startswith("class2/")}
    with OpenCounter(root) as opens:
        out = fitcache_run(cache_options, [root], ["true"],
                           flags=["--prefetch-only", "*.bin", "--prefetch-exclude", "class2/*"])
        assert out.returncode == 0, describe(out)
        deadline = time.monotonic() + 30
        while set(opens.counts()) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a file the patterns leave out would be opened by now
        counts = opens.counts()
    assert set(counts) == want, f"prefetched {sorted(set(counts) - want)}, missed {sorted(want - set(counts))}"
    stats = fitcache.server_stats(**cache_options)
    assert stats["prefetch"]["fetched"] == len(want), stats["prefetch"]
    out = fitcache_run(cache_options, [root], ["true"], flags=["--prefetch-exclude", "[a-"])
    assert out.returncode != 0 and b"[a-" in out.stderr, describe(out)


def test_debug_lines_name_the_origin(dataset, cache_options):
    """Under FITCACHE_PRELOAD_DEBUG the shim says where the server's answer came from by the
    name the metrics and `fitcache stats` use ("origin memory"), not by a number."""
    root, digests = dataset
    paths = [os.path.join(root, rel) for rel in sorted(digests)]
    out = fitcache_run(cache_options, [root], ["cat", *paths], prefetch=0,
                       env=command_env(cache_options, FITCACHE_PRELOAD_DEBUG="1"))
    assert out.returncode == 0, describe(out)
    origins = re.findall(rb"the server answered: fd \d+, origin (\S+)$", out.stderr, re.M)
    assert origins, describe(out)
    names = set(TIER_ORIGINS) | {b"none", b"inflight", b"source", b"peer", b"source-while-cached"}
    assert set(origins) <= names, f"origins {sorted(set(origins) - names)}\n{describe(out)}"


# --- command-line tools -------------------------------------------------------------------

# tool: (command for the files, expected output from their bytes). md5sum reads through
# fopen, cat and dd through open (dd seeks past the first 1000 bytes), sh opens the file
# itself for the `<` redirection and hands the descriptor to cat, tar opens with O_NOFOLLOW.
TOOLS = {
    "cat": (lambda paths: ["cat", *paths],
            lambda data, paths: b"".join(data[p] for p in paths)),
    "md5sum": (lambda paths: ["md5sum", *paths],
               lambda data, paths: "".join(f"{hashlib.md5(data[p]).hexdigest()}  {p}\n" for p in paths).encode()),
    "dd": (lambda paths: ["sh", "-c", 'for f in "$@"; do dd if="$f" bs=1000 skip=1 status=none || exit 1; done',
                          "sh", *paths],
           lambda data, paths: b"".join(data[p][1000:] for p in paths)),
    "sh-redirect": (lambda paths: ["sh", "-c", 'for f in "$@"; do cat < "$f" || exit 1; done', "sh", *paths],
                    lambda data, paths: b"".join(data[p] for p in paths)),
    # GNU tar opens every file with O_NOFOLLOW; the archive must be the one tar makes without
    # FitCache (and tar must not find a file "changed as we read it").
    "tar": (lambda paths: ["tar", "cf", "-", "-P", *paths],
            lambda data, paths: subprocess.run(["tar", "cf", "-", "-P", *paths], check=True,
                                               capture_output=True).stdout),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_tools_read_the_right_bytes_and_the_source_once(dataset, cache_options, tool):
    root, digests = dataset
    data = read_all(root)
    paths = sorted(data)
    command, expected = TOOLS[tool]
    want = expected(data, paths)
    with OpenCounter(root) as opens:
        for epoch in range(EPOCHS):
            out = fitcache_run(cache_options, [root], command(paths))
            assert out.returncode == 0, describe(out)
            assert out.stdout == want, f"epoch {epoch + 1}: {tool} output differs from the source's bytes"
        counts = opens.counts()
    assert_each_opened_once(counts, digests)
    # The shim's hits are counted where the server sees them (the tiers' index): epochs 2
    # and 3 at least were hits.
    stats = fitcache.server_stats(**cache_options)
    assert sum(stats["hits"].values()) >= (EPOCHS - 1) * len(paths), stats["hits"]
    # A descriptor handed to the program is no byte served: the program reads it (dd skips
    # the first 1000 bytes of each file). Counting file sizes made "served" 25 TiB where DLIO
    # read 71 GiB.
    assert stats["bytes_served"] < sum(len(d) for d in data.values()), stats["bytes_served"]


def test_several_data_dirs_relative_and_with_a_trailing_slash(dataset, cache_options, tmp_path):
    root, digests = dataset
    other = tmp_path / "other"
    (other / "deep" / "er").mkdir(parents=True)
    for i in range(5):
        (other / "deep" / "er" / f"f{i}.dat").write_bytes(os.urandom(1000 * i + 17))
    data = {**read_all(root), **read_all(str(other))}
    paths = sorted(data)
    # The second directory is given relative to the working directory, with a trailing slash.
    with OpenCounter(root) as opens, OpenCounter(str(other)) as opens_other:
        for epoch in range(EPOCHS):
            out = fitcache_run(cache_options, [root, "other/"], ["cat", *paths], cwd=tmp_path)
            assert out.returncode == 0, describe(out)
            assert out.stdout == b"".join(data[p] for p in paths), f"epoch {epoch + 1}"
        counts, counts_other = opens.counts(), opens_other.counts()
    assert_each_opened_once(counts, digests)
    assert_each_opened_once(counts_other, [os.path.relpath(p, other) for p in files_under(str(other))])


# --- Python programs ----------------------------------------------------------------------

LOADER = r'''
import torch
from torch.utils.data import DataLoader, Dataset


class Files(Dataset):
    """A plain dataset over the files of a directory, read with open().read()."""

    def __init__(self, root):
        self.root = root
        self.paths = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            where = fd_path(f.fileno())
            data = f.read()
        return os.path.relpath(self.paths[i], self.root), sha(data), where, os.getpid()


if __name__ == "__main__":
    ds = Files(ARGS["root"])
    # A read in the main process before the workers start: forked workers inherit whatever
    # state the shim set up for it (a connection to the server, with --prefetch 0).
    first = ds[0]
    kw = {}
    if ARGS["workers"]:
        kw = dict(num_workers=ARGS["workers"], multiprocessing_context=ARGS["context"],
                  persistent_workers=ARGS["context"] == "spawn")  # spawned workers start slowly
    loader = DataLoader(ds, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(0), **kw)
    epochs = []
    for epoch in range(3):
        if epoch == 1:
            # A miss may be answered before its copy is published: from the second epoch
            # on every file is in a tier.
            wait_published(len(ds))
        epochs.append({rel: [digest, where, pid] for rel, digest, where, pid in loader})
    done({"main_pid": os.getpid(), "first": list(first), "epochs": epochs})
'''


# Forked workers run with prefetch off, so that every read of the first epoch, the main
# process's included, is a miss that goes to the server from a process that forked.
@pytest.mark.parametrize("workers,context,prefetch", [(0, None, None), (2, "fork", 0), (2, "spawn", None)],
                         ids=["main-process", "fork", "spawn"])
def test_dataloader_reads_through_the_cache(dataset, cache_options, tmp_path, workers, context, prefetch):
    need("torch")
    root, digests = dataset
    tiers = tier_dirs(cache_options)
    script = write_script(tmp_path, "loader.py", LOADER)
    with OpenCounter(root) as opens:
        result = run_script(cache_options, [root], script, {"root": root, "workers": workers, "context": context},
                            prefetch=prefetch)
        counts = opens.counts()
    rel, digest, _, _ = result["first"]
    assert digest == digests[rel]
    for epoch, items in enumerate(result["epochs"], 1):
        assert set(items) == set(digests), f"epoch {epoch}: items missing"
        wrong = [r for r, (d, _, _) in items.items() if d != digests[r]]
        assert not wrong, f"epoch {epoch}: wrong bytes for {some(wrong)}"
        if workers:
            assert all(pid != result["main_pid"] for _, _, pid in items.values()), "items not read in workers"
        if epoch >= 2:
            outside = {r: where for r, (_, where, _) in items.items() if not in_tier(where, tiers)}
            assert not outside, f"epoch {epoch}: opens not served from a tier {tiers}: {some(outside)}"
    assert_each_opened_once(counts, digests)


CAT_IN_WORKER = r'''
import torch
from torch.utils.data import DataLoader, Dataset


class Cat(Dataset):
    """Each item is read by a cat started from the worker (vfork and exec under the shim)."""

    def __init__(self, root):
        self.root = root
        self.paths = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        out = subprocess.run(["cat", self.paths[i]], capture_output=True, check=True, timeout=30)
        return os.path.relpath(self.paths[i], self.root), sha(out.stdout)


if __name__ == "__main__":
    loader = DataLoader(Cat(ARGS["root"]), batch_size=None, num_workers=2, multiprocessing_context="fork")
    done({"epochs": [dict(loader) for _ in range(3)]})
'''


def test_cat_started_in_a_dataloader_worker(dataset, cache_options, tmp_path):
    need("torch")
    root, digests = dataset
    script = write_script(tmp_path, "cat_in_worker.py", CAT_IN_WORKER)
    with OpenCounter(root) as opens:
        result = run_script(cache_options, [root], script, {"root": root})
        counts = opens.counts()
    for epoch, items in enumerate(result["epochs"], 1):
        assert items == digests, f"epoch {epoch}: cat in a worker read other bytes"
    assert_each_opened_once(counts, digests)


IMAGEFOLDER = r'''
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets, transforms


class Indexed(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        image, label = self.ds[i]
        return i, image, label


if __name__ == "__main__":
    folder = datasets.ImageFolder(ARGS["root"], transform=transforms.PILToTensor())
    loader = DataLoader(Indexed(folder), batch_size=None, shuffle=True, num_workers=2)
    epochs = []
    for _ in range(3):
        seen = {}
        for i, image, label in loader:
            rel = os.path.relpath(folder.samples[i][0], ARGS["root"])
            seen[rel] = [sha(image.contiguous().numpy().tobytes()), list(image.shape), int(label)]
        epochs.append(seen)
    done({"epochs": epochs})
'''


def make_images(root, per_class=10):
    """JPEG and PNG files (RGB, grayscale, palette) in 3 class directories; returns
    {relative path: [sha256 of the decoded RGB pixels, CHW, shape, label]} decoded here with
    PIL from the source."""
    np = pytest.importorskip("numpy")
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(5)
    expected = {}
    for label, cls in enumerate(["ant", "bee", "cat"]):
        os.makedirs(os.path.join(root, cls))
        for i in range(per_class):
            h, w = 24 + i, 32 + 2 * label
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            image = Image.fromarray(pixels)
            if i % 5 == 3:
                image = image.convert("L")
            elif i % 5 == 4:
                image = image.convert("P")
            ext = ".jpg" if i % 2 == 0 and image.mode != "P" else ".png"
            rel = os.path.join(cls, f"img{i:02d}{ext}")
            if ext == ".jpg":
                image.save(os.path.join(root, rel), quality=90)
            else:
                image.save(os.path.join(root, rel))
    for rel in [os.path.relpath(p, root) for p in files_under(root)]:
        with Image.open(os.path.join(root, rel)) as image:
            chw = np.ascontiguousarray(np.asarray(image.convert("RGB")).transpose(2, 0, 1))
        expected[rel] = [sha(chw.tobytes()), list(chw.shape), ["ant", "bee", "cat"].index(rel.split(os.sep)[0])]
    return expected


def test_torchvision_imagefolder_decodes_the_same_pixels(cache_options, tmp_path):
    need("torch")
    need("torchvision")
    root = str(tmp_path / "images")
    expected = make_images(root)
    script = write_script(tmp_path, "imagefolder.py", IMAGEFOLDER)
    with OpenCounter(root) as opens:
        result = run_script(cache_options, [root], script, {"root": root})
        counts = opens.counts()
    for epoch, seen in enumerate(result["epochs"], 1):
        assert set(seen) == set(expected), f"epoch {epoch}: images missing"
        wrong = [rel for rel in expected if seen[rel] != expected[rel]]
        assert not wrong, f"epoch {epoch}: decoded differently from the source: {wrong}"
    assert_each_opened_once(counts, expected)


NUMPY = r'''
import numpy as np

if __name__ == "__main__":
    root = ARGS["root"]
    epochs = []
    for epoch in range(3):
        if epoch == 1:
            wait_published(ARGS["count"])
        seen, keep = {}, []
        for name in ARGS["npy"]:
            a = np.load(os.path.join(root, name), mmap_mode="r")
            keep.append(a)  # keeps the mapping alive until /proc/self/maps is read
            seen[name] = [type(a).__name__, sha(np.ascontiguousarray(a).tobytes()), list(a.shape), a.dtype.str]
        a = np.load(os.path.join(root, ARGS["npy"][0]))
        seen["load:" + ARGS["npy"][0]] = [type(a).__name__, sha(a.tobytes()), list(a.shape), a.dtype.str]
        a = np.fromfile(os.path.join(root, ARGS["raw"]), dtype="<f8")
        seen["fromfile:" + ARGS["raw"]] = [type(a).__name__, sha(a.tobytes()), list(a.shape), a.dtype.str]
        with open("/proc/self/maps") as f:
            mapped = [line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6]
        sources = sorted({m for m in mapped if m.startswith(root + os.sep)})
        cached = sorted({m for m in mapped if in_tier(m.replace(" (deleted)", ""))})
        epochs.append({"seen": seen, "mapped_sources": sources, "mapped_cached": len(cached)})
        del keep
    done({"epochs": epochs})
'''


def test_numpy_mmap_load_and_fromfile(cache_options, tmp_path):
    np = pytest.importorskip("numpy")
    need("numpy")
    root = str(tmp_path / "arrays")
    os.makedirs(os.path.join(root, "sub"))
    rng = np.random.default_rng(11)
    arrays = {
        "small.npy": np.arange(7, dtype=np.int16),
        "matrix.npy": rng.standard_normal((120, 50)).astype(np.float32),
        os.path.join("sub", "big.npy"): rng.integers(0, 1 << 40, (300, 512), dtype=np.int64),  # 1.2 MB
        os.path.join("sub", "fortran.npy"): np.asfortranarray(rng.standard_normal((33, 17))),
    }
    expected = {}
    for name, a in arrays.items():
        np.save(os.path.join(root, name), a)
        expected[name] = ["memmap", sha(np.ascontiguousarray(a).tobytes()), list(a.shape), a.dtype.str]
    first = sorted(arrays)[0]
    expected["load:" + first] = ["ndarray", sha(np.ascontiguousarray(arrays[first]).tobytes()),
                                 list(arrays[first].shape), arrays[first].dtype.str]
    raw = rng.standard_normal(5000)
    raw.astype("<f8").tofile(os.path.join(root, "raw.f8"))
    expected["fromfile:raw.f8"] = ["ndarray", sha(raw.astype("<f8").tobytes()), [5000], "<f8"]
    script = write_script(tmp_path, "arrays.py", NUMPY)
    with OpenCounter(root) as opens:
        result = run_script(cache_options, [root], script,
                            {"root": root, "npy": sorted(arrays), "raw": "raw.f8", "count": len(arrays) + 1})
        counts = opens.counts()
    for epoch, e in enumerate(result["epochs"], 1):
        assert e["seen"] == expected, f"epoch {epoch}: arrays differ from the source's"
        if epoch >= 2:
            # np.load(mmap_mode="r") maps the file it opened: the cached copy, not the source.
            assert e["mapped_sources"] == [], f"epoch {epoch}: source files mapped: {e['mapped_sources']}"
            assert e["mapped_cached"] >= len(arrays), f"epoch {epoch}: {e}"
    assert_each_opened_once(counts, list(arrays) + ["raw.f8"])


LARGE = r'''
if __name__ == "__main__":
    runs = []
    for run in range(2):
        if run == 1:
            wait_published(1)
        fd = os.open(ARGS["path"], os.O_RDONLY)
        where = fd_path(fd)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        os.close(fd)
        runs.append({"sha": sha(b"".join(chunks)), "where": where, "in_tier": in_tier(where)})
    done({"runs": runs})
'''


def test_a_large_file_is_read_from_its_source_while_it_is_cached(cache_options, tmp_path):
    """The first open of a large file does not wait for its copy: the program gets the source
    (opened once by the server, for the program and for the copy), and the next open, once
    the copy is published, gets the copy. The source is opened once in all."""
    root = tmp_path / "large"
    root.mkdir()
    path = root / "large.bin"
    data = os.urandom(24 << 20)  # over the size a reader is not kept waiting for (8 MiB)
    path.write_bytes(data)
    script = write_script(tmp_path, "large.py", LARGE)
    with OpenCounter(str(root)) as opens:
        result = run_script(cache_options, [str(root)], script, {"path": str(path)}, prefetch=0)
        counts = opens.counts()
    first, second = result["runs"]
    assert first["sha"] == second["sha"] == sha(data)
    assert first["where"] == str(path), f"the first open got {first['where']}, want the source"
    assert second["in_tier"], f"the second open got {second['where']}, want the cached copy"
    assert counts == {"large.bin": 1}, f"source opens: {counts}"


LARGE_DIRECT = r'''
import mmap

if __name__ == "__main__":
    fd = os.open(ARGS["path"], os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
    n = os.readv(fd, [buf])
    os.close(fd)
    wait_published(1)
    done({"sha": sha(buf[:n]), "n": n})
'''


def test_an_o_direct_reader_of_a_large_file_does_not_spoil_its_copy(cache_options, tmp_path):
    """The first open of a large file shares the source's open file with the server's copy:
    a program that opens it with O_DIRECT must not turn direct I/O on for the copy, whose
    last read (not a multiple of the block size) would fail, and the file would never be
    cached."""
    root = tmp_path / "direct"
    root.mkdir()
    path = root / "large.bin"
    data = os.urandom((12 << 20) + 1234)
    path.write_bytes(data)
    script = write_script(tmp_path, "direct.py", LARGE_DIRECT)
    result = run_script(cache_options, [str(root)], script, {"path": str(path)}, prefetch=0)
    assert result["n"] == 1 << 20 and result["sha"] == sha(data[:1 << 20])


H5PY = r'''
import h5py
import numpy as np

if __name__ == "__main__":
    epochs = []
    for epoch in range(3):
        if epoch == 1:
            wait_published(1)
        seen = {}
        with h5py.File(ARGS["path"], "r") as f:
            where = fd_path(f.id.get_vfd_handle())  # the descriptor of HDF5's sec2 driver

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    seen[name] = [sha(np.ascontiguousarray(obj[()]).tobytes()), list(obj.shape), obj.dtype.str]

            f.visititems(visit)
            seen["attr:note"] = str(f.attrs["note"])
            seen["slice:ints[5:9, 3]"] = f["ints"][5:9, 3].tolist()
        epochs.append({"seen": seen, "where": where})
    done({"epochs": epochs})
'''


def test_h5py_reads_the_same_datasets(cache_options, tmp_path):
    h5py = pytest.importorskip("h5py")
    np = pytest.importorskip("numpy")
    root = tmp_path / "hdf5"
    root.mkdir()
    path = str(root / "data.h5")
    rng = np.random.default_rng(3)
    ints = rng.integers(-1000, 1000, (200, 50), dtype=np.int32)
    with h5py.File(path, "w") as f:
        f["ints"] = ints
        f.create_dataset("floats/gz", data=rng.standard_normal((300, 40)), chunks=(50, 40), compression="gzip")
        f["bytes"] = rng.integers(0, 256, 70_000, dtype=np.uint8)
        f.attrs["note"] = "hello"
    expected = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: expected.__setitem__(name, [sha(np.ascontiguousarray(obj[()]).tobytes()),
                                                                   list(obj.shape), obj.dtype.str])
                     if isinstance(obj, h5py.Dataset) else None)
    expected["attr:note"] = "hello"
    expected["slice:ints[5:9, 3]"] = ints[5:9, 3].tolist()
    tiers = tier_dirs(cache_options)
    script = write_script(tmp_path, "h5.py", H5PY)
    with OpenCounter(str(root)) as opens:
        result = run_script(cache_options, [str(root)], script, {"path": path})
        counts = opens.counts()
    for epoch, e in enumerate(result["epochs"], 1):
        assert e["seen"] == expected, f"epoch {epoch}: HDF5 contents differ from the source's"
        if epoch >= 2:
            assert in_tier(e["where"], tiers), f"epoch {epoch}: HDF5 read {e['where']}, not a cached copy"
    assert_each_opened_once(counts, ["data.h5"])


LMDB = r'''
import lmdb

if __name__ == "__main__":
    epochs = []
    for _ in range(3):
        env = lmdb.open(ARGS["path"], readonly=True, lock=False)
        h, n = hashlib.sha256(), 0
        with env.begin() as txn:
            for k, v in txn.cursor():
                h.update(len(k).to_bytes(4, "little") + k + len(v).to_bytes(4, "little") + v)
                n += 1
            picked = {k: sha(txn.get(k.encode())) for k in ARGS["keys"]}
            missing = txn.get(b"no such key")
        env.close()
        epochs.append([h.hexdigest(), n, picked, missing])
    done({"epochs": epochs})
'''


def test_lmdb_readonly_environment(cache_options, tmp_path):
    lmdb = pytest.importorskip("lmdb")
    root = tmp_path / "lmdbdata"
    path = str(root / "db")
    os.makedirs(path)
    rng = random.Random(9)
    items = {f"key{i:04d}".encode(): rng.randbytes(rng.randrange(0, 3000)) for i in range(300)}
    env = lmdb.open(path, map_size=32 << 20)
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k, v)
    env.close()
    h = hashlib.sha256()
    for k in sorted(items):
        h.update(len(k).to_bytes(4, "little") + k + len(items[k]).to_bytes(4, "little") + items[k])
    keys = ["key0000", "key0123", "key0299"]
    want = [h.hexdigest(), len(items), {k: sha(items[k.encode()]) for k in keys}, None]
    before = {p: sha(b) for p, b in read_all(path).items()}
    script = write_script(tmp_path, "lmdb_read.py", LMDB)
    result = run_script(cache_options, [str(root)], script, {"path": path, "keys": keys})
    for epoch, got in enumerate(result["epochs"], 1):
        assert got == want, f"epoch {epoch}: lmdb read other data"
    assert {p: sha(b) for p, b in read_all(path).items()} == before, "a read-only lmdb open changed the files"


# --- writes -------------------------------------------------------------------------------

READ_ALL = r'''
if __name__ == "__main__":
    out = {}
    for d, _, names in os.walk(ARGS["root"]):
        for name in names:
            with open(os.path.join(d, name), "rb") as f:
                out[os.path.relpath(f.name, ARGS["root"])] = [sha(f.read()), fd_path(f.fileno())]
    done(out)
'''

WRITE = r'''
if __name__ == "__main__":
    p = lambda name: os.path.join(ARGS["root"], name)
    where = {}
    with open(p("a.bin"), "r+b") as f:  # O_RDWR, rewritten in place: same size
        where["a.bin"] = fd_path(f.fileno())
        f.seek(10)
        f.write(b"REWRITTEN")
    with open(p("b.bin"), "ab") as f:  # O_WRONLY|O_CREAT|O_APPEND
        where["b.bin"] = fd_path(f.fileno())
        f.write(b"appended tail")
    with open(p("c.bin"), "wb") as f:  # O_WRONLY|O_CREAT|O_TRUNC
        where["c.bin"] = fd_path(f.fileno())
        f.write(b"short")
    fd = os.open(p("d.bin"), os.O_WRONLY)  # no O_CREAT, no O_TRUNC
    where["d.bin"] = fd_path(fd)
    os.pwrite(fd, b"WO", 0)
    os.close(fd)
    with open(p("e.bin"), "xb") as f:  # a new file in the dataset
        where["e.bin"] = fd_path(f.fileno())
        f.write(b"a new file")
    # Read back in this process, after the writes.
    after = {}
    for name in sorted(where):
        with open(p(name), "rb") as f:
            after[name] = sha(f.read())
    done({"where": where, "after": after})
'''


def test_writes_reach_the_source_and_later_reads_see_them(cache_options, tmp_path):
    root = tmp_path / "rw"
    root.mkdir()
    old = {name: os.urandom(3000 + 100 * i) for i, name in enumerate(["a.bin", "b.bin", "c.bin", "d.bin"])}
    for name, data in old.items():
        (root / name).write_bytes(data)
    new = {
        "a.bin": old["a.bin"][:10] + b"REWRITTEN" + old["a.bin"][19:],
        "b.bin": old["b.bin"] + b"appended tail",
        "c.bin": b"short",
        "d.bin": b"WO" + old["d.bin"][2:],
        "e.bin": b"a new file",
    }
    tiers = tier_dirs(cache_options)
    reader = write_script(tmp_path, "read_all.py", READ_ALL)
    writer = write_script(tmp_path, "write.py", WRITE)

    # First run: the files are read, hence cached.
    got = run_script(cache_options, [str(root)], reader, {"root": str(root)})
    assert {n: d for n, (d, _) in got.items()} == {n: sha(b) for n, b in old.items()}
    wait_published(cache_options, len(old))
    got = run_script(cache_options, [str(root)], reader, {"root": str(root)})
    assert all(in_tier(where, tiers) for _, where in got.values()), f"not cached before the writes: {got}"

    # No prefetch job in the writer's run: one still running after a write-open could cache
    # the file again before the bytes are written (see the next test).
    result = run_script(cache_options, [str(root)], writer, {"root": str(root)}, prefetch=0)
    # Write-opens pass through to the source file itself.
    assert result["where"] == {n: os.path.realpath(root / n) for n in new}, result["where"]
    for name, data in new.items():
        assert (root / name).read_bytes() == data, f"{name} on disk does not hold the bytes written"
    assert result["after"] == {n: sha(b) for n, b in new.items()}, "a read after the writes, same process"
    got = run_script(cache_options, [str(root)], reader, {"root": str(root)})
    assert {n: d for n, (d, _) in got.items()} == {n: sha(b) for n, b in new.items()}, "a read in a new process"


WRITE_WHILE_READ = r'''
if __name__ == "__main__":
    path = ARGS["path"]
    w = open(path, "r+b")
    with open(path, "rb") as f:  # another descriptor reads the old bytes meanwhile
        old = sha(f.read())
    w.write(b"NEW BYTES")
    w.close()
    with open(path, "rb") as f:
        new = sha(f.read())
    done({"old": old, "new": new})
'''


def test_a_read_between_write_open_and_write_does_not_keep_stale_bytes(cache_options, tmp_path):
    # The cached copy is dropped when the write-open happens; a read through another
    # descriptor before the bytes are written must not leave the old bytes cached for reads
    # that come after the write.
    root = tmp_path / "rw2"
    root.mkdir()
    path = root / "f.bin"
    data = os.urandom(5000)
    path.write_bytes(data)
    script = write_script(tmp_path, "write_while_read.py", WRITE_WHILE_READ)
    result = run_script(cache_options, [str(root)], script, {"path": str(path)}, prefetch=0)
    written = b"NEW BYTES" + data[9:]
    assert path.read_bytes() == written
    assert result == {"old": sha(data), "new": sha(written)}, "a read after the write saw the old bytes"
    got = run_script(cache_options, [str(root)], write_script(tmp_path, "read_all.py", READ_ALL), {"root": str(root)})
    assert got["f.bin"][0] == sha(written), "a later process read the bytes from before the write"


# --- what must work as it does without the shim --------------------------------------------

PROBE = r'''
import errno, stat


def attempt(fn):
    try:
        return ["ok", fn()]
    except OSError as e:
        return ["error", type(e).__name__, errno.errorcode.get(e.errno, e.errno)]


def fd_info(fd):
    try:
        st = os.fstat(fd)
        return [stat.S_IFMT(st.st_mode), st.st_size if stat.S_ISREG(st.st_mode) else None]
    finally:
        os.close(fd)


def read(path):
    with open(path, "rb") as f:
        return sha(f.read())


if __name__ == "__main__":
    root, outside = ARGS["root"], ARGS["outside"]
    p = lambda *names: os.path.join(root, *names)
    r = {}
    r["missing"] = attempt(lambda: read(p("missing.bin")))
    r["missing dir"] = attempt(lambda: read(p("no", "such", "dir", "x.bin")))
    r["os.open missing"] = attempt(lambda: os.open(p("missing.bin"), os.O_RDONLY))
    r["file as dir"] = attempt(lambda: read(p("a.bin", "x")))
    r["os.open dir"] = attempt(lambda: fd_info(os.open(root, os.O_RDONLY)))
    r["os.open subdir O_DIRECTORY"] = attempt(lambda: fd_info(os.open(p("sub"), os.O_RDONLY | os.O_DIRECTORY)))
    r["open() dir"] = attempt(lambda: read(root))
    r["listdir"] = attempt(lambda: sorted(os.listdir(root)))
    r["file with O_DIRECTORY"] = attempt(lambda: fd_info(os.open(p("a.bin"), os.O_RDONLY | os.O_DIRECTORY)))
    r["O_CREAT|O_EXCL existing"] = attempt(lambda: fd_info(os.open(p("a.bin"), os.O_RDONLY | os.O_CREAT | os.O_EXCL)))
    r["O_NOFOLLOW on a link"] = attempt(lambda: fd_info(os.open(p("link_in"), os.O_RDONLY | os.O_NOFOLLOW)))
    r["O_NOFOLLOW on a file"] = attempt(lambda: fd_info(os.open(p("a.bin"), os.O_RDONLY | os.O_NOFOLLOW)))
    r["link inside"] = attempt(lambda: read(p("link_in")))
    r["link to outside"] = attempt(lambda: read(p("link_out")))
    r["O_PATH"] = attempt(lambda: fd_path(os.open(p("a.bin"), os.O_PATH)))
    r["fifo nonblocking"] = attempt(lambda: fd_info(os.open(p("fifo"), os.O_RDONLY | os.O_NONBLOCK)))
    r["odd name"] = attempt(lambda: read(p("sub", "sp ace \u00e9.bin")))
    r["outside"] = attempt(lambda: [read(outside), fd_path(os.open(outside, os.O_RDONLY))])
    if os.geteuid() != 0:  # root reads anything
        r["unreadable"] = attempt(lambda: read(p("unreadable.bin")))
    done(r)
'''


def test_errors_and_special_files_behave_as_without_the_shim(cache_options, tmp_path):
    # The probe runs once plainly and once under `fitcache run`: every answer (the bytes, the
    # exception and errno, what a descriptor is) must be the same.
    root = tmp_path / "special"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(os.urandom(5000))
    (root / "sub" / "sp ace \u00e9.bin").write_bytes(os.urandom(777))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(os.urandom(4000))
    os.symlink("a.bin", root / "link_in")
    os.symlink(outside, root / "link_out")
    os.mkfifo(root / "fifo")
    (root / "unreadable.bin").write_bytes(b"secret")
    os.chmod(root / "unreadable.bin", 0)
    script = write_script(tmp_path, "probe.py", PROBE)
    args = {"fitcache": FITCACHE_BIN, "tiers": tier_dirs(cache_options), "root": str(root), "outside": str(outside)}
    plain = subprocess.run([PYTHON, script, json.dumps(args)], env=command_env(cache_options), capture_output=True,
                           timeout=60)
    assert plain.returncode == 0, describe(plain)
    want = json.loads(plain.stdout.decode().strip().splitlines()[-1])
    # The probe itself: these are the answers of the kernel and libc.
    assert want["missing"][1] == "FileNotFoundError" and want["open() dir"][1] == "IsADirectoryError", want
    assert want["os.open dir"][0] == "ok" and want["fifo nonblocking"][0] == "ok", want
    got = run_script(cache_options, [str(root)], script, {"root": str(root), "outside": str(outside)})
    diff = {k: {"without": want[k], "with": got.get(k)} for k in want if got.get(k) != want[k]}
    assert not diff, f"the shim changed what these opens do: {json.dumps(diff, indent=1)}"


DIRECTORIES = r'''
if __name__ == "__main__":
    root = ARGS["root"]
    wait_published(ARGS["count"])
    out = {}
    os.chdir(root)
    for rel in ARGS["rels"]:
        with open(rel, "rb") as f:  # relative to the working directory
            out["relative " + rel] = [sha(f.read()), in_tier(fd_path(f.fileno()))]
        head, name = os.path.split(rel)
        dfd = os.open(head, os.O_RDONLY | os.O_DIRECTORY)
        fd = os.open(name, os.O_RDONLY, dir_fd=dfd)  # openat
        with os.fdopen(fd, "rb") as f:
            out["openat " + rel] = [sha(f.read()), in_tier(fd_path(f.fileno()))]
        os.close(dfd)
        with open(os.path.join(root, ".", head + "//" + name), "rb") as f:
            out["unclean " + rel] = [sha(f.read()), in_tier(fd_path(f.fileno()))]
        with open(os.path.join(root, head, "..", os.path.basename(head), name), "rb") as f:
            out["dotdot " + rel] = [sha(f.read()), None]
    os.chdir("/")
    done(out)
'''


def test_relative_openat_and_unclean_paths(dataset, cache_options, tmp_path):
    root, digests = dataset
    rels = sorted(digests)[::7]
    script = write_script(tmp_path, "directories.py", DIRECTORIES)
    with OpenCounter(root) as opens:
        got = run_script(cache_options, [root], script, {"root": root, "rels": rels, "count": len(digests)})
        counts = opens.counts()
    for rel in rels:
        assert got["relative " + rel] == [digests[rel], True], (rel, got["relative " + rel])
        assert got["openat " + rel] == [digests[rel], True], (rel, got["openat " + rel])
        assert got["unclean " + rel] == [digests[rel], True], (rel, got["unclean " + rel])
        # A path through ".." names the file only if no directory on the way is a link: the
        # shim may leave it to the kernel, so only the bytes are checked.
        assert got["dotdot " + rel] == [digests[rel], None], (rel, got["dotdot " + rel])
    # The prefetch opened every file once; the program's opens other than through ".." did
    # not reach the source.
    assert set(counts) == set(digests), counts
    assert all(counts[rel] == 1 for rel in digests if rel not in rels), counts


THROUGH_LINK = r'''
if __name__ == "__main__":
    wait_published(ARGS["count"])
    out = {}
    for root in (ARGS["link"], ARGS["real"]):
        for rel in ARGS["rels"]:
            with open(os.path.join(root, rel), "rb") as f:
                out[os.path.join(root, rel)] = [sha(f.read()), in_tier(fd_path(f.fileno()))]
    done(out)
'''


def test_data_dir_given_through_a_link(dataset, cache_options, tmp_path):
    # Clusters often name a dataset through a link (/scratch -> /lustre/...): opens through
    # the link and through the real path are the same files, read from the source once.
    root, digests = dataset
    link = tmp_path / "dataset-link"
    os.symlink(root, link)
    rels = sorted(digests)[::5]
    script = write_script(tmp_path, "through_link.py", THROUGH_LINK)
    with OpenCounter(root) as opens:
        got = run_script(cache_options, [str(link)], script,
                         {"link": str(link), "real": root, "rels": rels, "count": len(digests)})
        counts = opens.counts()
    want = {os.path.join(r, rel): [digests[rel], True] for r in (str(link), root) for rel in rels}
    assert got == want, {k: v for k, v in got.items() if v != want.get(k)}
    assert_each_opened_once(counts, digests)


SERVER_DIES = r'''
if __name__ == "__main__":
    paths = ARGS["paths"]
    half = len(paths) // 2
    before = {p: sha(open(p, "rb").read()) for p in paths[:half]}
    open(ARGS["ready"], "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(ARGS["go"]):
        if time.monotonic() > deadline:
            sys.exit("never told to go on")
        time.sleep(0.02)
    start = time.monotonic()
    after = {p: sha(open(p, "rb").read()) for p in paths}
    done({"before": before, "after": after, "seconds": time.monotonic() - start})
'''


def stop_server_under(script, cache_options, tmp_path, root, sig, extra_env=None):
    """Runs script under `fitcache run --prefetch 0` (so that half the files are not cached);
    when it has read half the files, sends sig to the server, then lets it read them all.
    Returns (result, server pid)."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    args = {"fitcache": FITCACHE_BIN, "tiers": tier_dirs(cache_options), "paths": files_under(root),
            "ready": str(ready), "go": str(go)}
    proc = subprocess.Popen([FITCACHE_BIN, "run", "--prefetch", "0", "--data", root, "--", PYTHON, script,
                             json.dumps(args)], env=command_env(cache_options, **(extra_env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pid = 0
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None:
                stdout, stderr = proc.communicate()
                raise AssertionError(describe(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)))
            assert time.monotonic() < deadline, "the script did not read the first half in 60 s"
            time.sleep(0.02)
        pid = server_pid(cache_options["runtime_dir"])
        assert pid, "no server runs"
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            assert wait_dead(pid), f"server {pid} still alive"
        go.touch()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if sig == signal.SIGSTOP and pid:
            os.kill(pid, signal.SIGCONT)  # so that the fixture can stop it
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, describe(out)
    return json.loads(stdout.decode().strip().splitlines()[-1])


def wait_dead(pid, timeout=10):
    """Waits until pid is gone or a zombie: the server may be a child of the program that
    `fitcache run` became, which does not reap it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except (FileNotFoundError, ProcessLookupError):  # gone, or going while read
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_reads_go_on_when_the_server_dies_or_hangs(dataset, cache_options, tmp_path, sig):
    # Killed: the node socket refuses at once. Stopped: it accepts and never answers, so the
    # shim must give up after read_timeout (set short here) and read the source.
    root, digests = dataset
    script = write_script(tmp_path, "server_dies.py", SERVER_DIES)
    result = stop_server_under(script, cache_options, tmp_path, root, sig, {"FITCACHE_READ_TIMEOUT": "2"})
    want = {os.path.join(root, rel): d for rel, d in digests.items()}
    assert result["before"] == {p: want[p] for p in result["before"]}
    assert result["after"] == want, "wrong bytes after the server went away"
    assert result["seconds"] < 30, f"reading {len(want)} files took {result['seconds']:.1f}s without a server"


# --- a C program: every symbol the shim wraps ----------------------------------------------

C_PROGRAM = r'''
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Prints what a descriptor is: where /proc says it points, close-on-exec, access mode,
   non-blocking, the size read with pread, and the FNV-1a hash of its bytes. */
static void report(const char *how, int fd) {
	char proc[64], link[4096];
	if (fd < 0) { printf("%s\tERROR\t%d\n", how, fd); return; }
	snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
	ssize_t n = readlink(proc, link, sizeof link - 1);
	link[n > 0 ? n : 0] = 0;
	int fdflags = fcntl(fd, F_GETFD), flflags = fcntl(fd, F_GETFL);
	struct stat st;
	fstat(fd, &st);
	unsigned char *buf = malloc(st.st_size + 1);
	size_t got = 0;
	ssize_t r;
	while ((r = pread(fd, buf + got, st.st_size + 1 - got, got)) > 0) got += r;
	uint64_t h = 14695981039346656037ULL;
	for (size_t i = 0; i < got; i++) h = (h ^ buf[i]) * 1099511628211ULL;
	free(buf);
	printf("%s\t%s\t%d\t%d\t%d\t%zu\t%016llx\n", how, link, !!(fdflags & FD_CLOEXEC), flflags & O_ACCMODE,
	       !!(flflags & O_NONBLOCK), got, (unsigned long long)h);
}

int main(int argc, char **argv) {
	const char *path = argv[1], *dir = argv[2], *name = argv[3];
	int flags = atoi(argv[4]); /* O_RDONLY, not a constant: fortified open() calls __open_2 */
	int fd, dfd = open(dir, O_RDONLY | O_DIRECTORY);
	FILE *f;
	/* Read-only opens, each with the symbol a program compiled this way calls. */
	fd = open(path, O_RDONLY); report("open", fd); close(fd);
	fd = open(path, O_RDONLY | O_CLOEXEC); report("open cloexec", fd); close(fd);
	fd = open64(path, O_RDONLY); report("open64", fd); close(fd);
	fd = open(path, flags); report("__open_2", fd); close(fd);
	fd = open64(path, flags); report("__open64_2", fd); close(fd);
	fd = openat(dfd, name, O_RDONLY); report("openat", fd); close(fd);
	fd = openat(AT_FDCWD, path, O_RDONLY | O_CLOEXEC); report("openat AT_FDCWD cloexec", fd); close(fd);
	fd = openat64(dfd, name, O_RDONLY); report("openat64", fd); close(fd);
	fd = openat(dfd, name, flags); report("__openat_2", fd); close(fd);
	fd = openat64(dfd, name, flags); report("__openat64_2", fd); close(fd);
	f = fopen(path, "r"); report("fopen", f ? fileno(f) : -1); if (f) fclose(f);
	f = fopen(path, "rbe"); report("fopen e", f ? fileno(f) : -1); if (f) fclose(f);
	f = fopen64(path, "r"); report("fopen64", f ? fileno(f) : -1); if (f) fclose(f);
	/* stdio reads through the FILE, and mmap of a redirected descriptor */
	f = fopen(path, "r");
	if (!f) return 2;
	uint64_t h = 14695981039346656037ULL;
	size_t got = 0;
	int c;
	while ((c = getc(f)) != EOF) { h = (h ^ (unsigned char)c) * 1099511628211ULL; got++; }
	fclose(f);
	printf("getc\t-\t-\t-\t-\t%zu\t%016llx\n", got, (unsigned long long)h);
	fd = open(path, O_RDONLY);
	struct stat st;
	fstat(fd, &st);
	unsigned char *m = mmap(NULL, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
	close(fd);
	if (m == MAP_FAILED) return 3;
	h = 14695981039346656037ULL;
	for (off_t i = 0; i < st.st_size; i++) h = (h ^ m[i]) * 1099511628211ULL;
	printf("mmap\t-\t-\t-\t-\t%lld\t%016llx\n", (long long)st.st_size, (unsigned long long)h);
	/* Last: a read-write open, which drops the cached copy, and a new file. */
	f = fopen(path, "r+"); report("fopen r+", f ? fileno(f) : -1); if (f) fclose(f);
	fd = creat(argv[5], 0600); report("creat", fd); close(fd);
	return 0;
}
'''


def fnv1a(data):
    h = 14695981039346656037
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def test_c_program_through_every_wrapped_symbol(dataset, cache_options, tmp_path):
    root, digests = dataset
    exe = compile_program(tmp_path, "opens", C_PROGRAM, ["open", "open64", "__open_2", "__open64_2", "openat",
                                                         "openat64", "__openat_2", "__openat64_2", "fopen", "fopen64",
                                                         "creat"], ["-D_FORTIFY_SOURCE=2"])
    rel = os.path.join("class2", "sub1", "sample_005.bin")  # 65,537 bytes: past a page and a stdio buffer
    path = os.path.join(root, rel)
    data = open(path, "rb").read()
    assert len(data) == 65537
    tiers = tier_dirs(cache_options)
    # Cache the dataset first (a miss is served from a tier as well, but a hit is what most
    # opens are), then run the program.
    out = fitcache_run(cache_options, [root], ["cat", path])
    assert out.returncode == 0 and out.stdout == data, describe(out)
    wait_published(cache_options, len(digests))
    with OpenCounter(root) as opens:
        # No prefetch job: one running late could cache the file again after "fopen r+".
        created = os.path.join(root, "class0", "created.bin")
        out = fitcache_run(cache_options, [root], [str(exe), path, os.path.dirname(path), os.path.basename(path),
                                                   str(os.O_RDONLY), created], prefetch=0)
        counts = opens.counts()
    assert out.returncode == 0, describe(out)
    rows = {line.split("\t")[0]: line.split("\t")[1:] for line in out.stdout.decode().splitlines()}
    failed = {how: row for how, row in rows.items() if len(row) != 6}
    assert not failed, f"opens that failed: {failed}"
    size, h = str(len(data)), fnv1a(data)
    link, _, mode, _, _, _ = rows.pop("creat")
    assert (link, mode) == (os.path.realpath(created), str(os.O_WRONLY)), ("creat", link, mode)
    assert os.path.getsize(created) == 0
    for how, (link, cloexec, mode, nonblock, got, digest) in rows.items():
        assert (got, digest) == (size, h), f"{how}: read {got} bytes, hash {digest}; want {size}, {h}"
        if how in ("getc", "mmap"):
            continue
        if how == "fopen r+":
            assert link == path, f"{how}: a read-write open went to {link}, not the source"
            assert mode == str(os.O_RDWR)
            continue
        assert in_tier(link, tiers), f"{how}: opened {link}, not a cached copy in {tiers}"
        # The descriptor is the one the program asked for: close-on-exec only when requested,
        # read-only, blocking.
        want_cloexec = "1" if "cloexec" in how or how == "fopen e" else "0"
        assert (cloexec, mode, nonblock) == (want_cloexec, str(os.O_RDONLY), "0"), \
            f"{how}: close-on-exec {cloexec} (want {want_cloexec}), access mode {mode}, non-blocking {nonblock}"
    assert len(rows) == 16, out.stdout.decode()
    # Only the write-opens reached the source.
    assert dict(counts) == {rel: 1, os.path.relpath(created, root): 1}, counts


# --- the shim against a node socket of the test's own ------------------------------------


class FakeNodeSocket:
    """A node socket that answers every request with success and records, for each, its
    operation, its path and the bytes the file held when the request arrived."""

    def __init__(self, address):
        import socket
        import threading
        self.requests = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        import socket
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(5)
                head = conn.recv(16, socket.MSG_WAITALL)
                if len(head) < 16:
                    continue
                op, rootlen, pathlen = (int.from_bytes(head[i:i + 4], "little") for i in (4, 8, 12))
                body = conn.recv(rootlen + pathlen, socket.MSG_WAITALL)
                conn.sendall(b"FCA3")  # the ack: the request is read
                path = body[rootlen:].decode()
                with open(path, "rb") as f:
                    held = f.read()
                self.requests.append((op, path, held))
                conn.sendall(b"FCN3" + bytes(8))  # errno 0, no message

    def close(self):
        self.stopped.set()
        self.thread.join(timeout=5)
        self.sock.close()


WRITER = r'''
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* Appends argv[2] to argv[1] through a buffered stream; with argv[3] "exit", exits without
 * fclose (stdio flushes at exit). */
int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "a");
    if (!f || fwrite(argv[2], 1, strlen(argv[2]), f) != strlen(argv[2]))
        return 1;
    if (argc > 3 && strcmp(argv[3], "exit") == 0)
        exit(0);
    return fclose(f) == 0 ? 0 : 2;
}
'''

OP_FORGET = 3
# The shim installed with the package, beside the library (what `fitcache preload-path` prints).
PRELOAD_LIB = os.path.join(os.path.dirname(fitcache._native.library_path()), "libfitcache_preload.so")


@pytest.mark.parametrize("how", ["fclose", "exit"])
def test_a_written_file_is_forgotten_after_its_last_write(tmp_path, how):
    """A stream's buffer reaches the file at fclose (or at exit): the copy must be dropped
    after that, or a reader could cache the file between the drop and the write."""
    exe = compile_program(tmp_path, "writer", WRITER)
    root = tmp_path / "data"
    root.mkdir()
    target = root / "labels.txt"
    target.write_bytes(b"old\n")
    node = FakeNodeSocket(str(tmp_path / "node.sock"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FITCACHE_")}
        env.update(LD_PRELOAD=PRELOAD_LIB, FITCACHE_PRELOAD_ROOTS=str(root), FITCACHE_PRELOAD_TIERS="",
                   FITCACHE_PRELOAD_SOCKET=str(tmp_path / "node.sock"))
        out = subprocess.run([str(exe), str(target), "new\n", how], env=env, capture_output=True, timeout=30)
        assert out.returncode == 0, describe(out)
    finally:
        node.close()
    forgets = [(path, held) for op, path, held in node.requests if op == OP_FORGET]
    assert [p for p, _ in forgets] == [str(target)] * 2, node.requests  # at the open and at the end
    assert forgets[-1][1] == b"old\nnew\n", f"the last forget came before the last write: {forgets}"


def test_an_empty_node_socket_is_never_an_abstract_one(dataset, tmp_path):
    """Without a node socket (FITCACHE_PRELOAD_SOCKET empty), the shim asks nobody: an empty
    name would be an abstract socket (all NUL bytes), which any user of the node can bind and
    answer with descriptors of their choosing."""
    import socket
    root, digests = dataset
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        squatter.bind(b"\0" * 108)
    except OSError as err:
        pytest.skip(f"cannot bind the all-NUL abstract name here: {err}")
    squatter.listen(4)
    squatter.settimeout(1)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FITCACHE_")}
        env.update(LD_PRELOAD=PRELOAD_LIB, FITCACHE_PRELOAD_ROOTS=root, FITCACHE_PRELOAD_TIERS="", FITCACHE_PRELOAD_SOCKET="")
        name = sorted(digests)[0]
        out = subprocess.run(["cat", os.path.join(root, name)], env=env, capture_output=True, timeout=30)
        assert out.returncode == 0 and sha(out.stdout) == digests[name], describe(out)
        with pytest.raises(socket.timeout):
            squatter.accept()[0].close()
    finally:
        squatter.close()


# --- POSIX's lowest-descriptor rule ---------------------------------------------------------

LOWEST_FD = r'''
if __name__ == "__main__":
    path = ARGS["path"]
    got = {}
    for how in ("miss", "hit"):
        if how == "hit":
            wait_published(1)
        os.close(0)  # the lowest free descriptor is 0 now
        fd = os.open(path, os.O_RDONLY)
        got[how] = [fd, in_tier(fd_path(fd)), sha(os.read(fd, 1 << 20))]
        os.close(fd)
        os.open(os.devnull, os.O_RDONLY)  # stdin back, for the next round
    done(got)
'''


def test_an_open_returns_the_lowest_free_descriptor(cache_options, tmp_path):
    """open() returns the lowest descriptor not open (POSIX), which programs rely on (`close(0);
    open(f)` to make f their standard input): also when the descriptor came from the server
    over the node socket (a miss), not only from the tiers (a hit). Before: a miss gave 5."""
    root = tmp_path / "lowest"
    root.mkdir()
    data = os.urandom(7000)
    (root / "f.bin").write_bytes(data)
    got = run_script(cache_options, [str(root)], write_script(tmp_path, "lowest.py", LOWEST_FD),
                     {"path": str(root / "f.bin")}, prefetch=0)
    assert got == {"miss": [0, True, sha(data)], "hit": [0, True, sha(data)]}, got


# --- a stopped server costs a short probe ---------------------------------------------------


def stopped_server(cache_options, root):
    """Starts the embedded server (a run that caches nothing), stops it with SIGSTOP and
    returns its pid; the caller sends SIGCONT."""
    out = fitcache_run(cache_options, [root], ["true"], prefetch=0)
    assert out.returncode == 0, describe(out)
    pid = server_pid(cache_options["runtime_dir"])
    assert pid, "no server runs"
    os.kill(pid, signal.SIGSTOP)
    return pid


def timed_cat(env, path, timeout=120):
    start = time.monotonic()
    out = subprocess.run(["cat", path], env=env, capture_output=True, timeout=timeout)
    return out, time.monotonic() - start


def test_a_stopped_server_costs_the_shim_a_short_probe(dataset, cache_options):
    """The node socket acknowledges a request at once: a server stopped with SIGSTOP accepts
    the connection (the kernel does) but sends no acknowledgement, so a miss waits about a
    second, not the read timeout, then reads the source. Before: the whole read timeout (30 s
    here), in every new process."""
    root, digests = dataset
    pid = stopped_server(cache_options, root)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FITCACHE_")}
        env.update(LD_PRELOAD=PRELOAD_LIB, FITCACHE_PRELOAD_ROOTS=root, FITCACHE_PRELOAD_TIERS="",
                   FITCACHE_PRELOAD_SOCKET=os.path.join(cache_options["runtime_dir"], "server.sock.node"),
                   FITCACHE_PRELOAD_TIMEOUT_MS="30000")
        for name in sorted(digests)[:2]:  # two processes: each pays the probe once
            out, seconds = timed_cat(env, os.path.join(root, name))
            assert out.returncode == 0 and sha(out.stdout) == digests[name], describe(out)
            assert seconds < 10, f"a miss with a stopped server took {seconds:.1f} s (read timeout 30 s)"
    finally:
        os.kill(pid, signal.SIGCONT)


def test_run_gives_no_server_it_could_not_reach_to_the_program(dataset, cache_options):
    """`fitcache run` with a stopped server reports it, and the program it runs (and every
    process it starts) reads the source without asking the server. Before: the first miss of
    each process waited the read timeout (61 s with the defaults)."""
    root, digests = dataset
    pid = stopped_server(cache_options, root)
    try:
        names = sorted(digests)[:3]
        script = "; ".join(f"cat {os.path.join(root, n)}" for n in names)
        start = time.monotonic()
        out = fitcache_run(cache_options, [root], ["sh", "-c", script], prefetch=0,
                           env=command_env(cache_options, FITCACHE_READ_TIMEOUT="30"), timeout=300)
        seconds = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    assert out.returncode == 0, describe(out)
    assert out.stdout == b"".join(open(os.path.join(root, n), "rb").read() for n in names)
    assert seconds < 15, f"three processes' misses with a stopped server took {seconds:.1f} s (read timeout 30 s)"
    assert b"could not be reached" in out.stderr and b"nor the processes it starts ask" in out.stderr, out.stderr.decode()


# --- renames, unlinks and truncates drop cached copies --------------------------------------

READ_NAMES = r'''
import errno

if __name__ == "__main__":
    out = {}
    for name in ARGS["names"]:
        try:
            with open(os.path.join(ARGS["root"], name), "rb") as f:
                out[name] = [sha(f.read()), in_tier(fd_path(f.fileno()))]
        except OSError as e:
            out[name] = [errno.errorcode[e.errno]]
    done(out)
'''


def plain_view(root, names):
    """What READ_NAMES must see: each file's digest, or the error of opening it, read by the
    test itself without the shim (the cached flag is not compared)."""
    import errno
    out = {}
    for name in names:
        try:
            out[name] = sha((root / name).read_bytes())
        except OSError as e:
            out[name] = errno.errorcode[e.errno]
    return out


def cached_dataset(cache_options, tmp_path, root, files):
    """Writes files ({relative name: bytes}) under root and caches them all; returns the
    reader script."""
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    reader = write_script(tmp_path, "read_names.py", READ_NAMES)
    args = {"root": str(root), "names": sorted(files)}
    run_script(cache_options, [str(root)], reader, args, prefetch=0)
    wait_published(cache_options, len(files))
    got = run_script(cache_options, [str(root)], reader, args, prefetch=0)
    assert all(cached for _, cached in got.values()), f"not all cached before the changes: {got}"
    return reader


def test_renames_unlinks_and_truncates_drop_cached_copies(cache_options, tmp_path):
    """Files renamed over (mv, os.replace, sed -i), moved, unlinked (rm), truncated
    (truncate, os.truncate) or under a renamed directory, by unmodified programs under
    `fitcache run`: later reads see the new bytes, and a file that is gone does not open.
    Before, only opens for writing dropped a copy: the old bytes were read, and deleted
    files still opened."""
    root = tmp_path / "mut"
    files = {name: os.urandom(4000 + 100 * i) for i, name in enumerate(
        ["a.bin", "b.bin", "c.bin", "d.bin", "e.bin", "g.bin", "h.bin", "sub/x.bin", "sub/deep/y.bin"])}
    files["s.txt"] = b"an old line\n" * 50
    reader = cached_dataset(cache_options, tmp_path, root, files)
    outside = tmp_path / "new.bin"
    outside.write_bytes(b"renamed over from outside")
    replace = "import os, sys; open(sys.argv[1] + '.new', 'wb').write(b'replaced'); os.replace(sys.argv[1] + '.new', sys.argv[1])"
    for cmd in [["mv", str(outside), str(root / "a.bin")],
                ["mv", str(root / "c.bin"), str(root / "b.bin")],
                [PYTHON, "-c", replace, str(root / "d.bin")],
                ["sed", "-i", "s/old/new/", str(root / "s.txt")],
                ["rm", str(root / "e.bin")],
                ["truncate", "-s", "10", str(root / "g.bin")],
                [PYTHON, "-c", "import os, sys; os.truncate(sys.argv[1], 7)", str(root / "h.bin")],
                ["mv", str(root / "sub"), str(root / "sub2")]]:
        out = fitcache_run(cache_options, [str(root)], cmd, prefetch=0)
        assert out.returncode == 0, describe(out)
    names = sorted(files) + ["sub2/x.bin", "sub2/deep/y.bin"]
    got = run_script(cache_options, [str(root)], reader, {"root": str(root), "names": names}, prefetch=0)
    assert {n: v[0] for n, v in got.items()} == plain_view(root, names)


RENAMES_C = r'''
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Prints each call's result and errno after it: errno must be the call's own on failure and
   untouched (the sentinel) on success. */
#define SENTINEL 12345
#define CALL(what, expr)                                                                      \
	do {                                                                                  \
		errno = SENTINEL;                                                             \
		int rc = (expr);                                                              \
		printf("%s\t%d\t%d\n", what, rc, errno);                                     \
	} while (0)

int main(int argc, char **argv) {
	const char *root = argv[1], *outside = argv[2];
	char a[4096], b[4096];
	int dfd = open(root, O_RDONLY | O_DIRECTORY);
#define P(buf, name) (snprintf(buf, sizeof buf, "%s/%s", root, name), buf)
	CALL("rename", rename(P(a, "f1"), P(b, "f1.moved")));
	snprintf(a, sizeof a, "%s/n2", outside);
	CALL("rename from outside", rename(a, P(b, "f2")));
	CALL("renameat", renameat(dfd, "f3", dfd, "f4"));
	CALL("renameat2 exchange", renameat2(dfd, "f5", AT_FDCWD, P(b, "f6"), RENAME_EXCHANGE));
	CALL("unlink", unlink(P(a, "f7")));
	CALL("unlinkat", unlinkat(dfd, "f8", 0));
	CALL("remove", remove(P(a, "f9")));
	CALL("truncate", truncate(P(a, "f10"), 3));
	CALL("truncate64", truncate64(P(a, "f11"), 5));
	CALL("remove dir", remove(P(a, "empty")));
	CALL("rename missing", rename(P(a, "missing"), P(b, "x")));
	CALL("renameat2 noreplace", renameat2(dfd, "f12", dfd, "f13", RENAME_NOREPLACE));
	CALL("rename through ..", rename(P(a, "sub/../f13"), P(b, "f13.moved"))); /* opens leave such paths to libc */
	CALL("unlink missing", unlink(P(a, "missing")));
	CALL("unlinkat dir", unlinkat(dfd, "sub", 0));
	CALL("remove missing", remove(P(a, "missing")));
	CALL("truncate missing", truncate(P(a, "missing"), 0));
	return 0;
}
'''


def test_every_wrapped_rename_unlink_and_truncate(cache_options, tmp_path):
    """A C program calls each function the shim wraps to see renames, unlinks and truncates:
    results and errno are the C library's, untouched, and the copies of the files they
    change are dropped (a removed file does not open, a renamed one gives its new bytes)."""
    exe = compile_program(tmp_path, "renames", RENAMES_C, ["rename", "renameat", "renameat2", "unlink", "unlinkat",
                                                           "remove", "truncate", "truncate64"])
    files = {f"f{i}": os.urandom(3000 + 10 * i) for i in range(1, 14)}

    def tree(root, outside):
        outside.mkdir()
        (outside / "n2").write_bytes(b"new bytes from outside")
        (root / "sub").mkdir(parents=True)
        (root / "empty").mkdir()

    # The program once without the shim, on a copy: what its calls return and leave in errno.
    plain_root = tmp_path / "plain"
    tree(plain_root, tmp_path / "plain-outside")
    for name, data in files.items():
        (plain_root / name).write_bytes(data)
    plain = subprocess.run([str(exe), str(plain_root), str(tmp_path / "plain-outside")], capture_output=True,
                           timeout=60)
    assert plain.returncode == 0 and len(plain.stdout.splitlines()) == 17, describe(plain)
    root = tmp_path / "data"
    tree(root, tmp_path / "outside")
    reader = cached_dataset(cache_options, tmp_path, root, files)
    out = fitcache_run(cache_options, [str(root)], [str(exe), str(root), str(tmp_path / "outside")], prefetch=0)
    assert out.returncode == 0, describe(out)
    assert out.stdout.decode() == plain.stdout.decode(), "results or errno differ from the C library's"
    names = sorted(files) + ["f1.moved", "f13.moved"]
    got = run_script(cache_options, [str(root)], reader, {"root": str(root), "names": names}, prefetch=0)
    assert {n: v[0] for n, v in got.items()} == plain_view(root, names)


# --- a function the C library lacks --------------------------------------------------------

CALLS_HIDDEN = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
	char b[4];
	int fd = open(argv[1], O_RDONLY);
	for (int i = 0; i < 2; i++) {
		errno = 0;
		ssize_t got = pread(fd, b, sizeof b, 0);
		printf("pread %zd %d\n", got, got < 0 ? errno : 0);
	}
	errno = 0;
	FILE *f = fopen(argv[1], "r");
	printf("fopen %d %d\n", f != NULL, f ? 0 : errno);
	return 0;
}
"""


def test_a_function_the_c_library_lacks_fails_with_enosys(tmp_path):
    """A program built against a newer C library than it runs on may call a function the shim
    wraps and the C library lacks: the call fails with ENOSYS, as from a kernel without it,
    and the shim says so under FITCACHE_PRELOAD_DEBUG; it never calls through a null pointer
    (it crashed the program before). The shim is built here with a dlsym that finds none of
    the functions named in FITCACHE_TEST_HIDDEN (tests/c/hide_symbols.c)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shim = tmp_path / "libhidden_preload.so"
    build = subprocess.run([cc, "-O2", "-std=gnu11", "-fPIC", "-shared", "-fvisibility=hidden",
                            "-Ddlsym=fitcache_test_dlsym", "-o", str(shim),
                            *(os.path.join(repo, p) for p in ("preload/fitcache_preload.c", "preload/ranges.c", "preload/copies.c",
                                                              "capi/fclookup.c", "tests/c/hide_symbols.c")),
                            "-ldl"], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    exe = compile_program(tmp_path, "calls_hidden", CALLS_HIDDEN, symbols=("pread", "fopen"))
    target = tmp_path / "f.bin"
    target.write_bytes(b"data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITCACHE_")}

    def run(**extra):
        out = subprocess.run([exe, str(target)], env={**env, "LD_PRELOAD": str(shim), **extra},
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"exit {out.returncode}: {out.stderr}"
        return out

    assert run().stdout == "pread 4 0\npread 4 0\nfopen 1 0\n"
    hidden = run(FITCACHE_TEST_HIDDEN="pread,fopen", FITCACHE_PRELOAD_DEBUG="1")
    assert hidden.stdout == f"pread -1 {errno.ENOSYS}\npread -1 {errno.ENOSYS}\nfopen 0 {errno.ENOSYS}\n"
    assert hidden.stderr.count("pread: the C library has no such function") == 2, hidden.stderr
    assert "fopen: the C library has no such function" in hidden.stderr, hidden.stderr
    assert hidden.stderr.count("dlsym found no pread") == 1, "dlsym asked again: " + hidden.stderr


# --- copies of dataset files: cp, install, copy_file_range, sendfile, splice ------------------


def cache_all(cache_options, root, digests):
    """Reads every file under root once under `fitcache run` and waits until all are cached."""
    out = fitcache_run(cache_options, [root], ["sh", "-c", 'cat "$@" > /dev/null', "sh", *files_under(root)],
                       prefetch=0)
    assert out.returncode == 0, describe(out)
    wait_published(cache_options, len(digests))


def assert_same_tree(source, copy):
    """copy holds the files of source with the same bytes (and no others)."""
    want = {os.path.relpath(p, source): sha(d) for p, d in read_all(source).items()}
    got = {os.path.relpath(p, copy): sha(d) for p, d in read_all(copy).items()}
    assert got == want, f"{copy} differs from {source}"


# cp compares fstat of the descriptor it opened with stat of the path, and refused the cached
# copy ("skipping file ..., as it was replaced while being copied", exit 1) before fstat
# reported the source's identity. Each line runs under `fitcache run`; cp -r goes first, so
# that in the cold case it opens every file uncached (answered by the server). The last
# copies standard input, a cached copy that sh opened: /dev/stdin leads to the copy itself.
COPY_COMMANDS = r'''
set -e
src=$1 out=$2 a=$3 b=$4 c=$5 d=$6
cp -r "$src" "$out/tree"
cp "$a" "$out/cp"
cp --reflink=auto "$b" "$out/reflink-auto"
cp -p "$c" "$out/cp-p"
install -m 640 "$a" "$out/install-m"
install -p "$d" "$out/install-p"
cp /dev/stdin "$out/stdin" < "$b"
'''


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_cp_and_install_copy_dataset_files(dataset, cache_options, tmp_path, cache):
    root, digests = dataset
    picks = [os.path.join(root, rel) for rel in sorted(digests)[:4]]
    for i, path in enumerate(picks):  # modes and times that cp -p and install -p must keep
        os.chmod(path, 0o640 if i % 2 else 0o444)
        os.utime(path, ns=(1_500_000_000_123_456_789 + i, 1_600_000_000_987_654_321 + i))
    if cache == "warm":
        cache_all(cache_options, root, digests)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    script = tmp_path / "copies.sh"
    script.write_text(COPY_COMMANDS)
    with OpenCounter(root) as opens:
        out = fitcache_run(cache_options, [root], ["sh", str(script), root, str(out_dir), *picks],
                           prefetch=0, env=command_env(cache_options, FITCACHE_PRELOAD_DEBUG="1"))
        counts = opens.counts()
    assert out.returncode == 0, describe(out)
    # The copies were read from the cache: a warm cache never opened the source, a cold one
    # once per file (the server's read), and the shim handed out cached copies.
    if cache == "warm":
        assert not counts, f"the source was opened: {counts}"
    else:
        assert_each_opened_once(counts, digests)
    served = re.findall(rb": (?:cached in tier \d+|the server answered: fd \d+, origin (?:memory|pmem|nvme|disk)$)",
                        out.stderr, re.M)
    assert len(served) >= len(digests) + 5, f"{len(served)} opens served from the cache\n" + describe(out)
    assert_same_tree(root, out_dir / "tree")
    a, b, c, d = picks
    for name, source in (("cp", a), ("reflink-auto", b), ("cp-p", c), ("install-m", a), ("install-p", d),
                         ("stdin", b)):
        assert (out_dir / name).read_bytes() == open(source, "rb").read(), f"{name}: other bytes than {source}"
    for name, source in (("cp-p", c), ("install-p", d)):
        got, want = os.stat(out_dir / name).st_mtime_ns, os.stat(source).st_mtime_ns
        assert got == want, f"{name}: modification time {got}, the source's {want}"
    assert os.stat(out_dir / "cp-p").st_mode & 0o7777 == os.stat(c).st_mode & 0o7777
    assert os.stat(out_dir / "install-m").st_mode & 0o7777 == 0o640


# Opens each file named on the command line as a program would (open, read-only), says where
# the descriptor leads and whether its identity is its path's (fstat, fstatat and statx with
# AT_EMPTY_PATH, fstat of a dup, the __fxstat64 of older binaries, against stat), then
# copies it into DIR with each call, from the descriptor to a file DIR/<call>-<n>:
# copy_file_range without offsets (moving both file offsets) and with them (moving neither:
# the offsets given are), sendfile without and with an offset, and splice through a pipe.
# Each copy starts 1000 bytes in (or at 0 for a shorter file) and checks the offsets it
# leaves. Last, the descriptor's number, reused by a file of the program's own, must be that
# file. One line per file: its number, the descriptor's path, then "same"/"differs" for each
# identity and "ok"/an error for each copy.
COPY_CALLS = r'''
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#ifdef __x86_64__
#define STAT_VER 1
#else
#define STAT_VER 0
#endif

static const char *dir;

static int out_file(const char *how, int n) {
    char name[4096];
    snprintf(name, sizeof name, "%s/%s-%d", dir, how, n);
    int fd = open(name, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) { perror(name); exit(2); }
    return fd;
}

#define FAIL(what) do { printf(" %s:%s", how, what); goto done; } while (0)
#define ERRNO (snprintf(err, sizeof err, "errno-%d", errno), err)
#define CHECK(cond, what) do { if (!(cond)) FAIL(what); } while (0)

static void copy(const char *how, int in, int n, off_t start, off_t size) {
    char err[32];
    int out = out_file(how, n);
    off_t want = size - start;
    if (lseek(in, start, SEEK_SET) != start) FAIL("lseek");
    off_t got = 0;
    if (!strcmp(how, "cfr")) {
        ssize_t k;
        while ((k = copy_file_range(in, NULL, out, NULL, 70000, 0)) > 0) got += k;
        CHECK(k == 0, ERRNO);
        CHECK(lseek(in, 0, SEEK_CUR) == size && lseek(out, 0, SEEK_CUR) == want, "offsets");
    } else if (!strcmp(how, "cfr-off")) {
        off64_t oin = start, oout = 0;
        ssize_t k;
        while ((k = copy_file_range(in, &oin, out, &oout, 70000, 0)) > 0) got += k;
        CHECK(k == 0, ERRNO);
        CHECK(oin == size && oout == want, "given offsets");
        CHECK(lseek(in, 0, SEEK_CUR) == start && lseek(out, 0, SEEK_CUR) == 0, "file offsets moved");
    } else if (!strcmp(how, "sendfile")) {
        ssize_t k;
        while ((k = sendfile(out, in, NULL, 70000)) > 0) got += k;
        CHECK(k == 0, ERRNO);
        CHECK(lseek(in, 0, SEEK_CUR) == size, "offset");
    } else if (!strcmp(how, "sendfile-off")) {
        off_t o = start;
        ssize_t k;
        CHECK(lseek(in, 0, SEEK_SET) == 0, "lseek");
        while ((k = sendfile(out, in, &o, 70000)) > 0) got += k;
        CHECK(k == 0, ERRNO);
        CHECK(o == size && lseek(in, 0, SEEK_CUR) == 0, "offsets");
    } else {
        int p[2];
        CHECK(pipe(p) == 0, "pipe");
        ssize_t k;
        while ((k = splice(in, NULL, p[1], NULL, 70000, 0)) > 0) {
            for (ssize_t left = k; left > 0;) {
                ssize_t w = splice(p[0], NULL, out, NULL, (size_t)left, 0);
                if (w <= 0) { k = -1; break; }
                left -= w;
            }
            if (k < 0) break;
            got += k;
        }
        close(p[0]);
        close(p[1]);
        CHECK(k == 0, ERRNO);
    }
    CHECK(got == want, "count");
    printf(" %s:ok", how);
done:
    close(out);
}

static const char *same(const struct stat *a, dev_t dev, ino_t ino) {
    return a->st_dev == dev && a->st_ino == ino ? "same" : "differs";
}

int main(int argc, char **argv) {
    dir = argv[1];
    for (int n = 2; n < argc; n++) {
        int in = open(argv[n], O_RDONLY);
        if (in < 0) { perror(argv[n]); return 2; }
        char link[64], target[4096] = "";
        snprintf(link, sizeof link, "/proc/self/fd/%d", in);
        ssize_t len = readlink(link, target, sizeof target - 1);
        target[len > 0 ? len : 0] = 0;
        struct stat path, fd, at;
        struct statx sx;
        if (stat(argv[n], &path) || fstat(in, &fd) || fstatat(in, "", &at, AT_EMPTY_PATH) ||
            statx(in, "", AT_EMPTY_PATH, STATX_BASIC_STATS, &sx)) { perror("stat"); return 2; }
        struct stat x = {0};
        x.st_dev = makedev(sx.stx_dev_major, sx.stx_dev_minor);
        x.st_ino = sx.stx_ino;
        int more = fd.st_size == path.st_size && fd.st_mtim.tv_sec == path.st_mtim.tv_sec &&
                   fd.st_mtim.tv_nsec == path.st_mtim.tv_nsec && fd.st_ctim.tv_sec == path.st_ctim.tv_sec &&
                   fd.st_ctim.tv_nsec == path.st_ctim.tv_nsec && fd.st_mode == path.st_mode;
        /* A duplicate is the same open file; __fxstat64 is what binaries built against glibc
           before 2.33 call (looked up, as the dynamic linker would bind it). */
        struct stat dupped, old;
        int d = dup(in);
        int (*fxstat64)(int, int, struct stat *) = (int (*)(int, int, struct stat *))dlsym(RTLD_DEFAULT, "__fxstat64");
        if (d < 0 || fstat(d, &dupped) || !fxstat64 || fxstat64(STAT_VER, in, &old)) { perror("dup"); return 2; }
        close(d);
        printf("%d %s fstat:%s fstatat:%s statx:%s times-mode:%s dup:%s fxstat64:%s", n - 1, target,
               same(&fd, path.st_dev, path.st_ino), same(&at, path.st_dev, path.st_ino),
               same(&x, path.st_dev, path.st_ino), more ? "same" : "differs", same(&dupped, path.st_dev, path.st_ino),
               same(&old, path.st_dev, path.st_ino));
        off_t start = path.st_size > 1000 ? 1000 : 0;
        copy("cfr", in, n - 1, start, path.st_size);
        copy("cfr-off", in, n - 1, start, path.st_size);
        copy("sendfile", in, n - 1, start, path.st_size);
        copy("sendfile-off", in, n - 1, start, path.st_size);
        copy("splice", in, n - 1, start, path.st_size);
        /* The descriptor's number, closed and reused by a file of the program's own, is that
           file: the source's identity went with the copy. */
        close(in);
        char own[4096];
        snprintf(own, sizeof own, "%s/own-%d", dir, n);
        int o = open(own, O_RDWR | O_CREAT | O_TRUNC, 0644);
        struct stat ost, ofd;
        if (o != in || stat(own, &ost) || fstat(o, &ofd)) { perror("reuse"); return 2; }
        printf(" reused:%s\n", same(&ofd, ost.st_dev, ost.st_ino));
        close(o);
    }
    return 0;
}
'''

COPY_CALL_NAMES = ("cfr", "cfr-off", "sendfile", "sendfile-off", "splice")


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_copy_calls_from_a_dataset_descriptor(dataset, cache_options, tmp_path, cache):
    """copy_file_range, sendfile and splice from the descriptor of a dataset file, cached
    (a tier under /dev/shm, tmpfs) or not yet, to files of another file system (the test's
    directory): copy_file_range across file systems fails with EXDEV in the kernel, which the
    shim turns into a copy. And the descriptor's identity is its path's."""
    root, digests = dataset
    exe = compile_program(tmp_path, "copy_calls", COPY_CALLS,
                          symbols=("copy_file_range", "sendfile", "splice", "fstat", "fstatat", "statx"))
    if cache == "warm":
        cache_all(cache_options, root, digests)
    # Files of several sizes, the largest ones (many copies through the buffer) included.
    rels = sorted(digests, key=lambda r: (os.path.getsize(os.path.join(root, r)), r))[-6:]
    paths = [os.path.join(root, rel) for rel in rels]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert os.stat(out_dir).st_dev != os.stat(os.path.dirname(tier_dirs(cache_options)[0])).st_dev, \
        "the copies must cross file systems: the memory tier and the test directory share one"
    out = fitcache_run(cache_options, [root], [exe, str(out_dir), *paths], prefetch=0)
    assert out.returncode == 0, describe(out)
    tiers = tier_dirs(cache_options)
    lines = out.stdout.decode().splitlines()
    assert len(lines) == len(paths), describe(out)
    for i, (path, line) in enumerate(zip(paths, lines), 1):
        n, target, *results = line.split(" ")
        assert in_tier(target, tiers), f"{path} was opened at {target}, not a cached copy"
        want = [f"{k}:same" for k in ("fstat", "fstatat", "statx", "times-mode", "dup", "fxstat64")] + \
               [f"{how}:ok" for how in COPY_CALL_NAMES] + ["reused:same"]
        assert results == want, f"{path} (opened at {target}): {results}"
        data = open(path, "rb").read()
        start = 1000 if len(data) > 1000 else 0
        for how in COPY_CALL_NAMES:
            assert (out_dir / f"{how}-{i}").read_bytes() == data[start:], f"{how} of {path}: other bytes"


# Opens the dataset file A twice (the first open is asked of the server: the file is not
# cached yet, or not checked in this run's session; the second is a hit the shim finds in
# the tier's index), and B; removes A's record, which the shim's slow way of telling a
# cached copy reads; then compares fstat of both descriptors of A, and statx of the hit,
# with stat of A (device, inode, change time), and fstat of the hit's number once B's
# descriptor was dup2'd over it with stat of B. One line of "what:same"/"what:differs".
IDENTITY_FROM_INDEX = r'''
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

static const char *same(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_ctim.tv_sec == b->st_ctim.tv_sec &&
           a->st_ctim.tv_nsec == b->st_ctim.tv_nsec ? "same" : "differs";
}

int main(int argc, char **argv) {
    int answered = open(argv[1], O_RDONLY), hit = open(argv[1], O_RDONLY), other = open(argv[2], O_RDONLY);
    if (answered < 0 || hit < 0 || other < 0) { perror("open"); return 2; }
    char link[64], copy[4096], rec[4200];
    snprintf(link, sizeof link, "/proc/self/fd/%d", hit);
    ssize_t n = readlink(link, copy, sizeof copy - 1);
    if (n <= 0) { perror("readlink"); return 2; }
    copy[n] = 0;
    char *base = strrchr(copy, '/');
    *base = 0;
    snprintf(rec, sizeof rec, "%s/.rec-%s", copy, base + 1);
    if (unlink(rec) != 0) { perror(rec); return 2; }
    struct stat a, b, got;
    struct statx sx;
    if (stat(argv[1], &a) || stat(argv[2], &b)) { perror("stat"); return 2; }
    printf("answered:%s", fstat(answered, &got) ? "error" : same(&got, &a));
    printf(" hit:%s", fstat(hit, &got) ? "error" : same(&got, &a));
    if (statx(hit, "", AT_EMPTY_PATH, STATX_BASIC_STATS, &sx)) { perror("statx"); return 2; }
    struct stat x = {0};
    x.st_dev = makedev(sx.stx_dev_major, sx.stx_dev_minor);
    x.st_ino = sx.stx_ino;
    x.st_ctim.tv_sec = sx.stx_ctime.tv_sec;
    x.st_ctim.tv_nsec = sx.stx_ctime.tv_nsec;
    printf(" statx:%s", same(&x, &a));
    if (dup2(other, hit) != hit) { perror("dup2"); return 2; }
    printf(" dup2:%s\n", fstat(hit, &got) ? "error" : same(&got, &b));
    return 0;
}
'''


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_fstat_of_a_descriptor_the_shim_opened_needs_no_record(dataset, cache_options, tmp_path, cache):
    """The shim notes what a copy it opens is (from the tier's index: the source's inode and
    change time), for the server's answer as for a hit it found itself, so that fstat of it
    costs the kernel's fstat alone: no readlink, no read of the copy's record. With the record
    gone, both still report the source's identity (the old shim read the record: the copy's
    own). A descriptor of another file dup2'd over the number reports that file's source."""
    root, digests = dataset
    exe = compile_program(tmp_path, "identity_from_index", IDENTITY_FROM_INDEX, symbols=("fstat", "statx", "dup2"))
    if cache == "warm":
        cache_all(cache_options, root, digests)
    a, b = (os.path.join(root, rel) for rel in sorted(digests)[:2])
    out = fitcache_run(cache_options, [root], [exe, a, b], prefetch=0,
                       env=command_env(cache_options, FITCACHE_PRELOAD_DEBUG="1"))
    assert out.returncode == 0, describe(out)
    ways = re.findall(rb": (cached in tier \d+|the server answered: fd \d+, origin [a-z-]+)", out.stderr)
    assert [w.split(b":")[0].split(b" ")[0] for w in ways[:2]] == [b"the", b"cached"], describe(out)
    assert ways[0].rsplit(b" ", 1)[1] in TIER_ORIGINS, f"the server's answer was no cached copy\n{describe(out)}"
    assert out.stdout.decode().split() == ["answered:same", "hit:same", "statx:same", "dup2:same"], describe(out)


# THREADS threads race through opens and closes of the dataset files given and of files of
# their own, so that descriptor numbers pass from a cached copy to another copy or to a file
# of a thread's own many times over: each fstat (and fstat of a dup) must report the identity
# of the file stat of its path gives. Prints the number of fstats that did not.
IDENTITY_UNDER_THREADS = r'''
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#define THREADS 8
#define ROUNDS 400

static int nfiles;
static char **files;
static const char *dir;
static int wrong, failed;

static int check(int fd, const char *path) {
    struct stat want, got;
    if (fd < 0 || stat(path, &want) || fstat(fd, &got)) { __atomic_add_fetch(&failed, 1, __ATOMIC_RELAXED); return 0; }
    return got.st_dev == want.st_dev && got.st_ino == want.st_ino;
}

static void *run(void *arg) {
    long t = (long)arg;
    char own[4096];
    snprintf(own, sizeof own, "%s/own-%ld", dir, t);
    for (int i = 0; i < ROUNDS; i++) {
        const char *f = files[(t * 7 + i) % nfiles];
        int fd = open(f, O_RDONLY), d = fd >= 0 ? dup(fd) : -1;
        int ok = check(fd, f) && check(d, f);
        close(fd);
        close(d);
        int o = open(own, O_RDWR | O_CREAT, 0644);
        ok = check(o, own) && ok;
        close(o);
        if (!ok)
            __atomic_add_fetch(&wrong, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

int main(int argc, char **argv) {
    dir = argv[1];
    files = argv + 2;
    nfiles = argc - 2;
    pthread_t th[THREADS];
    for (long t = 0; t < THREADS; t++)
        pthread_create(&th[t], NULL, run, (void *)t);
    for (int t = 0; t < THREADS; t++)
        pthread_join(th[t], NULL);
    printf("wrong:%d failed:%d\n", wrong, failed);
    return 0;
}
'''


def test_fstat_identity_under_threads(dataset, cache_options, tmp_path):
    """Threads opening and closing cached copies and files of their own at once, descriptor
    numbers passing between them: fstat of each descriptor (and of its dup) names the file
    its path does, never the file another thread had under the number (the shim's notes of
    descriptors are written under a sequence count and checked against the kernel's
    identity of the file)."""
    root, digests = dataset
    exe = compile_program(tmp_path, "identity_threads", IDENTITY_UNDER_THREADS, symbols=("fstat", "dup"),
                          flags=("-pthread",))
    cache_all(cache_options, root, digests)
    out_dir = tmp_path / "own"
    out_dir.mkdir()
    out = fitcache_run(cache_options, [root], [exe, str(out_dir), *files_under(root)], prefetch=0)
    assert out.returncode == 0, describe(out)
    assert out.stdout.decode().split() == ["wrong:0", "failed:0"], describe(out)
