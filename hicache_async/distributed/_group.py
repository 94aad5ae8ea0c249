"""The `RankGroup` protocol, its statistics and the one-rank implementation.

A rank group is what tensor-parallel ranks use to agree on numbers and sets. Each method is a
collective: every rank must call the same methods, in the same order, the same number of times.
The helpers in `_agree` keep that rule when a rank's local step fails.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import anyio.lowlevel
import msgspec

__all__ = ["GroupStatistics", "RankGroup", "SingleRank", "agreement_tag"]

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
#: tags are non-negative and fit 63 bits, so `-tag` fits a signed 64-bit integer too.
TAG_MAX = 2**63 - 1


class GroupStatistics(msgspec.Struct, frozen=True):
    """A snapshot of a group's counters."""

    #: collective calls this rank has entered (one per method call, however many transfers it
    #: takes). Ranks that stayed in step report the same number.
    collectives: int
    #: collectives that did not complete within the timeout.
    timeouts: int
    #: collectives that failed for another reason (a peer closed its connection, ...).
    failures: int
    #: the group is unusable: a collective failed or timed out, or the group was closed.
    broken: bool
    #: calls whose awaiting task was cancelled; their collective still ran and its result
    #: was dropped.
    cancelled: int = 0


@runtime_checkable
class RankGroup(Protocol):
    """Collectives over the tensor-parallel ranks that run one cache each.

    Every method is a collective: each rank must make the same calls in the same order. A
    call is entered as soon as its coroutine starts running; cancelling the awaiting task
    afterwards does not withdraw it (its result is dropped), so ranks stay in step.
    """

    # Read-only members: a cache checks them against its configuration once, when it is made
    # (a plain attribute satisfies them too).
    @property
    def rank(self) -> int:
        """This process's rank in the group, in [0, size)."""
        ...

    @property
    def size(self) -> int:
        """The number of ranks."""
        ...

    async def all_min(self, value: int, *, tag: int | None = None) -> int:
        """The minimum of `value` (a signed 64-bit integer) over all ranks.

        With a `tag` (see `agreement_tag`), the same collective also checks that every rank
        passed the same tag, and raises `AgreementMismatch` on every rank if not.
        """
        ...

    async def all_max(self, value: int) -> int:
        """The maximum of `value` (a signed 64-bit integer) over all ranks."""
        ...

    async def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload`, indexed by rank; payloads may differ in length."""
        ...

    async def agree_common(self, items: Sequence[bytes], *, tag: int | None = None) -> list[bytes]:
        """The items every rank has, without duplicates, in rank 0's order.

        Every rank gets the identical list. A `tag` is checked as in `all_min`.
        """
        ...

    async def barrier(self) -> None:
        """Return once every rank has called `barrier`."""
        ...

    def statistics(self) -> GroupStatistics:
        """A snapshot of this rank's counters."""
        ...


def check_int64(value: int) -> int:
    """`value` as an int if it is an integer (numpy's too) that fits a signed 64-bit integer;
    raise `TypeError` or `ValueError` otherwise."""
    if isinstance(value, bool):
        raise TypeError("a collective value must be an integer, not a bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"a collective value must be an integer, not {type(value).__name__}"
        ) from None
    if not _INT64_MIN <= number <= _INT64_MAX:
        raise ValueError(f"a collective value must fit a signed 64-bit integer, got {number}")
    return number


def check_tag(tag: int | None) -> int | None:
    """`tag` as an int if it is None or an integer in [0, 2**63); raise otherwise."""
    if tag is None:
        return None
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"an agreement tag must be an int, not {type(tag).__name__}")
    if not 0 <= tag <= TAG_MAX:
        raise ValueError(f"an agreement tag must be in [0, 2**63), got {tag}")
    return tag


def agreement_tag(operation: str, *parts: bytes | str | int) -> int:
    """A 63-bit tag naming one agreement: what is agreed (`operation`) and on what (`parts`,
    e.g. a request's page keys or a warmup entry's id).

    Ranks that mean the same agreement compute the same tag; a collective that pairs
    different agreements then fails loudly instead of returning a number that means
    something different on each rank.
    """
    digest = hashlib.blake2b(digest_size=8, person=b"hicache-tp-tag")
    for part in (operation, *parts):
        if isinstance(part, str):
            raw = b"s" + part.encode()
        elif isinstance(part, int) and not isinstance(part, bool):
            raw = b"i" + str(part).encode()
        elif isinstance(part, bytes):
            raw = b"b" + part
        else:
            raise TypeError(f"a tag part must be bytes, str or int, not {type(part).__name__}")
        # Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
    return int.from_bytes(digest.digest(), "little") & TAG_MAX


def check_payload(payload: bytes) -> bytes:
    """`payload` if it is `bytes`; raise `TypeError` otherwise."""
    if not isinstance(payload, bytes):
        raise TypeError(f"a payload must be bytes, not {type(payload).__name__}")
    return payload


def unique_items(items: Sequence[bytes]) -> list[bytes]:
    """`items` without duplicates, first occurrence first; raise `TypeError` on a non-bytes."""
    if isinstance(items, (bytes, bytearray, memoryview, str)):
        # A bytes object is itself a sequence (of ints); passing one is always a mistake.
        raise TypeError("items must be a sequence of bytes, not a single bytes or str object")
    seen: set[bytes] = set()
    out: list[bytes] = []
    for item in items:
        if not isinstance(item, bytes):
            raise TypeError(f"every item must be bytes, not {type(item).__name__}")
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


class SingleRank:
    """The group of one rank: every collective returns this rank's own contribution.

    No I/O, but every call is a coroutine that yields to the loop once, so code written for
    several ranks sees the same cancellation points with one. Invalid arguments raise the same
    errors as `TorchRankGroup`.
    """

    def __init__(self) -> None:
        self._collectives = 0

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def size(self) -> int:
        """Always 1."""
        return 1

    def __repr__(self) -> str:
        return f"<SingleRank collectives={self._collectives}>"

    async def _enter(self) -> None:
        self._collectives += 1
        await anyio.lowlevel.checkpoint()

    async def all_min(self, value: int, *, tag: int | None = None) -> int:
        """`value` itself (one rank cannot disagree with itself on the tag)."""
        number = check_int64(value)
        check_tag(tag)
        await self._enter()
        return number

    async def all_max(self, value: int) -> int:
        """`value` itself."""
        number = check_int64(value)
        await self._enter()
        return number

    async def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """``[payload]``."""
        check_payload(payload)
        await self._enter()
        return [payload]

    async def agree_common(self, items: Sequence[bytes], *, tag: int | None = None) -> list[bytes]:
        """`items` without duplicates, in their order."""
        unique = unique_items(items)
        check_tag(tag)
        await self._enter()
        return unique

    async def barrier(self) -> None:
        """Yield once."""
        await self._enter()

    def statistics(self) -> GroupStatistics:
        """A snapshot of the counters; a single rank never times out or breaks."""
        return GroupStatistics(collectives=self._collectives, timeouts=0, failures=0, broken=False)
