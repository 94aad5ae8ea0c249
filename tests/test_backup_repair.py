"""Backup writes what storage lacks above each job, so no chain keeps a hole.

A prefix is found in storage only up to its first missing page. These tests make pages go
missing the ways they do in service (the store loses them, a put is declined, an offer is
skipped) and check that the next backup below them writes them again, and that a second
instance then loads the whole prefix, every page checked against the KV generator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import structlog
from _unowned_storage import Unowned, assert_backup_adds_up

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import (
    MemoryStorage,
    Outcome,
    PageBuffer,
    PageMeta,
    StorageBackend,
    StorageError,
)
from hicache_async.testing import KVGenerator, assert_drained, serve
from hicache_async.workers import BackupStatistics

PAGE = 4


def _config(**backup: object) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "backup-repair-test",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
            "backup": {"batch_pages": 8, "retry_backoff_s": 0.001, **backup},
        }
    )


class Shared(Unowned):
    """A real backend the test opens and closes itself, so two caches can share it; it
    counts `exists` calls and can be told to fail them, decline puts, or hold `exists`."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.exists_calls = 0
        self.exists_answer: object = None  # what to return instead, or an exception to raise
        self.declined_puts = 0  # the next this many puts are declined (MISS for every page)
        self.hold_exists: asyncio.Event | None = None
        self.exists_waiting = asyncio.Event()

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.exists_calls += 1
        if self.hold_exists is not None:
            self.exists_waiting.set()
            await self.hold_exists.wait()
        if isinstance(self.exists_answer, BaseException):
            raise self.exists_answer
        if self.exists_answer is not None:
            return self.exists_answer  # type: ignore[return-value]  # a wrong answer
        return await self.inner.exists(keys)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        if self.declined_puts:
            self.declined_puts -= 1
            return [Outcome.MISS] * len(keys)
        return await self.inner.put(keys, pages, metas)


def _backup(cache: HiCache) -> BackupStatistics:
    status = cache.storage_status().backup
    assert status is not None
    return status


def _prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, size=pages * PAGE)


async def _in_storage(cache: HiCache, backend: StorageBackend, tokens: np.ndarray) -> int:
    """Pages of `tokens`' prefix that storage holds, from the first."""
    return await backend.exists(cache.namespace.storage_keys(cache.keys_for(tokens)))


async def _stored_then_lost(
    cache: HiCache, memory: MemoryStorage, tokens: np.ndarray, generator: KVGenerator, lost: slice
) -> None:
    """Serve `tokens` until backed up, then take the pages `lost` out of the store (as if it
    restarted): the cache still holds them on the host, marked as stored."""
    await serve(cache, tokens, generator, prefetch=False)
    await cache.drain()
    keys = cache.namespace.storage_keys(cache.keys_for(tokens))
    assert await memory.exists(keys) == len(keys)
    assert await memory.delete(keys[lost]) == len(keys[lost])


async def _loaded_by_a_second_instance(
    config: CacheConfig, shared: Shared, tokens: np.ndarray, generator: KVGenerator
) -> int:
    async with HiCache(config, storage=shared) as second:
        served = await serve(second, tokens, generator, check="all")
        await second.drain()
        assert_drained(second)
    assert served.checked_pages == len(tokens) // PAGE  # every page matched the generator
    return served.storage_tokens // PAGE


async def test_pages_the_store_lost_are_written_again_by_the_next_backup_below_them() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=3)
    base = _prompt(1, 6)
    longer = np.concatenate([base, _prompt(2, 3)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            await _stored_then_lost(cache, memory, base, generator, slice(0, 2))
            assert await _in_storage(cache, memory, longer) == 0
            await serve(cache, longer, generator)
            await cache.drain()
            assert await _in_storage(cache, memory, longer) == 9
            backup = _backup(cache)
            assert backup.lost_pages == 6  # the node holding the lost pages, marked again
            assert backup.repaired_pages == 6
            assert_backup_adds_up(backup)
            cache.tree.check_invariants()
            assert_drained(cache)
        assert await _loaded_by_a_second_instance(config, shared, longer, generator) == 9


async def test_a_declined_put_is_written_with_the_next_job_below_it() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=4)
    base = _prompt(3, 5)
    longer = np.concatenate([base, _prompt(4, 2)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        shared.declined_puts = 1
        async with HiCache(config, storage=shared) as cache:
            await serve(cache, base, generator)
            await cache.drain()
            assert _backup(cache).failed_pages == 5
            assert await _in_storage(cache, memory, base) == 0
            await serve(cache, longer, generator)
            await cache.drain()
            backup = _backup(cache)
            assert backup.repaired_pages == 5
            assert backup.lost_pages == 0  # never marked stored: nothing to find lost
            assert_backup_adds_up(backup)
            assert await _in_storage(cache, memory, longer) == 7
        assert await _loaded_by_a_second_instance(config, shared, longer, generator) == 7


async def test_without_the_check_lost_pages_stay_lost_and_no_exists_is_asked() -> None:
    config = _config(check_prefix=False)
    generator = KVGenerator(config.layout, PAGE, seed=5)
    base = _prompt(5, 4)
    longer = np.concatenate([base, _prompt(6, 2)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            await _stored_then_lost(cache, memory, base, generator, slice(0, 1))
            await serve(cache, longer, generator, prefetch=False)
            await cache.drain()
            assert shared.exists_calls == 0
            backup = _backup(cache)
            assert backup.lost_pages == backup.repaired_pages == 0
            assert await _in_storage(cache, memory, longer) == 0
            assert_backup_adds_up(backup)


@pytest.mark.parametrize("answer", [StorageError("exists broke"), 7, -1, True, "3"])
async def test_a_failed_or_wrong_check_unmarks_nothing_and_the_job_is_written(
    answer: object,
) -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=6)
    base = _prompt(7, 4)
    longer = np.concatenate([base, _prompt(8, 2)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            await _stored_then_lost(cache, memory, base, generator, slice(0, 1))
            shared.exists_answer = answer
            with structlog.testing.capture_logs() as logs:
                await serve(cache, longer, generator, prefetch=False)
                await cache.drain()
            assert shared.exists_calls == 1
            assert [e["event"] for e in logs].count("hicache.backup.check.failed") == 1
            backup = _backup(cache)
            assert backup.lost_pages == backup.repaired_pages == 0
            assert backup.written_pages == 6  # the base's 4 and the job's 2
            shared.exists_answer = None
            keys = cache.namespace.storage_keys(cache.keys_for(longer))
            assert await memory.exists(keys[1:]) == 5
            assert_drained(cache)


async def test_a_chain_split_while_its_check_waits_unmarks_the_right_node() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=8)
    base = _prompt(9, 8)
    longer = np.concatenate([base, _prompt(10, 2)])
    # Diverges after the base's third page: inserting it splits the base's node there.
    fork = np.concatenate([base[: 3 * PAGE], _prompt(11, 2)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            # Lost: the sixth page, below the split to come.
            await _stored_then_lost(cache, memory, base, generator, slice(5, 6))
            shared.hold_exists = asyncio.Event()
            await serve(cache, longer, generator, prefetch=False)
            await asyncio.wait_for(shared.exists_waiting.wait(), 5)
            await serve(cache, fork, generator, prefetch=False)
            shared.hold_exists.set()
            shared.hold_exists = None
            await cache.drain()
            backup = _backup(cache)
            assert backup.lost_pages == 5  # the tail of the split node, pages 4 to 8
            assert backup.repaired_pages == 5
            assert await _in_storage(cache, memory, longer) == 10
            assert await _in_storage(cache, memory, fork) == 5
            cache.tree.check_invariants()
            assert_backup_adds_up(backup)
            assert_drained(cache)
        assert await _loaded_by_a_second_instance(config, shared, longer, generator) == 10


async def test_a_detach_during_the_check_leaves_nothing_protected() -> None:
    config = _config(flush_deadline_s=0.05)
    generator = KVGenerator(config.layout, PAGE, seed=9)
    base = _prompt(12, 4)
    longer = np.concatenate([base, _prompt(13, 2)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            await serve(cache, base, generator, prefetch=False)
            await cache.drain()
            shared.hold_exists = asyncio.Event()  # never set: the check waits until cancelled
            await serve(cache, longer, generator, prefetch=False)
            await asyncio.wait_for(shared.exists_waiting.wait(), 5)
            await cache.detach_storage()
            assert not any(node.in_storage for node in cache.tree.iter_nodes())
            cache.tree.check_invariants()
            assert_drained(cache)
