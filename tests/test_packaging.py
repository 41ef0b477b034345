"""The source distribution: what `pip install fitcache` builds from on a node without a wheel.
It must carry every Go package the library and the command import (MANIFEST.in lists them by
hand), and say clearly when Go is missing."""

import os
import shutil
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GO = shutil.which("go")


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The sdist of this tree, unpacked; its directory."""
    out = tmp_path_factory.mktemp("sdist")
    # A fresh egg-info: setuptools adds the files an earlier one listed, which would hide a
    # directory MANIFEST.in lacks.
    egg = tmp_path_factory.mktemp("egg-info")
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(egg),
                    "sdist", "--formats=gztar", "-d", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    (archive,) = out.glob("fitcache-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(out)  # our own archive, just built
    (tree,) = [p for p in out.iterdir() if p.is_dir()]
    return tree


@pytest.mark.skipif(GO is None, reason="needs the Go toolchain")
@pytest.mark.parametrize("args", [["-o", "fitcache-bin", "./cmd/fitcache"],
                                  ["-buildmode=c-shared", "-o", "libfitcache.so", "./capi"]],
                         ids=["command", "library"])
def test_the_sdist_builds_the_command_and_the_library(sdist, args):
    env = dict(os.environ, CGO_ENABLED="1", GOFLAGS="-mod=readonly")
    proc = subprocess.run([GO, "build", "-trimpath", *args], cwd=sdist, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"go build {' '.join(args)} in the sdist failed:\n{proc.stderr}"


def test_without_go_the_sdist_build_says_so(sdist, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FITCACHE_GO"}
    env["PATH"] = str(tmp_path)  # no go here
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path / "build")],
                          cwd=sdist, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "building fitcache needs the Go toolchain" in proc.stderr + proc.stdout
