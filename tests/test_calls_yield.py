"""Every async call of the in-process stores lets the loop run once, even one with nothing
to do: a task calling in a loop would otherwise never let another task run."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from hicache_async.storage import MemoryStorage
from hicache_async.storage._manifest import FileManifest


@contextlib.asynccontextmanager
async def _ticks() -> AsyncIterator[list[int]]:
    """A one-item list counting the turns the loop gives a second task."""
    count = [0]

    async def tick() -> None:
        while True:
            await asyncio.sleep(0)
            count[0] += 1

    task = asyncio.get_running_loop().create_task(tick())
    await asyncio.sleep(0)  # started
    try:
        yield count
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _held(calls: dict[str, Callable[[], Awaitable[Any]]]) -> list[str]:
    """The calls during which the second task got no turn."""
    held: list[str] = []
    async with _ticks() as count:
        for name, call in calls.items():
            before = count[0]
            await call()
            if count[0] == before:
                held.append(name)
    return held


async def test_memory_admin_calls_yield() -> None:
    key = os.urandom(32)
    async with MemoryStorage(capacity_bytes=1 << 20) as storage:
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "list_pages of an empty store": storage.list_pages,
            "read_raw of an absent key": lambda: storage.read_raw(key),
            "write_raw": lambda: storage.write_raw(key, b"value"),
            "read_raw": lambda: storage.read_raw(key),
            "list_pages(limit=0)": lambda: storage.list_pages(limit=0),
        }
        assert await _held(calls) == []
        assert await storage.read_raw(key) == b"value"


async def test_a_file_manifest_append_of_nothing_yields(tmp_path: Path) -> None:
    manifest = FileManifest(tmp_path / "manifest")
    assert await _held({"append([])": lambda: manifest.append([])}) == []
