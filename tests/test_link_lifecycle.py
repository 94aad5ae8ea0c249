"""A storage link's end as the rest of the cache sees it: an attach cancelled just as its backend
opened, workers that end without a close, and a detach in progress that a second detach, an
attach of the same file root and the cache's exit all wait for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np
import pytest
from structlog.testing import capture_logs

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import FileStorage, Outcome, PageBuffer, PageMeta
from hicache_async.testing import KVGenerator, assert_drained, serve
from hicache_async.workers import (
    BackupWorker,
    Prefetcher,
    PrefetchHandle,
    PrefetchStatus,
    StorageLink,
)

PAGE = 8

CONFIG = CacheConfig.from_dict(
    {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "page_size": PAGE,
        "device_pages": 96,
        "host_pages": 160,
        "model_id": "link-lifecycle",
        "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
        # One page a batch, so jobs stay queued behind the write in progress; a deadline
        # no test reaches.
        "backup": {"batch_pages": 1, "flush_deadline_s": 10.0},
    }
)

GUARD_S = 30.0  # a hang guard only


async def _until(condition: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + GUARD_S
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met")
        await asyncio.sleep(0)


def _prompts(count: int, offset: int = 0) -> list[list[int]]:
    return [[offset + i] * PAGE + list(range(4 * PAGE)) for i in range(count)]


class OpensThen(FileStorage):
    """Calls `hook` in the loop step right after it opened, before `attach_storage` resumes."""

    hook: Callable[[], None] = staticmethod(lambda: None)

    async def __aenter__(self) -> OpensThen:
        opened = await super().__aenter__()
        asyncio.get_running_loop().call_soon(self.hook)
        return opened


class GatedPuts(FileStorage):
    """Writes wait for `gate`; `writing` is set once one does. A write cancelled while it
    waits sets `cut`."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = asyncio.Event()
        self.writing = asyncio.Event()
        self.cut = False

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        self.writing.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cut = True
            raise
        return await super().put(keys, pages, metas)


async def _flushing(cache: HiCache, store: GatedPuts) -> StorageLink:
    """Serve until a backup write waits on the gate with more queued behind it."""
    generator = KVGenerator(CONFIG.layout, PAGE)
    for prompt in _prompts(4):
        await serve(cache, prompt, generator, prefetch=False)
    link = cache._link
    assert link is not None
    await _until(lambda: store.writing.is_set() and link.backup.pending > 0)
    return link


async def _detach_in_progress(
    cache: HiCache, store: GatedPuts
) -> tuple[StorageLink, asyncio.Task[None], asyncio.Event]:
    """A detach whose flush waits on the gate, and an event set once another caller waits
    for its close."""
    link = await _flushing(cache, store)
    waiting = _spy_wait_closed(link)
    detach = asyncio.create_task(cache.detach_storage(flush=True))
    await _until(lambda: not cache.storage_status().attached)
    return link, detach, waiting


def _spy_wait_closed(link: StorageLink) -> asyncio.Event:
    """An event set when someone starts waiting for `link` to close."""
    waiting = asyncio.Event()
    wait_closed = link.wait_closed

    async def spy() -> None:
        waiting.set()
        await wait_closed()

    link.wait_closed = spy  # type: ignore[method-assign]
    return waiting


async def test_an_attach_cancelled_as_its_backend_opened_leaves_no_waiter_and_holds_nothing(
    tmp_path: Path,
) -> None:
    # The task group cancelled the link's task, and nothing closed its workers: a drain that
    # saw the link waited for its backup worker for ever.
    generator = KVGenerator(CONFIG.layout, PAGE)
    stored = np.arange(2000, 2000 + 8 * PAGE)
    async with HiCache(CONFIG, storage=FileStorage(tmp_path)) as first:
        await serve(first, stored, generator, prefetch=False)
        await first.drain()
    async with HiCache(CONFIG) as cache:
        await serve(cache, _prompts(1)[0], generator, prefetch=False)
        await cache.drain()
        store = OpensThen(tmp_path)
        attach = asyncio.create_task(cache.attach_storage(store))
        others: list[asyncio.Task[object]] = []

        def opened() -> None:
            link = cache._link
            assert link is not None
            assert link.running
            node = next(n for n in cache.tree.iter_nodes() if n.host_pages)
            assert link.backup.offer(node, node.num_pages)  # a commit's offer, in the window
            others.append(asyncio.create_task(cache.drain()))
            others.append(asyncio.create_task(cache.prefetch(stored)))
            attach.cancel()

        store.hook = opened
        with pytest.raises(asyncio.CancelledError):
            await attach
        assert len(others) == 2
        done, _ = await asyncio.wait(others, timeout=GUARD_S)
        assert len(done) == 2, "a waiter outlived the cancelled attach's link"
        assert not cache.storage_status().attached
        assert not [n for n in cache.tree.iter_nodes() if n.in_storage]
        # Nothing of the link runs any more and nothing it took is held.
        assert [
            t
            for t in asyncio.all_tasks()
            if t is not asyncio.current_task() and t is not cache._supervisor
        ] == []
        await cache.drain()
        assert_drained(cache)
        # Its backend was closed: the root is free for the next attach.
        await cache.attach_storage(FileStorage(tmp_path))
        assert cache.storage_status().attached


async def test_workers_that_end_without_a_close_wake_their_waiters(tmp_path: Path) -> None:
    # Cancelled without a close (as when the link's task is), the backup worker dropped its
    # queue but woke no `wait_idle()` waiter, and the prefetcher still ran a warmup's
    # prefetch against the backend.
    generator = KVGenerator(CONFIG.layout, PAGE)
    async with HiCache(CONFIG) as cache, GatedPuts(tmp_path) as store:
        for prompt in _prompts(3):
            await serve(cache, prompt, generator, prefetch=False)
        await cache.drain()
        nodes = [n for n in cache.tree.iter_nodes() if n.host_pages]
        assert len(nodes) >= 2
        backup = BackupWorker(cache, store, CONFIG.backup, is_current=lambda: False)
        prefetcher = Prefetcher(cache, store, CONFIG.prefetch, is_current=lambda: False)
        workers = [asyncio.create_task(backup.run()), asyncio.create_task(prefetcher.run())]
        for node in nodes:
            assert backup.offer(node, node.num_pages)
        await _until(lambda: store.writing.is_set() and backup.pending > 0)
        waiter = asyncio.create_task(backup.wait_idle())
        await _until(lambda: bool(backup._idle_waiters))
        for worker in workers:
            worker.cancel()
        await asyncio.wait(workers, timeout=GUARD_S)
        await asyncio.wait_for(waiter, GUARD_S)
        assert backup.statistics().dropped_pages > 0
        assert not backup.offer(nodes[0], nodes[0].num_pages)
        uncached = np.arange(5000, 5000 + 4 * PAGE)
        handle = PrefetchHandle(
            prefetcher, cache.keys_for(uncached), len(uncached), None, "wait_complete"
        )
        await prefetcher.run_now(handle)
        assert handle.status is PrefetchStatus.CANCELLED
        assert_drained(cache)


async def test_a_second_detach_returns_once_the_first_has_closed(tmp_path: Path) -> None:
    store = GatedPuts(tmp_path)
    async with HiCache(CONFIG, storage=store) as cache:
        link, first, waiting = await _detach_in_progress(cache, store)
        second = asyncio.create_task(cache.detach_storage())
        await _until(lambda: waiting.is_set() or second.done())
        assert not second.done()
        store.gate.set()
        await asyncio.wait_for(second, GUARD_S)
        assert first.done()
        assert link.closed
        await first
        backup = link.backup.statistics()
        assert backup.written_pages == backup.offered_pages
        assert_drained(cache)


async def test_a_cancelled_second_detach_leaves_the_first_flushing(tmp_path: Path) -> None:
    store = GatedPuts(tmp_path)
    async with HiCache(CONFIG, storage=store) as cache:
        with capture_logs() as logs:
            link, first, waiting = await _detach_in_progress(cache, store)
            second = asyncio.create_task(cache.detach_storage())
            await _until(lambda: waiting.is_set() or second.done())
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            assert not first.done()
            store.gate.set()
            await asyncio.wait_for(first, GUARD_S)
        events = [e["event"] for e in logs]
        assert "hicache.backup.flush.abandoned" not in events
        assert events.count("hicache.storage.detached") == 1
        backup = link.backup.statistics()
        assert backup.dropped_pages == 0
        assert backup.written_pages == backup.offered_pages


async def test_an_attach_of_the_same_root_waits_for_a_detach_in_progress(tmp_path: Path) -> None:
    store = GatedPuts(tmp_path)
    async with HiCache(CONFIG, storage=store) as cache:
        _, detach, waiting = await _detach_in_progress(cache, store)
        # Raised "is in use by another instance": the detach still held the root's lock.
        attach = asyncio.create_task(cache.attach_storage(f"file://{tmp_path}"))
        await _until(lambda: waiting.is_set() or attach.done())
        store.gate.set()
        await asyncio.wait_for(attach, GUARD_S)
        await detach
        status = cache.storage_status()
        assert status.attached
        assert status.generation == 2


async def test_leaving_during_a_detach_lets_its_flush_finish(tmp_path: Path) -> None:
    # The exit saw no link, stopped the workers' task group and cut the flush short.
    store = GatedPuts(tmp_path)
    cache = HiCache(CONFIG, storage=store)
    await cache.__aenter__()
    try:
        link, detach, waiting = await _detach_in_progress(cache, store)
        leave = asyncio.create_task(cache.__aexit__(None, None, None))
        await _until(lambda: waiting.is_set() or leave.done())
        store.gate.set()
        await asyncio.wait_for(leave, GUARD_S)
        await detach
    finally:
        await cache.__aexit__(None, None, None)
    assert not store.cut
    backup = link.backup.statistics()
    assert backup.dropped_pages == 0
    assert backup.written_pages == backup.offered_pages


async def test_a_cancelled_exit_gives_up_the_flush_of_a_detach_in_progress(tmp_path: Path) -> None:
    # As it gives up its own: the exit must end soon, and it waits for that close.
    store = GatedPuts(tmp_path)
    cache = HiCache(CONFIG, storage=store)
    await cache.__aenter__()
    with capture_logs() as logs:
        link, detach, waiting = await _detach_in_progress(cache, store)
        leave = asyncio.create_task(cache.__aexit__(None, None, None))
        await _until(lambda: waiting.is_set() or leave.done())
        leave.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(leave, GUARD_S)
        await detach
    assert [e for e in logs if e["event"] == "hicache.backup.flush.abandoned"]
    assert cache.statistics().state == "closed"
    assert link.closed
    assert store.closed
    assert link.backup.statistics().written_pages < link.backup.statistics().offered_pages


class FailsToOpen(FileStorage):
    """Its open fails once `fail` is set: a fault, a locked root, a server down."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail = asyncio.Event()

    async def __aenter__(self) -> FailsToOpen:
        await self.fail.wait()
        raise OSError("backend unreachable")


@pytest.mark.parametrize("how", ["detach", "exit"])
async def test_a_close_racing_a_failed_open_does_not_wait_for_a_flush(
    tmp_path: Path, how: str
) -> None:
    # No backup ever ran, yet the close waited out the whole flush deadline for one, and
    # an attach retried after it waited as long.
    config = CacheConfig.from_dict(
        {**CONFIG.to_dict(), "backup": {"batch_pages": 1, "flush_deadline_s": 3600.0}}
    )
    backend = FailsToOpen(tmp_path / "l3")
    cache = HiCache(config)
    await cache.__aenter__()
    try:
        attach = asyncio.ensure_future(cache.attach_storage(backend))
        await _until(lambda: cache._link is not None)
        with capture_logs() as logs:
            if how == "detach":
                closing = asyncio.ensure_future(cache.detach_storage(flush=True))
            else:
                closing = asyncio.ensure_future(cache.__aexit__(None, None, None))
            await _until(lambda: cache._closing is not None)
            backend.fail.set()
            with pytest.raises(OSError, match="unreachable"):
                await asyncio.wait_for(attach, GUARD_S)
            await asyncio.wait_for(closing, GUARD_S)
        assert not [e for e in logs if e["event"] == "hicache.backup.flush.deadline"]
        if how == "detach":
            await asyncio.wait_for(cache.attach_storage(FileStorage(tmp_path / "ok")), GUARD_S)
            assert cache.storage_status().attached
    finally:
        await cache.__aexit__(None, None, None)


@pytest.mark.parametrize("how", ["detach", "close"])
async def test_what_a_detach_left_unwritten_is_logged(tmp_path: Path, how: str) -> None:
    # The link's statistics vanish with it: a detach without a flush dropped queued backups
    # with no trace anywhere.
    store = GatedPuts(tmp_path)
    # For the close, which flushes: a deadline the gated write cannot meet drops the rest.
    config = msgspec.structs.replace(
        CONFIG, backup=msgspec.structs.replace(CONFIG.backup, flush_deadline_s=0.05)
    )
    with capture_logs() as logs:
        async with HiCache(config, storage=store) as cache:
            link = await _flushing(cache, store)
            if how == "detach":
                await cache.detach_storage(flush=False)
    (detached,) = [e for e in logs if e["event"] == "hicache.storage.detached"]
    backup = link.backup.statistics()
    assert backup.dropped_pages > 0
    assert detached["log_level"] == "warning"
    assert detached["dropped_pages"] == backup.dropped_pages
    assert detached["written_pages"] == backup.written_pages
    assert detached["failed_pages"] == backup.failed_pages
