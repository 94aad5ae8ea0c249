"""The raw Redis baseline for `hicache-async bench storage --backend redis://...`.

Plain redis-py moving the same bytes as the backend (`page_nbytes` per page, no header, no
checksum): several ways of issuing SET and GET are tried, each a few times, and the mode
with the best median counts, so the baseline is the best plain redis-py does here, not one
arbitrary mode. Like the backend's put, every put stores keys the server does not hold yet.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

__all__ = ["measure_raw"]

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
_EXISTS_CALLS = 200
_TIMEOUT_S = 30.0


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
    client: redis.Redis, keys: Sequence[bytes], values: Sequence[bytes], depth: int
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
                pipe.execute()

    return put, get


def _async_modes(
    client: aioredis.Redis,
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
            await pipe.execute()

    return (lambda: spread(put_chunk)), (lambda: spread(get_chunk))


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


async def _atimed(run: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await run()
    return time.perf_counter() - start


def measure_raw(url: str, page_nbytes: int, num_pages: int, *, reps: int = 3) -> dict[str, float]:
    """Best plain redis-py throughput for `num_pages` values of `page_nbytes` at `url`.

    Tries the sync client with pipelines of several depths and the asyncio client with 2 and
    4 connections, each `reps` times; returns `put_gbps` and `get_gbps` of the mode whose
    median is best, and `exists64_us` (median microseconds to check 64 keys, the faster of
    one multi-key EXISTS and a pipeline of 64). Every put writes keys the server does not
    hold (the previous run's are deleted first, untimed), as a cache's put does: overwriting
    a value lets the server reuse its memory and runs about twice as fast on loopback, which
    would measure another operation. Leaves nothing behind.
    """
    if page_nbytes < 1 or num_pages < 1 or reps < 1:
        raise ValueError("page_nbytes, num_pages and reps must be >= 1")
    client_url = _client_url(url)
    tag = f"hicache-raw-bench:{uuid.uuid4().hex}"
    values = [os.urandom(page_nbytes) for _ in range(num_pages)]
    total = page_nbytes * num_pages
    runs = itertools.count()

    def fresh_keys() -> list[bytes]:
        run = next(runs)
        return [f"{tag}:{run}:{i}".encode() for i in range(num_pages)]

    put_s: list[float] = []  # the best median of each kind so far
    get_s: list[float] = []
    client = redis.Redis.from_url(client_url, socket_timeout=_TIMEOUT_S)
    try:
        keys: list[bytes] = []
        for depth in _depths(page_nbytes, num_pages):
            puts, gets = [], []
            for _ in range(reps):
                _delete(client, keys)
                keys = fresh_keys()
                put, get = _sync_modes(client, keys, values, depth)
                puts.append(_timed(put))
                gets.append(_timed(get))
            put_s.append(statistics.median(puts))
            get_s.append(statistics.median(gets))
        exists = _exists_us(client, keys)
        _delete(client, keys)
    finally:
        client.close()

    async def concurrent() -> None:
        for width in (2, 4):
            pool = aioredis.BlockingConnectionPool.from_url(
                client_url, max_connections=width, socket_timeout=_TIMEOUT_S
            )
            aclient = aioredis.Redis(connection_pool=pool)
            keys: list[bytes] = []
            try:
                for depth in _depths(page_nbytes, num_pages)[:2]:
                    puts, gets = [], []
                    for _ in range(reps):
                        await _adelete(aclient, keys)
                        keys = fresh_keys()
                        put, get = _async_modes(aclient, keys, values, depth, width)
                        puts.append(await _atimed(put))
                        gets.append(await _atimed(get))
                    put_s.append(statistics.median(puts))
                    get_s.append(statistics.median(gets))
                await _adelete(aclient, keys)
            finally:
                await aclient.aclose()
                await pool.aclose()

    asyncio.run(concurrent())
    return {
        "put_gbps": total / min(put_s) / 1e9,
        "get_gbps": total / min(get_s) / 1e9,
        "exists64_us": exists,
    }


def _delete(client: redis.Redis, keys: Sequence[bytes]) -> None:
    for start in range(0, len(keys), 1000):
        client.delete(*keys[start : start + 1000])


async def _adelete(client: aioredis.Redis, keys: Sequence[bytes]) -> None:
    for start in range(0, len(keys), 1000):
        await client.delete(*keys[start : start + 1000])


def _exists_us(client: redis.Redis, keys: Sequence[bytes]) -> float:
    probe = [keys[i % len(keys)] for i in range(64)]
    multi: list[float] = []
    piped: list[float] = []
    for _ in range(_EXISTS_CALLS):
        start = time.perf_counter()
        client.exists(*probe)
        multi.append(time.perf_counter() - start)
        start = time.perf_counter()
        with client.pipeline(transaction=False) as pipe:
            for key in probe:
                pipe.exists(key)
            pipe.execute()
        piped.append(time.perf_counter() - start)
    return min(statistics.median(multi), statistics.median(piped)) * 1e6
