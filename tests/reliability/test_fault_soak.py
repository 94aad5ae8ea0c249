"""Fault soak: thousands of requests against a storage backend that fails in every way
FaultyStorage knows (errors, latency spikes, hangs, corrupt and truncated pages, partial batch
failures), with prefetch and backup on and pools small enough that eviction and backups never
stop.

What must hold: no request fails, every page a request reads holds the bytes committed for its
prefix (`serve(check="all")` compares each against the KV generator), and after the drain every
reference is zero and every pool balanced.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache_async import CacheConfig, HiCache
from hicache_async.storage import (
    HEADER_NBYTES,
    FileStorage,
    MemoryStorage,
    RawAccess,
    StorageBackend,
)
from hicache_async.testing import FaultyStorage, KVGenerator, ServedRequest, serve

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
SHORT_LOOP = "uvloop"

REQUESTS = scaled(1_000, 10_000)
CONCURRENCY = 6
# Device pages for every concurrent request's largest prompt (10 pages) and some to spare, so
# that running out of device pages cannot fail a request; everything else evicts constantly.
DEVICE_PAGES = CONCURRENCY * 10 + 16
HOST_PAGES = 64
# Far smaller than the working set (~2,000 distinct pages of 384 stored bytes): the backend
# evicts too.
STORAGE_BYTES = 160 << 10


def _config() -> CacheConfig:
    return make_config(
        device_pages=DEVICE_PAGES,
        host_pages=HOST_PAGES,
        prefetch={
            # A short wait, then the request goes on with what landed; the read in flight
            # finishes (or times out) behind it.
            "policy": "timeout",
            "timeout_base_s": 0.02,
            "timeout_per_1k_tokens_s": 0.0,
            "timeout_max_s": 0.05,
            "batch_pages": 4,
            "io_timeout_s": 0.05,
        },
        backup={"batch_pages": 4, "queue_size": 16, "max_retries": 2, "io_timeout_s": 0.05},
    )


def _faulty(inner: StorageBackend, seed: int) -> FaultyStorage:
    return FaultyStorage(
        inner,
        seed=seed,
        error_rate=0.10,
        latency_s=0.0,
        latency_spike_rate=0.05,
        latency_spike_s=0.02,
        hang_rate=0.02,
        corrupt_rate=0.05,
        truncate_rate=0.03,
        partial_batch_rate=0.10,
    )


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_fault_soak(kind: str, tmp_path: Path, figures: Record) -> None:
    config = _config()
    assert config.page_size == PAGE
    generator = KVGenerator(config.layout, PAGE, seed=17)
    seed = 4242 if kind == "memory" else 2424
    pool = prompt_pool(400, seed=seed)
    rng = random.Random(seed)
    inner: StorageBackend
    if kind == "memory":
        inner = MemoryStorage(capacity_bytes=STORAGE_BYTES)
    else:
        root = tmp_path / "l3"
        root.mkdir(mode=0o700)
        inner = FileStorage(root, capacity_bytes=STORAGE_BYTES, io_threads=2)
    faulty = _faulty(inner, seed)
    failures: list[BaseException] = []
    served: list[ServedRequest] = []
    unhandled = loop_errors()
    soak_corrupt = -1
    read_back: list[ServedRequest] = []
    began = time.perf_counter()
    async with HiCache(config, storage=faulty) as cache:
        semaphore = asyncio.Semaphore(CONCURRENCY)

        async def handler(number: int) -> None:
            # Popular prompts come back often (from device, host or storage), the rest rarely.
            prompt = pool[min(int(rng.expovariate(1 / 80)), len(pool) - 1)]
            async with semaphore:
                try:
                    served.append(
                        await serve(cache, prompt, generator, request_id=f"s{number}", check="all")
                    )
                except Exception as exc:
                    failures.append(exc)

        wave = 500
        try:
            for start in range(0, REQUESTS, wave):
                end = min(start + wave, REQUESTS)
                await asyncio.gather(*(handler(n) for n in range(start, end)))
                await settle(cache)
                assert_drained(cache)
            soak_corrupt = _corrupt(cache)
            read_back = await _read_back_damaged(cache, inner, pool, generator)
            await settle(cache)
            assert_drained(cache)
        finally:
            # Recorded even when an invariant broke, with the requests served until then.
            status = cache.storage_status()
            counters = cache.statistics().counters
            injected = faulty.injected()
            assert status.storage is not None
            assert status.prefetch is not None
            assert status.backup is not None
            figures(
                f"fault soak ({kind})",
                requests=len(served) + len(failures),
                failed=len(failures),
                unhandled_errors=len(unhandled),
                seconds=round(time.perf_counter() - began, 1),
                errors=injected.errors,
                partial_batches=injected.partial_batches,
                latency_spikes=injected.latency_spikes,
                hangs=injected.hangs,
                corrupted=injected.corrupted,
                truncated=injected.truncated,
                storage_corrupt_caught=status.storage.corrupt,
                soak_corrupt_caught=soak_corrupt,
                pages_read=status.prefetch.pages_read,
                pages_written=status.backup.written_pages,
                storage_tokens=sum(s.storage_tokens for s in served),
                checked_pages=sum(s.checked_pages for s in served),
                device_evicted=counters["device_evicted_pages"],
                host_evicted=counters["host_evicted_pages"],
            )
    assert not failures, f"{len(failures)} requests failed, first: {failures[0]!r}"
    assert not unhandled, unhandled[0].get("exception", unhandled[0])
    assert len(served) == REQUESTS
    # The faults were really injected, and the workload really went through storage.
    assert injected.errors > 0
    assert injected.partial_batches > 0
    assert injected.latency_spikes > 0
    assert injected.hangs > 0
    assert injected.corrupted + injected.truncated > 0
    assert status.storage.corrupt > 0, "no damaged page was ever read back"
    assert read_back, "no request read a damaged page back"
    assert sum(s.storage_tokens for s in served) > 0
    assert status.backup.written_pages > 0
    assert counters["device_evicted_pages"] > 0
    assert counters["host_evicted_pages"] > 0


def _corrupt(cache: HiCache) -> int:
    status = cache.storage_status().storage
    assert status is not None
    return status.corrupt


async def _read_back_damaged(
    cache: HiCache,
    inner: StorageBackend,
    pool: list[np.ndarray[Any, Any]],
    generator: KVGenerator,
) -> list[ServedRequest]:
    """Damage the first page a prompt would read from storage and serve it, until the backend
    catches one: the soak's random damage is read back only when a request happens to want a
    damaged page before the backend evicts it (some runs on files never did).

    Each try can still miss the page through the wrapper's own faults on that read (an error,
    a hang, a partial batch): a handful of prompts make that vanishingly unlikely.
    """
    assert isinstance(inner, RawAccess)
    served: list[ServedRequest] = []
    before = _corrupt(cache)
    for number, prompt in enumerate(pool):
        if _corrupt(cache) > before or len(served) == 16:
            break
        found = cache.match(prompt)
        cached = (found.device_tokens + found.host_tokens) // PAGE
        keys = found.keys[cached:]
        if not keys or await inner.exists(keys) == 0:
            continue
        value = await inner.read_raw(keys[0])
        assert value is not None
        # A page the soak truncated and nobody has read since is damaged already.
        if len(value) > HEADER_NBYTES:
            damaged = bytearray(value)
            damaged[HEADER_NBYTES + (len(value) - HEADER_NBYTES) // 2] ^= 0x10
            await inner.write_raw(keys[0], bytes(damaged))
        # Waits for the read (or its `io_timeout_s`), so it is done before the next try.
        await cache.prefetch(prompt, request_id=f"r{number}", policy="wait_complete")
        served.append(await serve(cache, prompt, generator, request_id=f"r{number}", check="all"))
    assert _corrupt(cache) > before, f"{len(served)} reads of a damaged page went uncaught"
    return served


# Reductions of what the soak found, each to the smallest deterministic case.


async def _storage_with(root: Path, *prompts: np.ndarray[Any, Any]) -> None:
    """Back `prompts` up to the file storage at `root` through a roomy cache."""
    generator = KVGenerator(make_config().layout, PAGE, seed=5)
    async with HiCache(make_config(), storage=f"file://{root}") as writer:
        for prompt in prompts:
            await serve(writer, prompt, generator, prefetch=False)
        await writer.drain()


async def test_prefetch_that_evicts_the_prefix_it_extends(tmp_path: Path) -> None:
    """A prefetch extending a host-only prefix allocates host pages before it protects that
    prefix, so the allocation can evict it; `protect_host` then raises after the prefetch
    registered its in-flight pages and took host pages and a device lock, outside the
    try/finally that gives them back. The host pages and the lock leak, and every later
    prefetch of those pages waits for a read nobody is doing (in the soak: all workers stuck,
    then every request's `start_prefetch` blocked on the full queue)."""
    prompt = np.random.default_rng(4).integers(0, 30_000, size=8 * PAGE)
    root = tmp_path / "l3"
    await _storage_with(root, prompt)
    config = make_config(device_pages=8, host_pages=6, prefetch={"max_host_share": 1.0})
    async with HiCache(config, storage=f"file://{root}") as cache:
        first = await cache.prefetch(prompt[:PAGE])  # page 0 lands as a host-only leaf
        assert first.storage_tokens == PAGE
        # Pages 1-6 want 6 host pages; 5 are free, so the allocation evicts page 0.
        await cache.prefetch(prompt)
        await cache.drain()
        assert cache.match(prompt).host_tokens > 0, "the prefetch landed nothing"
        assert_drained(cache)  # no host page held or leaked, no lock left


async def test_eviction_fallback_after_enough_pages_were_freed(tmp_path: Path) -> None:
    """`_try_alloc_device`: when an eviction pass frees enough pages but also reports a node
    that needs a host backup, and that backup cannot start (host full), the fallback pass is
    asked for `count - free_count` pages, which is then negative: ValueError from
    `evict_device` instead of the pages that are free."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 30_000, size=4 * PAGE)  # A (3 pages) + B (1 page) in storage
    other = rng.integers(0, 30_000, size=3 * PAGE)  # X
    root = tmp_path / "l3"
    await _storage_with(root, prompt)
    generator = KVGenerator(make_config().layout, PAGE, seed=5)
    config = make_config(device_pages=6, host_pages=2, prefetch={"max_host_share": 1.0})
    ticks = itertools.count()
    async with HiCache(config, storage=f"file://{root}", clock=lambda: float(next(ticks))) as cache:
        # X and A fill the device; neither fits in the 2 host pages, so neither is backed up.
        await serve(cache, other, generator, prefetch=False)
        await serve(cache, prompt[: 3 * PAGE], generator, prefetch=False)
        await cache.drain()
        # B lands on the host as A's child: A is now a device leaf that needs a backup.
        assert (await cache.prefetch(prompt)).storage_tokens == PAGE
        with cache.request(other):  # X becomes the most recently used
            pass
        # One page: eviction reaches A (needs a backup that cannot start), then frees X's 3.
        with cache.request(rng.integers(0, 30_000, size=PAGE)) as request:
            assert len(await request.allocate(PAGE)) == 1
        await settle(cache)
        assert_drained(cache)
