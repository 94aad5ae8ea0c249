"""Optional protocols beside `StorageBackend`: raw page access and maintenance.

`RawAccess` exposes the stored `header ‖ payload` bytes, below the verification path, so the
conformance suite and fault injection can damage a page and check that `get` catches it.
`MaintainableStorage` is what `hicache-async storage ls|verify|gc` needs, and `StreamsPages`
lets `ls` print a large store as it lists it instead of after.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

import msgspec

__all__ = [
    "GcReport",
    "MaintainableStorage",
    "PageInfo",
    "RawAccess",
    "StreamsPages",
    "VerifyReport",
]


class PageInfo(msgspec.Struct, frozen=True):
    """One stored page as listed by `list_pages`."""

    key: bytes
    #: stored bytes: the 128-byte header plus the payload.
    nbytes: int
    num_tokens: int
    priority: int
    #: unix seconds of the last read or write this backend knows of; 0.0 when there is none
    #: to go by (a header that cannot be read), which makes the page the first gc evicts.
    last_access: float


class VerifyReport(msgspec.Struct, frozen=True):
    """What `verify` found: every page checked, bad ones and leftovers removed.

    A verify that is clean has `corrupt_removed == 0` and `unchecked == 0`; the
    `hicache-async storage verify` command exits 3 otherwise.
    """

    checked: int
    ok: int
    corrupt_removed: int
    #: pages of a newer format version, left in place.
    unsupported: int
    #: temporary files of interrupted writes (of pages, and of a file store's manifest
    #: compactions) and stray entries (symlinks, FIFOs, devices and directories under
    #: `pages/`).
    leftovers_removed: int
    #: what could not be checked, so may still hold damage: unreadable pages, pages larger
    #: than the backend can stage, directories refused as unsafe (each counts once, whatever
    #: it holds), corrupt pages and leftovers that could not be removed. The log names
    #: them. (Added after the first release: decoders default it.)
    unchecked: int = 0
    #: regular files under `pages/` whose names are no page keys (an operator's notes or
    #: backup copy), and files in `tmp/` not named as the store's temporary or spare files:
    #: left in place, never the store's to remove. A page key's file out of its place (the
    #: wrong shard) is a stray, removed and counted in `leftovers_removed`.
    #: File store only. (Added after the first release, as `unchecked`.)
    foreign: int = 0


class GcReport(msgspec.Struct, frozen=True):
    """What `gc` evicted to bring the store within its capacity.

    A gc that did its job has `failed == 0` and `over_capacity_bytes == 0`; the
    `hicache-async storage gc` command exits 3 otherwise.
    """

    evicted_pages: int
    freed_bytes: int
    #: pages gc chose to evict but could not remove (they stay; the log names them). (Added
    #: after the first release, as the next field: decoders default them.)
    failed: int = 0
    #: bytes the store still holds above its capacity after gc: pages that could not be
    #: removed, or that could not be evicted at all (being read or written).
    over_capacity_bytes: int = 0
    #: True when this gc ran no pass: another one held the store's gc lease for longer than
    #: this one would wait (Redis's `gc_wait`), and that one brings the store within its
    #: capacity (unless it was killed: its lease then holds gc back until it expires). Never
    #: set by a store without such a lease.
    skipped: bool = False


@runtime_checkable
class RawAccess(Protocol):
    """Read and replace a page's stored bytes without any checks (for tests and tools)."""

    async def read_raw(self, key: bytes) -> bytes | None:
        """The stored `header ‖ payload` of `key`, or None when absent."""
        ...

    async def write_raw(self, key: bytes, value: bytes) -> None:
        """Store `value` under `key` as is, replacing what is there."""
        ...


@runtime_checkable
class MaintainableStorage(Protocol):
    """A backend that can list, verify and garbage-collect its pages."""

    async def list_pages(self, limit: int | None = None) -> list[PageInfo]:
        """Stored pages, most recently used first, at most `limit` of them."""
        ...

    async def verify(self) -> VerifyReport:
        """Check every page's integrity; remove corrupt pages and leftovers."""
        ...

    async def gc(self) -> GcReport:
        """Evict least recently used pages until the store is within its capacity."""
        ...


@runtime_checkable
class StreamsPages(Protocol):
    """Optional beside `MaintainableStorage`: the listing of `list_pages()` in batches, for a
    store too large to list in one piece (memory bounded by a batch, the first pages out at
    once).

    The batches run most recently used first, as `list_pages()` does; a page removed while
    the listing runs is left out, and a store closed meanwhile raises its closed error.
    """

    def stream_pages(self, batch_pages: int = 1024) -> AsyncIterator[list[PageInfo]]:
        """Every stored page, at most `batch_pages` a batch (each non-empty)."""
        ...
