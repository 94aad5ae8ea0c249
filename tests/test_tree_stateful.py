"""The radix tree against a page-by-page reference model, driven by hypothesis; every
eviction is also checked against a brute-force recomputation of the eviction order.

The model maps every cached prefix (a tuple of tokens, one token per page) to its device page,
host page, lock count and protection count. Keys are one repeated byte per token, so equal keys
appear under different prefixes and the tree must compare by position, not by key alone.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hicache_async._config import EvictionPolicy
from hicache_async.tree import RadixTree, TreeNode

DEVICE_PAGES = 24
HOST_PAGES = 32
ALPHABET = 3

Prefix = tuple[int, ...]
sequences = st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=6).map(tuple)


def keys_of(tokens: Prefix) -> list[bytes]:
    return [bytes([t]) * 32 for t in tokens]


def prefix_of(node: TreeNode) -> Prefix:
    runs: list[list[bytes]] = []
    while node.parent is not None:
        runs.append(node.keys)
        node = node.parent
    return tuple(key[0] for run in reversed(runs) for key in run)


@dataclass
class Entry:
    device: int | None = None
    host: int | None = None
    locks: int = 0
    protections: int = 0


def eviction_key(tree: RadixTree, node: TreeNode) -> tuple[int, int, float, int]:
    """The documented eviction order: priority, then LFU hits (LRU: none), age, node id."""
    hits = node.hit_count if tree.eviction == "lfu" else 0
    return (node.priority, hits, node.last_access, node.id)


def brute_force_device_eviction(
    tree: RadixTree, num_pages: int, backup_first: bool
) -> tuple[list[int], list[int]]:
    """What `evict_device` must free and report (node ids), recomputing every candidate from
    the whole tree before each pick. Call it before the eviction: it only reads the tree."""
    nodes = {n.id: n for n in tree.iter_nodes()}
    children = {i: {c.id for c in n.children.values()} for i, n in nodes.items()}
    children[tree.root.id] = {c.id for c in tree.root.children.values()}
    on_device = {i for i, n in nodes.items() if n.on_device}
    freed: list[int] = []
    backup: list[int] = []
    pending = 0
    while num_pages and len(freed) + pending < num_pages:
        candidates = [
            i
            for i in on_device
            if i not in backup and nodes[i].lock_ref == 0 and not children[i] & on_device
        ]
        if not candidates:
            break
        victim = nodes[min(candidates, key=lambda i: eviction_key(tree, nodes[i]))]
        assert victim.device_pages is not None
        assert victim.parent is not None
        if victim.on_host:
            on_device.discard(victim.id)
        elif backup_first or children[victim.id] or victim.host_ref:
            backup.append(victim.id)
            pending += victim.num_pages if backup_first else 0
            continue
        else:
            on_device.discard(victim.id)
            children[victim.parent.id].discard(victim.id)
        freed += victim.device_pages
    return freed, backup


def brute_force_host_eviction(tree: RadixTree, num_pages: int) -> list[int]:
    """What `evict_host` must free, recomputing every candidate before each pick."""
    nodes = {n.id: n for n in tree.iter_nodes()}
    children = {i: {c.id for c in n.children.values()} for i, n in nodes.items()}
    children[tree.root.id] = {c.id for c in tree.root.children.values()}
    left = set(nodes)
    freed: list[int] = []
    while len(freed) < num_pages:
        candidates = [
            i
            for i in left
            if nodes[i].on_host
            and not nodes[i].on_device
            and not children[i]
            and nodes[i].host_ref == 0
        ]
        if not candidates:
            break
        victim = nodes[min(candidates, key=lambda i: eviction_key(tree, nodes[i]))]
        assert victim.host_pages is not None
        assert victim.parent is not None
        left.discard(victim.id)
        children[victim.parent.id].discard(victim.id)
        freed += victim.host_pages
    return freed


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        ticks = itertools.count()
        self.tree = RadixTree(clock=lambda: float(next(ticks)))
        self.model: dict[Prefix, Entry] = {}
        self.free_device = set(range(DEVICE_PAGES))
        self.free_host = set(range(HOST_PAGES))
        self.locks: list[tuple[TreeNode, Prefix]] = []
        self.protections: list[tuple[TreeNode, Prefix]] = []

    @initialize(policy=st.sampled_from(["lru", "lfu"]))
    def choose_policy(self, policy: EvictionPolicy) -> None:
        ticks = itertools.count()
        self.tree = RadixTree(eviction=policy, clock=lambda: float(next(ticks)))

    # -- helpers ------------------------------------------------------------------------------

    def children_of(self, prefix: Prefix) -> list[Entry]:
        size = len(prefix) + 1
        return [e for p, e in self.model.items() if len(p) == size and p[:-1] == prefix]

    def take(self, free: set[int], count: int) -> list[int]:
        pages = sorted(free)[:count]
        free.difference_update(pages)
        return pages

    def expected_match(self, seq: Prefix) -> tuple[list[int], list[int]]:
        device: list[int] = []
        host: list[int] = []
        for i in range(1, len(seq) + 1):
            entry = self.model.get(seq[:i])
            if entry is None:
                break
            if entry.device is not None and not host:
                device.append(entry.device)
            elif entry.device is None and entry.host is not None:
                host.append(entry.host)
            else:
                break
        return device, host

    def nodes(self) -> list[TreeNode]:
        return sorted(self.tree.iter_nodes(), key=lambda n: n.id)

    # -- rules --------------------------------------------------------------------------------

    @rule(
        seq=sequences,
        tiers=st.sampled_from(["device", "host", "both"]),
        priority=st.integers(0, 2),
        hold=st.booleans(),
    )
    def insert(self, seq: Prefix, tiers: str, priority: int, hold: bool) -> None:
        """Insert fresh pages; with `hold`, keep the device pages locked like a running request."""
        n = len(seq)
        want_device = tiers in ("device", "both")
        want_host = tiers in ("host", "both")
        if (want_device and len(self.free_device) < n) or (want_host and len(self.free_host) < n):
            return
        device = self.take(self.free_device, n) if want_device else None
        host = self.take(self.free_host, n) if want_host else None
        result = self.tree.insert(keys_of(seq), device, host, priority=priority)

        dup_device: list[int] = []
        dup_host: list[int] = []
        for i in range(n):
            entry = self.model.setdefault(seq[: i + 1], Entry())
            if device is not None:
                if entry.device is None:
                    entry.device = device[i]
                else:
                    dup_device.append(device[i])
            if host is not None:
                if entry.host is None:
                    entry.host = host[i]
                else:
                    dup_host.append(host[i])
        assert result.duplicate_device_pages == dup_device
        assert result.duplicate_host_pages == dup_host
        assert prefix_of(result.node) == seq
        self.free_device.update(dup_device)
        self.free_host.update(dup_host)
        if hold and device is not None:
            self.tree.lock_device(result.node)
            for i in range(1, n + 1):
                self.model[seq[:i]].locks += 1
            self.locks.append((result.node, seq))

    @rule(head=sequences, tail=sequences, tiers=st.sampled_from(["device", "host"]))
    def insert_under(self, head: Prefix, tail: Prefix, tiers: str) -> None:
        """Land pages right after the cached part of `head`, as a storage prefetch does."""
        found = self.tree.match(keys_of(head), touch=False)
        base = head[: found.num_device_pages + found.num_host_pages]
        anchor = found.host_node
        free = self.free_device if tiers == "device" else self.free_host
        if len(free) < len(tail):
            return
        if tiers == "device" and anchor is not self.tree.root and not anchor.on_device:
            with pytest.raises(ValueError, match="not on the device"):
                self.tree.insert(keys_of(tail), device_pages=[0] * len(tail), under=anchor)
            return
        pages = self.take(free, len(tail))
        if tiers == "device":
            result = self.tree.insert(keys_of(tail), device_pages=pages, under=anchor)
        else:
            result = self.tree.insert(keys_of(tail), host_pages=pages, under=anchor)
        duplicates: list[int] = []
        for i, page in enumerate(pages):
            entry = self.model.setdefault(base + tail[: i + 1], Entry())
            if tiers == "device":
                if entry.device is None:
                    entry.device = page
                else:
                    duplicates.append(page)
            elif entry.host is None:
                entry.host = page
            else:
                duplicates.append(page)
        found_duplicates = (
            result.duplicate_device_pages if tiers == "device" else result.duplicate_host_pages
        )
        assert found_duplicates == duplicates
        assert prefix_of(result.node) == base + tail
        free.update(duplicates)

    @rule(seq=sequences, touch=st.booleans())
    def match(self, seq: Prefix, touch: bool) -> None:
        result = self.tree.match(keys_of(seq), touch=touch)
        device, host = self.expected_match(seq)
        assert result.device_pages == device
        assert result.host_pages == host
        assert prefix_of(result.device_node) == seq[: len(device)]
        assert prefix_of(result.host_node) == seq[: len(device) + len(host)]
        assert result.storage_keys == keys_of(seq[len(device) + len(host) :])

    @rule(seq=sequences)
    def lock(self, seq: Prefix) -> None:
        result = self.tree.match(keys_of(seq))
        if result.device_node is self.tree.root:
            return
        self.tree.lock_device(result.device_node)
        prefix = seq[: result.num_device_pages]
        for i in range(1, len(prefix) + 1):
            self.model[prefix[:i]].locks += 1
        self.locks.append((result.device_node, prefix))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, prefix = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock_device(node)
        for i in range(1, len(prefix) + 1):
            self.model[prefix[:i]].locks -= 1

    @rule(seq=sequences)
    def protect(self, seq: Prefix) -> None:
        result = self.tree.match(keys_of(seq))
        if result.host_node is self.tree.root:
            return
        self.tree.protect_host(result.host_node)
        prefix = seq[: result.num_device_pages + result.num_host_pages]
        for i in range(1, len(prefix) + 1):
            self.model[prefix[:i]].protections += 1
        self.protections.append((result.host_node, prefix))

    @precondition(lambda self: self.protections)
    @rule(data=st.data())
    def unprotect(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.protections) - 1))
        node, prefix = self.protections.pop(index)
        self.tree.unprotect_host(node)
        for i in range(1, len(prefix) + 1):
            self.model[prefix[:i]].protections -= 1

    def expected_descent(self, base: Prefix, tail: Prefix) -> bool:
        return all(base + tail[: i + 1] in self.model for i in range(len(tail)))

    def draw_tail(self, data: st.DataObject, base: Prefix) -> Prefix:
        """A cached continuation of `base` (possibly ending inside a node) or random tokens."""
        cached = sorted(p[len(base) :] for p in self.model if p[: len(base)] == base)
        random_tail = st.lists(st.integers(0, ALPHABET - 1), max_size=4).map(tuple)
        if not cached:
            return data.draw(random_tail)
        return data.draw(st.one_of(st.sampled_from(cached), random_tail))

    @rule(data=st.data())
    def descend(self, data: st.DataObject) -> None:
        """Read on from a held node (or the root), as a prefetch extends its prefix."""
        held = [(self.tree.root, ()), *self.protections, *self.locks]
        node, base = held[data.draw(st.integers(0, len(held) - 1))]
        tail = self.draw_tail(data, base)
        reached = self.tree.descend(node, keys_of(tail))
        if self.expected_descent(base, tail):
            assert reached is not None
            assert prefix_of(reached) == base + tail
        else:
            assert reached is None

    @precondition(lambda self: self.protections)
    @rule(data=st.data())
    def move_protection(self, data: st.DataObject) -> None:
        """Move a protection down to a cached node below it, as a prefetch lands pages."""
        index = data.draw(st.integers(0, len(self.protections) - 1))
        node, base = self.protections[index]
        tail = self.draw_tail(data, base)
        to = self.tree.descend(node, keys_of(tail))
        if to is None:
            return
        self.tree.move_protection(node, to)
        for i in range(len(tail)):
            self.model[base + tail[: i + 1]].protections += 1
        self.protections[index] = (to, base + tail)

    @precondition(lambda self: self.protections)
    @rule(data=st.data())
    def move_protection_elsewhere(self, data: st.DataObject) -> None:
        """Moving a protection to a node not below it, or from one that holds none, fails
        and changes nothing (the invariants check the counts)."""
        node, base = self.protections[data.draw(st.integers(0, len(self.protections) - 1))]
        others = [n for n in self.nodes() if prefix_of(n)[: len(base)] != base]
        if others:
            with pytest.raises(ValueError, match="is not below"):
                self.tree.move_protection(node, others[0])
        bare = [n for n in self.nodes() if n.host_ref == 0]
        if bare:
            with pytest.raises(ValueError, match="underflow"):
                self.tree.move_protection(bare[0], bare[0])

    @rule(data=st.data())
    def back_up_to_host(self, data: st.DataObject) -> None:
        candidates = [
            n
            for n in self.nodes()
            if n.on_device and not n.on_host and n.num_pages <= len(self.free_host)
        ]
        if not candidates:
            return
        node = data.draw(st.sampled_from(candidates))
        pages = self.take(self.free_host, node.num_pages)
        self.tree.set_host_pages(node, pages)
        start = prefix_of(node)
        for offset, page in enumerate(pages):
            self.model[start[: len(start) - node.num_pages + offset + 1]].host = page

    @rule(data=st.data())
    def load_to_device(self, data: st.DataObject) -> None:
        candidates = [
            n
            for n in self.nodes()
            if not n.on_device
            and n.parent is not None
            and (n.parent is self.tree.root or n.parent.on_device)
            and n.num_pages <= len(self.free_device)
        ]
        if not candidates:
            return
        node = data.draw(st.sampled_from(candidates))
        pages = self.take(self.free_device, node.num_pages)
        self.tree.set_device_pages(node, pages)
        start = prefix_of(node)
        for offset, page in enumerate(pages):
            self.model[start[: len(start) - node.num_pages + offset + 1]].device = page

    @rule(data=st.data())
    def drop_host_copy(self, data: st.DataObject) -> None:
        candidates = [n for n in self.nodes() if n.on_device and n.on_host and n.host_ref == 0]
        if not candidates:
            return
        node = data.draw(st.sampled_from(candidates))
        start = prefix_of(node)
        pages = self.tree.clear_host_pages(node)
        for offset, page in enumerate(pages):
            entry = self.model[start[: len(start) - node.num_pages + offset + 1]]
            assert entry.host == page
            assert entry.protections == 0
            entry.host = None
        self.free_host.update(pages)

    @rule(num_pages=st.integers(0, 12), backup_first=st.booleans())
    def evict_device(self, num_pages: int, backup_first: bool) -> None:
        owner = {e.device: p for p, e in self.model.items() if e.device is not None}
        expected = brute_force_device_eviction(self.tree, num_pages, backup_first)
        eviction = self.tree.evict_device(num_pages, backup_first=backup_first)
        freed = eviction.freed
        assert (freed, [n.id for n in eviction.needs_backup]) == expected
        assert len(set(freed)) == len(freed)
        # Deepest first, so a removed node's own later pages are gone before its earlier ones.
        for prefix in sorted((owner[page] for page in freed), key=len, reverse=True):
            entry = self.model[prefix]
            assert entry.locks == 0, "a locked device page was freed"
            entry.device = None
            if entry.host is None:
                assert not self.children_of(prefix), "a node with children was removed"
                assert entry.protections == 0, "a protected node was removed"
                del self.model[prefix]
        self.free_device.update(freed)
        for node in eviction.needs_backup:
            assert node.on_device
            assert not node.on_host
            assert node.lock_ref == 0
            assert backup_first or node.children or node.host_ref
        # With backup_first, pages waiting for a backup count toward the request.
        pending = sum(n.num_pages for n in eviction.needs_backup) if backup_first else 0
        if len(freed) + pending < num_pages:
            for prefix, entry in self.model.items():
                children = self.children_of(prefix)
                leaf = entry.device is not None and all(c.device is None for c in children)
                removable = entry.host is not None or (
                    not backup_first and not children and entry.protections == 0
                )
                assert not (leaf and entry.locks == 0 and removable), (
                    f"stopped at {len(freed)} + {pending} of {num_pages} pages with {prefix} "
                    "evictable"
                )

    @rule(num_pages=st.integers(0, 12))
    def evict_host(self, num_pages: int) -> None:
        owner = {e.host: p for p, e in self.model.items() if e.host is not None}
        expected = brute_force_host_eviction(self.tree, num_pages)
        freed = self.tree.evict_host(num_pages)
        assert freed == expected
        assert len(set(freed)) == len(freed)
        for page in freed:
            prefix = owner[page]
            entry = self.model.pop(prefix)
            assert entry.device is None, "host eviction took a node on the device"
            assert entry.protections == 0, "a protected host page was freed"
        self.free_host.update(freed)
        if len(freed) < num_pages:
            for prefix, entry in self.model.items():
                assert not (
                    entry.host is not None
                    and entry.device is None
                    and entry.protections == 0
                    and not self.children_of(prefix)
                ), f"stopped at {len(freed)} of {num_pages} pages with {prefix} evictable"

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def tree_invariants_hold(self) -> None:
        self.tree.check_invariants()

    @invariant()
    def tree_agrees_with_model(self) -> None:
        seen: dict[Prefix, Entry] = {}
        for node in self.tree.iter_nodes():
            start = prefix_of(node)
            base = len(start) - node.num_pages
            for offset in range(node.num_pages):
                seen[start[: base + offset + 1]] = Entry(
                    device=None if node.device_pages is None else node.device_pages[offset],
                    host=None if node.host_pages is None else node.host_pages[offset],
                    locks=node.lock_ref,
                    protections=node.host_ref,
                )
        assert seen == self.model

    @invariant()
    def model_is_prefix_closed(self) -> None:
        for prefix, entry in self.model.items():
            if len(prefix) > 1:
                parent = self.model[prefix[:-1]]
                assert entry.device is None or parent.device is not None
                assert parent.locks >= entry.locks
                assert parent.protections >= entry.protections

    @invariant()
    def every_page_is_in_the_tree_or_free(self) -> None:
        device = [e.device for e in self.model.values() if e.device is not None]
        host = [e.host for e in self.model.values() if e.host is not None]
        assert len(device) == len(set(device))
        assert len(host) == len(set(host))
        assert not self.free_device & set(device)
        assert not self.free_host & set(host)
        assert self.free_device | set(device) == set(range(DEVICE_PAGES))
        assert self.free_host | set(host) == set(range(HOST_PAGES))
        stats = self.tree.statistics()
        assert (stats.device_pages, stats.host_pages) == (len(device), len(host))

    def teardown(self) -> None:
        # Releasing everything brings every count back to zero.
        for node, _ in self.locks:
            self.tree.unlock_device(node)
        for node, _ in self.protections:
            self.tree.unprotect_host(node)
        assert all(n.lock_ref == 0 and n.host_ref == 0 for n in self.tree.iter_nodes())
        stats = self.tree.statistics()
        assert (stats.locked_nodes, stats.protected_nodes) == (0, 0)
        # Each round peels at least one tier off the bottom of every branch.
        for _ in range(2 * 6 + 1):
            self.tree.evict_host(HOST_PAGES)
            self.tree.evict_device(DEVICE_PAGES, backup_first=False)
        assert self.tree.statistics().nodes == 0
        self.tree.check_invariants()


TreeMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tree_machine = TreeMachine.TestCase


def _take(free: list[int], count: int) -> list[int] | None:
    if len(free) < count:
        return None
    taken = free[:count]
    del free[:count]
    return taken


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(3))
def test_long_random_sequence_evicts_in_brute_force_order(
    policy: EvictionPolicy, seed: int
) -> None:
    """Thousands of steps without a reset, so stale queue entries from touches, locks and
    priority raises pile up (and get compacted) between evictions, each of which must pick
    exactly what a brute-force recomputation picks."""
    rng = random.Random(seed)
    ticks = itertools.count()
    tree = RadixTree(eviction=policy, clock=lambda: float(next(ticks) // 3))  # some ties
    free_device = list(range(160))
    free_host = list(range(240))
    locks: list[TreeNode] = []
    protections: list[TreeNode] = []
    for step in range(3000):
        if step % 100 == 0:
            tree.check_invariants()  # the queues hold exactly the candidates, keyed right
        seq = tuple(rng.randrange(ALPHABET + 1) for _ in range(rng.randint(1, 8)))
        op = rng.randrange(10)
        if op <= 2:
            tiers = rng.choice(["device", "host", "both"])
            device = _take(free_device, len(seq)) if tiers != "host" else None
            host = _take(free_host, len(seq)) if tiers != "device" else None
            if device is None and host is None:
                continue
            result = tree.insert(keys_of(seq), device, host, priority=rng.randrange(4))
            free_device += result.duplicate_device_pages
            free_host += result.duplicate_host_pages
            if device is not None and rng.random() < 0.3:
                tree.lock_device(result.node)
                locks.append(result.node)
        elif op == 3:
            tree.match(keys_of(seq), touch=rng.random() < 0.8)
        elif op == 4 and locks:
            tree.unlock_device(locks.pop(rng.randrange(len(locks))))
        elif op == 4:
            found = tree.match(keys_of(seq))
            tree.protect_host(found.host_node)
            protections.append(found.host_node)
        elif op == 5 and protections:
            tree.unprotect_host(protections.pop(rng.randrange(len(protections))))
        elif op == 6:
            nodes = [n for n in tree.iter_nodes() if n.on_device != n.on_host]
            if nodes:
                node = rng.choice(sorted(nodes, key=lambda n: n.id))
                parent = node.parent
                assert parent is not None
                if not node.on_host and (pages := _take(free_host, node.num_pages)):
                    tree.set_host_pages(node, pages)
                elif (
                    not node.on_device
                    and (parent is tree.root or parent.on_device)
                    and (pages := _take(free_device, node.num_pages))
                ):
                    tree.set_device_pages(node, pages)
        elif op <= 8:
            num_pages = rng.randrange(1, 12)
            backup_first = rng.random() < 0.5
            expected = brute_force_device_eviction(tree, num_pages, backup_first)
            eviction = tree.evict_device(num_pages, backup_first=backup_first)
            assert (eviction.freed, [n.id for n in eviction.needs_backup]) == expected
            free_device += eviction.freed
        else:
            num_pages = rng.randrange(1, 12)
            expected_host = brute_force_host_eviction(tree, num_pages)
            assert tree.evict_host(num_pages) == expected_host
            free_host += expected_host
    tree.check_invariants()
