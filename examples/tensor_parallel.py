"""Two tensor-parallel ranks, each with its own cache over its shard, agreeing as they go.

Each rank is a real process with a gloo group on loopback. Both fill their own store; rank 1
holds fewer prefixes. After a restart they warm up only the entries both have, and a prefetch
that only rank 0 can serve is agreed down to what every rank has. Run:
python examples/tensor_parallel.py
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hicache_async import CacheConfig, HiCache
from hicache_async.distributed import TorchRankGroup
from hicache_async.storage import FileStorage
from hicache_async.testing import KVGenerator, serve

SIZE = 2


def config(rank: int) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8},
            "page_size": 8,
            "device_pages": 64,
            "host_pages": 256,
            "model_id": "tp-example",
            "tp_rank": rank,
            "tp_size": SIZE,
            "prefetch": {"policy": "wait_complete", "threshold_tokens": 8},
        }
    )


PROMPTS = [np.random.default_rng(i).integers(0, 30_000, size=96) for i in range(6)]


async def rank_main(rank: int, port: int, root: Path) -> dict[str, Any]:
    cfg = config(rank)
    model = KVGenerator(cfg.layout, cfg.page_size, seed=rank)  # each rank's own KV shard
    held = PROMPTS if rank == 0 else PROMPTS[:3]
    async with HiCache(cfg, storage=FileStorage(root / f"rank{rank}")) as cache:
        for prompt in held:
            await serve(cache, prompt, model, prefetch=False)
        await cache.drain()
    group = await TorchRankGroup.create(rank, SIZE, port=port)
    async with group:
        restarted = HiCache(cfg, storage=FileStorage(root / f"rank{rank}"), rank_group=group)
        async with restarted as cache:
            warm = await cache.warmup(ratio=1.0)
            handle = await cache.start_prefetch(PROMPTS[5])  # only rank 0 has it
            result = await handle.ready()
            with cache.request(PROMPTS[5], max_cached_tokens=result.agreed_tokens) as req:
                used = req.cached_tokens
    return {
        "entries": warm.entries_agreed,
        "pages": warm.pages_loaded,
        "local": result.cached_tokens,
        "agreed": result.agreed_tokens,
        "used": used,
    }


def run_rank(rank: int, port: int, root: str, results: Any) -> None:
    results.put((rank, asyncio.run(rank_main(rank, port, Path(root)))))


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="hicache-tp-") as root:
        ctx = mp.get_context("spawn")
        results: Any = ctx.Queue()
        procs = [ctx.Process(target=run_rank, args=(r, port, root, results)) for r in range(SIZE)]
        for proc in procs:
            proc.start()
        try:
            reports = dict(results.get(timeout=120) for _ in procs)
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
        for rank in sorted(reports):
            r = reports[rank]
            print(
                f"rank {rank}: warmed {r['entries']} agreed entries ({r['pages']} pages); "
                f"prefetch had {r['local']} tokens locally, agreed {r['agreed']}, used {r['used']}"
            )
        same = len({(r["entries"], r["pages"], r["used"]) for r in reports.values()}) == 1
        print("ranks agree" if same else "ranks DISAGREE")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
