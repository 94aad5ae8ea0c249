"""Under write_back, a small allocation on a full device backs up about what it needs."""

from __future__ import annotations

import numpy as np

from hicache_async import CacheConfig, HiCache, KVLayout
from hicache_async.testing import KVGenerator, assert_drained, serve

PAGE = 4
DEVICE_PAGES = 40


def _prompt(i: int) -> np.ndarray:
    """Two pages of tokens no other prompt shares."""
    return np.arange(2 * PAGE, dtype=np.int64) + 1000 * (i + 1)


async def test_one_small_request_on_a_full_device_backs_up_only_what_it_needs() -> None:
    config = CacheConfig(
        layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=4),
        page_size=PAGE,
        device_pages=DEVICE_PAGES,
        host_pages=2 * DEVICE_PAGES,
        write_policy="write_back",
    )
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
