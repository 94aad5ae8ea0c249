"""Several deployments on one store: none reads another's pages, each keeps its own hits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hicache_async import (
    CacheConfig,
    ConfigError,
    HiCache,
    KVLayout,
    Namespace,
    PrefetchConfig,
    page_keys,
)
from hicache_async.testing import KVGenerator, serve

PAGE = 4
MHA = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)
MLA = KVLayout(num_layers=2, attention="mla", kv_lora_rank=8, qk_rope_head_dim=4)


def _config(rank: int, size: int, layout: KVLayout = MHA) -> CacheConfig:
    return CacheConfig(
        layout=layout,
        page_size=PAGE,
        device_pages=16,
        host_pages=32,
        model_id="tenants",
        tp_size=size,
        tp_rank=rank,
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=PAGE),
    )


@pytest.mark.parametrize(
    ("size", "given"),
    [
        (2, lambda: Namespace.from_config(_config(0, 2))),  # one namespace made for every rank
        (2, Namespace.empty),
        (4, lambda: Namespace.from_config(_config(1, 2))),  # the rank of another TP size
    ],
    ids=["rank-0s", "empty", "other-size"],
)
def test_a_rank_refuses_a_namespace_without_its_rank_salt(
    size: int, given: Callable[[], Namespace]
) -> None:
    # Ranks hold different heads under the same chain keys: given such a namespace, rank 1
    # backed up and read its pages under rank 0's storage keys and fingerprint, and loaded
    # rank 0's shard as its own.
    namespace = given()
    with pytest.raises(ConfigError) as raised:
        HiCache(_config(1, size), namespace=namespace)
    assert raised.value.field == "namespace"
    # It says what to give instead.
    own = Namespace.from_config(_config(1, size)).rank_salt
    assert f"rank_salt={own!r}" in str(raised.value)


@pytest.mark.parametrize(
    ("config", "given"),
    [
        (_config(0, 1), lambda: Namespace.from_config(_config(0, 2))),
        (_config(1, 2, MLA), lambda: Namespace.from_config(_config(1, 2))),
    ],
    ids=["one-rank", "mla"],
)
def test_a_cache_of_whole_pages_refuses_a_ranks_namespace(
    config: CacheConfig, given: Callable[[], Namespace]
) -> None:
    # Given rank 0's namespace, a single-rank cache of the same per-rank layout read rank 0's
    # shard (its heads only) from a store rank 0 filled, as its own whole pages.
    with pytest.raises(ConfigError) as raised:
        HiCache(config, namespace=given())
    assert raised.value.field == "namespace"
    assert "Namespace.from_config(config)" in str(raised.value)
    assert "without a rank_salt" in str(raised.value)


def test_a_caches_namespace_config_and_rank_group_cannot_be_swapped_after_the_checks() -> None:
    # Assigned after construction, rank 0's namespace had rank 1 back up and read its shard
    # under rank 0's keys, past the check above; another config's page size split prompts
    # into pages the pools were not made for.
    cache = HiCache(_config(1, 2))
    own = cache.namespace
    for name, value in (
        ("namespace", Namespace.from_config(_config(0, 2))),
        ("config", _config(0, 2)),
        ("rank_group", None),
    ):
        with pytest.raises(AttributeError):
            setattr(cache, name, value)
    assert cache.namespace is own
    assert cache.config == _config(1, 2)
    assert cache.keys_for(np.arange(PAGE)) == page_keys(np.arange(PAGE), PAGE, own.seed)


@pytest.mark.parametrize(
    ("config", "namespace"),
    [
        (_config(1, 2), Namespace.from_config(_config(1, 2), sglang_compatible=True)),
        (_config(1, 2), Namespace.from_config(_config(1, 2)).salted("tenant")),
        (_config(1, 2, MLA), Namespace.empty()),  # MLA ranks share one copy
        (_config(0, 1), Namespace.empty()),
    ],
    ids=["sglang", "salted", "mla", "one-rank"],
)
async def test_namespaces_that_keep_ranks_apart_are_accepted(
    tmp_path: Path, config: CacheConfig, namespace: Namespace
) -> None:
    prompt = np.arange(3 * PAGE + 1)
    generator = KVGenerator(config.layout, PAGE, seed=config.tp_rank)
    store = f"file://{tmp_path}"
    for _ in range(2):
        async with HiCache(config, storage=store, namespace=namespace) as cache:
            served = await serve(cache, prompt, generator, check="all")
            await cache.drain()
    assert served.storage_tokens == 3 * PAGE


async def test_ranks_sharing_a_root_each_read_only_their_own_shard(tmp_path: Path) -> None:
    prompt = np.arange(3 * PAGE + 1)
    store = f"file://{tmp_path}?shared=1"
    for _ in range(2):
        for rank in range(2):
            config = _config(rank, 2)
            # Each rank's oracle differs, as its heads do: a page of the other rank fails it.
            generator = KVGenerator(config.layout, PAGE, seed=rank)
            async with HiCache(config, storage=store) as cache:
                served = await serve(cache, prompt, generator, check="all")
                await cache.drain()
    assert served.storage_tokens == 3 * PAGE
