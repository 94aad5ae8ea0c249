"""The storage conformance suite against every built-in backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from hicache_async.storage import FileStorage, MemoryStorage
from hicache_async.testing._conformance import MAC_KEY, StorageConformance
from hicache_async.testing._faults import FaultyStorage

_CAPACITY = 256 << 20


class TestMemoryStorage(StorageConformance):
    @pytest_asyncio.fixture
    async def backend(self) -> AsyncIterator[MemoryStorage]:
        async with MemoryStorage(capacity_bytes=_CAPACITY) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self) -> AsyncIterator[MemoryStorage]:
        async with MemoryStorage(capacity_bytes=_CAPACITY, mac_key=MAC_KEY) as storage:
            yield storage


class TestFileStorage(StorageConformance):
    @pytest_asyncio.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[FileStorage]:
        async with FileStorage(tmp_path / "store", capacity_bytes=_CAPACITY) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self, tmp_path: Path) -> AsyncIterator[FileStorage]:
        async with FileStorage(tmp_path / "mac", mac_key=MAC_KEY, fsync="data") as storage:
            yield storage


class TestSharedFileStorage(StorageConformance):
    """Shared mode, with a second instance open on the same root the whole time."""

    @pytest_asyncio.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[FileStorage]:
        root = tmp_path / "shared"
        async with (
            FileStorage(root, shared=True, io_threads=2),
            FileStorage(root, shared=True, fsync="always") as storage,
        ):
            yield storage


class TestFaultyStorageWithoutFaults(StorageConformance):
    page_nbytes = 48 * 1024 + 16

    @pytest_asyncio.fixture
    async def backend(self) -> AsyncIterator[FaultyStorage]:
        async with FaultyStorage(MemoryStorage(capacity_bytes=_CAPACITY), seed=1) as storage:
            yield storage
