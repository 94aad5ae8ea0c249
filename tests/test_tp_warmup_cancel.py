"""Agreements of two ranks in one event loop: a warmup cancelled while one rank waits in an
agreement leaves no peer waiting; concurrent ready() calls on one handle share its hold.

Two ranks share one event loop over an in-process group; rank 1 enters each collective only
after rank 0 has, so rank 0 is always the one waiting when it is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import structlog

from hicache_async import CacheConfig, HiCache, WarmupResult, WarmupStatus
from hicache_async.distributed import (
    AgreementMismatch,
    BackgroundAgreements,
    CollectiveError,
    GroupStatistics,
    run_uncancelled,
)
from hicache_async.storage import FileStorage
from hicache_async.workers._prefetch import PrefetchHandle

PAGE = 4


class _World:
    """Collectives of two ranks matched by call index; a slot completes once both entered."""

    def __init__(self) -> None:
        self.slots: dict[
            int, tuple[dict[int, tuple[str, object, int | None]], asyncio.Future[object]]
        ] = {}
        self.entered = [asyncio.Event() for _ in range(256)]

    def enter(
        self, rank: int, index: int, kind: str, value: object, tag: int | None
    ) -> asyncio.Future[object]:
        slot = self.slots.get(index)
        if slot is None:
            slot = self.slots[index] = ({}, asyncio.get_running_loop().create_future())
        slot[0][rank] = (kind, value, tag)
        if rank == 0:
            self.entered[index].set()
        if len(slot[0]) == 2 and not slot[1].done():
            entries = list(slot[0].values())
            if len({(k, t) for k, _, t in entries}) != 1:
                slot[1].set_exception(AgreementMismatch(f"collective {index}: {entries}"))
            elif kind == "min":
                slot[1].set_result(min(int(v) for _, v, _ in entries))  # type: ignore[call-overload]
            else:
                first = list(slot[0][0][1])  # type: ignore[call-overload]
                other = set(slot[0][1][1])  # type: ignore[call-overload]
                slot[1].set_result([item for item in first if item in other])
        return slot[1]


class _SlottedRank:
    """One rank of a `_World`; a class with __slots__ and no __weakref__, as some groups are."""

    __slots__ = ("calls", "on_enter", "rank", "size", "world")

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, 2
        self.calls = 0
        self.on_enter: Callable[[str, int], None] | None = None

    async def _collective(self, kind: str, value: object, tag: int | None) -> object:
        index = self.calls
        self.calls += 1
        if self.rank == 1:
            await self.world.entered[index].wait()  # rank 0 always enters first
        future = self.world.enter(self.rank, index, kind, value, tag)
        if self.on_enter is not None:
            self.on_enter(kind, index)
        return await asyncio.shield(future)

    async def all_min(self, value: int, *, tag: int | None = None) -> int:
        return int(await self._collective("min", value, tag))  # type: ignore[call-overload]

    async def agree_common(self, items: Sequence[bytes], *, tag: int | None = None) -> list[bytes]:
        return list(await self._collective("common", list(dict.fromkeys(items)), tag))  # type: ignore[call-overload]

    async def all_max(self, value: int) -> int:
        raise NotImplementedError

    async def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        raise NotImplementedError

    async def barrier(self) -> None:
        raise NotImplementedError

    def statistics(self) -> GroupStatistics:
        return GroupStatistics(
            collectives=self.calls, timeouts=0, failures=0, broken=False, cancelled=0
        )


class _Rank(_SlottedRank):
    """The same rank, weakly referenceable (a subclass without __slots__)."""


def _config(rank: int, *, warmup: bool = False) -> CacheConfig:
    """Rank `rank`'s config; `warmup` starts a warmup (all of the host pool) on attach."""
    return CacheConfig.from_dict(
        {
            "warmup": {"enabled": warmup, "ratio": 1.0},
            "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 256,
            "model_id": "tp-warmup-cancel",
            "tp_rank": rank,
            "tp_size": 2,
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
        }
    )


R = TypeVar("R", bound=_SlottedRank)


def _pair(kind: type[R]) -> list[R]:
    """Ranks 0 and 1 of a new `_World`."""
    world = _World()
    return [kind(world, 0), kind(world, 1)]


@contextlib.asynccontextmanager
async def _two_caches(
    ranks: Sequence[_SlottedRank], roots: Sequence[Path] | None = None, *, warmup: bool = False
) -> AsyncIterator[tuple[HiCache, HiCache]]:
    """Rank 0's and rank 1's caches over `ranks`, each on a FileStorage at its root if given."""
    stores = [None, None] if roots is None else [FileStorage(root) for root in roots]
    async with (
        HiCache(_config(0, warmup=warmup), storage=stores[0], rank_group=ranks[0]) as first,
        HiCache(_config(1, warmup=warmup), storage=stores[1], rank_group=ranks[1]) as second,
    ):
        yield first, second


async def _fill_both(tmp_path: Path, prompts: list[np.ndarray]) -> list[Path]:
    """Stores for ranks 0 and 1 (under `tmp_path`), both holding `prompts`."""
    roots = [tmp_path / "r0", tmp_path / "r1"]
    for rank, root in enumerate(roots):
        await _fill(root, rank, prompts)
    return roots


async def _fill(root: Path, rank: int, prompts: list[np.ndarray]) -> None:
    async with HiCache(_config(rank), storage=FileStorage(root)) as cache:
        for prompt in prompts:
            with cache.request(prompt) as request:
                await request.load()
                await request.allocate(len(prompt) - request.cached_tokens)
                request.commit()
        await cache.drain()


@pytest.mark.parametrize(
    ("kind", "at"), [("common", 0), ("common", 1), ("min", 4)], ids=["entries", "longest", "go_on"]
)
async def test_cancelled_warmup_leaves_no_peer_waiting(tmp_path: Path, kind: str, at: int) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 50000, size=int(rng.integers(3 * PAGE, 8 * PAGE))) for _ in range(6)]
    roots = await _fill_both(tmp_path, prompts)
    ranks = _pair(_Rank)
    async with _two_caches(ranks, roots) as (first, second):
        warmups = [asyncio.create_task(cache.warmup(ratio=1.0)) for cache in (first, second)]
        cancelled_at: list[int] = []

        def cancel_there(entered: str, index: int) -> None:
            # Collective 0 agrees on the entries, 1 (here the only step) on how far the
            # ranks share them; then each entry has "go on?" and a trim.
            if entered == kind and index == at and not cancelled_at:
                cancelled_at.append(index)
                warmups[0].cancel()  # rank 0 waits in it: rank 1 has not entered yet

        ranks[0].on_enter = cancel_there
        with contextlib.suppress(asyncio.CancelledError):
            await warmups[0]
        assert cancelled_at == [at]
        assert warmups[0].cancelled()
        # Without what rank 0 owed it, rank 1 would wait in its next collective forever.
        result = await asyncio.wait_for(warmups[1], 30)
        assert result.status.value == "stopped"
        assert ranks[0].calls == ranks[1].calls


async def _finish_then_cancel(steps: int) -> bool | None:
    """Let `run_uncancelled` finish its coroutine, cancel the caller `steps` loop steps later:
    what the caller returned, or None if it had already returned."""
    release = asyncio.Event()

    async def work() -> None:
        await release.wait()

    caller = asyncio.create_task(run_uncancelled(work()))
    await asyncio.sleep(0)
    release.set()
    for _ in range(steps):
        await asyncio.sleep(0)
    if caller.done():
        return None
    caller.cancel()
    return await caller


async def test_run_uncancelled_keeps_a_result_that_landed_before_the_cancellation() -> None:
    """A cancellation landing after the coroutine finished, before the caller resumed, is
    reported, not raised over the result."""
    outcomes = [await _finish_then_cancel(steps) for steps in range(6)]
    assert outcomes[0] is True  # cancelled before the coroutine even resumed
    assert True in outcomes[1:]  # ... and once it had finished, before the caller resumed
    assert set(outcomes) <= {True, None}


async def test_two_ready_calls_on_one_handle_share_the_hold(tmp_path: Path) -> None:
    """The prefix a rank offers stays held until the last of its ready() calls returns."""
    prompt = np.arange(1000, 1000 + 6 * PAGE)
    roots = await _fill_both(tmp_path, [prompt])
    ranks = _pair(_Rank)
    async with _two_caches(ranks, roots) as (first, second):
        handles = [await cache.start_prefetch(prompt) for cache in (first, second)]
        both = [asyncio.create_task(handles[0].ready()) for _ in range(2)]
        one = await handles[1].ready()  # pairs with rank 0's first agreement only
        done, pending = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        assert len(pending) == 1
        assert one.agreed_tokens == done.pop().result().agreed_tokens == len(prompt)
        assert handles[0]._held is not None  # the other ready() still offers that prefix
        again = await handles[1].ready()
        assert (await pending.pop()).agreed_tokens == again.agreed_tokens == len(prompt)
        assert handles[0]._held is None


async def test_run_uncancelled_does_not_lose_a_cancellation_to_an_error() -> None:
    release = asyncio.Event()

    async def fails() -> None:
        await release.wait()
        raise CollectiveError("the group broke meanwhile")

    caller = asyncio.create_task(run_uncancelled(fails()))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.sleep(0)
    release.set()
    assert await caller is True  # the caller re-raises its cancellation from here
    with pytest.raises(CollectiveError):
        await run_uncancelled(fails())  # not cancelled: the error is the caller's


async def _fill_missing_tail(root: Path, rank: int, prompts: list[np.ndarray], keep: int) -> None:
    """Fill the store, then drop every prompt's pages past the first `keep` from it (the
    manifest still lists them): a warmup on this rank lands fewer pages than its peers'."""
    await _fill(root, rank, prompts)
    async with HiCache(_config(rank), storage=FileStorage(root)) as cache:
        backend = cache._link.backend if cache._link is not None else None
        assert backend is not None
        for prompt in prompts:
            keys = cache.namespace.storage_keys(cache.keys_for(prompt))
            assert await backend.delete(keys[keep:]) == len(keys) - keep


async def test_warmup_cancelled_in_a_trim_still_trims_like_its_peers(tmp_path: Path) -> None:
    """Rank 1 holds fewer pages of each entry, so the agreed trim drops rank 0's excess; a
    cancellation while rank 0 waits in that trim agreement must not skip the drop."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 50000, size=6 * PAGE) for _ in range(3)]
    roots = [tmp_path / "r0", tmp_path / "r1"]
    await _fill(roots[0], 0, prompts)
    await _fill_missing_tail(roots[1], 1, prompts, keep=3)
    ranks = _pair(_Rank)
    async with _two_caches(ranks, roots) as (first, second):
        warmups = [asyncio.create_task(cache.warmup(ratio=1.0)) for cache in (first, second)]

        def cancel_in_first_trim(entered: str, index: int) -> None:
            # 0: entries; 1: how far they are shared; 2: the first entry's "go on?"; 3: its trim.
            if index == 3:
                assert entered == "min"
                warmups[0].cancel()  # rank 0 waits in the trim: rank 1 has not entered yet

        ranks[0].on_enter = cancel_in_first_trim
        with pytest.raises(asyncio.CancelledError):
            await warmups[0]
        result = await asyncio.wait_for(warmups[1], 30)
        assert result.status.value == "stopped"
        assert result.entries_loaded == 1
        assert ranks[0].calls == ranks[1].calls
        held = [[c.match(p).host_tokens for p in prompts] for c in (first, second)]
        assert sorted(held[1]) == [0, 0, 3 * PAGE]  # rank 1 loaded what it had of one entry
        assert held[0] == held[1]  # rank 0 dropped the pages rank 1 does not have
        pools = [c.statistics().host_pool for c in (first, second)]
        assert pools[0] is not None
        assert pools[1] is not None
        assert pools[0].used == pools[1].used == 3


@pytest.mark.parametrize("stop", ["none", "detach", "at_once"])
async def test_a_link_warmup_counts_once_and_ends_on_every_path(tmp_path: Path, stop: str) -> None:
    """The warmup started on attach counts as one background sequence from the attach on,
    and that count ends whether it completes, is cancelled mid-way (a detach) or at once;
    a request agreement made afterwards then runs instead of waiting forever."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 50000, size=4 * PAGE) for _ in range(4)]
    roots = await _fill_both(tmp_path, prompts)
    ranks = _pair(_Rank)
    backgrounds = [BackgroundAgreements.of(rank) for rank in ranks]
    async with _two_caches(ranks, warmup=True) as (first, second):
        seen: list[int] = []
        detaching: list[asyncio.Task[None]] = []

        def watch(entered: str, index: int) -> None:
            seen.append(backgrounds[0].active)
            if stop == "detach" and index == 4:  # the second entry's "go on?"
                detaching.append(asyncio.create_task(first.detach_storage()))

        ranks[0].on_enter = watch
        await first.attach_storage(FileStorage(roots[0]))
        assert backgrounds[0].active == 1  # counted before its task first ran
        if stop == "at_once":
            # Its warmup, cancelled at its first step, still enters the entries agreement,
            # so the detach completes once rank 1 has entered it too.
            detaching.append(asyncio.create_task(first.detach_storage()))
        await second.attach_storage(FileStorage(roots[1]))
        theirs = await asyncio.wait_for(second.wait_warmup(), 30)
        assert theirs is not None
        if stop == "none":
            ours = await first.wait_warmup()
            assert ours is not None
            assert ours.status.value == theirs.status.value == "complete"
            assert ours.entries_loaded == theirs.entries_loaded == len(prompts)
        else:
            await asyncio.gather(*detaching)
            assert theirs.status.value == "stopped"
        assert seen
        assert set(seen) == {1}  # one warmup, one count (not one per layer that began it)
        assert [b.active for b in backgrounds] == [0, 0]
        assert ranks[0].calls == ranks[1].calls
        agreed = await asyncio.wait_for(
            asyncio.gather(*(c.agree_cached_tokens(prompts[0]) for c in (first, second))), 30
        )
        assert agreed[0] == agreed[1]
        assert ranks[0].calls == ranks[1].calls


async def test_every_scheduled_link_warmup_ends_its_own_count(tmp_path: Path) -> None:
    """Two warmups scheduled on one link count twice and end twice; a link whose task group
    has ended refuses a warmup without counting it (a count that never ends would make every
    later request agreement on the group wait forever)."""
    world = _World()
    rank = _Rank(world, 0)
    background = BackgroundAgreements.of(rank)
    release = asyncio.Event()

    async def held() -> WarmupResult:
        await release.wait()
        return WarmupResult(status=WarmupStatus.COMPLETE)

    async with HiCache(_config(0), storage=FileStorage(tmp_path), rank_group=rank) as cache:
        link = cache._link
        assert link is not None
        futures = []
        for _ in range(2):
            link.start_warmup(held)
            assert link.warmup_result is not None
            futures.append(link.warmup_result)
        assert background.active == 2
        release.set()
        results = await asyncio.gather(*futures)
        assert [r.status for r in results] == [WarmupStatus.COMPLETE] * 2
        assert background.active == 0
        await cache.detach_storage()
        with pytest.raises(RuntimeError):
            link.start_warmup(held)
        assert background.active == 0


async def test_a_group_without_weakrefs_is_let_go_once_its_warmups_end(tmp_path: Path) -> None:
    """A group that cannot be weakly referenced keeps one `BackgroundAgreements` while a
    warmup runs on it, which a request agreement made meanwhile waits for; once the warmup
    ended and nobody holds it, the table no longer keeps it (nor the group)."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 50000, size=4 * PAGE) for _ in range(4)]
    roots = await _fill_both(tmp_path, prompts)
    ranks = _pair(_SlottedRank)
    with pytest.raises(TypeError):
        weakref.ref(ranks[0])
    async with _two_caches(ranks, roots) as (first, second):
        warmups = [asyncio.create_task(cache.warmup(ratio=1.0)) for cache in (first, second)]
        requests: list[asyncio.Task[int]] = []
        running: list[int] = []

        def ask(entered: str, index: int) -> None:
            if index == 2:  # rank 0's warmup waits in the first entry's "go on?"
                running.append(BackgroundAgreements.of(ranks[0]).active)
                requests.extend(
                    asyncio.create_task(c.agree_cached_tokens(prompts[0])) for c in (first, second)
                )

        ranks[0].on_enter = ask
        results = await asyncio.wait_for(asyncio.gather(*warmups), 30)
        agreed = await asyncio.wait_for(asyncio.gather(*requests), 30)
        assert running == [1]
        assert [r.status for r in results] == [WarmupStatus.STOPPED] * 2
        assert results[0].entries_loaded == results[1].entries_loaded < len(prompts)
        # Had a request not waited for its rank's warmup, it would have paired with one of
        # the warmup's collectives on the other rank.
        assert all(not f.exception() for _, f in ranks[0].world.slots.values())
        assert ranks[0].calls == ranks[1].calls
        assert agreed[0] == agreed[1]
        gc.collect()  # frames of finished tasks may sit in reference cycles
        assert all(id(rank) not in BackgroundAgreements._of_strong for rank in ranks)


async def test_a_warmup_a_broken_group_stops_reports_what_it_loaded(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 50000, size=4 * PAGE) for _ in range(5)]
    roots = await _fill_both(tmp_path, prompts)
    ranks = _pair(_Rank)

    def break_at(kind: str, index: int) -> None:
        # Collectives: the entries, how far they are shared (one step: the ranks hold the
        # same chains), then "go on?" and the trim per entry; the third entry's "go on?"
        # fails on both ranks, as a dead peer's would.
        if index == 6:
            raise CollectiveError("the peer went away")

    for rank in ranks:
        rank.on_enter = break_at
    async with _two_caches(ranks, roots) as (first, second):
        results = await asyncio.wait_for(
            asyncio.gather(*(c.warmup(ratio=1.0) for c in (first, second))), 30
        )
    for result in results:
        assert result.status is WarmupStatus.STOPPED
        assert (result.entries_read, result.entries_agreed) == (len(prompts), len(prompts))
        assert (result.entries_loaded, result.pages_loaded) == (2, 8)


async def test_a_budget_never_makes_a_rank_drop_pages_it_held(tmp_path: Path) -> None:
    # Rank 0 holds half of the entry already; the budget is less than the rest. Cuts of each
    # rank's own would leave the ranks different prefixes, and the trim would drop what rank
    # 0 held: with a rank group the entry is loaded whole.
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 50000, size=10 * PAGE)
    roots = await _fill_both(tmp_path, [prompt])
    ranks = _pair(_Rank)
    async with _two_caches(ranks, roots) as (first, second):
        link = first._link
        assert link is not None
        keys = first.keys_for(prompt)
        held = PrefetchHandle(link.prefetcher, keys[:5], 5 * PAGE, "own", "wait_complete")
        await link.prefetcher.run_now(held)
        assert first.match(prompt).host_tokens == 5 * PAGE
        ratio = 3 / first.config.resolved_host_pages
        await asyncio.wait_for(
            asyncio.gather(first.warmup(ratio=ratio), second.warmup(ratio=ratio)), 30
        )
        for cache in (first, second):
            assert cache.match(prompt).host_tokens == len(prompt)


class _OpensWhenLetGo(FileStorage):
    """Opens once `gate` is set."""

    gate: asyncio.Event

    async def __aenter__(self) -> _OpensWhenLetGo:
        await self.gate.wait()
        return await super().__aenter__()


async def test_a_prefetch_while_one_ranks_storage_opens_pairs_after_its_warmup(
    tmp_path: Path,
) -> None:
    # Rank 1's storage is open and its warmup on attach has begun; rank 0's is still
    # opening. Rank 0's prefetch must not enter its agreement before its own warmup's, or it
    # pairs with rank 1's warmup collective: a mismatch on both ranks.
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 50000, size=8 * PAGE) for _ in range(4)]
    roots = await _fill_both(tmp_path, prompts)
    ranks = _pair(_Rank)
    store = _OpensWhenLetGo(roots[0])
    store.gate = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        async with (
            HiCache(_config(0, warmup=True), rank_group=ranks[0]) as first,
            HiCache(_config(1, warmup=True), rank_group=ranks[1]) as second,
        ):
            attaching = asyncio.create_task(first.attach_storage(store))
            try:
                await second.attach_storage(FileStorage(roots[1]))
                deadline = asyncio.get_running_loop().time() + 30
                while not first.storage_status().opening:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.001)
                prompt = rng.integers(0, 50000, size=6 * PAGE)  # in neither store
                handles = [await cache.start_prefetch(prompt) for cache in (first, second)]
                ready = asyncio.ensure_future(asyncio.gather(*(h.ready() for h in handles)))
                await asyncio.sleep(0)
            finally:
                store.gate.set()
            results = await asyncio.wait_for(ready, 60)
            await attaching
            warmups = await asyncio.wait_for(
                asyncio.gather(first.wait_warmup(), second.wait_warmup()), 60
            )
    failed = [e["event"] for e in logs if "agreement.failed" in e["event"]]
    assert failed == []
    assert [r.agreed_tokens for r in results] == [0, 0]
    # The same on both ranks (a request agreement stops a warmup under way: STOPPED).
    assert warmups[0] is not None
    assert warmups[1] is not None
    assert warmups[0].status is warmups[1].status
    assert warmups[0].pages_loaded == warmups[1].pages_loaded
    assert ranks[0].calls == ranks[1].calls


async def test_a_rank_without_storage_holds_the_prefix_it_offers(tmp_path: Path) -> None:
    # Rank 0 has no storage and offers the prefix it has cached; while the agreement waits
    # for rank 1, eviction must not take that prefix, or rank 0 computes tokens the ranks
    # agreed were cached (`hicache.tp.prefix.short`) and the ranks diverge.
    prompt = np.arange(700, 700 + 6 * PAGE)
    root = tmp_path / "r1"
    await _fill(root, 1, [prompt])
    ranks = _pair(_Rank)
    async with (
        HiCache(_config(0), rank_group=ranks[0]) as first,
        HiCache(_config(1), storage=FileStorage(root), rank_group=ranks[1]) as second,
    ):
        with first.request(prompt) as request:
            await request.allocate(len(prompt))
            request.commit()
        await first.drain()
        handles = [await cache.start_prefetch(prompt) for cache in (first, second)]
        mine = asyncio.ensure_future(handles[0].ready())
        deadline = asyncio.get_running_loop().time() + 30
        while not ranks[0].calls:  # rank 0 waits in the agreement
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.001)
        # Meanwhile rank 0 serves other prompts: everything evictable goes.
        eviction = first.tree.evict_device(10**6, backup_first=False)
        first._device_free(eviction.freed)
        first._host_free(first.tree.evict_host(10**6))
        results = await asyncio.wait_for(asyncio.gather(mine, handles[1].ready()), 60)
        agreed = results[0].agreed_tokens
        assert agreed == results[1].agreed_tokens == len(prompt)
        with (
            structlog.testing.capture_logs() as logs,
            first.request(prompt, max_cached_tokens=agreed) as request,
        ):
            assert request.cached_tokens == agreed
        assert not [e for e in logs if e["event"] == "hicache.tp.prefix.short"]
        await first.drain()
