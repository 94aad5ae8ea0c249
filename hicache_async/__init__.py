"""hicache_async: an asyncio-native hierarchical KV cache (device, host, shared storage).

The names below are imported on first use: the cache's modules import torch, which takes more
than a second, and a command or a storage-only tool should not pay for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._extras import failed_import as _failed_import

if TYPE_CHECKING:
    from ._allocator import AllocatorStatistics, PageAllocator
    from ._cache import HiCache, MatchInfo
    from ._config import (
        BackupConfig,
        CacheConfig,
        KVLayout,
        PrefetchConfig,
        WarmupConfig,
        load_config,
    )
    from ._errors import (
        CacheClosedError,
        ConfigError,
        HiCacheError,
        InvalidTokensError,
        OutOfPagesError,
        StorageConfigError,
        StorageError,
        WorkersFailedError,
        WrongThreadError,
    )
    from ._keys import Namespace, page_keys
    from ._metrics import prometheus_collector, render_prometheus
    from ._pool import KVPool, PoolStatistics, make_pools
    from ._request import Request
    from ._stats import CacheStatistics, TierTokens
    from .distributed import (
        AgreementMismatch,
        CollectiveError,
        CollectiveTimeout,
        GroupBrokenError,
        RankGroup,
    )
    from .workers import (
        PrefetchHandle,
        PrefetchResult,
        PrefetchStatus,
        StorageStatus,
        WarmupResult,
        WarmupStatus,
    )

__version__ = "0.1.0"

#: public name -> the module (relative to this package) that defines it.
_EXPORTS: dict[str, str] = {
    "AllocatorStatistics": "._allocator",
    "PageAllocator": "._allocator",
    "HiCache": "._cache",
    "MatchInfo": "._cache",
    "BackupConfig": "._config",
    "CacheConfig": "._config",
    "KVLayout": "._config",
    "PrefetchConfig": "._config",
    "WarmupConfig": "._config",
    "load_config": "._config",
    "CacheClosedError": "._errors",
    "ConfigError": "._errors",
    "HiCacheError": "._errors",
    "InvalidTokensError": "._errors",
    "OutOfPagesError": "._errors",
    "StorageConfigError": "._errors",
    "StorageError": "._errors",
    "WorkersFailedError": "._errors",
    "WrongThreadError": "._errors",
    "Namespace": "._keys",
    "page_keys": "._keys",
    "prometheus_collector": "._metrics",
    "render_prometheus": "._metrics",
    "KVPool": "._pool",
    "PoolStatistics": "._pool",
    "make_pools": "._pool",
    "Request": "._request",
    "CacheStatistics": "._stats",
    "TierTokens": "._stats",
    "AgreementMismatch": ".distributed",
    "CollectiveError": ".distributed",
    "CollectiveTimeout": ".distributed",
    "GroupBrokenError": ".distributed",
    "RankGroup": ".distributed",
    "PrefetchHandle": ".workers",
    "PrefetchResult": ".workers",
    "PrefetchStatus": ".workers",
    "StorageStatus": ".workers",
    "WarmupResult": ".workers",
    "WarmupStatus": ".workers",
}


__all__ = [
    "AgreementMismatch",
    "AllocatorStatistics",
    "BackupConfig",
    "CacheStatistics",
    "CollectiveError",
    "CollectiveTimeout",
    "GroupBrokenError",
    "HiCache",
    "MatchInfo",
    "PrefetchHandle",
    "PrefetchResult",
    "PrefetchStatus",
    "RankGroup",
    "Request",
    "StorageStatus",
    "TierTokens",
    "CacheClosedError",
    "CacheConfig",
    "ConfigError",
    "HiCacheError",
    "InvalidTokensError",
    "KVLayout",
    "KVPool",
    "Namespace",
    "OutOfPagesError",
    "PageAllocator",
    "PoolStatistics",
    "PrefetchConfig",
    "StorageConfigError",
    "StorageError",
    "WarmupConfig",
    "WarmupResult",
    "WarmupStatus",
    "WorkersFailedError",
    "WrongThreadError",
    "load_config",
    "make_pools",
    "page_keys",
    "prometheus_collector",
    "render_prometheus",
    "__version__",
]


if not TYPE_CHECKING:
    # Hidden from type checkers, which would otherwise type any misspelt name as Any.
    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        try:
            loaded = importlib.import_module(module, __name__)
        except AttributeError as exc:
            raise _failed_import(name, f"{__name__}{module}", exc) from exc
        value = getattr(loaded, name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
