"""A Mooncake master known not to answer fails calls at once, with no call to the client.

Without the watch each call waits for the client's own timeouts: about 4.3 s per master call
for a master that is gone, 30 s for one that is frozen (docs/storage-mooncake.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog

from hicache_async import StorageError
from hicache_async.storage import GcReport, Outcome
from hicache_async.storage import _mooncake as mooncake_module
from hicache_async.storage import _mooncake_watch as watch_module
from hicache_async.storage._manifest import chain_entry
from hicache_async.storage._mooncake import MooncakeStorage, close_idle_clients
from hicache_async.storage._mooncake_watch import MasterWatch, http_probe
from hicache_async.testing._servers import MooncakeMaster

from .test_mooncake import NS, buffers, fresh_url, joined, make_pages

#: Far above the watch's own reaction (three failed probes a quarter second apart, each
#: bounded by one second): only a watch that never notices runs into it.
NOTICE_WITHIN_S = 20.0


class CountingClient:
    """Forwards to a Mooncake client and records the name of every method called on it."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return attribute(*args, **kwargs)

        return call


async def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + NOTICE_WITHIN_S
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        await asyncio.sleep(0.05)


async def _seen_up(*backends: MooncakeStorage) -> None:
    """Wait until each backend's watch has seen its master answer: a watch that never has is
    blind (it cannot tell a master gone from a probe that cannot work) and never says down,
    and on a loaded machine its first probe can come after the test has stopped the master."""
    for backend in backends:
        watch = backend._watch
        assert watch is not None
        await _until(lambda watch=watch: watch._seen_up)


async def _every_call_fails_without_reaching_the_client(
    backend: MooncakeStorage, client: CountingClient
) -> None:
    keys, pages, metas = make_pages(3)
    errors = backend.stats().errors
    calls = len(client.calls)
    assert await backend.get(keys, buffers(3), namespace=NS) == [Outcome.ERROR] * 3
    assert await backend.put(keys, pages, metas) == [Outcome.ERROR] * 3
    manifest = backend.manifest()
    entry = chain_entry(NS, keys, 3 * 16, 0, time.time())
    for call in (
        backend.exists(keys),
        backend.delete(keys),
        backend.read_raw(keys[0]),
        backend.write_raw(keys[0], b"value"),
        backend.list_pages(),
        backend.verify(),
        backend.gc(),
        manifest.append([entry]),
        manifest.read(),
        manifest.compact(),
    ):
        with pytest.raises(StorageError, match="not answering"):
            await call
    assert client.calls[calls:] == []
    assert backend.stats().errors >= errors + 6 + 10


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as server:
        yield server
        # The clients the test's backends gave back to the pool: closed while their master
        # answers, left unclosed (as at exit) once the test stopped it. Kept in the pool, the
        # exit-time clean-up of a later command in this process logs them on its stderr.
        close_idle_clients(server.address, reachable_only=True)


async def test_a_frozen_master_fails_calls_at_once_until_it_answers_again(
    master: MooncakeMaster,
) -> None:
    # The pages live in the holder's segment; the backend under test lends nothing.
    async with MooncakeStorage.from_url(fresh_url(master.url)) as holder:
        url = fresh_url(master.url, prefix=holder.prefix, segment_size=0, capacity="1MiB")
        async with MooncakeStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(4)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 4
            real = backend._store
            client = CountingClient(real)
            backend._store = client
            pid = master.pid
            assert pid is not None
            try:
                await _seen_up(backend, holder)
                with structlog.testing.capture_logs() as logs:
                    os.kill(pid, signal.SIGSTOP)
                    try:
                        await _until(lambda: backend._master_down() and holder._master_down())
                        await _every_call_fails_without_reaching_the_client(backend, client)
                    finally:
                        os.kill(pid, signal.SIGCONT)
                    await _until(lambda: not backend._master_down() and not holder._master_down())
                events = [e["event"] for e in logs]
                # Once each for the holder's watch and the backend's (a warning; its "up"
                # again is at info level, which a suite's logging setup may filter out).
                assert events.count("storage.mooncake.master_down") == 2
                into = buffers(4)
                assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 4
                assert [joined(b) for b in into] == [joined(p) for p in pages]
                assert await backend.exists(keys) == 4
                assert client.calls  # the calls reached the client again
            finally:
                backend._store = real  # the real client goes back to the pool on close


async def test_a_master_gone_is_noticed_without_the_admin_url(master: MooncakeMaster) -> None:
    # No admin=: the watch connects to the RPC port, which a master that is gone refuses.
    url = (
        f"mooncake://127.0.0.1:{master.rpc_port}?metadata={master.metadata_url}"
        "&protocol=tcp&local_hostname=127.0.0.1"
    )
    async with MooncakeStorage.from_url(fresh_url(url, segment_size=0)) as backend:
        assert "admin" not in backend.name
        assert await backend.exists(make_pages(1)[0]) == 0  # healthy: the call is made
        real = backend._store
        client = CountingClient(real)
        backend._store = client
        try:
            await _seen_up(backend)
            close_idle_clients(master.address)
            master.kill()
            await _until(backend._master_down)
            keys, pages, metas = make_pages(2)
            assert await backend.get(keys, buffers(2), namespace=NS) == [Outcome.ERROR] * 2
            assert await backend.put(keys, pages, metas) == [Outcome.ERROR] * 2
            with pytest.raises(StorageError, match="not answering"):
                await backend.exists(keys)
            assert client.calls == []
        finally:
            backend._store = real


async def test_gc_without_a_capacity_fails_when_the_master_is_gone(master: MooncakeMaster) -> None:
    # Nothing to trim, but an empty report would tell a cron job that gc succeeded against a
    # master that is gone: the watch fails it at once, and without the watch (a master lost
    # before it noticed) gc's own query to the master does.
    url = (
        f"mooncake://127.0.0.1:{master.rpc_port}?metadata={master.metadata_url}"
        "&protocol=tcp&local_hostname=127.0.0.1"
    )
    async with (
        MooncakeStorage.from_url(fresh_url(url, segment_size=0)) as watched,
        MooncakeStorage.from_url(fresh_url(url, segment_size=0)) as unwatched,
    ):
        for backend in (watched, unwatched):
            assert "capacity" not in backend.name
            assert await backend.gc() == GcReport(evicted_pages=0, freed_bytes=0)
        assert unwatched._watch is not None
        unwatched._watch.stop()
        await _seen_up(watched)
        close_idle_clients(master.address)
        master.kill()
        await _until(watched._master_down)
        with pytest.raises(StorageError, match="not answering"):
            await watched.gc()
        with pytest.raises(StorageError, match="gc failed: the Mooncake master did not answer"):
            await unwatched.gc()


def test_the_watch_needs_three_failed_probes_and_one_success() -> None:
    answers = iter([True, False, True, False, False, False, True])
    seen: list[bool] = []  # the verdict before each probe
    probed = threading.Event()

    def probe() -> bool:
        seen.append(watch.down)
        if len(seen) == 8:
            probed.set()
        return next(answers, True)

    watch = MasterWatch(probe, name="test")
    assert "up" in repr(watch)
    watch.start()
    try:
        assert probed.wait(NOTICE_WITHIN_S)
    finally:
        watch.stop()
    # Down after the third failure in a row (the 6th probe), up again at the next success.
    assert seen == [False, False, False, False, False, False, True, False]
    with pytest.raises(RuntimeError, match="started already"):
        watch.start()


def test_a_probe_that_never_answered_never_reports_the_master_down() -> None:
    probes = 0
    probed = threading.Event()

    def probe() -> bool:
        nonlocal probes
        probes += 1
        if probes == 5:
            probed.set()
        return False

    watch = MasterWatch(probe, name="test")
    with structlog.testing.capture_logs() as logs:
        watch.start()
        try:
            assert probed.wait(NOTICE_WITHIN_S)
            assert not watch.down
        finally:
            watch.stop()
    assert [e["event"] for e in logs] == ["storage.mooncake.watch_blind"]


def test_a_health_answer_that_does_not_end_is_read_no_further_than_its_start() -> None:
    # The wrong service behind the admin port: a 200 whose body goes on and on. The probe
    # takes the status and stops reading, rather than holding all of it.
    total = 256 << 20
    sent: list[int] = []
    # The handler runs on a daemon thread the server's close does not join.
    answered = threading.Event()

    class Endless(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(total))
            self.end_headers()
            chunk = bytes(1 << 20)
            done = 0
            try:
                while done < total:
                    self.wfile.write(chunk)
                    done += len(chunk)
            except OSError:  # the probe closed the connection
                pass
            sent.append(done)
            answered.set()

        def log_message(self, *args: object) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert http_probe(f"http://127.0.0.1:{server.server_address[1]}")() is True
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert answered.wait(60)
    assert len(sent) == 1
    assert sent[0] < 64 << 20  # what the socket buffers took, not the whole answer


class _HeldRetryWait:
    """Stands in for the Mooncake backend's wait before a put's second try (`_pause`): it
    ends only when the test says so."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.go_on = asyncio.Event()

    async def pause(self, delay: float) -> None:
        assert delay == mooncake_module._NO_SPACE_RETRY_S
        self.waiting.set()
        await self.go_on.wait()


async def test_a_put_waiting_to_retry_for_room_calls_no_master_known_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The second try of pages refused for room would wait out the client's timeout on a
    # master that stopped answering during the wait (30 s for a frozen one).
    held = _HeldRetryWait()
    with MooncakeMaster(extra_args=["-eviction_high_watermark_ratio=1.0"]) as master:
        url = fresh_url(master.url, segment_size="16MiB")
        async with MooncakeStorage.from_url(url) as storage:
            monkeypatch.setattr(storage, "_pause", held.pause)
            store = storage._master_store()
            for i in range(16):
                assert store.put(f"{storage.prefix}:filler{i}", bytes(1 << 20)) == 0
            await _seen_up(storage)
            real = storage._store
            client = CountingClient(real)
            storage._store = client
            pid = master.pid
            assert pid is not None
            try:
                keys, pages, metas = make_pages(3)
                put = asyncio.create_task(storage.put(keys, pages, metas))
                await asyncio.wait_for(held.waiting.wait(), NOTICE_WITHIN_S)
                os.kill(pid, signal.SIGSTOP)
                try:
                    await _until(storage._master_down)
                    calls = len(client.calls)
                    held.go_on.set()
                    outcomes = await asyncio.wait_for(put, NOTICE_WITHIN_S)
                    assert client.calls[calls:] == []
                finally:
                    os.kill(pid, signal.SIGCONT)
                assert outcomes == [Outcome.MISS] * 3
                await _until(lambda: not storage._master_down())
            finally:
                storage._store = real
        close_idle_clients(master.address)


def test_a_health_answer_whose_trailer_does_not_end_fails_the_probe() -> None:
    # A chunked 200 whose trailer lines keep coming, each within a read's timeout: the probe
    # read them for ever, and the watch thread never probed again.
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(1 << 16)
            connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            connection.sendall(b"2\r\nok\r\n0\r\n")
            try:
                while not stop.wait(0.05):
                    connection.sendall(b"X-More: y\r\n")
            except OSError:  # the probe closed the connection
                return

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    answers: list[bool] = []
    prober = threading.Thread(
        target=lambda: answers.append(
            http_probe(f"http://127.0.0.1:{listener.getsockname()[1]}")()
        ),
        daemon=True,
    )
    prober.start()
    prober.join(60)  # a bound for the test only: the probe itself ends within about a second
    stop.set()
    server.join(10)
    listener.close()
    assert answers == [False]


def _self_signed(directory: Any) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made here (PEM files in `directory`)."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("neither the cryptography package nor openssl is available")
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
            check=True, capture_output=True,
        )  # fmt: skip
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    with open(cert, "wb") as out:
        out.write(certificate.public_bytes(serialization.Encoding.PEM))
    with open(key, "wb") as out:
        out.write(
            private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert, key


@pytest.mark.parametrize("endless", [False, True])
def test_an_https_health_answer_is_bounded_as_a_whole(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, endless: bool
) -> None:
    # Over https each read had its own second: trailer lines that keep coming, each within
    # it, held the probe for ever, as they did over http before. A whole answer still passes.
    cert, key = _self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # the probe's default context trusts it
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        accepted, _ = listener.accept()
        try:
            connection = context.wrap_socket(accepted, server_side=True)
        except OSError:  # the probe refused the handshake
            accepted.close()
            return
        with connection:
            connection.recv(1 << 16)
            connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            connection.sendall(b"2\r\nok\r\n0\r\n")
            try:
                while endless and not stop.wait(0.05):
                    connection.sendall(b"X-More: y\r\n")
                connection.sendall(b"\r\n")
            except OSError:  # the probe closed the connection
                return

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    answers: list[bool] = []
    prober = threading.Thread(
        target=lambda: answers.append(
            http_probe(f"https://127.0.0.1:{listener.getsockname()[1]}")()
        ),
        daemon=True,
    )
    prober.start()
    prober.join(60)  # a bound for the test only: the probe itself ends within about a second
    stop.set()
    server.join(10)
    listener.close()
    assert answers == [not endless]


def test_an_https_probe_counts_its_handshake_in_the_answer_deadline(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The answer's deadline began once the handshake was over, the handshake having its own
    # second: a server taking most of a second for each passed the probe. The probe's clock
    # is moved on while its handshake waits, as if that handshake had taken the whole time.
    cert, key = _self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # the probe's default context trusts it
    skew = [0.0]

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + skew[0]

    monkeypatch.setattr(watch_module, "time", Clock)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        accepted, _ = listener.accept()
        accepted.recv(1, socket.MSG_PEEK)  # the probe's handshake has begun
        skew[0] = 10.0
        try:
            connection = context.wrap_socket(accepted, server_side=True)
        except OSError:  # the probe gave up the handshake
            accepted.close()
            return
        with connection, contextlib.suppress(OSError):
            connection.recv(1 << 16)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            connection.recv(1)  # until the probe closes the connection

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    answers: list[bool] = []
    prober = threading.Thread(
        target=lambda: answers.append(
            http_probe(f"https://127.0.0.1:{listener.getsockname()[1]}")()
        ),
        daemon=True,
    )
    prober.start()
    prober.join(60)  # a bound for the test only: the probe itself ends within about a second
    server.join(10)
    listener.close()
    assert answers == [False]
