"""MemoryStorage: byte capacity, LRU eviction, large batches on a worker thread."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import gc
import os
import threading
from collections.abc import Callable

import pytest

from hicache_async import StorageConfigError, StorageError
from hicache_async.storage import HEADER_NBYTES, MemoryStorage, Outcome, PageMeta, VerifyReport
from hicache_async.storage._memory import _LIST_SLICE

NS = b"memory-storage-1"
PAGE = 16 * 1024
SIZE = HEADER_NBYTES + PAGE


def _keys(count: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(count)]


async def _put(storage: MemoryStorage, keys: list[bytes], nbytes: int = PAGE) -> list[Outcome]:
    pages = [[memoryview(bytearray(key[:1] * nbytes))] for key in keys]
    metas = [PageMeta(key=k, namespace=NS, num_tokens=8) for k in keys]
    return await storage.put(keys, pages, metas)


async def _get(storage: MemoryStorage, keys: list[bytes], nbytes: int = PAGE) -> list[Outcome]:
    buffers = [[memoryview(bytearray(nbytes))] for _ in keys]
    outcomes = await storage.get(keys, buffers, namespace=NS)
    for key, outcome, buffer in zip(keys, outcomes, buffers, strict=True):
        if outcome is Outcome.OK:
            assert bytes(buffer[0]) == key[:1] * nbytes
    return outcomes


async def test_lru_eviction_within_capacity() -> None:
    keys = _keys(5)
    async with MemoryStorage(capacity_bytes=4 * SIZE) as storage:
        for key in keys[:4]:  # one at a time: a batch's first page is its most recent
            assert await _put(storage, [key]) == [Outcome.OK]
        await _get(storage, keys[:1])
        await _put(storage, keys[2:3])  # an existing key counts as used, not rewritten
        assert await _put(storage, keys[4:]) == [Outcome.OK]
        assert await storage.exists(keys[1:2]) == 0  # the least recently used went
        assert await storage.exists([keys[0], keys[2], keys[3], keys[4]]) == 4
        stats = storage.stats()
        assert (stats.pages, stats.bytes, stats.evictions) == (4, 4 * SIZE, 1)


async def _until(condition: Callable[[], bool]) -> None:
    """Let the loop run until `condition` holds (a call started is in the state it names)."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def _held_put(
    storage: MemoryStorage, old: list[bytes], new: list[bytes]
) -> tuple[asyncio.Task[list[Outcome]], asyncio.Event]:
    """Store `old` one at a time (`old[0]` the least recently used), then start a put of
    `new` that, once it has planned (room reserved, victims chosen), waits before its copy
    until the event returned is set."""
    for key in old:
        await _put(storage, [key])
    gate = asyncio.Event()
    run = storage._run_each

    async def gated(item, sizes):  # type: ignore[no-untyped-def]
        storage._run_each = run  # type: ignore[method-assign]  # only this put waits
        await gate.wait()
        return await run(item, sizes)

    storage._run_each = gated  # type: ignore[method-assign]
    put = asyncio.create_task(_put(storage, new))
    await _until(lambda: bool(storage._plans))  # it has planned
    return put, gate


async def test_gc_during_a_put_leaves_the_puts_victims_to_it() -> None:
    old, new = _keys(4), _keys(2)
    async with MemoryStorage(capacity_bytes=4 * SIZE) as storage:
        put, gate = await _held_put(storage, old, new)  # victims: old[0] and old[1]
        await _get(storage, old[:2])  # they become the most recently used meanwhile
        report = await storage.gc()
        assert (report.evicted_pages, storage.stats().bytes) == (0, 4 * SIZE)
        gate.set()
        assert await put == [Outcome.OK, Outcome.OK]
        assert await storage.exists(old[2:] + new) == 4
        stats = storage.stats()
        assert (stats.pages, stats.bytes, stats.evictions) == (4, 4 * SIZE, 2)


async def test_a_put_of_a_page_a_put_in_flight_evicts_is_a_miss() -> None:
    old, new = _keys(3), _keys(1)
    async with MemoryStorage(capacity_bytes=3 * SIZE) as storage:
        put, gate = await _held_put(storage, old, new)  # victim: old[0], stored until it ends
        assert await storage.exists(old[:1]) == 1
        # Not OK: the caller would count it stored, and the put in flight removes it.
        assert await _put(storage, old[:1]) == [Outcome.MISS]
        gate.set()
        assert await put == [Outcome.OK]
        assert await storage.exists(old[:1]) == 0
        assert await storage.exists(old[1:] + new) == 3


async def test_a_page_larger_than_the_capacity_ends_its_batch() -> None:
    (stored,), (first, big, after, last) = _keys(1), _keys(4)
    async with MemoryStorage(capacity_bytes=3 * SIZE) as storage:
        assert await _put(storage, [stored]) == [Outcome.OK]
        keys = [first, big, after, stored, last]
        sizes = [PAGE, 3 * SIZE, PAGE, PAGE, PAGE]
        pages = [[memoryview(bytearray(nbytes))] for nbytes in sizes]
        outcomes = await storage.put(keys, pages, [PageMeta(k, NS, 8) for k in keys])
        # Pages past it could only be reached through it: stored, they would evict others.
        # One stored already stays so.
        assert outcomes == [Outcome.OK, Outcome.MISS, Outcome.MISS, Outcome.OK, Outcome.MISS]
        assert [await storage.exists([key]) for key in keys] == [1, 0, 0, 1, 0]
        stats = storage.stats()
        assert (stats.pages, stats.evictions) == (2, 0)


async def test_batch_beyond_capacity_and_oversized_pages() -> None:
    async with MemoryStorage(capacity_bytes=3 * SIZE) as storage:
        keys = _keys(5)
        assert await _put(storage, keys) == [Outcome.OK] * 3 + [Outcome.MISS] * 2
        assert await _put(storage, _keys(1), nbytes=3 * SIZE) == [Outcome.MISS]
        assert storage.stats().bytes == 3 * SIZE


async def test_concurrent_puts_never_exceed_capacity() -> None:
    async with MemoryStorage(capacity_bytes=10 * SIZE) as storage:
        batches = [_keys(4) for _ in range(8)]
        results = await asyncio.gather(*(_put(storage, keys) for keys in batches))
        assert all(outcome in (Outcome.OK, Outcome.MISS) for r in results for outcome in r)
        assert storage.stats().bytes <= 10 * SIZE
        assert storage.stats().pages == 10


async def test_large_batches_round_trip_through_the_worker() -> None:
    nbytes = 512 * 1024  # 8 pages: 4 MiB, above the inline limit
    keys = _keys(8)
    async with MemoryStorage(capacity_bytes=64 << 20) as storage:
        assert await _put(storage, keys, nbytes) == [Outcome.OK] * 8
        assert await _get(storage, keys, nbytes) == [Outcome.OK] * 8


async def test_duplicate_keys_in_one_batch_are_stored_once() -> None:
    (key,) = _keys(1)
    async with MemoryStorage() as storage:
        assert await _put(storage, [key, key]) == [Outcome.OK, Outcome.OK]
        assert storage.stats().pages == 1


async def test_a_duplicate_key_gets_the_outcome_of_its_own_write() -> None:
    (writing,), (key,) = _keys(1), _keys(1)
    async with MemoryStorage(capacity_bytes=64 * SIZE) as storage:
        put, gate = await _held_put(storage, [], [writing])  # `writing` is being written
        # The first page is a miss (another put is writing it); the key given twice is
        # written once, and both of its places in the batch get that write's outcome.
        assert await _put(storage, [writing, key, key]) == [Outcome.MISS, Outcome.OK, Outcome.OK]
        gate.set()
        assert await put == [Outcome.OK]
        assert await _get(storage, [writing, key]) == [Outcome.OK, Outcome.OK]
        assert storage.stats().pages == 2


async def test_a_page_exactly_the_capacity_fits() -> None:
    (key,), (bigger,) = _keys(1), _keys(1)
    async with MemoryStorage(capacity_bytes=SIZE) as storage:
        assert await _put(storage, [bigger], nbytes=PAGE + 1) == [Outcome.MISS]
        assert await _put(storage, [key]) == [Outcome.OK]
        assert await _get(storage, [key]) == [Outcome.OK]
        stats = storage.stats()
        assert (stats.pages, stats.bytes, stats.evictions) == (1, SIZE, 0)


async def test_verify_and_gc() -> None:
    keys = _keys(3)
    async with MemoryStorage(capacity_bytes=3 * SIZE) as storage:
        await _put(storage, keys)
        value = await storage.read_raw(keys[0])
        assert value is not None
        await storage.write_raw(keys[0], value[:-1] + bytes([value[-1] ^ 1]))
        report = await storage.verify()
        assert (report.checked, report.ok, report.corrupt_removed) == (3, 2, 1)
        await storage.write_raw(keys[0], bytes(4 * SIZE))  # raw writes ignore capacity
        report_gc = await storage.gc()
        assert report_gc.evicted_pages >= 1
        assert storage.stats().bytes <= 3 * SIZE
        pages = await storage.list_pages()
        assert all(page.num_tokens == 8 for page in pages)


def test_from_url() -> None:
    assert MemoryStorage.from_url("memory://").stats().capacity_bytes == 1 << 30
    assert MemoryStorage.from_url("memory://?capacity=2MiB").stats().capacity_bytes == 2 << 20
    with pytest.raises(StorageConfigError, match="no host"):
        MemoryStorage.from_url("memory://somewhere")
    with pytest.raises(StorageConfigError, match="capacity"):
        MemoryStorage.from_url("memory://?capacity=0")


async def test_repr_and_close() -> None:
    storage = MemoryStorage(capacity_bytes=1 << 20)
    async with storage:
        await _put(storage, _keys(2))
        assert "pages=2" in repr(storage)
    assert "state=closed" in repr(storage)
    assert storage.stats().pages == 0


async def test_removed_buffers_are_reused_by_puts_of_their_size() -> None:
    old, new, other = _keys(2), _keys(2), _keys(1)
    async with MemoryStorage(capacity_bytes=64 * SIZE, spare_bytes=2 * SIZE) as storage:
        await _put(storage, old)
        buffers = {id(storage._values[k].data) for k in old}
        assert await storage.delete(old) == 2
        assert storage._spare_bytes == 2 * SIZE
        assert "spare=" in repr(storage)
        await _put(storage, other, nbytes=PAGE // 2)  # another size: a new buffer
        assert storage._spare_bytes == 2 * SIZE
        assert await _put(storage, new) == [Outcome.OK] * 2
        assert {id(storage._values[k].data) for k in new} == buffers
        assert storage._spare_bytes == 0
        # The old pages are gone for good and the new ones read back whole (_get checks).
        assert await _get(storage, old) == [Outcome.MISS] * 2
        assert await _get(storage, new) == [Outcome.OK] * 2
        assert await storage.verify() == VerifyReport(
            checked=3, ok=3, corrupt_removed=0, unsupported=0, leftovers_removed=0
        )
        raw = await storage.read_raw(new[0])
        assert type(raw) is bytes  # a copy: the buffer may be reused once the page goes


async def test_spare_buffers_stay_within_their_limit_and_gc_frees_them() -> None:
    keys = _keys(4)
    async with MemoryStorage(capacity_bytes=3 * SIZE, spare_bytes=SIZE) as storage:
        await _put(storage, keys[:3])
        assert await _put(storage, keys[3:]) == [Outcome.OK]  # evicts one: kept as a spare
        assert storage.stats().evictions == 1
        assert storage._spare_bytes == SIZE
        await storage.delete(keys)  # beyond the limit: freed
        assert storage._spare_bytes == SIZE
        await storage.gc()
        assert storage._spare_bytes == 0
    async with MemoryStorage(capacity_bytes=3 * SIZE, spare_bytes=0) as storage:
        await _put(storage, keys[:1])
        await storage.delete(keys[:1])
        assert storage._spare_bytes == 0


async def test_a_buffer_read_by_a_get_in_flight_is_not_reused() -> None:
    nbytes = 2 << 20  # above the inline limit: the get runs as a thread job
    keys, more = _keys(2), _keys(2)
    async with MemoryStorage(capacity_bytes=64 << 20) as storage:
        await _put(storage, keys, nbytes)
        reading = asyncio.ensure_future(_get(storage, keys, nbytes))
        await _until(lambda: storage._readers == 1)  # the job is on its thread now
        assert await storage.delete(keys) == 2
        assert storage._spare_bytes == 0  # not recycled under the reader
        await _put(storage, more, nbytes)
        assert await reading == [Outcome.OK] * 2  # the bytes it read were never overwritten
        assert storage._readers == 0
        await storage.delete(more)
        assert storage._spare_bytes == 2 * (HEADER_NBYTES + nbytes)


async def test_a_cancelled_put_leaves_the_accounting_whole() -> None:
    nbytes = 2 << 20
    keys = _keys(8)
    async with MemoryStorage(capacity_bytes=64 << 20, spare_bytes=16 << 20) as storage:
        await _put(storage, keys[:4], nbytes)
        await storage.delete(keys[:4])
        spare = storage._spare_bytes
        assert spare == 4 * (HEADER_NBYTES + nbytes)
        task = asyncio.ensure_future(_put(storage, keys[4:], nbytes))
        await _until(lambda: storage._reserved > 0)  # its job is copying
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # The spares it took went with it; nothing is reserved or stored.
        assert storage._spare_bytes == 0
        assert (storage._reserved, storage.stats().bytes, storage.stats().pages) == (0, 0, 0)
        assert await _put(storage, keys[4:], nbytes) == [Outcome.OK] * 4
        assert await _get(storage, keys[4:], nbytes) == [Outcome.OK] * 4


async def _cancel_a_get_mid_job(
    storage: MemoryStorage, keys: list[bytes], nbytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start a get of `keys` (a batch over the inline limit, so a thread job), cancel it while
    its job reads the first page, and wait until it has ended cancelled."""
    from hicache_async.storage import _memory

    entered, release = threading.Event(), threading.Event()
    read = _memory.read_value_into

    def held(*args: object, **kwargs: object) -> object:
        entered.set()
        release.wait(10)
        return read(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_memory, "read_value_into", held)
    task = asyncio.ensure_future(_get(storage, keys, nbytes))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()
    finally:
        release.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        monkeypatch.setattr(_memory, "read_value_into", read)
    assert task.cancelled()


async def test_a_cancelled_get_counts_no_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    nbytes = 1 << 20
    keys = _keys(16)
    async with MemoryStorage(capacity_bytes=64 << 20) as storage:
        await _put(storage, keys, nbytes)
        await _cancel_a_get_mid_job(storage, keys, nbytes, monkeypatch)
        # The pages it did not read were given up by the caller, not failed by the store.
        stats = storage.stats()
        assert (stats.errors, stats.pages) == (0, 16)
        assert await _get(storage, keys, nbytes) == [Outcome.OK] * 16


async def test_buffers_removed_after_a_cancelled_get_are_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nbytes = 1 << 20
    keys, new = _keys(4), _keys(4)
    size = HEADER_NBYTES + nbytes
    async with MemoryStorage(capacity_bytes=64 << 20, spare_bytes=4 * size) as storage:
        await _put(storage, keys, nbytes)
        buffers = {id(storage._values[k].data) for k in keys}
        await _cancel_a_get_mid_job(storage, keys, nbytes, monkeypatch)
        # The cancelled get reads no more, so what is removed now is recycled.
        assert await storage.delete(keys) == 4
        assert storage._spare_bytes == 4 * size
        assert await _put(storage, new, nbytes) == [Outcome.OK] * 4
        assert {id(storage._values[k].data) for k in new} == buffers
        assert await _get(storage, new, nbytes) == [Outcome.OK] * 4
        assert await _get(storage, keys, nbytes) == [Outcome.MISS] * 4


async def test_bad_buffers_raise_before_anything_is_counted() -> None:
    keys = _keys(2)
    async with MemoryStorage(capacity_bytes=1 << 20) as storage:
        await _put(storage, keys)
        readonly = [[memoryview(bytes(PAGE))] for _ in keys]
        with pytest.raises(ValueError, match="writable"):
            await storage.get(keys, readonly, namespace=NS)
        stats = storage.stats()
        assert (stats.errors, stats.gets, stats.get_hits) == (0, 0, 0)
        assert await _get(storage, keys) == [Outcome.OK] * 2


def test_spare_parameter() -> None:
    assert MemoryStorage.from_url("memory://?capacity=8MiB")._spare_limit == 1 << 20
    assert MemoryStorage.from_url("memory://")._spare_limit == 128 << 20
    assert MemoryStorage.from_url("memory://?spare=0")._spare_limit == 0
    assert MemoryStorage.from_url("memory://?capacity=1GiB&spare=5GiB")._spare_limit == 5 << 30
    with pytest.raises(StorageConfigError, match="spare"):
        MemoryStorage.from_url("memory://?spare=lots")
    with pytest.raises(StorageConfigError, match="spare_bytes must be an integer >= 0"):
        MemoryStorage(spare_bytes=-1)


async def test_new_buffers_of_a_big_put_are_allocated_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # bytearray(n) zero-fills n bytes: for a batch of many MiB that would stall the loop.
    from hicache_async.storage import _memory

    threads: list[threading.Thread] = []

    def allocate(size: int) -> bytearray:
        threads.append(threading.current_thread())
        return builtins.bytearray(size)

    monkeypatch.setattr(_memory, "bytearray", allocate, raising=False)
    nbytes = 2 << 20  # 4 pages: above the inline limit, one thread job
    async with MemoryStorage(capacity_bytes=64 << 20) as storage:
        assert await _put(storage, _keys(4), nbytes) == [Outcome.OK] * 4
    assert len(threads) == 4
    assert threading.current_thread() not in threads


async def test_stored_values_are_untracked_by_the_garbage_collector() -> None:
    # Half a million tracked values cost every full collection a third of a second.
    storage = MemoryStorage(capacity_bytes=1 << 22)
    keys = _keys(8)
    async with storage:
        assert await _put(storage, keys) == [Outcome.OK] * 8
        await storage.write_raw(keys[0], (await storage.read_raw(keys[0])) or b"")
        values = list(storage._values.values())
        assert len(values) == 8
        assert not any(gc.is_tracked(value) for value in values)
        assert await _get(storage, keys) == [Outcome.OK] * 8


async def test_list_pages_lets_the_loop_run_and_skips_pages_removed_meanwhile() -> None:
    # Half a million headers decoded in one go held the loop for over a second.
    count = 2 * _LIST_SLICE + 10
    keys = _keys(count)
    async with MemoryStorage(capacity_bytes=count * (HEADER_NBYTES + 64)) as storage:
        for start in range(0, count, 256):
            part = keys[start : start + 256]
            assert await _put(storage, part, nbytes=64) == [Outcome.OK] * len(part)
        removed: list[int] = []

        # First run at the listing's first turn, once it has taken its snapshot.
        async def remove_the_oldest() -> None:
            removed.append(await storage.delete([keys[0]]))

        task = asyncio.create_task(remove_the_oldest())
        pages = await storage.list_pages()
        await task
        assert removed == [1]
        listed = [page.key for page in pages]
        assert keys[0] not in listed
        assert len(listed) == count - 1
        assert (await storage.gc()).evicted_pages == 0


async def test_a_store_closed_while_it_lists_raises_instead_of_listing_short() -> None:
    count = 2 * _LIST_SLICE
    keys = _keys(count)
    storage = MemoryStorage(capacity_bytes=count * (HEADER_NBYTES + 64))
    async with storage:
        for start in range(0, count, 256):
            assert await _put(storage, keys[start : start + 256], nbytes=64) == [Outcome.OK] * 256
        listing = asyncio.create_task(storage.list_pages())
        await asyncio.sleep(0)
    with pytest.raises(StorageError, match="closed"):
        await listing


async def _steps_while(call: asyncio.Task[list[Outcome]]) -> int:
    """How many times this task ran while `call` had not finished."""
    steps = 0
    while True:
        await asyncio.sleep(0)
        if call.done():
            return steps
        steps += 1


async def test_a_batch_of_tiny_pages_lets_the_loop_run() -> None:
    # 1,024 pages of 64 bytes fit the inline bound: the batch was served on the loop whole,
    # so a long prefetch of tiny pages held it for as long as it ran.
    keys = _keys(1024)
    async with MemoryStorage() as storage:
        put = asyncio.create_task(_put(storage, keys, 64))
        assert await _steps_while(put) >= 3
        assert await put == [Outcome.OK] * len(keys)
        get = asyncio.create_task(_get(storage, keys, 64))
        assert await _steps_while(get) >= 3
        assert await get == [Outcome.OK] * len(keys)
        verify = asyncio.create_task(storage.verify())
        steps = 0
        while not verify.done():
            await asyncio.sleep(0)
            steps += 1
        assert steps >= 3
        assert (await verify).ok == len(keys)


async def test_a_get_of_tiny_pages_cancelled_or_closed_between_slices() -> None:
    keys = _keys(1024)
    async with MemoryStorage() as storage:
        assert await _put(storage, keys, 64) == [Outcome.OK] * len(keys)
        get = asyncio.create_task(_get(storage, keys, 64))
        await _until(lambda: storage._readers == 1)  # its first slice is read
        assert not get.done()
        get.cancel()
        with pytest.raises(asyncio.CancelledError):
            await get
        assert storage.stats().errors == 0
        assert await _get(storage, keys, 64) == [Outcome.OK] * len(keys)
        # A close stops it: the pages read are whole and OK, the rest ERROR.
        get = asyncio.create_task(_get(storage, keys, 64))
        await _until(lambda: storage._readers == 1)
        await storage.close()
        outcomes = await get  # `_get` checks the bytes of every OK page
    read = outcomes.count(Outcome.OK)
    assert 0 < read < len(keys)
    assert outcomes == [Outcome.OK] * read + [Outcome.ERROR] * (len(keys) - read)


async def test_a_put_planned_while_another_copies_counts_that_ones_victims_gone() -> None:
    # Between the slices of a big put, another put planned as if the first one's victims
    # stayed besides its reservation, and evicted that much more than it needed.
    old, big, small = _keys(40), _keys(30), _keys(1)
    async with MemoryStorage(capacity_bytes=60 * SIZE) as storage:
        assert await _put(storage, old) == [Outcome.OK] * 40
        # The big put reserves 30 pages, 10 of them made by evicting; the small one plans
        # while the big one lets the loop run, and needs one victim.
        results = await asyncio.gather(_put(storage, big), _put(storage, small))
        assert results == [[Outcome.OK] * 30, [Outcome.OK]]
        stats = storage.stats()
        assert (stats.pages, stats.bytes, stats.evictions) == (60, 60 * SIZE, 11)
        assert await storage.exists(big) == 30
        assert await storage.exists(small) == 1


async def test_a_cancelled_put_whose_victim_outweighs_its_pages_leaves_room_for_no_more() -> None:
    # A put in flight's victims count as room made only up to what it reserved: cancelled,
    # it leaves them stored, and a put that had planned on the rest would overfill the store.
    big, small = _keys(1), _keys(2)
    async with MemoryStorage(capacity_bytes=4 * SIZE) as storage:
        assert await _put(storage, big, nbytes=2 * SIZE - HEADER_NBYTES) == [Outcome.OK]
        put, _gate = await _held_put(storage, small, _keys(1))  # evicts the big page for one
        later = await _put(storage, _keys(1))
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert later == [Outcome.OK]
        stats = storage.stats()
        assert (stats.bytes, stats.evictions) == (4 * SIZE, 1)
        assert await storage.exists(big) == 1


async def test_gc_counts_a_put_in_flights_victims_only_up_to_what_it_reserved() -> None:
    # gc counted every victim of a put in flight gone: one outweighing the put's pages
    # left the store over capacity once that put was cancelled.
    big, old, new, extra = _keys(1), _keys(2), _keys(1), _keys(1)
    async with MemoryStorage(capacity_bytes=4 * SIZE) as storage:
        assert await _put(storage, big, nbytes=2 * SIZE - HEADER_NBYTES) == [Outcome.OK]
        put, _gate = await _held_put(storage, old, new)  # evicts the big page for one
        raw = await storage.read_raw(old[0])
        assert raw is not None
        await storage.write_raw(extra[0], raw)  # unchecked: the store is over capacity
        report = await storage.gc()
        assert (report.evicted_pages, report.freed_bytes) == (1, SIZE)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        stats = storage.stats()
        assert (stats.bytes, stats.evictions) == (4 * SIZE, 1)
        assert await storage.exists(big) == 1


async def test_a_stream_of_one_page_calls_lets_another_task_run() -> None:
    # A call of one page never suspended: a task streaming such calls held the loop, and a
    # task beside it got no turn until the stream ended.
    turns = 0
    stop = False

    async def count_turns() -> None:
        nonlocal turns
        while not stop:
            turns += 1
            await asyncio.sleep(0)

    keys = _keys(8)
    async with MemoryStorage() as storage:
        counter = asyncio.create_task(count_turns())
        await asyncio.sleep(0)
        calls = [
            *(lambda k=k: _put(storage, [k]) for k in keys),
            *(lambda k=k: storage.exists([k]) for k in keys),
            *(lambda k=k: _get(storage, [k]) for k in keys),
            *(lambda k=k: storage.exists([]) for k in keys),
            *(lambda k=k: storage.delete([k]) for k in keys),
        ]
        try:
            for call in calls:
                before = turns
                await call()
                assert turns > before
        finally:
            stop = True
            await counter


async def test_a_put_cancelled_at_its_first_turn_stores_nothing() -> None:
    keys = _keys(2)
    async with MemoryStorage(capacity_bytes=2 * SIZE) as storage:
        assert await _put(storage, keys[:1]) == [Outcome.OK]
        put = asyncio.create_task(_put(storage, keys[1:]))
        await asyncio.sleep(0)  # the put has started and waits for its turn
        assert not put.done()
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert await storage.exists(keys) == 1
        stats = storage.stats()
        assert (stats.pages, stats.bytes, stats.puts) == (1, SIZE, 1)
        assert await _put(storage, keys[1:]) == [Outcome.OK]
        assert await storage.exists(keys) == 2
