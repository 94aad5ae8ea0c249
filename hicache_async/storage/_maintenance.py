"""Optional protocols beside `StorageBackend`: raw page access and maintenance.

`RawAccess` exposes the stored `header ‖ payload` bytes, below the verification path, so the
conformance suite and fault injection can damage a page and check that `get` catches it.
`MaintainableStorage` is what `hicache-async storage ls|verify|gc` needs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec

__all__ = ["GcReport", "MaintainableStorage", "PageInfo", "RawAccess", "VerifyReport"]


class PageInfo(msgspec.Struct, frozen=True):
    """One stored page as listed by `list_pages`."""

    key: bytes
    #: stored bytes: the 128-byte header plus the payload.
    nbytes: int
    num_tokens: int
    priority: int
    #: unix seconds of the last read or write this backend knows of.
    last_access: float


class VerifyReport(msgspec.Struct, frozen=True):
    """What `verify` found: every page checked, bad ones and leftovers removed."""

    checked: int
    ok: int
    corrupt_removed: int
    #: pages of a newer format version, left in place.
    unsupported: int
    #: temporary files of interrupted writes and stray entries.
    leftovers_removed: int


class GcReport(msgspec.Struct, frozen=True):
    """What `gc` evicted to bring the store within its capacity."""

    evicted_pages: int
    freed_bytes: int


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
