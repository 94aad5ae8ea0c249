"""Bad arguments to the built-in backends raise the documented error before anything changes:
MAC keys, sizes, and a put's pages and metas."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache_async import StorageConfigError
from hicache_async.storage import (
    FileStorage,
    MemoryStorage,
    Outcome,
    PageMeta,
    StorageBackend,
    check_metas,
    open_storage,
)
from hicache_async.testing import FaultyStorage

NS = b"validation-ns-16"
PAGE = 64


def _key(index: int) -> bytes:
    return index.to_bytes(32, "big")


def _meta(key: bytes) -> PageMeta:
    return PageMeta(key=key, namespace=NS, num_tokens=4)


def _page(fill: int) -> list[memoryview]:
    return [memoryview(bytes([fill]) * PAGE)]


# -- MAC keys -------------------------------------------------------------------------------


SHORT_KEYS = [b"", b"x", bytes(15)]


@pytest.mark.parametrize("mac_key", SHORT_KEYS)
def test_every_backend_refuses_a_mac_key_under_16_bytes(tmp_path: Path, mac_key: bytes) -> None:
    # An empty key used to turn the MAC off without a word: a reader "with a key" then served
    # pages planted by a writer without one.
    with pytest.raises(StorageConfigError, match="at least 16 bytes"):
        MemoryStorage(mac_key=mac_key)
    with pytest.raises(StorageConfigError, match="at least 16 bytes"):
        FileStorage(tmp_path, mac_key=mac_key)
    with pytest.raises(StorageConfigError, match="at least 16 bytes"):
        open_storage("memory://", mac_key=mac_key)
    with pytest.raises(StorageConfigError, match="at least 16 bytes"):
        open_storage(f"file://{tmp_path}", mac_key=mac_key)


@pytest.mark.parametrize("mac_key", ["k" * 32, bytearray(32), 5])
def test_a_mac_key_that_is_not_bytes_is_refused(mac_key: Any) -> None:
    with pytest.raises(StorageConfigError, match="mac_key must be bytes or None"):
        MemoryStorage(mac_key=mac_key)
    with pytest.raises(StorageConfigError, match="mac_key must be bytes or None"):
        open_storage("memory://", mac_key=mac_key)


async def test_a_reader_with_a_16_byte_key_rejects_a_page_planted_without_it(
    tmp_path: Path,
) -> None:
    key = _key(1)
    async with FileStorage(tmp_path) as attacker:
        assert await attacker.put([key], [_page(0xEE)], [_meta(key)]) == [Outcome.OK]
    async with FileStorage(tmp_path, mac_key=bytes(16)) as reader:
        into = [[memoryview(bytearray(PAGE))]]
        assert await reader.get([key], into, namespace=NS) == [Outcome.CORRUPT]


# -- MemoryStorage sizes --------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [float("nan"), 1.5, 1024.0, True, "1024", None, 0, -1])
def test_memory_capacity_must_be_an_int_of_one_or_more(capacity: Any) -> None:
    # nan passed `< 1` (a store without bound), 1.5 made stats() refuse its own capacity.
    with pytest.raises(StorageConfigError, match=r"capacity_bytes must be an integer >= 1, got"):
        MemoryStorage(capacity_bytes=capacity)


@pytest.mark.parametrize("spare", [float("nan"), 1.5, True, "0", -1])
def test_memory_spare_bytes_must_be_an_int_of_zero_or_more(spare: Any) -> None:
    with pytest.raises(StorageConfigError, match=r"spare_bytes must be an integer >= 0 or None"):
        MemoryStorage(capacity_bytes=1 << 20, spare_bytes=spare)


def test_memory_sizes_that_are_ints_are_taken() -> None:
    assert MemoryStorage(capacity_bytes=1, spare_bytes=0).stats().capacity_bytes == 1
    assert MemoryStorage(capacity_bytes=1 << 20, spare_bytes=None)._spare_limit == 1 << 17


# -- a put's pages and metas ----------------------------------------------------------------


@pytest.fixture(params=["memory", "file", "faulty"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StorageBackend]:
    storage: StorageBackend
    if request.param == "memory":
        storage = MemoryStorage(capacity_bytes=1 << 20)
    elif request.param == "file":
        storage = FileStorage(tmp_path)
    else:
        storage = FaultyStorage(MemoryStorage(capacity_bytes=1 << 20))
    async with storage:
        yield storage


NOT_CONTIGUOUS = memoryview(np.zeros((4, 4), dtype=np.uint8)[:, ::2])

BAD_PAGES: list[Any] = [
    b"abc",  # bytes iterate as ints
    bytearray(PAGE),
    memoryview(bytes(PAGE)),
    None,
    5,
    ["abc"],  # a str is no buffer
    [None],
    [5],
    iter([memoryview(bytes(PAGE))]),  # would be used up by the check, then read as empty
    [NOT_CONTIGUOUS],
]


@pytest.mark.parametrize("bad", BAD_PAGES, ids=lambda bad: type(bad).__name__)
async def test_a_malformed_page_raises_value_error_and_changes_nothing(
    backend: StorageBackend, bad: Any
) -> None:
    old, new = _key(1), _key(2)
    assert await backend.put([old], [_page(1)], [_meta(old)]) == [Outcome.OK]
    before = backend.stats()
    # The stored key first: its use (LRU order) must not be touched by a refused batch either.
    with pytest.raises(ValueError, match=r"pages\[1\]"):
        await backend.put([old, new], [_page(1), bad], [_meta(old), _meta(new)])
    assert backend.stats() == before
    assert await backend.exists([new]) == 0


async def test_a_refused_put_moves_no_key_in_the_lru_order() -> None:
    first, second, third = _key(1), _key(2), _key(3)
    async with MemoryStorage(capacity_bytes=1 << 20) as probe:
        await probe.put([first], [_page(1)], [_meta(first)])
        one_page = probe.stats().bytes
    async with MemoryStorage(capacity_bytes=2 * one_page, spare_bytes=0) as storage:
        for key in (first, second):  # first is the least recently used
            assert await storage.put([key], [_page(1)], [_meta(key)]) == [Outcome.OK]
        with pytest.raises(ValueError, match="bytes-like"):
            await storage.put([first, third], [_page(1), [None]], [_meta(first), _meta(third)])
        assert await storage.put([third], [_page(3)], [_meta(third)]) == [Outcome.OK]
        # first was evicted: the refused batch did not count it as used.
        assert await storage.exists([first]) == 0
        assert await storage.exists([second, third]) == 2


@pytest.mark.parametrize("meta", [None, {"key": _key(2)}, (_key(2), NS, 4)])
async def test_a_meta_that_is_not_a_page_meta_raises_value_error(
    backend: StorageBackend, meta: Any
) -> None:
    with pytest.raises(ValueError, match="PageMeta"):
        check_metas([_key(2)], [meta])
    before = backend.stats()
    with pytest.raises(ValueError, match="PageMeta"):
        await backend.put([_key(2)], [_page(2)], [meta])
    assert backend.stats() == before


async def test_good_pages_of_every_accepted_shape_are_stored(backend: StorageBackend) -> None:
    keys = [_key(i) for i in range(4)]
    pages: list[Any] = [
        [memoryview(bytes(PAGE))],
        (memoryview(bytearray(PAGE // 2)), memoryview(bytes(PAGE // 2))),
        [bytes(PAGE)],  # bytes-like segments need not be memoryviews
        [memoryview(np.zeros(PAGE // 4, dtype=np.float32))],
    ]
    outcomes = await backend.put(keys, pages, [_meta(key) for key in keys])
    assert outcomes == [Outcome.OK] * 4
