from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from hicache_async import WrongThreadError, page_keys
from hicache_async._config import EvictionPolicy
from hicache_async._loop import LoopOwner
from hicache_async.tree import RadixTree, TreeNode


def K(*tokens: int) -> list[bytes]:
    """Chained page keys with one token per page, so shared token prefixes share keys."""
    return page_keys(list(tokens), 1)


class Clock:
    """A clock that advances by one on every reading, so access order is exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make_tree(eviction: EvictionPolicy = "lru") -> RadixTree:
    return RadixTree(eviction=eviction, clock=Clock())


def attached(node: TreeNode) -> bool:
    """Whether the node is still in its tree (a function, so type narrowing stays out of it)."""
    return node.parent is not None


def shape(tree: RadixTree) -> dict[tuple[int, ...], int]:
    """Every node as (its page count along the path) -> its own page count."""
    out: dict[tuple[int, ...], int] = {}

    def visit(node: TreeNode, path: tuple[int, ...]) -> None:
        for child in node.children.values():
            here = (*path, child.num_pages)
            out[here] = child.num_pages
            visit(child, here)

    visit(tree.root, ())
    return out


def test_empty_tree_misses() -> None:
    tree = make_tree()
    result = tree.match(K(1, 2, 3))
    assert result.device_pages == []
    assert result.host_pages == []
    assert result.device_node is tree.root
    assert result.host_node is tree.root
    assert result.storage_keys == K(1, 2, 3)
    assert tree.statistics().nodes == 0


def test_match_splits_inside_a_node() -> None:
    tree = make_tree()
    tree.insert(K(1, 2, 3, 4), device_pages=[10, 11, 12, 13])
    result = tree.match(K(1, 2))
    assert result.device_pages == [10, 11]
    assert result.device_node.keys == K(1, 2)
    assert result.device_node.children[K(1, 2, 3)[2]].device_pages == [12, 13]
    assert tree.statistics().nodes == 2
    tree.check_invariants()

    full = tree.match(K(1, 2, 3, 4, 5))
    assert full.device_pages == [10, 11, 12, 13]
    assert full.storage_keys == K(1, 2, 3, 4, 5)[4:]
    assert full.num_device_pages == 4
    assert full.num_host_pages == 0


def test_match_splits_on_divergence() -> None:
    tree = make_tree()
    tree.insert(K(1, 2, 3, 4), device_pages=[0, 1, 2, 3])
    result = tree.match(K(1, 2, 9))
    assert result.device_pages == [0, 1]
    assert result.storage_keys == K(1, 2, 9)[2:]
    assert shape(tree) == {(2,): 2, (2, 2): 2}
    tree.check_invariants()


def test_touch_updates_hits_and_access_time() -> None:
    tree = make_tree()
    node = tree.insert(K(1, 2), device_pages=[0, 1]).node
    before = node.last_access
    tree.match(K(1, 2), touch=False)
    assert node.hit_count == 0
    assert node.last_access == before
    tree.match(K(1, 2))
    tree.match(K(1, 2))
    assert node.hit_count == 2
    assert node.last_access > before


def test_insert_diverging_returns_duplicates_for_the_shared_prefix() -> None:
    tree = make_tree()
    tree.insert(K(1, 2, 3, 4), device_pages=[0, 1, 2, 3])
    result = tree.insert(K(1, 2, 7, 8), device_pages=[4, 5, 6, 7])
    assert result.duplicate_device_pages == [4, 5]
    assert result.duplicate_host_pages == []
    assert result.node.keys == K(1, 2, 7, 8)[2:]
    assert result.node.device_pages == [6, 7]
    assert shape(tree) == {(2,): 2, (2, 2): 2}
    assert tree.match(K(1, 2, 7, 8)).device_pages == [0, 1, 6, 7]
    assert tree.statistics().device_pages == 6
    tree.check_invariants()


def test_insert_ending_inside_a_node_splits_it() -> None:
    tree = make_tree()
    tree.insert(K(1, 2, 3), device_pages=[0, 1, 2])
    result = tree.insert(K(1, 2), device_pages=[5, 6])
    assert result.duplicate_device_pages == [5, 6]
    assert result.node.keys == K(1, 2)
    assert result.node.device_pages == [0, 1]
    tree.check_invariants()


def test_reinserting_the_trees_own_pages_is_not_a_duplicate() -> None:
    tree = make_tree()
    tree.insert(K(1, 2), device_pages=[0, 1])
    result = tree.insert(K(1, 2, 3), device_pages=[0, 1, 9])
    assert result.duplicate_device_pages == []
    partly = tree.insert(K(1, 2, 3), device_pages=[0, 7, 9])
    assert partly.duplicate_device_pages == [7]
    assert tree.match(K(1, 2, 3)).device_pages == [0, 1, 9]


def test_host_insert_extends_past_the_device_prefix() -> None:
    tree = make_tree()
    tree.insert(K(1, 2), device_pages=[0, 1])
    result = tree.insert(K(1, 2, 3, 4), host_pages=[5, 6, 7, 8])
    # The device node lacked a host copy, so it takes the caller's host pages.
    assert result.duplicate_host_pages == []
    match = tree.match(K(1, 2, 3, 4, 5))
    assert match.device_pages == [0, 1]
    assert match.host_pages == [7, 8]
    assert match.host_node is result.node
    assert match.device_node.host_pages == [5, 6]
    assert match.storage_keys == K(1, 2, 3, 4, 5)[4:]
    stats = tree.statistics()
    assert (stats.device_pages, stats.host_pages) == (2, 4)
    tree.check_invariants()


def test_device_insert_repromotes_an_evicted_node() -> None:
    tree = make_tree()
    node = tree.insert(K(1, 2, 3), device_pages=[0, 1, 2], host_pages=[10, 11, 12]).node
    eviction = tree.evict_device(3, backup_first=True)
    assert sorted(eviction.freed) == [0, 1, 2]
    assert not node.on_device
    assert tree.match(K(1, 2, 3)).host_pages == [10, 11, 12]

    result = tree.insert(K(1, 2, 3), device_pages=[5, 6, 7], host_pages=[20, 21, 22])
    assert result.duplicate_device_pages == []
    assert result.duplicate_host_pages == [20, 21, 22]
    assert result.node is node
    assert node.device_pages == [5, 6, 7]
    assert tree.match(K(1, 2, 3)).device_pages == [5, 6, 7]
    tree.check_invariants()


def test_insert_rejects_bad_arguments_without_changing_anything() -> None:
    tree = make_tree()
    tree.insert(K(1, 2), device_pages=[0, 1])
    before = tree.statistics()
    with pytest.raises(ValueError, match="device_pages, host_pages"):
        tree.insert(K(1, 2, 3))
    with pytest.raises(ValueError, match="device_pages has 2 pages for 3 keys"):
        tree.insert(K(1, 2, 3), device_pages=[0, 1])
    with pytest.raises(ValueError, match="host_pages has 4 pages"):
        tree.insert(K(1, 5, 6), device_pages=[7, 8, 9], host_pages=[1, 2, 3, 4])
    assert tree.statistics() == before
    assert shape(tree) == {(2,): 2}


def test_priority_is_the_maximum_along_the_path() -> None:
    tree = make_tree()
    tree.insert(K(1, 2, 3), device_pages=[0, 1, 2], priority=5)
    node = tree.insert(K(1, 2), device_pages=[7, 8], priority=1).node
    assert node.priority == 5
    tree.insert(K(1, 2), device_pages=[7, 8], priority=9)
    assert node.priority == 9
    assert node.children[K(1, 2, 3)[2]].priority == 5


def test_lock_covers_ancestors_and_blocks_eviction() -> None:
    tree = make_tree()
    tree.insert(K(1, 2), device_pages=[0, 1])
    leaf = tree.insert(K(1, 2, 3, 4), device_pages=[0, 1, 2, 3]).node
    parent = leaf.parent
    assert parent is not None
    tree.lock_device(leaf)
    assert (leaf.lock_ref, parent.lock_ref, tree.root.lock_ref) == (1, 1, 0)
    stats = tree.statistics()
    assert (stats.locked_nodes, stats.evictable_device_pages) == (2, 0)
    assert tree.evict_device(4, backup_first=False).freed == []

    tree.unlock_device(leaf)
    assert tree.statistics().evictable_device_pages == 4
    assert sorted(tree.evict_device(4, backup_first=False).freed) == [0, 1, 2, 3]
    tree.check_invariants()


def test_lock_errors() -> None:
    tree = make_tree()
    node = tree.insert(K(1, 2), host_pages=[0, 1]).node
    with pytest.raises(ValueError, match="not on the device"):
        tree.lock_device(node)
    device = tree.insert(K(3), device_pages=[0]).node
    with pytest.raises(ValueError, match="underflow"):
        tree.unlock_device(device)
    with pytest.raises(ValueError, match="underflow"):
        tree.unprotect_host(node)
    tree.lock_device(tree.root)
    tree.unlock_device(tree.root)
    assert tree.root.lock_ref == 0


def test_references_survive_a_split() -> None:
    tree = make_tree()
    tree.insert(K(1, 2, 3, 4, 5, 6), device_pages=[0, 1, 2, 3, 4, 5], host_pages=[0, 1, 2, 3, 4, 5])
    deep = tree.match(K(1, 2, 3, 4, 5, 6)).device_node
    tree.lock_device(deep)
    tree.protect_host(deep)
    tree.insert(K(1, 2, 3, 9), device_pages=[6, 7, 8, 9])
    tree.insert(K(1, 10), device_pages=[6, 10])
    # The original object kept the suffix and the new prefixes copied its references.
    assert deep.keys == K(1, 2, 3, 4, 5, 6)[3:]
    heads = [n for n in tree.iter_nodes() if n is not deep and n.lock_ref]
    assert len(heads) == 2
    assert all(n.host_ref == 1 for n in heads)
    assert tree.statistics().locked_nodes == 3
    tree.check_invariants()

    tree.unlock_device(deep)
    tree.unprotect_host(deep)
    assert all(n.lock_ref == 0 and n.host_ref == 0 for n in tree.iter_nodes())
    stats = tree.statistics()
    assert (stats.locked_nodes, stats.protected_nodes) == (0, 0)
    assert stats.evictable_device_pages == stats.device_pages == 8
    tree.check_invariants()


def test_insert_under_a_node_continues_its_prefix() -> None:
    tree = make_tree()
    anchor = tree.insert(K(1, 2), device_pages=[0, 1]).node
    landed = tree.insert(K(1, 2, 3, 4)[2:], host_pages=[5, 6], under=anchor).node
    assert landed.parent is anchor
    match = tree.match(K(1, 2, 3, 4))
    assert (match.device_pages, match.host_pages) == ([0, 1], [5, 6])
    assert match.host_node is landed

    # Continuing inside an existing node splits it and reports duplicates as usual.
    again = tree.insert(K(1, 2, 3)[2:], host_pages=[9], under=anchor)
    assert again.duplicate_host_pages == [9]
    assert again.node.host_pages == [5]
    with pytest.raises(ValueError, match="not on the device"):
        tree.insert(K(1, 2, 3, 4, 5)[4:], device_pages=[7], under=landed)
    assert tree.insert([], host_pages=[], under=landed).node is landed
    tree.check_invariants()

    tree.evict_host(10)
    assert not attached(landed)
    with pytest.raises(ValueError, match="not in the tree"):
        tree.insert(K(1, 2, 3, 4, 5)[4:], host_pages=[7], under=landed)


def test_descend_reads_on_from_a_node_splitting_where_the_keys_end() -> None:
    tree = make_tree()
    anchor = tree.insert(K(1, 2), device_pages=[0, 1]).node
    deep = tree.insert(K(1, 2, 3, 4, 5)[2:], host_pages=[5, 6, 7], under=anchor).node
    assert tree.descend(anchor, []) is anchor
    assert tree.descend(anchor, K(1, 2, 3, 4, 5)[2:]) is deep
    # Ending inside a node splits it; the original object keeps the suffix, as in match.
    mid = tree.descend(anchor, K(1, 2, 3, 4)[2:])
    assert mid is not None
    assert mid.host_pages == [5, 6]
    assert deep.parent is mid
    assert tree.descend(tree.root, K(1, 2, 3, 4)) is mid
    # Keys not all in the tree, parting inside a node or past its end: None, nothing split.
    nodes = tree.num_nodes
    assert tree.descend(anchor, K(1, 2, 3, 9)[2:]) is None
    assert tree.descend(anchor, K(1, 2, 3, 4, 5, 6)[2:]) is None
    assert tree.descend(mid, K(1, 2, 3, 4, 9)[4:]) is None
    assert tree.num_nodes == nodes
    tree.check_invariants()
    tree.evict_host(10)
    with pytest.raises(ValueError, match="not in the tree"):
        tree.descend(deep, [])


def test_move_protection_down_a_path_equals_protect_then_unprotect() -> None:
    tree = make_tree()
    top = tree.insert(K(1), host_pages=[0]).node
    tree.protect_host(top)
    middle = tree.insert(K(1, 2)[1:], host_pages=[1], under=top).node
    low = tree.insert(K(1, 2, 3)[2:], host_pages=[2], under=middle).node
    tree.move_protection(top, low)
    assert [n.host_ref for n in (top, middle, low)] == [1, 1, 1]
    tree.check_invariants()
    assert tree.evict_host(3) == []
    tree.move_protection(low, low)
    tree.check_invariants()
    with pytest.raises(ValueError, match="is not below"):
        tree.move_protection(low, top)
    assert [n.host_ref for n in (top, middle, low)] == [1, 1, 1]
    tree.unprotect_host(low)
    with pytest.raises(ValueError, match="underflow"):
        tree.move_protection(low, low)
    assert sorted(tree.evict_host(3)) == [0, 1, 2]
    tree.check_invariants()


def test_protected_nodes_are_never_removed() -> None:
    tree = make_tree()
    node = tree.insert(K(1), device_pages=[0]).node
    tree.protect_host(node)
    # Device-only and protected: it can only leave the device after a backup.
    eviction = tree.evict_device(1, backup_first=False)
    assert (eviction.freed, eviction.needs_backup) == ([], [node])
    tree.set_host_pages(node, [3])
    assert tree.evict_device(1, backup_first=False).freed == [0]
    assert node.parent is tree.root
    assert tree.evict_host(1) == []
    tree.unprotect_host(node)
    assert tree.evict_host(1) == [3]
    assert not attached(node)
    tree.check_invariants()


def _insert_disjoint(tree: RadixTree) -> list[TreeNode]:
    return [
        tree.insert(K(100 * i + 1, 100 * i + 2), device_pages=[2 * i, 2 * i + 1]).node
        for i in range(3)
    ]


def test_lru_evicts_least_recently_used_first() -> None:
    tree = make_tree("lru")
    a, b, c = _insert_disjoint(tree)
    tree.match(K(1, 2))  # touches a last
    order = [tree.evict_device(1, backup_first=False).freed for _ in range(3)]
    assert order == [[2, 3], [4, 5], [0, 1]]
    assert tree.statistics().nodes == 0
    assert all(n.parent is None for n in (a, b, c))


def test_lfu_evicts_least_frequently_used_first() -> None:
    tree = make_tree("lfu")
    _insert_disjoint(tree)
    for _ in range(3):
        tree.match(K(1, 2))
    tree.match(K(201, 202))
    tree.match(K(201, 202))
    tree.match(K(101, 102))
    order = [tree.evict_device(1, backup_first=False).freed for _ in range(3)]
    assert order == [[2, 3], [4, 5], [0, 1]]


def test_lfu_breaks_ties_by_age() -> None:
    tree = make_tree("lfu")
    _insert_disjoint(tree)
    tree.match(K(201, 202))
    tree.match(K(1, 2))
    tree.match(K(101, 102))
    assert tree.evict_device(2, backup_first=False).freed == [4, 5]


def test_lfu_a_split_keeps_the_hit_count_on_both_halves() -> None:
    tree = make_tree("lfu")
    tree.insert(K(1, 2, 3, 4), device_pages=[0, 1, 2, 3])
    for _ in range(5):
        tree.match(K(1, 2, 3, 4))
    head = tree.match(K(1, 2)).device_node  # splits the node: the prefix's 6th hit
    (tail,) = head.children.values()
    assert (head.hit_count, tail.hit_count) == (6, 5)
    tree.insert(K(201, 202), device_pages=[10, 11])
    for _ in range(5):
        tree.match(K(201, 202))
    # The tail (5 hits, older) goes before the other leaf (5 hits); the prefix (6) last.
    order = [tree.evict_device(1, backup_first=False).freed for _ in range(3)]
    assert order == [[2, 3], [10, 11], [0, 1]]
    tree.check_invariants()


def test_low_priority_goes_first_whatever_the_policy() -> None:
    tree = make_tree("lru")
    tree.insert(K(1, 2), device_pages=[0, 1], priority=3)
    tree.insert(K(5, 6), device_pages=[2, 3])
    tree.match(K(5, 6))
    assert tree.evict_device(1, backup_first=False).freed == [2, 3]


def test_eviction_frees_whole_nodes_and_cascades_to_parents() -> None:
    tree = make_tree()
    tree.insert(K(1, 2, 3), device_pages=[0, 1, 2])
    tree.insert(K(1, 2, 4, 5), device_pages=[0, 1, 3, 4])
    # One page asked for, a whole two-page leaf freed.
    # One page asked for: the older leaf [3] (untouched by the second insert) goes.
    assert tree.evict_device(1, backup_first=False).freed == [2]
    # Its sibling is freed whole, then the shared parent becomes a leaf and goes too.
    assert tree.evict_device(3, backup_first=False).freed == [3, 4, 0, 1]
    assert tree.statistics().nodes == 0
    tree.check_invariants()


def test_backup_first_reports_device_only_leaves() -> None:
    tree = make_tree()
    only_device = tree.insert(K(1, 2), device_pages=[0, 1]).node
    backed = tree.insert(K(5, 6), device_pages=[2, 3], host_pages=[0, 1]).node
    eviction = tree.evict_device(10, backup_first=True)
    assert eviction.freed == [2, 3]
    assert eviction.needs_backup == [only_device]
    assert only_device.device_pages == [0, 1]
    assert backed.parent is tree.root
    assert not backed.on_device
    assert backed.host_pages == [0, 1]

    tree.set_host_pages(only_device, [4, 5])
    again = tree.evict_device(1, backup_first=True)
    assert (again.freed, again.needs_backup) == ([0, 1], [])
    assert tree.match(K(1, 2)).host_pages == [4, 5]
    tree.check_invariants()


def test_device_only_node_with_host_children_needs_backup() -> None:
    tree = make_tree()
    parent = tree.insert(K(1, 2), device_pages=[0, 1]).node
    tree.insert(K(1, 2, 3), host_pages=[5, 6, 7])  # parent takes [5, 6]; child host-only
    tree.clear_host_pages(parent)
    eviction = tree.evict_device(2, backup_first=False)
    assert eviction.freed == []
    assert eviction.needs_backup == [parent]
    assert tree.evict_host(1) == [7]
    assert tree.evict_device(2, backup_first=False).freed == [0, 1]
    assert tree.statistics().nodes == 0


def test_host_eviction_only_takes_unprotected_off_device_leaves() -> None:
    tree = make_tree()
    both = tree.insert(K(1), device_pages=[0], host_pages=[0]).node
    protected = tree.insert(K(2), host_pages=[1]).node
    chain = tree.insert(K(3, 4), host_pages=[2, 3]).node
    tree.insert(K(3, 4, 5), host_pages=[2, 3, 4])
    tree.protect_host(protected)
    assert tree.statistics().evictable_host_pages == 3

    freed = tree.evict_host(100)
    # The leaf [5] goes first, then its parent [3, 4] becomes a leaf and goes too.
    assert freed == [4, 2, 3]
    assert chain.parent is None
    assert both.host_pages == [0]
    assert protected.host_pages == [1]

    tree.unprotect_host(protected)
    assert tree.evict_host(1) == [1]
    assert tree.evict_host(1) == []
    tree.check_invariants()


def test_host_eviction_does_not_cascade_into_device_parents() -> None:
    tree = make_tree()
    parent = tree.insert(K(1), device_pages=[0]).node
    tree.insert(K(1, 2), host_pages=[9, 1])
    assert parent.host_pages == [9]
    assert tree.evict_host(10) == [1]
    assert parent.host_pages == [9]
    assert parent.on_device


def test_set_and_clear_pages() -> None:
    tree = make_tree()
    parent = tree.insert(K(1), device_pages=[0], host_pages=[0]).node
    child = tree.insert(K(1, 2), device_pages=[0, 1], host_pages=[0, 1]).node
    tree.evict_device(2, backup_first=True)
    assert not parent.on_device
    assert not child.on_device

    with pytest.raises(ValueError, match="parent of"):
        tree.set_device_pages(child, [3])
    with pytest.raises(ValueError, match="2 pages for a node of 1"):
        tree.set_device_pages(parent, [3, 4])
    tree.set_device_pages(parent, [3])
    with pytest.raises(ValueError, match="already on the device"):
        tree.set_device_pages(parent, [5])
    with pytest.raises(ValueError, match="already on the host"):
        tree.set_host_pages(child, [5])
    with pytest.raises(ValueError, match="only on the host"):
        tree.clear_host_pages(child)
    tree.set_device_pages(child, [4])
    assert tree.match(K(1, 2)).device_pages == [3, 4]

    tree.protect_host(child)
    with pytest.raises(ValueError, match="protected"):
        tree.clear_host_pages(child)
    tree.unprotect_host(child)
    assert tree.clear_host_pages(child) == [1]
    with pytest.raises(ValueError, match="not on the host"):
        tree.clear_host_pages(child)
    assert tree.statistics().host_pages == 1
    tree.check_invariants()


def test_removed_nodes_are_rejected() -> None:
    tree = make_tree()
    node = tree.insert(K(1), device_pages=[0]).node
    tree.evict_device(1, backup_first=False)
    assert node.parent is None
    assert node.device_pages is None
    with pytest.raises(ValueError, match="not in the tree"):
        tree.lock_device(node)
    with pytest.raises(ValueError, match="not in the tree"):
        tree.mark_in_storage(node)


def test_storage_flag_counts_and_survives_splits() -> None:
    tree = make_tree()
    node = tree.insert(K(1, 2, 3), device_pages=[0, 1, 2]).node
    tree.mark_in_storage(node)
    tree.mark_in_storage(node)
    assert tree.statistics().storage_pages == 3
    head = tree.match(K(1)).device_node
    assert head.in_storage
    assert tree.statistics().storage_pages == 3
    tree.mark_in_storage(node, False)
    assert tree.statistics().storage_pages == 1
    tree.check_invariants()


def test_statistics_and_repr_show_live_state() -> None:
    tree = make_tree()
    node = tree.insert(K(1, 2), device_pages=[0, 1], host_pages=[3, 4]).node
    tree.insert(K(7), host_pages=[5])
    tree.lock_device(node)
    stats = tree.statistics()
    assert stats.nodes == 2
    assert (stats.device_pages, stats.host_pages, stats.locked_nodes) == (2, 3, 1)
    assert (stats.evictable_device_pages, stats.evictable_host_pages) == (0, 1)
    assert "nodes=2" in repr(tree)
    assert "locked_nodes=1" in repr(tree)
    assert "lock_ref=1" in repr(node)
    assert "tiers=device+host" in repr(node)


def test_check_invariants_catches_corruption() -> None:
    tree = make_tree()
    node = tree.insert(K(1, 2), device_pages=[0, 1]).node
    other = tree.insert(K(5), device_pages=[2]).node
    tree.check_invariants()
    other.device_pages = [1]
    with pytest.raises(AssertionError, match="device page 1 appears twice"):
        tree.check_invariants()
    other.device_pages = [2]
    node.lock_ref = 1
    with pytest.raises(AssertionError, match=r"statistics\.locked_nodes"):
        tree.check_invariants()
    node.lock_ref = 0
    node.host_pages = [0]
    with pytest.raises(AssertionError, match="1 host pages for 2 keys"):
        tree.check_invariants()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="eviction"):
        RadixTree(eviction="fifo")  # type: ignore[arg-type]
    tree = make_tree()
    with pytest.raises(ValueError, match="num_pages"):
        tree.evict_device(-1, backup_first=False)
    with pytest.raises(ValueError, match="num_pages"):
        tree.evict_host(-1)
    assert tree.evict_device(0, backup_first=False).freed == []


def test_calls_from_another_thread_raise() -> None:
    tree = RadixTree(owner=LoopOwner("tree"))
    tree.insert(K(1), device_pages=[0])
    errors: list[BaseException] = []

    def worker() -> None:
        for call in (
            lambda: tree.match(K(1)),
            lambda: tree.insert(K(2), device_pages=[1]),
            lambda: tree.evict_device(1, backup_first=False),
            tree.statistics,
        ):
            try:
                call()
            except WrongThreadError as exc:
                errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert len(errors) == 4
    assert tree.statistics().nodes == 1
    assert tree.match(K(1)).device_pages == [0]


async def test_calls_from_another_event_loop_raise() -> None:
    owner = LoopOwner("tree")
    other = asyncio.new_event_loop()
    try:
        owner.bind(other)
        tree = RadixTree(owner=owner)
        with pytest.raises(WrongThreadError, match="another event loop"):
            tree.match(K(1))
        owner.bind()
        assert tree.match(K(1)).device_pages == []
    finally:
        other.close()


class CountingTime(float):
    """An access time that counts how often eviction compares it (the work of ordering)."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        CountingTime.comparisons += 1
        return float(self) == other

    def __lt__(self, other: float) -> bool:
        CountingTime.comparisons += 1
        return float(self) < float(other)

    __hash__ = float.__hash__


def _counting_tree(leaves: int, *, host: bool) -> RadixTree:
    ticks = iter(range(1, 10**9))
    tree = RadixTree(clock=lambda: CountingTime(next(ticks)))
    for i in range(leaves):
        keys = page_keys([i, i], 1)
        if host:
            tree.insert(keys, host_pages=[2 * i, 2 * i + 1])
        else:
            tree.insert(keys, device_pages=[2 * i, 2 * i + 1])
    return tree


@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
def test_eviction_keeps_its_order_between_calls(host: bool) -> None:
    """A small eviction among many candidates costs O(log n) comparisons, not a reorder of
    every candidate on each call."""
    leaves = 4000
    tree = _counting_tree(leaves, host=host)
    CountingTime.comparisons = 0
    calls = 50
    for i in range(calls):
        freed = tree.evict_host(2) if host else tree.evict_device(2, backup_first=False).freed
        assert freed == [2 * i, 2 * i + 1]  # oldest first, as before
    # log2(4000) is about 12; reordering every candidate would take thousands per call.
    assert CountingTime.comparisons < 100 * calls
    tree.check_invariants()


def test_touch_and_lock_churn_keeps_the_order_right() -> None:
    """Stale queue entries from touches and locks never pick the wrong victim."""
    tree = make_tree()
    nodes = [tree.insert(K(i, 100 + i), device_pages=[2 * i, 2 * i + 1]).node for i in range(40)]
    for _ in range(5):
        for i in range(0, 40, 2):
            tree.match(K(i, 100 + i))  # the even ones become the most recent
        for node in nodes[1::4]:
            tree.lock_device(node)
            tree.unlock_device(node)
    tree.insert(K(3, 103), device_pages=[6, 7], priority=1)  # now evicted last
    tree.check_invariants()
    order = []
    for _ in range(40):
        freed = tree.evict_device(2, backup_first=False).freed
        order.append(freed[0] // 2)
    odd = [i for i in range(1, 40, 2) if i != 3]
    assert order == [*odd, *range(0, 40, 2), 3]
    assert tree.statistics().nodes == 0


def test_backup_first_asks_only_for_what_it_needs() -> None:
    """With backup_first, pages waiting for a backup count toward the request: one small
    eviction on a full device reports about what it needs, not every unbacked leaf."""
    tree = make_tree()
    nodes = [tree.insert(K(i, 100 + i), device_pages=[2 * i, 2 * i + 1]).node for i in range(50)]
    backed = tree.insert(K(99), device_pages=[100], host_pages=[0]).node
    tree.match(K(99))  # the newest: freed last
    eviction = tree.evict_device(3, backup_first=True)
    assert eviction.freed == []
    assert eviction.needs_backup == nodes[:2]  # oldest first, 4 pages >= 3
    again = tree.evict_device(3, backup_first=True)
    assert again.needs_backup == nodes[:2]  # still candidates until backed up
    tree.set_host_pages(nodes[0], [1, 2])
    third = tree.evict_device(4, backup_first=True)
    assert third.freed == [0, 1]
    assert third.needs_backup == [nodes[1]]
    assert backed.on_device  # has a host copy but is the most recent
    tree.check_invariants()


def test_removing_every_candidate_lets_the_queue_let_go_of_them() -> None:
    # A stale entry holds its node (and what hangs off it) until compacted: removals must
    # compact too, not only pushes.
    from hicache_async.tree._eviction import _SLACK

    clock = itertools.count()
    tree = RadixTree(clock=lambda: float(next(clock)))
    nodes = [tree.insert([b"%031d" % i], host_pages=[i]).node for i in range(5000)]
    for node in nodes:
        tree.discard_host_leaf(node)
    assert tree.num_nodes == 0
    assert len(tree._host_queue._heap) <= _SLACK


def test_a_backed_only_eviction_keeps_the_victims_it_passes_over() -> None:
    """An unbacked leaf that a `backed_only` eviction passes over stays a candidate: a later
    eviction without the restriction takes it."""
    tree = make_tree()
    unbacked = tree.insert(K(1), device_pages=[0]).node  # older: first in line
    tree.insert(K(2), device_pages=[1], host_pages=[5])
    eviction = tree.evict_device(2, backup_first=False, backed_only=True)
    assert (eviction.freed, eviction.needs_backup) == ([1], [])
    assert attached(unbacked)
    assert unbacked.device_pages == [0]
    tree.check_invariants()
    assert tree.evict_device(1, backup_first=False).freed == [0]
    assert not attached(unbacked)
    tree.check_invariants()


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_a_raised_priority_reorders_eviction(eviction: EvictionPolicy) -> None:
    tree = make_tree(eviction)
    raised = tree.insert(K(1, 2), device_pages=[0, 1], host_pages=[0, 1]).node  # older
    tree.insert(K(3), device_pages=[2], host_pages=[2])
    tree.raise_priority(raised, 5)
    assert raised.priority == 5
    tree.check_invariants()
    assert tree.evict_device(1, backup_first=False).freed == [2]
    assert tree.evict_host(1) == [2]
    assert raised.device_pages == [0, 1]


def test_a_match_and_a_refresh_reach_every_node_of_the_path() -> None:
    tree = make_tree()
    top = tree.insert(K(1), device_pages=[0]).node
    leaf = tree.insert(K(1, 2), device_pages=[0, 1]).node
    assert leaf.parent is top
    tree.match(K(1, 2))
    assert (top.hit_count, leaf.hit_count) == (1, 1)
    assert top.last_access == leaf.last_access
    other = tree.insert(K(3), device_pages=[2]).node
    tree.refresh(leaf)
    assert top.last_access == leaf.last_access > other.last_access
    assert top.hit_count == 1  # a refresh is no hit
    tree.check_invariants()


def test_a_backed_only_eviction_passes_over_many_unbacked_victims() -> None:
    tree = make_tree()
    for token in range(10, 40):
        tree.insert(K(token), device_pages=[token])  # older, no host copy
    tree.insert(K(99), device_pages=[99], host_pages=[0])
    eviction = tree.evict_device(1, backup_first=False, backed_only=True)
    assert (eviction.freed, eviction.needs_backup) == ([99], [])
    assert tree.statistics().device_pages == 30
    tree.check_invariants()


def test_discard_host_leaf_refuses_a_protected_leaf() -> None:
    tree = make_tree()
    leaf = tree.insert(K(1, 2), host_pages=[0, 1]).node
    tree.protect_host(leaf)
    with pytest.raises(ValueError, match="unprotected host-only leaf"):
        tree.discard_host_leaf(leaf)
    assert attached(leaf)
    tree.unprotect_host(leaf)
    assert tree.discard_host_leaf(leaf) == [0, 1]
    tree.check_invariants()
