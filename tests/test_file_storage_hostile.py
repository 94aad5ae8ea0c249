"""FileStorage against a root damaged or changed behind its back: huge or extended files,
entries that cannot be removed, a vanished tmp/, races with maintenance."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from test_file_storage import NS, SIZE, _get, _keys, _page_path, _put

from hicache_async.storage import FileStorage, Outcome, PageMeta, encode_header

_GIB = 1 << 30


async def _store(root: Path, keys: list[bytes]) -> None:
    async with FileStorage(root) as storage:
        await _put(storage, keys)


def _plant_sparse_page(root: Path, key: bytes, payload_nbytes: int) -> Path:
    """A page file whose header (checksummed, consistent) claims `payload_nbytes`, backed by a
    sparse file of that length: costs no disk, reads as zeros."""
    zeros = memoryview(bytes(1 << 20))
    pieces = [zeros] * (payload_nbytes // zeros.nbytes)  # only lengths matter to the header
    header = encode_header(PageMeta(key=key, namespace=NS, num_tokens=1), pieces, checksum=0)
    path = _page_path(root, key)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    with open(path, "wb") as file:
        file.write(header)
        file.truncate(len(header) + payload_nbytes)
    path.chmod(0o600)
    return path


def test_verify_memory_does_not_follow_a_huge_header(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = _keys(2)
    asyncio.run(_store(root, keys))
    huge = _keys(1)[0]
    _plant_sparse_page(root, huge, 2 * _GIB)
    # A child whose address space cannot hold a buffer of the claimed size: verify must
    # still check every page (the planted one fails its checksum and goes).
    script = textwrap.dedent(
        f"""
        import asyncio, resource
        from hicache_async.storage import FileStorage
        async def main():
            async with FileStorage({str(root)!r}) as storage:
                report = await storage.verify()
                print(report.checked, report.ok, report.corrupt_removed, report.unchecked)
        import hicache_async.storage._file  # everything loaded before the limit
        with open("/proc/self/statm") as statm:
            limit = int(statm.read().split()[0]) * {resource.getpagesize()} + {_GIB}
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].split() == ["3", "2", "1", "0"]  # after the log
    assert not _page_path(root, huge).exists()


async def test_a_file_no_page_can_be_is_evicted_first(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = _keys(8)
    async with FileStorage(root, capacity_bytes=8 * SIZE) as storage:
        await _put(storage, keys)
    past = time.time() - 100
    for key in keys:
        os.utime(_page_path(root, key), (past, past))
    # Changed by someone else, so the most recently touched: one extended (sparse) far past
    # the capacity, one cut shorter than a header.
    os.truncate(_page_path(root, keys[0]), 10 * _GIB)
    os.truncate(_page_path(root, keys[1]), 5)
    sound = keys[2:]
    async with FileStorage(root, capacity_bytes=8 * SIZE) as storage:
        new = _keys(1)
        assert await _put(storage, new) == [Outcome.OK]
        assert storage.stats().evictions <= 2
        assert not _page_path(root, keys[0]).exists()
        assert await _get(storage, sound + new) == [Outcome.OK] * 7
