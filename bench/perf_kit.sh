#!/usr/bin/env bash
# Packs this machine's `perf` with the shared libraries it needs, the C library's own left
# out (the other machine's is used), into DEST (default .device/perf): for a machine that has
# no perf and no network, such as the project's borrowed many-core node, where
# bench/device_sweep.sh runs it from there (PERF_SECTIONS) so that a sweep comes back with
# where the CPU went. It needs a perf here (Debian: apt-get install linux-perf).
#
#   bash bench/perf_kit.sh .device/perf && bash scripts/wheel.sh .device && cp bench/device_sweep.sh .device/
set -euo pipefail
dest=${1:-.device/perf}
perf=$(command -v perf) || { echo "perf_kit.sh: no perf on this machine" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest/lib"
cp -L "$perf" "$dest/perf"
# The C library and the dynamic loader stay the other machine's: a newer glibc runs what an
# older one built, and two C libraries in one process do not mix.
ldd "$perf" | awk '$3 ~ /^\// {print $3}' |
    grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
    while read -r lib; do cp -L "$lib" "$dest/lib/"; done
du -sh "$dest"
