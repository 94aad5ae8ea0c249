"""A tensor-parallel warmup stopped by a request, or cancelled while its group breaks: pages
every rank held before are kept, and the cancellation is not lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from test_tp_warmup_cancel import PAGE, _fill_both, _pair, _Rank, _two_caches

from hicache_async import HiCache
from hicache_async.distributed import CollectiveError


async def _on_host_only(cache: HiCache, prompt: np.ndarray) -> None:
    """Compute and commit `prompt`, back it up to the host, then drop it off the device."""
    with cache.request(prompt) as request:
        await request.allocate(len(prompt) - request.cached_tokens)
        request.commit()
    await cache.drain()
    eviction = cache.tree.evict_device(10**6, backup_first=True)
    assert not eviction.needs_backup
    cache._device_free(eviction.freed)
    info = cache.match(prompt)
    assert (info.device_tokens, info.host_tokens) == (0, len(prompt))


@contextlib.asynccontextmanager
async def _both_on_host(
    tmp_path: Path, prompt: np.ndarray
) -> AsyncIterator[tuple[list[_Rank], tuple[HiCache, HiCache]]]:
    """Two ranks whose stores hold `prompt` (a one-entry manifest) and whose host pools hold
    it already."""
    roots = await _fill_both(tmp_path, [prompt])
    ranks = _pair(_Rank)
    async with _two_caches(ranks, roots) as caches:
        for cache in caches:
            await _on_host_only(cache, prompt)
        yield ranks, caches


async def test_a_stopped_warmup_keeps_the_pages_every_rank_had(tmp_path: Path) -> None:
    prompt = np.arange(700, 700 + 4 * PAGE)
    async with _both_on_host(tmp_path, prompt) as (ranks, caches):
        warmups = [asyncio.create_task(cache.warmup(ratio=1.0)) for cache in caches]
        agreements: list[asyncio.Task[int]] = []

        def request_arrives(kind: str, index: int) -> None:
            # Collective 2 is the entry's "go on?", entered with "yes" by both: a request
            # agreement arriving now stops the warmup before it loads the entry.
            if index == 2 and not agreements:
                agreements.extend(
                    asyncio.create_task(cache.agree_cached_tokens(prompt)) for cache in caches
                )

        ranks[0].on_enter = request_arrives
        results = await asyncio.wait_for(asyncio.gather(*warmups), 30)
        assert [r.status.value for r in results] == ["complete", "complete"]
        # The entry's trim agreed on what both ranks held: nothing was dropped.
        assert await asyncio.wait_for(asyncio.gather(*agreements), 30) == [len(prompt)] * 2
        for cache in caches:
            assert cache.match(prompt).host_tokens == len(prompt)
        assert ranks[0].calls == ranks[1].calls


@pytest.mark.parametrize("at", [0, 1, 2], ids=["entries", "longest", "go_on"])
async def test_a_cancelled_warmup_stays_cancelled_when_its_group_breaks(
    tmp_path: Path, at: int
) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 50000, size=4 * PAGE) for _ in range(3)]
    roots = await _fill_both(tmp_path, prompts)
    ranks = _pair(_Rank)
    async with _two_caches(ranks, roots) as (first, second):
        warmup = asyncio.create_task(first.warmup(ratio=1.0))
        # Past the entries agreement, rank 1 is needed to get there; its "go on?" fails too.
        peer = asyncio.create_task(second.warmup(ratio=1.0)) if at else None

        def break_there(kind: str, index: int) -> None:
            if index == at:
                warmup.cancel()  # rank 0 waits in it, and rank 1 never comes: it fails
                ranks[0].world.slots[index][1].set_exception(CollectiveError("peer gone"))

        ranks[0].on_enter = break_there
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(warmup), 30)
        assert warmup.cancelled(), f"the cancellation was lost: {warmup.exception()!r}"
        if peer is not None:
            assert (await asyncio.wait_for(peer, 30)).status.value == "stopped"


async def test_the_pages_offered_to_a_trim_are_held_until_it(tmp_path: Path) -> None:
    """Host pressure on rank 0 while it waits in the entry's trim agreement cannot evict the
    pages it offered (the peer would keep pages it no longer has)."""
    prompt = np.arange(900, 900 + 4 * PAGE)
    async with _both_on_host(tmp_path, prompt) as (ranks, caches):
        warmups = [asyncio.create_task(cache.warmup(ratio=1.0)) for cache in caches]
        evicted: list[int] = []

        def evict_in_trim(kind: str, index: int) -> None:
            if index == 3:  # rank 0 waits in the entry's trim
                freed = caches[0].tree.evict_host(4)
                caches[0]._host_free(freed)
                evicted.append(len(freed))

        ranks[0].on_enter = evict_in_trim
        await asyncio.wait_for(asyncio.gather(*warmups), 30)
        assert evicted == [0]
        assert [cache.match(prompt).host_tokens for cache in caches] == [len(prompt)] * 2
        assert ranks[0].calls == ranks[1].calls == 4
