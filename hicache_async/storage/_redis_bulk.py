"""Plain-TCP Redis connections for moving page values: pipelined SET and GET, and the
`exists` script.

redis-py's asyncio connection sends a pipeline through `StreamWriter.writelines`, which joins
every value into one buffer and copies what the socket does not take at once into the
transport's buffer, and it receives a value into a stream buffer that is sliced into a new
bytes object before anyone can copy it into a page. On loopback that caps SET at ~1.6 GB/s
and GET at ~1.3 GB/s with 768 KiB values. Here the value segments go to the socket as they
are (`loop.sock_sendall`) and a GET reply is received straight into the page's segments
(`loop.sock_recv_into`): ~2 GB/s and ~3 GB/s on the same machine (docs/storage-redis.md).

Only what page transfers need is spoken (RESP2 simple strings, errors and bulk strings); every
other command of the backend stays on redis-py. A connection that fails, times out or is
cancelled in the middle of an exchange is closed, never reused: the reply stream would be out
of step with the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

__all__ = ["BulkConnection", "BulkConnectionPool", "ProtocolError", "ReplyError"]

T = TypeVar("T")

_RECV_NBYTES = 64 << 10
#: Longest reply line accepted (status, error or bulk length); a longer one is a protocol error.
_MAX_LINE = 64 << 10


#: Buffers per `sendmsg` (Linux's UIO_MAXIOV is 1024).
_IOV_MAX = 512


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ProtocolError(ConnectionError):
    """The server sent something that is not a reply to what was asked."""


class ReplyError(Exception):
    """An error reply (`-ERR ...`) to one command of a pipeline; the connection is still fine."""


class BulkConnection:
    """One non-blocking TCP socket to a Redis server, with a small receive buffer for reply
    lines; values bigger than what the buffer holds are received where the caller says."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._buffer = bytearray(_RECV_NBYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    def __repr__(self) -> str:
        state = "closed" if self._sock.fileno() < 0 else f"fd={self._sock.fileno()}"
        return f"<BulkConnection {state} buffered={self._end - self._start}>"

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    def close(self) -> None:
        self._sock.close()

    async def send(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send every part in order, without joining them: as many per system call as the
        socket takes (`sendmsg`), waiting for room when it is full."""
        views = [memoryview(part) for part in parts]
        first = 0
        while first < len(views):
            try:
                sent = self._sock.sendmsg(views[first : first + _IOV_MAX])
            except (BlockingIOError, InterruptedError):
                await self._writable()  # the socket is full: wait for room
                continue
            while first < len(views) and sent >= views[first].nbytes:
                sent -= views[first].nbytes
                first += 1
            if sent:
                views[first] = views[first][sent:]

    async def _writable(self) -> None:
        waiter = self._loop.create_future()
        fd = self._sock.fileno()
        self._loop.add_writer(fd, _wake, waiter)
        try:
            await waiter
        finally:
            self._loop.remove_writer(fd)

    async def read_status(self) -> bool | ReplyError | None:
        """The reply to `SET ... NX`: True (`+OK`), None (nil: not set) or the error."""
        line = await self._read_line()
        kind = line[:1]
        if kind == b"+":
            return True
        if kind == b"-":
            return ReplyError(line[1:].decode("utf-8", "replace"))
        if line in {b"$-1", b"_"}:
            return None
        raise ProtocolError(f"unexpected reply to SET: {line[:40]!r}")

    async def read_error(self) -> ReplyError | None:
        """The error of the next reply, a one-line one, or None if it is no error (`PING`)."""
        line = await self._read_line()
        return ReplyError(line[1:].decode("utf-8", "replace")) if line[:1] == b"-" else None

    async def call_integer(self, command: Sequence[bytes]) -> int | ReplyError:
        """Send one command whose reply is an integer (`EVAL` of a script returning a
        number); returns it, or the error reply."""
        await self.send([_command(*command)])
        reply = await self.read_integer()
        if reply is None:
            raise ProtocolError("nil reply where an integer was due")
        return reply

    async def read_integer(self) -> int | ReplyError | None:
        """The reply to a command that answers an integer or nil (`OBJECT IDLETIME`): the
        integer, None for nil, or the error reply."""
        line = await self._read_line()
        kind = line[:1]
        if kind == b":":
            try:
                return int(line[1:])
            except ValueError:
                raise ProtocolError(f"bad integer reply: {line[:40]!r}") from None
        if kind == b"-":
            return ReplyError(line[1:].decode("utf-8", "replace"))
        if line in {b"$-1", b"_"}:
            return None
        raise ProtocolError(f"unexpected reply where an integer was due: {line[:40]!r}")

    async def read_bulk_length(self) -> int | ReplyError | None:
        """The head of a bulk reply: its length, None for nil, or the error reply.

        After a length, the caller must take exactly that many bytes (`read_into`, `skip`) and
        then `skip(2)` for the line end.
        """
        line = await self._read_line()
        kind = line[:1]
        if kind == b"$":
            try:
                length = int(line[1:])
            except ValueError:
                raise ProtocolError(f"bad bulk length: {line[:40]!r}") from None
            return None if length < 0 else length
        if kind == b"-":
            return ReplyError(line[1:].decode("utf-8", "replace"))
        if line == b"_":
            return None
        raise ProtocolError(f"unexpected reply to GET: {line[:40]!r}")

    async def read_into(self, target: memoryview) -> None:
        """Fill `target` (a flat byte view) with the next bytes of the stream."""
        want = target.nbytes
        have = min(want, self._end - self._start)
        if have:
            target[:have] = self._view[self._start : self._start + have]
            self._start += have
        while have < want:
            got = await self._loop.sock_recv_into(self._sock, target[have:])
            if got == 0:
                raise ConnectionResetError("server closed the connection")
            have += got

    async def skip(self, nbytes: int) -> None:
        """Drop the next `nbytes` bytes of the stream."""
        while nbytes > 0:
            if self._start == self._end:
                await self._fill()
            taken = min(nbytes, self._end - self._start)
            self._start += taken
            nbytes -= taken

    async def _read_line(self) -> bytes:
        while True:
            found = self._buffer.find(b"\r\n", self._start, self._end)
            if found >= 0:
                line = bytes(self._view[self._start : found])
                self._start = found + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise ProtocolError("reply line too long")
            await self._fill()

    async def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):  # compact: what is left is part of one line
            size = self._end - self._start
            self._view[:size] = self._view[self._start : self._end]
            self._start, self._end = 0, size
        got = await self._loop.sock_recv_into(self._sock, self._view[self._end :])
        if got == 0:
            raise ConnectionResetError("server closed the connection")
        self._end += got


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class BulkConnectionPool:
    """Up to `limit` `BulkConnection`s to one server, opened on demand and kept while idle.

    `connection()` lends one; if the block that holds it raises (cancellation included) the
    connection is closed instead of returned. `exchange()` bounds a whole exchange (the wait
    for a connection and its opening included) by `timeout` seconds.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        client_name: str | None = None,
        limit: int = 16,
        timeout: float = 5.0,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self._timeout = timeout
        self._host = host
        self._port = port
        self._setup: list[bytes] = []
        if password is not None:
            auth = (b"AUTH",) + ((username.encode(),) if username else ()) + (password.encode(),)
            self._setup.append(_command(*auth))
        if db:
            self._setup.append(_command(b"SELECT", str(db).encode()))
        if client_name:
            self._setup.append(_command(b"CLIENT", b"SETNAME", client_name.encode()))
        self._slots = asyncio.Semaphore(limit)
        self._busy = 0
        self._idle: list[BulkConnection] = []
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<BulkConnectionPool {self._host}:{self._port} busy={self._busy} "
            f"idle={len(self._idle)} closed={self._closed}>"
        )

    @contextlib.asynccontextmanager
    async def connection(self, *, fresh: bool = False) -> AsyncIterator[BulkConnection]:
        """Lend a connection (`fresh`: a newly opened one, not an idle one)."""
        async with self._slots:
            if self._closed:
                raise ConnectionError("connection pool is closed")
            if fresh:
                for idle in self._idle:
                    idle.close()
                self._idle.clear()
            conn = self._idle.pop() if self._idle else await self._open()
            self._busy += 1
            try:
                yield conn
            except BaseException:
                conn.close()
                raise
            finally:
                self._busy -= 1
            if self._closed or conn.closed:
                conn.close()
            else:
                self._idle.append(conn)

    async def exchange(self, talk: Callable[[BulkConnection], Awaitable[T]]) -> T:
        """`await talk(conn)` on a lent connection within `timeout` seconds (raising
        TimeoutError); once more on a newly opened one if the connection fails (an idle one
        the server dropped: a restart, an idle timeout), so `talk` must be safe to repeat."""

        async def attempt(fresh: bool) -> T:
            with anyio.fail_after(self._timeout):
                async with self.connection(fresh=fresh) as conn:
                    return await talk(conn)

        try:
            return await attempt(fresh=False)
        except ConnectionError:
            return await attempt(fresh=True)

    def close(self) -> None:
        """Close the idle connections; lent ones are closed when they come back."""
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def _open(self) -> BulkConnection:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        error: OSError | None = None
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, address)
                conn = BulkConnection(sock)
                refused = await self._set_up(conn)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            if refused is not None:
                sock.close()
                if _greeting(refused):
                    raise ConnectionRefusedError(f"the server refused the connection: {refused}")
                raise ConnectionRefusedError(f"connection setup refused: {refused}")
            return conn
        raise error or OSError(f"no address for {self._host}:{self._port}")

    async def _set_up(self, conn: BulkConnection) -> ReplyError | None:
        """AUTH, SELECT and CLIENT SETNAME as configured, or a PING where none is: the first
        refusal, if any. A server refusing the connection itself (protected mode, a full
        `maxclients`) writes its error as soon as it accepts and closes: read here, it reads
        as what it is, where the first command of a batch would take it for its own reply (or
        meet a broken pipe)."""
        if not self._setup:
            await conn.send([_PING])
            error = await conn.read_error()
            # Any other answer (NOPERM: PING refused by an ACL) means the server took it.
            return error if error is not None and _greeting(error) else None
        await conn.send(self._setup)
        refused: ReplyError | None = None
        for _ in self._setup:
            reply = await conn.read_status()
            if isinstance(reply, ReplyError) and _greeting(reply):
                return reply  # the server closes the connection: no more replies come
            if isinstance(reply, ReplyError) and refused is None:
                refused = reply
        return refused


_PING = _command(b"PING")
#: How the replies a server sends before closing a connection it refused begin.
_GREETINGS = ("DENIED ", "ERR max number of clients reached")


def _greeting(reply: ReplyError) -> bool:
    """Whether `reply` is the server refusing the connection itself, not a command."""
    return str(reply).startswith(_GREETINGS)
