"""Mooncake pages in this client's own segment: placed there, read in place, always checked."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from hicache_async import StorageConfigError
from hicache_async.storage import HEADER_NBYTES, Outcome
from hicache_async.storage._mooncake import MooncakeStorage
from hicache_async.storage._mooncake_local import LocalObjects, readable_mapping
from hicache_async.testing._conformance import MAC_KEY

from .test_mooncake import NS, OTHER_NS, buffers, joined, make_pages
from .test_mooncake import fresh_url as _fresh_url

PAGE = 64 * 1024
SPLIT = 20_000


def fresh_url(base: str, **params: object) -> str:
    # A segment size no other test uses: these tests get a client of their own from the
    # pool, whose segment the rest of the session has not filled, so local placement finds
    # room in it.
    return _fresh_url(base, **{"segment_size": "96MiB", **params})


def _endpoints(storage: MooncakeStorage, keys: list[bytes]) -> set[str]:
    names = [storage._mkey(k) for k in keys]
    described = storage._store.batch_get_replica_desc(names)
    return {
        replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
        for name in names
        for replica in described[name]
    }


def _flip_in_segment(storage: MooncakeStorage, key: bytes, offset: int) -> None:
    """Damage one byte of a page where it lies, in this client's own segment."""
    (replica,) = storage._store.batch_get_replica_desc([storage._mkey(key)])[storage._mkey(key)]
    buffer = replica.get_memory_descriptor().buffer_descriptor
    assert buffer.transport_endpoint == storage._store.get_hostname()
    byte = ctypes.c_ubyte.from_address(int(buffer.buffer_address) + offset)
    byte.value ^= 0x10


async def test_local_placement_and_reads_in_place(mooncake_url: str) -> None:
    keys, pages, metas = make_pages(8, PAGE, split=SPLIT)
    async with MooncakeStorage.from_url(fresh_url(mooncake_url)) as storage:
        assert storage.placement == "local"  # the default with a segment
        assert await storage.put(keys, pages, metas) == [Outcome.OK] * 8
        assert _endpoints(storage, keys) == {storage._store.get_hostname()}
        into = buffers(8, PAGE, split=SPLIT)
        assert await storage.get(keys, into, namespace=NS) == [Outcome.OK] * 8
        assert [joined(p) for p in into] == [joined(p) for p in pages]
        assert storage.direct_pages == 8
        stats = storage.stats()
        assert (stats.get_hits, stats.corrupt) == (8, 0)


async def test_direct_reads_can_be_turned_off(mooncake_url: str) -> None:
    url = fresh_url(mooncake_url, placement="local", direct_reads="false")
    keys, pages, metas = make_pages(3, PAGE, split=SPLIT)
    async with MooncakeStorage.from_url(url) as storage:
        await storage.put(keys, pages, metas)
        into = buffers(3, PAGE, split=SPLIT)
        assert await storage.get(keys, into, namespace=NS) == [Outcome.OK] * 3
        assert [joined(p) for p in into] == [joined(p) for p in pages]
        assert storage.direct_pages == 0


@pytest.mark.parametrize(
    ("offset", "what"),
    [(HEADER_NBYTES + PAGE // 2, "payload"), (40, "header key")],
)
async def test_damage_in_own_segment_is_corrupt_and_removed(
    mooncake_url: str, offset: int, what: str
) -> None:
    keys, pages, metas = make_pages(3, PAGE, split=SPLIT)
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, placement="local")) as storage:
        await storage.put(keys, pages, metas)
        _flip_in_segment(storage, keys[1], offset)
        into = buffers(3, PAGE, split=SPLIT)
        outcomes = await storage.get(keys, into, namespace=NS)
        assert outcomes == [Outcome.OK, Outcome.CORRUPT, Outcome.OK], what
        assert joined(into[0]) == joined(pages[0])
        assert joined(into[2]) == joined(pages[2])
        # The damaged page went to the engine's path, which removed it.
        assert storage.direct_pages == 2
        assert storage.stats().corrupt == 1
        assert await storage.read_raw(keys[1]) is None


async def test_other_namespace_is_left_in_place(mooncake_url: str) -> None:
    keys, pages, metas = make_pages(2, PAGE, split=SPLIT)
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, placement="local")) as storage:
        await storage.put(keys, pages, metas)
        outcomes = await storage.get(keys, buffers(2, PAGE, split=SPLIT), namespace=OTHER_NS)
        assert outcomes == [Outcome.MISS] * 2
        assert storage.direct_pages == 0
        assert await storage.exists(keys) == 2


async def test_in_place_reads_check_the_mac(mooncake_url: str) -> None:
    url = fresh_url(mooncake_url, placement="local")
    keys, pages, metas = make_pages(2, PAGE, split=SPLIT)
    async with MooncakeStorage.from_url(url, mac_key=MAC_KEY) as writer:
        await writer.put(keys, pages, metas)
        into = buffers(2, PAGE, split=SPLIT)
        assert await writer.get(keys, into, namespace=NS) == [Outcome.OK] * 2
        assert writer.direct_pages == 2
    # The same client (from the idle pool), so the same segment, with another key.
    async with MooncakeStorage.from_url(url, mac_key=bytes(32)) as reader:
        assert _endpoints(reader, keys) == {reader._store.get_hostname()}
        outcomes = await reader.get(keys, buffers(2, PAGE, split=SPLIT), namespace=NS)
        assert outcomes == [Outcome.CORRUPT] * 2
        assert reader.direct_pages == 0


async def test_objects_elsewhere_or_of_another_size_are_not_read_in_place(
    mooncake_url: str,
) -> None:
    keys, pages, metas = make_pages(2, PAGE, split=SPLIT)
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, placement="local")) as storage:
        await storage.put(keys, pages, metas)
        store = storage._store
        names = [storage._mkey(k) for k in keys]
        size = HEADER_NBYTES + PAGE
        own = LocalObjects(store.get_hostname())
        found = own.sources(store, names, [size, size])
        assert sorted(found) == [0, 1]
        assert bytes(found[0][HEADER_NBYTES:]) == joined(pages[0])
        assert found[0].readonly
        assert sorted(own.sources(store, names, [size, size - 1])) == [0]
        assert LocalObjects("127.0.0.1:1").sources(store, names, [size, size]) == {}
        assert own.sources(store, [storage._mkey(os.urandom(32))], [size]) == {}
        # A lookup that fails (here the binding refuses the argument) leaves every page to
        # the engine's path instead of failing the get.
        assert own.sources(store, [b"not a str"], [size]) == {}  # type: ignore[list-item]
        with pytest.raises(ValueError, match="endpoint"):
            LocalObjects("")


def test_readable_mapping_of_this_process() -> None:
    array = np.ones(1 << 20, dtype=np.uint8)
    address = int(array.ctypes.data)
    found = readable_mapping(address, array.nbytes)
    assert found is not None
    start, stop = found
    assert start <= address
    assert address + array.nbytes <= stop


def test_readable_mapping_from_a_maps_listing() -> None:
    maps = "\n".join(
        [
            "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/python3",
            "7f0000000000-7f0000100000 rw-p 00000000 00:00 0",
            "7f0000100000-7f0000200000 ---p 00000000 00:00 0",
            "7f0000200000-7f0000300000 rw-p 00000000 00:00 0",
            "garbage line",
            "zz-yy rw-p 0 0 0",
        ]
    )
    assert readable_mapping(0x7F0000000010, 16, maps) == (0x7F0000000000, 0x7F0000100000)
    assert readable_mapping(0x7F00000FFFF0, 16, maps) == (0x7F0000000000, 0x7F0000100000)
    # Unreadable, spanning two mappings, or in no mapping at all.
    assert readable_mapping(0x7F0000100010, 16, maps) is None
    assert readable_mapping(0x7F00000FFFF0, 32, maps) is None
    assert readable_mapping(0x10, 16, maps) is None
    # Contiguous readable mappings (one region the kernel lists in parts) count as one.
    parts = "7f0000000000-7f0000001000 rw-p 0 0 0\n7f0000001000-7f0000002000 r--p 0 0 0"
    assert readable_mapping(0x7F0000000800, 0x1000, parts) == (0x7F0000000000, 0x7F0000002000)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"placement": "near"}, "placement must be one of any, local"),
        ({"placement": "local", "segment_size": "0"}, "placement=local needs a segment"),
        ({"direct_reads": "maybe"}, "direct_reads"),
    ],
)
def test_bad_placement_parameters(mooncake_url: str, params: dict[str, str], match: str) -> None:
    with pytest.raises(StorageConfigError, match=match):
        MooncakeStorage.from_url(fresh_url(mooncake_url, **params))


def test_no_segment_means_no_direct_reads(mooncake_url: str) -> None:
    storage = MooncakeStorage.from_url(fresh_url(mooncake_url, segment_size="0"))
    assert storage.placement == "any"
    assert storage._direct_reads is False


async def test_pages_of_any_placement_round_trip_with_both_paths(mooncake_url: str) -> None:
    # Placement by the master: pages land in any client's segment of this test session.
    # Whichever path reads each one, the bytes are the page's.
    count = 24
    keys, pages, metas = make_pages(count, PAGE, split=SPLIT)
    async with MooncakeStorage.from_url(fresh_url(mooncake_url, placement="any")) as storage:
        assert storage.placement == "any"
        await storage.put(keys, pages, metas)
        into = buffers(count, PAGE, split=SPLIT)
        assert await storage.get(keys, into, namespace=NS) == [Outcome.OK] * count
        assert [joined(p) for p in into] == [joined(p) for p in pages]
        own = storage._store.get_hostname()
        names = [storage._mkey(k) for k in keys]
        described = storage._store.batch_get_replica_desc(names)
        local = sum(
            described[n][0].get_memory_descriptor().buffer_descriptor.transport_endpoint == own
            for n in names
        )
        assert storage.direct_pages == local
