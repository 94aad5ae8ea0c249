"""Limits met exactly: a prefetch whose uncached part is exactly `prefetch.threshold_tokens`
long is read (only a shorter one is skipped), and a warmup entry exactly filling the warmup
budget loads whole and ends COMPLETE (only a longer one is cut and ends BUDGET). Each limit is
also tested one step past it, so both sides of the comparison are pinned."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache, PrefetchStatus, WarmupStatus
from hicache_async.storage import FileStorage, MemoryStorage
from hicache_async.testing import KVGenerator, assert_drained, serve

PAGE = 4
HOST_PAGES = 64


def _config(threshold_tokens: int = PAGE) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 32,
            "host_pages": HOST_PAGES,
            "model_id": "boundaries-test",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": threshold_tokens},
        }
    )


def _prompt(pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=pages * PAGE)


# -- prefetch.threshold_tokens ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "status", "storage_tokens"),
    [
        (2 * PAGE, PrefetchStatus.COMPLETE, 2 * PAGE),  # exactly the threshold: read
        (2 * PAGE + 1, PrefetchStatus.SKIPPED, 0),  # one token short of it: skipped
    ],
)
async def test_a_prefetch_of_exactly_threshold_tokens_is_read(
    threshold: int, status: PrefetchStatus, storage_tokens: int
) -> None:
    prompt = _prompt(3, seed=1)
    generator = KVGenerator(_config().layout, PAGE, seed=2)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        async with HiCache(_config(), storage=Unowned(memory)) as writer:
            await serve(writer, prompt, generator, prefetch=False)
            await writer.drain()
        async with HiCache(_config(threshold), storage=Unowned(memory)) as cache:
            # The first page is on the device already: the uncached part is the other two.
            await serve(cache, prompt[:PAGE], generator, prefetch=False)
            result = await cache.prefetch(prompt)
            assert (result.status, result.storage_tokens) == (status, storage_tokens)
            assert result.device_tokens == PAGE
            served = await serve(cache, prompt, generator, prefetch=False, check="all")
            assert served.computed_tokens == 2 * PAGE - storage_tokens
            await cache.drain()
            assert_drained(cache)


# -- the warmup budget -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget_pages", "status"),
    [
        (10, WarmupStatus.COMPLETE),  # the entry fills the budget exactly: loaded whole
        (9, WarmupStatus.BUDGET),  # one page over it: cut at the budget
    ],
)
async def test_a_warmup_entry_exactly_filling_the_budget_completes(
    tmp_path: Path, budget_pages: int, status: WarmupStatus
) -> None:
    prompt = _prompt(10, seed=3)
    generator = KVGenerator(_config().layout, PAGE, seed=4)
    async with HiCache(_config(), storage=FileStorage(tmp_path)) as writer:
        await serve(writer, prompt, generator, prefetch=False)
        await writer.drain()
    async with HiCache(_config(), storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=budget_pages / HOST_PAGES)
        assert result.status is status
        assert (result.entries_loaded, result.pages_loaded) == (1, budget_pages)
        info = cache.match(prompt)
        assert (info.device_tokens, info.host_tokens) == (0, budget_pages * PAGE)
        served = await serve(cache, prompt, generator, prefetch=False, check="loaded")
        assert served.host_tokens == budget_pages * PAGE
        await cache.drain()
        assert_drained(cache)
