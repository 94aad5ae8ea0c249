"""Agreements of two ranks in one event loop: a warmup cancelled while one rank waits in an
agreement leaves no peer waiting; concurrent ready() calls on one handle share its hold.

Two ranks share one event loop over an in-process group; rank 1 enters each collective only
after rank 0 has, so rank 0 is always the one waiting when it is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from hicache_async import CacheConfig, HiCache
from hicache_async.distributed import (
    AgreementMismatch,
    CollectiveError,
    GroupStatistics,
    run_uncancelled,
)
from hicache_async.storage import FileStorage

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


class _Rank:
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
        return GroupStatistics()


def _config(rank: int) -> CacheConfig:
    return CacheConfig.from_dict(
        {
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


async def _fill(root: Path, rank: int, prompts: list[np.ndarray]) -> None:
    async with HiCache(_config(rank), storage=FileStorage(root)) as cache:
        for prompt in prompts:
            with cache.request(prompt) as request:
                await request.load()
                await request.allocate(len(prompt) - request.cached_tokens)
                request.commit()
        await cache.drain()


@pytest.mark.parametrize(("kind", "at"), [("common", 0), ("min", 3)], ids=["entries", "go_on"])
async def test_cancelled_warmup_leaves_no_peer_waiting(tmp_path: Path, kind: str, at: int) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 50000, size=int(rng.integers(3 * PAGE, 8 * PAGE))) for _ in range(6)]
    roots = [tmp_path / "r0", tmp_path / "r1"]
    for rank, root in enumerate(roots):
        await _fill(root, rank, prompts)
    world = _World()
    ranks = [_Rank(world, 0), _Rank(world, 1)]
    async with (
        HiCache(_config(0), storage=FileStorage(roots[0]), rank_group=ranks[0]) as first,
        HiCache(_config(1), storage=FileStorage(roots[1]), rank_group=ranks[1]) as second,
    ):
        warmups = [asyncio.create_task(cache.warmup(ratio=1.0)) for cache in (first, second)]
        cancelled_at: list[int] = []

        def cancel_there(entered: str, index: int) -> None:
            # Collective 0 agrees on the entries; then each entry has "go on?" and a trim.
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
    roots = [tmp_path / "r0", tmp_path / "r1"]
    for rank, root in enumerate(roots):
        await _fill(root, rank, [prompt])
    world = _World()
    ranks = [_Rank(world, 0), _Rank(world, 1)]
    async with (
        HiCache(_config(0), storage=FileStorage(roots[0]), rank_group=ranks[0]) as first,
        HiCache(_config(1), storage=FileStorage(roots[1]), rank_group=ranks[1]) as second,
    ):
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
