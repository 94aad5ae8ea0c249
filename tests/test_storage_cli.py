"""`hicache-async storage stats|ls|verify|gc URL`."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hicache_async.cli import _args, _manifest, main
from hicache_async.storage import (
    HEADER_NBYTES,
    FileStorage,
    MemoryStorage,
    Outcome,
    PageInfo,
    PageMeta,
    StorageStats,
    _file,
)
from hicache_async.storage._manifest import ManifestEntry, chain_entry
from hicache_async.storage._page import FORMAT_VERSION
from hicache_async.testing._servers import free_port

PAGE = 8192
SIZE = HEADER_NBYTES + PAGE
NS = b"storage-cli-ns-1"


def _populate(root: Path, count: int) -> list[bytes]:
    keys = [os.urandom(32) for _ in range(count)]

    async def put() -> None:
        async with FileStorage(root) as storage:
            for key in keys:  # one at a time, so the last is the most recently used
                page = [memoryview(bytearray(PAGE))]
                meta = PageMeta(key=key, namespace=NS, num_tokens=32, priority=1)
                assert await storage.put([key], [page], [meta]) == [Outcome.OK]

    asyncio.run(put())
    return keys


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["storage", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _populate(tmp_path / "s", 3)
    code, out, _ = _run(capsys, "stats", f"file://{tmp_path / 's'}")
    assert code == 0
    assert "pages: 3" in out
    assert f"bytes: {3 * SIZE}" in out
    code, out, _ = _run(capsys, "stats", f"file://{tmp_path / 's'}", "--json")
    assert code == 0
    assert json.loads(out)["pages"] == 3


def test_ls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = _populate(tmp_path / "s", 4)
    code, out, _ = _run(capsys, "ls", f"file://{tmp_path / 's'}", "--json", "--limit", "2")
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 2
    assert {row["key"] for row in rows} <= {key.hex() for key in keys}
    assert all((row["nbytes"], row["num_tokens"], row["priority"]) == (SIZE, 32, 1) for row in rows)
    code, out, _ = _run(capsys, "ls", f"file://{tmp_path / 's'}")
    assert code == 0
    assert "4 pages" in out
    assert keys[0].hex() in out


def nfs_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes flock refuse an exclusive lock on a read-only descriptor with EBADF, as NFS
    does (its flock is a byte-range lock, whose exclusive kind needs write access)."""
    flock = fcntl.flock

    def refusing(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == 0:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        flock(fd, operation)

    monkeypatch.setattr(_file.fcntl, "flock", refusing)


@pytest.mark.parametrize("command", ["stats", "ls"])
def test_looking_at_a_private_root_on_nfs_takes_a_writable_lock(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    keys = _populate(tmp_path / "s", 3)
    nfs_flock(monkeypatch)
    code, out, err = _run(capsys, command, f"file://{tmp_path / 's'}")
    assert (code, "Bad file descriptor" in err) == (0, False), err
    assert "pages: 3" in out if command == "stats" else keys[0].hex() in out


def test_verify_removes_corrupt_pages_and_leftovers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    keys = _populate(root, 3)
    path = root / "pages" / keys[1].hex()[:2] / keys[1].hex()
    data = bytearray(path.read_bytes())
    data[HEADER_NBYTES + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    (root / "tmp" / "interrupted.tmp").write_bytes(b"partial")
    code, out, _ = _run(capsys, "verify", f"file://{root}", "--json")
    assert code == 3  # damage found (and removed): a script must be able to tell
    report = json.loads(out)
    assert report["checked"] == 3
    assert report["corrupt_removed"] == 1
    assert report["ok"] == 2
    assert report["unchecked"] == 0
    assert not path.exists()
    code, out, _ = _run(capsys, "verify", f"file://{root}")
    assert code == 0
    assert "corrupt_removed=0" in out


def test_verify_removes_a_directory_where_a_page_belongs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    _populate(root, 2)
    key = bytes([0xAB]) + os.urandom(31)
    blocker = root / "pages" / "ab" / key.hex()
    (blocker / "inner").mkdir(parents=True, mode=0o700)
    (blocker / "inner" / "file").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_bytes(b"y")
    (blocker / "inner" / "out").symlink_to(outside)  # removed, never followed
    code, out, _ = _run(capsys, "verify", f"file://{root}", "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["checked"], report["leftovers_removed"], report["unchecked"]) == (2, 1, 0)
    assert not blocker.exists()
    assert (outside / "kept").read_bytes() == b"y"

    async def put() -> list[Outcome]:
        async with FileStorage(root) as storage:
            meta = PageMeta(key=key, namespace=NS, num_tokens=32)
            return await storage.put([key], [[memoryview(bytearray(PAGE))]], [meta])

    assert asyncio.run(put()) == [Outcome.OK]


def test_verify_counts_a_refused_shard_as_unchecked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    keys = _populate(root, 3)
    shard = root / "pages" / keys[0].hex()[:2]
    held = len(list(shard.iterdir()))
    shard.chmod(0o777)  # anyone could plant pages there: it is not read
    code, out, err = _run(capsys, "verify", f"file://{root}", "--json")
    assert code == 3
    report = json.loads(out)
    assert report["unchecked"] == 1
    assert report["checked"] == 3 - held
    assert "storage.shard.refused" in err
    assert len(list(shard.iterdir())) == held  # left as it was


@pytest.mark.parametrize("command", ["verify", "gc"])
def test_an_unreadable_shard_is_logged_once(tmp_path: Path, command: str) -> None:
    # The open's scan meets it first, the command's own scan again: one line for both.
    root = tmp_path / "s"
    keys = _populate(root, 3)
    shard = root / "pages" / keys[0].hex()[:2]
    argv = [sys.executable, "-m", "hicache_async", "storage", command, f"file://{root}"]
    if os.geteuid() == 0:  # root's permission overrides would list it anyway
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to run without root's permission overrides")
        caps = "-dac_override,-dac_read_search,-fowner"
        argv = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", *argv]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    shard.chmod(0)
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, env=env, check=False, timeout=120
        )
    finally:
        shard.chmod(0o700)
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("storage.shard.unreadable") == 1, done.stderr[-2000:]


def _ls_into(root: Path, stdout: Any) -> subprocess.CompletedProcess[str]:
    """`storage ls` of `root` in a process of its own, its stdout going to `stdout`."""
    return subprocess.run(
        [sys.executable, "-m", "hicache_async", "storage", "ls", f"file://{root}"],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
        timeout=120,
    )


def test_unwritable_stdout_exits_1_without_a_traceback(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _populate(root, 3)
    with open("/dev/full", "w") as full:
        result = _ls_into(root, full)
    assert result.returncode == 1
    assert "cannot write the output" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_root_that_cannot_be_searched_exits_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As root, permissions do not stop a search: the failing check stands in for them.
    def denied(root: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(root))

    monkeypatch.setattr(_args, "store_missing", denied)
    code, _, err = _run(capsys, "stats", f"file://{tmp_path / 's'}")
    assert code == 2
    assert "cannot look into" in err
    assert "Permission denied" in err


def test_gc_enforces_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "s"
    _populate(root, 5)
    code, out, _ = _run(capsys, "gc", f"file://{root}?capacity={2 * SIZE}", "--json")
    assert code == 0
    assert json.loads(out) == {
        "evicted_pages": 3,
        "freed_bytes": 3 * SIZE,
        "failed": 0,
        "over_capacity_bytes": 0,
        "skipped": False,
    }
    assert len([p for p in (root / "pages").rglob("*") if p.is_file()]) == 2


def test_gc_that_cannot_evict_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Immutable shard directories (`chattr +i`: even root cannot unlink in them) leave every
    # page in place: that is a gc that did not do its job, not a store within capacity.
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    root = tmp_path / "s"
    _populate(root, 4)
    shards = sorted((root / "pages").iterdir())
    try:
        for shard in shards:
            done = subprocess.run(["chattr", "+i", str(shard)], capture_output=True, check=False)
            if done.returncode != 0:
                pytest.skip(f"chattr +i does not work here: {done.stderr.decode().strip()}")
        code, out, err = _run(capsys, "gc", f"file://{root}?capacity={SIZE}", "--json")
    finally:
        for shard in shards:
            subprocess.run(["chattr", "-i", str(shard)], capture_output=True, check=False)
    assert code == 3
    report = json.loads(out)
    assert (report["evicted_pages"], report["failed"]) == (0, 3)
    assert report["over_capacity_bytes"] == 3 * SIZE
    assert err.count("storage.evict.error") == 1  # one line for the three pages
    assert "pages=3" in err
    code, out, _ = _run(capsys, "gc", f"file://{root}?capacity={SIZE}")
    assert code == 0  # removable again: the same gc does its job
    assert out.strip() == (
        f"evicted_pages=3, freed_bytes={3 * SIZE}, failed=0, over_capacity_bytes=0, skipped=False"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["stats", "nope://x"], "unknown storage scheme"),
        (["stats", "file:///x?capacity=lots"], "capacity='lots'"),
        (["stats", "file://relative"], "absolute path"),
        (["stats", "memory://", "--limit", "3"], "--limit only applies to ls"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_missing_root_is_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "stats", f"file://{tmp_path / 'absent'}")
    assert code == 2
    assert "no storage at" in err
    assert not (tmp_path / "absent").exists()


def test_root_in_use_privately(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def hold() -> tuple[int, str]:
        async with FileStorage(tmp_path / "s"):
            code = await asyncio.to_thread(main, ["storage", "stats", f"file://{tmp_path / 's'}"])
            return code, capsys.readouterr().err

    code, err = asyncio.run(hold())
    assert code == 2
    assert "in use" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["bogus", "memory://"],
        ["ls", "memory://", "--limit", "0"],
        ["ls", "memory://", "--limit", str(sys.maxsize + 1)],
        ["ls", "memory://", "--limit", "99999999999999999999999"],
    ],
)
def test_argparse_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["storage", *argv])
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_limit_up_to_maxsize(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _populate(tmp_path / "s", 2)
    code, out, _ = _run(capsys, "ls", f"file://{tmp_path / 's'}", "--limit", str(sys.maxsize))
    assert code == 0
    assert "2 pages" in out


def test_command_line_has_no_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hicache_async", "storage", "stats", "ftp://host/x"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 2
    assert "unknown storage scheme 'ftp'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("action", ["stats", "ls", "verify", "gc"])
def test_a_directory_that_is_no_store_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir(mode=0o700)
    (plain / "notes.txt").write_text("mine")
    code, _, err = _run(capsys, action, f"file://{plain}")
    assert code == 2
    assert "no storage at" in err
    assert sorted(p.name for p in plain.iterdir()) == ["notes.txt"]  # no LOCK, pages/, tmp/


def test_manifest_show_says_what_a_newer_version_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _populate(tmp_path / "s", 1)
    # A record of a later manifest version: skipped and kept, and the listing says so.
    newer = b'{"v":2,"namespace":"' + NS.hex().encode() + b'","keys":[]}\n'
    with open(tmp_path / "s" / "manifest.jsonl", "ab") as f:
        f.write(newer)
    assert main(["manifest", "show", f"file://{tmp_path / 's'}"]) == 0
    assert "1 of a newer version left" in capsys.readouterr().out
    assert newer in (tmp_path / "s" / "manifest.jsonl").read_bytes()


def test_manifest_show_json_of_a_chain_and_its_continuation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A conversation's turn and the longer turn after it: the shorter is covered, and the
    # read says so in a field that must encode as JSON too.
    root = tmp_path / "s"
    _populate(root, 1)
    keys = [os.urandom(32) for _ in range(4)]
    turns = [chain_entry(NS, keys[:2], 64, 0, 1.0), chain_entry(NS, keys, 128, 0, 2.0)]
    asyncio.run(FileStorage(root).manifest().append(turns))
    capsys.readouterr()
    assert main(["manifest", "show", f"file://{root}", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [len(e["keys"]) for e in shown["entries"]] == [4]
    assert shown["covered"] == {f"{NS.hex()}:{keys[-1].hex()}": [2]}


@pytest.mark.parametrize("action", ["show", "compact"])
def test_manifest_of_a_directory_that_is_no_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir(mode=0o700)
    assert main(["manifest", action, f"file://{plain}"]) == 2
    # Worded as the storage command words its errors.
    assert capsys.readouterr().err.startswith(
        f"hicache-async manifest: error: no storage at {plain}"
    )
    assert list(plain.iterdir()) == []


def test_manifest_namespace_is_a_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _populate(tmp_path / "s", 1)
    url = f"file://{tmp_path / 's'}"
    for bad in ("xyz", "ab" * 15, "g" * 32):
        with pytest.raises(SystemExit) as info:
            main(["manifest", "show", url, "--namespace", bad])
        assert info.value.code == 2
    assert _manifest._namespace("AB" * 16) == "ab" * 16  # entries hold lowercase hex
    assert main(["manifest", "show", url, "--namespace", "AB" * 16, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == []
    # compact rewrites every namespace: a filter it would ignore is refused.
    assert main(["manifest", "compact", url, "--namespace", "ab" * 16]) == 2
    assert "--namespace only applies to show" in capsys.readouterr().err


def test_verify_leaves_files_that_are_no_pages_and_logs_each_stray_it_removes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    keys = _populate(root, 2)
    page = root / "pages" / keys[0].hex()[:2] / keys[0].hex()
    # An operator's files: a backup copy of a page, notes.
    backup = page.with_name(page.name + ".bak")
    backup.write_bytes(page.read_bytes())
    notes = page.with_name("NOTES.txt")
    notes.write_bytes(b"do not delete")
    readme = root / "pages" / "README"
    readme.write_bytes(b"do not delete")
    # Pages out of their place: never found, never counted against the capacity, never
    # evicted; removed as strays, so that they do not hold the disk for good.
    wrong = root / "pages" / ("00" if keys[0].hex()[:2] != "00" else "01")
    wrong.mkdir(mode=0o700, exist_ok=True)
    (wrong / page.name).write_bytes(page.read_bytes())
    upper = page.with_name(page.name.upper())
    upper.write_bytes(page.read_bytes())
    loose = root / "pages" / page.name
    loose.write_bytes(page.read_bytes())
    link = root / "pages" / "ab"
    link.mkdir(mode=0o700, exist_ok=True)
    (link / ("ab" + "0" * 62)).symlink_to(page)  # a stray entry where a page belongs
    code, out, err = _run(capsys, "verify", f"file://{root}", "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["ok"], report["leftovers_removed"], report["foreign"]) == (2, 4, 3)
    assert all(path.read_bytes() for path in (backup, notes, readme, page))
    for stray in (wrong / page.name, upper, loose, link / ("ab" + "0" * 62)):
        assert not stray.is_symlink()
        assert not stray.exists()
    assert err.count("storage.stray.removed") == 4
    assert "ab" + "0" * 62 in err
    assert page.name.upper() in err


def test_stats_and_ls_leave_leftovers_for_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    _populate(root, 2)
    leftover = root / "tmp" / "x.tmp"
    leftover.write_bytes(b"partial")
    for action in ("stats", "ls"):
        code, _, _ = _run(capsys, action, f"file://{root}")
        assert code == 0
        assert leftover.exists(), action
    assert main(["manifest", "show", f"file://{root}"]) == 0
    assert leftover.exists(), "manifest show"
    capsys.readouterr()
    code, out, _ = _run(capsys, "verify", f"file://{root}", "--json")
    assert code == 0
    assert json.loads(out)["leftovers_removed"] == 1
    assert not leftover.exists()


def test_closed_stdout_exits_1_without_a_traceback(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _populate(root, 3)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written, as after `| head -1`
    try:
        result = _ls_into(root, write_end)
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert result.stderr == ""


def _damage(root: Path, key: bytes, offset: int, value: bytes) -> None:
    path = root / "pages" / key.hex()[:2] / key.hex()
    data = bytearray(path.read_bytes())
    data[offset : offset + len(value)] = value
    path.write_bytes(bytes(data))


def test_ls_lists_pages_whose_header_cannot_be_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    keys = _populate(root, 4)
    _damage(root, keys[0], 0, b"XXXX")  # bad magic: a damaged page
    _damage(root, keys[2], 4, (FORMAT_VERSION + 1).to_bytes(2, "little"))  # a newer format
    code, out, _ = _run(capsys, "stats", f"file://{root}", "--json")
    assert code == 0
    assert json.loads(out)["pages"] == 4
    code, out, _ = _run(capsys, "ls", f"file://{root}", "--json")
    assert code == 0
    rows = json.loads(out)
    assert sorted(row["key"] for row in rows) == sorted(key.hex() for key in keys)
    times = [row["last_access"] for row in rows]
    assert times == sorted(times, reverse=True)  # most recently used first, damaged or not
    fields = {row["key"]: (row["nbytes"], row["num_tokens"], row["priority"]) for row in rows}
    assert fields[keys[0].hex()] == fields[keys[2].hex()] == (SIZE, 0, 0)
    assert fields[keys[1].hex()] == fields[keys[3].hex()] == (SIZE, 32, 1)


async def test_memory_list_pages_lists_pages_whose_header_cannot_be_read() -> None:
    keys = [os.urandom(32) for _ in range(3)]
    async with MemoryStorage() as storage:
        for key in keys:
            page = [memoryview(bytearray(PAGE))]
            meta = PageMeta(key=key, namespace=NS, num_tokens=32, priority=1)
            assert await storage.put([key], [page], [meta]) == [Outcome.OK]
        raw = await storage.read_raw(keys[1])
        assert raw is not None
        await storage.write_raw(keys[1], b"XXXX" + raw[4:])
        pages = await storage.list_pages()
        assert len(pages) == storage.stats().pages == 3
        assert pages[0].key == keys[1]  # rewritten last: most recently used
        assert (pages[0].nbytes, pages[0].num_tokens, pages[0].priority) == (SIZE, 0, 0)
        assert all((p.num_tokens, p.priority) == (32, 1) for p in pages[1:])


@pytest.mark.parametrize("action", ["stats", "ls", "verify", "gc"])
def test_memory_url_is_refused(capsys: pytest.CaptureFixture[str], action: str) -> None:
    code, out, err = _run(capsys, action, "memory://")
    assert code == 2
    assert out == ""
    assert "lives inside the process that opened it" in err
    assert len(err.strip().splitlines()) == 1


def test_backend_name_is_not_repeated_in_errors(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    code, _, err = _run(capsys, "ls", url)
    assert code == 1
    line = next(line for line in err.splitlines() if "error:" in line)
    assert line.count("redis://") == 1


@pytest.mark.parametrize("capacity", ["", "?capacity=1MiB"], ids=["unbounded", "bounded"])
def test_gc_of_a_server_nothing_answers_exits_1(
    capsys: pytest.CaptureFixture[str], capacity: str
) -> None:
    # Without a capacity gc has nothing to trim; still, exit 0 with an empty report would tell
    # a cron job it succeeded against a server that is not there. It fails as stats does.
    url = f"redis://127.0.0.1:{free_port()}/0{capacity}"  # nothing listens there
    for action in ("stats", "gc"):
        code, out, err = _run(capsys, action, url)
        assert (code, out) == (1, ""), (action, err)
        assert "error:" in err
        assert "Connect" in err


def test_manifest_show_into_a_closed_stdout_exits_1_without_a_traceback(tmp_path: Path) -> None:
    root = tmp_path / "s"

    async def fill() -> None:
        async with FileStorage(root) as storage:
            entries = [
                ManifestEntry(namespace="0" * 32, keys=[os.urandom(32).hex()], num_tokens=16)
                for _ in range(3000)
            ]
            await storage.manifest().append(entries)  # far more output than a pipe buffers

    asyncio.run(fill())
    for extra in ([], ["--json"]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone, as after `| head -1`
        try:
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "hicache_async",
                    "manifest",
                    "show",
                    f"file://{root}",
                    *extra,
                ],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                check=False,
                timeout=120,
            )
        finally:
            os.close(write_end)
        assert result.returncode == 1, extra
        assert result.stderr == "", extra


@pytest.mark.parametrize("action", ["show", "compact"])
def test_manifest_of_a_memory_url_is_refused(
    capsys: pytest.CaptureFixture[str], action: str
) -> None:
    assert main(["manifest", action, "memory://"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "lives inside the process that opened it" in err


@pytest.mark.parametrize("parts", [["pages"], ["LOCK"], ["LOCK", "pages"], ["pages", "tmp"]])
@pytest.mark.parametrize("argv", [["storage", "stats"], ["storage", "ls"], ["manifest", "show"]])
def test_looking_at_an_incomplete_store_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], parts: list[str], argv: list[str]
) -> None:
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    for part in parts:
        if part == "LOCK":
            (root / part).touch(mode=0o600)
        else:
            (root / part).mkdir(mode=0o700)
    assert main([*argv, f"file://{root}"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "is not a complete store" in err
    assert sorted(p.name for p in root.iterdir()) == sorted(parts)


# Runs the command line with every page check (verify) or removal (gc) slowed down, so that it
# is still at work when the signal comes; prints "started" once the first page is reached.
_SLOW_CLI = """
import asyncio, sys, threading
from hicache_async.cli import main
from hicache_async.storage import _file

started = threading.Event()

def announce():
    if not started.is_set():
        started.set()
        print("started", flush=True)

check, remove = _file.FileStorage._verify_file, _file._remove_page

def slow_check(self, shard_fd, key, scratch, stop):
    announce()
    stop.wait(0.05)
    return check(self, shard_fd, key, scratch, stop)

def slow_remove(*args):
    announce()
    threading.Event().wait(0.01)
    return remove(*args)

_file.FileStorage._verify_file = slow_check
_file._remove_page = slow_remove
if "--slow-close" in sys.argv:  # the store's close announced, and slow
    sys.argv.remove("--slow-close")
    close = _file.FileStorage.close

    async def slow_close(self):
        print("closing", flush=True)
        await asyncio.sleep(0.5)
        await close(self)

    _file.FileStorage.close = slow_close
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("action", "query"), [("verify", ""), ("gc", f"?capacity={SIZE}&spare={64 * SIZE}")]
)
@pytest.mark.parametrize(
    ("signals", "code", "said"),
    [
        ([signal.SIGINT], 130, "interrupted"),
        ([signal.SIGTERM], 143, "terminated"),  # as `timeout`, systemd and kubectl stop it
        ([signal.SIGINT, signal.SIGINT], 130, "interrupted"),  # the second one while closing
        ([signal.SIGTERM, signal.SIGINT], 143, "terminated"),
    ],
)
def test_interrupt_exits_130_and_closes_the_store(
    tmp_path: Path, action: str, query: str, *, signals: list[int], code: int, said: str
) -> None:
    root = tmp_path / "s"
    _populate(root, 200)
    slow_close = ["--slow-close"] if len(signals) > 1 else []
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI, *slow_close, "storage", action, f"file://{root}{query}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "started\n"
        process.send_signal(signals[0])
        for again in signals[1:]:
            assert process.stdout.readline() == "closing\n"
            process.send_signal(again)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == code, err
    assert err == f"hicache-async: {said}\n"
    assert out == ""
    assert list((root / "tmp").iterdir()) == []  # no write in progress, no spare file left

    async def reopen() -> None:
        async with FileStorage(root):  # the lock was released
            pass

    asyncio.run(reopen())


# Runs `python -m hicache_async ARGS` with a Ctrl-C (KeyboardInterrupt) raised when the module
# named first is imported: a Ctrl-C while the command starts, most of its start-up time.
_INTERRUPTED_IMPORT = """
import runpy, sys

MODULE = sys.argv[1]

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
sys.argv = ["hicache-async", *sys.argv[2:]]
runpy.run_module("hicache_async", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module", ["hicache_async.cli._signals", "hicache_async.storage"])
def test_interrupt_while_the_command_starts_exits_130(tmp_path: Path, module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_IMPORT, module, "storage", "stats", "memory://"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (130, "hicache-async: interrupted\n")
    assert result.stdout == ""


def _listing(root: Path) -> list[PageInfo]:
    async def pages() -> list[PageInfo]:
        async with FileStorage(root) as storage:
            return await storage.list_pages()

    return asyncio.run(pages())


def _expected_ls(pages: list[PageInfo], *, as_json: bool) -> str:
    """`ls`'s output as it was printed in one piece: a table, or one JSON array."""
    rows = [
        {
            "key": page.key.hex(),
            "nbytes": page.nbytes,
            "num_tokens": page.num_tokens,
            "priority": page.priority,
            "last_access": page.last_access,
        }
        for page in pages
    ]
    if as_json:
        return msgspec.json.encode(rows).decode() + "\n"
    lines = [f"{'key':<64}  {'bytes':>12}  {'tokens':>6}  {'prio':>4}  last access (UTC)"]
    for row in rows:
        when = datetime.fromtimestamp(row["last_access"], tz=timezone.utc)
        lines.append(
            f"{row['key']:<64}  {row['nbytes']:>12}  {row['num_tokens']:>6}  "
            f"{row['priority']:>4}  {when:%Y-%m-%d %H:%M:%S}"
        )
    lines.append(f"{len(rows)} pages")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("count", [0, 1, 3, 10])
def test_ls_streams_the_output_it_printed_in_one_piece(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    root = tmp_path / "s"
    keys = _populate(root, count)
    if count:
        _damage(root, keys[0], 0, b"XXXX")  # listed with 0 tokens and priority 0
    pages = _listing(root)
    original = FileStorage.stream_pages
    batches: list[int] = []

    def stream_pages(self: FileStorage, batch_pages: int = 1024) -> Any:
        batches.append(batch_pages)
        return original(self, 3)  # several batches of a small store

    monkeypatch.setattr(FileStorage, "stream_pages", stream_pages)
    for as_json in (False, True):
        flag = ["--json"] if as_json else []
        code, out, _ = _run(capsys, "ls", f"file://{root}", *flag)
        assert code == 0
        assert out == _expected_ls(pages, as_json=as_json)
        # --limit lists in one piece, through list_pages: the same bytes.
        code, limited, _ = _run(capsys, "ls", f"file://{root}", *flag, "--limit", str(1 << 40))
        assert (code, limited) == (0, out)
    assert batches == [1024, 1024]


# Lists the store in batches of 2 and holds the batch of the least recently used page until
# the file named by the last argument exists (at most 60 s, then says so on stderr).
_HELD_LS = """
import os, sys, time
from hicache_async.cli import main
from hicache_async.storage import FileStorage

flag, last = sys.argv.pop(), bytes.fromhex(sys.argv.pop())
headers = FileStorage._headers_job
stream = getattr(FileStorage, "stream_pages", None)  # absent: one listing, held whole

def held(self, stop, keys):
    if last in keys:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag):
            if time.monotonic() > deadline:
                print("held to the end", file=sys.stderr)
                break
            time.sleep(0.01)
    return headers(self, stop, keys)

FileStorage._headers_job = held
if stream is not None:
    FileStorage.stream_pages = lambda self, batch_pages=1024: stream(self, 2)
sys.exit(main(sys.argv[1:]))
"""


def test_ls_prints_the_first_pages_before_the_listing_ends(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _populate(root, 5)
    order = [page.key for page in _listing(root)]
    flag = tmp_path / "go"
    process = subprocess.Popen(
        [sys.executable, "-c", _HELD_LS, "storage", "ls", f"file://{root}", order[-1].hex(), flag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        head = process.stdout.readline()  # printed while the last batch is held
        flag.touch()
        rest = process.stdout.read()
        assert process.stderr is not None
        err = process.stderr.read()
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        # Both pipes closed here: left to the collector they warn (ResourceWarning).
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
    assert process.returncode == 0, err
    assert "held to the end" not in err
    lines = (head + rest).splitlines()
    assert head.startswith("key ")
    assert [line[:64] for line in lines[1:6]] == [key.hex() for key in order]
    assert lines[6:] == ["5 pages"]


def test_ls_that_fails_midway_keeps_what_it_printed_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    _populate(root, 4)
    order = [page.key for page in _listing(root)]
    headers = FileStorage._headers_job
    calls = 0

    def failing(self: FileStorage, stop: Any, keys: list[bytes]) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(errno.EIO, "Input/output error")
        return headers(self, stop, keys)

    original = FileStorage.stream_pages
    monkeypatch.setattr(FileStorage, "_headers_job", failing)
    monkeypatch.setattr(
        FileStorage, "stream_pages", lambda self, batch_pages=1024: original(self, 2)
    )
    code, out, err = _run(capsys, "ls", f"file://{root}")
    assert code == 1
    # The heading and the first batch, no count.
    assert [line[:64] for line in out.splitlines()[1:]] == [key.hex() for key in order[:2]]
    assert err == f"hicache-async storage: error: file://{root}: [Errno 5] Input/output error\n"


def test_ls_shows_a_last_access_no_date_can_show_as_seconds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # tmpfs (and btrfs) keep 64-bit file times: a page file given an mtime past the year 9999
    # (`touch -d`, a wrong clock) made the table's date raise ValueError, a traceback.
    if not Path("/dev/shm").is_dir():
        pytest.skip("needs /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        root = Path(shm) / "s"
        keys = _populate(root, 2)
        far = 10**12  # about the year 33658
        page = root / "pages" / keys[0].hex()[:2] / keys[0].hex()
        os.utime(page, (far, far))
        if page.stat().st_mtime != far:
            pytest.skip("/dev/shm clamps file times")
        code, out, err = _run(capsys, "ls", f"file://{root}")
        assert (code, err) == (0, "")
        lines = {line.split()[0]: line for line in out.splitlines()[1:-1]}
        assert lines[keys[0].hex()].endswith(f"@{far}")
        assert datetime.strptime(lines[keys[1].hex()][-19:], "%Y-%m-%d %H:%M:%S")
        assert out.endswith("2 pages\n")


class _OddStats(StorageStats, frozen=True):
    """A third-party backend's record with a field JSON cannot encode."""

    kinds: Any = None


class _OddStatsStorage(MemoryStorage):
    def stats(self) -> StorageStats:
        return _OddStats(**msgspec.structs.asdict(super().stats()), kinds={1 + 2j})


def test_stats_json_shows_a_field_json_cannot_encode_as_its_repr() -> None:
    # `stats --json` raised TypeError from the encoder: no output, a traceback.
    from hicache_async.cli._storage import _run

    text, code = asyncio.run(_run(_OddStatsStorage(), "stats", None, as_json=True))
    assert code == 0
    assert text is not None
    assert json.loads(text)["kinds"] == "{(1+2j)}"
    plain, _ = asyncio.run(_run(_OddStatsStorage(), "stats", None, as_json=False))
    assert plain is not None
    assert "kinds: {(1+2j)}" in plain.splitlines()


@pytest.mark.parametrize(
    ("argv", "package"),
    [
        (["storage", "stats", "redis://127.0.0.1:1/0"], "redis"),
        (["storage", "ls", "mooncake://127.0.0.1:1"], "mooncake"),
        (["manifest", "show", "mooncake://127.0.0.1:1"], "mooncake"),
    ],
)
def test_a_missing_client_library_is_a_usage_error_naming_the_extra(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    package: str,
) -> None:
    # As if the extra were not installed: Mooncake's came out as a store failure (exit 1)
    # where redis-py's was a usage error (exit 2).
    monkeypatch.delitem(sys.modules, "hicache_async.storage._redis", raising=False)
    names = [m for m in sys.modules if m == package or m.startswith(f"{package}.")]
    for name in names or [package]:
        monkeypatch.setitem(sys.modules, name, None)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"hicache-async {argv[0]}: error: ")
    assert f"pip install 'hicache-async[{package}]'" in err
