"""FileStorage when the file system says no: a full disk (bytes or inodes), a read-only file
system, a file size limit, a process out of descriptors.

Every such fault is a miss, never a failed request: pages that find no room make it by evicting
least recently used pages (after the spare files go), pages that cannot be written at all are
MISSes, not ERRORs a backup worker would retry, and each batch logs one line per distinct error.

The small file systems are tmpfs mounts, made only when running as root where mounting is
permitted; those tests skip otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import random
import resource
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from test_file_storage import (
    PAGE,
    SIZE,
    _assert_index_matches_disk,
    _get,
    _keys,
    _metas,
    _put,
)
from test_storage_cli import nfs_flock

from hicache_async import CacheConfig, HiCache, StorageConfigError, StorageError
from hicache_async._ratelog import LogLimiter
from hicache_async.storage import FileStorage, Outcome, _file
from hicache_async.storage._page import HEADER_NBYTES
from hicache_async.testing import KVGenerator, serve

Mount = Callable[..., Path]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """`tmpfs(name, size=..., nr_inodes=..., mode=..., ro=...)`: a tmpfs mounted at
    `tmp_path / name`, unmounted after the test. Skips when mounting is not permitted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted: list[Path] = []

    def mount(name: str, **options: object) -> Path:
        path = tmp_path / name
        path.mkdir(mode=0o700, exist_ok=True)
        flags = ",".join(
            key if value is True else f"{key}={value}" for key, value in options.items()
        )
        _mount(["-t", "tmpfs", "-o", flags or "defaults", "tmpfs"], path, mounted)
        return path

    yield mount
    _unmount(mounted)


def _mount(how: list[str], path: Path, mounted: list[Path]) -> None:
    """Mount at `path` (`mount *how path`), noted in `mounted`; skips the test if refused."""
    done = subprocess.run(["mount", *how, str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {how[-1]} here: {done.stderr.decode().strip()}")
    mounted.append(path)


def _unmount(mounted: list[Path]) -> None:
    """Unmount `mounted`, last first; a loop device that mount set up goes with it."""
    for path in reversed(mounted):
        done = subprocess.run(["umount", str(path)], capture_output=True, check=False)
        if done.returncode != 0:  # still busy: detach it, it goes when the last user does
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[Callable[[str, int, int], Path]]:
    """`ext4(name, size, block)`: an ext4 file system of `size` bytes and `block`-byte blocks
    in an image file, loop-mounted at `tmp_path / name`, unmounted after the test. Skips
    when mkfs.ext4 or a loop mount is not available or not permitted."""
    if os.geteuid() != 0:
        pytest.skip("mounting an ext4 image needs root")
    if shutil.which("mkfs.ext4") is None or shutil.which("losetup") is None:
        pytest.skip("mkfs.ext4 and losetup are needed for an ext4 image")
    mounted: list[Path] = []

    def mount(name: str, size: int, block: int) -> Path:
        image, path = tmp_path / f"{name}.img", tmp_path / name
        with open(image, "wb") as file:
            file.truncate(size)
        made = subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-b", str(block), "-m", "0", "-N", "2048", str(image)],
            capture_output=True,
            check=False,
        )
        if made.returncode != 0:
            pytest.skip(f"cannot make an ext4 image: {made.stderr.decode().strip()}")
        path.mkdir(mode=0o700)
        _mount(["-o", "loop", str(image)], path, mounted)
        return path

    yield mount
    _unmount(mounted)


def _remount(path: Path, how: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{how}", str(path)], check=True)


def _fill(path: Path) -> Path:
    """Fill the file system of `path` with one file (`path / "filler"`), to ENOSPC."""
    filler = path / "filler"
    chunk = bytes(64 << 10)
    with open(filler, "wb", buffering=0) as file, contextlib.suppress(OSError):
        while True:
            file.write(chunk)
    return filler


def _spares(root: Path) -> list[str]:
    return [name for name in os.listdir(root / "tmp") if name.endswith(".spare")]


@contextlib.contextmanager
def _limit(which: int, soft: int) -> Iterator[None]:
    """Lower a resource's soft limit to `soft` for the block."""
    old = resource.getrlimit(which)
    resource.setrlimit(which, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(which, old)


@contextlib.contextmanager
def _descriptors_left(count: int) -> Iterator[None]:
    """Let the process open exactly `count` more descriptors in the block: holes below the
    highest one are filled first (with /dev/null), so the next ones are numbered in a row."""
    top = max(int(name) for name in os.listdir("/proc/self/fd"))
    held: list[int] = []
    try:
        while (fd := os.open(os.devnull, os.O_RDONLY)) < top:
            held.append(fd)
        os.close(fd)
        with _limit(resource.RLIMIT_NOFILE, top + 1 + count):
            yield
    finally:
        for fd in held:
            os.close(fd)


def _page_errors(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "storage.page.error"]


# A full disk.


@pytest.mark.parametrize("capacity", [None, 64 << 20], ids=["no-capacity", "capacity-past-disk"])
async def test_a_full_disk_evicts_and_keeps_writing(tmpfs: Mount, capacity: int | None) -> None:
    root = tmpfs("disk", size="2m") / "s"
    async with FileStorage(root, capacity_bytes=capacity) as storage:
        batches = [_keys(8) for _ in range(12)]  # 3 MiB of pages on a 2 MiB disk
        for keys in batches:
            with structlog.testing.capture_logs() as logs:
                assert await _put(storage, keys) == [Outcome.OK] * 8
            assert not _page_errors(logs)
        stats = storage.stats()
        assert (stats.errors, storage.refused_writes) == (0, 0)
        assert stats.evictions > 0  # least recently used first: the last batch is all there
        assert await _get(storage, batches[-1]) == [Outcome.OK] * 8
        await _assert_index_matches_disk(storage, root)


async def test_inode_exhaustion_evicts_like_a_full_disk(tmpfs: Mount) -> None:
    root = tmpfs("disk", size="16m", nr_inodes=32) / "s"
    async with FileStorage(root) as storage:
        # One shard directory for all of them: each page costs an inode, nothing else.
        batches = [[b"\x01" + key[1:] for key in _keys(8)] for _ in range(8)]
        for keys in batches:
            assert await _put(storage, keys) == [Outcome.OK] * 8
        assert (storage.stats().errors, storage.refused_writes) == (0, 0)
        assert storage.stats().evictions > 0
        assert await _get(storage, batches[-1]) == [Outcome.OK] * 8


async def test_out_of_inodes_a_new_shard_directory_costs_one_more_page(tmpfs: Mount) -> None:
    root = tmpfs("disk", size="16m", nr_inodes=32) / "s"
    async with FileStorage(root, spare_bytes=0) as storage:
        while not storage.stats().evictions:  # until every inode is taken
            assert await _put(storage, [b"\x01" + _keys(1)[0][1:]]) == [Outcome.OK]
        before = storage.stats().evictions
        # Its shard directory does not exist: the page needs an inode for it and one for
        # its file, so two pages are evicted for it.
        key = b"\x02" + _keys(1)[0][1:]
        assert await _put(storage, [key]) == [Outcome.OK]
        assert storage.stats().evictions == before + 2
        assert await _get(storage, [key]) == [Outcome.OK]


def _sized(keys: list[bytes], nbytes: int) -> list[list[memoryview]]:
    return [[memoryview(bytearray(key[:1] * nbytes))] for key in keys]


def _in_shard(shard: int, count: int) -> list[bytes]:
    return [bytes([shard]) + key[1:] for key in _keys(count)]


async def test_out_of_bytes_the_second_try_evicts_only_the_bytes_short(tmpfs: Mount) -> None:
    disk = tmpfs("disk", size="2m")
    async with FileStorage(disk / "s", spare_bytes=0) as storage:
        big = _in_shard(1, 6)
        assert await storage.put(big, _sized(big, 256 << 10), _metas(big)) == [Outcome.OK] * 6
        _fill(disk)
        # Eight small pages into the same shard: bytes are short, not inodes, and one of the
        # big pages frees room for all eight.
        small = _in_shard(1, 8)
        assert await storage.put(small, _sized(small, 1024), _metas(small)) == [Outcome.OK] * 8
        assert storage.stats().evictions == 1
        assert await storage.exists(big) == 5


async def test_out_of_inodes_pages_into_one_new_shard_cost_one_directory(tmpfs: Mount) -> None:
    root = tmpfs("disk", size="64m", nr_inodes=64) / "s"
    async with FileStorage(root, spare_bytes=0) as storage:
        while not storage.stats().evictions:  # until every inode is taken
            assert await _put(storage, _in_shard(1, 1)) == [Outcome.OK]
        before = storage.stats().evictions
        # Eight files and the one shard directory they share: nine inodes, nine pages.
        keys = _in_shard(2, 8)
        assert await _put(storage, keys) == [Outcome.OK] * 8
        assert storage.stats().evictions == before + 9
        assert await _get(storage, keys) == [Outcome.OK] * 8


async def test_a_page_no_eviction_makes_room_for_evicts_nothing(tmpfs: Mount) -> None:
    disk = tmpfs("disk", size="2m")
    async with FileStorage(disk / "s", spare_bytes=0) as storage:
        keys = _keys(8)
        assert await _put(storage, keys) == [Outcome.OK] * 8
        _fill(disk)  # someone else's file: evicting all eight makes room for one page of 288 KiB
        huge = _keys(1)
        with structlog.testing.capture_logs() as logs:
            outcomes = await storage.put(huge, _sized(huge, 512 << 10), _metas(huge))
        assert outcomes == [Outcome.MISS]
        assert (storage.stats().evictions, storage.refused_writes) == (0, 1)
        [event] = _page_errors(logs)
        assert os.strerror(errno.ENOSPC) in event["error"]
        assert await _get(storage, keys) == [Outcome.OK] * 8
        # Planned page by page in batch order: the first page evicts what it needs (its
        # blocks and the slack, two pages' worth), the huge one nothing, and the page after it,
        # down the same chain, is a MISS too.
        batch = _keys(3)
        pages = [*_sized(batch[:1], PAGE), *_sized(batch[1:2], 512 << 10), *_sized(batch[2:], PAGE)]
        # As a minute later: the first put logged this error, which comes again only then.
        storage._page_errors_log = LogLimiter()
        with structlog.testing.capture_logs() as logs:
            outcomes = await storage.put(batch, pages, _metas(batch))
        assert outcomes == [Outcome.OK, Outcome.MISS, Outcome.MISS]
        assert (storage.stats().evictions, storage.refused_writes) == (2, 3)
        [event] = _page_errors(logs)  # one line for the batch
        assert (event["count"], event["key"]) == (2, batch[1].hex())
        assert await storage.exists(keys) == 6


async def test_a_full_disk_the_second_try_handles_is_logged_once(
    tmpfs: Mount, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once an interval, however many puts find room meanwhile.
    monkeypatch.setattr(_file, "_DISK_FULL_LOG_S", math.inf, raising=False)
    disk = tmpfs("disk", size="2m")
    async with FileStorage(disk / "s", spare_bytes=0, capacity_bytes=64 << 20) as storage:
        assert await _put(storage, _keys(16)) == [Outcome.OK] * 16
        filler = _fill(disk)
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                assert await _put(storage, _keys(4)) == [Outcome.OK] * 4
        [event] = [entry for entry in logs if entry["event"] == "storage.disk.full"]
        assert event["log_level"] == "warning"
        # Each page is planned its whole blocks and the slack, the batch the room for a
        # directory to grow; a victim frees its blocks.
        block = os.statvfs(disk).f_frsize
        need = 4 * _file._disk_need(SIZE, block) + _file._DISK_GROWTH_BLOCKS * block
        victims = -(-need // (-(-SIZE // block) * block))
        assert (event["pages"], event["refused"], event["victims"]) == (4, 0, victims)
        assert (event["bytes"], event["inodes"]) == (need, 0)
        assert storage.stats().evictions < 16  # far below the capacity: hence the warning
        filler.unlink()
        assert await _put(storage, _keys(4)) == [Outcome.OK] * 4  # room: no second try
        _fill(disk)
        with structlog.testing.capture_logs() as logs:
            assert await _put(storage, _keys(4)) == [Outcome.OK] * 4
        assert "storage.disk.full" not in [entry["event"] for entry in logs]


async def test_a_disk_kept_full_logs_once_however_often_puts_find_room(tmpfs: Mount) -> None:
    # A spare reused, or a big victim leaving room for small pages: on a disk that stays full
    # puts find room all the time, and the warning still comes once an interval.
    disk = tmpfs("disk", size="2m")
    async with FileStorage(disk / "s") as storage:
        keys = _keys(40)
        assert await _put(storage, keys) == [Outcome.OK] * 40
        _fill(disk)
        with structlog.testing.capture_logs() as logs:
            for key in keys[:10]:
                assert await storage.delete([key]) == 1  # its file kept as a spare
                for _ in range(2):  # the first reuses the spare, the second has no room
                    assert await _put(storage, _keys(1)) == [Outcome.OK]
        assert [entry["event"] for entry in logs].count("storage.disk.full") == 1


async def test_a_second_try_that_needed_nothing_is_not_logged(tmpfs: Mount) -> None:
    disk = tmpfs("disk", size="2m")
    async with FileStorage(disk / "s", spare_bytes=0) as storage:
        assert await _put(storage, _keys(8)) == [Outcome.OK] * 8
        filler = _fill(disk)
        write_one = storage._write_one

        def room_made_meanwhile(*args: Any, **kwargs: Any) -> Any:
            # Someone else frees room right after the first try found none.
            result = write_one(*args, **kwargs)
            if result[0] == _file._NO_ROOM and filler.exists():
                filler.unlink()
            return result

        storage._write_one = room_made_meanwhile  # type: ignore[method-assign]
        with structlog.testing.capture_logs() as logs:
            assert await _put(storage, _keys(1)) == [Outcome.OK]
        assert not filler.exists()  # the first try did find no room
        assert storage.stats().evictions == 0
        assert "storage.disk.full" not in [entry["event"] for entry in logs]


@pytest.mark.parametrize("block", [1024, 4096])
async def test_a_full_ext4_second_try_allows_for_metadata(
    ext4: Callable[[str, int, int], Path], block: int
) -> None:
    # A file takes more than its blocks (extent blocks once fragmented, a directory growing
    # a block): a second try planned only to the block still finds no room, a MISS.
    disk = ext4("disk", 8 << 20 if block == 1024 else 16 << 20, block)
    draw = random.Random(7)
    async with FileStorage(disk / "s", spare_bytes=0) as storage:
        for _ in range(400):
            keys = _keys(draw.randint(1, 3))
            size = draw.choice([500, 3000, 32768, 70000])
            outcomes = await storage.put(keys, _sized(keys, size), _metas(keys))
            assert outcomes == [Outcome.OK] * len(keys)
        assert storage.stats().evictions > 0  # the disk was full, often
        assert storage.refused_writes == 0
        await _assert_index_matches_disk(storage, disk / "s")


async def test_concurrent_puts_count_the_room_each_other_claimed(
    tmpfs: Mount, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two one-page puts on a full disk, their threads only held back, nothing faked: A's
    # second try has removed its victim and not yet written into the room it made when B,
    # whose first try found no room, takes statvfs. That room is A's: B must plan a victim
    # of its own, or its second try finds no room either.
    disk = tmpfs("disk", size="2m")
    wait_s = 10.0  # wall time: each wait ends as soon as the other thread gets there
    b_failed, victim_gone, b_looked = threading.Event(), threading.Event(), threading.Event()
    a_looked = threading.Event()
    async with FileStorage(disk / "s", spare_bytes=0) as storage:
        assert await _put(storage, _keys(40)) == [Outcome.OK] * 40
        _fill(disk)
        key_a, key_b = _keys(1), _keys(1)
        tries: dict[bytes, int] = {}
        write_one = storage._write_one
        release_spares = storage._release_spares
        disk_room = _file._disk_room

        def held_write(handles: Any, key: bytes, *args: Any, **kwargs: Any) -> Any:
            tries[key] = tries.get(key, 0) + 1
            if key == key_a[0] and tries[key] == 2:  # A's second try, its victim gone
                victim_gone.set()
                b_looked.wait(wait_s)
            result = write_one(handles, key, *args, **kwargs)
            if key == key_b[0] and tries[key] == 1 and result[0] == _file._NO_ROOM:
                b_failed.set()
            return result

        def held_release(handles: Any, *, reason: str) -> None:
            if reason == "disk full":  # A removes its victim once B found no room
                b_failed.wait(wait_s)
            release_spares(handles, reason=reason)

        looks: list[int] = []

        def held_room(dir_fd: int, results: Any) -> Any:
            looks.append(dir_fd)
            if len(looks) == 1:  # A's
                try:
                    return disk_room(dir_fd, results)
                finally:
                    a_looked.set()
            victim_gone.wait(wait_s)
            try:
                return disk_room(dir_fd, results)
            finally:
                b_looked.set()

        monkeypatch.setattr(storage, "_write_one", held_write)
        monkeypatch.setattr(storage, "_release_spares", held_release)
        monkeypatch.setattr(_file, "_disk_room", held_room)
        put_a = asyncio.ensure_future(_put(storage, key_a))
        await asyncio.to_thread(a_looked.wait, wait_s)  # A's first try found no room
        put_b = asyncio.ensure_future(_put(storage, key_b))
        assert (await put_a, await put_b) == ([Outcome.OK], [Outcome.OK])
        assert all(event.is_set() for event in (b_failed, victim_gone, b_looked))
        assert storage.refused_writes == 0
        assert storage._claims.pending() == (0, 0)  # every claim settled


async def test_no_room_even_after_evicting_is_one_miss_logged_once(tmpfs: Mount) -> None:
    disk = tmpfs("disk", size="2m")
    root = disk / "s"
    async with FileStorage(root) as storage:
        filler = _fill(disk)  # someone else's file: evicting every page would not make room
        keys = _keys(8)
        with structlog.testing.capture_logs() as logs:
            assert await _put(storage, keys) == [Outcome.MISS] * 8
        assert (storage.stats().errors, storage.refused_writes) == (0, 8)
        # One line for the batch, not one a page.
        [event] = _page_errors(logs)
        assert (event["count"], event["key"]) == (8, keys[0].hex())
        assert os.strerror(errno.ENOSPC) in event["error"]
        assert os.listdir(root / "tmp") == []  # no half-written file holds the room
        filler.unlink()  # room again: writes resume, no restart
        assert await _put(storage, keys) == [Outcome.OK] * 8
        assert await _get(storage, keys) == [Outcome.OK] * 8


async def test_a_full_disk_releases_the_spare_files_first(tmpfs: Mount) -> None:
    disk = tmpfs("disk", size="2m")
    root = disk / "s"
    async with FileStorage(root) as storage:
        keys = _keys(32)
        assert await _put(storage, keys) == [Outcome.OK] * 32
        assert await storage.delete(keys[8:]) == 24  # their files are kept as spares
        assert len(_spares(root)) == 24
        _fill(disk)
        # Pages of another size cannot go over a spare file: the spares must make room.
        small = _keys(8)
        pages = [[memoryview(bytearray(key[:1] * (PAGE // 2)))] for key in small]
        with structlog.testing.capture_logs() as logs:
            assert await storage.put(small, pages, _metas(small)) == [Outcome.OK] * 8
        assert _spares(root) == []
        [released] = [entry for entry in logs if entry["event"] == "storage.spares.released"]
        assert (released["files"], released["reason"]) == (24, "disk full")
        # The spares made room enough: no page was evicted for it.
        assert storage.stats().evictions == 0
        assert await _get(storage, keys[:8]) == [Outcome.OK] * 8


async def test_spare_files_count_the_blocks_they_hold(tmpfs: Mount) -> None:
    disk = tmpfs("disk", size="2m")
    root = disk / "s"
    async with FileStorage(root) as storage:
        small = _keys(48)
        assert await storage.put(small, _sized(small, 1024), _metas(small)) == [Outcome.OK] * 48
        assert await storage.delete(small[:24]) == 24  # spare files of 1152 bytes, a block each
        _fill(disk)
        block = os.statvfs(disk).f_frsize
        held = sum(os.stat(root / "tmp" / name).st_blocks * 512 for name in _spares(root))
        assert held == 24 * block
        # Pages whose planned room is what the spare files hold: releasing them is enough.
        size = 2 * block
        growth = _file._DISK_GROWTH_BLOCKS * block
        count = (held - growth) // _file._disk_need(HEADER_NBYTES + size, block)
        assert count >= 4
        keys = _keys(count)
        assert await storage.put(keys, _sized(keys, size), _metas(keys)) == [Outcome.OK] * count
        assert storage.stats().evictions == 0
        assert await storage.exists(small[24:]) == 24


async def test_gc_releases_the_spare_files(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        keys = _keys(5)
        await _put(storage, keys)
        assert await storage.delete(keys) == 5
        assert len(_spares(root)) == 5
        with structlog.testing.capture_logs() as logs:
            report = await storage.gc()
        assert report.evicted_pages == 0
        assert _spares(root) == []
        [released] = [entry for entry in logs if entry["event"] == "storage.spares.released"]
        assert (released["files"], released["reason"]) == (5, "gc")


class _EmptiedWhileMoving:
    """A spare pool's lock that empties the pool (as a full disk or gc() does) as soon as the
    first section under it ends, `keep`'s count of a page file, before the file moves; then
    runs `then` (nothing by default)."""

    def __init__(self, pool: Any, then: Callable[[], None] = lambda: None) -> None:
        self._lock = threading.Lock()
        self._pool = pool
        self._then = then
        self.released: list[tuple[str, int]] = []

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *_: object) -> None:
        self._lock.release()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            self.released = pool.release()
            self._then()


@pytest.mark.parametrize("move", ["moves", "fails"])
async def test_spares_released_while_a_page_moves_in_stay_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, move: str
) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        keys = _keys(2)
        assert await _put(storage, keys) == [Outcome.OK] * 2
        pool = storage._spares
        assert pool is not None
        # "fails": tmp/ goes before the rename, which then fails and the page is unlinked.
        then = (root / "tmp").rmdir if move == "fails" else (lambda: None)
        lock = _EmptiedWhileMoving(pool, then)
        monkeypatch.setattr(pool, "_lock", lock)
        assert await storage.delete(keys[:1]) == 1
        assert lock.released == []  # the pool was empty: the page's file was moving
        held = _spares(root) if (root / "tmp").exists() else []
        # The count is what the pool holds, and the pool holds every spare file there is.
        assert (pool.nbytes, pool.files, len(held)) == (0, 0, 0)
        fresh = _keys(1)  # its write makes tmp/ again if it went
        assert await _put(storage, fresh) == [Outcome.OK]
        assert await storage.delete(fresh) == 1  # the pool works on as before
        assert (pool.nbytes, pool.files, len(_spares(root))) == (SIZE, 1, 1)


# Writes the file system refuses for good.


async def test_a_file_size_limit_is_a_miss_not_an_error(tmp_path: Path) -> None:
    async with FileStorage(tmp_path / "s") as storage:
        keys = _keys(4)
        with structlog.testing.capture_logs() as logs, _limit(resource.RLIMIT_FSIZE, PAGE // 2):
            outcomes = await _put(storage, keys)
        assert outcomes == [Outcome.MISS] * 4
        assert (storage.stats().errors, storage.refused_writes) == (0, 4)
        [event] = _page_errors(logs)
        assert event["count"] == 4
        assert os.strerror(errno.EFBIG) in event["error"]
        assert await _put(storage, keys) == [Outcome.OK] * 4  # the limit gone, they fit


async def test_a_read_only_file_system_is_a_miss_not_an_error(tmpfs: Mount) -> None:
    root = tmpfs("disk", size="4m") / "s"
    async with FileStorage(root):
        pass  # the store's directories and LOCK
    # Writes go through tmp/: a read-only file system there refuses every one.
    tmpfs("disk/s/tmp", size="1m", mode="0700", ro=True)
    async with FileStorage(root) as storage:
        keys = _keys(4)
        with structlog.testing.capture_logs() as logs:
            assert await _put(storage, keys) == [Outcome.MISS] * 4
        assert (storage.stats().errors, storage.refused_writes) == (0, 4)
        [event] = _page_errors(logs)
        assert os.strerror(errno.EROFS) in event["error"]


async def test_the_root_can_be_remounted_read_only_while_the_store_serves(tmpfs: Mount) -> None:
    # An open store holds no descriptor open for writing (the kernel would refuse the remount
    # as busy): puts become misses, logged once, gets go on, and once the file
    # system is writable again puts store without a reopen.
    disk = tmpfs("disk", size="4m")
    async with FileStorage(disk / "s") as storage:
        stored = _keys(4)
        assert await _put(storage, stored) == [Outcome.OK] * 4
        _remount(disk, "ro")
        try:
            with structlog.testing.capture_logs() as logs:
                for _ in range(3):
                    assert await _put(storage, _keys(4)) == [Outcome.MISS] * 4
            assert await _get(storage, stored) == [Outcome.OK] * 4
        finally:
            _remount(disk, "rw")
        [event] = _page_errors(logs)  # one line for the kind, not one per batch
        assert os.strerror(errno.EROFS) in event["error"]
        assert (storage.stats().errors, storage.refused_writes) == (0, 12)
        keys = _keys(4)
        assert await _put(storage, keys) == [Outcome.OK] * 4
        assert await _get(storage, keys) == [Outcome.OK] * 4


# Reads.


async def test_read_errors_are_logged_once_per_batch(tmp_path: Path) -> None:
    async with FileStorage(tmp_path / "s") as storage:
        keys = [b"\x02" + key[1:] for key in _keys(16)]  # one shard, its descriptor held
        await _put(storage, keys)
        with structlog.testing.capture_logs() as logs, _descriptors_left(0):
            outcomes = await _get(storage, keys)
        assert outcomes == [Outcome.ERROR] * 16
        [event] = _page_errors(logs)
        assert (event["count"], event["key"]) == (16, keys[0].hex())
        assert os.strerror(errno.EMFILE) in event["error"]
        assert await _get(storage, keys) == [Outcome.OK] * 16


# Opening short of descriptors, or on a read-only file system.


async def test_open_short_of_descriptors_leaves_unreadable_shards_out(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = [bytes([shard]) + key[1:] for shard, key in enumerate(_keys(40))]
    async with FileStorage(root) as storage:
        await _put(storage, keys)
    storage = FileStorage(root)
    # The root's four, then a descriptor a shard kept and two while it is listed.
    with structlog.testing.capture_logs() as logs, _descriptors_left(12):
        await storage.__aenter__()
    try:
        unreadable = [entry for entry in logs if entry["event"] == "storage.shard.unreadable"]
        assert unreadable
        assert os.strerror(errno.EMFILE) in unreadable[0]["error"]
        indexed = storage.stats().pages
        assert 0 < indexed < len(keys)
        assert await storage.exists(keys[:indexed]) == indexed  # the shards read first
    finally:
        await storage.close()
    async with FileStorage(root) as storage:  # with descriptors enough, every page is back
        assert storage.stats().pages == len(keys)


@pytest.mark.parametrize("scan", ["gc", "verify"])
async def test_a_shard_listing_that_fails_keeps_its_pages_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scan: str
) -> None:
    root = tmp_path / "s"
    listing = os.scandir

    def scandir(path: Any) -> Any:
        # The shard's listing fails as it does when the process runs out of descriptors
        # between opening the directory and listing it.
        if isinstance(path, int) and os.readlink(f"/proc/self/fd/{path}") == str(unlisted):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return listing(path)

    async with FileStorage(root, capacity_bytes=64 * SIZE) as storage:
        keys = [
            bytes([shard]) + key[1:] for shard, key in zip([1] * 4 + [2] * 4, _keys(8), strict=True)
        ]
        assert await _put(storage, keys) == [Outcome.OK] * 8
        unlisted = root / "pages" / "01"
        monkeypatch.setattr(os, "scandir", scandir)
        with structlog.testing.capture_logs() as logs:
            if scan == "gc":
                await storage.gc()
            else:
                assert (await storage.verify()).unchecked == 1
        monkeypatch.undo()
        [unreadable] = [entry for entry in logs if entry["event"] == "storage.shard.unreadable"]
        assert unreadable["directory"] == str(unlisted)
        # Unlisted is not gone: its pages stay indexed, readable and counted.
        assert storage.stats().pages == 8
        assert await storage.exists(keys) == 8
        assert await _get(storage, keys) == [Outcome.OK] * 8
        await _assert_index_matches_disk(storage, root)


@pytest.mark.parametrize("left", range(5))
async def test_open_out_of_descriptors_is_a_storage_error(tmp_path: Path, left: int) -> None:
    # Whichever open runs out (the parent, the root, pages/, tmp/, LOCK, listing tmp/): the
    # process's limit is named, never the root called bad. Threads of other backends in this
    # process may hold a descriptor or two more, so fewer than `left` may be there.
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        await _put(storage, _keys(2))
    storage = FileStorage(root)
    with _descriptors_left(left), pytest.raises(StorageError, match=r"ulimit -n") as raised:
        await storage.__aenter__()
    assert not isinstance(raised.value, StorageConfigError)
    async with FileStorage(root) as storage:  # nothing was taken or left half open
        assert storage.stats().pages == 2


async def test_out_of_descriptors_when_retaking_the_lock_is_not_losing_it(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        old = _keys(2)
        assert await _put(storage, old) == [Outcome.OK] * 2
        for entry in root.iterdir():  # rm -rf root/*: LOCK must be taken again
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        with structlog.testing.capture_logs() as logs:
            with _descriptors_left(0):
                assert await _put(storage, _keys(2)) == [Outcome.ERROR] * 2
            keys = _keys(3)
            assert await _put(storage, keys) == [Outcome.OK] * 3
        events = [entry["event"] for entry in logs]
        assert "storage.lock.lost" not in events
        assert "storage.lock.recreated" in events
        assert await _get(storage, keys) == [Outcome.OK] * 3
        assert await _get(storage, old) == [Outcome.MISS] * 2
        await _assert_index_matches_disk(storage, root)
        with pytest.raises(StorageConfigError, match="in use by another instance"):
            async with FileStorage(root):
                pytest.fail("a second private instance opened a root in use")


async def test_a_read_only_root_opens_for_a_look_only(tmpfs: Mount) -> None:
    disk = tmpfs("disk", size="4m")
    root = disk / "s"
    keys = _keys(3)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
    _remount(disk, "ro")
    try:
        with pytest.raises(StorageConfigError, match="read-only file system") as refused:
            async with FileStorage(root):
                pass
        # The hint names what a look needs where the file system locks as NFS does.
        assert "on NFS with shared=1 in the URL" in str(refused.value)
        looking = FileStorage(root)
        looking._keep_leftovers = True  # as `hicache-async storage stats|ls` open it
        async with looking:
            assert looking.stats().pages == 3
            assert len(await looking.list_pages()) == 3
    finally:
        _remount(disk, "rw")


async def test_a_look_at_a_read_only_root_on_nfs_says_to_look_with_shared(
    tmpfs: Mount, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NFS takes an exclusive flock only on a descriptor open for writing, which a read-only
    # mount cannot give: a clear refusal naming the way that works, not "Bad file descriptor".
    disk = tmpfs("disk", size="4m")
    root = disk / "s"
    async with FileStorage(root) as storage:
        await _put(storage, _keys(3))
    _remount(disk, "ro")
    try:
        nfs_flock(monkeypatch)
        looking = FileStorage(root)
        looking._keep_leftovers = True  # as `hicache-async storage stats|ls` open it
        with pytest.raises(StorageConfigError) as refused:
            async with looking:
                pytest.fail("an exclusive lock was taken on a read-only descriptor")
        assert str(refused.value).startswith(f"cannot lock {root / 'LOCK'} to look"), refused
        assert f"({os.strerror(errno.EROFS)}); look with shared=1" in str(refused.value)
        shared = FileStorage(root, shared=True)
        shared._keep_leftovers = True
        async with shared:
            assert shared.stats().pages == 3
    finally:
        _remount(disk, "rw")


async def test_the_roots_own_mount_decides_whether_it_is_read_only(
    tmp_path: Path, tmpfs: Mount
) -> None:
    # LOCK may be a file mounted from another file system: the store writes into the root,
    # so the root's mount is what must be writable, not LOCK's.
    mounted: list[Path] = []
    try:
        lock_fs = tmpfs("lock_fs", size="1m")
        (lock_fs / "LOCK").touch(mode=0o600)
        writable = tmp_path / "writable"
        async with FileStorage(writable):
            pass
        _mount(["--bind", str(lock_fs / "LOCK")], writable / "LOCK", mounted)
        _remount(lock_fs, "ro")
        async with FileStorage(writable) as storage:  # a writable root, a read-only LOCK
            keys = _keys(2)
            assert await _put(storage, keys) == [Outcome.OK] * 2
        _remount(lock_fs, "rw")
        view = tmp_path / "view"
        view.mkdir(mode=0o700)
        _mount(["--bind", str(writable)], view, mounted)
        _mount(["-o", "remount,ro,bind"], view, mounted[:0])
        _mount(["--bind", str(lock_fs / "LOCK")], view / "LOCK", mounted)
        with pytest.raises(StorageConfigError, match="read-only file system"):
            async with FileStorage(view):  # a read-only root, a writable LOCK
                pytest.fail("a store that writes opened a root on a read-only mount")
    finally:
        _unmount(mounted)


# End to end.


_CONFIG = {
    "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64},
    "page_size": 16,
    "device_pages": 32,
    "host_pages": 48,
    "model_id": "full-disk",
    "prefetch": {"policy": "wait_complete", "io_timeout_s": 5, "threshold_tokens": 16},
    "backup": {"io_timeout_s": 5, "retry_backoff_s": 0.001},
}


def _prompts(count: int, seed: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 50_000, size=64)
    return [
        np.concatenate([shared, rng.integers(0, 50_000, size=int(rng.integers(16, 160)))])
        for _ in range(count)
    ]


async def test_a_cache_on_a_full_disk_serves_every_request(tmpfs: Mount) -> None:
    config = CacheConfig.from_dict(_CONFIG)
    generator = KVGenerator(config.layout, config.page_size, seed=1)
    storage = FileStorage(tmpfs("disk", size="2m") / "s")
    async with HiCache(config, storage=storage) as cache:

        async def phase(prompts: list[np.ndarray[Any, Any]], tag: str) -> int:
            for number, prompt in enumerate(prompts):
                # check="all": every page read (from any tier) holds its prefix's bytes.
                await serve(cache, prompt, generator, request_id=f"{tag}{number}", check="all")
                # Each request's backup ends before the next needs the host pool: otherwise
                # a slow machine drops queued backups to make room, and the disk may never
                # fill at all.
                await cache.drain()
            return cache.storage_status().backup.written_pages

        filled = await phase(_prompts(40, 1), "fill")  # some 4 MiB of pages for 2 MiB
        second = _prompts(40, 2)
        written = await phase(second, "full")
        assert written > filled  # still writing, with the disk full
        # Prompts whose next pages are on the disk only: served, the pages read back right.
        stored = []
        for prompt in second:
            found = cache.match(prompt)
            cached = (found.device_tokens + found.host_tokens) // config.page_size
            if found.keys[cached:] and await storage.exists(found.keys[cached:]):
                stored.append(prompt)
        assert stored
        await phase(stored, "again")
        backup = cache.storage_status().backup
        stats = storage.stats()
    assert stats.get_hits > 0
    assert stats.evictions > 0
    assert stats.errors == 0
    assert backup.retried_pages == 0  # no room is no error to retry
