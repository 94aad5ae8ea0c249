"""A close's flush deadline over a store whose calls cannot be cut short (a call running in a
thread, as Mooncake's to a frozen master): once the deadline has passed, nothing more is
written, even while the close still waits for a prefetch's call to return."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
from _unowned_storage import Unowned, assert_backup_adds_up
from structlog.testing import capture_logs
from test_cancelled_close import _until

from hicache_async import CacheConfig, HiCache, PrefetchStatus
from hicache_async._uncancelled import finish_uncancelled
from hicache_async.storage import MemoryStorage, Outcome, PageBuffer, PageMeta, StorageBackend
from hicache_async.testing import KVGenerator, serve

PAGE = 4


def _config() -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "flush-deadline-test",
            "prefetch": {"policy": "best_effort", "threshold_tokens": PAGE},
            "backup": {"batch_pages": 2, "flush_deadline_s": 0.0, "retry_backoff_s": 0.0},
        }
    )


class Stuck(Unowned):
    """A real store whose `exists` and `put` wait, through any cancellation, until the test
    opens their gate: calls in a thread that cannot be stopped."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.lookups = asyncio.Event()
        self.writes = asyncio.Event()
        self.lookups_held = 0
        self.puts = 0
        self.puts_held = 0

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.lookups_held += 1
        cancelled = await finish_uncancelled(self.lookups.wait())
        self.lookups_held -= 1
        if cancelled is not None:
            raise cancelled
        return await self.inner.exists(keys)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        self.puts += 1
        self.puts_held += 1
        cancelled = await finish_uncancelled(self.writes.wait())
        self.puts_held -= 1
        if cancelled is not None:
            raise cancelled
        return await self.inner.put(keys, pages, metas)


async def test_no_backup_is_written_past_the_flush_deadline_while_a_lookup_holds_the_close() -> (
    None
):
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=2)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 5000, size=4 * PAGE) for _ in range(6)]
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        store = Stuck(memory)
        cache = HiCache(config, storage=store)
        await cache.__aenter__()
        try:
            for prompt in prompts:
                await serve(cache, prompt, generator, prefetch=False)
            link = cache._link
            assert link is not None
            offered = len(prompts) * 4
            # Every page offered: the first batch is in its put, the others queued.
            await _until(lambda: link.backup.offered_pages == offered and store.puts_held == 1)
            handle = await cache.start_prefetch(prompts[0][: 2 * PAGE] + 1)
            await _until(lambda: store.lookups_held == 1)  # a worker is in the lookup
            assert link.backup.pending > 0
            with capture_logs() as logs:
                closing = asyncio.create_task(cache.__aexit__(None, None, None))
                await _until(
                    lambda: any(e["event"] == "hicache.backup.flush.deadline" for e in logs)
                )
                store.writes.set()  # the put in progress returns; the deadline has passed
                await _until(lambda: store.puts_held == 0)
                for _ in range(50):  # loop passes enough for a worker still running to put
                    await asyncio.sleep(0)
                assert store.puts == 1, "backups were written after the flush deadline"
                store.lookups.set()
                await asyncio.wait_for(closing, 30)
            assert handle.status is PrefetchStatus.CANCELLED
            detached = next(e for e in logs if e["event"] == "hicache.storage.detached")
            assert detached["written_pages"] == 0
            assert detached["dropped_pages"] == offered
            assert_backup_adds_up(link.backup.statistics())
        finally:
            store.lookups.set()
            store.writes.set()
            if cache.state == "open":
                await cache.__aexit__(None, None, None)
