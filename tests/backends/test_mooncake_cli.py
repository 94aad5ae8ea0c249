"""The storage command against Mooncake: the admin URL, gc's report, the exit."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from hicache_async import StorageConfigError
from hicache_async.cli import main
from hicache_async.storage import HEADER_NBYTES
from hicache_async.storage._mooncake import MooncakeStorage
from hicache_async.storage._mooncake_watch import http_probe
from hicache_async.testing._servers import MooncakeMaster

from .test_mooncake import _Client, fresh_url, make_pages

_BASE = "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata&protocol=tcp"


@pytest.mark.parametrize(
    ("admin", "shown"),
    [("http://127.0.0.1:notaport", "'notaport'"), ("http://127.0.0.1:99999", "'99999'")],
)
def test_an_admin_url_with_a_bad_port_is_refused_at_once(
    admin: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(StorageConfigError, match="not a port number"):
        MooncakeStorage.from_url(f"{_BASE}&admin={admin}")
    assert main(["storage", "stats", f"{_BASE}&admin={admin}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert shown in err


def test_an_admin_url_with_credentials_is_refused_without_quoting_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"{_BASE}&admin=http://ops:AdminPW@127.0.0.1:30326"
    with pytest.raises(StorageConfigError, match="must not hold a user or password"):
        MooncakeStorage.from_url(url)
    assert main(["storage", "stats", url]) == 2
    err = capsys.readouterr().err
    assert "must not hold a user or password" in err
    assert "AdminPW" not in err
    assert main(["storage", "stats", f"{_BASE}&admin=ftp://ops:AdminPW@host"]) == 2
    assert "AdminPW" not in capsys.readouterr().err  # refused for its scheme, quoted masked


@contextlib.contextmanager
def _cut_answers(
    answer: bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
) -> Iterator[str]:
    """An HTTP server on loopback whose every answer promises 100 bytes and sends 5: the
    reader's `read()` raises `http.client.IncompleteRead`, no OSError. Yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def _url_with_admin(master: MooncakeMaster, admin: str) -> str:
    return fresh_url(
        f"mooncake://127.0.0.1:{master.rpc_port}"
        f"?metadata={master.metadata_url}&protocol=tcp&local_hostname=127.0.0.1&admin={admin}"
    )


def test_a_probe_of_a_broken_admin_server_fails_without_raising() -> None:
    # The probe runs on the watch's thread: anything it raised would end the thread.
    with _cut_answers() as admin:
        assert http_probe(admin)() is False
    assert http_probe("http://127.0.0.1:notaport")() is False


def test_a_broken_answer_of_the_admin_server_is_a_backend_error(
    mooncake_master: MooncakeMaster, capsys: pytest.CaptureFixture[str]
) -> None:
    with _cut_answers() as admin:
        url = _url_with_admin(mooncake_master, admin)
        assert main(["storage", "ls", url]) == 1
    err = capsys.readouterr().err
    assert "get_all_keys failed" in err
    assert "Traceback" not in err


class _RefusedRemove(_Client):
    """The Mooncake client, except that the master refuses to remove `name` (-706)."""

    def __init__(self, inner: Any, name: str) -> None:
        super().__init__(inner)
        self.name = name

    def batch_remove(self, names: list[str], force: bool) -> Any:
        others = [n for n in names if n != self.name]
        codes = iter(self.inner.batch_remove(others, force=force))
        return [-706 if n == self.name else next(codes) for n in names]


async def test_gc_counts_the_pages_it_could_not_remove(mooncake_url: str) -> None:
    page = HEADER_NBYTES + 3000
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, capacity=2 * page)) as backend:
        keys, pages, metas = make_pages(4)
        await backend.put(keys, pages, metas)
        oldest = (await backend.list_pages())[-1]
        client = _RefusedRemove(backend._store, backend._mkey(oldest.key))
        backend._store = client
        try:
            gc = await backend.gc()  # chooses the 2 oldest: one is refused
        finally:
            backend._store = client.inner
        assert (gc.evicted_pages, gc.failed, gc.over_capacity_bytes) == (1, 1, page)
        assert backend.stats().errors == 1
        assert len(await backend.list_pages()) == 3


# Runs the storage command with each pooled Mooncake client's close slowed down and announced
# ("closing" on stderr), so that a signal can come while the command closes them.
_SLOW_CLOSE = """
import sys, time
from hicache_async.cli import main
from hicache_async.storage import _mooncake

class Slow:
    def __init__(self, inner):
        self.inner = inner
    def __getattr__(self, name):
        return getattr(self.inner, name)
    def close(self):
        print("closing", file=sys.stderr, flush=True)
        # A sleep, not a threading wait: Ctrl-C raised inside Condition.wait can leave its
        # lock released twice (RuntimeError), which is the wait's, not the command's.
        time.sleep(2)
        self.inner.close()

give_back = _mooncake._ClientPool.give_back
_mooncake._ClientPool.give_back = lambda self, key, client: give_back(self, key, Slow(client))
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_clients_close_is_an_interrupt(mooncake_url: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLOSE, "storage", "stats", fresh_url(mooncake_url)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:  # Mooncake's own log lines come first
            if line == "closing\n":
                break
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    assert "pages:" in out  # the result came first
    assert "hicache-async: interrupted" in err
    assert "Traceback" not in err


def test_a_broken_answer_to_a_manifest_listing_is_a_backend_error(
    mooncake_master: MooncakeMaster, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without --namespace, `manifest show` lists the namespaces through the admin server,
    # which here answers something that is not HTTP (`http.client.BadStatusLine`).
    with _cut_answers(b"not http at all\r\n\r\n") as admin:
        url = _url_with_admin(mooncake_master, admin)
        assert main(["manifest", "show", url]) == 1
    err = capsys.readouterr().err
    assert "get_all_keys failed" in err
    assert "Traceback" not in err
