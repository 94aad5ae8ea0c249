"""MooncakeStorage against a real mooncake_master (TCP transport, everything on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import ipaddress
import json
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import quote

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import structlog

from hicache_async import StorageConfigError, StorageError
from hicache_async._ratelog import LogLimiter
from hicache_async.cli import main
from hicache_async.cli._args import mooncake_lending_nothing
from hicache_async.storage import HEADER_NBYTES, Outcome, PageInfo, PageMeta, open_storage
from hicache_async.storage import _mooncake as mooncake_module
from hicache_async.storage._manifest import ManifestEntry, ManifestLimits, chain_entry, encode_entry
from hicache_async.storage._manifest_mooncake import _INDEX_VERSION, _Index, _with_token
from hicache_async.storage._mooncake import (
    _NOT_FOUND,
    _POOL,
    MooncakeStorage,
    _Arena,
    _put_groups,
    close_idle_clients,
)
from hicache_async.storage._page import FORMAT_VERSION, PageCheck, decode_header, encode_header
from hicache_async.testing._conformance import MAC_KEY, StorageConformance
from hicache_async.testing._servers import (
    MooncakeMaster,
    ServerBinaryNotFoundError,
    ServerError,
    free_port,
)

NS = bytes(range(16))
OTHER_NS = bytes(16)
# Small segments keep the suite light; auto_register above the test buffers' sizes keeps the
# plain tests on the staged path, the zero-copy tests register explicitly or lower it.
SMALL = {"segment_size": "512MiB", "buffer_size": "16MiB", "staging_size": "8MiB"}


def make_pages(
    count: int, nbytes: int = 3000, *, split: int = 1000
) -> tuple[list[bytes], list[list[memoryview]], list[PageMeta]]:
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
    merged = {**SMALL, "prefix": f"t{uuid.uuid4().hex}", **params}
    return base + "".join(f"&{k}={v}" for k, v in merged.items())


@pytest.fixture
async def backend(mooncake_url: str) -> AsyncIterator[MooncakeStorage]:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url)) as storage:
        yield storage


async def test_round_trip_with_per_key_outcomes(backend: MooncakeStorage) -> None:
    keys, pages, metas = make_pages(6)
    assert await backend.put(keys[:4], pages[:4], metas[:4]) == [Outcome.OK] * 4
    into = buffers(6)
    assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 4 + [Outcome.MISS] * 2
    for page, got in zip(pages[:4], into[:4], strict=True):
        assert joined(got) == joined(page)
    stats = backend.stats()
    assert (stats.puts, stats.put_ok, stats.gets, stats.get_hits) == (4, 4, 6, 4)
    assert (stats.pages, stats.bytes) == (4, 4 * (HEADER_NBYTES + 3000))
    assert backend.staged_pages == 10  # small bytearrays: not registered


async def test_existing_key_is_ok_and_not_rewritten(backend: MooncakeStorage) -> None:
    keys, pages, metas = make_pages(1)
    _, other, _ = make_pages(1)
    assert await backend.put(keys, pages, metas) == [Outcome.OK]
    before = await backend.read_raw(keys[0])
    assert await backend.put(keys, other, metas) == [Outcome.OK]
    assert await backend.read_raw(keys[0]) == before
    assert backend.stats().pages == 1


class _Client:
    """The Mooncake client as it is, for subclasses to change one call of."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Recording:
    """The Mooncake client, recording the arguments of each call of `method`."""

    def __init__(self, inner: Any, method: str) -> None:
        self.inner = inner
        self.method = method
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name != self.method:
            return attribute

        def call(*args: Any) -> Any:
            result = attribute(*args)
            self.calls.append(args)
            self._called(first=len(self.calls) == 1)
            return result

        return call

    def _called(self, *, first: bool) -> None:
        """Runs after each recorded call, on the caller's thread: nothing here."""


async def test_a_key_put_twice_in_one_batch_is_sent_and_counted_once(
    backend: MooncakeStorage,
) -> None:
    keys, pages, metas = make_pages(2)
    _, other, _ = make_pages(1)
    client = _Recording(backend._store, "batch_put_from_multi_buffers")
    backend._store = client
    try:
        outcomes = await backend.put(
            [keys[0], keys[1], keys[0]], [pages[0], pages[1], other[0]], [*metas, metas[0]]
        )
    finally:
        backend._store = client.inner
    assert outcomes == [Outcome.OK] * 3
    assert [list(args[0]) for args in client.calls] == [[backend._mkey(k) for k in keys]]
    stats = backend.stats()
    assert (stats.pages, stats.bytes, stats.put_ok) == (2, 2 * (HEADER_NBYTES + 3000), 3)
    into = buffers(1)
    assert await backend.get(keys[:1], into, namespace=NS) == [Outcome.OK]
    assert joined(into[0]) == joined(pages[0])  # the first occurrence's page
    assert await backend.delete(keys) == 2
    assert (backend.stats().pages, backend.stats().bytes) == (0, 0)


def test_put_groups_cut_in_order_at_the_byte_budget() -> None:
    assert _put_groups([], [], 10) == []
    assert _put_groups([4, 7, 9], [3, 3, 3], 100) == [[4, 7, 9]]
    assert _put_groups([0, 1, 2, 3, 4], [4, 6, 10, 1, 1], 10) == [[0, 1], [2], [3, 4]]
    assert _put_groups([0, 1], [50, 50], 10) == [[0], [1]]


@pytest.mark.parametrize("registered", [False, True])
async def test_put_in_groups_on_two_lanes(mooncake_url: str, registered: bool) -> None:
    """A batch larger than a group goes out in several groups at once; each page's outcome
    and bytes are its own, pages already stored among them included."""
    nbytes = 64 * 1024
    keys, pages, metas = make_pages(11, nbytes, split=nbytes // 3)
    arena = np.frombuffer(b"".join(joined(p) for p in pages), dtype=np.uint8).copy()
    if registered:
        flat = memoryview(arena.data)
        pages = [[flat[i * nbytes : (i + 1) * nbytes]] for i in range(11)]
    async with MooncakeStorage.from_url(fresh_url(mooncake_url)) as storage:
        if registered:
            await storage.register_memory(arena)
        storage._put_group_bytes = 2 * nbytes
        assert await storage.put(keys[3:5], pages[3:5], metas[3:5]) == [Outcome.OK] * 2
        assert await storage.put(keys, pages, metas) == [Outcome.OK] * 11
        assert storage.stats().pages == 11  # the two already stored were not counted again
        assert storage.zero_copy_pages == (13 if registered else 0)
        into = buffers(11, nbytes, split=nbytes // 3)
        assert await storage.get(keys, into, namespace=NS) == [Outcome.OK] * 11
        assert [joined(p) for p in into] == [
            bytes(arena[i * nbytes : (i + 1) * nbytes]) for i in range(11)
        ]


class _CancelInside(_Recording):
    """The Mooncake client, except that the first call of `method` cancels `task` once it has
    returned, and holds its thread until the cancellation has reached the job."""

    def __init__(self, inner: Any, method: str) -> None:
        super().__init__(inner, method)
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Future[Any] | None = None

    def _called(self, *, first: bool) -> None:
        if first:
            assert self.task is not None
            self.loop.call_soon_threadsafe(self.task.cancel)
            time.sleep(0.5)


async def test_cancelled_put_in_groups_sends_no_group_after_the_cancel(mooncake_url: str) -> None:
    keys, pages, metas = make_pages(48, 1 << 20, split=1 << 19)
    async with MooncakeStorage.from_url(fresh_url(mooncake_url)) as storage:
        storage._put_group_bytes = 2 << 20
        client = _CancelInside(storage._store, "batch_put_from_multi_buffers")
        storage._store = client
        try:
            client.task = task = asyncio.ensure_future(storage.put(keys, pages, metas))
            with pytest.raises(asyncio.CancelledError):
                await task
            calls = len(client.calls)
            await asyncio.sleep(0.2)
            assert len(client.calls) == calls  # the put returned only once its job had stopped
        finally:
            storage._store = client.inner
        sent = {name for args in client.calls for name in args[0]}
        # The first lane's group, and at most what the other lane sent before the cancel.
        assert 2 <= len(sent) <= 12
        assert storage.stats().pages == len(sent)  # counted although the caller gave up
        into = buffers(48, 1 << 20, split=1 << 19)
        outcomes = await storage.get(keys, into, namespace=NS)
        stored = {storage._mkey(k) for k, o in zip(keys, outcomes, strict=True) if o is Outcome.OK}
        assert stored == sent
        assert set(outcomes) == {Outcome.OK, Outcome.MISS}
        for outcome, page, got in zip(outcomes, pages, into, strict=True):
            if outcome is Outcome.OK:
                assert joined(got) == joined(page)
        # The put can be done again in full afterwards.
        assert await storage.put(keys, pages, metas) == [Outcome.OK] * 48
        assert await storage.get(keys, into, namespace=NS) == [Outcome.OK] * 48


async def test_registration_cancelled_midway_is_undone_on_close(mooncake_url: str) -> None:
    pool = np.zeros(2 << 20, dtype=np.uint8)
    address = int(pool.ctypes.data)
    keys, _, metas = make_pages(1)
    url = fresh_url(mooncake_url, auto_register="1MiB")
    async with MooncakeStorage.from_url(url) as storage:
        client = _CancelInside(storage._store, "register_buffer")
        storage._store = client
        try:
            put = storage.put(keys, [[memoryview(pool[:4096])]], metas)
            client.task = task = asyncio.ensure_future(put)
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            storage._store = client.inner
        assert [args[0] for args in client.calls] == [address]
        assert "registered=1" in repr(storage)  # known, so close() undoes it
    # The pooled client holds no stale registration of that memory.
    assert client.inner.register_buffer(address, pool.nbytes) == 0
    assert client.inner.unregister_buffer(address) == 0


class _RecordingRegistrations(_CancelInside):
    def __init__(self, inner: Any, method: str) -> None:
        super().__init__(inner, method)
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def register_buffer(self, address: int, size: int) -> int:
        code = int(self.inner.register_buffer(address, size))
        if code == 0:
            self.registered.append(address)
        return code

    def unregister_buffer(self, address: int) -> int:
        self.unregistered.append(address)
        return int(self.inner.unregister_buffer(address))


class _NoHostname(_RecordingRegistrations):
    def get_hostname(self) -> str:
        raise RuntimeError("no hostname")


@pytest.mark.parametrize("how", ["cancelled", "failing"])
async def test_open_stopped_once_registered_hands_the_client_back(
    mooncake_url: str, how: str
) -> None:
    """An open cancelled once the client is ready, or failing after its arena is registered,
    undoes the registration and gives the client back to the pool."""
    url = fresh_url(mooncake_url)
    async with MooncakeStorage.from_url(url) as first:
        key = first._client_key()
    inner = _POOL.take(key)  # the client `first` gave back
    assert inner is not None
    if how == "cancelled":
        client: _RecordingRegistrations = _RecordingRegistrations(inner, "get_hostname")
    else:
        client = _NoHostname(inner, "no_such_method")
    _POOL.give_back(key, client)
    try:
        storage = MooncakeStorage.from_url(url)
        client.task = task = asyncio.ensure_future(storage.__aenter__())
        expected: type[BaseException] = (
            asyncio.CancelledError if how == "cancelled" else RuntimeError
        )
        with pytest.raises(expected):
            await task
        assert storage.closed
        assert len(client.registered) == 1  # the staging arena
        assert client.unregistered == client.registered
        assert _POOL.take(key) is client  # back in the pool, ready for the next backend
    finally:
        _POOL.give_back(key, inner)


class _RefusingRegistrations(_RecordingRegistrations):
    """Records registrations and refuses those `refuse(address)` picks (as Mooncake refuses
    an overlapping range)."""

    def __init__(self, inner: Any, refuse: Any) -> None:
        super().__init__(inner, "no_such_method")
        self.refuse = refuse

    def register_buffer(self, address: int, size: int) -> int:
        if self.refuse(address):
            return -600
        return super().register_buffer(address, size)


async def test_memory_registered_while_entering_takes_effect(mooncake_url: str) -> None:
    pool = np.zeros(2 << 20, dtype=np.uint8)
    keys, _, metas = make_pages(1)
    storage = MooncakeStorage.from_url(fresh_url(mooncake_url))
    opening = asyncio.ensure_future(storage.__aenter__())
    await asyncio.sleep(0)  # the open job is running: the backend is neither new nor open
    try:
        await storage.register_memory(pool)
        assert await opening is storage
        assert "registered=1" in repr(storage)
        assert await storage.put(keys, [[memoryview(pool[:4096])]], metas) == [Outcome.OK]
        assert (storage.zero_copy_pages, storage.staged_pages) == (1, 0)
        await storage.unregister_memory(pool)
    finally:
        await storage.close()


async def test_registration_refused_while_entering_raises_and_leaves_none(
    mooncake_url: str,
) -> None:
    url = fresh_url(mooncake_url)
    async with MooncakeStorage.from_url(url) as first:
        key = first._client_key()
    inner = _POOL.take(key)
    assert inner is not None
    pool = np.zeros(2 << 20, dtype=np.uint8)
    address = int(pool.ctypes.data)
    client = _RefusingRegistrations(inner, lambda a: a == address)
    _POOL.give_back(key, client)
    try:
        storage = MooncakeStorage.from_url(url)
        opening = asyncio.ensure_future(storage.__aenter__())
        await asyncio.sleep(0)
        try:
            # Strict, as once entered: the caller hears of it, the backend stays usable.
            with pytest.raises(StorageError, match="register_buffer failed"):
                await storage.register_memory(pool)
            assert await opening is storage
            assert "registered=0" in repr(storage)
            keys, pages, metas = make_pages(1)
            assert await storage.put(keys, pages, metas) == [Outcome.OK]
        finally:
            await storage.close()
        assert len(client.registered) == 1  # the staging arena only
        assert client.unregistered == client.registered
    finally:
        assert _POOL.take(key) is client
        _POOL.give_back(key, inner)


async def test_registration_while_entering_fails_when_the_open_fails(mooncake_url: str) -> None:
    url = fresh_url(mooncake_url)
    async with MooncakeStorage.from_url(url) as first:
        key = first._client_key()
    inner = _POOL.take(key)
    assert inner is not None
    client = _RefusingRegistrations(inner, lambda a: True)
    _POOL.give_back(key, client)
    try:
        storage = MooncakeStorage.from_url(url)
        opening = asyncio.ensure_future(storage.__aenter__())
        await asyncio.sleep(0)
        with pytest.raises(StorageError, match="closed"):
            await storage.register_memory(np.zeros(2 << 20, dtype=np.uint8))
        with pytest.raises(StorageError, match="register_buffer failed"):
            await opening
        assert client.registered == []
    finally:
        assert _POOL.take(key) is client
        _POOL.give_back(key, inner)


async def test_delete_counts_the_sizes_of_what_it_removed(backend: MooncakeStorage) -> None:
    small_keys, small_pages, small_metas = make_pages(2)
    big_keys, big_pages, big_metas = make_pages(1, 5000)
    await backend.put(small_keys + big_keys, small_pages + big_pages, small_metas + big_metas)
    assert backend.stats().bytes == 2 * (HEADER_NBYTES + 3000) + HEADER_NBYTES + 5000
    absent = os.urandom(32)
    # One size lookup for the whole batch; an absent key costs nothing and counts nothing.
    assert await backend.delete([big_keys[0], absent, small_keys[0]]) == 2
    stats = backend.stats()
    assert (stats.pages, stats.bytes, stats.deletes) == (1, HEADER_NBYTES + 3000, 2)
    assert await backend.exists(small_keys[1:]) == 1


def _mooncake_errors(captured: str) -> list[str]:
    """The error lines of Mooncake's own log (glog: `E` and the date) in `captured`."""
    return [line for line in captured.splitlines() if re.match(r"E\d{4} ", line)]


async def test_delete_of_absent_keys_logs_nothing_per_key(
    backend: MooncakeStorage, capfd: pytest.CaptureFixture[str]
) -> None:
    keys, pages, metas = make_pages(2)
    await backend.put(keys, pages, metas)
    capfd.readouterr()
    assert await backend.delete([os.urandom(32)]) == 0
    one = _mooncake_errors(capfd.readouterr().err)
    assert await backend.delete([os.urandom(32) for _ in range(64)]) == 0
    many = _mooncake_errors(capfd.readouterr().err)
    assert len(many) <= len(one), many[:3]
    # Present keys among absent ones still count their bytes.
    assert await backend.delete([os.urandom(32), keys[0], os.urandom(32)]) == 1
    stats = backend.stats()
    assert (stats.pages, stats.bytes, stats.deletes) == (1, HEADER_NBYTES + 3000, 1)
    assert _mooncake_errors(capfd.readouterr().err) == []


async def test_exists_counts_the_consecutive_prefix(backend: MooncakeStorage) -> None:
    keys, pages, metas = make_pages(4)
    stored = [0, 1, 3]
    await backend.put(
        [keys[i] for i in stored], [pages[i] for i in stored], [metas[i] for i in stored]
    )
    assert await backend.exists(keys) == 2
    assert await backend.exists(keys[2:]) == 0
    assert await backend.exists([]) == 0


async def test_registered_memory_moves_zero_copy(backend: MooncakeStorage) -> None:
    pool = np.zeros(8 << 20, dtype=np.uint8)
    await backend.register_memory(pool)
    page_nbytes = 256 << 10
    count = 8
    source = np.random.default_rng(1).integers(0, 256, count * page_nbytes, dtype=np.uint8)
    pool[: source.size] = source
    # Each page as four segments of the pool, like a layer-split host layout.
    quarter = page_nbytes // 4
    segments = [
        [memoryview(pool[i * page_nbytes + q * quarter :][:quarter]) for q in range(4)]
        for i in range(count)
    ]
    keys = [os.urandom(32) for _ in range(count)]
    metas = [PageMeta(key=k, namespace=NS, num_tokens=64) for k in keys]
    # Read-only, as the cache hands them over: still zero copy.
    read_only = [[view.toreadonly() for view in page] for page in segments]
    assert await backend.put(keys, read_only, metas) == [Outcome.OK] * count
    pool[: source.size] = 0
    assert await backend.get(keys, segments, namespace=NS) == [Outcome.OK] * count
    assert np.array_equal(pool[: source.size], source)
    assert backend.zero_copy_pages == 2 * count
    assert backend.staged_pages == 0
    # The stored object is header ‖ payload, whatever the path.
    raw = await backend.read_raw(keys[3])
    assert raw is not None
    assert raw[HEADER_NBYTES:] == source[3 * page_nbytes : 4 * page_nbytes].tobytes()
    await backend.unregister_memory(pool)


async def test_host_pools_register_on_first_use(mooncake_url: str) -> None:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, auto_register="1MiB")) as backend:
        pool = np.zeros(2 << 20, dtype=np.uint8)
        pool[:4096] = 7
        keys, _, _ = make_pages(2)
        # Read-only, as the cache hands them over: they register all the same.
        pages = [[memoryview(pool[:4096]).toreadonly()], [memoryview(pool[4096:8192]).toreadonly()]]
        metas = [PageMeta(key=k, namespace=NS, num_tokens=1) for k in keys]
        small = bytearray(4096)  # below the threshold: staged
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 2
        assert await backend.get(keys[:1], [[memoryview(small)]], namespace=NS) == [Outcome.OK]
        assert small == bytes([7]) * 4096
        assert (backend.zero_copy_pages, backend.staged_pages) == (2, 1)
        assert "registered=1" in repr(backend)


async def test_another_client_reads_the_pages(mooncake_url: str, backend: MooncakeStorage) -> None:
    keys, pages, metas = make_pages(3, 100_000, split=60_000)
    await backend.put(keys, pages, metas)
    url = fresh_url(mooncake_url, prefix=backend.prefix, segment_size=0)
    async with MooncakeStorage.from_url(url) as reader:
        assert reader.capabilities.persistent  # it lends no memory: pages outlive it
        into = buffers(3, 100_000, split=60_000)
        assert await reader.get(keys, into, namespace=NS) == [Outcome.OK] * 3
        assert [joined(b) for b in into] == [joined(p) for p in pages]
        assert await reader.exists(keys) == 3


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
    backend: MooncakeStorage, damage: object, expected: Outcome
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
        assert await backend.read_raw(keys[0]) is None
        assert backend.stats().corrupt == 1
    else:
        assert await backend.read_raw(keys[0]) == damaged
        assert backend.stats().corrupt == 0


class _ReplacedAfterRead(_Client):
    """The Mooncake client, except that right after the first batch read another client
    stores `value` under `name`, as a delete and put racing with the read would."""

    def __init__(self, inner: Any, name: str, value: bytes) -> None:
        super().__init__(inner)
        self.name = name
        self.value = value
        self.replaced = False

    def batch_get_into_multi_buffers(self, *args: Any) -> Any:
        codes = self.inner.batch_get_into_multi_buffers(*args)
        if not self.replaced:
            self.replaced = True
            assert self.inner.upsert(self.name, self.value) == 0
        return codes


async def test_a_page_replaced_while_read_is_a_miss_not_removed(backend: MooncakeStorage) -> None:
    # The read saw another object's bytes under the name (its memory was reused): the page
    # now there is sound and must stay, uncounted as corrupt.
    keys, pages, metas = make_pages(2)
    await backend.put(keys, pages, metas)
    sound, other = await backend.read_raw(keys[0]), await backend.read_raw(keys[1])
    assert sound is not None
    assert other is not None
    await backend.write_raw(keys[0], other)  # the header names keys[1]
    client = _ReplacedAfterRead(backend._store, backend._mkey(keys[0]), sound)
    backend._store = client
    try:
        assert await backend.get(keys[:1], buffers(1), namespace=NS) == [Outcome.MISS]
    finally:
        backend._store = client.inner
    assert client.replaced
    assert backend.stats().corrupt == 0
    assert await backend.read_raw(keys[0]) == sound
    into = buffers(1)
    assert await backend.get(keys[:1], into, namespace=NS) == [Outcome.OK]
    assert joined(into[0]) == joined(pages[0])
    # Without the race the same foreign object is judged corrupt and removed.
    await backend.write_raw(keys[0], other)
    assert await backend.get(keys[:1], buffers(1), namespace=NS) == [Outcome.CORRUPT]
    assert await backend.read_raw(keys[0]) is None


async def test_a_damaged_page_larger_than_the_local_buffer_is_removed(mooncake_url: str) -> None:
    # The whole read that confirms the damage copies through Mooncake's local buffer, which
    # gives nothing for a larger object: the page was a miss left in place for every reader.
    nbytes = 2 << 20
    keys, pages, metas = make_pages(1, nbytes, split=nbytes // 2)
    url = fresh_url(mooncake_url)
    async with MooncakeStorage.from_url(url) as writer:
        await writer.put(keys, pages, metas)
        stored = await writer.read_raw(keys[0])
        assert stored is not None
        await writer.write_raw(keys[0], stored[:-1] + bytes([stored[-1] ^ 0xFF]))
        reader_url = url.replace("buffer_size=16MiB", "buffer_size=1MiB")
        async with MooncakeStorage.from_url(reader_url) as reader:
            into = buffers(1, nbytes, split=nbytes // 2)
            assert await reader.get(keys, into, namespace=NS) == [Outcome.CORRUPT]
            assert reader.stats().corrupt == 1
            assert await reader.exists(keys) == 0


@pytest.mark.parametrize("stored_as", ["cut", "lengthened", "another layout"])
async def test_a_page_of_another_length_larger_than_the_local_buffer_is_judged(
    mooncake_url: str, stored_as: str
) -> None:
    # Judging a page stored at another length read it whole through Mooncake's local buffer,
    # which gives nothing for a larger object: a damaged one stayed a miss for ever.
    nbytes = 2 << 20
    keys, pages, metas = make_pages(1, nbytes, split=nbytes // 2)
    url = fresh_url(mooncake_url)
    async with MooncakeStorage.from_url(url) as writer:
        if stored_as == "another layout":
            # Sound, for readers of pages a MiB longer: left in place.
            _, longer, _ = make_pages(1, nbytes + (1 << 20), split=nbytes // 2)
            await writer.put(keys, longer, metas)
        else:
            await writer.put(keys, pages, metas)
            stored = await writer.read_raw(keys[0])
            assert stored is not None
            damaged = stored[:-4096] if stored_as == "cut" else stored + bytes(4096)
            await writer.write_raw(keys[0], damaged)
        before = await writer.read_raw(keys[0])
        reader_url = url.replace("buffer_size=16MiB", "buffer_size=1MiB")
        async with MooncakeStorage.from_url(reader_url) as reader:
            into = buffers(1, nbytes, split=nbytes // 2)
            outcomes = await reader.get(keys, into, namespace=NS)
            if stored_as == "another layout":
                assert outcomes == [Outcome.MISS]
                assert reader.stats().corrupt == 0
                assert await writer.read_raw(keys[0]) == before
            else:
                assert outcomes == [Outcome.CORRUPT]
                assert reader.stats().corrupt == 1
                assert await reader.exists(keys) == 0


class _BeingPut(_Client):
    """The Mooncake client, except that removing `name` finds another client still putting
    it (OBJECT_NOT_READY, -703)."""

    def __init__(self, inner: Any, name: str) -> None:
        super().__init__(inner)
        self.name = name

    def batch_remove(self, names: list[str], force: bool) -> Any:
        codes = list(self.inner.batch_remove(names, force=force))
        return [-703 if n == self.name else c for n, c in zip(names, codes, strict=True)]


async def test_deleting_a_key_another_client_is_putting_is_no_failure(
    backend: MooncakeStorage,
) -> None:
    keys, pages, metas = make_pages(2)
    await backend.put(keys, pages, metas)
    client = _BeingPut(backend._store, backend._mkey(keys[1]))
    backend._store = client
    try:
        assert await backend.delete(keys) == 1
    finally:
        backend._store = client.inner
    assert backend.stats().errors == 0


async def test_cancelled_get_counts_the_damaged_pages_it_removed(
    backend: MooncakeStorage,
) -> None:
    keys, pages, metas = make_pages(3)
    await backend.put(keys, pages, metas)
    raw = await backend.read_raw(keys[0])
    assert raw is not None
    await backend.write_raw(keys[0], raw[:-10])
    client = _CancelInside(backend._store, "batch_get_into_multi_buffers")
    backend._store = client
    try:
        client.task = task = asyncio.ensure_future(backend.get(keys, buffers(3), namespace=NS))
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        backend._store = client.inner
    assert len(client.calls) == 1
    assert await backend.read_raw(keys[0]) is None  # removed by the job after the cancel
    stats = backend.stats()
    assert (stats.pages, stats.bytes, stats.corrupt) == (2, 2 * (HEADER_NBYTES + 3000), 1)


async def test_a_damaged_page_got_twice_in_one_batch_is_counted_once(
    backend: MooncakeStorage,
) -> None:
    keys, pages, metas = make_pages(2)
    await backend.put(keys, pages, metas)
    raw = await backend.read_raw(keys[0])
    assert raw is not None
    await backend.write_raw(keys[0], raw[:-10])
    outcomes = await backend.get([keys[0], keys[1], keys[0]], buffers(3), namespace=NS)
    assert outcomes == [Outcome.CORRUPT, Outcome.OK, Outcome.CORRUPT]
    stats = backend.stats()
    assert (stats.pages, stats.bytes) == (1, HEADER_NBYTES + 3000)
    assert stats.corrupt == 2  # found twice, removed once


async def test_a_key_got_twice_in_one_batch_fills_both_buffers_with_its_page(
    mooncake_url: str,
) -> None:
    # Mooncake's batch read fills only the last buffer of an object named twice and reports
    # both read: the first kept its staging slot's old bytes, an earlier read's page of the
    # same key, which checked as sound.
    prefix = f"t{uuid.uuid4().hex}"
    reader_url = fresh_url(mooncake_url, prefix=prefix, direct_reads="false")
    writer_url = fresh_url(mooncake_url, prefix=prefix)
    async with (
        MooncakeStorage.from_url(reader_url) as reader,
        MooncakeStorage.from_url(writer_url) as writer,
    ):
        (key,), (old,), metas = make_pages(1)
        _, (new,), _ = make_pages(1)
        assert await reader.put([key], [old], metas) == [Outcome.OK]
        assert await reader.get([key], buffers(1), namespace=NS) == [Outcome.OK]
        assert await reader.delete([key]) == 1
        assert await writer.put([key], [new], metas) == [Outcome.OK]
        into = buffers(3) + buffers(1, 2000, split=500)
        before = reader.stats()
        outcomes = await reader.get([key, key, key, key], into, namespace=NS)
        after = reader.stats()
    pages = {joined(old): "the deleted page", joined(new): "the page"}
    read = [
        (o, pages.get(joined(p), "other bytes"))
        for o, p in zip(outcomes[:3], into[:3], strict=True)
    ]
    assert read == [(Outcome.OK, "the page")] * 3
    assert outcomes[3] is Outcome.MISS  # stored at another length
    assert (after.gets - before.gets, after.get_hits - before.get_hits) == (4, 3)


class _MeetingRemoves(_Client):
    """The Mooncake client, except that `batch_remove` waits until `parties` jobs call it."""

    def __init__(self, inner: Any, parties: int) -> None:
        super().__init__(inner)
        self.barrier = threading.Barrier(parties, timeout=10)
        self.codes: list[list[int]] = []

    def batch_remove(self, names: list[str], force: bool = False) -> list[int]:
        self.barrier.wait()
        codes = [int(c) for c in self.inner.batch_remove(names, force=force)]
        self.codes.append(codes)
        return codes


async def test_concurrent_gets_of_a_damaged_page_count_its_removal_once(
    backend: MooncakeStorage,
) -> None:
    keys, pages, metas = make_pages(2)
    await backend.put(keys, pages, metas)
    raw = await backend.read_raw(keys[0])
    assert raw is not None
    await backend.write_raw(keys[0], raw[:-10])
    client = _MeetingRemoves(backend._store, 2)
    backend._store = client
    try:
        # Both read the damaged page before either removes it.
        got = await asyncio.gather(
            backend.get(keys[:1], buffers(1), namespace=NS),
            backend.get(keys[:1], buffers(1), namespace=NS),
        )
    finally:
        backend._store = client.inner
    assert got == [[Outcome.CORRUPT], [Outcome.CORRUPT]]
    assert sorted(client.codes) == [[_NOT_FOUND], [0]]
    stats = backend.stats()
    assert (stats.pages, stats.bytes) == (1, HEADER_NBYTES + 3000)
    assert await backend.exists(keys[1:]) == 1


async def test_several_wrong_lengths_in_one_batch(backend: MooncakeStorage) -> None:
    keys, pages, metas = make_pages(3)
    await backend.put(keys, pages, metas)
    for key, change in ((keys[0], lambda v: v[:-10]), (keys[2], lambda v: v + b"extra")):
        raw = await backend.read_raw(key)
        assert raw is not None
        await backend.write_raw(key, change(raw))
    outcomes = await backend.get(keys, buffers(3), namespace=NS)
    assert outcomes == [Outcome.CORRUPT, Outcome.OK, Outcome.CORRUPT]
    assert await backend.read_raw(keys[0]) is None
    assert await backend.read_raw(keys[2]) is None
    assert backend.stats().corrupt == 2


async def test_other_namespace_is_a_miss_left_in_place(backend: MooncakeStorage) -> None:
    keys, pages, metas = make_pages(1)
    await backend.put(keys, pages, metas)
    assert await backend.get(keys, buffers(1), namespace=OTHER_NS) == [Outcome.MISS]
    assert await backend.exists(keys) == 1  # another deployment's page is not ours to delete
    assert await backend.get(keys, buffers(1), namespace=NS) == [Outcome.OK]


async def test_mac_key_is_required_and_checked(mooncake_url: str) -> None:
    url = fresh_url(mooncake_url)
    keys, pages, metas = make_pages(2)
    # One backend at a time: each takes over the pooled client (and its pages) of the last.
    async with MooncakeStorage.from_url(url, mac_key=b"k" * 32) as writer:
        await writer.put(keys[:1], pages[:1], metas[:1])
    async with MooncakeStorage.from_url(url) as plain:
        await plain.put(keys[1:], pages[1:], metas[1:])
        # An unkeyed reader checks the checksum and accepts the MACed page.
        assert await plain.get(keys[:1], buffers(1), namespace=NS) == [Outcome.OK]
    async with MooncakeStorage.from_url(url, mac_key=b"k" * 32) as reader:
        into = buffers(1)
        assert await reader.get(keys[:1], into, namespace=NS) == [Outcome.OK]
        assert joined(into[0]) == joined(pages[0])
        # An unkeyed writer's page is not trusted by a keyed reader.
        assert await reader.get(keys[1:], buffers(1), namespace=NS) == [Outcome.CORRUPT]
    async with MooncakeStorage.from_url(url, mac_key=b"x" * 32) as stranger:
        assert await stranger.get(keys[:1], buffers(1), namespace=NS) == [Outcome.CORRUPT]


async def test_cancelled_get_writes_nothing_afterwards(backend: MooncakeStorage) -> None:
    keys, pages, metas = make_pages(16, 1 << 20, split=1 << 19)
    await backend.put(keys, pages, metas)
    into = buffers(16, 1 << 20, split=1 << 19)
    task = asyncio.ensure_future(backend.get(keys, into, namespace=NS))
    await asyncio.sleep(0.005)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    snapshot = [joined(b) for b in into]
    await asyncio.sleep(0.2)
    assert [joined(b) for b in into] == snapshot
    again = buffers(16, 1 << 20, split=1 << 19)
    assert await backend.get(keys, again, namespace=NS) == [Outcome.OK] * 16


async def test_master_loss_gives_errors_not_hangs() -> None:
    with MooncakeMaster() as master:
        # The client that sees its master die lends no memory (segment_size=0): a client
        # with a segment spends seconds at exit trying to unmount it from a dead master.
        async with MooncakeStorage.from_url(fresh_url(master.url)) as holder:
            url = fresh_url(master.url, prefix=holder.prefix, segment_size=0)
            async with MooncakeStorage.from_url(url) as backend:
                keys, pages, metas = make_pages(3)
                assert await backend.put(keys[:1], pages[:1], metas[:1]) == [Outcome.OK]
                await holder.close()
                assert close_idle_clients(master.address) == 1  # unmounted while it answers
                master.kill()
                # Each call waits for Mooncake's reconnect timeout (~4 s): run them at once.
                got, put, exists = await asyncio.gather(
                    backend.get(keys, buffers(3), namespace=NS),
                    backend.put(keys[1:], pages[1:], metas[1:]),
                    backend.exists(keys),
                    return_exceptions=True,
                )
                assert got == [Outcome.ERROR] * 3
                assert put == [Outcome.ERROR] * 2
                assert isinstance(exists, StorageError)
                assert backend.stats().errors >= 6


_FORK_AFTER_CLOSE = """
import asyncio, atexit, os, sys
from hicache_async.storage._mooncake import MooncakeStorage, close_idle_clients

async def use():
    async with MooncakeStorage.from_url(sys.argv[1]):
        pass  # closed: its client waits in the idle pool

asyncio.run(use())
pid = os.fork()
if pid == 0:
    # The exit handlers a normal exit runs. The child then skips the C library's, as
    # multiprocessing's children do: Mooncake's own tears down every client of the process.
    atexit._run_exitfuncs()
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
close_idle_clients()
"""


async def test_a_forked_child_closes_none_of_the_parents_idle_clients(mooncake_url: str) -> None:
    # The idle clients are the parent's: closing one in the child, whose process has none of
    # their threads, crashed it (SIGSEGV) at exit.
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FORK_AFTER_CLOSE, fresh_url(mooncake_url),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(child.communicate(), 120)
    assert child.returncode == 0
    assert out.decode().split() == ["0"]


async def test_unreachable_master_fails_to_open() -> None:
    url = f"mooncake://127.0.0.1:{free_port()}?protocol=tcp"
    with pytest.raises(StorageError, match="cannot reach"):
        async with MooncakeStorage.from_url(fresh_url(url)):
            pass


@pytest.mark.parametrize(
    ("params", "match"),
    [
        # Mooncake aborts the process on a metadata scheme it has no plugin for.
        ({"metadata": "foo://127.0.0.1:1"}, "accepted: P2PHANDSHAKE, http://host:port"),
        ({"metadata": "redis://127.0.0.1:1"}, "accepted: P2PHANDSHAKE, http://host:port"),
        ({"metadata": "HTTP://127.0.0.1:1/metadata"}, "accepted: P2PHANDSHAKE, http://host"),
        ({"metadata": "http:///metadata"}, "metadata 'http:///metadata' is not usable"),
        ({"metadata": "etcd://127.0.0.1:99999"}, "metadata 'etcd://127.0.0.1:99999'"),
        ({"admin": "http://"}, "admin must be an http://host:port URL"),
        ({"device": "mlx5_0"}, "needs protocol=rdma"),
        ({"replicas": "x"}, "replicas='x' must be an integer >= 1: replicas per page"),
        ({"threads": "0"}, "threads='0' must be an integer >= 1: worker threads"),
        # Mooncake mounts no segment below 16 MiB: its setup() failed with a bare -600.
        ({"segment_size": "8MiB"}, "segment_size must be 0 or >= 16777216 (16MiB"),
        ({"segment_size": "1"}, "segment_size must be 0 or >= 16777216 (16MiB"),
        # The manifest's puts are copied through this buffer: with less, none fits.
        ({"buffer_size": "64KiB"}, "buffer_size must be >= 1048576, got 65536"),
    ],
)
def test_bad_parameters_are_refused_before_mooncake_sees_them(
    params: dict[str, str], match: str
) -> None:
    url = f"mooncake://127.0.0.1:{free_port()}?protocol=tcp"
    with pytest.raises(StorageConfigError, match=re.escape(match)):
        MooncakeStorage.from_url(fresh_url(url, **params))


@pytest.mark.parametrize(
    "url",
    [
        "mooncake://user:secret@127.0.0.1:50051",
        "mooncake://127.0.0.1:50051/0",
        "mooncake://127.0.0.1:50051#x",
    ],
)
def test_url_parts_mooncake_has_no_use_for_are_refused(url: str) -> None:
    with pytest.raises(StorageConfigError, match="no user, password, path or fragment") as info:
        MooncakeStorage.from_url(url)
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    "metadata",
    [
        "http://127.0.0.1:1/metadata?x=1",
        "http://127.0.0.1:1/metadata?",
        "http://u:pw-42x@127.0.0.1:1/metadata?password=pw-43y",
    ],
)
def test_a_metadata_url_with_a_query_string_is_refused_naming_it(metadata: str) -> None:
    # Mooncake appends `?key=...` as written: the probe refused such a URL on open as "no
    # Mooncake metadata server", which sent a user looking at the server.
    with pytest.raises(StorageConfigError, match="must not carry a query string") as info:
        MooncakeStorage(f"127.0.0.1:{free_port()}", metadata=metadata)
    said = str(info.value)
    assert "127.0.0.1:1/metadata?" in said, said
    assert "pw-42x" not in said, said
    assert "pw-43y" not in said, said


@pytest.mark.parametrize(
    "metadata",
    [
        "htp://u:pw-44z@127.0.0.1:1/metadata",  # an unknown scheme
        "http://u:pw-44z@127.0.0.1:notaport/metadata",  # a port that is no number
        "http://u:pw-44z@/metadata",  # no host
    ],
)
def test_a_metadata_url_refused_does_not_show_its_password(metadata: str) -> None:
    with pytest.raises(StorageConfigError, match="mooncake metadata") as info:
        MooncakeStorage(f"127.0.0.1:{free_port()}", metadata=metadata)
    assert "pw-44z" not in str(info.value), str(info.value)


@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_a_missing_client_library_off_linux_says_it_is_published_for_linux_only(
    monkeypatch: pytest.MonkeyPatch, platform: str
) -> None:
    # The `mooncake` extra installs nothing off Linux: naming it sent users to an install
    # that could not help.
    names = [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]
    for name in names or ["mooncake"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(sys, "platform", platform)
    with pytest.raises(StorageConfigError) as info:
        MooncakeStorage.from_url("mooncake://127.0.0.1:1")
    with pytest.raises(StorageError) as opened:
        mooncake_module.client_library()
    for said in (str(info.value), str(opened.value)):
        assert "published for Linux only" in said, said
        assert repr(platform) in said, said
        assert "pip install" not in said, said


async def test_unreachable_metadata_server_fails_to_open_at_once(
    mooncake_master: MooncakeMaster,
) -> None:
    # An etcd client retries an unreachable server for minutes, in a thread no cancel stops.
    port = free_port()
    url = f"mooncake://{mooncake_master.address}?protocol=tcp&metadata=etcd://127.0.0.1:{port}"
    storage = MooncakeStorage.from_url(fresh_url(url))
    reason = f"cannot reach the Mooncake metadata server at 127.0.0.1:{port}"
    with pytest.raises(StorageError, match=reason):
        async with storage:
            pytest.fail("opened without its metadata server")


async def test_a_metadata_url_of_another_http_server_fails_to_open_naming_it(
    mooncake_master: MooncakeMaster, tmp_path: Any
) -> None:
    # Any HTTP server answered the probe's request: one that is not Mooncake's metadata
    # server passed it, and Mooncake's setup() failed seconds later with a bare -1.
    seen: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            super().do_GET()

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        storage = MooncakeStorage(
            mooncake_master.address,
            metadata=f"http://hicache:pw-42x@127.0.0.1:{port}/metadata",
            segment_size=64 << 20,
            buffer_size=16 << 20,
            staging_size=8 << 20,
        )
        with pytest.raises(StorageError) as info:
            async with storage:
                pytest.fail("opened with a metadata server that is not Mooncake's")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    said = str(info.value)
    assert f"127.0.0.1:{port}/metadata is no Mooncake metadata server" in said, said
    assert "'HTTP/1.0 404 File not found'" in said, said
    assert "pw-42x" not in said
    # Asked as Mooncake's curl asks, with the URL's user information.
    assert seen == ["Basic aGljYWNoZTpwdy00Mng="]


async def test_a_metadata_server_that_closes_without_an_answer_fails_to_open(
    mooncake_master: MooncakeMaster,
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:  # the probe's one connection
        with contextlib.suppress(OSError):  # the listener was closed
            accepted, _ = listener.accept()
            with accepted:
                accepted.recv(1 << 16)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        storage = MooncakeStorage.from_url(
            fresh_url(
                f"mooncake://{mooncake_master.address}?protocol=tcp"
                f"&metadata=http://127.0.0.1:{port}/metadata"
            )
        )
        with pytest.raises(StorageError, match="a GET of an absent key got no answer"):
            async with storage:
                pytest.fail("opened with a metadata server that answers nothing")
    finally:
        listener.close()
        thread.join(10)


def test_a_metadata_server_that_requires_mooncakes_token_passes_the_probe(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mooncake's Python metadata server of later releases answers 401 to a request without the
    # token MC_METADATA_HTTP_TOKEN holds, which Mooncake's client sends: a probe without it
    # refused a working setup. The installed server with that release's check of the token.
    from aiohttp import web
    from mooncake.http_metadata_server import KVBootstrapServer

    from hicache_async.storage._mooncake_watch import reachable

    token = "tok-" + os.urandom(6).hex()
    seen: list[str] = []

    class TokenServer(KVBootstrapServer):  # type: ignore[misc]
        async def _handle_metadata(self, request: web.Request) -> web.Response:
            seen.append(request.headers.get("Authorization", ""))
            if request.headers.get("Authorization") != f"Bearer {token}":
                return web.Response(text="unauthorized", status=401)
            answer: web.Response = await super()._handle_metadata(request)
            return answer

    port = free_port()
    server = TokenServer(port, host="127.0.0.1")
    server.run()
    try:
        metadata = f"http://hicache:pw-42x@127.0.0.1:{port}/metadata"
        deadline = time.monotonic() + 10
        while not reachable(("127.0.0.1", port), 1.0):
            assert time.monotonic() < deadline, "the metadata server did not start"
            time.sleep(0.05)
        monkeypatch.delenv("MC_METADATA_HTTP_TOKEN", raising=False)
        refused = mooncake_module._silent_server(mooncake_master.address, metadata)
        assert refused is not None
        assert "'HTTP/1.1 401 Unauthorized'" in refused, refused
        assert "MC_METADATA_HTTP_TOKEN names none" in refused, refused
        monkeypatch.setenv("MC_METADATA_HTTP_TOKEN", token)
        assert mooncake_module._silent_server(mooncake_master.address, metadata) is None
        # As Mooncake's client: the token in place of the URL's user information.
        assert seen == ["Basic aGljYWNoZTpwdy00Mng=", f"Bearer {token}"]
        monkeypatch.setenv("MC_METADATA_HTTP_TOKEN", "wrong")
        refused = mooncake_module._silent_server(mooncake_master.address, metadata)
        assert refused is not None
        assert "MC_METADATA_HTTP_TOKEN does not hold the token" in refused, refused
    finally:
        server.close()


def test_a_name_whose_first_address_never_connects_passes_the_probes(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A name resolving first to an address that never connects (a full backlog drops the SYN,
    # as a firewall does) spent the probe's whole timeout on it: the master and metadata
    # server found at the next address, answering at once, were refused as silent. The name
    # is resolved here: one that resolves so cannot be made without changing the host. The
    # master's own metadata server listens on every address: Mooncake's Python one is used.
    from mooncake.http_metadata_server import KVBootstrapServer

    from hicache_async.storage._mooncake_watch import reachable

    metadata = KVBootstrapServer(free_port(), host="127.0.0.1")
    metadata.run()
    deadline = time.monotonic() + 10
    while not reachable(("127.0.0.1", metadata.port), 1.0):
        assert time.monotonic() < deadline, "the metadata server did not start"
        time.sleep(0.05)
    ports = (mooncake_master.rpc_port, metadata.port)
    dead: list[socket.socket] = []
    for port in ports:
        listener = socket.socket()
        listener.bind(("127.0.0.2", port))
        listener.listen(0)
        dead += [listener, socket.create_connection(("127.0.0.2", port), timeout=5)]
    resolve = socket.getaddrinfo

    def resolved(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "mooncake.test":
            return resolve(host, port, *args, **kwargs)
        stream = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "")
        return [(*stream, ("127.0.0.2", int(port))), (*stream, ("127.0.0.1", int(port)))]

    monkeypatch.setattr(socket, "getaddrinfo", resolved)
    monkeypatch.setattr(mooncake_module, "_PROBE_TIMEOUT_S", 0.5)
    try:
        silent = mooncake_module._silent_server(
            f"mooncake.test:{ports[0]}", f"http://mooncake.test:{ports[1]}/metadata"
        )
        assert silent is None
    finally:
        for sock in dead:
            sock.close()
        metadata.close()


def test_a_chunked_metadata_answer_on_a_kept_connection_passes_the_probe(
    mooncake_master: MooncakeMaster,
) -> None:
    # A chunked answer was read as it came, chunk sizes and all, and never counted as whole:
    # text split over chunks (as a proxy may send it) was refused, and a server keeping the
    # connection open held the probe to its deadline.
    from hicache_async.storage import _mooncake_watch as watch_module

    answer = (
        b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"b\r\nmetadata no\r\n7\r\nt found\r\n0\r\n\r\n"
    )
    assert watch_module._whole(answer)
    listener = socket.create_server(("127.0.0.1", 0))
    closed: list[bytes] = []

    def serve() -> None:  # the probe's one connection, kept open after the answer
        with contextlib.suppress(OSError):  # the listener was closed
            accepted, _ = listener.accept()
            with accepted:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += accepted.recv(1 << 16)
                for n in range(0, len(answer), 7):
                    accepted.sendall(answer[n : n + 7])
                closed.append(accepted.recv(1))  # b"" once the probe closes its end

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        metadata = f"http://127.0.0.1:{port}/metadata"
        assert mooncake_module._silent_server(mooncake_master.address, metadata) is None
    finally:
        listener.close()
        thread.join(10)
    assert closed == [b""]


_FORWARD_PROXY = """
import http.server, socket, sys, urllib.parse

class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def forward(self):
        url = urllib.parse.urlsplit(self.path)
        host = "127.0.0.1" if url.hostname == "metadata.test" else url.hostname
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        target = url.path + ("?" + url.query if url.query else "")
        head = f"{self.command} {target} HTTP/1.1\\r\\nHost: {url.netloc}\\r\\n"
        head += f"Content-Length: {len(body)}\\r\\nConnection: close\\r\\n\\r\\n"
        with socket.create_connection((host, url.port), timeout=10) as upstream:
            upstream.sendall(head.encode() + body)
            while piece := upstream.recv(1 << 16):
                self.wfile.write(piece)
        self.close_connection = True

    do_GET = do_PUT = do_DELETE = forward

    def log_message(self, *args):
        return None

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


async def test_a_metadata_server_reached_through_the_http_proxy_opens(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mooncake's curl asks the metadata server through the proxy http_proxy names; the probe
    # connected directly, and refused as unreachable a server only the proxy reaches (here a
    # name only the proxy resolves). The proxy runs apart: setup() holds this one's GIL.
    proxy = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FORWARD_PROXY, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proxy.stdout is not None
        port = int(await proxy.stdout.readline())
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        storage = MooncakeStorage(
            mooncake_master.address,
            metadata=f"http://metadata.test:{mooncake_master.http_port}/metadata",
            protocol="tcp",
            local_hostname="127.0.0.1",
            segment_size=64 << 20,
            buffer_size=16 << 20,
            staging_size=8 << 20,
        )
        async with storage:
            keys, pages, metas = make_pages(1)
            assert await storage.put(keys, pages, metas) == [Outcome.OK]
    finally:
        proxy.kill()
        await proxy.wait()


def test_an_https_metadata_server_reached_through_the_proxy_is_not_refused(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As for http://: curl asks an https:// metadata server through the proxy of https_proxy
    # (or HTTPS_PROXY), so one the probe cannot connect to directly is left to setup(),
    # unless no_proxy names it.
    for name in ("http_proxy", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    metadata = f"https://metadata.test:{free_port()}/metadata"
    refused = mooncake_module._silent_server(mooncake_master.address, metadata)
    assert refused is not None
    assert "cannot reach the Mooncake metadata server" in refused
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")  # not for https
    assert mooncake_module._silent_server(mooncake_master.address, metadata) == refused
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{free_port()}")
    assert mooncake_module._silent_server(mooncake_master.address, metadata) is None
    monkeypatch.setenv("no_proxy", "localhost,.test")
    assert mooncake_module._silent_server(mooncake_master.address, metadata) == refused


def _link_local() -> tuple[str, str] | None:
    """A link-local IPv6 address of this host and its interface's name, if it has one."""
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as table:
        for line in table:
            fields = line.split()
            if len(fields) == 6 and fields[0].startswith("fe80"):
                address = ":".join(fields[0][n : n + 4] for n in range(0, 32, 4))
                return str(ipaddress.IPv6Address(address)), fields[5]
    return None


def test_a_link_local_metadata_server_named_with_its_zone_passes_the_probe(
    mooncake_master: MooncakeMaster,
) -> None:
    # The zone of a link-local address is escaped in a URL (`%25`), as curl reads it: the
    # probe handed the escaped form to the resolver, and refused as unreachable a server
    # Mooncake's setup() reaches.
    from mooncake.http_metadata_server import KVBootstrapServer

    from hicache_async.storage._mooncake_watch import reachable

    found = _link_local()
    if found is None:
        pytest.skip("no link-local IPv6 address here")
    address, interface = found
    port = free_port()
    server = KVBootstrapServer(port, host=f"{address}%{interface}")
    server.run()
    try:
        deadline = time.monotonic() + 10
        while not reachable((f"{address}%{interface}", port), 1.0):
            if time.monotonic() > deadline:
                pytest.skip("no server can listen on the link-local address here")
            time.sleep(0.05)
        metadata = f"http://[{address}%25{interface}]:{port}/metadata"
        assert mooncake_module._silent_server(mooncake_master.address, metadata) is None
    finally:
        server.close()


async def test_a_staging_arena_that_cannot_be_allocated_is_a_storage_error(
    mooncake_url: str,
) -> None:
    # More than any x86-64 or arm64 process can map, whatever the overcommit policy.
    storage = MooncakeStorage.from_url(fresh_url(mooncake_url, staging_size=str(1 << 50)))
    with pytest.raises(StorageError, match="staging_size=1125899906842624"):
        async with storage:
            pytest.fail("opened with a petabyte arena")


async def test_page_larger_than_staging_is_an_error_alone(mooncake_url: str) -> None:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, staging_size="1MiB")) as backend:
        keys, pages, metas = make_pages(1)
        big_keys, big_pages, big_metas = make_pages(1, 2 << 20, split=1 << 20)
        outcomes = await backend.put([*keys, *big_keys], [*pages, *big_pages], [*metas, *big_metas])
        assert outcomes == [Outcome.OK, Outcome.ERROR]


async def test_pages_larger_than_staging_are_logged_once_not_per_batch(mooncake_url: str) -> None:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, staging_size="1MiB")) as backend:
        with structlog.testing.capture_logs() as logs:
            for _ in range(6):
                big = make_pages(1, 2 << 20, split=1 << 20)
                assert await backend.put(*big) == [Outcome.ERROR]
        assert backend.stats().errors == 6
    events = [e for e in logs if e["event"] == "storage.mooncake.page_exceeds_staging"]
    # Once, or twice where the run took longer than the log's interval.
    assert 1 <= len(events) <= 2, len(events)


async def test_misuse_raises_before_io(backend: MooncakeStorage) -> None:
    keys, pages, metas = make_pages(2)
    with pytest.raises(ValueError, match="buffers"):
        await backend.get(keys, buffers(1), namespace=NS)
    with pytest.raises(ValueError, match="metas"):
        await backend.put(keys, pages, metas[:1])
    with pytest.raises(ValueError, match=r"meta\.key"):
        await backend.put(keys, pages, list(reversed(metas)))
    assert await backend.exists(keys) == 0
    assert backend.stats().puts == 0


async def test_closed_backend_raises(mooncake_url: str) -> None:
    backend = MooncakeStorage.from_url(fresh_url(mooncake_url))
    keys, pages, metas = make_pages(1)
    with pytest.raises(StorageError, match="not open"):
        await backend.exists(keys)
    async with backend:
        await backend.put(keys, pages, metas)
        assert await backend.delete(keys) == 1
        assert await backend.delete(keys) == 0
    await backend.close()
    for call in (
        backend.exists(keys),
        backend.get(keys, buffers(1), namespace=NS),
        backend.put(keys, pages, metas),
        backend.delete(keys),
        backend.read_raw(keys[0]),
    ):
        with pytest.raises(StorageError, match="closed"):
            await call


async def test_list_verify_and_gc(mooncake_url: str) -> None:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, capacity=7000)) as backend:
        keys, pages, metas = make_pages(4)
        await backend.put(keys, pages, metas)
        listed = await backend.list_pages()
        assert sorted(p.key for p in listed) == sorted(keys)
        assert {p.nbytes for p in listed} == {HEADER_NBYTES + 3000}
        assert sorted(p.priority for p in listed) == [0, 1, 2, 3]
        raw = await backend.read_raw(keys[1])
        assert raw is not None
        await backend.write_raw(keys[1], raw[:-1] + bytes([raw[-1] ^ 1]))
        report = await backend.verify()
        assert (report.checked, report.ok, report.corrupt_removed) == (4, 3, 1)
        gc = await backend.gc()
        assert (gc.evicted_pages, gc.freed_bytes) == (1, HEADER_NBYTES + 3000)
        assert len(await backend.list_pages()) == 2


class _FailingReads(_Client):
    """The Mooncake client, except that the first `batch_get_into` fails every transfer
    (TRANSFER_FAIL, as when a peer's segment does not answer); the objects are intact."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.failed = False

    def batch_get_into(self, names: list[str], addresses: list[int], sizes: list[int]) -> Any:
        if self.failed:
            return self.inner.batch_get_into(names, addresses, sizes)
        self.failed = True
        return [-800] * len(names)


async def test_verify_leaves_pages_it_could_not_read(mooncake_url: str) -> None:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url)) as backend:
        keys, pages, metas = make_pages(3)
        await backend.put(keys, pages, metas)
        raw = await backend.read_raw(keys[2])
        assert raw is not None
        await backend.write_raw(keys[2], raw[:-10])  # header intact, 10 bytes short
        client = _FailingReads(backend._store)
        backend._store = client
        try:
            report = await backend.verify()
        finally:
            backend._store = client.inner
        assert client.failed
        # Nothing was read: nothing is judged, nothing removed, and the report says so.
        assert (report.checked, report.corrupt_removed, report.unchecked) == (0, 0, 3)
        stats = backend.stats()
        assert (stats.errors, stats.corrupt) == (3, 0)
        assert await backend.exists(keys) == 3
        raw = await backend.read_raw(keys[1])
        assert raw is not None
        await backend.write_raw(keys[1], raw + b"extra")
        report = await backend.verify()
        assert (report.checked, report.ok, report.corrupt_removed, report.unchecked) == (3, 1, 2, 0)
        assert await backend.exists(keys[:1]) == 1
        assert await backend.exists(keys[1:2]) == 0
        assert await backend.exists(keys[2:]) == 0


async def test_objects_not_named_as_pages_are_left_out_of_maintenance(mooncake_url: str) -> None:
    url = fresh_url(mooncake_url, capacity=HEADER_NBYTES + 3000)
    async with MooncakeStorage.from_url(url) as backend:
        keys, pages, metas = make_pages(1)
        await backend.put(keys, pages, metas)
        prefix = backend._mkey(keys[0]).rsplit(":", 1)[0]
        strangers = [f"{prefix}:abcd", f"{prefix}:{keys[0].hex().upper()}", f"{prefix}:{'g' * 64}"]
        for name in strangers:
            assert backend._store.upsert(name, b"x" * 5000) == 0
        assert [p.key for p in await backend.list_pages()] == keys
        report = await backend.verify()
        assert (report.checked, report.ok, report.corrupt_removed) == (1, 1, 0)
        gc = await backend.gc()
        assert gc.evicted_pages == 0
        assert await backend.exists(keys) == 1
        assert all(backend._store.get_size(name) == 5000 for name in strangers)


async def test_a_listing_of_pages_removed_since_logs_nothing_per_page(
    backend: MooncakeStorage, capfd: pytest.CaptureFixture[str]
) -> None:
    # The sizes were asked of every listed name: one removed between the master's key list and
    # the size lookup made Mooncake log an error line, for each such page.
    keys, pages, metas = make_pages(2)
    await backend.put(keys, pages, metas)
    listed = await backend._list_names()
    removed = [backend._mkey(os.urandom(32)) for _ in range(64)]

    async def names() -> list[str]:
        return [*listed, *removed]

    backend._list_names = names  # type: ignore[method-assign]
    capfd.readouterr()
    found = await backend.list_pages()
    assert sorted(p.key for p in found) == sorted(keys)
    assert {p.nbytes for p in found} == {HEADER_NBYTES + 3000}
    assert _mooncake_errors(capfd.readouterr().err) == []


async def test_pages_with_unreadable_headers_are_listed_by_size(mooncake_url: str) -> None:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url)) as backend:
        keys, pages, metas = make_pages(3)
        await backend.put(keys, pages, metas)
        raw = await backend.read_raw(keys[0])
        assert raw is not None
        await backend.write_raw(keys[0], raw[:10] + bytes([raw[10] ^ 1]) + raw[11:])
        await backend.write_raw(keys[1], b"short")
        listed = {p.key: p for p in await backend.list_pages()}
        assert set(listed) == set(keys)
        assert listed[keys[0]].nbytes == HEADER_NBYTES + 3000
        assert listed[keys[1]].nbytes == 5
        assert (listed[keys[2]].nbytes, listed[keys[2]].priority) == (HEADER_NBYTES + 3000, 2)
        report = await backend.verify()
        assert (report.checked, report.ok, report.corrupt_removed) == (3, 1, 2)
        assert [p.key for p in await backend.list_pages()] == [keys[2]]


async def test_listing_counts_stored_bytes_and_puts_unreadable_headers_first_for_gc(
    mooncake_url: str,
) -> None:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, capacity=7000)) as backend:
        keys, pages, metas = make_pages(4)
        for i in range(4):  # one at a time: each later page is newer
            await backend.put(keys[i : i + 1], pages[i : i + 1], metas[i : i + 1])
        raw = await backend.read_raw(keys[3])
        assert raw is not None
        await backend.write_raw(keys[3], raw[:-10])  # header intact, claims 10 bytes more
        raw = await backend.read_raw(keys[2])
        assert raw is not None
        await backend.write_raw(keys[2], raw[:10] + bytes([raw[10] ^ 1]) + raw[11:])
        raw = await backend.read_raw(keys[1])
        assert raw is not None
        newer = raw[:4] + struct.pack("<H", FORMAT_VERSION + 1) + raw[6:]
        await backend.write_raw(keys[1], newer)  # sound for a newer reader: not evicted first
        listed = {p.key: p for p in await backend.list_pages()}
        assert listed[keys[3]].nbytes == HEADER_NBYTES + 3000 - 10
        assert listed[keys[2]].last_access == 0.0  # damaged: no time to go by
        assert listed[keys[1]].last_access > listed[keys[0]].last_access
        # 7000 bytes hold two pages: the damaged one goes first, then the oldest.
        gc = await backend.gc()
        assert gc.evicted_pages == 2
        assert await backend.exists([keys[2]]) == 0
        assert await backend.exists([keys[0]]) == 0
        assert await backend.read_raw(keys[1]) == newer


async def test_a_page_stamped_far_ahead_lists_as_never_used_and_gc_evicts_it_first(
    mooncake_url: str,
) -> None:
    # Mooncake keeps no access times: a page lists by its header's creation, which its
    # writer's clock stamped. One stamped more than 300 s ahead would list newest and be the
    # last gc evicts until that time came; it lists as never used. One a little ahead lists
    # as now.
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, capacity=7000)) as backend:
        keys, pages, metas = make_pages(3)
        await backend.put(keys[2:], pages[2:], metas[2:])
        for key, page, meta, ahead_s in zip(keys, pages, metas, (86_400, 100), strict=False):
            header = encode_header(meta, page, created_ns=time.time_ns() + ahead_s * 10**9)
            await backend.write_raw(key, header + joined(page))
            raw = await backend.read_raw(key)
            assert raw is not None
            assert not isinstance(decode_header(raw), PageCheck)
        before = time.time()
        listed = {p.key: p for p in await backend.list_pages()}
        assert listed[keys[0]].last_access == 0.0
        assert before <= listed[keys[1]].last_access <= time.time()
        # 7000 bytes hold two pages: the one stamped far ahead goes.
        gc = await backend.gc()
        assert gc.evicted_pages == 1
        assert await backend.exists(keys[:1]) == 0
        assert await backend.exists(keys[1:2]) == 1
        assert await backend.exists(keys[2:]) == 1


async def test_a_manifest_listing_that_fails_masks_a_token_in_the_admin_url(
    mooncake_url: str,
) -> None:
    # The admin URL is quoted in the error: a credential-named parameter in it is masked.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    admin = quote(f"http://127.0.0.1:{port}/?token=s3cretpw", safe="")
    base = re.sub(r"&admin=[^&]*", "", mooncake_url)
    async with MooncakeStorage.from_url(fresh_url(base, admin=admin)) as backend:
        with pytest.raises(StorageError) as caught:
            await backend.manifest().read()
    assert "s3cretpw" not in str(caught.value)
    assert "token=***" in str(caught.value)


async def test_verify_counts_pages_too_large_to_stage_as_unchecked(mooncake_url: str) -> None:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, staging_size="1MiB")) as backend:
        keys, pages, metas = make_pages(2)
        await backend.put(keys, pages, metas)
        raw = await backend.read_raw(keys[1])
        assert raw is not None
        await backend.write_raw(keys[1], raw + bytes(2 << 20))  # damaged, and past the arena
        report = await backend.verify()
        assert (report.checked, report.ok, report.unchecked) == (1, 1, 1)
        assert await backend.exists(keys) == 2  # left as it is: it could not be read


def test_storage_command_checks_the_url_before_it_adjusts_it(
    mooncake_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = fresh_url(mooncake_url, placement="nearby")
    assert main(["storage", "stats", url]) == 2
    assert "placement" in capsys.readouterr().err


def test_storage_command_lends_the_cluster_no_memory(
    mooncake_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = fresh_url(mooncake_url, placement="local")  # a URL a serving instance would use
    opened = open_storage(mooncake_lending_nothing(url))
    assert isinstance(opened, MooncakeStorage)
    assert opened._segment_size == 0
    assert opened.name == MooncakeStorage.from_url(url).name
    assert main(["storage", "stats", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pages"] == 0


async def test_listing_needs_the_admin_url(mooncake_master: MooncakeMaster) -> None:
    url = (
        f"mooncake://127.0.0.1:{mooncake_master.rpc_port}?metadata={mooncake_master.metadata_url}"
        "&protocol=tcp&local_hostname=127.0.0.1"
    )
    async with MooncakeStorage.from_url(fresh_url(url)) as backend:
        with pytest.raises(StorageConfigError, match="admin"):
            await backend.list_pages()


class _KeyListServer:
    """Stands in for the master's admin port: `/health` answers 200, `/get_all_keys` with
    `junk` bytes of names of no page before the master's own answer, its last line left
    without a newline. With `hold`, it sets `held` once the junk is sent and goes on (with
    more junk first) only when `hold` is set."""

    def __init__(
        self, master: MooncakeMaster, junk: int, hold: threading.Event | None = None
    ) -> None:
        self.sent: list[int] = []
        self.held = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/get_all_keys":
                    self.send_response(200)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"OK")
                    return
                with urllib.request.urlopen(f"{master.admin_url}/get_all_keys") as real:
                    keys = real.read()
                self.send_response(200)
                self.end_headers()  # no length: the answer ends when the connection does
                line = b"other:" + b"x" * 1000 + b"\n"
                done = 0
                try:
                    # A line longer than any read, then names of other objects.
                    self.wfile.write(b" " * 300_000 + b"\n")
                    while done < junk:
                        self.wfile.write(line * 64)
                        done += len(line) * 64
                    if hold is not None:
                        self.wfile.flush()
                        owner.held.set()
                        hold.wait(60)
                        # More than a read takes: the read waiting here ends before the names.
                        self.wfile.write(line * 64)
                    self.wfile.write(keys.rstrip())
                except OSError:  # the listing stopped reading
                    owner.sent.append(done)
                    return
                owner.sent.append(done)

            def log_message(self, *args: object) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _KeyListServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


def _url_with_admin(master: MooncakeMaster, admin: str) -> str:
    return (
        f"mooncake://127.0.0.1:{master.rpc_port}?metadata={master.metadata_url}&admin={admin}"
        "&protocol=tcp&local_hostname=127.0.0.1"
    )


async def test_a_key_list_past_its_bound_fails_the_listing(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `/get_all_keys` names every object of the cluster; it was read whole, so a huge or
    # endless answer grew the process without bound.
    monkeypatch.setattr(mooncake_module, "_MAX_KEY_LIST_BYTES", 4 << 20, raising=False)
    monkeypatch.setattr(mooncake_module, "_KEY_LIST_READ_BYTES", 4096, raising=False)
    total = 64 << 20
    with _KeyListServer(mooncake_master, total) as admin:
        url = _url_with_admin(mooncake_master, admin.url)
        async with MooncakeStorage.from_url(fresh_url(url)) as backend:
            await backend.put(*make_pages(2))
            with pytest.raises(StorageError, match="more than 4 MiB of object names"):
                await backend.list_pages()
    assert len(admin.sent) == 1
    assert admin.sent[0] < total // 2  # what the socket buffers took, not the whole answer


async def test_a_key_list_is_read_a_piece_at_a_time(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Names cut across reads, a line longer than any read and the last line without a
    # newline are all told apart as when the answer was read whole.
    monkeypatch.setattr(mooncake_module, "_KEY_LIST_READ_BYTES", 777, raising=False)
    async with MooncakeStorage.from_url(fresh_url(mooncake_master.url)) as direct:
        keys, pages, metas = make_pages(5)
        await direct.put(keys, pages, metas)
        with _KeyListServer(mooncake_master, 100_000) as admin:
            url = _url_with_admin(mooncake_master, admin.url)
            async with MooncakeStorage.from_url(
                f"{url}&prefix={direct.prefix}&segment_size=0"
            ) as backend:
                listed = await backend.list_pages()
        assert sorted(p.key for p in listed) == sorted(keys)


async def _listing_blocked_in_read(backend: MooncakeStorage) -> None:
    """Until a thread runs a listing job of `backend` blocked in a socket read (not between
    reads)."""

    def blocked() -> bool:
        for frame in sys._current_frames().values():
            if frame.f_code.co_name not in ("readinto", "recv_into"):
                continue
            caller: Any = frame
            while caller is not None:
                code = caller.f_code
                if code.co_name == "job" and code.co_filename.endswith("_mooncake.py"):
                    return caller.f_locals.get("self") is backend
                caller = caller.f_back
        return False

    for _ in range(2000):
        if blocked():
            return
        await asyncio.sleep(0.005)
    pytest.fail("the listing never waited in a read")


async def test_a_key_list_stopped_by_a_close_fails_the_listing(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A close stops the read of `/get_all_keys` part way: the names read until then were
    # returned as the whole listing (none here), so `verify` or `gc` saw an empty store.
    # The read waiting for more of the answer ends at the close, not when more comes (the
    # socket's timeout is stretched past the test's bound).
    monkeypatch.setattr(mooncake_module, "_KEY_LIST_READ_BYTES", 4096, raising=False)
    monkeypatch.setattr(mooncake_module, "_ADMIN_TIMEOUT_S", 3600.0)
    hold = threading.Event()
    with _KeyListServer(mooncake_master, 100_000, hold) as admin:
        url = _url_with_admin(mooncake_master, admin.url)
        try:
            async with MooncakeStorage.from_url(fresh_url(url)) as backend:
                await backend.put(*make_pages(2))
                listing = asyncio.create_task(backend.list_pages())
                assert await asyncio.to_thread(admin.held.wait, 60)
                await _listing_blocked_in_read(backend)
                closing = asyncio.create_task(backend.close())
                # Bounded only so that a read left waiting fails the test, not hangs it.
                await asyncio.wait({closing, listing}, timeout=30)
                assert closing.done(), "the close waited for the read"
                assert listing.done()
                await closing
                with pytest.raises(StorageError, match="closed"):
                    await listing
        finally:
            hold.set()


async def test_a_cancelled_key_list_ends_its_read_at_once(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cancelled listing waited for the read under way: for the next piece of the answer,
    # or the admin timeout without data. Its socket is shut down now, so it ends at once and
    # no thread stays blocked on it; the backend goes on serving.
    monkeypatch.setattr(mooncake_module, "_KEY_LIST_READ_BYTES", 4096, raising=False)
    monkeypatch.setattr(mooncake_module, "_ADMIN_TIMEOUT_S", 3600.0)
    hold = threading.Event()
    with _KeyListServer(mooncake_master, 100_000, hold) as admin:
        url = _url_with_admin(mooncake_master, admin.url)
        try:
            async with MooncakeStorage.from_url(fresh_url(url)) as backend:
                keys, pages, metas = make_pages(2)
                await backend.put(keys, pages, metas)
                listing = asyncio.create_task(backend.list_pages())
                assert await asyncio.to_thread(admin.held.wait, 60)
                await _listing_blocked_in_read(backend)
                listing.cancel()
                # Bounded only so that a read left waiting fails the test, not hangs it.
                await asyncio.wait({listing}, timeout=30)
                assert listing.done(), "the cancelled listing waited for its read"
                assert listing.cancelled()
                assert not backend._jobs  # its job has returned
                hold.set()
                # The server sees the connection gone once it writes again.
                for _ in range(2000):
                    if admin.sent:
                        break
                    await asyncio.sleep(0.005)
                assert admin.sent
                into = buffers(2)
                assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 2
        finally:
            hold.set()


async def test_a_cancelled_https_key_list_ends_its_handshake_at_once(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The socket was attached only once the TLS handshake was over: an admin port that
    # accepts and never answers the handshake (a frozen master) held a cancelled listing
    # until the admin timeout.
    monkeypatch.setattr(mooncake_module, "_ADMIN_TIMEOUT_S", 3600.0)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    try:
        async with MooncakeStorage.from_url(fresh_url(mooncake_master.url)) as backend:
            # Only the listing's request goes there: the master's watch keeps its own URL.
            backend._admin = f"https://127.0.0.1:{listener.getsockname()[1]}"
            listing = asyncio.create_task(backend.list_pages())
            try:
                accepted.append((await asyncio.to_thread(listener.accept))[0])
                for _ in range(2000):  # until its thread waits in the handshake
                    if any(
                        frame.f_code.co_name == "do_handshake"
                        for frame in sys._current_frames().values()
                    ):
                        break
                    await asyncio.sleep(0.005)
                else:
                    pytest.fail("the listing never began its handshake")
                listing.cancel()
                # Bounded only so that a handshake left waiting fails the test, not hangs it.
                await asyncio.wait({listing}, timeout=30)
                assert listing.done(), "the cancelled listing waited for its handshake"
                assert listing.cancelled()
                assert not backend._jobs
            finally:
                for connection in accepted:  # a handshake still waiting ends here
                    connection.close()
    finally:
        listener.close()


def test_storage_command_without_the_admin_url_exits_2(
    mooncake_master: MooncakeMaster, capsys: pytest.CaptureFixture[str]
) -> None:
    url = fresh_url(
        f"mooncake://127.0.0.1:{mooncake_master.rpc_port}?metadata={mooncake_master.metadata_url}"
        "&protocol=tcp&local_hostname=127.0.0.1"
    )
    assert main(["storage", "ls", url]) == 2
    err = capsys.readouterr().err
    assert "needs the master's admin URL" in err
    line = next(line for line in err.splitlines() if "error:" in line)
    assert line.count("mooncake://") == 1


class _RacedGc(MooncakeStorage):
    """A MooncakeStorage whose listing is followed at once by the removal of its oldest
    page, as when another client's gc or delete runs between gc's listing and its removal."""

    async def list_pages(self, limit: int | None = None) -> list[PageInfo]:
        pages = await super().list_pages(limit)
        if pages:
            assert await self.delete([pages[-1].key]) == 1
        return pages


async def test_gc_reports_only_what_it_removed(mooncake_url: str) -> None:
    async with _RacedGc.from_url(fresh_url(mooncake_url, capacity=7000)) as backend:
        keys, pages, metas = make_pages(4)
        await backend.put(keys, pages, metas)
        # 4 pages of HEADER_NBYTES + 3000 bytes: gc chooses the 2 oldest, 1 is already gone.
        gc = await backend.gc()
        assert (gc.evicted_pages, gc.freed_bytes) == (1, HEADER_NBYTES + 3000)
        assert backend.stats().evictions == 1


def test_from_url_parameters() -> None:
    backend = MooncakeStorage.from_url(
        "mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:8080/metadata&protocol=rdma"
        "&device=mlx5_0&segment_size=4GiB&buffer_size=32MiB&prefix=m&replicas=2&capacity=1GiB"
    )
    assert backend.name == "mooncake://10.0.0.1:50051?prefix=m"
    assert backend.stats().capacity_bytes == 1 << 30
    assert backend.capabilities.shared
    assert not backend.capabilities.persistent
    with pytest.raises(StorageConfigError, match=r"accepted: .*segment_size"):
        MooncakeStorage.from_url("mooncake://127.0.0.1:50051?colour=blue")
    with pytest.raises(StorageConfigError, match="host:port"):
        MooncakeStorage.from_url("mooncake://127.0.0.1")
    with pytest.raises(StorageConfigError, match="protocol"):
        MooncakeStorage.from_url("mooncake://127.0.0.1:1?protocol=udp")
    with pytest.raises(StorageConfigError, match="segment_size"):
        MooncakeStorage.from_url("mooncake://127.0.0.1:1?segment_size=lots")


class TestMooncakeConformance(StorageConformance):
    @pytest_asyncio.fixture
    async def backend(self, mooncake_url: str) -> AsyncIterator[MooncakeStorage]:
        async with MooncakeStorage.from_url(fresh_url(mooncake_url)) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self, mooncake_url: str) -> AsyncIterator[MooncakeStorage]:
        url = fresh_url(mooncake_url)
        async with MooncakeStorage.from_url(url, mac_key=MAC_KEY) as storage:
            yield storage


class TestMooncakeZeroCopyConformance(StorageConformance):
    """The same suite with every buffer object registered on first use (zero copy)."""

    @pytest_asyncio.fixture
    async def backend(self, mooncake_url: str) -> AsyncIterator[MooncakeStorage]:
        url = fresh_url(mooncake_url, auto_register=1)
        async with MooncakeStorage.from_url(url) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self, mooncake_url: str) -> AsyncIterator[MooncakeStorage]:
        url = fresh_url(mooncake_url, auto_register=1)
        async with MooncakeStorage.from_url(url, mac_key=MAC_KEY) as storage:
            yield storage


class TestMooncakeAnyPlacementConformance(StorageConformance):
    """The same suite with pages placed by the master in any client's segment of the session,
    so gets take both paths: in place for this client's segment, the engine for the others."""

    @pytest_asyncio.fixture
    async def backend(self, mooncake_url: str) -> AsyncIterator[MooncakeStorage]:
        url = fresh_url(mooncake_url, placement="any")
        async with MooncakeStorage.from_url(url) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self, mooncake_url: str) -> AsyncIterator[MooncakeStorage]:
        url = fresh_url(mooncake_url, placement="any")
        async with MooncakeStorage.from_url(url, mac_key=MAC_KEY) as storage:
            yield storage


def test_master_ports_must_differ() -> None:
    port = free_port()
    with pytest.raises(ValueError, match="must differ"):
        MooncakeMaster(rpc_port=port, http_port=port)
    with pytest.raises(ValueError, match="must differ"):
        MooncakeMaster(http_port=port, admin_port=port)


def test_master_ports_served_by_another_master_are_refused(
    mooncake_master: MooncakeMaster,
) -> None:
    # Every port of the running master answers; ours must not pass for ready on them.
    ours = MooncakeMaster(
        rpc_port=mooncake_master.rpc_port,
        http_port=mooncake_master.http_port,
        admin_port=mooncake_master.admin_port,
    )
    with pytest.raises(ServerError, match="did not become ready"):
        ours.start()
    assert not ours.running
    assert mooncake_master.running


def test_a_missing_master_binary_fails_loudly() -> None:
    with pytest.raises(ServerBinaryNotFoundError, match="no-such-master"):
        MooncakeMaster(binary="no-such-master")


async def test_open_storage_builds_it_from_the_url(mooncake_url: str) -> None:
    storage = open_storage(fresh_url(mooncake_url), mac_key=MAC_KEY)
    assert isinstance(storage, MooncakeStorage)
    async with storage:
        keys, pages, metas = make_pages(1)
        assert await storage.put(keys, pages, metas) == [Outcome.OK]
        raw = await storage.read_raw(keys[0])
        assert raw is not None
        assert raw[6] & 1  # written with the MAC


def test_an_object_still_being_put_reads_as_missing() -> None:
    from hicache_async.storage._mooncake import _read_states

    # -703: another client's put has not ended; the object is not readable yet.
    states = _read_states(None, ["a", "b", "c"], [-703, -704, 4096], [4096, 4096, 4096])
    assert states == ["missing", "missing", "read"]


def test_sizes_are_whole_bytes_and_an_empty_capacity_is_refused() -> None:
    base = "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata"
    for query in ("segment_size=0.5", "segment_size=1.9", "capacity=", "capacity=1.5"):
        with pytest.raises(StorageConfigError):
            MooncakeStorage.from_url(f"{base}&{query}")
    assert MooncakeStorage.from_url(f"{base}&segment_size=0.5GiB").name.startswith("mooncake://")


@pytest.mark.parametrize("call", ["get", "put"])
async def test_a_call_waiting_for_the_staging_arena_at_close_raises_storage_error(
    backend: MooncakeStorage, call: str
) -> None:
    keys, pages, metas = make_pages(2)
    if call == "get":
        await backend.put(keys, pages, metas)
    arena = backend._arena
    held = await arena.acquire(arena.capacity)  # every byte taken: the call below waits
    waiting = asyncio.ensure_future(
        backend.get(keys, buffers(2), namespace=NS)
        if call == "get"
        else backend.put(keys, pages, metas)
    )
    for _ in range(1000):
        if arena._queue:
            break
        await asyncio.sleep(0)
    assert arena._queue
    await backend.close()
    arena.release(held, arena.capacity)
    with pytest.raises(StorageError, match="closed"):
        await waiting


async def _until(condition: Callable[[], bool]) -> None:
    """Wait until `condition()` holds (a hang guard of 30 s of wall time)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        await asyncio.sleep(0)


_SLOT = 64  # the arena's alignment: every request below is whole slots


async def test_the_arena_serves_waiting_requests_first_come_first_served() -> None:
    arena = _Arena(4 * _SLOT)
    first = await arena.acquire(2 * _SLOT)
    second = await arena.acquire(2 * _SLOT)
    big = asyncio.ensure_future(arena.acquire(3 * _SLOT))
    await _until(lambda: len(arena._queue) == 1)
    # Two slots come free: the waiting request does not fit them yet, and a later one that
    # would fit queues behind it instead of taking them.
    arena.release(second, 2 * _SLOT)
    small = asyncio.ensure_future(arena.acquire(_SLOT))
    await _until(lambda: len(arena._queue) == 2)
    assert not big.done()
    assert not small.done()
    arena.release(first, 2 * _SLOT)  # now the first in line fits, then the next
    await _until(lambda: big.done() and small.done())
    assert await big == 0
    assert await small == 3 * _SLOT
    assert not arena._queue


async def test_a_cancelled_waiter_leaves_the_queue_and_lets_the_next_be_served() -> None:
    arena = _Arena(4 * _SLOT)
    held = await arena.acquire(2 * _SLOT)
    head = asyncio.ensure_future(arena.acquire(4 * _SLOT))
    await _until(lambda: len(arena._queue) == 1)
    behind = asyncio.ensure_future(arena.acquire(2 * _SLOT))
    await _until(lambda: len(arena._queue) == 2)
    assert not behind.done()  # queued behind the head, though it fits the free space
    head.cancel()
    await _until(behind.done)
    assert await behind == 2 * _SLOT
    assert head.cancelled()
    assert not arena._queue
    arena.release(held, 2 * _SLOT)
    arena.release(2 * _SLOT, 2 * _SLOT)
    assert arena._free == [(0, 4 * _SLOT)]


async def test_space_granted_to_a_waiter_cancelled_before_it_resumed_goes_back() -> None:
    arena = _Arena(4 * _SLOT)
    held = await arena.acquire(4 * _SLOT)
    head = asyncio.ensure_future(arena.acquire(4 * _SLOT))
    await _until(lambda: len(arena._queue) == 1)
    behind = asyncio.ensure_future(arena.acquire(_SLOT))
    await _until(lambda: len(arena._queue) == 2)
    arena.release(held, 4 * _SLOT)  # the whole arena goes to the head...
    head.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await head
    # The head's space went back, and to the next in line.
    await _until(behind.done)
    assert await behind == 0
    arena.release(0, _SLOT)
    assert arena._free == [(0, 4 * _SLOT)]
    assert not arena._queue


async def test_a_request_larger_than_the_arena_is_refused() -> None:
    arena = _Arena(4 * _SLOT)
    with pytest.raises(ValueError, match="exceed the staging arena"):
        await arena.acquire(4 * _SLOT + 1)


async def test_a_large_staged_get_is_not_starved_by_a_stream_of_small_ones(
    mooncake_url: str,
) -> None:
    # Memory that is not registered goes through the staging arena: one page needing most of
    # it waits for room while small gets keep parts of it busy.
    url = fresh_url(mooncake_url, staging_size="1MiB", auto_register=0)
    async with MooncakeStorage.from_url(url) as storage:
        small_keys, small_pages, small_metas = make_pages(64, 16 << 10, split=8 << 10)
        assert await storage.put(small_keys, small_pages, small_metas) == [Outcome.OK] * 64
        big_keys, big_pages, big_metas = make_pages(1, 900 << 10, split=450 << 10)
        assert await storage.put(big_keys, big_pages, big_metas) == [Outcome.OK]
        stop = asyncio.Event()
        small_gets = 0

        async def small_reader(seed: int) -> None:
            nonlocal small_gets
            rng = np.random.default_rng(seed)
            while not stop.is_set():
                picked = [small_keys[i] for i in rng.choice(64, 8, replace=False)]
                await storage.get(picked, buffers(8, 16 << 10, split=8 << 10), namespace=NS)
                small_gets += 1

        readers = [asyncio.ensure_future(small_reader(seed)) for seed in range(6)]
        try:
            await _until(lambda: small_gets >= 12)  # the stream is under way
            into = buffers(1, 900 << 10, split=450 << 10)
            big = asyncio.ensure_future(storage.get(big_keys, into, namespace=NS))
            # A hang guard: starved, it would wait for as long as the small gets go on.
            done, _ = await asyncio.wait([big], timeout=30)
        finally:
            stop.set()
            await asyncio.gather(*readers)
        assert done, "the large get still waits for the staging arena"
        assert await big == [Outcome.OK]
        assert joined(into[0]) == joined(big_pages[0])


async def test_manifest_compact_writes_where_it_outlives_the_command(mooncake_url: str) -> None:
    # The URL a serving instance would use: its own puts go to its own segment. A command's
    # client is gone at its exit, so a compaction written there would vanish with it.
    url = fresh_url(mooncake_url, placement="local")
    namespace = bytes(range(16))
    async with MooncakeStorage.from_url(url) as serving:
        manifest = serving.manifest()
        for i in range(4):  # four records, so the compaction has something to rewrite
            keys = [uuid.uuid4().bytes * 2 for _ in range(3)]
            await manifest.append([chain_entry(namespace, keys, 3 * 64, 0, float(i))])
        command = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hicache_async", "manifest", "compact", url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await command.communicate()
        assert command.returncode == 0, err.decode()
        read = await manifest.read(namespace=namespace.hex())
        assert len(read.entries) == 4, (out.decode(), err.decode())


# Lends a segment, puts one object there (argv: URL, name, hex of the value), says so, and
# waits to be killed: its segment stays mounted on the master, unreachable.
_LENDER = """
import sys, time
from mooncake.store import ReplicateConfig
from hicache_async.storage._mooncake import pooled_client
with pooled_client(sys.argv[1]) as client:
    config = ReplicateConfig()
    config.with_hard_pin = True
    config.preferred_segment = str(client.get_hostname())
    print(client.put(sys.argv[2], bytes.fromhex(sys.argv[3]), config), flush=True)
    time.sleep(3600)
"""


async def test_a_manifest_chunk_in_a_dead_clients_segment_leaves_a_gap() -> None:
    # The master keeps the dead client's segment for an hour: reads of it fail (-800)
    # instead of missing. Each failure takes about a second, so the read leases are
    # Mooncake's default 10 s: one of 0.5 s would expire on the other chunk meanwhile.
    with MooncakeMaster(lease_ttl_ms=10_000, extra_args=["-client_ttl=3600"]) as master:
        url = fresh_url(master.url, segment_size="64MiB")
        namespace = bytes(range(16))
        ns = namespace.hex()
        alive, dead = (
            chain_entry(namespace, [uuid.uuid4().bytes * 2], 64, 0, float(i)) for i in range(2)
        )
        async with MooncakeStorage.from_url(url) as storage:
            manifest = storage.manifest()
            await manifest.append([alive])  # seq 0, in this client's segment (the only one)
            # Seq 1 in the segment of another client, which then dies without unmounting it.
            name = manifest.object_name(ns, "g0:l1")
            chunk = _with_token(encode_entry(dead))
            lender = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _LENDER, fresh_url(master.url, segment_size="64MiB"),
                name, chunk.hex(), stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                assert lender.stdout is not None
                line = await asyncio.wait_for(lender.stdout.readline(), 60)
                assert line.strip() == b"0", line
            finally:
                lender.kill()
                await lender.wait()
            errors = storage.stats().errors
            read = await manifest.read(namespace=ns)
            # The other chunk's record is read; the read says it is partial.
            assert read.entries == [alive]
            assert read.truncated
            assert storage.stats().errors == errors + 1
            # A compaction never goes on without a chunk it could not read: it would drop
            # the chunk's records for good.
            with pytest.raises(StorageError):
                await manifest.compact_namespace(ns)
            assert (await manifest.read(namespace=ns)).entries == [alive]
        assert close_idle_clients(master.address) == 1


async def test_puts_a_full_cluster_refuses_are_misses_logged_once() -> None:
    # A cluster whose only segment holds nothing it may evict (hard-pinned objects) refuses
    # every put with NO_AVAILABLE_HANDLE.
    with MooncakeMaster() as master:
        url = fresh_url(master.url, segment_size="16MiB")
        async with MooncakeStorage.from_url(url) as storage:
            from mooncake.store import ReplicateConfig

            store = storage._master_store()
            config = ReplicateConfig()
            config.with_hard_pin = True
            filler = bytes(1 << 20)
            for i in range(64):
                if store.put(f"{storage.prefix}:filler{i}", filler, config) != 0:
                    break
            else:
                pytest.fail("16 MiB segment took 64 MiB of hard-pinned objects")
            keys, pages, metas = make_pages(3)
            now = [0.0]
            storage._put_log = LogLimiter(60.0, clock=lambda: now[0])
            with structlog.testing.capture_logs() as logs:
                assert await storage.put(keys, pages, metas) == [Outcome.MISS] * 3
                assert await storage.put(keys, pages, metas) == [Outcome.MISS] * 3
                assert await storage.put(keys[:2], pages[:2], metas[:2]) == [Outcome.MISS] * 2
                now[0] = 60.0  # a minute later: the next refusal is told again
                assert await storage.put(keys[:1], pages[:1], metas[:1]) == [Outcome.MISS]
            refused = [e for e in logs if e["event"] == "storage.mooncake.put_no_space"]
            # Told once, with Mooncake's code; the repeat waits for the next interval, and
            # then tells how many pages the refusals left out were about.
            told = [
                (e["code"], e["pages"], e["unlogged_since_last"], e["unlogged_pages_since_last"])
                for e in refused
            ]
            assert told == [(-200, 3, 0, 0), (-200, 1, 2, 5)], logs
            stats = storage.stats()
            assert (stats.puts, stats.put_ok, stats.errors) == (9, 0, 0)
        # Its client goes back to the pool: closed while its master answers, so no later
        # command's exit finds it orphaned.
        assert close_idle_clients(master.address) == 1


async def test_a_put_refused_for_room_is_tried_again_after_the_master_evicts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With the high watermark at 100%, the master evicts only after an allocation failed: a
    # segment filled exactly holds until the put's first try is refused, deterministically.
    # The wait before the second try is stretched so a loaded machine's master (which evicts
    # within a few ms here) is sure to have made room by then.
    monkeypatch.setattr(mooncake_module, "_NO_SPACE_RETRY_S", 1.0)
    with MooncakeMaster(extra_args=["-eviction_high_watermark_ratio=1.0"]) as master:
        url = fresh_url(master.url, segment_size="16MiB")
        async with MooncakeStorage.from_url(url) as storage:
            store = storage._master_store()
            fillers = [f"{storage.prefix}:filler{i}" for i in range(16)]
            for name in fillers:
                assert store.put(name, bytes(1 << 20)) == 0
            keys, pages, metas = make_pages(3)
            with structlog.testing.capture_logs() as logs:
                assert await storage.put(keys, pages, metas) == [Outcome.OK] * 3
            # The refusal set the master's eviction going: it made room for the second try,
            # which is not reported as refused.
            assert sum(store.is_exist(name) == 1 for name in fillers) < 16
            assert not [e for e in logs if e["event"] == "storage.mooncake.put_no_space"]
            stats = storage.stats()
            assert (stats.puts, stats.put_ok, stats.errors, stats.pages) == (3, 3, 0, 3)
            into = buffers(3)
            assert await storage.get(keys, into, namespace=NS) == [Outcome.OK] * 3
        assert close_idle_clients(master.address) == 1


def _alloc_failures(master: MooncakeMaster) -> int:
    """How many allocations the master has refused for want of room."""
    with urllib.request.urlopen(f"{master.admin_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(r"^master_put_start_alloc_failures_total (\d+)$", text, re.MULTILINE)
    assert found is not None, text
    return int(found.group(1))


async def test_a_put_cancelled_while_its_refused_pages_wait_gives_back_what_it_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The wait before the second try is long here, so the cancellation lands in it.
    monkeypatch.setattr(mooncake_module, "_NO_SPACE_RETRY_S", 3600.0)
    with MooncakeMaster() as master:
        url = fresh_url(master.url, segment_size="16MiB")
        async with MooncakeStorage.from_url(url) as storage:
            from mooncake.store import ReplicateConfig

            store = storage._master_store()
            config = ReplicateConfig()
            config.with_hard_pin = True
            fillers = [f"{storage.prefix}:filler{i}" for i in range(64)]
            stored = [n for n in fillers if store.put(n, bytes(1 << 20), config) == 0]
            assert len(stored) < len(fillers)
            refusals = await asyncio.to_thread(_alloc_failures, master)
            keys, pages, metas = make_pages(3)
            put = asyncio.create_task(storage.put(keys, pages, metas))
            for _ in range(2000):
                if await asyncio.to_thread(_alloc_failures, master) > refusals:
                    break
                await asyncio.sleep(0.005)
            else:
                pytest.fail("the put was never refused")
            put.cancel()
            with pytest.raises(asyncio.CancelledError):
                await put
            # Its staging space is free, nothing was counted, and the backend goes on.
            arena = storage._arena
            assert sum(size for _, size in arena._free) == arena.capacity
            stats = storage.stats()
            assert (stats.puts, stats.pages) == (0, 0)
            assert all(c == 0 for c in store.batch_remove(stored, force=True))
            assert await storage.put(keys, pages, metas) == [Outcome.OK] * 3
        assert close_idle_clients(master.address) == 1


async def test_a_close_ends_the_wait_of_a_put_refused_for_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The wait before the second try is long here: only the close can end it.
    monkeypatch.setattr(mooncake_module, "_NO_SPACE_RETRY_S", 3600.0)
    with MooncakeMaster() as master:
        url = fresh_url(master.url, segment_size="16MiB")
        storage = MooncakeStorage.from_url(url)
        async with storage:
            from mooncake.store import ReplicateConfig

            store = storage._master_store()
            config = ReplicateConfig()
            config.with_hard_pin = True
            fillers = [f"{storage.prefix}:filler{i}" for i in range(64)]
            stored = [n for n in fillers if store.put(n, bytes(1 << 20), config) == 0]
            assert len(stored) < len(fillers)
            refusals = await asyncio.to_thread(_alloc_failures, master)
            keys, pages, metas = make_pages(3)
            put = asyncio.create_task(storage.put(keys, pages, metas))
            for _ in range(2000):
                if await asyncio.to_thread(_alloc_failures, master) > refusals:
                    break
                await asyncio.sleep(0.005)
            else:
                pytest.fail("the put was never refused")
            await storage.close()
            # Bounded only so that a wait left running fails the test instead of hanging it.
            assert await asyncio.wait_for(put, 60) == [Outcome.MISS] * 3
            arena = storage._arena
            assert sum(size for _, size in arena._free) == arena.capacity
            assert all(c == 0 for c in store.batch_remove(stored, force=True))
        assert close_idle_clients(master.address) == 1


async def test_compaction_after_one_that_died_past_its_switch_frees_its_generation(
    mooncake_master: MooncakeMaster,
) -> None:
    # No admin URL, so no sweep: what the compaction removes itself is all that goes. The
    # manifest's objects are hard-pinned, so what it leaves stays in the cluster for good.
    url = (
        f"mooncake://127.0.0.1:{mooncake_master.rpc_port}?metadata={mooncake_master.metadata_url}"
        "&protocol=tcp&local_hostname=127.0.0.1"
    )
    namespace = bytes(range(16))
    ns = namespace.hex()
    entries = [chain_entry(namespace, [uuid.uuid4().bytes * 2], 64, 0, float(i)) for i in range(5)]
    async with MooncakeStorage.from_url(fresh_url(url)) as storage:
        manifest = storage.manifest()
        await manifest.append(entries[:3])
        await manifest.compact_namespace(ns)
        first = await manifest._index(ns)
        for entry in entries[3:]:
            await manifest.append([entry])  # the log of generation 1: seqs 0 and 1
        # What a compaction to generation 2 leaves when it dies right after its switch:
        # every record but the last in its base, its index carrying log seq 1 on, and all of
        # generation 1 still there.
        stem = f"g2-{os.urandom(8).hex()}"
        base = manifest.object_name(ns, f"{stem}:b0")
        assert await manifest._claim(base, b"".join(encode_entry(e) for e in entries[:4]))
        index = _Index(
            v=_INDEX_VERSION, namespace=ns, generation=2, stem=stem, base=1,
            carry=first.stem, carry_from=1,
        )  # fmt: skip
        assert await manifest._claim_raw(
            manifest.object_name(ns, "index.0"), msgspec.json.encode(index)
        )
        gone = [manifest.object_name(ns, f"{first.stem}:{n}") for n in ("b0", "l0", "l1")]
        assert await manifest._exist(gone) == [True] * 3
        await manifest.compact_namespace(ns)
        read = await manifest.read(namespace=ns)
        assert sorted(e.last_use for e in read.entries) == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert await manifest._exist(gone) == [False] * 3


async def test_the_idle_client_pool_keeps_the_most_recent_clients_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every distinct setting kept its idle client, threads and segment for the life of the
    # process: one that moves between masters kept one per master.
    monkeypatch.setattr(mooncake_module, "_MAX_IDLE_CLIENTS", 2, raising=False)
    abandoned = len(_POOL._abandoned)
    with contextlib.ExitStack() as stack:
        masters = [stack.enter_context(MooncakeMaster()) for _ in range(3)]
        try:
            for master in masters:
                async with MooncakeStorage.from_url(fresh_url(master.url)) as storage:
                    keys, pages, metas = make_pages(1)
                    assert await storage.put(keys, pages, metas) == [Outcome.OK]
            # The first master's client was closed (its master answers: not abandoned).
            assert len(_POOL._abandoned) == abandoned
            assert [close_idle_clients(m.address) for m in masters] == [0, 1, 1]
        finally:
            for master in masters:
                close_idle_clients(master.address)


def _entry_of_line_length(namespace: bytes, nbytes: int) -> ManifestEntry:
    """An entry whose manifest line is exactly `nbytes` long (padded with priority digits)."""
    keys = [uuid.uuid4().bytes * 2]
    base = len(encode_entry(chain_entry(namespace, keys, 64, 0, 0.0)))
    step = len(encode_entry(chain_entry(namespace, keys * 2, 64, 0, 0.0))) - base
    keys *= 1 + (nbytes - base - 16) // step
    pad = nbytes - len(encode_entry(chain_entry(namespace, keys, 64, 0, 0.0)))
    entry = chain_entry(namespace, keys, 64, 10**pad, 0.0)
    assert len(encode_entry(entry)) == nbytes
    return entry


async def test_a_manifest_fits_its_puts_in_the_local_buffer(mooncake_url: str) -> None:
    # Mooncake copies a put through its local buffer and refuses one larger (-600). Entries
    # allowed to be as long as the buffer made chunks longer than it: an append holding one
    # failed whole, its other entries included.
    url = fresh_url(mooncake_url, buffer_size="1MiB")
    namespace = bytes(range(16))
    small = [
        chain_entry(namespace, [uuid.uuid4().bytes * 2 for _ in range(3)], 3 * 64, 0, float(i))
        for i in range(3)
    ]
    async with MooncakeStorage.from_url(url) as backend:
        manifest = backend.manifest(ManifestLimits(max_entry_bytes=1 << 20))
        await manifest.append([*small, _entry_of_line_length(namespace, 1 << 20)])
        read = await manifest.read(namespace=namespace.hex())
        assert sorted(e.last_use for e in read.entries) == [0.0, 1.0, 2.0]


async def test_a_client_past_the_pool_bound_whose_master_is_frozen_is_left_unclosed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A frozen master still accepts connections: closing its client waited out Mooncake's
    # RPC timeouts holding the GIL (over a minute), freezing the loop of the backend whose
    # close handed back the client past the bound.
    monkeypatch.setattr(mooncake_module, "_MAX_IDLE_CLIENTS", 1, raising=False)
    abandoned = len(_POOL._abandoned)
    with MooncakeMaster() as frozen, MooncakeMaster() as other:
        pid = frozen.pid
        assert pid is not None
        try:
            async with MooncakeStorage.from_url(fresh_url(frozen.url)):
                pass  # its client goes idle in the pool
            os.kill(pid, signal.SIGSTOP)
            with structlog.testing.capture_logs() as logs:
                async with MooncakeStorage.from_url(fresh_url(other.url)):
                    pass  # handing its client back pushes the frozen master's out
            assert len(_POOL._abandoned) == abandoned + 1
            gone = [e for e in logs if e["event"] == "storage.mooncake.master_gone_at_exit"]
            assert [e["master"] for e in gone] == [frozen.address]
            assert "does not answer" in gone[0]["reason"]
        finally:
            os.kill(pid, signal.SIGCONT)
            # It answers again: close the abandoned client while it does.
            for client in _POOL._abandoned[abandoned:]:
                client.close()
            del _POOL._abandoned[abandoned:]
            close_idle_clients(other.address)


async def test_idle_clients_of_one_frozen_master_are_checked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each check of a frozen master waits out the probe timeout: at exit, every idle client
    # of it (other settings) waited it out again.
    checks: list[str] = []
    check = mooncake_module._silent_server

    def counted(master: str, metadata: str) -> str | None:
        checks.append(master)
        return check(master, metadata)

    monkeypatch.setattr(mooncake_module, "_silent_server", counted)
    abandoned = len(_POOL._abandoned)
    with MooncakeMaster() as frozen:
        pid = frozen.pid
        assert pid is not None
        for buffer_size in ("16MiB", "32MiB"):  # two client settings: two idle clients
            async with MooncakeStorage.from_url(fresh_url(frozen.url, buffer_size=buffer_size)):
                pass
        os.kill(pid, signal.SIGSTOP)
        try:
            checks.clear()
            with structlog.testing.capture_logs() as logs:
                assert close_idle_clients(frozen.address, reachable_only=True) == 0
            assert len(_POOL._abandoned) == abandoned + 2
            assert checks == [frozen.address]
            gone = [e for e in logs if e["event"] == "storage.mooncake.master_gone_at_exit"]
            assert len(gone) == 2
            assert all("does not answer" in e["reason"] for e in gone)
        finally:
            os.kill(pid, signal.SIGCONT)
            for client in _POOL._abandoned[abandoned:]:
                client.close()
            del _POOL._abandoned[abandoned:]


class _HeldLookups(_Client):
    """The Mooncake client, its `batch_is_exist` held on a thread until `release` is set (a
    master that does not answer), counting the calls that reached it."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.calls = 0

    def batch_is_exist(self, names: Any) -> Any:
        self.calls += 1
        self.release.wait(30)  # a hang guard only
        return self.inner.batch_is_exist(names)


async def test_a_lookup_cancelled_while_it_waits_for_a_thread_never_asks_the_master(
    mooncake_url: str,
) -> None:
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, threads=1)) as storage:
        keys, _, _ = make_pages(2)
        client = _HeldLookups(storage._store)
        storage._store = client
        try:
            first = asyncio.ensure_future(storage.exists(keys))
            for _ in range(30_000):  # until the only thread is in the held call
                if client.calls:
                    break
                await asyncio.sleep(0.001)
            assert client.calls == 1
            queued = asyncio.ensure_future(storage.exists(keys))
            await asyncio.sleep(0)  # its job waits for the thread
            queued.cancel()
            await asyncio.sleep(0)
            client.release.set()
            assert await asyncio.wait_for(first, 30) == 0
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(queued, 30)
            assert client.calls == 1  # the cancelled lookup's job did not call the client
        finally:
            client.release.set()
            storage._store = client.inner
