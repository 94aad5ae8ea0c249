"""The cooperative workers: prefetch (storage → host) and backup (host → storage)."""

from ._backup import BackupStatistics, BackupWorker
from ._link import StorageLink, StorageStatus
from ._prefetch import (
    Prefetcher,
    PrefetchHandle,
    PrefetchResult,
    PrefetchStatistics,
    PrefetchStatus,
)
from ._warmup import Warmer, WarmupResult, WarmupStatus

__all__ = [
    "BackupStatistics",
    "BackupWorker",
    "PrefetchHandle",
    "PrefetchResult",
    "PrefetchStatistics",
    "PrefetchStatus",
    "Prefetcher",
    "StorageLink",
    "StorageStatus",
    "Warmer",
    "WarmupResult",
    "WarmupStatus",
]
