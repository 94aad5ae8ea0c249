"""A node of the radix tree: a run of page keys and where those pages live."""

from __future__ import annotations

__all__ = ["TreeNode"]


class TreeNode:
    """A run of pages sharing one path from the root, and their residency in each tier.

    Nodes are owned by their `RadixTree`: read them freely, but change them only through the
    tree's methods, which keep its counters, candidate sets and invariants in step. A node
    removed from the tree has `parent is None` (and no pages); the tree rejects it afterwards.

    Attributes:
        id: unique within the tree (the root is 0); also the last tie-breaker of eviction order.
        parent: the node one step closer to the root; None for the root and for removed nodes.
        children: child nodes keyed by their first page key.
        keys: the page keys of this run, in order.
        device_pages: one device-pool page index per key, or None when not on the device.
        host_pages: one host-pool page index per key, or None when not on the host.
        in_storage: the storage backend acknowledged every page of this run.
        lock_ref: device locks (running requests) on this node or any descendant.
        host_ref: host protections (pending copies or storage operations) on this node or any
            descendant.
        hit_count: matches that reached this node.
        last_access: clock reading of the last match or insert that reached this node.
        priority: eviction priority; lower goes first.
        num_device_children: how many children are on the device (kept by the tree so "is a
            device leaf" is O(1)).
    """

    __slots__ = (
        "children",
        "device_pages",
        "hit_count",
        "host_pages",
        "host_ref",
        "id",
        "in_storage",
        "keys",
        "last_access",
        "lock_ref",
        "num_device_children",
        "parent",
        "priority",
    )

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        keys: list[bytes],
        *,
        device_pages: list[int] | None = None,
        host_pages: list[int] | None = None,
        priority: int = 0,
        last_access: float = 0.0,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.keys = keys
        self.device_pages = device_pages
        self.host_pages = host_pages
        self.in_storage = False
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access = last_access
        self.priority = priority
        self.num_device_children = 0

    @property
    def num_pages(self) -> int:
        """Number of pages (keys) in this run."""
        return len(self.keys)

    @property
    def on_device(self) -> bool:
        """Whether the run has device pages."""
        return self.device_pages is not None

    @property
    def on_host(self) -> bool:
        """Whether the run has host pages."""
        return self.host_pages is not None

    def __repr__(self) -> str:
        tiers = [
            name
            for name, present in (
                ("device", self.device_pages is not None),
                ("host", self.host_pages is not None),
                ("storage", self.in_storage),
            )
            if present
        ]
        return (
            f"TreeNode(id={self.id}, pages={len(self.keys)}, tiers={'+'.join(tiers) or '-'}, "
            f"lock_ref={self.lock_ref}, host_ref={self.host_ref}, hits={self.hit_count}, "
            f"priority={self.priority}, children={len(self.children)})"
        )
