"""Prefetches that share reads: one giving up never makes another give up, a page read once
counts once, a failed read is not read again by those that waited on it, and a prefetch
reports (and holds) the pages others brought it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import structlog
from _log_table import assert_documented
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache, PrefetchHandle, PrefetchStatus
from hicache_async._ratelog import LogLimiter
from hicache_async.storage import (
    MemoryStorage,
    Outcome,
    PageBuffer,
    StorageBackend,
    StorageCapabilities,
)
from hicache_async.testing import KVGenerator, assert_drained, serve
from hicache_async.workers import Prefetcher, _prefetch

PAGE = 4
PAGES = 8


def _config(**prefetch: Any) -> CacheConfig:
    settings: dict[str, Any] = {
        "policy": "wait_complete",
        "threshold_tokens": PAGE,
        "batch_pages": 4,
    }
    settings.update(prefetch)
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "prefetch-sharing-test",
            "prefetch": settings,
        }
    )


class HeldGets(Unowned):
    """A real backend whose gets, once done, wait for `gate` while it is set."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate: asyncio.Future[None] | None = None
        self.held = asyncio.Event()
        self.gets = 0

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        self.gets += 1
        outcomes = await self.inner.get(keys, into, namespace=namespace)
        gate = self.gate
        if gate is not None:
            self.held.set()
            await gate
        return outcomes


class Gate:
    """While closed, each call that passes waits until the test releases it."""

    def __init__(self) -> None:
        self.closed = False
        self.waiting: list[asyncio.Event] = []

    async def passage(self) -> None:
        if not self.closed:
            return
        event = asyncio.Event()
        self.waiting.append(event)
        try:
            await event.wait()
        finally:
            self.waiting.remove(event)

    def release(self) -> None:
        """Let through every call waiting now (later ones wait while the gate is closed)."""
        for event in self.waiting:
            event.set()

    def open(self) -> None:
        self.closed = False
        self.release()


class GatedStorage(Unowned):
    """A real backend whose `get` and `exists` calls pass gates the test opens; it counts
    the reads of each key, and can fail gets (`error`) once they pass the gate."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gets = Gate()
        self.lookups = Gate()
        self.reads: collections.Counter[bytes] = collections.Counter()
        self.error: Exception | None = None
        self.miss = False  # gets answer MISS once they pass the gate

    async def exists(self, keys: Sequence[bytes]) -> int:
        await self.lookups.passage()
        return await self.inner.exists(keys)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        self.reads.update(bytes(key) for key in keys)
        await self.gets.passage()
        if self.error is not None:
            raise self.error
        if self.miss:
            return [Outcome.MISS] * len(keys)
        return await self.inner.get(keys, into, namespace=namespace)

    def open(self) -> None:
        self.gets.open()
        self.lookups.open()


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def _stored(memory: MemoryStorage, config: CacheConfig, prompt: np.ndarray) -> KVGenerator:
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with HiCache(config, storage=Unowned(memory)) as writer:
        await serve(writer, prompt, generator, prefetch=False)
        await writer.drain()
    return generator


@contextlib.asynccontextmanager
async def _gated(
    config: CacheConfig, *prompts: np.ndarray
) -> AsyncIterator[tuple[HiCache, GatedStorage, KVGenerator]]:
    """A cache over a store holding `prompts`, whose gets wait at the gate until the test
    lets them through (opened on the way out, so a failed assertion cannot hang the close)."""
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        generator = KVGenerator(config.layout, PAGE, seed=5)
        for prompt in prompts:
            await _stored(memory, config, prompt)
        store = GatedStorage(memory)
        async with HiCache(config, storage=store) as cache:
            store.gets.closed = True
            try:
                yield cache, store, generator
            finally:
                store.open()


def _prompt(seed: int, pages: int = PAGES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, size=pages * PAGE)


def _prefetcher(cache: HiCache) -> Prefetcher:
    link = cache._link
    assert link is not None
    return link.prefetcher


def _waiters(cache: HiCache, key: bytes) -> int:
    """How many prefetches wait on another's read of `key`."""
    flight = _prefetcher(cache)._inflight.get(key)
    return 0 if flight is None else len(flight.waiters)


def _reader(cache: HiCache) -> PrefetchHandle:
    """The one prefetch whose storage call is in flight."""
    (reader,) = [h for h in _prefetcher(cache)._running if h._reading]
    return reader


async def _sharing(
    cache: HiCache, store: GatedStorage, prompt: np.ndarray, names: str
) -> list[PrefetchHandle]:
    """Prefetches of `prompt`, one per letter of `names`: the first reads (its get held at
    the gate), the others wait on its read."""
    key = cache.keys_for(prompt)[0]
    handles = [await cache.start_prefetch(prompt, request_id=names[0])]
    await _until(lambda: len(store.gets.waiting) == 1, f"{names[0]}'s get in flight")
    for count, name in enumerate(names[1:], 1):
        handles.append(await cache.start_prefetch(prompt, request_id=name))
        await _until(lambda n=count: _waiters(cache, key) == n, f"{name} to wait")
    return handles


def _read_once(store: GatedStorage, cache: HiCache, prompt: np.ndarray) -> None:
    keys = cache.namespace.storage_keys(cache.keys_for(prompt))
    assert [store.reads[key] for key in keys] == [1] * len(keys)


async def _check_and_drain(cache: HiCache, prompt: np.ndarray, generator: KVGenerator) -> None:
    await serve(cache, prompt, generator, prefetch=False, check="all")
    await cache.drain()
    assert_drained(cache)


async def test_a_cancelled_prefetch_lands_the_batch_others_wait_on_and_they_read_the_rest() -> None:
    # A's caller is cancelled while B waits on A's first batch: that batch still lands (for
    # B), A issues no further read and ends CANCELLED, and B reads the pages A gave up itself.
    prompt = _prompt(5)
    async with _gated(_config(), prompt) as (cache, store, generator):
        first = asyncio.create_task(cache.prefetch(prompt, request_id="A"))
        await _until(lambda: len(store.gets.waiting) == 1, "A's first batch in flight")
        a = _reader(cache)
        second = await cache.start_prefetch(prompt, request_id="B")
        await _until(lambda: _waiters(cache, a.keys[0]) == 1, "B to wait on A's reads")
        first.cancel()
        # The caller is let go at once; the read it started is not.
        await asyncio.wait([first])
        assert first.cancelled()
        assert not a.done()
        store.gets.open()
        result = await asyncio.wait_for(second.wait(), 30)
        assert (await asyncio.wait_for(a.wait(), 30)).status is PrefetchStatus.CANCELLED
        assert a.storage_tokens == 4 * PAGE  # its batch in flight, nothing after it
        assert result.status is PrefetchStatus.COMPLETE
        assert result.storage_tokens == len(prompt)
        _read_once(store, cache, prompt)
        assert cache.statistics().tokens.storage == len(prompt)
        await _check_and_drain(cache, prompt, generator)


async def test_a_cancelled_prefetch_stops_its_read_once_nobody_waits_on_it() -> None:
    prompt = _prompt(8)
    async with _gated(_config(), prompt) as (cache, store, generator):
        a, b = await _sharing(cache, store, prompt, "AB")
        a.cancel()
        scope = a._scope
        assert scope is not None
        assert not scope.cancel_called  # B waits on its read
        b.cancel()  # the last waiter leaves: A's read is abandoned, the gate still shut
        one, two = await asyncio.wait_for(asyncio.gather(a.wait(), b.wait()), 30)
        assert one.status is two.status is PrefetchStatus.CANCELLED
        assert one.storage_tokens == two.storage_tokens == 0
        store.gets.open()
        await _check_and_drain(cache, prompt, generator)


async def test_a_detach_cancels_a_read_others_wait_on_at_once() -> None:
    prompt = _prompt(9)
    async with _gated(_config(), prompt) as (cache, store, _):
        a, b = await _sharing(cache, store, prompt, "AB")
        # With the gate still shut: the detach does not wait for A's read.
        await asyncio.wait_for(cache.detach_storage(flush=False), 30)
        assert a.status is b.status is PrefetchStatus.CANCELLED
        assert_drained(cache)


def _futures() -> int:
    return sum(issubclass(type(o), asyncio.Future) for o in gc.get_objects())


async def test_a_long_prefetch_makes_a_future_per_read_batch_not_per_page() -> None:
    # In one step a prefetch plans every page it reads; a future per page would cost as many
    # objects (and, in asyncio debug mode, a traceback each) as the prompt has pages.
    pages, batch = 512, 128
    settings = _config(batch_pages=batch).to_dict()
    settings.update(device_pages=2 * pages, host_pages=2 * pages)
    config = CacheConfig.from_dict(settings)
    prompt = _prompt(21, pages)
    async with _gated(config, prompt) as (cache, store, generator):
        before = _futures()
        a = await cache.start_prefetch(prompt, request_id="A")
        await _until(lambda: len(store.gets.waiting) == 1, "A's first batch in flight")
        assert len(_prefetcher(cache)._inflight) == pages
        assert _futures() - before < 2 * pages // batch + 16
        # A second prefetch waits on those batches and lands every page with them.
        b = await cache.start_prefetch(prompt, request_id="B")
        await _until(lambda: _waiters(cache, a.keys[0]) == 1, "B to wait on A's reads")
        store.gets.open()
        results = await asyncio.wait_for(asyncio.gather(a.wait(), b.wait()), 30)
        assert [r.status for r in results] == [PrefetchStatus.COMPLETE] * 2
        assert [r.cached_tokens for r in results] == [len(prompt)] * 2
        _read_once(store, cache, prompt)
        await _check_and_drain(cache, prompt, generator)


async def test_pages_read_once_for_two_prefetches_count_once_in_the_storage_tokens() -> None:
    config = _config()
    prompt = _prompt(6)
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        generator = await _stored(memory, config, prompt)
        held = HeldGets(memory)
        async with HiCache(config, storage=held) as reader:
            held.gate = asyncio.get_running_loop().create_future()
            first = await reader.start_prefetch(prompt, request_id="A")
            await asyncio.wait_for(held.held.wait(), 30)
            second = await reader.start_prefetch(prompt, request_id="B")
            link = reader._link
            assert link is not None
            await _until(lambda: len(link.prefetcher._running) == 2, "B to wait on A's reads")
            gate, held.gate = held.gate, None
            gate.set_result(None)
            one, two = await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), 30)
            assert one.status is two.status is PrefetchStatus.COMPLETE
            # Each reports what it has from storage; the cache counts each page read once.
            assert one.storage_tokens == two.storage_tokens == len(prompt)
            assert held.gets == PAGES // 4
            assert reader.statistics().tokens.storage == len(prompt)
            status = reader.storage_status().prefetch
            assert status is not None
            assert (status.pages_read, status.pages_shared) == (PAGES, PAGES)
            await _check_and_drain(reader, prompt, generator)


async def test_pages_others_landed_while_a_prefetch_looked_them_up_count_for_it() -> None:
    # B matched nothing, then A landed the whole prompt while B's `exists` ran: B found it
    # all cached when it planned, and reported 0 tokens (COMPLETE) for a prompt on the host.
    prompt = _prompt(7)
    async with _gated(_config(), prompt) as (cache, store, generator):
        (a,) = await _sharing(cache, store, prompt, "A")
        store.lookups.closed = True
        b = await cache.start_prefetch(prompt, request_id="B")
        await _until(lambda: len(store.lookups.waiting) == 1, "B's lookup in flight")
        store.gets.open()
        one = await asyncio.wait_for(a.wait(), 30)
        store.lookups.open()
        two = await asyncio.wait_for(b.wait(), 30)
        assert one.status is two.status is PrefetchStatus.COMPLETE
        assert one.cached_tokens == two.cached_tokens == len(prompt)
        assert two.storage_tokens == len(prompt)
        assert cache.statistics().tokens.storage == len(prompt)  # read once, by A
        _read_once(store, cache, prompt)
        await _check_and_drain(cache, prompt, generator)


async def test_a_prefetch_sharing_with_readers_that_stop_in_turn_reads_everything() -> None:
    # Three prefetches read the prompt in turn, each terminated (a timeout policy's wait
    # ending) once its batch in flight lands. B, waiting on each, used to count every hand-over
    # as a failed plan and end TERMINATED after the third with part of the prompt.
    prompt = _prompt(10, 4 * PAGES)
    async with _gated(_config(), prompt) as (cache, store, generator):
        *readers, b = await _sharing(cache, store, prompt, "XYZB")
        for turn, reader in enumerate(readers):
            assert _reader(cache) is reader  # the earliest waiter plans first
            reader.terminate()
            store.gets.release()
            await asyncio.wait_for(reader.wait(), 30)
            if turn < len(readers) - 1:
                await _until(lambda: len(store.gets.waiting) == 1, "the next reader")
        store.gets.open()
        result = await asyncio.wait_for(b.wait(), 30)
        assert [r.status for r in readers] == [PrefetchStatus.TERMINATED] * 3
        assert result.status is PrefetchStatus.COMPLETE
        assert result.storage_tokens == len(prompt)
        _read_once(store, cache, prompt)
        await _check_and_drain(cache, prompt, generator)


@pytest.mark.parametrize("failure", ["error", "timeout"])
async def test_a_failed_shared_read_ends_those_waiting_on_it_without_reading_it_again(
    failure: str,
) -> None:
    # A's get failed (raised, or hung past io_timeout_s): B and C, waiting on it, each read
    # the page again in turn, so a hanging store held them for one timeout after another.
    prompt = _prompt(11)
    config = _config(io_timeout_s=1.0 if failure == "timeout" else 10.0)
    async with _gated(config, prompt) as (cache, store, generator):
        handles = await _sharing(cache, store, prompt, "ABC")
        if failure == "error":
            store.error = OSError("storage unreachable")
            store.gets.release()
        # else: the gate stays shut until A's call times out
        results = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 30)
        assert [r.status for r in results] == [PrefetchStatus.TERMINATED] * 3
        assert [r.cached_tokens for r in results] == [0, 0, 0]
        storage_keys = cache.namespace.storage_keys(cache.keys_for(prompt))
        assert [store.reads[key] for key in storage_keys[:4]] == [1] * 4
        assert sum(store.reads.values()) == 4  # A's first batch, once
        status = cache.storage_status().prefetch
        assert status is not None
        # Every page asked lands in one counter: A's failed batch and the batch it left
        # unread are errors; B and C, which read none of it again, count all theirs as
        # misses (they used to count nowhere).
        assert status.errors == 2 * 4
        assert status.misses == 2 * PAGES
        assert status.pages_read == status.pages_shared == status.corrupt == 0
        store.error = None
        store.gets.open()
        await _check_and_drain(cache, prompt, generator)


async def test_a_corrupt_page_ends_those_sharing_its_read_at_it_without_rereads() -> None:
    # Page 1 of a batch is corrupt: the sharers used to read pages 1-7 again (the reader had
    # read 2-7 fine) and ask for the removed page again.
    prompt = _prompt(12)
    async with _gated(_config(batch_pages=PAGES), prompt) as (cache, store, generator):
        key = cache.namespace.storage_keys(cache.keys_for(prompt))[1]
        raw = bytearray(await store.read_raw(key))
        raw[-1] ^= 0xFF
        await store.write_raw(key, bytes(raw))
        handles = await _sharing(cache, store, prompt, "ABC")
        store.gets.open()
        results = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 30)
        assert [r.status for r in results] == [PrefetchStatus.TERMINATED] * 3
        assert [r.cached_tokens for r in results] == [PAGE] * 3
        _read_once(store, cache, prompt)
        status = cache.storage_status().prefetch
        assert status is not None
        assert status.corrupt == 1
        await _check_and_drain(cache, prompt, generator)


async def test_a_prefetch_holds_the_pages_it_waited_for_until_it_ends() -> None:
    # B (a longer prompt) waited on A's read of its first pages and read the rest itself.
    # Once A ended nobody protected A's pages: host pressure evicted them, B's own pages
    # could not attach, and B reported tokens that were no longer cached.
    d = _config(batch_pages=PAGES, max_host_share=1.0).to_dict()
    d["host_pages"] = 16
    config = CacheConfig.from_dict(d)
    long, other = _prompt(13), _prompt(14, 12)
    short = long[: 6 * PAGE]
    async with _gated(config, long, other) as (cache, store, generator):
        a = await cache.start_prefetch(short, request_id="A")
        await _until(lambda: len(store.gets.waiting) == 1, "A's read in flight")
        b = await cache.start_prefetch(long, request_id="B")
        await _until(lambda: _waiters(cache, a.keys[0]) == 1, "B to wait on A's reads")
        # A's read lands and A ends: the pages are B's to hold now, while it reads the rest.
        store.gets.release()
        assert (await asyncio.wait_for(a.wait(), 30)).status is PrefetchStatus.COMPLETE
        await _until(lambda: len(store.gets.waiting) == 1, "B's own read in flight")
        # Host pressure: a prefetch of another prompt takes every host page it can.
        c = await cache.start_prefetch(other, request_id="C")
        await _until(lambda: len(store.gets.waiting) == 2, "C's read in flight")
        store.gets.open()
        result = await asyncio.wait_for(b.wait(), 30)
        await asyncio.wait_for(c.wait(), 30)
        assert result.status is PrefetchStatus.COMPLETE
        assert result.cached_tokens == len(long)
        assert cache.match(long).host_tokens == len(long)
        await _check_and_drain(cache, long, generator)


async def test_a_prefetch_larger_than_the_host_budget_reads_it_in_turns() -> None:
    # Half the prompt fits the prefetches' share of the host pool: it reads a half, lands
    # it, then reads the other, never holding more than its share, and ends COMPLETE.
    prompt = _prompt(11)
    async with _gated(_config(max_host_share=(PAGES // 2) / 128), prompt) as (
        cache,
        store,
        generator,
    ):
        reading = asyncio.ensure_future(cache.prefetch(prompt))
        held = []
        while not reading.done():
            await _until(lambda: bool(store.gets.waiting) or reading.done(), "a get or the end")
            stats = cache.storage_status().prefetch
            assert stats is not None
            held.append(stats.host_pages_held)
            assert stats.host_pages_held <= stats.host_pages_limit == PAGES // 2
            store.gets.release()
            await asyncio.sleep(0)
        result = reading.result()
        assert result.status is PrefetchStatus.COMPLETE
        assert result.storage_tokens == len(prompt)
        assert held.count(PAGES // 2) == 2  # two turns, each at the budget
        _read_once(store, cache, prompt)
        await _check_and_drain(cache, prompt, generator)


async def test_prefetches_over_the_host_budget_take_turns_and_read_everything() -> None:
    # Each prompt alone fills the budget: the second waits for room instead of ending with
    # what little it got while the first held it.
    prompts = [_prompt(31), _prompt(32)]
    async with _gated(_config(max_host_share=PAGES / 128), *prompts) as (
        cache,
        store,
        generator,
    ):
        handles = [await cache.start_prefetch(prompt) for prompt in prompts]
        await _until(lambda: len(store.gets.waiting) == 1, "the first read to hold the budget")
        await _until(lambda: handles[1].status is PrefetchStatus.RUNNING, "the second to run")
        store.gets.open()
        results = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 30)
        for prompt, result in zip(prompts, results, strict=True):
            assert result.status is PrefetchStatus.COMPLETE
            assert result.storage_tokens == len(prompt)
            _read_once(store, cache, prompt)
        for prompt in prompts:
            await _check_and_drain(cache, prompt, generator)


async def test_a_prefetch_back_for_its_next_turn_waits_behind_those_in_line() -> None:
    # L is twice the budget; S, started while L reads its first half, must get the room L
    # lets go of, not wait until L has read everything (a timeout policy would give up).
    large, small = _prompt(36), _prompt(37, pages=2)
    async with _gated(_config(max_host_share=(PAGES // 2) / 128), large, small) as (
        cache,
        store,
        generator,
    ):
        first = await cache.start_prefetch(large, request_id="L")
        await _until(lambda: len(store.gets.waiting) == 1, "L's first turn to hold the budget")
        second = await cache.start_prefetch(small, request_id="S")
        await _until(lambda: second.status is PrefetchStatus.RUNNING, "S to run")
        store.gets.release()  # L's first turn lands and lets the budget go
        await _until(lambda: sum(store.reads.values()) > PAGES // 2, "the next read")
        small_keys = cache.namespace.storage_keys(second.keys)
        assert all(store.reads[k] == 1 for k in small_keys), "L took its next turn first"
        store.gets.open()
        for handle, prompt in ((first, large), (second, small)):
            result = await asyncio.wait_for(handle.wait(), 30)
            assert (result.status, result.storage_tokens) == (PrefetchStatus.COMPLETE, len(prompt))
            _read_once(store, cache, prompt)
        for prompt in (large, small):
            await _check_and_drain(cache, prompt, generator)


async def test_a_prefetch_reading_nothing_of_its_own_does_not_wait_in_the_budget_line() -> None:
    # X's pages are all in L's read: it needs no budget, and must end when they land, not
    # wait behind S (which needs room) in the line.
    large, other = _prompt(38), _prompt(39, pages=4)
    async with _gated(_config(max_host_share=(PAGES // 2) / 128), large, other) as (
        cache,
        store,
        generator,
    ):
        first = await cache.start_prefetch(large, request_id="L")
        await _until(lambda: len(store.gets.waiting) == 1, "L's first turn to hold the budget")
        waiting = await cache.start_prefetch(other, request_id="S")
        await _until(lambda: waiting.status is PrefetchStatus.RUNNING, "S to wait for room")
        sharing = await cache.start_prefetch(large[: (PAGES // 2) * PAGE], request_id="X")
        await _until(lambda: _waiters(cache, first.keys[0]) == 1, "X to wait on L's read")
        store.gets.release()  # L's first turn only; S's read, next, stays at the gate
        await _until(sharing.done, "X to end as L's read lands")
        result = sharing.result()
        assert (result.status, result.storage_tokens) == (PrefetchStatus.COMPLETE, 4 * PAGE)
        store.gets.open()
        for handle in (first, waiting):
            assert (await asyncio.wait_for(handle.wait(), 30)).status is PrefetchStatus.COMPLETE
        for prompt in (large, other):
            await _check_and_drain(cache, prompt, generator)


@pytest.mark.parametrize("stop", ["terminate", "cancel"])
async def test_a_prefetch_waiting_for_host_budget_stops_when_told(stop: str) -> None:
    # A timeout policy's deadline terminates a prefetch that is still waiting for room:
    # it must end then, not once the prefetch holding the budget lets go.
    first, second = _prompt(33), _prompt(34)
    async with _gated(_config(max_host_share=PAGES / 128), first, second) as (
        cache,
        store,
        generator,
    ):
        holder = await cache.start_prefetch(first, request_id="A")
        await _until(lambda: len(store.gets.waiting) == 1, "A's read to hold the budget")
        waiting = await cache.start_prefetch(second, request_id="B")
        await _until(lambda: waiting.status is PrefetchStatus.RUNNING, "B to run")
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(store.gets.waiting) == 1  # B reads nothing: no room
        getattr(waiting, stop)()
        result = await asyncio.wait_for(waiting.wait(), 30)
        assert len(store.gets.waiting) == 1  # A still holds its read
        expected = PrefetchStatus.TERMINATED if stop == "terminate" else PrefetchStatus.CANCELLED
        assert (result.status, result.storage_tokens) == (expected, 0)
        store.gets.open()
        assert (await asyncio.wait_for(holder.wait(), 30)).status is PrefetchStatus.COMPLETE
        assert sum(store.reads[k] for k in cache.namespace.storage_keys(waiting.keys)) == 0
        await _check_and_drain(cache, first, generator)


async def test_a_prefetch_with_no_host_budget_ends_without_reading() -> None:
    prompt = _prompt(35)
    async with _gated(_config(max_host_share=0.0), prompt) as (cache, store, generator):
        store.gets.open()
        result = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, 0)
        assert not store.reads
        await _check_and_drain(cache, prompt, generator)


async def test_a_positive_host_share_below_one_page_still_reads_a_page_at_a_time() -> None:
    # 128 host pages x 0.005 rounds down to none: every prefetch ended unread (as with a
    # share of 0) although the share allows reads. It now reads one page at a time.
    prompt = _prompt(36)
    async with _gated(_config(max_host_share=0.005), prompt) as (cache, store, generator):
        stats = cache.storage_status().prefetch
        assert stats is not None
        assert stats.host_pages_limit == 1
        store.gets.open()
        result = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert (result.status, result.storage_tokens) == (PrefetchStatus.COMPLETE, len(prompt))
        _read_once(store, cache, prompt)
        await _check_and_drain(cache, prompt, generator)


@pytest.mark.parametrize("readers", [1, 2])
async def test_a_long_prefetch_plans_its_reads_a_bounded_number_of_pages_at_a_time(
    monkeypatch: pytest.MonkeyPatch, readers: int
) -> None:
    # A plan is one step of the loop: planning a hundred thousand pages (a long prompt at
    # page size 1) held it for 0.7 to 1.2 s. A plan takes on a bounded number of pages now
    # (8 here), the rest in later plans; prefetches of one prompt still share every read,
    # and the pages land whole.
    monkeypatch.setattr(_prefetch, "_PLAN_PAGES", 8, raising=False)
    prompt = _prompt(60, 40)
    async with _gated(_config(), prompt) as (cache, store, generator):
        store.gets.open()
        prefetcher = _prefetcher(cache)
        most = 0
        turns = 0

        async def watch() -> None:
            nonlocal most, turns
            while True:
                most = max(most, len(prefetcher._inflight))
                turns += 1
                await asyncio.sleep(0)

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(cache.prefetch(prompt) for _ in range(readers))), 30
            )
        finally:
            watcher.cancel()
        for result in results:
            assert (result.status, result.cached_tokens) == (
                PrefetchStatus.COMPLETE,
                len(prompt),
            )
        assert turns > 5
        assert 0 < most <= 8
        _read_once(store, cache, prompt)
        await _check_and_drain(cache, prompt, generator)


@pytest.mark.parametrize("ending", ["complete", "cancel", "terminate"])
async def test_a_long_prefetch_is_forgotten_by_the_prefetcher_as_it_ends(
    monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    # A prefetch planned in several parts is remembered as having distinct keys between its
    # plans; once it ended, the prefetcher holds it (its keys, its request) no longer, even
    # when no other prefetch plans after it.
    monkeypatch.setattr(_prefetch, "_PLAN_PAGES", 8, raising=False)
    prompt = _prompt(61, 40)
    async with _gated(_config(), prompt) as (cache, store, generator):
        prefetcher = _prefetcher(cache)
        if ending == "complete":
            store.gets.open()
            result = await asyncio.wait_for(cache.prefetch(prompt), 30)
            assert result.status is PrefetchStatus.COMPLETE
        else:
            handle = await cache.start_prefetch(prompt)
            await _until(lambda: bool(store.gets.waiting), "its first batch in flight")
            assert handle in prefetcher._distinct  # still planning
            if ending == "cancel":
                handle.cancel()
            else:
                handle.terminate()
                store.gets.open()
            await asyncio.wait_for(handle.wait(), 30)
            assert handle.done()
        assert not prefetcher._distinct
        store.gets.open()
        await _check_and_drain(cache, prompt, generator)


@pytest.mark.parametrize(("share", "limit"), [(0.29, 29), (0.57, 57), (0.58, 58), (0.5, 50)])
async def test_the_host_share_gives_the_pages_its_decimal_says(share: float, limit: int) -> None:
    # 0.29 x 100 host pages is 28.999999999999996 in binary floating point, which rounded
    # down to a share of 28 pages.
    config = CacheConfig.from_dict(
        {**_config(max_host_share=share).to_dict(), "device_pages": 50, "host_pages": 100}
    )
    async with HiCache(config, storage=MemoryStorage()) as cache:
        stats = cache.storage_status().prefetch
        assert stats is not None
        assert stats.host_pages_limit == limit


@pytest.mark.parametrize("order", ["cancel_first", "terminate_first"])
async def test_a_cancelled_read_is_not_kept_for_a_waiter_that_gave_up(order: str) -> None:
    # A's read was kept going for B alone; once B gives up too (a best_effort or timed-out
    # caller terminates it), A stops at once instead of holding a worker until its get ends.
    prompt = _prompt(12)
    async with _gated(_config(), prompt) as (cache, store, generator):
        a, b = await _sharing(cache, store, prompt, "AB")
        if order == "cancel_first":
            a.cancel()
            assert not a.done()  # kept for B
            b.terminate()
        else:
            b.terminate()
            a.cancel()
        # The gate stays shut: only A's abandoned read can end it.
        done, _ = await asyncio.wait([asyncio.ensure_future(a.wait())], timeout=30)
        assert done, "the cancelled read was kept for a waiter that had given up"
        assert a.status is PrefetchStatus.CANCELLED
        result = await asyncio.wait_for(b.wait(), 30)
        assert result.status is PrefetchStatus.TERMINATED
        assert result.storage_tokens == 0
        store.open()
        await _check_and_drain(cache, prompt, generator)


async def test_a_prefetch_cancelled_during_its_last_batch_ends_cancelled() -> None:
    # Its one batch is kept going for B and lands; A was still cancelled, and says so.
    prompt = _prompt(13, pages=4)
    async with _gated(_config(), prompt) as (cache, store, generator):
        a, b = await _sharing(cache, store, prompt, "AB")
        a.cancel()
        store.open()
        assert (await asyncio.wait_for(b.wait(), 30)).status is PrefetchStatus.COMPLETE
        result = await asyncio.wait_for(a.wait(), 30)
        assert result.status is PrefetchStatus.CANCELLED
        stats = cache.storage_status().prefetch
        assert stats is not None
        assert (stats.completed, stats.cancelled) == (1, 1)
        _read_once(store, cache, prompt)
        await _check_and_drain(cache, prompt, generator)


async def test_pages_cached_while_a_prefetch_looked_them_up_count_wherever_they_are() -> None:
    # Q reads the prompt and a request loads it to the device while P looks it up: P finds
    # every page cached, and must say so (with a rank group it offers that figure).
    prompt = _prompt(14)
    async with _gated(_config(), prompt) as (cache, store, generator):
        store.gets.open()
        store.lookups.closed = True
        try:
            handle = await cache.start_prefetch(prompt, request_id="P")
            await _until(lambda: len(store.lookups.waiting) == 1, "P's lookup in flight")
            store.lookups.closed = False
            other = await asyncio.wait_for(cache.prefetch(prompt, request_id="Q"), 30)
            assert other.storage_tokens == len(prompt)
            await serve(cache, prompt, generator, prefetch=False, check="all")
            assert cache.match(prompt).device_tokens == len(prompt)
        finally:
            store.open()
        result = await asyncio.wait_for(handle.wait(), 30)
        assert result.status is PrefetchStatus.COMPLETE
        assert result.cached_tokens == len(prompt)
        _read_once(store, cache, prompt)
        await _check_and_drain(cache, prompt, generator)


@pytest.mark.parametrize("stop", ["none", "terminate", "cancel"])
async def test_a_prefetch_never_reports_more_than_is_cached(stop: str) -> None:
    # P's first look finds A's first 4 pages on the host; they are evicted while it looks up
    # the rest, and storage holds only 6 of A's 8 pages: P reads 6 and must report 6. Stopped
    # during its lookup, it reads nothing and must report nothing (not the 4 pages it saw).
    config = CacheConfig.from_dict({**_config(max_host_share=1.0).to_dict(), "host_pages": 12})
    a = _prompt(15)
    b = _prompt(16, pages=12)
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        generator = KVGenerator(config.layout, PAGE, seed=5)
        async with HiCache(_config(), storage=Unowned(memory)) as writer:
            await serve(writer, a[: 6 * PAGE], generator, prefetch=False)
            await serve(writer, b, generator, prefetch=False)
            await writer.drain()
        store = GatedStorage(memory)
        async with HiCache(config, storage=store) as cache:
            try:
                await cache.prefetch(a[: 4 * PAGE])  # A's first 4 pages on the host
                store.lookups.closed = True
                handle = await cache.start_prefetch(a, request_id="P")
                await _until(lambda: len(store.lookups.waiting) == 1, "P's lookup in flight")
                store.lookups.closed = False
                # B fills the host pool: A's pages go.
                await cache.prefetch(b)
                assert cache.match(a).host_tokens == 0
                if stop == "terminate":
                    handle.terminate()
                elif stop == "cancel":
                    handle.cancel()
            finally:
                store.open()
            result = await asyncio.wait_for(handle.wait(), 30)
            found = cache.match(a)
            cached = found.device_tokens + found.host_tokens
            assert cached == (6 * PAGE if stop == "none" else 0)
            assert result.cached_tokens == cached
            await cache.drain()
            assert_drained(cache)


async def test_pages_a_request_brought_to_the_host_while_a_prefetch_read_them_go_back() -> None:
    """A's read is held while a request computes the same prompt and its pages reach the
    host: A's copies land as duplicates, and their host pages go back to the pool."""
    prompt = _prompt(21)
    async with _gated(_config(), prompt) as (cache, store, generator):
        (a,) = await _sharing(cache, store, prompt, "A")
        await serve(cache, prompt, generator, prefetch=False)
        await _until(lambda: cache.tree.statistics().host_pages == PAGES, "the host copies")
        used = cache.host_pool.allocator.used_count
        assert used == 2 * PAGES  # the tree's copies, and A's pages in flight
        store.gets.open()
        result = await asyncio.wait_for(a.wait(), 30)
        assert result.status is PrefetchStatus.COMPLETE
        assert cache.host_pool.allocator.used_count == PAGES
        await _check_and_drain(cache, prompt, generator)


@pytest.mark.parametrize("failure", ["error", "timeout"])
async def test_prefetches_after_a_failed_read_take_its_pages_as_misses_without_reading_them(
    failure: str,
) -> None:
    # More prefetches of one prompt than there are workers: those a worker took only after
    # the first read failed (or timed out) read the page again, a wave at a time, so a
    # hanging store held every wave for a whole timeout.
    prompt = _prompt(31)
    config = _config(io_timeout_s=0.5 if failure == "timeout" else 10.0)
    count = 3 * _config().prefetch.workers
    async with _gated(config, prompt) as (cache, store, generator):
        handles = [await cache.start_prefetch(prompt, request_id=str(i)) for i in range(count)]
        await _until(lambda: len(store.gets.waiting) == 1, "the first read in flight")
        if failure == "error":
            store.error = OSError("storage unreachable")
            store.gets.release()
        # else: the gate stays shut until the read times out
        results = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 30)
        assert [r.status for r in results] == [PrefetchStatus.TERMINATED] * count
        assert [r.cached_tokens for r in results] == [0] * count
        assert sum(store.reads.values()) == 4  # the first batch, once
        # Within the window, a prefetch of the same pages still reads nothing.
        later = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert later.status is PrefetchStatus.TERMINATED
        assert sum(store.reads.values()) == 4
        status = cache.storage_status().prefetch
        assert status is not None
        # The first: its failed batch and the one it left unread.
        assert status.errors == 2 * 4
        assert status.pages_read == 0
        # Every page of the others (waiting on the failed read, or planned after it) is a
        # miss, each counted once.
        assert status.misses == count * PAGES
        store.error = None
        store.gets.open()
        await _check_and_drain(cache, prompt, generator)


async def test_a_missed_page_is_read_again_by_the_next_prefetch() -> None:
    # A MISS is not remembered: a backup may store the page a moment later.
    prompt = _prompt(32)
    async with _gated(_config(), prompt) as (cache, store, generator):
        store.miss = True
        store.gets.open()
        first = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert first.status is PrefetchStatus.TERMINATED
        store.miss = False
        second = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert second.status is PrefetchStatus.COMPLETE
        assert second.storage_tokens == len(prompt)
        key = cache.namespace.storage_keys(cache.keys_for(prompt))[0]
        assert store.reads[key] == 2
        await _check_and_drain(cache, prompt, generator)


async def test_a_failed_page_is_read_again_once_its_window_has_passed() -> None:
    prompt = _prompt(33)
    async with _gated(_config(failed_read_window_s=30.0), prompt) as (cache, store, generator):
        loop = asyncio.get_running_loop()
        shift = [0.0]
        _prefetcher(cache).failed_reads.clock = lambda: loop.time() + shift[0]
        store.error = OSError("storage unreachable")
        store.gets.open()
        first = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert first.status is PrefetchStatus.TERMINATED
        store.error = None
        key = cache.namespace.storage_keys(cache.keys_for(prompt))[0]
        inside = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert inside.status is PrefetchStatus.TERMINATED
        assert store.reads[key] == 1
        shift[0] = 29.9  # within the configured window, not the default 2 s
        inside = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert inside.status is PrefetchStatus.TERMINATED
        assert store.reads[key] == 1
        shift[0] = 30.0
        after = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert after.status is PrefetchStatus.COMPLETE
        assert after.storage_tokens == len(prompt)
        assert store.reads[key] == 2
        await _check_and_drain(cache, prompt, generator)


async def test_a_failed_read_window_of_zero_reads_a_failed_page_again_at_once() -> None:
    prompt = _prompt(38)
    async with _gated(_config(failed_read_window_s=0), prompt) as (cache, store, generator):
        store.error = OSError("storage unreachable")
        store.gets.open()
        first = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert first.status is PrefetchStatus.TERMINATED
        assert len(_prefetcher(cache).failed_reads) == 0
        store.error = None
        second = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert second.status is PrefetchStatus.COMPLETE
        assert second.storage_tokens == len(prompt)
        key = cache.namespace.storage_keys(cache.keys_for(prompt))[0]
        assert store.reads[key] == 2
        await _check_and_drain(cache, prompt, generator)


async def test_the_failed_reads_remembered_keep_to_their_configured_bound() -> None:
    # Batches of one page: each failed prefetch remembers one key, and with room for two
    # the first of three failures is forgotten, so only its prompt is read again.
    prompts = [_prompt(39 + i) for i in range(3)]
    config = _config(batch_pages=1, failed_read_keys=2)
    async with _gated(config, *prompts) as (cache, store, generator):
        store.error = OSError("storage unreachable")
        store.gets.open()
        for prompt in prompts:
            failed = await asyncio.wait_for(cache.prefetch(prompt), 30)
            assert failed.status is PrefetchStatus.TERMINATED
        assert len(_prefetcher(cache).failed_reads) == 2
        store.error = None
        results = [await asyncio.wait_for(cache.prefetch(p), 30) for p in prompts]
        assert [r.status for r in results] == [PrefetchStatus.COMPLETE] + [
            PrefetchStatus.TERMINATED
        ] * 2
        firsts = [cache.namespace.storage_keys(cache.keys_for(p))[0] for p in prompts]
        assert [store.reads[key] for key in firsts] == [2, 1, 1]
        for prompt in prompts:
            await serve(cache, prompt, generator, prefetch=False, check="all")
        await cache.drain()
        assert_drained(cache)


async def test_a_failed_batch_larger_than_the_bound_keeps_its_first_pages() -> None:
    # A batch of four failed with room for one key: the last was kept, so the next prefetch
    # of the prompt, which needs the first page before it can reach the last, read the
    # first again instead of taking it as a miss.
    prompt = _prompt(44)
    async with _gated(_config(failed_read_keys=1), prompt) as (cache, store, generator):
        store.error = OSError("storage unreachable")
        store.gets.open()
        first = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert first.status is PrefetchStatus.TERMINATED
        assert len(_prefetcher(cache).failed_reads) == 1
        store.error = None
        second = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert second.status is PrefetchStatus.TERMINATED
        key = cache.namespace.storage_keys(cache.keys_for(prompt))[0]
        assert store.reads[key] == 1
        await _check_and_drain(cache, prompt, generator)


async def test_a_failed_read_line_counts_the_pages_of_the_lines_left_out() -> None:
    # Each prefetch's failed batch is a line of its own before the limit: those left out
    # must keep how many pages failed, not only how many lines there were.
    prompts = [_prompt(seed) for seed in range(40, 44)]
    async with _gated(_config(), *prompts) as (cache, store, _generator):
        now = [0.0]
        _prefetcher(cache)._log_limit = LogLimiter(60.0, clock=lambda: now[0])
        store.error = OSError("storage unreachable")
        store.gets.open()
        with structlog.testing.capture_logs() as logs:
            for n, prompt in enumerate(prompts):
                if n == len(prompts) - 1:
                    now[0] = 60.0  # a minute later: the last failure is told again
                done = await asyncio.wait_for(cache.prefetch(prompt), 30)
                assert done.status is PrefetchStatus.TERMINATED
        store.error = None
        asked = sum(store.reads.values())  # every get failed: the pages of every line
    failed = [e for e in logs if e["event"] == "hicache.prefetch.get.failed"]
    assert [e["unlogged_since_last"] for e in failed] == [0, len(prompts) - 2]
    assert sum(e["pages"] + e["unlogged_pages_since_last"] for e in failed) == asked > 0
    assert assert_documented(failed, exact=["hicache.prefetch.get.failed"]) == 2


async def test_a_detach_and_attach_forget_the_failed_reads() -> None:
    prompt = _prompt(34)
    async with _gated(_config(), prompt) as (cache, store, generator):
        store.error = OSError("storage unreachable")
        store.gets.open()
        first = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert first.status is PrefetchStatus.TERMINATED
        store.error = None
        await cache.detach_storage()
        await cache.attach_storage(store)
        second = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert second.status is PrefetchStatus.COMPLETE
        assert second.storage_tokens == len(prompt)
        key = cache.namespace.storage_keys(cache.keys_for(prompt))[0]
        assert store.reads[key] == 2
        await _check_and_drain(cache, prompt, generator)


async def test_a_page_stored_by_a_backup_is_read_again_after_its_read_failed() -> None:
    prompt = _prompt(35)
    async with _gated(_config(), prompt) as (cache, store, generator):
        store.error = OSError("storage unreachable")
        store.gets.open()
        first = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert first.status is PrefetchStatus.TERMINATED
        store.error = None
        # The request computes the prompt, and its backup stores every page again.
        await serve(cache, prompt, generator, prefetch=False)
        await cache.drain()
        keys = cache.keys_for(prompt)
        assert _prefetcher(cache).failed_reads.first(keys, {}) is None
        await _check_and_drain(cache, prompt, generator)


async def test_a_prefetch_after_a_failed_read_ends_while_every_worker_is_busy() -> None:
    # Queued behind a read that hangs, it would wait for the worker (up to io_timeout_s),
    # by when the failure is forgotten and the page read again.
    prompt, other = _prompt(36), _prompt(37)
    async with _gated(_config(workers=1), prompt, other) as (cache, store, generator):
        store.error = OSError("storage unreachable")
        store.gets.open()
        first = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert first.status is PrefetchStatus.TERMINATED
        store.error = None
        store.gets.closed = True  # the store hangs from now on
        busy = await cache.start_prefetch(other)
        await _until(lambda: len(store.gets.waiting) == 1, "the only worker's read in flight")
        again = await asyncio.wait_for(cache.prefetch(prompt), 30)
        assert again.status is PrefetchStatus.TERMINATED
        assert again.storage_tokens == 0
        assert len(store.gets.waiting) == 1  # the other read still hangs
        key = cache.namespace.storage_keys(cache.keys_for(prompt))[0]
        assert store.reads[key] == 1
        status = cache.storage_status().prefetch
        assert status is not None
        assert (status.submitted, status.terminated, status.queued) == (3, 2, 0)
        store.gets.open()
        assert (await asyncio.wait_for(busy.wait(), 30)).status is PrefetchStatus.COMPLETE
        await _check_and_drain(cache, prompt, generator)


class StoredFirst(GatedStorage):
    """A backend whose put writes every page it is given: the backup asks `exists` first."""

    @property
    def capabilities(self) -> StorageCapabilities:
        return msgspec.structs.replace(self.inner.capabilities, put_skips_stored=False)


async def test_a_page_a_backup_finds_stored_is_read_again_after_its_read_failed() -> None:
    # skip_stored: the backup's `exists` finds the page and writes nothing, as a put that
    # skips stored pages answers OK for it; either way the page is known to be stored.
    prompt = _prompt(38)
    config = _config()
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        generator = await _stored(memory, config, prompt)
        store = StoredFirst(memory)
        async with HiCache(config, storage=store) as cache:
            store.error = OSError("storage unreachable")
            first = await asyncio.wait_for(cache.prefetch(prompt), 30)
            assert first.status is PrefetchStatus.TERMINATED
            store.error = None
            await serve(cache, prompt, generator, prefetch=False)
            await cache.drain()
            backup = cache.storage_status().backup
            assert backup is not None
            assert backup.already_stored_pages == PAGES
            assert backup.written_pages == 0
            keys = cache.keys_for(prompt)
            assert _prefetcher(cache).failed_reads.first(keys, {}) is None
            await _check_and_drain(cache, prompt, generator)


class MissingAt(GatedStorage):
    """A gated store whose gets answer MISS for the storage keys in `missing`."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.missing: set[bytes] = set()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        outcomes = await super().get(keys, into, namespace=namespace)
        return [
            Outcome.MISS if bytes(k) in self.missing else o
            for k, o in zip(keys, outcomes, strict=True)
        ]


async def test_a_prefetch_that_gives_up_after_fruitless_replans_counts_its_pages_once() -> None:
    # B needs two pages that three readers in turn plan to read after a page of their own;
    # each reader's own page is a MISS, so it drops the two B waits on, and the next reader,
    # waiting for host budget, plans them before B can. After the third such plan B ends
    # with nothing, and its two pages were in no counter.
    base = _prompt(50)
    heads = [_prompt(51 + i, 1) for i in range(3)]
    config = CacheConfig.from_dict(
        {
            **msgspec.to_builtins(_config(threshold_tokens=1, max_host_share=0.01)),
            "host_pages": 300,
        }
    )
    async with MemoryStorage(capacity_bytes=64 << 20) as memory:
        for prompt in (base, *heads):
            await _stored(memory, config, prompt)
        store = MissingAt(memory)
        async with HiCache(config, storage=store) as cache:
            store.gets.closed = True
            try:
                prefetcher = _prefetcher(cache)
                assert prefetcher.statistics().host_pages_limit == 3
                shared = cache.keys_for(base)[4:6]
                zs = [cache.keys_for(head)[0] for head in heads]
                store.missing = set(cache.namespace.storage_keys(zs))

                def run(keys: list[bytes], name: str) -> asyncio.Task[None]:
                    handle = PrefetchHandle(
                        prefetcher, keys, len(keys) * PAGE, name, "wait_complete"
                    )
                    handles[name] = handle
                    return asyncio.ensure_future(prefetcher.run_now(handle))

                handles: dict[str, PrefetchHandle] = {}
                tasks = [run([zs[0], *shared], "R1")]
                await _until(lambda: len(store.gets.waiting) == 1, "R1's get")
                tasks += [run([z, *shared], f"R{i}") for i, z in enumerate(zs[1:], 2)]
                await _until(lambda: len(prefetcher._budget_line) == 2, "R2, R3 in line")
                tasks.append(run(list(shared), "B"))
                for turn in range(3):
                    await _until(lambda: _waiters(cache, shared[0]) == 1, "B to wait")
                    await _until(lambda: len(store.gets.waiting) == 1, "a reader's get")
                    store.gets.release()
                    await asyncio.wait_for(tasks[turn], 30)
                await asyncio.wait_for(asyncio.gather(*tasks), 30)
            finally:
                store.open()
            b = handles["B"].result()
            assert (b.status, b.storage_tokens) == (PrefetchStatus.TERMINATED, 0)
            assert sum(store.reads[k] for k in cache.namespace.storage_keys(shared)) == 6
            stats = cache.storage_status().prefetch
            assert stats is not None
            # Each reader: its own page missed, the two after it read but not landed.
            assert (stats.misses, stats.pages_read) == (3, 6)
            assert stats.pages_abandoned == 2
            assert (
                stats.misses
                + stats.pages_read
                + stats.pages_shared
                + stats.corrupt
                + stats.errors
                + stats.pages_abandoned
                + stats.pages_skipped
            ) == 3 * 3 + 2
