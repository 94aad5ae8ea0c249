"""Backups to storage give way to a device allocation that needs what they protect.

A queued or retrying backup protects its host pages, and with them the tree above them: a
device-only node whose host-only children wait for a backup cannot leave the device, and a
host full of such pages cannot take the write-back that would let it go. A lone request
then failed with `OutOfPagesError` although, without storage, it fits. These tests serve a
workload one request at a time over a store whose puts fail, with a backoff long enough that
a failed batch would hold its pages for the whole test, or whose puts wait until the test
lets them through, and check that every request is served, every page it uses matching the
KV generator.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import structlog
from _log_table import assert_documented
from _unowned_storage import Unowned, assert_backup_adds_up

from hicache_async import CacheConfig, HiCache, OutOfPagesError
from hicache_async._ratelog import LogLimiter
from hicache_async.storage import MemoryStorage, Outcome, PageBuffer, PageMeta, StorageBackend
from hicache_async.testing import FaultyStorage, KVGenerator, assert_drained, serve
from hicache_async.workers import BackupStatistics

PAGE = 8
#: A retry's backoff (doubling on each retry) longer than any test here runs: a batch that
#: waited one out would hold its pages until the end.
BACKOFF_S = 600.0
GUARD_S = 30.0  # a hang guard only


def _config(write_policy: str) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
            "page_size": PAGE,
            "device_pages": 32,
            "host_pages": 64,
            "write_policy": write_policy,
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
            "backup": {"max_retries": 3, "retry_backoff_s": BACKOFF_S},
        }
    )


def _prompts() -> list[np.ndarray]:
    """Four shared prefixes, each cut at four lengths and given its own tail: 6 to 28 pages."""
    rng = np.random.default_rng(1)
    prompts = []
    for _ in range(4):
        base = rng.integers(0, 50000, 400)
        for cut in (40, 100, 160, 200):
            prompts.append(np.concatenate([base[:cut], rng.integers(0, 50000, 24)]))
    return prompts


def _backup(cache: HiCache) -> BackupStatistics:
    status = cache.storage_status().backup
    assert status is not None
    return status


class HeldPuts(Unowned):
    """A real store whose puts wait until the test lets them through (`gate`)."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.held = 0  # puts waiting on the gate now
        self.calls = 0

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        self.calls += 1
        self.held += 1
        try:
            await self.gate.wait()
        finally:
            self.held -= 1
        return await self.inner.put(keys, pages, metas)


async def _until(condition: Callable[[], bool]) -> None:
    """Wait until `condition()` holds; bounded by wall time only as a hang guard."""
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.001)


def _waiting(task: asyncio.Task[Any], cache: HiCache, gave_way: int) -> bool:
    """`task` has ended, or the backup worker gave way since it had `gave_way` times (the
    task then waits for the backup's call in progress)."""
    return task.done() or _backup(cache).gave_way > gave_way


async def _settle(cache: HiCache) -> BackupStatistics:
    """End the batch waiting out its backoff (as an allocation would), drain, and check that
    every page is accounted for and every protection is back."""
    link = cache._link
    assert link is not None
    # Device -> host copies still landing would offer jobs that wait out a backoff again.
    await _until(lambda: not cache._copies)
    link.backup.give_way()
    await cache.drain()
    backup = _backup(cache)
    assert_backup_adds_up(backup)
    assert_drained(cache)
    return backup


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize(
    "faults", [{"error_rate": 1.0}, {"partial_batch_rate": 1.0}], ids=["errors", "partial"]
)
async def test_a_lone_request_is_served_while_backups_wait_out_their_retries(
    faults: dict[str, float], write_policy: str
) -> None:
    config = _config(write_policy)
    generator = KVGenerator(config.layout, PAGE, seed=7)
    prompts = _prompts()
    for seed in range(4):
        order = random.Random(seed)
        store = FaultyStorage(MemoryStorage(capacity_bytes=64 << 20), seed=seed, **faults)
        async with HiCache(config, storage=store) as cache:
            checked = 0
            for _ in range(40):
                tokens = prompts[order.randrange(len(prompts))]
                served = await serve(cache, tokens, generator, check="all")  # one at a time
                checked += served.checked_pages
            backup = await _settle(cache)
            assert checked > 0
            assert backup.failed_pages > 0  # the batch waiting out its backoff gave up
        assert store.injected().errors + store.injected().partial_batches > 0


async def test_a_request_waits_for_the_put_in_flight_then_is_served() -> None:
    # The batch holding the pages is in a put: the request waits for that call to return
    # (at most backup.io_timeout_s), then is served.
    config = _config("write_through")
    generator = KVGenerator(config.layout, PAGE, seed=8)
    prompts = _prompts()
    order = random.Random(0)
    waited = 0
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        store = HeldPuts(memory)
        async with HiCache(config, storage=store) as cache:
            for _ in range(40):
                tokens = prompts[order.randrange(len(prompts))]
                served = asyncio.create_task(serve(cache, tokens, generator, check="all"))
                await _until(functools.partial(_waiting, served, cache, _backup(cache).gave_way))
                if not served.done():
                    waited += 1
                    assert store.held == 1  # the call the request waits for
                    store.gate.set()  # the put returns; the batch ends
                    store.gate = asyncio.Event()  # later puts wait again
                await served
            assert waited > 0
            assert _backup(cache).gave_way >= waited
            store.gate.set()
            backup = await _settle(cache)
            assert backup.written_pages > 0  # the puts let through stored their pages


async def test_giving_way_again_and_again_is_one_line_a_minute() -> None:
    # Under steady device pressure the worker gives way at request after request: one line
    # a minute tells it, with how many times were left out; `gave_way` counts every time.
    config = _config("write_through")
    generator = KVGenerator(config.layout, PAGE, seed=11)
    now = [0.0]
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        store = HeldPuts(memory)
        store.gate.set()
        async with HiCache(config, storage=store) as cache:
            await serve(cache, _prompts()[0], generator, prefetch=False)
            await cache.drain()
            link = cache._link
            assert link is not None
            link.backup._log_limit = LogLimiter(60.0, clock=lambda: now[0])
            node = next(n for n in cache.tree.iter_nodes() if n.in_storage and n.on_host)

            async def give_way_once() -> None:
                cache.tree.mark_in_storage(node, False)  # as after a detach: written again
                assert link.backup.offer(node, node.num_pages)
                link.backup.give_way()
                await cache.drain()  # its batch writes nothing

            with structlog.testing.capture_logs() as logs:
                for _ in range(5):
                    await give_way_once()
                told = [e for e in logs if e["event"] == "hicache.backup.gave_way"]
                assert [e["unlogged_since_last"] for e in told] == [0]
                now[0] = 60.0  # a minute later, the next line tells those left out
                await give_way_once()
            told = [e for e in logs if e["event"] == "hicache.backup.gave_way"]
            assert [e["unlogged_since_last"] for e in told] == [0, 4]
            assert assert_documented(logs, exact=["hicache.backup.gave_way"]) >= 2
            backup = _backup(cache)
            assert backup.gave_way == 6
            assert backup.failed_pages == 6 * node.num_pages
            assert store.calls == 1  # the first serve's only
            assert_backup_adds_up(backup)
            assert_drained(cache)


async def test_a_request_that_cannot_fit_fails_at_once_and_the_backups_go_on() -> None:
    # What running requests lock is not freed by giving way: the request fails at once, and
    # the backups keep their jobs.
    config = _config("write_through")
    generator = KVGenerator(config.layout, PAGE, seed=9)
    prompts = _prompts()
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        store = HeldPuts(memory)
        async with HiCache(config, storage=store) as cache:
            for tokens in prompts[:4]:
                await serve(cache, tokens, generator, prefetch=False)
            await _until(lambda: store.held == 1)  # a batch is in its put
            with (
                structlog.testing.capture_logs() as logs,
                cache.request(np.arange(28 * PAGE)) as big,
            ):
                await big.allocate(28 * PAGE)
                with (
                    cache.request(np.arange(10**6, 10**6 + 8 * PAGE)) as other,
                    pytest.raises(OutOfPagesError, match="cannot provide 8 pages"),
                ):
                    await other.allocate(8 * PAGE)
                assert _backup(cache).gave_way == 0
                assert not [e for e in logs if e["event"] == "hicache.backup.gave_way"]
                assert store.held == 1  # the put in progress goes on
            store.gate.set()
            await cache.drain()
            backup = _backup(cache)
            assert backup.dropped_pages == 0
            assert backup.failed_pages == 0
            assert_backup_adds_up(backup)
            assert_drained(cache)


async def test_a_job_handed_to_the_worker_but_not_yet_begun_gives_way_too() -> None:
    # An offer to a worker waiting for jobs hands the job over at once: it is neither queued
    # nor in a batch until the worker runs, but its protection is held. Giving way then
    # makes the batch it begins write nothing.
    config = _config("write_through")
    generator = KVGenerator(config.layout, PAGE, seed=10)
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        store = HeldPuts(memory)
        store.gate.set()
        async with HiCache(config, storage=store) as cache:
            await serve(cache, _prompts()[0], generator, prefetch=False)
            await cache.drain()
            link = cache._link
            assert link is not None
            calls = store.calls
            node = next(n for n in cache.tree.iter_nodes() if n.in_storage and n.on_host)
            cache.tree.mark_in_storage(node, False)  # as after a detach: to be written again
            before = _backup(cache)
            assert link.backup.offer(node, node.num_pages)
            assert link.backup.idle  # nothing queued or being written yet...
            assert link.backup.protecting  # ...but the job's protection is held
            link.backup.give_way()
            await cache.drain()
            assert store.calls == calls
            assert _backup(cache).failed_pages == before.failed_pages + node.num_pages
            assert not node.in_storage
            assert_backup_adds_up(_backup(cache))
            assert_drained(cache)
