#!/usr/bin/env bash
# Prepares a fresh Debian machine for FitCache: system packages (PyTorch CPU build, numpy,
# pytest; torchvision, PIL, h5py and lmdb for the transparent-mode tests; mypy; gcc; iptables
# and libnetfilter-queue-dev for bench/netdelay, the link delay of the netns benches), a virtualenv
# at .venv that sees them, and FitCache installed into it with pip (which compiles the Go
# parts and the preload library). Needs Go >= 1.26 on PATH. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(python3-venv python3-torch python3-numpy python3-pytest python3-pytest-forked
          python3-torchvision python3-pil python3-h5py python3-lmdb
          python3-pytest-timeout python3-mypy gcc iptables libnetfilter-queue-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

if ! command -v go >/dev/null; then
  echo "setup: the Go toolchain (1.26 or newer) is needed to build FitCache: https://go.dev/doc/install" >&2
  exit 1
fi

# Debian's python3-torch is built for /usr/bin/python3: the virtualenv uses that interpreter
# and sees the system packages.
if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
.venv/bin/pip install -q --disable-pip-version-check .
echo "setup: FitCache installed in $(pwd)/.venv"
