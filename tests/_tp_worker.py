"""One tensor-parallel rank of a cache test world, run in a spawned process.

Each rank keeps its own shard store (its own root; the namespace holds tp_rank anyway),
fills it, then plays the scenarios of tests/test_tp_cache.py with a fresh gloo group each,
reporting ``(rank, scenario, result)`` on a queue. The parent enforces a hard deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import numpy as np

from hicache_async import CacheConfig, HiCache
from hicache_async.distributed import TorchRankGroup
from hicache_async.storage import FileStorage, Outcome, PageBuffer
from hicache_async.testing import KVGenerator, serve

PAGE = 4
PROMPTS = 10


#: the collective timeout of the regression scenarios: a rank left waiting fails in seconds.
SHORT_TIMEOUT_S = 15.0


def config(rank: int, size: int, **overrides: object) -> CacheConfig:
    base: dict[str, object] = {
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4},
        "page_size": PAGE,
        "device_pages": 64,
        "host_pages": 256,
        "model_id": "tp-test",
        "tp_rank": rank,
        "tp_size": size,
        "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
    }
    base.update(overrides)
    return CacheConfig.from_dict(base)


def prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(42)
    return [
        rng.integers(0, 40_000, size=int(rng.integers(4 * PAGE, 10 * PAGE))) for _ in range(PROMPTS)
    ]


def held_by(rank: int, scenario: str) -> list[int]:
    """Which prompts rank `rank` has in storage for a scenario."""
    if scenario == "different":
        return [i for i in range(PROMPTS) if i % (rank + 2) != 1]
    if scenario == "prefetch":
        return [0] if rank == 0 else []
    return list(range(PROMPTS))


async def fill(root: Path, rank: int, size: int, which: list[int]) -> None:
    cfg = config(rank, size)
    generator = KVGenerator(cfg.layout, PAGE, seed=rank)
    all_prompts = prompts()
    async with HiCache(cfg, storage=FileStorage(root)) as cache:
        for i in which:
            await serve(cache, all_prompts[i], generator, prefetch=False)
        await cache.drain()


def shape(cache: HiCache) -> dict[str, Any]:
    stats = cache.statistics().tree
    per_prompt = [
        (info.device_tokens, info.host_tokens) for info in (cache.match(p) for p in prompts())
    ]
    return {
        "host_pages": stats.host_pages,
        "device_pages": stats.device_pages,
        "prompts": per_prompt,
    }


def extra_prompts() -> list[np.ndarray]:
    """Three 10-page prompts outside `prompts()`."""
    rng = np.random.default_rng(11)
    return [rng.integers(0, 40_000, size=10 * PAGE) for _ in range(3)]


class SteeredStorage(FileStorage):
    """A FileStorage whose reads can be slowed down or held, to put a rank at a chosen point.

    Reads of pages whose first storage key is in `slow_keys` sleep `slow_s`, other reads
    `other_s`; with `hold`, every read first waits for `release`. `entered` is set when the
    first read starts.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.slow_keys: set[bytes] = set()
        self.slow_s = 0.0
        self.other_s = 0.0
        self.hold = False
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        self.entered.set()
        if self.hold:
            await self.release.wait()
        delay = self.slow_s if keys and keys[0] in self.slow_keys else self.other_s
        if delay:
            await asyncio.sleep(delay)
        return await super().get(keys, into, namespace=namespace)


def group_stats(group: TorchRankGroup) -> dict[str, Any]:
    stats = group.statistics()
    return {"collectives": stats.collectives, "broken": stats.broken}


async def fill_prompts(root: Path, rank: int, size: int, which: list[np.ndarray]) -> None:
    cfg = config(rank, size)
    generator = KVGenerator(cfg.layout, PAGE, seed=rank)
    async with HiCache(cfg, storage=FileStorage(root)) as cache:
        for prompt in which:
            await serve(cache, prompt, generator, prefetch=False)
        await cache.drain()


async def background_warmup(rank: int, size: int, port: int, root: Path) -> dict[str, Any]:
    """The library's own warmup (warmup.enabled) runs while a request prefetches.

    Every rank has prompts 0-8; of the extra prompt, rank 0 has 4 pages and the others all
    10, so the request's agreement is 4 pages everywhere. Rank 0 reads the request's pages
    slowly and warmup's quickly, the others the other way round, so without ordering the
    ranks would pair the request's agreement with a warmup one.
    """
    prompt = extra_prompts()[0]
    await fill_prompts(
        root, rank, size, [*prompts()[:9], prompt[: 4 * PAGE] if rank == 0 else prompt]
    )
    group = await TorchRankGroup.create(rank, size, port=port, timeout_s=SHORT_TIMEOUT_S)
    async with group:
        cfg = config(rank, size, warmup={"enabled": True, "ratio": 1.0})
        async with HiCache(cfg, rank_group=group) as cache:
            store = SteeredStorage(root)
            store.slow_keys = set(cache.namespace.storage_keys(cache.keys_for(prompt)))
            store.slow_s, store.other_s = (1.0, 0.2) if rank == 0 else (0.0, 1.0)
            await cache.attach_storage(store)
            await asyncio.sleep(0.1)  # let the warmup get going: the race this guards against
            result = await cache.prefetch(prompt)
            with cache.request(prompt, max_cached_tokens=result.agreed_tokens) as req:
                used = req.cached_tokens
            warm = await cache.wait_warmup()
            return {
                "agreed": result.agreed_tokens,
                "used": used,
                "warmup": None if warm is None else warm.status.value,
                **group_stats(group),
            }


@contextlib.asynccontextmanager
async def _rank_0_held(
    rank: int, size: int, port: int, root: Path
) -> AsyncIterator[tuple[TorchRankGroup, SteeredStorage, HiCache]]:
    """A rank of a filled world whose storage reads are held on rank 0 until released."""
    await fill(root, rank, size, list(range(PROMPTS)))
    group = await TorchRankGroup.create(rank, size, port=port, timeout_s=SHORT_TIMEOUT_S)
    async with group:
        store = SteeredStorage(root)
        store.hold = rank == 0
        async with HiCache(config(rank, size), storage=store, rank_group=group) as cache:
            yield group, store, cache


async def cancel_ready(rank: int, size: int, port: int, root: Path) -> dict[str, Any]:
    """Rank 0 cancels its prefetch while ready() waits for the read (its policy wait)."""
    async with _rank_0_held(rank, size, port, root) as (group, store, cache):
        first, second = prompts()[:2]
        out: dict[str, Any] = {}
        if rank == 0:
            task = asyncio.create_task(cache.prefetch(first))
            await store.entered.wait()  # the read is held: ready() waits for it
            task.cancel()
            try:
                await task
                out["first"] = "returned"
            except asyncio.CancelledError:
                out["first"] = "cancelled"
            store.release.set()
        else:
            out["first"] = (await cache.prefetch(first)).agreed_tokens
        result = await cache.prefetch(second)
        out["second"] = {"local": result.cached_tokens, "agreed": result.agreed_tokens}
        out.update(group_stats(group))
        return out


async def cancel_start(rank: int, size: int, port: int, root: Path) -> dict[str, Any]:
    """Every rank starts three prefetches, then makes each ready in turn; rank 0's third
    start is cancelled while it waits for queue room (its one worker held in the first's
    read, the second queued). It must still enter the third's agreement, with 0, where its
    peers do: after the first's and the second's."""
    first, second, third, fourth = prompts()[:4]
    await fill(root, rank, size, list(range(PROMPTS)))
    group = await TorchRankGroup.create(rank, size, port=port, timeout_s=SHORT_TIMEOUT_S)
    async with group:
        store = SteeredStorage(root)
        store.hold = rank == 0
        cfg = config(
            rank,
            size,
            prefetch={
                "policy": "wait_complete",
                "threshold_tokens": PAGE,
                "queue_size": 1,
                "workers": 1,
            },
        )
        async with HiCache(cfg, storage=store, rank_group=group) as cache:
            out: dict[str, Any] = {}
            if rank == 0:
                held = await cache.start_prefetch(first)
                await store.entered.wait()  # the worker is in its read
                queued = await cache.start_prefetch(second)
                waiting = asyncio.create_task(cache.start_prefetch(third))
                await asyncio.sleep(0.05)
                waiting.cancel()
                try:
                    await waiting
                    out["third"] = "started"
                except asyncio.CancelledError:
                    out["third"] = "cancelled"
                store.release.set()
                out["first"] = (await held.ready()).agreed_tokens
                out["second"] = (await queued.ready()).agreed_tokens
            else:
                handles = [await cache.start_prefetch(p) for p in (first, second, third)]
                out["first"], out["second"], out["third"] = [
                    (await handle.ready()).agreed_tokens for handle in handles
                ]
            result = await cache.prefetch(fourth)
            out["fourth"] = {"local": result.cached_tokens, "agreed": result.agreed_tokens}
            out.update(group_stats(group))
            return out


async def cancel_warmup(rank: int, size: int, port: int, root: Path) -> dict[str, Any]:
    """Rank 0's warmup is cancelled while it loads its first entry (between collectives)."""
    async with _rank_0_held(rank, size, port, root) as (group, store, cache):
        out: dict[str, Any] = {}
        task = asyncio.create_task(cache.warmup(ratio=1.0))
        if rank == 0:
            await store.entered.wait()  # inside the first entry's load
            task.cancel()
            try:
                out["warmup"] = (await task).status.value
            except asyncio.CancelledError:
                out["warmup"] = "cancelled"
            store.release.set()
        else:
            out["warmup"] = (await task).status.value
        out["shape"] = shape(cache)
        result = await cache.prefetch(prompts()[0])
        out["next"] = {"local": result.cached_tokens, "agreed": result.agreed_tokens}
        out.update(group_stats(group))
        return out


async def evict_while_agreeing(rank: int, size: int, port: int, root: Path) -> dict[str, Any]:
    """Two 10-page requests over a 16-page host pool, in the same order on every rank.

    Rank 0 reads the first slowly, so the others wait in its agreement while the second's
    prefetch wants host pages: the prefix they offered must not be evicted meanwhile.
    """
    first, second = extra_prompts()[1:]
    await fill_prompts(root, rank, size, [first, second])
    group = await TorchRankGroup.create(rank, size, port=port, timeout_s=SHORT_TIMEOUT_S)
    async with group:
        cfg = config(
            rank,
            size,
            host_pages=16,
            prefetch={"policy": "wait_complete", "threshold_tokens": PAGE, "max_host_share": 1.0},
        )
        store = SteeredStorage(root)
        async with HiCache(cfg, storage=store, rank_group=group) as cache:
            if rank == 0:
                store.slow_keys = set(cache.namespace.storage_keys(cache.keys_for(first)))
                store.slow_s = 1.0
            first_handle = await cache.start_prefetch(first)

            async def start_second() -> Any:
                await asyncio.sleep(0.3)  # while the others wait in the first's agreement
                return await cache.start_prefetch(second)

            second_task = asyncio.create_task(start_second())
            out: dict[str, Any] = {}
            for name, prompt in (("first", first), ("second", second)):
                handle = first_handle if name == "first" else await second_task
                result = await handle.ready()
                with cache.request(prompt, max_cached_tokens=result.agreed_tokens) as req:
                    out[name] = {"agreed": result.agreed_tokens, "used": req.cached_tokens}
            out.update(group_stats(group))
            return out


#: the pages every rank shares of each of `shared_prefixes()`'s prompts: a warmup agreeing only
#: on powers of two would load 4, 4 and 8 of them
SHARED_PAGES = (5, 7, 13)


def shared_prefixes() -> list[np.ndarray]:
    """Three 16-page prompts."""
    rng = np.random.default_rng(13)
    return [rng.integers(0, 40_000, size=16 * PAGE) for _ in SHARED_PAGES]


async def longest_shared(rank: int, size: int, port: int, root: Path) -> dict[str, Any]:
    """Rank 0 backs up each of `shared_prefixes()` whole; odd ranks only its first
    `SHARED_PAGES` pages; other even ranks that many, then 16 pages of their own question
    after them (so no rank records a chain of the shared length, nor anything covering it:
    one entry each, agreed on a power of two). A warmup loads exactly the shared pages."""
    rng = np.random.default_rng(100 + rank)
    mine = [
        prompt
        if rank == 0
        else prompt[: pages * PAGE]
        if rank % 2
        else np.concatenate([prompt[: pages * PAGE], rng.integers(0, 40_000, size=16 * PAGE)])
        for prompt, pages in zip(shared_prefixes(), SHARED_PAGES, strict=True)
    ]
    await fill_prompts(root, rank, size, mine)
    group = await TorchRankGroup.create(rank, size, port=port, timeout_s=SHORT_TIMEOUT_S)
    async with group:
        cfg = config(rank, size)
        generator = KVGenerator(cfg.layout, PAGE, seed=rank)
        async with HiCache(cfg, storage=FileStorage(root), rank_group=group) as cache:
            warm = await cache.warmup(ratio=1.0)
            host = [cache.match(prompt).host_tokens for prompt in shared_prefixes()]
            # Each shared prefix served from the host pool, every page checked against the KV.
            served = [
                await serve(cache, prompt[: pages * PAGE], generator, prefetch=False, check="all")
                for prompt, pages in zip(shared_prefixes(), SHARED_PAGES, strict=True)
            ]
            return {
                "status": warm.status.value,
                "loaded": (warm.entries_agreed, warm.entries_loaded, warm.pages_loaded),
                "host": host,
                "served": [(s.host_tokens, s.computed_tokens, s.checked_pages) for s in served],
                **group_stats(group),
            }


#: scenarios that each reproduce one ordering or cancellation bug between ranks.
REGRESSIONS: dict[str, Callable[[int, int, int, Path], Awaitable[dict[str, Any]]]] = {
    "background_warmup": background_warmup,
    "cancel_ready": cancel_ready,
    "cancel_start": cancel_start,
    "cancel_warmup": cancel_warmup,
    "evict": evict_while_agreeing,
    "longest_shared": longest_shared,
}


async def scenario(rank: int, size: int, name: str, port: int, base: Path) -> dict[str, Any]:
    root = base / f"{name}-rank{rank}"
    if name in REGRESSIONS:
        return await REGRESSIONS[name](rank, size, port, root)
    await fill(root, rank, size, held_by(rank, name))
    if name == "failing" and rank == 1:
        shutil.rmtree(root / "pages")  # the manifest says yes, the pages are gone
    group = await TorchRankGroup.create(rank, size, port=port, timeout_s=60.0)
    async with group:
        cfg = config(rank, size)
        async with HiCache(cfg, storage=FileStorage(root), rank_group=group) as cache:
            if name == "slow" and rank == 1:
                await asyncio.sleep(1.5)
            if name == "prefetch":
                prompt = prompts()[0]
                handle = await cache.start_prefetch(prompt)
                result = await handle.ready()
                with cache.request(prompt, max_cached_tokens=result.agreed_tokens) as req:
                    used = req.cached_tokens
                return {"local": result.cached_tokens, "agreed": result.agreed_tokens, "used": used}
            warm = await cache.warmup(ratio=1.0)
            await cache.drain()
            return {
                "status": warm.status.value,
                "entries_agreed": warm.entries_agreed,
                "loaded": (warm.entries_loaded, warm.pages_loaded, warm.entries_missed),
                "shape": shape(cache),
                "collectives": group.statistics().collectives,
            }


def main(rank: int, size: int, ports: dict[str, int], base: str, results: Queue[Any]) -> None:
    for name, port in ports.items():
        try:
            result = asyncio.run(scenario(rank, size, name, port, Path(base)))
            results.put((rank, name, "ok", result))
        except BaseException:
            results.put((rank, name, "error", traceback.format_exc()))
