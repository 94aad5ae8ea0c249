"""The `hicache_async` pytest plugin (installed with the `testing` extra).

Fixtures for users' own suites, so they drive scenarios the way hicache_async's tests do:

- `hicache_config`: a small `CacheConfig`; override the fixture to change it.
- `kv_generator`: the KV oracle for that config.
- `hicache`: an open `HiCache` over bounded in-memory storage.
- `hicache_file`: an open `HiCache` over file storage in the test's temporary directory.
- `faulty_storage`: a factory wrapping any backend in fault injection.
- `redis_server`, `redis_url`: a real redis-server on a free loopback port (session-scoped).

The async fixtures need pytest-asyncio; without it only the synchronous ones are defined.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# Imports of the library happen inside the fixtures: pytest loads this plugin in every run
# where hicache_async is installed, and should not pay for importing torch unless used.
if TYPE_CHECKING:
    from .._cache import HiCache
    from .._config import CacheConfig
    from ..storage import StorageBackend
    from ._faults import FaultyStorage
    from ._kvgen import KVGenerator
    from ._servers import RedisServer

__all__ = [
    "faulty_storage",
    "hicache_config",
    "kv_generator",
    "redis_server",
    "redis_url",
]


@pytest.fixture
def hicache_config() -> CacheConfig:
    """A small configuration: pools of a few dozen pages, so eviction happens early."""
    from .._config import CacheConfig

    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
            "page_size": 8,
            "device_pages": 64,
            "host_pages": 256,
            "model_id": "pytest",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": 8},
        }
    )


@pytest.fixture
def kv_generator(hicache_config: CacheConfig) -> KVGenerator:
    """The oracle: KV bytes as a function of token ids, position, layer, head and layout."""
    from ._kvgen import KVGenerator

    return KVGenerator(hicache_config.layout, hicache_config.page_size)


@pytest.fixture
def faulty_storage() -> Callable[..., FaultyStorage]:
    """`faulty_storage(inner, seed=..., error_rate=..., ...)` → a FaultyStorage."""

    def make(inner: StorageBackend, **rates: Any) -> FaultyStorage:
        from ._faults import FaultyStorage

        return FaultyStorage(inner, **rates)

    return make


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port for the whole session."""
    from ._servers import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


try:
    import pytest_asyncio

    _HAVE_PYTEST_ASYNCIO = True
except ImportError:  # pragma: no cover - the testing extra brings it
    _HAVE_PYTEST_ASYNCIO = False

if _HAVE_PYTEST_ASYNCIO:

    @pytest_asyncio.fixture
    async def hicache(hicache_config: CacheConfig) -> AsyncIterator[HiCache]:
        """An open cache over 64 MiB of in-memory storage."""
        from .._cache import HiCache
        from ..storage import MemoryStorage

        async with HiCache(hicache_config, storage=MemoryStorage(capacity_bytes=64 << 20)) as c:
            yield c

    @pytest_asyncio.fixture
    async def hicache_file(hicache_config: CacheConfig, tmp_path: Path) -> AsyncIterator[HiCache]:
        """An open cache over file storage in the test's temporary directory."""
        from .._cache import HiCache
        from ..storage import FileStorage

        root = tmp_path / "hicache-store"
        async with HiCache(hicache_config, storage=FileStorage(root)) as c:
            yield c

    __all__ += ["hicache", "hicache_file"]
