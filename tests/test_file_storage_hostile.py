"""FileStorage against a root damaged or changed behind its back: huge or extended files,
entries that cannot be removed, a vanished tmp/, races with maintenance."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import resource
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog
from test_file_storage import (
    NS,
    SIZE,
    _assert_index_matches_disk,
    _Gate,
    _get,
    _keys,
    _page_path,
    _put,
    _released,
)
from test_file_storage_maintenance import _VERIFY_PAGES, _damaged_store

from hicache_async import StorageConfigError, StorageError
from hicache_async.storage import (
    HEADER_NBYTES,
    FileStorage,
    Outcome,
    PageHeader,
    PageMeta,
    VerifyReport,
    _file,
    encode_header,
)
from hicache_async.storage._manifest import chain_entry
from hicache_async.storage._page import PayloadVerifier

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
    # still check every other page, and leave the planted one, whose file has holes, unread
    # and unchecked (a sound page copied sparse has holes too).
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
    assert done.stdout.splitlines()[-1].split() == ["2", "2", "0", "1"]  # after the log
    assert _page_path(root, huge).exists()


def test_deletes_unlink_pages_when_tmp_cannot_be_written(tmp_path: Path) -> None:
    # Deletes move pages into tmp/ as spare files; with tmp/ read-only they are unlinked.
    # Root writes anywhere, so the child drops the capabilities that let it.
    root = tmp_path / "s"
    script = textwrap.dedent(
        f"""
        import asyncio, os
        from hicache_async.storage import FileStorage, Outcome, PageMeta
        keys = [bytes([i]) * 32 for i in range(1, 4)]
        async def main():
            async with FileStorage({str(root)!r}, spare_bytes=1 << 20) as storage:
                pages = [[memoryview(bytearray(key[:1] * 1024))] for key in keys]
                metas = [PageMeta(key=k, namespace=bytes(16), num_tokens=1) for k in keys]
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 3
                os.chmod({str(root / "tmp")!r}, 0o500)
                print(await storage.delete(keys[:2]), await storage.exists(keys[2:]))
        asyncio.run(main())
        """
    )
    command = [sys.executable, "-c", script]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to run without root's permission overrides")
        caps = "-dac_override,-dac_read_search,-fowner"
        command = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", *command]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    (root / "tmp").chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["2", "1"]
    assert sorted(p.name for p in (root / "pages").rglob("*") if p.is_file()) == [
        (bytes([3]) * 32).hex()
    ]


def _run_without_overrides(script: str) -> subprocess.CompletedProcess[str]:
    """Runs `script` in a child that root's permission overrides do not let past a mode."""
    command = [sys.executable, "-c", script]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to run without root's permission overrides")
        caps = "-dac_override,-dac_read_search,-fowner"
        command = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", *command]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.run(command, capture_output=True, text=True, env=env, check=False)


def test_a_shard_made_again_and_unreadable_again_is_logged_again(tmp_path: Path) -> None:
    # Logged once while it stays unreadable; once it is gone, the shard made again in its
    # place is another directory, and its being unreadable is news again.
    root = tmp_path / "s"
    shard = root / "pages" / "ab"
    script = textwrap.dedent(
        f"""
        import asyncio, os, shutil
        import structlog
        from hicache_async.storage import FileStorage, Outcome, PageMeta

        keys = [bytes([0xAB]) * 32, bytes([0xAB, 1]) * 16]

        async def put(storage, key):
            page = [[memoryview(bytearray(1024))]]
            meta = [PageMeta(key=key, namespace=bytes(16), num_tokens=1)]
            assert await storage.put([key], page, meta) == [Outcome.OK]

        async def main():
            async with FileStorage({str(root)!r}) as storage:
                await put(storage, keys[0])
                with structlog.testing.capture_logs() as logs:
                    os.chmod({str(shard)!r}, 0)
                    first = await storage.verify()
                    again = await storage.verify()
                    os.chmod({str(shard)!r}, 0o700)
                    shutil.rmtree({str(shard)!r})
                    gone = await storage.verify()
                    await put(storage, keys[1])
                    os.chmod({str(shard)!r}, 0)
                    last = await storage.verify()
                    os.chmod({str(shard)!r}, 0o700)
            print([r.unchecked for r in (first, again, gone, last)])
            print(sum(e["event"] == "storage.shard.unreadable" for e in logs))
        asyncio.run(main())
        """
    )
    done = _run_without_overrides(script)
    if shard.exists():
        shard.chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-3:-1] == ["[1, 1, 0, 1]", "2"]


@pytest.mark.parametrize("directory", ["pages", "tmp"])
def test_maintenance_of_an_open_store_with_an_unreadable_directory(
    tmp_path: Path, directory: str
) -> None:
    # pages/ unreadable: no scan can tell anything, a StorageError naming it. tmp/ unreadable:
    # counted unchecked, as an unreadable shard is, and the pages are still verified.
    root = tmp_path / "s"
    script = textwrap.dedent(
        f"""
        import asyncio, os
        from hicache_async import StorageError
        from hicache_async.storage import FileStorage, Outcome, PageMeta
        keys = [bytes([i]) * 32 for i in range(1, 4)]
        async def main():
            async with FileStorage({str(root)!r}) as storage:
                pages = [[memoryview(bytearray(key[:1] * 1024))] for key in keys]
                metas = [PageMeta(key=k, namespace=bytes(16), num_tokens=1) for k in keys]
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 3
                os.chmod({str(root / directory)!r}, 0)
                for call in (storage.verify, storage.gc):
                    try:
                        print("ok", await call())
                    except StorageError as exc:
                        print("error", exc)
        asyncio.run(main())
        """
    )
    done = _run_without_overrides(script)
    (root / directory).chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()[-2:]
    if directory == "pages":
        for line in lines:
            assert line.startswith(f"error {root / 'pages'}: Permission denied"), line
            assert "chmod u+rx" in line
    else:
        assert lines[0].startswith("ok VerifyReport("), lines
        assert "checked=3, ok=3" in lines[0]
        assert "unchecked=1" in lines[0]
        assert lines[1].startswith("ok GcReport("), lines


def test_an_unreadable_manifest_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    # Its reader, appender and compaction, and the `manifest` command (exit 1: the store
    # failed), each say which file and what to do, not a bare PermissionError.
    root = tmp_path / "s"
    manifest = root / "manifest.jsonl"
    script = textwrap.dedent(
        f"""
        import asyncio, os
        from hicache_async import StorageError
        from hicache_async.cli import main as cli
        from hicache_async.storage import FileStorage
        from hicache_async.storage._manifest import chain_entry

        async def main():
            async with FileStorage({str(root)!r}) as storage:
                manifest = storage.manifest()
                await manifest.append([chain_entry(bytes(16), [bytes(32)], 1, 1, 1.0)])
                os.chmod({str(manifest)!r}, 0)
                calls = (
                    manifest.read,
                    lambda: manifest.append([chain_entry(bytes(16), [bytes(32)], 1, 1, 1.0)]),
                    manifest.compact,
                )
                for call in calls:
                    try:
                        print("ok", await call())
                    except StorageError as exc:
                        print("error", exc)

        asyncio.run(main())
        for action in ("show", "compact"):
            print("exit", cli(["manifest", action, {root.as_uri()!r}]))
        """
    )
    done = _run_without_overrides(script)
    if manifest.exists():
        manifest.chmod(0o600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[-5:-2] == [f"error {manifest}: Permission denied: {_MANIFEST_HINT}"] * 3, lines
    assert lines[-2:] == ["exit 1", "exit 1"], lines
    expected = f"error: StorageError: {manifest}: Permission denied: {_MANIFEST_HINT}"
    assert done.stderr.count(expected) == 2, done.stderr[-2000:]


_MANIFEST_HINT = "give this user read and write permission on it (chmod u+rw)"


def test_verify_says_an_unreadable_page_it_cannot_remove_is_unreadable(tmp_path: Path) -> None:
    # In the shape of a corrupt page that stays: what the page is, then why it stays.
    root = tmp_path / "s"
    key = bytes([0xCD]) * 32
    page, shard = root / "pages" / "cd" / key.hex(), root / "pages" / "cd"
    script = textwrap.dedent(
        f"""
        import asyncio, os
        import structlog
        from hicache_async.storage import FileStorage, Outcome, PageMeta

        async def main():
            async with FileStorage({str(root)!r}) as storage:
                meta = [PageMeta(key={key!r}, namespace=bytes(16), num_tokens=1)]
                page = [[memoryview(bytearray(1024))]]
                assert await storage.put([{key!r}], page, meta) == [Outcome.OK]
                os.chmod({str(page)!r}, 0)
                os.chmod({str(shard)!r}, 0o500)  # the page cannot be removed
                with structlog.testing.capture_logs() as logs:
                    report = await storage.verify()
                print(report.unchecked, report.corrupt_removed)
                for entry in logs:
                    if entry["event"] == "storage.page.error":
                        print(entry["key"], entry["error"])

        asyncio.run(main())
        """
    )
    done = _run_without_overrides(script)
    shard.chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-2:] == [
        "1 0",
        f"{key.hex()} unreadable, cannot remove it: Permission denied",
    ]


def _failing_listing(
    monkeypatch: pytest.MonkeyPatch, directory: Path, where: str, error: int = errno.EIO
) -> Callable[[], None]:
    """Makes listing `directory` fail with `error` (at its open for the listing, or at the
    listing itself), as a failing disk would; the returned call heals it."""
    real_open, real_scandir = os.open, os.scandir
    healed = threading.Event()

    def names_it(fd: object) -> bool:
        if healed.is_set() or not isinstance(fd, int):
            return False
        try:
            return os.readlink(f"/proc/self/fd/{fd}") == str(directory)
        except OSError:
            return False

    def failing_open(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if where == "open" and path == "." and names_it(dir_fd):
            raise OSError(error, os.strerror(error))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def failing_scandir(path: object = ".") -> object:
        if where == "list" and names_it(path):
            raise OSError(error, os.strerror(error))
        return real_scandir(path)  # type: ignore[call-overload]

    monkeypatch.setattr(_file.os, "open", failing_open)
    monkeypatch.setattr(_file.os, "scandir", failing_scandir)
    return healed.set


@pytest.mark.parametrize("where", ["open", "list"])
async def test_a_tmp_that_cannot_be_listed_is_unchecked_and_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # Not only a refused permission: an I/O error or no descriptor left hides tmp/'s
    # leftovers alike. The pages are still verified; the open and gc() go on.
    root, keys = tmp_path / "s", _keys(3)
    await _store(root, keys)
    heal = _failing_listing(monkeypatch, root / "tmp", where)
    with structlog.testing.capture_logs() as logs:
        async with FileStorage(root) as storage:
            first = await storage.verify()
            again = await storage.verify()
            assert (await storage.gc()).failed == 0
            heal()
            healed = await storage.verify()
            monkeypatch.undo()
            _failing_listing(monkeypatch, root / "tmp", where)
            other = await storage.verify()
    assert [(r.ok, r.unchecked) for r in (first, again, healed, other)] == [
        (3, 1),
        (3, 1),
        (3, 0),
        (3, 1),
    ]
    told = [e for e in logs if e["event"] == "storage.stray.error" and e["entry"] == "tmp"]
    # The open's and the first verify's: once; again once it failed after a listing.
    assert [e["error"] for e in told] == [f"{os.strerror(errno.EIO)}: cannot list it"] * 2


async def test_a_tmp_removed_made_again_and_unlistable_again_is_logged_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a shard found gone: the tmp/ a write made again is another directory, whose
    # failure is news even with no listing of it between.
    root, keys = tmp_path / "s", _keys(3)
    async with FileStorage(root) as storage:
        await _put(storage, keys[:1])
        with structlog.testing.capture_logs() as logs:
            heal = _failing_listing(monkeypatch, root / "tmp", "list")
            before = await storage.verify()
            heal()
            monkeypatch.undo()
            shutil.rmtree(root / "tmp")
            assert await _put(storage, keys[1:]) == [Outcome.OK] * 2  # makes tmp/ again
            _failing_listing(monkeypatch, root / "tmp", "list")
            after = await storage.verify()
    assert [(r.ok, r.unchecked) for r in (before, after)] == [(3 - 2, 1), (3, 1)]
    told = [e for e in logs if e["event"] == "storage.stray.error" and e["entry"] == "tmp"]
    assert len(told) == 2, told


@pytest.mark.parametrize("where", ["open", "list"])
async def test_a_pages_directory_that_cannot_be_listed_is_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    root, keys = tmp_path / "s", _keys(3)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        _failing_listing(monkeypatch, root / "pages", where)
        for call in (storage.verify, storage.gc):
            with pytest.raises(StorageError) as raised:
                await call()
            assert str(raised.value) == (
                f"{root / 'pages'}: {os.strerror(errno.EIO)}: cannot list the pages"
            )


async def test_a_shard_fixed_and_unreadable_again_is_logged_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once per change seen: while it stays unreadable, once; a page of it read meanwhile
    # shows it was fixed, so its next failure is news again, even with no scan between.
    root, keys = tmp_path / "s", _keys(3)
    shard = root / "pages" / keys[0].hex()[:2]
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        with structlog.testing.capture_logs() as logs:
            heal = _failing_listing(monkeypatch, shard, "list")
            broken = [await storage.verify(), await storage.verify()]
            heal()
            assert await _get(storage, keys[:1]) == [Outcome.OK]
            monkeypatch.undo()
            _failing_listing(monkeypatch, shard, "list")
            broken += [await storage.verify(), await storage.verify()]
    assert [report.unchecked for report in broken] == [1] * 4
    told = [e for e in logs if e["event"] == "storage.shard.unreadable"]
    assert [e["directory"] for e in told] == [str(shard)] * 2


async def test_a_shard_removed_made_again_and_unreadable_again_is_logged_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shard a write made again is another directory: its failure is news even with no
    # scan between to find the old one gone.
    root, keys = tmp_path / "s", _keys(1)
    shard = root / "pages" / keys[0].hex()[:2]
    again = [bytes.fromhex(keys[0].hex()[:2]) + os.urandom(31)]
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        with structlog.testing.capture_logs() as logs:
            heal = _failing_listing(monkeypatch, shard, "list")
            before = await storage.verify()
            heal()
            monkeypatch.undo()
            shutil.rmtree(shard)
            assert await _put(storage, again) == [Outcome.OK]  # makes the shard again
            _failing_listing(monkeypatch, shard, "list")
            after = await storage.verify()
    assert [(r.ok, r.unchecked) for r in (before, after)] == [(0, 1), (0, 1)]
    told = [e for e in logs if e["event"] == "storage.shard.unreadable"]
    assert [e["directory"] for e in told] == [str(shard)] * 2


async def test_a_shard_its_owner_may_search_but_not_read_is_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # chmod u-r: its pages still open by name, its listing is refused. A page read from it
    # shows nothing was fixed, so the scans after it do not log it again.
    root, keys = tmp_path / "s", _keys(3)
    shard = root / "pages" / keys[0].hex()[:2]
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        shard.chmod(0o300)
        try:
            with structlog.testing.capture_logs() as logs:
                # Refused as it would be for a user other than root, whom no mode stops.
                _failing_listing(monkeypatch, shard, "open", errno.EACCES)
                reports = [await storage.verify()]
                for _ in range(2):
                    assert await _get(storage, keys[:1]) == [Outcome.OK]
                    reports.append(await storage.verify())
        finally:
            monkeypatch.undo()
            shard.chmod(0o700)
    assert [report.unchecked for report in reports] == [1] * 3
    told = [e for e in logs if e["event"] == "storage.shard.unreadable"]
    assert [e["directory"] for e in told] == [str(shard)]


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
        # A lookup finds every file (a use of each): it must not make the misfits recent.
        assert await storage.exists(keys) == len(keys)
        new = _keys(1)
        assert await _put(storage, new) == [Outcome.OK]
        assert storage.stats().evictions <= 2
        assert not _page_path(root, keys[0]).exists()
        assert await _get(storage, sound + new) == [Outcome.OK] * 7


# One entry that cannot be removed is logged and counted, never fails the whole operation.


@pytest.fixture
def immutable() -> Iterator[Callable[[Path], None]]:
    """Makes a file immutable (`chattr +i`: even root cannot unlink it), undone at teardown
    so the temporary directory can go."""
    marked: list[Path] = []

    def mark(path: Path) -> None:
        try:
            done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
        except FileNotFoundError:
            pytest.skip("chattr is not installed")
        if done.returncode != 0:
            pytest.skip(f"chattr +i does not work here: {done.stderr.decode().strip()}")
        marked.append(path)

    yield mark
    for path in marked:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)


async def test_pages_that_stay_are_logged_once_per_call_and_error(
    tmp_path: Path, immutable: Callable[[Path], None]
) -> None:
    # Every page of a gc() or delete() fails alike (immutable shards here, a read-only remount
    # in use): one line per call and error, with the count and a few keys, not one per page.
    root, keys = tmp_path / "s", _keys(40)
    async with FileStorage(root) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 40
    for shard in (root / "pages").iterdir():
        immutable(shard)
    async with FileStorage(root, capacity_bytes=SIZE) as storage:
        with structlog.testing.capture_logs() as logs:
            assert (await storage.gc()).failed == 39
            assert (await storage.gc()).failed == 39
            assert await storage.delete(keys) == 0
            assert await storage.delete(keys) == 0
        assert storage.stats().pages == 40
    stayed = [entry for entry in logs if entry["event"].endswith((".evict.error", ".delete.error"))]
    assert [entry["event"] for entry in stayed] == ["storage.evict.error"] * 2 + [
        "storage.delete.error"
    ] * 2
    assert [entry["pages"] for entry in stayed] == [39, 39, 40, 40]
    for entry in stayed:
        assert entry["error"] == os.strerror(1)  # EPERM, without a file's name
        assert len(entry["keys"]) == 3
        assert {bytes.fromhex(key) for key in entry["keys"]} <= set(keys)


async def test_pages_in_refused_shards_are_logged_once_per_call(tmp_path: Path) -> None:
    # A refusal's text names its shard directory: the pages that stay in refused shards are
    # still one line per call, not one per shard.
    root, keys = tmp_path / "s", _keys(40)
    async with FileStorage(root, shared=True) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 40
    shards = list((root / "pages").iterdir())
    for shard in shards:
        shard.chmod(0o777)
    with structlog.testing.capture_logs() as logs:
        async with FileStorage(root, shared=True) as storage:
            assert await storage.delete(keys) == 0
    stayed = [entry for entry in logs if entry["event"] == "storage.delete.error"]
    assert [entry["pages"] for entry in stayed] == [40]
    assert str(root) not in stayed[0]["error"]
    refused = [entry for entry in logs if entry["event"] == "storage.shard.refused"]
    assert len(refused) == len(shards)  # each directory named once, there


async def test_verify_keeps_going_past_a_corrupt_page_it_cannot_remove(
    tmp_path: Path, immutable: Callable[[Path], None]
) -> None:
    root, keys = tmp_path / "s", _keys(3)
    await _store(root, keys)
    async with FileStorage(root) as storage:
        path = _page_path(root, keys[0])
        data = bytearray(path.read_bytes())
        data[HEADER_NBYTES + 5] ^= 0xFF
        path.write_bytes(data)
        immutable(path)
        with structlog.testing.capture_logs() as logs:
            report = await storage.verify()
        assert (report.ok, report.corrupt_removed, report.unchecked) == (2, 0, 1)
        assert [entry["key"] for entry in logs if entry["event"] == "storage.page.error"] == [
            keys[0].hex()
        ]
        assert storage.stats().corrupt == 0  # nothing was removed
        assert await _get(storage, keys[1:]) == [Outcome.OK] * 2


def test_verify_on_several_threads_leaves_what_cannot_be_removed_unchecked(
    tmp_path: Path, immutable: Callable[[Path], None]
) -> None:
    root = tmp_path / "s"
    _, corrupt, unsupported = _damaged_store(root)
    stuck = corrupt[::5]  # spread over the scan, so over the threads
    for key in stuck:
        immutable(_page_path(root, key))

    async def verify() -> VerifyReport:
        async with FileStorage(root, io_threads=4) as storage:
            return await storage.verify()

    report = asyncio.run(verify())
    assert report.corrupt_removed == len(corrupt) - len(stuck)
    assert report.unchecked == len(stuck)
    assert report.checked == _VERIFY_PAGES - len(stuck)
    assert report.unsupported == len(unsupported)
    assert all(_page_path(root, key).exists() for key in stuck)


async def test_a_leftover_that_cannot_be_removed_fails_neither_open_nor_verify(
    tmp_path: Path, immutable: Callable[[Path], None]
) -> None:
    root, keys = tmp_path / "s", _keys(2)
    await _store(root, keys)
    stuck = root / "tmp" / "stuck.tmp"
    stuck.write_bytes(b"x")
    (root / "tmp" / "gone.tmp").write_bytes(b"x")
    past = time.time() - 3600  # a leftover to verify() too
    os.utime(stuck, (past, past))
    immutable(stuck)
    with structlog.testing.capture_logs() as logs:
        async with FileStorage(root) as storage:
            assert storage.leftovers_removed_at_open == 1
            assert await _get(storage, keys) == [Outcome.OK] * 2
            report = await storage.verify()
            assert (report.ok, report.leftovers_removed, report.unchecked) == (2, 1, 1)
    errors = [entry["entry"] for entry in logs if entry["event"] == "storage.stray.error"]
    assert errors == ["stuck.tmp", "stuck.tmp"]  # at open, then by verify()


def _plant_tree(where: Path, *, depth: int, width: int = 0) -> None:
    """A directory `depth` levels deep with a file at the bottom, and `width` empty
    subdirectories beside the first level."""
    where.parent.mkdir(mode=0o700, exist_ok=True)
    where.mkdir()
    for n in range(width):
        (where / f"w{n}").mkdir()
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = below
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    os.close(fd)


async def test_verify_removes_a_stray_tree_listing_each_directory_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    keys = _keys(3)
    listed: list[int] = []
    empty_but_dirs = _file._empty_but_dirs

    def counted(fd: int) -> list[str]:
        listed.append(fd)
        return empty_but_dirs(fd)

    monkeypatch.setattr(_file, "_empty_but_dirs", counted)
    async with FileStorage(root) as storage:
        await _put(storage, keys[:2])
        # Where keys[2]'s page belongs: 60 levels, and 300 directories beside the first.
        where = _page_path(root, keys[2])
        _plant_tree(where, depth=60, width=300)
        report = await storage.verify()
        assert (report.ok, report.leftovers_removed, report.unchecked) == (2, 1, 0)
        assert not where.exists()
        assert len(listed) == 1 + 60 + 300  # once each: climbing back never lists again
        assert await _put(storage, keys[2:]) == [Outcome.OK]


async def test_verify_leaves_a_stray_tree_too_deep_to_be_a_leftover(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = _keys(3)
    async with FileStorage(root) as storage:
        await _put(storage, keys[:2])
        where = _page_path(root, keys[2])
        _plant_tree(where, depth=100)
        with structlog.testing.capture_logs() as logs:
            report = await storage.verify()
        assert (report.ok, report.leftovers_removed, report.unchecked) == (2, 0, 1)
        assert where.is_dir()  # left, and said so
        errors = [e for e in logs if e["event"] == "storage.stray.error"]
        assert len(errors) == 1
        assert "deeper than 64 levels" in errors[0]["error"]


# tmp/ removed under a running instance.


async def test_removal_and_writes_work_after_tmp_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = _keys(8)
    async with FileStorage(root, capacity_bytes=8 * SIZE, spare_bytes=4 * SIZE) as storage:
        await _put(storage, keys)
        await storage.delete(keys[:1])  # one spare file, gone with tmp/
        shutil.rmtree(root / "tmp")
        # Deletes and evictions would move pages into tmp/: they unlink them instead.
        assert await storage.delete(keys[1:3]) == 2
        assert not _page_path(root, keys[1]).exists()
        await _assert_index_matches_disk(storage, root)
        with structlog.testing.capture_logs() as logs:
            more = _keys(6)  # 3 fit, then 3 evictions
            assert await _put(storage, more) == [Outcome.OK] * 6
        assert [entry["event"] for entry in logs] == ["storage.tmp.recreated"]
        assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o700
        assert storage.stats().evictions == 3
        await _assert_index_matches_disk(storage, root)
        assert await _get(storage, more) == [Outcome.OK] * 6


async def test_writes_work_after_a_shard_directory_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = [bytes.fromhex("ab" + f"{i:02x}" * 31) for i in range(4)]
    async with FileStorage(root) as storage:
        assert await _put(storage, keys[:2]) == [Outcome.OK] * 2
        shutil.rmtree(root / "pages" / "ab")
        with structlog.testing.capture_logs() as logs:
            assert await _put(storage, keys[2:]) == [Outcome.OK] * 2
        assert [entry["event"] for entry in logs] == ["storage.shard.recreated"]
        assert stat.S_IMODE((root / "pages" / "ab").stat().st_mode) == 0o700
        assert await _get(storage, keys) == [Outcome.MISS] * 2 + [Outcome.OK] * 2
        await _assert_index_matches_disk(storage, root)


async def test_a_store_dropped_open_warns_and_frees_its_root(tmp_path: Path) -> None:
    # Entered and never closed: once collected, its descriptors are closed (the root's lock
    # with them) and its job threads end, with a ResourceWarning saying it was not closed.
    root = tmp_path / "s"
    storage = FileStorage(root)
    await storage.__aenter__()
    await _put(storage, _keys(2))
    threads = list(storage._executor._threads)
    assert threads
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        del storage  # collected here, or by the collection for a cycle
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == [
        f"storage backend file://{root} was never closed; close it or use `async with`"
    ]
    for thread in threads:
        await asyncio.to_thread(thread.join, 60)
        assert not thread.is_alive()
    async with FileStorage(root) as again:
        assert again.stats().pages == 2


async def test_an_emptied_root_is_made_again_and_stays_locked(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        old = _keys(4)
        assert await _put(storage, old) == [Outcome.OK] * 4
        for entry in root.iterdir():  # someone clears the cache by hand: rm -rf root/*
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        with structlog.testing.capture_logs() as logs:
            new = _keys(6)
            assert await _put(storage, new) == [Outcome.OK] * 6
        events = [entry["event"] for entry in logs]
        assert "storage.pages.recreated" in events or "storage.tmp.recreated" in events
        assert "storage.lock.recreated" in events
        assert await _get(storage, new) == [Outcome.OK] * 6
        assert await _get(storage, old) == [Outcome.MISS] * 4
        await _assert_index_matches_disk(storage, root)
        # LOCK was made again and taken: a second private instance is still refused.
        with pytest.raises(StorageConfigError, match="in use by another instance"):
            async with FileStorage(root):
                pytest.fail("a second private instance opened a root in use")
    async with FileStorage(root) as storage:
        assert await _get(storage, new) == [Outcome.OK] * 6


async def test_an_instance_whose_emptied_root_another_took_writes_nothing_there(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as first:
        assert await _put(first, _keys(2)) == [Outcome.OK] * 2
        for entry in root.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        async with FileStorage(root) as second:  # the root is free: LOCK went
            theirs = _keys(2)
            assert await _put(second, theirs) == [Outcome.OK] * 2
            with structlog.testing.capture_logs() as logs:
                assert await _put(first, _keys(3)) == [Outcome.ERROR] * 3
                assert await _put(first, _keys(1)) == [Outcome.ERROR]
            events = [entry["event"] for entry in logs]
            assert events.count("storage.lock.lost") == 1  # once, not at every write
            assert "storage.pages.recreated" not in events
            await _assert_index_matches_disk(second, root)  # only its own pages there
            assert await _get(second, theirs) == [Outcome.OK] * 2


async def test_a_root_removed_while_open_is_told_as_removed(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        assert await _put(storage, _keys(2)) == [Outcome.OK] * 2
        shutil.rmtree(root)
        with structlog.testing.capture_logs() as logs:
            assert await _put(storage, _keys(3)) == [Outcome.ERROR] * 3
            assert await _put(storage, _keys(1)) == [Outcome.ERROR]
        [lost] = [entry for entry in logs if entry["event"] == "storage.lock.lost"]
        assert "was removed while the store was open" in lost["error"]
        assert not root.exists()  # nothing made again where the root was
        with pytest.raises(StorageError, match="moved away, removed, or replaced"):
            await storage.manifest().append([chain_entry(NS, [bytes([1]) * 32], 16, 0, 1.0)])
    async with FileStorage(root) as again:  # reopening makes a new, empty one
        assert again.stats().pages == 0


async def test_a_shard_removed_with_the_lock_is_not_made_again_in_a_root_another_took(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    keys = [bytes.fromhex("ab" + f"{i:02x}" * 31) for i in range(4)]
    async with FileStorage(root) as first:
        assert await _put(first, keys[:1]) == [Outcome.OK]
        shutil.rmtree(root / "pages" / "ab")
        (root / "LOCK").unlink()
        async with FileStorage(root) as second:
            with structlog.testing.capture_logs() as logs:
                assert await _put(first, keys[1:2]) == [Outcome.ERROR]
            events = [entry["event"] for entry in logs]
            assert events.count("storage.lock.lost") == 1
            assert "storage.shard.recreated" not in events
            assert not (root / "pages" / "ab").exists()
            assert await _put(second, keys[2:]) == [Outcome.OK] * 2
            await _assert_index_matches_disk(second, root)


async def test_descriptors_of_removed_directories_are_closed_once_idle(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root) as storage:
        handles = storage._handles
        assert handles is not None

        def others() -> int:
            """Open descriptors besides the shard directories in use."""
            return len(os.listdir("/proc/self/fd")) - len(handles._shards)

        keys = _keys(64)  # shards across pages/
        assert await _put(storage, keys) == [Outcome.OK] * 64
        before = others()
        for _ in range(5):
            shutil.rmtree(root / "pages")
            more = _keys(64)
            assert await _put(storage, more) == [Outcome.OK] * 64
        assert not handles.has_retired
        assert others() <= before + 2
        assert await _get(storage, more) == [Outcome.OK] * 64


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
@pytest.mark.parametrize("shard", ["symlink", "file"])
async def test_read_raw_of_a_shard_that_is_not_a_directory_is_none(
    tmp_path: Path, shard: str, shared: bool
) -> None:
    root = tmp_path / "s"
    keys = [bytes.fromhex("ab" + "01" * 31), bytes.fromhex("cd" + "01" * 31)]
    async with FileStorage(root) as storage:
        await _put(storage, keys[1:])
    target = root / "pages" / "ab"
    if shard == "symlink":
        target.symlink_to(root / "pages" / "cd")
    else:
        target.write_bytes(b"")
    async with FileStorage(root, shared=shared) as storage:
        assert await storage.read_raw(keys[0]) is None
        assert await _get(storage, keys[:1]) == [Outcome.MISS]
        assert await storage.read_raw(keys[1]) is not None


async def test_a_tmp_replaced_by_a_symlink_is_not_used(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = _keys(2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    async with FileStorage(root) as storage:
        await _put(storage, keys[:1])
        shutil.rmtree(root / "tmp")
        (root / "tmp").symlink_to(elsewhere)
        with structlog.testing.capture_logs() as logs:
            assert await _put(storage, keys[1:]) == [Outcome.ERROR]
            assert await _put(storage, keys[1:]) == [Outcome.ERROR]  # logged once, not twice
        assert [entry["event"] for entry in logs].count("storage.tmp.refused") == 1
        assert list(elsewhere.iterdir()) == []
        assert await storage.delete(keys[:1]) == 1
        await _assert_index_matches_disk(storage, root)


async def test_verify_does_not_call_corrupt_a_page_evicted_while_it_read_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    old, new = _keys(2), _keys(1)
    gate = _Gate()

    class HeldVerifier(PayloadVerifier):
        """Holds verify() after it read `old[0]`'s header, before its payload: the real
        eviction and spare-file reuse then run in that window."""

        def __init__(self, header: PageHeader, *, mac_key: bytes | None = None) -> None:
            if header.key == old[0]:
                gate.hold()
            super().__init__(header, mac_key=mac_key)

    monkeypatch.setattr(_file, "PayloadVerifier", HeldVerifier)
    async with FileStorage(root, capacity_bytes=2 * SIZE, spare_bytes=SIZE) as storage:
        for key in old:  # one at a time: old[0] is the least recently used
            await _put(storage, [key])
        with structlog.testing.capture_logs() as logs, _released(gate):
            verifying = asyncio.create_task(storage.verify())
            await gate.wait_reached()
            # Evicts old[0] into the spare files; new[0], of its size, is written over it.
            assert await _put(storage, new) == [Outcome.OK]
            assert storage.stats().evictions == 1
        report = await verifying
        assert (report.corrupt_removed, storage.stats().corrupt) == (0, 0)
        assert "storage.page.corrupt" not in [entry["event"] for entry in logs]
        assert await _get(storage, old[1:] + new) == [Outcome.OK] * 2
        await _assert_index_matches_disk(storage, root)


async def test_raw_access_answers_like_get_and_raises_storage_errors(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = [bytes.fromhex("ab" + "01" * 31), bytes.fromhex("cd" + "01" * 31)]
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        path = _page_path(root, keys[0])
        path.unlink()
        path.symlink_to(_page_path(root, keys[1]))
        assert await storage.read_raw(keys[0]) is None  # never followed
        assert await _get(storage, keys[:1]) == [Outcome.CORRUPT]
    _page_path(root, keys[1]).parent.chmod(0o777)  # refused at the next open
    async with FileStorage(root) as storage:
        assert await storage.read_raw(keys[1]) is None
        assert await _get(storage, keys[1:]) == [Outcome.MISS]
        with pytest.raises(StorageError, match="write_raw failed"):
            await storage.write_raw(keys[1], b"x" * HEADER_NBYTES)


async def test_verify_stops_mid_page_when_asked_and_calls_it_unchecked(tmp_path: Path) -> None:
    # A page as large as a sparse file can make it would take long to read: a close sets
    # `stop`, and the page is left unchecked rather than read to its end.
    root = tmp_path / "s"
    keys = _keys(1)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        handles = storage._handles_or_raise()
        shard_fd = handles.shard(keys[0].hex()[:2], create=False)
        assert shard_fd is not None
        stop = threading.Event()
        stop.set()
        code, reason, _, _ = storage._verify_file(shard_fd, keys[0], bytearray(), stop)
        assert (code, reason) == (_file._ERROR, "stopped")
        assert await _get(storage, keys) == [Outcome.OK]  # left as it was


async def test_read_raw_refuses_a_file_larger_than_any_page(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = _keys(1)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        os.truncate(_page_path(root, keys[0]), 2 * _GIB)  # sparse: costs no disk
        with pytest.raises(StorageError, match="more than a page can be"):
            await storage.read_raw(keys[0])


async def test_pages_linked_from_elsewhere_are_never_written_over(tmp_path: Path) -> None:
    # A hard-link snapshot of the root (`cp -al`, `rsync --link-dest`), or a link planted in
    # it: a removed page's file must not become a spare a later write goes over, which would
    # change the file under its other name.
    root = tmp_path / "s"
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    keys = _keys(3)
    async with FileStorage(root, capacity_bytes=3 * SIZE, spare_bytes=4 * SIZE) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 3
        for key in keys:
            os.link(_page_path(root, key), snapshot / key.hex())
        before = {path.name: path.read_bytes() for path in snapshot.iterdir()}
        assert await storage.delete(keys[:1]) == 1
        # Pages of the removed pages' size, one by one: each evicts one of the linked pages
        # once the store is full, and would be written over a spare file if there were one.
        more = _keys(3)
        for key in more:
            assert await _put(storage, [key]) == [Outcome.OK]
        assert storage.stats().evictions == 2
        assert {path.name: path.read_bytes() for path in snapshot.iterdir()} == before
        assert await _get(storage, more) == [Outcome.OK] * 3
        await _assert_index_matches_disk(storage, root)


async def test_the_manifest_does_not_follow_a_root_replaced_by_a_symlink(tmp_path: Path) -> None:
    # Pages go by the root's descriptor; the manifest by its path, which must still name the
    # directory the store opened.
    root = tmp_path / "s"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    entry = chain_entry(NS, [bytes([1]) * 32], 16, 0, 1.0)
    async with FileStorage(root) as storage:
        manifest = storage.manifest()
        await manifest.append([entry])
        shutil.rmtree(root)
        root.symlink_to(elsewhere)
        with pytest.raises(StorageError, match="replaced since it was opened"):
            await manifest.append([entry])
        with pytest.raises(StorageError, match="replaced since it was opened"):
            await manifest.read()
        with pytest.raises(StorageError, match="replaced since it was opened"):
            await manifest.compact()
        await storage.verify()
    assert os.listdir(elsewhere) == []


async def test_a_page_file_others_may_read_is_not_kept_as_a_spare(tmp_path: Path) -> None:
    # A page copied into the root with a looser mode (cp under umask 022) is served, but once
    # removed its file must not pass that mode on to a page written over it, nor the owner of
    # one another user copied in (removed by the get, as corrupt).
    root = tmp_path / "s"
    keys = _keys(4)
    async with FileStorage(root, spare_bytes=4 * SIZE) as storage:
        assert await _put(storage, keys[:2]) == [Outcome.OK] * 2
    _page_path(root, keys[0]).chmod(0o644)
    other = os.geteuid() + 1
    try:
        os.chown(_page_path(root, keys[1]), other, -1)
    except PermissionError:
        other = os.geteuid()  # not root: the mode case alone
    served = [Outcome.OK, Outcome.OK if other == os.geteuid() else Outcome.CORRUPT]
    async with FileStorage(root, spare_bytes=4 * SIZE) as storage:
        assert await _get(storage, keys[:2]) == served
        assert await storage.delete(keys[:2]) == served.count(Outcome.OK)
        assert await _put(storage, keys[2:]) == [Outcome.OK] * 2
        for key in keys[2:]:
            st = _page_path(root, key).stat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, os.geteuid())


async def test_files_in_tmp_the_store_would_not_have_written_are_left(tmp_path: Path) -> None:
    # A root whose tmp/ was there before the store (a directory reused as a root), or an
    # operator's file there: only the store's own temporary and spare files are leftovers.
    root = tmp_path / "s"
    (root / "tmp").mkdir(mode=0o700, parents=True)
    root.chmod(0o700)
    notes = root / "tmp" / "notes.txt"
    notes.write_bytes(b"an operator's")
    old = time.time() - 3600
    os.utime(notes, (old, old))
    leftover = root / "tmp" / "dead-writer.tmp"
    leftover.write_bytes(b"x")
    os.utime(leftover, (old, old))
    async with FileStorage(root) as storage:
        assert notes.read_bytes() == b"an operator's"
        assert not leftover.exists()
        report = await storage.verify()
        # The leftover the open removed is reported by the next verify().
        assert (report.leftovers_removed, report.foreign) == (1, 1)
    assert notes.read_bytes() == b"an operator's"


async def test_verify_leaves_a_directory_in_a_shard_not_named_as_a_page(tmp_path: Path) -> None:
    # Only a directory where a page belongs blocks a write; another is an operator's.
    root = tmp_path / "s"
    keys = _keys(2)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        kept = _page_path(root, keys[0]).parent / "old-pages"
        kept.mkdir()
        (kept / "copy").write_bytes(b"an operator's")
        report = await storage.verify()
        assert (report.ok, report.leftovers_removed, report.foreign) == (2, 0, 1)
        assert (kept / "copy").read_bytes() == b"an operator's"
        assert await _get(storage, keys) == [Outcome.OK] * 2


async def test_the_manifest_looks_at_its_root_path_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The look is a file system call, which a hung NFS server stalls: on the loop, it would
    # hold every task, a deadline around the append included.
    root = tmp_path / "s"
    loop_thread = threading.get_ident()
    threads: list[int] = []
    plain = os.lstat

    def watched(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if path == root:
            threads.append(threading.get_ident())
        return plain(path, *args, **kwargs)  # type: ignore[arg-type]

    entry = chain_entry(NS, [bytes([1]) * 32], 16, 0, 1.0)
    async with FileStorage(root) as storage:
        manifest = storage.manifest()
        monkeypatch.setattr(os, "lstat", watched)
        await manifest.append([entry])
        await manifest.read()
        await manifest.compact()
    assert threads
    assert loop_thread not in threads


async def test_an_append_does_not_follow_a_root_replaced_while_it_waited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The root is looked at before the append waits for the manifest's lock, and again once
    # it holds it: replaced in between, the records must not land outside the root.
    root = tmp_path / "s"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    looked, go = threading.Event(), threading.Event()
    plain = os.lstat

    def held(path: object, *args: object, **kwargs: object) -> os.stat_result:
        st = plain(path, *args, **kwargs)  # type: ignore[arg-type]
        if path == root and not looked.is_set():  # the first look: held after it is taken
            looked.set()
            go.wait(5)
        return st

    entry = chain_entry(NS, [bytes([1]) * 32], 16, 0, 1.0)
    async with FileStorage(root) as storage:
        manifest = storage.manifest()
        await manifest.append([entry])
        monkeypatch.setattr(os, "lstat", held)
        append = asyncio.create_task(manifest.append([entry]))
        assert await asyncio.to_thread(looked.wait, 30)
        shutil.rmtree(root)
        root.symlink_to(elsewhere)
        go.set()
        with pytest.raises(StorageError, match="replaced since it was opened"):
            await append
    assert "manifest.jsonl" not in os.listdir(elsewhere)


async def test_verify_leaves_a_directory_in_a_shard_where_no_page_belongs(
    tmp_path: Path,
) -> None:
    # Named as a page key in upper case, or as a key of another shard, a directory blocks
    # no write of the store, which writes lower-case keys into their own shard only.
    root = tmp_path / "s"
    keys = _keys(2)
    async with FileStorage(root) as storage:
        await _put(storage, keys)
        shard = _page_path(root, keys[0]).parent
        other = "ff" if shard.name != "ff" else "fe"
        kept = [shard / (shard.name.upper() + "A" * 62), shard / (other + "a" * 62)]
        for directory in kept:
            directory.mkdir()
            (directory / "copy").write_bytes(b"an operator's")
        report = await storage.verify()
        assert (report.ok, report.leftovers_removed, report.foreign) == (2, 0, 2)
        for directory in kept:
            assert (directory / "copy").read_bytes() == b"an operator's"
        assert await _get(storage, keys) == [Outcome.OK] * 2


def _ends_despite_fifo(fifo: Path, work: Callable[[], None]) -> BaseException | None:
    """Run `work` on a thread and return what it raised; fail the test if it is still blocked
    (on an open of `fifo`, waiting for a writer) after a generous bound."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            work()
            outcome.append(None)
        except BaseException as exc:  # reported to the test thread below
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        # Release the blocked open so the thread ends, then fail.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(60)
        pytest.fail(f"blocked opening the FIFO {fifo}")
    return outcome[0]


def test_a_fifo_planted_as_lock_is_refused_at_open_not_waited_on(tmp_path: Path) -> None:
    root = tmp_path / "s"
    asyncio.run(_store(root, _keys(1)))
    (root / "LOCK").unlink()
    os.mkfifo(root / "LOCK", 0o600)

    async def open_it() -> None:
        async with FileStorage(root):
            pytest.fail("a store opened with a FIFO as its LOCK")

    error = _ends_despite_fifo(root / "LOCK", lambda: asyncio.run(open_it()))
    assert isinstance(error, StorageConfigError)
    assert "is not a regular file" in str(error)


def test_a_fifo_put_in_place_of_lock_while_open_loses_the_lock_not_the_writer(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"

    async def put_after_swap() -> None:
        async with FileStorage(root) as storage:
            assert await _put(storage, _keys(1)) == [Outcome.OK]
            (root / "LOCK").unlink()
            os.mkfifo(root / "LOCK", 0o600)
            shutil.rmtree(root / "pages")  # the next write looks at LOCK again
            with structlog.testing.capture_logs() as logs:
                assert await _put(storage, _keys(2)) == [Outcome.ERROR] * 2
            [lost] = [entry for entry in logs if entry["event"] == "storage.lock.lost"]
            assert "is not a regular file" in lost["error"]

    assert _ends_despite_fifo(root / "LOCK", lambda: asyncio.run(put_after_swap())) is None


@pytest.mark.parametrize("shared", [False, True])
def test_a_page_file_its_owner_cannot_read_is_removed_and_stored_again(
    tmp_path: Path, shared: bool
) -> None:
    # A page file copied in by another user as 0600 (`sudo cp`) or made `chmod 000`: no
    # instance of the root (all run as its owner) could ever read it. Left in place it was an
    # ERROR at every get, and every put found it stored: a hole in the chain for good.
    root = tmp_path / "s"
    script = textwrap.dedent(
        f"""
        import asyncio, hashlib, os
        import structlog
        from hicache_async import KVLayout
        from hicache_async.storage import FileStorage, Outcome, PageMeta
        from hicache_async.testing import KVGenerator

        ns = bytes(16)
        gen = KVGenerator(KVLayout(num_layers=2, num_kv_heads=2, head_dim=16), 16)
        tokens = list(range(100, 148))
        keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
        metas = [PageMeta(key=k, namespace=ns, num_tokens=16) for k in keys]

        def pages():
            return [[memoryview(bytearray(gen.page_bytes(tokens, i)))] for i in range(3)]

        async def get(storage, what):
            into = [[memoryview(bytearray(len(gen.page_bytes(tokens, 0))))] for _ in keys]
            outcomes = await storage.get(keys, into, namespace=ns)
            for i, (outcome, page) in enumerate(zip(outcomes, into)):
                if outcome is Outcome.OK:
                    assert bytes(page[0]) == gen.page_bytes(tokens, i), i
            print(what, [o.name for o in outcomes])

        def unreadable(i):
            path = os.path.join({str(root)!r}, "pages", keys[i].hex()[:2], keys[i].hex())
            os.chmod(path, 0)
            return path

        async def main():
            async with FileStorage({str(root)!r}, shared={shared!r}) as storage:
                assert await storage.put(keys, pages(), metas) == [Outcome.OK] * 3
                path = unreadable(1)
                await get(storage, "get")
                print("removed", not os.path.exists(path))
                print("put", [o.name for o in await storage.put(keys, pages(), metas)])
                await get(storage, "again")
                path = unreadable(2)
                report = await storage.verify()
                print("verify", report.corrupt_removed, report.unchecked, os.path.exists(path))
                print("errors", storage.stats().errors)
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        print("logged", [e.get("reason") for e in logs if e["event"] == "storage.page.corrupt"])
        """
    )
    done = _run_without_overrides(script)
    for path in (root / "pages").rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "get ['OK', 'CORRUPT', 'OK']",
        "removed True",
        "put ['OK', 'OK', 'OK']",
        "again ['OK', 'OK', 'OK']",
        "verify 1 0 False",
        "errors 0",
        "logged ['unreadable', 'unreadable']",
    ]


def _refusing_page_opens(code: str) -> str:
    """Script lines that make the kernel refuse (with errno `code`) every open with the file
    store's page read flags, as a security module, seccomp or fanotify policy may: the
    refusal is the kernel's own, whatever the file's mode."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("the seccomp filter is written for x86_64 Linux")
    return textwrap.dedent(
        f"""
        import ctypes, errno, struct
        from hicache_async.storage import _file

        def _refuse_page_opens():
            def insn(code, jt, jf, k):
                return struct.pack("HBBI", code, jt, jf, k)
            ld, jeq, ret = 0x20, 0x15, 0x06
            prog = b"".join([
                insn(ld, 0, 0, 4), insn(jeq, 0, 5, 0xC000003E),  # x86_64
                insn(ld, 0, 0, 0), insn(jeq, 0, 3, 257),  # openat
                insn(ld, 0, 0, 32), insn(jeq, 0, 1, _file._READ_FLAGS),
                insn(ret, 0, 0, 0x00050000 | errno.{code}),
                insn(ret, 0, 0, 0x7FFF0000),
            ])
            class Prog(ctypes.Structure):
                _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
            buf = ctypes.create_string_buffer(prog)
            fprog = Prog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0):
                raise SystemExit("seccomp unavailable")
        """
    )


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("code", ["EPERM", "EACCES"])
def test_a_sound_page_a_policy_refuses_to_open_is_an_error_left_in_place(
    tmp_path: Path, code: str, shared: bool
) -> None:
    # A refusal its mode does not explain (a security module, a seccomp or fanotify policy,
    # EPERM or EACCES) is no unreadable page: another instance, or this one once the policy
    # changes, reads it. Such sound pages were removed as `unreadable` by get and verify().
    # Each get of them was an ERROR too: now the first is, and gets of the same file are
    # quiet misses until `_POLICY_RETRY_S` has passed (its deadline is moved here).
    root = tmp_path / "s"
    script = _refusing_page_opens(code) + textwrap.dedent(
        f"""
        import asyncio, hashlib, os
        import structlog
        from hicache_async.storage import FileStorage, Outcome, PageMeta

        ns = bytes(16)
        keys = [hashlib.sha256(bytes([i])).digest() for i in range(2)]
        metas = [PageMeta(key=k, namespace=ns, num_tokens=1) for k in keys]
        paths = [os.path.join({str(root)!r}, "pages", k.hex()[:2], k.hex()) for k in keys]

        async def main():
            async with FileStorage({str(root)!r}, shared={shared!r}) as storage:
                pages = [[memoryview(bytearray(1024))] for _ in keys]
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 2
            _refuse_page_opens()
            async with FileStorage({str(root)!r}, shared={shared!r}) as storage:
                into = [[memoryview(bytearray(1024))] for _ in keys]
                for _ in range(2):
                    got = await storage.get(keys, into, namespace=ns)
                    print("get", [o.name for o in got], storage.stats().errors)
                print("exists", await storage.exists(keys))
                refused = storage._policy_refused._files
                for key, (identity, _) in list(refused.items()):
                    refused[key] = (identity, 0.0)
                got = await storage.get(keys, into, namespace=ns)
                print("get", [o.name for o in got], storage.stats().errors)
                report = await storage.verify()
                print("verify", report.corrupt_removed, report.unchecked)
            print("kept", [os.path.exists(p) for p in paths])
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        print("corrupt", [e["reason"] for e in logs if e["event"] == "storage.page.corrupt"])
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    if "seccomp unavailable" in done.stderr:
        pytest.skip("seccomp filters are not allowed here")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "get ['ERROR', 'ERROR'] 2",
        "get ['MISS', 'MISS'] 2",
        "exists 2",
        "get ['ERROR', 'ERROR'] 4",
        "verify 0 2",
        "kept [True, True]",
        "corrupt []",
    ]


@pytest.mark.parametrize("shared", [False, True])
def test_a_page_a_policy_refuses_stays_quiet_when_another_read_stamps_it(
    tmp_path: Path, shared: bool
) -> None:
    # The quiet period of a page a policy refuses was keyed by the file's times too, so a
    # read by another instance of a shared root (which stamps the page's mtime) made the next
    # get here an ERROR again. A page written anew is still news: a delete and a put (in a
    # private root, into the spare file the delete kept, so the same inode) is an ERROR again.
    root = tmp_path / "s"
    script = _refusing_page_opens("EPERM") + textwrap.dedent(
        f"""
        import asyncio, hashlib, os
        import structlog
        from hicache_async.storage import FileStorage, Outcome, PageMeta

        ns = bytes(16)
        keys = [hashlib.sha256(b"policy").digest()]
        metas = [PageMeta(key=keys[0], namespace=ns, num_tokens=1)]
        path = os.path.join({str(root)!r}, "pages", keys[0].hex()[:2], keys[0].hex())
        pages = [[memoryview(bytearray(1024))]]

        async def main():
            async with FileStorage({str(root)!r}, shared={shared!r}) as storage:
                assert await storage.put(keys, pages, metas) == [Outcome.OK]
            _refuse_page_opens()
            async with FileStorage({str(root)!r}, shared={shared!r}) as storage:
                into = [[memoryview(bytearray(1024))]]
                got = await storage.get(keys, into, namespace=ns)
                print("get", [o.name for o in got], storage.stats().errors)
                st = os.stat(path)
                stamp = st.st_mtime_ns + 5_000_000_000
                os.utime(path, ns=(stamp, stamp))  # another instance's read
                got = await storage.get(keys, into, namespace=ns)
                print("stamped", [o.name for o in got], storage.stats().errors)
                ino = os.stat(path).st_ino
                assert await storage.delete(keys) == 1
                assert await storage.put(keys, pages, metas) == [Outcome.OK]
                if not {shared!r}:  # a shared root keeps no spares (its inode may be reused)
                    assert os.stat(path).st_ino == ino
                got = await storage.get(keys, into, namespace=ns)
                print("rewritten", [o.name for o in got], storage.stats().errors)
        with structlog.testing.capture_logs():
            asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    if "seccomp unavailable" in done.stderr:
        pytest.skip("seccomp filters are not allowed here")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "get ['ERROR'] 1",
        "stamped ['MISS'] 1",
        "rewritten ['ERROR'] 2",
    ]


@pytest.mark.parametrize("damage", ["checksum", "unreadable"])
def test_a_corrupt_page_that_cannot_be_removed_is_reported_once_in_a_shared_root(
    tmp_path: Path, damage: str
) -> None:
    # A shard directory its owner may not write (a root made read-only for a reader): the
    # corrupt page stays. A shared root's get looks on disk for every key, so it read the page
    # in full, counted and logged it again at every get.
    root = tmp_path / "s"
    script = textwrap.dedent(
        f"""
        import asyncio, hashlib, os
        import structlog
        from hicache_async import KVLayout
        from hicache_async.storage import FileStorage, Outcome, PageMeta
        from hicache_async.testing import KVGenerator

        ns = bytes(16)
        gen = KVGenerator(KVLayout(num_layers=2, num_kv_heads=2, head_dim=16), 16)
        tokens = list(range(100, 148))
        keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
        metas = [PageMeta(key=k, namespace=ns, num_tokens=16) for k in keys]
        shard = os.path.join({str(root)!r}, "pages", keys[1].hex()[:2])
        path = os.path.join(shard, keys[1].hex())

        async def get(storage):
            into = [[memoryview(bytearray(len(gen.page_bytes(tokens, 0))))] for _ in keys]
            outcomes = await storage.get(keys, into, namespace=ns)
            for i, (outcome, page) in enumerate(zip(outcomes, into)):
                if outcome is Outcome.OK:
                    assert bytes(page[0]) == gen.page_bytes(tokens, i), i
            print([o.name for o in outcomes])

        async def main():
            async with FileStorage({str(root)!r}, shared=True) as storage:
                pages = [[memoryview(bytearray(gen.page_bytes(tokens, i)))] for i in range(3)]
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 3
                if {damage!r} == "unreadable":
                    os.chmod(path, 0)
                else:
                    with open(path, "r+b") as file:
                        file.seek(-1, os.SEEK_END)
                        file.write(b"?")
                os.chmod(shard, 0o500)
                for _ in range(3):
                    await get(storage)
                print("corrupt", storage.stats().corrupt)
                print("put", [o.name for o in await storage.put(keys, pages, metas)])
                os.chmod(shard, 0o700)
                os.unlink(path)  # replaced: the page stored in its place is read as any
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 3
                await get(storage)
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        print("logged", [e["reason"] for e in logs if e["event"] == "storage.page.corrupt"])
        """
    )
    done = _run_without_overrides(script)
    for path in (root / "pages").rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "['OK', 'CORRUPT', 'OK']",
        "['OK', 'MISS', 'OK']",
        "['OK', 'MISS', 'OK']",
        "corrupt 1",
        "put ['OK', 'MISS', 'OK']",
        "['OK', 'OK', 'OK']",
        f"logged [{damage!r}]",
    ]


def _stuck_page_script(root: Path, n: int) -> str:
    """The start of a child's script for a page that cannot be removed: `n` pages of the
    oracle, the second one's `shard` and `path`, `damage(kind)` of that page, and `get`,
    which checks every page read against the oracle and prints the outcomes."""
    return textwrap.dedent(
        f"""
        import asyncio, hashlib, os
        import structlog
        from hicache_async import KVLayout
        from hicache_async.storage import FileStorage, Outcome, PageMeta
        from hicache_async.testing import KVGenerator

        ns = bytes(16)
        gen = KVGenerator(KVLayout(num_layers=2, num_kv_heads=2, head_dim=16), 16)
        tokens = list(range(100, 100 + 16 * {n}))
        keys = [hashlib.sha256(bytes([i])).digest() for i in range({n})]
        metas = [PageMeta(key=k, namespace=ns, num_tokens=16) for k in keys]
        pages = [[memoryview(bytearray(gen.page_bytes(tokens, i)))] for i in range({n})]
        shard = os.path.join({str(root)!r}, "pages", keys[1].hex()[:2])
        path = os.path.join(shard, keys[1].hex())

        def damage(kind):
            if kind == "unreadable":
                os.chmod(path, 0)
                return
            with open(path, "r+b") as file:
                file.seek(-1, os.SEEK_END)
                last = file.read(1)[0]
                file.seek(-1, os.SEEK_END)
                file.write(bytes([last ^ 0xFF]))

        async def get(storage):
            into = [[memoryview(bytearray(len(gen.page_bytes(tokens, 0))))] for _ in keys]
            outcomes = await storage.get(keys, into, namespace=ns)
            for i, (outcome, page) in enumerate(zip(outcomes, into)):
                if outcome is Outcome.OK:
                    assert bytes(page[0]) == gen.page_bytes(tokens, i), i
            print("get", [o.name for o in outcomes])
        """
    )


@pytest.mark.parametrize("damage", ["checksum", "unreadable"])
def test_a_put_removes_a_stuck_corrupt_page_once_its_directory_may_be_written(
    tmp_path: Path, damage: str
) -> None:
    # A corrupt page that could not be removed (its shard directory read-only for a while)
    # made every later put of its key a refused MISS, and every get a MISS, for as long as
    # the process ran, though the directory could be written again.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 2) + textwrap.dedent(
        f"""
        async def main():
            async with FileStorage({str(root)!r}, shared=True) as storage:
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 2
                damage({damage!r})
                os.chmod(shard, 0o500)
                await get(storage)
                print("put", [o.name for o in await storage.put(keys, pages, metas)])
                os.chmod(shard, 0o700)
                print("put", [o.name for o in await storage.put(keys, pages, metas)])
                print("refused", storage.refused_writes)
                await get(storage)
        with structlog.testing.capture_logs():
            asyncio.run(main())
        """
    )
    done = _run_without_overrides(script)
    for path in (root / "pages").rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "get ['OK', 'CORRUPT']",
        "put ['OK', 'MISS']",
        "put ['OK', 'OK']",
        "refused 1",
        "get ['OK', 'OK']",
    ]


@pytest.mark.parametrize("damage", ["checksum", "unreadable"])
def test_a_lookup_neither_counts_nor_stamps_a_stuck_corrupt_page(
    tmp_path: Path, damage: str
) -> None:
    # A shared root's exists looks on disk for keys it does not index. It counted a corrupt
    # page that could not be removed, and stamped its file (a lookup is a use): the next get
    # met another file, read it in full and reported it again, after every lookup.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 2) + textwrap.dedent(
        f"""
        async def main():
            async with FileStorage({str(root)!r}, shared=True) as storage:
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 2
                damage({damage!r})
                os.utime(path, (1e9, 1e9))  # last used long ago: a lookup stamps it
                os.chmod(shard, 0o500)
                await get(storage)
                for _ in range(2):
                    print("exists", await storage.exists(keys))
                    await get(storage)
                print("corrupt", storage.stats().corrupt)
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        print("logged", [e["reason"] for e in logs if e["event"] == "storage.page.corrupt"])
        """
    )
    done = _run_without_overrides(script)
    for path in (root / "pages").rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "get ['OK', 'CORRUPT']",
        "exists 1",
        "get ['OK', 'MISS']",
        "exists 1",
        "get ['OK', 'MISS']",
        "corrupt 1",
        f"logged [{damage!r}]",
    ]


@pytest.mark.parametrize("stuck", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_a_corrupt_page_read_by_gets_at_once_is_reported_once(
    tmp_path: Path, shared: bool, stuck: bool
) -> None:
    # Gets in flight at once each read the page before any of them removed it, or
    # remembered it as impossible to remove, and each counted and logged it. The reads are
    # held until both have passed the check of what is remembered.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 2) + textwrap.dedent(
        f"""
        import contextlib, threading
        from hicache_async import _native

        barrier = threading.Barrier(2, timeout=30)
        real = _native.pread_checksum

        def held(*args):
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()
            return real(*args)

        size = len(gen.page_bytes(tokens, 0))

        async def main():
            async with FileStorage({str(root)!r}, shared={shared!r}, io_threads=2) as storage:
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 2
                damage("checksum")
                if {stuck!r}:
                    os.chmod(shard, 0o500)
                _native.pread_checksum = held
                intos = [[[memoryview(bytearray(size))]] for _ in range(2)]
                outcomes = await asyncio.gather(
                    *(storage.get(keys[1:], into, namespace=ns) for into in intos)
                )
                _native.pread_checksum = real
                print(sorted(o[0].name for o in outcomes), storage.stats().corrupt)
                os.chmod(shard, 0o700)
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        print("logged", [e["reason"] for e in logs if e["event"] == "storage.page.corrupt"])
        """
    )
    done = _run_without_overrides(script)
    for path in (root / "pages").rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["['CORRUPT', 'MISS'] 1", "logged ['checksum']"]


@pytest.mark.parametrize("call", ["get", "verify"])
def test_an_unreadable_page_replaced_before_its_removal_is_not_reported(
    tmp_path: Path, call: str
) -> None:
    # Another instance's put renamed a sound page over the unreadable file between its look
    # and its removal (as after another read in flight removed and reported it): the file
    # was left alone, yet reported, counted and logged as a corrupt page this call removed.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 2) + textwrap.dedent(
        f"""
        import shutil
        from hicache_async.storage import _file

        real = _file._remove_if_same

        def replaced_first(shard_fd, name, st, **kwargs):
            if name == keys[1].hex() and os.path.exists(path + ".sound"):
                os.rename(path + ".sound", path)
            return real(shard_fd, name, st, **kwargs)

        async def main():
            async with FileStorage({str(root)!r}, shared=True) as storage:
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 2
                shutil.copy2(path, path + ".sound")
                damage("unreadable")
                _file._remove_if_same = replaced_first
                if {call!r} == "get":
                    await get(storage)
                else:
                    print("verify", (await storage.verify()).corrupt_removed)
                _file._remove_if_same = real
                print("corrupt", storage.stats().corrupt, os.path.exists(path))
                await get(storage)
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        print("logged", [e["reason"] for e in logs if e["event"] == "storage.page.corrupt"])
        """
    )
    done = _run_without_overrides(script)
    assert done.returncode == 0, done.stderr[-2000:]
    first = "get ['OK', 'MISS']" if call == "get" else "verify 0"
    assert done.stdout.splitlines() == [
        first,
        "corrupt 0 True",
        "get ['OK', 'OK']",
        "logged []",
    ]


@pytest.mark.parametrize("when", ["open", "put"])
def test_a_root_this_user_may_not_write_is_said_once(tmp_path: Path, when: str) -> None:
    # Every put of a reader's instance was a refused MISS, and no line said why: only the
    # per-page errors, once a minute, and the count of refused writes.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 2) + textwrap.dedent(
        f"""
        tmp = os.path.join({str(root)!r}, "tmp")

        async def main():
            async with FileStorage({str(root)!r}, shared=True):
                pass
            if {when!r} == "open":
                os.chmod(tmp, 0o500)
            async with FileStorage({str(root)!r}, shared=True) as storage:
                os.chmod(tmp, 0o500)
                print("open", storage.read_only)
                for _ in range(2):
                    print("put", [o.name for o in await storage.put(keys, pages, metas)])
                print("then", storage.read_only, "read_only=tmp" in repr(storage))
                os.chmod(tmp, 0o700)
                print("put", [o.name for o in await storage.put(keys, pages, metas)])
                print("then", storage.read_only, "read_only" in repr(storage))
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        for e in logs:
            if e["event"].startswith("storage.root."):
                print(e["event"], os.path.basename(e.get("directory", "")))
        """
    )
    done = _run_without_overrides(script)
    (root / "tmp").chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        f"open {'tmp' if when == 'open' else None}",
        "put ['MISS', 'MISS']",
        "put ['MISS', 'MISS']",
        "then tmp True",
        "put ['OK', 'OK']",
        "then None False",
        "storage.root.read_only tmp",
        "storage.root.writable ",
    ]


def test_a_pages_directory_this_user_may_not_write_is_said_as_it_is(tmp_path: Path) -> None:
    # With pages/ not writable, puts into its shard directories made already still land:
    # the line said every put was refused.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 4) + textwrap.dedent(
        f"""
        pages_dir = os.path.join({str(root)!r}, "pages")

        async def main():
            async with FileStorage({str(root)!r}) as storage:
                assert await storage.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
                assert await storage.delete(keys[:1]) == 1
            os.chmod(pages_dir, 0o500)
            async with FileStorage({str(root)!r}) as storage:
                print("open", storage.read_only)
                print("put", [o.name for o in await storage.put(keys, pages, metas)])
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        for e in logs:
            if e["event"] == "storage.root.read_only":
                print(os.path.basename(e["directory"]), "every put is refused" in e["error"])
        """
    )
    done = _run_without_overrides(script)
    (root / "pages").chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "open pages",
        "put ['OK', 'MISS', 'MISS', 'MISS']",
        "pages False",
    ]


def test_puts_under_a_pages_directory_not_writable_ask_again_at_most_once_a_while(
    tmp_path: Path,
) -> None:
    # With pages/ not writable, puts into shard directories made already land, and every
    # such put asked the kernel twice (tmp/, then pages/) whether the root had become
    # writable. Now a write job asks at most every `_LOOK_AGAIN_S` (the store's clock is
    # moved here), and still finds pages/ writable again once that time has passed.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 2) + textwrap.dedent(
        f"""
        from hicache_async.storage import _file

        pages_dir = os.path.join({str(root)!r}, "pages")
        asked = []
        real_access = os.access

        def counted(path, mode, **kwargs):
            asked.append(path)
            return real_access(path, mode, **kwargs)

        os.access = counted
        now = [1000.0]

        async def main():
            async with FileStorage({str(root)!r}) as storage:
                assert await storage.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
                assert await storage.delete(keys[:1]) == 1
            os.chmod(pages_dir, 0o500)
            del asked[:]
            storage = FileStorage({str(root)!r})
            storage._clock = lambda: now[0]
            async with storage:
                print("open", storage.read_only, len(asked))
                del asked[:]
                for _ in range(5):
                    assert await storage.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
                    assert await storage.delete(keys[:1]) == 1
                print("asked", len(asked))
                now[0] += _file._LOOK_AGAIN_S
                assert await storage.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
                print("asked", len(asked), storage.read_only)
                os.chmod(pages_dir, 0o700)
                print("put", [o.name for o in await storage.put(keys[1:], pages[1:], metas[1:])])
                print("then", storage.read_only)
                now[0] += _file._LOOK_AGAIN_S
                assert await storage.delete(keys[1:]) == 1
                print("put", [o.name for o in await storage.put(keys[1:], pages[1:], metas[1:])])
                print("then", storage.read_only)
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        print("logged", [e["event"] for e in logs if e["event"].startswith("storage.root.")])
        """
    )
    done = _run_without_overrides(script)
    (root / "pages").chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "open pages 2",
        "asked 0",
        "asked 2 pages",
        "put ['OK']",
        "then pages",
        "put ['OK']",
        "then None",
        "logged ['storage.root.read_only', 'storage.root.writable']",
    ]


def test_a_spare_file_given_back_and_taken_again_at_once_stays_marked_taken(
    tmp_path: Path,
) -> None:
    # A temp file tmp/ would not let go of goes back into the spare pool; its mark as taken
    # was cleared after that, so a write that took it from the pool in between lost its
    # mark, and the file it was writing was no longer one of the store's own (`verify()`
    # keeps only those from its leftovers). The two steps are driven here by hand.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 2) + textwrap.dedent(
        f"""
        tmp = os.path.join({str(root)!r}, "tmp")

        async def main():
            async with FileStorage({str(root)!r}) as storage:
                assert await storage.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
                assert await storage.delete(keys[:1]) == 1
                spares = storage._spares
                (size,) = spares._by_size
                name = spares.take(size)  # a write's, which could not rename it
                real_give_back = spares.give_back
                taken = []

                def give_back(*args):
                    kept = real_give_back(*args)
                    taken.append(spares.take(size))  # another write's, at once
                    return kept

                spares.give_back = give_back
                os.chmod(tmp, 0o500)
                try:
                    storage._drop_tmp(storage._handles, name)
                finally:
                    os.chmod(tmp, 0o700)
                print("taken again", taken == [name])
                print("still marked", name in spares.names())
                spares.done(name)
        with structlog.testing.capture_logs():
            asyncio.run(main())
        """
    )
    done = _run_without_overrides(script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["taken again True", "still marked True"]


def test_an_older_look_at_the_root_does_not_undo_a_newer_one(tmp_path: Path) -> None:
    # Two puts at once: the first looked at the root while tmp/ was not writable and finished
    # after the second, which had found it writable. The first's look was recorded last:
    # the root was read-only again (logged again) while puts landed, until the next put.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 3) + textwrap.dedent(
        f"""
        import threading
        from hicache_async.storage import _file

        tmp = os.path.join({str(root)!r}, "tmp")
        real = _file._unwritable
        looked, go = threading.Event(), threading.Event()

        def held_first(handles):
            found = real(handles)
            if not looked.is_set():
                looked.set()
                go.wait(30)
            return found

        async def main():
            async with FileStorage({str(root)!r}, shared=True):
                pass
            os.chmod(tmp, 0o500)
            async with FileStorage({str(root)!r}, shared=True) as storage:
                _file._unwritable = held_first
                first = asyncio.ensure_future(storage.put(keys[:1], pages[:1], metas[:1]))
                await asyncio.get_running_loop().run_in_executor(None, looked.wait, 30)
                os.chmod(tmp, 0o700)
                print("put", [o.name for o in await storage.put(keys[1:2], pages[1:2], metas[1:2])])
                go.set()
                print("put", [o.name for o in await first])
                print("then", storage.read_only)
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        print("logged", [e["event"] for e in logs if e["event"].startswith("storage.root.")])
        """
    )
    done = _run_without_overrides(script)
    (root / "tmp").chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "put ['OK']",
        "put ['MISS']",
        "then None",
        "logged ['storage.root.read_only', 'storage.root.writable']",
    ]


def test_a_spare_file_a_put_could_not_rename_is_kept_as_a_spare(tmp_path: Path) -> None:
    # With tmp/ not writable, a put over a spare file wrote it and could neither rename nor
    # remove it: the file was left behind, unaccounted, until the next open or verify().
    # Kept as a spare, it is reused and goes at close.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 2) + textwrap.dedent(
        f"""
        tmp = os.path.join({str(root)!r}, "tmp")

        async def main():
            async with FileStorage({str(root)!r}) as storage:
                assert await storage.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
                assert await storage.delete(keys[:1]) == 1
                print("spares", len(os.listdir(tmp)))
                os.chmod(tmp, 0o500)
                print("put", [o.name for o in await storage.put(keys[1:], pages[1:], metas[1:])])
                os.chmod(tmp, 0o700)
                print("spares", len(os.listdir(tmp)))
                print("put", [o.name for o in await storage.put(keys[1:], pages[1:], metas[1:])])
                print("spares", len(os.listdir(tmp)))
                assert await storage.delete(keys[1:]) == 1
            print("closed", os.listdir(tmp))
        with structlog.testing.capture_logs():
            asyncio.run(main())
        """
    )
    done = _run_without_overrides(script)
    (root / "tmp").chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "spares 1",
        "put ['MISS']",
        "spares 1",
        "put ['OK']",
        "spares 0",
        "closed []",
    ]


def test_a_raw_write_whose_shard_cannot_be_made_again_removes_its_temp_file(
    tmp_path: Path,
) -> None:
    # The shard directory removed under the store and pages/ not writable: the raw write
    # failed and left its temporary file in tmp/ until the next open or verify().
    root = tmp_path / "s"
    script = textwrap.dedent(
        f"""
        import asyncio, os, shutil
        import structlog
        from hicache_async.storage import FileStorage, StorageError

        root = {str(root)!r}
        key = bytes([0xAB]) * 32

        async def main():
            async with FileStorage(root) as storage:
                await storage.write_raw(key, b"x" * 100)
                shutil.rmtree(os.path.join(root, "pages", "ab"))
                os.chmod(os.path.join(root, "pages"), 0o500)
                try:
                    await storage.write_raw(key, b"y" * 100)
                except StorageError:
                    print("refused")
                os.chmod(os.path.join(root, "pages"), 0o700)
                print("tmp", os.listdir(os.path.join(root, "tmp")))
        with structlog.testing.capture_logs():
            asyncio.run(main())
        """
    )
    done = _run_without_overrides(script)
    (root / "pages").chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["refused", "tmp []"]


def test_a_put_into_a_root_its_owner_may_not_write_is_a_refused_miss(tmp_path: Path) -> None:
    # A root made read-only by its mode (a reader's) refuses every write as a read-only file
    # system does: a MISS counted in refused_writes, not an ERROR the backup worker retries.
    root = tmp_path / "s"
    script = textwrap.dedent(
        f"""
        import asyncio, hashlib, os
        import structlog
        from hicache_async import KVLayout
        from hicache_async.storage import FileStorage, Outcome, PageMeta
        from hicache_async.testing import KVGenerator

        ns = bytes(16)
        gen = KVGenerator(KVLayout(num_layers=2, num_kv_heads=2, head_dim=16), 16)
        tokens = list(range(100, 148))
        keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
        metas = [PageMeta(key=k, namespace=ns, num_tokens=16) for k in keys]
        pages = [[memoryview(bytearray(gen.page_bytes(tokens, i)))] for i in range(3)]
        tmp = os.path.join({str(root)!r}, "tmp")

        async def main():
            async with FileStorage({str(root)!r}, shared=True) as storage:
                os.chmod(tmp, 0o500)
                print([o.name for o in await storage.put(keys, pages, metas)])
                print(storage.refused_writes, storage.stats().errors)
                os.chmod(tmp, 0o700)
                print([o.name for o in await storage.put(keys, pages, metas)])
                into = [[memoryview(bytearray(len(gen.page_bytes(tokens, 0))))] for _ in keys]
                assert await storage.get(keys, into, namespace=ns) == [Outcome.OK] * 3
                assert [bytes(p[0]) for p in into] == [bytes(p[0]) for p in pages]
        with structlog.testing.capture_logs():
            asyncio.run(main())
        """
    )
    done = _run_without_overrides(script)
    (root / "tmp").chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["['MISS', 'MISS', 'MISS']", "3 0", "['OK', 'OK', 'OK']"]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("damage", ["checksum", "unreadable"])
def test_verify_and_gc_do_not_index_a_corrupt_page_they_cannot_remove(
    tmp_path: Path, damage: str, shared: bool
) -> None:
    # verify() and gc() index what their scan finds. A corrupt page whose shard directory
    # may not be written stayed indexed after them: a lookup counted it and a private root's
    # put found it stored (OK) though the page there is corrupt, until a get read it again.
    root = tmp_path / "s"
    script = _stuck_page_script(root, 3) + textwrap.dedent(
        f"""
        async def after(storage, what):
            print(what, await storage.exists(keys), storage.stats().pages)
            print("put", [o.name for o in await storage.put(keys, pages, metas)])

        async def main():
            async with FileStorage({str(root)!r}, shared={shared!r}) as storage:
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 3
                damage({damage!r})
                os.chmod(shard, 0o500)
                await get(storage)
                report = await storage.verify()
                print("verify", report.checked, report.corrupt_removed, report.unchecked)
                await after(storage, "verified")
                await storage.gc()
                await after(storage, "collected")
                print("refused", storage.refused_writes, storage.stats().errors)
                os.chmod(shard, 0o700)
                report = await storage.verify()
                print("verify", report.checked, report.corrupt_removed, report.unchecked)
                print("put", [o.name for o in await storage.put(keys, pages, metas)])
                await get(storage)
        with structlog.testing.capture_logs():
            asyncio.run(main())
        """
    )
    done = _run_without_overrides(script)
    for path in (root / "pages").rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "get ['OK', 'CORRUPT', 'OK']",
        "verify 2 0 1",
        "verified 1 2",
        "put ['OK', 'MISS', 'OK']",
        "collected 1 2",
        "put ['OK', 'MISS', 'OK']",
        "refused 2 0",
        "verify 3 1 0",
        "put ['OK', 'OK', 'OK']",
        "get ['OK', 'OK', 'OK']",
    ]


@pytest.mark.parametrize("shared", [False, True])
async def test_a_page_file_of_another_user_is_corrupt_and_removed(
    tmp_path: Path, shared: bool
) -> None:
    # A shard directory once group-writable let another user of the group copy in a sound
    # page of their own. The refusal tells the owner to run `chmod -R go-rwx`, which cannot
    # change that user's files: their page stayed, was served, and verify() found it sound.
    if os.geteuid() != 0:
        pytest.skip("giving a file another owner needs root")
    root, keys = tmp_path / "s", _keys(4)
    async with FileStorage(root, shared=shared) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 4
    other = os.geteuid() + 1
    for key in keys[1:]:
        os.chown(_page_path(root, key), other, -1)
        _page_path(root, key).chmod(0o644)
    with structlog.testing.capture_logs() as logs:
        async with FileStorage(root, shared=shared) as storage:
            assert await _get(storage, keys[:2]) == [Outcome.OK, Outcome.CORRUPT]
            report = await storage.verify()
            assert (report.ok, report.corrupt_removed, report.unchecked) == (1, 2, 0)
            assert await _put(storage, keys) == [Outcome.OK] * 4
            assert await _get(storage, keys) == [Outcome.OK] * 4
            if shared:  # a put looks at the file first: another user's is written over
                os.chown(_page_path(root, keys[0]), other, -1)
                assert await _put(storage, keys[:1]) == [Outcome.OK]
    assert {_page_path(root, key).stat().st_uid for key in keys} == {os.geteuid()}
    corrupt = [entry["reason"] for entry in logs if entry["event"] == "storage.page.corrupt"]
    assert corrupt == ["owner"] * 3


@pytest.mark.parametrize("shared", [False, True])
async def test_a_put_over_a_corrupt_page_that_cannot_be_removed_is_a_refused_miss(
    tmp_path: Path, shared: bool, immutable: Callable[[Path], None]
) -> None:
    # An immutable corrupt page: a private root's put of its key renamed over it, which
    # failed (EPERM) as an ERROR the backup worker retried, while a shared root's was
    # already a MISS counted in refused_writes.
    root, keys = tmp_path / "s", _keys(2)
    async with FileStorage(root, shared=shared) as storage:
        assert await _put(storage, keys) == [Outcome.OK] * 2
        path = _page_path(root, keys[1])
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(data)
        immutable(path)
        with structlog.testing.capture_logs():
            assert await _get(storage, keys) == [Outcome.OK, Outcome.CORRUPT]
            assert await _put(storage, keys) == [Outcome.OK, Outcome.MISS]
        assert (storage.refused_writes, storage.stats().errors) == (1, 0)
