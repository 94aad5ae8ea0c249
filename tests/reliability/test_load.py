"""Load: 1,000 request handlers at once on one event loop, with file storage, prefetch and
backup on.

Measured: the event loop's scheduling lag (a ticker task asks to sleep 1 ms and records how
late it wakes), and memory: the peak resident set over the run (the kernel's high-water mark,
reset before the cache opens) against the configured pools, and the peak of Python-level
allocations (tracemalloc) per handler in a separate pass, since tracing slows everything down.

Asserted: no handler fails, every page checks out, the cache drains clean, and memory stays
within the pools plus a documented overhead (generous bounds; the figures are reported).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache_async import CacheConfig, HiCache
from hicache_async.testing import KVGenerator, ServedRequest, serve

from . import Record, assert_drained, loop_errors, percentile, scaled, settle

#: The loop this suite runs under in the short run (the full run uses every loop).
SHORT_LOOP = "uvloop"

HANDLERS = 1_000
WAVES = scaled(4, 9)
PROMPT_SETS = 3
PAGE = 16
TICK_S = 0.001
# The overhead allowed beyond the pools: the interpreter's and torch's working memory, storage
# and copy threads, and per handler its prompt, request and page-sized generator buffers.
FIXED_OVERHEAD = 96 << 20
PER_HANDLER_OVERHEAD = 64 << 10
PYTHON_HEAP_PER_HANDLER = 256 << 10


def _config() -> CacheConfig:
    # Pages of 16 tokens x 4 layers x 2 heads x 32 wide, float16: 8 KiB. Room on the device
    # for every handler's own pages (at most 4 beyond the shared system prompts) at once, so
    # none can run out; three waves of prompts do not fit, so eviction and backups happen, and
    # the host is smaller still, so evicted prefixes come back from storage too.
    device_pages = HANDLERS * 4 + 256
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32},
            "page_size": PAGE,
            "device_pages": device_pages,
            "host_pages": HANDLERS * 2,
            "model_id": "load",
            "prefetch": {"policy": "timeout", "threshold_tokens": PAGE, "queue_size": 256},
            "backup": {"queue_size": 1024},
        }
    )


def _prompts(count: int, seed: int) -> list[np.ndarray[Any, Any]]:
    rng = random.Random(seed)
    systems = [[random.Random(s).randrange(30_000) for _ in range(2 * PAGE)] for s in range(8)]
    return [
        np.array(
            rng.choice(systems) + [rng.randrange(30_000) for _ in range(rng.randrange(1, 4 * PAGE))]
        )
        for _ in range(count)
    ]


def _rss_peak_reset() -> bool:
    """Reset the kernel's resident-set high-water mark (VmHWM); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


async def _wave(
    cache: HiCache, prompts: list[np.ndarray[Any, Any]], generator: KVGenerator, tag: str
) -> list[ServedRequest | BaseException]:
    """Start every handler, release them together, wait for all."""
    go = asyncio.Event()

    async def handler(number: int) -> ServedRequest:
        await go.wait()
        return await serve(cache, prompts[number], generator, request_id=f"{tag}{number}")

    tasks = [asyncio.create_task(handler(n)) for n in range(len(prompts))]
    await asyncio.sleep(0)
    go.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
async def test_thousand_concurrent_handlers(tmp_path: Path, figures: Record) -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=3)
    pools = config.page_nbytes * (config.device_pages + config.resolved_host_pages)
    sets = [_prompts(HANDLERS, seed) for seed in range(1, PROMPT_SETS + 1)]
    root = tmp_path / "l3"
    root.mkdir(mode=0o700)
    gc.collect()
    baseline = _status_kib("VmRSS") << 10
    exact_peak = _rss_peak_reset()
    lags: list[float] = []
    sampled_peak = baseline
    ticking = True

    async def ticker() -> None:
        nonlocal sampled_peak
        loop = asyncio.get_running_loop()
        while ticking:
            asked = loop.time()
            await asyncio.sleep(TICK_S)
            lags.append(loop.time() - asked - TICK_S)
            if len(lags) % 20 == 0:
                sampled_peak = max(sampled_peak, _status_kib("VmRSS") << 10)

    failures: list[BaseException] = []
    served: list[ServedRequest] = []
    unhandled = loop_errors()
    began = time.perf_counter()
    async with HiCache(config, storage=f"file://{root}") as cache:
        tick = asyncio.create_task(ticker())
        for wave in range(WAVES):
            # A, B, C, A...: the third set evicts the first, which then comes back from the
            # host and storage tiers.
            results = await _wave(cache, sets[wave % PROMPT_SETS], generator, f"w{wave}.")
            failures += [r for r in results if isinstance(r, BaseException)]
            served += [r for r in results if not isinstance(r, BaseException)]
        ticking = False
        await tick
        elapsed = time.perf_counter() - began
        await settle(cache)
        assert_drained(cache)
        counters = cache.statistics().counters
    peak = (_status_kib("VmHWM") << 10) if exact_peak else sampled_peak
    growth = peak - baseline
    bound = pools + FIXED_OVERHEAD + HANDLERS * PER_HANDLER_OVERHEAD
    figures(
        "load",
        handlers=HANDLERS,
        waves=WAVES,
        requests=len(served) + len(failures),
        failed=len(failures),
        seconds=round(elapsed, 1),
        lag_p50_ms=round(percentile(lags, 50) * 1e3, 2),
        lag_p99_ms=round(percentile(lags, 99) * 1e3, 2),
        lag_max_ms=round(max(lags, default=0.0) * 1e3, 2),
        ticks=len(lags),
        pools_mib=round(pools / 2**20, 1),
        rss_growth_mib=round(growth / 2**20, 1),
        overhead_mib=round((growth - pools) / 2**20, 1),
        bound_mib=round(bound / 2**20, 1),
        peak_measure="VmHWM" if exact_peak else "sampled VmRSS",
        storage_tokens=sum(s.storage_tokens for s in served),
        host_tokens=sum(s.host_tokens for s in served),
        device_evicted=counters["device_evicted_pages"],
    )
    assert not failures, f"{len(failures)} handlers failed, first: {failures[0]!r}"
    assert not unhandled, unhandled[0].get("exception", unhandled[0])
    assert len(lags) > 10, "the ticker never ran: the loop was blocked for the whole run"
    assert counters["device_evicted_pages"] > 0
    assert sum(s.host_tokens + s.storage_tokens for s in served) > 0
    assert growth <= bound, f"resident set grew {growth >> 20} MiB, bound {bound >> 20} MiB"


async def test_python_heap_per_handler(figures: Record) -> None:
    """Python-level allocations of 1,000 concurrent handlers (the pools are torch memory,
    which tracemalloc does not see)."""
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=4)
    prompts = _prompts(HANDLERS, 7)
    async with HiCache(config, storage="memory://?capacity=256MiB") as cache:
        gc.collect()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            results = await _wave(cache, prompts, generator, "t")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await settle(cache)
        assert_drained(cache)
    failures = [r for r in results if isinstance(r, BaseException)]
    per_handler = (peak - before) / HANDLERS
    figures(
        "load python heap",
        handlers=HANDLERS,
        peak_mib=round((peak - before) / 2**20, 1),
        per_handler_kib=round(per_handler / 1024, 1),
    )
    assert not failures, failures[0]
    assert per_handler <= PYTHON_HEAP_PER_HANDLER
