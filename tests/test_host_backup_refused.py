"""Device -> host backups the copy engine refuses to start, or that a split cuts in two while
they run: a backup is optional, so neither may fail the caller, leak a page or lock, or copy
the same pages twice."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from hicache_async import CacheConfig, HiCache, KVLayout, KVPool, OutOfPagesError
from hicache_async.testing import KVGenerator, assert_drained, serve
from hicache_async.transfer import CopyStatistics, CpuCopyEngine, LayerwiseCopy
from tests._gated_copies import HeldCopy, evict_device

PAGE = 4


def config(policy: str, *, device_pages: int = 8, host_pages: int = 16) -> CacheConfig:
    return CacheConfig(
        layout=KVLayout(num_layers=2, num_kv_heads=1, head_dim=4),
        page_size=PAGE,
        device_pages=device_pages,
        host_pages=host_pages,
        write_policy=policy,
        write_through_threshold=2,  # selective: the first reuse
    )


class BackupGate:
    """A real CPU engine that, for copies out of `device`, does as `mode` says: "refuse" to
    start them (raise, as an engine without a free stream would) or "hold" them until
    `open()`. Every other copy runs as it is."""

    def __init__(self) -> None:
        self.inner = CpuCopyEngine()
        self.device: KVPool | None = None
        self.mode = "free"
        self.backups: list[int] = []  # pages per device -> host copy started
        self.held: dict[LayerwiseCopy, LayerwiseCopy] = {}

    def copy(
        self, src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
    ) -> LayerwiseCopy:
        if src is not self.device or not src_pages or self.mode == "free":
            return self.inner.copy(src, src_pages, dst, dst_pages)
        if self.mode == "refuse":
            raise RuntimeError("no copy stream available")
        self.backups.append(len(src_pages))
        inner = self.inner.copy(src, src_pages, dst, dst_pages)
        outer = HeldCopy(inner)
        self.held[outer] = inner
        return outer

    async def open(self) -> None:
        self.mode = "free"
        while self.held:
            outer, inner = self.held.popitem()
            await inner
            outer._layer_landed(outer.num_layers - 1)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def statistics(self) -> CopyStatistics:
        return self.inner.statistics()


async def commit(cache: HiCache, generator: KVGenerator, tokens: list[int]) -> None:
    with cache.request(tokens) as req:
        pages = await req.allocate(len(tokens))
        for i, page in enumerate(pages):
            generator.fill_page(cache.device_pool, page, tokens, i)
        req.commit()


def host_used(cache: HiCache) -> int:
    assert cache.host_pool is not None
    return cache.host_pool.allocator.used_count


async def test_a_refused_write_through_backup_leaves_the_commit_and_the_pools_whole() -> None:
    gate = BackupGate()
    generator = KVGenerator(config("write_through").layout, PAGE, seed=3)
    prompt = list(range(4 * PAGE))
    async with HiCache(config("write_through"), copy_engine=gate) as cache:
        gate.device, gate.mode = cache.device_pool, "refuse"
        await commit(cache, generator, prompt)  # the commit itself must not raise
        assert cache.statistics().counters["copy_failures"] == 1
        assert host_used(cache) == 0
        await cache.drain()
        assert_drained(cache)
        # Nothing stays locked or in flight: the whole device pool can be taken, evicting.
        other = list(range(1000, 1000 + 8 * PAGE))
        with cache.request(other) as req:
            assert len(await req.allocate(len(other))) == 8
        # Backups run again once the engine copies again.
        gate.mode = "free"
        await commit(cache, generator, other)
        await cache.drain()
        assert cache.statistics().tree.host_pages == 8
        assert_drained(cache)
    await gate.aclose()


async def test_a_refused_write_back_eviction_drops_the_pages_instead() -> None:
    gate = BackupGate()
    generator = KVGenerator(config("write_back").layout, PAGE, seed=4)
    async with HiCache(config("write_back"), copy_engine=gate) as cache:
        first = list(range(6 * PAGE))
        await commit(cache, generator, first)
        gate.device, gate.mode = cache.device_pool, "refuse"
        other = list(range(1000, 1000 + 8 * PAGE))
        with cache.request(other) as req:
            try:
                pages = await asyncio.wait_for(req.allocate(len(other)), 30)
            except OutOfPagesError as exc:
                pytest.fail(f"the eviction could have dropped the pages: {exc}")
            assert len(pages) == 8
        assert cache.match(first).device_tokens == 0
        assert cache.statistics().counters["copy_failures"] >= 1
        await cache.drain()
        assert_drained(cache)
    await gate.aclose()


async def test_a_refused_selective_backup_still_returns_the_request() -> None:
    gate = BackupGate()
    policy = "write_through_selective"
    generator = KVGenerator(config(policy).layout, PAGE, seed=5)
    prompt = list(range(4 * PAGE))
    async with HiCache(config(policy), copy_engine=gate) as cache:
        await commit(cache, generator, prompt)
        gate.device, gate.mode = cache.device_pool, "refuse"
        req = cache.request(prompt)  # the hit makes the prefix hot: a backup it cannot start
        try:
            assert req.cached_tokens == len(prompt)
        finally:
            req.release()
        assert cache.statistics().counters["copy_failures"] == 1
        await cache.drain()
        assert_drained(cache)
        assert host_used(cache) == 0
    await gate.aclose()


async def test_a_split_during_a_backup_does_not_copy_the_head_again() -> None:
    gate = BackupGate()
    policy = "write_through_selective"
    cfg = config(policy, device_pages=32, host_pages=32)
    generator = KVGenerator(cfg.layout, PAGE, seed=6)
    prompt = list(range(8 * PAGE))
    async with HiCache(cfg, copy_engine=gate) as cache:
        try:
            await serve(cache, prompt, generator, check="all")
            gate.device, gate.mode = cache.device_pool, "hold"
            cache.request(prompt).release()  # a hit: the 8 pages' backup starts, held
            assert gate.backups == [8]
            # A shorter prompt splits the node while its backup runs, and hits the head.
            cache.request(prompt[: 4 * PAGE]).release()
            assert gate.backups == [8], "the split's head was copied a second time"
            cache.request(prompt).release()  # a hit on the head and the tail
            assert gate.backups == [8], "the split's tail was copied a second time"
            assert host_used(cache) == 8
        finally:
            await gate.open()
        await cache.drain()
        assert cache.statistics().counters["host_backup_pages"] == 8
        assert cache.statistics().tree.host_pages == 8
        assert_drained(cache)
    await gate.aclose()


async def test_write_through_backs_up_every_node_a_commit_publishes() -> None:
    cfg = config("write_through", device_pages=32, host_pages=32)
    generator = KVGenerator(cfg.layout, PAGE, seed=7)
    shared = list(range(100, 100 + 4 * PAGE))
    longer = [*shared, *range(500, 500 + 2 * PAGE)]
    async with HiCache(cfg) as cache:
        first, second = cache.request(shared), cache.request(longer)
        for req in (first, second):
            pages = await req.allocate(len(req.tokens))
            for i, page in enumerate(pages):
                generator.fill_page(cache.device_pool, page, req.tokens, i)
        # No await between: the second commit's path starts with the node the first just
        # published, whose backup is still in flight; the node after it needs its own.
        first.commit()
        second.commit()
        first.release()
        second.release()
        await cache.drain()
        assert [n.num_pages for n in cache.tree.iter_nodes() if not n.on_host] == []
        assert cache.statistics().tree.host_pages == 6
        assert_drained(cache)
        # The host copies hold the right data: off the device, the prompt loads from them.
        evict_device(cache)
        assert cache.match(longer).host_tokens == len(longer)
        served = await serve(cache, longer, generator, check="loaded")
        assert (served.host_tokens, served.checked_pages) == (len(longer), 6)
        await cache.drain()
        assert_drained(cache)
