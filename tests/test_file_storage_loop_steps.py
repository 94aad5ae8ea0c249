"""FileStorage work that grows with the number of pages runs on the loop in bounded steps: a
rescan's merge, evictions, listings. Each step is `_file._LOOP_SLICE` pages (made small
here), and the loop's other tasks run between steps; a cancellation between them leaves the
index sound."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from test_file_storage import SIZE, _assert_index_matches_disk, _get, _keys, _page_path, _put

from hicache_async.storage import HEADER_NBYTES, FileStorage, Outcome, _file

STEP = 8


@pytest.fixture(autouse=True)
def _small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_file, "_LOOP_SLICE", STEP, raising=False)


class _Ticker:
    """A task that counts the turns the loop gives it, and runs `action` at the first turn
    where `when` holds."""

    def __init__(self) -> None:
        self.ticks = 0
        self.when: Callable[[], bool] = lambda: False
        self.action: Callable[[], None] = lambda: None
        self.acted = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.ticks += 1
            if not self.acted and self.when():
                self.acted = True
                self.action()


@contextlib.asynccontextmanager
async def _ticking() -> AsyncIterator[_Ticker]:
    ticker = _Ticker()
    task = asyncio.get_running_loop().create_task(ticker.run())
    try:
        yield ticker
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _write_pages(root: Path, stamps: list[float]) -> list[bytes]:
    """Page files another instance wrote, with these mtimes (s); their keys, in order."""
    keys = _keys(len(stamps))
    for key, stamp in zip(keys, stamps, strict=True):
        path = _page_path(root, key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_bytes(bytes(HEADER_NBYTES))
        os.utime(path, (stamp, stamp))
    return keys


def _assert_sound(storage: FileStorage) -> None:
    """The index's byte count is its entries', and nothing is left marked in flight."""
    assert storage._bytes == sum(entry.nbytes for entry in storage._index.values())
    assert not storage._watchers
    assert not storage._changed
    assert not storage._writing
    assert not storage._evicting
    assert not storage._pins
    assert storage._reserved == 0


async def _assert_matches_disk(storage: FileStorage, root: Path) -> None:
    await _assert_index_matches_disk(storage, root)
    _assert_sound(storage)


def _recording(storage: FileStorage, name: str, sizes: list[int], arg: str) -> None:
    """Record the length of the keyword argument `arg` of each call of `storage.<name>`."""
    original = getattr(storage, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sizes.append(len(kwargs[arg]) if arg in kwargs else len(args[-1]))
        return original(*args, **kwargs)

    setattr(storage, name, wrapper)


# A rescan's merge.


async def test_a_rescan_merges_the_pages_it_found_in_steps(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root, shared=True) as storage:
        own = _keys(3)
        await _put(storage, own)
        now = time.time()
        found = _write_pages(root, [now - 1000 + i for i in range(5 * STEP)])
        async with _ticking() as ticker:
            at_insert: list[int] = []
            insert = storage._insert

            def recording(key: bytes, nbytes: int, last_access: float) -> None:
                at_insert.append(ticker.ticks)
                insert(key, nbytes, last_access)

            storage._insert = recording  # type: ignore[method-assign]
            await storage.gc()
        assert len(at_insert) == len(found)
        assert at_insert[0] < at_insert[-1]  # the loop ran other tasks in between
        # Older than this instance's own pages, least recently used first.
        assert list(storage._index) == [*found, *own[::-1]]
        _assert_sound(storage)


async def test_a_merge_in_steps_orders_pages_by_time_among_the_indexed(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root, shared=True) as storage:
        own = _keys(3 * STEP)
        await _put(storage, own)
        rng = random.Random(5)
        base = float(int(time.time()) - 10_000)  # whole seconds: file times keep them
        times: dict[bytes, float] = {}
        indexed = list(storage._index)  # oldest first
        for position, key in enumerate(indexed):
            storage._index[key].last_access = times[key] = base + 10 * position
        stamps = sorted(base + t for t in rng.sample(range(10 * len(own) + 20), 5 * STEP))
        found = _write_pages(root, stamps)
        times.update(zip(found, stamps, strict=True))
        await storage.gc()
        # By time; on a tie, this instance's own page first.
        found_set = set(found)
        expected = sorted([*indexed, *found], key=lambda key: (times[key], key in found_set))
        assert list(storage._index) == expected
        _assert_sound(storage)


async def test_pages_used_during_a_merge_stay_the_most_recent(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root, shared=True) as storage:
        own = _keys(2)
        await _put(storage, own)
        count = len(storage._index)
        now = time.time()
        found = _write_pages(root, [now - 1000 + i for i in range(6 * STEP)])
        used = [own[1], found[0]]
        async with _ticking() as ticker:
            # Between two steps of the merge (no job runs then), a lookup uses two pages.
            ticker.when = lambda: count + STEP <= len(storage._index) and not storage._jobs
            ticker.action = lambda: storage._touch_chain(used, time.time())
            await storage.gc()
        assert ticker.acted
        assert list(storage._index)[-2:] == used[::-1]
        assert len(storage._index) == count + len(found)
        _assert_sound(storage)


async def test_pages_used_during_a_merge_stay_the_most_recent_whatever_the_clocks(
    tmp_path: Path,
) -> None:
    # Another host's clock runs ahead (a shared root on a network file system): its pages
    # are dated after the use made during the merge, which must still end most recent.
    root = tmp_path / "s"
    async with FileStorage(root, shared=True) as storage:
        own = _keys(2)
        await _put(storage, own)
        count = len(storage._index)
        ahead = time.time() + 30
        found = _write_pages(root, [ahead + i for i in range(6 * STEP)])
        async with _ticking() as ticker:
            ticker.when = lambda: count + 2 * STEP <= len(storage._index) and not storage._jobs
            ticker.action = lambda: storage._touch_chain([own[0]], time.time())
            await storage.gc()
        assert ticker.acted
        assert list(storage._index)[-1] == own[0]
        assert len(storage._index) == count + len(found)
        _assert_sound(storage)


async def test_a_step_whose_placed_pages_were_all_used_keeps_older_pages_first(
    tmp_path: Path,
) -> None:
    # Every page the first step placed is used before the second: the pages this instance
    # last used long before the merge must stay first in line, not move after the rest.
    root = tmp_path / "s"
    async with FileStorage(root, shared=True) as storage:
        own = _keys(4)
        await _put(storage, own)
        now = time.time()
        for i, key in enumerate(own):
            storage._index[key].last_access = now - 5000 + i
        storage._index = type(storage._index)(
            sorted(storage._index.items(), key=lambda item: item[1].last_access)
        )
        count = len(storage._index)
        found = _write_pages(root, [now - 1000 + i for i in range(6 * STEP)])
        async with _ticking() as ticker:
            ticker.when = lambda: count + STEP <= len(storage._index) and not storage._jobs
            ticker.action = lambda: storage._touch_chain(found[:STEP][::-1], time.time())
            await storage.gc()
        assert ticker.acted
        order = list(storage._index)
        assert order[: len(own)] == own
        assert order[len(own) : -STEP] == found[STEP:]
        assert order[-STEP:] == found[:STEP]
        _assert_sound(storage)


async def test_a_merge_cancelled_between_steps_leaves_a_sound_index(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root, shared=True, capacity_bytes=1 << 40) as storage:
        own = _keys(2)
        await _put(storage, own)
        count = len(storage._index)
        now = time.time()
        found = _write_pages(root, [now - 1000 + i for i in range(6 * STEP)])
        gc = asyncio.get_running_loop().create_task(storage.gc())
        async with _ticking() as ticker:
            ticker.when = lambda: count + STEP <= len(storage._index) and not storage._jobs
            ticker.action = gc.cancel
            with pytest.raises(asyncio.CancelledError):
                await gc
        assert ticker.acted
        assert count < len(storage._index) < count + len(found)  # merged in part
        _assert_sound(storage)
        assert all(_page_path(root, key).exists() for key in storage._index)
        assert (await storage.gc()).evicted_pages == 0  # the next rescan merges the rest
        assert list(storage._index) == [*found, *own[::-1]]
        _assert_sound(storage)


# The comparison of a rescan with the index (on a job thread).


def test_a_rescan_is_compared_with_the_index_without_a_call_over_every_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It runs on a job thread while the loop serves: one set, difference or sort over a
    # million pages holds the GIL for half a second, stalling the loop as long.
    monkeypatch.setattr(_file, "_BUILD_SLICE", STEP)
    sizes: list[int] = []

    def recording_set(items: Any = ()) -> set[Any]:
        items = list(items)
        sizes.append(len(items))
        return set(items)

    def recording_sorted(items: Any, **kwargs: Any) -> list[Any]:
        items = list(items)
        sizes.append(len(items))
        return sorted(items, **kwargs)

    monkeypatch.setattr(_file, "set", recording_set, raising=False)
    monkeypatch.setattr(_file, "sorted", recording_sorted, raising=False)
    rng = random.Random(7)
    found = [(key, HEADER_NBYTES, float(rng.randrange(10))) for key in _keys(100)]
    gone = _keys(30)
    indexed = [key for key, _, _ in found[::3]] + gone
    rng.shuffle(indexed)
    unlisted_key = next(key for key in gone if key.hex()[:2] != gone[0].hex()[:2])
    unlisted = frozenset({unlisted_key.hex()[:2]})
    listing = list(found)
    diff = _file._diff_scan(listing, indexed, unlisted)
    assert max(sizes, default=0) <= STEP
    indexed_set = {*indexed}
    assert diff[0] == [key for key in indexed if key in gone and key.hex()[:2] not in unlisted]
    # New pages oldest first, ties in listing order.
    assert diff[1] == sorted(
        [page for page in found if page[0] not in indexed_set], key=lambda page: page[2]
    )
    assert not listing  # freed a slice at a time


# Evictions.


async def _reopened_smaller(root: Path, pages: int) -> list[bytes]:
    keys = _keys(pages)
    async with FileStorage(root) as storage:
        for key in keys:  # one at a time: each its own last access
            assert await _put(storage, [key]) == [Outcome.OK]
    return keys


async def test_gc_evicts_in_rounds(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = await _reopened_smaller(root, 5 * STEP)
    async with FileStorage(root, capacity_bytes=2 * SIZE) as storage:
        sizes: list[int] = []
        _recording(storage, "_unlink_job", sizes, "keys")
        report = await storage.gc()
        assert (report.evicted_pages, report.freed_bytes) == (5 * STEP - 2, (5 * STEP - 2) * SIZE)
        assert max(sizes) <= STEP
        assert list(storage._index) == keys[-2:]  # the least recently used went
        await _assert_matches_disk(storage, root)


async def test_a_put_past_a_shrunk_capacity_evicts_in_rounds(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = await _reopened_smaller(root, 5 * STEP)
    async with FileStorage(root, capacity_bytes=3 * SIZE) as storage:
        sizes: list[int] = []
        _recording(storage, "_unlink_job", sizes, "keys")
        _recording(storage, "_write_job", sizes, "victims")
        new = _keys(2)
        assert await _put(storage, new) == [Outcome.OK, Outcome.OK]
        assert max(sizes) <= STEP
        assert storage.stats().bytes == 3 * SIZE  # never past the capacity
        assert list(storage._index) == [keys[-1], *new[::-1]]
        await _assert_matches_disk(storage, root)


async def test_a_put_in_rounds_makes_room_only_for_the_pages_that_fit(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = await _reopened_smaller(root, 5 * STEP)
    async with FileStorage(root, capacity_bytes=3 * SIZE) as storage:
        # Two pages of the batch are stored already and stay: room is left for one more.
        stored, new = [keys[0], keys[1]], _keys(2)
        outcomes = await _put(storage, [*stored, *new])
        assert outcomes == [Outcome.OK, Outcome.OK, Outcome.OK, Outcome.MISS]
        assert storage.stats().evictions == 5 * STEP - 2
        assert set(storage._index) == {*stored, new[0]}
        await _assert_matches_disk(storage, root)


@pytest.mark.parametrize("call", ["gc", "put"])
async def test_evictions_cancelled_between_rounds_leave_a_sound_index(
    tmp_path: Path, call: str
) -> None:
    root = tmp_path / "s"
    await _reopened_smaller(root, 6 * STEP)
    async with FileStorage(root, capacity_bytes=2 * SIZE) as storage:
        new = _keys(1)

        async def work() -> None:
            if call == "gc":
                await storage.gc()
            else:
                await _put(storage, new)

        task = asyncio.get_running_loop().create_task(work())
        async with _ticking() as ticker:
            # In a later round (a job each): the first has been committed.
            ticker.when = lambda: storage.stats().evictions >= STEP
            ticker.action = task.cancel
            with pytest.raises(asyncio.CancelledError):
                await task
        assert ticker.acted
        assert STEP <= storage.stats().evictions < 6 * STEP - 1
        await _assert_matches_disk(storage, root)
        # Nothing is left half done: the store goes on as if the call had stopped sooner.
        assert await _put(storage, new) == [Outcome.OK]
        assert storage.stats().bytes <= 2 * SIZE
        await _assert_matches_disk(storage, root)


# Listings.


async def test_list_pages_lists_in_steps(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = await _reopened_smaller(root, 3 * STEP + 3)
    async with FileStorage(root) as storage:
        sizes: list[int] = []
        _recording(storage, "_headers_job", sizes, "keys")
        pages = await storage.list_pages()
        assert [page.key for page in pages] == keys[::-1]
        assert max(sizes) <= STEP
        assert [page.key for page in await storage.list_pages(limit=STEP + 1)] == keys[::-1][
            : STEP + 1
        ]


async def test_list_pages_leaves_out_pages_removed_while_it_lists(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = await _reopened_smaller(root, 3 * STEP)
    async with FileStorage(root) as storage:
        listing = asyncio.get_running_loop().create_task(storage.list_pages())
        async with _ticking() as ticker:
            ticker.when = lambda: bool(storage._jobs)  # the first slice is being read
            deleting: list[asyncio.Task[int]] = []
            ticker.action = lambda: deleting.append(
                asyncio.get_running_loop().create_task(storage.delete([keys[0]]))
            )
            pages = await listing
        assert ticker.acted
        assert await deleting[0] == 1
        # The least recently used page, in the last slice, was deleted before it was listed.
        assert [page.key for page in pages] == keys[::-1][:-1]


async def test_lookups_answered_from_the_index_let_another_task_run(tmp_path: Path) -> None:
    # A lookup the index answers never suspended: a task looking up in a loop held the
    # loop, and a task beside it got no turn until the loop ended.
    keys = _keys(4)
    async with FileStorage(tmp_path / "root") as storage, _ticking() as ticker:
        assert await _put(storage, keys) == [Outcome.OK] * 4
        for prefix in (keys, keys[:1], []):
            before = ticker.ticks
            assert await storage.exists(prefix) == len(prefix)
            assert ticker.ticks > before


async def test_calls_with_nothing_to_do_on_disk_let_another_task_run(tmp_path: Path) -> None:
    # A get of keys not stored, a put of keys stored, a delete of keys not stored: each
    # answered from the index without suspending.
    keys, absent = _keys(2), _keys(2)
    async with FileStorage(tmp_path / "root") as storage, _ticking() as ticker:
        assert await _put(storage, keys) == [Outcome.OK] * 2
        calls = [
            lambda: _get(storage, absent),
            lambda: _put(storage, keys),
            lambda: storage.delete(absent),
        ]
        for call in calls:
            before = ticker.ticks
            await call()
            assert ticker.ticks > before
        assert await storage.exists(keys) == 2


@pytest.mark.parametrize("shared", [False, True])
async def test_a_long_lookup_runs_in_steps_and_touches_as_one_step_would(
    tmp_path: Path, shared: bool
) -> None:
    # A lookup of a hundred thousand pages (a long prompt at page size 1) held the loop for
    # about 0.1 s: it walks and touches the index a step at a time now, with the same answer,
    # the same recency order (the first key the most recent) and the same stamps.
    keys = _keys(5 * STEP)
    async with FileStorage(tmp_path / "s", shared=shared) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * len(keys)
        for key in keys:
            storage._index[key].mtime = 0.0  # each file due a stamp of its mtime
        queued: list[dict[bytes, int]] = []
        stamp_later = storage._stamp_later
        storage._stamp_later = lambda stamps, base=None: (  # type: ignore[method-assign]
            queued.append(dict(stamps)),
            stamp_later(stamps, base),
        )[-1]
        async with _ticking() as ticker:
            before = ticker.ticks
            assert await storage.exists([*keys, *_keys(1)]) == len(keys)
            turns = ticker.ticks - before
        if not shared:  # a shared root's look on disk for the missing key yields besides
            assert turns >= 5
        assert list(storage._index)[-len(keys) :] == keys[::-1]
        if shared:  # stamped by the lookup's own job: the first key's the newest
            stamped = [_page_path(tmp_path / "s", key).stat().st_mtime_ns for key in keys]
            assert stamped == sorted(stamped, reverse=True)
            assert len(set(stamped)) == len(keys)
            assert queued == []
        else:
            assert queued == [{key: position for position, key in enumerate(keys)}]


@pytest.mark.parametrize("shared", [False, True])
async def test_a_long_lookup_cancelled_between_touch_steps_touches_and_stamps_as_one_step_would(
    tmp_path: Path, shared: bool
) -> None:
    # Cancelled once its last keys were made the most recent, a lookup still makes the keys
    # before them more recent still, and queues all their stamps: left as they were, the
    # chain's first pages would be evicted before its deepest ones, and the chain with them.
    keys = _keys(5 * STEP)
    others = _keys(2)
    async with FileStorage(tmp_path / "s", shared=shared) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * len(keys)
        assert await _put(storage, others) == [Outcome.OK] * len(others)
        for key in keys:
            storage._index[key].mtime = 0.0  # each file due a stamp of its mtime
        queued: list[dict[bytes, int]] = []
        stamp_later = storage._stamp_later
        storage._stamp_later = lambda stamps, base=None: (  # type: ignore[method-assign]
            queued.append(dict(stamps)),
            stamp_later(stamps, base),
        )[-1]
        lookup = asyncio.get_running_loop().create_task(storage.exists(keys))
        for _ in range(100):  # loop turns, until its first touch step (the last STEP keys)
            if next(reversed(storage._index)) == keys[-STEP]:
                break
            await asyncio.sleep(0)
        assert not lookup.done()
        lookup.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lookup
        assert list(storage._index)[-len(keys) :] == keys[::-1]
        assert queued == [{key: position for position, key in enumerate(keys)}]
        _assert_sound(storage)


async def test_a_put_between_the_steps_of_a_long_lookup_evicts_none_of_the_pages_it_counted(
    tmp_path: Path,
) -> None:
    # A full root, whose least recently used pages are the chain a lookup is counting: a put
    # that begins between the lookup's touch steps evicts other pages, as after a lookup in
    # one step, not the chain's first pages it counted (which would leave its tail useless).
    chain = _keys(5 * STEP)
    others = _keys(STEP)
    async with FileStorage(tmp_path / "s", capacity_bytes=6 * STEP * SIZE) as storage:
        for keys in (chain, others):
            assert await _put(storage, keys) == [Outcome.OK] * len(keys)
        lookup = asyncio.get_running_loop().create_task(storage.exists(chain))
        for _ in range(100):  # loop turns, until its first touch step (the last STEP keys)
            if next(reversed(storage._index)) == chain[-STEP]:
                break
            await asyncio.sleep(0)
        assert not lookup.done()
        assert await _put(storage, _keys(STEP)) == [Outcome.OK] * STEP
        assert await lookup == len(chain)
        assert [key in storage._index for key in chain] == [True] * len(chain)
        assert not any(key in storage._index for key in others)
        _assert_sound(storage)
