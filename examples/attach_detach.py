"""Attaching, switching and detaching storage while requests are being served.

Run: python examples/attach_detach.py
"""

from __future__ import annotations

import asyncio
import tempfile

import numpy as np

from hicache_async import CacheConfig, HiCache, KVLayout
from hicache_async.testing import KVGenerator, serve


async def main() -> None:
    config = CacheConfig(
        layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=16),
        page_size=16,
        device_pages=64,
        host_pages=256,
        model_id="attach-example",
    )
    model = KVGenerator(config.layout, config.page_size)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 30_000, size=int(rng.integers(40, 200))) for _ in range(40)]
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        async with HiCache(config) as cache:
            print("attached at start:", cache.storage_status().attached)

            async def traffic() -> None:
                for i, prompt in enumerate(prompts):
                    await serve(cache, prompt, model, request_id=f"req-{i}")
                    await asyncio.sleep(0.001)

            serving = asyncio.create_task(traffic())
            await cache.attach_storage(f"file://{first}")
            await asyncio.sleep(0.02)
            # No need to wait for idle: in-flight prefetches are cancelled, backups flushed.
            await cache.detach_storage(flush=True)
            await cache.attach_storage(f"file://{second}")
            status = cache.storage_status()
            print(f"now attached to {status.backend} (generation {status.generation})")
            await serving
            await cache.drain()
            backup = cache.storage_status().backup
            print("pages backed up to the second store:", backup.written_pages if backup else 0)
            await cache.detach_storage()
            await cache.detach_storage()  # detaching twice is harmless
            print("attached at the end:", cache.storage_status().attached)


if __name__ == "__main__":
    asyncio.run(main())
