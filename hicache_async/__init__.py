"""hicache_async: an asyncio-native hierarchical KV cache (device, host, shared storage)."""

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
    "WrongThreadError",
    "load_config",
    "make_pools",
    "page_keys",
    "prometheus_collector",
    "render_prometheus",
    "__version__",
]
