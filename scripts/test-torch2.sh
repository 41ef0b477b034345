#!/usr/bin/env bash
# Runs the Python binding's dataset tests against the current PyPI torch (2.x), whose
# DataLoader fetches batches with __getitems__, in a virtualenv of its own (.venv-torch2), beside
# CI's default run against Debian's torch 1.13 (scripts/test.sh). Not part of CI: PyPI's torch
# is a CUDA build of several GB (it runs on the CPU). pytest stays below 8, as in Debian 12:
# pytest-forked fails every test under pytest 9. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-torch2/bin/python ]; then
  python3 -m venv .venv-torch2
fi
.venv-torch2/bin/pip install -q --disable-pip-version-check torch numpy "pytest<8" pytest-forked pytest-timeout
.venv-torch2/bin/pip install -q --disable-pip-version-check .
echo "torch $(.venv-torch2/bin/python -c 'import torch; print(torch.__version__)')"
cd tests
exec ../.venv-torch2/bin/python -m pytest -v test_dataset.py "$@"
