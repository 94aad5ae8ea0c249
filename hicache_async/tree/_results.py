"""What the tree's operations return."""

from __future__ import annotations

import msgspec

from ._node import TreeNode

__all__ = ["DeviceEviction", "InsertResult", "MatchResult", "TreeStatistics"]


class MatchResult(msgspec.Struct, frozen=True):
    """The cached prefix of a query, split by tier.

    The query's keys are covered in order by: the device-resident prefix, then the host-only
    extension right after it, then `storage_keys` (not cached here; maybe in storage).
    """

    keys: list[bytes]
    device_pages: list[int]
    device_node: TreeNode
    host_pages: list[int]
    host_node: TreeNode

    @property
    def num_device_pages(self) -> int:
        """Pages of the query already on the device."""
        return len(self.device_pages)

    @property
    def num_host_pages(self) -> int:
        """Pages right after the device prefix that are on the host only."""
        return len(self.host_pages)

    @property
    def storage_keys(self) -> list[bytes]:
        """Keys of the query past every cached page (candidates for a storage prefetch)."""
        return self.keys[len(self.device_pages) + len(self.host_pages) :]


class InsertResult(msgspec.Struct, frozen=True):
    """The outcome of an insert.

    The duplicate lists hold the caller's pages for spans the tree already had on that tier;
    the caller still owns them and should free them.
    """

    node: TreeNode
    duplicate_device_pages: list[int]
    duplicate_host_pages: list[int]


class DeviceEviction(msgspec.Struct, frozen=True):
    """The outcome of a device eviction.

    `freed` pages now belong to the caller. `needs_backup` lists device leaves that would have
    been evicted but have no host copy; back them up to the host, then evict again.
    """

    freed: list[int]
    needs_backup: list[TreeNode]


class TreeStatistics(msgspec.Struct, frozen=True):
    """A snapshot of the tree's size (the root is not counted).

    `evictable_device_pages` counts device pages of unlocked nodes (some of them need a host
    backup before they can go); `evictable_host_pages` counts host pages of unprotected nodes
    that are not on the device.
    """

    nodes: int
    device_pages: int
    host_pages: int
    storage_pages: int
    locked_nodes: int
    protected_nodes: int
    evictable_device_pages: int
    evictable_host_pages: int
