"""Cold start: a new instance loads what an earlier one left in shared storage.

The first instance serves a few conversations and backs their KV up to a file store; each
backup also records the prefix's page keys in the store's warmup manifest. A second instance
then starts cold with `warmup.enabled`, loads the most valuable prefixes into its host pool
before traffic arrives, and serves the same prompts from host memory instead of recomputing
them. Every page it uses is checked against the KV generator that stands in for the model.

Run: python examples/cold_start_warmup.py
"""

from __future__ import annotations

import asyncio
import tempfile

import numpy as np

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import FileStorage
from hicache_async.testing import KVGenerator, serve


def config(**overrides: object) -> CacheConfig:
    base: dict[str, object] = {
        "layout": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32},
        "page_size": 16,
        "device_pages": 128,
        "host_pages": 1024,
        "model_id": "cold-start-example",
    }
    base.update(overrides)
    return CacheConfig.from_dict(base)


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hicache-warmup-") as root:
        model = KVGenerator(config().layout, 16)  # stands in for a model's KV
        rng = np.random.default_rng(7)
        system = rng.integers(0, 32_000, size=128)  # a shared system prompt: 8 pages
        prompts = [np.concatenate([system, rng.integers(0, 32_000, size=200)]) for _ in range(8)]

        # 1. A warm instance serves traffic; backups fill the store and its manifest.
        async with HiCache(config(), storage=FileStorage(root)) as first:
            for prompt in prompts:
                await serve(first, prompt, model)
            await first.drain()
            backup = first.storage_status().backup
            assert backup is not None
            print(
                f"first instance: backed up {backup.written_pages} pages, "
                f"recorded {backup.manifest_entries} manifest entries"
            )

        # 2. A new instance starts cold and warms up from the store before serving.
        cold = config(warmup={"enabled": True, "ratio": 0.9, "deadline_s": 30.0})
        async with HiCache(cold, storage=FileStorage(root)) as second:
            result = await second.wait_warmup()
            assert result is not None
            print(
                f"warmup: {result.status.value}, {result.entries_loaded} of {result.entries_read} "
                f"entries, {result.pages_loaded} pages in {result.seconds * 1000:.0f} ms"
            )
            host = device = computed = checked = 0
            for prompt in prompts:
                served = await serve(second, prompt, model, check="all")
                host += served.host_tokens
                device += served.device_tokens
                computed += served.computed_tokens
                checked += served.checked_pages
            total = sum(len(p) for p in prompts)
            print(
                f"second instance: {total} prompt tokens, {host} from its host pool, "
                f"{device} from its device pool, {computed} computed; "
                f"{checked} pages checked, all matched"
            )


if __name__ == "__main__":
    asyncio.run(main())
