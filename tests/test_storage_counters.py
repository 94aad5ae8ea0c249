"""What the prefetch and backup counters and the storage latency histograms count: pages
everywhere, a timeout once per prefetch, and batch latencies only of calls that moved a page."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _plain_storage import PlainStorage

from hicache_async import CacheConfig, HiCache
from hicache_async._config import PrefetchConfig
from hicache_async.storage import Outcome, PageMeta
from hicache_async.storage._protocol import PageBuffer
from hicache_async.testing import FaultyStorage, KVGenerator, serve
from hicache_async.workers._prefetch import Prefetcher

PAGE = 8
# Bounds waits that must end at once: far above any stall of a loaded machine.
GUARD_S = 30.0


def _config(**prefetch: object) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 96,
            "model_id": "counters",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE, **prefetch},
            "backup": {"max_retries": 1, "retry_backoff_s": 0.0},
        }
    )


def _prompt(pages: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 30_000, size=pages * PAGE)


class _Scripted(PlainStorage):
    """Claims every page exists; gets wait for `release`, then answer MISS for every page;
    puts answer ERROR for every page."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def exists(self, keys: Sequence[bytes]) -> int:
        return len(keys)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        await self.release.wait()
        return [Outcome.MISS] * len(keys)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        return [Outcome.ERROR] * len(keys)


async def test_a_prefetch_times_out_once_however_often_it_is_awaited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each `ready()` used to wait a whole limit again and count one more timeout.
    # The read is held until the end, and nothing times it out meanwhile.
    config = _config(
        policy="timeout", timeout_base_s=0.2, timeout_per_1k_tokens_s=0.0, io_timeout_s=3600.0
    )
    store = _Scripted()
    async with HiCache(config, storage=store) as cache:
        handle = await cache.start_prefetch(_prompt(4))
        assert (await handle.ready()).storage_tokens == 0
        # Past its deadline, later waits end at once. Were each to take a whole limit again,
        # an hour from now, these would not return within the guard.
        monkeypatch.setattr(PrefetchConfig, "timeout_for", lambda self, num_tokens: 3600.0)
        await asyncio.wait_for(handle.ready(), GUARD_S)
        await asyncio.wait_for(handle.ready(), GUARD_S)
        status = cache.storage_status().prefetch
        assert status is not None
        assert status.submitted == 1
        assert status.timeouts == 1
        store.release.set()
        await handle.wait()


async def test_prefetch_misses_and_errors_count_pages(tmp_path: Path) -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE)
    prompt = _prompt(5)
    root = tmp_path / "l3"
    async with HiCache(config, storage=f"file://{root}") as writer:
        await serve(writer, prompt[: 2 * PAGE], generator, prefetch=False)
        await writer.drain()
    async with HiCache(config, storage=f"file://{root}") as reader:
        result = await reader.prefetch(prompt)
        assert result.storage_tokens == 2 * PAGE
        status = reader.storage_status().prefetch
        assert status is not None
        assert status.pages_read == 2
        assert status.misses == 3  # asked of storage, not there: pages, not one per prefetch
        assert status.errors == 0
    failing = FaultyStorage(PlainStorage(), seed=1, error_rate=1.0)
    async with HiCache(config, storage=failing) as cache:
        await cache.prefetch(prompt)  # its exists fails: five pages unread
        status = cache.storage_status().prefetch
        assert status is not None
        assert status.errors == 5
        assert status.misses == 0


async def test_batch_latencies_leave_out_calls_that_moved_no_page() -> None:
    # The store claims every page exists: the backup must not skip them, or it puts nothing.
    config = CacheConfig.from_dict(
        {
            **_config().to_dict(),
            "backup": {"max_retries": 1, "retry_backoff_s": 0.0, "skip_stored": False},
        }
    )
    generator = KVGenerator(config.layout, PAGE)
    store = _Scripted()
    store.release.set()
    async with HiCache(config, storage=store) as cache:
        await serve(cache, _prompt(3), generator, prefetch=False)
        await cache.drain()
        backup = cache.storage_status().backup
        assert backup is not None
        assert backup.failed_pages == 3  # every put call returned, storing nothing
        assert cache.storage_put_latency.snapshot().count == 0
        await cache.prefetch(_prompt(3, seed=1))  # every get returns, reading nothing
        prefetch = cache.storage_status().prefetch
        assert prefetch is not None
        assert prefetch.misses == 3
        assert cache.storage_get_latency.snapshot().count == 0
    # And a call that moved pages is observed.
    async with HiCache(config, storage=PlainStorage()) as cache:
        await serve(cache, _prompt(3), generator, prefetch=False)
        await cache.drain()
        assert cache.storage_put_latency.snapshot().count >= 1


async def test_prefetched_pages_count_their_bytes_and_are_known_to_be_stored(
    tmp_path: Path,
) -> None:
    """Pages a prefetch read count in `bytes_read`, and are marked in storage: the backup
    of the request that uses them writes none of them again."""
    config = _config()
    generator = KVGenerator(config.layout, PAGE)
    prompt = _prompt(4, seed=7)
    root = tmp_path / "l3"
    async with HiCache(config, storage=f"file://{root}") as writer:
        await serve(writer, prompt[: 3 * PAGE], generator, prefetch=False)
        await writer.drain()
    async with HiCache(config, storage=f"file://{root}") as reader:
        result = await reader.prefetch(prompt)
        assert result.storage_tokens == 3 * PAGE
        status = reader.storage_status().prefetch
        assert status is not None
        assert (status.pages_read, status.bytes_read) == (3, 3 * config.page_nbytes)
        assert reader.tree.statistics().storage_pages == 3
        await serve(reader, prompt, generator, prefetch=False)
        await reader.drain()
        backup = reader.storage_status().backup
        assert backup is not None
        assert backup.written_pages == 1  # only the page storage lacked
        assert reader.tree.statistics().storage_pages == 4


async def test_a_prefetch_that_fails_unexpectedly_counts_the_pages_it_left_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counted as one error, it stood for a prefetch where every other case counts pages;
    # then the pages read but not landed counted twice, in `pages_read` and in `errors`.
    config = _config(batch_pages=2)
    generator = KVGenerator(config.layout, PAGE)
    prompt = _prompt(8)
    root = tmp_path / "l3"
    async with HiCache(config, storage=f"file://{root}") as writer:
        await serve(writer, prompt[: 6 * PAGE], generator, prefetch=False)
        await writer.drain()
    land = Prefetcher._land
    calls = 0

    def land_once(self: Prefetcher, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise RuntimeError("landing failed")
        return land(self, *args, **kwargs)

    monkeypatch.setattr(Prefetcher, "_land", land_once)
    async with HiCache(config, storage=f"file://{root}") as reader:
        result = await reader.prefetch(prompt)
        assert result.storage_tokens == 2 * PAGE
        status = reader.storage_status().prefetch
        assert status is not None
        assert status.terminated == 1
        assert status.misses == 2  # past the six pages `exists` found
        # The second batch was read but never landed: counted as read, once.
        assert status.pages_read == 4
        # The third batch was never read: its two pages, not one per prefetch.
        assert status.errors == 2
        assert status.pages_abandoned == 0
