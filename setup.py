"""Builds the fitcache Python package, compiling its Go parts with the Go toolchain:
libfitcache.so (the C interface, loaded with ctypes) and bin/fitcache (the server and the
command-line tool), and with a C compiler libfitcache_preload.so (the LD_PRELOAD library of
`fitcache run`). The wheel is platform-specific."""

import os
import re
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version():
    """The version's single source: FITCACHE_VERSION in capi/fitcache.h."""
    with open(os.path.join(HERE, "capi", "fitcache.h")) as f:
        match = re.search(r'#define FITCACHE_VERSION "([^"]+)"', f.read())
    if not match:
        raise SystemExit("error: no FITCACHE_VERSION in capi/fitcache.h")
    return match.group(1)


def go_binary():
    go = os.environ.get("FITCACHE_GO") or shutil.which("go")
    if not go:
        raise SystemExit(
            "error: building fitcache needs the Go toolchain (go 1.26 or newer) on PATH, or its "
            "path in FITCACHE_GO; see https://go.dev/doc/install")
    return go


def build_native(dest):
    """Compiles libfitcache.so and bin/fitcache into the package directory dest."""
    go = go_binary()
    os.makedirs(os.path.join(dest, "bin"), exist_ok=True)
    flags = ["-trimpath", "-ldflags=-s -w"]
    env = dict(os.environ, CGO_ENABLED="1")
    for args in (["-buildmode=c-shared", "-o", os.path.join(dest, "libfitcache.so"), "./capi"],
                 ["-o", os.path.join(dest, "bin", "fitcache"), "./cmd/fitcache"]):
        print("fitcache: go build", " ".join(args), flush=True)
        subprocess.run([go, "build", *flags, *args], cwd=HERE, env=env, check=True)
    build_preload(dest)
    header = os.path.join(dest, "libfitcache.h")  # Go's generated header; capi/fitcache.h is the contract
    if os.path.exists(header):
        os.remove(header)
    shutil.copy(os.path.join(HERE, "capi", "fitcache.h"), os.path.join(dest, "fitcache.h"))


def build_preload(dest):
    """Compiles libfitcache_preload.so, the LD_PRELOAD library of the transparent mode (C only,
    no Go: see preload/Makefile), into the package directory dest."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise SystemExit("error: building fitcache needs a C compiler (cc or gcc on PATH, or CC)")
    out = os.path.join(dest, "libfitcache_preload.so")
    # The flags of preload/Makefile, which C-only users build with.
    args = [cc, "-O2", "-g", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fPIC", "-shared",
            "-fvisibility=hidden", "-o", out,
            os.path.join("preload", "fitcache_preload.c"), os.path.join("preload", "ranges.c"),
            os.path.join("preload", "copies.c"),
            os.path.join("capi", "fclookup.c"), "-ldl"]
    print("fitcache:", " ".join(args), flush=True)
    subprocess.run(args, cwd=HERE, check=True)


class BuildPyWithGo(build_py):
    def run(self):
        super().run()
        build_native(os.path.join(self.build_lib, "fitcache"))


class BinaryDistribution(Distribution):
    """The package ships native code: make the wheel platform-specific."""

    def has_ext_modules(self):
        return True


try:
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel


# What the sdist builds from it at install time: the library and the command.
GO_MAINS = ["./capi", "./cmd/fitcache"]


def go_packages():
    """The directories of this module's Go packages that GO_MAINS import, as `go list` gives
    them, relative to this directory: the sdist carries them (see GoSdist)."""
    out = subprocess.run([go_binary(), "list", "-deps", "-f", "{{if not .Standard}}{{.Dir}}{{end}}", *GO_MAINS],
                         cwd=HERE, check=True, capture_output=True, text=True).stdout
    dirs = []
    for d in out.split():
        rel = os.path.relpath(d, HERE)
        if not rel.startswith(".."):  # this module's, not a dependency's (go.sum fetches those)
            dirs.append(rel)
    return dirs


class GoSdist(sdist):
    """The sdist carries every Go package of this module that the library and the command
    import, found by `go list` (so that no list kept by hand misses one), besides MANIFEST.in's
    files; tests/test_packaging.py builds both from the sdist."""

    def make_release_tree(self, base_dir, files):
        files = list(files)
        for d in go_packages():
            for name in sorted(os.listdir(os.path.join(HERE, d))):
                path = os.path.join(d, name)
                if os.path.isfile(os.path.join(HERE, path)) and not name.endswith((".so", ".pyc")) and path not in files:
                    files.append(path)
        super().make_release_tree(base_dir, files)


class PlatformWheel(_bdist_wheel):
    """One wheel per platform for every Python 3: the native parts are a shared library loaded
    with ctypes and a program, no CPython extension, so the wheel is tagged py3-none-PLATFORM
    (not cp311-cp311-PLATFORM). `auditwheel repair` then gives it its manylinux tag."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    name="fitcache",
    version=read_version(),
    description="Multi-tier, fault-tolerant cache for deep-learning datasets on HPC file systems",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    package_dir={"": "bindings/python"},
    packages=["fitcache"],
    package_data={"fitcache": ["py.typed"]},
    cmdclass={"build_py": BuildPyWithGo, "bdist_wheel": PlatformWheel, "sdist": GoSdist},
    distclass=BinaryDistribution,
    entry_points={"console_scripts": ["fitcache = fitcache.__main__:main"]},
    extras_require={"torch": ["torch"], "test": ["pytest", "numpy"]},
    zip_safe=False,
)
