# Spack package recipe for FitCache: `spack install fitcache` builds the Python package (its Go
# library and `fitcache` command, and the C preload library) from a release's sdist, and
# `spack load fitcache` (or the module Spack generates) puts the command on PATH and the package
# on PYTHONPATH. Copy this directory into a Spack repository (`spack repo add`), or into
# var/spack/repos/builtin/packages/fitcache/. Sites without Spack install the manylinux wheel
# (README, "Python").

from spack.package import *


class Fitcache(PythonPackage):
    """Multi-tier, fault-tolerant cache for deep-learning datasets on HPC file systems: files
    cached on each node's memory and NVMe tiers, spread over the job's nodes by a hash ring,
    read by PyTorch (FitCacheDataset), C (libfitcache) and unmodified programs (fitcache run)."""

    homepage = "https://github.com/fitcache/fitcache"
    pypi = "fitcache/fitcache-0.1.0.tar.gz"

    maintainers("fitcache")
    license("Apache-2.0")

    version("0.1.0")

    depends_on("python@3.9:", type=("build", "run"))
    depends_on("py-setuptools@61:", type="build")
    depends_on("go@1.26:", type="build")  # the library and the command are Go
    depends_on("c", type="build")  # the preload library, and cgo

    variant("torch", default=False, description="FitCacheDataset as a torch Dataset")
    depends_on("py-torch", type=("build", "run"), when="+torch")

    def setup_build_environment(self, env):
        # setup.py finds Go on PATH, or at FITCACHE_GO.
        env.set("FITCACHE_GO", self.spec["go"].prefix.bin.go)
        env.set("GOFLAGS", "-trimpath")
