"""What the cache hands a backend, and what it makes of a backend's wrong answers."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
import structlog
from _plain_storage import PlainStorage

from hicache_async import CacheConfig, HiCache
from hicache_async._ratelog import LogLimiter
from hicache_async.storage import Outcome, PageBuffer, PageMeta, StorageStats
from hicache_async.testing import KVGenerator, serve


class _Scribbler(PlainStorage):
    """Stores a page, then zeroes every segment of it it is able to write (scratch use)."""

    def __init__(self) -> None:
        super().__init__()
        self.segments = 0
        self.writable = 0

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        outcomes = await super().put(keys, pages, metas)
        for page in pages:
            for segment in page:
                self.segments += 1
                view = memoryview(segment)
                if not view.readonly:
                    self.writable += 1
                    view.cast("B")[:] = bytes(view.nbytes)
        return outcomes


async def test_backups_hand_put_read_only_views_of_host_pages(
    hicache_config: CacheConfig, kv_generator: KVGenerator
) -> None:
    generator = kv_generator
    prompt = np.arange(8 * hicache_config.page_size)
    storage = _Scribbler()
    async with HiCache(hicache_config, storage=storage) as cache:
        await serve(cache, prompt, generator)
        await cache.drain()
        assert storage.segments > 0
        assert storage.writable == 0
        # What the host pool serves is still the prompt's KV.
        host = cache.host_pool
        found = cache.tree.match(cache.keys_for(prompt), touch=False)
        for index, page in enumerate(found.host_pages):
            generator.check_page(host, page, prompt, index)


async def test_a_bool_priority_is_refused_when_the_request_starts(hicache: HiCache) -> None:
    # It would be stored in page headers, where a put refuses it (much later, in a backup).
    with pytest.raises(ValueError, match="priority"):
        hicache.request(list(range(16)), priority=True)


class _BadStats(PlainStorage):
    """Stats of the wrong types, which msgspec builds without a word."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def stats(self) -> StorageStats:
        self.calls += 1
        return msgspec.structs.replace(super().stats(), pages="many", bytes=-5)  # type: ignore[arg-type]


class _DeadStats(PlainStorage):
    """A backend whose `stats()` always raises, as one whose server is gone may."""

    def stats(self) -> StorageStats:
        raise ConnectionError("server gone")


async def test_malformed_stats_count_as_a_failed_stats_call(hicache_config: CacheConfig) -> None:
    storage = _BadStats()
    async with HiCache(hicache_config, storage=storage) as cache:
        with structlog.testing.capture_logs() as logs:
            status = cache.storage_status()
        assert status.attached
        assert status.storage is None
        (failed,) = [e for e in logs if e["event"] == "hicache.storage.stats.failed"]
        assert "pages='many'" in failed["error"]
        calls = storage.calls
        assert "hicache_storage_bytes" not in cache.metrics_text()
        # Once per scrape: the exposition used to ask the backend a second time.
        assert storage.calls == calls + 1


async def test_a_failing_stats_call_is_logged_once_per_interval(
    hicache_config: CacheConfig,
) -> None:
    # Scraped every few seconds, a backend whose stats() fails must not log at each scrape.
    async with HiCache(hicache_config, storage=_DeadStats()) as cache:
        link = cache._link
        assert link is not None
        now = [0.0]
        link._stats_log = LogLimiter(60.0, clock=lambda: now[0])
        with structlog.testing.capture_logs() as logs:
            for _ in range(10):
                assert cache.storage_status().storage is None
                assert "hicache_storage_bytes" not in cache.metrics_text()
            now[0] = 60.0
            cache.storage_status()
    failed = [e for e in logs if e["event"] == "hicache.storage.stats.failed"]
    assert [e["unlogged_since_last"] for e in failed] == [0, 19]
    assert all(e["error"] == "ConnectionError('server gone')" for e in failed)
    assert all(e["backend"] == link.backend.name for e in failed)
