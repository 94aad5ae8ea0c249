"""Storage (L3): the async backend protocol, the page format and the backends.

`open_storage(url)` builds a backend from a URL (`file:///path`, `memory://`, `redis://`,
`mooncake://` or a plugin). `RedisStorage` and `MooncakeStorage` are importable from here too,
but only load (with their optional dependencies) when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._errors import StorageConfigError
from .._extras import failed_import, missing_module
from ._base import check_get, check_keys, check_metas, check_pages, check_put
from ._file import FileStorage, FileStorageStats, FsyncPolicy, default_root
from ._maintenance import (
    GcReport,
    MaintainableStorage,
    PageInfo,
    RawAccess,
    StreamsPages,
    VerifyReport,
)
from ._manifest import (
    CompactReport,
    ManifestEntry,
    ManifestLimits,
    ManifestRead,
    SupportsManifest,
    WarmupManifest,
)
from ._memory import MemoryStorage
from ._page import (
    HEADER_NBYTES,
    PageCheck,
    PageHeader,
    decode_header,
    encode_header,
    read_value_into,
)
from ._protocol import (
    Outcome,
    PageBuffer,
    PageMeta,
    StorageBackend,
    StorageCapabilities,
    StorageError,
    StorageStats,
    check_stats,
)
from ._registry import ENTRY_POINT_GROUP, StorageFactory, open_storage, storage_schemes

if TYPE_CHECKING:  # at run time these load on first use, with their optional dependencies
    from ._mooncake import MooncakeStorage as MooncakeStorage
    from ._redis import RedisStorage as RedisStorage

__all__ = [
    "ENTRY_POINT_GROUP",
    "HEADER_NBYTES",
    "CompactReport",
    "FileStorage",
    "FileStorageStats",
    "FsyncPolicy",
    "GcReport",
    "MaintainableStorage",
    "ManifestEntry",
    "ManifestLimits",
    "ManifestRead",
    "MemoryStorage",
    "Outcome",
    "PageBuffer",
    "PageCheck",
    "PageHeader",
    "PageInfo",
    "PageMeta",
    "RawAccess",
    "StorageBackend",
    "StorageCapabilities",
    "StorageConfigError",
    "StorageError",
    "StorageFactory",
    "StorageStats",
    "StreamsPages",
    "SupportsManifest",
    "VerifyReport",
    "check_keys",
    "check_metas",
    "check_get",
    "check_pages",
    "check_put",
    "check_stats",
    "WarmupManifest",
    "decode_header",
    "default_root",
    "encode_header",
    "read_value_into",
    "open_storage",
    "storage_schemes",
]

# Not in __all__: `import *` must not pull in optional dependencies. Each with the extra
# that installs what its module imports.
_LAZY = {
    "RedisStorage": ("hicache_async.storage._redis", "redis"),
    "MooncakeStorage": ("hicache_async.storage._mooncake", "mooncake"),
}


if not TYPE_CHECKING:
    # Hidden from type checkers, which would otherwise type any misspelt name as Any.
    def __getattr__(name: str) -> Any:
        lazy = _LAZY.get(name)
        if lazy is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module_name, extra = lazy
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] == "hicache_async":
                raise
            raise missing_module(name, exc, extra) from exc
        except AttributeError as exc:
            raise failed_import(name, module_name, exc) from exc
        value = getattr(module, name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
