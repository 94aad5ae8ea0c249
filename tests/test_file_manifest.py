"""The file manifest when the filesystem refuses a write part-way (a full disk, a file size
limit): an append lands whole or not at all, and a compaction leaves no temporary file.

The refusal is real: a child process runs the step under `RLIMIT_FSIZE`, so the kernel
writes up to the limit (a short write) and then refuses with EFBIG, as a full disk does with
ENOSPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _idle_child import IdleChild

from hicache_async.storage import _manifest
from hicache_async.storage._manifest import FileManifest, ManifestEntry, _file_lock, chain_entry

NS = b"n" * 16

# argv: the manifest's path, the file size limit, then "append" (of five records) or
# "compact". Prints the errno the step failed with, or "ok".
_CHILD = """
import asyncio, resource, signal, sys
from hicache_async.storage._manifest import FileManifest, chain_entry

path, limit, step = sys.argv[1], int(sys.argv[2]), sys.argv[3]
manifest = FileManifest(path)
entries = [
    chain_entry(b"n" * 16, [bytes([i, j]) * 16 for j in range(64)], 1024, 0, 2.0 + i)
    for i in range(5)
]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    asyncio.run(manifest.append(entries) if step == "append" else manifest.compact())
except OSError as exc:
    print(exc.errno)
else:
    print("ok")
"""


# argv: a path prefix for three lock files. Forks once the three are registered; in the child,
# the fork hook's first close runs a store's finalizer (as a collection there may) that closes
# another of them. Prints the child's exit code: 0 when every descriptor is closed in it and
# the registry's mutex is free for another of its threads.
_FORK_CHILD = """
import os, sys, threading
from hicache_async.storage import _flocks

fds = [
    _flocks.open_lock_fd(lambda n=n: os.open(f"{sys.argv[1]}.{n}", os.O_RDWR | os.O_CREAT, 0o600))
    for n in range(3)
]
plain_close, finalized = os.close, []

def close(fd):
    if not finalized:
        finalized.append(fd)
        _flocks.close_lock_fd(next(other for other in fds if other != fd))
    plain_close(fd)

os.close = close
pid = os.fork()
if pid == 0:
    os.close = plain_close
    taken = []
    mutex = _flocks._REGISTRY.mutex
    thread = threading.Thread(target=lambda: taken.append(mutex.acquire(timeout=5)))
    thread.start()
    thread.join()
    still_open = []
    for fd in fds:
        try:
            os.fstat(fd)
            still_open.append(fd)
        except OSError:
            pass
    os._exit(0 if taken == [True] and not still_open else 1)
os.close = plain_close
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_finalizer_run_by_the_child_s_fork_hook_leaves_it_whole(tmp_path: Path) -> None:
    # The hook iterated over the registered set while a finalizer it set off (a dropped store
    # collected in the child) changed it: it raised, left descriptors open and the mutex held,
    # and every later lock open in the child (a FileStorage's) hung.
    done = subprocess.run(
        [sys.executable, "-c", _FORK_CHILD, str(tmp_path / "lock")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "0", done.stderr


def _run_limited(path: Path, limit: int, step: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(limit), step],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _entry(i: int) -> ManifestEntry:
    keys = [i.to_bytes(4, "big") + bytes([j]) * 28 for j in range(8)]
    return chain_entry(NS, keys, 128, 0, float(i))


def test_an_append_that_fails_part_way_lands_nothing(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    asyncio.run(manifest.append([_entry(0)]))
    before = path.read_bytes()
    # Room for a record and a half of the five: the write is cut short, then refused.
    assert _run_limited(path, len(before) + 6000, "append") == str(errno.EFBIG)
    assert path.read_bytes() == before
    read = asyncio.run(manifest.read())
    assert [e.chain_id for e in read.entries] == [_entry(0).chain_id]
    assert read.malformed == 0
    # The next append lands whole, after the record that was there.
    asyncio.run(manifest.append([_entry(1)]))
    read = asyncio.run(manifest.read())
    assert {e.chain_id for e in read.entries} == {_entry(0).chain_id, _entry(1).chain_id}
    assert read.malformed == 0


def test_a_compaction_that_fails_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    asyncio.run(manifest.append([_entry(i) for i in range(40)]))
    before = path.read_bytes()
    # The compacted file would be as large: its temporary copy is refused part-way.
    assert _run_limited(path, len(before) // 2, "compact") == str(errno.EFBIG)
    assert _names(tmp_path) == [".manifest.jsonl.lock", "manifest.jsonl"]
    assert path.read_bytes() == before
    report = asyncio.run(manifest.compact())
    assert report.entries_after == 40


async def test_a_compaction_cancelled_before_its_rename_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    # Large enough that writing and syncing the temporary file take a while.
    for start in range(0, 3000, 500):
        await manifest.append([_entry(i) for i in range(start, start + 500)])
    before = path.read_bytes()
    compaction = asyncio.create_task(manifest.compact())
    deadline = time.monotonic() + 30
    while not any(name.endswith(".tmp") for name in _names(tmp_path)):
        assert not compaction.done()
        assert time.monotonic() < deadline
        await asyncio.sleep(0)
    compaction.cancel()
    with pytest.raises(asyncio.CancelledError):
        await compaction
    assert _names(tmp_path) == [".manifest.jsonl.lock", "manifest.jsonl"]
    assert path.read_bytes() == before


def _lock_is_free(path: Path) -> bool:
    """Whether an exclusive flock on the manifest's lock file can be taken now (through a
    descriptor of its own, so a copy held by any process counts)."""
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


async def test_a_child_forked_while_the_lock_is_held_does_not_keep_it(tmp_path: Path) -> None:
    # A flock belongs to the open file: a child holding a copy of the lock's descriptor (a
    # long-lived worker forked while an append or a compaction held it) would keep the
    # manifest locked after the parent released it, and every later append would wait on it.
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    async with _file_lock(path):
        child = IdleChild()
    try:
        await child.started()
        assert _lock_is_free(path)
        await manifest.append([_entry(0)])
        assert [e.chain_id for e in (await manifest.read()).entries] == [_entry(0).chain_id]
    finally:
        assert await child.exit() == 0


async def test_a_compaction_cancelled_while_its_temp_file_opens_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The temp file was opened on a thread the cancel did not wait for: the compaction removed
    # it before it existed, and the thread then made it, left until the next compaction.
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    await manifest.append([_entry(i) for i in range(4)])
    before = path.read_bytes()
    opening, go, opened = threading.Event(), threading.Event(), threading.Event()
    plain_open = _manifest._open_regular

    def held_open(name: str, flags: int) -> int:
        if not name.endswith(".tmp"):
            return plain_open(name, flags)
        opening.set()
        go.wait(30)
        try:
            return plain_open(name, flags)
        finally:
            opened.set()

    monkeypatch.setattr(_manifest, "_open_regular", held_open)
    compaction = asyncio.create_task(manifest.compact())
    assert await asyncio.to_thread(opening.wait, 30)
    compaction.cancel()
    with pytest.raises(asyncio.CancelledError):
        await compaction
    go.set()
    assert await asyncio.to_thread(opened.wait, 30)
    assert await asyncio.to_thread(_temp_files_after, tmp_path, 10.0) == []
    assert path.read_bytes() == before


def _temp_files_after(directory: Path, wait_s: float) -> list[Path]:
    """The manifest's temp files in `directory` once there are none, or after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while (temps := list(directory.glob(".manifest.jsonl.*.tmp"))) and time.monotonic() < deadline:
        time.sleep(0.01)
    return temps


async def test_an_append_leaves_a_hard_linked_copy_of_the_manifest_as_it_was(
    tmp_path: Path,
) -> None:
    # A snapshot of the root made with hard links (`cp -al`, `rsync --link-dest`) names the
    # manifest's file too: appends after it must not change the snapshot.
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    first = chain_entry(NS, [bytes([1]) * 32], 16, 0, 1.0)
    second = chain_entry(NS, [bytes([2]) * 32], 16, 0, 2.0)
    await manifest.append([first])
    snapshot = tmp_path / "snapshot.jsonl"
    os.link(path, snapshot)
    before = snapshot.read_bytes()
    await manifest.append([second])
    assert snapshot.read_bytes() == before
    assert path.stat().st_nlink == 1
    assert (path.stat().st_mode & 0o777) == 0o600
    read = await manifest.read()
    assert {entry.chain_id for entry in read.entries} == {first.chain_id, second.chain_id}
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".manifest.jsonl.lock", "manifest.jsonl", "snapshot.jsonl"]
    )


async def test_the_copy_replacing_a_hard_linked_manifest_is_synced_before_it_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a compaction's temporary file is: the rename may reach the disk before the copy's
    # data, and a crash then would leave the manifest empty where it held every record.
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    await manifest.append([chain_entry(NS, [bytes([1]) * 32], 16, 0, 1.0)])
    os.link(path, tmp_path / "snapshot.jsonl")
    synced: list[int] = []
    replaced: list[tuple[int, list[int]]] = []
    plain_fsync, plain_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        plain_fsync(fd)

    def replace(src: str, dst: str) -> None:
        replaced.append((os.stat(src).st_ino, list(synced)))
        plain_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    await manifest.append([chain_entry(NS, [bytes([2]) * 32], 16, 0, 2.0)])
    assert len(replaced) == 1
    copy, synced_before = replaced[0]
    assert copy in synced_before


def test_a_read_cancelled_while_its_file_opens_closes_the_file(tmp_path: Path) -> None:
    # The open runs on a worker thread that finishes it after the cancel: the file it opened
    # must be closed then, not left to the collector.
    import gc
    import warnings

    path = tmp_path / "manifest.jsonl"
    path.write_bytes(b"{}\n" * 10)

    async def main() -> None:
        async def read() -> None:
            async for _ in _manifest._lines(path, _manifest.ManifestLimits()):
                continue

        for i in range(200):
            task = asyncio.ensure_future(read())
            for _ in range(i % 3):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    gc.collect()  # what earlier tests left, before counting
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        asyncio.run(main())  # ends once the worker threads did (its executor's shutdown)
        gc.collect()
    assert [w for w in caught if str(path) in str(w.message)] == []


def test_a_read_cancelled_while_its_file_opens_as_the_loop_ends_closes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop ends (cancelling what is left) while the worker thread is still opening: the
    # file must be closed all the same.
    import gc
    import warnings

    path = tmp_path / "manifest.jsonl"
    path.write_bytes(b"{}\n" * 10)
    entered = threading.Event()
    go_on = threading.Event()
    opener = _manifest._open_regular

    def held_opener(name: str, flags: int) -> int:
        entered.set()
        go_on.wait(60)
        return opener(name, flags)

    monkeypatch.setattr(_manifest, "_open_regular", held_opener)

    async def main() -> None:
        async def read() -> None:
            async for _ in _manifest._lines(path, _manifest.ManifestLimits()):
                continue

        task = asyncio.ensure_future(read())
        for _ in range(60_000):  # polled: the default executor is the one under test
            if entered.is_set():
                break
            await asyncio.sleep(0.001)
        assert entered.is_set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        go_on.set()  # the open ends while the loop shuts down

    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        asyncio.run(main())
        gc.collect()
    assert [w for w in caught if str(path) in str(w.message)] == []
