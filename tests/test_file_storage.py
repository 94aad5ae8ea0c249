"""FileStorage: root safety, layout, crash leftovers, the index, capacity, shared roots."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import gc
import os
import resource
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from _idle_child import IdleChild

from hicache_async import KVLayout, StorageConfigError, StorageError, _native
from hicache_async.storage import (
    HEADER_NBYTES,
    FileStorage,
    Outcome,
    PageMeta,
    _file,
    default_root,
)
from hicache_async.storage._manifest import _file_lock
from hicache_async.testing import KVGenerator

NS = b"file-storage-ns!"
PAGE = 32 * 1024
SIZE = HEADER_NBYTES + PAGE


def _keys(count: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(count)]


def _pages(keys: list[bytes]) -> list[list[memoryview]]:
    return [[memoryview(bytearray(key[:1] * PAGE))] for key in keys]


def _metas(keys: list[bytes]) -> list[PageMeta]:
    return [PageMeta(key=k, namespace=NS, num_tokens=16, priority=2) for k in keys]


async def _put(storage: FileStorage, keys: list[bytes]) -> list[Outcome]:
    return await storage.put(keys, _pages(keys), _metas(keys))


async def _get(storage: FileStorage, keys: list[bytes]) -> list[Outcome]:
    buffers = [[memoryview(bytearray(PAGE))] for _ in keys]
    outcomes = await storage.get(keys, buffers, namespace=NS)
    for key, outcome, buffer in zip(keys, outcomes, buffers, strict=True):
        if outcome is Outcome.OK:
            assert bytes(buffer[0]) == key[:1] * PAGE
    return outcomes


def _page_path(root: Path, key: bytes) -> Path:
    return root / "pages" / key.hex()[:2] / key.hex()


def _disk_usage(root: Path) -> tuple[int, int]:
    files = [p for p in (root / "pages").rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


class _Gate:
    """Holds a worker thread at a chosen point until the test, on the loop, lets it go."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        assert self.go.wait(10), "the test never released the worker"

    async def wait_reached(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 10)


@contextlib.contextmanager
def _released(*gates: _Gate) -> Iterator[None]:
    try:
        yield
    finally:  # never leave a worker thread blocked, whatever failed
        for gate in gates:
            gate.go.set()


def _held_after(original: Callable[..., Any], gate: _Gate) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        gate.hold()
        return result

    return wrapper


async def _assert_index_matches_disk(storage: FileStorage, root: Path) -> None:
    stats = storage.stats()
    assert _disk_usage(root) == (stats.pages, stats.bytes)


# The root.


def test_default_root_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_root() == tmp_path / "hicache_async"
    assert FileStorage().root == tmp_path / "hicache_async"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the spec says
    assert default_root() == Path.home() / ".cache" / "hicache_async"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_root() == Path.home() / ".cache" / "hicache_async"


async def test_default_root_opens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    async with FileStorage() as storage:
        assert await _put(storage, _keys(1)) == [Outcome.OK]
    assert (tmp_path / "cache" / "hicache_async" / "pages").is_dir()


async def test_modes_are_private(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (key,) = _keys(1)
    async with FileStorage(root) as storage:
        await _put(storage, [key])
    for directory in (root, root / "pages", root / "tmp", _page_path(root, key).parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(_page_path(root, key).stat().st_mode) == 0o600


async def test_refuses_world_writable_root(tmp_path: Path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(StorageConfigError, match="world-writable"):
        async with FileStorage(root):
            pass
    assert not (root / "pages").exists()


async def test_refuses_root_owned_by_someone_else(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        root = tmp_path / "theirs"
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
    else:
        root = Path("/")  # owned by root, not by us
    with pytest.raises(StorageConfigError, match="owned by uid"):
        async with FileStorage(root):
            pass


async def test_refuses_symlinked_subdirectory(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / "pages").symlink_to(elsewhere)
    with pytest.raises(StorageConfigError, match="symlink"):
        async with FileStorage(root):
            pass


async def test_a_private_root_is_exclusive(tmp_path: Path) -> None:
    async with FileStorage(tmp_path / "s"):
        with pytest.raises(StorageConfigError, match="shared=1"):
            async with FileStorage(tmp_path / "s"):
                pass
        with pytest.raises(StorageConfigError, match="an instance that opened it privately"):
            async with FileStorage(tmp_path / "s", shared=True):
                pass
    async with FileStorage(tmp_path / "s", shared=True), FileStorage(tmp_path / "s", shared=True):
        pass


def _held_lock_access(root: Path) -> int:
    """The access mode (O_RDONLY, O_WRONLY or O_RDWR) of this process's descriptor of LOCK."""
    lock = root / "LOCK"
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == str(lock):
                return fcntl.fcntl(int(fd), fcntl.F_GETFL) & os.O_ACCMODE
    raise AssertionError(f"{lock} is not held open")


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
async def test_the_lock_is_held_read_only(tmp_path: Path, shared: bool) -> None:
    # A descriptor open for writing held for the store's life would make the kernel refuse
    # to remount the root's file system read-only (test_file_storage_full has the remount).
    root = tmp_path / "s"
    async with FileStorage(root, shared=shared):
        assert _held_lock_access(root) == os.O_RDONLY


async def test_an_exclusive_lock_refused_on_a_read_only_descriptor_is_taken_on_a_writable_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As NFS does: its flock is a byte-range lock, whose exclusive kind needs write access.
    flock = fcntl.flock

    def nfs_flock(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == 0:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        flock(fd, operation)

    monkeypatch.setattr(_file.fcntl, "flock", nfs_flock)
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        assert _held_lock_access(root) == os.O_RDWR
        assert await _put(storage, _keys(2)) == [Outcome.OK] * 2
        with pytest.raises(StorageConfigError, match="in use by another instance"):
            async with FileStorage(root):
                pytest.fail("a second private instance opened a root in use")
    async with FileStorage(root, shared=True):
        assert _held_lock_access(root) == os.O_RDONLY


async def test_a_forked_child_does_not_keep_the_root_locked(tmp_path: Path) -> None:
    # A flock belongs to the open file: a child holding a copy of the descriptor would keep
    # the root locked after the parent closed it, until the child exits.
    root = tmp_path / "s"
    async with FileStorage(root):
        child = IdleChild()
        await child.started()
    try:
        async with FileStorage(root) as again:
            assert again.stats().pages == 0
    finally:
        assert await child.exit() == 0


async def test_lifecycle_errors(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "s")
    with pytest.raises(StorageError, match="not open"):
        await storage.exists(_keys(1))
    async with storage:
        assert "state=open" in repr(storage)
    assert "state=closed" in repr(storage)
    with pytest.raises(StorageError, match="closed"):
        async with storage:
            pass


def test_bad_constructor_arguments(tmp_path: Path) -> None:
    with pytest.raises(StorageConfigError, match="fsync"):
        FileStorage(tmp_path, fsync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(StorageConfigError, match="capacity"):
        FileStorage(tmp_path, capacity_bytes=0)
    with pytest.raises(StorageConfigError, match="io_threads"):
        FileStorage(tmp_path, io_threads=0)


# Symlinks and other strangers inside the root.


async def test_symlinked_page_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (key,) = _keys(1)
    secret = tmp_path / "secret"
    async with FileStorage(root) as storage:
        await _put(storage, [key])
        value = _page_path(root, key).read_bytes()
        secret.write_bytes(value)  # a valid page, but outside the root
        _page_path(root, key).unlink()
        _page_path(root, key).symlink_to(secret)
        assert await _get(storage, [key]) == [Outcome.CORRUPT]
    assert not _page_path(root, key).is_symlink()
    assert secret.read_bytes() == value


async def test_fifo_in_place_of_a_page_does_not_block(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (key,) = _keys(1)
    async with FileStorage(root) as storage:
        await _put(storage, [key])
        _page_path(root, key).unlink()
        os.mkfifo(_page_path(root, key), 0o600)
        assert await _get(storage, [key]) == [Outcome.CORRUPT]
    assert not _page_path(root, key).exists()


# Crash leftovers and persistence.


async def test_leftover_temp_files_are_removed_on_open(tmp_path: Path) -> None:
    root = tmp_path / "store"
    async with FileStorage(root):
        pass
    leftover = root / "tmp" / "deadbeef.1234.tmp"
    leftover.write_bytes(b"half a page")
    async with FileStorage(root):
        assert not leftover.exists()


async def test_shared_root_keeps_fresh_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    async with FileStorage(root, shared=True):
        pass
    fresh = root / "tmp" / "fresh.tmp"
    stale = root / "tmp" / "stale.tmp"
    fresh.write_bytes(b"another instance is writing this")
    stale.write_bytes(b"left by a crash an hour ago")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    async with FileStorage(root, shared=True):
        assert fresh.exists()
        assert not stale.exists()


@pytest.mark.parametrize("fsync", ["none", "data", "always"])
async def test_pages_survive_reopen(tmp_path: Path, fsync: str) -> None:
    root = tmp_path / "store"
    keys = _keys(5)
    async with FileStorage(root, fsync=fsync) as storage:  # type: ignore[arg-type]
        assert await _put(storage, keys) == [Outcome.OK] * 5
    async with FileStorage(root) as storage:
        assert storage.stats().pages == 5
        assert storage.stats().bytes == 5 * SIZE
        assert await storage.exists(keys) == 5
        assert await _get(storage, keys) == [Outcome.OK] * 5


@pytest.mark.parametrize("fsync", ["none", "data", "always"])
async def test_write_raw_syncs_as_a_put_does(
    tmp_path: Path, fsync: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real calls, recorded: (function, whether the descriptor is a directory's).
    synced: list[tuple[str, bool]] = []

    def recorded(name: str, call: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            synced.append((name, stat.S_ISDIR(os.fstat(fd).st_mode)))
            call(fd)

        return sync

    monkeypatch.setattr(os, "fsync", recorded("fsync", os.fsync))
    monkeypatch.setattr(os, "fdatasync", recorded("fdatasync", os.fdatasync))
    # Each in a shard directory of its own, made by the write.
    put_key, raw_key = b"\x01" * 32, b"\x02" * 32
    async with FileStorage(tmp_path / "store", fsync=fsync) as storage:  # type: ignore[arg-type]
        synced.clear()
        assert await _put(storage, [put_key]) == [Outcome.OK]
        by_put, synced[:] = synced[:], []
        await storage.write_raw(raw_key, b"r" * SIZE)
        by_raw = synced[:]
    expected = {
        "none": [],
        "data": [("fdatasync", False)],
        # the new shard directory's parent, the file, the shard directory after the rename
        "always": [("fsync", True), ("fsync", False), ("fsync", True)],
    }
    assert by_put == expected[fsync]
    assert by_raw == by_put


async def test_torn_page_after_crash_is_corrupt_not_served(tmp_path: Path) -> None:
    # What a crash with fsync="none" can leave: the rename survived, the data did not.
    root = tmp_path / "store"
    keys = _keys(2)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
    path = _page_path(root, keys[0])
    whole = path.read_bytes()
    # The lost half reads back as other bytes: the complement, since zeros could be the page's own.
    path.write_bytes(whole[: SIZE // 2] + bytes(b ^ 0xFF for b in whole[SIZE // 2 :]))
    _page_path(root, keys[1]).write_bytes(b"")
    async with FileStorage(root) as storage:
        assert await _get(storage, keys) == [Outcome.CORRUPT, Outcome.CORRUPT]
        assert storage.stats().pages == 0
    assert _disk_usage(root) == (0, 0)


# The index.


async def test_exists_is_answered_from_the_index(tmp_path: Path) -> None:
    root = tmp_path / "store"
    keys = _keys(3)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        _page_path(root, keys[1]).unlink()  # behind the index's back
        assert await storage.exists(keys) == 3
        assert await _get(storage, keys) == [Outcome.OK, Outcome.MISS, Outcome.OK]
        assert await storage.exists(keys) == 1
        assert storage.stats().pages == 2


async def test_list_pages_most_recent_first(tmp_path: Path) -> None:
    keys = _keys(4)
    async with FileStorage(tmp_path / "s") as storage:
        await _put(storage, keys)
        await _get(storage, [keys[1]])
        pages = await storage.list_pages()
        assert [p.key for p in pages][:1] == [keys[1]]
        assert {p.key for p in pages} == set(keys)
        assert all((p.nbytes, p.num_tokens, p.priority) == (SIZE, 16, 2) for p in pages)
        assert len(await storage.list_pages(limit=2)) == 2


# Capacity.


async def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    root = tmp_path / "store"
    keys = _keys(5)
    async with FileStorage(root, capacity_bytes=4 * SIZE) as storage:
        for key in keys[:4]:  # one at a time: a batch's first page is its most recent
            assert await _put(storage, [key]) == [Outcome.OK]
        await _get(storage, [keys[0]])  # keys[1] is now the least recently used
        assert await _put(storage, [keys[4]]) == [Outcome.OK]
        assert await storage.exists([keys[1]]) == 0
        assert await storage.exists([keys[0], keys[2], keys[3], keys[4]]) == 4
        stats = storage.stats()
        assert (stats.pages, stats.bytes, stats.evictions) == (4, 4 * SIZE, 1)
    assert _disk_usage(root) == (4, 4 * SIZE)


async def test_batch_beyond_capacity_keeps_its_prefix(tmp_path: Path) -> None:
    keys = _keys(5)
    async with FileStorage(tmp_path / "s", capacity_bytes=3 * SIZE) as storage:
        outcomes = await _put(storage, keys)
        assert outcomes == [Outcome.OK] * 3 + [Outcome.MISS] * 2
        assert await storage.exists(keys) == 3


async def test_page_larger_than_capacity_is_a_miss(tmp_path: Path) -> None:
    root = tmp_path / "store"
    async with FileStorage(root, capacity_bytes=SIZE - 1) as storage:
        assert await _put(storage, _keys(1)) == [Outcome.MISS]
        assert storage.stats().pages == 0
    assert _disk_usage(root) == (0, 0)


@pytest.mark.parametrize("shared", [False, True])
async def test_a_page_larger_than_the_capacity_ends_its_batch(tmp_path: Path, shared: bool) -> None:
    root = tmp_path / "store"
    (stored,), (first, big, after, last) = _keys(1), _keys(4)
    async with FileStorage(root, capacity_bytes=3 * SIZE, shared=shared) as storage:
        assert await _put(storage, [stored]) == [Outcome.OK]
        keys = [first, big, after, stored, last]
        sizes = [PAGE, 3 * SIZE, PAGE, PAGE, PAGE]
        pages = [[memoryview(bytearray(nbytes))] for nbytes in sizes]
        outcomes = await storage.put(keys, pages, _metas(keys))
        # Pages past it could only be reached through it: stored, they would evict others.
        # One stored already stays so.
        assert outcomes == [Outcome.OK, Outcome.MISS, Outcome.MISS, Outcome.OK, Outcome.MISS]
        assert [await storage.exists([key]) for key in keys] == [1, 0, 0, 1, 0]
        stats = storage.stats()
        assert (stats.pages, stats.evictions) == (2, 0)
    assert _disk_usage(root) == (2, 2 * SIZE)


async def test_pages_being_read_are_not_evicted(tmp_path: Path) -> None:
    reading = _keys(8)
    older = _keys(4)
    newer = _keys(4)
    async with FileStorage(tmp_path / "s", capacity_bytes=12 * SIZE) as storage:
        await _put(storage, reading)  # least recently used of all
        await _put(storage, older)
        # The get pins its pages before its first await; the put then plans its evictions.
        got, put = await asyncio.gather(_get(storage, reading), _put(storage, newer))
        assert got == [Outcome.OK] * 8
        assert put == [Outcome.OK] * 4
        assert await storage.exists(reading) == 8
        assert await storage.exists(older[:1]) == 0
        assert storage.stats().evictions == 4


async def test_gc_enforces_a_shrunk_capacity(tmp_path: Path) -> None:
    root = tmp_path / "store"
    keys = _keys(6)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
    async with FileStorage(root, capacity_bytes=2 * SIZE) as storage:
        report = await storage.gc()
        assert (report.evicted_pages, report.freed_bytes) == (4, 4 * SIZE)
        assert storage.stats().bytes == 2 * SIZE
    assert _disk_usage(root) == (2, 2 * SIZE)


async def test_gc_of_a_shared_root_evicts_by_file_time_among_pages_found_on_disk(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    old, new = _keys(4), _keys(2)
    async with FileStorage(root, shared=True) as writer:
        await _put(writer, old)
        day_ago = time.time() - 86400
        for key in old:
            os.utime(_page_path(root, key), (day_ago, day_ago))
        async with FileStorage(root, shared=True, capacity_bytes=3 * SIZE) as gc_side:
            await _put(writer, new)  # after gc_side's open: found by gc's rescan
            report = await gc_side.gc()
            assert report.evicted_pages == 3
            # The day-old pages go; the ones just written by the other instance stay.
            assert await gc_side.exists(new[:1]) == 1
            assert await gc_side.exists(new[1:]) == 1
            assert sum(_page_path(root, key).exists() for key in old) == 1
            listed = [page.key for page in await gc_side.list_pages()]
            assert set(listed[:2]) == set(new)  # most recently used first


async def test_two_gc_at_once_on_a_shared_root_report_only_the_pages_each_removed(
    tmp_path: Path,
) -> None:
    # Both instances chose the same victims; a file the other had already removed counted
    # as evicted in both reports, whose sum came to nearly twice the pages gone.
    root = tmp_path / "store"
    payload = 256
    keys = _keys(2000)
    async with FileStorage(root, shared=True) as writer:
        for start in range(0, len(keys), 500):
            batch = keys[start : start + 500]
            pages = [[memoryview(bytearray(payload))] for _ in batch]
            assert await writer.put(batch, pages, _metas(batch)) == [Outcome.OK] * len(batch)
    size = HEADER_NBYTES + payload
    async with (
        FileStorage(root, shared=True, capacity_bytes=1000 * size) as first,
        FileStorage(root, shared=True, capacity_bytes=1000 * size) as second,
    ):
        reports = await asyncio.gather(first.gc(), second.gc())
        evictions = first.stats().evictions + second.stats().evictions
    assert _disk_usage(root) == (1000, 1000 * size)
    assert sum(report.evicted_pages for report in reports) == 1000
    assert sum(report.freed_bytes for report in reports) == 1000 * size
    assert evictions == 1000


async def test_a_put_on_a_shared_root_does_not_count_victims_another_instance_removed(
    tmp_path: Path,
) -> None:
    # The put's victims, indexed at its open, were deleted by the other instance since: the
    # put removed nothing, but counted each as its eviction.
    root = tmp_path / "store"
    old, new = _keys(4), _keys(2)
    async with FileStorage(root, shared=True) as writer:
        await _put(writer, old)
        async with FileStorage(root, shared=True, capacity_bytes=4 * SIZE) as storage:
            assert await storage.exists(old) == 4
            assert await writer.delete(old) == 4
            await _put(storage, new)
            assert storage.stats().evictions == 0
            assert _disk_usage(root) == (2, 2 * SIZE)


async def test_index_matches_disk_after_cancelled_operations(tmp_path: Path) -> None:
    root = tmp_path / "store"
    async with FileStorage(root, capacity_bytes=40 * SIZE) as storage:
        for round_ in range(6):
            keys = _keys(16)
            task = asyncio.create_task(_put(storage, keys))
            for _ in range(round_):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            task = asyncio.create_task(storage.delete(keys[::2]))
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        stats = storage.stats()
        assert _disk_usage(root) == (stats.pages, stats.bytes)
        assert stats.bytes <= 40 * SIZE
        # No write in progress is left behind; removed pages may wait in tmp/ as spare files
        # (how many depends on how far the cancelled deletes got), each one in the pool.
        spares = storage._spares.names() if storage._spares is not None else frozenset()
        assert {p.name for p in (root / "tmp").iterdir()} == spares
    assert not list((root / "tmp").iterdir())  # closing removes the spare files


# verify.


async def test_verify_removes_corrupt_pages_and_leftovers(tmp_path: Path) -> None:
    root = tmp_path / "store"
    keys = _keys(4)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        damaged = bytearray(_page_path(root, keys[0]).read_bytes())
        damaged[-1] ^= 1
        _page_path(root, keys[0]).write_bytes(bytes(damaged))
        newer = bytearray(_page_path(root, keys[1]).read_bytes())
        newer[4] = 9  # format version 9
        _page_path(root, keys[1]).write_bytes(bytes(newer))
        leftover = root / "tmp" / "x.tmp"
        leftover.write_bytes(b"leftover")
        hour_ago = time.time() - 3600
        os.utime(leftover, (hour_ago, hour_ago))
        (root / "tmp" / "y.tmp").write_bytes(b"a put in flight")  # fresh: kept
        (root / "pages" / "zz-not-a-page").write_bytes(b"an operator's")  # left, counted
        (root / "pages" / "zz-link").symlink_to("elsewhere")  # a stray entry: removed
        report = await storage.verify()
        assert (report.checked, report.ok, report.corrupt_removed, report.unsupported) == (
            4,
            2,
            1,
            1,
        )
        assert (report.leftovers_removed, report.foreign) == (2, 1)
        assert storage.stats().pages == 3
        assert storage.stats().corrupt == 1
    assert not _page_path(root, keys[0]).exists()
    assert _page_path(root, keys[1]).exists()
    assert not leftover.exists()
    assert (root / "tmp" / "y.tmp").exists()
    assert (root / "pages" / "zz-not-a-page").read_bytes() == b"an operator's"
    assert not (root / "pages" / "zz-link").is_symlink()


# Shared roots.


async def test_shared_instances_see_each_others_pages(tmp_path: Path) -> None:
    root = tmp_path / "store"
    keys = _keys(4)
    async with (
        FileStorage(root, shared=True) as first,
        FileStorage(root, shared=True) as second,
    ):
        assert await _put(first, keys) == [Outcome.OK] * 4
        assert second.stats().pages == 0
        assert await second.exists(keys) == 4  # looked up on disk, then indexed
        assert second.stats().pages == 4
        assert await _get(second, keys) == [Outcome.OK] * 4
        assert await first.delete(keys[:2]) == 2
        assert await _get(second, keys) == [Outcome.MISS] * 2 + [Outcome.OK] * 2
        assert second.stats().pages == 2
        # A page another instance already stored is not rewritten.
        assert await _put(second, keys) == [Outcome.OK] * 4
        assert await _get(first, keys) == [Outcome.OK] * 4


async def test_shared_put_rewrites_a_page_another_instance_deleted(tmp_path: Path) -> None:
    root = tmp_path / "store"
    keys = _keys(3)
    async with (
        FileStorage(root, shared=True) as first,
        FileStorage(root, shared=True) as second,
    ):
        assert await _put(first, keys) == [Outcome.OK] * 3
        assert await second.delete(keys[:2]) == 2
        # `first` still indexes them; its put must look, not answer from the index.
        assert await _put(first, keys) == [Outcome.OK] * 3
        assert all(_page_path(root, key).is_file() for key in keys)
        assert await _get(second, keys) == [Outcome.OK] * 3
        assert first.stats().pages == 3
        assert first.stats().bytes == 3 * SIZE
        # A page still there is kept as it is, not written again.
        before = _page_path(root, keys[2]).stat().st_ino
        assert await _put(first, keys[2:]) == [Outcome.OK]
        assert _page_path(root, keys[2]).stat().st_ino == before


async def test_shared_rewrite_at_another_size_makes_room_for_it(tmp_path: Path) -> None:
    root = tmp_path / "store"
    older, (tiny, resized) = _keys(2), _keys(2)
    capacity = 3 * SIZE
    async with (
        FileStorage(root, shared=True, capacity_bytes=capacity) as first,
        FileStorage(root, shared=True, capacity_bytes=capacity) as second,
    ):
        for key in older:  # the least recently used
            assert await _put(first, [key]) == [Outcome.OK]
        header_only = [[memoryview(bytearray(HEADER_NBYTES))]]
        for key in (tiny, resized):
            assert await first.put([key], header_only, _metas([key])) == [Outcome.OK]
        assert await second.delete([resized]) == 1
        # Still indexed by `first` at its old size: written again at a page's, it needs the
        # room of the difference, made by evicting the least recently used page.
        assert await _put(first, [resized]) == [Outcome.OK]
        stats = first.stats()
        assert (stats.pages, stats.bytes, stats.evictions) == (3, 2 * SIZE + 2 * HEADER_NBYTES, 1)
        assert await first.exists(older[:1]) == 0
        assert _disk_usage(root) == (3, stats.bytes)
        # Larger than the capacity: a miss, whatever its entry counts, and nothing written.
        assert await second.delete([resized]) == 1
        huge = [[memoryview(bytearray(capacity))]]
        assert await first.put([resized], huge, _metas([resized])) == [Outcome.MISS]
        assert not _page_path(root, resized).exists()


async def test_shared_put_of_a_stored_key_is_ok_and_takes_no_room(tmp_path: Path) -> None:
    root = tmp_path / "store"
    mine, theirs = _keys(2), _keys(4)
    async with (
        FileStorage(root, shared=True, capacity_bytes=3 * SIZE) as first,
        FileStorage(root, shared=True, capacity_bytes=3 * SIZE) as second,
    ):
        assert await _put(first, mine) == [Outcome.OK] * 2
        assert await _put(second, theirs[:3]) == [Outcome.OK] * 3
        assert await _get(first, theirs[:3]) == [Outcome.OK] * 3  # now indexed here too
        assert first.stats().bytes > 3 * SIZE
        # Beyond its capacity: its own least recently used pages go, in the background.
        assert first._trimmer is not None
        await first._trimmer
        assert (first.stats().bytes, first.stats().evictions) == (3 * SIZE, 2)
        # Stored already: OK, and no eviction to make room it does not need.
        assert await _put(first, theirs[:1]) == [Outcome.OK]
        assert first.stats().evictions == 2
        # Two puts of it at once: the first looks at the file; the second cannot know yet
        # whether that write will hold, so it is not told OK.
        both = await asyncio.gather(_put(first, theirs[:1]), _put(first, theirs[:1]))
        assert both == [[Outcome.OK], [Outcome.MISS]]
        assert first.stats().evictions == 2


async def test_shared_lookups_index_no_more_than_the_capacity(tmp_path: Path) -> None:
    # An instance whose puts all find their pages stored (another instance stores the same
    # pages first) indexed every page its lookups ever found, long after the other
    # instance had evicted them: its index grew with the keys it had seen, not its capacity.
    root = tmp_path / "store"
    capacity = 4 * SIZE
    async with (
        FileStorage(root, shared=True, capacity_bytes=capacity) as writer,
        FileStorage(root, shared=True, capacity_bytes=capacity) as reader,
    ):
        for round_ in range(20):
            keys = _keys(2)
            assert await _put(writer, keys) == [Outcome.OK] * 2
            if round_ % 2:
                assert await reader.exists(keys) == 2
            else:
                assert await _get(reader, keys) == [Outcome.OK] * 2
            assert await _put(reader, keys) == [Outcome.OK] * 2  # stored already
            trimming = getattr(reader, "_trimmer", None)  # what the lookups left it
            if trimming is not None:
                await trimming
            assert reader.stats().bytes <= capacity
        assert len(reader._index) == len(writer._index) == 4
        assert {*reader._index} == {*writer._index}
        assert _disk_usage(root) == (4, capacity)


async def test_shared_lookups_that_index_nothing_evict_nothing(tmp_path: Path) -> None:
    # A shared root's get started the eviction of the excess whatever it read: reopened
    # with a lower capacity, the first get of a page indexed already (or a miss) evicted
    # down to the capacity, though only a lookup that indexes pages it found on disk does.
    root = tmp_path / "store"
    keys = _keys(8)
    async with FileStorage(root, shared=True, capacity_bytes=8 * SIZE) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 8
    async with (
        FileStorage(root, shared=True, capacity_bytes=4 * SIZE) as lowered,
        FileStorage(root, shared=True, capacity_bytes=8 * SIZE) as other,
    ):
        assert await _get(lowered, keys[-1:]) == [Outcome.OK]
        assert await _get(lowered, _keys(1)) == [Outcome.MISS]
        assert await lowered.exists(keys) == 8
        assert lowered._trimmer is None
        assert (lowered.stats().pages, lowered.stats().evictions) == (8, 0)
        # A page found on disk: the excess goes, in the background.
        theirs = _keys(1)
        assert await _put(other, theirs) == [Outcome.OK]
        assert await _get(lowered, theirs) == [Outcome.OK]
        assert lowered._trimmer is not None
        await lowered._trimmer
        # Five pages left its index; `other`'s put had evicted the oldest already.
        assert (lowered.stats().bytes, lowered.stats().evictions) == (4 * SIZE, 4)


async def _polled(condition: Callable[[], bool], guard_s: float = 30.0) -> None:
    """Until `condition()` holds, looked at once a loop step; a hang guard of `guard_s`."""
    deadline = asyncio.get_running_loop().time() + guard_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met")
        await asyncio.sleep(0)


class TrimsWhenLetGo(FileStorage):
    """Its background eviction (`_trim_later`) waits for `let_go`, through a cancellation
    too: a task that ends some steps after it is cancelled."""

    def __init__(self, root: Path, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.let_go = asyncio.Event()

    async def _evict_in_stead(self, keep: set[bytes], spared: set[bytes]) -> None:
        while not self.let_go.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.let_go.wait()
        await super()._evict_in_stead(keep, spared)


async def test_a_close_cancelled_while_the_eviction_ends_releases_the_root(
    tmp_path: Path,
) -> None:
    # A close cancelled while it waited for the background eviction to end (or for the task
    # that stamps uses) raised at once: the root's descriptors and its lock stayed, and the
    # root could not be opened again by this process or another.
    root = tmp_path / "store"
    async with FileStorage(root, shared=True) as writer:
        reader = TrimsWhenLetGo(root, shared=True, capacity_bytes=2 * SIZE)
        await reader.__aenter__()
        keys = _keys(4)
        assert await _put(writer, keys) == [Outcome.OK] * 4
        assert await reader.exists(keys) == 4
        trimmer = reader._trimmer
        assert trimmer is not None
        closing = asyncio.create_task(reader.close())
        await _polled(lambda: trimmer.cancelling() > 0)  # the close waits for it
        closing.cancel()
        reader.let_go.set()
        (cancelled,) = await asyncio.gather(closing, return_exceptions=True)
        assert isinstance(cancelled, asyncio.CancelledError)
        assert trimmer.done()
        assert reader._handles is None
    async with FileStorage(root) as again:  # the root's lock went with the close
        assert again.stats().pages == 4


async def test_io_threads_one_and_many_agree(tmp_path: Path) -> None:
    keys = _keys(24)
    pages = [[memoryview(os.urandom(256 * 1024))] for _ in keys]
    for threads in (1, 3):
        async with FileStorage(tmp_path / f"t{threads}", io_threads=threads) as storage:
            assert await storage.put(keys, pages, _metas(keys)) == [Outcome.OK] * 24
            buffers = [[memoryview(bytearray(256 * 1024))] for _ in keys]
            assert await storage.get(keys, buffers, namespace=NS) == [Outcome.OK] * 24
            assert all(bytes(b[0]) == bytes(p[0]) for b, p in zip(buffers, pages, strict=True))


async def test_bad_buffers_raise_before_io(tmp_path: Path) -> None:
    keys = _keys(2)
    async with FileStorage(tmp_path / "s") as storage:
        await _put(storage, keys)
        readonly = [[memoryview(bytes(PAGE))] for _ in keys]
        with pytest.raises(ValueError, match="writable"):
            await storage.get(keys, readonly, namespace=NS)
        with pytest.raises(ValueError, match="meta\\.key"):
            await storage.put(keys, _pages(keys), _metas(keys[::-1]))
        assert await _get(storage, keys) == [Outcome.OK] * 2


# Spare files: removed pages' files reused by writes of the same size.


def _spares(root: Path) -> list[Path]:
    return sorted(p for p in (root / "tmp").iterdir() if p.name.endswith(".spare"))


async def _put_and_delete(storage: FileStorage, count: int) -> None:
    """Store `count` new pages and delete them again, which leaves spare files."""
    keys = _keys(count)
    assert await _put(storage, keys) == [Outcome.OK] * count
    assert await storage.delete(keys) == count


async def test_deleted_pages_files_are_reused_and_never_served(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        old = _keys(3)
        await _put(storage, old)
        inodes = {_page_path(root, k).stat().st_ino for k in old}
        assert await storage.delete(old) == 3
        assert len(_spares(root)) == 3
        assert "spare=" + str(3 * SIZE) in repr(storage)
        new = _keys(3)
        assert await _put(storage, new) == [Outcome.OK] * 3
        assert _spares(root) == []  # every spare went into a new page
        assert {_page_path(root, k).stat().st_ino for k in new} == inodes
        assert await _get(storage, new) == [Outcome.OK] * 3  # checks the bytes too
        assert await _get(storage, old) == [Outcome.MISS] * 3
        assert await storage.exists(old) == 0
        assert all(_page_path(root, k).stat().st_mode & 0o777 == 0o600 for k in new)
    # Reopened, the pages are whole and valid.
    async with FileStorage(root) as storage:
        assert await _get(storage, new) == [Outcome.OK] * 3
        report = await storage.verify()
        assert (report.checked, report.ok, report.corrupt_removed) == (3, 3, 0)


async def test_spare_files_only_serve_writes_of_their_size(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        gone = _keys(1)
        await _put(storage, gone)
        await storage.delete(gone)
        other = _keys(1)
        small = [[memoryview(bytearray(other[0][:1] * (PAGE // 2)))]]
        assert await storage.put(other, small, _metas(other)) == [Outcome.OK]
        assert len(_spares(root)) == 1  # not the right size: a new file
        buffers = [[memoryview(bytearray(PAGE // 2))]]
        assert await storage.get(other, buffers, namespace=NS) == [Outcome.OK]
        assert bytes(buffers[0][0]) == other[0][:1] * (PAGE // 2)


async def test_spare_files_removed_from_outside_are_forgotten_once_taken(
    tmp_path: Path,
) -> None:
    # A write that took a spare file someone else had removed (or replaced) wrote a new
    # file, but the spare's name stayed among those taken by writes in progress for good:
    # one name more per such write, for as long as the store stayed open.
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        assert storage._spares is not None
        for _ in range(20):
            await _put_and_delete(storage, 3)
            spares = _spares(root)
            assert len(spares) == 3
            spares[0].unlink()
            spares[1].write_bytes(b"not a page's size")
            assert await _put(storage, _keys(3)) == [Outcome.OK] * 3
        # Nothing is being written: no name of a spare file is held for a write.
        assert storage._spares.names() == frozenset()
        assert _spares(root) == []


async def test_a_spare_file_that_cannot_be_opened_is_removed(tmp_path: Path) -> None:
    # A write that took a spare file and could not open it (out of descriptors) forgot the
    # file but left it in tmp/, where neither the pool nor a close removed it.
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        assert storage._spares is not None
        first = os.urandom(32)
        assert await _put(storage, [first]) == [Outcome.OK]
        assert await storage.delete([first]) == 1
        assert len(_spares(root)) == 1
        key = first[:1] + os.urandom(31)  # its shard directory is open already
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor number
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
        try:
            outcomes = await _put(storage, [key])
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert outcomes == [Outcome.ERROR]
        assert storage._spares.files == 0
        assert storage._spares.names() == frozenset()
        assert _spares(root) == []
    assert list((root / "tmp").iterdir()) == []


async def test_spare_bytes_is_a_bound_and_zero_turns_it_off(tmp_path: Path) -> None:
    async with FileStorage(tmp_path / "a", spare_bytes=2 * SIZE) as storage:
        await _put_and_delete(storage, 5)
        assert len(_spares(tmp_path / "a")) == 2  # the rest unlinked
        assert _disk_usage(tmp_path / "a") == (0, 0)
    async with FileStorage.from_url(f"file://{tmp_path / 'b'}?spare=0") as storage:
        await _put_and_delete(storage, 2)
        assert _spares(tmp_path / "b") == []
    # The default is at most an eighth of the capacity.
    async with FileStorage(tmp_path / "c", capacity_bytes=16 * SIZE) as storage:
        await _put_and_delete(storage, 8)
        assert len(_spares(tmp_path / "c")) == 2
    with pytest.raises(StorageConfigError, match="spare"):
        FileStorage(tmp_path, spare_bytes=-1)
    with pytest.raises(StorageConfigError, match="spare"):
        FileStorage.from_url(f"file://{tmp_path}?spare=lots")


async def test_evicted_pages_files_take_the_new_pages(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root, capacity_bytes=4 * SIZE, spare_bytes=4 * SIZE) as storage:
        first = _keys(4)
        await _put(storage, first)
        inodes = {_page_path(root, k).stat().st_ino for k in first}
        second = _keys(4)
        assert await _put(storage, second) == [Outcome.OK] * 4
        assert {_page_path(root, k).stat().st_ino for k in second} == inodes
        assert _disk_usage(root) == (4, 4 * SIZE)
        assert _spares(root) == []
        assert await _get(storage, second) == [Outcome.OK] * 4
        assert await _get(storage, first) == [Outcome.MISS] * 4


async def test_spare_files_go_at_close_and_at_the_next_open(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        await _put_and_delete(storage, 3)
        assert len(_spares(root)) == 3
    assert _spares(root) == []
    # A process that died left its spare files behind: the next open removes them.
    (root / "tmp" / "0123456789abcdef.spare").write_bytes(bytes(SIZE))
    async with FileStorage(root) as storage:
        assert storage.leftovers_removed_at_open == 1
    assert _spares(root) == []


async def test_a_spare_file_that_changed_is_not_written_over(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root, io_threads=1) as storage:
        await _put_and_delete(storage, 3)
        spares = _spares(root)
        spares[0].unlink()  # gone (a verify elsewhere, say)
        spares[1].write_bytes(b"short")  # no longer the size it was kept for
        spares[2].unlink()
        os.mkfifo(spares[2])  # something that would block a writer
        new = _keys(3)
        assert await _put(storage, new) == [Outcome.OK] * 3
        assert await _get(storage, new) == [Outcome.OK] * 3
        assert not spares[1].exists()  # dropped, not reused
        assert all(stat.S_ISREG(_page_path(root, k).stat().st_mode) for k in new)


async def test_verify_keeps_this_instances_spare_files(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        await _put_and_delete(storage, 2)
        spares = _spares(root)
        old = time.time() - 3600
        for path in spares:  # long idle, as leftovers of a dead writer would be
            os.utime(path, (old, old))
        stray = root / "tmp" / "dead-writer.tmp"
        stray.write_bytes(b"x")
        os.utime(stray, (old, old))
        report = await storage.verify()
        assert report.leftovers_removed == 1
        assert _spares(root) == spares
        new = _keys(2)
        assert await _put(storage, new) == [Outcome.OK] * 2
        assert _spares(root) == []  # both reused


# Operations racing each other: a read or scan commits what it saw only if nothing changed since.


async def test_read_done_before_a_delete_does_not_bring_the_page_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    (key,) = _keys(1)
    gate = _Gate()
    async with FileStorage(root, spare_bytes=0) as storage:
        await _put(storage, [key])
        monkeypatch.setattr(storage, "_read_one", _held_after(storage._read_one, gate))
        with _released(gate):
            get = asyncio.ensure_future(_get(storage, [key]))
            await gate.wait_reached()  # read whole, not yet committed
            assert await storage.delete([key]) == 1
            gate.go.set()
            assert await get == [Outcome.OK]
        assert await storage.exists([key]) == 0
        await _assert_index_matches_disk(storage, root)
        monkeypatch.undo()
        assert await _put(storage, [key]) == [Outcome.OK]
        assert _page_path(root, key).exists()  # stored, not taken for already there
        assert await _get(storage, [key]) == [Outcome.OK]


async def test_read_that_missed_does_not_drop_a_page_written_since(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    (key,) = _keys(1)
    before, after = _Gate(), _Gate()
    original = FileStorage._read_one

    def read_one(self: FileStorage, *args: Any, **kwargs: Any) -> Any:
        before.hold()
        result = original(self, *args, **kwargs)
        after.hold()
        return result

    async with FileStorage(root, spare_bytes=0) as storage:
        await _put(storage, [key])
        monkeypatch.setattr(FileStorage, "_read_one", read_one)
        with _released(before, after):
            get = asyncio.ensure_future(_get(storage, [key]))
            await before.wait_reached()
            assert await storage.delete([key]) == 1
            before.go.set()
            await after.wait_reached()  # the read missed
            assert await _put(storage, [key]) == [Outcome.OK]
            after.go.set()
            assert await get == [Outcome.MISS]
        assert await storage.exists([key]) == 1
        await _assert_index_matches_disk(storage, root)


async def test_verify_does_not_bring_back_pages_deleted_meanwhile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    keys = _keys(6)
    gate = _Gate()
    checked: list[bytes] = []

    async with FileStorage(root, spare_bytes=0) as storage:
        original = storage._verify_file

        def verify_file(
            shard_fd: int, key: bytes, scratch: bytearray, stop: threading.Event
        ) -> Any:
            checked.append(key)
            if len(checked) == len(keys):  # every other page is checked, and still listed
                gate.hold()
            return original(shard_fd, key, scratch, stop)

        await _put(storage, keys)
        monkeypatch.setattr(storage, "_verify_file", verify_file)
        with _released(gate):
            task = asyncio.ensure_future(storage.verify())
            await gate.wait_reached()
            assert await storage.delete(checked[:-1]) == len(keys) - 1
            gate.go.set()
            assert (await task).ok == len(keys)
        assert await storage.exists(checked[:1]) == 0
        assert storage.stats().pages == 1
        await _assert_index_matches_disk(storage, root)


async def test_gc_does_not_bring_back_pages_deleted_meanwhile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    keys = _keys(6)
    gate = _Gate()
    async with FileStorage(root, capacity_bytes=100 * SIZE, spare_bytes=0) as storage:
        await _put(storage, keys)
        monkeypatch.setattr(_file, "_scan", _held_after(_file._scan, gate))
        with _released(gate):
            task = asyncio.ensure_future(storage.gc())
            await gate.wait_reached()  # the scan listed every page
            assert await storage.delete(keys[:4]) == 4
            gate.go.set()
            await task
        assert await storage.exists(keys[:1]) == 0
        assert storage.stats().pages == 2
        await _assert_index_matches_disk(storage, root)


async def test_shared_stat_does_not_bring_back_a_page_deleted_meanwhile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    (key,) = _keys(1)
    gate = _Gate()
    async with (
        FileStorage(root, shared=True) as writer,
        FileStorage(root, shared=True) as reader,
    ):
        await _put(writer, [key])
        monkeypatch.setattr(reader, "_stat_job", _held_after(reader._stat_job, gate))
        with _released(gate):
            exists = asyncio.ensure_future(reader.exists([key]))
            await gate.wait_reached()
            assert await reader.delete([key]) == 1
            gate.go.set()
            assert await exists == 1  # it was there when looked up
        assert reader.stats().pages == 0
        assert not _page_path(root, key).exists()


# Removal failures: the page stays, so does its entry.


def _failing_removal(monkeypatch: pytest.MonkeyPatch, failing: set[str]) -> None:
    original = _file._remove_page

    def remove_page(spares: Any, handles: Any, shard_fd: int, name: str) -> None:
        if name in failing:
            raise PermissionError(errno.EPERM, "Operation not permitted", name)
        original(spares, handles, shard_fd, name)

    monkeypatch.setattr(_file, "_remove_page", remove_page)


async def test_a_page_that_cannot_be_removed_stays_indexed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    old, new = _keys(4), _keys(4)
    failing: set[str] = set()
    _failing_removal(monkeypatch, failing)
    async with FileStorage(root, capacity_bytes=4 * SIZE, spare_bytes=0) as storage:
        await _put(storage, old)
        failing.add(old[0].hex())
        assert await _put(storage, new) == [Outcome.OK] * 4
        stats = storage.stats()
        assert (stats.evictions, stats.errors) == (3, 1)
        assert await storage.exists(old[:1]) == 1
        await _assert_index_matches_disk(storage, root)
        failing.clear()
        report = await storage.gc()  # over capacity by old[0]; it goes now
        assert (report.evicted_pages, storage.stats().bytes) == (1, 4 * SIZE)
        failing.add(new[0].hex())
        assert await storage.delete(new[:2]) == 1
        assert await storage.exists(new[:1]) == 1
        assert storage.stats().errors == 2
        await _assert_index_matches_disk(storage, root)


async def test_gc_does_not_count_a_failed_eviction(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    keys = _keys(3)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
    now = time.time()
    for age, key in zip((300, 200, 100), keys, strict=True):  # reopened in this LRU order
        os.utime(_page_path(root, key), (now - age, now - age))
    _failing_removal(monkeypatch, {keys[0].hex()})
    async with FileStorage(root, capacity_bytes=SIZE, spare_bytes=0) as storage:
        report = await storage.gc()
        assert (report.evicted_pages, report.freed_bytes) == (1, SIZE)
        assert storage.stats().evictions == 1
        assert await storage.exists(keys[:1]) == 1
        assert await storage.exists(keys[1:2]) == 0
        await _assert_index_matches_disk(storage, root)


# Shard directories are checked like pages/ and tmp/.


async def test_a_world_writable_shard_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "s"
    kept = bytes.fromhex("ab" + "01" * 31)
    async with FileStorage(root) as storage:
        assert await _put(storage, [kept]) == [Outcome.OK]
    (root / "pages" / "ab").chmod(0o777)
    with structlog.testing.capture_logs() as logs:
        async with FileStorage(root) as storage:
            assert storage.stats().pages == 0  # not indexed at open
            assert await _get(storage, [kept]) == [Outcome.MISS]
            new = bytes.fromhex("ab" + "02" * 31)
            # Refused for good, as on a read-only file system: no ERROR to retry.
            assert await _put(storage, [new]) == [Outcome.MISS]
            assert (storage.refused_writes, storage.stats().errors) == (1, 0)
            assert await _put(storage, [bytes.fromhex("cd" + "02" * 31)]) == [Outcome.OK]
    assert not _page_path(root, new).exists()
    assert _page_path(root, kept).exists()  # left alone
    refused = [entry for entry in logs if entry["event"] == "storage.shard.refused"]
    assert len(refused) == 1
    assert "world-writable" in refused[0]["error"]


async def test_a_put_into_refused_shards_logs_one_line_not_one_per_shard(tmp_path: Path) -> None:
    # A refusal's text names its shard directory, which `storage.shard.refused` has named
    # already: the put's refused pages made a `storage.page.error` kind of their own per
    # shard, a line per shard at every batch, as the pages that stay in them do not.
    root, keys = tmp_path / "s", _keys(8)
    async with FileStorage(root) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 8
    shards = {key.hex()[:2] for key in keys}
    for shard in shards:
        (root / "pages" / shard).chmod(0o770)
    with structlog.testing.capture_logs() as logs:
        async with FileStorage(root) as storage:
            assert await _put(storage, keys) == [Outcome.MISS] * 8
            assert (storage.refused_writes, storage.stats().errors) == (8, 0)
    refused = [entry for entry in logs if entry["event"] == "storage.shard.refused"]
    assert len(refused) == len(shards)  # each directory named once, there
    [error] = [entry for entry in logs if entry["event"] == "storage.page.error"]
    assert error["count"] == 8
    assert str(root) not in error["error"]


async def test_group_writable_directories_in_the_root_are_refused(tmp_path: Path) -> None:
    # `chmod -R g+rwX` on a root, as one might to share it among users of a group, let any
    # of them copy in a sound page of their own making, which was served.
    gen = KVGenerator(KVLayout(num_layers=2, num_kv_heads=2, head_dim=16), 16)
    tokens = list(range(100, 132))
    key = bytes.fromhex("ab" + "01" * 31)
    meta = [PageMeta(key=key, namespace=NS, num_tokens=16)]

    async def store(root: Path, page: int) -> None:
        async with FileStorage(root) as storage:
            data = [[memoryview(bytearray(gen.page_bytes(tokens, page)))]]
            assert await storage.put([key], data, meta) == [Outcome.OK]

    async def get(root: Path) -> Outcome:
        async with FileStorage(root) as storage:
            into = [[memoryview(bytearray(len(gen.page_bytes(tokens, 0))))]]
            [outcome] = await storage.get([key], into, namespace=NS)
            if outcome is Outcome.OK:
                assert bytes(into[0][0]) == gen.page_bytes(tokens, 0)
            return outcome

    root, other = tmp_path / "s", tmp_path / "other"
    await store(root, 0)
    await store(other, 1)  # another user's page for the same key
    for path in (root, root / "pages", root / "pages" / "ab"):
        path.chmod(0o770)
    _page_path(other, key).replace(_page_path(root, key))
    with pytest.raises(StorageConfigError, match="pages is group-writable"):
        await get(root)
    (root / "pages").chmod(0o750)  # the root itself may be (made by mkdir under umask 002)
    with structlog.testing.capture_logs() as logs:
        assert await get(root) == Outcome.MISS
    refused = [entry for entry in logs if entry["event"] == "storage.shard.refused"]
    assert len(refused) == 1
    assert "group-writable" in refused[0]["error"]
    (root / "pages" / "ab").chmod(0o700)
    _page_path(root, key).unlink()
    await store(root, 0)
    assert await get(root) == Outcome.OK


async def test_a_group_writable_root_is_refused_with_the_command_that_fixes_all_of_it(
    tmp_path: Path,
) -> None:
    # `chmod -R g+rwX` on a root (or a volume whose group ownership is set again at every
    # mount) leaves pages/, tmp/ and every shard directory group-writable. The refusal told
    # `chmod 700`, which fixed one directory: the next open refused the next one, then each
    # shard directory was refused in turn while the store served, its pages misses.
    root = tmp_path / "s"
    keys = [bytes.fromhex(f"{i:02x}" + "01" * 31) for i in (0xAB, 0xCD)]
    async with FileStorage(root) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 2
    for path in [root, *root.rglob("*")]:
        path.chmod(path.stat().st_mode | (0o070 if path.is_dir() else 0o060))
    with pytest.raises(StorageConfigError, match="pages is group-writable") as refused:
        async with FileStorage(root):
            pass
    fix = str(refused.value).split("use a private directory (", 1)[1].split(")", 1)[0]
    assert fix.startswith("chmod -R ")
    await anyio.run_process(fix)  # a shell command, as an operator runs it
    with structlog.testing.capture_logs() as logs:
        async with FileStorage(root) as storage:
            assert await _get(storage, keys) == [Outcome.OK] * 2
    assert not [entry for entry in logs if entry["event"] == "storage.shard.refused"]


# URL parameters.


@pytest.mark.parametrize("param", ["capacity", "spare"])
def test_blank_size_in_url_is_refused(tmp_path: Path, param: str) -> None:
    with pytest.raises(StorageConfigError, match=f"{param}=''"):
        FileStorage.from_url(f"file://{tmp_path}?{param}=")


# Bad input is not a storage error.


async def test_bad_input_is_not_counted_as_an_error(tmp_path: Path) -> None:
    keys = _keys(2)
    async with FileStorage(tmp_path / "s", capacity_bytes=2 * SIZE) as storage:
        await _put(storage, keys)
        strided = [[memoryview(bytearray(2 * PAGE))[::2]] for _ in keys]
        new = _keys(2)  # would evict both pages
        with pytest.raises(ValueError, match="contiguous"):
            await storage.put(new, strided, _metas(new))
        with pytest.raises(ValueError, match="writable"):
            await storage.get(keys, [[memoryview(bytes(PAGE))] for _ in keys], namespace=NS)
        stats = storage.stats()
        assert (stats.errors, stats.evictions, stats.pages) == (0, 0, 2)
        assert (stats.gets, stats.puts) == (0, 2)  # nor as a call
        assert await _get(storage, keys) == [Outcome.OK] * 2


# Recency survives a reopen.


async def test_reads_order_eviction_after_reopen(tmp_path: Path) -> None:
    root = tmp_path / "s"
    read, unread, new = _keys(3)
    async with FileStorage(root) as storage:
        await _put(storage, [read, unread])
        now = time.time()
        os.utime(_page_path(root, read), (now - 100, now - 100))  # written first
        os.utime(_page_path(root, unread), (now - 50, now - 50))
        assert await _get(storage, [read]) == [Outcome.OK]
        # Touched by the read (the kernel stamps files from a coarser clock than time.time:
        # up to a few ms behind it, so not `>= now`).
        assert _page_path(root, read).stat().st_mtime > now - 1
    async with FileStorage(root, capacity_bytes=2 * SIZE) as storage:
        assert await _put(storage, [new]) == [Outcome.OK]
        assert await storage.exists([read]) == 1
        assert await storage.exists([unread]) == 0


def _held_before(original: Callable[..., Any], gate: _Gate) -> Callable[..., Any]:
    """`original`, whose first call waits at `gate` before it runs (later calls run)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not gate.reached.is_set():
            gate.hold()
        return original(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("indexed", [False, True], ids=["new", "indexed"])
async def test_shared_delete_during_own_put_leaves_no_page_in_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, indexed: bool
) -> None:
    # In a shared root a delete does not wait for this instance's writes; when it removes the
    # file after the write's rename, the put must not then index a page that is gone.
    root = tmp_path / "s"
    (key,) = _keys(1)
    gate = _Gate()
    async with FileStorage(root, shared=True) as storage:
        if indexed:  # indexed here, removed by another instance: the put writes it again
            await _put(storage, [key])
            async with FileStorage(root, shared=True) as other:
                assert await other.delete([key]) == 1
        monkeypatch.setattr(storage, "_write_job", _held_after(storage._write_job, gate))
        with _released(gate):
            put = asyncio.ensure_future(_put(storage, [key]))
            await gate.wait_reached()  # renamed into place, not yet committed
            assert _page_path(root, key).is_file()
            assert await storage.delete([key]) == 1
        assert await put == [Outcome.OK]
        assert not _page_path(root, key).exists()
        assert await storage.exists([key]) == 0
        await _assert_index_matches_disk(storage, root)


@pytest.mark.parametrize("call", ["get", "put"])
async def test_pages_a_cancelled_call_never_reached_are_not_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    keys = _keys(4)
    gate = _Gate()
    async with FileStorage(tmp_path / "s") as storage:
        await _put(storage, keys[:2] if call == "put" else keys)
        job = "_read_job" if call == "get" else "_write_job"
        monkeypatch.setattr(storage, job, _held_before(getattr(storage, job), gate))
        with _released(gate):
            task = asyncio.ensure_future(
                _get(storage, keys) if call == "get" else _put(storage, keys[2:])
            )
            await gate.wait_reached()  # the job has not begun: cancelled, it does nothing
            task.cancel()
            for _ in range(3):  # let the cancellation reach the job before it goes on
                await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = storage.stats()
        assert stats.errors == 0
        assert (stats.get_hits, stats.put_ok) == (0, 2 if call == "put" else 4)
        # The disk room the put claimed for its pages is given back: later plans count it.
        assert storage._claims.pending() == (0, 0)
        await _assert_index_matches_disk(storage, tmp_path / "s")


async def test_a_page_deleted_and_stored_again_while_read_is_never_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The page being read is unlinked, not kept as a spare, so the new page gets a file of
    # its own; the read finishes on the old file and the new page stays.
    page = 32 << 10
    gate = _Gate()
    async with FileStorage(tmp_path / "store") as storage:
        (key,) = _keys(1)
        meta = [PageMeta(key=key, namespace=NS, num_tokens=1)]
        assert await storage.put([key], [[memoryview(b"A" * page)]], meta) == [Outcome.OK]
        monkeypatch.setattr(_native, "pread_checksum", _held_before(_native.pread_checksum, gate))
        with _released(gate):
            into = [[memoryview(bytearray(page))]]
            read = asyncio.ensure_future(storage.get([key], into, namespace=NS))
            await gate.wait_reached()
            assert await storage.delete([key]) == 1
            assert await storage.put([key], [[memoryview(b"B" * page)]], meta) == [Outcome.OK]
            gate.go.set()
            assert (await read)[0] in (Outcome.OK, Outcome.MISS)
        again = [[memoryview(bytearray(page))]]
        assert await storage.get([key], again, namespace=NS) == [Outcome.OK]
        assert bytes(again[0][0]) == b"B" * page
        assert storage.stats().corrupt == 0


async def test_verify_leaves_a_spare_file_a_put_has_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = 32 << 10
    root = tmp_path / "store"
    gate = _Gate()
    async with FileStorage(root) as storage:
        old, new = _keys(2)
        meta = [PageMeta(key=old, namespace=NS, num_tokens=1)]
        assert await storage.put([old], [[memoryview(b"A" * page)]], meta) == [Outcome.OK]
        hour_ago = time.time() - 3600
        os.utime(_page_path(root, old), (hour_ago, hour_ago))  # a spare keeps this mtime
        assert await storage.delete([old]) == 1
        assert [n for n in os.listdir(root / "tmp") if n.endswith(".spare")]
        # The put has opened the spare and not written it yet.
        monkeypatch.setattr(_native, "checksum", _held_before(_native.checksum, gate))
        with _released(gate):
            meta = [PageMeta(key=new, namespace=NS, num_tokens=1)]
            put = asyncio.ensure_future(storage.put([new], [[memoryview(b"B" * page)]], meta))
            await gate.wait_reached()
            report = await storage.verify()
            gate.go.set()
            assert await put == [Outcome.OK]
        assert report.leftovers_removed == 0
        into = [[memoryview(bytearray(page))]]
        assert await storage.get([new], into, namespace=NS) == [Outcome.OK]
        assert bytes(into[0][0]) == b"B" * page


async def test_a_shared_root_keeps_no_spare_files(tmp_path: Path) -> None:
    # Another instance may be reading a page whose file would be reused, and cannot tell
    # this instance's spares from leftovers.
    root = tmp_path / "store"
    async with FileStorage(root, shared=True, spare_bytes=1 << 20) as storage:
        keys = _keys(2)
        assert await storage.put(keys, _pages(keys), _metas(keys)) == [Outcome.OK] * 2
        assert await storage.delete(keys[:1]) == 1
        assert [n for n in os.listdir(root / "tmp") if n.endswith(".spare")] == []


async def test_a_cancelled_put_still_evicts_what_it_made_room_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The victims' room counts as free from the moment they are chosen; a put that runs
    # meanwhile may fill it, so the cancelled put must still remove them.
    big, small = 1 << 20, 4096
    capacity = (HEADER_NBYTES + big) + (HEADER_NBYTES + small)
    root = tmp_path / "store"
    gate = _Gate()
    async with FileStorage(root, capacity_bytes=capacity, spare_bytes=0) as storage:
        x, y, z, w = _keys(4)

        def meta(key: bytes) -> list[PageMeta]:
            return [PageMeta(key=key, namespace=NS, num_tokens=1)]

        def page(nbytes: int) -> list[list[memoryview]]:
            return [[memoryview(bytes(nbytes))]]

        assert await storage.put([x], page(big), meta(x)) == [Outcome.OK]
        assert await storage.put([y], page(small), meta(y)) == [Outcome.OK]
        # Only the first put's job is held (the second's runs).
        monkeypatch.setattr(_file._Job, "segments", _held_before(_file._Job.segments, gate))
        with _released(gate):
            first = asyncio.ensure_future(storage.put([z], page(small), meta(z)))  # evicts x
            await gate.wait_reached()
            assert await storage.put([w], page(big - small), meta(w)) == [Outcome.OK]
            first.cancel()
            await asyncio.sleep(0)
            gate.go.set()
            with contextlib.suppress(asyncio.CancelledError):
                await first
        assert _disk_usage(root)[1] <= capacity
        assert storage.stats().bytes <= capacity
        assert await storage.exists([x]) == 0


async def test_cancelled_puts_and_deletes_count_what_they_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writing, removing = _Gate(), _Gate()
    async with FileStorage(tmp_path / "store", io_threads=1) as storage:
        keys = _keys(2)
        # The first page is being written.
        monkeypatch.setattr(_native, "checksum", _held_before(_native.checksum, writing))
        with _released(writing):
            put = asyncio.ensure_future(storage.put(keys, _pages(keys), _metas(keys)))
            await writing.wait_reached()
            put.cancel()
            await asyncio.sleep(0)
            writing.go.set()
            with pytest.raises(asyncio.CancelledError):
                await put
        stored = [await storage.exists([key]) for key in keys]
        assert stored == [1, 0]  # the page under way lands whole; the next never starts
        assert storage.stats().put_ok == 1
        monkeypatch.undo()

        more = _keys(2)
        assert await storage.put(more, _pages(more), _metas(more)) == [Outcome.OK] * 2
        monkeypatch.setattr(_file, "_remove_page", _held_before(_file._remove_page, removing))
        with _released(removing):
            delete = asyncio.ensure_future(storage.delete(more))
            await removing.wait_reached()
            delete.cancel()
            await asyncio.sleep(0)
            removing.go.set()
            with pytest.raises(asyncio.CancelledError):
                await delete
        # Every page it took out of the index is removed, and counted.
        assert [await storage.exists([key]) for key in more] == [0, 0]
        assert storage.stats().deletes == 2


async def test_the_index_is_built_off_the_loop_untracked_and_oldest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A million pages sorted and indexed on the loop stalled it for seconds at open (an
    # attach while serving), and a million tracked entries made every full collection slow.
    keys = _keys(12)
    async with FileStorage(tmp_path) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 12
    base = time.time() - 1000
    order = [5, 0, 11, 3, 7, 1, 9, 2, 10, 4, 8, 6]
    for rank, i in enumerate(order):
        os.utime(_page_path(tmp_path, keys[i]), (base + rank, base + rank))
    builders: list[str] = []
    original = FileStorage._insert

    def recorded(self: FileStorage, *args: Any) -> Any:
        builders.append(threading.current_thread().name)
        return original(self, *args)

    monkeypatch.setattr(FileStorage, "_insert", recorded)
    async with FileStorage(tmp_path) as storage:
        assert builders
        assert threading.main_thread().name not in builders
        builders.clear()
        index = storage._index
        assert list(index) == [keys[i] for i in order]
        assert not any(gc.is_tracked(entry) for entry in index.values())
        assert [entry.seq for entry in index.values()] == sorted(e.seq for e in index.values())
        assert storage._bytes == sum(e.nbytes for e in index.values())
        await _assert_index_matches_disk(storage, tmp_path)
        # The next pages are ordered after them, and the oldest is evicted first.
        more = _keys(2)
        assert await _put(storage, more) == [Outcome.OK] * 2
        assert set(list(storage._index)[-2:]) == set(more)


async def test_verify_removes_dead_compactions_temp_files_unless_one_runs(tmp_path: Path) -> None:
    root = tmp_path / "store"
    async with FileStorage(root) as storage:
        await _put(storage, _keys(2))
        dead = root / ".manifest.jsonl.4242.0a0b0c0d.tmp"  # a process killed compacting
        dead.write_bytes(b'{"v":1}\n')
        # While a compaction holds the manifest's lock, its temp file is its own.
        async with _file_lock(root / "manifest.jsonl"):
            assert (await storage.verify()).leftovers_removed == 0
        assert dead.exists()
        assert (await storage.verify()).leftovers_removed == 1
        assert not dead.exists()
        assert storage.stats().pages == 2


async def test_a_keyboard_interrupt_in_the_close_still_releases_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    storage = FileStorage(root)
    await storage.__aenter__()
    await _put_and_delete(storage, 2)  # spare files, removed by the close on a job thread

    def interrupted(dir_fd: int, names: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_file, "_unlink_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        await storage.close()
    monkeypatch.undo()
    assert storage.closed
    # The lock went with the descriptors: the root opens again in this process.
    async with FileStorage(root) as again:
        assert await again.exists(_keys(1)) == 0


async def test_a_page_with_a_flag_this_release_does_not_know_is_a_miss_left_in_place(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    keys = _keys(2)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        path = _page_path(root, keys[0])
        value = bytearray(path.read_bytes())
        value[6] |= 2  # a flag bit a later release could define, header checksum made right
        value[120:128] = _native.checksum([memoryview(value)[:120]]).to_bytes(8, "little")
        path.write_bytes(bytes(value))
        assert await _get(storage, keys) == [Outcome.MISS, Outcome.OK]
        report = await storage.verify()
        assert (report.ok, report.corrupt_removed, report.unsupported) == (1, 0, 1)
        assert storage.stats().corrupt == 0
    assert path.read_bytes() == bytes(value)


async def test_concurrent_puts_stay_within_the_capacity_together(tmp_path: Path) -> None:
    """Room a put in progress reserved counts for the next put's plan: two puts running at
    once never store more than the capacity between them."""
    root = tmp_path / "store"
    keys = _keys(6)
    async with FileStorage(root, capacity_bytes=4 * SIZE) as storage:
        one, two = await asyncio.gather(_put(storage, keys[:3]), _put(storage, keys[3:]))
        assert one == [Outcome.OK] * 3
        assert two.count(Outcome.OK) >= 1
        stats = storage.stats()
        assert (stats.pages, stats.bytes) == (4, 4 * SIZE)
    assert _disk_usage(root) == (4, 4 * SIZE)


async def test_a_raw_read_cancelled_while_it_waits_for_a_thread_reads_nothing(
    tmp_path: Path,
) -> None:
    """A `read_raw` whose caller is cancelled while its job waits for the only thread does
    not read the file once a thread takes the job: nobody would take the bytes."""
    async with FileStorage(tmp_path / "s", io_threads=1) as storage:
        keys = _keys(1)
        assert await _put(storage, keys) == [Outcome.OK]
        # Every file job begins by taking the root's descriptors: counted, a job that went
        # to the disk shows.
        taken = 0
        handles_or_raise = storage._handles_or_raise

        def counted() -> Any:
            nonlocal taken
            taken += 1
            return handles_or_raise()

        storage._handles_or_raise = counted  # type: ignore[method-assign]
        entered, release = threading.Event(), threading.Event()

        def hold(stop: threading.Event) -> None:
            entered.set()
            release.wait(30)  # a hang guard only

        holder = asyncio.ensure_future(storage.run_job(hold))
        try:
            for _ in range(3000):  # until the only thread is in the held job
                if entered.is_set():
                    break
                await asyncio.sleep(0.001)
            assert entered.is_set()
            queued = asyncio.ensure_future(storage.read_raw(keys[0]))
            await asyncio.sleep(0)  # its job waits for the thread
            assert len(storage._jobs) == 2
            queued.cancel()
            await asyncio.sleep(0)
            release.set()
            await asyncio.wait_for(holder, 30)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(queued, 30)
            assert taken == 0  # its job went nowhere near the disk
            assert await storage.read_raw(keys[0]) is not None
            assert taken == 1
        finally:
            release.set()
            await asyncio.wait_for(holder, 30)


async def test_a_lookup_cancelled_while_it_waits_for_a_thread_leaves_its_stamps_to_the_stamper(
    tmp_path: Path,
) -> None:
    """A shared root's `exists` whose caller is cancelled while its job waits for the only
    thread touches no file once a thread takes the job (the cancellation waits for it); the
    use it counted in the index still reaches the disk, through the stamper."""
    root = tmp_path / "s"
    keys = _keys(2)
    async with FileStorage(root, shared=True) as storage:
        assert await _put(storage, keys[:1]) == [Outcome.OK]
    old = time.time_ns() - 100 * 10**9
    os.utime(_page_path(root, keys[0]), ns=(old, old))
    async with FileStorage(root, shared=True, io_threads=1) as storage:
        holds = [threading.Event(), threading.Event()]
        entered = threading.Event()

        def hold(release: threading.Event) -> Callable[[threading.Event], None]:
            def work(stop: threading.Event) -> None:
                entered.set()
                release.wait(30)  # a hang guard only

            return work

        first = asyncio.ensure_future(storage.run_job(hold(holds[0])))
        try:
            for _ in range(3000):  # until the only thread is in the held job
                if entered.is_set():
                    break
                await asyncio.sleep(0.001)
            assert entered.is_set()
            # The first key is indexed and due a stamp; the second is looked for on disk.
            queued = asyncio.ensure_future(storage.exists(keys))
            for _ in range(100):  # until its job waits for the thread
                if len(storage._jobs) == 2:
                    break
                await asyncio.sleep(0)
            assert len(storage._jobs) == 2
            queued.cancel()
            await asyncio.sleep(0)
            # Behind it, a job that holds the thread again: the stamper's comes after.
            second = asyncio.ensure_future(storage.run_job(hold(holds[1])))
            await asyncio.sleep(0)
            holds[0].set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(queued, 30)
            assert os.stat(_page_path(root, keys[0])).st_mtime_ns == old  # not by its job
            holds[1].set()
            await asyncio.wait_for(second, 30)
            for _ in range(3000):  # until the stamper has written it
                if storage._stamper is None and not storage._unstamped:
                    break
                await asyncio.sleep(0.001)
            assert os.stat(_page_path(root, keys[0])).st_mtime_ns > old
        finally:
            for release in holds:
                release.set()
            await asyncio.wait_for(first, 30)


async def test_a_cancelled_lookups_stamps_are_written_by_a_close_that_began_meanwhile(
    tmp_path: Path,
) -> None:
    """A shared root's `exists` cancelled while its job waited for the thread leaves its
    stamps to the store; a close that begins as that job returns (a detach cancels the
    lookups, then closes the store) writes them before it returns."""
    root = tmp_path / "s"
    keys = _keys(2)
    async with FileStorage(root, shared=True) as storage:
        assert await _put(storage, keys[:1]) == [Outcome.OK]
    old = time.time_ns() - 100 * 10**9
    os.utime(_page_path(root, keys[0]), ns=(old, old))
    storage = FileStorage(root, shared=True, io_threads=1)
    await storage.__aenter__()
    release, entered, returned, resume = (threading.Event() for _ in range(4))
    stat_job = storage._stat_job

    def held_after(*args: Any, **kwargs: Any) -> int:
        found = stat_job(*args, **kwargs)
        returned.set()
        resume.wait(30)  # a hang guard only: the close begins meanwhile
        return found

    storage._stat_job = held_after  # type: ignore[method-assign]

    def hold(stop: threading.Event) -> None:
        entered.set()
        release.wait(30)  # a hang guard only

    holder = asyncio.ensure_future(storage.run_job(hold))
    closing: asyncio.Future[None] | None = None
    try:
        for _ in range(3000):  # until the only thread is in the held job
            if entered.is_set():
                break
            await asyncio.sleep(0.001)
        assert entered.is_set()
        # The first key is indexed and due a stamp; the second is looked for on disk.
        queued = asyncio.ensure_future(storage.exists(keys))
        for _ in range(100):  # until its job waits for the thread
            if len(storage._jobs) == 2:
                break
            await asyncio.sleep(0)
        assert len(storage._jobs) == 2
        queued.cancel()
        await asyncio.sleep(0)
        release.set()
        await asyncio.wait_for(holder, 30)
        for _ in range(3000):  # until its job, given up, has returned on the thread
            if returned.is_set():
                break
            await asyncio.sleep(0.001)
        assert returned.is_set()
        closing = asyncio.ensure_future(storage.close())
        await asyncio.sleep(0)
        assert storage.closed
        resume.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(queued, 30)
        await asyncio.wait_for(closing, 30)
        assert os.stat(_page_path(root, keys[0])).st_mtime_ns > old
    finally:
        release.set()
        resume.set()
        await asyncio.wait_for(holder, 30)
        if closing is None:
            await storage.close()
