"""A hot prefix stays stored in a store that evicts by use.

A prefix every chain runs through (a shared system prompt) is served from the device, so
nothing but the backup's `check_prefix` lookups uses it in storage. Those must ask about it
again once its record is `check_prefix_interval_s` old, however busy the chains below it
are; otherwise the store evicts it, and every chain under it is lost to another instance and
to a warmup after a restart, though each of their other pages is still stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import HEADER_NBYTES, MemoryStorage, Outcome, PageBuffer, PageMeta
from hicache_async.testing import KVGenerator, serve
from hicache_async.workers import _backup as backup_worker

PAGE = 4
INTERVAL_S = 10.0


class _Clock:
    """The backup worker's clock, which the test moves."""

    now = 1000.0

    @classmethod
    def monotonic(cls) -> float:
        return cls.now


def _config(interval: float = INTERVAL_S) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "backup-hot-prefix-test",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
            "backup": {"check_prefix_interval_s": interval},
        }
    )


def _prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, size=pages * PAGE)


async def test_a_prefix_every_chain_shares_is_asked_about_each_interval_and_stays_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backup_worker, "time", _Clock)
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=21)
    system = _prompt(1, 1)
    # Room for 12 pages; the conversations below write 40.
    capacity = 12 * (HEADER_NBYTES + config.page_nbytes)
    async with MemoryStorage(capacity_bytes=capacity) as memory:
        shared = Unowned(memory)
        async with HiCache(config, storage=shared) as cache:
            system_key = cache.namespace.storage_keys(cache.keys_for(system))
            # Conversations of two one-page turns under the system prompt, a turn every 3 s:
            # each second turn's check starts below the system prompt, found 3 s earlier.
            for seed in range(10, 30):
                first = np.concatenate([system, _prompt(seed, 1)])
                last = np.concatenate([first, _prompt(seed + 100, 1)])
                for prompt in (first, last):
                    await serve(cache, prompt, generator, prefetch=False)
                    await cache.drain()
                    _Clock.now += 3.0
            assert await memory.exists(system_key) == 1
        async with HiCache(config, storage=shared) as second:
            served = await serve(second, last, generator, check="all")
            await second.drain()
        assert served.checked_pages == 3
        assert served.storage_tokens == 3 * PAGE  # the whole conversation, from storage


class _Counting(Unowned):
    """Counts the keys `exists` is asked about, the calls that begin with `first`, and can
    hold puts (so that the backup queue gathers jobs for one batch)."""

    def __init__(self, inner: MemoryStorage) -> None:
        super().__init__(inner)
        self.first: bytes | None = None
        self.first_asked = 0
        self.keys_asked = 0
        self.hold_puts: asyncio.Event | None = None
        self.put_waiting = asyncio.Event()
        self.hold_exists: asyncio.Event | None = None
        self.exists_held = 0

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.keys_asked += len(keys)
        self.first_asked += 1 if keys and keys[0] == self.first else 0
        if self.hold_exists is not None:
            self.exists_held += 1
            await self.hold_exists.wait()
        return await super().exists(keys)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        if self.hold_puts is not None:
            self.put_waiting.set()
            await self.hold_puts.wait()
        return await super().put(keys, pages, metas)


async def test_chains_of_one_batch_under_a_stale_shared_prefix_ask_about_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Eight conversations under a 10-page system prompt, their next turns backed up in one
    # batch after the prompt's record went stale: the chains are checked several at once,
    # yet the prompt is asked about once (one chain first, the others below it).
    monkeypatch.setattr(backup_worker, "time", _Clock)
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=22)
    system = _prompt(2, 10)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        counting = _Counting(memory)
        async with HiCache(config, storage=counting) as cache:
            counting.first = cache.namespace.storage_keys(cache.keys_for(system))[0]
            prompts = [np.concatenate([system, _prompt(200 + c, 1)]) for c in range(8)]
            for prompt in prompts:
                await serve(cache, prompt, generator, prefetch=False)
            await cache.drain()
            _Clock.now += 2 * INTERVAL_S
            # A put held: the eight turns below queue up behind it, for one batch.
            counting.hold_puts = asyncio.Event()
            await serve(cache, _prompt(3, 1), generator, prefetch=False)
            await counting.put_waiting.wait()
            prompts = [np.concatenate([p, _prompt(300 + c, 1)]) for c, p in enumerate(prompts)]
            for prompt in prompts:
                await serve(cache, prompt, generator, prefetch=False)
            link = cache._link
            assert link is not None
            for _ in range(1000):  # the device-to-host copies land meanwhile
                if link.backup.pending >= 8:
                    break
                await asyncio.sleep(0.01)
            assert link.backup.pending == 8
            keys, firsts, batches = counting.keys_asked, counting.first_asked, link.backup.batches
            counting.hold_puts.set()
            await cache.drain()
            assert link.backup.batches == batches + 1  # the eight turns in one batch
            assert counting.first_asked - firsts == 1
            # The prompt once, and each chain's turn written last time.
            assert counting.keys_asked - keys == 10 + 8
            assert link.backup.statistics().lost_pages == 0


async def test_a_long_conversation_asks_one_key_a_turn_and_its_history_once_an_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the docs say a conversation's checks cost: one-page turns every quarter of the
    # interval ask about the page the last turn wrote, and every fourth turn, once the
    # history's record is an interval old, about the whole history above the new turn.
    monkeypatch.setattr(backup_worker, "time", _Clock)
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=23)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        counting = _Counting(memory)
        async with HiCache(config, storage=counting) as cache:
            prompt = _prompt(4, 1)
            await serve(cache, prompt, generator, prefetch=False)
            await cache.drain()
            asked = []
            for turn in range(24):
                _Clock.now += INTERVAL_S / 4
                prompt = np.concatenate([prompt, _prompt(400 + turn, 1)])
                before = counting.keys_asked
                await serve(cache, prompt, generator, prefetch=False)
                await cache.drain()
                asked.append(counting.keys_asked - before)
            history = [len(prompt) // PAGE - 24 + turn for turn in range(24)]
            assert asked == [h if turn % 4 == 0 else 1 for turn, h in enumerate(history)]


async def test_with_no_record_kept_the_chains_under_a_shared_prefix_are_checked_at_once() -> None:
    # check_prefix_interval_s=0: every chain is asked about whole, so none waits for
    # another that shares its first node (it would ask about that node all the same).
    config = _config(interval=0.0)
    generator = KVGenerator(config.layout, PAGE, seed=24)
    system = _prompt(5, 2)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        counting = _Counting(memory)
        async with HiCache(config, storage=counting) as cache:
            prompts = [np.concatenate([system, _prompt(500 + c, 1)]) for c in range(8)]
            for prompt in prompts:
                await serve(cache, prompt, generator, prefetch=False)
            await cache.drain()
            counting.hold_puts = asyncio.Event()
            await serve(cache, _prompt(6, 1), generator, prefetch=False)
            await counting.put_waiting.wait()
            prompts = [np.concatenate([p, _prompt(600 + c, 1)]) for c, p in enumerate(prompts)]
            for prompt in prompts:
                await serve(cache, prompt, generator, prefetch=False)
            link = cache._link
            assert link is not None
            for _ in range(1000):  # the device-to-host copies land meanwhile
                if link.backup.pending >= 8:
                    break
                await asyncio.sleep(0.01)
            assert link.backup.pending == 8
            counting.hold_exists = asyncio.Event()
            counting.hold_puts.set()
            for _ in range(1000):  # the batch's checks begin
                if counting.exists_held >= 8:
                    break
                await asyncio.sleep(0.01)
            assert counting.exists_held == 8  # all eight chains asked at once
            counting.hold_exists.set()
            await cache.drain()
            assert link.backup.statistics().lost_pages == 0
