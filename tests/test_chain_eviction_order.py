"""The built-in stores with a capacity evict a prefix chain's deepest pages first.

A prefix is found in storage only up to its first missing page, so evicting a chain from its
root (its oldest page under plain LRU) makes all of it useless. Within one call the first key
is the most recently used, and `exists` counts as a use, so a shared prefix that every new
chain is checked against stays while the leaves of old chains go.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import (
    HEADER_NBYTES,
    FileStorage,
    MemoryStorage,
    Outcome,
    PageMeta,
    StorageBackend,
)
from hicache_async.testing import KVGenerator, serve

NS = b"chain-eviction-1"
PAGE = 4096
SIZE = HEADER_NBYTES + PAGE

Store = Callable[[int], StorageBackend]


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    def make(capacity_pages: int) -> StorageBackend:
        if request.param == "memory":
            return MemoryStorage(capacity_bytes=capacity_pages * SIZE)
        return FileStorage(tmp_path / "store", capacity_bytes=capacity_pages * SIZE)

    return make


def _chain(length: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(length)]


async def _put(storage: StorageBackend, keys: list[bytes]) -> list[Outcome]:
    pages = [[memoryview(bytearray(key[:1] * PAGE))] for key in keys]
    metas = [PageMeta(key=k, namespace=NS, num_tokens=8) for k in keys]
    return await storage.put(keys, pages, metas)


async def _present(storage: StorageBackend, keys: list[bytes]) -> list[bool]:
    """Which of `keys` the store holds, asked one at a time (so the order is kept)."""
    buffers = [[memoryview(bytearray(PAGE))] for _ in keys]
    outcomes = await storage.get(keys, buffers, namespace=NS)
    return [outcome is Outcome.OK for outcome in outcomes]


async def test_a_chain_put_in_one_batch_loses_its_deepest_pages_first(store: Store) -> None:
    chain, other = _chain(4), _chain(2)
    async with store(4) as storage:
        assert await _put(storage, chain) == [Outcome.OK] * 4
        assert await _put(storage, other) == [Outcome.OK] * 2
        assert await storage.exists(chain) == 2  # the root and the page below it stayed
        assert storage.stats().evictions == 2


async def test_a_chain_looked_up_outlives_a_newer_one(store: Store) -> None:
    shared, newer, newest = _chain(2), _chain(2), _chain(1)
    async with store(4) as storage:
        await _put(storage, shared)
        await _put(storage, newer)
        assert await storage.exists(shared) == 2  # a use, like a read
        await _put(storage, newest)
        assert await storage.exists(shared) == 2
        assert await storage.exists(newer) == 1  # the newer chain lost its leaf


async def test_a_chain_read_keeps_its_root_longest(store: Store) -> None:
    chain, other = _chain(3), _chain(1)
    async with store(4) as storage:
        await _put(storage, chain[2:])
        await _put(storage, chain[:2])
        await _put(storage, other)
        assert await _present(storage, chain) == [True] * 3  # read: root first in the batch
        for _ in range(3):
            await _put(storage, _chain(1))
        # Three newer pages: the chain keeps only its root, which its read touched last.
        assert await storage.exists(chain) == 1


def _config() -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
            "page_size": 8,
            "device_pages": 64,
            "host_pages": 256,
            "model_id": "chain-eviction-test",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": 8},
            # This store cycles through its capacity within milliseconds: every batch asks
            # about (and so touches) the shared prefix, as batches 2 s apart would.
            "backup": {"check_prefix_interval_s": 0},
        }
    )


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_a_full_store_keeps_the_shared_prefix_and_the_newest_chain(
    kind: str, tmp_path: Path
) -> None:
    # Prompts share a 10-page system prompt; the store holds 20 pages, so it fills up after
    # two prompts. Evicting by plain LRU took the system prompt first and left nothing
    # reachable; now a new instance finds the newest prompt whole.
    config = _config()
    generator = KVGenerator(config.layout, config.page_size, seed=7)
    rng = np.random.default_rng(7)
    system = rng.integers(0, 5000, size=10 * 8)
    prompts = [np.concatenate([system, rng.integers(0, 5000, size=6 * 8)]) for _ in range(8)]
    capacity = 20 * (HEADER_NBYTES + config.page_nbytes)
    memory = MemoryStorage(capacity_bytes=capacity)

    def backend() -> StorageBackend | str:
        if kind == "memory":
            return Unowned(memory)  # both caches share it
        return f"file://{tmp_path / 'l3'}?capacity={capacity}"

    async with memory:
        async with HiCache(config, storage=backend()) as first:
            for prompt in prompts:
                await serve(first, prompt, generator)
                await first.drain()
            status = first.storage_status()
            assert status.storage is not None
            assert status.storage.evictions > 0
        async with HiCache(config, storage=backend()) as second:
            newest = await serve(second, prompts[-1], generator, check="all")
            other = await serve(second, prompts[0], generator, check="all")
    assert newest.storage_tokens == len(prompts[-1])  # whole, every page checked
    assert newest.checked_pages == len(prompts[-1]) // 8
    assert other.storage_tokens == 0  # its own pages went; the shared ones came from host
    assert other.device_tokens + other.host_tokens >= len(system)
