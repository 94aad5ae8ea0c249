"""PageAllocator: all-or-nothing allocation, validated frees, and its invariant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hicache_async._allocator import AllocatorStatistics, PageAllocator


def test_alloc_hands_out_distinct_pages_in_range() -> None:
    alloc = PageAllocator(8, name="dev")
    first = alloc.alloc(3)
    second = alloc.alloc(5)
    assert first is not None
    assert second is not None
    assert sorted(first + second) == list(range(8))
    assert alloc.free_count == 0
    assert alloc.used_count == 8
    assert all(alloc.is_allocated(p) for p in range(8))


def test_alloc_zero_and_negative() -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(0) == []
    with pytest.raises(ValueError, match="negative"):
        alloc.alloc(-1)
    assert alloc.statistics().allocs == 0
    assert alloc.free_count == 4


def test_alloc_is_all_or_nothing() -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(3) is not None
    assert alloc.alloc(2) is None
    assert alloc.free_count == 1
    stats = alloc.statistics()
    assert stats.failed_allocs == 1
    assert stats.allocs == 3


def test_free_rejects_bad_batches_and_changes_nothing() -> None:
    alloc = PageAllocator(6)
    pages = alloc.alloc(4)
    assert pages == [0, 1, 2, 3]
    before = alloc.statistics()
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([0, 6])
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([-1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([1, 4])
    with pytest.raises(ValueError, match="twice"):
        alloc.free([2, 3, 2])
    assert alloc.statistics() == before
    assert all(alloc.is_allocated(p) for p in pages)
    alloc.free([2, 3, 0])
    assert alloc.free_count == 5
    with pytest.raises(ValueError, match="double free"):
        alloc.free([2])


def test_freed_pages_are_reused_and_peak_is_kept() -> None:
    alloc = PageAllocator(3)
    assert alloc.alloc(3) == [0, 1, 2]
    alloc.free([1])
    assert alloc.alloc(1) == [1]
    alloc.free([0, 1, 2])
    stats = alloc.statistics()
    assert stats == AllocatorStatistics(
        name="pages",
        capacity=3,
        free=3,
        used=0,
        peak_used=3,
        allocs=4,
        frees=4,
        failed_allocs=0,
    )
    assert "free=3" in repr(alloc)
    assert "used=0" in repr(alloc)


def test_peak_used_is_the_most_ever_used_not_the_latest() -> None:
    alloc = PageAllocator(8)
    pages = alloc.alloc(6)
    assert pages is not None
    alloc.free(pages)
    assert alloc.alloc(2) == [0, 1]
    assert alloc.statistics().peak_used == 6
    assert alloc.statistics().used == 2


def test_the_page_freed_last_is_handed_out_first() -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(2) == [0, 1]
    alloc.free([0])
    assert alloc.alloc(1) == [0]  # still warm in cache, rather than the untouched 2
    alloc.free([1, 0])
    assert alloc.alloc(2) == [1, 0]


def test_is_allocated_out_of_range_is_false() -> None:
    alloc = PageAllocator(2)
    assert not alloc.is_allocated(-1)
    assert not alloc.is_allocated(2)


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity"):
        PageAllocator(-1)


@given(st.lists(st.integers(0, 20), max_size=30))
def test_alloc_sequence_never_overlaps(sizes: list[int]) -> None:
    alloc = PageAllocator(40)
    held: set[int] = set()
    for n in sizes:
        pages = alloc.alloc(n)
        if pages is None:
            assert n > 40 - len(held)
            continue
        assert len(pages) == n
        assert held.isdisjoint(pages)
        held.update(pages)
        assert alloc.used_count == len(held)


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a reference model: the set of free pages."""

    alloc: PageAllocator
    model_free: set[int]
    capacity: int

    @initialize(capacity=st.integers(0, 24))
    def setup(self, capacity: int) -> None:
        self.capacity = capacity
        self.alloc = PageAllocator(capacity)
        self.model_free = set(range(capacity))

    @rule(n=st.integers(0, 30))
    def allocate(self, n: int) -> None:
        before = self.alloc.statistics()
        pages = self.alloc.alloc(n)
        if n > len(self.model_free):
            assert pages is None
            after = self.alloc.statistics()
            assert after.failed_allocs == before.failed_allocs + 1
            assert (after.free, after.used) == (before.free, before.used)
            return
        assert pages is not None
        assert len(pages) == n
        assert len(set(pages)) == n
        assert set(pages) <= self.model_free
        self.model_free -= set(pages)

    @precondition(lambda self: len(self.model_free) < self.capacity)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        used = sorted(set(range(self.capacity)) - self.model_free)
        batch = data.draw(st.lists(st.sampled_from(used), unique=True, min_size=1))
        self.alloc.free(batch)
        self.model_free |= set(batch)

    @rule(data=st.data())
    def free_invalid(self, data: st.DataObject) -> None:
        """A batch with at least one bad page (free, out of range, or repeated) changes nothing."""
        used = sorted(set(range(self.capacity)) - self.model_free)
        good = data.draw(st.lists(st.sampled_from(used), unique=True)) if used else []
        bad_choices: list[st.SearchStrategy[list[int]]] = [
            st.integers(self.capacity, self.capacity + 5).map(lambda p: [p]),
            st.integers(-5, -1).map(lambda p: [p]),
        ]
        if self.model_free:
            bad_choices.append(st.sampled_from(sorted(self.model_free)).map(lambda p: [p]))
        if good:
            bad_choices.append(st.sampled_from(good).map(lambda p: [p]))
        bad = data.draw(st.one_of(bad_choices))
        batch = data.draw(st.permutations(good + bad))
        before = self.alloc.statistics()
        with pytest.raises(ValueError):
            self.alloc.free(batch)
        assert self.alloc.statistics() == before

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "alloc"):
            return
        stats = self.alloc.statistics()
        assert stats.free + stats.used == self.capacity
        assert self.alloc.free_count == len(self.model_free)
        for page in range(self.capacity):
            assert self.alloc.is_allocated(page) == (page not in self.model_free)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
