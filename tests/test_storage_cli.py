"""`hicache-async storage stats|ls|verify|gc URL`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_async.cli import _manifest, main
from hicache_async.storage import HEADER_NBYTES, FileStorage, Outcome, PageMeta

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
    assert code == 0
    report = json.loads(out)
    assert report["checked"] == 3
    assert report["corrupt_removed"] == 1
    assert report["ok"] == 2
    assert not path.exists()
    code, out, _ = _run(capsys, "verify", f"file://{root}")
    assert code == 0
    assert "corrupt_removed=0" in out


def test_gc_enforces_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "s"
    _populate(root, 5)
    code, out, _ = _run(capsys, "gc", f"file://{root}?capacity={2 * SIZE}", "--json")
    assert code == 0
    assert json.loads(out) == {"evicted_pages": 3, "freed_bytes": 3 * SIZE}
    assert len([p for p in (root / "pages").rglob("*") if p.is_file()]) == 2


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


@pytest.mark.parametrize("argv", [["bogus", "memory://"], ["ls", "memory://", "--limit", "0"]])
def test_argparse_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["storage", *argv])
    assert info.value.code == 2


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


@pytest.mark.parametrize("action", ["show", "compact"])
def test_manifest_of_a_directory_that_is_no_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir(mode=0o700)
    assert main(["manifest", action, f"file://{plain}"]) == 2
    assert "no storage at" in capsys.readouterr().err
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
