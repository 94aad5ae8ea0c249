"""The design's invariants as assertions a test can make about a cache at rest."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._cache import HiCache
else:
    # Not imported at run time (it brings torch, which the pytest plugin must not import):
    # tools that read hints at run time (typing.get_type_hints, beartype, sphinx) see a
    # cache as Any rather than fail.
    HiCache = Any

__all__ = ["assert_drained"]


def assert_drained(cache: HiCache) -> None:
    """Assert that a cache whose workload has drained (`await cache.drain()`) is balanced.

    No live request; every device lock and host protection back to zero; the tree's own
    invariants; and in both pools free + used == capacity, with every used page in the tree.
    Raises AssertionError naming the first thing that is off.
    """
    stats = cache.statistics()
    assert stats.live_requests == 0, f"{stats.live_requests} requests were never released"
    for node in cache.tree.iter_nodes():
        assert node.lock_ref == 0, f"device lock left on {node!r}"
        assert node.host_ref == 0, f"host protection left on {node!r}"
    cache.tree.check_invariants()
    for pool, in_tree in (
        (cache.device_pool, stats.tree.device_pages),
        (cache.host_pool, stats.tree.host_pages),
    ):
        alloc = pool.allocator
        assert alloc.free_count + alloc.used_count == alloc.capacity, f"{pool!r} unbalanced"
        assert alloc.used_count == in_tree, (
            f"{pool!r}: {alloc.used_count} pages used but {in_tree} in the tree (a leak)"
        )
