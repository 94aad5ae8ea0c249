"""Tensor-parallel ranks holding different numbers of KV heads (5 heads over 2 ranks: 3 and
2) still name a prefix with the same keys, so their prefetch and warmup agreements pair up,
while each rank reads only its own shard.

Two ranks share one event loop over the in-process group of test_tp_warmup_cancel.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import msgspec
import numpy as np
import pytest
from test_tp_warmup_cancel import _pair, _Rank

from hicache_async import CacheConfig, HiCache, KVLayout, Namespace, WarmupStatus
from hicache_async.storage import FileStorage
from hicache_async.testing import KVGenerator, serve

SHAPES = [
    pytest.param((3, 2), 80, 3, id="heads-3-2-dim80-page3"),
    pytest.param((1, 2), 5, 17, id="heads-1-2-dim5-page17"),
]


def _config(rank: int, heads: tuple[int, int], head_dim: int, page_size: int) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 3, "num_kv_heads": heads[rank], "head_dim": head_dim},
            "page_size": page_size,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "tp-uneven",
            "tp_rank": rank,
            "tp_size": 2,
            "prefetch": {"policy": "wait_complete", "threshold_tokens": page_size},
        }
    )


def _prompts(page_size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(page_size)
    # Not whole pages: the tail stays on the device and is never stored.
    return [rng.integers(0, 50_000, size=5 * page_size + page_size // 2) for _ in range(3)]


async def _fill(roots: list[Path], configs: list[CacheConfig], prompts: list[np.ndarray]) -> None:
    """Each rank's own store holds its shard of every prompt."""
    for root, config in zip(roots, configs, strict=True):
        generator = KVGenerator(config.layout, config.page_size, seed=config.tp_rank)
        async with HiCache(config, storage=FileStorage(root)) as cache:
            for prompt in prompts:
                await serve(cache, prompt, generator, prefetch=False)
            await cache.drain()


@pytest.mark.parametrize(("heads", "head_dim", "page_size"), SHAPES)
async def test_ranks_with_uneven_heads_share_chains_and_read_their_own_shards(
    tmp_path: Path, heads: tuple[int, int], head_dim: int, page_size: int
) -> None:
    configs = [_config(rank, heads, head_dim, page_size) for rank in range(2)]
    generators = [KVGenerator(c.layout, page_size, seed=c.tp_rank) for c in configs]
    prompts = _prompts(page_size)
    roots = [tmp_path / "r0", tmp_path / "r1"]
    await _fill(roots, configs, prompts)
    ranks = _pair(_Rank)
    async with (
        HiCache(configs[0], storage=FileStorage(roots[0]), rank_group=ranks[0]) as first,
        HiCache(configs[1], storage=FileStorage(roots[1]), rank_group=ranks[1]) as second,
    ):
        assert first.keys_for(prompts[0]) == second.keys_for(prompts[0])
        for prompt in prompts:
            served = await asyncio.gather(
                serve(first, prompt, generators[0], check="all"),
                serve(second, prompt, generators[1], check="all"),
            )
            whole = len(prompt) // page_size
            # Every page came from the rank's own store, checked against its own shard.
            assert [s.storage_tokens for s in served] == [whole * page_size] * 2
            assert [s.checked_pages for s in served] == [whole] * 2
        assert all(rank.statistics().failures == 0 for rank in ranks)


@pytest.mark.parametrize(("heads", "head_dim", "page_size"), SHAPES)
async def test_ranks_with_uneven_heads_agree_on_warmup_entries(
    tmp_path: Path, heads: tuple[int, int], head_dim: int, page_size: int
) -> None:
    configs = [_config(rank, heads, head_dim, page_size) for rank in range(2)]
    generators = [KVGenerator(c.layout, page_size, seed=c.tp_rank) for c in configs]
    prompts = _prompts(page_size)
    roots = [tmp_path / "r0", tmp_path / "r1"]
    await _fill(roots, configs, prompts)
    ranks = _pair(_Rank)
    async with (
        HiCache(configs[0], storage=FileStorage(roots[0]), rank_group=ranks[0]) as first,
        HiCache(configs[1], storage=FileStorage(roots[1]), rank_group=ranks[1]) as second,
    ):
        results = await asyncio.gather(first.warmup(ratio=1.0), second.warmup(ratio=1.0))
        for result in results:
            assert result.status is WarmupStatus.COMPLETE
            assert result.entries_agreed == len(prompts)
        for cache, generator in ((first, generators[0]), (second, generators[1])):
            for prompt in prompts:
                whole = len(prompt) // page_size
                with cache.request(prompt) as request:
                    assert request.host_tokens == whole * page_size
                    await (await request.load())
                    for index in range(whole):
                        generator.check_page(
                            cache.device_pool, request.page_table[index], prompt, index
                        )


def test_the_heads_a_rank_holds_stay_in_its_fingerprint() -> None:
    """Out of the chain, the heads still keep a rank from reading a shard of another width."""

    def namespace(heads: int, rank: int = 0) -> Namespace:
        layout = KVLayout(num_layers=2, num_kv_heads=heads, head_dim=8)
        config = CacheConfig(layout=layout, device_pages=4, tp_rank=rank, tp_size=2)
        return Namespace.from_config(config)

    assert namespace(3).seed == namespace(2, rank=1).seed
    assert namespace(3).fingerprint != namespace(2).fingerprint
    assert namespace(3).rank_salt == namespace(2).rank_salt


def _earlier_release_namespace(config: CacheConfig, *, sglang_compatible: bool) -> Namespace:
    """The namespace releases before the heads left the seed gave a tensor-parallel MHA rank:
    the heads in the seed, and the fingerprint `sha256(digest + rank_salt)`."""
    layout = config.layout
    fields = {
        "v": 1,
        "model_id": config.model_id,
        "attention": layout.attention,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "kv_lora_rank": layout.kv_lora_rank,
        "qk_rope_head_dim": layout.qk_rope_head_dim,
        "dtype": layout.dtype,
        "page_size": config.page_size,
        "tp_size": config.tp_size,
        "salt": config.salt,
        "token_major": False,
    }
    digest = hashlib.sha256(msgspec.json.encode(fields, order="sorted")).digest()
    rank_salt = b"hicache-tp\x00%d\x00%d\x00" % (config.tp_rank, config.tp_size)
    return Namespace(
        seed=b"" if sglang_compatible else digest,
        fingerprint=hashlib.sha256(digest + rank_salt).digest()[:16],
        rank_salt=rank_salt,
    )


async def test_a_warmup_leaves_the_chains_of_an_earlier_release_alone(tmp_path: Path) -> None:
    """Its chains' keys are not this release's: loaded, they would fill the host pool with
    pages no request matches. Their pages and manifest entries are of another namespace."""
    config = _config(0, (3, 2), 8, 4)
    generator = KVGenerator(config.layout, config.page_size, seed=0)
    prompts = _prompts(config.page_size)
    earlier = _earlier_release_namespace(config, sglang_compatible=False)
    assert earlier.seed != Namespace.from_config(config).seed
    async with HiCache(config, storage=FileStorage(tmp_path), namespace=earlier) as cache:
        for prompt in prompts:
            await serve(cache, prompt, generator, prefetch=False)
        await cache.drain()
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=1.0)
        assert (result.entries_read, result.pages_loaded) == (0, 0)
        assert cache.statistics().tree.host_pages == 0


def test_sglang_compatible_ranks_keep_the_fingerprint_of_an_earlier_release() -> None:
    """Their chains start from an empty seed, as before: what they stored stays readable."""
    for heads, rank in ((3, 0), (2, 1)):
        config = _config(rank, (heads, heads), 8, 4)
        earlier = _earlier_release_namespace(config, sglang_compatible=True)
        assert Namespace.from_config(config, sglang_compatible=True) == earlier
