"""Shard directories a `gc()` finds empty: removed on a private root, whatever write races
the removal; kept on a shared root, whose other instances hold descriptors of them."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import pytest
import structlog
from test_file_storage import (
    _assert_index_matches_disk,
    _Gate,
    _get,
    _held_after,
    _put,
    _released,
)

from hicache_async.storage import FileStorage, Outcome


def _in_shard(shard: str, count: int, first: int = 0) -> list[bytes]:
    return [bytes.fromhex(shard + f"{first + i:02x}" * 31) for i in range(count)]


async def test_gc_removes_an_emptied_shard_and_a_put_makes_it_again(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = _in_shard("ab", 3)
    kept = _in_shard("cd", 1)
    async with FileStorage(root) as storage:
        assert await _put(storage, keys + kept) == [Outcome.OK] * 4
        assert await storage.delete(keys) == 3
        with structlog.testing.capture_logs() as logs:
            await storage.gc()
        assert not (root / "pages" / "ab").exists()
        assert (root / "pages" / "cd").is_dir()  # it holds a page
        removed = [e for e in logs if e["event"] == "storage.shards.removed"]
        assert [e["directories"] for e in removed] == [1]
        again = _in_shard("ab", 2, first=10)
        with structlog.testing.capture_logs() as logs:
            assert await _put(storage, again) == [Outcome.OK] * 2
        # Made again as any new shard is: no sign of a directory removed by someone else.
        assert [e["event"] for e in logs if e["log_level"] != "debug"] == []
        assert await _get(storage, again + kept) == [Outcome.OK] * 3
        await _assert_index_matches_disk(storage, root)
    async with FileStorage(root) as reopened:
        assert await _get(reopened, again + kept) == [Outcome.OK] * 3


async def test_gc_removes_the_shards_its_own_eviction_emptied(tmp_path: Path) -> None:
    # The shard directories of the pages a gc() evicted were left for the next gc().
    root = tmp_path / "s"
    old = _in_shard("ab", 3)
    new = _in_shard("cd", 1)
    async with FileStorage(root) as storage:
        assert await _put(storage, old) == [Outcome.OK] * 3
        assert await _put(storage, new) == [Outcome.OK]
        size = storage.stats().bytes // 4
    async with FileStorage(root, capacity_bytes=size) as storage:
        with structlog.testing.capture_logs() as logs:
            report = await storage.gc()
        assert report.evicted_pages == 3
        assert sorted(p.name for p in (root / "pages").iterdir()) == ["cd"]
        removed = [e for e in logs if e["event"] == "storage.shards.removed"]
        assert [e["directories"] for e in removed] == [1]
        assert await _get(storage, new) == [Outcome.OK]
        again = _in_shard("ab", 1, first=10)
        assert await _put(storage, again) == [Outcome.OK]
        assert await _get(storage, again) == [Outcome.OK]
        await _assert_index_matches_disk(storage, root)


async def test_a_put_into_a_shard_removed_before_its_rename_keeps_its_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put took the shard's descriptor and wrote its file; the removal comes before its
    rename: it makes the directory again and the page lands there."""
    root = tmp_path / "s"
    gone, late = _in_shard("ab", 1), _in_shard("ab", 1, first=5)
    async with FileStorage(root) as storage:
        assert await _put(storage, gone) == [Outcome.OK]
        assert await storage.delete(gone) == 1
        gate = _Gate()
        monkeypatch.setattr(storage, "_write_fd", _held_after(storage._write_fd, gate))
        with _released(gate), structlog.testing.capture_logs() as logs:
            put = asyncio.create_task(_put(storage, late))
            await gate.wait_reached()  # the file is written, not yet renamed into ab/
            await storage.gc()
            assert not (root / "pages" / "ab").exists()
            gate.go.set()
            assert await put == [Outcome.OK]
        assert "storage.shard.recreated" not in [e["event"] for e in logs]
        monkeypatch.undo()
        assert await _get(storage, late) == [Outcome.OK]
        assert list((root / "tmp").iterdir()) == []
        await _assert_index_matches_disk(storage, root)


async def test_a_put_whose_removed_shard_cannot_be_made_again_for_want_of_room_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As any write the file system has no room for (no inode left for the directory): a
    MISS counted in `refused_writes`, not an ERROR of the ENOENT the rename met."""
    root = tmp_path / "s"
    gone, late = _in_shard("ab", 1), _in_shard("ab", 1, first=5)
    real_mkdir = os.mkdir

    def full_mkdir(path: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        if path == "ab" and dir_fd is not None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_mkdir(path, mode, dir_fd=dir_fd)

    async with FileStorage(root) as storage:
        assert await _put(storage, gone) == [Outcome.OK]
        assert await storage.delete(gone) == 1
        gate = _Gate()
        monkeypatch.setattr(storage, "_write_fd", _held_after(storage._write_fd, gate))
        with _released(gate):
            put = asyncio.create_task(_put(storage, late))
            await gate.wait_reached()  # the file is written, not yet renamed into ab/
            await storage.gc()
            assert not (root / "pages" / "ab").exists()
            monkeypatch.setattr(os, "mkdir", full_mkdir)
            gate.go.set()
            assert await put == [Outcome.MISS]
        monkeypatch.undo()
        stats = storage.stats()
        assert (storage.refused_writes, stats.errors) == (1, 0)
        assert list((root / "tmp").iterdir()) == []
        assert await _put(storage, late) == [Outcome.OK]  # room again: made as any new shard
        assert await _get(storage, late) == [Outcome.OK]
        await _assert_index_matches_disk(storage, root)


async def test_a_shared_root_keeps_its_empty_shards(tmp_path: Path) -> None:
    """Another instance reads through its descriptor of the shard: had a gc removed it, the
    page written into the one made again would be a miss there for good."""
    root = tmp_path / "s"
    first, later = _in_shard("ab", 1), _in_shard("ab", 1, first=7)
    async with FileStorage(root, shared=True) as one, FileStorage(root, shared=True) as other:
        assert await _put(one, first) == [Outcome.OK]
        assert await _get(other, first) == [Outcome.OK]  # `other` opened ab/
        assert await one.delete(first) == 1
        await one.gc()
        await other.gc()
        assert await _put(one, later) == [Outcome.OK]
        assert await _get(other, later) == [Outcome.OK]
        assert await _get(one, later) == [Outcome.OK]
        assert (root / "pages" / "ab").is_dir()


async def test_a_raw_write_into_a_shard_removed_before_its_rename_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    gone, late = _in_shard("ab", 1), _in_shard("ab", 1, first=5)
    async with FileStorage(root) as storage:
        assert await _put(storage, gone) == [Outcome.OK]
        raw = await storage.read_raw(gone[0])
        assert raw is not None
        assert await storage.delete(gone) == 1
        gate = _Gate()
        monkeypatch.setattr(storage, "_create_tmp", _held_after(storage._create_tmp, gate))
        with _released(gate):
            write = asyncio.create_task(storage.write_raw(late[0], raw))
            await gate.wait_reached()  # the shard's descriptor taken, the file not yet moved
            await storage.gc()
            assert not (root / "pages" / "ab").exists()
            gate.go.set()
            await write
        monkeypatch.undo()
        assert await storage.read_raw(late[0]) == raw
        await _assert_index_matches_disk(storage, root)


async def test_a_removed_shards_descriptor_closes_while_later_jobs_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy store's jobs overlap without end: the descriptor of a shard a gc() removed is
    closed once the jobs begun before the removal are done, not when none runs."""
    root = tmp_path / "s"
    held, gone = _in_shard("cd", 1), _in_shard("ab", 1)
    async with FileStorage(root) as storage:
        assert await _put(storage, held) == [Outcome.OK]
        gates: list[_Gate] = []
        read_raw_job = storage._read_raw_job

        def held_read(stop: threading.Event, key: bytes) -> bytes | None:
            gate = gates.pop(0)
            result = read_raw_job(stop, key)
            gate.hold()
            return result

        monkeypatch.setattr(storage, "_read_raw_job", held_read)

        async def read_held(gate: _Gate) -> asyncio.Task[bytes | None]:
            gates.append(gate)
            task = asyncio.create_task(storage.read_raw(held[0]))
            await gate.wait_reached()
            return task

        first, second = _Gate(), _Gate()
        with _released(first, second):
            reading = await read_held(first)
            before = len(os.listdir("/proc/self/fd"))
            for _ in range(3):
                assert await _put(storage, gone) == [Outcome.OK]
                assert await storage.delete(gone) == 1
                await storage.gc()
                assert not (root / "pages" / "ab").exists()
            # Begun before the removals, the first read could hold their descriptors.
            assert len(os.listdir("/proc/self/fd")) == before + 3
            later = await read_held(second)
            first.go.set()
            assert await reading is not None
            assert len(os.listdir("/proc/self/fd")) == before
            second.go.set()
            assert await later is not None
        monkeypatch.undo()
        assert await _get(storage, held) == [Outcome.OK]
