"""FileStorage when the file system says no: a process out of descriptors, a read-only file
system.

The small file systems are tmpfs mounts, made only when running as root where mounting is
permitted; those tests skip otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog
from test_file_storage import (
    _keys,
    _put,
)

from hicache_async import StorageConfigError, StorageError
from hicache_async.storage import FileStorage

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
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", flags or "defaults", "tmpfs", str(path)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        done = subprocess.run(["umount", str(path)], capture_output=True, check=False)
        if done.returncode != 0:  # still busy: detach it, it goes when the last user does
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def _remount(path: Path, how: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{how}", str(path)], check=True)


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


async def test_open_out_of_descriptors_is_a_storage_error(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        await _put(storage, _keys(2))
    storage = FileStorage(root)
    with _descriptors_left(4), pytest.raises(StorageError, match=r"ulimit -n"):
        await storage.__aenter__()  # the root's four descriptors, none to list tmp/


async def test_a_read_only_root_opens_for_a_look_only(tmpfs: Mount) -> None:
    disk = tmpfs("disk", size="4m")
    root = disk / "s"
    keys = _keys(3)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
    _remount(disk, "ro")
    try:
        with pytest.raises(StorageConfigError, match="read-only file system"):
            async with FileStorage(root):
                pass
        looking = FileStorage(root)
        looking._keep_leftovers = True  # as `hicache-async storage stats|ls` open it
        async with looking:
            assert looking.stats().pages == 3
            assert len(await looking.list_pages()) == 3
    finally:
        _remount(disk, "rw")
