"""`hicache-async` in shell scripts: a stdout or stderr closed at the start (`>&-`, `2>&-`),
a stdout that is a terminal while stderr is a file, and a locale that cannot encode every
character of the output. Run as the executable runs, in a process of its own."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_async.storage import HEADER_NBYTES, FileStorage, Outcome, PageMeta
from hicache_async.storage._manifest import ManifestEntry

PAGE = 4096
NS = b"cli-pipes-ns-001"
ESCAPE = "\x1b["


def _populate(root: Path, count: int, *, corrupt: bool = False) -> None:
    """A file store of `count` pages and a manifest entry; with `corrupt`, one page's header
    damaged, so that `verify` logs `storage.page.corrupt`."""

    async def fill() -> None:
        async with FileStorage(root) as storage:
            keys = [os.urandom(32) for _ in range(count)]
            pages = [[memoryview(bytearray(PAGE))] for _ in keys]
            metas = [PageMeta(key=key, namespace=NS, num_tokens=16, priority=1) for key in keys]
            assert await storage.put(keys, pages, metas) == [Outcome.OK] * count
            entry = ManifestEntry(namespace="0" * 32, keys=[keys[0].hex()], num_tokens=16)
            await storage.manifest().append([entry])

    asyncio.run(fill())
    if corrupt:
        victim = next(path for path in (root / "pages").rglob("*") if path.is_file())
        with open(victim, "r+b") as file:
            file.seek(HEADER_NBYTES // 2)
            file.write(b"\xff\xfe\xfd\xfc")


def _command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "hicache_async", *argv]


def _closing(fd: int, argv: list[str]) -> list[str]:
    """`argv` run by a shell with descriptor `fd` closed, as `cmd >&-` (1) or `cmd 2>&-` (2)
    leave it: Python starts with sys.stdout or sys.stderr None."""
    return ["/bin/sh", "-c", f'exec "$@" {fd}>&-', "sh", *argv]


@pytest.mark.parametrize(
    "argv",
    [
        ["storage", "ls"],
        ["storage", "ls", "--json"],
        ["storage", "stats"],
        ["storage", "verify"],
        ["manifest", "show"],
    ],
    ids=" ".join,
)
def test_a_stdout_closed_at_the_start_is_a_one_line_error(tmp_path: Path, argv: list[str]) -> None:
    root = tmp_path / "s"
    _populate(root, 3)
    command = _command(*argv[:2], f"file://{root}", *argv[2:])
    result = subprocess.run(
        _closing(1, command), stderr=subprocess.PIPE, text=True, check=False, timeout=120
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1
    assert result.stderr.strip().endswith("cannot write the output: stdout is closed")
    assert result.stderr.count("\n") == 1, result.stderr


def test_a_stderr_closed_at_the_start_keeps_log_lines_and_errors_off_stdout(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    _populate(root, 4, corrupt=True)
    verify = _command("storage", "verify", f"file://{root}", "--json")
    result = subprocess.run(
        _closing(2, verify), stdout=subprocess.PIPE, text=True, check=False, timeout=120
    )
    assert result.returncode == 3  # the damage found, not a failure to log it
    report = json.loads(result.stdout)  # the report alone: no storage.page.corrupt line
    assert report["corrupt_removed"] == 1
    missing = _command("storage", "ls", f"file://{tmp_path / 'none'}")
    result = subprocess.run(
        _closing(2, missing), stdout=subprocess.PIPE, text=True, check=False, timeout=120
    )
    assert result.returncode == 2
    assert result.stdout == ""


def _on_terminals(argv: list[str], env: dict[str, str], *, stderr_tty: bool) -> tuple[str, str]:
    """Run `argv` with stdout on a pseudo-terminal, stderr on another one (`stderr_tty`) or
    on a pipe; return what stderr got and what stdout got."""
    out_master, out_slave = pty.openpty()
    err_master, err_slave = pty.openpty() if stderr_tty else (-1, -1)
    try:
        process = subprocess.Popen(
            argv,
            stdout=out_slave,
            stderr=err_slave if stderr_tty else subprocess.PIPE,
            env={**os.environ, **env},
        )
        os.close(out_slave)
        if stderr_tty:
            os.close(err_slave)
        err = b"" if stderr_tty else process.communicate(timeout=120)[1]
        process.wait(timeout=120)
        if stderr_tty:
            err = _drain(err_master)
        return err.decode(), _drain(out_master).decode()
    finally:
        for fd in (out_master, err_master):
            if fd >= 0:
                os.close(fd)


def _drain(master: int) -> bytes:
    """What a pseudo-terminal whose other end is closed still holds (a few lines here: less
    than its buffer, so the writer never waited on it)."""
    data = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other end is closed and all is read
            return data
        if not chunk:
            return data
        data += chunk


@pytest.mark.parametrize(
    ("stderr_tty", "env", "coloured"),
    [
        (False, {"TERM": "xterm"}, False),  # stdout a terminal, stderr a log file
        (True, {"TERM": "xterm"}, True),
        (True, {"TERM": "dumb"}, False),
        (True, {"TERM": "xterm", "NO_COLOR": "1"}, False),
    ],
    ids=["stderr-file", "stderr-terminal", "term-dumb", "no-color"],
)
def test_log_lines_are_coloured_only_on_a_terminal_that_wants_colour(
    tmp_path: Path, stderr_tty: bool, env: dict[str, str], coloured: bool
) -> None:
    root = tmp_path / "s"
    _populate(root, 4, corrupt=True)
    env = {"NO_COLOR": "", "FORCE_COLOR": "", **env}
    err, out = _on_terminals(
        _command("storage", "verify", f"file://{root}"), env, stderr_tty=stderr_tty
    )
    assert "storage.page.corrupt" in err
    assert "corrupt_removed=1" in out
    assert (ESCAPE in err) is coloured, err


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_output_a_locale_cannot_encode_is_escaped_not_a_traceback(
    tmp_path: Path, encoding: str
) -> None:
    root = tmp_path / "s"
    _populate(root, 1)
    result = subprocess.run(
        _command("manifest", "show", f"file://{root}"),
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": encoding},
        check=False,
        timeout=120,
    )
    assert b"Traceback" not in result.stderr, result.stderr.decode(errors="replace")
    assert result.returncode == 0
    assert result.stdout.startswith(b"1 entries")
    assert b"\\u2026  pages=1" in result.stdout  # the ellipsis after a shortened key


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_json_a_locale_cannot_encode_still_parses(tmp_path: Path, encoding: str) -> None:
    root = tmp_path / "caf\u00e9-\u2026-\U0001f642"  # Latin-1, BMP and astral characters
    _populate(root, 2)
    result = subprocess.run(
        _command("storage", "stats", f"file://{root}", "--json"),
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": encoding},
        check=False,
        timeout=120,
    )
    assert b"Traceback" not in result.stderr, result.stderr.decode(errors="replace")
    assert result.returncode == 0
    stats = json.loads(result.stdout.decode(encoding))
    assert stats["backend"] == f"file://{root}"
    assert stats["pages"] == 2
