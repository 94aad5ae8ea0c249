"""Two real processes share one store: B starts cold, warms up from what A backed up, and
serves A's prefixes from its host pool; and two live instances share a file root, and a
Mooncake cluster (each lending a segment: B reads A's pages from A's).

Both processes are spawned up front (their imports overlap) and driven by commands; every
phase builds a new HiCache, so B's cache is created only after A has finished. The whole
world has a hard deadline; children still running then are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import uuid
from pathlib import Path
from typing import Any

import _two_process_worker as worker
import pytest

from hicache_async.testing._fixtures import close_mooncake_clients
from hicache_async.testing._servers import MooncakeMaster, RedisServer

DEADLINE_S = 150.0


class _World:
    def __init__(self, root: Path, redis_url: str, mooncake_url: str) -> None:
        self.file_url = f"file://{root}?shared=1"
        self.redis_url = f"{redis_url}?prefix=two{uuid.uuid4().hex}"
        # Each instance lends a segment and puts its pages there: B reads A's from A's.
        small = "&segment_size=256MiB&buffer_size=16MiB&staging_size=16MiB"
        self.mooncake_urls = [
            f"{mooncake_url}{small}&prefix=two{uuid.uuid4().hex}" for _ in range(2)
        ]
        ctx = mp.get_context("spawn")
        self.results: Any = ctx.Queue()
        self.commands: dict[str, Any] = {"A": ctx.Queue(), "B": ctx.Queue()}
        # Held here: a queue collected before a child has unpickled it is gone for the child.
        self.channels: tuple[Any, Any] = (ctx.Queue(), ctx.Queue())
        a_to_b, b_to_a = self.channels
        self.procs = {
            "A": ctx.Process(
                target=worker.main,
                args=("A", self.commands["A"], self.results, a_to_b, b_to_a),
                daemon=True,
            ),
            "B": ctx.Process(
                target=worker.main,
                args=("B", self.commands["B"], self.results, b_to_a, a_to_b),
                daemon=True,
            ),
        }
        self.deadline = time.monotonic() + DEADLINE_S
        self.reports: dict[str, dict[str, Any]] = {}

    def run(self, *steps: tuple[str, str, str, str, int]) -> None:
        """Send each `(role, label, phase, url, seed)`; wait for all of their results."""
        waiting = set()
        for role, label, phase, url, seed in steps:
            self.commands[role].put((label, phase, url, seed))
            waiting.add(label)
        while waiting:
            if time.monotonic() > self.deadline:
                pytest.fail(f"deadline passed waiting for {sorted(waiting)}")
            try:
                role, label, status, payload = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in self.procs.items() if not p.is_alive()]
                if dead:
                    pytest.fail(f"process {dead} died waiting for {sorted(waiting)}")
                continue
            assert status == "ok", f"{role} {label}:\n{payload}"
            self.reports[label] = payload
            waiting.discard(label)

    def stop(self) -> None:
        for commands in self.commands.values():
            commands.put(None)
        for proc in self.procs.values():
            proc.join(max(1.0, min(20.0, self.deadline - time.monotonic())))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("shared-root")
    with RedisServer() as server, MooncakeMaster() as master:
        w = _World(root, server.url, master.url)
        try:
            for proc in w.procs.values():
                proc.start()
            # A fills the file root, Redis and Mooncake, each from an empty store.
            w.run(
                ("A", "fill-file", "fill", w.file_url, 1),
                ("A", "fill-redis", "fill", w.redis_url, 2),
                ("A", "fill-mooncake", "fill", w.mooncake_urls[0], 4),
            )
            # Then B starts cold against each store, warms up and serves A's prompts.
            w.run(
                ("B", "warm-file", "warm", w.file_url, 1),
                ("B", "warm-redis", "warm", w.redis_url, 2),
                ("B", "warm-mooncake", "warm", w.mooncake_urls[0], 4),
            )
            # Two live instances on one store: A writes new prompts while B reads them.
            w.run(
                ("A", "writer", "writer", w.file_url, 3),
                ("B", "reader", "reader", w.file_url, 3),
            )
            w.run(
                ("A", "writer-mooncake", "writer", w.mooncake_urls[1], 5),
                ("B", "reader-mooncake", "reader", w.mooncake_urls[1], 5),
            )
        finally:
            w.stop()
            close_mooncake_clients(master)
        yield w.reports


TAILS = worker.PROMPTS * 2  # each prompt ends in a 2-token partial page, always computed


def _check_fill(report: dict[str, Any]) -> None:
    assert report["mismatches"] == 0
    assert report["served"] == worker.PROMPTS
    assert report["written_pages"] > 0
    assert report["manifest_entries"] >= worker.PROMPTS


def _check_warm(report: dict[str, Any]) -> None:
    assert report["warmup_status"] == "complete"
    assert report["warmup_entries"] >= worker.PROMPTS
    assert report["mismatches"] == 0
    assert report["served"] == worker.PROMPTS
    # Every whole page was cached: from B's host pool (warmup put it there) or, for the
    # shared system prompt after the first request, from B's device pool. Nothing came from
    # storage on a request's path, and every page was checked against the generator.
    assert report["warmup_pages"] * worker.PAGE >= report["host_tokens"] > 0
    assert report["device_tokens"] + report["host_tokens"] == report["expected_tokens"]
    assert report["storage_tokens"] == 0
    assert report["computed_tokens"] == TAILS
    assert report["checked_pages"] * worker.PAGE == report["expected_tokens"]


def test_b_warms_up_from_a_shared_file_root(world: dict[str, dict[str, Any]]) -> None:
    _check_fill(world["fill-file"])
    _check_warm(world["warm-file"])


def test_b_warms_up_from_a_shared_redis(world: dict[str, dict[str, Any]]) -> None:
    _check_fill(world["fill-redis"])
    _check_warm(world["warm-redis"])


def test_b_warms_up_from_a_shared_mooncake(world: dict[str, dict[str, Any]]) -> None:
    _check_fill(world["fill-mooncake"])
    _check_warm(world["warm-mooncake"])


@pytest.mark.parametrize("store", ["file", "mooncake"])
def test_two_live_instances_share_a_store(world: dict[str, dict[str, Any]], store: str) -> None:
    suffix = "" if store == "file" else f"-{store}"
    writer, reader = world[f"writer{suffix}"], world[f"reader{suffix}"]
    assert writer["mismatches"] == reader["mismatches"] == 0
    assert writer["served"] == reader["served"] == worker.PROMPTS
    assert writer["written_pages"] > 0
    # B found every whole page of A's prompts in the shared store by prefetching it (the
    # shared system prompt only once: later requests have it on B's device).
    cached = reader["device_tokens"] + reader["host_tokens"] + reader["storage_tokens"]
    assert cached == reader["expected_tokens"]
    assert reader["storage_tokens"] > reader["expected_tokens"] // 2
    assert reader["computed_tokens"] == TAILS
    assert reader["checked_pages"] * worker.PAGE == reader["expected_tokens"]
