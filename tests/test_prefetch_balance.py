"""The balance of prefetch page counters, ending by ending: every page a prefetch looks for
(one stopped while queued: those not cached as it ends) lands in exactly one of `misses`,
`pages_read`, `pages_shared`, `corrupt`, `errors`, `pages_abandoned` and `pages_skipped`
(docs/api.md), whichever way the prefetch ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache, PrefetchHandle, PrefetchResult, PrefetchStatus
from hicache_async.storage import MemoryStorage, Outcome, PageBuffer, StorageBackend
from hicache_async.testing import KVGenerator, serve
from hicache_async.workers import Prefetcher, PrefetchStatistics

PAGE = 4
PAGES = 8
COUNTERS = (
    "misses",
    "pages_read",
    "pages_shared",
    "corrupt",
    "errors",
    "pages_abandoned",
    "pages_skipped",
)


def _config(**overrides: Any) -> CacheConfig:
    prefetch: dict[str, Any] = {
        "policy": "wait_complete",
        "threshold_tokens": 1,
        "batch_pages": 2,
        "max_host_share": 1.0,
    }
    prefetch.update(overrides.pop("prefetch", {}))
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 256,
            "model_id": "prefetch-balance-test",
            "prefetch": prefetch,
            **overrides,
        }
    )


class Scripted(Unowned):
    """A real backend whose gets and lookups wait while their gate is set, whose gets answer
    `answer[key]` for the storage keys in it, and which raises `get_error` or
    `exists_error` once past its gate while they are set."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.answer: dict[bytes, Outcome] = {}
        self.get_error: Exception | None = None
        self.exists_error: Exception | None = None
        self.get_gate: asyncio.Future[None] | None = None
        self.exists_gate: asyncio.Future[None] | None = None
        self.gets_held = 0
        self.lookups_held = 0

    async def exists(self, keys: Sequence[bytes]) -> int:
        gate = self.exists_gate
        if gate is not None:
            self.lookups_held += 1
            await asyncio.shield(gate)
        if self.exists_error is not None:
            raise self.exists_error
        return await self.inner.exists(keys)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        gate = self.get_gate
        if gate is not None:
            self.gets_held += 1
            await asyncio.shield(gate)
        if self.get_error is not None:
            raise self.get_error
        outcomes = await self.inner.get(keys, into, namespace=namespace)
        return [self.answer.get(bytes(k), o) for k, o in zip(keys, outcomes, strict=True)]

    def open_gates(self) -> None:
        for gate in (self.get_gate, self.exists_gate):
            if gate is not None and not gate.done():
                gate.set_result(None)
        self.get_gate = self.exists_gate = None


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def _prompt(seed: int, pages: int = PAGES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, size=pages * PAGE)


#: One-page prompts storage holds besides the scenario's prompt.
HEADS = [_prompt(51 + i, 1) for i in range(3)]


def _prefetcher(cache: HiCache) -> Prefetcher:
    link = cache._link
    assert link is not None
    return link.prefetcher


def _storage_key(cache: HiCache, prompt: np.ndarray, page: int) -> bytes:
    return cache.namespace.storage_keys(cache.keys_for(prompt))[page]


@dataclass
class World:
    """What a scenario works with: a cache over `store`, whose backend holds `prompt`."""

    cache: HiCache
    store: Scripted
    prompt: np.ndarray
    generator: KVGenerator
    monkeypatch: pytest.MonkeyPatch
    results: list[tuple[PrefetchResult, int]] = field(default_factory=list)

    def keep(self, result: PrefetchResult, pages: int = PAGES) -> PrefetchResult:
        self.results.append((result, pages))
        return result


async def _completed(w: World) -> None:
    result = w.keep(await w.cache.prefetch(w.prompt))
    assert result.status is PrefetchStatus.COMPLETE


async def _waiting_on_a_held_read(w: World) -> tuple[PrefetchHandle, PrefetchHandle]:
    """A, whose first get is held, and B, which waits on A's read of the prompt."""
    w.store.get_gate = asyncio.get_running_loop().create_future()
    a = await w.cache.start_prefetch(w.prompt, request_id="A")
    await _until(lambda: w.store.gets_held == 1, "A's get")
    b = await w.cache.start_prefetch(w.prompt, request_id="B")
    flight = _prefetcher(w.cache)._inflight[w.cache.keys_for(w.prompt)[0]]
    await _until(lambda: b in flight.waiters, "B to wait on A's read")
    return a, b


async def _completed_sharing(w: World) -> None:
    # B waits on A's reads instead of reading; C starts while A and B look the pages up,
    # and finds them landed by its plan.
    a, b = await _waiting_on_a_held_read(w)
    w.store.exists_gate = asyncio.get_running_loop().create_future()
    c = await w.cache.start_prefetch(w.prompt, request_id="C")
    await _until(lambda: w.store.lookups_held == 1, "C's lookup")
    gets, w.store.get_gate = w.store.get_gate, None
    gets.set_result(None)
    for handle in (a, b):
        result = w.keep(await asyncio.wait_for(handle.wait(), 30))
        assert (result.status, result.storage_tokens) == (PrefetchStatus.COMPLETE, PAGES * PAGE)
    w.store.open_gates()
    result = w.keep(await asyncio.wait_for(c.wait(), 30))
    assert (result.status, result.storage_tokens) == (PrefetchStatus.COMPLETE, PAGES * PAGE)


async def _stopped_reading(w: World, stop: str) -> PrefetchResult:
    w.store.get_gate = asyncio.get_running_loop().create_future()
    handle = await w.cache.start_prefetch(w.prompt)
    await _until(lambda: w.store.gets_held == 1, "the first get")
    getattr(handle, stop)()
    w.store.open_gates()
    return w.keep(await asyncio.wait_for(handle.wait(), 30))


async def _cancelled(w: World) -> None:
    result = await _stopped_reading(w, "cancel")
    assert result.status is PrefetchStatus.CANCELLED


async def _terminated(w: World) -> None:
    result = await _stopped_reading(w, "terminate")
    assert result.status is PrefetchStatus.TERMINATED


async def _terminated_during_lookup(w: World) -> None:
    w.store.exists_gate = asyncio.get_running_loop().create_future()
    handle = await w.cache.start_prefetch(w.prompt)
    await _until(lambda: w.store.lookups_held == 1, "the lookup")
    handle.terminate()
    w.store.open_gates()
    result = w.keep(await asyncio.wait_for(handle.wait(), 30))
    assert result.status is PrefetchStatus.TERMINATED


async def _host_pool_full(w: World) -> None:
    # The copies of a request's device pages fill the host pool but for two pages.
    await serve(w.cache, _prompt(99, 6), w.generator, prefetch=False)
    await w.cache.drain()
    assert w.cache.host_pool.allocator.free_count == 2
    result = w.keep(await w.cache.prefetch(w.prompt))
    assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, 2 * PAGE)


def _get_answers(outcome: Outcome) -> Callable[[World], Awaitable[None]]:
    async def scenario(w: World) -> None:
        w.store.answer[_storage_key(w.cache, w.prompt, 2)] = outcome
        result = w.keep(await w.cache.prefetch(w.prompt))
        assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, 2 * PAGE)

    return scenario


async def _get_raises(w: World) -> None:
    w.store.get_error = OSError("storage unreachable")
    result = w.keep(await w.cache.prefetch(w.prompt))
    assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, 0)


async def _lookup_raises(w: World) -> None:
    w.store.exists_error = OSError("storage unreachable")
    result = w.keep(await w.cache.prefetch(w.prompt))
    assert result.status is PrefetchStatus.SKIPPED


async def _first_page_failed_just_before(w: World) -> None:
    w.store.answer[_storage_key(w.cache, w.prompt, 0)] = Outcome.ERROR
    first = w.keep(await w.cache.prefetch(w.prompt))
    assert (first.status, first.storage_tokens) == (PrefetchStatus.TERMINATED, 0)
    # The second takes the page as failed without reading it (nor looking it up).
    second = w.keep(await w.cache.prefetch(w.prompt))
    assert (second.status, second.storage_tokens) == (PrefetchStatus.TERMINATED, 0)


async def _later_page_failed_just_before(w: World) -> None:
    _prefetcher(w.cache).failed_reads.add([w.cache.keys_for(w.prompt)[3]])
    result = w.keep(await w.cache.prefetch(w.prompt))
    assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, 3 * PAGE)


async def _waited_read_failed(w: World) -> None:
    # B waits on A's read of the first batch, which fails: B does not read it again.
    a, b = await _waiting_on_a_held_read(w)
    w.store.get_error = OSError("storage unreachable")
    w.store.open_gates()
    for handle in (a, b):
        result = w.keep(await asyncio.wait_for(handle.wait(), 30))
        assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, 0)


async def _failed_unexpectedly(w: World) -> None:
    land = Prefetcher._land
    calls = 0

    def land_once(self: Prefetcher, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise RuntimeError("landing failed")
        return land(self, *args, **kwargs)

    w.monkeypatch.setattr(Prefetcher, "_land", land_once)
    result = w.keep(await w.cache.prefetch(w.prompt))
    assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, 2 * PAGE)


async def _replans_given_up(w: World) -> None:
    # B needs two pages that three readers in turn plan after a page of their own, which
    # storage misses: each drops the two B waits on, and the next reader, let through the
    # host budget, plans them before B can (the case of test_prefetch_sharing).
    prefetcher = _prefetcher(w.cache)
    assert prefetcher.statistics().host_pages_limit == 3
    zs = [w.cache.keys_for(head)[0] for head in HEADS]
    shared = w.cache.keys_for(w.prompt)[4:6]
    for z in zs:
        w.store.answer[w.cache.namespace.storage_keys([z])[0]] = Outcome.MISS
    handles: list[PrefetchHandle] = []

    def run(keys: list[bytes]) -> asyncio.Task[None]:
        handle = PrefetchHandle(prefetcher, keys, len(keys) * PAGE, None, "wait_complete")
        handles.append(handle)
        return asyncio.ensure_future(prefetcher.run_now(handle))

    def waiters() -> int:
        flight = prefetcher._inflight.get(shared[0])
        return 0 if flight is None else len(flight.waiters)

    gate = w.store.get_gate = asyncio.get_running_loop().create_future()
    tasks = [run([zs[0], *shared])]
    await _until(lambda: w.store.gets_held == 1, "R1's get")
    tasks += [run([z, *shared]) for z in zs[1:]]
    await _until(lambda: len(prefetcher._budget_line) == 2, "R2, R3 in line")
    tasks.append(run(list(shared)))
    for turn in range(3):
        await _until(lambda: waiters() == 1, "B to wait")
        await _until(lambda t=turn: w.store.gets_held == t + 1, "a reader's get")
        gate.set_result(None)
        gate = w.store.get_gate = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(tasks[turn], 30)
    w.store.open_gates()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    for handle in handles[:3]:
        w.keep(handle.result(), 3)
    b = w.keep(handles[3].result(), 2)
    assert (b.status, b.storage_tokens) == (PrefetchStatus.TERMINATED, 0)


async def _terminated_in_last_read(w: World) -> None:
    # Its one batch is in flight when it is told to stop: that read lands, and the prefetch
    # still ends as it was asked to (docs/api.md: "finishes as TERMINATED once the read in
    # flight lands"), though nothing was left to read.
    result = await _stopped_reading(w, "terminate")
    assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, PAGES * PAGE)


async def _timed_out_in_last_read(w: World) -> None:
    w.store.get_gate = asyncio.get_running_loop().create_future()
    handle = await w.cache.start_prefetch(w.prompt)
    await _until(lambda: w.store.gets_held == 1, "its get")
    assert (await handle.ready()).status is PrefetchStatus.RUNNING  # the limit ran out
    w.store.open_gates()
    result = w.keep(await asyncio.wait_for(handle.wait(), 30))
    # A timeout `wait()` tells (docs/api.md: count timeouts from it).
    assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, PAGES * PAGE)
    assert _prefetcher(w.cache).statistics().timeouts == 1


async def _reader_cancelled_for_a_waiter(w: World) -> None:
    # A's first batch goes on for B, which waits on it; A reads nothing more.
    a, b = await _waiting_on_a_held_read(w)
    a.cancel()
    w.store.open_gates()
    result = w.keep(await asyncio.wait_for(a.wait(), 30))
    assert (result.status, result.storage_tokens) == (PrefetchStatus.CANCELLED, 2 * PAGE)
    result = w.keep(await asyncio.wait_for(b.wait(), 30))
    assert (result.status, result.storage_tokens) == (PrefetchStatus.COMPLETE, PAGES * PAGE)


async def _waiter_cancelled(w: World) -> None:
    a, b = await _waiting_on_a_held_read(w)
    b.cancel()
    result = w.keep(await asyncio.wait_for(b.wait(), 30))
    assert (result.status, result.storage_tokens) == (PrefetchStatus.CANCELLED, 0)
    w.store.open_gates()
    result = w.keep(await asyncio.wait_for(a.wait(), 30))
    assert result.status is PrefetchStatus.COMPLETE


async def _reader_and_waiter_cancelled(w: World) -> None:
    a, b = await _waiting_on_a_held_read(w)
    a.cancel()
    b.cancel()  # the last one that wanted A's read: it is abandoned
    for handle in (a, b):
        result = w.keep(await asyncio.wait_for(handle.wait(), 30))
        assert (result.status, result.storage_tokens) == (PrefetchStatus.CANCELLED, 0)


async def _waited_batch_partly_delivered(w: World) -> None:
    # A's first batch delivers page 0, not page 1: B takes page 0 and misses the rest.
    w.store.answer[_storage_key(w.cache, w.prompt, 1)] = Outcome.ERROR
    a, b = await _waiting_on_a_held_read(w)
    w.store.open_gates()
    for handle in (a, b):
        result = w.keep(await asyncio.wait_for(handle.wait(), 30))
        assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, PAGE)


async def _cancelled_during_lookup(w: World) -> None:
    w.store.exists_gate = asyncio.get_running_loop().create_future()
    handle = await w.cache.start_prefetch(w.prompt)
    await _until(lambda: w.store.lookups_held == 1, "the lookup")
    handle.cancel()
    result = w.keep(await asyncio.wait_for(handle.wait(), 30))
    assert result.status is PrefetchStatus.CANCELLED


async def _detached_while_reading(w: World) -> None:
    w.store.get_gate = asyncio.get_running_loop().create_future()
    handle = await w.cache.start_prefetch(w.prompt)
    await _until(lambda: w.store.gets_held == 1, "the first get")
    detach = asyncio.ensure_future(w.cache.detach_storage(flush=False))
    result = w.keep(await asyncio.wait_for(handle.wait(), 30))
    w.store.open_gates()
    await asyncio.wait_for(detach, 30)
    assert (result.status, result.storage_tokens) == (PrefetchStatus.CANCELLED, 0)


async def _cancelled_waiting_for_room(w: World) -> None:
    # The host share is 3 pages: A holds them for its first batch, B waits in line.
    w.store.get_gate = asyncio.get_running_loop().create_future()
    a = await w.cache.start_prefetch(w.prompt)
    await _until(lambda: w.store.gets_held == 1, "A's get")
    b = await w.cache.start_prefetch(HEADS[0])
    await _until(lambda: bool(_prefetcher(w.cache)._budget_line), "B in line")
    b.cancel()
    result = w.keep(await asyncio.wait_for(b.wait(), 30), 1)
    assert (result.status, result.storage_tokens) == (PrefetchStatus.CANCELLED, 0)
    w.store.open_gates()
    result = w.keep(await asyncio.wait_for(a.wait(), 30))
    assert result.status is PrefetchStatus.COMPLETE


async def _stopped_while_queued(w: World, stop: str) -> None:
    # One worker, held by A's lookup: B waits in the queue when it is told to stop, and
    # ends at once, its pages never looked up.
    w.store.exists_gate = asyncio.get_running_loop().create_future()
    a = await w.cache.start_prefetch(w.prompt, request_id="A")
    await _until(lambda: w.store.lookups_held == 1, "A's lookup")
    b = await w.cache.start_prefetch(w.prompt, request_id="B")
    assert b.status is PrefetchStatus.QUEUED
    if stop == "detach":
        await asyncio.wait_for(w.cache.detach_storage(flush=False), 30)
    elif stop == "ready":
        assert (await b.ready()).status is PrefetchStatus.TERMINATED  # its limit ran out
    else:
        getattr(b, stop)()
    result = w.keep(await asyncio.wait_for(b.wait(), 30))
    assert (result.status, result.storage_tokens) == (
        PrefetchStatus.CANCELLED if stop in ("cancel", "detach") else PrefetchStatus.TERMINATED,
        0,
    )
    w.store.open_gates()
    result = w.keep(await asyncio.wait_for(a.wait(), 30))
    assert result.status is (
        PrefetchStatus.CANCELLED if stop == "detach" else PrefetchStatus.COMPLETE
    )


def _queued_and_stopped(stop: str) -> Callable[[World], Awaitable[None]]:
    async def scenario(w: World) -> None:
        await _stopped_while_queued(w, stop)

    return scenario


async def _found_the_queue_full(w: World) -> None:
    # One worker held by A's lookup and a queue of one held by B: C, best effort, finds
    # no room and ends at once.
    w.store.exists_gate = asyncio.get_running_loop().create_future()
    a = await w.cache.start_prefetch(w.prompt, request_id="A")
    await _until(lambda: w.store.lookups_held == 1, "A's lookup")
    b = await w.cache.start_prefetch(HEADS[0], request_id="B")
    c = await w.cache.start_prefetch(HEADS[1], request_id="C", policy="best_effort")
    result = w.keep(await asyncio.wait_for(c.wait(), 30), 1)
    assert (result.status, result.storage_tokens) == (PrefetchStatus.TERMINATED, 0)
    w.store.open_gates()
    for handle, pages in ((a, PAGES), (b, 1)):
        result = w.keep(await asyncio.wait_for(handle.wait(), 30), pages)
        assert result.status is PrefetchStatus.COMPLETE


def _repeated_key(cached: int) -> Callable[[World], Awaitable[None]]:
    """A forged chain that repeats its first key at its third page, with its first `cached`
    pages cached (a cached path past the repeat only a forged chain could make)."""

    async def scenario(w: World) -> None:
        real = w.cache.keys_for(w.prompt)
        keys = [real[0], real[1], real[0], real[2]]
        if cached:
            pages = w.cache._try_alloc_host(cached)
            assert pages is not None
            w.cache.tree.insert(keys[:cached], host_pages=pages)
        prefetcher = _prefetcher(w.cache)
        handle = PrefetchHandle(prefetcher, keys, len(keys) * PAGE, None, "wait_complete")
        await prefetcher.run_now(handle)
        w.keep(handle.result(), len(keys))
        assert handle.host_tokens == cached * PAGE
        assert handle.storage_tokens == max(2 - cached, 0) * PAGE

    return scenario


async def _skipped_after_lookup(w: World) -> None:
    # Storage holds 6 of the 12 pages, fewer tokens than the threshold of 7 pages.
    longer = np.concatenate([w.prompt[: 6 * PAGE], _prompt(98, 6)])
    result = w.keep(await w.cache.prefetch(longer), 12)
    assert result.status is PrefetchStatus.SKIPPED


@dataclass(frozen=True)
class Ending:
    scenario: Callable[[World], Awaitable[None]]
    #: The counters the ending must add to (the case it is about), besides the balance.
    counters: tuple[str, ...]
    config: dict[str, Any] = field(default_factory=dict)


ENDINGS: dict[str, Ending] = {
    "completed": Ending(_completed, ("pages_read",)),
    "completed, shared": Ending(_completed_sharing, ("pages_read", "pages_shared")),
    "cancelled": Ending(_cancelled, ("pages_abandoned",)),
    "terminated": Ending(_terminated, ("pages_read", "pages_abandoned")),
    "terminated during lookup": Ending(_terminated_during_lookup, ("pages_abandoned",)),
    "terminated during its last read": Ending(
        _terminated_in_last_read, ("pages_read",), {"prefetch": {"batch_pages": PAGES}}
    ),
    "timed out during its last read": Ending(
        _timed_out_in_last_read,
        ("pages_read",),
        {
            "prefetch": {
                "policy": "timeout",
                "batch_pages": PAGES,
                "timeout_base_s": 0.01,
                "timeout_per_1k_tokens_s": 0.0,
            }
        },
    ),
    "reader cancelled, its read kept for a waiter": Ending(
        _reader_cancelled_for_a_waiter, ("pages_read", "pages_shared", "pages_abandoned")
    ),
    "waiter cancelled": Ending(_waiter_cancelled, ("pages_read", "pages_abandoned")),
    "reader and waiter cancelled": Ending(_reader_and_waiter_cancelled, ("pages_abandoned",)),
    "waited batch partly delivered": Ending(
        _waited_batch_partly_delivered, ("pages_read", "pages_shared", "errors", "misses")
    ),
    "cancelled during lookup": Ending(_cancelled_during_lookup, ("pages_abandoned",)),
    "detached while reading": Ending(_detached_while_reading, ("pages_abandoned",)),
    "cancelled waiting for room": Ending(
        _cancelled_waiting_for_room,
        ("pages_read", "pages_abandoned"),
        {"host_pages": 300, "prefetch": {"max_host_share": 0.01}},
    ),
    "terminated while queued": Ending(
        _queued_and_stopped("terminate"),
        ("pages_read", "pages_abandoned"),
        {"prefetch": {"workers": 1}},
    ),
    "cancelled while queued": Ending(
        _queued_and_stopped("cancel"),
        ("pages_read", "pages_abandoned"),
        {"prefetch": {"workers": 1}},
    ),
    "timed out while queued": Ending(
        _queued_and_stopped("ready"),
        ("pages_read", "pages_abandoned"),
        {
            "prefetch": {
                "workers": 1,
                "policy": "timeout",
                "timeout_base_s": 0.01,
                "timeout_per_1k_tokens_s": 0.0,
            }
        },
    ),
    "detached while queued": Ending(
        _queued_and_stopped("detach"), ("pages_abandoned",), {"prefetch": {"workers": 1}}
    ),
    "found the queue full": Ending(
        _found_the_queue_full,
        ("pages_read", "pages_abandoned"),
        {"prefetch": {"workers": 1, "queue_size": 1}},
    ),
    "host pool full": Ending(
        _host_pool_full,
        ("pages_read", "pages_abandoned"),
        {"device_pages": 16, "host_pages": 8, "write_through_threshold": 1},
    ),
    "get ERROR": Ending(_get_answers(Outcome.ERROR), ("pages_read", "errors")),
    "get MISS": Ending(_get_answers(Outcome.MISS), ("pages_read", "misses")),
    "get CORRUPT": Ending(_get_answers(Outcome.CORRUPT), ("pages_read", "corrupt", "misses")),
    "get raises": Ending(_get_raises, ("errors",)),
    "lookup raises": Ending(_lookup_raises, ("errors",)),
    "first page failed just before": Ending(_first_page_failed_just_before, ("errors", "misses")),
    "later page failed just before": Ending(_later_page_failed_just_before, ("misses",)),
    "waited read failed": Ending(_waited_read_failed, ("errors", "misses")),
    "failed unexpectedly": Ending(_failed_unexpectedly, ("pages_read", "errors")),
    "re-plans given up": Ending(
        _replans_given_up,
        ("misses", "pages_read", "pages_abandoned"),
        {"host_pages": 300, "prefetch": {"max_host_share": 0.01, "batch_pages": 4}},
    ),
    "repeated key": Ending(_repeated_key(0), ("pages_read", "pages_abandoned")),
    # The pages cached before the repeat were counted as abandoned from the repeat on.
    "repeated key, cached past it": Ending(_repeated_key(3), ("pages_abandoned",)),
    "skipped after lookup": Ending(
        _skipped_after_lookup,
        ("misses", "pages_skipped"),
        {"prefetch": {"threshold_tokens": 7 * PAGE}},
    ),
}


def _counted(stats: PrefetchStatistics) -> int:
    return sum(getattr(stats, name) for name in COUNTERS)


ENDING_COUNTERS = {
    PrefetchStatus.COMPLETE: "completed",
    PrefetchStatus.TERMINATED: "terminated",
    PrefetchStatus.CANCELLED: "cancelled",
    PrefetchStatus.SKIPPED: "skipped",
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_every_page_a_prefetch_looks_for_counts_once_whatever_its_ending(
    ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = ENDINGS[ending]
    config = _config(**case.config)
    prompt = _prompt(1)
    generator = KVGenerator(config.layout, PAGE, seed=5)
    # Pages not cached when each prefetch began to look (its first match), as they begin.
    looked_for = 0
    fetch = Prefetcher._fetch

    async def fetch_looked_for(self: Prefetcher, handle: PrefetchHandle) -> PrefetchStatus:
        nonlocal looked_for
        found = self._cache._tree.match(handle.keys, touch=False)
        looked_for += len(handle.keys) - found.num_device_pages - found.num_host_pages
        return await fetch(self, handle)

    ended = Prefetcher._ended

    def ended_looked_for(self: Prefetcher, handle: PrefetchHandle, status: PrefetchStatus) -> None:
        # One stopped before a worker took it looks for its pages not cached as it ends.
        nonlocal looked_for
        stopped = status in (PrefetchStatus.TERMINATED, PrefetchStatus.CANCELLED)
        if handle.status is PrefetchStatus.QUEUED and stopped:
            found = self._cache._tree.match(handle.keys, touch=False)
            looked_for += len(handle.keys) - found.num_device_pages - found.num_host_pages
        ended(self, handle, status)

    async with MemoryStorage(capacity_bytes=16 << 20) as memory:
        async with HiCache(config, storage=Unowned(memory)) as writer:
            for stored in (prompt, *HEADS):
                await serve(writer, stored, generator, prefetch=False)
            await writer.drain()
        store = Scripted(memory)
        async with HiCache(config, storage=store) as cache:
            world = World(cache, store, prompt, generator, monkeypatch)
            prefetcher = _prefetcher(cache)  # its figures outlive a detach
            monkeypatch.setattr(Prefetcher, "_fetch", fetch_looked_for)
            monkeypatch.setattr(Prefetcher, "_ended", ended_looked_for)
            # Taken at every turn of the loop: no page is in a counter before its prefetch
            # looked for it, nor in two, while prefetches are in flight.
            exceeded: list[tuple[int, PrefetchStatistics]] = []
            watching = True

            async def watch() -> None:
                while watching:
                    stats = prefetcher.statistics()
                    if _counted(stats) > looked_for:
                        exceeded.append((looked_for, stats))
                    await asyncio.sleep(0)

            watcher = asyncio.ensure_future(watch())
            try:
                await asyncio.wait_for(case.scenario(world), 60)
            finally:
                store.open_gates()
                watching = False
                await watcher
            monkeypatch.undo()
            assert not exceeded, exceeded[:3]
            stats = prefetcher.statistics()
            for name in case.counters:
                assert getattr(stats, name) > 0, (name, stats)
            # Pages not cached when each started (nothing it cached is evicted here).
            asked = sum(
                pages - (r.device_tokens + r.host_tokens) // PAGE for r, pages in world.results
            )
            assert _counted(stats) == asked == looked_for, stats
            # Each prefetch is counted once, in the counter of the status it ended with.
            for status, name in ENDING_COUNTERS.items():
                ended = sum(r.status is status for r, _ in world.results)
                assert getattr(stats, name) == ended, (name, stats)
            assert stats.submitted == len(world.results), stats
