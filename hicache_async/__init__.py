"""hicache_async: an asyncio-native hierarchical KV cache (device, host, shared storage)."""

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

__version__ = "0.1.0"

__all__ = [
    "BackupConfig",
    "CacheClosedError",
    "CacheConfig",
    "ConfigError",
    "HiCacheError",
    "InvalidTokensError",
    "KVLayout",
    "Namespace",
    "OutOfPagesError",
    "PrefetchConfig",
    "StorageConfigError",
    "StorageError",
    "WarmupConfig",
    "WrongThreadError",
    "load_config",
    "page_keys",
    "__version__",
]
