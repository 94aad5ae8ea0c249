"""The errors a rank group raises. Every one means the group can no longer be used."""

from __future__ import annotations

from .._errors import HiCacheError

__all__ = ["CollectiveError", "CollectiveTimeout", "GroupBrokenError"]


class CollectiveError(HiCacheError, RuntimeError):
    """A collective failed on this rank, so the group is now broken.

    Catch this (it covers the two subclasses) to degrade: treat storage as a miss, skip warmup.
    """


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the group's timeout (a peer never arrived)."""


class GroupBrokenError(CollectiveError):
    """An earlier collective failed or the group was closed; no collective was entered."""
