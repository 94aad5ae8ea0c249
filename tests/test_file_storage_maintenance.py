"""FileStorage maintenance at scale: the streamed listing (`stream_pages`) and `verify()`
spread over the store's `io_threads`."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from test_file_storage import (
    SIZE,
    _assert_index_matches_disk,
    _Gate,
    _get,
    _held_before,
    _keys,
    _page_path,
    _put,
    _released,
)

from hicache_async import StorageError
from hicache_async.storage import (
    HEADER_NBYTES,
    FileStorage,
    MaintainableStorage,
    Outcome,
    PageInfo,
    StreamsPages,
    _file,
)


async def _put_one_by_one(storage: FileStorage, keys: list[bytes]) -> None:
    """Each page its own put: the last is the most recently used, and no two share a time."""
    for key in keys:
        assert await _put(storage, [key]) == [Outcome.OK]


async def _streamed(storage: FileStorage, batch_pages: int) -> list[list[PageInfo]]:
    return [batch async for batch in storage.stream_pages(batch_pages)]


def _damage(root: Path, key: bytes, offset: int, value: bytes) -> None:
    path = _page_path(root, key)
    data = bytearray(path.read_bytes())
    data[offset : offset + len(value)] = value
    path.write_bytes(bytes(data))


# The streamed listing.


async def test_the_streamed_listing_is_list_pages_in_batches(tmp_path: Path) -> None:
    keys = _keys(23)
    async with FileStorage(tmp_path / "s") as storage:
        assert isinstance(storage, StreamsPages)
        assert isinstance(storage, MaintainableStorage)
        await _put_one_by_one(storage, keys)
        await _get(storage, [keys[3], keys[10]])  # used: first in the order
        _damage(tmp_path / "s", keys[5], 0, b"XXXX")  # listed with 0 tokens, as list_pages
        whole = await storage.list_pages()
        assert [page.key for page in whole[:2]] == [keys[3], keys[10]]
        for batch_pages in (1, 5, 23, 1000):
            batches = await _streamed(storage, batch_pages)
            assert all(0 < len(batch) <= batch_pages for batch in batches)
            assert [page for batch in batches for page in batch] == whole
        assert await _streamed(storage, 4) == [whole[i : i + 4] for i in range(0, 23, 4)]
    async with FileStorage(tmp_path / "empty") as storage:
        assert await _streamed(storage, 4) == []


async def test_stream_pages_refuses_a_bad_batch_size_and_a_store_not_open(
    tmp_path: Path,
) -> None:
    storage = FileStorage(tmp_path / "s")
    with pytest.raises(StorageError, match="not open"):
        storage.stream_pages()
    async with storage:
        for bad in (0, -1, 1.5, True, "8"):
            with pytest.raises(ValueError, match="batch_pages must be an integer >= 1"):
                storage.stream_pages(bad)  # type: ignore[arg-type]
    with pytest.raises(StorageError, match="closed"):
        storage.stream_pages()


async def _listed_around(
    root: Path,
    count: int,
    batch_pages: int,
    change: Callable[[FileStorage, list[bytes]], Awaitable[object]],
) -> tuple[list[bytes], list[bytes]]:
    """Stores `count` pages, lists a first batch, awaits `change(storage, order)`, lists the
    rest. Returns the order before the change and the keys listed, in their order."""
    async with FileStorage(root) as storage:
        await _put_one_by_one(storage, _keys(count))
        order = [page.key for page in await storage.list_pages()]
        stream = storage.stream_pages(batch_pages)
        listed = [page.key for page in await anext(stream)]
        assert listed == order[:batch_pages]
        await change(storage, order)
        listed += [page.key async for batch in stream for page in batch]
        await _assert_index_matches_disk(storage, root)
    return order, listed


async def test_pages_removed_while_the_listing_runs_are_left_out(tmp_path: Path) -> None:
    # The last page listed (where the listing goes on from) and pages not listed yet.
    gone = [4, 7, 12, 29]

    async def delete(storage: FileStorage, order: list[bytes]) -> None:
        assert await storage.delete([order[i] for i in gone]) == len(gone)

    order, listed = await _listed_around(tmp_path, 30, 5, delete)
    assert listed == [key for i, key in enumerate(order) if i not in gone[1:]]


async def test_a_listing_goes_on_when_every_page_of_its_last_batch_went(tmp_path: Path) -> None:
    async def delete(storage: FileStorage, order: list[bytes]) -> None:
        assert await storage.delete(order[:4]) == 4

    order, listed = await _listed_around(tmp_path, 12, 4, delete)
    assert listed == order


@pytest.mark.parametrize("change", ["delete", "read"])
async def test_pages_of_one_put_are_listed_once_when_a_later_batch_of_them_goes(
    tmp_path: Path, change: str
) -> None:
    # Every page of one put shares its last access: when no page of the batch listed before
    # a change was left in place, the listing went on from the pages as old as that batch's
    # oldest, and listed the earlier batches of the put again.
    keys = _keys(12)
    async with FileStorage(tmp_path / "s") as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 12
        order = [page.key for page in await storage.list_pages()]
        stream = storage.stream_pages(4)
        first = [page.key for page in await anext(stream)]
        second = [page.key for page in await anext(stream)]
        if change == "delete":
            assert await storage.delete(second) == 4
        else:
            assert await _get(storage, second) == [Outcome.OK] * 4
        rest = [page.key async for batch in stream for page in batch]
    listed = first + second + rest
    assert len(listed) == len(set(listed)) == 12
    assert listed == order


async def test_pages_used_or_stored_while_the_listing_runs_are_listed_once_at_most(
    tmp_path: Path,
) -> None:
    new = _keys(2)
    used: list[bytes] = []

    async def use(storage: FileStorage, order: list[bytes]) -> None:
        used.extend([order[2], order[4], order[9]])  # two listed already, one not yet
        assert await _get(storage, used) == [Outcome.OK] * 3
        assert await _put(storage, new) == [Outcome.OK] * 2

    order, listed = await _listed_around(tmp_path, 20, 5, use)
    assert len(listed) == len(set(listed))
    assert not set(new) & set(listed)
    # Every page neither used nor stored meanwhile, in its place.
    assert [key for key in listed if key not in used] == [key for key in order if key not in used]


async def test_a_page_deleted_while_its_batch_is_read_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = _keys(6)
    gate = _Gate()
    async with FileStorage(tmp_path / "s", spare_bytes=0) as storage:
        await _put_one_by_one(storage, keys)
        order = [page.key for page in await storage.list_pages()]
        monkeypatch.setattr(storage, "_headers_job", _held_before(storage._headers_job, gate))
        with _released(gate):
            listing = asyncio.ensure_future(_streamed(storage, 10))
            await gate.wait_reached()
            assert await storage.delete([order[1], order[3]]) == 2
            gate.go.set()
            batches = await listing
        assert [page.key for batch in batches for page in batch] == [
            key for i, key in enumerate(order) if i not in (1, 3)
        ]


async def _closed_while_held(
    storage: FileStorage, gate: _Gate, work: Coroutine[Any, Any, object]
) -> None:
    """Runs `work` until its job reaches `gate`, closes the store, lets the job go on (asked
    to stop by then) and checks that `work` raises the store's closed error."""
    with _released(gate):
        running = asyncio.ensure_future(work)
        await gate.wait_reached()
        closing = asyncio.ensure_future(storage.close())
        await asyncio.sleep(0)  # close() has asked the job to stop
        gate.go.set()
        await closing
        with pytest.raises(StorageError, match="closed"):
            await running


async def test_a_close_while_the_listing_runs_raises_the_closed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = _keys(10)
    async with FileStorage(tmp_path / "s") as storage:
        await _put_one_by_one(storage, keys)
        stream = storage.stream_pages(3)
        assert len(await anext(stream)) == 3
        await storage.close()
        with pytest.raises(StorageError, match="closed"):
            await anext(stream)
    # Closed while a batch is read: the job stops part-way, and its answers are not pages.
    gate = _Gate()
    async with FileStorage(tmp_path / "s") as storage:
        monkeypatch.setattr(storage, "_headers_job", _held_before(storage._headers_job, gate))
        await _closed_while_held(storage, gate, _streamed(storage, 100))


async def test_a_cancelled_listing_stops_its_job_and_leaves_the_store_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = _keys(10)
    gate = _Gate()
    async with FileStorage(tmp_path / "s") as storage:
        await _put_one_by_one(storage, keys)
        before = await storage.list_pages()
        original = storage._headers_job
        stopped: list[bool] = []

        def headers_job(stop: threading.Event, keys: list[bytes]) -> Any:
            gate.hold()
            stopped.append(stop.is_set())
            return original(stop, keys)

        monkeypatch.setattr(storage, "_headers_job", headers_job)
        with _released(gate):
            listing = asyncio.ensure_future(_streamed(storage, 4))
            await gate.wait_reached()
            listing.cancel()
            await asyncio.sleep(0)  # the cancellation has reached the job's wait
            gate.go.set()
            with pytest.raises(asyncio.CancelledError):
                await listing
        assert stopped == [True]  # asked to stop, and waited for before the cancel went on
        monkeypatch.undo()
        assert await storage.list_pages() == before
        assert await _get(storage, keys) == [Outcome.OK] * 10


# verify() over several threads.

# Enough bytes for a batch to fan out (_FANOUT_MIN_BYTES).
_VERIFY_PAGES = 96


def _damaged_store(root: Path) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """A store of `_VERIFY_PAGES` pages with corrupt pages and pages of a newer format spread
    over it, and a leftover; returns (keys, corrupt, unsupported)."""
    keys = _keys(_VERIFY_PAGES)

    async def store() -> None:
        async with FileStorage(root) as storage:
            for start in range(0, len(keys), 32):
                assert await _put(storage, keys[start : start + 32]) == [Outcome.OK] * 32

    asyncio.run(store())
    corrupt = keys[3::7]
    unsupported = keys[6::14]  # none of them corrupt
    for key in corrupt:
        _damage(root, key, HEADER_NBYTES + 17, b"\xff\x00")  # the payload: checksum
    for key in unsupported:
        _damage(root, key, 4, (99).to_bytes(2, "little"))  # format version 99
    (root / "pages" / "zz-stray").symlink_to("elsewhere")  # a regular file would be left
    return keys, corrupt, unsupported


@pytest.mark.parametrize("io_threads", [1, 2, 4])
def test_verify_on_several_threads_finds_what_one_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_threads: int
) -> None:
    root = tmp_path / "s"
    keys, corrupt, unsupported = _damaged_store(root)
    assert _VERIFY_PAGES * SIZE >= _file._FANOUT_MIN_BYTES
    checkers: set[str] = set()
    original = FileStorage._verify_file

    def verify_file(self: FileStorage, *args: Any) -> Any:
        checkers.add(threading.current_thread().name)
        return original(self, *args)

    monkeypatch.setattr(FileStorage, "_verify_file", verify_file)

    async def verify() -> None:
        async with FileStorage(root, io_threads=io_threads) as storage:
            report = await storage.verify()
            assert (report.checked, report.ok) == (
                _VERIFY_PAGES,
                _VERIFY_PAGES - len(corrupt) - len(unsupported),
            )
            assert (report.corrupt_removed, report.unsupported) == (len(corrupt), len(unsupported))
            assert (report.leftovers_removed, report.unchecked) == (1, 0)
            assert storage.stats().corrupt == len(corrupt)
            assert storage.stats().pages == _VERIFY_PAGES - len(corrupt)
            await _assert_index_matches_disk(storage, root)
            good = [key for key in keys if key not in corrupt and key not in unsupported]
            assert await _get(storage, good) == [Outcome.OK] * len(good)
            again = await storage.verify()
            assert (again.checked, again.corrupt_removed) == (_VERIFY_PAGES - len(corrupt), 0)

    asyncio.run(verify())
    for key in corrupt:
        assert not _page_path(root, key).exists()
    for key in unsupported:
        assert _page_path(root, key).exists()
    # The pages were spread over the store's threads (a thread that started late checks fewer;
    # on a busy machine one may not have started at all, so at least two of them).
    assert len(checkers) >= min(io_threads, 2)


async def test_a_close_stops_verify_on_every_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    await asyncio.to_thread(_damaged_store, root)
    gate = _Gate()
    checked: list[bytes] = []
    lock = threading.Lock()
    original = FileStorage._verify_file

    def verify_file(self: FileStorage, shard_fd: int, key: bytes, *args: Any) -> Any:
        with lock:
            checked.append(key)
        gate.hold()  # every thread that takes a page waits here until the close
        return original(self, shard_fd, key, *args)

    monkeypatch.setattr(FileStorage, "_verify_file", verify_file)
    storage = FileStorage(root, io_threads=4)
    async with storage:
        await _closed_while_held(storage, gate, storage.verify())
    # Each thread stopped after the page it held, which it left unchecked: none removed.
    assert 1 <= len(checked) <= 4
    assert len([p for p in (root / "pages").rglob("*") if p.is_file()]) == _VERIFY_PAGES


async def test_a_cancelled_verify_on_several_threads_removes_nothing_it_did_not_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    _, corrupt, _ = await asyncio.to_thread(_damaged_store, root)
    gate = _Gate()
    original = FileStorage._verify_file

    def verify_file(self: FileStorage, *args: Any) -> Any:
        gate.hold()  # every thread that takes a page waits here until the cancellation
        return original(self, *args)

    monkeypatch.setattr(FileStorage, "_verify_file", verify_file)
    async with FileStorage(root, io_threads=4) as storage:
        with _released(gate):
            verifying = asyncio.ensure_future(storage.verify())
            await gate.wait_reached()
            verifying.cancel()
            await asyncio.sleep(0)
            gate.go.set()
            with pytest.raises(asyncio.CancelledError):
                await verifying
        monkeypatch.undo()
        # Whatever the cancelled run removed, the next one finds the rest: between them,
        # every corrupt page once, and the index in line with the disk.
        removed_before = sum(not _page_path(root, key).exists() for key in corrupt)
        report = await storage.verify()
        assert report.corrupt_removed == len(corrupt) - removed_before
        assert report.checked == _VERIFY_PAGES - removed_before
        await _assert_index_matches_disk(storage, root)
    assert os.listdir(root / "tmp") == []
