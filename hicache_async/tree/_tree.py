"""The radix tree over page keys that indexes every tier.

Everything is counted in pages. The tree is owned by one event loop and takes no locks: each
public method runs to completion synchronously, so each state change is one atomic step as seen
from any coroutine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from itertools import compress
from operator import ne

from .._config import EvictionPolicy
from .._loop import LoopOwner
from ._eviction import EvictionQueue, check_policy
from ._node import TreeNode
from ._results import DeviceEviction, InsertResult, MatchResult, TreeStatistics

__all__ = ["RadixTree"]

# How many unbacked victims a `backed_only` device eviction passes over before it gives up:
# a bound on its cost when few pages have a host copy.
_BACKED_ONLY_SKIPS = 256


def _common_prefix(run: list[bytes], query: list[bytes], start: int) -> int:
    """Length of the common prefix of `run` and `query[start:]`."""
    limit = min(len(run), len(query) - start)
    k = 0
    while k < limit and run[k] == query[start + k]:
        k += 1
    return k


def _new_duplicates(given: list[int], existing: list[int], out: list[int]) -> None:
    """Append the caller's pages that differ from the tree's own at the same position.

    A caller that passes back the very pages it matched does not own two copies, so those are
    not duplicates (freeing them would free pages the tree still uses). Matched pages are a
    prefix of the caller's list ending on a node boundary (match splits there), so a span is
    either all the tree's own pages or all fresh ones; checking both ends keeps the usual
    case free of a per-page loop, and a span that shares an end is filtered page by page.
    """
    if given == existing:
        return
    if given[0] != existing[0] and given[-1] != existing[-1]:
        out += given
    else:
        out.extend(compress(given, map(ne, given, existing)))


class RadixTree:
    """A radix tree over page keys recording, per run of pages, its device and host pages.

    Invariants (see `check_invariants`): every non-root node is on the device or the host (or
    both); device residency is prefix-closed; a node's page lists match its keys in length;
    reference counts are non-negative and never larger on a child than on its parent; a page
    index appears at most once per tier.

    Device locks and host protections are path-based: taking one on a node adds one to it and
    to every ancestor, so a locked node's whole prefix stays on the device and a protected
    node's whole prefix stays in the tree (with any host pages it has). Splits keep the original
    node object as the suffix, so a node reference held by a caller still names the same
    prefix and its references still balance.
    """

    __slots__ = (
        "_clock",
        "_device_leaves",
        "_device_pages",
        "_device_queue",
        "_evictable_device",
        "_evictable_host",
        "_host_leaves",
        "_host_pages",
        "_host_queue",
        "_locked",
        "_next_id",
        "_nodes",
        "_owner",
        "_policy",
        "_protected",
        "_root",
        "_storage_pages",
    )

    def __init__(
        self,
        *,
        eviction: EvictionPolicy = "lru",
        owner: LoopOwner | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy: EvictionPolicy = check_policy(eviction)
        self._owner = owner
        self._clock = clock
        self._root = TreeNode(0, None, [])
        self._next_id = 1
        # Nodes on the device with no child on the device (locked or not).
        self._device_leaves: set[TreeNode] = set()
        # Nodes on the host, not on the device, without children (protected or not).
        self._host_leaves: set[TreeNode] = set()
        # The unlocked device leaves and unprotected host leaves, in eviction order.
        self._device_queue = EvictionQueue(self._policy)
        self._host_queue = EvictionQueue(self._policy)
        self._nodes = 0
        self._device_pages = 0
        self._host_pages = 0
        self._storage_pages = 0
        self._locked = 0
        self._protected = 0
        self._evictable_device = 0
        self._evictable_host = 0

    @property
    def root(self) -> TreeNode:
        """The root: no keys, no pages, counts as on the device for prefix closure."""
        return self._root

    @property
    def eviction(self) -> EvictionPolicy:
        """The eviction policy applied after priority."""
        return self._policy

    def __repr__(self) -> str:
        return (
            f"RadixTree(eviction={self._policy!r}, nodes={self._nodes}, "
            f"device_pages={self._device_pages}, host_pages={self._host_pages}, "
            f"storage_pages={self._storage_pages}, locked_nodes={self._locked}, "
            f"protected_nodes={self._protected})"
        )

    # -- lookup -------------------------------------------------------------------------------

    def match(self, keys: Sequence[bytes], *, touch: bool = True) -> MatchResult:
        """Find the cached prefix of `keys`: its device prefix and the host-only run after it.

        A node the query ends or diverges inside is split so the result ends on a node
        boundary. With `touch`, every matched node gets a hit and a fresh access time.
        """
        if self._owner is not None:
            self._owner.check()
        query = list(keys)
        n = len(query)
        node = self._root
        device_pages: list[int] = []
        host_pages: list[int] = []
        device_node = node
        host_node: TreeNode | None = None
        path: list[TreeNode] = []
        i = 0
        while i < n:
            child = node.children.get(query[i])
            if child is None:
                break
            end = i + len(child.keys)
            partial = query[i:end] != child.keys
            if partial:
                k = _common_prefix(child.keys, query, i)
                child = self._split(child, k)
                end = i + k
            if child.device_pages is not None and host_node is None:
                device_pages += child.device_pages
                device_node = child
            elif child.host_pages is not None and child.device_pages is None:
                host_pages += child.host_pages
                host_node = child
            else:
                break
            path.append(child)
            node = child
            i = end
            if partial:
                break
        if touch and path:
            now = self._clock()
            for visited in path:
                visited.hit_count += 1
                visited.last_access = now
                self._requeue(visited)
        return MatchResult(
            keys=query,
            device_pages=device_pages,
            device_node=device_node,
            host_pages=host_pages,
            host_node=device_node if host_node is None else host_node,
        )

    def descend(self, node: TreeNode, keys: Sequence[bytes]) -> TreeNode | None:
        """The node ending `keys` read on from `node`, or None if they are not all cached.

        `keys` continue the prefix that ends at `node`; a node they end inside is split so
        the result ends on a node boundary, as `match` does. Costs O(len(keys)) however deep
        `node` is, so a caller extending a prefix step by step that holds on to `node` (a
        protected node stays in the tree) does not match the whole prefix again each step.
        Every node in the tree is cached (on the device or the host), so reaching the end
        of `keys` means all of them are. Touches nothing.
        """
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        query = keys if isinstance(keys, list) else list(keys)
        n = len(query)
        i = 0
        while i < n:
            child = node.children.get(query[i])
            if child is None:
                return None
            end = i + len(child.keys)
            if end > n or query[i:end] != child.keys:
                k = _common_prefix(child.keys, query, i)
                if i + k < n:
                    return None  # they part inside this node
                child = self._split(child, k)
                end = n
            node = child
            i = end
        return node

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children (a snapshot of each child list)."""
        if self._owner is not None:
            self._owner.check()
        return self._walk()

    def _walk(self) -> Iterator[TreeNode]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    # -- insertion ----------------------------------------------------------------------------

    def insert(
        self,
        keys: Sequence[bytes],
        device_pages: Sequence[int] | None = None,
        host_pages: Sequence[int] | None = None,
        *,
        priority: int = 0,
        under: TreeNode | None = None,
    ) -> InsertResult:
        """Record that `keys` have pages on the device and/or the host.

        Along the existing path, a node lacking a tier the caller gave pages for takes them
        (re-promotion after eviction); a node that already has that tier keeps its own pages
        and the caller's pages for the span come back as duplicates. The unmatched rest
        becomes a new node. Every node on the path gets `max(priority, its own)`.

        With `under`, `keys` continue the prefix that ends at that node (for landing pages
        that extend a cached prefix without restating it); device pages then need `under`
        on the device.
        """
        if self._owner is not None:
            self._owner.check()
        start = self._root if under is None else under
        self._check_node(start)
        if device_pages is not None and start.parent is not None and start.device_pages is None:
            raise ValueError(f"device pages cannot go under {start!r}: it is not on the device")
        query = list(keys)
        n = len(query)
        device = None if device_pages is None else list(device_pages)
        host = None if host_pages is None else list(host_pages)
        if device is None and host is None:
            raise ValueError("insert needs device_pages, host_pages or both")
        for name, pages in (("device_pages", device), ("host_pages", host)):
            if pages is not None and len(pages) != n:
                raise ValueError(f"{name} has {len(pages)} pages for {n} keys")
        dup_device: list[int] = []
        dup_host: list[int] = []
        now = self._clock()
        node = start
        i = 0
        while i < n:
            child = node.children.get(query[i])
            if child is None:
                fresh = TreeNode(
                    self._next_id,
                    node,
                    query[i:],
                    device_pages=None if device is None else device[i:],
                    host_pages=None if host is None else host[i:],
                    priority=priority,
                    last_access=now,
                )
                self._next_id += 1
                self._attach(node, fresh)
                node = fresh
                break
            end = i + len(child.keys)
            if query[i:end] != child.keys:
                k = _common_prefix(child.keys, query, i)
                child = self._split(child, k)
                end = i + k
            child.priority = max(child.priority, priority)
            child.last_access = now
            self._requeue(child)
            if device is not None:
                if child.device_pages is None:
                    self._set_device(child, device[i:end])
                else:
                    _new_duplicates(device[i:end], child.device_pages, dup_device)
            if host is not None:
                if child.host_pages is None:
                    self._set_host(child, host[i:end])
                else:
                    _new_duplicates(host[i:end], child.host_pages, dup_host)
            node = child
            i = end
        return InsertResult(
            node=node, duplicate_device_pages=dup_device, duplicate_host_pages=dup_host
        )

    # -- references ---------------------------------------------------------------------------

    def refresh(self, node: TreeNode) -> None:
        """Give `node` and its ancestors a fresh access time, without a hit: an order of use
        for pages loaded ahead of any request (a warmup's)."""
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        now = self._clock()
        while node.parent is not None:
            node.last_access = now
            self._requeue(node)
            node = node.parent

    def raise_priority(self, node: TreeNode, priority: int) -> None:
        """Give `node` and its ancestors at least `priority`, as an insert of their keys with
        it would (a request that found its whole prompt cached inserts nothing)."""
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        while node.parent is not None:
            if node.priority < priority:
                node.priority = priority
                self._requeue(node)
            node = node.parent

    def lock_device(self, node: TreeNode) -> None:
        """Lock `node` and its ancestors on the device (a running request uses them).

        Locking the root does nothing, so a miss's `device_node` can be locked unconditionally.
        """
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        if node.parent is not None and node.device_pages is None:
            raise ValueError(f"cannot lock {node!r}: it is not on the device")
        while node.parent is not None:
            node.lock_ref += 1
            if node.lock_ref == 1:
                self._locked += 1
                self._evictable_device -= len(node.keys)
                self._requeue(node)
            node = node.parent

    def unlock_device(self, node: TreeNode) -> None:
        """Undo one `lock_device(node)`; raises ValueError if `node` holds no lock."""
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        if node.parent is not None and node.lock_ref < 1:
            raise ValueError(f"unlock_device underflow on {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked -= 1
                self._evictable_device += len(node.keys)
                self._requeue(node)
            node = node.parent

    def protect_host(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors for a pending copy or storage operation.

        A protected node keeps its host pages and is never removed from the tree, so a
        pending operation can extend or read it; a protected node that is only on the device
        may still be backed up and then leave the device. Protecting the root does nothing.
        """
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        while node.parent is not None:
            node.host_ref += 1
            if node.host_ref == 1:
                self._protected += 1
                if node.host_pages is not None and node.device_pages is None:
                    self._evictable_host -= len(node.keys)
                self._requeue(node)
            node = node.parent

    def unprotect_host(self, node: TreeNode) -> None:
        """Undo one `protect_host(node)`; raises ValueError if `node` holds no protection."""
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        if node.parent is not None and node.host_ref < 1:
            raise ValueError(f"unprotect_host underflow on {node!r}")
        while node.parent is not None:
            node.host_ref -= 1
            if node.host_ref == 0:
                self._protected -= 1
                if node.host_pages is not None and node.device_pages is None:
                    self._evictable_host += len(node.keys)
                self._requeue(node)
            node = node.parent

    def move_protection(self, node: TreeNode, to: TreeNode) -> None:
        """`protect_host(to)` then `unprotect_host(node)`, for `to` at or below `node`.

        The prefix down to `node` keeps its counts, so this costs the path from `to` up to
        `node`, not to the root: a holder that moves its protection down a long prefix step
        by step pays for each step, not for the whole prefix each time.
        """
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        self._check_node(to)
        if node.parent is not None and node.host_ref < 1:
            raise ValueError(f"unprotect_host underflow on {node!r}")
        path: list[TreeNode] = []
        step = to
        while step is not node:
            if step.parent is None:
                raise ValueError(f"{to!r} is not below {node!r}")
            path.append(step)
            step = step.parent
        for step in path:
            step.host_ref += 1
            if step.host_ref == 1:
                self._protected += 1
                if step.host_pages is not None and step.device_pages is None:
                    self._evictable_host -= len(step.keys)
                self._requeue(step)

    # -- residency ----------------------------------------------------------------------------

    def set_device_pages(self, node: TreeNode, pages: Sequence[int]) -> None:
        """Give a node that is not on the device its device pages (a host → device load).

        The parent must be on the device (or be the root), keeping device residency
        prefix-closed.
        """
        if self._owner is not None:
            self._owner.check()
        parent = self._check_target(node, pages)
        if node.device_pages is not None:
            raise ValueError(f"{node!r} is already on the device")
        if parent.parent is not None and parent.device_pages is None:
            raise ValueError(f"the parent of {node!r} is not on the device")
        self._set_device(node, list(pages))

    def set_host_pages(self, node: TreeNode, pages: Sequence[int]) -> None:
        """Give a node that is not on the host its host pages (a device → host backup)."""
        if self._owner is not None:
            self._owner.check()
        self._check_target(node, pages)
        if node.host_pages is not None:
            raise ValueError(f"{node!r} is already on the host")
        self._set_host(node, list(pages))

    def clear_host_pages(self, node: TreeNode) -> list[int]:
        """Drop the host copy of a node that is also on the device; return its host pages.

        A host-only node leaves through `evict_host` instead, and protected pages stay.
        """
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        pages = node.host_pages
        if pages is None:
            raise ValueError(f"{node!r} is not on the host")
        if node.device_pages is None:
            raise ValueError(f"{node!r} is only on the host; evict_host removes such nodes")
        if node.host_ref > 0:
            raise ValueError(f"{node!r} is protected on the host")
        self._set_host(node, None)
        return pages

    def mark_in_storage(self, node: TreeNode, value: bool = True) -> None:
        """Record whether the storage backend holds every page of `node`."""
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        if node.parent is None:
            raise ValueError("the root has no pages")
        if node.in_storage != value:
            self._storage_pages += len(node.keys) if value else -len(node.keys)
            node.in_storage = value

    # -- eviction -----------------------------------------------------------------------------

    def evict_device(
        self, num_pages: int, *, backup_first: bool, backed_only: bool = False
    ) -> DeviceEviction:
        """Free at least `num_pages` device pages if that many can go; return them.

        Victims are unlocked device leaves, lowest priority first, then by the policy. A
        victim with a host copy just leaves the device. One without is removed from the tree
        when it has no children, is not protected and `backup_first` is false; otherwise it
        is reported in `needs_backup` and kept. With `backup_first`, the pages reported in
        `needs_backup` count toward `num_pages` (once backed up they can leave), so a small
        request asks for about as many pages to be backed up as it needs, not the whole
        device.

        With `backed_only`, only victims with a host copy leave; the others stay, unreported,
        and at most `_BACKED_ONLY_SKIPS` of them are passed over (a fallback for when no
        backup can start: it keeps what has no other copy while some page has one).

        The candidates stay ordered between calls, so a call costs O(log n) per victim, not
        O(n) in the number of candidates.
        """
        if self._owner is not None:
            self._owner.check()
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        freed: list[int] = []
        needs_backup: list[TreeNode] = []
        if num_pages == 0:
            return DeviceEviction(freed=freed, needs_backup=needs_backup)
        queue = self._device_queue
        pending = 0  # pages of needs_backup that count toward num_pages
        passed: list[TreeNode] = []  # unbacked victims a `backed_only` call leaves alone
        while len(freed) + pending < num_pages:
            victim = queue.pop()
            if victim is None:
                break
            pages = victim.device_pages
            parent = victim.parent
            if pages is None or parent is None:  # cannot happen: candidates stay on device
                raise AssertionError(f"eviction candidate {victim!r} left the device")
            if victim.host_pages is not None:
                self._set_device(victim, None)
            elif backed_only:
                passed.append(victim)
                if len(passed) >= _BACKED_ONLY_SKIPS:
                    break
                continue
            elif backup_first or victim.children or victim.host_ref:
                needs_backup.append(victim)
                if backup_first:
                    pending += len(pages)
                continue
            else:
                self._remove(victim)
            # Leaving the device made its parent a candidate if it is now an unlocked leaf:
            # _sync queued it, so the loop may take it next.
            freed += pages
        for node in (*needs_backup, *passed):
            queue.update(node, True)  # still a candidate: popping took it out of the queue
        return DeviceEviction(freed=freed, needs_backup=needs_backup)

    def evict_host(self, num_pages: int) -> list[int]:
        """Free at least `num_pages` host pages if that many can go; return them.

        Victims are unprotected, childless nodes that are on the host but not the device,
        lowest priority first, then by the policy; each is removed from the tree. Like device
        eviction, this costs O(log n) per victim, not O(n) in the number of candidates.
        """
        if self._owner is not None:
            self._owner.check()
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        freed: list[int] = []
        if num_pages == 0:
            return freed
        queue = self._host_queue
        while len(freed) < num_pages:
            victim = queue.pop()
            if victim is None:
                break
            pages = victim.host_pages
            parent = victim.parent
            if pages is None or parent is None:  # cannot happen: candidates stay on host
                raise AssertionError(f"eviction candidate {victim!r} left the host")
            self._remove(victim)  # queues its parent if that became an unprotected leaf
            freed += pages
        return freed

    def discard_host_leaf(self, node: TreeNode) -> list[int]:
        """Remove one unprotected, childless, host-only node; return its host pages.

        For dropping pages on purpose (e.g. a rank trimming what the others do not have),
        as opposed to eviction, which picks its own victims.
        """
        if self._owner is not None:
            self._owner.check()
        self._check_node(node)
        if node not in self._host_leaves or node.host_ref != 0:
            raise ValueError(f"{node!r} is not an unprotected host-only leaf")
        pages = node.host_pages
        assert pages is not None
        self._remove(node)
        return pages

    # -- reporting ----------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree; readable from any thread, for a `repr` that never raises."""
        return self._nodes

    def statistics(self) -> TreeStatistics:
        """Counts of nodes, pages per tier, references and evictable pages (O(1))."""
        if self._owner is not None:
            self._owner.check()
        return self._counts()

    def _counts(self) -> TreeStatistics:
        """`statistics()` without the owner's check, for a reader that knows nothing changes
        the tree meanwhile."""
        return TreeStatistics(
            nodes=self._nodes,
            device_pages=self._device_pages,
            host_pages=self._host_pages,
            storage_pages=self._storage_pages,
            locked_nodes=self._locked,
            protected_nodes=self._protected,
            evictable_device_pages=self._evictable_device,
            evictable_host_pages=self._evictable_host,
        )

    def check_invariants(self) -> None:
        """Walk the whole tree; raise AssertionError naming the first broken invariant."""
        if self._owner is not None:
            self._owner.check()
        root = self._root
        if root.parent is not None or root.keys or root.device_pages or root.host_pages:
            raise AssertionError("the root must have no parent, keys or pages")
        if root.lock_ref or root.host_ref or root.in_storage:
            raise AssertionError("the root must hold no references and no storage flag")
        seen_ids = {root.id}
        device_seen: set[int] = set()
        host_seen: set[int] = set()
        device_leaves: set[TreeNode] = set()
        host_leaves: set[TreeNode] = set()
        totals = dict.fromkeys(
            (
                "nodes",
                "device_pages",
                "host_pages",
                "storage_pages",
                "locked_nodes",
                "protected_nodes",
                "evictable_device_pages",
                "evictable_host_pages",
            ),
            0,
        )
        stack = [root]
        while stack:
            parent = stack.pop()
            device_children = 0
            for first, node in parent.children.items():
                stack.append(node)
                where = f"{node!r}"
                if node.parent is not parent:
                    raise AssertionError(f"{where}: parent link does not match its parent")
                if not node.keys or node.keys[0] != first:
                    raise AssertionError(f"{where}: not keyed by its first key")
                if node.id in seen_ids:
                    raise AssertionError(f"{where}: duplicate node id")
                seen_ids.add(node.id)
                size = len(node.keys)
                on_device = node.device_pages is not None
                on_host = node.host_pages is not None
                if not on_device and not on_host:
                    raise AssertionError(f"{where}: on neither the device nor the host")
                if on_device and parent is not root and parent.device_pages is None:
                    raise AssertionError(f"{where}: on the device but its parent is not")
                for tier, pages, seen in (
                    ("device", node.device_pages, device_seen),
                    ("host", node.host_pages, host_seen),
                ):
                    if pages is None:
                        continue
                    if len(pages) != size:
                        raise AssertionError(f"{where}: {len(pages)} {tier} pages for {size} keys")
                    for page in pages:
                        if page in seen:
                            raise AssertionError(f"{where}: {tier} page {page} appears twice")
                        seen.add(page)
                if node.lock_ref < 0 or node.host_ref < 0:
                    raise AssertionError(f"{where}: negative reference count")
                if parent is not root and (
                    node.lock_ref > parent.lock_ref or node.host_ref > parent.host_ref
                ):
                    raise AssertionError(f"{where}: holds more references than its parent")
                if node.lock_ref and not on_device:
                    raise AssertionError(f"{where}: locked but not on the device")
                if on_device:
                    device_children += 1
                    if node.num_device_children == 0:
                        device_leaves.add(node)
                if on_host and not on_device and not node.children:
                    host_leaves.add(node)
                totals["nodes"] += 1
                totals["device_pages"] += size if on_device else 0
                totals["host_pages"] += size if on_host else 0
                totals["storage_pages"] += size if node.in_storage else 0
                totals["locked_nodes"] += 1 if node.lock_ref else 0
                totals["protected_nodes"] += 1 if node.host_ref else 0
                if on_device and not node.lock_ref:
                    totals["evictable_device_pages"] += size
                if on_host and not on_device and not node.host_ref:
                    totals["evictable_host_pages"] += size
            if parent.num_device_children != device_children:
                raise AssertionError(
                    f"{parent!r}: counts {parent.num_device_children} device children, "
                    f"has {device_children}"
                )
        if max(seen_ids) >= self._next_id:
            raise AssertionError(f"node id {max(seen_ids)} was never handed out")
        if device_leaves != self._device_leaves:
            raise AssertionError("the device-leaf set is out of date")
        if host_leaves != self._host_leaves:
            raise AssertionError("the host-leaf set is out of date")
        kept = _as_dict(self.statistics())
        for name, value in totals.items():
            if kept[name] != value:
                raise AssertionError(f"statistics.{name} is {kept[name]}, the tree has {value}")
        self._device_queue.check(n for n in device_leaves if n.lock_ref == 0)
        self._host_queue.check(n for n in host_leaves if n.host_ref == 0)

    # -- internals ----------------------------------------------------------------------------

    def _check_node(self, node: TreeNode) -> None:
        if node.parent is None and node is not self._root:
            raise ValueError(f"{node!r} is not in the tree (it was removed)")

    def _check_target(self, node: TreeNode, pages: Sequence[int]) -> TreeNode:
        self._check_node(node)
        parent = node.parent
        if parent is None:
            raise ValueError("the root has no pages")
        if len(pages) != len(node.keys):
            raise ValueError(f"{len(pages)} pages for a node of {len(node.keys)} pages")
        return parent

    def _account(self, node: TreeNode, sign: int) -> None:
        """Add (sign=1) or take away (sign=-1) the node's share of every counter."""
        size = sign * len(node.keys)
        on_device = node.device_pages is not None
        self._nodes += sign
        if on_device:
            self._device_pages += size
            if node.lock_ref == 0:
                self._evictable_device += size
        if node.host_pages is not None:
            self._host_pages += size
            if not on_device and node.host_ref == 0:
                self._evictable_host += size
        if node.in_storage:
            self._storage_pages += size
        if node.lock_ref:
            self._locked += sign
        if node.host_ref:
            self._protected += sign

    def _sync(self, node: TreeNode) -> None:
        """Bring the node's membership of the leaf sets and eviction queues up to date."""
        if node.device_pages is not None and node.num_device_children == 0:
            self._device_leaves.add(node)
            self._device_queue.update(node, node.lock_ref == 0)
        else:
            self._device_leaves.discard(node)
            self._device_queue.update(node, False)
        if node.host_pages is not None and node.device_pages is None and not node.children:
            self._host_leaves.add(node)
            self._host_queue.update(node, node.host_ref == 0)
        else:
            self._host_leaves.discard(node)
            self._host_queue.update(node, False)

    def _requeue(self, node: TreeNode) -> None:
        """Bring the queues up to date after the node's key or references changed (its leaf
        set memberships did not)."""
        if node in self._device_leaves:
            self._device_queue.update(node, node.lock_ref == 0)
        if node in self._host_leaves:
            self._host_queue.update(node, node.host_ref == 0)

    def _set_device(self, node: TreeNode, pages: list[int] | None) -> None:
        parent = node.parent
        if parent is None:
            raise AssertionError("the root has no pages")
        was_on = node.device_pages is not None
        self._account(node, -1)
        node.device_pages = pages
        self._account(node, 1)
        if was_on != (pages is not None):
            parent.num_device_children += 1 if pages is not None else -1
            self._sync(parent)
        self._sync(node)

    def _set_host(self, node: TreeNode, pages: list[int] | None) -> None:
        self._account(node, -1)
        node.host_pages = pages
        self._account(node, 1)
        self._sync(node)

    def _attach(self, parent: TreeNode, node: TreeNode) -> None:
        parent.children[node.keys[0]] = node
        if node.device_pages is not None:
            parent.num_device_children += 1
        self._account(node, 1)
        self._sync(node)
        self._sync(parent)

    def _remove(self, node: TreeNode) -> None:
        """Detach a childless node; its pages go back to the caller."""
        parent = node.parent
        if parent is None or node.children or node.lock_ref or node.host_ref:
            raise AssertionError(f"cannot remove {node!r}")
        self._account(node, -1)
        del parent.children[node.keys[0]]
        if node.device_pages is not None:
            parent.num_device_children -= 1
        node.parent = None
        node.device_pages = None
        node.host_pages = None
        self._sync(node)
        self._sync(parent)

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Split `node` after `k` keys; the new node is the prefix, `node` keeps the suffix."""
        parent = node.parent
        if parent is None or not 0 < k < len(node.keys):
            raise AssertionError(f"cannot split {node!r} at {k}")
        self._account(node, -1)
        device = node.device_pages
        host = node.host_pages
        head = TreeNode(
            self._next_id,
            parent,
            node.keys[:k],
            device_pages=None if device is None else device[:k],
            host_pages=None if host is None else host[:k],
            priority=node.priority,
            last_access=node.last_access,
        )
        self._next_id += 1
        head.in_storage = node.in_storage
        head.lock_ref = node.lock_ref
        head.host_ref = node.host_ref
        head.hit_count = node.hit_count
        node.keys = node.keys[k:]
        if device is not None:
            node.device_pages = device[k:]
            head.num_device_children = 1
        if host is not None:
            node.host_pages = host[k:]
        head.children[node.keys[0]] = node
        parent.children[head.keys[0]] = head
        node.parent = head
        self._account(node, 1)
        self._account(head, 1)
        self._sync(head)
        return head


def _as_dict(stats: TreeStatistics) -> dict[str, int]:
    return {name: getattr(stats, name) for name in stats.__struct_fields__}
