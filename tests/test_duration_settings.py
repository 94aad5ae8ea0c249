"""Duration settings at the ends of their accepted ranges keep the cache serving.

A setting the configuration accepts must mean what the documentation says it means at its
bounds too: never a raw error far from the configuration, never a lost store.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import MemoryStorage
from hicache_async.testing import FaultyStorage, KVGenerator, serve

PAGE = 8
GUARD_S = 60.0  # a hang guard only


def _config(**backup: object) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
            "page_size": PAGE,
            "device_pages": 32,
            "host_pages": 64,
            "write_policy": "write_through",
            "backup": backup,
        }
    )


def _prompt(pages: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 30_000, size=pages * PAGE)


async def test_more_than_a_thousand_retries_without_backoff_keep_storage_attached() -> None:
    # With no backoff, retries past the 1,024th would double it beyond what a float holds.
    config = _config(max_retries=1100, retry_backoff_s=0.0)
    store = FaultyStorage(MemoryStorage(), error_rate=1.0)
    generator = KVGenerator(config.layout, PAGE, seed=3)
    async with HiCache(config, storage=store) as cache:
        await serve(cache, _prompt(4), generator, prefetch=False, check="all")
        await asyncio.wait_for(cache.drain(), GUARD_S)
        status = cache.storage_status()
        assert status.workers_failed is None
        assert status.attached
        backup = status.backup
        assert backup is not None
        assert backup.failed_pages == 4
        assert backup.retried_pages == 4 * 1100
        # Still serving, storage included.
        await serve(cache, _prompt(2, seed=1), generator, prefetch=False, check="all")
