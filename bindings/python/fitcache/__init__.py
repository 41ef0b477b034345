"""FitCache: a multi-tier, fault-tolerant cache for deep-learning datasets.

    from fitcache import FitCacheDataset
    ds = FitCacheDataset("/path/to/dataset", transform=decode)

See the README for configuration, the C interface and how it works.
"""

import importlib.metadata as _metadata
from typing import Any

from ._native import (Client, FitCacheError, ForkedAfterLoad, IsADirectory, NotADirectory,
                      NotFound, PermissionDenied, version)
# The dataset module imports torch (a second or more): it is loaded on first use, so that the
# `fitcache` command (which runs the Go program, see __main__) starts at once.
_DATASET_NAMES = ("FitCacheDataset", "list_files", "prefetch_files", "server_stats")


def __getattr__(name: str) -> Any:
    if name in _DATASET_NAMES:
        from . import dataset
        return getattr(dataset, name)
    raise AttributeError(f"module 'fitcache' has no attribute {name!r}")


try:  # the installed distribution's version, which setup.py takes from capi/fitcache.h
    __version__ = _metadata.version("fitcache")
except _metadata.PackageNotFoundError:  # pragma: no cover - a source tree on sys.path
    __version__ = "0+unknown"

__all__ = [
    "Client", "FitCacheDataset", "FitCacheError", "ForkedAfterLoad", "IsADirectory",
    "NotADirectory", "NotFound", "PermissionDenied", "list_files", "prefetch_files", "server_stats", "version",
]
