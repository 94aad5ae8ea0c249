"""`main()` called in-process, as a host process may: a signal ends a storage command as it
does the executable, and the signal dispositions the host had are the ones it has after."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from hicache_async.cli import main
from hicache_async.storage import FileStorage, Outcome, PageMeta, _file

PAGE = 8192
NS = b"cli-signals-ns-1"
# How long a signal may take to reach a command once it is at work, at most.
WAIT = 60.0


def _populate(root: Path, count: int) -> None:
    async def put() -> None:
        async with FileStorage(root) as storage:
            for _ in range(count):
                key = os.urandom(32)
                page = [memoryview(bytearray(PAGE))]
                meta = PageMeta(key=key, namespace=NS, num_tokens=32, priority=1)
                assert await storage.put([key], [page], [meta]) == [Outcome.OK]

    asyncio.run(put())


@pytest.fixture
def dispositions() -> Iterator[None]:
    """The test's process handlers set back afterwards, whatever the test left."""
    saved = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)


class Gate:
    """`started` is set once verify checks its first page, `sent` once the signal is sent."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.sent = threading.Event()


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """Verify's page checks wait until the signal is sent, then go on slowly, so that the
    command is still at work when the signal comes, however late the sender runs."""
    gate = Gate()
    check = _file.FileStorage._verify_file

    def slow_check(
        self: FileStorage, shard_fd: int, key: bytes, scratch: object, stop: threading.Event
    ) -> object:
        gate.started.set()
        gate.sent.wait(WAIT)
        stop.wait(0.05)
        return check(self, shard_fd, key, scratch, stop)  # type: ignore[arg-type]

    monkeypatch.setattr(_file.FileStorage, "_verify_file", slow_check)
    return gate


def _send_when(
    event: threading.Event, number: int, sent: threading.Event | None = None
) -> threading.Thread:
    def send() -> None:
        if event.wait(WAIT):
            os.kill(os.getpid(), number)
        if sent is not None:
            sent.set()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _verify(root: Path, started: Gate, number: int) -> int:
    sender = _send_when(started.started, number, started.sent)
    code = main(["storage", "verify", f"file://{root}"])
    sender.join(WAIT)
    return code


def _assert_closed(root: Path) -> None:
    """The command closed the store: no temporary file left, the lock released."""
    assert list((root / "tmp").iterdir()) == []

    async def reopen() -> None:
        async with FileStorage(root):
            pass

    asyncio.run(reopen())


def _handlers() -> tuple[object, object]:
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


@pytest.mark.usefixtures("dispositions")
@pytest.mark.parametrize(("number", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_interrupted_command_leaves_the_default_handlers(
    tmp_path: Path,
    started: Gate,
    capsys: pytest.CaptureFixture[str],
    number: int,
    code: int,
) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _populate(tmp_path / "s", 100)
    assert _verify(tmp_path / "s", started, number) == code
    assert capsys.readouterr().out == ""
    _assert_closed(tmp_path / "s")
    # Not ignored for good: the host can still be stopped, and asyncio.run still cancels.
    assert _handlers() == (signal.default_int_handler, signal.SIG_DFL)


@pytest.mark.usefixtures("dispositions")
def test_sigterm_ends_the_command_and_leaves_the_hosts_sigint_handler(
    tmp_path: Path, started: Gate, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[int] = []

    def host(number: int, _frame: FrameType | None) -> None:
        calls.append(number)

    signal.signal(signal.SIGINT, host)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _populate(tmp_path / "s", 100)
    assert _verify(tmp_path / "s", started, signal.SIGTERM) == 143
    assert capsys.readouterr().err == "hicache-async: terminated\n"
    assert calls == []  # a SIGTERM is not the host's SIGINT
    assert _handlers() == (host, signal.SIG_DFL)
    signal.raise_signal(signal.SIGINT)  # still the host's
    assert calls == [signal.SIGINT]
    _assert_closed(tmp_path / "s")


@pytest.mark.usefixtures("dispositions")
def test_ignored_sigint_stays_ignored(
    tmp_path: Path, started: Gate, capsys: pytest.CaptureFixture[str]
) -> None:
    # A background job of a non-interactive shell starts with SIGINT ignored, so that a
    # Ctrl-C at the terminal does not reach it: the command runs on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _populate(tmp_path / "s", 40)
    assert _verify(tmp_path / "s", started, signal.SIGINT) == 0
    assert "checked=40, ok=40" in capsys.readouterr().out
    assert _handlers() == (signal.SIG_IGN, signal.SIG_DFL)


@pytest.mark.usefixtures("dispositions")
def test_ignored_sigterm_stays_ignored(
    tmp_path: Path, started: Gate, capsys: pytest.CaptureFixture[str]
) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _populate(tmp_path / "s", 40)
    assert _verify(tmp_path / "s", started, signal.SIGTERM) == 0
    assert "checked=40, ok=40" in capsys.readouterr().out
    assert _handlers() == (signal.default_int_handler, signal.SIG_IGN)


@pytest.mark.usefixtures("dispositions")
def test_a_later_ctrl_c_is_not_reported_as_the_earlier_sigterm(
    tmp_path: Path, started: Gate, capsys: pytest.CaptureFixture[str]
) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _populate(tmp_path / "s", 100)
    assert _verify(tmp_path / "s", started, signal.SIGTERM) == 143
    capsys.readouterr()
    # The host sets its handlers back, whatever the command left; then a Ctrl-C ends a
    # command that takes no signal over itself (the example replays for minutes).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    running = threading.Event()
    threading.Timer(0.5, running.set).start()
    sender = _send_when(running, signal.SIGINT)
    assert main(["example", "--requests", "100000"]) == 130
    sender.join(WAIT)
    assert capsys.readouterr().err == "hicache-async: interrupted\n"
