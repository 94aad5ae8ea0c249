"""RedisStorage against a real redis-server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from operator import itemgetter
from typing import Any, TypeVar

import anyio
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import structlog
from _log_table import assert_documented

from hicache_async import StorageConfigError, StorageError
from hicache_async.storage import (
    HEADER_NBYTES,
    GcReport,
    Outcome,
    PageMeta,
    _redis,
    encode_header,
    open_storage,
)
from hicache_async.storage._manifest import chain_entry
from hicache_async.storage._page import FORMAT_VERSION, PageCheck, decode_header
from hicache_async.storage._redis import RedisStorage
from hicache_async.testing import _servers
from hicache_async.testing._conformance import MAC_KEY, StorageConformance
from hicache_async.testing._servers import (
    RedisServer,
    ServerBinaryNotFoundError,
    ServerError,
    free_port,
)

NS = bytes(range(16))
T = TypeVar("T")
OTHER_NS = bytes(16)


def make_pages(
    count: int, nbytes: int = 3000, *, split: int = 1000
) -> tuple[list[bytes], list[list[memoryview]], list[PageMeta]]:
    """Random keys and two-segment pages (`split` bytes, then the rest)."""
    keys = [os.urandom(32) for _ in range(count)]
    pages = [
        [memoryview(data[:split]), memoryview(data[split:])]
        for data in (os.urandom(nbytes) for _ in range(count))
    ]
    metas = [PageMeta(key=k, namespace=NS, num_tokens=16, priority=i) for i, k in enumerate(keys)]
    return keys, pages, metas


def buffers(count: int, nbytes: int = 3000, *, split: int = 1000) -> list[list[memoryview]]:
    return [
        [memoryview(bytearray(split)), memoryview(bytearray(nbytes - split))] for _ in range(count)
    ]


def joined(page: list[memoryview]) -> bytes:
    return b"".join(bytes(s) for s in page)


def fresh_url(base: str, **params: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"prefix": f"t{uuid.uuid4().hex}", **params}.items())
    return f"{base}?{query}"


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisStorage]:
    async with RedisStorage.from_url(fresh_url(redis_url)) as storage:
        yield storage


async def test_round_trip_with_per_key_outcomes(backend: RedisStorage) -> None:
    keys, pages, metas = make_pages(6)
    assert await backend.put(keys[:4], pages[:4], metas[:4]) == [Outcome.OK] * 4
    into = buffers(6)
    outcomes = await backend.get(keys, into, namespace=NS)
    assert outcomes == [Outcome.OK] * 4 + [Outcome.MISS] * 2
    for page, got in zip(pages[:4], into[:4], strict=True):
        assert joined(got) == joined(page)
    stats = backend.stats()
    assert (stats.puts, stats.put_ok, stats.gets, stats.get_hits) == (4, 4, 6, 4)
    assert stats.pages == 4
    assert stats.bytes == 4 * (HEADER_NBYTES + 3000)


async def test_existing_key_is_ok_and_not_rewritten(backend: RedisStorage) -> None:
    keys, pages, metas = make_pages(1)
    _, other, _ = make_pages(1)
    assert await backend.put(keys, pages, metas) == [Outcome.OK]
    before = await backend.read_raw(keys[0])
    assert await backend.put(keys, other, metas) == [Outcome.OK]
    assert await backend.read_raw(keys[0]) == before
    into = buffers(1)
    assert await backend.get(keys, into, namespace=NS) == [Outcome.OK]
    assert joined(into[0]) == joined(pages[0])
    assert backend.stats().pages == 1


@pytest.mark.parametrize(("multikey", "bulk"), [(1, 1), (1, 0), (0, 1)])
async def test_exists_counts_the_consecutive_prefix(
    redis_url: str, multikey: int, bulk: int
) -> None:
    url = fresh_url(redis_url, multikey=multikey, bulk=bulk)
    async with RedisStorage.from_url(url) as backend:
        keys, pages, metas = make_pages(4)
        stored = [0, 1, 3]
        await backend.put(
            [keys[i] for i in stored], [pages[i] for i in stored], [metas[i] for i in stored]
        )
        assert await backend.exists(keys) == 2
        assert await backend.exists(keys[:2]) == 2
        assert await backend.exists(keys[2:]) == 0
        assert await backend.exists([]) == 0
        # Longer than one script call or pipeline.
        many, many_pages, many_metas = make_pages(1100, 64, split=32)
        await backend.put(many, many_pages, many_metas)
        assert await backend.exists(many) == 1100
        assert await backend.exists([*many[:1050], keys[2], *many[1050:]]) == 1050


async def test_pages_are_one_key_each_without_hash_tags(
    backend: RedisStorage, redis_url: str
) -> None:
    keys, pages, metas = make_pages(3)
    await backend.put(keys, pages, metas)
    client = aioredis.Redis.from_url(redis_url)
    try:
        found = sorted(await client.keys(f"{backend.prefix}:*"))
    finally:
        await client.aclose()
    assert found == sorted(f"{backend.prefix}:{k.hex()}".encode() for k in keys)
    assert not any(b"{" in k for k in found)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda v: v[:-1] + bytes([v[-1] ^ 0xFF]), Outcome.CORRUPT),  # payload bit flips
        (lambda v: v[:100] + bytes([v[100] ^ 1]) + v[101:], Outcome.CORRUPT),  # header
        (lambda v: v[:-10], Outcome.CORRUPT),  # truncated
        (lambda v: v + b"extra", Outcome.CORRUPT),  # too long
        (lambda v: v[:4] + b"\x02\x00" + v[6:], Outcome.MISS),  # a newer format version
    ],
    ids=["payload", "header", "truncated", "extended", "newer-version"],
)
async def test_damaged_pages_are_rejected(
    backend: RedisStorage, damage: object, expected: Outcome
) -> None:
    keys, pages, metas = make_pages(2)
    await backend.put(keys, pages, metas)
    raw = await backend.read_raw(keys[0])
    assert raw is not None
    assert len(raw) == HEADER_NBYTES + 3000
    damaged = damage(raw)  # type: ignore[operator]
    await backend.write_raw(keys[0], damaged)
    outcomes = await backend.get(keys, buffers(2), namespace=NS)
    assert outcomes == [expected, Outcome.OK]
    if expected is Outcome.CORRUPT:
        assert await backend.read_raw(keys[0]) is None  # removed
        assert backend.stats().corrupt == 1
    else:
        assert await backend.read_raw(keys[0]) == damaged  # a newer writer's: left alone
        assert backend.stats().corrupt == 0


#: Values a writer to Redis could store under page keys, far longer than a page.
BIG = 64 << 20


def page_value(key: bytes, payload: bytes, *, claimed: int | None = None) -> bytes:
    """`header ‖ payload`, the header describing `payload`, or a payload of `claimed` bytes."""
    header = encode_header(PageMeta(key=key, namespace=NS, num_tokens=1), [payload])
    if claimed is not None:
        header = encode_header(PageMeta(key=key, namespace=NS, num_tokens=1), [bytes(claimed)])
    return header + payload


async def peak_allocated(call: Awaitable[T]) -> tuple[T, int]:
    """`call`'s result and the most bytes Python held beyond what it held before the call."""
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = await call
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak - before


async def check_oversized_values_are_not_read_whole(backend: RedisStorage) -> None:
    """A get holds about header + expected payload per key, whatever is stored, and sorts
    values as it does when it reads them whole."""
    keys, pages, metas = make_pages(5)
    assert await backend.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
    sound_big = page_value(keys[1], bytes(BIG))  # agrees with itself: another page size
    await backend.write_raw(keys[1], sound_big)
    await backend.write_raw(keys[2], page_value(keys[2], bytes(BIG), claimed=3000))
    await backend.write_raw(keys[3], b"")  # no header at all
    del sound_big
    outcomes, peak = await peak_allocated(backend.get(keys, buffers(5), namespace=NS))
    assert outcomes == [Outcome.OK, Outcome.MISS, Outcome.CORRUPT, Outcome.CORRUPT, Outcome.MISS]
    assert peak < 16 << 20  # the two big values are 128 MiB
    assert await backend.exists(keys[1:2]) == 1  # a sound page of another size stays
    assert await backend.read_raw(keys[2]) is None
    assert await backend.read_raw(keys[3]) is None
    assert backend.stats().corrupt == 2


@pytest.mark.parametrize("bulk", [0, 1])
async def test_a_get_never_reads_a_value_longer_than_its_page(redis_url: str, bulk: int) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url, bulk=bulk)) as backend:
        await check_oversized_values_are_not_read_whole(backend)


async def test_verify_reads_long_values_in_pieces(redis_url: str) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url, bulk=0)) as backend:
        keys, pages, metas = make_pages(3)
        assert await backend.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
        payload = os.urandom(BIG)
        await backend.write_raw(keys[1], page_value(keys[1], payload))  # sound, however long
        damaged = page_value(keys[2], payload)
        await backend.write_raw(keys[2], damaged[:-1] + bytes([damaged[-1] ^ 1]))
        del payload, damaged
        report, peak = await peak_allocated(backend.verify())
        assert (report.checked, report.ok, report.corrupt_removed) == (3, 2, 1)
        assert peak < 32 << 20  # the two big values are 128 MiB
        assert await backend.exists(keys[:2]) == 2
        assert await backend.exists(keys[2:]) == 0


async def test_other_namespace_is_a_miss_left_in_place(backend: RedisStorage) -> None:
    keys, pages, metas = make_pages(1)
    await backend.put(keys, pages, metas)
    assert await backend.get(keys, buffers(1), namespace=OTHER_NS) == [Outcome.MISS]
    assert await backend.exists(keys) == 1  # another deployment's page is not ours to delete
    assert await backend.get(keys, buffers(1), namespace=NS) == [Outcome.OK]


async def test_a_wrong_buffer_size_is_a_miss_that_keeps_the_page(backend: RedisStorage) -> None:
    keys, pages, metas = make_pages(1)
    await backend.put(keys, pages, metas)
    assert await backend.get(keys, buffers(1, 2000), namespace=NS) == [Outcome.MISS]
    into = buffers(1)
    assert await backend.get(keys, into, namespace=NS) == [Outcome.OK]
    assert joined(into[0]) == joined(pages[0])
    assert backend.stats().corrupt == 0


async def test_mac_key_is_required_and_checked(redis_url: str) -> None:
    url = fresh_url(redis_url)
    keys, pages, metas = make_pages(2)
    async with RedisStorage.from_url(url, mac_key=b"k" * 32) as writer:
        await writer.put(keys[:1], pages[:1], metas[:1])
    async with RedisStorage.from_url(url) as plain:
        await plain.put(keys[1:], pages[1:], metas[1:])
        # An unkeyed reader still checks the checksum and accepts the MACed page.
        assert await plain.get(keys[:1], buffers(1), namespace=NS) == [Outcome.OK]
    async with RedisStorage.from_url(url, mac_key=b"k" * 32) as reader:
        into = buffers(1)
        assert await reader.get(keys[:1], into, namespace=NS) == [Outcome.OK]
        assert joined(into[0]) == joined(pages[0])
        # Unkeyed pages are not trusted by a keyed reader.
        assert await reader.get(keys[1:], buffers(1), namespace=NS) == [Outcome.CORRUPT]
    async with RedisStorage.from_url(url, mac_key=b"x" * 32) as stranger:
        assert await stranger.get(keys[:1], buffers(1), namespace=NS) == [Outcome.CORRUPT]


async def test_ttl_expires_pages(redis_url: str) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url, ttl=1)) as backend:
        keys, pages, metas = make_pages(2)
        await backend.put(keys, pages, metas)
        client = aioredis.Redis.from_url(redis_url)
        try:
            ttl = await client.ttl(f"{backend.prefix}:{keys[0].hex()}")
        finally:
            await client.aclose()
        assert 0 < ttl <= 1
        for _ in range(100):  # eventually gone, within 10 s
            if await backend.exists(keys[:1]) == 0:
                break
            await asyncio.sleep(0.1)
        assert await backend.get(keys, buffers(2), namespace=NS) == [Outcome.MISS] * 2


async def test_server_loss_gives_errors_not_hangs() -> None:
    with RedisServer() as server:
        async with RedisStorage.from_url(f"{server.url}?timeout=2&prefix=loss") as backend:
            keys, pages, metas = make_pages(3)
            assert await backend.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
            server.stop()
            assert await backend.get(keys, buffers(3), namespace=NS) == [Outcome.ERROR] * 3
            assert await backend.put(keys[1:], pages[1:], metas[1:]) == [Outcome.ERROR] * 2
            with pytest.raises(StorageError):
                await backend.exists(keys)
            with pytest.raises(StorageError):
                await backend.delete(keys)
            assert backend.stats().errors >= 5


@pytest.mark.parametrize("capacity", ["", "&capacity=1MiB"], ids=["unbounded", "bounded"])
async def test_gc_of_a_server_gone_fails_with_or_without_a_capacity(capacity: str) -> None:
    # Without a capacity there is nothing to trim, but an empty report would tell a cron job
    # that gc succeeded against a server that is gone.
    with RedisServer() as server:
        url = f"{server.url}?timeout=2&prefix=gone{capacity}"
        async with RedisStorage.from_url(url) as backend:
            assert await backend.gc() == GcReport(evicted_pages=0, freed_bytes=0)
            server.stop()
            with pytest.raises(StorageError, match="failed"):
                await backend.gc()


@pytest.mark.parametrize("bulk", [0, 1], ids=["redis-py", "bulk"])
async def test_a_stalled_server_fails_a_batch_in_about_one_timeout(bulk: int) -> None:
    # Ten pipelines of two pages on two connections: once the first fail as a whole, the
    # rest of the batch is ERROR at once instead of each waiting out its own timeout.
    with RedisServer() as server:
        url = (
            f"{server.url}?timeout=0.3&bulk={bulk}&get_pipeline_bytes=6000&put_pipeline_bytes=6000"
        )
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(20)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 20
            pid = server.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                with structlog.testing.capture_logs() as logs:
                    got = await backend.get(keys, buffers(20), namespace=NS)
                    put = await backend.put(*make_pages(20))
            finally:
                os.kill(pid, signal.SIGCONT)
            assert got == [Outcome.ERROR] * 20
            assert put == [Outcome.ERROR] * 20
            events = [entry["event"] for entry in logs]
            assert 1 <= events.count("storage.redis.get_failed") <= 2  # not one per pipeline
            assert 1 <= events.count("storage.redis.put_failed") <= 2
            # The server is back: the next batch reads every page.
            assert await backend.get(keys, buffers(20), namespace=NS) == [Outcome.OK] * 20


async def test_batches_work_again_after_a_server_restart() -> None:
    port = free_port()
    with RedisServer(port=port) as first:
        url = f"{first.url}?timeout=2"
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(2)
            assert await backend.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
            first.stop()
            with RedisServer(port=port):
                # The pooled connections are dead; the next calls reconnect (and exists loads
                # its script again on the new server).
                assert await backend.exists(keys) == 0
                assert await backend.put(keys[1:], pages[1:], metas[1:]) == [Outcome.OK]
                assert await backend.exists(keys[1:]) == 1
                into = buffers(2)
                outcomes = await backend.get(keys, into, namespace=NS)
                assert outcomes == [Outcome.MISS, Outcome.OK]  # the first server kept nothing
                assert joined(into[1]) == joined(pages[1])


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_delete_after_the_server_closed_idle_connections_succeeds(bulk: int) -> None:
    # `timeout 1` in the server's configuration: it closes connections idle for a second.
    with RedisServer(extra_args=["--timeout", "1"]) as server:
        name = f"idle{uuid.uuid4().hex[:8]}"
        url = fresh_url(f"redis://{server.host}:{server.port}/0", bulk=bulk, client_name=name)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(3)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 3
            assert await backend.delete(keys[:1]) == 1
            for _ in range(300):  # up to ~30 s for the server's idle sweep
                if not await asyncio.to_thread(_connections_named, server.host, server.port, name):
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the server did not close the idle connections")
            # Every pooled connection is closed: the delete goes out on a new one.
            assert await backend.delete(keys[1:]) == 2
            assert await backend.exists(keys) == 0
            assert (backend.stats().pages, backend.stats().errors) == (0, 0)


async def test_open_with_no_server_then_batches_are_errors() -> None:
    with RedisServer() as server:
        url = server.url
    async with RedisStorage.from_url(f"{url}?timeout=1") as backend:
        keys, pages, metas = make_pages(1)
        assert await backend.put(keys, pages, metas) == [Outcome.ERROR]


@pytest.mark.parametrize("nbytes", [3000, 300_000], ids=["small", "large"])
@pytest.mark.parametrize("named", [False, True], ids=["plain", "client_name"])
async def test_a_full_maxclients_is_logged_as_the_servers_refusal(nbytes: int, named: bool) -> None:
    # The server writes its refusal as it accepts a connection, then closes it: a batch sent
    # without reading it first took it for a SET's reply, or met a broken pipe.
    with RedisServer() as server:
        params = {"timeout": 2, **({"client_name": "full"} if named else {})}
        url = fresh_url(f"redis://{server.host}:{server.port}/0", bulk=1, **params)
        async with RedisStorage.from_url(url) as backend:
            admin = aioredis.Redis(host=server.host, port=server.port)
            try:
                await admin.config_set("maxclients", 1)
                await admin.execute_command("CLIENT", "KILL", "SKIPME", "yes")
                keys, pages, metas = make_pages(3, nbytes)
                with structlog.testing.capture_logs() as logs:
                    assert await backend.put(keys, pages, metas) == [Outcome.ERROR] * 3
                    got = await backend.get(keys, buffers(3, nbytes), namespace=NS)
                    assert got == [Outcome.ERROR] * 3
            finally:
                await admin.aclose()
    events = {entry["event"]: entry for entry in logs}
    assert "storage.redis.reply_error" not in events
    refusal = "the server refused the connection: ERR max number of clients reached"
    assert events["storage.redis.put_failed"]["error"] == refusal
    assert events["storage.redis.get_failed"]["error"] == refusal


async def test_batches_larger_than_a_pipeline(redis_url: str) -> None:
    url = fresh_url(redis_url, put_pipeline_bytes="64KiB", get_pipeline_bytes="100KiB")
    async with RedisStorage.from_url(url) as backend:
        keys, pages, metas = make_pages(40, 40_000, split=10_000)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 40
        into = buffers(40, 40_000, split=10_000)
        assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 40
        assert [joined(b) for b in into] == [joined(p) for p in pages]


async def test_cancelled_get_writes_nothing_afterwards(redis_url: str) -> None:
    url = fresh_url(redis_url, get_pipeline_bytes="64KiB", concurrency=2)
    async with RedisStorage.from_url(url) as backend:
        keys, pages, metas = make_pages(32, 64_000, split=32_000)
        await backend.put(keys, pages, metas)
        into = buffers(32, 64_000, split=32_000)
        task = asyncio.ensure_future(backend.get(keys, into, namespace=NS))
        for _ in range(100_000):  # until the first pipeline has been copied in
            if task.done() or any(into[0][0]):
                break
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snapshot = [joined(b) for b in into]
        await asyncio.sleep(0.2)
        assert [joined(b) for b in into] == snapshot
        # The backend is still usable.
        again = buffers(32, 64_000, split=32_000)
        assert await backend.get(keys, again, namespace=NS) == [Outcome.OK] * 32


async def test_delete_counts_existing(backend: RedisStorage) -> None:
    keys, pages, metas = make_pages(3)
    await backend.put(keys[:2], pages[:2], metas[:2])
    assert await backend.delete(keys) == 2
    assert await backend.exists(keys) == 0
    stats = backend.stats()
    assert (stats.deletes, stats.pages, stats.bytes) == (2, 0, 0)


async def test_misuse_raises_before_io(backend: RedisStorage) -> None:
    keys, pages, metas = make_pages(2)
    with pytest.raises(ValueError, match="buffers"):
        await backend.get(keys, buffers(1), namespace=NS)
    with pytest.raises(ValueError, match="metas"):
        await backend.put(keys, pages, metas[:1])
    with pytest.raises(ValueError, match=r"meta\.key"):
        await backend.put(keys, pages, list(reversed(metas)))
    assert await backend.exists(keys) == 0
    assert backend.stats().puts == 0


async def test_closed_backend_raises(redis_url: str) -> None:
    backend = RedisStorage.from_url(fresh_url(redis_url))
    keys, pages, metas = make_pages(1)
    with pytest.raises(StorageError, match="not open"):
        await backend.exists(keys)
    async with backend:
        await backend.put(keys, pages, metas)
    await backend.close()  # idempotent
    for call in (
        backend.exists(keys),
        backend.get(keys, buffers(1), namespace=NS),
        backend.put(keys, pages, metas),
        backend.delete(keys),
        backend.read_raw(keys[0]),
    ):
        with pytest.raises(StorageError, match="closed"):
            await call


async def test_list_verify_and_gc(redis_url: str) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url, capacity=7000)) as backend:
        keys, pages, metas = make_pages(4)
        await backend.put(keys, pages, metas)
        listed = await backend.list_pages()
        assert sorted(p.key for p in listed) == sorted(keys)
        assert {p.nbytes for p in listed} == {HEADER_NBYTES + 3000}
        assert sorted(p.priority for p in listed) == [0, 1, 2, 3]
        assert len(await backend.list_pages(limit=2)) == 2
        raw = await backend.read_raw(keys[1])
        assert raw is not None
        await backend.write_raw(keys[1], raw[:-1] + bytes([raw[-1] ^ 1]))
        report = await backend.verify()
        assert (report.checked, report.ok, report.corrupt_removed) == (4, 3, 1)
        assert await backend.read_raw(keys[1]) is None
        gc = await backend.gc()  # 3 pages of 3128 bytes, capacity 7000: one goes
        assert (gc.evicted_pages, gc.freed_bytes) == (1, HEADER_NBYTES + 3000)
        assert len(await backend.list_pages()) == 2
        assert backend.stats().evictions == 1


@pytest.mark.parametrize("inspect", ["list_pages", "verify", "gc"])
async def test_listing_the_pages_does_not_cost_gc_its_order(redis_url: str, inspect: str) -> None:
    # Reading every page counts as a use for Redis: after a listing, a verify or a gc, what
    # was not used since goes by its age, oldest first, and what was used since goes last.
    page = HEADER_NBYTES + 3000
    url = fresh_url(redis_url)
    async with (
        RedisStorage.from_url(f"{url}&capacity={6 * page}") as roomy,
        RedisStorage.from_url(f"{url}&capacity={3 * page}") as backend,
    ):
        old, old_pages, old_metas = make_pages(4)
        for key, data, meta in zip(old, old_pages, old_metas, strict=True):
            assert await backend.put([key], [data], [meta]) == [Outcome.OK]
        new, new_pages, new_metas = make_pages(2)
        assert await backend.put(new, new_pages, new_metas) == [Outcome.OK] * 2
        await getattr(roomy, inspect)()  # a gc that has room for all six evicts nothing
        # One old page is used after the pass, later than Redis's one-second idle clock.
        await asyncio.sleep(2.2)
        assert await backend.get(old[:1], buffers(1), namespace=NS) == [Outcome.OK]
        gc = await backend.gc()
        assert gc.evicted_pages == 3
        assert await backend.exists(new) == 2
        assert await backend.exists(old[:1]) == 1
        assert sum([await backend.exists([key]) for key in old[1:]]) == 0


def _victims_by_one_sort(
    entries: list[tuple[float, int, bytes]], total: int, capacity: int
) -> list[bytes]:
    """What gc evicted when it sorted every page at once: the reference order."""
    ordered = sorted(entries, key=itemgetter(0), reverse=True)
    victims = []
    while ordered and total > capacity:
        _, nbytes, rkey = ordered.pop()
        victims.append(rkey)
        total -= nbytes
    return victims


def test_gc_victims_in_slices_are_those_of_one_sort() -> None:
    rng = random.Random(7)
    for count, slice_len in [(0, 4), (1, 4), (50, 7), (1000, 64), (1000, 1000), (1000, 5000)]:
        # Few distinct times: many ties, which go latest listed first.
        entries = [
            (float(rng.randrange(20)), rng.randrange(1, 100), b"%d" % i) for i in range(count)
        ]
        total = sum(nbytes for _, nbytes, _ in entries)
        for capacity in (0, total // 3, total - 1, total):
            chosen = _redis._gc_victims(entries, total, capacity, slice_len=slice_len)
            assert chosen == _victims_by_one_sort(entries, total, capacity)


async def test_gc_chooses_its_victims_off_the_loop(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sorting every page on the loop held it for about 0.1 s at 200k pages.
    page = HEADER_NBYTES + 3000
    async with RedisStorage.from_url(fresh_url(redis_url, capacity=2 * page)) as backend:
        keys, pages, metas = make_pages(4)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 4
        reached, go = threading.Event(), threading.Event()
        threads: list[threading.Thread] = []
        choose = _redis._gc_victims

        def held(*args: Any, **kwargs: Any) -> list[bytes]:
            threads.append(threading.current_thread())
            reached.set()
            assert go.wait(10), "the test never let the worker go"
            return choose(*args, **kwargs)

        monkeypatch.setattr(_redis, "_gc_victims", held)
        collecting = asyncio.ensure_future(backend.gc())
        try:
            assert await asyncio.to_thread(reached.wait, 10)
            # While gc chooses, the loop serves other calls.
            assert await backend.exists(keys) == 4
        finally:
            go.set()
        report = await collecting
        assert (report.evicted_pages, report.freed_bytes) == (2, 2 * page)
        assert threads
        assert threading.current_thread() not in threads


async def test_gc_evicts_pages_with_unreadable_headers_first_and_lists_empty_values(
    redis_url: str,
) -> None:
    page = HEADER_NBYTES + 3000
    async with RedisStorage.from_url(fresh_url(redis_url, capacity=2 * page)) as backend:
        keys, pages, metas = make_pages(4)
        assert await backend.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
        raw = await backend.read_raw(keys[0])
        assert raw is not None
        await backend.write_raw(keys[0], raw[:40] + bytes([raw[40] ^ 1]) + raw[41:])
        await backend.list_pages()  # the listing itself reads every page
        assert await backend.put(keys[1:], pages[1:], metas[1:]) == [Outcome.OK] * 3
        (empty,) = make_pages(1)[0]
        await backend.write_raw(empty, b"")
        listed = {p.key: p for p in await backend.list_pages()}
        assert listed[keys[0]].last_access == 0.0
        assert listed[empty].nbytes == 0
        # The empty value and the damaged page first (no time to go by), then the oldest
        # sound page.
        gc = await backend.gc()
        assert (gc.evicted_pages, gc.freed_bytes) == (3, 2 * page)
        assert await backend.exists([empty]) == 0
        assert await backend.exists(keys[:1]) == 0
        assert await backend.exists(keys[1:2]) == 0
        assert await backend.exists(keys[2:]) == 2


async def test_listings_keep_newer_format_pages_recent_and_verify_counts_foreign_types(
    redis_url: str,
) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url)) as backend:
        keys, pages, metas = make_pages(3)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 3
        raw = await backend.read_raw(keys[0])
        assert raw is not None
        newer = raw[:4] + struct.pack("<H", FORMAT_VERSION + 1) + raw[6:]
        await backend.write_raw(keys[0], newer)
        await backend.list_pages()  # marks every page read: later listings go by creation
        await asyncio.sleep(1.1)  # past the one-second idle clock
        listed = {p.key: p for p in await backend.list_pages()}
        assert listed[keys[0]].last_access >= listed[keys[1]].last_access > 0
        client = backend._redis()
        await client.delete(backend._rkey(keys[1]))
        await client.hset(backend._rkey(keys[1]), "field", "value")  # not ours to remove
        report = await backend.verify()
        assert (report.checked, report.ok, report.unsupported, report.unchecked) == (2, 1, 1, 1)
        assert await client.type(backend._rkey(keys[1])) in (b"hash", "hash")


async def test_an_lfu_server_lists_empty_values(redis_url: str) -> None:
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lfu"]) as server:
        async with RedisStorage.from_url(fresh_url(server.url)) as backend:
            keys, pages, metas = make_pages(2)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 2
            await backend.write_raw(keys[1], b"")
            with structlog.testing.capture_logs() as logs:
                listed = {p.key: p.nbytes for p in await backend.list_pages()}
            assert listed == {keys[0]: HEADER_NBYTES + 3000, keys[1]: 0}
            # No idle times under LFU is the policy, not a refusal.
            assert not [e for e in logs if e["event"] == "storage.redis.idletime_refused"]


async def test_an_lfu_listing_puts_a_page_stamped_far_ahead_first_for_gc() -> None:
    # Under LFU a page lists by its header's creation, which its writer's clock stamped: one
    # stamped more than 300 s ahead would list newest and be the last gc evicts until that
    # time came; it lists as never used. One a little ahead lists as now.
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lfu"]) as server:
        async with RedisStorage.from_url(fresh_url(server.url, capacity=7000)) as backend:
            keys, pages, metas = make_pages(3)
            assert await backend.put(keys[2:], pages[2:], metas[2:]) == [Outcome.OK]
            for key, page, meta, ahead_s in zip(keys, pages, metas, (86_400, 100), strict=False):
                header = encode_header(meta, page, created_ns=time.time_ns() + ahead_s * 10**9)
                await backend.write_raw(key, header + joined(page))
            before = time.time()
            listed = await backend.list_pages(record=False)
            assert [page.key for page in listed][-1] == keys[0]
            by_key = {page.key: page for page in listed}
            assert by_key[keys[0]].last_access == 0.0
            assert before <= by_key[keys[1]].last_access <= time.time()
            limited = await backend.list_pages(2, record=False)
            assert keys[0] not in {page.key for page in limited}
            # 7000 bytes hold two pages: the one stamped far ahead goes.
            gc = await backend.gc()
            assert gc.evicted_pages == 1
            assert await backend.exists(keys[:1]) == 0
            assert await backend.exists(keys[1:2]) == 1


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_listing_without_idle_times_says_once_that_it_orders_by_age(
    redis_url: str, bulk: int
) -> None:
    async with (
        acl_user(redis_url, "~*", "+@all", "-object") as (user, _),
        RedisStorage.from_url(user_url(redis_url, user, bulk=bulk)) as backend,
    ):
        keys, pages, metas = make_pages(3)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 3
        with structlog.testing.capture_logs() as logs:
            assert len(await backend.list_pages()) == 3
            assert len(await backend.list_pages(2, record=False)) == 2
            await backend.gc()
    told = [e for e in logs if e["event"] == "storage.redis.idletime_refused"]
    assert len(told) == 1
    assert "no permissions to run the 'object|idletime' command" in told[0]["error"]


@pytest.mark.parametrize("params", [{}, {"bulk": 0}, {"multikey": 0}])
async def test_exists_counts_as_a_use_for_the_servers_eviction(params: dict[str, int]) -> None:
    # Under LFU a key's counter starts at 5 and its first use makes it 6 (for sure, not by
    # chance); EXISTS is no use, TOUCH is. The script touches only the prefix it found; a
    # pipeline (multikey=0) touches every key it asked about.
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lfu"]) as server:
        async with RedisStorage.from_url(fresh_url(server.url, **params)) as backend:
            keys, pages, metas = make_pages(4)
            stored = [0, 1, 3]
            outcomes = await backend.put(
                [keys[i] for i in stored], [pages[i] for i in stored], [metas[i] for i in stored]
            )
            assert outcomes == [Outcome.OK] * 3
            client = backend._redis()

            async def counters() -> list[int]:
                return [await client.object("freq", backend._rkey(keys[i])) for i in stored]

            before = await counters()
            assert await backend.exists(keys) == 2
            beyond = 1 if params.get("multikey") == 0 else 0
            assert await counters() == [before[0] + 1, before[1] + 1, before[2] + beyond]


async def test_verify_keeps_a_page_stored_again_while_it_ran(redis_url: str) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url)) as backend:
        keys, pages, metas = make_pages(2)
        await backend.put(keys, pages, metas)
        raw = await backend.read_raw(keys[0])
        assert raw is not None
        await backend.write_raw(keys[0], raw[:-1] + bytes([raw[-1] ^ 1]))
        remove = backend._remove_if_same
        assert remove is not None

        async def stored_again_first(**kwargs: object) -> object:
            # Between verify's read and its removal, a get removes the damaged page and the
            # page is stored again, sound.
            assert await backend.get(keys[:1], buffers(1), namespace=NS) == [Outcome.CORRUPT]
            assert await backend.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
            return await remove(**kwargs)

        backend._remove_if_same = stored_again_first  # type: ignore[assignment]
        report = await backend.verify()
        assert (report.checked, report.ok, report.corrupt_removed) == (2, 1, 0)
        into = buffers(2)
        assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 2
        assert [joined(page) for page in into] == [joined(page) for page in pages]
        assert backend.stats().pages == 2


async def test_verify_without_scripting_removes_only_damaged_pages() -> None:
    hidden = ["--rename-command", "EVALSHA", f"x{uuid.uuid4().hex}"]
    hidden += ["--rename-command", "EVAL", f"x{uuid.uuid4().hex}"]
    hidden += ["--rename-command", "EVAL_RO", f"x{uuid.uuid4().hex}"]
    with RedisServer(extra_args=hidden) as server:
        url = fresh_url(f"redis://{server.host}:{server.port}/0", multikey=0)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(3)
            await backend.put(keys, pages, metas)
            raw = await backend.read_raw(keys[1])
            assert raw is not None
            await backend.write_raw(keys[1], raw[:-1] + bytes([raw[-1] ^ 1]))
            report = await backend.verify()
            assert (report.checked, report.ok, report.corrupt_removed) == (3, 2, 1)
            assert await backend.read_raw(keys[1]) is None
            assert backend.stats().pages == 2


async def test_write_raw_keeps_the_occupancy_true(backend: RedisStorage) -> None:
    keys, pages, metas = make_pages(2)
    await backend.put(keys[:1], pages[:1], metas[:1])
    raw = await backend.read_raw(keys[0])
    assert raw is not None
    await backend.write_raw(keys[1], raw[:100])  # a new key
    await backend.write_raw(keys[0], raw + b"x")  # a replaced one
    stats = backend.stats()
    assert (stats.pages, stats.bytes) == (2, len(raw) + 1 + 100)
    assert await backend.delete(keys) == 2
    assert (backend.stats().pages, backend.stats().bytes) == (0, 0)


async def test_keys_under_the_prefix_that_are_not_pages_are_left_alone(redis_url: str) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url)) as backend:
        keys, pages, metas = make_pages(3)
        await backend.put(keys, pages, metas)
        foreign = [
            f"{backend.prefix}:{tail}".encode()
            for tail in ("deadbeef", "00", "AB" * 32, "ab" * 33, "manifest:x")
        ]
        client = aioredis.Redis.from_url(redis_url)
        try:
            for rkey in foreign:
                await client.set(rkey, b"someone else's")
            assert sorted(p.key for p in await backend.list_pages()) == sorted(keys)
            report = await backend.verify()
            assert (report.checked, report.ok, report.corrupt_removed) == (3, 3, 0)
            assert await client.exists(*foreign) == len(foreign)
            assert backend.stats().pages == 3
        finally:
            await client.delete(*foreign)
            await client.aclose()


def test_from_url_parameters() -> None:
    backend = RedisStorage.from_url(
        "redis://user:secret@127.0.0.1:6390/2?ttl=60&prefix=p&max_connections=4"
        "&timeout=0.5&concurrency=8&put_pipeline_bytes=1MiB&capacity=1GiB&multikey=0"
    )
    assert "secret" not in backend.name
    assert backend.name == "redis://127.0.0.1:6390/2?prefix=p"
    assert backend.prefix == "p"
    assert backend.stats().capacity_bytes == 1 << 30
    assert backend.capabilities.shared
    assert not backend.capabilities.zero_copy
    assert RedisStorage.from_url("rediss://example.com").name.startswith("rediss://example.com")
    with pytest.raises(StorageConfigError, match=r"accepted: .*ttl"):
        RedisStorage.from_url("redis://127.0.0.1:6379/0?colour=blue")
    with pytest.raises(StorageConfigError, match="ttl"):
        RedisStorage.from_url("redis://127.0.0.1:6379/0?ttl=0")
    with pytest.raises(StorageConfigError, match="twice"):
        RedisStorage.from_url("redis://127.0.0.1:6379/0?ttl=1&ttl=2")
    with pytest.raises(StorageConfigError, match="redis://"):
        RedisStorage.from_url("http://127.0.0.1:6379/0")
    # redis-py would take these for localhost, or drop the fragment unsaid.
    for url in ("redis:///0", "redis://127.0.0.1:6379/0#x"):
        with pytest.raises(StorageConfigError, match="needs a host, and takes no fragment"):
            RedisStorage.from_url(url)
        with pytest.raises(StorageConfigError, match="needs a host, and takes no fragment"):
            RedisStorage(url)
    with pytest.raises(StorageConfigError, match="prefix"):
        RedisStorage.from_url("redis://127.0.0.1:6379/0?prefix=a*b")
    # redis-py would drop blank values silently, and fail on TLS settings only at open.
    for query in ("client_name=", "ssl_ca_certs=", "ssl_cert_reqs=", "ssl_check_hostname="):
        with pytest.raises(StorageConfigError, match="no value"):
            RedisStorage.from_url(f"rediss://127.0.0.1:6379/0?{query}")
    with pytest.raises(StorageConfigError, match="rediss://"):
        RedisStorage.from_url("redis://127.0.0.1:6379/0?ssl_cert_reqs=none")
    with pytest.raises(StorageConfigError, match="accepted: none, optional, required"):
        RedisStorage.from_url("rediss://127.0.0.1:6379/0?ssl_cert_reqs=bogus")
    with pytest.raises(StorageConfigError, match="ssl_check_hostname"):
        RedisStorage.from_url("rediss://127.0.0.1:6379/0?ssl_check_hostname=maybe")
    assert RedisStorage.from_url(
        "rediss://127.0.0.1:6379/0?ssl_cert_reqs=none&ssl_check_hostname=0&client_name=me"
    ).name.startswith("rediss://127.0.0.1:6379/0")
    # A backslash escapes in SCAN patterns: t\e\am would match team's keys.
    with pytest.raises(StorageConfigError, match="prefix"):
        RedisStorage.from_url("redis://127.0.0.1:6379/0?prefix=t%5Ce%5Cam")
    # Braces make a cluster hash tag (every page in one slot); page names are cut after the
    # prefix by its length, which a non-ASCII prefix has otherwise in bytes.
    for prefix in ("hi%7Bcache%7D", "%7Btenant%7D", "hicach%C3%A9", "a%09b"):
        with pytest.raises(StorageConfigError, match="prefix"):
            RedisStorage.from_url(f"redis://127.0.0.1:6379/0?prefix={prefix}")
    with pytest.raises(StorageConfigError, match="braces"):
        RedisStorage(prefix="{x}")
    # The constructor's URL carries only what redis-py reads; redis-py would take the rest
    # for connection arguments and fail at the first connection (or drop them).
    for query in ("ttl=5", "prefix=mine", "timeout=1"):
        with pytest.raises(StorageConfigError, match="as arguments"):
            RedisStorage(f"redis://127.0.0.1:6379/0?{query}")
    with pytest.raises(StorageConfigError, match="unknown parameter 'colour'"):
        RedisStorage("redis://127.0.0.1:6379/0?colour=blue")
    with pytest.raises(StorageConfigError, match="client_name"):
        RedisStorage("redis://127.0.0.1:6379/0?client_name=a%20b")
    assert RedisStorage("redis://127.0.0.1:6379/0?client_name=me").name.startswith("redis://")
    # The server would refuse the name at every connection, so every call would fail.
    for name in ("a%20b", "caf%C3%A9", "a%0Ab"):
        with pytest.raises(StorageConfigError, match="client_name"):
            RedisStorage.from_url(f"redis://127.0.0.1:6379/0?client_name={name}")


def test_ttl_and_argument_types_are_checked() -> None:
    # The server refuses such a ttl at every SET (or an old one drops the key at once): every
    # put would be ERROR, so it is refused here, by URL and by argument.
    # int() would also take "+5", " 5" and digits of other scripts ("٣").
    for ttl in (
        "10000000000000000",
        "99999999999999999999",
        "315360001",
        "1.5",
        "nan",
        "0",
        "%2B5",
        "%205",
        "%D9%A3",
    ):
        with pytest.raises(StorageConfigError, match="ttl"):
            RedisStorage.from_url(f"redis://127.0.0.1:6379/0?ttl={ttl}")
    assert RedisStorage.from_url("redis://127.0.0.1:6379/0?ttl=315360000")._ttl == 315360000
    refused: list[tuple[dict[str, object], str]] = [
        ({"ttl": 1.5}, "ttl must be an integer from 1 to 315360000"),
        ({"ttl": float("nan")}, "ttl must be an integer"),
        ({"ttl": True}, "ttl must be an integer"),
        ({"ttl": "60"}, "ttl must be an integer"),
        ({"ttl": 315360001}, "ttl must be an integer"),
        ({"max_connections": 2.5}, "max_connections must be an integer >= 1"),
        ({"concurrency": True}, "concurrency must be an integer >= 1"),
        ({"max_batch_pages": "8"}, "max_batch_pages must be an integer >= 1"),
        ({"get_pipeline_bytes": 1.0}, "get_pipeline_bytes must be an integer >= 1"),
        ({"capacity_bytes": 0}, "capacity_bytes must be an integer >= 1"),
        ({"timeout": "5"}, "timeout must be a finite number of seconds >= 0.001"),
        ({"timeout": 1e-9}, "timeout must be a finite number of seconds >= 0.001"),
        ({"timeout": True}, "timeout must be a finite number"),
        ({"timeout": float("inf")}, "timeout must be a finite number"),
        ({"timeout": 10**400}, "timeout must be a finite number"),  # past a float's range
        ({"prefix": b"x"}, "prefix must be a str, got bytes"),
        ({"bulk": 1}, "bulk must be True or False"),
        ({"multikey": "no"}, "multikey must be True, False or None"),
        ({"connection_kwargs": [("a", 1)]}, "connection_kwargs must be a mapping"),
    ]
    for kwargs, message in refused:
        with pytest.raises(StorageConfigError, match=message):
            RedisStorage(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(StorageConfigError, match="url must be a str"):
        RedisStorage(b"redis://127.0.0.1:6379/0")  # type: ignore[arg-type]
    assert RedisStorage(timeout=1)._timeout == 1


@pytest.mark.parametrize("bulk", [1, 0])
async def test_the_longest_ttl_is_one_the_server_accepts(redis_url: str, bulk: int) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url, bulk=bulk, ttl=315360000)) as backend:
        keys, pages, metas = make_pages(2)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 2
        plain = aioredis.Redis.from_url(redis_url)
        try:
            assert await plain.ttl(f"{backend.prefix}:{keys[0].hex()}") > 315350000
        finally:
            await plain.aclose()


class TestRedisConformance(StorageConformance):
    @pytest_asyncio.fixture
    async def backend(self, redis_url: str) -> AsyncIterator[RedisStorage]:
        async with RedisStorage.from_url(fresh_url(redis_url)) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self, redis_url: str) -> AsyncIterator[RedisStorage]:
        async with RedisStorage.from_url(fresh_url(redis_url), mac_key=MAC_KEY) as storage:
            yield storage


class TestRedisConformanceWithoutBulk(StorageConformance):
    """The same contract with page values moved by redis-py (`bulk=0`, as over TLS)."""

    @pytest_asyncio.fixture
    async def backend(self, redis_url: str) -> AsyncIterator[RedisStorage]:
        async with RedisStorage.from_url(fresh_url(redis_url, bulk=0)) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self, redis_url: str) -> AsyncIterator[RedisStorage]:
        url = fresh_url(redis_url, bulk=0)
        async with RedisStorage.from_url(url, mac_key=MAC_KEY) as storage:
            yield storage


@pytest.mark.parametrize("bulk", [0, 1])
async def test_both_paths_store_the_same_values(redis_url: str, bulk: int) -> None:
    url = fresh_url(redis_url, bulk=bulk, put_pipeline_bytes="8KiB", get_pipeline_bytes="8KiB")
    async with RedisStorage.from_url(url) as backend:
        assert (backend._bulk is not None) == bool(bulk)
        keys, pages, metas = make_pages(9, 5000, split=1234)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 9
        # What one path wrote, the other reads: the values are the same bytes.
        other = fresh_url(redis_url, bulk=1 - bulk, prefix=backend.prefix)
        async with RedisStorage.from_url(other) as reader:
            into = buffers(9, 5000, split=1234)
            assert await reader.get(keys, into, namespace=NS) == [Outcome.OK] * 9
            assert [joined(b) for b in into] == [joined(p) for p in pages]
            raw = await reader.read_raw(keys[0])
            assert raw is not None
            assert raw[HEADER_NBYTES:] == joined(pages[0])


async def test_bulk_connections_authenticate_and_select_the_database() -> None:
    with RedisServer() as server:
        admin = aioredis.Redis(host=server.host, port=server.port)
        try:
            await admin.config_set("requirepass", "s3cret")
        finally:
            await admin.aclose()
        url = f"redis://:s3cret@{server.host}:{server.port}/3?prefix=auth"
        async with RedisStorage.from_url(url) as backend:
            assert backend._bulk is not None
            keys, pages, metas = make_pages(3)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 3
            into = buffers(3)
            assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 3
            assert [joined(b) for b in into] == [joined(p) for p in pages]
        plain = aioredis.Redis(host=server.host, port=server.port, password="s3cret", db=3)
        try:
            assert await plain.exists(f"auth:{keys[0].hex()}") == 1
            await plain.select(0)  # type: ignore[no-untyped-call]
            assert await plain.dbsize() == 0
        finally:
            await plain.aclose()
        # Credentials, a database or a connection setting the server refuses: no call could
        # ever succeed, so the open fails, saying why (and not the password).
        for wrong, why in (
            (f"redis://:nope@{server.host}:{server.port}/3", "invalid username-password"),
            # redis-py 8 says "... already authenticated ...", earlier "Authentication required."
            (f"redis://{server.host}:{server.port}/3", "authenticat"),
            (f"redis://:s3cret@{server.host}:{server.port}/99", "DB index is out of range"),
        ):
            with pytest.raises(StorageConfigError, match="refused this configuration") as info:
                async with RedisStorage.from_url(f"{wrong}?prefix=auth&timeout=2"):
                    pytest.fail("opened with a configuration the server refuses")
            assert why.lower() in str(info.value).lower()
            assert "nope" not in str(info.value)


async def test_a_listing_the_acl_keeps_keys_from_is_an_error(redis_url: str) -> None:
    url = fresh_url(redis_url)
    async with RedisStorage.from_url(url) as writer:
        keys, pages, metas = make_pages(2)
        assert await writer.put(keys, pages, metas) == [Outcome.OK] * 2
        prefix = writer.prefix
    async with (
        acl_user(redis_url, "~elsewhere:*", "+@all") as (user, _),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix)) as reader,
    ):
        with pytest.raises(StorageError, match=r"list_pages failed: .*no permissions"):
            await reader.list_pages()
        with pytest.raises(StorageError, match=r"count_pages failed: .*no permissions"):
            await reader.count_pages()


async def test_an_acl_refusing_the_connection_setup_fails_the_open(redis_url: str) -> None:
    async with acl_user(redis_url, "~*", "+@all", "-client") as (user, _):
        url = user_url(redis_url, user, client_name="hicache")
        with pytest.raises(StorageConfigError, match=re.escape("'client|setname'")):
            async with RedisStorage.from_url(url):
                pytest.fail("opened with a client name the ACL refuses")
    # Refusing PING alone refuses nothing the store needs: it opens, quietly, and works.
    async with acl_user(redis_url, "~*", "+@all", "-ping") as (user, _):
        with structlog.testing.capture_logs() as logs:
            async with RedisStorage.from_url(user_url(redis_url, user)) as backend:
                keys, pages, metas = make_pages(2)
                assert await backend.put(keys, pages, metas) == [Outcome.OK] * 2
                assert await backend.get(keys, buffers(2), namespace=NS) == [Outcome.OK] * 2
        assert "storage.redis.unreachable" not in [entry["event"] for entry in logs]


@pytest.mark.parametrize("params", [{}, {"bulk": 0}, {"multikey": 0}])
async def test_exists_asks_with_exists_where_touch_is_refused(params: dict[str, int]) -> None:
    # An ACL that lists commands and leaves TOUCH out: exists answers all the same.
    with RedisServer() as server:
        admin = aioredis.Redis(host=server.host, port=server.port)
        try:
            await admin.execute_command(
                "ACL", "SETUSER", "touchless", "on", ">pw", "~*", "+@all", "-touch"
            )
        finally:
            await admin.aclose()
        url = fresh_url(f"redis://touchless:pw@{server.host}:{server.port}/0", **params)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(3)
            assert await backend.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
            with structlog.testing.capture_logs() as logs:
                assert await backend.exists(keys) == 2
                assert await backend.exists(keys[:1]) == 1
                assert await backend.exists(keys[2:]) == 0
            assert backend.stats().errors == 0
        fallbacks = [e["event"] for e in logs].count("storage.redis.no_touch")
        assert fallbacks == (1 if params.get("multikey") == 0 else 0)


@pytest.mark.parametrize("bulk", [1, 0])
@pytest.mark.parametrize(
    ("rules", "params", "events"),
    [
        (("~*", "+@all", "-touch"), {"multikey": 0}, ["storage.redis.no_touch"]),
        (
            ("%R~*", "+@all", "-eval_ro"),
            {},
            ["hicache.redis.eval_ro_refused", "storage.redis.no_scripting"],
        ),
    ],
    ids=["touch", "script"],
)
async def test_calls_refused_together_all_fall_back_and_say_it_once(
    redis_url: str, bulk: int, rules: tuple[str, ...], params: dict[str, int], events: list[str]
) -> None:
    keys, pages, metas = make_pages(3)
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        assert await writer.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        prefix = writer.prefix
    async with (
        acl_user(redis_url, *rules) as (user, _),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix, bulk=bulk, **params)) as r,
    ):
        with structlog.testing.capture_logs() as logs:
            # Each sent before the first refusal came back.
            assert await asyncio.gather(*(r.exists(keys) for _ in range(8))) == [2] * 8
        assert r.stats().errors == 0
    assert [e["event"] for e in logs] == events


async def test_exists_loads_its_script_again_after_a_flush(redis_url: str) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url)) as backend:
        assert backend._bulk is not None
        keys, pages, metas = make_pages(3)
        await backend.put(keys[:2], pages[:2], metas[:2])
        assert await backend.exists(keys) == 2
        plain = aioredis.Redis.from_url(redis_url)
        try:
            await plain.script_flush()  # the bulk EVALSHA now gets NOSCRIPT
            assert await backend.exists(keys) == 2
            assert await backend.exists(keys[1:]) == 1  # loaded again, on the bulk path
            assert await plain.script_exists(backend._prefix_script.sha) == [True]  # type: ignore[union-attr]
        finally:
            await plain.aclose()
        assert backend.stats().errors == 0


async def test_exists_rejects_a_count_beyond_its_keys() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            writer.write(b":99\r\n")  # any command: "99", more keys than were asked about
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        url = f"redis://127.0.0.1:{port}/0?timeout=0.5&prefix=odd"
        async with RedisStorage.from_url(url) as backend:
            keys, _, _ = make_pages(2)
            with pytest.raises(StorageError, match="exists got 99 for 2 keys"):
                await backend.exists(keys)
            assert backend.stats().errors == 1
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("mac", [False, True])
async def test_big_pages_are_hashed_ahead_of_the_sends(redis_url: str, mac: bool) -> None:
    # Pages over 2 MiB are hashed on a worker thread running ahead of the SETs.
    url = fresh_url(redis_url, put_pipeline_bytes="1MiB")  # one page per pipeline
    mac_key = MAC_KEY if mac else None
    async with RedisStorage.from_url(url, mac_key=mac_key) as backend:
        nbytes = 3 << 20
        keys, pages, metas = make_pages(5, nbytes, split=1 << 20)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 5
        into = buffers(5, nbytes, split=1 << 20)
        assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 5
        assert [joined(b) for b in into] == [joined(p) for p in pages]
        # Cancelled while hashing and sending: nothing is left running, the backend works on.
        more_keys, more_pages, more_metas = make_pages(6, nbytes, split=1 << 20)
        task = asyncio.ensure_future(backend.put(more_keys, more_pages, more_metas))
        await asyncio.sleep(0.005)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert await backend.put(more_keys, more_pages, more_metas) == [Outcome.OK] * 6
        again = buffers(6, nbytes, split=1 << 20)
        assert await backend.get(more_keys, again, namespace=NS) == [Outcome.OK] * 6
        assert [joined(b) for b in again] == [joined(p) for p in more_pages]


@pytest.mark.parametrize("bulk", [0, 1])
async def test_an_error_reply_fails_only_its_key(redis_url: str, bulk: int) -> None:
    url = fresh_url(redis_url, bulk=bulk)
    async with RedisStorage.from_url(url) as backend:
        keys, pages, metas = make_pages(3)
        plain = aioredis.Redis.from_url(redis_url)
        try:  # the middle key holds a list: GET and SET on it answer WRONGTYPE / are refused
            await plain.rpush(f"{backend.prefix}:{keys[1].hex()}", b"x")  # type: ignore[misc]
        finally:
            await plain.aclose()
        assert await backend.put(keys, pages, metas) == [
            Outcome.OK,
            Outcome.OK,  # SET NX keeps the existing key, whatever its type
            Outcome.OK,
        ]
        into = buffers(3)
        outcomes = await backend.get(keys, into, namespace=NS)
        assert outcomes == [Outcome.OK, Outcome.ERROR, Outcome.OK]
        assert joined(into[2]) == joined(pages[2])
        # The connection stayed in step: the next batch reads the right values.
        again = buffers(3)
        assert await backend.get(keys, again, namespace=NS) == outcomes
        assert joined(again[0]) == joined(pages[0])


@contextlib.asynccontextmanager
async def acl_user(redis_url: str, *rules: str) -> AsyncIterator[tuple[str, aioredis.Redis]]:
    """A user on the server with `rules` (password `pw`), deleted afterwards: its name, and
    an admin client to change its rules with."""
    name = f"u{uuid.uuid4().hex[:12]}"
    admin = aioredis.Redis.from_url(redis_url)
    try:
        await admin.execute_command("ACL", "SETUSER", name, "on", ">pw", *rules)
        yield name, admin
    finally:
        await admin.execute_command("ACL", "DELUSER", name)
        await admin.aclose()


def user_url(redis_url: str, user: str, **params: object) -> str:
    return fresh_url(redis_url.replace("redis://", f"redis://{user}:pw@"), **params)


async def test_a_delete_refused_some_keys_uncounts_every_key_it_removed(redis_url: str) -> None:
    # The server runs every DEL of a pipeline, those after a refused one too; only the keys
    # before the first refusal were taken off the counts, so `stats()` kept counting pages
    # the server had removed.
    async with (
        acl_user(redis_url, "~*", "+@all") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user)) as backend,
    ):
        keys, pages, metas = make_pages(40)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 40
        writable = re.compile("[0-7]")
        # The refused keys first: the old count stopped at the first one.
        keys.sort(key=lambda k: bool(writable.match(k.hex())))
        assert not writable.match(keys[0].hex())
        rules = [f"%W~{backend.prefix}:{d}*" for d in "01234567"]
        await admin.execute_command("ACL", "SETUSER", user, "resetkeys", "%R~*", *rules)
        with pytest.raises(StorageError, match="no permissions"):
            await backend.delete(keys)
        left = await admin.exists(*(f"{backend.prefix}:{k.hex()}" for k in keys))
        assert 0 < left < 40
        assert backend.stats().pages == left
        assert backend.stats().bytes == left * (HEADER_NBYTES + 3000)
        # The call raised, but the keys it removed are deletes all the same.
        assert backend.stats().deletes == 40 - left


async def test_a_gc_refused_some_dels_counts_every_page_it_evicted(redis_url: str) -> None:
    # A gc that raised after removing some of its victims left them out of `evictions`.
    prefix = f"t{uuid.uuid4().hex}"
    async with (
        acl_user(redis_url, "~*", "+@all") as (user, admin),
        RedisStorage.from_url(fresh_url(redis_url, prefix=prefix)) as writer,
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix, capacity=1)) as backend,
    ):
        keys, pages, metas = make_pages(40)
        assert await writer.put(keys, pages, metas) == [Outcome.OK] * 40
        rules = [f"%W~{backend.prefix}:{d}*" for d in "01234567"]
        await admin.execute_command("ACL", "SETUSER", user, "resetkeys", "%R~*", *rules)
        with pytest.raises(StorageError, match="no permissions"):
            await backend.gc()
        left = await admin.exists(*(f"{backend.prefix}:{k.hex()}" for k in keys))
        assert 0 < left < 40
        assert backend.stats().evictions == 40 - left


async def _blocked_clients(admin: aioredis.Redis, count: int) -> None:
    """Until `count` clients wait on the server (a `CLIENT PAUSE WRITE` holds their writes)."""
    for _ in range(3000):
        info = await admin.info("clients")
        if info["blocked_clients"] >= count:
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"{count} clients never waited on the paused server")


async def _aged_pages(backend: RedisStorage, count: int) -> tuple[list[bytes], list[bytes]]:
    """`count` pages of 256 bytes, then as many again past Redis's one-second idle clock:
    (the older keys, the newer)."""
    old, old_pages, old_metas = make_pages(count, 256, split=100)
    assert await backend.put(old, old_pages, old_metas) == [Outcome.OK] * count
    await asyncio.sleep(2.2)  # the idle clock's granularity: nothing to await
    new, new_pages, new_metas = make_pages(count, 256, split=100)
    assert await backend.put(new, new_pages, new_metas) == [Outcome.OK] * count
    return old, new


async def test_a_slow_listing_ranks_the_pages_it_reaches_last_by_their_own_idle_time(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Idle times counted to the listing's start, not to their batch's answer: on a loaded
    # host, the pages a listing reached seconds later looked that much older, and gc
    # evicted newer pages before older ones.
    page = HEADER_NBYTES + 256
    url = fresh_url(redis_url)
    async with RedisStorage.from_url(url) as writer:
        old, new = await _aged_pages(writer, 300)
    async with RedisStorage.from_url(f"{url}&capacity={300 * page}") as backend:
        scan = backend._scan

        async def slow_scan() -> AsyncIterator[list[bytes]]:
            batches = 0
            async for batch in scan():
                if batches == 1:
                    # A stalled host: Redis's idle clock runs on past the pages' age gap.
                    await asyncio.sleep(5)
                batches += 1
                yield batch

        monkeypatch.setattr(backend, "_scan", slow_scan)
        report = await backend.gc()
        monkeypatch.undo()
        assert report.evicted_pages == 300
        assert await backend.exists(new) == 300
        assert sum([await backend.exists([key]) for key in old]) == 0


async def test_two_gc_passes_at_once_evict_to_the_capacity_not_below(redis_url: str) -> None:
    # Each pass's listing reads every header, which Redis counts as a use: the second pass
    # saw every page as just used, ranked them otherwise than the first, and each evicted
    # half of the store by its own ranking. The prefix's lease makes them take turns.
    page = HEADER_NBYTES + 256
    url = fresh_url(redis_url, timeout=120)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        async with RedisStorage.from_url(url) as writer:
            old, new = await _aged_pages(writer, 300)
        async with (
            RedisStorage.from_url(f"{url}&capacity={300 * page}") as first,
            RedisStorage.from_url(f"{url}&capacity={300 * page}") as second,
        ):
            # Writes wait, reads do not: both passes list before either evicts (without the
            # lease each waits at its listing's mark; with it, at the lease).
            await admin.client_pause(120_000, all=False)
            try:
                with structlog.testing.capture_logs() as logs:
                    passes = asyncio.gather(first.gc(), second.gc())
                    await _blocked_clients(admin, 2)
                    await admin.client_unpause()
                    reports = await passes
            finally:
                await admin.client_unpause()
            assert await first.count_pages() == (300, 300 * page)
            assert sorted(r.evicted_pages for r in reports) == [0, 300]
            assert await first.exists(new) == 300
            assert sum([await first.exists([key]) for key in old]) == 0
            assert not await admin.exists(f"{first.prefix}:{_redis._GC_LEASE_NAME}")
        assert "storage.redis.gc_waiting" in {entry["event"] for entry in logs}
        assert_documented(logs, exact={"storage.redis.gc_waiting"})
    finally:
        await admin.aclose()


async def test_two_gc_commands_at_once_evict_to_the_capacity_not_below(redis_url: str) -> None:
    page = HEADER_NBYTES + 256
    url = fresh_url(redis_url, timeout=120)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        async with RedisStorage.from_url(url) as writer:
            old, new = await _aged_pages(writer, 300)
            command = [sys.executable, "-m", "hicache_async", "storage", "gc"]
            await admin.client_pause(120_000, all=False)
            try:
                processes = [
                    await asyncio.create_subprocess_exec(
                        *command,
                        f"{url}&capacity={300 * page}",
                        "--json",
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                    )
                    for _ in range(2)
                ]
                await _blocked_clients(admin, 2)
            finally:
                await admin.client_unpause()
            reports = []
            for process in processes:
                out, err = await asyncio.wait_for(process.communicate(), 120)
                assert process.returncode == 0, err.decode()
                reports.append(json.loads(out))
            assert sorted(r["evicted_pages"] for r in reports) == [0, 300]
            assert await writer.count_pages() == (300, 300 * page)
            assert await writer.exists(new) == 300
            assert sum([await writer.exists([key]) for key in old]) == 0
    finally:
        await admin.aclose()


async def test_a_gc_lease_its_holder_left_holds_gc_back_only_until_it_expires(
    redis_url: str,
) -> None:
    page = HEADER_NBYTES + 3000
    async with RedisStorage.from_url(fresh_url(redis_url, capacity=page)) as backend:
        keys, pages, metas = make_pages(3)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 3
        lease = f"{backend.prefix}:{_redis._GC_LEASE_NAME}"
        admin = aioredis.Redis.from_url(redis_url)
        try:
            # As a gc killed mid-pass leaves it: nobody renews or releases it.
            await admin.set(lease, b"gone", px=1500)
            with structlog.testing.capture_logs() as logs:
                report = await backend.gc()
            assert report.evicted_pages == 2
            assert not await admin.exists(lease)
        finally:
            await admin.aclose()
    assert [entry["event"] for entry in logs] == ["storage.redis.gc_waiting"]


@pytest.mark.parametrize("wait", ["0", "0.2"])
async def test_a_gc_with_gc_wait_gives_up_while_another_holds_the_lease(
    redis_url: str, wait: str
) -> None:
    # A holder renews its lease for as long as its pass runs: without a bound the caller
    # waited for the whole of that pass.
    page = HEADER_NBYTES + 3000
    url = fresh_url(redis_url, capacity=page, gc_wait=wait)
    async with RedisStorage.from_url(url) as backend:
        keys, pages, metas = make_pages(3)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 3
        lease = f"{backend.prefix}:{_redis._GC_LEASE_NAME}"
        admin = aioredis.Redis.from_url(redis_url)
        try:
            await admin.set(lease, b"running", px=600_000)  # a live pass, renewing it
            with structlog.testing.capture_logs() as logs:
                report = await backend.gc()
            assert report == GcReport(evicted_pages=0, freed_bytes=0, skipped=True)
            assert await admin.get(lease) == b"running"  # not taken, not removed
            assert await backend.exists(keys) == 3
            await admin.delete(lease)  # that pass ended: the next one runs
            report = await backend.gc()
            assert (report.evicted_pages, report.skipped) == (2, False)
        finally:
            await admin.aclose()
    events = [entry["event"] for entry in logs]
    assert events[-1] == "storage.redis.gc_skipped"
    assert set(events) <= {"storage.redis.gc_waiting", "storage.redis.gc_skipped"}
    assert_documented(logs, exact={"storage.redis.gc_skipped"})


def test_gc_wait_takes_seconds_of_0_or_more() -> None:
    assert RedisStorage(gc_wait=0)._gc_wait == 0.0
    assert RedisStorage.from_url("redis://127.0.0.1:6379/0?gc_wait=1.5")._gc_wait == 1.5
    # Bounded by default: unbounded, a scheduled gc whose passes outlast its period piled up
    # runs, each waiting for the whole of the last and then listing every page again.
    assert RedisStorage()._gc_wait == 300.0
    assert RedisStorage.from_url("redis://127.0.0.1:6379/0")._gc_wait == 300.0
    assert RedisStorage(gc_wait=None)._gc_wait is None
    assert RedisStorage.from_url("redis://127.0.0.1:6379/0?gc_wait=none")._gc_wait is None
    for bad in (-1, math.inf, math.nan, True, "1"):
        with pytest.raises(StorageConfigError, match="gc_wait"):
            RedisStorage(gc_wait=bad)  # type: ignore[arg-type]
    with pytest.raises(StorageConfigError, match="gc_wait"):
        RedisStorage.from_url("redis://127.0.0.1:6379/0?gc_wait=-1")


async def test_a_gc_refused_its_lease_runs_without_it_and_says_so(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}"
    async with (
        acl_user(redis_url, "~*", "+@all") as (user, admin),
        RedisStorage.from_url(fresh_url(redis_url, prefix=prefix)) as writer,
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix, capacity=1)) as backend,
    ):
        keys, pages, metas = make_pages(4)
        assert await writer.put(keys, pages, metas) == [Outcome.OK] * 4
        # Writes to page keys only (hex names): the lease and the listing's mark are refused.
        rules = [f"%W~{prefix}:{d}*" for d in "0123456789abcdef"]
        await admin.execute_command("ACL", "SETUSER", user, "resetkeys", "%R~*", *rules)
        with structlog.testing.capture_logs() as logs:
            report = await backend.gc()
        assert report.evicted_pages == 4
    refused = [entry for entry in logs if entry["event"] == "storage.redis.gc_lease_refused"]
    assert len(refused) == 1
    assert "no permissions" in refused[0]["error"]
    assert_documented(logs, exact={"storage.redis.gc_lease_refused"})


async def test_a_gc_where_scripting_is_refused_still_releases_its_lease(redis_url: str) -> None:
    async with (
        acl_user(redis_url, "~*", "+@all", "-@scripting") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, capacity=1)) as backend,
    ):
        keys, pages, metas = make_pages(3)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 3
        assert (await backend.gc()).evicted_pages == 3
        assert not await admin.exists(f"{backend.prefix}:{_redis._GC_LEASE_NAME}")
        # The next pass takes it at once.
        with structlog.testing.capture_logs() as logs:
            assert (await backend.gc()).evicted_pages == 0
        assert not [e for e in logs if e["event"].startswith("storage.redis.gc_")]


async def test_a_running_gc_renews_its_lease_and_says_so_once_it_is_lost(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_redis, "_GC_LEASE_S", 0.6)
    async with RedisStorage.from_url(fresh_url(redis_url)) as backend:
        client = backend._redis()
        lease = f"{backend.prefix}:{_redis._GC_LEASE_NAME}".encode()
        await client.set(lease, b"mine", px=600)
        with structlog.testing.capture_logs() as logs:
            renewal = asyncio.ensure_future(backend._renew_gc_lease(client, lease, b"mine", 600))
            try:
                # Renewed: its time to live goes back up before it runs out.
                ttls = [await client.pttl(lease)]
                while len(ttls) < 2 or ttls[-1] <= ttls[-2]:
                    assert len(ttls) < 1000, ttls
                    await asyncio.sleep(0.02)
                    ttls.append(await client.pttl(lease))
                    assert ttls[-1] > 0, ttls
                # Another pass took it (this one was held past its expiry): not renewed,
                # and said.
                await client.set(lease, b"another", px=60_000)
                await asyncio.wait_for(renewal, 30)
            finally:
                renewal.cancel()
            assert await client.get(lease) == b"another"
            assert await client.pttl(lease) > 30_000
    assert [entry["event"] for entry in logs] == ["storage.redis.gc_lease_lost"]
    assert_documented(logs, exact={"storage.redis.gc_lease_lost"})


@pytest.mark.parametrize("bulk", [1, 0])
async def test_error_replies_are_logged_once_per_kind(redis_url: str, bulk: int) -> None:
    # A user that may read but not write: every SET answers NOPERM.
    async with (
        acl_user(redis_url, "~*", "+@all", "-@write") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, bulk=bulk)) as backend,
    ):
        keys, pages, metas = make_pages(3)
        await admin.rpush(f"{backend.prefix}:{keys[1].hex()}", b"x")  # type: ignore[misc]
        with structlog.testing.capture_logs() as logs:
            assert await backend.put(keys, pages, metas) == [Outcome.ERROR] * 3
            assert await backend.put(keys, pages, metas) == [Outcome.ERROR] * 3
            into = buffers(3)
            assert await backend.get(keys, into, namespace=NS) == [
                Outcome.MISS,
                Outcome.ERROR,  # WRONGTYPE
                Outcome.MISS,
            ]
            await backend.get(keys, into, namespace=NS)
    # One line per kind of reply, not one per key or per batch.
    logged = [e for e in logs if e["event"] == "storage.redis.reply_error"]
    # redis-py before 7.4 drops the code of a reply it knows (NOPERM) and keeps it nowhere;
    # the bulk path reads the replies itself.
    keeps_codes = bulk or hasattr(aioredis.ResponseError("x"), "status_code")
    assert [e["error"].split(" ", 1)[0] for e in logged] == [
        "NOPERM" if keeps_codes else "this",
        "WRONGTYPE",
    ]
    assert "no permissions to run the 'set' command" in logged[0]["error"]
    assert {e["backend"] for e in logged} == {backend.name}


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_user_that_may_only_read_the_keys_gets_exists_and_the_manifest(
    redis_url: str, bulk: int
) -> None:
    keys, pages, metas = make_pages(3)
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        assert await writer.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        await writer.manifest().append([chain_entry(NS, keys[:2], 32, 0, time.time())])
        prefix = writer.prefix
    # `%R~*`: every key may be read, none written. EVAL asks for write access to the keys
    # it names, so the scripts are refused where TOUCH, GET and LRANGE are not.
    async with (
        acl_user(redis_url, "%R~*", "+@all") as (user, _),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix, bulk=bulk)) as reader,
    ):
        for _ in range(2):
            assert await reader.exists(keys) == 2
            into = buffers(3)
            assert await reader.get(keys, into, namespace=NS) == [Outcome.OK] * 2 + [Outcome.MISS]
            assert [joined(p) for p in into[:2]] == [joined(p) for p in pages[:2]]
            read = await reader.manifest().read()
            assert [e.keys for e in read.entries] == [[k.hex() for k in keys[:2]]]
        assert reader.stats().errors == 0


async def eval_calls(admin: aioredis.Redis) -> tuple[int, int]:
    """How many EVAL_RO and EVAL calls the server ran."""
    stats = await admin.info("commandstats")
    return tuple(  # type: ignore[return-value]
        stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("eval_ro", "eval")
    )


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_user_that_may_only_read_the_keys_keeps_the_scripts(
    redis_url: str, bulk: int
) -> None:
    # EVAL_RO asks only for read access to the keys it names: `%R~*` keeps both scripts.
    keys, pages, metas = make_pages(3)
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        assert await writer.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        await writer.manifest().append([chain_entry(NS, keys[:2], 32, 0, time.time())])
        prefix = writer.prefix
    async with (
        acl_user(redis_url, "%R~*", "+@all") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix, bulk=bulk)) as reader,
    ):
        before = await eval_calls(admin)
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                assert await reader.exists(keys) == 2
                read = await reader.manifest().read()
                assert [e.keys for e in read.entries] == [[k.hex() for k in keys[:2]]]
        after = await eval_calls(admin)
        assert reader._multikey
        assert reader.stats().errors == 0
    assert (after[0] - before[0], after[1] - before[1]) == (4, 0)
    assert [e["event"] for e in logs if e["log_level"] != "debug"] == []


async def test_a_server_without_eval_ro_runs_the_read_scripts_with_eval() -> None:
    # Before Redis 7.0 EVAL_RO is an unknown command: EVAL, learned once per store.
    with RedisServer(extra_args=["--rename-command", "EVAL_RO", ""]) as server:
        for params in ({}, {"bulk": 0}):
            url = fresh_url(f"redis://{server.host}:{server.port}/0", **params)
            async with RedisStorage.from_url(url) as backend:
                keys, pages, metas = make_pages(3)
                assert await backend.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
                entry = chain_entry(NS, keys[:2], 32, 0, time.time())
                with structlog.testing.capture_logs() as logs:
                    await backend.manifest().append([entry])
                    for _ in range(2):
                        assert await backend.exists(keys) == 2
                        assert len((await backend.manifest().read()).entries) == 1
                assert backend._multikey
                assert backend.stats().errors == 0
            refused = [e for e in logs if e["event"] == "hicache.redis.eval_ro_refused"]
            assert len(refused) == 1
            assert "unknown command" in refused[0]["error"]
            assert not [e for e in logs if e["log_level"] == "warning"]


@pytest.mark.parametrize("bulk", [1, 0])
async def test_exists_tries_its_script_again_once_a_minute(redis_url: str, bulk: int) -> None:
    # Refused EVAL_RO, and EVAL for the keys it may only read: TOUCH per key, and the script
    # again once the user's rights allow it.
    keys, pages, metas = make_pages(3)
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        assert await writer.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        prefix = writer.prefix
    now = [1000.0]
    async with (
        acl_user(redis_url, "%R~*", "+@all", "-eval_ro") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix, bulk=bulk)) as reader,
    ):
        reader._scripts.clock = lambda: now[0]
        with structlog.testing.capture_logs() as logs:
            assert await reader.exists(keys) == 2
            assert not reader._multikey
            now[0] += 61  # tried again, still refused: nothing said
            assert await reader.exists(keys) == 2
            assert not reader._multikey
            await admin.execute_command("ACL", "SETUSER", user, "allkeys")
            now[0] += 59  # within the minute: still TOUCH per key
            assert await reader.exists(keys) == 2
            assert not reader._multikey
            now[0] += 2
            calls = await eval_calls(admin)
            assert await reader.exists(keys) == 2
            assert reader._multikey
            assert await reader.exists(keys[:1]) == 1
            assert (await eval_calls(admin))[1] == calls[1] + 2
        assert reader.stats().errors == 0
    assert [e["event"] for e in logs] == [
        "hicache.redis.eval_ro_refused",
        "storage.redis.no_scripting",
        "storage.redis.scripting_restored",
    ]


async def _touch_calls(admin: aioredis.Redis) -> int:
    """How many TOUCH calls the server ran."""
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_touch", {}).get("calls", 0))


async def test_exists_asks_with_touch_again_once_a_minute(redis_url: str) -> None:
    # Refused TOUCH (an ACL listing commands): EXISTS per key, and TOUCH again once the
    # user's rights allow it, instead of EXISTS for the life of the store.
    keys, pages, metas = make_pages(3)
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        assert await writer.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        prefix = writer.prefix
    now = [1000.0]
    async with (
        acl_user(redis_url, "~*", "+@all", "-touch") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix, multikey=0)) as reader,
    ):
        reader._scripts.clock = lambda: now[0]
        with structlog.testing.capture_logs() as logs:
            assert await reader.exists(keys) == 2
            assert not reader._touch
            now[0] += 61  # tried again, still refused: nothing said
            assert await reader.exists(keys) == 2
            assert not reader._touch
            await admin.execute_command("ACL", "SETUSER", user, "+touch")
            now[0] += 59  # within the minute: still EXISTS per key
            touches = await _touch_calls(admin)
            assert await reader.exists(keys) == 2
            assert await _touch_calls(admin) == touches
            now[0] += 2
            assert await reader.exists(keys) == 2
            assert reader._touch
            assert await reader.exists(keys[:1]) == 1
            assert await _touch_calls(admin) == touches + 3 + 1
        assert reader.stats().errors == 0
    assert [e["event"] for e in logs] == [
        "storage.redis.no_touch",
        "storage.redis.touch_restored",
    ]
    assert assert_documented(logs, exact=["storage.redis.touch_restored"]) >= 1


@pytest.mark.parametrize("bulk", [1, 0])
async def test_an_empty_exists_does_not_take_a_refused_script_for_restored(
    redis_url: str, bulk: int
) -> None:
    # An empty call due to try the script again ran none of it, took the refusal for over
    # and said so; the next call was refused again and warned again: two lines a minute
    # for a user whose rights never changed.
    keys, pages, metas = make_pages(3)
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        assert await writer.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        prefix = writer.prefix
    now = [1000.0]
    async with (
        acl_user(redis_url, "%R~*", "+@all", "-eval_ro") as (user, _),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix, bulk=bulk)) as reader,
    ):
        reader._scripts.clock = lambda: now[0]
        with structlog.testing.capture_logs() as logs:
            assert await reader.exists(keys) == 2
            for _ in range(3):
                now[0] += 61
                assert await reader.exists([]) == 0
                assert not reader._multikey
                assert await reader.exists(keys) == 2
        assert reader.stats().errors == 0
    assert [e["event"] for e in logs] == [
        "hicache.redis.eval_ro_refused",
        "storage.redis.no_scripting",
    ]


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_store_that_learnt_eval_takes_eval_ro_again_for_a_user_made_read_only(
    redis_url: str, bulk: int
) -> None:
    # EVAL_RO refused once (an ACL without it), so the scripts went as EVAL. The user then
    # allowed EVAL_RO but only reads of the keys: EVAL was refused its keys, and exists
    # warned and went to TOUCH per key, the manifest to plain windows, for a minute.
    keys, pages, metas = make_pages(3)
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        assert await writer.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        await writer.manifest().append([chain_entry(NS, keys[:2], 32, 0, time.time())])
        prefix = writer.prefix
    async with (
        acl_user(redis_url, "~*", "+@all", "-eval_ro") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix, bulk=bulk)) as reader,
    ):
        with structlog.testing.capture_logs() as logs:
            assert await reader.exists(keys) == 2
            assert not reader._scripts.read_only
            await admin.execute_command("ACL", "SETUSER", user, "resetkeys", "%R~*", "+eval_ro")
            for _ in range(2):
                assert await reader.exists(keys) == 2
                assert len((await reader.manifest().read()).entries) == 1
            assert reader._multikey
            assert reader._scripts.read_only
            assert reader._scripts.window_retry_at is None
        assert reader.stats().errors == 0
    assert [e["event"] for e in logs if e["log_level"] != "debug"] == [
        "hicache.redis.eval_ro_refused"
    ]


async def test_the_manifest_says_once_per_store_that_it_reads_without_its_script(
    redis_url: str,
) -> None:
    keys = [os.urandom(32) for _ in range(2)]
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        await writer.manifest().append([chain_entry(NS, keys, 32, 0, time.time())])
        prefix = writer.prefix
    async with (
        acl_user(redis_url, "%R~*", "+@all", "-eval_ro") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix)) as reader,
    ):
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                assert len((await reader.manifest().read()).entries) == 1
        events = [e["event"] for e in logs]
        assert events.count("hicache.manifest.read_unscripted") == 1
        # The script again a minute after the refusal, with its rights back.
        retry_at = reader._scripts.window_retry_at
        assert retry_at is not None
        now = [retry_at - 1]
        reader._scripts.clock = lambda: now[0]
        await admin.execute_command("ACL", "SETUSER", user, "+eval_ro")
        with structlog.testing.capture_logs() as logs:
            calls = await eval_calls(admin)
            assert len((await reader.manifest().read()).entries) == 1
            assert await eval_calls(admin) == calls
            now[0] += 2
            for _ in range(2):
                assert len((await reader.manifest().read()).entries) == 1
            assert (await eval_calls(admin))[0] == calls[0] + 2
    assert [e["event"] for e in logs] == ["hicache.manifest.read_scripted"]


async def test_the_manifest_says_once_per_store_that_scripting_is_refused(
    redis_url: str,
) -> None:
    # Scripting refused as a command (an ACL without EVAL, EVAL_RO, EVALSHA): each manifest
    # the store built found it out and warned again, warmup and every backup's append alike.
    keys = [os.urandom(32) for _ in range(2)]
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        await writer.manifest().append([chain_entry(NS, keys, 32, 0, time.time())])
        prefix = writer.prefix
    refused = ("~*", "+@all", "-eval", "-eval_ro", "-evalsha")
    async with (
        acl_user(redis_url, *refused) as (user, _),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix)) as reader,
    ):
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                manifest = reader.manifest()
                assert len((await manifest.read()).entries) == 1
                await manifest.append([chain_entry(NS, keys[:1], 16, 0, time.time())])
            fresh = reader.manifest()
        assert reader.stats().errors == 0
    warned = [e for e in logs if e["event"] == "hicache.manifest.no_scripting"]
    assert len(warned) == 1, warned
    assert "eval" in warned[0]["error"].lower()
    assert assert_documented(warned, exact=["hicache.manifest.no_scripting"]) == 1
    assert not fresh._scripting  # a new one knows, before any call


async def _script_calls(admin: aioredis.Redis) -> int:
    """How many script calls (EVAL, EVALSHA and their read-only forms) the server ran."""
    stats = await admin.info("commandstats")
    names = ("eval", "eval_ro", "evalsha", "evalsha_ro")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names)


async def test_the_manifest_tries_its_scripts_again_once_a_minute(redis_url: str) -> None:
    # Scripting refused once (an ACL changed for a while, a proxy): every manifest the store
    # built afterwards went without it for the life of the store, rights restored or not.
    keys = [os.urandom(32) for _ in range(2)]
    async with RedisStorage.from_url(fresh_url(redis_url)) as writer:
        await writer.manifest().append([chain_entry(NS, keys, 32, 0, time.time())])
        prefix = writer.prefix
    now = [1000.0]
    refused = ("~*", "+@all", "-eval", "-eval_ro", "-evalsha", "-evalsha_ro")
    async with (
        acl_user(redis_url, *refused) as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, prefix=prefix)) as reader,
    ):
        reader._scripts.clock = lambda: now[0]
        with structlog.testing.capture_logs() as logs:
            assert len((await reader.manifest().read()).entries) == 1
            now[0] += 61  # tried again, still refused: nothing said
            assert len((await reader.manifest().read()).entries) == 1
            granted = ("+eval", "+eval_ro", "+evalsha", "+evalsha_ro")
            await admin.execute_command("ACL", "SETUSER", user, *granted)
            now[0] += 59  # within the minute: plain commands still
            calls = await _script_calls(admin)
            assert len((await reader.manifest().read()).entries) == 1
            assert await _script_calls(admin) == calls
            now[0] += 2
            assert len((await reader.manifest().read()).entries) == 1
            assert await _script_calls(admin) > calls
            assert reader.manifest()._scripting  # back for every manifest of the store
            await reader.manifest().append([chain_entry(NS, keys[:1], 16, 0, time.time())])
        assert reader.stats().errors == 0
    events = [e["event"] for e in logs if e["event"].startswith("hicache.manifest.")]
    assert events == ["hicache.manifest.no_scripting", "hicache.manifest.scripting_restored"]
    assert assert_documented(logs, exact=["hicache.manifest.scripting_restored"]) >= 1


async def test_a_read_script_allowed_does_not_bring_back_refused_write_scripts(
    redis_url: str,
) -> None:
    # A user allowed EVAL_RO but not EVAL nor EVALSHA: the read's script ran at the minute's
    # retry and was taken for scripting restored, so the next compaction was refused again
    # and each minute logged the refusal and the restoration once more.
    keys = [os.urandom(32) for _ in range(2)]
    now = [1000.0]
    async with (
        acl_user(redis_url, "~*", "+@all", "-eval", "-evalsha") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user)) as store,
    ):
        store._scripts.clock = lambda: now[0]
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                await store.manifest().append([chain_entry(NS, keys, 32, 0, time.time())])
                await store.manifest().compact()
                assert len((await store.manifest().read()).entries) == 1
                now[0] += 61
            granted = ("+eval", "+evalsha")
            await admin.execute_command("ACL", "SETUSER", user, *granted)
            await store.manifest().append([chain_entry(NS, keys, 32, 0, time.time())])
            await store.manifest().compact()  # the retry is due: a write script runs
            assert store.manifest()._scripting
        assert store.stats().errors == 0
    events = [e["event"] for e in logs if e["event"].startswith("hicache.manifest.")]
    assert events == ["hicache.manifest.no_scripting", "hicache.manifest.scripting_restored"]


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_command_refused_inside_a_script_is_named_among_those_it_runs(
    redis_url: str, bulk: int
) -> None:
    # The server's reply names no command: "... can't run this command or subcommand".
    entry = chain_entry(NS, [os.urandom(32)], 16, 0, time.time())
    reader = ("~*", "+@read", "+@connection", "+@scripting")  # no MULTI: appends by script
    async with (
        acl_user(redis_url, *reader) as (user, _),
        RedisStorage.from_url(user_url(redis_url, user, bulk=bulk)) as backend,
    ):
        with pytest.raises(StorageError, match="the script runs RPUSH HINCRBY EXPIRE: the user"):
            await backend.manifest().append([entry])
    async with (
        acl_user(redis_url, "~*", "+@all", "-touch", "-exists") as (user, _),
        RedisStorage.from_url(user_url(redis_url, user, bulk=bulk)) as backend,
    ):
        with pytest.raises(StorageError, match=r"\(the script runs TOUCH EXISTS: the user [^(]*$"):
            await backend.exists([os.urandom(32)])


@pytest.mark.parametrize("bulk", [1, 0])
async def test_only_a_refused_script_command_turns_the_script_off(
    redis_url: str, bulk: int
) -> None:
    keys, pages, metas = make_pages(3)
    # Keys outside the user's patterns: NOPERM, which says nothing about scripts.
    async with (
        acl_user(redis_url, "~elsewhere:*", "+@all") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, bulk=bulk)) as backend,
    ):
        with pytest.raises(StorageError, match="access one of the keys"):
            await backend.exists(keys)
        assert (backend._multikey, backend._touch) == (True, True)
        # Once the ACL lets it in, exists is the script call again.
        await admin.execute_command("ACL", "SETUSER", user, "allkeys")
        assert await backend.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        assert await backend.exists(keys) == 2
        assert backend._multikey
    # CLIENT SETNAME refused when redis-py sets a connection up (bulk=0 asks EVALSHA there):
    # at open that fails the open; refused later, on the connections made after it, the
    # calls fail until it is allowed again, and the script stays on.
    async with acl_user(redis_url, "~*", "+@all") as (user, admin):
        url = user_url(redis_url, user, bulk=bulk, client_name="named")
        async with RedisStorage.from_url(url) as backend:
            await admin.execute_command("ACL", "SETUSER", user, "-client|setname")
            await admin.execute_command("CLIENT", "KILL", "USER", user)
            with pytest.raises(StorageError, match=r"client\|setname"):
                await backend.exists(keys)
            assert backend._multikey
            await admin.execute_command("ACL", "SETUSER", user, "+client|setname")
            assert await backend.exists(keys) == 0
            assert backend._multikey
    # The script commands refused: one EXISTS per key from then on.
    async with (
        acl_user(redis_url, "~*", "+@all", "-evalsha", "-eval", "-eval_ro", "-script") as (user, _),
        RedisStorage.from_url(user_url(redis_url, user, bulk=bulk)) as backend,
    ):
        assert await backend.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        assert await backend.exists(keys) == 2
        assert not backend._multikey
        assert backend.stats().errors == 0


async def test_a_compaction_on_a_read_only_replica_says_the_server_refused_it() -> None:
    other = bytes(range(16, 32))
    with (
        RedisServer() as primary,
        RedisServer(extra_args=["--replicaof", primary.host, str(primary.port)]) as replica,
    ):
        async with RedisStorage.from_url(fresh_url(primary.url)) as writer:
            for namespace in (NS, other):
                entry = chain_entry(namespace, [os.urandom(32)], 16, 0, time.time())
                await writer.manifest().append([entry])
            prefix = writer.prefix
        admin = aioredis.Redis(host=replica.host, port=replica.port)
        try:
            for _ in range(300):  # up to ~30 s for the first sync
                if len(await admin.keys(f"{prefix}:*")) >= 5:  # 2 lists, 2 metas, the index
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the replica did not sync")
            synced = sorted(await admin.keys(f"{prefix}:*"))
            url = f"redis://{replica.host}:{replica.port}/0?prefix={prefix}"
            async with RedisStorage.from_url(url) as backend:
                with (
                    structlog.testing.capture_logs() as logs,
                    pytest.raises(StorageError, match=r"refused the write \(READONLY"),
                ):
                    await backend.manifest().compact()
                assert len((await backend.manifest().read()).entries) == 2
            assert sorted(await admin.keys(f"{prefix}:*")) == synced
        finally:
            await admin.aclose()
    # Said once, by the error: not a temporary list left, nor once per namespace.
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == []


async def test_an_exists_that_times_out_on_a_bulk_connection_says_so() -> None:
    with RedisServer() as server:
        url = fresh_url(f"redis://{server.host}:{server.port}/0", timeout=0.2)
        async with RedisStorage.from_url(url) as backend:
            assert backend._bulk is not None
            keys, _, _ = make_pages(2)
            assert await backend.exists(keys) == 0  # connected
            pid = server.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)  # a server that stops answering
            try:
                with pytest.raises(StorageError, match=r"exists failed: timed out after 0.2s"):
                    await backend.exists(keys)
            finally:
                os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize(
    ("name", "reply"),
    [
        ("truncated value", b"$5000\r\nHCKV"),  # then the server hangs up
        ("unknown reply type", b"*1\r\n$1\r\nx\r\n"),
        ("bad length", b"$12x\r\n"),
        ("bad number", b":12x\r\n"),
        ("no reply at all", None),  # accepts, reads, never answers
    ],
)
async def test_a_misbehaving_server_gives_errors_not_wrong_pages(
    name: str, reply: bytes | None
) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read(65536)
            if reply is not None:
                writer.write(reply)
                await writer.drain()
            else:
                await reader.read()  # until the client gives up and closes
        finally:
            # Closed on every path, a handler cancelled at the loop's end included: an
            # accepted connection left open warns (ResourceWarning) at collection.
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        url = f"redis://127.0.0.1:{port}/0?timeout=0.5&prefix=odd"
        async with RedisStorage.from_url(url) as backend:
            assert backend._bulk is not None
            keys, pages, metas = make_pages(2)
            into = buffers(2)
            assert await backend.get(keys, into, namespace=NS) == [Outcome.ERROR] * 2, name
            assert await backend.put(keys, pages, metas) == [Outcome.ERROR] * 2, name
            assert backend.stats().errors >= 4
            # The calls that report failure by raising raise the backend's error, whatever
            # the reply (redis-py itself lets a malformed number escape as ValueError).
            with pytest.raises(StorageError):
                await backend.exists(keys)
            with pytest.raises(StorageError):
                await backend.delete(keys)
            with pytest.raises(StorageError):
                await backend.read_raw(keys[0])
            with pytest.raises(StorageError):
                await backend.list_pages()
    finally:
        server.close()
        await server.wait_closed()


def test_redis_server_lifecycle() -> None:
    server = RedisServer()
    with server:
        assert server.running
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        directory = server.directory
        assert directory.is_dir()
    assert not server.running
    assert not directory.exists()
    server.stop()  # idempotent


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ServerError, match="did not become ready"):
            RedisServer(port=taken.getsockname()[1]).start()


def test_a_requested_port_served_by_another_redis_is_refused() -> None:
    # Another redis (a developer's own, say) answers PING on the port while ours fails to
    # bind and exits: start() must not hand out a URL that points at the other one.
    with RedisServer() as foreign:
        ours = RedisServer(port=foreign.port)
        with pytest.raises(ServerError, match="another process"):
            ours.start()
        assert not ours.running
        assert foreign.running


def test_a_chosen_port_served_by_another_redis_is_chosen_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with RedisServer() as foreign:
        ports = iter([foreign.port])
        choose = _servers.free_port
        monkeypatch.setattr(_servers, "free_port", lambda: next(ports, None) or choose())
        with RedisServer() as ours:
            assert ours.port != foreign.port
            assert ours._server_pid() == ours.pid


def test_a_server_started_from_a_thread_outlives_the_thread() -> None:
    # PR_SET_PDEATHSIG follows the thread that forked: a server forked from a short-lived
    # thread (asyncio.to_thread in an async fixture) used to get SIGTERM when it ended.
    server = RedisServer()
    try:
        thread = threading.Thread(target=server.start)
        thread.start()
        thread.join()
        process = server._process
        assert process is not None
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1.0)  # a SIGTERMed redis exits within milliseconds
        assert server.running
    finally:
        server.stop()


def test_an_interrupted_start_leaves_no_process_or_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = RedisServer()
    seen: list[tuple[subprocess.Popen[bytes], str]] = []

    def interrupted(self: RedisServer) -> bool:
        assert self._process is not None
        seen.append((self._process, str(self.directory)))
        raise KeyboardInterrupt

    monkeypatch.setattr(RedisServer, "_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    ((process, directory),) = seen
    assert process.poll() is not None
    assert not os.path.exists(directory)
    assert server not in _servers._LIVE


def test_start_after_kill_removes_the_old_directory() -> None:
    server = RedisServer()
    with server:
        first = server.directory
        server.kill()
        assert first.is_dir()  # kept for inspecting the crash
        server.start()
        assert not first.exists()
        assert server.directory != first
    assert not server.running


def test_port_ownership_comes_from_the_kernel() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        if _servers._port_owned_by(os.getpid(), port) is None:
            pytest.skip("no /proc to ask")
        assert _servers._port_owned_by(os.getpid(), port)
        assert _servers._port_owned_by(os.getppid(), port) is False


def test_a_missing_binary_fails_loudly() -> None:
    with pytest.raises(ServerBinaryNotFoundError, match="no-such-redis-server"):
        RedisServer(binary="no-such-redis-server")


async def test_open_storage_builds_it_from_the_url(redis_url: str) -> None:
    storage = open_storage(fresh_url(redis_url, ttl=60), mac_key=MAC_KEY)
    assert isinstance(storage, RedisStorage)
    async with storage:
        keys, pages, metas = make_pages(1)
        assert await storage.put(keys, pages, metas) == [Outcome.OK]
        raw = await storage.read_raw(keys[0])
        assert raw is not None
        assert raw[6] & 1  # written with the MAC


def test_storage_command_counts_the_pages_in_the_server(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hicache_async.cli import main

    url = fresh_url(redis_url)
    keys, pages, metas = make_pages(5)

    async def put() -> None:
        async with open_storage(url) as storage:
            assert await storage.put(keys, pages, metas) == [Outcome.OK] * 5

    asyncio.run(put())
    # A fresh client's own counters start at zero; the command counts what the server holds.
    assert main(["storage", "stats", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["pages"], stats["bytes"]) == (5, 5 * (HEADER_NBYTES + 3000))
    down = fresh_url(f"redis://127.0.0.1:{free_port()}/0", timeout="0.2")
    assert main(["storage", "stats", down]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "scan failed" in captured.err


async def _store_image(redis_url: str, prefix: str) -> dict[bytes, tuple[bytes | None, int]]:
    """Every key under `prefix`: its value (None for a non-string) and when it expires (-1:
    never)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        image: dict[bytes, tuple[bytes | None, int]] = {}
        async for rkey in client.scan_iter(match=f"{prefix}:*".encode()):
            kind = await client.type(rkey)
            value = await client.get(rkey) if kind in (b"string", "string") else None
            image[rkey] = (value, await client.execute_command("PEXPIRETIME", rkey))
        return image
    finally:
        await client.aclose()


async def _damaged_store(url: str) -> list[bytes]:
    """Sound pages, one with a TTL, a damaged one, an empty value, a foreign hash under a page
    key and a key under the prefix that is no page key; the sound pages' keys."""
    keys, pages, metas = make_pages(6)
    async with RedisStorage.from_url(url) as storage:
        assert await storage.put(keys[:4], pages[:4], metas[:4]) == [Outcome.OK] * 4
        async with RedisStorage.from_url(f"{url}&ttl=3600") as expiring:
            assert await expiring.put(keys[4:5], pages[4:5], metas[4:5]) == [Outcome.OK]
        raw = await storage.read_raw(keys[0])
        assert raw is not None
        await storage.write_raw(keys[0], raw[:40] + bytes([raw[40] ^ 1]) + raw[41:])
        await storage.write_raw(keys[5], b"")
        client = storage._redis()
        await client.hset(storage._rkey(os.urandom(32)), "field", "value")
        await client.set(f"{storage.prefix}:not-a-page".encode(), b"x")
    return keys


def test_stats_and_ls_leave_the_store_as_it_was(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The look-only commands write nothing: no mark, no value or TTL changed.
    from hicache_async.cli import main

    url = fresh_url(redis_url)
    prefix = url.split("prefix=")[1]
    asyncio.run(_damaged_store(url))
    before = asyncio.run(_store_image(redis_url, prefix))
    assert main(["storage", "stats", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert main(["storage", "ls", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert main(["storage", "ls", url, "--limit", "2"]) == 0
    capsys.readouterr()
    assert asyncio.run(_store_image(redis_url, prefix)) == before
    assert f"{prefix}:maintenance-read-at".encode() not in before
    # stats counts the pages ls lists: the damaged one and the empty value included.
    assert (stats["pages"], stats["bytes"]) == (len(listed), sum(p["nbytes"] for p in listed))
    assert stats["pages"] == 6


async def test_count_pages_counts_what_list_pages_lists_and_writes_nothing(
    redis_url: str,
) -> None:
    url = fresh_url(redis_url)
    await _damaged_store(url)
    async with RedisStorage.from_url(url) as backend:
        before = await _store_image(redis_url, backend.prefix)
        pages, nbytes = await backend.count_pages()
        assert await _store_image(redis_url, backend.prefix) == before
        listed = await backend.list_pages(record=False)
        assert await _store_image(redis_url, backend.prefix) == before
        assert (pages, nbytes) == (len(listed), sum(p.nbytes for p in listed))
        assert (pages, nbytes) == (6, 5 * (HEADER_NBYTES + 3000))
        # The default listing still records its pass, for later listings' order.
        await backend.list_pages()
        mark = f"{backend.prefix}:maintenance-read-at".encode()
        assert mark in await _store_image(redis_url, backend.prefix)


@pytest.mark.parametrize("record", [True, False])
async def test_a_limited_listing_is_the_full_listings_first_pages(
    redis_url: str, record: bool
) -> None:
    # An unrecorded listing reads every page, so on an LRU server the order it leaves moves
    # with the clock; under LFU the pages go by their creation, which stays put.
    with contextlib.ExitStack() as stack:
        if not record:
            lfu = ["--maxmemory-policy", "allkeys-lfu"]
            redis_url = stack.enter_context(RedisServer(extra_args=lfu)).url
        await _check_limited_listings(redis_url, record=record)


async def _check_limited_listings(redis_url: str, *, record: bool) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url)) as backend:
        keys, pages, metas = make_pages(30, 200)
        for key, page, meta in zip(keys, pages, metas, strict=True):
            assert await backend.put([key], [page], [meta]) == [Outcome.OK]  # own creation time
        for key in keys[::7]:  # damaged: last used at 0, the listing's ties
            raw = await backend.read_raw(key)
            assert raw is not None
            await backend.write_raw(key, raw[:40] + bytes([raw[40] ^ 1]) + raw[41:])
        await backend.list_pages()  # recorded: from now on the pages go by their creation
        full = await backend.list_pages(record=record)
        assert len({p.last_access for p in full}) > 20  # an order to keep, not all ties
        for limit in (1, 2, 5, 29, 30, 31, 1000):
            assert await backend.list_pages(limit, record=record) == full[:limit]


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_full_server_declines_pages_as_misses(bulk: int) -> None:
    full = ["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]
    with RedisServer(extra_args=full) as server:
        url = fresh_url(f"redis://{server.host}:{server.port}/0", bulk=bulk)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(64, 256 << 10, split=1 << 10)
            outcomes = await backend.put(keys, pages, metas)
            assert Outcome.ERROR not in outcomes
            assert Outcome.MISS in outcomes
            assert Outcome.OK in outcomes
            stats = backend.stats()
            assert (stats.errors, stats.put_ok) == (0, outcomes.count(Outcome.OK))
            stored = [k for k, o in zip(keys, outcomes, strict=True) if o is Outcome.OK]
            assert await backend.exists(stored) == len(stored)


def _hold_the_server(host: str, port: int, seconds: float) -> threading.Thread:
    """Run a script that keeps `host:port` busy for `seconds`, on a thread."""
    import redis as sync_redis

    busy = (
        "local s = redis.call('TIME') "
        "while true do local n = redis.call('TIME') "
        "if (n[1] - s[1]) * 1000000 + (n[2] - s[2]) > tonumber(ARGV[1]) then break end end "
        "return 1"
    )

    def run() -> None:
        client = sync_redis.Redis(host=host, port=port)
        try:
            client.eval(busy, 0, int(seconds * 1e6))
        finally:
            client.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_busy_server_fails_one_exists_and_keeps_scripts_on(bulk: int) -> None:
    import redis as sync_redis

    with RedisServer(extra_args=["--busy-reply-threshold", "50"]) as server:
        url = fresh_url(f"redis://{server.host}:{server.port}/0", bulk=bulk)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(3)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 3
            thread = _hold_the_server(server.host, server.port, 3.0)
            probe = sync_redis.Redis(host=server.host, port=server.port)

            def busy() -> bool:
                try:
                    probe.ping()
                except sync_redis.ResponseError as exc:
                    return "BUSY" in str(exc)
                return False

            try:
                for _ in range(1000):  # until the server answers BUSY to everyone else
                    if busy():
                        break
                    await asyncio.sleep(0.01)
                else:
                    pytest.fail("the script never made the server busy")
                with pytest.raises(StorageError, match="BUSY"):
                    await backend.exists(keys)
            finally:
                probe.close()
                await asyncio.to_thread(thread.join)
            assert backend._multikey
            assert await backend.exists(keys) == 3
            assert backend.stats().errors == 1


def test_which_replies_refuse_scripts_for_good() -> None:
    from redis._parsers.base import BaseParser

    from hicache_async.storage._manifest_redis import no_room, scripting_refused

    def parsed(reply: str) -> Exception:
        return BaseParser.parse_error(reply)

    for reply in (
        "ERR unknown command 'evalsha', with args beginning with: ",
        "NOPERM this user has no permissions to run the 'evalsha' command",
        "CROSSSLOT Keys in request don't hash to the same slot",
        "ERR unsupported command 'EVALSHA'",
        "NOPERM this user has no permissions to run the 'eval' command",
        "NOPERM this user has no permissions to run the 'script|load' command",
        "NOPERM this user has no permissions to run the 'touch' command",
    ):
        assert scripting_refused(parsed(reply)), reply
        assert scripting_refused(reply), reply  # the bulk path sees the whole reply
    for reply in (
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
        "LOADING Redis is loading the dataset in memory",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "OOM command not allowed when used memory > 'maxmemory'.",
        # An ACL refusing a key, or another command, says nothing about scripts.
        "NOPERM this user has no permissions to access one of the keys used as arguments",
        "NOPERM this user has no permissions to run the 'client|setname' command",
        "NOPERM this user has no permissions to run the 'set' command",
    ):
        assert not scripting_refused(parsed(reply)), reply
        assert not scripting_refused(reply), reply
    assert no_room(parsed("OOM command not allowed when used memory > 'maxmemory'."))
    assert no_room("OOM command not allowed when used memory > 'maxmemory'.")
    assert not no_room(parsed("ERR value is not an integer or out of range"))


def _connections_named(host: str, port: int, name: str) -> int:
    import redis as sync_redis

    client = sync_redis.Redis(host=host, port=port)
    try:
        return sum(1 for c in client.client_list() if c.get("name") == name)
    finally:
        client.close()


@pytest.mark.parametrize("bulk", [1, 0])
async def test_close_waits_for_a_batch_in_flight_and_leaves_no_connection(bulk: int) -> None:
    import redis as sync_redis

    with RedisServer(extra_args=["--enable-debug-command", "yes"]) as server:
        name = f"closing{uuid.uuid4().hex[:8]}"
        base = f"redis://{server.host}:{server.port}/0"
        backend = RedisStorage.from_url(fresh_url(base, bulk=bulk, client_name=name))
        await backend.__aenter__()
        keys, pages, metas = make_pages(16, 64 << 10, split=1 << 10)
        sleeper = sync_redis.Redis(host=server.host, port=server.port)
        # The server stops answering for a while: the put below is then surely in flight
        # when close() is called.
        pause = threading.Thread(target=sleeper.execute_command, args=("DEBUG", "SLEEP", "1"))
        pause.start()
        try:
            await asyncio.sleep(0.1)
            put = asyncio.ensure_future(backend.put(keys, pages, metas))
            await asyncio.sleep(0.2)
            assert not put.done()
            await backend.close()
            assert put.done()
            assert await put == [Outcome.OK] * len(keys)
        finally:
            await asyncio.to_thread(pause.join)
            sleeper.close()
        assert _connections_named(server.host, server.port, name) == 0
        with pytest.raises(StorageError, match="closed"):
            await backend.exists(keys)


class _SteppedPipeline:
    """A pipeline whose commands run one at a time, with `between(command)` awaited after
    each: the interleaving a server allows another client within a pipeline."""

    def __init__(self, client: aioredis.Redis, between: Callable[[str], Awaitable[None]]):
        self._client = client
        self._between = between
        self._queued: list[tuple[str, tuple[object, ...]]] = []

    async def __aenter__(self) -> _SteppedPipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._queued = []

    def __getattr__(self, name: str) -> Callable[..., _SteppedPipeline]:
        def queue(*args: object) -> _SteppedPipeline:
            self._queued.append((name, args))
            return self

        return queue

    async def execute(self, raise_on_error: bool = True) -> list[object]:
        replies: list[object] = []
        for name, args in self._queued:
            try:
                replies.append(await getattr(self._client, name)(*args))
            except aioredis.ResponseError as exc:
                replies.append(exc)
            await self._between(name)
        return replies


@contextlib.contextmanager
def _stepped(backend: RedisStorage, between: Callable[[str], Awaitable[None]]) -> Iterator[None]:
    real = backend._client
    assert real is not None

    class _Client:
        def pipeline(self, transaction: bool = True) -> _SteppedPipeline:
            return _SteppedPipeline(real, between)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    backend._client = _Client()  # type: ignore[assignment]
    try:
        yield
    finally:
        backend._client = real


@pytest.mark.parametrize(("before", "after"), [(3000, 6000), (6000, 3000), (6000, 9000)])
async def test_a_value_replaced_between_length_and_read_is_a_miss_left_in_place(
    redis_url: str, before: int, after: int
) -> None:
    # The length came from one value and the bytes from the next: two sound pages were
    # judged CORRUPT and the one stored later was removed (a single GET never could). Both
    # past the page, the byte read past it cannot tell them apart: the removal, which takes
    # only the value read, does.
    async with RedisStorage.from_url(fresh_url(redis_url, bulk=0)) as backend:
        key = os.urandom(32)
        other = aioredis.Redis.from_url(redis_url)
        replacement = page_value(key, os.urandom(after))
        await backend.write_raw(key, page_value(key, os.urandom(before)))
        replaced = False

        async def replace(command: str) -> None:
            nonlocal replaced
            if command == "strlen" and not replaced:
                replaced = True
                await other.set(backend._rkey(key), replacement)

        try:
            with _stepped(backend, replace):
                outcomes = await backend.get([key], buffers(1), namespace=NS)
            assert replaced
            assert outcomes == [Outcome.MISS]
            assert await backend.read_raw(key) == replacement
            assert backend.stats().corrupt == 0
        finally:
            await other.aclose()


async def test_a_damaged_value_replaced_before_its_removal_keeps_the_new_page(
    redis_url: str,
) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url, bulk=0)) as backend:
        keys, pages, _ = make_pages(1)
        other = aioredis.Redis.from_url(redis_url)
        payload = joined(pages[0])
        damaged = page_value(keys[0], payload)
        await backend.write_raw(keys[0], damaged[:-1] + bytes([damaged[-1] ^ 1]))
        # Another writer's copy: the same page, its header written apart (another count).
        meta = PageMeta(key=keys[0], namespace=NS, num_tokens=2)
        sound = encode_header(meta, [payload]) + payload
        replaced = False

        async def replace(command: str) -> None:
            nonlocal replaced
            if command == "getrange" and not replaced:
                replaced = True
                await other.set(backend._rkey(keys[0]), sound)

        try:
            with _stepped(backend, replace):
                # What was read was damaged, but what is stored now is not: a miss.
                assert await backend.get(keys, buffers(1), namespace=NS) == [Outcome.MISS]
            assert backend.stats().corrupt == 0
            assert await backend.read_raw(keys[0]) == sound
            into = buffers(1)
            assert await backend.get(keys, into, namespace=NS) == [Outcome.OK]
            assert joined(into[0]) == joined(pages[0])
        finally:
            await other.aclose()


async def test_a_user_without_getrange_reads_whole_values(redis_url: str) -> None:
    # An ACL listing the commands a deployment allows (the data path as the docs had it):
    # every get was ERROR once reads went by STRLEN and GETRANGE.
    rules = ("allkeys", "+@connection", "+set", "+get", "+touch", "+exists", "+del", "+scan")
    rules += ("+evalsha", "+eval", "+script|load", "+info", "+client")
    async with acl_user(redis_url, *rules) as (user, _):
        url = user_url(redis_url, user, bulk=0)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(3)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 3
            with structlog.testing.capture_logs() as logs:
                into = buffers(3)
                assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 3
            assert [joined(b) for b in into] == [joined(p) for p in pages]
            assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
                "storage.redis.bounded_reads_refused"
            ]
            assert await backend.get(keys, buffers(3), namespace=NS) == [Outcome.OK] * 3


async def test_a_page_replaced_while_verify_reads_it_is_not_reported_corrupt(
    redis_url: str,
) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url, bulk=0)) as backend:
        key = os.urandom(32)
        other = aioredis.Redis.from_url(redis_url)
        payload = os.urandom(3 << 20)  # read in several pieces
        await backend.write_raw(key, page_value(key, payload))
        other_payload = os.urandom(len(payload))
        replacement = (
            encode_header(PageMeta(key=key, namespace=NS, num_tokens=2), [other_payload])
            + other_payload
        )
        ranges = 0

        async def replace(command: str) -> None:
            nonlocal ranges
            if command == "getrange":
                ranges += 1
                if ranges == 2:  # the header, then the first piece of the payload
                    await other.set(backend._rkey(key), replacement)

        try:
            with structlog.testing.capture_logs() as logs, _stepped(backend, replace):
                report = await backend.verify()
            assert ranges > 2
            assert report.corrupt_removed == 0
            assert backend.stats().corrupt == 0
            assert not [e for e in logs if e["event"] == "storage.page.corrupt"]
            assert await backend.read_raw(key) == replacement
        finally:
            await other.aclose()


async def test_a_close_cancelled_at_once_still_closes_every_connection(redis_url: str) -> None:
    # A cache never left: its loop's end cancels the close, whose aclose() of the client and
    # the pool was cancelled with it, and the connections stayed open.
    admin = aioredis.Redis.from_url(redis_url)
    try:
        name = f"c{uuid.uuid4().hex[:10]}"
        backend = RedisStorage.from_url(fresh_url(redis_url, bulk=0, client_name=name))
        await backend.__aenter__()
        keys, pages, metas = make_pages(8)
        await asyncio.gather(
            *(backend.put(keys[i : i + 1], pages[i : i + 1], metas[i : i + 1]) for i in range(8))
        )

        async def connections() -> int:
            listed = await admin.execute_command("CLIENT", "LIST")
            text = listed.decode() if isinstance(listed, bytes) else str(listed)
            return text.count(f"name={name} ")

        assert await connections() > 0
        closing = asyncio.create_task(backend.close())
        await asyncio.sleep(0)
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        for _ in range(200):
            if await connections() == 0:
                break
            await asyncio.sleep(0.01)
        assert await connections() == 0
    finally:
        await admin.aclose()


async def test_a_damaged_page_a_get_removes_leaves_the_counts(redis_url: str) -> None:
    async with RedisStorage.from_url(fresh_url(redis_url, bulk=0)) as backend:
        keys, pages, metas = make_pages(2)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 2
        before = backend.stats()
        damaged = await backend.read_raw(keys[0])
        assert damaged is not None
        await backend.write_raw(keys[0], damaged[:-1] + bytes([damaged[-1] ^ 1]))
        assert await backend.get(keys, buffers(2), namespace=NS) == [Outcome.CORRUPT, Outcome.OK]
        after = backend.stats()
        assert after.pages == before.pages - 1
        assert after.bytes == before.bytes - len(damaged)
        assert after.corrupt == before.corrupt + 1
        assert await backend.exists(keys[:1]) == 0


async def test_a_user_without_exists_gets_misses_for_absent_keys(redis_url: str) -> None:
    rules = ("allkeys", "+@connection", "+set", "+get", "+touch", "+strlen", "+getrange")
    rules += ("+del", "+scan", "+evalsha", "+eval", "+script|load", "+info", "+client")
    async with (
        acl_user(redis_url, *rules) as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, bulk=0)) as backend,
    ):
        keys, pages, metas = make_pages(3)
        assert await backend.put(keys[:2], pages[:2], metas[:2]) == [Outcome.OK] * 2
        await admin.set(backend._rkey(keys[1]), b"")  # an empty value: no page
        outcomes = await backend.get(keys, buffers(3), namespace=NS)
        assert outcomes == [Outcome.OK, Outcome.CORRUPT, Outcome.MISS]
        assert backend.stats().errors == 0


@pytest.mark.parametrize("bulk", [1, 0])
async def test_removals_keep_the_byte_count_where_strlen_is_refused(
    redis_url: str, bulk: int
) -> None:
    # A removal's bytes came from STRLEN alone: refused, they were counted as 0, and
    # stats().bytes grew with every page removed.
    page = HEADER_NBYTES + 3000
    async with (
        acl_user(redis_url, "~*", "+@all", "-strlen") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, bulk=bulk)) as backend,
    ):
        keys, pages, metas = make_pages(4)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 4
        assert (backend.stats().pages, backend.stats().bytes) == (4, 4 * page)
        for key, at in ((keys[0], page - 1), (keys[1], 40)):  # the payload, the header
            raw = await admin.get(backend._rkey(key))
            assert isinstance(raw, bytes)
            await admin.set(backend._rkey(key), raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :])
        outcomes = await backend.get(keys[:2], buffers(2), namespace=NS)
        assert outcomes == [Outcome.CORRUPT] * 2  # removed, at the lengths they were read with
        assert (backend.stats().pages, backend.stats().bytes) == (2, 2 * page)
        assert await backend.delete(keys[2:3]) == 1  # its header tells its length
        assert (backend.stats().pages, backend.stats().bytes) == (1, page)
        # A value whose length nothing tells: the mean page, all that is left with the last.
        await admin.set(backend._rkey(keys[3]), os.urandom(5000))
        assert await backend.delete(keys[3:]) == 1
        assert (backend.stats().pages, backend.stats().bytes) == (0, 0)
        more, more_pages, more_metas = make_pages(3, 1000)
        assert await backend.put(more, more_pages, more_metas) == [Outcome.OK] * 3
        for key in more:
            await admin.set(backend._rkey(key), os.urandom(777))
        assert await backend.delete(more[:2]) == 2
        assert (backend.stats().pages, backend.stats().bytes) == (1, HEADER_NBYTES + 1000)
        assert await backend.delete(more) == 1
        assert (backend.stats().pages, backend.stats().bytes) == (0, 0)
        # Pages another writer stored, removed here, take nothing below zero.
        await admin.set(backend._rkey(keys[0]), os.urandom(900))
        assert await backend.delete(keys[:1]) == 1
        assert backend._bytes == 0


async def _old_and_recent_pages(
    backend: RedisStorage, admin: aioredis.Redis, old_count: int, *, gap_s: float
) -> tuple[list[bytes], list[bytes], dict[bytes, int], dict[bytes, int]]:
    """`old_count` pages, then after `gap_s` 12 recent ones; some of each damaged, and an
    empty value. The old keys, the recent ones, {damaged key: stored length} and {sound
    key: priority}."""
    old, old_pages, old_metas = make_pages(old_count, 200)
    assert await backend.put(old, old_pages, old_metas) == [Outcome.OK] * old_count
    await asyncio.sleep(gap_s)  # past Redis's one-second idle clock
    new, new_pages, new_metas = make_pages(12, 200)
    assert await backend.put(new, new_pages, new_metas) == [Outcome.OK] * 12
    damaged = {}
    for key in [*old[::50], *new[::4]]:  # some among the most recent: read, passed over
        rkey = backend._rkey(key)
        raw = await admin.get(rkey)
        assert isinstance(raw, bytes)
        await admin.set(rkey, raw[:40] + bytes([raw[40] ^ 1]) + raw[41:])
        damaged[rkey] = len(raw)
    (empty,) = make_pages(1)[0]
    await admin.set(backend._rkey(empty), b"")
    damaged[backend._rkey(empty)] = 0
    sound = {
        backend._rkey(m.key): m.priority
        for m in [*old_metas, *new_metas]
        if backend._rkey(m.key) not in damaged
    }
    return old, new, damaged, sound


async def _scan_order(
    backend: RedisStorage, admin: aioredis.Redis, rkeys: Iterable[bytes]
) -> list[bytes]:
    """The pages in the order the backend's listing scans them. Lookups first (EXISTS: no
    use for Redis) finish the server's incremental rehash, a step each, which would reorder
    SCAN between this and the listing."""
    async with admin.pipeline(transaction=False) as pipe:
        for rkey in rkeys:
            pipe.exists(rkey)
        await pipe.execute()
    return [rkey async for batch in backend._scan() for rkey in batch]


async def _idle_times(admin: aioredis.Redis, rkeys: list[bytes]) -> list[Any]:
    """OBJECT IDLETIME of each key (it touches none of them)."""
    async with admin.pipeline(transaction=False) as pipe:
        for rkey in rkeys:
            pipe.object("idletime", rkey)
        return list(await pipe.execute())


async def _header_reads(admin: aioredis.Redis, call: Awaitable[T]) -> tuple[T, int]:
    """What `call` returns, and how many GETRANGE the server ran meanwhile."""
    await admin.config_resetstat()
    result = await call
    stats = await admin.info("commandstats")
    return result, stats.get("cmdstat_getrange", {}).get("calls", 0)


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_limited_look_reads_only_the_headers_that_decide_it(bulk: int) -> None:
    # `storage ls --limit 10` read every page's header (13.6 s for 200k pages). It reads the
    # idle times of all (no use for Redis), then headers best first, and more where some
    # of those turn out damaged: the same pages as the full listing's first ones. (The pages
    # fit one scan batch, whose idle times are read together: the clock's one-second tick
    # between two batches would move one against the other, here and in the full listing.)
    with RedisServer() as server:
        admin = aioredis.Redis(host=server.host, port=server.port)
        try:
            async with RedisStorage.from_url(fresh_url(server.url, bulk=bulk)) as backend:
                old, new, damaged, sound = await _old_and_recent_pages(
                    backend, admin, 200, gap_s=1.1
                )
                everything = sound.keys() | damaged.keys()
                for limit in (1, 5, 10, 12, 20, 400):
                    # The idle clock ticks once a second, and a pipeline of lookups can span a
                    # tick: the listing is compared only with idle times that did not move
                    # while it ran (read before and after it), trying again otherwise.
                    for _ in range(5):
                        scanned = await _scan_order(backend, admin, everything)
                        assert len(scanned) == 213
                        idles = await _idle_times(admin, scanned)
                        listed, reads = await _header_reads(
                            admin, backend.list_pages(limit, record=False)
                        )
                        if await _idle_times(admin, scanned) == idles:
                            break
                    else:
                        pytest.fail("the idle clock ticked during each of 5 listings")
                    # The full listing's order, from what reads nothing: idle times, the
                    # scan's order, the damage done (damaged pages: last used at 0).
                    ranks = [
                        (rkey in damaged, 0 if rkey in damaged else idle, i)
                        for i, (rkey, idle) in enumerate(zip(scanned, idles, strict=True))
                    ]
                    order = sorted(range(len(scanned)), key=ranks.__getitem__)
                    assert [backend._rkey(p.key) for p in listed] == [
                        scanned[i] for i in order[:limit]
                    ]
                    for page in listed:
                        rkey = backend._rkey(page.key)
                        if rkey in damaged:
                            assert (page.nbytes, page.last_access) == (damaged[rkey], 0.0)
                            assert (page.num_tokens, page.priority) == (0, 0)
                        else:
                            assert page.nbytes == HEADER_NBYTES + 200
                            assert (page.num_tokens, page.priority) == (16, sound[rkey])
                    if limit < len(sound):
                        assert reads <= limit + len(damaged)
                # After a recorded pass the pages not used since go by their creation, which
                # only their headers tell: those are all read, the ones used since are not.
                created = {}
                for rkey in scanned:
                    header = decode_header(await admin.getrange(rkey, 0, HEADER_NBYTES - 1))
                    if not isinstance(header, PageCheck):
                        created[rkey] = header.created_ns / 1e9
                await backend.list_pages()
                await asyncio.sleep(2.2)  # used clearly after the mark, on a one-second clock
                # Used one clock tick apart: two pages used together tie on the one-second
                # idle clock, and a tick between reads of their idle times could order them
                # either way.
                used = [old[7], new[1]]
                for i, key in enumerate(used):
                    if i:
                        await asyncio.sleep(1.2)
                    outcomes = await backend.get([key], buffers(1, 200, split=200), namespace=NS)
                    assert outcomes == [Outcome.OK]
                used_rkeys = {backend._rkey(key) for key in used}
                scanned = await _scan_order(backend, admin, everything)
                used_idle = {rkey: await admin.object("idletime", rkey) for rkey in used_rkeys}

                def after_the_pass(i: int) -> tuple[bool, float, int]:
                    rkey = scanned[i]
                    if rkey in used_rkeys:
                        return (False, used_idle[rkey], i)
                    return (True, -created.get(rkey, 0.0), i)

                order = sorted(range(len(scanned)), key=after_the_pass)
                listed = await backend.list_pages(5, record=False)
                assert [backend._rkey(p.key) for p in listed] == [scanned[i] for i in order[:5]]
            # Over several scan batches: the recent pages, a few headers read per batch.
            async with RedisStorage.from_url(fresh_url(server.url, bulk=bulk)) as backend:
                _, new, damaged, sound = await _old_and_recent_pages(backend, admin, 600, gap_s=2.2)
                recent = {backend._rkey(key) for key in new} - damaged.keys()
                listed, reads = await _header_reads(
                    admin, backend.list_pages(len(recent), record=False)
                )
                assert {backend._rkey(p.key) for p in listed} == recent
                batches = -(-(len(sound) + len(damaged)) // 256)
                assert reads <= batches * (2 * len(recent) + len(damaged))
                assert reads < len(sound) // 4
        finally:
            await admin.aclose()


@pytest.mark.parametrize(
    "params", [{}, {"bulk": 0}, {"multikey": 0}], ids=["bulk", "redis-py", "no-multikey"]
)
async def test_exists_answers_through_a_client_pause_write(
    redis_url: str, params: dict[str, int]
) -> None:
    # FAILOVER and a manual cluster failover pause writes for seconds while reads go on. The
    # script of exists only reads (TOUCH is a read), and says so: without the flag Redis 7
    # held it for the whole pause, and exists failed after `timeout` while get answered.
    admin = aioredis.Redis.from_url(redis_url)
    try:
        async with RedisStorage.from_url(fresh_url(redis_url, **params)) as backend:
            keys, pages, metas = make_pages(8)
            assert await backend.put(keys[:5], pages[:5], metas[:5]) == [Outcome.OK] * 5
            assert await backend.exists(keys[:1]) == 1
            # Not cached by the server (a restart, SCRIPT FLUSH): an EVALSHA would be held
            # for the pause before it could answer NOSCRIPT.
            await admin.script_flush()
            await admin.execute_command("CLIENT", "PAUSE", 30000, "WRITE")
            try:
                assert await asyncio.wait_for(backend.exists(keys), 10) == 5
            finally:
                await admin.execute_command("CLIENT", "UNPAUSE")
            assert backend.stats().errors == 0
    finally:
        await admin.aclose()


async def test_a_server_that_refuses_script_flags_gets_the_scripts_without_them(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before Redis 7.0 the flag line is a syntax error; this server refuses an unknown flag
    # alike. exists and the manifest's reads then use their scripts without it.
    from hicache_async.storage import _manifest_redis
    from hicache_async.storage._manifest import ManifestEntry

    unknown = "#!lua flags=no-such-flag\n"
    real = _manifest_redis.NO_WRITES
    monkeypatch.setattr(_manifest_redis, "NO_WRITES", unknown)
    monkeypatch.setattr(_redis, "_PREFIX_SCRIPT", unknown + _redis._PREFIX_SCRIPT[len(real) :])
    window = unknown + _manifest_redis._WINDOW_SCRIPT[len(real) :]
    monkeypatch.setattr(_manifest_redis, "_WINDOW_SCRIPT", window)
    for params in ({}, {"bulk": 0}):
        async with RedisStorage.from_url(fresh_url(redis_url, **params)) as backend:
            keys, pages, metas = make_pages(4)
            assert await backend.put(keys[:3], pages[:3], metas[:3]) == [Outcome.OK] * 3
            assert await backend.exists(keys) == 3
            assert await backend.exists(keys) == 3
            assert backend._prefix_script is not None
            assert not backend._prefix_script.script.startswith("#!")
            manifest = backend.manifest()
            chain = ManifestEntry(namespace="ab" * 16, keys=["cd" * 32], num_tokens=8)
            await manifest.append([chain])
            assert (await manifest.read(namespace="ab" * 16)).entries == [chain]
            assert manifest._scripting
            assert backend.stats().errors == 0


def test_which_replies_refuse_script_flags() -> None:
    from hicache_async.storage._manifest_redis import flags_refused

    for reply in (
        # Redis 6.2, and a server that takes the flag line for Lua (Dragonfly).
        "ERR Error compiling script (new function): user_script:1: unexpected symbol near '#'",
        "user_script:2: unexpected symbol near '#'",
        "ERR Unexpected flag in script shebang: no-writes",
        "ERR Unexpected engine in script shebang: lua",
    ):
        assert flags_refused(reply), reply
    for reply in (
        "NOSCRIPT No matching script. Please use EVAL.",
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
        "NOPERM this user has no permissions to run the 'evalsha' command",
    ):
        assert not flags_refused(reply), reply


async def test_a_cancelled_delete_counts_what_the_server_removed() -> None:
    # The server runs the DELs it received whether or not the caller waits for the replies:
    # dropped with the cancellation, stats() kept counting pages that were gone, for good.
    page = HEADER_NBYTES + 3000
    with RedisServer() as server:
        async with RedisStorage.from_url(f"{server.url}?prefix=cancelled") as backend:
            keys, pages, metas = make_pages(300)  # two pipelines of DELs
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 300
            pid = server.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                task = asyncio.ensure_future(backend.delete(keys))
                await asyncio.sleep(0.3)  # its first pipeline is sent, the server holds it
                task.cancel()
            finally:
                os.kill(pid, signal.SIGCONT)
            with pytest.raises(asyncio.CancelledError):
                await task
            admin = aioredis.Redis(host=server.host, port=server.port)
            try:
                left = await admin.dbsize()
            finally:
                await admin.aclose()
            assert left == 300 - 256  # the second pipeline was never sent
            assert (backend.stats().pages, backend.stats().bytes) == (left, left * page)


async def test_a_delete_stops_between_pipelines_for_an_anyio_cancel_scope(redis_url: str) -> None:
    # Each pipeline's replies are read whatever cancels the caller, behind a shield that
    # anyio's scopes respect: a deadline or a cancelled task group that came meanwhile went
    # undelivered until every pipeline of the call had run, and the call returned normally.
    async with RedisStorage.from_url(fresh_url(redis_url)) as backend:
        keys, pages, metas = make_pages(300)  # two pipelines of DELs
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 300
        with anyio.CancelScope() as scope:
            scope.cancel()
            await backend.delete(keys)
        assert scope.cancelled_caught
        assert await backend.exists(keys[256:]) == 300 - 256  # the second was never sent
        assert backend.stats().pages == 300 - 256
        assert await backend.delete(keys) == 300 - 256


async def test_a_delete_that_times_out_is_not_sent_again_nor_counted_twice() -> None:
    # redis-py's retry sent the pipeline again after the timeout: the server had run the
    # first meanwhile, so the second found nothing and delete() returned 0 for pages it had
    # removed, which stats() went on counting (and counted again once put again).
    page = HEADER_NBYTES + 3000
    with RedisServer() as server:
        admin = aioredis.Redis(host=server.host, port=server.port)
        url = f"{server.url}?prefix=late&timeout=1"
        try:
            async with RedisStorage.from_url(url) as backend:
                keys, pages, metas = make_pages(50)
                assert await backend.put(keys, pages, metas) == [Outcome.OK] * 50
                await admin.config_resetstat()
                pid = server.pid
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                # Back after the first attempt timed out, while a retry would be connecting.
                resume = asyncio.get_running_loop().call_later(1.5, os.kill, pid, signal.SIGCONT)
                try:
                    with pytest.raises(StorageError, match="delete failed"):
                        await backend.delete(keys)
                finally:
                    resume.cancel()
                    os.kill(pid, signal.SIGCONT)
                for _ in range(200):  # the server runs the DELs it had received
                    if await admin.dbsize() == 0:
                        break
                    await asyncio.sleep(0.05)
                assert await admin.dbsize() == 0
                calls = (await admin.info("commandstats"))["cmdstat_del"]["calls"]
                assert calls == 50  # sent once
                # The next put finds them gone before storing them again: counted once.
                assert await backend.put(keys, pages, metas) == [Outcome.OK] * 50
                assert (backend.stats().pages, backend.stats().bytes) == (50, 50 * page)
                assert await backend.delete(keys) == 50
                assert (backend.stats().pages, backend.stats().bytes) == (0, 0)
                assert not backend._unsettled
        finally:
            await admin.aclose()


async def test_write_raw_where_multi_is_refused(redis_url: str) -> None:
    # A refused MULTI runs the commands of a transaction one by one (redis-py sends them in
    # one write): write_raw stored the value, then raised. A script does it instead, and
    # where scripting is refused too, nothing is written.
    async with (
        acl_user(redis_url, "~*", "+@all", "-multi") as (user, _),
        RedisStorage.from_url(user_url(redis_url, user)) as backend,
    ):
        keys, pages, metas = make_pages(2)
        assert await backend.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
        raw = await backend.read_raw(keys[0])
        assert raw is not None
        await backend.write_raw(keys[1], raw[:100])
        await backend.write_raw(keys[0], raw + b"x")
        assert await backend.read_raw(keys[0]) == raw + b"x"
        assert (backend.stats().pages, backend.stats().bytes) == (2, len(raw) + 1 + 100)
    async with (
        acl_user(redis_url, "~*", "+@all", "-multi", "-@scripting") as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user)) as backend,
    ):
        key = os.urandom(32)
        with pytest.raises(StorageError, match="MULTI"):
            await backend.write_raw(key, b"value")
        assert await admin.exists(backend._rkey(key)) == 0


@pytest.mark.parametrize("multi", [True, False], ids=["multi", "scripted"])
async def test_write_raw_keeps_the_ttl(redis_url: str, multi: bool) -> None:
    # Both ways write_raw writes (a transaction, or a script where MULTI is refused) give
    # the page the backend's TTL, on a new key and on one it replaces.
    rules = ("~*", "+@all") if multi else ("~*", "+@all", "-multi")
    async with (
        acl_user(redis_url, *rules) as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user, ttl=60)) as backend,
    ):
        keys, pages, metas = make_pages(2)
        assert await backend.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
        raw = await backend.read_raw(keys[0])
        assert raw is not None
        assert await admin.persist(backend._rkey(keys[0]))  # replacing it must set it again
        await backend.write_raw(keys[0], raw + b"x")
        await backend.write_raw(keys[1], raw[:100])
        assert backend._multi is multi
        for key in keys:
            assert 0 < await admin.ttl(backend._rkey(key)) <= 60
    # Without a TTL, what write_raw stores never expires.
    async with (
        acl_user(redis_url, *rules) as (user, admin),
        RedisStorage.from_url(user_url(redis_url, user)) as backend,
    ):
        key = os.urandom(32)
        await backend.write_raw(key, b"value")
        assert await admin.ttl(backend._rkey(key)) == -1


class _ClockAhead:
    """The `time` module as the Redis store sees it, with `time()` moved `ahead` seconds."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def time(self) -> float:
        return time.time() + self.ahead

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.mark.parametrize("record", [True, False])
async def test_a_listing_that_takes_long_reads_the_marks_idle_time_with_each_batch(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, record: bool
) -> None:
    # The recorded pass's mark had its idle time read once, when a listing began, and
    # `ls --limit` (no pass recorded) counted every batch's idle times to that start too: a
    # page used shortly after the pass, reached by a later batch once the listing had taken
    # longer than that, listed as not used since the pass (gc and `ls` ranked it with the
    # pages nobody used). Here 100 s pass between the two batches: the server's idle times
    # move on by RESTORE, this host's clock by the store's `time`, nothing waits.
    from hicache_async.storage import _redis

    admin = aioredis.Redis.from_url(redis_url)
    clock = _ClockAhead()
    try:
        async with RedisStorage.from_url(fresh_url(redis_url)) as backend:
            keys, pages, metas = make_pages(2)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 2
            await backend.list_pages()  # the recorded pass
            mark = backend._touched_rkey()
            unused, used = (backend._rkey(key) for key in keys)

            async def age(rkey: bytes, idle: int) -> None:
                dumped = await admin.dump(rkey)
                await admin.execute_command("RESTORE", rkey, 0, dumped, "REPLACE", "IDLETIME", idle)

            # The pass ran 100 s ago; one page was not used since, the other 5 s after it.
            for rkey, idle in ((mark, 100), (unused, 100), (used, 95)):
                await age(rkey, idle)

            async def slow_scan() -> AsyncIterator[list[bytes]]:
                yield [unused]
                clock.ahead += 100
                for rkey, idle in ((mark, 200), (used, 195)):
                    await age(rkey, idle)
                yield [used]

            monkeypatch.setattr(backend, "_scan", slow_scan)
            monkeypatch.setattr(_redis, "time", clock)
            listed = await backend.list_pages(None if record else 1, record=record)
            monkeypatch.undo()
            assert listed[0].key == keys[1]
            assert abs(listed[0].last_access - (time.time() - 95)) <= 2
    finally:
        await admin.aclose()


async def test_a_page_created_ahead_of_this_clock_lists_no_newer_than_its_idle_time(
    redis_url: str,
) -> None:
    # A page not used since a recorded pass goes by its creation, which its writer's clock
    # stamped: a writer whose clock ran ahead (or this host's clock stepped back since) made
    # it list as used after pages read a moment ago, and gc evicted those first. Its last
    # use is no later than the pass, whose mark's idle time tells when on the server's clock.
    admin = aioredis.Redis.from_url(redis_url)
    try:
        async with RedisStorage.from_url(fresh_url(redis_url)) as backend:
            keys, pages, metas = make_pages(2)
            assert await backend.put(keys[1:], pages[1:], metas[1:]) == [Outcome.OK]
            ahead_ns = time.time_ns() + 86_400 * 10**9  # a day ahead
            header = encode_header(metas[0], pages[0], created_ns=ahead_ns)
            await backend.write_raw(keys[0], header + joined(pages[0]))
            await backend.list_pages()  # the recorded pass

            async def pass_long_ago() -> None:
                # Idle times as if the pass ran 100 s ago and the page ahead was last read
                # by it (a listing's header read is a use): no one-second clock to wait for.
                for rkey in (backend._touched_rkey(), backend._rkey(keys[0])):
                    dumped = await admin.dump(rkey)
                    await admin.execute_command(
                        "RESTORE", rkey, 0, dumped, "REPLACE", "IDLETIME", 100
                    )

            await pass_long_ago()
            # The other page is used after the pass.
            assert await backend.get(keys[1:], buffers(1), namespace=NS) == [Outcome.OK]
            listed = await backend.list_pages(record=False)
            assert [page.key for page in listed] == [keys[1], keys[0]]
            assert listed[1].last_access <= time.time() - 100 + 1
            await pass_long_ago()
            limited = await backend.list_pages(1, record=False)
            assert [page.key for page in limited] == [keys[1]]
    finally:
        await admin.aclose()
