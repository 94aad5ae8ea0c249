"""Prefetch page counters add up: every page a prefetch asks for lands in exactly one of
`misses`, `pages_read`, `pages_shared`, `corrupt` and `errors`; and landing a long prompt
costs in proportion to it, not to its square."""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache, PrefetchHandle, PrefetchResult, PrefetchStatus
from hicache_async.storage import MemoryStorage, Outcome, PageBuffer, StorageBackend
from hicache_async.testing import FaultyStorage, KVGenerator, assert_drained, serve
from hicache_async.tree import RadixTree
from hicache_async.workers import PrefetchStatistics

PAGE = 4


def _config(device_pages: int = 64, **prefetch: Any) -> CacheConfig:
    settings: dict[str, Any] = {
        "policy": "wait_complete",
        "threshold_tokens": 1,
        "batch_pages": 2,
        "max_host_share": 1.0,
    }
    settings.update(prefetch)
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": device_pages,
            "host_pages": 2 * device_pages + 1024,
            "model_id": "prefetch-counts-test",
            "prefetch": settings,
        }
    )


def _counted(stats: PrefetchStatistics | None) -> int:
    assert stats is not None
    return (
        stats.misses
        + stats.pages_read
        + stats.pages_shared
        + stats.corrupt
        + stats.errors
        + stats.pages_abandoned
        + stats.pages_skipped
    )


def _asked(result: PrefetchResult, pages: int) -> int:
    """Pages the prefetch had to look for: those not cached when it started (nothing is
    evicted in these tests, so its figures are not cut)."""
    return pages - (result.device_tokens + result.host_tokens) // PAGE


def _taking_turns(**prefetch: Any) -> tuple[CacheConfig, list[np.ndarray]]:
    """Two 8-page prompts with nothing in common and a config under which they take turns:
    a host share of two pages in a pool of eight, on a device of four, so each evicts pages
    the other landed."""
    config = CacheConfig.from_dict(
        {
            **msgspec.to_builtins(_config(max_host_share=0.3, **prefetch)),
            "device_pages": 4,
            "host_pages": 8,
        }
    )
    rng = np.random.default_rng(13)
    return config, [rng.integers(0, 5000, size=8 * PAGE) for _ in range(2)]


async def _store(memory: MemoryStorage, config: CacheConfig, *prompts: np.ndarray) -> None:
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with HiCache(config, storage=Unowned(memory)) as writer:
        for prompt in prompts:
            await serve(writer, prompt, generator, prefetch=False)
        await writer.drain()


class FailAt(Unowned):
    """A real backend whose gets answer `outcome` for the keys in `keys`."""

    def __init__(self, inner: StorageBackend, outcome: Outcome) -> None:
        super().__init__(inner)
        self.outcome = outcome
        self.keys: set[bytes] = set()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        outcomes = await self.inner.get(keys, into, namespace=namespace)
        return [
            self.outcome if bytes(k) in self.keys else o
            for k, o in zip(keys, outcomes, strict=True)
        ]


@pytest.mark.parametrize(("outcome", "counter"), [("ERROR", "errors"), ("MISS", "misses")])
async def test_the_pages_after_a_failed_batch_count_once(outcome: str, counter: str) -> None:
    # Page 2 of 8 fails in the second batch of two: the pages after that batch were counted
    # nowhere, so a prefetch's counters fell short of the pages it asked for.
    config = _config()
    prompt = np.random.default_rng(1).integers(0, 5000, size=8 * PAGE)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, config, prompt)
        store = FailAt(memory, Outcome[outcome])
        async with HiCache(config, storage=store) as cache:
            store.keys = {cache.namespace.storage_keys(cache.keys_for(prompt))[2]}
            result = await cache.prefetch(prompt)
            assert result.status is PrefetchStatus.TERMINATED
            assert result.storage_tokens == 2 * PAGE
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.pages_read == 3  # pages 0, 1 and 3 (read, not landed: after page 2)
            assert getattr(stats, counter) == 1 + 4  # page 2, then the four left unread
            assert _counted(stats) == 8


async def test_pages_others_landed_while_a_prefetch_looked_them_up_are_shared() -> None:
    # B's lookup is held while A reads and lands everything: B reads nothing, and its pages,
    # brought by A, are shared rather than counted nowhere.
    config = _config()
    prompt = np.random.default_rng(2).integers(0, 5000, size=8 * PAGE)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, config, prompt)
        store = HeldLookups(memory)
        async with HiCache(config, storage=store) as cache:
            store.hold = asyncio.get_running_loop().create_future()
            b = await cache.start_prefetch(prompt, request_id="B")
            await asyncio.wait_for(store.held.wait(), 30)
            store.hold, gate = None, store.hold
            a = await asyncio.wait_for(cache.prefetch(prompt, request_id="A"), 30)
            assert a.status is PrefetchStatus.COMPLETE
            gate.set_result(None)
            result = await asyncio.wait_for(b.wait(), 30)
            assert result.storage_tokens == 8 * PAGE
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.pages_read == 8
            assert stats.pages_shared == 8
            assert _counted(stats) == 16


async def test_pages_past_what_storage_holds_count_once_when_a_request_caches_them() -> None:
    # Storage holds 4 of 8 pages; while B looks them up, a request computes all 8. The 4
    # past what storage holds were counted as misses at the lookup and again as shared.
    config = _config()
    prompt = np.random.default_rng(4).integers(0, 5000, size=8 * PAGE)
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, config, prompt[: 4 * PAGE])
        store = HeldLookups(memory)
        async with HiCache(config, storage=store) as cache:
            store.hold = asyncio.get_running_loop().create_future()
            b = await cache.start_prefetch(prompt, request_id="B")
            await asyncio.wait_for(store.held.wait(), 30)
            store.hold, gate = None, store.hold
            await serve(cache, prompt, generator, prefetch=False, check="none")
            gate.set_result(None)
            result = await asyncio.wait_for(b.wait(), 30)
            assert result.storage_tokens == 8 * PAGE  # cached for the prompt all the same
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.misses == 4
            assert stats.pages_shared == 4
            assert _counted(stats) == 8


class HeldLookups(Unowned):
    """A real backend whose `exists` waits for `hold` while it is set."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.hold: asyncio.Future[None] | None = None
        self.held = asyncio.Event()

    async def exists(self, keys: Sequence[bytes]) -> int:
        hold = self.hold
        if hold is not None:
            self.held.set()
            await hold
        return await self.inner.exists(keys)


async def test_a_prefetchs_keys_and_figures_cannot_be_changed_while_it_runs() -> None:
    # The workers read the handle's own key list: cut in place while the lookup was held,
    # the prefetch read half the prompt while its counts were for all of it.
    config = _config()
    prompt = np.random.default_rng(3).integers(0, 5000, size=8 * PAGE)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, config, prompt)
        store = HeldLookups(memory)
        async with HiCache(config, storage=store) as cache:
            store.hold = asyncio.get_running_loop().create_future()
            handle = await cache.start_prefetch(prompt, request_id="A")
            await asyncio.wait_for(store.held.wait(), 30)
            del handle.keys[4:]
            for name, value in (
                ("keys", []),
                ("status", PrefetchStatus.COMPLETE),
                ("storage_tokens", 8 * PAGE),
                ("num_tokens", PAGE),
                ("min_tokens", 10**9),
                ("priority", 1 << 40),
                ("request_id", "B"),
            ):
                with pytest.raises(AttributeError):
                    setattr(handle, name, value)
            assert handle.status is PrefetchStatus.RUNNING
            store.hold, gate = None, store.hold
            gate.set_result(None)
            result = await asyncio.wait_for(handle.wait(), 30)
            assert result.status is PrefetchStatus.COMPLETE
            assert result.storage_tokens == 8 * PAGE
            assert handle.keys == cache.keys_for(prompt)
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.pages_read == _counted(stats) == 8
            await cache.drain()
            assert_drained(cache)


def _workload(seed: int, count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Prompts over a few shared prefixes (so reads are shared and cut short), and the
    prefixes storage holds (part of each prompt: the rest is a miss at `exists`)."""
    rng = random.Random(seed)
    gen = np.random.default_rng(seed)
    roots = [gen.integers(0, 5000, size=24 * PAGE) for _ in range(3)]
    prompts = []
    for _ in range(count):
        root = roots[rng.randrange(len(roots))]
        shared = rng.randrange(1, 25) * PAGE
        tail = gen.integers(0, 5000, size=rng.randrange(0, 8) * PAGE)
        prompts.append(np.concatenate([root[:shared], tail]))
    stored = [root[: rng.randrange(12, 25) * PAGE] for root in roots]
    stored += [p for p in prompts if rng.random() < 0.5]
    return prompts, stored


@pytest.mark.parametrize("seed", [3, 11])
async def test_every_page_a_prefetch_asks_for_counts_once_under_faults(seed: int) -> None:
    config = _config()
    prompts, stored = _workload(seed, 24)
    generator = KVGenerator(config.layout, PAGE, seed=5)
    faults = {"partial_batch_rate": 0.15, "error_rate": 0.05, "latency_s": 0.001}
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        await _store(memory, config, *stored)
        # One at a time: the counters each prefetch added are its pages, each once.
        store = FaultyStorage(Unowned(memory), seed=seed, **faults)
        async with HiCache(config, storage=store) as cache:
            for prompt in prompts:
                before = _counted(cache.storage_status().prefetch)
                result = await asyncio.wait_for(cache.prefetch(prompt), 30)
                added = _counted(cache.storage_status().prefetch) - before
                assert added == _asked(result, len(prompt) // PAGE), result
            injected = store.injected()
            assert injected.errors + injected.partial_batches > 0
            for prompt in prompts:  # what landed is the right KV
                await serve(cache, prompt, generator, prefetch=False, check="all")
            await cache.drain()
            assert_drained(cache)
        # All at once: reads shared, some failing under others waiting on them.
        store = FaultyStorage(Unowned(memory), seed=seed + 1, **faults)
        async with HiCache(config, storage=store) as cache:
            handles = [await cache.start_prefetch(prompt) for prompt in prompts]
            results = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 60)
            stats = cache.storage_status().prefetch
            asked = sum(_asked(r, len(p) // PAGE) for r, p in zip(results, prompts, strict=True))
            assert _counted(stats) == asked
            assert stats is not None
            assert stats.pages_shared > 0
            for prompt in prompts:
                await serve(cache, prompt, generator, prefetch=False, check="all")
            await cache.drain()
            assert_drained(cache)


async def test_landing_a_long_prompt_costs_in_proportion_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every landed batch matched the whole prefix again: a prompt of n pages read in
    # batches of b made n/b matches of up to n keys each. Counted in keys walked.
    pages = 512
    config = _config(device_pages=pages, batch_pages=4)
    prompt = np.random.default_rng(4).integers(0, 5000, size=pages * PAGE)
    walked = 0
    match, descend = RadixTree.match, RadixTree.descend

    def counting_match(self: RadixTree, keys: Sequence[bytes], **kwargs: Any) -> Any:
        nonlocal walked
        walked += len(keys)
        return match(self, keys, **kwargs)

    def counting_descend(self: RadixTree, node: Any, keys: Sequence[bytes]) -> Any:
        nonlocal walked
        walked += len(keys)
        return descend(self, node, keys)

    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        await _store(memory, config, prompt)
        generator = KVGenerator(config.layout, PAGE, seed=5)
        # Gets that take a moment, so the second prefetch comes to wait on the first's.
        store = FaultyStorage(Unowned(memory), latency_s=0.001)
        async with HiCache(config, storage=store) as cache:
            monkeypatch.setattr(RadixTree, "match", counting_match)
            monkeypatch.setattr(RadixTree, "descend", counting_descend)
            # Two, so the second waits on the first's reads and lands them as they come.
            first = await cache.start_prefetch(prompt)
            second = await cache.start_prefetch(prompt)
            results = await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), 60)
            monkeypatch.undo()
            assert [r.cached_tokens for r in results] == [pages * PAGE] * 2
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.pages_read == pages
            assert stats.pages_shared > 0
            # A few whole-prompt matches per prefetch (its start, its plan, its end), and
            # each landed page once: not a match of the prefix for every batch.
            assert walked <= 2 * 5 * pages
            await serve(cache, prompt, generator, prefetch=False, check="all")
            await cache.drain()
            assert_drained(cache)


class HeldGets(Unowned):
    """A real backend whose gets after the first `free` wait for `gate` before reading."""

    def __init__(self, inner: StorageBackend, free: int) -> None:
        super().__init__(inner)
        self.free = free
        self.gate = asyncio.get_running_loop().create_future()
        self.held = asyncio.Event()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        if self.free:
            self.free -= 1
        else:
            self.held.set()
            await asyncio.shield(self.gate)
        return await self.inner.get(keys, into, namespace=namespace)


@pytest.mark.parametrize("stop", ["terminate", "cancel"])
async def test_the_pages_a_stopped_prefetch_did_not_reach_count_once(stop: str) -> None:
    # Stopped during its second batch: the pages it had not read were in no counter.
    config = _config()
    prompt = np.random.default_rng(6).integers(0, 5000, size=8 * PAGE)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, config, prompt)
        store = HeldGets(memory, free=1)
        async with HiCache(config, storage=store) as cache:
            handle = await cache.start_prefetch(prompt)
            await asyncio.wait_for(store.held.wait(), 30)
            getattr(handle, stop)()
            store.gate.set_result(None)
            result = await asyncio.wait_for(handle.wait(), 30)
            stats = cache.storage_status().prefetch
            assert stats is not None
            read = 4 if stop == "terminate" else 2  # a terminated one lands its batch
            assert result.storage_tokens == read * PAGE
            assert stats.pages_read == read
            assert stats.pages_abandoned == 8 - read
            assert _counted(stats) == 8


async def test_the_pages_a_prefetch_left_for_a_full_host_pool_count_once() -> None:
    # The host pool holds the copies of a request's device pages, which cannot be evicted:
    # room for two of the eight pages, and the six left were in no counter.
    config = CacheConfig.from_dict(
        {
            **msgspec.to_builtins(_config()),
            "device_pages": 16,
            "host_pages": 8,
            "write_through_threshold": 1,
        }
    )
    generator = KVGenerator(config.layout, PAGE, seed=5)
    prompt = np.random.default_rng(7).integers(0, 5000, size=8 * PAGE)
    other = np.random.default_rng(8).integers(0, 5000, size=6 * PAGE)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, config, prompt)
        async with HiCache(config, storage=Unowned(memory)) as cache:
            await serve(cache, other, generator, prefetch=False)
            await cache.drain()
            assert cache.host_pool.allocator.free_count == 2
            result = await asyncio.wait_for(cache.prefetch(prompt), 30)
            assert result.status is PrefetchStatus.TERMINATED
            assert result.storage_tokens == 2 * PAGE
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.pages_read == 2
            assert stats.pages_abandoned == 6
            assert _counted(stats) == 8


async def test_the_pages_past_a_repeated_key_count_once() -> None:
    # A forged chain repeats its first key at its third page: it reads no further, and the
    # pages from the repeat on were in no counter.
    config = _config()
    prompt = np.random.default_rng(9).integers(0, 5000, size=4 * PAGE)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, config, prompt)
        async with HiCache(config, storage=Unowned(memory)) as cache:
            link = cache._link
            assert link is not None
            real = cache.keys_for(prompt)
            keys = [real[0], real[1], real[0], real[2]]
            handle = PrefetchHandle(link.prefetcher, keys, len(keys) * PAGE, "own", "wait_complete")
            await link.prefetcher.run_now(handle)
            assert handle.storage_tokens == 2 * PAGE
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.pages_read == 2
            assert stats.pages_abandoned == 2
            assert _counted(stats) == 4


async def test_the_pages_storage_holds_of_a_skipped_prefetch_count_once() -> None:
    # Storage holds 2 of 8 pages, fewer than the threshold of 3: the 6 it lacks were misses,
    # the 2 it holds were in no counter.
    config = _config(threshold_tokens=3 * PAGE)
    prompt = np.random.default_rng(10).integers(0, 5000, size=8 * PAGE)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, config, prompt[: 2 * PAGE])
        async with HiCache(config, storage=Unowned(memory)) as cache:
            result = await asyncio.wait_for(cache.prefetch(prompt), 30)
            assert result.status is PrefetchStatus.SKIPPED
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert (stats.misses, stats.pages_skipped, stats.pages_read) == (6, 2, 0)
            assert _counted(stats) == 8


async def test_the_pages_of_a_prefetch_stopped_during_its_lookup_count_once() -> None:
    config = _config()
    prompt = np.random.default_rng(11).integers(0, 5000, size=8 * PAGE)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, config, prompt[: 6 * PAGE])
        store = HeldLookups(memory)
        async with HiCache(config, storage=store) as cache:
            store.hold = asyncio.get_running_loop().create_future()
            handle = await cache.start_prefetch(prompt)
            await asyncio.wait_for(store.held.wait(), 30)
            handle.terminate()  # cuts the lookup short: its answer would go unused
            result = await asyncio.wait_for(handle.wait(), 30)
            assert result.status is PrefetchStatus.TERMINATED
            assert store.hold.cancelled()
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert (stats.misses, stats.pages_abandoned, stats.pages_read) == (0, 8, 0)
            assert _counted(stats) == 8


@pytest.mark.parametrize("seed", [3, 11])
async def test_every_page_counts_once_with_prefetches_stopped_while_they_run(seed: int) -> None:
    # Shared reads under faults, in turns under a small host share, each prefetch terminated,
    # cancelled or left alone once a worker has taken it.
    config = _config(max_host_share=0.05, workers=32, queue_size=64)
    prompts, stored = _workload(seed, 24)
    generator = KVGenerator(config.layout, PAGE, seed=5)
    rng = random.Random(seed)
    faults = {"partial_batch_rate": 0.1, "error_rate": 0.05, "latency_s": 0.002}
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        await _store(memory, config, *stored)
        store = FaultyStorage(Unowned(memory), seed=seed, **faults)
        async with HiCache(config, storage=store) as cache:
            handles = [await cache.start_prefetch(prompt) for prompt in prompts]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            for handle in handles:
                while handle.status is PrefetchStatus.QUEUED:  # until a worker takes it
                    assert loop.time() < deadline
                    await asyncio.sleep(0)
                choice = rng.randrange(3)
                if choice == 0:
                    handle.terminate()
                elif choice == 1:
                    handle.cancel()
            results = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 60)
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert stats.pages_abandoned > 0
            asked = sum(_asked(r, len(p) // PAGE) for r, p in zip(results, prompts, strict=True))
            assert _counted(stats) == asked
            for prompt in prompts:
                await serve(cache, prompt, generator, prefetch=False, check="all")
            await cache.drain()
            assert_drained(cache)


class CountedReads(Unowned):
    """A real backend that counts the gets of each key."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.reads: collections.Counter[bytes] = collections.Counter()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        self.reads.update(bytes(k) for k in keys)
        # The inner store lets the loop run once per call, so the two take turns (a turn
        # more here would let one prefetch evict and read again its own pages).
        return await self.inner.get(keys, into, namespace=namespace)


async def test_prefetches_that_read_evicted_pages_again_count_no_shared_pages() -> None:
    # Two prompts with nothing in common, taking turns under a host share of two pages in a
    # pool of eight: each evicts pages the other landed and reads them again. Those read
    # again counted as pages others shared, in place of the pages left unreached.
    config, prompts = _taking_turns()
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, _config(), *prompts)
        store = CountedReads(memory)
        async with HiCache(config, storage=store) as cache:
            handles = [await cache.start_prefetch(prompt) for prompt in prompts]
            await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 30)
            stats = cache.storage_status().prefetch
            assert stats is not None
            again = stats.pages_read - len(store.reads)
            assert again > 0  # the case this is about
            assert stats.pages_shared == 0
            # Every page once, and each page read again once more for each time.
            assert _counted(stats) - again == 16


class FailsReadsAgain(CountedReads):
    """A real backend that counts the gets of each key and answers `outcome` for a key read
    before."""

    def __init__(self, inner: StorageBackend, outcome: Outcome) -> None:
        super().__init__(inner)
        self.outcome = outcome

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        again = [self.reads[bytes(k)] > 0 for k in keys]
        outcomes = await super().get(keys, into, namespace=namespace)
        return [self.outcome if a else o for a, o in zip(again, outcomes, strict=True)]


@pytest.mark.parametrize(
    ("outcome", "counter"), [("MISS", "misses"), ("ERROR", "errors"), ("CORRUPT", "corrupt")]
)
async def test_a_page_read_again_that_fails_counts_the_pages_after_it_once(
    outcome: str, counter: str
) -> None:
    # Taking turns under a host share of two pages, read one at a time: each prefetch's last
    # two pages are evicted by the other and read again, and that read fails. The pages
    # after the failed one were counted again as misses or errors, although one of them
    # was read already and is not read again.
    config, prompts = _taking_turns(batch_pages=1)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, _config(), *prompts)
        store = FailsReadsAgain(memory, Outcome[outcome])
        async with HiCache(config, storage=store) as cache:
            handles = [await cache.start_prefetch(prompt) for prompt in prompts]
            await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 30)
            stats = cache.storage_status().prefetch
            assert stats is not None
            again = sum(store.reads.values()) - len(store.reads)
            assert again > 0  # the case this is about
            assert getattr(stats, counter) > 0
            # Every page once, and each page read again once more for each time.
            assert _counted(stats) - again == 16


async def test_a_page_read_lost_and_then_failing_counts_once_where_a_plan_stops() -> None:
    # As above, but each page read is taken as failed just after (as when another prefetch's
    # read of it fails): a prefetch planning again from a page it read and lost stops
    # there, without reading. The pages from there on were counted as misses, those it had
    # read included.
    config, prompts = _taking_turns(batch_pages=1)
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, _config(), *prompts)
        store = CountedReads(memory)
        async with HiCache(config, storage=store) as cache:
            link = cache._link
            assert link is not None
            failed = link.prefetcher.failed_reads
            tree_key: dict[bytes, bytes] = {}
            for prompt in prompts:
                keys = cache.keys_for(prompt)
                tree_key.update(zip(cache.namespace.storage_keys(keys), keys, strict=True))
            inner_get = store.get

            async def get_then_fail(
                keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
            ) -> list[Outcome]:
                outcomes = await inner_get(keys, into, namespace=namespace)
                failed.add([tree_key[bytes(k)] for k in keys])
                return outcomes

            store.get = get_then_fail  # type: ignore[method-assign]
            handles = [await cache.start_prefetch(prompt) for prompt in prompts]
            await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 30)
            stats = cache.storage_status().prefetch
            assert stats is not None
            assert max(store.reads.values()) == 1  # none read again: taken as failed
            assert stats.pages_read == len(store.reads) < 16  # some lost before the end
            assert _counted(stats) == 16


@pytest.mark.parametrize("outcome", ["MISS", "ERROR"])
async def test_a_page_lost_and_waited_for_again_that_fails_counts_the_pages_after_it_once(
    outcome: str,
) -> None:
    # Two prompts, each asked for twice, taking turns under a host share of three pages: a
    # prefetch that lost pages it read waits for another one's read of them again, which
    # fails. The pages from the failed one on were counted as misses, those it had read
    # included.
    config = CacheConfig.from_dict(
        {
            **msgspec.to_builtins(_config(max_host_share=0.3)),
            "device_pages": 4,
            "host_pages": 12,
        }
    )
    rng = np.random.default_rng(13)
    first, second = (rng.integers(0, 5000, size=8 * PAGE) for _ in range(2))
    prompts = [first, second, second, first]
    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        await _store(memory, _config(), first, second)
        store = FailsReadsAgain(memory, Outcome[outcome])
        async with HiCache(config, storage=store) as cache:
            handles = [await cache.start_prefetch(prompt) for prompt in prompts]
            results = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 30)
            stats = cache.storage_status().prefetch
            assert stats is not None
            # One page is read twice, by two prefetches: the second read fails, under the
            # prefetch that lost it and waits for it (none reads a page twice itself).
            assert sum(store.reads.values()) > len(store.reads)
            asked = sum(_asked(r, len(p) // PAGE) for r, p in zip(results, prompts, strict=True))
            assert _counted(stats) == asked
