"""Every async call of the in-process stores lets the loop run once, even one with nothing
to do: a task calling in a loop would otherwise never let another task run."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from hicache_async.storage import FileStorage, MemoryStorage, Outcome, PageMeta, _memory
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
            "gc with nothing to evict": storage.gc,
        }
        assert await _held(calls) == []
        assert await storage.read_raw(key) == b"value"
        assert await _held({"verify of one page": storage.verify}) == []
        async with MemoryStorage() as empty:
            assert await _held({"verify of an empty store": empty.verify}) == []


async def test_a_file_listing_of_an_empty_root_yields(tmp_path: Path) -> None:
    async with FileStorage(tmp_path / "root") as storage:
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "list_pages": storage.list_pages,
            "list_pages(limit=0)": lambda: storage.list_pages(limit=0),
        }
        assert await _held(calls) == []


async def test_a_file_manifest_append_of_nothing_yields(tmp_path: Path) -> None:
    manifest = FileManifest(tmp_path / "manifest")
    assert await _held({"append([])": lambda: manifest.append([])}) == []


async def _cancelled_at_first_turn(call: Callable[[], Awaitable[Any]]) -> None:
    task = asyncio.get_running_loop().create_task(call())
    await asyncio.sleep(0)  # the call runs to its turn
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_memory_admin_calls_cancelled_at_their_turn_did_nothing() -> None:
    # The turn comes first: a write_raw cancelled there neither removed the page it would
    # replace nor stored its value, and the counters are as they were.
    key, other = os.urandom(32), os.urandom(32)
    async with MemoryStorage(capacity_bytes=1 << 20) as storage:
        await storage.write_raw(key, b"before")
        before = storage.stats()
        await _cancelled_at_first_turn(lambda: storage.write_raw(key, b"after"))
        await _cancelled_at_first_turn(lambda: storage.write_raw(other, b"new"))
        await _cancelled_at_first_turn(lambda: storage.read_raw(key))
        await _cancelled_at_first_turn(storage.gc)
        assert storage.stats() == before
        assert await storage.read_raw(key) == b"before"
        assert await storage.read_raw(other) is None
    async with MemoryStorage(capacity_bytes=1 << 20) as empty:
        await _cancelled_at_first_turn(empty.list_pages)
        assert await empty.list_pages() == []


async def test_a_file_manifest_append_of_nothing_cancelled_at_its_turn(tmp_path: Path) -> None:
    manifest = FileManifest(tmp_path / "manifest")
    await _cancelled_at_first_turn(lambda: manifest.append([]))
    assert (await manifest.read()).entries == []


async def test_a_long_memory_lookup_yields_in_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # A lookup of a hundred thousand pages (a long prompt at page size 1) held the loop for
    # about 0.1 s: it walks and touches the keys a step at a time now, with the same answer
    # and recency order (the first key the most recent).
    monkeypatch.setattr(_memory, "_LOOKUP_STEP", 8, raising=False)
    keys = [os.urandom(32) for _ in range(40)]
    async with MemoryStorage() as storage:
        metas = [PageMeta(key=k, namespace=bytes(16), num_tokens=1, priority=0) for k in keys]
        pages = [[memoryview(bytearray(key[:8]))] for key in keys]
        assert await storage.put(keys, pages, metas) == [Outcome.OK] * len(keys)
        async with _ticks() as count:
            before = count[0]
            assert await storage.exists([*keys, os.urandom(32)]) == len(keys)
            assert count[0] - before >= 5
        assert list(storage._values)[-len(keys) :] == keys[::-1]


async def test_a_long_memory_lookup_cancelled_between_steps_touches_as_one_step_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Cancelled once its last keys were made the most recent, a lookup still makes the keys
    # before them more recent still: left as they were, the chain's first pages would be
    # evicted before its deepest ones, and the whole chain with them.
    monkeypatch.setattr(_memory, "_LOOKUP_STEP", 8, raising=False)
    keys = [os.urandom(32) for _ in range(40)]
    others = [os.urandom(32) for _ in range(4)]
    async with MemoryStorage() as storage:
        for batch in (keys, others):
            metas = [PageMeta(key=k, namespace=bytes(16), num_tokens=1, priority=0) for k in batch]
            pages = [[memoryview(bytearray(key[:8]))] for key in batch]
            assert await storage.put(batch, pages, metas) == [Outcome.OK] * len(batch)
        lookup = asyncio.get_running_loop().create_task(storage.exists(keys))
        for _ in range(100):  # loop turns, until its first touch step (the last 8 keys)
            if next(reversed(storage._values)) == keys[-8]:
                break
            await asyncio.sleep(0)
        assert not lookup.done()
        lookup.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lookup
        assert list(storage._values)[-len(keys) :] == keys[::-1]


async def test_a_put_between_the_steps_of_a_long_memory_lookup_evicts_none_of_its_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A full store, whose least recently used pages are the chain a lookup is counting: a put
    # that runs between the lookup's steps evicts pages the lookup has not reached, or other
    # pages, never the chain's first pages it counted (which would leave its tail useless).
    monkeypatch.setattr(_memory, "_LOOKUP_STEP", 8, raising=False)

    def batch(keys: list[bytes]) -> tuple[list[list[memoryview]], list[PageMeta]]:
        pages = [[memoryview(bytearray(key[:8]))] for key in keys]
        return pages, [PageMeta(key=k, namespace=bytes(16), num_tokens=1, priority=0) for k in keys]

    chain = [os.urandom(32) for _ in range(40)]
    others = [os.urandom(32) for _ in range(8)]
    async with MemoryStorage() as probe:
        assert await probe.put(chain[:1], *batch(chain[:1])) == [Outcome.OK]
        page_bytes = probe._bytes
    async with MemoryStorage(capacity_bytes=48 * page_bytes, spare_bytes=0) as storage:
        for keys in (chain, others):
            assert await storage.put(keys, *batch(keys)) == [Outcome.OK] * len(keys)
        lookup = asyncio.get_running_loop().create_task(storage.exists(chain))
        for step in range(100):  # loop turns: a put at each step of the lookup
            if lookup.done():
                break
            new = [os.urandom(32)]
            assert await storage.put(new, *batch(new)) == [Outcome.OK], step
        found = await lookup
        assert found >= 8  # the first step's, at least
        # Pages past those the walk reached may go (the deepest first); none it counted.
        assert [key in storage._values for key in chain[:found]] == [True] * found
