"""`Request.load()` when the copy engine misbehaves or the request goes away mid-load: a copy
that finishes inside `copy()`, a copy the engine refuses to start, a joiner released or
cancelled while it waits. A gated copy engine holds each host -> device copy until the test
lands it, so every interleaving here is chosen, not timed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest
from _gated_copies import (
    PAGE,
    A,
    B,
    GatedEngine,
    HeldCopy,
    assert_landed,
    check_table,
    evict_device,
    finish,
    held,
    host_cache,
    start_joining,
)

from hicache_async import CacheClosedError, HiCache, HiCacheError
from hicache_async.testing import assert_drained
from hicache_async.transfer import LayerwiseCopy

C = list(range(300, 300 + 2 * PAGE))  # another host-only prefix


def _free(cache: HiCache) -> tuple[int, int]:
    return cache.device_pool.allocator.free_count, cache.host_pool.allocator.free_count


async def _check_all_back(cache: HiCache, start: tuple[int, int]) -> None:
    """Drain; no abandoned load nor hold is left, and off the device every page is free again."""
    await cache.drain()
    assert cache._abandoned_loads == 0
    assert_drained(cache)
    evict_device(cache)
    assert _free(cache) == start


@contextlib.asynccontextmanager
async def _device_full(cache: HiCache) -> AsyncIterator[HeldCopy]:
    """Hold every device page: two in an abandoned load in flight (its held copy is yielded),
    the rest in a running request."""
    abandoned = cache.request([*A, 1])
    load = held(await abandoned.load())
    abandoned.release()
    with cache.request(list(range(6 * PAGE))) as hog:
        await hog.allocate(6 * PAGE)
        assert cache.device_pool.allocator.free_count == 0
        yield load


async def _settle(future: asyncio.Future[Any], steps: int = 10) -> None:
    """Let the loop run up to `steps` rounds, stopping once `future` is done."""
    for _ in range(steps):
        if future.done():
            return
        await asyncio.sleep(0)


async def _cancel_after(
    steps: int, coro: Coroutine[Any, Any, LayerwiseCopy]
) -> LayerwiseCopy | None:
    """Run `coro` for `steps` loop rounds, then cancel it: its copy, or None if cancelled."""
    task = asyncio.ensure_future(coro)
    for _ in range(steps):
        await asyncio.sleep(0)
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None if task.cancelled() else task.result()


async def _fail_held(gate: GatedEngine, load: HeldCopy) -> None:
    """Let the real copy behind `load` finish, then fail `load` as a lost copy stream would:
    its done callbacks (the cache's bookkeeping) run before this returns."""
    inner = gate.held.pop(load)
    await asyncio.gather(inner, return_exceptions=True)
    load._fail(RuntimeError("copy stream lost"))


# -- a load is landed exactly when its copy is done ------------------------------------------------


async def test_a_copy_finished_inside_copy_has_landed_when_load_returns(
    gate: GatedEngine,
) -> None:
    async with host_cache(gate, A, mode="finish_inside") as (cache, generator):
        with cache.request(B) as req:
            load = await req.load()
            # Nothing has yielded since `copy()` returned a finished copy.
            assert_landed(req, load, len(A))
            assert await finish(cache, generator, req) == 2


async def test_release_right_after_a_copy_finished_inside_copy(gate: GatedEngine) -> None:
    async with host_cache(gate, A, mode="finish_inside") as (cache, _):
        start = _free(cache)
        req = cache.request(B)
        assert (await req.load()).done()
        req.release()
        await _check_all_back(cache, start)


async def test_a_request_without_a_host_run_loads_nothing_and_commits_at_once() -> None:
    async with host_cache(None) as (cache, generator):
        with cache.request(B) as req:
            load = await req.load()
            assert load.done()
            assert load.num_pages == 0
            assert "loading=False" in repr(req)
            assert await finish(cache, generator, req) == 4


# -- a joiner released while it waits --------------------------------------------------------------


async def test_releasing_a_joiner_wakes_its_load_at_once(gate: GatedEngine) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, generator):
        start = _free(cache)
        try:
            with cache.request([*A, 1]) as first:
                second = cache.request([*A, 2])
                load, joining = await start_joining(first, second)
                second.release()
                await _settle(joining)
                assert joining.done(), "the released joiner still waits for the other's copy"
                assert not load.done()  # the copy is still held: release did not wait for it
                with pytest.raises(CacheClosedError) as woken:
                    await joining
                # The same error as any load() of a released request.
                with pytest.raises(CacheClosedError) as later:
                    await second.load()
                assert str(woken.value) == str(later.value)
                # The copy it had joined is unaffected.
                await gate.land(load)
                assert load.exception() is None
                assert first.device_tokens == len(A)
                check_table(cache, generator, first, 2)
        finally:
            await gate.open()
        await _check_all_back(cache, start)


async def test_releasing_the_copying_request_leaves_its_joiner_a_correct_load(
    gate: GatedEngine,
) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, generator):
        start = _free(cache)
        try:
            first = cache.request([*A, 1])
            with cache.request([*A, 2]) as second:
                load, joining = await start_joining(first, second)
                first.release()
                await _settle(joining)
                assert not joining.done()  # the copy goes on, and the joiner waits for it
                await gate.land(load)
                shared = await joining
                assert shared.done()
                assert second.device_tokens == len(A)
                check_table(cache, generator, second, 2)
        finally:
            await gate.open()
        await _check_all_back(cache, start)


# -- a copy that fails after it started -----------------------------------------------------------


async def test_a_failed_copy_leaves_the_page_table_and_the_tokens_are_computed(
    gate: GatedEngine,
) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, generator):
        start = _free(cache)
        failures = cache.statistics().counters["copy_failures"]
        with cache.request(B) as req:
            load = held(await req.load())
            assert len(req.page_table) == 2
            await _fail_held(gate, load)
            assert cache.statistics().counters["copy_failures"] == failures + 1
            # The pages it was loading into are free again, and so out of its page table.
            assert req.page_table == []
            assert (req.cached_tokens, req.device_tokens) == (0, 0)
            assert _free(cache) == start
            assert "loading=False" in repr(req)
            # The whole prompt is computed instead: four pages, in token order.
            gate.mode = "free"
            assert await finish(cache, generator, req) == len(B) // PAGE
            assert len(req.page_table) == len(B) // PAGE
        await cache.drain()
        assert cache.match(B).device_tokens == len(B)
        evict_device(cache)
        assert _free(cache)[0] == start[0]


async def test_a_released_request_whose_copy_then_fails_gives_back_its_pages(
    gate: GatedEngine,
) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, generator):
        start = _free(cache)
        req = cache.request(B)
        load = held(await req.load())
        req.release()
        assert _free(cache) != start  # the pages stay with the copy while it runs
        await _fail_held(gate, load)
        await _check_all_back(cache, start)
        # The host copy is intact: a later request loads it.
        gate.mode = "free"
        with cache.request(B) as later:
            await (await later.load())
            assert later.device_tokens == len(A)
            assert await finish(cache, generator, later) == 2
        await cache.drain()
        evict_device(cache)
        assert _free(cache)[0] == start[0]


# -- a copy the engine refuses to start ------------------------------------------------------------


async def test_a_refused_copy_gives_back_its_device_pages(gate: GatedEngine) -> None:
    async with host_cache(gate, A, mode="refuse") as (cache, generator):
        start = _free(cache)
        loaded = cache.statistics().counters["loaded_pages"]
        with cache.request(B) as req:
            with pytest.raises((HiCacheError, RuntimeError)) as refused:
                await req.load()
            assert gate.refused == 1
            assert _free(cache) == start
            assert req.page_table == []
            assert isinstance(refused.value, HiCacheError)
            assert "refused to start" in str(refused.value)
            assert isinstance(refused.value.__cause__, RuntimeError)
            assert not cache._loading
            assert cache.statistics().counters["loaded_pages"] == loaded
            assert "loading=False" in repr(req)
            # The request itself may try again once the engine takes copies.
            gate.mode = "free"
            await (await req.load())
            assert req.device_tokens == len(A)
            check_table(cache, generator, req, 2)
        await _check_all_back(cache, start)
        # A later request gets the pages and loads normally.
        with cache.request(B) as later:
            await (await later.load())
            assert later.device_tokens == len(A)
            assert await finish(cache, generator, later) == 2


async def test_a_refused_copy_then_release_holds_nothing(gate: GatedEngine) -> None:
    async with host_cache(gate, A, mode="refuse") as (cache, _):
        start = _free(cache)
        with cache.request(B) as req, pytest.raises((HiCacheError, RuntimeError)):
            await req.load()
        await _check_all_back(cache, start)  # the host protection went back too
        assert cache.match(A).host_tokens == len(A)


# -- cancelling load() at each of its await points -------------------------------------------------


async def test_cancelling_a_lone_load_at_each_await_point_holds_nothing(
    gate: GatedEngine,
) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, generator):
        start = _free(cache)
        cancelled = 0
        for steps in range(20):
            with cache.request(B) as req:
                load = await _cancel_after(steps, req.load())
                finished = load is not None
                if load is None:
                    cancelled += 1
                    assert _free(cache) == start
                    assert req.page_table == []
                    assert not cache._loading
                    load = await req.load()  # and it may load after all
                await gate.land(load)
                check_table(cache, generator, req, 2)
            await _check_all_back(cache, start)
            if finished:
                break  # load() ran to the end within `steps`: every await point was tried
        assert finished
        assert cancelled >= 2  # before it ran, and while obtaining device pages


async def test_cancelling_a_joiner_at_each_await_point_holds_nothing(gate: GatedEngine) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, generator):
        start = _free(cache)
        for steps in range(4):
            with cache.request([*A, 1]) as first, cache.request([*A, 2]) as second:
                load = held(await first.load())
                assert await _cancel_after(steps, second.load()) is None
                assert not load.done()  # cancelling the joiner left the copy alone
                await gate.land(load)
                assert load.exception() is None
                check_table(cache, generator, first, 2)
                assert (await second.load()).done()  # adopts what landed
                assert second.page_table == first.page_table
            await _check_all_back(cache, start)


async def test_cancelling_a_load_waiting_for_pages_holds_nothing(gate: GatedEngine) -> None:
    async with host_cache(gate, A, C, mode="hold") as (cache, generator):
        start = _free(cache)
        try:
            async with _device_full(cache) as load:
                with cache.request([*C, 1]) as waiting:
                    for steps in (1, 2, 3):
                        assert await _cancel_after(steps, waiting.load()) is None
                        assert cache.device_pool.allocator.free_count == 0
                        assert waiting.page_table == []
                    # Once the abandoned load lands, its pages are evictable: a load goes on.
                    pending = asyncio.ensure_future(waiting.load())
                    await _settle(pending)
                    assert not pending.done()
                    await gate.land(load)
                    await _settle(pending)
                    assert pending.done()
                    await gate.land(held(pending.result()))
                    assert waiting.device_tokens == len(C)
                    check_table(cache, generator, waiting, 2)
        finally:
            await gate.open()
        await _check_all_back(cache, start)


@pytest.mark.parametrize("call", ["load", "allocate"])
async def test_releasing_a_request_waiting_for_pages_wakes_it_at_once(
    gate: GatedEngine, call: str
) -> None:
    async with host_cache(gate, A, C, mode="hold") as (cache, _):
        start = _free(cache)
        try:
            async with _device_full(cache) as load:
                waiting = cache.request([*C, 1])
                pending = asyncio.ensure_future(
                    waiting.load() if call == "load" else waiting.allocate(2 * PAGE)
                )
                await _settle(pending)
                assert not pending.done()  # it waits for the abandoned load to land
                waiting.release()
                await _settle(pending)
                assert pending.done(), "the released request still waits for pages"
                assert not load.done()
                with pytest.raises(CacheClosedError, match="released"):
                    await pending
                assert cache.device_pool.allocator.free_count == 0
            await gate.land(load)
        finally:
            await gate.open()
        await _check_all_back(cache, start)
