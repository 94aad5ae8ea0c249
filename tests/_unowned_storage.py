"""A wrapper that forwards to a real backend but leaves opening and closing it to the test,
so that two caches in one process can share one backend instance; and the check that the
backup worker's counters add up."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from hicache_async.storage import (
    Outcome,
    PageBuffer,
    PageMeta,
    RawAccess,
    StorageBackend,
    StorageCapabilities,
    StorageStats,
)
from hicache_async.workers import BackupStatistics


class Unowned:
    """Forwards to a backend but leaves entering and closing it to the test.

    Two caches in one process can then share one real backend instance.
    """

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def capabilities(self) -> StorageCapabilities:
        return self.inner.capabilities

    async def __aenter__(self) -> Unowned:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    async def exists(self, keys: Sequence[bytes]) -> int:
        return await self.inner.exists(keys)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        return await self.inner.get(keys, into, namespace=namespace)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        return await self.inner.put(keys, pages, metas)

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self.inner.delete(keys)

    def stats(self) -> StorageStats:
        return self.inner.stats()

    async def close(self) -> None:
        return None

    async def read_raw(self, key: bytes) -> bytes | None:
        assert isinstance(self.inner, RawAccess)
        return await self.inner.read_raw(key)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        assert isinstance(self.inner, RawAccess)
        await self.inner.write_raw(key, value)


def assert_backup_adds_up(backup: BackupStatistics) -> None:
    """Every offered or repaired page is accounted for exactly once (nothing queued)."""
    assert backup.queued == 0
    assert backup.offered_pages + backup.repaired_pages == (
        backup.written_pages
        + backup.skipped_pages
        + backup.failed_pages
        + backup.dropped_pages
        + backup.superseded_pages
        + backup.already_stored_pages
    )
