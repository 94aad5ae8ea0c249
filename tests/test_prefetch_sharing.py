"""Prefetches that share reads: one giving up never makes another give up, and a page read
once counts once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import numpy as np
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache, PrefetchStatus
from hicache_async.storage import MemoryStorage, Outcome, PageBuffer, StorageBackend
from hicache_async.testing import KVGenerator, assert_drained, serve

PAGE = 4
PAGES = 8


def _config() -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "prefetch-sharing-test",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE, "batch_pages": 4},
        }
    )


class HeldGets(Unowned):
    """A real backend whose gets, once done, wait for `gate` while it is set."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate: asyncio.Future[None] | None = None
        self.held = asyncio.Event()
        self.gets = 0

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        self.gets += 1
        outcomes = await self.inner.get(keys, into, namespace=namespace)
        gate = self.gate
        if gate is not None:
            self.held.set()
            await gate
        return outcomes


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def _stored(memory: MemoryStorage, config: CacheConfig, prompt: np.ndarray) -> KVGenerator:
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with HiCache(config, storage=Unowned(memory)) as writer:
        await serve(writer, prompt, generator, prefetch=False)
        await writer.drain()
    return generator


async def test_a_prefetch_whose_shared_reads_were_given_up_reads_the_pages_itself() -> None:
    # B waited on A's reads; A's caller was cancelled mid-batch, and B ended TERMINATED with
    # nothing although every page was in storage and nobody had asked B to stop.
    config = _config()
    prompt = np.random.default_rng(5).integers(0, 5000, size=PAGES * PAGE)
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        generator = await _stored(memory, config, prompt)
        held = HeldGets(memory)
        async with HiCache(config, storage=held) as reader:
            held.gate = asyncio.get_running_loop().create_future()
            first = asyncio.create_task(reader.prefetch(prompt, request_id="A"))
            await asyncio.wait_for(held.held.wait(), 30)  # A's first batch is read, not landed
            second = await reader.start_prefetch(prompt, request_id="B")
            link = reader._link
            assert link is not None
            await _until(lambda: len(link.prefetcher._running) == 2, "B to wait on A's reads")
            held.gate = None  # B's own reads go through
            first.cancel()
            result = await asyncio.wait_for(second.wait(), 30)
            assert result.status is PrefetchStatus.COMPLETE
            assert result.storage_tokens == len(prompt)
            assert reader.statistics().tokens.storage == len(prompt)  # A landed nothing
            served = await serve(reader, prompt, generator, prefetch=False, check="all")
            assert served.host_tokens == len(prompt)
            await reader.drain()
            assert_drained(reader)


async def test_pages_read_once_for_two_prefetches_count_once_in_the_storage_tokens() -> None:
    config = _config()
    prompt = np.random.default_rng(6).integers(0, 5000, size=PAGES * PAGE)
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        generator = await _stored(memory, config, prompt)
        held = HeldGets(memory)
        async with HiCache(config, storage=held) as reader:
            held.gate = asyncio.get_running_loop().create_future()
            first = await reader.start_prefetch(prompt, request_id="A")
            await asyncio.wait_for(held.held.wait(), 30)
            second = await reader.start_prefetch(prompt, request_id="B")
            link = reader._link
            assert link is not None
            await _until(lambda: len(link.prefetcher._running) == 2, "B to wait on A's reads")
            gate, held.gate = held.gate, None
            gate.set_result(None)
            one, two = await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), 30)
            assert one.status is two.status is PrefetchStatus.COMPLETE
            # Each reports what it has from storage; the cache counts each page read once.
            assert one.storage_tokens == two.storage_tokens == len(prompt)
            assert held.gets == PAGES // 4
            assert reader.statistics().tokens.storage == len(prompt)
            await serve(reader, prompt, generator, prefetch=False, check="all")
            await reader.drain()
            assert_drained(reader)
