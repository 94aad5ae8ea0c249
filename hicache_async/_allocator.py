"""An O(1)-per-page allocator of page indices in `[0, capacity)`.

Free pages sit on a stack (a Python list; allocation pops from its end, so recently freed pages
are reused first while they are still warm in cache); a bytearray holds each page's state so
`free` can reject double frees and foreign pages without a set lookup.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import msgspec

__all__ = ["AllocatorStatistics", "PageAllocator"]

_FREE = 0
_USED = 1


class AllocatorStatistics(msgspec.Struct, frozen=True):
    """A snapshot of a `PageAllocator`'s counters.

    `allocs` and `frees` count pages; `failed_allocs` counts `alloc` calls that returned None.
    """

    name: str
    capacity: int
    free: int
    used: int
    peak_used: int
    allocs: int
    frees: int
    failed_allocs: int


class PageAllocator:
    """Hands out page indices of one pool, all-or-nothing per call.

    Not thread-safe: like every piece of bookkeeping it belongs to the event loop's thread.
    Invariant: `free_count + used_count == capacity` before and after every call, including
    calls that fail.
    """

    __slots__ = (
        "_allocs",
        "_capacity",
        "_failed",
        "_free",
        "_frees",
        "_name",
        "_peak",
        "_state",
    )

    def __init__(self, capacity: int, *, name: str = "pages") -> None:
        capacity = operator.index(capacity)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._name = name
        self._capacity = capacity
        # Reversed so that the first allocations return 0, 1, 2, ...
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._state = bytearray(capacity)
        self._peak = 0
        self._allocs = 0
        self._frees = 0
        self._failed = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def capacity(self) -> int:
        """Number of pages managed."""
        return self._capacity

    @property
    def free_count(self) -> int:
        """Pages available to `alloc`."""
        return len(self._free)

    @property
    def used_count(self) -> int:
        """Pages handed out and not yet freed."""
        return self._capacity - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Allocate `n` pages, or none at all (returning None) if fewer than `n` are free.

        `n == 0` returns `[]`; a negative `n` raises `ValueError`.
        """
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n == 0:
            return []
        free = self._free
        if n > len(free):
            self._failed += 1
            return None
        pages = free[-n:]
        del free[-n:]
        pages.reverse()
        state = self._state
        for page in pages:
            state[page] = _USED
        self._allocs += n
        used = self._capacity - len(free)
        self._peak = max(self._peak, used)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool.

        Every page is checked first (in range, currently allocated, not repeated within this
        call); on any error `ValueError` is raised and nothing is freed.
        """
        batch = [operator.index(p) for p in pages]
        if not batch:
            return
        state = self._state
        capacity = self._capacity
        for page in batch:
            if not 0 <= page < capacity:
                raise ValueError(f"{self._name}: page {page} is out of range [0, {capacity})")
            if state[page] != _USED:
                raise ValueError(f"{self._name}: page {page} is not allocated (double free?)")
        if len(set(batch)) != len(batch):
            seen: set[int] = set()
            for page in batch:
                if page in seen:
                    raise ValueError(f"{self._name}: page {page} appears twice in one free() call")
                seen.add(page)
        for page in batch:
            state[page] = _FREE
        self._free.extend(reversed(batch))
        self._frees += len(batch)

    def is_allocated(self, page: int) -> bool:
        """Whether `page` is currently handed out (False for pages out of range)."""
        page = operator.index(page)
        return 0 <= page < self._capacity and self._state[page] == _USED

    def statistics(self) -> AllocatorStatistics:
        """A snapshot of the counters."""
        return AllocatorStatistics(
            name=self._name,
            capacity=self._capacity,
            free=len(self._free),
            used=self._capacity - len(self._free),
            peak_used=self._peak,
            allocs=self._allocs,
            frees=self._frees,
            failed_allocs=self._failed,
        )

    def __repr__(self) -> str:
        return (
            f"PageAllocator(name={self._name!r}, capacity={self._capacity}, "
            f"free={len(self._free)}, used={self._capacity - len(self._free)})"
        )
