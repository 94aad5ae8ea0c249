"""What the cache hands a backend, and what it makes of a backend's wrong answers."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
import structlog
from _plain_storage import PlainStorage

from hicache_async import CacheConfig, HiCache
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

    def stats(self) -> StorageStats:
        return msgspec.structs.replace(super().stats(), pages="many", bytes=-5)  # type: ignore[arg-type]


async def test_malformed_stats_count_as_a_failed_stats_call(hicache_config: CacheConfig) -> None:
    async with HiCache(hicache_config, storage=_BadStats()) as cache:
        with structlog.testing.capture_logs() as logs:
            status = cache.storage_status()
        assert status.attached
        assert status.storage is None
        (failed,) = [e for e in logs if e["event"] == "hicache.storage.stats.failed"]
        assert "pages='many'" in failed["error"]
        with structlog.testing.capture_logs() as logs:
            assert "hicache_storage_bytes" not in cache.metrics_text()
        # Once per scrape: the exposition used to ask the backend a second time.
        assert [e["event"] for e in logs].count("hicache.storage.stats.failed") == 1
