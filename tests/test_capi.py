"""Compiles the C test programs against the installed libfitcache and runs them."""

import os
import subprocess

import pytest


def compile_c(tmp_path, source, lib, *extra):
    libdir = os.path.dirname(lib)
    exe = tmp_path / os.path.basename(source).replace(".c", "")
    here = os.path.join(os.path.dirname(__file__), "c", source)
    cmd = ["cc", "-std=c11", "-Wall", "-Werror", "-o", str(exe), here, f"-I{libdir}", *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return str(exe)


@pytest.fixture
def c_dataset(tmp_path):
    root = tmp_path / "cdata"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(os.urandom(300_000))
    (root / "empty.bin").write_bytes(b"")
    return str(root)


def c_env(cache_options):
    return {**os.environ, **{"FITCACHE_" + k.upper(): v for k, v in cache_options.items()}}


def test_c_interface(tmp_path, native_library, c_dataset, cache_options):
    libdir = os.path.dirname(native_library)
    exe = compile_c(tmp_path, "capi_test.c", native_library, f"-L{libdir}", "-lfitcache",
                    f"-Wl,-rpath,{libdir}")
    out = subprocess.run([exe, c_dataset], capture_output=True, text=True, timeout=120, env=c_env(cache_options))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout


def test_c_fork_before_load(tmp_path, native_library, c_dataset, cache_options):
    exe = compile_c(tmp_path, "fork_before_load.c", native_library, "-ldl")
    out = subprocess.run([exe, native_library, c_dataset], capture_output=True, text=True, timeout=120,
                         env=c_env(cache_options))
    assert out.returncode == 0, out.stdout + out.stderr


def test_version_has_one_source(native_library):
    """capi/fitcache.h defines the version; the library, the installed header and the Python
    package report that one."""
    import re

    import fitcache
    with open(os.path.join(os.path.dirname(native_library), "fitcache.h")) as f:
        header = re.search(r'#define FITCACHE_VERSION "([^"]+)"', f.read()).group(1)
    assert fitcache.version() == header
    assert fitcache.__version__ == header
