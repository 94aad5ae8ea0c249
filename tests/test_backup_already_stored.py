"""Backup does not write again what storage holds already.

Keys are content-addressed (namespace and token chain), so a page another instance stored, or
this one before its tree forgot the node, is the same page: the backup asks `exists` about the
batch's own pages first, writes only what storage lacks, and marks the rest in storage. The
built-in file and memory stores' puts already move nothing for such pages
(`put_skips_stored`), so most tests wrap them to say otherwise, as a backend whose put sends
every page would.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import numpy as np
import pytest
import structlog
from _unowned_storage import assert_backup_adds_up
from test_backup_repair import Shared, _queued

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import (
    FileStorage,
    MemoryStorage,
    Outcome,
    PageBuffer,
    PageMeta,
    StorageBackend,
    StorageCapabilities,
    StorageError,
)
from hicache_async.testing import KVGenerator, RedisServer, assert_drained, serve
from hicache_async.workers import BackupStatistics
from hicache_async.workers import _backup as backup_worker

PAGE = 4


class SendsEveryPage(Shared):
    """A real store whose put, as far as the backup knows, sends every page it is given."""

    @property
    def capabilities(self) -> StorageCapabilities:
        return msgspec.structs.replace(self.inner.capabilities, put_skips_stored=False)


def _config(**backup: object) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "backup-already-stored-test",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
            "backup": {"batch_pages": 8, "retry_backoff_s": 0.001, **backup},
        }
    )


def _prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, size=pages * PAGE)


def _backup(cache: HiCache) -> BackupStatistics:
    status = cache.storage_status().backup
    assert status is not None
    return status


def _all_in_storage(cache: HiCache, tokens: np.ndarray) -> bool:
    keys = set(cache.keys_for(tokens))
    stored = {key for node in cache.tree.iter_nodes() if node.in_storage for key in node.keys}
    return keys <= stored


@asynccontextmanager
async def _store(kind: str, tmp_path: Path) -> AsyncIterator[StorageBackend]:
    backend: StorageBackend = (
        MemoryStorage(capacity_bytes=16 << 20) if kind == "memory" else FileStorage(tmp_path)
    )
    async with backend:
        yield backend


async def _served_and_stored(
    config: CacheConfig, shared: Shared, tokens: np.ndarray, generator: KVGenerator
) -> None:
    """One instance serves `tokens` and backs them up."""
    async with HiCache(config, storage=shared) as cache:
        await serve(cache, tokens, generator, prefetch=False)
        await cache.drain()
        assert _all_in_storage(cache, tokens)


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_a_second_instance_writes_none_of_what_the_first_stored(
    kind: str, tmp_path: Path
) -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=1)
    tokens = _prompt(1, 6)
    async with _store(kind, tmp_path) as backend:
        shared = SendsEveryPage(backend)
        await _served_and_stored(config, shared, tokens, generator)
        puts = backend.stats().puts
        shared.put_keys.clear()
        # The second computes the same prompt (no prefetch) and backs it up.
        async with HiCache(config, storage=shared) as second:
            await serve(second, tokens, generator, prefetch=False)
            await second.drain()
            backup = _backup(second)
            assert backup.written_pages == 0
            assert backup.already_stored_pages == 6
            assert shared.put_keys == []
            assert backend.stats().puts == puts
            assert _all_in_storage(second, tokens)
            assert_backup_adds_up(backup)
            second.tree.check_invariants()
            assert_drained(second)
        # A third instance loads the whole prompt from storage, every page checked.
        async with HiCache(config, storage=shared) as third:
            served = await serve(third, tokens, generator, check="loaded")
            assert served.storage_tokens == 6 * PAGE


async def test_a_partly_stored_chain_writes_only_its_missing_tail() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=2)
    tokens = _prompt(2, 6)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = SendsEveryPage(memory)
        await _served_and_stored(config, shared, tokens[: 3 * PAGE], generator)
        shared.put_keys.clear()
        async with HiCache(config, storage=shared) as second:
            await serve(second, tokens, generator, prefetch=False)
            await second.drain()
            backup = _backup(second)
            keys = second.namespace.storage_keys(second.keys_for(tokens))
            assert shared.put_keys == keys[3:]
            assert backup.written_pages == 3
            assert backup.already_stored_pages == 3
            assert _all_in_storage(second, tokens)
            assert_backup_adds_up(backup)
            assert_drained(second)
        async with HiCache(config, storage=shared) as third:
            served = await serve(third, tokens, generator, check="loaded")
            assert served.storage_tokens == 6 * PAGE


async def test_pages_above_a_job_that_storage_holds_are_not_written_again() -> None:
    # The first instance stores the base. The second's offer of it is skipped (its queue is
    # full); then it backs up a longer prompt: the base, planned above the job, is found in
    # storage and not written again.
    config = _config(queue_size=1)
    generator = KVGenerator(config.layout, PAGE, seed=3)
    base = _prompt(3, 4)
    longer = np.concatenate([base, _prompt(4, 2)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = SendsEveryPage(memory)
        await _served_and_stored(config, shared, base, generator)
        async with HiCache(config, storage=shared) as second:
            shared.hold_puts = asyncio.Event()
            await serve(second, _prompt(10, 1), generator, prefetch=False)
            await asyncio.wait_for(shared.put_waiting.wait(), 5)  # that batch is held
            await serve(second, _prompt(11, 1), generator, prefetch=False)
            await _queued(second, 1)  # the queue is full
            await serve(second, base, generator, prefetch=False)
            for _ in range(500):  # until the base's host copy lands and its offer is skipped
                if _backup(second).skipped_pages:
                    break
                await asyncio.sleep(0.01)
            shared.hold_puts.set()
            await second.drain()
            assert _backup(second).skipped_pages == 4
            shared.put_keys.clear()
            await serve(second, longer, generator, prefetch=False)
            await second.drain()
            backup = _backup(second)
            keys = second.namespace.storage_keys(second.keys_for(longer))
            assert shared.put_keys == keys[4:]
            assert backup.repaired_pages == 4
            assert backup.already_stored_pages == 4
            assert _all_in_storage(second, longer)
            assert_backup_adds_up(backup)
            assert_drained(second)


@pytest.mark.parametrize("answer", [StorageError("exists broke"), 7, -1])
async def test_a_failed_or_wrong_exists_writes_every_page(answer: object) -> None:
    config = _config(check_prefix=False)
    generator = KVGenerator(config.layout, PAGE, seed=5)
    tokens = _prompt(5, 6)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = SendsEveryPage(memory)
        await _served_and_stored(config, shared, tokens, generator)
        shared.put_keys.clear()
        shared.exists_calls = 0
        shared.exists_answer = answer
        async with HiCache(config, storage=shared) as second:
            with structlog.testing.capture_logs() as logs:
                await serve(second, tokens, generator, prefetch=False)
                await second.drain()
            assert shared.exists_calls == 1
            assert [e["event"] for e in logs].count("hicache.backup.stored.failed") == 1
            backup = _backup(second)
            assert backup.already_stored_pages == 0
            assert backup.written_pages == 6
            assert len(shared.put_keys) == 6
            assert _all_in_storage(second, tokens)
            assert_backup_adds_up(backup)
            assert_drained(second)


async def test_an_exists_that_times_out_writes_every_page() -> None:
    config = _config(check_prefix=False, io_timeout_s=0.05)
    generator = KVGenerator(config.layout, PAGE, seed=6)
    tokens = _prompt(6, 6)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = SendsEveryPage(memory)
        await _served_and_stored(config, shared, tokens, generator)
        shared.put_keys.clear()
        shared.hold_exists = asyncio.Event()  # never set: only the timeout ends the call
        async with HiCache(config, storage=shared) as second:
            await serve(second, tokens, generator, prefetch=False)
            await second.drain()
            assert shared.exists_waiting.is_set()
            backup = _backup(second)
            assert backup.already_stored_pages == 0
            assert backup.written_pages == 6
            assert _all_in_storage(second, tokens)
            assert_drained(second)


async def test_with_skip_stored_off_every_page_is_written_and_no_exists_asked() -> None:
    config = _config(check_prefix=False, skip_stored=False)
    generator = KVGenerator(config.layout, PAGE, seed=7)
    tokens = _prompt(7, 6)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = SendsEveryPage(memory)
        await _served_and_stored(config, shared, tokens, generator)
        shared.exists_calls = 0
        async with HiCache(config, storage=shared) as second:
            await serve(second, tokens, generator, prefetch=False)
            await second.drain()
            assert shared.exists_calls == 0
            backup = _backup(second)
            assert backup.written_pages == 6
            assert backup.already_stored_pages == 0
            assert_backup_adds_up(backup)


async def test_giving_way_during_the_look_up_writes_nothing_more() -> None:
    config = _config(check_prefix=False)
    generator = KVGenerator(config.layout, PAGE, seed=8)
    stored, fresh = _prompt(8, 3), _prompt(9, 3)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = SendsEveryPage(memory)
        await _served_and_stored(config, shared, stored, generator)
        shared.put_keys.clear()
        shared.hold_exists = asyncio.Event()
        async with HiCache(config, storage=shared) as second:
            await serve(second, stored, generator, prefetch=False)
            await asyncio.wait_for(shared.exists_waiting.wait(), 5)
            link = second._link
            assert link is not None
            await serve(second, fresh, generator, prefetch=False)
            await _queued(second, 1)
            link.backup.give_way()
            shared.hold_exists.set()
            await second.drain()
            backup = _backup(second)
            # The look-up in flight was cancelled (its pages left unknown, not written), the
            # queued job was dropped, and nothing was put.
            assert shared.put_keys == []
            assert backup.already_stored_pages == 0
            assert backup.failed_pages == 3
            assert backup.dropped_pages == 3
            assert not _all_in_storage(second, stored)
            assert backup.written_pages == 0
            assert_backup_adds_up(backup)
            assert_drained(second)


async def test_a_node_split_during_the_look_up_is_marked_in_both_parts() -> None:
    # While the look-up of a stored 6-page node is held, a prompt that diverges after its
    # third page splits it: the pages found are marked by the counts planned, in both parts.
    config = _config(check_prefix=False)
    generator = KVGenerator(config.layout, PAGE, seed=10)
    tokens = _prompt(13, 6)
    fork = np.concatenate([tokens[: 3 * PAGE], _prompt(14, 1)])
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = SendsEveryPage(memory)
        await _served_and_stored(config, shared, tokens, generator)
        shared.put_keys.clear()
        shared.hold_exists = asyncio.Event()
        async with HiCache(config, storage=shared) as second:
            await serve(second, tokens, generator, prefetch=False)
            await asyncio.wait_for(shared.exists_waiting.wait(), 5)
            await serve(second, fork, generator, prefetch=False)
            shared.hold_exists.set()
            await second.drain()
            assert _all_in_storage(second, tokens)
            assert _all_in_storage(second, fork)
            backup = _backup(second)
            assert backup.already_stored_pages == 6
            # Only the fork's own page was written.
            assert shared.put_keys == second.namespace.storage_keys(second.keys_for(fork))[3:]
            second.tree.check_invariants()
            assert_backup_adds_up(backup)
            assert_drained(second)


async def test_over_redis_a_second_instance_sends_no_page_the_first_stored() -> None:
    # Redis is where a put of a stored page costs most: SET NX sends the whole page.
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=9)
    tokens = _prompt(12, 6)
    with RedisServer() as server:
        url = f"{server.url}?prefix=already-stored"
        async with HiCache(config, storage=url) as first:
            await serve(first, tokens, generator, prefetch=False)
            await first.drain()
            assert _backup(first).written_pages == 6
        async with HiCache(config, storage=url) as second:
            await serve(second, tokens, generator, prefetch=False)
            await second.drain()
            status = second.storage_status()
            assert status.storage is not None
            assert status.backup is not None
            assert status.storage.puts == 0
            assert status.backup.already_stored_pages == 6
            assert _all_in_storage(second, tokens)
        async with HiCache(config, storage=url) as third:
            served = await serve(third, tokens, generator, check="loaded")
            assert served.storage_tokens == 6 * PAGE


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_a_store_whose_put_skips_stored_pages_is_asked_nothing_first(
    kind: str, tmp_path: Path
) -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=13)
    tokens = _prompt(13, 6)
    async with _store(kind, tmp_path) as backend:
        assert backend.capabilities.put_skips_stored
        shared = Shared(backend)
        await _served_and_stored(config, shared, tokens, generator)
        async with HiCache(config, storage=shared) as second:
            asked = shared.exists_calls
            await serve(second, tokens, generator, prefetch=False)
            await second.drain()
            backup = _backup(second)
            # The put found them itself: no look-up, no bytes moved, all marked.
            assert shared.exists_calls == asked
            assert backup.already_stored_pages == 0
            assert backup.written_pages == 6
            assert backend.stats().pages == 6
            assert _all_in_storage(second, tokens)
            assert_backup_adds_up(backup)


class CountsViewsAtPut(SendsEveryPage):
    """Small calls, and at each put the number of byte views alive in the process."""

    def __init__(self, inner: StorageBackend, limit: int) -> None:
        super().__init__(inner)
        self.limit = limit
        self.views_at_put: list[int] = []

    @property
    def capabilities(self) -> StorageCapabilities:
        return msgspec.structs.replace(super().capabilities, max_batch_pages=self.limit)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        self.views_at_put.append(_views())
        return await super().put(keys, pages, metas)


def _views() -> int:
    return sum(type(o) is memoryview for o in gc.get_objects())


async def test_a_long_job_prepares_each_put_as_it_is_cut() -> None:
    # One job of a long prompt is written in many calls: preparing every call's buffers and
    # records before the first (one step of the loop for the whole prompt) would hold them
    # all at once.
    pages, limit = 256, 8
    settings = _config().to_dict()
    settings.update(device_pages=2 * pages, host_pages=2 * pages)
    config = CacheConfig.from_dict(settings)
    tokens = _prompt(31, pages)
    generator = KVGenerator(config.layout, PAGE, seed=31)
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        store = CountsViewsAtPut(memory, limit)
        async with HiCache(config, storage=store) as cache:
            host = cache._host_pool
            assert host is not None
            segments = len(host.page_segments(0))
            before = _views()
            await serve(cache, tokens, generator, prefetch=False)
            await cache.drain()
            assert _all_in_storage(cache, tokens)
            assert len(store.views_at_put) == pages // limit
            # One call's views (and some of the serving's own), not the whole job's.
            assert max(store.views_at_put) - before < 4 * limit * segments
            assert_drained(cache)


class CountsLookupsInFlight(SendsEveryPage):
    """Holds every `exists` until the gate it found set, counting the calls begun."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.begun = 0
        self.in_flight = 0
        self.most_in_flight = 0

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.begun += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.gate.wait()
            return await self.inner.exists(keys)
        finally:
            self.in_flight -= 1


async def _until_begun(store: CountsLookupsInFlight, calls: int) -> None:
    for _ in range(3000):  # a bound only: each loop turn lets the worker begin more
        if store.begun >= calls:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{store.begun} look-ups begun, not {calls}")


@pytest.mark.parametrize("chains", [4, 12])
async def test_the_look_ups_of_a_batchs_chains_are_in_flight_together(chains: int) -> None:
    # A slow store answers each look-up after a round trip: a batch of many chains must not
    # pay one after another. At most `_LOOKUPS_IN_FLIGHT` are asked at once.
    config = _config(check_prefix=False, batch_pages=16)
    generator = KVGenerator(config.layout, PAGE, seed=11)
    first = _prompt(20, 1)
    prompts = [_prompt(21 + i, 1) for i in range(chains)]
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = CountsLookupsInFlight(memory)
        shared.gate.set()
        for tokens in (first, *prompts):
            await _served_and_stored(config, shared, tokens, generator)
        shared.put_keys.clear()
        shared.begun = shared.most_in_flight = 0
        shared.gate = asyncio.Event()
        async with HiCache(config, storage=shared) as second:
            # The first batch's one look-up holds the worker while the others queue up.
            await serve(second, first, generator, prefetch=False)
            await _until_begun(shared, 1)
            for tokens in prompts:
                await serve(second, tokens, generator, prefetch=False)
            await _queued(second, chains)
            held, shared.gate = shared.gate, asyncio.Event()
            held.set()
            # The second batch asks about all its chains before any answers.
            expected = min(chains, backup_worker._LOOKUPS_IN_FLIGHT)
            await _until_begun(shared, 1 + expected)
            for _ in range(20):  # no more begin while those are held
                await asyncio.sleep(0)
            assert shared.begun == 1 + expected
            assert shared.most_in_flight == expected
            shared.gate.set()
            await second.drain()
            assert shared.begun == 1 + chains
            backup = _backup(second)
            assert backup.already_stored_pages == 1 + chains
            assert backup.written_pages == 0
            assert shared.put_keys == []
            for tokens in (first, *prompts):
                assert _all_in_storage(second, tokens)
            assert_backup_adds_up(backup)
            assert_drained(second)


class AnswersOneAtATime(SendsEveryPage):
    """A store that answers one `exists` at a time (one connection, one thread), each held
    until the gate it found set; counts the calls it began to answer after a give-way."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.lock = asyncio.Lock()
        self.gate = asyncio.Event()
        self.gate.set()
        self.answering = 0
        self.gave_way = False
        self.answered_after_give_way = 0

    async def exists(self, keys: Sequence[bytes]) -> int:
        async with self.lock:
            self.answering += 1
            self.answered_after_give_way += self.gave_way
            await self.gate.wait()
            return await self.inner.exists(keys)


async def _until_answering(store: AnswersOneAtATime, calls: int) -> None:
    for _ in range(3000):  # a bound only
        if store.answering >= calls:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{store.answering} look-ups answering, not {calls}")


async def test_giving_way_cancels_the_look_ups_queued_in_the_store() -> None:
    # Eight look-ups in flight on a store that answers one at a time: after a give-way the
    # allocation waits for the batch's end, so none of them may still go to the store.
    config = _config(check_prefix=False, batch_pages=16)
    generator = KVGenerator(config.layout, PAGE, seed=12)
    first = _prompt(40, 1)
    prompts = [_prompt(41 + i, 1) for i in range(backup_worker._LOOKUPS_IN_FLIGHT)]
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = AnswersOneAtATime(memory)
        for tokens in (first, *prompts):
            await _served_and_stored(config, shared, tokens, generator)
        shared.put_keys.clear()
        shared.answering = 0
        shared.gate = asyncio.Event()
        async with HiCache(config, storage=shared) as second:
            # The first batch's look-up holds the worker while the others queue up.
            await serve(second, first, generator, prefetch=False)
            await _until_answering(shared, 1)
            for tokens in prompts:
                await serve(second, tokens, generator, prefetch=False)
            await _queued(second, len(prompts))
            held, shared.gate = shared.gate, asyncio.Event()
            held.set()
            await _until_answering(shared, 2)  # the second batch's first, the rest queued
            link = second._link
            assert link is not None
            shared.gave_way = True
            link.backup.give_way()
            shared.gate.set()
            await second.drain()
            assert shared.answered_after_give_way == 0
            assert shared.put_keys == []
            backup = _backup(second)
            assert backup.gave_way == 1
            assert backup.already_stored_pages == 1
            assert backup.written_pages == 0
            assert backup.failed_pages == len(prompts)
            assert_backup_adds_up(backup)
            assert_drained(second)


class AnswersOnceTheGateOpens(CountsLookupsInFlight):
    """Holds every `exists` answer, ready, until the gate it found set: the look-ups waiting
    all resume in one loop turn."""

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.begun += 1
        answer = await self.inner.exists(keys)
        await self.gate.wait()
        return answer


@pytest.mark.parametrize(("chains", "failing"), [(1, 1), (3, 1), (3, 3)])
async def test_a_bug_in_a_look_up_ends_the_workers_with_the_error_itself(
    chains: int, failing: int
) -> None:
    # A look-up contains its backend's failures: what escapes it is a bug, which ends the
    # workers with that error as it is, whether the batch asked about one chain or several
    # at once (not inside an exception group). Of several, the first ends them and each
    # other one is logged.
    config = _config(check_prefix=False, batch_pages=16)
    generator = KVGenerator(config.layout, PAGE, seed=12)
    first = _prompt(40, 1)
    prompts = [_prompt(41 + i, 1) for i in range(chains)]
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        shared = AnswersOnceTheGateOpens(memory)
        shared.gate.set()
        for tokens in (first, *prompts):
            await _served_and_stored(config, shared, tokens, generator)
        shared.begun = 0
        shared.gate = asyncio.Event()
        raised: list[RuntimeError] = []
        with structlog.testing.capture_logs() as logs:
            async with HiCache(config, storage=shared) as second:
                link = second._link
                assert link is not None
                buggy = {key for tokens in prompts[:failing] for key in second.keys_for(tokens)}
                forget = link.backup._stored
                assert forget is not None

                def stored(keys: list[bytes]) -> None:
                    # Told the keys a look-up found stored, as every look-up tells them.
                    if buggy.intersection(keys):
                        raised.append(RuntimeError(f"bug {len(raised)}"))
                        raise raised[-1]
                    forget(keys)

                link.backup._stored = stored
                # The first batch's look-up holds the worker while the others queue up.
                await serve(second, first, generator, prefetch=False)
                await _until_begun(shared, 1)
                for tokens in prompts:
                    await serve(second, tokens, generator, prefetch=False)
                await _queued(second, chains)
                held, shared.gate = shared.gate, asyncio.Event()
                held.set()
                # The batch's look-ups all wait, answered, so that they resume together.
                await _until_begun(shared, 1 + chains)
                shared.gate.set()
                for _ in range(3000):  # a bound only
                    if link.failed_with is not None:
                        break
                    await asyncio.sleep(0.001)
                assert raised
                assert link.failed_with is raised[0]
                for _ in range(3000):  # a bound only: the task groups above it unwind
                    if second.storage_status().workers_failed is not None:
                        break
                    await asyncio.sleep(0.001)
                assert second.storage_status().workers_failed == repr(raised[0])
                await second.detach_storage()
        failed = [e for e in logs if e["event"] == "hicache.workers.failed"]
        assert len(failed) == 1
        assert repr(raised[0]) in failed[0]["error"]
        others = [e["error"] for e in logs if e["event"] == "hicache.backup.lookup.also_failed"]
        assert others == [repr(error) for error in raised[1:]]
        assert len(raised) == failing
