"""`Request.load()` under misuse and sharing: call order, repeats, joins, and the instant a
load lands. A gated copy engine holds each host -> device copy until the test lands it, so
every interleaving here is chosen, not timed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from hicache_async import (
    CacheClosedError,
    CacheConfig,
    HiCache,
    KVLayout,
    KVPool,
    OutOfPagesError,
    Request,
)
from hicache_async.testing import KVGenerator, assert_drained
from hicache_async.transfer import CopyStatistics, CpuCopyEngine, LayerwiseCopy

PAGE = 4
A = list(range(100, 100 + 2 * PAGE))  # the host-only prefix: two pages
B = [*A, *range(200, 200 + 2 * PAGE)]  # A and two pages to compute


def _config() -> CacheConfig:
    return CacheConfig(
        layout=KVLayout(num_layers=3, num_kv_heads=1, head_dim=4),
        page_size=PAGE,
        device_pages=8,
        host_pages=16,
    )


class _Watched(LayerwiseCopy):
    """A copy that tells when someone besides the cache waits for it."""

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


class GatedEngine:
    """A real CPU copy engine whose copies into `hold_into` land only when `land()` says."""

    def __init__(self) -> None:
        self.inner = CpuCopyEngine()
        self.hold_into: KVPool | None = None
        self.held: dict[LayerwiseCopy, LayerwiseCopy] = {}

    def copy(
        self, src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
    ) -> LayerwiseCopy:
        inner = self.inner.copy(src, src_pages, dst, dst_pages)
        if dst is not self.hold_into or inner.done():
            return inner
        outer = _Watched(inner)
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
        self.hold_into = None
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
        for i, page in enumerate(pages[: len(tokens) // PAGE]):
            generator.fill_page(cache.device_pool, page, tokens, i)
        req.commit()
    await cache.drain()
    eviction = cache.tree.evict_device(10**6, backup_first=True)
    cache._device_free(eviction.freed)
    info = cache.match(tokens)
    assert (info.device_tokens, info.host_tokens) == (0, len(tokens) // PAGE * PAGE)


async def _compute_rest(cache: HiCache, generator: KVGenerator, req: Request) -> list[int]:
    """Allocate and fill the pages after the cached prefix, as a model would."""
    first = req.cached_tokens // PAGE
    pages = await req.allocate(req.num_tokens - req.cached_tokens)
    for offset, page in enumerate(pages):
        generator.fill_page(cache.device_pool, page, req.tokens, first + offset)
    return pages


def _check_table(cache: HiCache, generator: KVGenerator, req: Request, pages: int) -> None:
    for i in range(pages):
        generator.check_page(cache.device_pool, req.page_table[i], req.tokens, i)


def _watched(copy: LayerwiseCopy) -> _Watched:
    assert isinstance(copy, _Watched), "the gate did not hold this copy"
    return copy


async def _start_joining(load: _Watched, req: Request) -> asyncio.Future[LayerwiseCopy]:
    """Start `req.load()`; return once it waits for `load` (or, wrongly, finished without)."""
    joining = asyncio.ensure_future(req.load())
    joined = asyncio.ensure_future(load.joined.wait())
    await asyncio.wait([joining, joined], return_when=asyncio.FIRST_COMPLETED)
    joined.cancel()
    assert not joining.done(), "the second load copied the pages again instead of joining"
    return joining


def _loaded_pages(cache: HiCache) -> int:
    return int(cache.statistics().counters["loaded_pages"])


# -- bug 1: where loaded pages go, and when load() may run ------------------------------------


async def test_load_after_allocate_places_loaded_pages_after_the_cached_prefix() -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config()) as cache:
        await _host_only(cache, generator, A)
        with cache.request(B) as req:
            new = await _compute_rest(cache, generator, req)  # before the load: pages 2 and 3
            load = await req.load()
            await load
            assert req.page_table[2:] == new
            _check_table(cache, generator, req, 4)
            assert req.commit() == 2
        await cache.drain()
        with cache.request(B) as again:
            assert again.device_tokens == len(B)
            _check_table(cache, generator, again, 4)
        assert_drained(cache)


async def test_concurrent_loads_share_one_copy() -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config()) as cache:
        await _host_only(cache, generator, A)
        before = _loaded_pages(cache)
        with cache.request(B) as req:
            first, second = await asyncio.gather(req.load(), req.load())
            assert first is second
            assert await req.load() is first
            await first
            assert _loaded_pages(cache) - before == 2
            assert cache.device_pool.allocator.used_count == 2
            await _compute_rest(cache, generator, req)
            assert req.commit() == 2
            _check_table(cache, generator, req, 4)
        await cache.drain()
        with cache.request(B) as again:
            _check_table(cache, generator, again, again.device_tokens // PAGE)
        assert_drained(cache)


async def test_load_after_commit_is_refused() -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config()) as cache:
        await _host_only(cache, generator, A)
        with cache.request(B) as req:
            # Recompute the host run instead of loading it, then (wrongly) load anyway.
            pages = await req.allocate(len(B) - req.device_tokens)
            for i, page in enumerate(pages):
                generator.fill_page(cache.device_pool, page, B, i)
            assert req.commit() == 4
            with pytest.raises(RuntimeError, match="after commit"):
                await req.load()
            _check_table(cache, generator, req, 4)
        await cache.drain()
        assert_drained(cache)


# -- bug 2: a landed load is fully booked the moment it can be seen as done ---------------------


async def test_commit_right_as_the_load_lands(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        gate.hold_into = cache.device_pool
        with cache.request(B) as req:
            load = await req.load()
            await _compute_rest(cache, generator, req)
            assert "loading=True" in repr(req)
            await gate.land(load)
            # Nothing has yielded since the copy completed.
            assert load.done()
            assert req.device_tokens == len(A)
            assert "loading=False" in repr(req)
            assert req.commit() == 2
            _check_table(cache, generator, req, 4)
        await cache.drain()
        assert_drained(cache)


async def test_release_right_as_the_load_lands(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        gate.hold_into = cache.device_pool
        req = cache.request(B)
        load = await req.load()
        await gate.land(load)
        req.release()
        await cache.drain()
        assert cache._abandoned_loads == 0
        assert_drained(cache)


async def test_a_miscounted_abandoned_load_cannot_make_allocation_wait_forever() -> None:
    async with HiCache(_config()) as cache:
        cache._abandoned_loads = -1
        with cache.request(list(range(8 * PAGE))) as hog:
            await hog.allocate(8 * PAGE)  # the whole pool, held by a running request
            # The timeout only turns a hang into a failure; the fixed code raises at once.
            with cache.request(list(range(500, 500 + PAGE))) as req, pytest.raises(OutOfPagesError):
                await asyncio.wait_for(req.allocate(PAGE), 30)
        assert cache._abandoned_loads == 0
        assert_drained(cache)


async def test_done_callbacks_run_as_the_copy_completes() -> None:
    loop = asyncio.get_running_loop()
    copy = LayerwiseCopy(loop, 2, 1)
    seen: list[bool] = []
    copy.add_done_callback(lambda c: seen.append(c.done()))

    def broken(_: LayerwiseCopy) -> None:
        raise RuntimeError("callback bug")

    copy.add_done_callback(broken)
    copy.add_done_callback(lambda c: seen.append(c.done()))
    errors: list[object] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        copy._layer_landed(0)
        assert seen == []
        copy._layer_landed(1)
    finally:
        loop.set_exception_handler(previous)
    assert seen == [True, True]  # synchronously, and a failing callback skips none
    assert len(errors) == 1
    await copy


# -- bug 3: two requests loading one host prefix copy it once ---------------------------------


async def test_second_load_of_a_prefix_in_flight_joins_it(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        gate.hold_into = cache.device_pool
        before = _loaded_pages(cache)
        try:
            with cache.request([*A, 1, 2]) as first, cache.request([*A, 3, 4]) as second:
                load = _watched(await first.load())
                joining = await _start_joining(load, second)
                with pytest.raises(RuntimeError, match="while load"):
                    second.commit()
                await gate.land(load)
                shared = await joining
                assert shared.done()
                assert second.device_tokens == len(A)
                assert second.page_table == first.page_table
                _check_table(cache, generator, second, 2)
                assert _loaded_pages(cache) - before == 2
        finally:
            await gate.open()
        await cache.drain()
        assert_drained(cache)


@pytest.mark.parametrize("longer", ["first", "second"])
async def test_overlapping_loads_copy_each_page_once(gate: GatedEngine, longer: str) -> None:
    # One host node of three pages; the other request's prompt ends (and splits it) after
    # two, so one load covers the other's pages and a bit more.
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    three = [*A, *range(300, 300 + PAGE)]
    long_prompt, short_prompt = [*three, 7], [*A, 8]
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, three)
        gate.hold_into = cache.device_pool
        before = _loaded_pages(cache)
        prompts = (long_prompt, short_prompt) if longer == "first" else (short_prompt, long_prompt)
        try:
            with cache.request(prompts[0]) as first, cache.request(prompts[1]) as second:
                load = _watched(await first.load())
                joining = await _start_joining(load, second)
                await gate.land(load)
                gate.hold_into = None  # the rest of the longer prompt, if any, goes freely
                await (await joining)
                for req in (first, second):
                    assert req.device_tokens == len(req.tokens) // PAGE * PAGE
                    _check_table(cache, generator, req, len(req.tokens) // PAGE)
                assert _loaded_pages(cache) - before == 3
        finally:
            await gate.open()
        await cache.drain()
        assert_drained(cache)


async def test_cancelled_joiner_leaves_the_shared_copy_alone(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        gate.hold_into = cache.device_pool
        try:
            with cache.request([*A, 1]) as first, cache.request([*A, 2]) as second:
                load = _watched(await first.load())
                joining = await _start_joining(load, second)
                joining.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await joining
                assert not load.done()
                await gate.land(load)
                assert load.exception() is None
                assert first.device_tokens == len(A)
                _check_table(cache, generator, first, 2)
                # The cancelled request may try again: the pages are on the device by now.
                again = await second.load()
                assert again.done()
                assert second.page_table == first.page_table
        finally:
            await gate.open()
        await cache.drain()
        assert_drained(cache)


async def test_joiner_released_while_waiting(gate: GatedEngine) -> None:
    generator = KVGenerator(_config().layout, PAGE, seed=1)
    async with HiCache(_config(), copy_engine=gate) as cache:
        await _host_only(cache, generator, A)
        gate.hold_into = cache.device_pool
        try:
            with cache.request([*A, 1]) as first:
                second = cache.request([*A, 2])
                load = _watched(await first.load())
                joining = await _start_joining(load, second)
                second.release()
                await gate.land(load)
                with pytest.raises(CacheClosedError, match="released"):
                    await joining
        finally:
            await gate.open()
        await cache.drain()
        assert_drained(cache)
