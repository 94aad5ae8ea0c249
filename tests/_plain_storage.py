"""A correct backend with only the StorageBackend methods (no raw access, maintenance,
manifest or memory registration), for tests of code that must cope without them."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from hicache_async.storage import MemoryStorage, Outcome, PageMeta
from hicache_async.storage._protocol import PageBuffer, StorageCapabilities, StorageStats


class PlainStorage:
    def __init__(self, capacity_bytes: int = 1 << 24) -> None:
        self._inner = MemoryStorage(capacity_bytes=capacity_bytes)

    @property
    def name(self) -> str:
        return "plain"

    @property
    def capabilities(self) -> StorageCapabilities:
        return self._inner.capabilities

    async def __aenter__(self) -> PlainStorage:
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
