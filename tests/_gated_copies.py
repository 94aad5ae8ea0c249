"""What the tests of `Request.load()` share: a small cache, host-only prefixes, and a gated copy
engine that holds each host -> device copy until the test lands it (or refuses it, or finishes
it inside `copy()`), so every interleaving is chosen, not timed. The `gate` fixture is in
conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Literal

from hicache_async import CacheConfig, HiCache, KVLayout, KVPool, Request
from hicache_async.testing import KVGenerator, assert_drained
from hicache_async.transfer import CopyStatistics, CpuCopyEngine, LayerwiseCopy

PAGE = 4
A = list(range(100, 100 + 2 * PAGE))  # a host-only prefix: two pages
B = [*A, *range(200, 200 + 2 * PAGE)]  # A and two pages to compute


def config() -> CacheConfig:
    return CacheConfig(
        layout=KVLayout(num_layers=3, num_kv_heads=1, head_dim=4),
        page_size=PAGE,
        device_pages=8,
        host_pages=16,
    )


class HeldCopy(LayerwiseCopy):
    """A copy the gate holds; `joined` is set once someone besides the cache waits for it."""

    __slots__ = ("joined", "registrations")

    def __init__(self, inner: LayerwiseCopy) -> None:
        super().__init__(asyncio.get_running_loop(), inner.num_layers, inner.num_pages)
        self.registrations = 0
        self.joined = asyncio.Event()

    def add_done_callback(self, fn: Callable[[LayerwiseCopy], None]) -> None:
        super().add_done_callback(fn)
        self.registrations += 1
        if self.registrations > 1:  # the first is the cache's own bookkeeping
            self.joined.set()


Mode = Literal["free", "hold", "refuse", "finish_inside"]


class GatedEngine:
    """A real CPU copy engine that, for non-empty copies into `device`, does as `mode` says:
    "hold" them until `land()`, "refuse" to start them (raise), "finish_inside" `copy()`."""

    def __init__(self) -> None:
        self.inner = CpuCopyEngine()
        self.device: KVPool | None = None
        self.mode: Mode = "free"
        self.held: dict[LayerwiseCopy, LayerwiseCopy] = {}
        self.refused = 0

    def copy(
        self, src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
    ) -> LayerwiseCopy:
        if dst is not self.device or not dst_pages or self.mode == "free":
            return self.inner.copy(src, src_pages, dst, dst_pages)
        if self.mode == "refuse":
            self.refused += 1
            raise RuntimeError("no copy stream available")
        if self.mode == "finish_inside":
            for s, d in zip(src_pages, dst_pages, strict=True):
                dst.write_page(d, src.read_page(s))
            done = LayerwiseCopy(asyncio.get_running_loop(), src.layout.num_layers, len(dst_pages))
            done._layer_landed(done.num_layers - 1)
            return done
        inner = self.inner.copy(src, src_pages, dst, dst_pages)
        outer = HeldCopy(inner)
        self.held[outer] = inner
        return outer

    async def land(self, outer: LayerwiseCopy) -> None:
        """Wait for the real copy, then complete `outer` without yielding afterwards."""
        inner = self.held.pop(outer)
        with contextlib.suppress(Exception):  # a failure is passed on below
            await inner
        error = inner.exception()
        if error is None:
            outer._layer_landed(outer.num_layers - 1)
        else:
            outer._fail(error)

    async def open(self) -> None:
        """Land everything held and hold nothing more."""
        self.mode = "free"
        while self.held:
            await self.land(next(iter(self.held)))

    async def aclose(self) -> None:
        await self.inner.aclose()

    def statistics(self) -> CopyStatistics:
        return self.inner.statistics()


@contextlib.asynccontextmanager
async def host_cache(
    gate: GatedEngine | None, *prefixes: list[int], mode: Mode = "free"
) -> AsyncIterator[tuple[HiCache, KVGenerator]]:
    """A cache copying through `gate` with `prefixes` host-only, and the generator of their
    pages; from then on the gate treats copies to the cache's device as `mode` says. Left
    without an error, the cache is drained and must hold nothing more (`assert_drained`)."""
    generator = KVGenerator(config().layout, PAGE, seed=1)
    async with HiCache(config(), copy_engine=gate) as cache:
        for tokens in prefixes:
            await host_only(cache, generator, tokens)
        if gate is not None:
            gate.device, gate.mode = cache.device_pool, mode
        yield cache, generator
        await cache.drain()
        assert_drained(cache)


async def host_only(cache: HiCache, generator: KVGenerator, tokens: list[int]) -> None:
    """Compute and commit `tokens` (whole pages), let the write-through land, then drop them
    off the device."""
    with cache.request(tokens) as req:
        pages = await req.allocate(len(tokens))
        for i, page in enumerate(pages):
            generator.fill_page(cache.device_pool, page, tokens, i)
        req.commit()
    await cache.drain()
    evict_device(cache)
    info = cache.match(tokens)
    assert (info.device_tokens, info.host_tokens) == (0, len(tokens))


def evict_device(cache: HiCache) -> None:
    """Drop every unlocked page off the device (backed up on the host already)."""
    eviction = cache.tree.evict_device(10**6, backup_first=True)
    assert not eviction.needs_backup
    cache._device_free(eviction.freed)


async def compute_rest(cache: HiCache, generator: KVGenerator, req: Request) -> list[int]:
    """Allocate and fill the pages after the cached prefix, as a model would."""
    first = req.cached_tokens // PAGE
    pages = await req.allocate(req.num_tokens - req.cached_tokens)
    for offset, page in enumerate(pages):
        generator.fill_page(cache.device_pool, page, req.tokens, first + offset)
    return pages


def check_table(cache: HiCache, generator: KVGenerator, req: Request, pages: int) -> None:
    assert len(req.page_table) >= pages
    for i in range(pages):
        generator.check_page(cache.device_pool, req.page_table[i], req.tokens, i)


def commit_checked(cache: HiCache, generator: KVGenerator, req: Request) -> int:
    """Commit `req`, then check its whole page table: the pages the commit inserted."""
    inserted = req.commit()
    check_table(cache, generator, req, len(req.tokens) // PAGE)
    return inserted


async def finish(cache: HiCache, generator: KVGenerator, req: Request) -> int:
    """Compute the rest of `req` and commit it, checking its page table: what it inserted."""
    await compute_rest(cache, generator, req)
    return commit_checked(cache, generator, req)


def assert_landed(req: Request, load: LayerwiseCopy, tokens: int) -> None:
    """`load` is done and already booked: `req` has `tokens` on the device, loading no more."""
    assert load.done()
    assert req.device_tokens == tokens
    assert "loading=False" in repr(req)


def held(copy: LayerwiseCopy) -> HeldCopy:
    assert isinstance(copy, HeldCopy), "the gate did not hold this copy"
    return copy


async def start_joining(
    first: Request, second: Request
) -> tuple[HeldCopy, asyncio.Future[LayerwiseCopy]]:
    """Load `first` (the gate holds its copy), then start `second.load()`: that copy and the
    second load, once it waits for the copy (or, wrongly, finished without)."""
    load = held(await first.load())
    joining = asyncio.ensure_future(second.load())
    joined = asyncio.ensure_future(load.joined.wait())
    await asyncio.wait([joining, joined], return_when=asyncio.FIRST_COMPLETED)
    joined.cancel()
    assert not joining.done(), "the second load copied the pages again instead of joining"
    return load, joining
