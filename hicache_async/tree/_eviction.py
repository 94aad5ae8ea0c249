"""Eviction order: lowest priority first, then LRU or LFU, then node id."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from .._config import EvictionPolicy
from ._node import TreeNode

__all__ = ["EvictionQueue", "check_policy"]

# (priority, hits or 0, last access, id, node): ids are unique, so nodes are never compared.
_Entry = tuple[int, int, float, int, TreeNode]

# Stale entries tolerated beyond one per live candidate before the heap is compacted.
_SLACK = 16


def check_policy(policy: str) -> EvictionPolicy:
    """Return `policy` if it is a known eviction policy, else raise ValueError."""
    if policy == "lru":
        return "lru"
    if policy == "lfu":
        return "lfu"
    raise ValueError(f"eviction must be 'lru' or 'lfu', got {policy!r}")


class EvictionQueue:
    """The eviction candidates of one tier, kept in order between eviction calls.

    A min-heap with lazy invalidation: the tree calls `update` whenever a node becomes or
    stops being a candidate, or its key (priority, hits, last access) changes. Each candidate
    has exactly one live entry, the one `_live` maps it to; any other entry in the heap is
    stale and skipped when popped. Once stale entries outnumber live ones (plus a slack), the
    heap is compacted, so memory stays proportional to the candidates and every operation is
    O(log n) amortized, however many candidates there are.
    """

    __slots__ = ("_heap", "_lfu", "_live")

    def __init__(self, policy: EvictionPolicy) -> None:
        self._lfu = policy == "lfu"
        self._heap: list[_Entry] = []
        self._live: dict[TreeNode, _Entry] = {}

    def _entry(self, node: TreeNode) -> _Entry:
        hits = node.hit_count if self._lfu else 0
        return (node.priority, hits, node.last_access, node.id, node)

    def update(self, node: TreeNode, candidate: bool) -> None:
        """Record whether `node` is a candidate now, under its current key."""
        live = self._live
        if not candidate:
            # Also after removals: the stale entries would keep removed nodes (and their
            # subtrees' memory) alive until the next push.
            if live.pop(node, None) is not None:
                self._compact_if_stale()
            return
        entry = self._entry(node)
        old = live.get(node)
        if old is not None and old[:4] == entry[:4]:
            return
        live[node] = entry
        heapq.heappush(self._heap, entry)
        self._compact_if_stale()

    def _compact_if_stale(self) -> None:
        heap, live = self._heap, self._live
        if len(heap) > 2 * len(live) + _SLACK:
            self._heap = [e for e in heap if live.get(e[4]) is e]
            heapq.heapify(self._heap)

    def pop(self) -> TreeNode | None:
        """Take the next victim out of the queue, or None when no candidate is left.

        The victim stops being a candidate here; if the caller keeps it as one, it must
        `update` it back.
        """
        heap = self._heap
        live = self._live
        while heap:
            entry = heapq.heappop(heap)
            node = entry[4]
            if live.get(node) is entry:
                del live[node]
                return node
        return None

    def check(self, candidates: Iterable[TreeNode]) -> None:
        """Raise AssertionError unless the queue holds exactly `candidates` under their
        current keys (for `RadixTree.check_invariants`)."""
        expected = set(candidates)
        if set(self._live) != expected:
            raise AssertionError("the eviction queue does not hold exactly the candidates")
        live = self._live
        for node, entry in live.items():
            if entry != self._entry(node):
                raise AssertionError(f"the eviction queue holds {node!r} under a stale key")
        if sum(1 for e in self._heap if live.get(e[4]) is e) != len(live):
            raise AssertionError("a live eviction entry is missing from the heap")

    def __len__(self) -> int:
        return len(self._live)
