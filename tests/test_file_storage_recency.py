"""FileStorage: the order of use survives a reopen.

The index is rebuilt from the page files' mtimes at open, so every use the index counts
(a put, a `get` hit, an `exists` that finds the page, a put of a page stored already) must
reach the file's mtime, and the pages of one call must get mtimes that fall from its first
key to its last, as the index orders them: a chain then still loses its deepest pages first.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_file_storage import SIZE, _Gate, _get, _keys, _page_path, _put, _released

from hicache_async.storage import HEADER_NBYTES, FileStorage, Outcome, _file

HOUR_NS = 3600 * 10**9


def _mtimes(root: Path, keys: list[bytes]) -> list[int]:
    return [_page_path(root, key).stat().st_mtime_ns for key in keys]


def _age(root: Path, keys: list[bytes], base_ns: int) -> None:
    """Set the pages' mtimes to `base_ns`, `base_ns` + 1 s, ...: used long ago, the first key
    least recently."""
    for rank, key in enumerate(keys):
        stamp = base_ns + rank * 10**9
        os.utime(_page_path(root, key), ns=(stamp, stamp))


def _strictly_falling(values: list[int]) -> bool:
    return all(a > b for a, b in itertools.pairwise(values))


async def test_a_chain_put_in_one_batch_loses_its_deepest_page_first_after_a_reopen(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    chain, new = _keys(5), _keys(1)
    async with FileStorage(root, capacity_bytes=5 * SIZE, io_threads=1) as storage:
        assert await _put(storage, chain) == [Outcome.OK] * 5
    # Written in batch order, the root's file would be the oldest (and within one tick of the
    # kernel's clock, all alike): the reopened index would evict the chain from its root.
    assert _strictly_falling(_mtimes(root, chain))
    async with FileStorage(root, capacity_bytes=5 * SIZE, io_threads=1) as storage:
        assert list(storage._index) == chain[::-1]
        assert await _put(storage, new) == [Outcome.OK]
        assert await storage.exists(chain) == 4
        assert await storage.exists(chain[4:]) == 0


async def test_lookups_and_puts_of_stored_pages_order_eviction_after_a_reopen(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    old, new = _keys(5), _keys(1)
    async with FileStorage(root) as storage:
        for key in old:
            assert await _put(storage, [key]) == [Outcome.OK]
    _age(root, old, time.time_ns() - HOUR_NS)  # old[0] the least recently used
    async with FileStorage(root) as storage:
        assert list(storage._index) == old
        assert await storage.exists(old[:1]) == 1  # a lookup: stamped by a job of its own
        assert await _put(storage, old[1:2]) == [Outcome.OK]  # stored already: the same
        # Stored already, then written: both stamped by the put's job, the first key newest.
        assert await _put(storage, [old[2], new[0]]) == [Outcome.OK] * 2
        expected = [old[2], new[0], old[1], old[0], old[4], old[3]]
        assert [page.key for page in await storage.list_pages()] == expected
    async with FileStorage(root) as storage:  # read back from the files' mtimes
        assert [page.key for page in await storage.list_pages()] == expected
    async with FileStorage(root, capacity_bytes=6 * SIZE) as storage:
        assert await _put(storage, _keys(1)) == [Outcome.OK]
        assert await storage.exists(old[3:4]) == 0
        assert [await storage.exists([key]) for key in expected[:-1]] == [1] * 5


async def test_a_lookup_does_not_wait_for_its_stamps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    keys = _keys(4)
    async with FileStorage(root) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 4
    long_ago = time.time_ns() - HOUR_NS
    _age(root, keys, long_ago)
    gate = _Gate()
    threads: list[threading.Thread] = []
    jobs: list[list[int]] = []  # per stamping job: how many stamps each call queued
    original = _file._stamp_queued

    def held(handles: Any, queued: list[tuple[int, dict[bytes, int]]]) -> None:
        threads.append(threading.current_thread())
        jobs.append([len(stamps) for _, stamps in queued])
        if len(jobs) == 1:
            gate.hold()
        original(handles, queued)

    monkeypatch.setattr(_file, "_stamp_queued", held, raising=False)
    async with FileStorage(root) as storage:
        with _released(gate):
            assert await storage.exists(keys[:3]) == 3  # answered while its stamps wait
            assert await storage.exists(keys[:1]) == 1  # used again: nothing new to stamp
            await gate.wait_reached()
            assert jobs == [[3]]
            assert _mtimes(root, keys)[0] == long_ago
            # Queued while the stamper's job runs, and still queued at the close: written
            # by the close, after that job.
            assert await storage.exists(keys[3:]) == 1
            gate.go.set()
    assert jobs == [[3], [1]]
    assert threading.main_thread() not in threads
    stamped = _mtimes(root, keys)
    assert stamped[3] > stamped[0] > long_ago + 3 * 10**9
    assert _strictly_falling(stamped[:3])


async def test_the_hits_of_a_get_are_stamped_first_key_newest(tmp_path: Path) -> None:
    root = tmp_path / "s"
    chain = _keys(4)
    async with FileStorage(root, io_threads=1) as storage:
        assert await _put(storage, chain) == [Outcome.OK] * 4
        long_ago = time.time_ns() - HOUR_NS
        for key in chain:  # all alike: only the read's stamps can order them
            os.utime(_page_path(root, key), ns=(long_ago, long_ago))
        assert await _get(storage, chain) == [Outcome.OK] * 4
        stamped = _mtimes(root, chain)
        assert stamped[-1] > long_ago
        assert _strictly_falling(stamped)


async def test_a_shared_lookup_stamps_in_its_own_job(tmp_path: Path) -> None:
    root = tmp_path / "s"
    chain = _keys(5)
    async with FileStorage(root, shared=True) as writer:
        assert await _put(writer, chain[:2]) == [Outcome.OK] * 2
        long_ago = time.time_ns() - HOUR_NS
        _age(root, chain[:2], long_ago)
        async with FileStorage(root, shared=True) as reader:
            assert list(reader._index) == chain[:2]  # indexed at open
            assert await _put(writer, chain[2:]) == [Outcome.OK] * 3
            _age(root, chain[2:], long_ago)
            # The first two from the index, the rest looked up on disk by the call's job,
            # which also stamps all five.
            assert await reader.exists(chain) == 5
            stamped = _mtimes(root, chain)
            assert stamped[-1] > long_ago + 4 * 10**9
            assert _strictly_falling(stamped)
            assert reader._stamper is None  # no job of its own


async def test_a_shared_put_of_a_stored_page_stamps_its_file(tmp_path: Path) -> None:
    root = tmp_path / "s"
    mine, theirs = _keys(1), _keys(1)
    async with (
        FileStorage(root, shared=True) as first,
        FileStorage(root, shared=True) as second,
    ):
        assert await _put(first, mine) == [Outcome.OK]
        assert await _put(second, theirs) == [Outcome.OK]
        long_ago = time.time_ns() - HOUR_NS
        _age(root, mine + theirs, long_ago)
        # One this instance indexes, one another instance wrote: a use either way.
        assert await _put(first, mine + theirs) == [Outcome.OK] * 2
        stamped = _mtimes(root, mine + theirs)
        assert stamped[-1] > long_ago + 10**9
        assert _strictly_falling(stamped)


async def test_a_shared_lookup_stamps_indexed_pages_past_one_it_looked_up(tmp_path: Path) -> None:
    root = tmp_path / "s"
    first, middle, last = _keys(3)
    async with FileStorage(root, shared=True) as writer:
        assert await _put(writer, [first, last]) == [Outcome.OK] * 2
    long_ago = time.time_ns() - HOUR_NS
    _age(root, [first, last], long_ago)
    async with (
        FileStorage(root, shared=True) as reader,
        FileStorage(root, shared=True) as writer,
    ):
        assert await _put(writer, [middle]) == [Outcome.OK]  # not in the reader's index
        _age(root, [middle], long_ago)
        # `last` is indexed but comes after a key the lookup's job had to look at on disk.
        assert await reader.exists([first, middle, last]) == 3
        assert await reader.exists([last]) == 1  # within the second: nothing new to stamp
    stamped = _mtimes(root, [first, middle, last])
    assert stamped[-1] > long_ago + 2 * 10**9
    assert _strictly_falling(stamped)


async def test_a_shared_gc_keeps_a_page_another_instance_used_since(tmp_path: Path) -> None:
    # Another deployment (another model, or another version during an upgrade) shares the
    # root: this instance learns of its uses only from the files' mtimes.
    root = tmp_path / "s"
    hot, cold = _keys(1), _keys(3)
    async with FileStorage(root, shared=True) as other:
        assert await _put(other, hot + cold) == [Outcome.OK] * 4
        _age(root, hot + cold, time.time_ns() - HOUR_NS)  # `hot` the least recently used
        async with FileStorage(root, shared=True, capacity_bytes=2 * SIZE) as mine:
            assert list(mine._index) == hot + cold
            assert await _get(other, hot) == [Outcome.OK]  # used (and stamped) there since
            report = await mine.gc()
            assert (report.evicted_pages, report.failed, report.over_capacity_bytes) == (2, 0, 0)
            assert [page.key for page in await mine.list_pages()] == [hot[0], cold[2]]
            assert (mine.stats().evictions, mine.stats().errors) == (2, 0)
        assert await _get(other, hot) == [Outcome.OK]


async def test_a_shared_put_spares_a_page_another_instance_used_since(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    hot, own, new = _keys(1), _keys(2), _keys(2)
    async with FileStorage(root, shared=True) as other:
        assert await _put(other, hot) == [Outcome.OK]
        _age(root, hot, time.time_ns() - HOUR_NS)
        async with FileStorage(root, shared=True, capacity_bytes=3 * SIZE) as mine:
            assert await _put(mine, own) == [Outcome.OK] * 2  # full
            assert await _get(other, hot) == [Outcome.OK]
            # Its victim, `hot`, was used there since: it stays, and is now this index's
            # most recent but the new page; the least recently used of the others goes in
            # its stead, in the same put.
            assert await _put(mine, new[:1]) == [Outcome.OK]
            assert list(mine._index) == [own[0], *hot, new[0]]
            assert (mine.stats().evictions, mine.stats().bytes) == (1, 3 * SIZE)
            assert await _put(mine, new[1:]) == [Outcome.OK]
            assert list(mine._index) == [*hot, *new]
            assert (mine.stats().evictions, mine.stats().bytes) == (2, 3 * SIZE)
        assert await _get(other, hot) == [Outcome.OK]


async def test_shared_puts_whose_every_victim_another_instance_uses_keep_the_capacity(
    tmp_path: Path,
) -> None:
    # Another deployment uses every page this instance would evict: each stays once, moved
    # to the most recent end, and the put evicts in its stead, so no put leaves the store
    # over its capacity (it grew by each put's pages before, without bound).
    root = tmp_path / "s"
    hot = _keys(4)
    async with FileStorage(root, shared=True) as other:
        assert await _put(other, hot) == [Outcome.OK] * 4
        _age(root, hot, time.time_ns() - HOUR_NS)  # hot[0] the least recently used
        async with FileStorage(root, shared=True, capacity_bytes=4 * SIZE) as mine:
            assert list(mine._index) == hot
            assert await _get(other, hot) == [Outcome.OK] * 4  # all used there since
            stored: list[bytes] = []
            for _ in range(6):
                new = _keys(1)
                assert await _put(mine, new) == [Outcome.OK]
                stored += new
                assert mine.stats().bytes <= 4 * SIZE
                assert len(await mine.list_pages()) == len(mine._index) <= 4
            # Every page stayed once, then the least recently used went first: the hot
            # pages in the order they were tried again, then this instance's own.
            assert list(mine._index) == stored[2:]
            assert mine.stats().evictions == 6
            assert not any(_page_path(root, key).exists() for key in hot)


async def test_a_shared_put_records_the_mtimes_its_job_gave_the_files(tmp_path: Path) -> None:
    # The job stamps files later than the call's own clock (by as long as it waited for a
    # thread): recorded at the call's time, an eviction would take the difference for
    # another instance's use, and keep the page.
    root = tmp_path / "s"
    stored, new = _keys(2), _keys(3)
    async with FileStorage(root, shared=True) as storage:
        assert await _put(storage, stored) == [Outcome.OK] * 2
        _age(root, stored, time.time_ns() - HOUR_NS)
        assert await _put(storage, stored[:1] + new) == [Outcome.OK] * 4  # one stamped again
        for key in stored[:1] + new:
            # Within a microsecond: the index holds seconds as a float.
            assert storage._index[key].mtime * 10**9 >= _mtimes(root, [key])[0] - 1000


async def test_a_shared_get_records_the_mtimes_its_job_gave_the_files(tmp_path: Path) -> None:
    # A read stamps a file by the file's own age, which the index may hold younger than it
    # is (a page found on disk is indexed at the time of the read that found it): had the
    # index kept its older time, an eviction would take the read's stamp for another
    # instance's use, and keep the page in place of pages used since.
    root = tmp_path / "s"
    keys = _keys(2)
    async with FileStorage(root, shared=True) as other, FileStorage(root, shared=True) as mine:
        assert await _put(other, keys) == [Outcome.OK] * 2
        assert await _get(mine, keys) == [Outcome.OK] * 2  # found on disk: indexed now
        _age(root, keys, time.time_ns() - HOUR_NS)
        assert await _get(mine, keys) == [Outcome.OK] * 2  # stamped by the read's job
        for key in keys:
            assert mine._index[key].mtime * 10**9 >= _mtimes(root, [key])[0] - 1000


async def test_a_delete_while_an_eviction_spares_the_page_removes_it_for_good(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The eviction looked at the page and left it in place (another instance used it); a
    # delete removed it before the eviction committed: the index must not take it back.
    root = tmp_path / "s"
    hot, cold = _keys(1), _keys(1)
    gate = _Gate()
    async with FileStorage(root, shared=True) as other:
        assert await _put(other, hot + cold) == [Outcome.OK] * 2
        _age(root, hot + cold, time.time_ns() - HOUR_NS)  # `hot` the least recently used
        async with FileStorage(root, shared=True, capacity_bytes=SIZE) as mine:
            assert await _get(other, hot) == [Outcome.OK]  # used there since
            original = _file._used_elsewhere

            def used_elsewhere(*args: Any) -> float | None:
                used = original(*args)
                gate.hold()
                return used

            monkeypatch.setattr(_file, "_used_elsewhere", used_elsewhere)
            with _released(gate):
                gc = asyncio.ensure_future(mine.gc())
                await gate.wait_reached()  # `hot` looked at and left in place
                monkeypatch.undo()
                assert await mine.delete(hot) == 1
                gate.go.set()
                report = await gc
            assert not _page_path(root, hot[0]).exists()
            assert await mine.exists(hot) == 0
            # Nothing more to evict: the delete made the room.
            assert (report.evicted_pages, report.over_capacity_bytes) == (0, 0)
            assert await mine.exists(cold) == 1
            assert (mine.stats().pages, mine.stats().bytes) == (1, SIZE)


def _root_of_aged_pages(root: Path, count: int, seed: int) -> None:
    """A root of `count` page files (random keys, so in every shard) whose mtimes take a few
    distinct values (ties are ordered by the listing), one in ten too short to be a page."""
    rng = random.Random(seed)
    stamps = [time.time_ns() - HOUR_NS + rng.randrange(50) * 10**9 for _ in range(count)]
    for stamp in stamps:
        key = rng.randbytes(32)
        path = _page_path(root, key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_bytes(bytes(HEADER_NBYTES if rng.random() < 0.9 else 10))
        os.utime(path, ns=(stamp, stamp))


async def test_the_index_at_open_is_ordered_by_mtime_ties_in_listing_order(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as empty:  # lays the root out
        assert not empty._index
    _root_of_aged_pages(root, 700, seed=3)
    async with FileStorage(root) as storage:
        assert storage._handles is not None
        found = _file._scan(storage._handles, threading.Event())
        # Least recently used first: a stable sort of the listing by mtime, then the files
        # no page can be moved to the front, one after another in listing order.
        expected = [key for key, _, _ in sorted(found, key=lambda page: page[2])]
        for key, nbytes, _ in found:
            if nbytes < HEADER_NBYTES:
                expected.remove(key)
                expected.insert(0, key)
        assert len(found) == 700
        assert list(storage._index) == expected


async def test_open_sorts_no_list_of_every_page_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The index is built on a job thread while the loop serves; a sort in C holds the GIL
    # throughout (half a second for a million pages), so open must not sort them all at once.
    root = tmp_path / "s"
    async with FileStorage(root) as empty:
        assert not empty._index
    _root_of_aged_pages(root, 700, seed=4)
    sorted_lengths: list[int] = []

    def recording_sorted(items: Any, **kwargs: Any) -> list[Any]:
        items = list(items)
        sorted_lengths.append(len(items))
        return sorted(items, **kwargs)

    monkeypatch.setattr(_file, "sorted", recording_sorted, raising=False)
    async with FileStorage(root) as storage:
        assert len(storage._index) == 700
    assert max(sorted_lengths, default=0) < 700


async def test_a_put_during_an_eviction_in_stead_leaves_the_store_within_its_capacity(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The eviction in stead offers its job more pages than it owes once some stayed, and they
    # are out of the index while the job looks at them: a put meanwhile took the room of
    # those the job did not remove for free, and the eviction, owing only its own, left the
    # store over its capacity by that put's page.
    root = tmp_path / "s"
    hot, first, second = _keys(4), _keys(1), _keys(1)
    gate = _Gate()
    async with FileStorage(root, shared=True) as other:
        assert await _put(other, hot) == [Outcome.OK] * 4
        _age(root, hot, time.time_ns() - HOUR_NS)  # hot[0] the least recently used
        async with FileStorage(root, shared=True, capacity_bytes=4 * SIZE, io_threads=2) as mine:
            assert await _get(other, hot) == [Outcome.OK] * 4  # all used there since
            original = _file._used_elsewhere

            def used_elsewhere(shard_fd: int, name: str, seen: float | None) -> float | None:
                # hot[2] is looked at in the eviction's second round, with hot[3] offered too.
                if name == hot[2].hex():
                    gate.hold()
                return original(shard_fd, name, seen)

            monkeypatch.setattr(_file, "_used_elsewhere", used_elsewhere)
            with _released(gate):
                put = asyncio.ensure_future(_put(mine, first))
                await gate.wait_reached()
                assert mine.stats().bytes < 4 * SIZE  # hot[2] and hot[3] out of the index
                assert await _put(mine, second) == [Outcome.OK]
                gate.go.set()
                assert await put == [Outcome.OK]
            assert mine.stats().bytes <= 4 * SIZE
            assert len(await mine.list_pages()) == len(mine._index) <= 4
            assert set(first + second) <= set(mine._index)
