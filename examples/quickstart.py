"""Quickstart: a cache with device, host and file storage tiers, and one prompt served twice.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import asyncio
import tempfile

from hicache_async import CacheConfig, HiCache, KVLayout
from hicache_async.testing import KVGenerator


async def main() -> None:
    config = CacheConfig(
        layout=KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16"),
        page_size=16,
        device_pages=64,
        host_pages=256,
        model_id="quickstart",
    )
    # The embedded default is files under ~/.cache/hicache_async; a private root keeps the
    # example self-contained.
    with tempfile.TemporaryDirectory(prefix="hicache-quickstart-") as root:
        model = KVGenerator(config.layout, config.page_size)  # stands in for a model's KV
        prompt = list(range(1000, 1100))

        async with HiCache(config, storage=f"file://{root}") as cache:
            for attempt in (1, 2):
                await cache.prefetch(prompt, request_id=f"attempt-{attempt}")
                with cache.request(prompt, request_id=f"attempt-{attempt}") as req:
                    load = await req.load()
                    for layer in range(config.layout.num_layers):
                        await load.layer(layer)  # a model computes layer `layer` here
                    cached = req.cached_tokens
                    pages = await req.allocate(len(prompt) - cached)
                    first = cached // config.page_size
                    for offset, page in enumerate(pages[: len(prompt) // config.page_size - first]):
                        model.fill_page(cache.device_pool, page, prompt, first + offset)
                    req.commit()
                print(f"attempt {attempt}: {cached} of {len(prompt)} tokens came from the cache")
            await cache.drain()
            print(cache)


if __name__ == "__main__":
    asyncio.run(main())
