"""The raw Redis baseline for `hicache-async bench storage --backend redis://...`.

Plain redis-py moving the same bytes as the backend (`page_nbytes` per page, no header, no
checksum): several ways of issuing SET and GET are tried, each a few times, and the modes
with the best medians count, so the baseline is the best plain redis-py does here, not one
arbitrary mode. Like the backend's put, every put stores keys the server does not hold yet.
With `cluster=1` in the URL the same modes run on redis-py's cluster clients, whose
pipelines split per node.

redis-py parses replies with `hiredis` when that package is installed (its fastest mode: GETs
of large values run faster, up to about 2.6 times for 768 KiB values) and in pure Python
otherwise. `RawModes.parser` says which the baseline's connections use, and
`RawModes.warning` what that means when it is not hiredis; the bench prints both.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster
import redis.asyncio.connection
import redis.cluster
import redis.connection

from .._errors import StorageError
from ..storage._redact import mask_userinfo
from ._runner import LoopRunner, fastest_loop_factory
from ._timing import EXISTS_CALLS, median_us

__all__ = ["RawModes"]

_MiB = 1 << 20
#: redis-py's own URL options, kept when the backend URL is turned into a plain client URL.
_CLIENT_PARAMS = (
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
    "client_name",
)
_TIMEOUT_S = 30.0


_SyncClient = redis.Redis | redis.cluster.RedisCluster
_AsyncClient = aioredis.Redis | redis.asyncio.cluster.RedisCluster


def _is_cluster(url: str) -> bool:
    return any(k == "cluster" and v == "1" for k, v in parse_qsl(urlsplit(url).query))


def _client_url(url: str) -> str:
    parts = urlsplit(url)
    query = "&".join(f"{k}={v}" for k, v in parse_qsl(parts.query) if k in _CLIENT_PARAMS)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))


def _depths(page_nbytes: int, num_pages: int) -> list[int]:
    """Pipeline depths to try: one page per round trip up to ~16 MiB per pipeline."""
    depths = {1}
    for target in (2 * _MiB, 8 * _MiB, 16 * _MiB):
        depths.add(max(1, min(num_pages, target // max(page_nbytes, 1))))
    return sorted(depths)


def _sync_modes(
    client: _SyncClient, keys: Sequence[bytes], values: Sequence[bytes], depth: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    def put() -> None:
        for start in range(0, len(keys), depth):
            with client.pipeline(transaction=False) as pipe:
                for i in range(start, min(start + depth, len(keys))):
                    pipe.set(keys[i], values[i])
                pipe.execute()

    def get() -> None:
        for start in range(0, len(keys), depth):
            with client.pipeline(transaction=False) as pipe:
                for key in keys[start : start + depth]:
                    pipe.get(key)
                _check_found(pipe.execute())

    return put, get


def _async_modes(
    client: _AsyncClient,
    keys: Sequence[bytes],
    values: Sequence[bytes],
    depth: int,
    width: int,
) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    chunks = [range(start, min(start + depth, len(keys))) for start in range(0, len(keys), depth)]

    async def spread(op: Callable[[range], Awaitable[None]]) -> None:
        pending = iter(chunks)

        async def worker() -> None:
            for chunk in pending:
                await op(chunk)

        await asyncio.gather(*(worker() for _ in range(width)))

    async def put_chunk(chunk: range) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in chunk:
                pipe.set(keys[i], values[i])
            await pipe.execute()

    async def get_chunk(chunk: range) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in chunk:
                pipe.get(keys[i])
            _check_found(await pipe.execute())

    return (lambda: spread(put_chunk)), (lambda: spread(get_chunk))


class _Evicted(Exception):
    """A value the baseline wrote was gone when it read it back."""


def _check_found(values: Sequence[object]) -> None:
    # A GET of a missing key is a short reply: timed, it would inflate the baseline's GB/s.
    if None in values:
        raise _Evicted


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


async def _atimed(run: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await run()
    return time.perf_counter() - start


async def _connect_all(client: _AsyncClient, width: int) -> None:
    """Open the `width` connections a mode uses (per node, on a cluster) before it is timed:
    pings at once each take a connection of their own, as the mode's workers will."""
    await asyncio.gather(*(client.ping() for _ in range(width)))


def parser_name() -> str:
    """The reply parser redis-py's connections use here, sync and asyncio alike: "hiredis"
    when that package (>= 3.2) is importable, else "python" (redis-py's own)."""
    classes = (redis.connection.DefaultParser, redis.asyncio.connection.DefaultParser)
    return "hiredis" if all("Hiredis" in c.__name__ for c in classes) else "python"


_NO_HIREDIS = (
    "hiredis is not installed, so the Redis baseline parses replies in pure Python: that is "
    "not redis-py's fastest mode (its GETs of large values are slower) and the ratios "
    "flatter ours; `pip install hiredis` for the baseline the target means"
)


class RawModes:
    """Plain redis-py ways of moving `num_pages` values of `page_nbytes`, run one at a time.

    Modes: the sync client with pipelines of several depths (`sync/dN`) and the asyncio
    client over 2 and 4 connections (`async/wN/dN`), on uvloop where it is installed, every
    connection opened before the timing starts. `put(mode)` first deletes what the
    previous put stored (untimed), then SETs keys the server does not hold, as a cache's put
    does: overwriting a value lets the server reuse its memory and runs about twice as fast
    on loopback, which would measure another operation. `get(mode)` reads the last put's
    keys. Both return seconds. Use as a context manager; it leaves nothing behind.
    """

    def __init__(self, url: str, page_nbytes: int, num_pages: int) -> None:
        if page_nbytes < 1 or num_pages < 1:
            raise ValueError("page_nbytes and num_pages must be >= 1")
        #: Which reply parser the baseline's clients use ("hiredis" or "python"), and
        #: what it means for the figures when it is not hiredis (else None).
        self.parser = parser_name()
        self.warning = None if self.parser == "hiredis" else _NO_HIREDIS
        self._url = _client_url(url)
        self._cluster = _is_cluster(url)
        self._tag = f"hicache-raw-bench:{uuid.uuid4().hex}"
        self._values = [os.urandom(page_nbytes) for _ in range(num_pages)]
        self._runs = itertools.count()
        self._keys: list[bytes] = []
        self._runner: LoopRunner | None = None
        self._client: _SyncClient = (
            redis.cluster.RedisCluster.from_url(self._url, socket_timeout=_TIMEOUT_S)
            if self._cluster
            else redis.Redis.from_url(self._url, socket_timeout=_TIMEOUT_S)
        )
        depths = _depths(page_nbytes, num_pages)
        self.modes = [f"sync/d{d}" for d in depths] + [
            f"async/w{w}/d{d}" for w in (2, 4) for d in depths[:2]
        ]

    def __enter__(self) -> RawModes:
        try:
            self._client.ping()
        except redis.RedisError as exc:
            self._client.close()
            # Said in one line by the command, not as a traceback.
            where = mask_userinfo(self._url)
            raise StorageError(f"the raw baseline cannot reach {where}: {exc}") from None
        # The asyncio modes run on the loop the bench runs the store on (uvloop where it is
        # installed: 7 to 18% faster here than asyncio's own for these modes).
        self._runner = LoopRunner(fastest_loop_factory())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            _delete(self._client, self._keys)
        finally:
            self._client.close()
            if self._runner is not None:
                self._runner.__exit__(None, None, None)
                self._runner = None

    def put(self, mode: str) -> float:
        _delete(self._client, self._keys)
        run = next(self._runs)
        self._keys = [f"{self._tag}:{run}:{i}".encode() for i in range(len(self._values))]
        return self._run(mode, put=True)

    def get(self, mode: str) -> float:
        if not self._keys:
            raise RuntimeError("get before any put")
        return self._run(mode, put=False)

    def exists_us(self, calls: int = EXISTS_CALLS) -> float:
        """Median microseconds of a 64-key existence check of the last put's keys, over
        `calls` calls: one multi-key `EXISTS` or a pipeline of 64, whichever is faster."""
        if not self._keys:
            raise RuntimeError("exists before any put")
        return _exists_us(self._client, self._keys, calls)

    def _run(self, mode: str, *, put: bool) -> float:
        """The run's seconds; a server that refuses or loses the values (a full one: OOM
        under `noeviction`, evictions under another policy) raises StorageError."""
        where = mask_userinfo(self._url)
        try:
            return self._run_mode(mode, put=put)
        except _Evicted:
            raise StorageError(
                f"the raw baseline's values were evicted from {where} before it read them "
                f"back: the server's maxmemory is too small for --pages"
            ) from None
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            verb = "put" if put else "get"
            # redis-py names a pipeline's failed command with its arguments: the page bytes.
            reply = str(exc).rpartition("caused error: ")[2]
            raise StorageError(
                f"the raw baseline's {verb} failed on {where}: {type(exc).__name__}: {reply}"
                + ("; is the server's maxmemory large enough for --pages?" if put else "")
            ) from None

    def _run_mode(self, mode: str, *, put: bool) -> float:
        kind, *params = mode.split("/")
        numbers = [int(p[1:]) for p in params]
        if kind == "sync":
            put_run, get_run = _sync_modes(self._client, self._keys, self._values, numbers[0])
            return _timed(put_run if put else get_run)
        width, depth = numbers

        async def timed() -> float:
            pool: aioredis.BlockingConnectionPool | None = None
            aclient: _AsyncClient
            if self._cluster:
                # `width` connections per node, as many as the standalone mode has in all.
                aclient = redis.asyncio.cluster.RedisCluster.from_url(
                    self._url, max_connections=width, socket_timeout=_TIMEOUT_S
                )
            else:
                pool = aioredis.BlockingConnectionPool.from_url(
                    self._url, max_connections=width, socket_timeout=_TIMEOUT_S
                )
                aclient = aioredis.Redis(connection_pool=pool)
            try:
                put_run, get_run = _async_modes(aclient, self._keys, self._values, depth, width)
                # Every connection opened outside the timed part, as the sync client's is.
                await _connect_all(aclient, width)
                return await _atimed(put_run if put else get_run)
            finally:
                await aclient.aclose()
                if pool is not None:
                    await pool.aclose()

        if self._runner is None:
            raise RuntimeError("RawModes is used outside its with block")
        return self._runner.run(timed())


def _delete(client: _SyncClient, keys: Sequence[bytes]) -> None:
    for start in range(0, len(keys), 1000):
        client.delete(*keys[start : start + 1000])


def _exists_us(client: _SyncClient, keys: Sequence[bytes], calls: int) -> float:
    probe = [keys[i % len(keys)] for i in range(64)]

    def piped() -> None:
        with client.pipeline(transaction=False) as pipe:
            for key in probe:
                pipe.exists(key)
            pipe.execute()

    return min(median_us(lambda: client.exists(*probe), calls), median_us(piped, calls))
