"""FitCache: a multi-tier, fault-tolerant cache for deep-learning datasets.

    from fitcache import FitCacheDataset
    ds = FitCacheDataset("/path/to/dataset", transform=decode)

See the README for configuration, the C interface and how it works.
"""

from ._native import (Client, FitCacheError, ForkedAfterLoad, IsADirectory, NotADirectory,
                      NotFound, PermissionDenied, version)
from .dataset import FitCacheDataset, list_files, prefetch_files, server_stats

__version__ = "0.1.0"

__all__ = [
    "Client", "FitCacheDataset", "FitCacheError", "ForkedAfterLoad", "IsADirectory",
    "NotADirectory", "NotFound", "PermissionDenied", "list_files", "prefetch_files", "server_stats", "version",
]
