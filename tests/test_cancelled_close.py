"""A detach or an exit cancelled by its caller (a shutdown under a timeout) gives up
its flush, never its close: the backend is closed and the copy threads have stopped before the
cancellation goes on. Plain `task.cancel()` lands inside anyio's shielded scopes, so these
closes must not rely on them."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from structlog.testing import capture_logs

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import FileStorage, MemoryStorage, Outcome, PageBuffer
from hicache_async.testing import FaultyStorage, KVGenerator, assert_drained, serve
from hicache_async.workers import PrefetchStatus

PAGE = 8

CONFIG = CacheConfig.from_dict(
    {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "page_size": PAGE,
        "device_pages": 96,
        "host_pages": 160,
        "model_id": "cancelled-close",
        "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
        # Long enough that the flush is still running when the caller's timeout fires.
        "backup": {"flush_deadline_s": 30.0},
    }
)


def _prompts(count: int) -> list[list[int]]:
    return [[i] * PAGE + list(range(64)) for i in range(count)]


async def _serve_all(cache: HiCache, generator: KVGenerator) -> None:
    for prompt in _prompts(6):
        await serve(cache, prompt, generator, prefetch=False)
    # The device -> host copies land and their backups queue on the slow store.
    for _ in range(1000):
        if not cache.statistics().copy_engine.in_flight:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("device -> host copies still in flight after 10 s")


class SlowToStopFiles(FileStorage):
    """Reads that, like one already handed to a thread, end their current step before a
    cancellation lands."""

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(0.3)
        return await super().get(keys, into, namespace=namespace)


def _copy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "copy" in t.name]


async def test_a_cancelled_detach_closes_the_backend_and_gives_up_the_flush(
    tmp_path: Path,
) -> None:
    generator = KVGenerator(CONFIG.layout, PAGE)
    slow = FaultyStorage(FileStorage(tmp_path), latency_s=0.5)
    async with HiCache(CONFIG, storage=slow) as cache:
        await _serve_all(cache, generator)
        link = cache._link
        assert link is not None
        backup = link.backup.statistics()
        assert backup.offered_pages > backup.written_pages + 1  # the flush has work left
        with capture_logs() as logs, pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(cache.detach_storage(), 0.05)
        assert not cache.storage_status().attached
        assert [e for e in logs if e["event"] == "hicache.backup.flush.abandoned"]
        after = link.backup.statistics()
        assert after.written_pages < after.offered_pages  # the flush was given up
        # Closed before the cancellation went on: the root's lock is free again.
        await cache.attach_storage(FileStorage(tmp_path))
        assert cache.storage_status().attached
        assert_drained(cache)


async def test_a_cancelled_exit_closes_the_backend_and_the_copy_engine(tmp_path: Path) -> None:
    generator = KVGenerator(CONFIG.layout, PAGE)
    before = _copy_threads()
    cache = HiCache(CONFIG, storage=FaultyStorage(FileStorage(tmp_path), latency_s=0.5))
    await cache.__aenter__()
    try:
        await _serve_all(cache, generator)
        assert len(_copy_threads()) > len(before)
    finally:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(cache.__aexit__(None, None, None), 0.05)
    assert cache.statistics().state == "closed"
    assert _copy_threads() == before
    # The backend was closed: another instance can take the root.
    async with FileStorage(tmp_path) as again:
        assert again.stats().pages >= 0


async def _under_anyio(scope_kind: str, step: Callable[[], Any]) -> bool:
    """Run `step` in an anyio scope that cancels it soon (a deadline, or a cancelled task
    group); whether the scope took the cancellation. One that escaped it fails the test."""
    if scope_kind == "fail_after":
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await step()
        return True
    if scope_kind == "move_on_after":
        with anyio.move_on_after(0.05) as scope:
            await step()
        return scope.cancelled_caught
    async with anyio.create_task_group() as group:

        async def cancel_soon() -> None:
            await anyio.sleep(0.05)
            group.cancel_scope.cancel()

        group.start_soon(cancel_soon)
        await step()
    return group.cancel_scope.cancelled_caught


SCOPES = ["fail_after", "move_on_after", "task_group"]


@pytest.mark.parametrize("scope_kind", SCOPES)
async def test_a_detach_cancelled_by_an_anyio_scope_gives_up_the_flush(
    tmp_path: Path, scope_kind: str
) -> None:
    # Starlette and anyio task groups cancel through scopes: the detach must hear them as
    # it hears asyncio's timeouts, and the scope, not the caller's task, takes the cancel.
    generator = KVGenerator(CONFIG.layout, PAGE)
    slow = FaultyStorage(FileStorage(tmp_path), latency_s=0.5)
    async with HiCache(CONFIG, storage=slow) as cache:
        await _serve_all(cache, generator)
        link = cache._link
        assert link is not None
        with capture_logs() as logs:
            assert await _under_anyio(scope_kind, cache.detach_storage)
        current = asyncio.current_task()
        assert current is not None
        if sys.version_info >= (3, 11):
            assert current.cancelling() == 0
        assert not cache.storage_status().attached
        assert [e for e in logs if e["event"] == "hicache.backup.flush.abandoned"]
        after = link.backup.statistics()
        assert after.written_pages < after.offered_pages  # the flush was given up
        await cache.attach_storage(FileStorage(tmp_path))  # the root's lock is free
        assert_drained(cache)


@pytest.mark.parametrize("scope_kind", SCOPES)
async def test_an_exit_cancelled_by_an_anyio_scope_closes_everything(
    tmp_path: Path, scope_kind: str
) -> None:
    generator = KVGenerator(CONFIG.layout, PAGE)
    before = _copy_threads()
    cache = HiCache(CONFIG, storage=FaultyStorage(FileStorage(tmp_path), latency_s=0.5))
    await cache.__aenter__()
    try:
        await _serve_all(cache, generator)
    finally:
        with capture_logs() as logs:
            assert await _under_anyio(scope_kind, lambda: cache.__aexit__(None, None, None))
    assert [e for e in logs if e["event"] == "hicache.backup.flush.abandoned"]
    assert cache.statistics().state == "closed"
    assert _copy_threads() == before
    async with FileStorage(tmp_path) as again:
        assert again.stats().pages >= 0


async def test_a_detach_waits_for_the_read_of_a_warmup_it_stops(tmp_path: Path) -> None:
    generator = KVGenerator(CONFIG.layout, PAGE, seed=2)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 50_000, size=10 * PAGE) for _ in range(8)]
    async with HiCache(CONFIG, storage=FileStorage(tmp_path)) as first:
        for prompt in prompts:
            await serve(first, prompt, generator, prefetch=False)
        await first.drain()
    async with HiCache(CONFIG, storage=SlowToStopFiles(tmp_path)) as cache:
        link = cache._link
        assert link is not None
        warmup = asyncio.create_task(cache.warmup(ratio=1.0))
        for _ in range(1000):  # until a warmup read is in flight
            if link.prefetcher.statistics().host_pages_held:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the warmup read nothing for 10 s")
        await cache.detach_storage()
        # The warmup's read ended before the backend was closed under it.
        assert link.prefetcher.statistics().host_pages_held == 0
        await warmup
        await cache.drain()
        assert_drained(cache)


async def test_a_prefetch_a_worker_took_just_before_a_detach_is_cancelled(tmp_path: Path) -> None:
    generator = KVGenerator(CONFIG.layout, PAGE)
    prompt = np.arange(1000, 1000 + 8 * PAGE)
    async with HiCache(CONFIG, storage=FileStorage(tmp_path)) as first:
        await serve(first, prompt, generator, prefetch=False)
        await first.drain()
    slow = FaultyStorage(FileStorage(tmp_path), latency_s=0.5)
    async with HiCache(CONFIG, storage=slow) as cache:
        await asyncio.sleep(0.05)  # the workers wait on the queue: one takes the prefetch at once
        handle = await cache.start_prefetch(prompt)
        await cache.detach_storage()
        result = await handle.wait()
        assert result.status is PrefetchStatus.CANCELLED
        assert result.storage_tokens == 0


class SlowToStopExists(FileStorage):
    async def exists(self, keys: Sequence[bytes]) -> int:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(0.3)
        return await super().exists(keys)


def test_a_detach_does_not_spin_on_a_prefetch_finished_while_it_runs(tmp_path: Path) -> None:
    # A handle can be finished while a worker still runs it (a submit's limit passing as the
    # worker took it): waiting for it must still yield to the worker. Run in a thread of its
    # own, so that a loop that never yields fails this test instead of hanging the suite.
    async def scenario() -> PrefetchStatus:
        generator = KVGenerator(CONFIG.layout, PAGE)
        prompt = np.arange(1000, 1000 + 8 * PAGE)
        async with HiCache(CONFIG, storage=FileStorage(tmp_path)) as first:
            await serve(first, prompt, generator, prefetch=False)
            await first.drain()
        async with HiCache(CONFIG, storage=SlowToStopExists(tmp_path)) as cache:
            handle = await cache.start_prefetch(prompt)
            link = cache._link
            assert link is not None
            for _ in range(1000):
                if handle in link.prefetcher._running:
                    break
                await asyncio.sleep(0.01)
            handle._finish(PrefetchStatus.TERMINATED)  # the end state of that race
            await cache.detach_storage()
            return handle.status

    outcome: list[PrefetchStatus] = []
    runner = threading.Thread(target=lambda: outcome.append(asyncio.run(scenario())), daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "detach_storage() never returned"
    assert outcome == [PrefetchStatus.TERMINATED]


async def test_an_entry_cancelled_while_the_workers_start_logs_no_failure() -> None:
    # Cancelled before the supervisor first ran, the supervisor set the result of the entry's
    # cancelled future, which raised inside its task group and was logged as
    # hicache.workers.failed (an error alert for a cancel). Cancelled just after it ran, it
    # waited for the cache's close for ever.
    cancelled = 0
    for spins in (0, 1):
        cache = HiCache(CONFIG)
        entry = asyncio.create_task(cache.__aenter__())
        await _until(lambda cache=cache: cache._supervisor is not None)
        for _ in range(spins):
            await asyncio.sleep(0)
        with capture_logs() as logs:
            entry.cancel()
            (outcome,) = await asyncio.gather(entry, return_exceptions=True)
            supervisor = cache._supervisor
            assert supervisor is not None
            if isinstance(outcome, asyncio.CancelledError):
                cancelled += 1
                await asyncio.wait_for(supervisor, 5)
                assert cache._task_group is None
            else:  # entered before the cancel landed
                await cache.__aexit__(None, None, None)
        assert [e for e in logs if e["log_level"] == "error"] == []
    assert cancelled


async def _until(condition: Callable[[], bool]) -> None:
    # Spins, so the condition is seen in the loop iteration it becomes true; bounded in time
    # (the pools are made on a thread, which a loaded machine may be slow to run).
    deadline = asyncio.get_running_loop().time() + 30
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met")
        await asyncio.sleep(0)


class NeverOpens(MemoryStorage):
    async def __aenter__(self) -> NeverOpens:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_an_attach_cancelled_while_its_backend_opens_closes_its_queues() -> None:
    # The link's workers never ran, so nothing closed their queues' streams: two pairs of
    # ResourceWarnings per cancelled attach.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        async with HiCache(CONFIG) as cache:
            attach = asyncio.create_task(cache.attach_storage(NeverOpens()))
            await _until(lambda: cache._link is not None)
            link = cache._link
            assert link is not None
            await asyncio.sleep(0.01)
            attach.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attach
            assert cache._link is None
            assert link.prefetcher._receive._closed
            assert link.backup._receive._closed
            del link, attach
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
