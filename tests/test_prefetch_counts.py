"""Landing a long prompt costs in proportion to it, not to its square."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import MemoryStorage
from hicache_async.testing import FaultyStorage, KVGenerator, assert_drained, serve
from hicache_async.tree import RadixTree

PAGE = 4


def _config(device_pages: int = 64, **prefetch: Any) -> CacheConfig:
    settings: dict[str, Any] = {
        "policy": "wait_complete",
        "threshold_tokens": 1,
        "batch_pages": 2,
        "max_host_share": 1.0,
    }
    settings.update(prefetch)
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": device_pages,
            "host_pages": 2 * device_pages + 1024,
            "model_id": "prefetch-counts-test",
            "prefetch": settings,
        }
    )


async def _store(memory: MemoryStorage, config: CacheConfig, *prompts: np.ndarray) -> None:
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with HiCache(config, storage=Unowned(memory)) as writer:
        for prompt in prompts:
            await serve(writer, prompt, generator, prefetch=False)
        await writer.drain()


async def test_landing_a_long_prompt_costs_in_proportion_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every landed batch matched the whole prefix again: a prompt of n pages read in
    # batches of b made n/b matches of up to n keys each. Counted in keys walked.
    pages = 512
    config = _config(device_pages=pages, batch_pages=4)
    prompt = np.random.default_rng(4).integers(0, 5000, size=pages * PAGE)
    walked = 0
    match, descend = RadixTree.match, RadixTree.descend

    def counting_match(self: RadixTree, keys: Sequence[bytes], **kwargs: Any) -> Any:
        nonlocal walked
        walked += len(keys)
        return match(self, keys, **kwargs)

    def counting_descend(self: RadixTree, node: Any, keys: Sequence[bytes]) -> Any:
        nonlocal walked
        walked += len(keys)
        return descend(self, node, keys)

    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        await _store(memory, config, prompt)
        generator = KVGenerator(config.layout, PAGE, seed=5)
        # Gets that take a moment, so the second prefetch comes to wait on the first's.
        store = FaultyStorage(Unowned(memory), latency_s=0.001)
        async with HiCache(config, storage=store) as cache:
            monkeypatch.setattr(RadixTree, "match", counting_match)
            monkeypatch.setattr(RadixTree, "descend", counting_descend)
            # Two, so the second waits on the first's reads and lands them as they come.
            first = await cache.start_prefetch(prompt)
            second = await cache.start_prefetch(prompt)
            results = await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), 60)
            monkeypatch.undo()
            assert [r.cached_tokens for r in results] == [pages * PAGE] * 2
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.pages_read == pages
            assert stats.pages_shared > 0
            # A few whole-prompt matches per prefetch (its start, its plan, its end), and
            # each landed page once: not a match of the prefix for every batch.
            assert walked <= 2 * 5 * pages
            await serve(cache, prompt, generator, prefetch=False, check="all")
            await cache.drain()
            assert_drained(cache)
