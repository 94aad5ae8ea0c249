"""Under write_back, a small allocation on a full device backs up about what it needs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
import pytest

from hicache_async import CacheConfig, HiCache, KVLayout, KVPool, OutOfPagesError, PrefetchConfig
from hicache_async.storage import FileStorage, MemoryStorage
from hicache_async.testing import KVGenerator, assert_drained, serve
from hicache_async.transfer import CopyStatistics, CpuCopyEngine, LayerwiseCopy

PAGE = 4
DEVICE_PAGES = 40


def _config(
    *,
    device_pages: int = DEVICE_PAGES,
    host_pages: int = 2 * DEVICE_PAGES,
    prefetch: PrefetchConfig | None = None,
) -> CacheConfig:
    return CacheConfig(
        layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=4),
        page_size=PAGE,
        device_pages=device_pages,
        host_pages=host_pages,
        write_policy="write_back",
        prefetch=prefetch or PrefetchConfig(),
    )


def _prompt(i: int) -> np.ndarray:
    """Two pages of tokens no other prompt shares."""
    return np.arange(2 * PAGE, dtype=np.int64) + 1000 * (i + 1)


async def test_one_small_request_on_a_full_device_backs_up_only_what_it_needs() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=11)
    async with HiCache(config) as cache:
        count = DEVICE_PAGES // 2
        for i in range(count):
            await serve(cache, _prompt(i), generator, check="all")
        await cache.drain()
        before = cache.statistics()
        assert before.device_pool is not None
        assert before.host_pool is not None
        assert before.device_pool.used == DEVICE_PAGES
        assert before.counters["host_backup_pages"] == 0

        await serve(cache, _prompt(count), generator, check="all")
        await cache.drain()
        after = cache.statistics()
        assert after.host_pool is not None
        # The oldest prompt made room: it alone was copied to the host, not the whole device.
        assert after.counters["host_backup_pages"] == 2
        assert after.host_pool.used == 2
        assert after.counters["device_evicted_pages"] == 2

        # Its pages come back from the host with the right bytes; the rest are on the device.
        first = await serve(cache, _prompt(0), generator, check="all")
        assert first.host_tokens == 2 * PAGE
        last = await serve(cache, _prompt(count - 1), generator, check="all")
        assert last.device_tokens == 2 * PAGE
        await cache.drain()
        assert_drained(cache)


def _sized(i: int, pages: int) -> np.ndarray:
    return np.arange(pages * PAGE, dtype=np.int64) + 1000 * (i + 1)


class _FailingBackups:
    """A CPU copy engine whose device -> host copies, once `failing`, start and then fail
    (the next `budget` of them, or all when it is None)."""

    def __init__(self) -> None:
        self.inner = CpuCopyEngine()
        self.failing = False
        self.budget: int | None = None
        self.failed = 0

    def copy(
        self, src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
    ) -> LayerwiseCopy:
        if self.failing and dst_pages and dst.name == "host" and src.name == "device":
            if self.budget is not None:
                if self.budget == 0:
                    return self.inner.copy(src, src_pages, dst, dst_pages)
                self.budget -= 1
            self.failed += 1
            loop = asyncio.get_running_loop()
            copy = LayerwiseCopy(loop, src.layout.num_layers, len(src_pages))
            loop.call_soon(copy._fail, RuntimeError("copy failed"))
            return copy
        return self.inner.copy(src, src_pages, dst, dst_pages)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def statistics(self) -> CopyStatistics:
        return self.inner.statistics()


def _small_config(host_pages: int) -> CacheConfig:
    return _config(device_pages=12, host_pages=host_pages)


async def test_backups_that_fail_let_a_page_with_a_host_copy_leave_instead() -> None:
    # The oldest victim needs a backup that keeps failing; a newer one is on the host
    # already. The allocation must not start that backup again and again.
    config = _small_config(host_pages=40)
    generator = KVGenerator(config.layout, PAGE, seed=1)
    engine = _FailingBackups()
    b, x, a, y, z = _sized(0, 2), _sized(1, 2), _sized(2, 8), _sized(3, 2), _sized(4, 2)
    async with HiCache(config, copy_engine=engine) as cache:
        for prompt in (b, x, a, y, b):  # b last: on the device and the host, most recent
            await serve(cache, prompt, generator, check="all")
            await cache.drain()
        engine.failing = True
        # Bounded only so that a regression fails instead of hanging the suite.
        served = await asyncio.wait_for(serve(cache, z, generator, check="all"), 60)
        assert served.computed_tokens == len(z)
        assert engine.failed == 2  # tried twice in a row, then something else went
        again = await serve(cache, a, generator, check="all")  # its pages stayed on the device
        assert again.device_tokens == len(a)
        await cache.drain()
        assert_drained(cache)


async def test_no_room_for_a_backup_keeps_what_has_no_other_copy() -> None:
    # The host cannot take the oldest victim's backup; a newer victim has a host copy and
    # leaves the device at no loss, instead of the oldest being dropped from every tier.
    config = _small_config(host_pages=6)
    generator = KVGenerator(config.layout, PAGE, seed=1)
    b, x, a, y, z = _sized(0, 2), _sized(1, 2), _sized(2, 8), _sized(3, 2), _sized(4, 2)
    async with HiCache(config) as cache:
        for prompt in (b, x, a, y, b):
            await serve(cache, prompt, generator, check="all")
            await cache.drain()
        await serve(cache, z, generator, check="all")
        await cache.drain()
        again = await serve(cache, a, generator, check="all")
        assert again.computed_tokens == 0
        assert again.device_tokens + again.host_tokens == len(a)
        await cache.drain()
        assert_drained(cache)


async def test_a_backup_that_failed_once_is_tried_again_before_data_is_dropped() -> None:
    config = _small_config(host_pages=40)
    generator = KVGenerator(config.layout, PAGE, seed=1)
    engine = _FailingBackups()
    x, a, y, z = _sized(1, 2), _sized(2, 8), _sized(3, 2), _sized(4, 2)
    async with HiCache(config, copy_engine=engine) as cache:
        for prompt in (x, a, y):
            await serve(cache, prompt, generator, check="all")
            await cache.drain()
        engine.failing, engine.budget = True, 1
        await asyncio.wait_for(serve(cache, z, generator, check="all"), 60)
        await cache.drain()
        assert engine.failed == 1
        again = await serve(cache, x, generator, check="all")  # backed up on the second try
        assert again.computed_tokens == 0
        await cache.drain()
        assert_drained(cache)


@pytest.mark.parametrize("budget", [1, None], ids=["transient", "for-good"])
async def test_a_parent_that_only_a_backup_can_free(budget: int | None) -> None:
    # The only unlocked device node has children on the host: it cannot be dropped, only
    # backed up. A failure once is retried; a copy failing for good ends in OutOfPagesError
    # after a bounded number of tries, never a request waiting for ever.
    config = _small_config(host_pages=40)
    config = CacheConfig.from_dict({**msgspec.to_builtins(config), "device_pages": 8})
    generator = KVGenerator(config.layout, PAGE, seed=1)
    engine = _FailingBackups()
    base = _sized(0, 2)
    left, right = np.concatenate([base, _sized(1, 2)]), np.concatenate([base, _sized(2, 2)])
    e, f, g = _sized(3, 4), _sized(4, 2), _sized(5, 2)
    async with HiCache(config, copy_engine=engine) as cache:
        for prompt in (left, right, e, f):
            await serve(cache, prompt, generator, check="all")
            await cache.drain()
        held = [cache.request(p) for p in (e, f)]  # running requests keep these locked
        for request in held:
            await request.load()
        engine.failing, engine.budget = True, budget
        if budget is None:
            with pytest.raises(OutOfPagesError):
                await asyncio.wait_for(serve(cache, g, generator, check="all"), 60)
            assert 2 <= engine.failed <= 16
            engine.failing = False  # the copies work again: the next allocation tries anew
            await asyncio.wait_for(serve(cache, g, generator, check="all"), 60)
        else:
            await asyncio.wait_for(serve(cache, g, generator, check="all"), 60)
            assert engine.failed == 1
        for request in held:
            request.release()
        again = await serve(cache, left, generator, check="all")
        assert again.computed_tokens == 0  # nothing of it was dropped either way
        await cache.drain()
        assert_drained(cache)


async def test_evicted_turns_reach_storage_with_the_prefix_they_share(tmp_path: Path) -> None:
    # The shared prefix of a conversation never leaves the device, so under write_back it
    # was never copied down: its turns reached storage without it, no manifest entry could
    # name a chain from the root, and a restarted instance warmed up nothing.
    config = _config(prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=PAGE))
    generator = KVGenerator(config.layout, PAGE, seed=12)
    shared = np.arange(4 * PAGE, dtype=np.int64) + 77_000
    turns = [np.concatenate([shared, _prompt(i)]) for i in range(DEVICE_PAGES)]
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        for turn in turns:
            await serve(cache, turn, generator, check="all")
        await cache.drain()
        assert cache.match(shared).device_tokens == len(shared)  # still on the device
        link = cache.storage_status()
        assert link.backup is not None
        assert link.backup.manifest_entries > 0
    async with HiCache(config, storage=FileStorage(tmp_path)) as restarted:
        result = await restarted.warmup(ratio=1.0)
        assert result.entries_loaded > 0
        assert restarted.match(shared).host_tokens == len(shared)
        await serve(restarted, turns[0], generator, check="all")
        await restarted.drain()
        assert_drained(restarted)


def _tokens(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, size=pages * PAGE)


async def test_a_host_pool_smaller_than_the_device_takes_no_prefix_copies() -> None:
    # A prefix's host copy stays while the prefix is on the device: with a host pool smaller
    # than the device, a hot prefix's copy would fill it, and every later victim would be
    # dropped with no copy anywhere.
    config = _config(device_pages=30, host_pages=16)
    generator = KVGenerator(config.layout, PAGE, seed=13)
    shared = _tokens(3, 12)
    turn = np.concatenate([shared, _tokens(5, 1)])
    async with HiCache(config, storage=MemoryStorage()) as cache:
        await serve(cache, np.concatenate([shared, _tokens(4, 1)]), generator)
        await serve(cache, turn, generator)
        for i in range(8):
            await serve(cache, _tokens(100 + i, 5), generator)
            await serve(cache, turn, generator)  # the conversation goes on: its start stays
            await cache.drain()
        counters = cache.statistics().counters
        assert counters["host_backups_skipped"] == 0
        assert counters["host_backup_pages"] == counters["device_evicted_pages"]
        assert not cache.tree.match(cache.keys_for(shared), touch=False).device_node.on_host
        assert_drained(cache)


async def test_a_prefix_copy_that_cannot_fit_evicts_nothing_from_the_host() -> None:
    config = _config(device_pages=14, host_pages=16)
    generator = KVGenerator(config.layout, PAGE, seed=14)
    held, kept = _tokens(1, 4), [_tokens(2, 4), _tokens(3, 4)]
    shared = _tokens(4, 12)
    async with HiCache(config, storage=MemoryStorage()) as cache:
        for prompt in (held, *kept):
            await serve(cache, prompt, generator)
        # The conversation pushes those three to the host (stored): 4 host pages stay free.
        await serve(cache, np.concatenate([shared, _tokens(5, 1)]), generator)
        await serve(cache, np.concatenate([shared, _tokens(6, 1)]), generator)
        await cache.drain()
        assert cache.match(held).host_tokens == len(held)
        with cache.request(held):  # protects its host pages: 8 evictable, 4 free
            # One page wanted: a turn leaves the device, and its 12-page start does not
            # fit beside it (13 > 12); the turn alone fits in a free page.
            await serve(cache, _tokens(7, 1), generator)
            await cache.drain()
        assert [cache.match(p).host_tokens for p in kept] == [len(p) for p in kept]
        assert cache.statistics().counters["host_evicted_pages"] == 0
        await cache.drain()
        assert_drained(cache)
