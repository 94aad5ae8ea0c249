"""The radix tree that indexes cached pages across the device, host and storage tiers.

Keys are page keys (see `hicache_async.page_keys`); every count is in pages. The tree belongs to
one event loop: give it a `LoopOwner` and any call from another thread or loop raises
`WrongThreadError`.
"""

from ._node import TreeNode
from ._results import DeviceEviction, InsertResult, MatchResult, TreeStatistics
from ._tree import RadixTree

__all__ = [
    "DeviceEviction",
    "InsertResult",
    "MatchResult",
    "RadixTree",
    "TreeNode",
    "TreeStatistics",
]
