"""A storage lookup slow for some keys: a prefetch whose caller stopped waiting for it must
not keep a worker from the prefetches behind it until its `exists` returns."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache, PrefetchStatus
from hicache_async.storage import MemoryStorage, StorageBackend
from hicache_async.testing import KVGenerator, assert_drained, serve

PAGE = 4
PAGES = 6
#: Loop passes a terminated lookup may take to end: the cancellation it needs is a few.
PASSES = 50


def _config() -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "slow-lookup-test",
            "prefetch": {
                "policy": "timeout",
                "timeout_base_s": 0.01,
                "timeout_per_1k_tokens_s": 0.0,
                "threshold_tokens": PAGE,
                "workers": 1,
                "io_timeout_s": 600.0,
            },
        }
    )


class SlowLookups(Unowned):
    """A real store whose `exists` of the keys in `slow` waits until the test opens `gate`
    (as a hot shard would answer), counting the lookups cut short."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.slow: set[bytes] = set()
        self.gate = asyncio.Event()
        self.held = 0
        self.cut_short = 0

    async def exists(self, keys: Sequence[bytes]) -> int:
        if self.slow.intersection(bytes(k) for k in keys):
            self.held += 1
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cut_short += 1
                raise
            finally:
                self.held -= 1
        return await self.inner.exists(keys)


async def test_a_terminated_lookup_frees_its_worker_for_the_next_prefetch() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=3)
    rng = np.random.default_rng(3)
    slow_prompt, fast_prompt = (rng.integers(0, 5000, size=PAGES * PAGE) for _ in range(2))
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        async with HiCache(config, storage=Unowned(memory)) as writer:
            for prompt in (slow_prompt, fast_prompt):
                await serve(writer, prompt, generator, prefetch=False)
            await writer.drain()
        store = SlowLookups(memory)
        async with HiCache(config, storage=store) as cache:
            store.slow = set(cache.namespace.storage_keys(cache.keys_for(slow_prompt)))
            slow = await cache.start_prefetch(slow_prompt)
            result = await slow.ready()  # the policy's wait runs out: terminated
            assert result.status in (PrefetchStatus.RUNNING, PrefetchStatus.TERMINATED)
            for _ in range(PASSES):
                if slow.done():
                    break
                await asyncio.sleep(0)
            assert slow.done(), "the terminated prefetch still waits for its lookup"
            assert (store.cut_short, store.held) == (1, 0)
            assert (await slow.wait()).status is PrefetchStatus.TERMINATED
            # The only worker is free: a prefetch of other keys reads them while the slow
            # lookups still would not answer.
            fast = await cache.start_prefetch(fast_prompt)
            done = await asyncio.wait_for(fast.wait(), 30)
            assert (done.status, done.storage_tokens) == (PrefetchStatus.COMPLETE, PAGES * PAGE)
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.pages_abandoned == PAGES  # the slow prompt's, looked for, not reached
            assert (stats.pages_read, stats.misses, stats.errors) == (PAGES, 0, 0)
            for prompt in (slow_prompt, fast_prompt):
                await serve(cache, prompt, generator, prefetch=False, check="all")
            store.gate.set()
            await cache.drain()
            assert_drained(cache)
