"""One rank of a test world, run in a spawned process by tests/test_rank_group.py.

A world is `size` processes. Each runs an event loop (asyncio or uvloop) and plays every
scenario in order; for each one it joins a fresh gloo group on its own loopback port (so a
scenario that breaks its group cannot affect the next), runs it, and reports
``(rank, scenario, "ok" | "error", result)`` on the results queue. A per-scenario
multiprocessing barrier (the "side channel") lets ranks order themselves without the group
under test, so no scenario depends on timing.

The inputs are functions of the rank so the test can compute what every rank must get.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist

from hicache_async.distributed import (
    AgreementMismatch,
    CollectiveError,
    CollectiveTimeout,
    GroupBrokenError,
    TorchRankGroup,
    agree_entries,
    agree_min,
    agreement_tag,
)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: how long a rank waits on the side channel before giving up (only reached if a test fails).
SIDE_TIMEOUT_S = 60.0
#: how long any one scenario may run in a rank before it is abandoned as failed.
SCENARIO_TIMEOUT_S = 90.0

Result = dict[str, Any]


# -- inputs, shared with the test ----------------------------------------------------------


def value_for(rank: int) -> int:
    """A different, sometimes negative, integer per rank."""
    return (rank * 7919) % 23 - 11 + (rank if rank % 2 == 0 else -rank)


def payload_for(rank: int) -> bytes:
    """Payloads of very different lengths, one of them empty."""
    if rank == 1:
        return b""
    if rank == 2:
        return bytes(range(256)) * 300  # 76,800 bytes
    return f"payload of rank {rank}".encode()


def items_for(rank: int, size: int) -> list[bytes]:
    """Overlapping item sets in a per-rank order, with duplicates on the non-zero ranks."""
    items = [f"key-{i:02d}".encode() for i in range(40) if i % (rank + 2) != 1]
    items.append(f"only-rank-{rank}".encode())
    random.Random(rank).shuffle(items)
    if rank:
        items.extend(items[:3])
    return items


def common_items(size: int) -> list[bytes]:
    """What agree_common must return for `items_for`: rank 0's order, deduplicated, filtered."""
    sets = [set(items_for(rank, size)) for rank in range(size)]
    out: list[bytes] = []
    for item in items_for(0, size):
        if item not in out and all(item in s for s in sets):
            out.append(item)
    return out


# -- the scenarios ------------------------------------------------------------------------


@dataclass
class Ctx:
    rank: int
    size: int
    group: TorchRankGroup
    side: Barrier

    async def side_sync(self) -> None:
        """Wait (off the loop) until every rank has reached this point of the scenario."""
        await asyncio.to_thread(self.side.wait, SIDE_TIMEOUT_S)


async def returns(value: Any) -> Any:
    await asyncio.sleep(0)
    return value


async def fails() -> Any:
    await asyncio.sleep(0)
    raise RuntimeError("local step failed")


def stats(group: TorchRankGroup) -> Result:
    s = group.statistics()
    return {
        "collectives": s.collectives,
        "timeouts": s.timeouts,
        "failures": s.failures,
        "broken": s.broken,
        "cancelled": s.cancelled,
    }


async def collectives(ctx: Ctx) -> Result:
    g, rank, size = ctx.group, ctx.rank, ctx.size
    out: Result = {"rank": g.rank, "size": g.size}
    refused = []
    for name in ("rank", "size"):
        try:
            setattr(g, name, 0)
        except AttributeError:
            refused.append(name)
    out["refused"] = refused
    out["min"] = await g.all_min(value_for(rank))
    out["max"] = await g.all_max(value_for(rank))
    out["numpy_max"] = await g.all_max(np.int64(rank))  # type: ignore[arg-type]
    out["min_extreme"] = await g.all_min(INT64_MIN if rank == 0 else rank)
    out["max_extreme"] = await g.all_max(INT64_MAX if rank == size - 1 else rank)
    out["gathered"] = await g.all_gather_bytes(payload_for(rank))
    out["gathered_empty"] = await g.all_gather_bytes(b"")
    await g.barrier()
    same = [f"same-{i}".encode() for i in range(12)]
    out["same"] = await g.agree_common(same if rank == 0 else same[::-1] + same[:2])
    out["different"] = await g.agree_common(items_for(rank, size))
    out["one_empty"] = await g.agree_common([] if rank == size - 1 else [b"x", b"y"])
    out["rank0_empty"] = await g.agree_common([] if rank == 0 else [b"x"])
    out["stats"] = stats(g)
    return out


async def local_failure(ctx: Ctx) -> Result:
    g, rank, size = ctx.group, ctx.rank, ctx.size
    out: Result = {}
    with structlog.testing.capture_logs() as logs:
        out["min_failed"] = await agree_min(g, fails if rank == size - 1 else lambda: returns(9))
        out["min_ok"] = await agree_min(g, lambda: returns(10 + rank))
        out["min_invalid"] = await agree_min(g, lambda: returns("7" if rank == 0 else 7))
        out["entries_failed"] = await agree_entries(
            g, fails if rank == 1 else lambda: returns(items_for(rank, size))
        )
        out["entries_invalid"] = await agree_entries(
            g, lambda: returns(["not bytes"] if rank == 0 else items_for(rank, size))
        )
        out["entries_ok"] = await agree_entries(g, lambda: returns(items_for(rank, size)))

        # Rank 0's local step is cancelled; it must still enter the collective.
        if rank == 0:
            started = asyncio.Event()

            async def stuck() -> int:
                started.set()
                await asyncio.Event().wait()
                return 1

            task = asyncio.create_task(agree_min(g, stuck))
            await started.wait()
            task.cancel()
            try:
                out["min_cancelled"] = await task
            except asyncio.CancelledError:
                out["min_cancelled"] = "cancelled"
        else:
            out["min_cancelled"] = await agree_min(g, lambda: returns(5))

        out["after"] = await g.all_max(rank)
    out["failure_logs"] = [
        (entry["helper"], entry["rank"]) for entry in logs if entry["event"] == "tp.local.failed"
    ]
    out["stats"] = stats(g)
    return out


async def cancel_caller(ctx: Ctx) -> Result:
    g, rank = ctx.group, ctx.rank
    out: Result = {}
    if rank == 0:
        # The peers are held on the side channel, so this collective cannot complete yet.
        task = asyncio.create_task(g.all_min(2))
        for _ in range(3):
            await asyncio.sleep(0)
        out["pending_at_cancel"] = not task.done()
        task.cancel()
        try:
            await task
            out["first"] = "returned"
        except asyncio.CancelledError:
            out["first"] = "cancelled"
        await ctx.side_sync()
    else:
        await ctx.side_sync()
        out["first"] = await g.all_min(9 + rank)
    out["second"] = await g.all_gather_bytes(f"second from {rank}".encode())
    out["third"] = await g.all_max(rank)
    out["stats"] = stats(g)
    return out


async def slow_rank(ctx: Ctx) -> Result:
    g, rank, size = ctx.group, ctx.rank, ctx.size
    out: Result = {}
    if rank == size - 1:
        # Arrive only after every other rank has shown its loop ticking, then a bit later.
        await ctx.side_sync()
        await asyncio.sleep(0.2)
        out["min"] = await g.all_min(rank + 5)
        return out

    ticks = 0
    ticked = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.002)
            ticks += 1
            if ticks == 5:
                ticked.set()

    collective = asyncio.create_task(g.all_min(rank + 5))
    tick_task = asyncio.create_task(ticker())
    await ticked.wait()
    out["pending_while_ticking"] = not collective.done()
    out["ticks"] = ticks
    await ctx.side_sync()
    out["min"] = await collective
    tick_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await tick_task
    return out


async def wrap_existing(ctx: Ctx) -> Result:
    rank = ctx.rank
    out: Result = {}
    default = TorchRankGroup(timeout_s=20.0)
    out["default"] = (default.rank, default.size, await default.all_max(rank))
    await default.aclose()
    sub = dist.new_group(backend="gloo")
    async with TorchRankGroup(sub, timeout_s=20.0) as wrapped:
        out["wrapped"] = (wrapped.rank, wrapped.size, await wrapped.all_min(rank + 3))
        out["wrapped_common"] = await wrapped.agree_common([b"a", b"b", f"r{rank}".encode()])
    try:
        await wrapped.all_min(0)
        out["after_close"] = "returned"
    except GroupBrokenError:
        out["after_close"] = "GroupBrokenError"
    # Closing the wrapper leaves the wrapped group alone.
    total = torch.tensor([1], dtype=torch.int64)
    dist.all_reduce(total, group=sub)
    out["sub_still_usable"] = int(total.item())
    dist.destroy_process_group(sub)
    return out


async def absent_rank(ctx: Ctx) -> Result:
    g, rank, size = ctx.group, ctx.rank, ctx.size
    out: Result = {}
    if rank == size - 1:
        await ctx.side_sync()  # never enters a collective
        out["stats"] = stats(g)
        return out

    async def attempt(name: str, call: Callable[[], Awaitable[object]]) -> None:
        try:
            await call()
            out[name] = "returned"
        except CollectiveTimeout:
            out[name] = "CollectiveTimeout"
        except GroupBrokenError:
            out[name] = "GroupBrokenError"
        except CollectiveError:
            out[name] = "CollectiveError"

    await attempt("first", lambda: g.all_min(rank))
    out["stats_after_timeout"] = stats(g)
    await attempt("second", lambda: g.all_gather_bytes(b"x"))
    await attempt("agree", lambda: agree_min(g, lambda: returns(3)))
    out["stats"] = stats(g)
    await ctx.side_sync()
    return out


async def _outcome(call: Callable[[], Awaitable[object]]) -> Any:
    """The call's result, or the name of the rank-group error it raised."""
    try:
        return await call()
    except (AgreementMismatch, GroupBrokenError) as exc:
        return type(exc).__name__


async def tags(ctx: Ctx) -> Result:
    """Matching tags agree as usual; one rank pairing another agreement breaks every rank."""
    g, rank, size = ctx.group, ctx.rank, ctx.size
    out: Result = {}
    prefetch_a = agreement_tag("prefetch", b"keys of A")
    out["min"] = await agree_min(g, lambda: returns(10 + rank), tag=prefetch_a)
    out["raw_min"] = await g.all_min(value_for(rank), tag=prefetch_a)
    entries_tag = agreement_tag("warmup.entries")
    out["entries"] = await agree_entries(g, lambda: returns(items_for(rank, size)), tag=entries_tag)
    out["entries_empty"] = await agree_entries(g, lambda: returns([]), tag=entries_tag)
    out["default"] = await agree_min(g, lambda: returns(rank))
    # The last rank agrees on another prompt (its requests ran in another order).
    other = agreement_tag("prefetch", b"keys of B") if rank == size - 1 else prefetch_a
    out["mismatch"] = await _outcome(lambda: agree_min(g, lambda: returns(40), tag=other))
    out["after"] = await _outcome(lambda: g.all_max(rank))
    out["stats"] = stats(g)
    return out


async def tags_entries(ctx: Ctx) -> Result:
    """A tag mismatch in agree_common is detected even when rank 0's list is empty."""
    g, rank = ctx.group, ctx.rank
    tag = agreement_tag("warmup.entries", rank)  # a different tag on every rank
    out: Result = {
        "mismatch": await _outcome(lambda: agree_entries(g, lambda: returns([]), tag=tag))
    }
    out["stats"] = stats(g)
    return out


async def untagged(ctx: Ctx) -> Result:
    """Plain calls check a tag of their own: pairing one with a tagged agreement, or with
    another kind of plain call, raises on every rank instead of returning a number."""
    g, rank, size = ctx.group, ctx.rank, ctx.size
    out: Result = {"min": await g.all_min(value_for(rank)), "max": await g.all_max(rank)}
    await g.barrier()
    last = rank == size - 1
    tagged = agreement_tag("prefetch", b"keys of A")
    out["mismatch"] = await _outcome(
        (lambda: g.all_min(7)) if last else (lambda: g.all_min(100, tag=tagged))
    )
    out["stats"] = stats(g)
    return out


async def barrier_paired(ctx: Ctx) -> Result:
    """A barrier paired with an all_max on one rank is a mismatch, not a barrier passed."""
    g, rank, size = ctx.group, ctx.rank, ctx.size

    async def barrier() -> str:
        await g.barrier()
        return "passed"

    call = (lambda: g.all_max(5)) if rank == size - 1 else barrier
    return {"mismatch": await _outcome(call), "stats": stats(g)}


SCENARIOS: dict[str, Callable[[Ctx], Awaitable[Result]]] = {
    "collectives": collectives,
    "local_failure": local_failure,
    "cancel_caller": cancel_caller,
    "slow_rank": slow_rank,
    "wrap_existing": wrap_existing,
    "absent_rank": absent_rank,
    "tags": tags,
    "tags_entries": tags_entries,
    "untagged": untagged,
    "barrier_paired": barrier_paired,
}

#: the collective timeout each scenario's group runs with.
TIMEOUTS: dict[str, float] = {"absent_rank": 1.0, "slow_rank": 30.0}
DEFAULT_TIMEOUT_S = 20.0


# -- the process ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What one world runs: scenarios in order, each on its own port and side barrier."""

    size: int
    loop: str
    scenarios: Sequence[str]
    ports: Sequence[int]


async def _scenario(rank: int, plan: Plan, name: str, port: int, side: Barrier) -> Result:
    group = await TorchRankGroup.create(
        rank,
        plan.size,
        port=port,
        timeout_s=TIMEOUTS.get(name, DEFAULT_TIMEOUT_S),
        connect_timeout_s=60.0,
    )
    async with group:
        return await SCENARIOS[name](Ctx(rank, plan.size, group, side))


async def _play(rank: int, plan: Plan, results: Queue[Any], sides: Sequence[Barrier]) -> None:
    for name, port, side in zip(plan.scenarios, plan.ports, sides, strict=True):
        try:
            result = await asyncio.wait_for(
                _scenario(rank, plan, name, port, side), SCENARIO_TIMEOUT_S
            )
        except BaseException:
            side.abort()  # release peers waiting on the side channel
            results.put((rank, name, "error", traceback.format_exc()))
            if dist.is_initialized():
                dist.destroy_process_group()
        else:
            results.put((rank, name, "ok", result))


def main(rank: int, plan: Plan, results: Queue[Any], sides: Sequence[Barrier]) -> None:
    """The spawned process's entry point."""
    torch.set_num_threads(1)
    loop: asyncio.AbstractEventLoop
    if plan.loop == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_play(rank, plan, results, sides))
    finally:
        loop.close()
    # Closing a group stops its collective thread: none may outlive the scenarios.
    leftover = []
    for thread in threading.enumerate():
        if thread.name.startswith("hicache-tp"):
            thread.join(10.0)
            if thread.is_alive():
                leftover.append(thread.name)
    results.put((rank, "threads", "ok", leftover))
    # Skip the interpreter's teardown of torch (most of a second per process on a busy
    # machine) once the reports are flushed; there is nothing left to clean up.
    results.close()
    results.join_thread()
    os._exit(0)
