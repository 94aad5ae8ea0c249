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

from hicache_async import CacheConfig, HiCache
from hicache_async._config import PrefetchPolicy
from hicache_async.storage import MemoryStorage
from hicache_async.testing import FaultyStorage, KVGenerator, serve

from . import (
    PAGE,
    Record,
    assert_drained,
    loop_errors,
    make_config,
    prompt_pool,
    scaled,
    settle,
)

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
    unhandled = loop_errors()
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
        reused = 0
        try:
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
            for prompt in pool[:30]:
                result = await serve(cache, prompt, generator, check="all")
                reused += result.device_tokens + result.host_tokens + result.storage_tokens
            await settle(cache)
            assert_drained(cache)
        finally:
            # Recorded even when an invariant broke, with the calls made until then.
            by_point = collections.Counter(cancel_points)
            figures(
                "cancellation storm",
                calls=done,
                cancelled=sum(n for key, n in outcomes.items() if key.endswith("cancelled")),
                failed=len(failures),
                unhandled_errors=len(unhandled),
                seconds=round(time.perf_counter() - began, 1),
                **{key.replace(" ", "_"): n for key, n in sorted(outcomes.items())},
                cancel_points=", ".join(f"{p}: {n}" for p, n in sorted(by_point.items())),
            )
    cancelled = sum(n for key, n in outcomes.items() if key.endswith("cancelled"))
    assert not failures, f"{len(failures)} calls not cancelled failed, first: {failures[0]!r}"
    assert not unhandled, unhandled[0].get("exception", unhandled[0])
    assert cancelled > REQUESTS * 0.2, outcomes
    assert outcomes["serve cancelled"] > 0
    assert outcomes["serve completed"] > 0
    assert outcomes["prefetch cancelled"] + outcomes["prefetch handle cancelled"] > 0
    assert reused > 0


async def test_release_during_a_load_then_eviction_of_the_prefix() -> None:
    """What the full storm found, reduced: a request is released (its handler cancelled)
    while its host → device load is in flight, and another request then needs the pages of
    the device prefix the load hangs from. The released request keeps that prefix locked
    until its load lands, so the other allocation waits for the landing instead of evicting
    the prefix from under it (which once made the landing raise inside the copy's
    done-callback and leak the host protection and the loaded pages)."""
    page = 64
    # 1 MiB pages: the load of 8 of them is still in flight one loop iteration later.
    config = CacheConfig.from_dict(
        {
            "layout": {"num_layers": 4, "num_kv_heads": 8, "head_dim": 128},
            "page_size": page,
            "device_pages": 20,
            "host_pages": 24,
        }
    )
    generator = KVGenerator(config.layout, page, seed=29)
    rng = np.random.default_rng(30)
    prompt = rng.integers(0, 30_000, size=10 * page)  # D (2 pages) then H (8 pages)
    errors = loop_errors()
    in_flight = 0
    async with HiCache(config) as cache:
        for attempt in range(3):
            await serve(cache, prompt[: 2 * page], generator, prefetch=False)  # D, own node
            await serve(cache, prompt, generator, prefetch=False)  # H, D's child
            await cache.drain()
            # Push H (a leaf with a host copy) off the device; D stays.
            with cache.request(rng.integers(0, 30_000, size=page)) as pusher:
                await pusher.allocate((config.device_pages - 2) * page)
            assert cache.match(prompt).device_tokens == 2 * page, attempt
            request = cache.request(prompt)
            load = await request.load()  # H: host → device, in flight
            request.release()  # the handler is cancelled
            in_flight += not load.done()
            # Another request needs D's pages: it gets them once the load has landed.
            with cache.request(rng.integers(0, 30_000, size=page)) as other:
                pages = await other.allocate((config.device_pages - 8) * page)
                assert len(pages) == config.device_pages - 8
                assert load.done()
            await cache.drain()
            assert not errors, errors[0].get("exception")
            await settle(cache)
            assert_drained(cache)
        assert in_flight, "the load finished before the release every time"
        # What survived is still served with the right bytes.
        await serve(cache, prompt, generator, check="all")
        await settle(cache)
        assert_drained(cache)
        assert not errors, errors[0].get("exception")
