"""Backup writes what storage lacks above each job, so no chain keeps a hole.

A prefix is found in storage only up to its first missing page. These tests make pages go
missing the ways they do in service (the store loses them, a put is declined, an offer is
skipped) and check that the next backup below them writes them again, and that a second
instance then loads the whole prefix, every page checked against the KV generator.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

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
from hicache_async.storage._manifest import ManifestLimits, WarmupManifest
from hicache_async.storage._protocol import check_exists
from hicache_async.testing import KVGenerator, assert_drained, serve
from hicache_async.workers import BackupStatistics
from hicache_async.workers import _backup as backup_worker
from hicache_async.workers._backup import BackupWorker

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
    """A real backend the test opens and closes itself, so two caches can share it. It
    counts `exists` calls and keys and can fail them or hold them, and can decline puts
    (whole calls, or chosen keys), hold them, and record the keys they were given."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.exists_calls = 0
        self.exists_keys = 0
        self.exists_answer: object = None  # what to return instead, or an exception to raise
        self.declined_puts = 0  # the next this many puts are declined (MISS for every page)
        self.declined_keys: set[bytes] = set()  # always declined
        self.hold_exists: asyncio.Event | None = None
        self.exists_waiting = asyncio.Event()
        self.hold_puts: asyncio.Event | None = None
        self.put_waiting = asyncio.Event()
        self.put_keys: list[bytes] = []

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.exists_calls += 1
        self.exists_keys += len(keys)
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
        self.put_keys += keys
        if self.hold_puts is not None:
            self.put_waiting.set()
            await self.hold_puts.wait()
        if self.declined_puts:
            self.declined_puts -= 1
            return [Outcome.MISS] * len(keys)
        chosen = [i for i, key in enumerate(keys) if key not in self.declined_keys]
        stored = await self.inner.put(
            [keys[i] for i in chosen], [pages[i] for i in chosen], [metas[i] for i in chosen]
        )
        outcomes = [Outcome.MISS] * len(keys)
        for i, outcome in zip(chosen, stored, strict=True):
            outcomes[i] = outcome
        return outcomes


async def _queued(cache: HiCache, jobs: int) -> None:
    """Wait until the backup queue holds `jobs` jobs (device → host copies land meanwhile)."""
    link = cache._link
    assert link is not None
    for _ in range(500):
        if link.backup.pending >= jobs:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the backup queue never held {jobs} jobs")


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
    config = _config(check_prefix=False, skip_stored=False)
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
    config = _config(skip_stored=False)  # the check's own call, counted alone
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


async def test_a_node_split_while_its_put_runs_is_marked_by_the_pages_planned() -> None:
    # One batch holds `long` (8 pages) and `declined` (2 pages, refused by the store). While
    # its put runs, a prompt diverging after `long`'s fourth page splits that node: its
    # pages are then in two nodes, and `declined` must not be marked as stored.
    config = _config(max_retries=0, batch_pages=64)
    generator = KVGenerator(config.layout, PAGE, seed=10)
    first, long, declined = _prompt(14, 1), _prompt(15, 8), _prompt(16, 2)
    fork = np.concatenate([long[: 4 * PAGE], _prompt(17, 1)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            shared.declined_keys = set(cache.namespace.storage_keys(cache.keys_for(declined)))
            shared.hold_puts = asyncio.Event()
            await serve(cache, first, generator, prefetch=False)
            await asyncio.wait_for(shared.put_waiting.wait(), 5)  # the first put is held
            await serve(cache, long, generator, prefetch=False)
            await serve(cache, declined, generator, prefetch=False)
            await _queued(cache, 2)  # one batch for both
            shared.put_waiting.clear()
            held, shared.hold_puts = shared.hold_puts, asyncio.Event()
            held.set()
            await asyncio.wait_for(shared.put_waiting.wait(), 5)  # `long` and `declined`
            await serve(cache, fork, generator, prefetch=False)
            shared.hold_puts.set()
            await cache.drain()
            stored = {
                key for node in cache.tree.iter_nodes() if node.in_storage for key in node.keys
            }
            assert not stored & set(cache.keys_for(declined))
            assert set(cache.keys_for(long)) <= stored  # both parts of the split node
            assert await _in_storage(cache, memory, long) == 8
            cache.tree.check_invariants()
            assert_drained(cache)


async def test_a_flush_at_a_detach_writes_only_what_was_offered() -> None:
    # The detach unmarks every node before the flush: the chain above a queued job is not
    # "missing" from the old backend, and the flush must not write it again.
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=11)
    base = _prompt(18, 12)
    longer = np.concatenate([base, _prompt(19, 1)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            await serve(cache, base, generator, prefetch=False)
            await cache.drain()
            shared.put_keys.clear()
            shared.hold_puts = asyncio.Event()
            await serve(cache, _prompt(21, 1), generator, prefetch=False)
            await asyncio.wait_for(shared.put_waiting.wait(), 5)  # that put is held
            await serve(cache, longer, generator, prefetch=False)
            await _queued(cache, 1)  # planned only once the detach has begun
            detaching = asyncio.create_task(cache.detach_storage())
            await asyncio.sleep(0)
            shared.hold_puts.set()
            await detaching
            assert len(shared.put_keys) == 2  # the jobs' pages, not the 12 above the second
            assert_drained(cache)


async def test_a_long_conversation_asks_about_its_history_once_not_every_turn() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=12)
    turns = [_prompt(20 + turn, 1) for turn in range(40)]
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            for turn in range(len(turns)):
                await serve(cache, np.concatenate(turns[: turn + 1]), generator, prefetch=False)
                await cache.drain()
            backup = _backup(cache)
            assert backup.written_pages == 40
            # Each turn asks about what lies below the part found whole moments ago: about
            # one page a turn, not the whole conversation each time (820 keys).
            assert shared.exists_keys <= 2 * backup.written_pages
            assert backup.lost_pages == backup.repaired_pages == 0


async def _conversations(
    cache: HiCache, generator: KVGenerator, seeds: range, turns: int = 2
) -> list[np.ndarray]:
    """Serve a conversation of `turns` one-page turns per seed, each backed up before the
    next: from the second turn on, each backup finds the chain above it whole."""
    prompts = [_prompt(seed, 1) for seed in seeds]
    for turn in range(turns):
        if turn:
            prompts = [
                np.concatenate([p, _prompt(1000 * turn + s, 1)])
                for p, s in zip(prompts, seeds, strict=True)
            ]
        for prompt in prompts:
            await serve(cache, prompt, generator, prefetch=False)
            await cache.drain()
    return prompts


@contextlib.asynccontextmanager
async def _recording(
    interval: float, seed: int
) -> AsyncIterator[tuple[HiCache, Shared, KVGenerator, BackupWorker]]:
    """A cache over a counting store whose backup keeps chains found whole on record for
    `interval` seconds."""
    # Without the look-up of the batch's own pages, which would add one key a batch.
    config = _config(check_prefix_interval_s=interval, skip_stored=False)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            link = cache._link
            assert link is not None
            yield cache, shared, KVGenerator(config.layout, PAGE, seed=seed), link.backup
            assert_drained(cache)


async def test_chains_found_whole_are_kept_on_record_up_to_a_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # More chains found whole than the record holds, all fresh: the least recently found
    # are forgotten (not the record rebuilt on every batch), and a forgotten chain's next
    # batch asks about its whole history again, one longer `exists`.
    monkeypatch.setattr(backup_worker, "_CHECKED_MAX", 4)
    async with _recording(3600.0, seed=13) as (cache, shared, generator, worker):
        record = worker._checked
        prompts = await _conversations(cache, generator, range(60, 66))
        assert worker._checked is record
        assert len(record) == 4  # six chains found whole, the first two forgotten
        asked = []
        for prompt in (prompts[-1], prompts[0]):
            before = shared.exists_keys
            longer = np.concatenate([prompt, _prompt(99, 1)])
            await serve(cache, longer, generator, prefetch=False)
            await cache.drain()
            asked.append(shared.exists_keys - before)
        # The last conversation: its second turn only; the first: its whole history.
        assert asked == [1, 2]
        backup = _backup(cache)
        assert backup.lost_pages == backup.repaired_pages == 0


async def test_stale_chains_are_dropped_as_others_are_found() -> None:
    async with _recording(0.05, seed=14) as (cache, _, generator, worker):
        await _conversations(cache, generator, range(80, 84))
        assert worker._checked
        await asyncio.sleep(0.1)  # all of them stale now
        await _conversations(cache, generator, range(90, 91))
        assert len(worker._checked) == 1  # only the chain just found


async def test_backed_up_pages_carry_the_priority_of_the_request_that_committed_them() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=9)
    pinned, plain = _prompt(31, pages=4), _prompt(32, pages=2)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            for tokens, priority in ((pinned, 7), (plain, 0)):
                with cache.request(tokens, priority=priority) as req:
                    pages = await req.allocate(len(tokens))
                    for i, page in enumerate(pages):
                        generator.fill_page(cache.device_pool, page, tokens, i)
                    req.commit()
            await cache.drain()
            assert_drained(cache)
            stored = {info.key: info.priority for info in await memory.list_pages()}
            expected = {
                **dict.fromkeys(cache.namespace.storage_keys(cache.keys_for(pinned)), 7),
                **dict.fromkeys(cache.namespace.storage_keys(cache.keys_for(plain)), 0),
            }
            assert stored == expected
        assert await _loaded_by_a_second_instance(config, shared, pinned, generator) == 4


def test_an_exists_answer_is_a_count_of_the_keys_asked_about() -> None:
    assert check_exists(2, 3) == 2
    assert check_exists(np.int64(3), 3) == 3  # an integer type of a plugin's own
    assert type(check_exists(np.int64(0), 3)) is int
    for wrong in (True, False, 4, -1, "3", 2.0, np.float64(2.0), None):
        with pytest.raises(StorageError, match="not a count of 0 to 3 keys"):
            check_exists(wrong, 3)


class Flaky(Shared):
    """`Shared` whose put answers ERROR for the keys in `errors`, each once, and which
    keeps the memory store's warmup manifest."""

    def __init__(self, inner: MemoryStorage) -> None:
        super().__init__(inner)
        self.memory = inner
        self.errors: set[bytes] = set()

    def manifest(self, limits: ManifestLimits | None = None) -> WarmupManifest:
        return self.memory.manifest(limits)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        outcomes = await super().put(keys, pages, metas)
        for i, key in enumerate(keys):
            if key in self.errors:
                self.errors.discard(key)
                outcomes[i] = Outcome.ERROR
        return outcomes


async def test_a_node_with_one_page_declined_is_not_marked_stored() -> None:
    """A node counts as stored only once every one of its pages is: one declined page in
    the middle leaves the whole node unmarked and out of the warmup manifest, and counts as
    the only failed page."""
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=11)
    tokens = _prompt(11, 6)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Flaky(memory)
        async with HiCache(config, storage=shared) as cache:
            keys = cache.namespace.storage_keys(cache.keys_for(tokens))
            shared.declined_keys = {keys[3]}
            await serve(cache, tokens, generator, prefetch=False)
            await cache.drain()
            backup = _backup(cache)
            assert (backup.written_pages, backup.failed_pages, backup.retried_pages) == (5, 1, 0)
            assert backup.bytes_written == 5 * config.page_nbytes
            assert cache.tree.statistics().storage_pages == 0
            assert await _in_storage(cache, memory, tokens) == 3
            assert backup.manifest_entries == 0  # warmup must not look for the chain
            assert_backup_adds_up(backup)
            cache.tree.check_invariants()


async def test_a_page_that_failed_once_is_retried_and_counted_once() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=12)
    tokens = _prompt(12, 6)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        flaky = Flaky(memory)
        async with HiCache(config, storage=flaky) as cache:
            keys = cache.namespace.storage_keys(cache.keys_for(tokens))
            flaky.errors = {keys[1], keys[4]}
            await serve(cache, tokens, generator, prefetch=False)
            await cache.drain()
            backup = _backup(cache)
            assert (backup.written_pages, backup.failed_pages, backup.retried_pages) == (6, 0, 2)
            assert backup.bytes_written == 6 * config.page_nbytes
            assert cache.tree.statistics().storage_pages == 6
            assert await _in_storage(cache, memory, tokens) == 6
            assert backup.manifest_entries == 1
            assert_backup_adds_up(backup)


async def test_a_batch_takes_queued_jobs_only_up_to_batch_pages() -> None:
    """Jobs queued behind a held batch are taken until the batch holds `batch_pages` pages
    (the job that crosses it included), the rest left for the next batch."""
    config = _config(batch_pages=8)
    generator = KVGenerator(config.layout, PAGE, seed=13)
    first, *queued = [_prompt(30 + i, 5) for i in range(4)]
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = Shared(memory)
        async with HiCache(config, storage=shared) as cache:
            shared.hold_puts = asyncio.Event()
            await serve(cache, first, generator, prefetch=False)
            await asyncio.wait_for(shared.put_waiting.wait(), 5)  # the first batch is held
            for tokens in queued:
                await serve(cache, tokens, generator, prefetch=False)
            await _queued(cache, 3)
            shared.hold_puts.set()
            await cache.drain()
            backup = _backup(cache)
            assert backup.batches == 3  # 5 pages, then 5 + 5, then 5
            assert backup.written_pages == 20
            assert_backup_adds_up(backup)
            assert_drained(cache)


class CountsChecksInFlight(Shared):
    """Holds every `exists` until the gate it found set, counting the calls begun."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.gate.set()
        self.begun = 0
        self.in_flight = 0
        self.most_in_flight = 0

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.begun += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.gate.wait()
            return await super().exists(keys)
        finally:
            self.in_flight -= 1


async def _until_begun(store: CountsChecksInFlight, calls: int) -> None:
    for _ in range(3000):  # a bound only: each loop turn lets the worker begin more
        if store.begun >= calls:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{store.begun} checks begun, not {calls}")


@pytest.mark.parametrize("chains", [4, 12])
async def test_the_checks_of_a_batchs_chains_are_in_flight_together(chains: int) -> None:
    # Each job extends a one-page base backed up before: its batch checks every base on a
    # slow store at once (up to `_LOOKUPS_IN_FLIGHT`), not one round trip after another.
    # One base was lost meanwhile: only its chain is found short, and written again.
    config = _config(skip_stored=False, batch_pages=32)
    generator = KVGenerator(config.layout, PAGE, seed=14)
    bases = [_prompt(60 + i, 1) for i in range(chains + 1)]
    longer = [np.concatenate([base, _prompt(80 + i, 1)]) for i, base in enumerate(bases)]
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = CountsChecksInFlight(memory)
        async with HiCache(config, storage=shared) as cache:
            for base in bases:
                await serve(cache, base, generator, prefetch=False)
            await cache.drain()
            lost = cache.namespace.storage_keys(cache.keys_for(bases[-1]))
            assert await memory.delete(lost) == 1
            shared.begun = shared.most_in_flight = 0
            shared.gate = asyncio.Event()
            # The first batch's one check holds the worker while the others queue up.
            await serve(cache, longer[0], generator, prefetch=False)
            await _until_begun(shared, 1)
            for tokens in longer[1:]:
                await serve(cache, tokens, generator, prefetch=False)
            await _queued(cache, chains)
            held, shared.gate = shared.gate, asyncio.Event()
            held.set()
            expected = min(chains, backup_worker._LOOKUPS_IN_FLIGHT)
            await _until_begun(shared, 1 + expected)
            for _ in range(20):  # no more begin while those are held
                await asyncio.sleep(0)
            assert shared.begun == 1 + expected
            assert shared.most_in_flight == expected
            shared.gate.set()
            await cache.drain()
            assert shared.begun == 1 + chains
            backup = _backup(cache)
            assert backup.lost_pages == backup.repaired_pages == 1
            assert await memory.exists(lost) == 1
            for tokens in longer:
                assert await _in_storage(cache, memory, tokens) == 2
            assert_backup_adds_up(backup)
            assert_drained(cache)


async def test_giving_way_while_a_shared_prefix_is_checked_stops_the_chains_below_it() -> None:
    # Chains whose first node to ask about is one they share (a system prompt whose record
    # went stale) wait for the first one's check: a give-way during it cancels that check,
    # and the others are then never asked about.
    config = _config(skip_stored=False, batch_pages=32)
    generator = KVGenerator(config.layout, PAGE, seed=15)
    system = _prompt(90, 2)
    bases = [np.concatenate([system, _prompt(91 + i, 1)]) for i in range(4)]
    longer = [np.concatenate([base, _prompt(101 + i, 1)]) for i, base in enumerate(bases)]
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = CountsChecksInFlight(memory)
        async with HiCache(config, storage=shared) as cache:
            for base in bases:
                await serve(cache, base, generator, prefetch=False)
            await cache.drain()
            link = cache._link
            assert link is not None
            link.backup._checked.clear()  # the record of the system prompt gone stale
            # A put held keeps the worker while the jobs below the bases queue up.
            shared.hold_puts = asyncio.Event()
            await serve(cache, _prompt(120, 1), generator, prefetch=False)
            await asyncio.wait_for(shared.put_waiting.wait(), 30)
            for tokens in longer:
                await serve(cache, tokens, generator, prefetch=False)
            await _queued(cache, len(longer))
            shared.begun = 0
            shared.gate = asyncio.Event()
            held, shared.hold_puts = shared.hold_puts, None
            held.set()
            await _until_begun(shared, 1)
            for _ in range(20):  # the others wait for it
                await asyncio.sleep(0)
            assert shared.begun == 1
            link.backup.give_way()
            shared.gate.set()
            await cache.drain()
            assert shared.begun == 1
            backup = _backup(cache)
            assert backup.gave_way == 1
            assert backup.failed_pages == len(longer)
            assert_backup_adds_up(backup)
            assert_drained(cache)
