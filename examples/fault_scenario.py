"""A scenario test: a workload over storage that fails, hangs and corrupts pages.

Every request still completes, every page read back is checked against the KV generator, and
afterwards every reference is back to zero. Run: python examples/fault_scenario.py
"""

from __future__ import annotations

import asyncio
import tempfile

import numpy as np

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import FileStorage
from hicache_async.testing import FaultyStorage, KVGenerator, serve

CONFIG = CacheConfig.from_dict(
    {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "page_size": 8,
        "device_pages": 48,
        "host_pages": 96,
        "model_id": "fault-example",
        "prefetch": {"policy": "wait_complete", "io_timeout_s": 0.2, "threshold_tokens": 8},
        "backup": {"io_timeout_s": 0.2, "retry_backoff_s": 0.001},
    }
)


async def main() -> None:
    model = KVGenerator(CONFIG.layout, CONFIG.page_size, seed=1)
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 50_000, size=64)
    prompts = [
        np.concatenate([shared, rng.integers(0, 50_000, size=int(rng.integers(8, 120)))])
        for _ in range(60)
    ]
    # Fill storage with a healthy instance first.
    with tempfile.TemporaryDirectory(prefix="hicache-faults-") as root:
        async with HiCache(CONFIG, storage=FileStorage(root)) as healthy:
            for prompt in prompts:
                await serve(healthy, prompt, model)
            await healthy.drain()
            store = healthy.storage_status()
        print(f"healthy instance wrote {store.backup.written_pages if store.backup else 0} pages")

        faulty = FaultyStorage(
            FileStorage(root),
            seed=7,
            error_rate=0.1,
            hang_rate=0.05,
            corrupt_rate=0.1,
            truncate_rate=0.05,
            partial_batch_rate=0.1,
            latency_spike_rate=0.1,
            latency_spike_s=0.005,
        )
        async with HiCache(CONFIG, storage=faulty) as cache:
            results = [
                await serve(cache, p, model, request_id=f"r{i}") for i, p in enumerate(prompts * 2)
            ]
            await cache.drain()
            locks = sum(node.lock_ref + node.host_ref for node in cache.tree.iter_nodes())
            device, host = cache.device_pool.allocator, cache.host_pool.allocator
            assert locks == 0, "a reference leaked"
            assert device.free_count + device.used_count == device.capacity
            assert host.free_count + host.used_count == host.capacity
        print(f"{len(results)} requests served, 0 failed; faults injected: {faulty.injected()}")
        print(f"tokens from storage despite the faults: {sum(r.storage_tokens for r in results)}")
        print(f"pages checked against the generator: {sum(r.checked_pages for r in results)}")


if __name__ == "__main__":
    asyncio.run(main())
