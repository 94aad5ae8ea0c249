"""Tensor-parallel ranks agree on warmup entries and prefetch hits; no scenario can hang."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any

import _tp_worker as worker
import pytest

from hicache_async.testing._servers import free_ports

SCENARIOS = ["same", "different", "failing", "slow", "prefetch", *worker.REGRESSIONS]
DEADLINE_S = 240.0


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    size = request.param
    base = tmp_path_factory.mktemp(f"tp{size}")
    ports = dict(zip(SCENARIOS, free_ports(len(SCENARIOS)), strict=True))
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=worker.main, args=(rank, size, ports, str(base), results))
        for rank in range(size)
    ]
    reports: dict[tuple[int, str], Any] = {}
    expected = {(rank, name) for rank in range(size) for name in SCENARIOS}
    deadline = time.monotonic() + DEADLINE_S
    try:
        for proc in procs:
            proc.start()
        while expected and time.monotonic() < deadline:
            try:
                rank, name, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            assert status == "ok", f"rank {rank} {name}:\n{payload}"
            reports[(rank, name)] = payload
            expected.discard((rank, name))
        for proc in procs:
            proc.join(20)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert not expected, f"ranks hung or died; missing {sorted(expected)}"
    return {"size": size, "reports": reports}


def _per_rank(world: dict[str, Any], name: str) -> list[Any]:
    return [world["reports"][(rank, name)] for rank in range(world["size"])]


def test_same_manifests_load_everything_identically(world: dict[str, Any]) -> None:
    reports = _per_rank(world, "same")
    assert all(r["entries_agreed"] == worker.PROMPTS for r in reports)
    shapes = [r["shape"] for r in reports]
    assert all(s == shapes[0] for s in shapes)
    assert shapes[0]["host_pages"] > 0
    assert len({r["collectives"] for r in reports}) == 1


def test_different_manifests_agree_on_the_common_entries(world: dict[str, Any]) -> None:
    size = world["size"]
    common = set.intersection(*(set(worker.held_by(r, "different")) for r in range(size)))
    reports = _per_rank(world, "different")
    assert all(r["entries_agreed"] == len(common) for r in reports)
    shapes = [r["shape"] for r in reports]
    assert all(s == shapes[0] for s in shapes)
    for index, (_, host) in enumerate(shapes[0]["prompts"]):
        assert (host > 0) == (index in common)


def test_a_rank_whose_storage_fails_leaves_every_rank_equal(world: dict[str, Any]) -> None:
    reports = _per_rank(world, "failing")
    shapes = [r["shape"] for r in reports]
    assert all(s == shapes[0] for s in shapes)
    assert shapes[0]["host_pages"] == 0  # rank 1 has nothing, so nobody keeps anything
    assert len({r["collectives"] for r in reports}) == 1
    # What the agreed trim dropped is not counted loaded on the ranks that had read it.
    for r in reports:
        assert r["entries_agreed"] > 0
        assert tuple(r["loaded"]) == (0, 0, r["entries_agreed"])


def test_a_slow_rank_is_waited_for(world: dict[str, Any]) -> None:
    reports = _per_rank(world, "slow")
    shapes = [r["shape"] for r in reports]
    assert all(s == shapes[0] for s in shapes)
    assert shapes[0]["host_pages"] > 0


def test_prefetch_hits_are_the_minimum_over_ranks(world: dict[str, Any]) -> None:
    reports = _per_rank(world, "prefetch")
    assert reports[0]["local"] > 0  # only rank 0 had the pages
    assert all(r["agreed"] == 0 for r in reports)
    assert all(r["used"] == 0 for r in reports)


def _in_step(reports: list[Any]) -> None:
    """Every rank entered the same number of collectives and no group broke."""
    assert len({r["collectives"] for r in reports}) == 1, reports
    assert not any(r["broken"] for r in reports), reports


def test_background_warmup_never_interleaves_with_a_request_agreement(
    world: dict[str, Any],
) -> None:
    reports = _per_rank(world, "background_warmup")
    _in_step(reports)
    for r in reports:
        assert r["agreed"] == 4 * worker.PAGE  # rank 0 has 4 of the 10 pages
        assert r["used"] == r["agreed"]
    # The request stopped the warmup at the same entry on every rank.
    assert len({r["warmup"] for r in reports}) == 1


def test_cancelling_ready_in_its_policy_wait_still_enters_the_agreement(
    world: dict[str, Any],
) -> None:
    reports = _per_rank(world, "cancel_ready")
    _in_step(reports)
    assert reports[0]["first"] == "cancelled"
    assert all(r["first"] == 0 for r in reports[1:])  # rank 0 took part with 0
    for r in reports:
        assert r["second"]["agreed"] == r["second"]["local"] > 0


def test_cancelling_a_start_waiting_for_queue_room_still_enters_its_agreement(
    world: dict[str, Any],
) -> None:
    # Cancelled before it had a handle, the start entered no agreement: rank 0's next one
    # paired with the others' third, every rank raised AgreementMismatch, and the broken
    # group made every later prefetch a miss on every rank. (Entered at the cancellation,
    # it paired with the others' first instead.)
    reports = _per_rank(world, "cancel_start")
    _in_step(reports)
    assert reports[0]["third"] == "cancelled"
    assert all(r["third"] == 0 for r in reports[1:])  # rank 0 took part with 0
    for r in reports:
        assert r["first"] > 0
        assert r["second"] > 0
        assert r["fourth"]["agreed"] == r["fourth"]["local"] > 0


def test_cancelling_warmup_between_its_collectives_keeps_ranks_in_step(
    world: dict[str, Any],
) -> None:
    reports = _per_rank(world, "cancel_warmup")
    _in_step(reports)
    assert reports[0]["warmup"] == "cancelled"
    assert all(r["warmup"] == "stopped" for r in reports[1:])
    assert all(r["shape"] == reports[0]["shape"] for r in reports)
    for r in reports:
        assert r["next"]["agreed"] == r["next"]["local"] > 0


def test_the_agreed_prefix_survives_eviction_until_the_request(world: dict[str, Any]) -> None:
    reports = _per_rank(world, "evict")
    _in_step(reports)
    for name in ("first", "second"):
        assert len({r[name]["agreed"] for r in reports}) == 1
        for r in reports:
            assert r[name]["used"] == r[name]["agreed"]
    assert reports[0]["first"]["agreed"] == 10 * worker.PAGE


def test_warmup_loads_the_longest_prefix_every_rank_shares(world: dict[str, Any]) -> None:
    """Each rank's manifest has one entry per prompt, and the ranks share 5, 7 and 13 pages
    of them: the shorter or diverging chains of ranks 1 to 3 are recorded whole only, so
    agreement on prefix ids alone reaches 4, 4 and 8 pages; the ranks load all they share."""
    reports = _per_rank(world, "longest_shared")
    _in_step(reports)
    shared = [pages * worker.PAGE for pages in worker.SHARED_PAGES]
    for r in reports:
        assert r["status"] == "complete"
        assert tuple(r["loaded"]) == (3, 3, sum(worker.SHARED_PAGES))
        assert r["host"] == shared
        assert [tuple(s) for s in r["served"]] == [
            (tokens, 0, pages) for tokens, pages in zip(shared, worker.SHARED_PAGES, strict=True)
        ]
