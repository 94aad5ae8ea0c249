"""`Request.load()` under misuse and sharing: call order, repeats, joins, and the instant a
load lands. A gated copy engine holds each host -> device copy until the test lands it, so
every interleaving here is chosen, not timed."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from _gated_copies import (
    PAGE,
    A,
    B,
    GatedEngine,
    assert_landed,
    check_table,
    commit_checked,
    compute_rest,
    config,
    finish,
    host_cache,
    start_joining,
)

from hicache_async import CacheClosedError, HiCache, OutOfPagesError, WrongThreadError
from hicache_async.testing import assert_drained
from hicache_async.transfer import LayerwiseCopy


def _loaded_pages(cache: HiCache) -> int:
    return int(cache.statistics().counters["loaded_pages"])


# -- bug 1: where loaded pages go, and when load() may run ------------------------------------


async def test_load_after_allocate_places_loaded_pages_after_the_cached_prefix() -> None:
    async with host_cache(None, A) as (cache, generator):
        with cache.request(B) as req:
            new = await compute_rest(cache, generator, req)  # before the load: pages 2 and 3
            load = await req.load()
            await load
            assert req.page_table[2:] == new
            check_table(cache, generator, req, 4)
            assert req.commit() == 2
        await cache.drain()
        with cache.request(B) as again:
            assert again.device_tokens == len(B)
            check_table(cache, generator, again, 4)
        assert_drained(cache)


async def test_concurrent_loads_share_one_copy() -> None:
    async with host_cache(None, A) as (cache, generator):
        before = _loaded_pages(cache)
        with cache.request(B) as req:
            first, second = await asyncio.gather(req.load(), req.load())
            assert first is second
            assert await req.load() is first
            await first
            assert _loaded_pages(cache) - before == 2
            assert cache.device_pool.allocator.used_count == 2
            assert await finish(cache, generator, req) == 2
        await cache.drain()
        with cache.request(B) as again:
            check_table(cache, generator, again, again.device_tokens // PAGE)
        assert_drained(cache)


async def test_load_after_commit_is_refused() -> None:
    async with host_cache(None, A) as (cache, generator):
        with cache.request(B) as req:
            # Recompute the host run instead of loading it, then (wrongly) load anyway.
            pages = await req.allocate(len(B) - req.device_tokens)
            for i, page in enumerate(pages):
                generator.fill_page(cache.device_pool, page, B, i)
            assert req.commit() == 4
            with pytest.raises(RuntimeError, match="after commit"):
                await req.load()
            check_table(cache, generator, req, 4)


async def test_a_load_started_before_commit_is_returned_again_after_it() -> None:
    async with host_cache(None, A) as (cache, generator):
        with cache.request(B) as req:
            load = await req.load()
            await load
            assert await finish(cache, generator, req) == 2
            # A repeated call, not a new load: the same finished copy, nothing copied again.
            loaded = _loaded_pages(cache)
            assert await req.load() is load
            assert _loaded_pages(cache) == loaded
            check_table(cache, generator, req, 4)
        await cache.drain()
        assert_drained(cache)


# -- bug 2: a landed load is fully booked the moment it can be seen as done ---------------------


async def test_commit_right_as_the_load_lands(gate: GatedEngine) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, generator):
        with cache.request(B) as req:
            load = await req.load()
            await compute_rest(cache, generator, req)
            assert "loading=True" in repr(req)
            await gate.land(load)
            # Nothing has yielded since the copy completed.
            assert_landed(req, load, len(A))
            assert commit_checked(cache, generator, req) == 2


async def test_release_right_as_the_load_lands(gate: GatedEngine) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, _):
        req = cache.request(B)
        load = await req.load()
        await gate.land(load)
        req.release()
        await cache.drain()
        assert cache._abandoned_loads == 0
        assert_drained(cache)


async def test_a_miscounted_abandoned_load_cannot_make_allocation_wait_forever() -> None:
    async with HiCache(config()) as cache:
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
    async with host_cache(gate, A, mode="hold") as (cache, generator):
        before = _loaded_pages(cache)
        try:
            with cache.request([*A, 1, 2]) as first, cache.request([*A, 3, 4]) as second:
                load, joining = await start_joining(first, second)
                with pytest.raises(RuntimeError, match="while load"):
                    second.commit()
                await gate.land(load)
                shared = await joining
                assert shared.done()
                assert second.device_tokens == len(A)
                assert second.page_table == first.page_table
                check_table(cache, generator, second, 2)
                assert _loaded_pages(cache) - before == 2
        finally:
            await gate.open()


@pytest.mark.parametrize("longer", ["first", "second"])
async def test_overlapping_loads_copy_each_page_once(gate: GatedEngine, longer: str) -> None:
    # One host node of three pages; the other request's prompt ends (and splits it) after
    # two, so one load covers the other's pages and a bit more.
    three = [*A, *range(300, 300 + PAGE)]
    long_prompt, short_prompt = [*three, 7], [*A, 8]
    async with host_cache(gate, three, mode="hold") as (cache, generator):
        before = _loaded_pages(cache)
        prompts = (long_prompt, short_prompt) if longer == "first" else (short_prompt, long_prompt)
        try:
            with cache.request(prompts[0]) as first, cache.request(prompts[1]) as second:
                load, joining = await start_joining(first, second)
                await gate.land(load)
                gate.mode = "free"  # the rest of the longer prompt, if any, goes freely
                await (await joining)
                for req in (first, second):
                    assert req.device_tokens == len(req.tokens) // PAGE * PAGE
                    check_table(cache, generator, req, len(req.tokens) // PAGE)
                assert _loaded_pages(cache) - before == 3
        finally:
            await gate.open()


async def test_cancelled_joiner_leaves_the_shared_copy_alone(gate: GatedEngine) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, generator):
        try:
            with cache.request([*A, 1]) as first, cache.request([*A, 2]) as second:
                load, joining = await start_joining(first, second)
                joining.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await joining
                assert not load.done()
                await gate.land(load)
                assert load.exception() is None
                assert first.device_tokens == len(A)
                check_table(cache, generator, first, 2)
                # The cancelled request may try again: the pages are on the device by now.
                again = await second.load()
                assert again.done()
                assert second.page_table == first.page_table
        finally:
            await gate.open()


async def test_joiner_released_while_waiting(gate: GatedEngine) -> None:
    async with host_cache(gate, A, mode="hold") as (cache, _):
        try:
            with cache.request([*A, 1]) as first:
                second = cache.request([*A, 2])
                load, joining = await start_joining(first, second)
                second.release()
                await gate.land(load)
                with pytest.raises(CacheClosedError, match="released"):
                    await joining
        finally:
            await gate.open()


async def test_a_release_from_another_thread_changes_nothing() -> None:
    # It marked the request released, then failed at the tree: the owner's release found
    # nothing to do, and the request's lock, host hold and pages were never given back.
    async with host_cache(None, A) as (cache, _):
        req = cache.request(B)
        await req.allocate(len(B) - len(A))
        used = cache.device_pool.allocator.used_count
        raised: list[BaseException] = []

        def other() -> None:
            try:
                req.release()
            except BaseException as exc:
                raised.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert [type(e) for e in raised] == [WrongThreadError]
        assert not req.released
        assert cache.statistics().live_requests == 1
        assert cache.device_pool.allocator.used_count == used
        req.release()
        assert req.released
        assert cache.statistics().live_requests == 0
        # Released by now: from another thread (a `with` block's exit) it returns, as it did.
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert len(raised) == 1  # only the first call's


# -- what commit() publishes ------------------------------------------------------------------


async def test_a_requests_keys_tokens_and_priority_cannot_be_changed_before_its_commit() -> None:
    # commit() inserts the request's pages under its keys, with its priority: a key list
    # changed in place published this prompt's KV as another prompt's, and a priority set
    # past check_priority reached the tree (and every page header of its backups).
    async with HiCache(config()) as cache:
        other = list(range(300, 300 + 2 * PAGE))
        with cache.request(A, priority=3, request_id="a") as req:
            req.keys[:] = cache.keys_for(other)
            for name, value in (
                ("keys", cache.keys_for(other)),
                ("tokens", np.arange(4 * PAGE, dtype=np.uint32)),
                ("priority", 1 << 40),
                ("request_id", "b"),
            ):
                with pytest.raises(AttributeError):
                    setattr(req, name, value)
            assert (req.keys, req.priority, req.request_id) == (cache.keys_for(A), 3, "a")
            assert req.tokens.tolist() == A
            await req.allocate(len(A))
            assert req.commit() == 2
        assert cache.match(other).device_tokens == 0
        assert cache.match(A).device_tokens == len(A)
        await cache.drain()
        assert_drained(cache)


async def test_a_loads_layer_count_cannot_be_changed_under_its_copy() -> None:
    # The engine copies `num_layers` layers: raised by assignment, it asked the pools for a
    # layer they do not have, and the load failed, its host run to be computed again.
    async with host_cache(None, A) as (cache, generator):
        with cache.request(B) as req:
            load = await req.load()
            for name in ("num_layers", "num_pages", "nbytes"):
                with pytest.raises(AttributeError):
                    setattr(load, name, 10**6)
            await asyncio.wait_for(load, 30)
            assert load.layers_landed == load.num_layers == cache.config.layout.num_layers
            await compute_rest(cache, generator, req)
            assert req.commit() == 2
        await cache.drain()
        assert_drained(cache)
