"""One tensor-parallel rank of a cache test world, run in a spawned process.

Each rank keeps its own shard store (its own root; the namespace holds tp_rank anyway),
fills it, then plays the scenarios of tests/test_tp_cache.py with a fresh gloo group each,
reporting ``(rank, scenario, result)`` on a queue. The parent enforces a hard deadline.
"""

from __future__ import annotations

import asyncio
import shutil
import traceback
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import numpy as np

from hicache_async import CacheConfig, HiCache
from hicache_async.distributed import TorchRankGroup
from hicache_async.storage import FileStorage
from hicache_async.testing import KVGenerator, serve

PAGE = 4
PROMPTS = 10


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


async def scenario(rank: int, size: int, name: str, port: int, base: Path) -> dict[str, Any]:
    root = base / f"{name}-rank{rank}"
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
