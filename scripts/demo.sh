#!/usr/bin/env bash
# Installs FitCache (scripts/setup-env.sh) and runs the training demo on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python examples/train_demo.py "$@"
