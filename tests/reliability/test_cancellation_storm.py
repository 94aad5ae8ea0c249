"""Cancellation storm: request handlers, prefetches and drains cancelled at random points.

Each wave starts a batch of handlers, most of which are cancelled after a random number of loop
iterations or a random short delay, so cancellations land at every await point the library
has: waiting for the prefetch queue, for storage, for device pages, for a layer of a load, for
a backup. After each wave the cache is drained and must be exactly as consistent as if the
cancelled calls had never been made (DESIGN.md, "Cancellation-safe everywhere"): no live
request, every reference zero, every pool balanced. Every handler that was not cancelled must
have succeeded and read correct bytes.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any, get_args

import numpy as np

from hicache_async import HiCache
from hicache_async._config import PrefetchPolicy
from hicache_async.storage import MemoryStorage
from hicache_async.testing import FaultyStorage, KVGenerator, serve

from . import PAGE, Record, assert_drained, make_config, prompt_pool, scaled, settle

#: The loop this suite runs under in the short run (the full run uses every loop).
SHORT_LOOP = "asyncio"

REQUESTS = scaled(1_000, 10_000)
WAVE = 40
CONCURRENCY = 6
CANCEL_RATE = 0.7
POLICIES: tuple[PrefetchPolicy, ...] = get_args(PrefetchPolicy)


async def _cancel_later(task: asyncio.Task[Any], rng: random.Random, where: list[str]) -> None:
    """Cancel `task` after a random number of loop iterations or a random short delay."""
    if rng.random() < 0.6:
        steps = rng.randrange(0, 60)
        for _ in range(steps):
            if task.done():
                return
            await asyncio.sleep(0)
        where.append(f"iteration {steps // 10 * 10}-{steps // 10 * 10 + 9}")
    else:
        delay = rng.uniform(0.0, 0.02)
        await asyncio.sleep(delay)
        where.append(f"delay {int(delay * 200) * 5}-{int(delay * 200) * 5 + 4} ms")
    task.cancel()


async def test_cancellation_storm(figures: Record) -> None:
    config = make_config(
        device_pages=CONCURRENCY * 10 + 16,
        host_pages=64,
        prefetch={
            "policy": "timeout",
            "timeout_base_s": 0.01,
            "timeout_per_1k_tokens_s": 0.0,
            "timeout_max_s": 0.02,
            "queue_size": 4,
            "workers": 2,
            "io_timeout_s": 0.5,
        },
        backup={"batch_pages": 4, "queue_size": 8},
    )
    generator = KVGenerator(config.layout, PAGE, seed=23)
    pool = prompt_pool(300, seed=31)
    rng = random.Random(77)
    # Every storage call yields to the loop for a while, so cancellations land inside them.
    storage = FaultyStorage(
        MemoryStorage(capacity_bytes=256 << 10),
        seed=5,
        latency_s=0.0005,
        latency_spike_rate=0.05,
        latency_spike_s=0.005,
    )
    outcomes: collections.Counter[str] = collections.Counter()
    cancel_points: list[str] = []
    failures: list[BaseException] = []
    began = time.perf_counter()
    async with HiCache(config, storage=storage) as cache:
        semaphore = asyncio.Semaphore(CONCURRENCY)

        def pick() -> np.ndarray[Any, Any]:
            return pool[min(int(rng.expovariate(1 / 60)), len(pool) - 1)]

        def action(number: int) -> tuple[str, Callable[[], Coroutine[Any, Any, object]]]:
            prompt = pick()
            roll = rng.random()
            if roll < 0.75:

                async def handler() -> object:
                    async with semaphore:
                        return await serve(cache, prompt, generator, request_id=f"c{number}")

                return "serve", handler
            if roll < 0.88:
                policy = rng.choice(POLICIES)
                return "prefetch", lambda: cache.prefetch(prompt, policy=policy)
            if roll < 0.96:
                hold = rng.random()

                async def handle_prefetch() -> object:
                    handle = await cache.start_prefetch(prompt, request_id=f"h{number}")
                    if hold < 0.3:
                        handle.cancel()
                    elif hold < 0.6:
                        handle.terminate()
                    return await handle.wait()

                return "prefetch handle", handle_prefetch
            return "drain", cache.drain

        done = 0
        while done < REQUESTS:
            count = min(WAVE, REQUESTS - done)
            planned = [action(done + i) for i in range(count)]
            tasks = [asyncio.create_task(call()) for _, call in planned]
            cancellers = [
                asyncio.create_task(_cancel_later(task, rng, cancel_points))
                for task in tasks
                if rng.random() < CANCEL_RATE
            ]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*cancellers)
            for (kind, _), result in zip(planned, results, strict=True):
                if isinstance(result, asyncio.CancelledError):
                    outcomes[f"{kind} cancelled"] += 1
                elif isinstance(result, BaseException):
                    failures.append(result)
                else:
                    outcomes[f"{kind} completed"] += 1
            done += count
            await settle(cache, timeout_s=30)
            assert_drained(cache)
        # The cache still serves correct bytes for what survived the storm.
        reused = 0
        for prompt in pool[:30]:
            result = await serve(cache, prompt, generator, check="all")
            reused += result.device_tokens + result.host_tokens + result.storage_tokens
        await settle(cache)
        assert_drained(cache)
        elapsed = time.perf_counter() - began
    cancelled = sum(n for key, n in outcomes.items() if key.endswith("cancelled"))
    by_point = collections.Counter(cancel_points)
    figures(
        "cancellation storm",
        calls=REQUESTS,
        cancelled=cancelled,
        failed=len(failures),
        seconds=round(elapsed, 1),
        **{key.replace(" ", "_"): n for key, n in sorted(outcomes.items())},
        cancel_points=", ".join(f"{point}: {n}" for point, n in sorted(by_point.items())),
    )
    assert not failures, f"{len(failures)} calls not cancelled failed, first: {failures[0]!r}"
    assert cancelled > REQUESTS * 0.2, outcomes
    assert outcomes["serve cancelled"] > 0
    assert outcomes["serve completed"] > 0
    assert outcomes["prefetch cancelled"] + outcomes["prefetch handle cancelled"] > 0
    assert reused > 0
