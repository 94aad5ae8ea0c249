"""Eviction order: lowest priority first, then LRU or LFU, then node id."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from .._config import EvictionPolicy
from ._node import TreeNode

__all__ = ["EvictionQueue", "check_policy"]

# (priority, hits or 0, last access, id, node): ids are unique, so nodes are never compared.
_Entry = tuple[int, int, float, int, TreeNode]


def check_policy(policy: str) -> EvictionPolicy:
    """Return `policy` if it is a known eviction policy, else raise ValueError."""
    if policy == "lru":
        return "lru"
    if policy == "lfu":
        return "lfu"
    raise ValueError(f"eviction must be 'lru' or 'lfu', got {policy!r}")


class EvictionQueue:
    """A min-heap of eviction candidates for one eviction call.

    Keys are read when a node is pushed; nothing touches nodes during an eviction call, so
    they stay valid until it returns.
    """

    __slots__ = ("_heap", "_lfu")

    def __init__(self, policy: EvictionPolicy, nodes: Iterable[TreeNode]) -> None:
        self._lfu = policy == "lfu"
        self._heap: list[_Entry] = [self._entry(node) for node in nodes]
        heapq.heapify(self._heap)

    def _entry(self, node: TreeNode) -> _Entry:
        hits = node.hit_count if self._lfu else 0
        return (node.priority, hits, node.last_access, node.id, node)

    def push(self, node: TreeNode) -> None:
        """Add a node that became a candidate during the call."""
        heapq.heappush(self._heap, self._entry(node))

    def pop(self) -> TreeNode | None:
        """The next victim, or None when no candidate is left."""
        if not self._heap:
            return None
        return heapq.heappop(self._heap)[4]

    def __len__(self) -> int:
        return len(self._heap)
