"""`Request.load()` when the copy engine misbehaves or the request goes away mid-load: a copy
that finishes inside `copy()`, a copy the engine refuses to start, a joiner released or
cancelled while it waits. A gated copy engine holds each host -> device copy until the test
lands it, so every interleaving here is chosen, not timed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, Literal

import pytest

from hicache_async import (
    CacheClosedError,
    CacheConfig,
    HiCache,
    HiCacheError,
    KVLayout,
    KVPool,
    Request,
)
from hicache_async.testing import KVGenerator, assert_drained
from hicache_async.transfer import CopyStatistics, CpuCopyEngine, LayerwiseCopy

PAGE = 4
A = list(range(100, 100 + 2 * PAGE))  # a host-only prefix: two pages
B = [*A, *range(200, 200 + 2 * PAGE)]  # A and two pages to compute
C = list(range(300, 300 + 2 * PAGE))  # another host-only prefix


def _config() -> CacheConfig:
    return CacheConfig(
        layout=KVLayout(num_layers=3, num_kv_heads=1, head_dim=4),
        page_size=PAGE,
        device_pages=8,
        host_pages=16,
    )


class _Held(LayerwiseCopy):
    """A copy the gate holds; `joined` is set once someone besides the cache waits for it."""

    __slots__ = ("joined", "registrations")

    def __init__(self, inner: LayerwiseCopy) -> None:
        super().__init__(asyncio.get_running_loop(), inner.num_layers, inner.num_pages)
        self.registrations = 0
        self.joined = asyncio.Event()

    def add_done_callback(self, fn: Callable[[LayerwiseCopy], None]) -> None:
        super().add_done_callback(fn)
        self.registrations += 1
        if self.registrations > 1:  # the first is the cache's own bookkeeping
            self.joined.set()


Mode = Literal["free", "hold", "refuse", "finish_inside"]


class GatedEngine:
    """A real CPU copy engine that, for non-empty copies into `device`, does as `mode` says:
    "hold" them until `land()`, "refuse" to start them (raise), "finish_inside" `copy()`."""

    def __init__(self) -> None:
        self.inner = CpuCopyEngine()
        self.device: KVPool | None = None
        self.mode: Mode = "free"
        self.held: dict[LayerwiseCopy, LayerwiseCopy] = {}
        self.refused = 0

    def copy(
        self, src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
    ) -> LayerwiseCopy:
        if dst is not self.device or not dst_pages or self.mode == "free":
            return self.inner.copy(src, src_pages, dst, dst_pages)
        if self.mode == "refuse":
            self.refused += 1
            raise RuntimeError("no copy stream available")
        if self.mode == "finish_inside":
            for s, d in zip(src_pages, dst_pages, strict=True):
                dst.write_page(d, src.read_page(s))
            done = LayerwiseCopy(asyncio.get_running_loop(), src.layout.num_layers, len(dst_pages))
            done._layer_landed(done.num_layers - 1)
            return done
        inner = self.inner.copy(src, src_pages, dst, dst_pages)
        outer = _Held(inner)
        self.held[outer] = inner
        return outer

    async def land(self, outer: LayerwiseCopy) -> None:
        """Wait for the real copy, then complete `outer` without yielding afterwards."""
        inner = self.held.pop(outer)
        with contextlib.suppress(Exception):  # a failure is passed on below
            await inner
        error = inner.exception()
        if error is None:
            outer._layer_landed(outer.num_layers - 1)
        else:
            outer._fail(error)

    async def open(self) -> None:
        """Land everything held and hold nothing more."""
        self.mode = "free"
        while self.held:
            await self.land(next(iter(self.held)))

    async def aclose(self) -> None:
        await self.inner.aclose()

    def statistics(self) -> CopyStatistics:
        return self.inner.statistics()


@pytest.fixture
async def gate() -> AsyncIterator[GatedEngine]:
    engine = GatedEngine()
    try:
        yield engine
    finally:
        await engine.aclose()


async def _host_only(cache: HiCache, generator: KVGenerator, tokens: list[int]) -> None:
    """Compute and commit `tokens`, let the write-through land, then drop them off the device."""
    with cache.request(tokens) as req:
        pages = await req.allocate(len(tokens))
        for i, page in enumerate(pages):
            generator.fill_page(cache.device_pool, page, tokens, i)
        req.commit()
    await cache.drain()
    _evict_device(cache)
    info = cache.match(tokens)
    assert (info.device_tokens, info.host_tokens) == (0, len(tokens))


def _evict_device(cache: HiCache) -> None:
    """Drop every unlocked page off the device (backed up on the host already)."""
    eviction = cache.tree.evict_device(10**6, backup_first=True)
    assert not eviction.needs_backup
    cache._device_free(eviction.freed)


def _free(cache: HiCache) -> tuple[int, int]:
    return cache.device_pool.allocator.free_count, cache.host_pool.allocator.free_count


async def _compute_rest(cache: HiCache, generator: KVGenerator, req: Request) -> list[int]:
    """Allocate and fill the pages after the cached prefix, as a model would."""
    first = req.cached_tokens // PAGE
    pages = await req.allocate(req.num_tokens - req.cached_tokens)
    for offset, page in enumerate(pages):
        generator.fill_page(cache.device_pool, page, req.tokens, first + offset)
    return pages


def _check_table(cache: HiCache, generator: KVGenerator, req: Request, pages: int) -> None:
    assert len(req.page_table) >= pages
    for i in range(pages):
        generator.check_page(cache.device_pool, req.page_table[i], req.tokens, i)


def _held(copy: LayerwiseCopy) -> _Held:
    assert isinstance(copy, _Held), "the gate did not hold this copy"
    return copy


async def _start_joining(load: _Held, req: Request) -> asyncio.Future[LayerwiseCopy]:
    """Start `req.load()`; return once it waits for `load` (or, wrongly, finished without)."""
    joining = asyncio.ensure_future(req.load())
    joined = asyncio.ensure_future(load.joined.wait())
    await asyncio.wait([joining, joined], return_when=asyncio.FIRST_COMPLETED)
    joined.cancel()
    assert not joining.done(), "the second load copied the pages again instead of joining"
    return joining


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


# -- a load is landed exactly when its copy is done ------------------------------------------------


async def test_a_copy_finished_inside_copy_has_landed_when_load_returns(
    gate: GatedEngine,
) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        gate.device, gate.mode = cache.device_pool, "finish_inside"
        with cache.request(B) as req:
            load = await req.load()
            # Nothing has yielded since `copy()` returned a finished copy.
            assert load.done()
            assert req.device_tokens == len(A)
            assert "loading=False" in repr(req)
            await _compute_rest(cache, generator, req)
            assert req.commit() == 2
            _check_table(cache, generator, req, 4)
        await cache.drain()
        assert_drained(cache)


async def test_release_right_after_a_copy_finished_inside_copy(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        start = _free(cache)
        gate.device, gate.mode = cache.device_pool, "finish_inside"
        req = cache.request(B)
        assert (await req.load()).done()
        req.release()
        await cache.drain()
        assert cache._abandoned_loads == 0
        assert_drained(cache)
        _evict_device(cache)
        assert _free(cache) == start


async def test_a_request_without_a_host_run_loads_nothing_and_commits_at_once() -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config()) as cache:
        with cache.request(B) as req:
            load = await req.load()
            assert load.done()
            assert load.num_pages == 0
            assert "loading=False" in repr(req)
            await _compute_rest(cache, generator, req)
            assert req.commit() == 4
        await cache.drain()
        assert_drained(cache)


# -- a joiner released while it waits --------------------------------------------------------------


async def test_releasing_a_joiner_wakes_its_load_at_once(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        start = _free(cache)
        gate.device, gate.mode = cache.device_pool, "hold"
        try:
            with cache.request([*A, 1]) as first:
                second = cache.request([*A, 2])
                load = _held(await first.load())
                joining = await _start_joining(load, second)
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
                _check_table(cache, generator, first, 2)
        finally:
            await gate.open()
        await cache.drain()
        assert_drained(cache)
        _evict_device(cache)
        assert _free(cache) == start


async def test_releasing_the_copying_request_leaves_its_joiner_a_correct_load(
    gate: GatedEngine,
) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        start = _free(cache)
        gate.device, gate.mode = cache.device_pool, "hold"
        try:
            first = cache.request([*A, 1])
            with cache.request([*A, 2]) as second:
                load = _held(await first.load())
                joining = await _start_joining(load, second)
                first.release()
                await _settle(joining)
                assert not joining.done()  # the copy goes on, and the joiner waits for it
                await gate.land(load)
                shared = await joining
                assert shared.done()
                assert second.device_tokens == len(A)
                _check_table(cache, generator, second, 2)
        finally:
            await gate.open()
        await cache.drain()
        assert cache._abandoned_loads == 0
        assert_drained(cache)
        _evict_device(cache)
        assert _free(cache) == start


# -- a copy the engine refuses to start ------------------------------------------------------------


async def test_a_refused_copy_gives_back_its_device_pages(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        start = _free(cache)
        loaded = cache.statistics().counters["loaded_pages"]
        gate.device, gate.mode = cache.device_pool, "refuse"
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
            _check_table(cache, generator, req, 2)
        await cache.drain()
        assert_drained(cache)
        _evict_device(cache)
        assert _free(cache) == start
        # A later request gets the pages and loads normally.
        with cache.request(B) as later:
            await (await later.load())
            assert later.device_tokens == len(A)
            await _compute_rest(cache, generator, later)
            assert later.commit() == 2
            _check_table(cache, generator, later, 4)
        await cache.drain()
        assert_drained(cache)


async def test_a_refused_copy_then_release_holds_nothing(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        start = _free(cache)
        gate.device, gate.mode = cache.device_pool, "refuse"
        with cache.request(B) as req, pytest.raises((HiCacheError, RuntimeError)):
            await req.load()
        await cache.drain()
        assert cache._abandoned_loads == 0
        assert_drained(cache)  # the host protection went back too
        assert _free(cache) == start
        assert cache.match(A).host_tokens == len(A)


# -- cancelling load() at each of its await points -------------------------------------------------


async def test_cancelling_a_lone_load_at_each_await_point_holds_nothing(
    gate: GatedEngine,
) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        start = _free(cache)
        gate.device = cache.device_pool
        cancelled = 0
        for steps in range(20):
            gate.mode = "hold"
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
                _check_table(cache, generator, req, 2)
            await cache.drain()
            assert_drained(cache)
            _evict_device(cache)
            assert _free(cache) == start
            if finished:
                break  # load() ran to the end within `steps`: every await point was tried
        assert finished
        assert cancelled >= 2  # before it ran, and while obtaining device pages


async def test_cancelling_a_joiner_at_each_await_point_holds_nothing(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        start = _free(cache)
        gate.device = cache.device_pool
        for steps in range(4):
            gate.mode = "hold"
            with cache.request([*A, 1]) as first, cache.request([*A, 2]) as second:
                load = _held(await first.load())
                assert await _cancel_after(steps, second.load()) is None
                assert not load.done()  # cancelling the joiner left the copy alone
                await gate.land(load)
                assert load.exception() is None
                _check_table(cache, generator, first, 2)
                assert (await second.load()).done()  # adopts what landed
                assert second.page_table == first.page_table
            await cache.drain()
            assert_drained(cache)
            _evict_device(cache)
            assert _free(cache) == start


async def test_cancelling_a_load_waiting_for_pages_holds_nothing(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        await _host_only(cache, generator, C)
        start = _free(cache)
        gate.device, gate.mode = cache.device_pool, "hold"
        try:
            # An abandoned load in flight holds two device pages; a running request the rest.
            abandoned = cache.request([*A, 1])
            load = _held(await abandoned.load())
            abandoned.release()
            with cache.request(list(range(6 * PAGE))) as hog:
                await hog.allocate(6 * PAGE)
                assert cache.device_pool.allocator.free_count == 0
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
                    await gate.land(_held(pending.result()))
                    assert waiting.device_tokens == len(C)
                    _check_table(cache, generator, waiting, 2)
        finally:
            await gate.open()
        await cache.drain()
        assert cache._abandoned_loads == 0
        assert_drained(cache)
        _evict_device(cache)
        assert _free(cache) == start


@pytest.mark.parametrize("call", ["load", "allocate"])
async def test_releasing_a_request_waiting_for_pages_wakes_it_at_once(
    gate: GatedEngine, call: str
) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        await _host_only(cache, generator, C)
        start = _free(cache)
        gate.device, gate.mode = cache.device_pool, "hold"
        try:
            # An abandoned load in flight holds two device pages; a running request the rest.
            abandoned = cache.request([*A, 1])
            load = _held(await abandoned.load())
            abandoned.release()
            with cache.request(list(range(6 * PAGE))) as hog:
                await hog.allocate(6 * PAGE)
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
        await cache.drain()
        assert cache._abandoned_loads == 0
        assert_drained(cache)
        _evict_device(cache)
        assert _free(cache) == start
