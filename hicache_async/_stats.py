"""Counters the facade keeps, and the frozen records `statistics()` returns."""

from __future__ import annotations

import msgspec

# At run time too: msgspec resolves the field types when a snapshot is decoded or inspected.
from ._pool import PoolStatistics
from .transfer._protocol import CopyStatistics
from .tree._results import TreeStatistics
from .workers._link import StorageStatus

__all__ = ["CacheStatistics", "Counters", "TierTokens"]


class TierTokens(msgspec.Struct, frozen=True):
    """Token counts by tier, as each tier saw them (the tiers overlap).

    `device` and `host`: tokens matched in that pool when requests started (`host` includes
    pages a prefetch had just brought from storage). `storage`: tokens prefetches and warmup
    read from storage. `computed`: tokens requests computed and committed.
    """

    device: int
    host: int
    storage: int
    computed: int


class Counters:
    """Mutable counters, touched only on the owning loop (so plain ints suffice)."""

    __slots__ = (
        "copy_failures",
        "device_evicted_pages",
        "host_backup_pages",
        "host_backups_skipped",
        "host_evicted_pages",
        "loaded_pages",
        "pages_committed",
        "pages_duplicate",
        "requests",
        "tokens_computed",
        "tokens_device",
        "tokens_host",
        "tokens_requested",
        "tokens_storage",
    )

    def __init__(self) -> None:
        self.copy_failures = 0
        self.device_evicted_pages = 0
        self.host_backup_pages = 0
        self.host_backups_skipped = 0
        self.host_evicted_pages = 0
        self.loaded_pages = 0
        self.pages_committed = 0
        self.pages_duplicate = 0
        self.requests = 0
        self.tokens_computed = 0
        self.tokens_device = 0
        self.tokens_host = 0
        self.tokens_requested = 0
        self.tokens_storage = 0

    def snapshot(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class CacheStatistics(msgspec.Struct, frozen=True):
    """A snapshot of a `HiCache`: its counters and each component's own statistics.

    `counters` is a copy, made for this snapshot. The pools' and copy engine's records are
    None before the cache is entered; after its close, the pools' are their last.
    """

    state: str
    live_requests: int
    tokens: TierTokens
    counters: dict[str, int]
    device_pool: PoolStatistics | None
    host_pool: PoolStatistics | None
    tree: TreeStatistics
    copy_engine: CopyStatistics | None
    storage: StorageStatus | None = None
