"""The errors a rank group raises. Every one means the group can no longer be used."""

from __future__ import annotations

from .._errors import HiCacheError

__all__ = ["AgreementMismatch", "CollectiveError", "CollectiveTimeout", "GroupBrokenError"]


class CollectiveError(HiCacheError, RuntimeError):
    """A collective failed on this rank, so the group is now broken.

    Catch this (it covers the two subclasses) to degrade: treat storage as a miss, skip warmup.
    """


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the group's timeout (a peer never arrived)."""


class GroupBrokenError(CollectiveError):
    """An earlier collective failed or the group was closed; no collective was entered."""


class AgreementMismatch(CollectiveError):
    """The ranks paired different agreements in one collective (their tags differed).

    Every rank sees the same reduced tags, so every rank raises this for the same collective,
    and the group is then broken like after any other failed collective: ranks that paired
    different calls once are out of step, and anything they agree on afterwards is suspect.
    """
