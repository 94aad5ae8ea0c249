"""User code a type checker must accept: `mypy --strict` over it reports nothing.

Never run, only checked (tests/test_public_typing.py): what a typed serving stack, a plugin
author and a test suite write against the public API, as the docs show it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import numpy as np
import torch
from numpy.typing import NDArray
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector
from typing_extensions import Self, assert_type

from hicache_async import CacheConfig, HiCache, KVLayout, KVPool, prometheus_collector
from hicache_async.demo import DemoOptions, TraceRequest, run_demo
from hicache_async.distributed import (
    BackgroundAgreements,
    GroupStatistics,
    RankGroup,
    agree_min,
    run_uncancelled,
)
from hicache_async.storage import (
    FileStorage,
    GcReport,
    MaintainableStorage,
    ManifestLimits,
    MemoryStorage,
    MooncakeStorage,
    Outcome,
    PageBuffer,
    PageInfo,
    PageMeta,
    RawAccess,
    RedisStorage,
    StorageBackend,
    StorageCapabilities,
    StorageFactory,
    StorageStats,
    StreamsPages,
    SupportsManifest,
    VerifyReport,
    WarmupManifest,
)
from hicache_async.testing import FaultyStorage, KVGenerator
from hicache_async.transfer import LayerwiseCopy


class DictStorage:
    """A third-party backend with every optional interface (by delegation)."""

    def __init__(self, *, mac_key: bytes | None = None) -> None:
        self._inner = MemoryStorage(mac_key=mac_key)

    @classmethod
    def from_url(cls, url: str, *, mac_key: bytes | None = None) -> DictStorage:
        return cls(mac_key=mac_key)

    name = "dict://"  # a plain attribute does for the read-only property

    @property
    def capabilities(self) -> StorageCapabilities:
        return self._inner.capabilities

    async def __aenter__(self) -> DictStorage:
        await self._inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def exists(self, keys: Sequence[bytes]) -> int:
        return await self._inner.exists(keys)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        return await self._inner.get(keys, into, namespace=namespace)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        return await self._inner.put(keys, pages, metas)

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self._inner.delete(keys)

    def stats(self) -> StorageStats:
        return self._inner.stats()

    async def close(self) -> None:
        await self._inner.close()

    async def read_raw(self, key: bytes) -> bytes | None:
        return await self._inner.read_raw(key)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        await self._inner.write_raw(key, value)

    async def list_pages(self, limit: int | None = None) -> list[PageInfo]:
        return await self._inner.list_pages(limit)

    async def stream_pages(self, batch_pages: int = 1024) -> AsyncIterator[list[PageInfo]]:
        yield await self._inner.list_pages(batch_pages)

    async def verify(self) -> VerifyReport:
        return await self._inner.verify()

    async def gc(self) -> GcReport:
        return await self._inner.gc()

    def manifest(self, limits: ManifestLimits | None = None) -> WarmupManifest:
        return self._inner.manifest(limits)


class SelfStorage(DictStorage):
    """A backend whose `__aenter__` returns `Self`, as the built-in ones do."""

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        return self


class OneRank:
    """A third-party rank group."""

    rank = 0
    size = 1

    async def all_min(self, value: int, *, tag: int | None = None) -> int:
        return value

    async def all_max(self, value: int) -> int:
        return value

    async def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        return [payload]

    async def agree_common(self, items: Sequence[bytes], *, tag: int | None = None) -> list[bytes]:
        return list(items)

    async def barrier(self) -> None:
        return None

    def statistics(self) -> GroupStatistics:
        return GroupStatistics(collectives=0, timeouts=0, failures=0, broken=False)


def backend(store: StorageBackend) -> None: ...
def raw(store: RawAccess) -> None: ...
def maintainable(store: MaintainableStorage) -> None: ...
def manifests(store: SupportsManifest) -> None: ...
def streams(store: StreamsPages) -> None: ...
def factory(make: StorageFactory) -> None: ...


def every_backend_is_a_storage_backend(config: CacheConfig) -> None:
    redis = RedisStorage("redis://127.0.0.1:6379/0")
    mooncake = MooncakeStorage.from_url("mooncake://127.0.0.1:50051")
    plugin = DictStorage()
    for store in (MemoryStorage(), FileStorage("/tmp/pages"), redis, mooncake, plugin):
        backend(store)
        raw(store)
        maintainable(store)
        manifests(store)
    backend(SelfStorage())
    streams(FileStorage("/tmp/pages"))
    streams(plugin)
    backend(FaultyStorage(redis, error_rate=0.1))
    for make in (RedisStorage.from_url, MooncakeStorage.from_url, DictStorage.from_url):
        factory(make)
    HiCache(config, storage=redis)
    HiCache(config, storage=plugin, rank_group=OneRank())


async def callbacks_may_return_anything(cache: HiCache) -> None:
    def landed(copy: LayerwiseCopy) -> int:
        return copy.layers_landed

    with cache.request(range(64)) as req:
        (await req.load()).add_done_callback(landed)
    group: RankGroup = OneRank()
    event = asyncio.Event()  # whose wait() returns True

    async def local() -> int:
        return 1

    await agree_min(group, local, gate=event.wait)
    await agree_min(group, local, gate=BackgroundAgreements.of(group).wait_idle)
    task = asyncio.current_task()
    assert task is not None
    await run_uncancelled(asyncio.sleep(0), on_cancel=task.cancel)  # cancel() returns a bool


def exports_are_typed(cache: HiCache) -> None:
    registry = CollectorRegistry()
    collector = prometheus_collector(cache)
    assert_type(collector, Collector)
    registry.register(collector)
    plain = dict(cache.statistics().counters)
    assert_type(plain, dict[str, int])
    requests: list[TraceRequest] = []
    run_demo(DemoOptions(storage="memory://"), requests=requests)


def the_oracle_takes_what_the_cache_takes() -> None:
    model = KVGenerator(KVLayout(num_layers=1, num_kv_heads=1, head_dim=8), 4)
    model.page_bytes(torch.arange(8), 1)
    model.page_bytes([np.int64(i) for i in range(8)], 1)


async def every_documented_token_form(cache: HiCache, ids: Sequence[int]) -> None:
    from array import array

    cache.match(ids)
    cache.keys_for(range(64), salt="tenant")
    cache.request(np.arange(64, dtype=np.uint32)).release()
    await cache.prefetch(torch.arange(64))
    await cache.start_prefetch([np.int64(i) for i in range(64)])
    await cache.agree_cached_tokens(array("I", range(64)))
    cache.match(memoryview(array("i", range(64))))
    cache.match((1, 2, np.uint32(3)))


async def arrays_say_their_dtypes(cache: HiCache, pool: KVPool) -> None:
    with cache.request(range(64)) as req:
        assert_type(req.tokens, NDArray[np.uint32])
    rows, step = pool.copy_row_index(np.arange(4), per_token=True)
    assert_type(rows, NDArray[np.int64])
    assert_type(step, int)


async def entered_backends_are_backends(url: str) -> None:
    from hicache_async.storage import open_storage

    async with open_storage(url) as store:
        assert_type(store, StorageBackend)
        assert_type(await store.exists([]), int)
