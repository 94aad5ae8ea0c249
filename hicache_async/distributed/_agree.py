"""Agreement helpers that keep every rank's collective count equal whatever fails locally.

A rank that skips a collective because its local step raised leaves its peers waiting in that
collective until they time out (SGLang's warmup deadlocked this way when manifests differed).
So each helper runs the local step, turns any failure into the neutral contribution, and then
enters its collective exactly once, on every path.

Every agreement is tagged (see `agreement_tag`): the tag names what is agreed and travels in
the same collective as the value, so ranks that pair two different agreements get
`AgreementMismatch` instead of a number that means something else on each rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import structlog

from .._uncancelled import run_uncancelled
from ._group import RankGroup, agreement_tag, check_int64, unique_items

__all__ = ["agree_entries", "agree_min", "enter_min_cancelled", "run_uncancelled"]

_log = structlog.get_logger("hicache_async")

#: What `agree_min` / `agree_entries` are tagged with when the caller names nothing more
#: specific: they still never pair with another kind of agreement.
_DEFAULT_MIN_TAG = agreement_tag("agree_min")
_DEFAULT_ENTRIES_TAG = agreement_tag("agree_entries")


async def agree_min(
    group: RankGroup,
    local: Callable[[], Awaitable[int]],
    *,
    tag: int | None = None,
    gate: Callable[[], Coroutine[Any, Any, object]] | None = None,
) -> int:
    """The minimum over ranks of each rank's `local()`, e.g. how many pages a prefetch hit.

    If `local()` raises or returns something that is not a signed 64-bit int, this rank
    contributes 0 (so the agreement is 0) and logs ``tp.local.failed``. If it is cancelled,
    this rank still enters the collective with 0, waits for it, and then re-raises the
    cancellation, so its peers are not left waiting. Either way `group.all_min` is entered
    exactly once. Errors of the collective itself (`CollectiveError`) propagate.

    `tag` names the agreement (default: a tag for "agree_min"); every rank must pass the same
    one, or every rank raises `AgreementMismatch`. `gate`, if given, is awaited after the local
    step and before the collective on every path, cancellation included, and cannot be
    cancelled itself: it orders this collective after others (e.g. a running warmup's).
    """
    key = _DEFAULT_MIN_TAG if tag is None else tag
    try:
        try:
            value = check_int64(await local())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _log_failure(group, "agree_min", exc)
            value = 0
        if gate is not None:
            await gate()
    except asyncio.CancelledError:
        await _enter_then_reraise(gate, lambda: group.all_min(0, tag=key))
        raise
    return await group.all_min(value, tag=key)


async def agree_entries(
    group: RankGroup,
    local: Callable[[], Awaitable[Sequence[bytes]]],
    *,
    tag: int | None = None,
) -> list[bytes]:
    """The entries every rank's `local()` returned, in rank 0's order, e.g. which warmup
    manifest entries to load.

    If `local()` raises or returns something other than a sequence of bytes, this rank
    contributes the empty set (so the agreement is empty) and logs ``tp.local.failed``.
    Cancellation, tags and errors of the collective itself are handled as in `agree_min`.
    `group.agree_common` is entered exactly once on every path.
    """
    key = _DEFAULT_ENTRIES_TAG if tag is None else tag
    try:
        items = unique_items(await local())
    except asyncio.CancelledError:
        await _enter_then_reraise(None, lambda: group.agree_common((), tag=key))
        raise
    except Exception as exc:
        _log_failure(group, "agree_entries", exc)
        items = []
    return await group.agree_common(items, tag=key)


async def enter_min_cancelled(
    group: RankGroup,
    *,
    tag: int,
    gate: Callable[[], Coroutine[Any, Any, object]] | None = None,
) -> None:
    """For an `agree_min` (same `tag` and `gate`) that this rank can no longer run, its work
    cancelled or failed before it began: enter the collective with 0 as `agree_min` would
    after a cancelled local step, and wait for it, so the peers are not left in it. The
    caller then raises its own error; errors of the collective are swallowed."""
    await _enter_then_reraise(gate, lambda: group.all_min(0, tag=tag))


async def _enter_then_reraise(
    gate: Callable[[], Coroutine[Any, Any, object]] | None,
    collective: Callable[[], Awaitable[object]],
) -> None:
    """After a cancellation: pass `gate` (never cancelled), then enter `collective` and wait
    for it; swallow what it raises, because the caller is about to re-raise its own
    cancellation."""
    if gate is not None:
        await run_uncancelled(gate())
    try:
        await collective()
    except (asyncio.CancelledError, Exception):
        # Cancelled again while waiting: the collective was already entered and completes on
        # its own; a collective error: the peers see it too. Either way the cancellation wins.
        return


def _log_failure(group: RankGroup, helper: str, exc: Exception) -> None:
    _log.warning(
        "tp.local.failed",
        helper=helper,
        rank=group.rank,
        size=group.size,
        error=f"{type(exc).__name__}: {exc}",
    )
