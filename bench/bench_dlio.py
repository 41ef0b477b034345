#!/usr/bin/env python3
"""MLPerf Storage's DLIO benchmark under the transparent mode: the `indexed_binary` and
`mmap_indexed_binary` workloads (the formats of Megatron-DeepSpeed's datasets), whose few
LARGE files are read by ranges: each sample is one (offset, size) range of a data file, named
by the file's index files (<file>.off.idx and <file>.sz.idx, int64 each). DLIO is run
unchanged, from its own virtualenv (--dlio-python; PyPI's dlio-benchmark 2.0.0 with
tensorflow-cpu, see "Setup" below), with its TensorFlow data loader (tf.data over its reader,
--read-threads threads), --epochs training epochs of --files files of --samples samples of
--record-bytes each, --batch-size samples a step and --computation-time seconds of simulated
computation a step (a sleep). The samples of a file are read in a random order (DLIO's
sample_shuffle=seed), the files in order; one open of each file per epoch.

  indexed_binary       DLIO's IndexedBinaryReader: open(), then seek + readinto of each sample
  mmap_indexed_binary  DLIO's IndexedBinaryMMapReader: np.memmap of the file, a slice per sample.
                       In dlio-benchmark 2.0.0 this reader maps the index files as uint8
                       instead of int64 (offsets and sizes of 0..255 bytes) and only slices the
                       map, which touches no page: it reads next to nothing. --mmap-reader
                       fixed runs it with a corrected reader instead (a subclass passed by
                       DLIO's reader_classname: int64 index, each sample copied out of the
                       map), which reads every sample's pages.

Configurations, in each of --repeats rounds (medians reported):

  plain     DLIO reading the files directly. The files are read once before the round, so
            they are in the page cache (warm: this measures FitCache's overhead against the
            page cache, not a slow source); --drop-caches drops the page cache instead,
            before each configuration (then the source is the device, or a PFS under --data).
  fitcache  the same command under `fitcache run --data DIR --prefetch 0 --` with a new
            private cache: FITCACHE_RUNTIME_DIR a new directory, FITCACHE_TIERS one memory
            tier in a new directory under --tier-parent (default /dev/shm) of --tier-bytes
            (default 1.5 times the dataset, so that every file fits; smaller, files that do
            not fit are served by ranges from the server's blocks). Epoch 1 is then cold
            (the copies are made while DLIO reads), epochs 2+ warm. The server is stopped
            (`fitcache stop`) and the tier removed after the run.

DLIO gets an environment without LD_PRELOAD, PYTHONPATH or any FITCACHE_* variable of the
caller's (only what the fitcache configuration sets). Figures come from DLIO's own output
files, in a new output folder per run: summary.json (per-epoch AU % and throughput in
samples/s, metric.train_au_percentage and metric.train_throughput_samples_per_second) and
per_epoch_stats.json (per-epoch durations in s); wall is the whole DLIO process (TensorFlow's
import included). Ratios are throughputs against plain measured in the same round.

The dataset is generated once by DLIO itself (workflow.generate_data, without FitCache) under
--data, in a directory named after its shape; the mmap_indexed_binary one is hard links to
the indexed_binary files (same bytes, the names DLIO expects). DLIO 2.0.0 generates at about
8 s per 64 MiB on this machine (2 cores), so 2 GiB takes about 4 minutes, once.

Setup (a virtualenv of its own; dlio-benchmark 2.0.0 requires nvidia-dali-cuda110, which
only installs from NVIDIA's index, and torch, so it is installed without its dependencies):

    apt-get update && apt-get install -y libopenmpi-dev openmpi-bin
    python3.11 -m venv /work/dlio-venv
    /work/dlio-venv/bin/pip install --no-deps dlio-benchmark==2.0.0
    /work/dlio-venv/bin/pip install 'Pillow>=9.3.0' 'PyYAML>=6.0.0' 'h5py>=3.11.0' \\
        'mpi4py>=3.1.4' 'numpy>=1.23.5' 'omegaconf>=2.2.0' 'pandas>=1.5.1' 'psutil>=5.9.8' \\
        'pydftracer==1.0.2' 'hydra-core>=1.3.2' tensorflow-cpu

Run:

    .venv/bin/python bench/bench_dlio.py --out bench/results/dlio-indexed.json
    .venv/bin/python bench/bench_dlio.py --format mmap_indexed_binary --mmap-reader fixed \\
        --out bench/results/dlio-mmap.json
    .venv/bin/python bench/bench_dlio.py --files 2 --samples 64 --epochs 1 --repeats 1   # smoke
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAIN_VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"

# --mmap-reader fixed: DLIO's mmap reader with the index read as int64 and each sample copied
# out of the map (as Megatron's MMapIndexedDataset hands samples to the model).
FIXED_MMAP_READER = r'''
import numpy as np
from dlio_benchmark.reader.indexed_binary_mmap_reader import IndexedBinaryMMapReader


class FixedMMapReader(IndexedBinaryMMapReader):
    def load_index_file(self, global_sample_idx, filename, sample_index):
        if filename not in self.file_map_ibr:
            self.file_map_ibr[filename] = [
                np.memmap(self.index_file_path_off(filename), dtype=np.int64, mode="r"),
                np.memmap(self.index_file_path_size(filename), dtype=np.int64, mode="r")]

    def get_sample(self, filename, sample_index):
        buffer = self.buffer_map[filename]
        offset = int(self.file_map_ibr[filename][0][sample_index])
        size = int(self.file_map_ibr[filename][1][sample_index])
        np.array(buffer[offset:offset + size])  # reads the pages
'''


def parse_size(text):
    """'512MiB', '2GiB', '1.5G' or a number of bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text}")
    return int(float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()))


def fitcache_binary(args):
    if args.fitcache_bin:
        return args.fitcache_bin
    try:
        import fitcache
        return fitcache._native.server_binary()
    except ImportError:
        out = subprocess.run([str(MAIN_VENV_PYTHON), "-c", "import fitcache; print(fitcache._native.server_binary())"],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.strip()


def clean_env():
    """The caller's environment less the preload, FitCache's variables and PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "PYTHONPATH") and not k.startswith("FITCACHE_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def dataset_options(args, folder, fmt):
    return ["workload=default",
            "++workload.framework=tensorflow", "++workload.reader.data_loader=tensorflow",
            f"++workload.dataset.format={fmt}", f"++workload.dataset.data_folder={folder}",
            f"++workload.dataset.num_files_train={args.files}", "++workload.dataset.num_files_eval=0",
            f"++workload.dataset.num_samples_per_file={args.samples}",
            f"++workload.dataset.record_length={args.record_bytes}",
            "++workload.dataset.num_subfolders_train=0", "++workload.dataset.num_subfolders_eval=0"]


def dlio_command(args, folder, fmt, out):
    cmd = [args.dlio_python, "-m", "dlio_benchmark.main", *dataset_options(args, folder, fmt),
           "++workload.workflow.generate_data=False", "++workload.workflow.train=True",
           "++workload.workflow.evaluation=False", "++workload.workflow.checkpoint=False",
           "++workload.workflow.profiling=False",
           f"++workload.train.epochs={args.epochs}",
           f"++workload.train.computation_time={args.computation_time}",
           f"++workload.reader.batch_size={args.batch_size}",
           f"++workload.reader.read_threads={args.read_threads}",
           f"++workload.reader.sample_shuffle={'off' if args.no_shuffle else 'seed'}",
           f"++workload.output.folder={out}", f"hydra.run.dir={out}"]
    if fmt == "mmap_indexed_binary" and args.mmap_reader == "fixed":
        cmd.append("++workload.reader.reader_classname=bench_dlio_reader.FixedMMapReader")
    return cmd


def generate(args, root):
    """The indexed_binary dataset under root/indexed_binary (DLIO's generator, once), and the
    mmap_indexed_binary one as hard links to it; returns the format's folder."""
    ib = root / "indexed_binary"
    if not (ib / "complete").exists():
        shutil.rmtree(ib, ignore_errors=True)
        ib.mkdir(parents=True)
        t = time.monotonic()
        # 64 MiB a write: DLIO 2.0.0 packs its buffer with struct.pack('B' * n, *records),
        # which takes about 40 bytes of memory per byte of buffer.
        cmd = [args.dlio_python, "-m", "dlio_benchmark.main", *dataset_options(args, ib, "indexed_binary"),
               "++workload.workflow.generate_data=True", "++workload.workflow.train=False",
               "++workload.workflow.evaluation=False", "++workload.workflow.checkpoint=False",
               f"++workload.dataset.generation_buffer_size={64 << 20}",
               f"++workload.output.folder={root / 'generate-log'}", f"hydra.run.dir={root / 'generate-log'}"]
        print(f"generating {args.files} x {args.samples * args.record_bytes >> 20} MiB under {ib} with DLIO...",
              flush=True)
        out = subprocess.run(cmd, env=clean_env(), cwd=root, capture_output=True, text=True, timeout=args.timeout)
        if out.returncode != 0:
            sys.exit(f"DLIO's generation failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        (ib / "valid").mkdir(exist_ok=True)
        (ib / "complete").write_text(json.dumps({"seconds": time.monotonic() - t, "command": cmd}))
        print(f"generated in {time.monotonic() - t:.0f} s", flush=True)
    if args.format == "indexed_binary":
        return ib
    mm = root / "mmap_indexed_binary"
    if not (mm / "complete").exists():
        shutil.rmtree(mm, ignore_errors=True)
        (mm / "train").mkdir(parents=True)
        (mm / "valid").mkdir()
        for f in sorted((ib / "train").iterdir()):
            os.link(f, mm / "train" / f.name.replace(".indexed_binary", ".mmap_indexed_binary"))
        (mm / "complete").write_text("hard links to ../indexed_binary\n")
    return mm


def warm(folder):
    for p in sorted((folder / "train").iterdir()):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def drop_caches():
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def results(out, wall):
    summary = json.loads((out / "summary.json").read_text())
    epochs = json.loads((out / "per_epoch_stats.json").read_text())
    metric = summary["metric"]
    return {"epoch_s": [float(epochs[k]["duration"]) for k in sorted(epochs, key=int)],
            "throughput": list(metric["train_throughput_samples_per_second"]),
            "au": list(metric["train_au_percentage"]), "wall_s": wall}


def run_dlio(prefix, folder, args, work, name, env):
    out = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    cmd = [*prefix, *dlio_command(args, folder, args.format, out)]
    t = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t
    (out / "stdout.txt").write_text(proc.stdout)
    (out / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0 or not (out / "summary.json").exists():
        sys.exit(f"{name}: DLIO exited {proc.returncode} (output in {out}); command:\n  {' '.join(cmd)}\n"
                 f"stderr (end):\n{proc.stderr[-4000:]}\nstdout (end):\n{proc.stdout[-2000:]}")
    row = results(out, wall)
    row["exit"] = proc.returncode
    return row


def dataset_bytes(folder):
    return sum(p.stat().st_size for p in (folder / "train").iterdir())


def fitcache_round(folder, args, work, env):
    fc = fitcache_binary(args)
    tier = Path(tempfile.mkdtemp(prefix="fitcache-bench-dlio-", dir=args.tier_parent))
    runtime = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    budget = args.tier_bytes or int(dataset_bytes(folder) * 1.5)
    env = {**env, "FITCACHE_RUNTIME_DIR": str(runtime),
           "FITCACHE_TIERS": f"memory:{tier}:{-(-budget // (1 << 20))}MiB"}
    try:
        row = run_dlio([fc, "run", "--data", str(folder), "--prefetch", "0", "--"], folder, args, work,
                       "fitcache", env)
        stats = subprocess.run([fc, "stats", "--json"], env=env, capture_output=True, text=True, timeout=30)
        stats = json.loads(stats.stdout) if stats.returncode == 0 else {}
        row["server"] = {k: stats.get(k) for k in ("hits", "misses", "source_reads", "source_bytes",
                                                    "bytes_served", "published", "uncached", "errors",
                                                    "client_hits")}
    finally:
        stop = subprocess.run([fc, "stop"], env=env, capture_output=True, text=True, timeout=60)
        shutil.rmtree(tier, ignore_errors=True)
    if stop.returncode != 0:
        sys.exit(f"fitcache stop exited {stop.returncode}: {stop.stderr}")
    return row


def summarize(row):
    later = row["throughput"][1:] or row["throughput"]
    return {"epoch1_s": row["epoch_s"][0], "later_s": statistics.mean(row["epoch_s"][1:] or row["epoch_s"]),
            "epoch1_sps": row["throughput"][0], "later_sps": statistics.mean(later),
            "au": statistics.mean(row["au"]), "wall_s": row["wall_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dlio-python", default="/work/dlio-venv/bin/python",
                    help="the python of a virtualenv with dlio-benchmark and tensorflow-cpu")
    ap.add_argument("--data", default="/var/tmp/fitcache-bench-dlio", help="where the datasets are kept")
    ap.add_argument("--format", choices=["indexed_binary", "mmap_indexed_binary"], default="indexed_binary")
    ap.add_argument("--mmap-reader", choices=["dlio", "fixed"], default="dlio",
                    help="mmap_indexed_binary: DLIO 2.0.0's reader as it is, or the corrected one (see above)")
    ap.add_argument("--files", type=int, default=8, help="data files")
    ap.add_argument("--samples", type=int, default=256, help="samples per file")
    ap.add_argument("--record-bytes", type=int, default=1 << 20, help="bytes per sample (a square of a whole number)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--read-threads", type=int, default=1)
    ap.add_argument("--computation-time", type=float, default=0.005, help="simulated seconds of computation a step")
    ap.add_argument("--no-shuffle", action="store_true", help="read the samples of a file in order")
    ap.add_argument("--tier-parent", default="/dev/shm", help="where the memory tier is made (a tmpfs)")
    ap.add_argument("--tier-bytes", type=parse_size, help="the memory tier's size (default: 1.5x the dataset)")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each configuration")
    ap.add_argument("--fitcache-bin", help="the fitcache binary (default: the one of this checkout's .venv)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds allowed to one DLIO run")
    ap.add_argument("--out", help="JSON results")
    args = ap.parse_args()
    r = args.record_bytes
    if int(r ** 0.5) ** 2 != r:
        sys.exit("--record-bytes must be a square (DLIO makes samples of dimension x dimension bytes)")
    root = Path(args.data) / f"ib-{args.files}x{args.samples}x{r}"
    root.mkdir(parents=True, exist_ok=True)
    folder = generate(args, root)
    size = dataset_bytes(folder)
    configs = ["plain", "fitcache"]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="fitcache-bench-dlio-") as work:
        env = clean_env()
        if args.format == "mmap_indexed_binary" and args.mmap_reader == "fixed":
            (Path(work) / "bench_dlio_reader.py").write_text(FIXED_MMAP_READER)
            env["PYTHONPATH"] = work
        for _ in range(args.repeats):
            row = {}
            for c in configs:
                if args.drop_caches:
                    drop_caches()
                else:
                    warm(folder)
                row[c] = run_dlio([], folder, args, work, c, env) if c == "plain" else \
                    fitcache_round(folder, args, work, env)
            rounds.append(row)
            print(json.dumps(row), flush=True)
    per = {c: [summarize(r[c]) for r in rounds] for c in configs}
    keys = ("epoch1_s", "later_s", "epoch1_sps", "later_sps", "au", "wall_s")
    med = {c: {k: statistics.median(s[k] for s in per[c]) for k in keys} for c in configs}
    for c in configs:
        for k in ("epoch1_sps", "later_sps"):
            med[c][k + "_vs_plain"] = statistics.median(
                p[k] / q[k] for p, q in zip(per[c], per["plain"]))
    results_ = {"args": vars(args), "dataset_bytes": size, "dataset": str(folder), "rounds": rounds,
                "medians": med, "loadavg": open("/proc/loadavg").read().split()[:3]}
    reader = f", {args.mmap_reader} reader" if args.format == "mmap_indexed_binary" else ""
    print(f"\nDLIO {args.format}{reader}: {args.files} files x {args.samples} samples of {r >> 10} KiB "
          f"({size / (1 << 30):.2f} GiB), batch {args.batch_size}, {args.computation_time * 1e3:g} ms "
          f"computation a step, {args.epochs} epochs, page cache {'dropped' if args.drop_caches else 'warm'}; "
          f"medians of {args.repeats} rounds\n")
    print("| configuration | epoch 1 s | epochs 2+ s | epoch 1 samples/s | epochs 2+ samples/s | "
          "AU % | wall s | epoch 1 vs plain | epochs 2+ vs plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in configs:
        m = med[c]
        later = f"{m['later_s']:.2f}" if args.epochs > 1 else "-"
        later_sps = f"{m['later_sps']:.1f}" if args.epochs > 1 else "-"
        later_ratio = f"{m['later_sps_vs_plain']:.2f}x" if args.epochs > 1 else "-"
        print(f"| {c} | {m['epoch1_s']:.2f} | {later} | {m['epoch1_sps']:.1f} | {later_sps} | {m['au']:.1f} | "
              f"{m['wall_s']:.1f} | {m['epoch1_sps_vs_plain']:.2f}x | {later_ratio} |")
    servers = [r["fitcache"].get("server", {}) for r in rounds]
    print("\nfitcache server per round: " + "; ".join(
        f"published {s.get('published')}, source reads {s.get('source_reads')}, misses {s.get('misses')}, "
        f"uncached {s.get('uncached')}, errors {s.get('errors')}" for s in servers))
    if args.out:
        Path(args.out).write_text(json.dumps(results_, indent=2))


if __name__ == "__main__":
    main()
