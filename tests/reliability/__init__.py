"""Reliability suites: crash consistency, fault soak, cancellation storm, load, hostile input,
decoder fuzzing, blocking calls on the loop, and security checks.

`HICACHE_RELIABILITY=full` runs the full versions (`nox -s reliability`); anything else runs the
short versions that CI runs with the rest of the tests. The helpers the suites share live here.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import numpy as np

from hicache_async import CacheConfig, HiCache, testing

__all__ = [
    "FULL",
    "PAGE",
    "Record",
    "assert_drained",
    "loop_errors",
    "make_config",
    "percentile",
    "prompt_pool",
    "scaled",
    "settle",
]

FULL = os.environ.get("HICACHE_RELIABILITY", "").strip().lower() == "full"
PAGE = 4

#: The `figures` fixture: `figures(name, **values)` records figures for the run's summary.
Record = Callable[..., None]


def scaled(short: int, full: int) -> int:
    """`full` under HICACHE_RELIABILITY=full, else `short`."""
    return full if FULL else short


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def make_config(**overrides: Any) -> CacheConfig:
    """A small configuration (pages of 4 tokens, 256 bytes) with nested overrides merged in."""
    base: dict[str, Any] = {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
        "page_size": PAGE,
        "device_pages": 48,
        "host_pages": 64,
        "model_id": "reliability",
        "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE, "batch_pages": 4},
        "backup": {"batch_pages": 4, "retry_backoff_s": 0.001},
    }
    return CacheConfig.from_dict(_merge(base, overrides))


def prompt_pool(
    count: int, seed: int, *, systems: int = 6, system_pages: int = 3, max_turn_pages: int = 7
) -> list[np.ndarray[Any, Any]]:
    """Prompts that share prefixes as chat traffic does: a few system prompts, conversations
    that grow turn by turn, and tails that are not whole pages."""
    rng = random.Random(seed)
    heads = [[rng.randrange(30_000) for _ in range(system_pages * PAGE)] for _ in range(systems)]
    prompts: list[np.ndarray[Any, Any]] = []
    for _ in range(count):
        if prompts and rng.random() < 0.4:
            base = list(rng.choice(prompts)[: (max_turn_pages + system_pages) * PAGE])
        else:
            base = list(rng.choice(heads))
        turn = [rng.randrange(30_000) for _ in range(rng.randrange(1, max_turn_pages * PAGE))]
        prompts.append(np.array(base + turn, dtype=np.int64))
    return prompts


def loop_errors() -> list[dict[str, Any]]:
    """Collect what the running loop would log as unhandled (an exception in a callback or a
    task nobody awaited): such an error is invisible to the caller but leaves work undone."""
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
    return errors


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100.0 * len(ordered)) - 1))
    return ordered[rank]


async def settle(cache: HiCache, *, timeout_s: float = 120.0) -> None:
    """Wait until no copy, backup, warmup or prefetch is in flight.

    `drain()` does not wait for prefetches that outlived their request (a `timeout` or
    `best_effort` prefetch keeps its read in flight), so this also waits for the prefetcher to
    have none running, and for the warmup started on attach, whose read may not have started
    yet; the deadline only guards against a hang.
    """
    try:
        with anyio.fail_after(timeout_s):
            await cache.wait_warmup()
            while True:
                await cache.drain()
                link = cache._link
                # No public handle on prefetches whose requests are gone: read the worker's set.
                if link is None or not link.prefetcher._running:
                    status = cache.storage_status().prefetch
                    if status is None or (status.queued == 0 and status.host_pages_held == 0):
                        await cache.drain()
                        return
                await asyncio.sleep(0.002)
    except TimeoutError:
        raise AssertionError(
            f"the cache did not settle within {timeout_s} s: {cache!r}, {cache.storage_status()}"
        ) from None


def assert_drained(cache: HiCache) -> None:
    """Invariants 1 and 4 once a workload has settled (`testing.assert_drained`: no live
    request, every lock and protection zero, pools balanced and in step with the tree), plus
    the storage workers': no host page held by a prefetch, nothing queued."""
    testing.assert_drained(cache)
    stats = cache.statistics()
    if stats.storage is not None and stats.storage.prefetch is not None:
        assert stats.storage.prefetch.host_pages_held == 0, stats.storage.prefetch
        assert stats.storage.prefetch.queued == 0, stats.storage.prefetch
    if stats.storage is not None and stats.storage.backup is not None:
        assert stats.storage.backup.queued == 0, stats.storage.backup
