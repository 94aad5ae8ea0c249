"""Whether the Mooncake master answers, known before a call is made.

A Mooncake client call to a master that is gone waits out the client's reconnect (about
4.3 s), and one to a master that stopped answering waits out its request timeout (30 s);
the client has no setting for either, and a call running in a thread cannot be interrupted.
A prefetch worker stuck that long turns every request into a miss meanwhile. So a thread
probes the master a few times a second, and the backend's calls check the verdict first and
fail at once while the master is known not to answer; the calls already running still wait.

The probe is a GET of the master's `/health` on its admin (metrics) port when the backend was
given `admin=`, which also notices a frozen master; without it, a TCP connect to the RPC port,
which notices only a master that is gone (a stopped process's kernel still accepts).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from ._base import log

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "MasterWatch",
    "answers",
    "http_answer",
    "http_body",
    "http_probe",
    "reachable",
    "tcp_probe",
]

#: Seconds between probes, and the bound on each.
_INTERVAL_S = 0.25
_PROBE_TIMEOUT_S = 1.0
#: Probes failed in a row before the master counts as down (a slow answer or two from a busy
#: admin server is not enough).
_FAILURES_FOR_DOWN = 3
#: Most of a `/health` answer's body a probe reads: only its status counts, and a body that
#: never ends (the wrong service behind the port) must cost neither memory nor the probe.
_HEALTH_BODY_NBYTES = 64 << 10


class _DeadlineSocket(socket.socket):
    """A connected socket whose reads all end by `deadline` (monotonic): http.client reads a
    chunked answer's trailer lines for as long as they come, each read bounded only by the
    socket's timeout, so a service sending them without end would hold the probe for ever."""

    deadline = 0.0

    def recv_into(self, buffer: Buffer, nbytes: int = 0, flags: int = 0) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the /health answer took longer than a probe may")
        self.settimeout(remaining)
        return super().recv_into(buffer, nbytes, flags)


class _ProbeConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        plain = self.sock
        wrapped = _DeadlineSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
        wrapped.settimeout(self.timeout)  # for sending the request, as before
        wrapped.deadline = time.monotonic() + _PROBE_TIMEOUT_S
        self.sock = wrapped


class _DeadlineTLSSocket(ssl.SSLSocket):
    """`_DeadlineSocket` for https: every read of the answer ends by `deadline`."""

    deadline = float("inf")

    def recv_into(self, buffer: Buffer, nbytes: int | None = None, flags: int = 0) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the /health answer took longer than a probe may")
        self.settimeout(min(remaining, _PROBE_TIMEOUT_S))
        return super().recv_into(buffer, nbytes, flags)


class _ProbeTLSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, *, context: ssl.SSLContext | None = None, **kwargs: Any) -> None:
        super().__init__(host, context=context, **kwargs)
        self._probe_context = context or ssl.create_default_context()

    def connect(self) -> None:
        # The deadline begins before the handshake, as it begins once connected over http:
        # a server taking most of the probe's time for its handshake, and most of it again
        # for its answer, failed no probe.
        http.client.HTTPConnection.connect(self)
        deadline = time.monotonic() + _PROBE_TIMEOUT_S
        sock = self._probe_context.wrap_socket(
            self.sock,
            server_hostname=getattr(self, "_tunnel_host", None) or self.host,
            do_handshake_on_connect=False,
        )
        self.sock = sock
        if isinstance(sock, _DeadlineTLSSocket):
            sock.deadline = deadline
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the TLS handshake took longer than a probe may")
        sock.settimeout(remaining)  # CPython bounds the whole handshake by it
        sock.do_handshake()


class _ProbeHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_ProbeConnection, req)


class _ProbeTLSHandler(urllib.request.HTTPSHandler):
    def __init__(self) -> None:
        # The default context's checks, with sockets whose reads share one deadline.
        self._probe_context = ssl.create_default_context()
        self._probe_context.sslsocket_class = _DeadlineTLSSocket
        super().__init__(context=self._probe_context)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_ProbeTLSConnection, req, context=self._probe_context)


def http_probe(admin: str) -> Callable[[], bool]:
    """A probe that the master's admin server answers `/health` with 200 (http or https),
    the whole answer within the probe's timeout."""
    url = f"{admin}/health"
    opener = urllib.request.build_opener(_ProbeHandler, _ProbeTLSHandler)

    def probe() -> bool:
        try:
            with opener.open(url, timeout=_PROBE_TIMEOUT_S) as response:
                body = response.read(_HEALTH_BODY_NBYTES)
                if len(body) < _HEALTH_BODY_NBYTES and response.length:
                    return False  # cut short of the length it declared: a broken answer
                return int(response.status) == 200
        except (OSError, http.client.HTTPException, ValueError):
            # URLError is an OSError; HTTPException covers a bad URL (InvalidURL), a garbled
            # or cut answer: any of them is a failed probe, never the end of the thread.
            return False

    return probe


def reachable(address: tuple[str, int], timeout_s: float) -> bool:
    """Whether `address` accepts a TCP connection within `timeout_s`."""
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError:
        return False
    return True


def answers(address: tuple[str, int], request: bytes, timeout_s: float) -> bool | None:
    """Whether the server at `address`, sent `request` and then the end of the stream,
    answers or closes the connection within `timeout_s` seconds of connecting: True if it
    does, False if it accepts the connection but stays silent (a frozen process whose kernel
    still accepts, a port that accepts and never reads), None if it cannot be connected to
    (each address a name resolves to tried for `timeout_s`).

    Any answer counts, an error or a close included: a live server is quick to drop a
    connection whose first bytes are not its protocol (a `mooncake_master` does at once).
    """
    try:
        connection = socket.create_connection(address, timeout=timeout_s)
    except OSError:
        return None
    # From the connection on: a name whose first address never connects spends the whole
    # timeout on it, which left a server found at the next one no time to answer.
    deadline = time.monotonic() + timeout_s
    with connection:
        try:
            connection.settimeout(max(deadline - time.monotonic(), 0.001))
            connection.sendall(request)
            connection.shutdown(socket.SHUT_WR)
            connection.settimeout(max(deadline - time.monotonic(), 0.001))
            connection.recv(1)  # data or end of stream alike
        except TimeoutError:
            return False
        except OSError:
            return True  # reset or refused mid-way: a live peer's kernel or process said so
    return True


def http_answer(
    address: tuple[str, int], request: bytes, timeout_s: float, limit: int
) -> bytes | Literal[False] | None:
    """The start of the answer the HTTP server at `address` gives to `request`, within
    `timeout_s` seconds of connecting: its first `limit` bytes at most, read until the server
    closes the connection or the body its `Content-Length` declares has come. False if it
    accepts the connection but says nothing in time, None if it cannot be connected to (each
    address a name resolves to tried for `timeout_s`).

    A server that keeps the connection open after a whole answer costs no wait, and one that
    sends part of an answer and stalls gives what it sent by the deadline.
    """
    try:
        connection = socket.create_connection(address, timeout=timeout_s)
    except OSError:
        return None
    deadline = time.monotonic() + timeout_s  # from the connection on, as `answers` counts
    answer = b""
    timed_out = False
    with connection:
        try:
            connection.settimeout(max(deadline - time.monotonic(), 0.001))
            connection.sendall(request)
            while len(answer) < limit and not _whole(answer):
                remaining = deadline - time.monotonic()
                timed_out = remaining <= 0
                if timed_out:
                    break
                connection.settimeout(remaining)
                piece = connection.recv(limit - len(answer))
                if not piece:
                    break
                answer += piece
        except TimeoutError:
            timed_out = True
        except OSError:
            if not answer:
                return b""  # reset: a live peer that gave no answer
    return False if timed_out and not answer else answer


def http_body(answer: bytes) -> bytes:
    """The body of `answer` (an HTTP answer, or its start), its chunks' data when it came
    chunked."""
    head, _, body = answer.partition(b"\r\n\r\n")
    return _dechunked(body)[0] if _chunked(head) else body


def _chunked(head: bytes) -> bool:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding":
            return b"chunked" in value.lower()
    return False


def _dechunked(body: bytes) -> tuple[bytes, bool]:
    """The data of the chunks of `body` come so far, and whether it has all come (its last
    chunk and the end of its trailer)."""
    data: list[bytes] = []
    at = 0
    while True:
        end = body.find(b"\r\n", at)
        if end < 0:
            return b"".join(data), False
        try:
            size = int(body[at:end].partition(b";")[0].strip(), 16)
        except ValueError:
            size = -1
        if size < 0:
            return b"".join(data), True  # garbled: nothing more is worth waiting for
        if size == 0:
            return b"".join(data), body.find(b"\r\n\r\n", end) >= 0
        data.append(body[end + 2 : end + 2 + size])
        at = end + 2 + size + 2
        if at > len(body):
            return b"".join(data), False


def _whole(answer: bytes) -> bool:
    """Whether `answer` holds an HTTP answer's head and all of the body it declares."""
    head, blank, body = answer.partition(b"\r\n\r\n")
    if not blank:
        return False
    if _chunked(head):
        # A server that keeps the connection open after a chunked answer would otherwise
        # hold the probe to its deadline.
        return _dechunked(body)[1]
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return len(body) >= int(value.strip())
            except ValueError:
                return False
    return False


def tcp_probe(address: tuple[str, int]) -> Callable[[], bool]:
    """A probe that the master's RPC port accepts a connection."""
    return lambda: reachable(address, _PROBE_TIMEOUT_S)


class MasterWatch:
    """Runs `probe` on a daemon thread every quarter second; `down` once it failed three
    times in a row, up again at its first success.

    A probe that has never succeeded says nothing about the master (the backend opened, so
    the master answered then): the probe itself is what fails, say an `admin` URL this host
    cannot reach. Then the watch never reports down, and logs once that it is blind.
    """

    def __init__(self, probe: Callable[[], bool], *, name: str) -> None:
        self._probe = probe
        self._name = name
        self._failures = 0
        self._seen_up = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        running = self._thread is not None and not self._stop.is_set()
        state = "down" if self.down else "up"
        return f"<MasterWatch {self._name} {state} running={running}>"

    @property
    def down(self) -> bool:
        """Whether the master failed the last probes (read from any thread)."""
        return self._seen_up and self._failures >= _FAILURES_FOR_DOWN

    def start(self) -> None:
        """Start probing (once)."""
        if self._thread is not None:
            raise RuntimeError(f"{self!r} was started already")
        self._thread = threading.Thread(
            target=self._run, name=f"hicache-mooncake-watch {self._name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop probing; never waits (a probe in progress ends within its timeout)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            was_down = self.down
            answered = self._probe()
            failures = 0 if answered else self._failures + 1
            seen_up = self._seen_up or answered
            down = seen_up and failures >= _FAILURES_FOR_DOWN
            # Logged before the new state is published: whoever sees it can find the line.
            if down != was_down and not self._stop.is_set():
                if down:
                    log.warning("storage.mooncake.master_down", master=self._name)
                else:
                    log.info("storage.mooncake.master_up", master=self._name)
            elif not seen_up and failures == _FAILURES_FOR_DOWN:
                log.warning("storage.mooncake.watch_blind", master=self._name)
            # One writer, each field replaced whole; the count first, so that a first
            # success after failures never reads as down in between.
            self._failures = failures
            self._seen_up = seen_up
            self._stop.wait(_INTERVAL_S)
