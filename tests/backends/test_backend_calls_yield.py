"""Every async call lets the loop run once, even one that has nothing to send to its server
(no keys, no records) or answers at once because its Mooncake master is known down: a task
calling in a loop would otherwise never let another task run."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from hicache_async import StorageError
from hicache_async.storage import Outcome
from hicache_async.storage._manifest import chain_entry
from hicache_async.storage._mooncake import MooncakeStorage, close_idle_clients
from hicache_async.storage._redis import RedisStorage
from hicache_async.testing._servers import MooncakeMaster

from . import test_mooncake, test_redis
from .test_mooncake_watch import _seen_up, _until


class _Ticker:
    """Counts the turns the loop gives a second task."""

    def __init__(self) -> None:
        self.ticks = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.ticks += 1


@contextlib.asynccontextmanager
async def _ticking() -> AsyncIterator[_Ticker]:
    ticker = _Ticker()
    task = asyncio.get_running_loop().create_task(ticker.run())
    await asyncio.sleep(0)  # started
    try:
        yield ticker
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _assert_each_yields(calls: dict[str, Callable[[], Awaitable[Any]]]) -> None:
    """Run each call alone; the ones the second task got no turn during."""
    held: list[str] = []
    async with _ticking() as ticker:
        for name, call in calls.items():
            before = ticker.ticks
            await call()
            if ticker.ticks == before:
                held.append(name)
    assert held == []


async def test_redis_calls_with_nothing_to_send_yield(redis_url: str) -> None:
    async with RedisStorage.from_url(test_redis.fresh_url(redis_url)) as backend:
        manifest = backend.manifest()
        await _assert_each_yields(
            {
                "exists([])": lambda: backend.exists([]),
                "get([])": lambda: backend.get([], [], namespace=test_redis.NS),
                "put([])": lambda: backend.put([], [], []),
                "delete([])": lambda: backend.delete([]),
                "append([])": lambda: manifest.append([]),
            }
        )


async def test_mooncake_calls_with_nothing_to_send_yield(mooncake_url: str) -> None:
    async with MooncakeStorage.from_url(test_mooncake.fresh_url(mooncake_url)) as backend:
        manifest = backend.manifest()
        await _assert_each_yields(
            {
                "exists([])": lambda: backend.exists([]),
                "get([])": lambda: backend.get([], [], namespace=test_mooncake.NS),
                "put([])": lambda: backend.put([], [], []),
                "delete([])": lambda: backend.delete([]),
                "append([])": lambda: manifest.append([]),
            }
        )


@pytest.fixture
def master() -> Any:
    with MooncakeMaster() as server:
        yield server
        close_idle_clients(server.address, reachable_only=True)


async def _raises(call: Awaitable[Any]) -> None:
    with pytest.raises(StorageError, match="not answering"):
        await call


async def test_mooncake_answers_while_its_master_is_known_down_yield(
    master: MooncakeMaster,
) -> None:
    url = test_mooncake.fresh_url(master.url, segment_size=0, capacity="1MiB")
    async with MooncakeStorage.from_url(url) as backend:
        await _seen_up(backend)
        close_idle_clients(master.address)
        master.kill()
        await _until(backend._master_down)
        keys, pages, metas = test_mooncake.make_pages(2)
        ns = test_mooncake.NS
        manifest = backend.manifest()
        entry = chain_entry(ns, keys, 2 * 16, 0, time.time())

        async def get() -> None:
            into = test_mooncake.buffers(2)
            assert await backend.get(keys, into, namespace=ns) == [Outcome.ERROR] * 2

        async def put() -> None:
            assert await backend.put(keys, pages, metas) == [Outcome.ERROR] * 2

        await _assert_each_yields(
            {
                "get": get,
                "put": put,
                "exists": lambda: _raises(backend.exists(keys)),
                "delete": lambda: _raises(backend.delete(keys)),
                "read_raw": lambda: _raises(backend.read_raw(keys[0])),
                "write_raw": lambda: _raises(backend.write_raw(keys[0], b"x")),
                "list_pages": lambda: _raises(backend.list_pages()),
                "verify": lambda: _raises(backend.verify()),
                "gc": lambda: _raises(backend.gc()),
                "manifest append": lambda: _raises(manifest.append([entry])),
                "manifest read": lambda: _raises(manifest.read()),
                "manifest compact": lambda: _raises(manifest.compact()),
            }
        )


async def _cancel_at_first_turn(call: Callable[[], Awaitable[Any]]) -> None:
    """Start `call`, cancel it at the first turn it gives the loop, and see it end cancelled."""
    task = asyncio.get_running_loop().create_task(call())
    await asyncio.sleep(0)  # the call runs to its first turn
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_mooncake_calls_cancelled_at_the_master_down_turn_count_nothing(
    master: MooncakeMaster,
) -> None:
    # The turn comes before the batch is counted as failed or the call raises: a call
    # cancelled there did nothing, so the counters stay as they were and the next call
    # still fails as one whose master is down.
    url = test_mooncake.fresh_url(master.url, segment_size=0)
    async with MooncakeStorage.from_url(url) as backend:
        await _seen_up(backend)
        close_idle_clients(master.address)
        master.kill()
        await _until(backend._master_down)
        keys, pages, metas = test_mooncake.make_pages(2)
        ns = test_mooncake.NS
        manifest = backend.manifest()
        entry = chain_entry(ns, keys, 2 * 16, 0, time.time())
        into = test_mooncake.buffers(2)
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "get": lambda: backend.get(keys, into, namespace=ns),
            "put": lambda: backend.put(keys, pages, metas),
            "exists": lambda: backend.exists(keys),
            "delete": lambda: backend.delete(keys),
            "read_raw": lambda: backend.read_raw(keys[0]),
            "write_raw": lambda: backend.write_raw(keys[0], b"x"),
            "list_pages": backend.list_pages,
            "gc": backend.gc,
            "manifest append": lambda: manifest.append([entry]),
            "manifest read": manifest.read,
        }
        for name, call in calls.items():
            before = backend.stats()
            await _cancel_at_first_turn(call)
            assert backend.stats() == before, name
        # Nothing was left held: each call fails again, counted once.
        before = backend.stats()
        assert await backend.get(keys, into, namespace=ns) == [Outcome.ERROR] * 2
        assert await backend.put(keys, pages, metas) == [Outcome.ERROR] * 2
        for name in ("exists", "delete", "read_raw", "write_raw", "list_pages", "gc"):
            await _raises(calls[name]())
        after = backend.stats()
        assert (after.gets, after.puts) == (before.gets + 2, before.puts + 2)
        assert after.errors == before.errors + 4 + 6


async def test_calls_with_nothing_to_send_cancelled_at_their_turn(
    redis_url: str, mooncake_url: str
) -> None:
    async with (
        RedisStorage.from_url(test_redis.fresh_url(redis_url)) as redis,
        MooncakeStorage.from_url(test_mooncake.fresh_url(mooncake_url)) as mooncake,
    ):
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "redis exists([])": lambda: redis.exists([]),
            "redis get([])": lambda: redis.get([], [], namespace=test_redis.NS),
            "redis put([])": lambda: redis.put([], [], []),
            "redis delete([])": lambda: redis.delete([]),
            "redis append([])": lambda: redis.manifest().append([]),
            "mooncake exists([])": lambda: mooncake.exists([]),
            "mooncake get([])": lambda: mooncake.get([], [], namespace=test_mooncake.NS),
            "mooncake put([])": lambda: mooncake.put([], [], []),
            "mooncake delete([])": lambda: mooncake.delete([]),
            "mooncake append([])": lambda: mooncake.manifest().append([]),
        }
        for name, call in calls.items():
            before = (redis.stats(), mooncake.stats())
            await _cancel_at_first_turn(call)
            assert (redis.stats(), mooncake.stats()) == before, name
        # Still usable: a Redis call counted in flight was let go (close waits for those).
        assert redis._in_flight == 0
        assert await redis.exists([]) == 0
        assert await mooncake.exists([]) == 0
