"""Counters the facade keeps, and the frozen records `statistics()` returns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import msgspec

# At run time too: msgspec resolves the field types when a snapshot is decoded or inspected.
from ._pool import PoolStatistics
from .transfer._protocol import CopyStatistics
from .tree._results import TreeStatistics
from .workers._link import StorageStatus

__all__ = ["CacheStatistics", "Counters", "ReadOnlyCounts", "TierTokens"]


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

    def snapshot(self) -> ReadOnlyCounts:
        return ReadOnlyCounts({name: getattr(self, name) for name in self.__slots__})


class ReadOnlyCounts(dict[str, int]):
    """A `dict` of counts that refuses changes: the counters of a frozen snapshot.

    A dict (not a `types.MappingProxyType` or another `Mapping`) so that msgspec, `json.dumps`
    and `isinstance(..., dict)` take it as one and pickle copies it; `copy()` gives a plain,
    mutable dict. Its refusals are its own methods', so `dict`'s called on it directly
    (`dict.__setitem__(counts, k, v)`, `dict.update(counts, ...)`) still change it: nothing
    a dict subclass defines can stop them.
    """

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> ReadOnlyCounts:
        # Filled here, not in __init__: calling __init__ again on a snapshot's counters would
        # otherwise add to them, as dict's does.
        counts = super().__new__(cls)
        dict.update(counts, *args, **kwargs)
        return counts

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Counts as `dict(*args, **kwargs)` gives them (filled by `__new__`)."""

    @classmethod
    def fromkeys(cls, keys: Iterable[str], value: int = 0, /) -> ReadOnlyCounts:  # type: ignore[override]
        """Counts of `value` for each of `keys`."""
        return cls(dict.fromkeys(keys, value))

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("the counters of a statistics snapshot are read-only")

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def copy(self) -> dict[str, int]:
        """A plain, mutable dict of the same counts."""
        return dict(self)

    def __reduce__(self) -> tuple[type[ReadOnlyCounts], tuple[dict[str, int]]]:
        # The default for a dict subclass fills the new object through __setitem__.
        return ReadOnlyCounts, (dict(self),)


class CacheStatistics(msgspec.Struct, frozen=True):
    """A snapshot of a `HiCache`: its counters and each component's own statistics.

    `counters` is a read-only copy (a `ReadOnlyCounts`, a `dict` that refuses changes),
    made for this snapshot or when one is decoded. The pools' and copy engine's records are
    None before the cache is entered; after its close, the pools' are their last.
    """

    state: str
    live_requests: int
    tokens: TierTokens
    counters: Mapping[str, int]
    device_pool: PoolStatistics | None
    host_pool: PoolStatistics | None
    tree: TreeStatistics
    copy_engine: CopyStatistics | None
    storage: StorageStatus | None = None

    def __post_init__(self) -> None:
        # A decoded record (or one built by hand) holds a plain dict: made read-only too.
        if type(self.counters) is not ReadOnlyCounts:
            msgspec.structs.force_setattr(self, "counters", ReadOnlyCounts(self.counters))
