"""A storage link's end as the rest of the cache sees it: an attach cancelled just as its backend
opened, workers that end without a close, a detach in progress that a second detach, an
attach of the same file root and the cache's exit all wait for, and a cache left from two tasks
(a second leave waits for the first's close, a leave during the entry for the entry)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np
import pytest
from _unowned_storage import assert_backup_adds_up
from structlog.testing import capture_logs

import hicache_async._cache as cache_module
from hicache_async import CacheConfig, HiCache, KVPool, WrongThreadError, make_pools
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


class OpensWhenLetGo(FileStorage):
    """Opens once `gate` is set."""

    gate: asyncio.Event

    async def __aenter__(self) -> OpensWhenLetGo:
        await self.gate.wait()
        return await super().__aenter__()


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


class GatedGets(FileStorage):
    """Reads wait for `gate`; `reading` is set once one does."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = asyncio.Event()
        self.reading = asyncio.Event()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        self.reading.set()
        await self.gate.wait()
        return await super().get(keys, into, namespace=namespace)


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
        await _until(lambda: backup._idle_event is not None)
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


async def test_cancelled_drains_leave_nothing_behind_while_a_backup_is_written(
    tmp_path: Path,
) -> None:
    # Each `drain()` cancelled while the backup worker stayed busy left a waiter of its own
    # behind until the worker next went idle: a serving process that bounds its drains
    # (`wait_for(cache.drain(), ...)`) under steady backups kept every one of them.
    store = GatedPuts(tmp_path)
    generator = KVGenerator(CONFIG.layout, PAGE)
    async with HiCache(CONFIG, storage=store) as cache:
        for prompt in _prompts(3):
            await serve(cache, prompt, generator, prefetch=False)
        await _until(lambda: store.writing.is_set() and not cache._copies)
        link = cache._link
        assert link is not None
        backup = link.backup
        for _ in range(50):
            drain = asyncio.create_task(cache.drain())
            await asyncio.sleep(0)  # one step: the drain runs up to its wait for the worker
            assert not drain.done()
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)
        assert not backup.idle
        # Whatever the waiters are kept in holds none of the cancelled drains.
        leftovers = [
            value
            for value in vars(backup).values()
            if isinstance(value, (list, set, dict)) and len(value) >= 50
        ]
        assert leftovers == []
        waiter = asyncio.create_task(cache.drain())
        store.gate.set()
        await asyncio.wait_for(waiter, GUARD_S)
        assert backup.idle


async def test_a_queue_given_up_between_batches_wakes_the_drains(tmp_path: Path) -> None:
    # An allocation that made the worker give way between two batches (the worker at its
    # queue, the next job still in it) emptied the queue and left the worker idle, but woke
    # no `wait_idle()` waiter: a drain waited until some later backup was written.
    store = GatedPuts(tmp_path)
    generator = KVGenerator(CONFIG.layout, PAGE)
    async with HiCache(CONFIG, storage=store) as cache:
        for prompt in _prompts(3):
            await serve(cache, prompt, generator, prefetch=False)
        link = cache._link
        assert link is not None
        backup = link.backup
        await _until(lambda: store.writing.is_set() and backup.pending > 0)
        drain = asyncio.create_task(cache.drain())
        await _until(lambda: backup._idle_event is not None)
        store.gate.set()

        def gave_way_between_batches() -> bool:
            if backup._writing or backup.pending == 0:
                return False
            backup.give_way()
            return True

        await _until(gave_way_between_batches)
        assert backup.idle
        assert backup.statistics().dropped_pages > 0
        await asyncio.wait_for(drain, GUARD_S)
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
        # The detach does not wait for the cache's own copies to host (one can still hold
        # its device pages on a loaded machine): the drain does.
        await asyncio.wait_for(cache.drain(), GUARD_S)
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
    assert store.cut
    # The write the detach cancelled left its pages unwritten too: they are counted.
    assert_backup_adds_up(backup)
    assert detached["log_level"] == "warning"
    assert detached["dropped_pages"] == backup.dropped_pages
    assert detached["written_pages"] == backup.written_pages
    assert detached["failed_pages"] == backup.failed_pages


class SpiedEvent(asyncio.Event):
    """An event that records that someone started waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = False

    async def wait(self) -> Literal[True]:
        self.waited = True
        return await super().wait()


async def _leave_twice(
    cache: HiCache, store: GatedPuts
) -> tuple[StorageLink, asyncio.Task[None], asyncio.Task[None]]:
    """Leave `cache` from one task, its flush held by the gate, then from a second task once
    the first closes the link; returns when the second waits for that close."""
    ended = cache._close_ended = SpiedEvent()
    link = await _flushing(cache, store)
    first = asyncio.create_task(cache.__aexit__(None, None, None))
    await _until(lambda: cache._closing is link)
    second = asyncio.create_task(cache.__aexit__(None, None, None))
    await _until(lambda: ended.waited or second.done())
    assert not second.done()
    return link, first, second


async def test_a_second_leave_returns_once_the_first_has_closed(tmp_path: Path) -> None:
    # A lifespan teardown and a shutdown hook leave the same cache: the second returned at
    # once while the first still flushed and held the root's lock, so a new instance opening
    # the root right after was refused ("in use by another instance").
    store = GatedPuts(tmp_path)
    cache = HiCache(CONFIG, storage=store)
    await cache.__aenter__()
    try:
        link, first, second = await _leave_twice(cache, store)
        # From another thread, even while closing: refused before anything is waited for.
        refused: list[BaseException] = []

        def other() -> None:
            try:
                asyncio.run(cache.__aexit__(None, None, None))
            except BaseException as exc:
                refused.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(GUARD_S)
        assert [type(e) for e in refused] == [WrongThreadError]
        store.gate.set()
        await asyncio.wait_for(second, GUARD_S)
        assert cache.statistics().state == "closed"
        assert link.closed
        assert store.closed
        async with HiCache(CONFIG, storage=f"file://{tmp_path}") as again:
            assert again.storage_status().attached
        await asyncio.wait_for(first, GUARD_S)
    finally:
        store.gate.set()
        await cache.__aexit__(None, None, None)
    backup = link.backup.statistics()
    assert backup.written_pages == backup.offered_pages


async def test_a_cancelled_second_leave_leaves_the_first_close_alone(tmp_path: Path) -> None:
    store = GatedPuts(tmp_path)
    cache = HiCache(CONFIG, storage=store)
    await cache.__aenter__()
    with capture_logs() as logs:
        try:
            link, first, second = await _leave_twice(cache, store)
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            assert not first.done()
            assert cache.statistics().state == "closing"
            store.gate.set()
            await asyncio.wait_for(first, GUARD_S)
        finally:
            store.gate.set()
            await cache.__aexit__(None, None, None)
    assert "hicache.backup.flush.abandoned" not in [e["event"] for e in logs]
    assert not store.cut
    backup = link.backup.statistics()
    assert backup.dropped_pages == 0
    assert backup.written_pages == backup.offered_pages


@pytest.fixture
def held_pools(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The real pools, made once the returned event is set: until then an entry stays
    "opening"."""
    release = threading.Event()

    def held(config: CacheConfig) -> tuple[KVPool, KVPool]:
        release.wait(GUARD_S)
        return make_pools(config)

    monkeypatch.setattr(cache_module, "make_pools", held)
    yield release
    release.set()


async def _leave_while_entering(
    cache: HiCache,
) -> tuple[asyncio.Task[HiCache], asyncio.Task[None]]:
    """Enter `cache` in a task of its own, held while "opening" (`held_pools`), and leave it
    from another; returns when the leave waits for the entry."""
    ended = cache._entry_ended = SpiedEvent()
    entry = asyncio.create_task(cache.__aenter__())
    await _until(lambda: cache.statistics().state == "opening")
    leave = asyncio.create_task(cache.__aexit__(None, None, None))
    await _until(lambda: ended.waited or leave.done())
    assert not leave.done()
    return entry, leave


async def test_a_leave_while_another_task_enters_closes_the_cache_once_entered(
    tmp_path: Path, held_pools: threading.Event
) -> None:
    # A shutdown hook leaving while the entry still made the pools returned at once and did
    # nothing: the cache then opened, attached its storage and stayed open.
    cache = HiCache(CONFIG, storage=FileStorage(tmp_path))
    try:
        entry, leave = await _leave_while_entering(cache)
        held_pools.set()
        await asyncio.wait_for(leave, GUARD_S)
        assert entry.done()
        assert entry.result() is cache
        assert cache.statistics().state == "closed"
        async with HiCache(CONFIG, storage=FileStorage(tmp_path)) as again:
            assert again.storage_status().attached
    finally:
        held_pools.set()
        await cache.__aexit__(None, None, None)


async def test_a_leave_while_an_entry_fails_returns_once_it_failed(
    tmp_path: Path, held_pools: threading.Event
) -> None:
    backend = FailsToOpen(tmp_path)
    backend.fail.set()
    cache = HiCache(CONFIG, storage=backend)
    try:
        entry, leave = await _leave_while_entering(cache)
        held_pools.set()
        await asyncio.wait_for(leave, GUARD_S)
        assert entry.done()
        with pytest.raises(OSError, match="unreachable"):
            entry.result()
        assert cache.statistics().state == "closed"
    finally:
        held_pools.set()
        await cache.__aexit__(None, None, None)


async def test_a_cancelled_leave_while_entering_leaves_the_entry_alone(
    tmp_path: Path, held_pools: threading.Event
) -> None:
    cache = HiCache(CONFIG, storage=FileStorage(tmp_path))
    try:
        entry, leave = await _leave_while_entering(cache)
        leave.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leave
        held_pools.set()
        assert await asyncio.wait_for(entry, GUARD_S) is cache
        assert cache.statistics().state == "open"
        assert cache.storage_status().attached
    finally:
        held_pools.set()
        await cache.__aexit__(None, None, None)
    assert cache.statistics().state == "closed"


async def test_a_prefetch_handle_refuses_calls_from_another_thread(tmp_path: Path) -> None:
    # cancel() set the handle's flags, then failed at its cancel scope (no running loop in that
    # thread) with a RuntimeError: the read went on, under a handle marked cancelled.
    # terminate() stopped a prefetch from a thread that does not own it.
    generator = KVGenerator(CONFIG.layout, PAGE)
    prompt = _prompts(1)[0]
    async with HiCache(CONFIG, storage=FileStorage(tmp_path)) as first:
        await serve(first, prompt, generator, prefetch=False)
        await first.drain()
    store = GatedGets(tmp_path)
    async with HiCache(CONFIG, storage=store) as cache:
        handle = await cache.start_prefetch(prompt)
        await _until(store.reading.is_set)
        assert handle.status is PrefetchStatus.RUNNING
        calls: dict[str, Callable[[], object]] = {
            "cancel": handle.cancel,
            "terminate": handle.terminate,
            "wait": lambda: asyncio.run(handle.wait()),
            "ready": lambda: asyncio.run(handle.ready()),
        }
        raised: dict[str, type[BaseException] | None] = {}

        def other() -> None:
            for name, call in calls.items():
                try:
                    call()
                    raised[name] = None
                except BaseException as exc:
                    raised[name] = type(exc)

        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        thread.join(GUARD_S)
        assert raised == dict.fromkeys(calls, WrongThreadError)
        assert handle.status is PrefetchStatus.RUNNING
        assert not handle._gave_up()
        assert not handle._cancel_requested
        # From the owner's loop, the same handle is cancelled at once, mid-read.
        handle.cancel()
        result = await asyncio.wait_for(handle.wait(), GUARD_S)
        assert result.status is PrefetchStatus.CANCELLED
        store.gate.set()
        await cache.drain()
        assert_drained(cache)


async def test_a_flush_in_progress_is_seen_in_the_status_until_it_has_closed(
    tmp_path: Path,
) -> None:
    # The link left the status at the start of its detach: a flush taking minutes at
    # shutdown showed nothing until its log line.
    store = GatedPuts(tmp_path)
    async with HiCache(CONFIG, storage=store) as cache:
        link, detach, _ = await _detach_in_progress(cache, store)
        try:
            status = cache.storage_status()
            assert not status.attached
            assert status.flushing_backend == store.name
            assert status.flushing is not None
            assert status.flushing.written_pages < status.flushing.offered_pages
            seen = cache.statistics().storage
            assert seen is not None
            assert seen.flushing == status.flushing
            offered = f"hicache_flushing_offered_pages {float(status.flushing.offered_pages)!r}"
            assert offered in cache.metrics_text().splitlines()
        finally:
            store.gate.set()  # else a failure here would hang the cache's close
        await asyncio.wait_for(detach, GUARD_S)
        after = cache.storage_status()
        assert (after.flushing, after.flushing_backend) == (None, None)
        assert cache.statistics().storage is None
        assert "hicache_flushing_" not in cache.metrics_text()
        backup = link.backup.statistics()
        assert backup.written_pages == backup.offered_pages


async def test_a_detach_without_a_flush_shows_no_flush(tmp_path: Path) -> None:
    # It showed the dropped backups as a flush for as long as the backend took to close.
    store = GatedPuts(tmp_path)
    async with HiCache(CONFIG, storage=store) as cache:
        link = await _flushing(cache, store)
        closing = asyncio.Event()
        close = link.backend.close

        async def held_close() -> None:
            closing.set()
            await store.gate.wait()
            await close()

        link.backend.close = held_close  # type: ignore[method-assign]
        detach = asyncio.create_task(cache.detach_storage(flush=False))
        try:
            await asyncio.wait_for(closing.wait(), GUARD_S)
            status = cache.storage_status()
            assert (status.flushing, status.flushing_backend) == (None, None)
            assert cache.statistics().storage is None
            assert "hicache_flushing_" not in cache.metrics_text()
        finally:
            store.gate.set()  # else a failure here would hang the cache's close
        await asyncio.wait_for(detach, GUARD_S)
        assert link.backup.statistics().dropped_pages > 0


async def test_a_prefetch_while_storage_is_still_opening_is_a_miss_at_once(
    tmp_path: Path,
) -> None:
    # It used to wait in the queue of workers not started yet: under `wait_complete` (this
    # config) for the whole attach, under `timeout` for its whole limit.
    generator = KVGenerator(CONFIG.layout, PAGE)
    stored = np.arange(3000, 3000 + 8 * PAGE)
    async with HiCache(CONFIG, storage=FileStorage(tmp_path)) as first:
        await serve(first, stored, generator, prefetch=False)
        await first.drain()
    async with HiCache(CONFIG) as cache:
        store = OpensWhenLetGo(tmp_path)
        store.gate = asyncio.Event()
        attach = asyncio.create_task(cache.attach_storage(store))
        try:
            await _until(lambda: cache.storage_status().opening)
            prefetching = asyncio.ensure_future(cache.prefetch(stored))
            done, _ = await asyncio.wait([prefetching], timeout=GUARD_S)
            assert done, "the prefetch waited for the attach"
            result = prefetching.result()
            assert result.status is PrefetchStatus.SKIPPED
            assert result.cached_tokens == 0
        finally:
            store.gate.set()
        await attach
        # Once open, the same prompt is read.
        result = await cache.prefetch(stored)
        assert result.status is PrefetchStatus.COMPLETE
        assert result.storage_tokens == len(stored)
        await serve(cache, stored, generator, prefetch=False, check="all")
        await cache.drain()
        assert_drained(cache)
