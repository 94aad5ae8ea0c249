"""Rank groups and agreement: real gloo groups of 2 and 4 processes on loopback, and SingleRank.

Each world is spawned once per module (spawning processes that import torch is the slow part)
and plays every scenario in `_rank_worker`, each on a fresh group. The parent never waits
without a bound: results are collected against a deadline, then processes are joined with a
timeout and killed if still alive.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import queue
import threading
import time
from typing import Any

import _rank_worker as rw
import numpy as np
import pytest
import structlog

from hicache_async import CacheConfig, ConfigError, HiCache, HiCacheError, KVLayout
from hicache_async.distributed import (
    AgreementMismatch,
    BackgroundAgreements,
    CollectiveError,
    CollectiveTimeout,
    GroupBrokenError,
    GroupStatistics,
    RankGroup,
    SingleRank,
    TorchRankGroup,
    agree_entries,
    agree_min,
    agreement_tag,
    run_uncancelled,
)
from hicache_async.testing._servers import free_ports

#: a world that has not reported everything by then has failed (it normally takes seconds).
WORLD_DEADLINE_S = 150.0
JOIN_TIMEOUT_S = 20.0


# -- the multi-process worlds -------------------------------------------------------------


class World:
    """What every rank reported for every scenario."""

    def __init__(self, size: int, loop: str) -> None:
        self.size = size
        self.loop = loop
        self.reports: dict[tuple[int, str], tuple[str, Any]] = {}
        self.problems: list[str] = []

    def results(self, scenario: str) -> list[Any]:
        """Each rank's result for `scenario`; fail the test with the ranks' errors otherwise."""
        out, errors = [], []
        for rank in range(self.size):
            report = self.reports.get((rank, scenario))
            if report is None:
                errors.append(f"rank {rank} did not report {scenario!r}")
            elif report[0] != "ok":
                errors.append(f"rank {rank} failed {scenario!r}:\n{report[1]}")
            else:
                out.append(report[1])
        if errors:
            pytest.fail("\n".join(errors + self.problems))
        return out


def run_world(size: int, loop: str) -> World:
    """Spawn `size` ranks that play every scenario; collect their reports, never hanging."""
    names = list(rw.SCENARIOS)
    plan = rw.Plan(size=size, loop=loop, scenarios=names, ports=free_ports(len(names)))
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    sides = [ctx.Barrier(size) for _ in names]
    procs = [
        ctx.Process(target=rw.main, args=(rank, plan, results, sides), name=f"rank-{rank}")
        for rank in range(size)
    ]
    world = World(size, loop)
    expected = {(rank, name) for rank in range(size) for name in [*names, "threads"]}
    deadline = time.monotonic() + WORLD_DEADLINE_S
    try:
        for proc in procs:
            proc.start()
        while expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                world.problems.append(f"deadline passed; missing reports {sorted(expected)}")
                break
            try:
                rank, name, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if not any(proc.is_alive() for proc in procs):
                    world.problems.append(f"every rank exited; missing {sorted(expected)}")
                    break
                continue
            world.reports[(rank, name)] = (status, payload)
            expected.discard((rank, name))
        for proc in procs:
            proc.join(JOIN_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                world.problems.append(f"{proc.name} was killed")
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        results.close()
        results.join_thread()
    for proc in procs:
        if proc.exitcode != 0:
            world.problems.append(f"{proc.name} exited with {proc.exitcode}")
    return world


try:
    import uvloop  # noqa: F401 - only whether the worlds can run on it
except ImportError:  # pragma: no cover - the testing extra brings it everywhere but Windows
    _WORLDS = [(2, "asyncio"), (4, "asyncio")]
else:
    _WORLDS = [(2, "asyncio"), (4, "uvloop")]


@pytest.fixture(scope="module", params=_WORLDS, ids=[f"{size}-{loop}" for size, loop in _WORLDS])
def world(request: pytest.FixtureRequest) -> World:
    size, loop = request.param
    return run_world(size, loop)


def test_world_exits_cleanly(world: World) -> None:
    assert world.results("threads") == [[]] * world.size, "a collective thread outlived its group"
    assert not world.problems, world.problems


def test_all_min_all_max(world: World) -> None:
    values = [rw.value_for(rank) for rank in range(world.size)]
    for rank, r in enumerate(world.results("collectives")):
        assert (r["rank"], r["size"]) == (rank, world.size)
        # Assigned, they made a cache's checked rank disagree with the group's collectives.
        assert r["refused"] == ["rank", "size"]
        assert r["min"] == min(values)
        assert r["max"] == max(values)
        assert r["numpy_max"] == world.size - 1
        assert type(r["numpy_max"]) is int
        assert r["min_extreme"] == rw.INT64_MIN
        assert r["max_extreme"] == rw.INT64_MAX


def test_all_gather_bytes_variable_length(world: World) -> None:
    expected = [rw.payload_for(rank) for rank in range(world.size)]
    assert len({len(p) for p in expected}) > 1  # the payloads really differ in length
    for r in world.results("collectives"):
        assert r["gathered"] == expected
        assert r["gathered_empty"] == [b""] * world.size


def test_agree_common_same_items_in_rank0_order(world: World) -> None:
    same = [f"same-{i}".encode() for i in range(12)]
    for r in world.results("collectives"):
        assert r["same"] == same


def test_agree_common_different_items_is_the_ordered_intersection(world: World) -> None:
    expected = rw.common_items(world.size)
    assert expected  # not trivially empty
    assert len(expected) < len(set(rw.items_for(0, world.size)))  # and not everything
    for r in world.results("collectives"):
        assert r["different"] == expected
        assert r["one_empty"] == []
        assert r["rank0_empty"] == []


def test_collective_counts_match(world: World) -> None:
    counts = [r["stats"]["collectives"] for r in world.results("collectives")]
    assert counts == [12] * world.size
    for r in world.results("collectives"):
        assert r["stats"]["broken"] is False
        assert r["stats"]["timeouts"] == r["stats"]["failures"] == 0


def test_failed_local_step_degrades_and_keeps_ranks_in_step(world: World) -> None:
    results = world.results("local_failure")
    for r in results:
        assert r["min_failed"] == 0  # the last rank failed: it contributed 0
        assert r["min_ok"] == 10
        assert r["min_invalid"] == 0  # rank 0 returned a str
        assert r["entries_failed"] == []  # rank 1 failed: the empty set
        assert r["entries_invalid"] == []
        assert r["entries_ok"] == rw.common_items(world.size)
        assert r["after"] == world.size - 1
    assert results[0]["min_cancelled"] == "cancelled"
    for r in results[1:]:
        assert r["min_cancelled"] == 0  # the cancelled rank still took part, with 0
    # Every rank entered every collective exactly once, whatever failed where.
    assert [r["stats"]["collectives"] for r in results] == [8] * world.size
    last = world.size - 1
    assert results[last]["failure_logs"][0] == ("agree_min", last)
    assert ("agree_entries", 1) in results[1]["failure_logs"]
    assert results[0]["failure_logs"] == [("agree_min", 0), ("agree_entries", 0)]


def test_cancelled_caller_still_contributes_and_order_holds(world: World) -> None:
    results = world.results("cancel_caller")
    assert results[0]["pending_at_cancel"] is True
    assert results[0]["first"] == "cancelled"
    for r in results[1:]:
        assert r["first"] == 2  # rank 0's contribution arrived although its caller left
    second = [f"second from {rank}".encode() for rank in range(world.size)]
    for r in results:
        assert r["second"] == second
        assert r["third"] == world.size - 1
        assert r["stats"]["collectives"] == 3
    assert results[0]["stats"]["cancelled"] == 1


def test_slow_rank_is_waited_for_while_the_loop_keeps_running(world: World) -> None:
    results = world.results("slow_rank")
    for r in results:
        assert r["min"] == 5
    for r in results[:-1]:
        assert r["pending_while_ticking"] is True
        assert r["ticks"] >= 5


def test_wrapping_existing_groups(world: World) -> None:
    for rank, r in enumerate(world.results("wrap_existing")):
        assert r["default"] == (rank, world.size, world.size - 1)
        assert r["wrapped"] == (rank, world.size, 3)
        assert r["wrapped_common"] == [b"a", b"b"]
        assert r["after_close"] == "GroupBrokenError"
        assert r["sub_still_usable"] == world.size


def test_absent_rank_times_out_then_group_is_broken(world: World) -> None:
    results = world.results("absent_rank")
    for r in results[:-1]:
        assert r["first"] == "CollectiveTimeout"
        assert r["stats_after_timeout"]["broken"] is True
        assert r["stats_after_timeout"]["timeouts"] == 1
        assert r["second"] == "GroupBrokenError"
        assert r["agree"] == "GroupBrokenError"
        # The refused calls entered nothing.
        assert r["stats"]["collectives"] == 1
    assert results[-1]["stats"]["collectives"] == 0


def test_tagged_agreements_agree_and_a_mismatch_breaks_every_rank(world: World) -> None:
    results = world.results("tags")
    values = [rw.value_for(rank) for rank in range(world.size)]
    for r in results:
        assert r["min"] == 10
        assert r["raw_min"] == min(values)
        assert r["entries"] == rw.common_items(world.size)
        assert r["entries_empty"] == []
        assert r["default"] == 0
        assert r["mismatch"] == "AgreementMismatch"  # on every rank, not a number
        assert r["after"] == "GroupBrokenError"
        assert r["stats"]["broken"] is True
        assert r["stats"]["failures"] == 1
        # One collective per agreement, the tag included.
        assert r["stats"]["collectives"] == 6


def test_tag_mismatch_in_agree_common_is_seen_with_an_empty_list(world: World) -> None:
    for r in world.results("tags_entries"):
        assert r["mismatch"] == "AgreementMismatch"
        assert r["stats"]["collectives"] == 1
        assert r["stats"]["broken"] is True


def test_plain_calls_paired_with_other_calls_raise_on_every_rank(world: World) -> None:
    values = [rw.value_for(rank) for rank in range(world.size)]
    for r in world.results("untagged"):
        assert (r["min"], r["max"]) == (min(values), world.size - 1)
        assert r["mismatch"] == "AgreementMismatch"  # on every rank, not a number
        assert r["stats"]["broken"] is True
        assert r["stats"]["collectives"] == 4
    for r in world.results("barrier_paired"):
        assert r["mismatch"] == "AgreementMismatch"
        assert r["stats"]["broken"] is True


# -- in-process tests ---------------------------------------------------------------------


async def test_a_single_ranks_rank_and_size_cannot_be_changed_under_its_cache() -> None:
    # The cache checks them against tp_rank/tp_size only when it is made: changed afterwards,
    # the group it agrees through no longer matches its configuration.
    group = SingleRank()
    HiCache(
        CacheConfig(layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=4), device_pages=4),
        rank_group=group,
    )
    for name in ("rank", "size"):
        with pytest.raises(AttributeError):
            setattr(group, name, 2)
    assert (group.rank, group.size) == (0, 1)


async def test_single_rank_collectives() -> None:
    group = SingleRank()
    assert isinstance(group, RankGroup)
    assert (group.rank, group.size) == (0, 1)
    assert await group.all_min(-5) == -5
    assert await group.all_max(rw.INT64_MAX) == rw.INT64_MAX
    numpy_value = await group.all_min(np.int64(3))  # type: ignore[arg-type]
    assert numpy_value == 3
    assert type(numpy_value) is int
    assert await group.all_gather_bytes(b"abc") == [b"abc"]
    assert await group.agree_common([b"b", b"a", b"b", b"c", b"a"]) == [b"b", b"a", b"c"]
    assert await group.agree_common([]) == []
    await group.barrier()
    assert group.statistics() == GroupStatistics(
        collectives=7, timeouts=0, failures=0, broken=False
    )


async def test_single_rank_rejects_misuse_before_entering() -> None:
    group = SingleRank()
    with pytest.raises(ValueError, match="64-bit"):
        await group.all_min(2**63)
    with pytest.raises(TypeError):
        await group.all_max(True)
    with pytest.raises(TypeError):
        await group.all_gather_bytes("text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await group.agree_common(b"abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await group.agree_common([b"a", "b"])  # type: ignore[list-item]
    assert group.statistics().collectives == 0


async def test_single_rank_yields_to_the_loop() -> None:
    group = SingleRank()
    ran = asyncio.Event()
    asyncio.get_running_loop().call_soon(ran.set)  # runs only if the call gives up control
    await group.all_min(1)
    assert ran.is_set()


async def test_single_rank_call_can_be_cancelled_at_its_yield() -> None:
    group = SingleRank()
    task = asyncio.create_task(group.barrier())
    await asyncio.sleep(0)  # the task starts and suspends at its yield
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_agree_helpers_on_one_rank() -> None:
    group = SingleRank()

    async def seven() -> int:
        return 7

    async def broken() -> int:
        raise OSError("disk gone")

    async def entries() -> list[bytes]:
        return [b"x", b"y", b"x"]

    async def broken_entries() -> list[bytes]:
        raise OSError("manifest unreadable")

    with structlog.testing.capture_logs() as logs:
        assert await agree_min(group, seven) == 7
        assert await agree_min(group, broken) == 0
        assert await agree_entries(group, entries) == [b"x", b"y"]
        assert await agree_entries(group, broken_entries) == []
    failures = [e for e in logs if e["event"] == "tp.local.failed"]
    assert [(e["helper"], e["rank"], e["size"]) for e in failures] == [
        ("agree_min", 0, 1),
        ("agree_entries", 0, 1),
    ]
    assert "disk gone" in failures[0]["error"]
    assert group.statistics().collectives == 4


async def test_agree_min_enters_the_collective_when_its_local_step_is_cancelled() -> None:
    group = SingleRank()
    started = asyncio.Event()

    async def stuck() -> int:
        started.set()
        await asyncio.Event().wait()
        return 1

    task = asyncio.create_task(agree_min(group, stuck))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert group.statistics().collectives == 1


async def test_agree_entries_enters_the_collective_when_its_local_step_is_cancelled() -> None:
    group = SingleRank()
    started = asyncio.Event()

    async def stuck() -> list[bytes]:
        started.set()
        await asyncio.Event().wait()
        return []

    task = asyncio.create_task(agree_entries(group, stuck))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert group.statistics().collectives == 1


def test_error_hierarchy() -> None:
    assert issubclass(CollectiveTimeout, CollectiveError)
    assert issubclass(CollectiveTimeout, TimeoutError)
    assert issubclass(GroupBrokenError, CollectiveError)
    assert issubclass(AgreementMismatch, CollectiveError)
    assert issubclass(CollectiveError, HiCacheError)


async def test_torch_rank_group_rejects_bad_configuration() -> None:
    with pytest.raises(ConfigError, match="rank"):
        await TorchRankGroup.create(2, 2, port=29500)
    with pytest.raises(ConfigError, match="port"):
        await TorchRankGroup.create(0, 2, port=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        await TorchRankGroup.create(0, 2, port=29500, timeout_s=0)
    with pytest.raises(ConfigError, match="group"):
        TorchRankGroup()  # torch.distributed is not initialised in the test process


def test_agreement_tags_name_what_is_agreed() -> None:
    tag = agreement_tag("prefetch", 40, b"key")
    assert tag == agreement_tag("prefetch", 40, b"key")
    assert 0 <= tag < 2**63
    distinct = {
        tag,
        agreement_tag("prefetch", 40, b"other"),
        agreement_tag("prefetch", 41, b"key"),
        agreement_tag("warmup.trim", 40, b"key"),
        agreement_tag("prefetch", "40", b"key"),  # a str is not the int it spells
        agreement_tag("prefetc", "h", 40, b"key"),  # parts are length-prefixed
    }
    assert len(distinct) == 6
    with pytest.raises(TypeError):
        agreement_tag("prefetch", 1.5)  # type: ignore[arg-type]


async def test_single_rank_checks_tags_before_entering() -> None:
    group = SingleRank()
    assert await group.all_min(3, tag=agreement_tag("x")) == 3
    assert await group.agree_common([b"a"], tag=0) == [b"a"]
    for bad in (-1, 2**63, True):
        with pytest.raises((TypeError, ValueError)):
            await group.all_min(1, tag=bad)
    with pytest.raises(TypeError):
        await group.agree_common([], tag="x")  # type: ignore[arg-type]
    assert group.statistics().collectives == 2


async def test_a_gate_orders_the_collective_even_when_cancelled() -> None:
    """Cancelled in its gate, agree_min still waits for the gate before entering (so it
    cannot overtake what the gate waits for), enters once, then re-raises."""
    group = SingleRank()
    opened = asyncio.Event()
    gate_entered = asyncio.Event()

    async def gate() -> None:
        gate_entered.set()
        await opened.wait()

    task = asyncio.create_task(agree_min(group, lambda: rw.returns(5), gate=gate))
    await gate_entered.wait()
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()  # a second cancellation does not skip the gate either
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()
    assert group.statistics().collectives == 0
    opened.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert group.statistics().collectives == 1


async def test_run_uncancelled_finishes_and_reports_the_cancellation() -> None:
    steps: list[int] = []
    started = asyncio.Event()
    release = asyncio.Event()

    async def steps_to_finish() -> None:
        steps.append(1)
        started.set()
        await release.wait()
        steps.append(2)

    async def caller() -> bool:
        return await run_uncancelled(steps_to_finish())

    task = asyncio.create_task(caller())
    await started.wait()
    task.cancel()
    await asyncio.sleep(0)
    release.set()
    assert await task is True
    assert steps == [1, 2]


async def test_background_agreements_stop_then_reset() -> None:
    group = SingleRank()
    background = BackgroundAgreements.of(group)
    assert BackgroundAgreements.of(group) is background
    await background.wait_idle()  # nothing runs: returns at once
    assert background.stop_requested is False
    background.begin()
    waiter = asyncio.create_task(background.wait_idle())
    await asyncio.sleep(0)
    assert background.stop_requested is True
    assert not waiter.done()
    background.end()
    await waiter
    assert background.stop_requested is False  # the next warmup starts afresh
    assert background.active == 0


def _tp_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hicache-tp")]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("timeout_s", {"timeout_s": math.inf}),
        ("timeout_s", {"timeout_s": 1e300}),
        ("timeout_s", {"timeout_s": math.nan}),
        ("connect_timeout_s", {"connect_timeout_s": math.inf}),
        ("connect_timeout_s", {"connect_timeout_s": 1e300}),
        ("timeout_s", {"timeout_s": 10**400}),  # an int past a float's range
        ("connect_timeout_s", {"connect_timeout_s": 10**400}),
        ("rank", {"rank": True, "size": 2}),  # bool is an int: True would mean rank 1
        ("size", {"size": True}),
    ],
)
async def test_create_rejects_unusable_values_before_joining(
    field: str, kwargs: dict[str, Any]
) -> None:
    import torch.distributed as dist

    args: dict[str, Any] = {"rank": 0, "size": 1, "port": free_ports(1)[0], **kwargs}
    with pytest.raises(ConfigError, match=field):
        await TorchRankGroup.create(args.pop("rank"), args.pop("size"), **args)
    assert not dist.is_initialized()  # nothing joined, so a later create can
    assert _tp_threads() == []  # and no thread was left behind


def test_wrapping_rejects_an_infinite_timeout_first() -> None:
    with pytest.raises(ConfigError, match="timeout_s"):
        TorchRankGroup(timeout_s=math.inf)
    with pytest.raises(ConfigError, match="timeout_s"):
        TorchRankGroup(timeout_s=10**400)


async def test_a_closed_group_frees_its_port() -> None:
    port = free_ports(1)[0]
    first = await TorchRankGroup.create(0, 1, port=port, connect_timeout_s=10.0)
    await first.aclose()
    # `first` is still referenced here, as a caller's variable would be.
    second = await TorchRankGroup.create(0, 1, port=port, connect_timeout_s=10.0)
    try:
        assert await second.all_max(4) == 4
    finally:
        await second.aclose()
    assert repr(first).endswith("closed>")
