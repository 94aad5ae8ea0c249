"""Odd layouts and dtypes through Redis and Mooncake: stored, restarted, prefetched and warmed
up byte for byte (tests/test_dtypes.py runs every dtype through `file://`)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from hicache_async import CacheConfig, HiCache
from hicache_async.testing import KVGenerator, serve

LAYOUTS = {
    # One byte a token, one token a page.
    "mla-e5m2-1": ({"num_layers": 1, "attention": "mla", "kv_lora_rank": 1}, "float8_e5m2", 1),
    # Rows of 7 bf16 elements, 3 heads, token-major pages.
    "mha-bf16-3": ({"num_layers": 2, "num_kv_heads": 3, "head_dim": 7}, "bfloat16", 3),
}


@pytest.mark.parametrize("backend", ["redis", "mooncake"])
@pytest.mark.parametrize("shape", sorted(LAYOUTS))
async def test_odd_layouts_come_back_byte_exact(
    request: pytest.FixtureRequest, backend: str, shape: str
) -> None:
    fields, dtype, page_size = LAYOUTS[shape]
    prefix = f"t{uuid.uuid4().hex}"
    if backend == "redis":
        url = f"{request.getfixturevalue('redis_url')}?prefix={prefix}"
    else:
        url = f"{request.getfixturevalue('mooncake_url')}&prefix={prefix}"

    def config(**overrides: object) -> CacheConfig:
        return CacheConfig.from_dict(
            {
                "layout": {**fields, "dtype": dtype},
                "page_size": page_size,
                "device_pages": 32,
                "host_pages": 64,
                "host_layout": "page_first" if page_size > 1 else "layer_first",
                "model_id": "odd-layouts",
                "prefetch": {"policy": "wait_complete", "threshold_tokens": 0},
                **overrides,
            }
        )

    generator = KVGenerator(config().layout, page_size, seed=3)
    prompt = np.arange(7, 7 + 9 * page_size + 1)
    whole = len(prompt) // page_size * page_size
    async with HiCache(config(), storage=url) as first:
        await serve(first, prompt, generator, check="all")
        await first.drain()
    async with HiCache(config(), storage=url) as cold:
        served = await serve(cold, prompt, generator, check="all")
        assert served.storage_tokens == whole
    warm = config(warmup={"enabled": True, "ratio": 1.0})
    async with HiCache(warm, storage=url) as cache:
        result = await cache.wait_warmup()
        assert result is not None
        assert result.pages_loaded == whole // page_size
        served = await serve(cache, prompt, generator, check="all", prefetch=False)
        assert served.host_tokens == whole
