"""`agree_cached_tokens` over two ranks in one event loop: the local figure is taken after a
running warmup stopped, and refused input still enters the collective."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import structlog

try:
    import uvloop
except ImportError:  # pragma: no cover - the testing extra brings it everywhere but Windows
    uvloop = None
from test_tp_warmup_cancel import PAGE, _config, _fill, _pair, _Rank, _two_caches, _World

from hicache_async import CacheClosedError, HiCache, WrongThreadError
from hicache_async.distributed import (
    BackgroundAgreements,
    GroupBrokenError,
    GroupStatistics,
)
from hicache_async.storage import FileStorage
from hicache_async.testing import KVGenerator, serve


async def _commit(cache: HiCache, prompt: np.ndarray) -> None:
    with cache.request(prompt) as request:
        await request.allocate(len(prompt) - request.cached_tokens)
        request.commit()


async def test_the_figure_is_taken_after_the_warmup_stopped(tmp_path: Path) -> None:
    prompt = np.arange(500, 500 + 5 * PAGE)
    ranks = _pair(_Rank)
    async with _two_caches(ranks) as (first, second):
        await _commit(second, prompt)
        background = BackgroundAgreements.of(ranks[0])
        background.begin()  # a warmup runs on rank 0
        agreeing = asyncio.create_task(first.agree_cached_tokens(prompt))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not agreeing.done()
        assert background.stop_requested
        # What the warmup brings in before it stops counts: rank 0 offers it.
        await _commit(first, prompt)
        background.end()
        theirs = await second.agree_cached_tokens(prompt)
        assert await agreeing == theirs == len(prompt)
        assert ranks[0].calls == ranks[1].calls == 1


async def test_the_prefix_offered_is_held_until_the_ranks_agree() -> None:
    prompt = np.arange(500, 500 + 5 * PAGE)
    ranks = _pair(_Rank)
    async with _two_caches(ranks) as (first, second):
        for cache in (first, second):
            await _commit(cache, prompt)
        agreeing = asyncio.create_task(first.agree_cached_tokens(prompt))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not agreeing.done()  # rank 1 is late
        # Rank 0's loop serves other prompts meanwhile, more than both pools hold.
        for i in range(12):
            start = 10_000 + i * 1_000
            await _commit(first, np.arange(start, start + 32 * PAGE))
        theirs = await second.agree_cached_tokens(prompt)
        agreed = await agreeing
        assert agreed == theirs == len(prompt)
        with (
            structlog.testing.capture_logs() as logs,
            first.request(prompt, max_cached_tokens=agreed) as request,
        ):
            assert request.cached_tokens == agreed
        assert logs == []
        # An await between the agreement and the request lets the prefix go: the request
        # says so, as the ranks now compute different tokens.
        agreed = (await asyncio.gather(*(c.agree_cached_tokens(prompt) for c in (first, second))))[
            0
        ]
        for i in range(12):
            start = 50_000 + i * 1_000
            await _commit(first, np.arange(start, start + 32 * PAGE))
        with (
            structlog.testing.capture_logs() as logs,
            first.request(prompt, max_cached_tokens=agreed) as request,
        ):
            assert request.cached_tokens == 0
        assert [(e["event"], e["agreed_tokens"], e["cached_tokens"]) for e in logs] == [
            ("hicache.tp.prefix.short", len(prompt), 0)
        ]
        first.tree.check_invariants()


async def test_serve_uses_the_prefix_every_rank_holds(tmp_path: Path) -> None:
    prompt = np.arange(700, 700 + 6 * PAGE)
    roots = [tmp_path / "r0", tmp_path / "r1"]
    await _fill(roots[0], 0, [prompt])  # only rank 0's store has it
    ranks = _pair(_Rank)
    async with _two_caches(ranks, roots) as (first, second):
        generator = KVGenerator(first.config.layout, PAGE)
        for prefetch in (True, False):
            served = await asyncio.wait_for(
                asyncio.gather(
                    *(serve(c, prompt, generator, prefetch=prefetch) for c in (first, second))
                ),
                30,
            )
            # Rank 0 could load the prompt, rank 1 cannot: both compute it all, the first
            # time (the prompt's pages then stay on both ranks' devices).
            computed = [s.computed_tokens for s in served]
            assert computed == ([len(prompt)] * 2 if prefetch else [0, 0])


async def test_serve_agrees_when_only_one_rank_has_storage(tmp_path: Path) -> None:
    prompt = np.arange(900, 900 + 6 * PAGE)
    ranks = _pair(_Rank)
    async with (
        HiCache(_config(0), storage=FileStorage(tmp_path), rank_group=ranks[0]) as first,
        HiCache(_config(1), rank_group=ranks[1]) as second,
    ):
        generator = KVGenerator(first.config.layout, PAGE)
        with structlog.testing.capture_logs() as logs:
            served = await asyncio.wait_for(
                asyncio.gather(*(serve(c, prompt, generator) for c in (first, second))), 30
            )
        assert "hicache.tp.agreement.failed" not in [entry["event"] for entry in logs]
        assert [s.computed_tokens for s in served] == [len(prompt)] * 2
        assert ranks[0].calls == ranks[1].calls == 1


class _BrokenRank(_Rank):
    """A rank whose group broke earlier: every collective refuses at once."""

    def statistics(self) -> GroupStatistics:
        return GroupStatistics(collectives=0, timeouts=0, failures=1, broken=True, cancelled=0)

    async def all_min(self, value: int, *, tag: int | None = None) -> int:
        raise GroupBrokenError("an earlier collective failed; the group is broken")


class _HangingStorage(FileStorage):
    """A file store whose lookups never answer."""

    async def exists(self, keys: Sequence[bytes]) -> int:
        await asyncio.Event().wait()
        return 0


async def test_a_broken_group_answers_a_prefetch_without_waiting_for_its_reads(
    tmp_path: Path,
) -> None:
    prompt = np.arange(1_100, 1_100 + 6 * PAGE)
    (rank, _) = _pair(_BrokenRank)
    # wait_complete: without the group's state, ready() would wait for storage for ever.
    async with HiCache(_config(0), storage=_HangingStorage(tmp_path), rank_group=rank) as cache:
        result = await asyncio.wait_for(cache.prefetch(prompt), 10)
        assert result.agreed_tokens == 0
        assert result.storage_tokens == 0


async def test_a_broken_group_is_logged_once_not_per_request(tmp_path: Path) -> None:
    (rank, _) = _pair(_BrokenRank)
    with structlog.testing.capture_logs() as logs:
        async with HiCache(_config(0), storage=_HangingStorage(tmp_path), rank_group=rank) as cache:
            for number in range(10):
                prompt = np.arange(2_000 + 100 * number, 2_000 + 100 * number + 6 * PAGE)
                assert (await asyncio.wait_for(cache.prefetch(prompt), 10)).agreed_tokens == 0
                assert await cache.agree_cached_tokens(prompt) == 0
    failed = [entry for entry in logs if entry["event"] == "hicache.tp.agreement.failed"]
    # Once, or twice where the run took longer than the log's interval.
    assert 1 <= len(failed) <= 2, len(failed)
    assert "GroupBrokenError" in failed[0]["error"]


class _NoStatisticsRank(_Rank):
    """A user's group that does not implement `statistics()`."""

    def statistics(self) -> GroupStatistics:
        raise NotImplementedError


async def test_a_group_without_statistics_still_agrees(tmp_path: Path) -> None:
    prompt = np.arange(1_300, 1_300 + 6 * PAGE)
    roots = [tmp_path / "r0", tmp_path / "r1"]
    for rank, root in enumerate(roots):
        await _fill(root, rank, [prompt])
    ranks = _pair(_NoStatisticsRank)
    async with _two_caches(ranks, roots) as (first, second):
        results = await asyncio.wait_for(
            asyncio.gather(*(c.prefetch(prompt) for c in (first, second))), 30
        )
        assert [r.agreed_tokens for r in results] == [len(prompt)] * 2


@pytest.mark.parametrize("bad", [[1.5, 2.5], [True, False], [-3]], ids=["float", "bool", "neg"])
async def test_refused_tokens_still_enter_the_collective(bad: list[object]) -> None:
    prompt = np.arange(100, 100 + 3 * PAGE)
    ranks = _pair(_Rank)
    async with _two_caches(ranks) as (first, second):
        await _commit(second, prompt)
        refused = asyncio.create_task(first.agree_cached_tokens(bad))
        # The peer's agreement pairs with a tag no valid prompt has: it gets 0, not a hang.
        assert await asyncio.wait_for(second.agree_cached_tokens(prompt), 30) == 0
        with pytest.raises((TypeError, ValueError)):
            await refused
        assert ranks[0].calls == ranks[1].calls == 1


async def test_a_closed_cache_raises_after_entering(tmp_path: Path) -> None:
    prompt = np.arange(100, 100 + 3 * PAGE)
    ranks = _pair(_Rank)
    await _fill(tmp_path, 1, [prompt])
    async with HiCache(_config(1), storage=FileStorage(tmp_path), rank_group=ranks[1]) as second:
        first = HiCache(_config(0), rank_group=ranks[0])
        async with first:
            await _commit(first, prompt)
        closed = asyncio.create_task(first.agree_cached_tokens(prompt))
        assert await asyncio.wait_for(second.agree_cached_tokens(prompt), 30) == 0
        with pytest.raises(CacheClosedError):
            await closed
        assert ranks[0].calls == ranks[1].calls == 1


async def test_a_call_from_another_thread_raises_before_entering() -> None:
    prompt = np.arange(100, 100 + 3 * PAGE)
    ranks = _pair(_Rank)
    async with _two_caches(ranks) as (first, _):
        raised: list[BaseException] = []

        def elsewhere() -> None:
            try:
                asyncio.run(first.agree_cached_tokens(prompt))
            except BaseException as exc:
                raised.append(exc)

        # A daemon thread joined with a bound: a call that entered the collective would
        # wait there for a peer that never comes.
        thread = threading.Thread(target=elsewhere, daemon=True)
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        assert [type(exc) for exc in raised] == [WrongThreadError]
        assert ranks[0].calls == 0


async def test_a_request_alone_gets_the_device_pages_while_a_peer_is_late() -> None:
    # The offered prefix fills rank 0's device pool. Held in the tree (not locked on the
    # device) while rank 1 is late, its pages may leave for the host: a request for another
    # prompt gets the device pool instead of failing with OutOfPagesError.
    pages = _config(0).device_pages
    prompt = np.arange(500, 500 + pages * PAGE)
    own = np.arange(90_000, 90_000 + pages * PAGE)
    ranks = _pair(_Rank)
    async with _two_caches(ranks) as (first, second):
        for cache in (first, second):
            await _commit(cache, prompt)
        agreeing = asyncio.create_task(first.agree_cached_tokens(prompt))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not agreeing.done()  # rank 1 is late
        await _commit(first, own)
        theirs = await second.agree_cached_tokens(prompt)
        agreed = await agreeing
        assert agreed == theirs == len(prompt)
        with first.request(prompt, max_cached_tokens=agreed) as request:
            assert request.cached_tokens == agreed
        first.tree.check_invariants()


_LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
if uvloop is not None:
    _LOOPS["uvloop"] = uvloop.new_event_loop


@pytest.mark.parametrize("factory", list(_LOOPS.values()), ids=list(_LOOPS))
def test_a_group_serves_a_request_agreement_on_successive_loops(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # Test harnesses run one group object under one `asyncio.run` after another: a request
    # agreement that waited for a warmup on the first loop must not leave the group refusing
    # (or waiting for) the second one's.
    prompt = np.arange(500, 500 + 5 * PAGE)
    ranks = _pair(_Rank)

    async def once() -> None:
        world = _World()
        for rank in ranks:
            rank.world, rank.calls = world, 0
        async with _two_caches(ranks) as (first, second):
            await _commit(first, prompt)
            await _commit(second, prompt)
            background = BackgroundAgreements.of(ranks[0])
            background.begin()  # a warmup runs on rank 0
            agreeing = asyncio.create_task(first.agree_cached_tokens(prompt))
            for _ in range(5):
                await asyncio.sleep(0)
            assert not agreeing.done()
            assert background.stop_requested
            background.end()
            theirs = await asyncio.wait_for(second.agree_cached_tokens(prompt), 30)
            assert await asyncio.wait_for(agreeing, 30) == theirs == len(prompt)

    for _ in range(2):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(once())


@pytest.mark.parametrize("factory", list(_LOOPS.values()), ids=list(_LOOPS))
def test_a_count_left_by_a_loop_that_ended_holds_no_later_loop(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # A warmup counted on a loop closed without running its tasks to the end never ends its
    # count: a later loop's request agreement must not wait for it.
    group = _Rank(_World(), 0)

    async def counted() -> None:
        BackgroundAgreements.of(group).begin()

    loop = factory()
    try:
        loop.run_until_complete(counted())
    finally:
        loop.close()

    async def agree() -> tuple[int, bool]:
        background = BackgroundAgreements.of(group)
        await asyncio.wait_for(background.wait_idle(), 30)
        return background.active, background.stop_requested

    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(agree()) == (0, False)


@pytest.mark.parametrize("factory", list(_LOOPS.values()), ids=list(_LOOPS))
def test_a_count_read_between_steps_of_its_loop_holds(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # A loop driven by `run_until_complete` is stopped, not closed, between calls: its
    # warmups go on at the next call, so state read from plain code meanwhile must not drop
    # their count.
    group = _Rank(_World(), 0)
    background = BackgroundAgreements.of(group)

    async def counted() -> None:
        background.begin()

    async def agree() -> None:
        agreeing = asyncio.create_task(background.wait_idle())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not agreeing.done()
        assert background.stop_requested
        background.end()
        await asyncio.wait_for(agreeing, 30)

    loop = factory()
    try:
        loop.run_until_complete(counted())
        assert background.active == 1
        assert not background.stop_requested
        loop.run_until_complete(agree())
        assert background.active == 0
    finally:
        loop.close()


async def test_a_group_in_use_on_a_running_loop_is_refused_on_another() -> None:
    group = _Rank(_World(), 0)
    counted, release = threading.Event(), threading.Event()

    def elsewhere() -> None:
        async def warmup() -> None:
            background = BackgroundAgreements.of(group)
            background.begin()
            counted.set()
            await asyncio.to_thread(release.wait, 30)
            background.end()

        asyncio.run(warmup())

    thread = threading.Thread(target=elsewhere)
    thread.start()
    try:
        assert await asyncio.to_thread(counted.wait, 30)
        with pytest.raises(RuntimeError, match="two running event loops"):
            await asyncio.wait_for(BackgroundAgreements.of(group).wait_idle(), 30)
    finally:
        release.set()
        await asyncio.to_thread(thread.join, 30)
    await BackgroundAgreements.of(group).wait_idle()  # that loop ended: nothing to wait for
