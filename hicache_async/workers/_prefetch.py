"""Prefetch: storage → host, as cooperative tasks, with reads shared between requests.

A prefetch plans synchronously (what is cached, what it must read, what others are already
reading), awaits storage, then lands each batch synchronously: its pages join the tree as host
nodes only after their bytes are in host memory and verified. Whatever stops it (a miss, an
error, termination, cancellation), the pages it did not land go back and the futures other
prefetches wait on are resolved.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._config import PrefetchConfig, PrefetchPolicy, _times_ratio
from .._loop import LoopOwner
from .._ratelog import LogLimiter, describe_error
from ..distributed import BackgroundAgreements, CollectiveError, RankGroup, agree_min, agreement_tag
from ..distributed._agree import enter_min_cancelled
from ..storage import Outcome, StorageBackend
from ..storage._protocol import check_exists, check_outcomes
from ..tree import TreeNode
from ._watch import WorkerWatch

if TYPE_CHECKING:
    from .._cache import HiCache
else:
    # Not imported at run time (it imports this module): tools that read hints at run time
    # (typing.get_type_hints, beartype, sphinx) see a cache as Any rather than fail.
    HiCache = Any

__all__ = ["PrefetchHandle", "PrefetchResult", "PrefetchStatus", "Prefetcher"]

_log = structlog.get_logger("hicache_async")


class PrefetchStatus(enum.Enum):
    """Where a prefetch stands."""

    QUEUED = "queued"
    RUNNING = "running"
    #: read every page storage had.
    COMPLETE = "complete"
    #: stopped early on request (best_effort scheduling, a timeout, or `terminate()`).
    TERMINATED = "terminated"
    CANCELLED = "cancelled"
    #: not worth starting (below the threshold, nothing in storage, or no storage).
    SKIPPED = "skipped"


# Plans that brought nothing, each ended by another prefetch dropping a page this one waited
# for (it could not keep it): after this many the prefetch ends with what it has. A plan that
# brought pages, or whose reader stopped on request, does not count (see `Prefetcher._fetch`).
_REPLANS = 3
# Pages one plan of a prefetch takes on at least (a multiple of its batch size): a plan is
# one step of the loop, and a hundred thousand pages (a long prompt at page size 1) held it
# for 0.7 to 1.2 s. A long prompt's plan takes up to `1 / _PLAN_PARTS` of it, so the whole
# prefix matched again at each plan costs at most that many matches.
_PLAN_PAGES = 1 << 12
_PLAN_PARTS = 16

# Endings a prefetch is asked for, which can come before a worker takes it.
_STOPPED = (PrefetchStatus.TERMINATED, PrefetchStatus.CANCELLED)


class _FailedReads:
    """Keys whose read just failed (ERROR, or a call that raised or timed out), taken as
    misses by the prefetches planned after it, without a read (`prefetch.failed_read_window_s`
    and `prefetch.failed_read_keys`). Each is forgotten `window_s` after its failure (on the
    loop's clock), at a successful put of it, or when more than `max_keys` failed since (the
    oldest first); with either at 0 none is remembered."""

    __slots__ = ("_until", "clock", "max_keys", "window_s")

    def __init__(self, window_s: float, max_keys: int) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        # Key -> when it is forgotten; in order of failure, so the oldest come first.
        self._until: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        #: The clock the window runs on: the running loop's, unless replaced.
        self.clock: Callable[[], float] | None = None

    def _now(self) -> float:
        return self.clock() if self.clock is not None else asyncio.get_running_loop().time()

    def add(self, keys: list[bytes]) -> None:
        """Remember `keys` as failed now."""
        if not keys or self.window_s <= 0 or self.max_keys <= 0:
            return
        until = self._now() + self.window_s
        remembered = self._until
        # A batch larger than the bound keeps its first pages: keys are chained, so a prompt
        # that needs a later one reaches the first before it and stops there.
        for key in keys[: self.max_keys]:
            remembered[key] = until
            remembered.move_to_end(key)
        while len(remembered) > self.max_keys:
            remembered.popitem(last=False)

    def __len__(self) -> int:
        return len(self._until)

    def forget(self, keys: list[bytes]) -> None:
        """Forget `keys` (stored since: a read may find them now)."""
        if self._until:
            for key in keys:
                self._until.pop(key, None)

    def first(self, keys: list[bytes], skip: dict[bytes, _Flight]) -> int | None:
        """Index of the first of `keys` that failed within the window and is not in `skip`
        (being read again: those who need it wait on that read), or None."""
        remembered = self._until
        if not remembered:
            return None
        now = self._now()
        while remembered:  # the oldest first: drop those past their window
            key, until = next(iter(remembered.items()))
            if until > now:
                break
            del remembered[key]
        for i, key in enumerate(keys):
            if key in remembered and key not in skip:
                return i
        return None


class _Shared(enum.Enum):
    """How a page one prefetch was reading ended, for the prefetches waiting on it."""

    #: in the tree as a host page.
    LANDED = "landed"
    #: given up: its reader was terminated or cancelled before reading it.
    STOPPED = "stopped"
    #: given up: its reader could not keep it (host pressure, or it stopped on a failed page).
    DROPPED = "dropped"
    #: storage did not deliver it (MISS, CORRUPT, ERROR, or the call failed or timed out).
    FAILED = "failed"


class _Again(enum.Enum):
    """A plan that stopped before the end for a reason that passes."""

    #: at the prefetches' host budget (`max_host_share`): the rest is planned once pages
    #: being read have landed or gone back, so a prefetch larger than the budget reads in
    #: turns rather than ending with part of what storage holds.
    BUDGET = "budget"
    #: at the pages one plan takes on (`_PLAN_PAGES`): the rest is planned at once.
    MORE = "more"


class _Read:
    """One storage call a prefetch planned: the flights of its pages share one future, set
    once every one of them has an outcome (a future per page would cost one object per
    page of a long prompt in one step, and a traceback each in asyncio debug mode)."""

    __slots__ = ("future", "keys", "unsettled")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future
        self.keys: list[bytes] = []
        self.unsettled = 0  # pages of `keys` without an outcome


class _Flight:
    """A page being read by `reader`, and the other prefetches waiting on it."""

    __slots__ = ("outcome", "read", "reader", "waiters")

    def __init__(self, read: _Read, reader: PrefetchHandle) -> None:
        self.read = read
        self.reader = reader
        self.waiters: set[PrefetchHandle] = set()
        #: How the read of this page ended; None while it goes on.
        self.outcome: _Shared | None = None

    def settle(self, outcome: _Shared) -> None:
        """Record how the read of this page ended (the first outcome stands); those waiting
        on its batch wake once the whole batch has one."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        read = self.read
        read.unsettled -= 1
        if read.unsettled == 0 and not read.future.done():
            read.future.set_result(None)

    def wanted(self) -> bool:
        """Whether a waiter still wants the page: one terminated or cancelled does not."""
        return any(not waiter._terminated for waiter in self.waiters)


_FINAL = frozenset(
    {
        PrefetchStatus.COMPLETE,
        PrefetchStatus.TERMINATED,
        PrefetchStatus.CANCELLED,
        PrefetchStatus.SKIPPED,
    }
)


class PrefetchResult(msgspec.Struct, frozen=True):
    """How many tokens of a prompt came from each tier by the time the caller looked."""

    request_id: str | None
    status: PrefetchStatus
    num_tokens: int
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    wait_s: float
    #: With tensor parallelism: the cached tokens every rank has (the minimum over ranks),
    #: which the request must not exceed (`HiCache.request(max_cached_tokens=...)`).
    #: Without it, the same as `cached_tokens`.
    agreed_tokens: int = -1

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.storage_tokens


class StartOrder:
    """The prefetch agreements a cache with a rank group owes for starts that were cancelled
    or failed before their caller got a handle (so no `ready()` enters them), entered with 0
    in start order.

    Every rank runs the same program: starts A, B, C, then `ready()` on each in that order. A
    rank whose start of C is cancelled must enter C's agreement after A's and B's, as its
    peers do, not at the cancellation: an owed agreement is entered once every prefetch
    started before it has entered its own (by the `ready()` that enters the last of them,
    before it returns), at once if none is pending. A prefetch started and never made
    `ready()` holds back the agreements owed after it.
    """

    def __init__(self, group: RankGroup) -> None:
        self._group = group
        self._next = 0
        self._pending: set[int] = set()  # started, agreement not entered yet
        # No start numbered below this is pending: advanced lazily past the numbers left
        # pending, so finding the earliest pending start costs O(1) amortized, not O(pending).
        self._low = 0
        self._owed: collections.deque[tuple[int, int]] = collections.deque()  # (start, tag)
        self._paying = False

    def started(self) -> int:
        """Number a start (with a handle to come); `entered` or `owe` it later."""
        seq = self._next
        self._next += 1
        self._pending.add(seq)
        return seq

    def entered(self, seq: int) -> None:
        """Start `seq`'s `ready()` has entered its agreement."""
        self._pending.discard(seq)

    async def owe(self, seq: int, tag: int) -> None:
        """Start `seq` will never enter its agreement (tagged `tag`): enter it with 0 when due."""
        self._pending.discard(seq)
        self._owed.append((seq, tag))
        await self.pay()

    async def pay(self) -> None:
        """Enter, in order, the owed agreements that are due."""
        if self._paying:
            return  # the payer under way goes on to whatever falls due meanwhile
        self._paying = True
        try:
            while self._owed and self._earliest_pending() > self._owed[0][0]:
                _, tag = self._owed.popleft()
                gate = BackgroundAgreements.of(self._group).wait_idle
                await enter_min_cancelled(self._group, tag=tag, gate=gate)
        finally:
            self._paying = False

    def _earliest_pending(self) -> int:
        """The number of the earliest start still pending, or the next number if none is."""
        # Numbers are handed out increasing and leave `_pending` for good: each is passed once.
        while self._low < self._next and self._low not in self._pending:
            self._low += 1
        return self._low


class PrefetchHandle:
    """A prefetch in progress. Await `ready()` when the request is about to be scheduled.

    Owned by the cache's event loop: `terminate()`, `cancel()`, `wait()` and `ready()` from
    another thread or loop raise `WrongThreadError` before anything changes (hand the call
    to the loop: `loop.call_soon_threadsafe(handle.cancel)`). `done()` and `result()` only
    read.
    """

    __slots__ = (
        "_agreed",
        "_agreeing",
        "_cache",
        "_cancel_requested",
        "_counted_live",
        "_counted_to",
        "_cut_at_failed",
        "_deadline",
        "_device_tokens",
        "_done",
        "_group",
        "_held",
        "_host_tokens",
        "_in_queue",
        "_kept_for_others",
        "_keys",
        "_lookup",
        "_min_tokens",
        "_num_tokens",
        "_order",
        "_owner",
        "_policy",
        "_prefetcher",
        "_priority",
        "_read_end",
        "_reading",
        "_request_id",
        "_scope",
        "_seq",
        "_started",
        "_status",
        "_storage_tokens",
        "_terminated",
        "_timed_out",
        "_waited",
        "_waiting",
    )

    def __init__(
        self,
        prefetcher: Prefetcher | None,
        keys: list[bytes],
        num_tokens: int,
        request_id: str | None,
        policy: PrefetchPolicy,
        *,
        group: RankGroup | None = None,
        priority: int = 0,
        min_tokens: int | None = None,
        owner: LoopOwner | None = None,
        cache: HiCache | None = None,
    ) -> None:
        self._prefetcher = prefetcher
        # Where the prefix this rank offers in an agreement is held: with storage or not.
        if cache is None and prefetcher is not None:
            cache = prefetcher._cache
        self._cache = cache
        # The cache's: a handle without storage has no prefetcher, but the same owner.
        if owner is None and prefetcher is not None:
            owner = prefetcher._cache._owner
        self._owner = owner
        self._group = group
        # Set by `HiCache.start_prefetch` with a rank group: where this start stands among
        # the cache's prefetch starts (see `StartOrder`).
        self._order: StartOrder | None = None
        self._seq = 0
        self._priority = priority
        self._min_tokens = min_tokens
        self._agreed: int | None = None
        # The deepest node of the prefix this rank offered in its agreement, protected until
        # `ready()` returns, so it stays cached while the ranks agree on it.
        self._held: TreeNode | None = None
        self._agreeing = 0  # ready() calls in their agreement (they share one hold)
        self._keys = keys
        self._num_tokens = num_tokens
        self._request_id = request_id
        self._policy = policy
        self._status = PrefetchStatus.QUEUED
        self._device_tokens = 0
        self._host_tokens = 0
        self._storage_tokens = 0
        # Pages up to this one are to be read from storage: the prompt's end until `exists`
        # answers, then the end of the prefix it found (the rest counted as misses).
        self._read_end = len(keys)
        # Pages before this one, from the first match on, are in the counters (those from
        # `_read_end` on are too): the rest, when it finishes, were not reached. Set by its
        # first match; until then there is nothing to count.
        self._counted_to = len(keys)
        # `_read_end` was moved back to a page whose read just failed (see `_FailedReads`).
        self._cut_at_failed = False
        self._terminated = False
        # Seconds the caller already spent waiting for room in the queue: the `timeout`
        # policy's wait in `ready()` is what is left of its limit.
        self._waited = 0.0
        # When the `timeout` policy's wait ends, set by the first `ready()`: a later call
        # waits what is left of it, not a whole limit again, and the timeout counts once.
        self._deadline: float | None = None
        self._timed_out = False
        self._counted_live = False  # counted in the prefetcher's live prefetches
        self._in_queue = False  # holds a slot of the prefetcher's queue (see `_PrefetchQueue`)
        self._cancel_requested = False
        self._scope: anyio.CancelScope | None = None
        # Its `exists` call while in flight, which a terminate cuts short (see `_fetch`).
        self._lookup: anyio.CancelScope | None = None
        # The keys of this prefetch's storage call in flight (others may wait on them).
        self._reading: list[bytes] = []
        # The reads of others this prefetch waits on.
        self._waiting: list[_Flight] = []
        # Cancelled while others waited on its read, which went on for them.
        self._kept_for_others = False
        self._done = asyncio.Event()
        self._started = time.monotonic()

    # Read-only, `keys` a copy: the workers read these keys, count their pages against
    # `_read_end` and `_counted_to`, and set the status and figures; changed from outside,
    # the prefetch statistics would no longer add up and a queued one could end unfreed.
    @property
    def keys(self) -> list[bytes]:
        """A copy of the page keys being prefetched."""
        return list(self._keys)

    @property
    def num_tokens(self) -> int:
        """The prompt's length in tokens."""
        return self._num_tokens

    @property
    def request_id(self) -> str | None:
        """The id given to `start_prefetch`, if any."""
        return self._request_id

    @property
    def priority(self) -> int:
        """The priority the pages read are inserted with."""
        return self._priority

    @property
    def min_tokens(self) -> int | None:
        """Below this many uncached tokens the prefetch is skipped (None: the threshold)."""
        return self._min_tokens

    @property
    def status(self) -> PrefetchStatus:
        """Where the prefetch stands."""
        return self._status

    @property
    def device_tokens(self) -> int:
        """Tokens on the device when the prefetch started (cut to what is cached at its end)."""
        return self._device_tokens

    @property
    def host_tokens(self) -> int:
        """Tokens in the host pool when the prefetch started (cut likewise)."""
        return self._host_tokens

    @property
    def storage_tokens(self) -> int:
        """Tokens landed from storage for this prefetch so far."""
        return self._storage_tokens

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> PrefetchResult:
        """What has landed so far (final once `done()`)."""
        cached = self._device_tokens + self._host_tokens + self._storage_tokens
        return PrefetchResult(
            request_id=self._request_id,
            status=self._status,
            num_tokens=self._num_tokens,
            device_tokens=self._device_tokens,
            host_tokens=self._host_tokens,
            storage_tokens=self._storage_tokens,
            wait_s=time.monotonic() - self._started,
            agreed_tokens=cached if self._agreed is None else min(cached, self._agreed),
        )

    def _count_until(self, page: int) -> int:
        """Take the pages before `page` as counted, and return how many of them were in no
        counter yet: the caller adds that many to the counter they belong in.

        For pages counted once, however often they are planned again (those it reached
        without reading them, or left unread). Pages this prefetch reads or waits for count
        each time, as they come (`Prefetcher._get`, a shared run), and pass the same mark
        here only to say so, without using the number.
        """
        uncounted = max(page - self._counted_to, 0)
        self._counted_to = max(self._counted_to, page)
        return uncounted

    def _read_only_to(self, page: int) -> int:
        """End the prefix to read at `page` (never later than it ended), and return how many
        of the pages given up were in no counter yet: the caller adds that many to the
        counter they belong in (pages from `_read_end` on are counted by whoever moved it
        there; those below `_counted_to` were counted as they came, and are not again)."""
        uncounted = max(self._read_end - max(page, self._counted_to), 0)
        self._read_end = min(self._read_end, page)
        return uncounted

    def _gave_up(self) -> bool:
        """Terminated or cancelled: no further reads (a call, so a check after an await is
        not taken as settled by the one before it)."""
        return self._terminated

    def _stopped(self) -> PrefetchStatus:
        """The status of a prefetch that stops because it was asked to."""
        return PrefetchStatus.CANCELLED if self._cancel_requested else PrefetchStatus.TERMINATED

    def terminate(self) -> None:
        """Issue no further reads; what is in flight still lands. A prefetch still queued
        finishes TERMINATED at once, and its place in the queue is free again."""
        self._check_owner()
        self._terminated = True
        if self._lookup is not None:
            self._lookup.cancel()
        if self._prefetcher is not None:
            if self._in_queue:
                self._prefetcher._drop_queued(self, PrefetchStatus.TERMINATED)
            # A cancelled read kept going for this prefetch alone need not go on.
            self._prefetcher._unwanted(self)
            self._prefetcher._wake_budget_waiters()  # one of them may be this one

    def cancel(self) -> None:
        """Stop now: the read in flight is abandoned and its pages go back, unless other
        prefetches wait on it (they need the same pages): it then lands for them (or is
        abandoned once none of them still wants it: each has stopped waiting, or was
        terminated or cancelled), and no further read is issued.
        Either way the prefetch finishes CANCELLED. A prefetch still queued finishes
        CANCELLED at once, and its place in the queue is free again."""
        # Before the flags: from another thread the cancel scope cannot be cancelled (no
        # running loop there), and flags set before that failure would stop the prefetch
        # half-way, without its scope.
        self._check_owner()
        self._request_cancel()
        prefetcher = self._prefetcher
        if prefetcher is not None and prefetcher._shared_in_flight(self):
            # The last waiter to leave cancels the read (`Prefetcher._unwait`); if it lands
            # first, this prefetch still ends CANCELLED, as it would have without them.
            self._kept_for_others = True
            return
        self._cancel_scope()

    def _abort(self) -> None:
        """Cancel at once, the read in flight too, whoever waits on it (a detach or close)."""
        self._request_cancel()
        self._cancel_scope()

    def _request_cancel(self) -> None:
        self._cancel_requested = True
        self._terminated = True
        if self._prefetcher is not None:
            if self._in_queue:
                self._prefetcher._drop_queued(self, PrefetchStatus.CANCELLED)
            self._prefetcher._unwanted(self)
            self._prefetcher._wake_budget_waiters()

    def _cancel_scope(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    async def wait(self) -> PrefetchResult:
        """Wait until the prefetch has finished, whatever the policy."""
        self._check_owner()
        began = time.monotonic()
        await self._done.wait()
        self._observe(began)
        return self.result()

    def _check_owner(self) -> None:
        if self._owner is not None:
            self._owner.check()

    def _observe(self, began: float) -> None:
        if self._prefetcher is not None:
            self._prefetcher._cache.prefetch_wait.observe(time.monotonic() - began)

    async def ready(self) -> PrefetchResult:
        """Wait as the prefetch policy says, then report what arrived.

        `best_effort` takes what has landed now; `wait_complete` waits for everything;
        `timeout` waits up to base + per-1k-tokens x length (capped), then terminates. The
        result's status is the handle's at that moment: RUNNING when the wait stopped first
        (it finishes TERMINATED once the read in flight lands; `wait()`), TERMINATED when the
        prefetch was still queued (it finishes at once, and reads nothing).

        With a rank group, the ranks then agree on the tokens all of them have (one
        collective, entered whatever happened locally, cancellation included): see
        `PrefetchResult.agreed_tokens`. Every rank must call `ready()` for the same prefetches
        in the same order; the collective is tagged with the prompt's keys, so a mismatch
        fails (`AgreementMismatch`, logged; the result is then a miss) rather than pairing
        different prompts. Before entering it, a warmup running over the same group is asked
        to stop and waited for, so its collectives never interleave with this one. The prefix
        this rank offers stays protected (cached) until `ready()` returns: call
        `HiCache.request(..., max_cached_tokens=result.agreed_tokens)` right after it, with no
        await in between.
        """
        self._check_owner()
        group = self._group
        if group is None or group.size == 1:
            await self._wait_for_policy()
            return self.result()

        def broken() -> bool:
            try:
                return group.statistics().broken
            except Exception:  # a group that breaks the protocol: never a reason for 0 tokens
                return False

        async def mine() -> int:
            if broken():
                # The agreement fails at once (0 tokens, logged): waiting out the policy for
                # reads no rank will use would only hold the caller. None are issued now.
                self.terminate()
                await anyio.lowlevel.checkpoint()
                return 0
            # The policy wait is part of the local step, so a cancellation while waiting still
            # enters the collective (with 0) instead of leaving the peers in it.
            await self._wait_for_policy()
            return self._hold_cached()

        tag = self._agreement_tag()
        self._agreeing += 1
        try:
            self._agreed = await agree_min(
                group, mine, tag=tag, gate=BackgroundAgreements.of(group).wait_idle
            )
        except CollectiveError as exc:
            # A broken group: the ranks cannot agree, so none may use what it fetched.
            if self._cache is not None:
                self._cache._agreement_failed(exc, request_id=self._request_id)
            else:
                _log.warning(
                    "hicache.tp.agreement.failed", request_id=self._request_id, error=repr(exc)
                )
            self._agreed = 0
        finally:
            self._agreeing -= 1
            if not self._agreeing:  # another ready() on this handle still needs the hold
                self._release()
            if self._order is not None:
                # Entered: an agreement owed by a later start that was cancelled may be due.
                self._order.entered(self._seq)
                await self._order.pay()
        return self.result()

    def _agreement_tag(self) -> int:
        # The last key names the whole prefix (keys are chained).
        return agreement_tag("prefetch", self._num_tokens, *self._keys[-1:])

    async def _enter_unstarted(self) -> None:
        """In place of `ready()`, for a prefetch whose start was cancelled or failed (its
        caller never gets the handle to call `ready()` on): with a rank group, owe its
        agreement, entered with 0 in its place among the starts (see `StartOrder`), so the
        peers' `ready()` is neither left waiting nor paired with another prompt's."""
        if self._order is not None:
            await self._order.owe(self._seq, self._agreement_tag())

    def _hold_cached(self) -> int:
        """Protect the prefix cached now, and return its length in tokens: what
        this rank can still serve when the agreement returns."""
        cached = self._device_tokens + self._host_tokens + self._storage_tokens
        cache = self._cache
        if cache is None:
            return cached  # a handle made outside a cache: nothing to hold
        # Held without storage too: what this rank offers must be there once the ranks agree.
        self._release()  # a second, concurrent ready() on this handle: hold once, not twice
        if cache._state != "open":
            return 0
        here, self._held = cache._hold_prefix(self._keys)
        # Pages landed but since evicted are gone: offer only what is really there.
        return min(cached, here)

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None and self._cache is not None:
            self._cache._let_go(held)

    async def _wait_for_policy(self) -> None:
        if self._policy == "best_effort" or self._prefetcher is None:
            await anyio.lowlevel.checkpoint()
            if not self.done():
                self.terminate()
            return
        began = time.monotonic()
        if self._policy == "wait_complete":
            await self._done.wait()
            self._observe(began)
            return
        if self._deadline is None:
            limit = self._prefetcher.config.timeout_for(self._num_tokens) - self._waited
            self._deadline = began + max(0.0, limit)
        with anyio.move_on_after(max(0.0, self._deadline - began)):
            await self._done.wait()
        self._observe(began)
        if not self.done():
            self.terminate()
            if not self._timed_out:
                self._timed_out = True
                self._prefetcher.timeouts += 1

    def _finish(self, status: PrefetchStatus) -> None:
        if not self.done():
            self._status = status
            self._done.set()

    def __repr__(self) -> str:
        return (
            f"<PrefetchHandle {self._request_id or hex(id(self))} {self._status.value} "
            f"tokens={self._num_tokens} device={self._device_tokens} host={self._host_tokens} "
            f"storage={self._storage_tokens}>"
        )


class PrefetchStatistics(msgspec.Struct, frozen=True):
    """Counters of the prefetch worker."""

    submitted: int
    completed: int
    terminated: int
    cancelled: int
    skipped: int
    timeouts: int
    queued: int
    pages_read: int
    bytes_read: int
    pages_shared: int
    misses: int
    corrupt: int
    errors: int
    #: Pages a prefetch looked for and did not reach: it was stopped (terminated,
    #: cancelled, the host pool full, its prefix evicted), gave up after fruitless re-plans,
    #: or its keys repeat from that page on.
    pages_abandoned: int
    #: Pages storage holds of a prefetch skipped after its lookup (fewer than the threshold).
    pages_skipped: int
    host_pages_held: int
    host_pages_limit: int


class _Waiter:
    """A sender waiting in line for room in the prefetch queue."""

    __slots__ = ("admitted", "handle", "in_line", "left")

    def __init__(self, handle: PrefetchHandle, admitted: asyncio.Future[bool]) -> None:
        self.handle = handle
        #: True once admitted, False if the queue closed first.
        self.admitted = admitted
        #: still in the line: taken out only as it reaches the front, or at close.
        self.in_line = True
        #: its sender was cancelled while in line: a dead entry, skipped when it is reached.
        self.left = False


class _PrefetchQueue:
    """The sending side of the prefetch queue: room for `size` queued prefetches.

    A slot is held from admission until a worker takes the prefetch or it finishes while
    queued (cancelled or terminated), so a given-up prefetch frees its room at once even
    though its entry stays in the stream until a worker skips it or a compaction drops it.
    Senders that find no room wait in arrival order and are admitted as slots free up. A
    sender cancelled while waiting leaves a dead entry in the line, skipped when it reaches
    the front or dropped by a compaction once the dead outnumber the live, so neither an
    admission nor a cancellation searches the line.
    """

    def __init__(
        self,
        size: int,
        send: MemoryObjectSendStream[PrefetchHandle],
        receive: MemoryObjectReceiveStream[PrefetchHandle],
    ) -> None:
        self._size = size
        self._stream = send  # unbounded: room is counted here, in `queued`
        self._receive = receive  # for compaction only; workers read clones of it
        self._waiting: deque[_Waiter] = deque()
        self._dead = 0  # entries of `_waiting` whose sender left
        self._closed = False
        #: live prefetches holding a slot.
        self.queued = 0

    def send_nowait(self, handle: PrefetchHandle) -> None:
        """Admit `handle` if there is room and nobody waits for it before; else WouldBlock."""
        if len(self._waiting) > self._dead or self.queued >= self._size:
            raise anyio.WouldBlock
        self._admit(handle)

    async def send(self, handle: PrefetchHandle) -> None:
        """Admit `handle`, waiting for room in turn. Raises ClosedResourceError if the queue
        closes first. A cancellation that lands once it was admitted still raises, with
        `handle` queued: the caller must give it up."""
        await anyio.lowlevel.checkpoint()
        with contextlib.suppress(anyio.WouldBlock):
            self.send_nowait(handle)
            return
        if self._closed:
            raise anyio.ClosedResourceError
        waiter = _Waiter(handle, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        try:
            admitted = await waiter.admitted
        finally:
            if waiter.in_line:  # cancelled while waiting: admitted or refused ones are out
                self._leave(waiter)
        if not admitted:
            raise anyio.ClosedResourceError

    def _leave(self, waiter: _Waiter) -> None:
        # Left in the line, dead, rather than searched for: once the dead outnumber the
        # live, one pass drops them all, its cost spread over as many cancellations.
        waiter.admitted.cancel()  # done already, normally: the cancellation came through it
        waiter.left = True
        self._dead += 1
        if 2 * self._dead > len(self._waiting):
            self._waiting = deque(w for w in self._waiting if not w.left)
            self._dead = 0

    def _admit(self, handle: PrefetchHandle) -> None:
        self._stream.send_nowait(handle)  # raises if closed: then not admitted
        handle._in_queue = True
        self.queued += 1

    def release(self, handle: PrefetchHandle) -> None:
        """Free the slot of a queued `handle`: a worker took it, or it finished while queued
        (its entry is then dead)."""
        if not handle._in_queue:
            return
        handle._in_queue = False
        self.queued -= 1
        while self._waiting and self.queued < self._size:
            waiter = self._waiting.popleft()
            waiter.in_line = False
            if waiter.left:
                self._dead -= 1
                continue
            if waiter.admitted.done():
                continue  # its sender was cancelled and has not run since: it gives up
            try:
                self._admit(waiter.handle)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                waiter.admitted.set_result(False)
            else:
                waiter.admitted.set_result(True)
        # Buffered entries beyond the live ones are dead: at most `size` of them, so each
        # compaction's cost is spread over as many give-ups as it drops.
        if self._stream.statistics().current_buffer_used > self.queued + self._size:
            self._compact()

    def _compact(self) -> None:
        # Many prefetches given up while a worker is busy: drop their dead entries now
        # rather than when a worker reaches them, so the stream stays about `size` long.
        # Synchronous, and no receiver waits while entries are buffered, so every live one
        # goes back into the buffer, in order.
        if self._closed:
            return
        live = []
        with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            while True:
                handle = self._receive.receive_nowait()
                if handle._in_queue:
                    live.append(handle)
        for handle in live:
            self._stream.send_nowait(handle)

    def close(self) -> None:
        """Admit nothing more: those waiting for room fail with ClosedResourceError."""
        self._closed = True
        self._stream.close()
        waiting, self._waiting = self._waiting, deque()
        self._dead = 0
        for waiter in waiting:
            waiter.in_line = False
            if not waiter.admitted.done():
                waiter.admitted.set_result(False)


class Prefetcher:
    """Runs prefetch jobs from a bounded queue on a few cooperative worker tasks."""

    def __init__(
        self,
        cache: HiCache,
        backend: StorageBackend,
        config: PrefetchConfig,
        *,
        is_current: Callable[[], bool],
    ) -> None:
        self._cache = cache
        self._backend = backend
        # A prefetch can land after its backend was detached (its get had finished): the
        # pages are good, but they are no longer "in storage".
        self._is_current = is_current
        self.config = config
        send, self._receive = anyio.create_memory_object_stream[PrefetchHandle](
            max_buffer_size=math.inf
        )
        self._send = _PrefetchQueue(config.queue_size, send, self._receive)
        # Key -> the page being read, whose future says how the read ended (`_Shared`).
        # Concurrent prefetches wait on it instead of reading.
        self._inflight: dict[bytes, _Flight] = {}
        self._running: set[PrefetchHandle] = set()
        self._left = asyncio.Event()  # a prefetch left `_running` (see `wait_stopped`)
        self._closed = False
        # Live (request-driven) prefetches queued or running; warmup waits for zero.
        self._live = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        assert cache._host_pool is not None
        # From the decimal as written: 0.29 of 100 pages is 29, where the binary product is 28.
        self._host_limit = _times_ratio(cache._host_pool.num_pages, config.max_host_share)
        if config.max_host_share > 0:
            # A share of a small pool that rounds down to no page would silently end every
            # prefetch (and warmup read) unread: a positive share allows at least one page.
            self._host_limit = max(1, self._host_limit)
        self._held = 0
        #: What ended a worker, as soon as it did (`watch.failed_with`).
        self.watch = WorkerWatch()
        # Set, and replaced, when pages held for reads are let go or a prefetch is told to
        # stop: prefetches waiting for budget look again.
        self._budget_changed = asyncio.Event()
        # Prefetches waiting for budget, in the order they came: room goes to the first.
        self._budget_line: list[PrefetchHandle] = []
        # The one `_budget_room` just let through, whose plan follows in the same step.
        self._granted: PrefetchHandle | None = None
        # Long prefetches running whose keys were found distinct up to where they read (which
        # only comes closer), so their later plans do not look again; each leaves as it ends.
        self._distinct: set[PrefetchHandle] = set()
        self.submitted = self.completed = self.terminated = self.cancelled = 0
        self.skipped = self.timeouts = self.pages_read = self.bytes_read = 0
        self.pages_shared = self.misses = self.corrupt = self.errors = 0
        self.pages_abandoned = self.pages_skipped = 0
        # Per attach: a detach forgets what failed with the backend it had.
        self.failed_reads = _FailedReads(config.failed_read_window_s, config.failed_read_keys)
        # A store that fails every call would otherwise log once per prefetch or batch.
        self._log_limit = LogLimiter()

    # -- submission and workers -------------------------------------------------------------

    async def submit(self, handle: PrefetchHandle) -> None:
        """Queue a prefetch; waits while the queue is full (a live request's prefetch waits).

        Under the `timeout` policy the wait for room counts against the policy's limit, and a
        prefetch that finds none in time finishes TERMINATED without reading (a miss); under
        `best_effort` a full queue is a miss at once.
        """
        self.submitted += 1
        self._live += 1
        handle._counted_live = True
        self._quiet.clear()
        policy = handle._policy
        began = time.monotonic()
        if self._first_read_failed(handle):
            # Ended at once (`_fetch`, without an await), not queued for a worker that a
            # hanging store may hold for a whole `io_timeout_s`: the failure would be
            # forgotten by then, and the page read again.
            try:
                await self._process(handle)
            finally:
                self._live_done(handle)
            return
        try:
            if policy == "wait_complete":
                await self._send.send(handle)
                return
            await anyio.lowlevel.checkpoint()
            with contextlib.suppress(anyio.WouldBlock):
                self._send.send_nowait(handle)
                return
            limit = 0.0 if policy == "best_effort" else self.config.timeout_for(handle.num_tokens)
            with anyio.move_on_after(limit):
                await self._send.send(handle)
                handle._waited = time.monotonic() - began
                return
            # No room before the caller's limit. A slot may still have freed up for it as
            # the limit passed: `terminate()` then finishes it at once, counted, and the worker
            # drops it uncounted. One a worker took already (running) reads nothing more and
            # is counted by the worker.
            if handle.status is PrefetchStatus.QUEUED:
                self.timeouts += policy == "timeout"
            handle.terminate()
            if handle.status is PrefetchStatus.QUEUED:
                self._ended(handle, PrefetchStatus.TERMINATED)
            self._live_done_unless_running(handle)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            # Storage was detached while this prefetch waited for the queue: a miss.
            self._live_done(handle)
            self._ended(handle, PrefetchStatus.CANCELLED)
        except BaseException:
            # Counted here, once: should it be in the queue after all, `cancel()` finishes
            # it (counted) and the worker drops it without counting it again. One a worker
            # took already (running) is counted by the worker.
            handle.cancel()
            if handle.status is PrefetchStatus.QUEUED:
                self._ended(handle, PrefetchStatus.CANCELLED)
            self._live_done_unless_running(handle)
            raise

    def _first_read_failed(self, handle: PrefetchHandle) -> bool:
        """Whether the first page `handle` has to read is one whose read just failed."""
        if not self.failed_reads:
            return False
        keys = handle._keys
        found = self._cache._tree.match(keys, touch=False)
        start = found.num_device_pages + found.num_host_pages
        return self.failed_reads.first(keys[start : start + 1], self._inflight) == 0

    def _drop_queued(self, handle: PrefetchHandle, status: PrefetchStatus) -> None:
        """Finish a prefetch given up while queued: counted once, here; its slot is free at
        once and a worker reaching its entry skips it (it is done)."""
        self._send.release(handle)
        self._ended(handle, status)
        self._live_done(handle)

    def _ended(self, handle: PrefetchHandle, status: PrefetchStatus) -> None:
        """Finish `handle` with `status` and count it in that status's counter. The caller
        makes sure nothing ended it before: a handle already done keeps its status, but
        would be counted again."""
        if handle._status is PrefetchStatus.QUEUED and status in _STOPPED:
            # Ended before a worker took it: no first match set its figures, so its pages
            # are counted here, as those of a prefetch stopped before its lookup.
            self.pages_abandoned += self._unstarted_pages(handle)
        handle._finish(status)
        if status is PrefetchStatus.COMPLETE:
            self.completed += 1
        elif status is PrefetchStatus.TERMINATED:
            self.terminated += 1
        elif status is PrefetchStatus.SKIPPED:
            self.skipped += 1
        else:
            self.cancelled += 1

    def _unstarted_pages(self, handle: PrefetchHandle) -> int:
        """The pages a prefetch that never started would have looked for had it started
        now: those not cached, none if they are fewer tokens than its threshold (it would
        have been skipped before any lookup, outside the balance)."""
        keys = handle._keys
        found = self._cache._tree.match(keys, touch=False)
        uncached = len(keys) - found.num_device_pages - found.num_host_pages
        threshold = self.config.threshold_tokens if handle.min_tokens is None else handle.min_tokens
        if uncached * self._cache.config.page_size < max(threshold, 1):
            return 0
        return uncached

    def _live_done_unless_running(self, handle: PrefetchHandle) -> None:
        # A worker that took the handle is still reading into the host pool: warmup must go
        # on yielding until it stops, and the worker marks it done then.
        if handle not in self._running:
            self._live_done(handle)

    def _live_done(self, handle: PrefetchHandle) -> None:
        if not handle._counted_live:
            return
        handle._counted_live = False
        self._live -= 1
        if self._live == 0:
            self._quiet.set()

    async def wait_quiet(self) -> None:
        """Wait until no live prefetch is queued or running (warmup yields to them)."""
        await self._quiet.wait()

    async def run_now(self, handle: PrefetchHandle) -> None:
        """Run a (warmup) prefetch in the caller's task, outside the queue; after `close()`
        it finishes as CANCELLED at once."""
        self.submitted += 1
        await self._process(handle)

    async def wait_stopped(self) -> None:
        """Wait until no prefetch runs: after `close()`, those running in their callers'
        tasks (`run_now`) end at their next step."""
        while self._running:
            # Set as each one leaves `_running`: a handle's own `done` may be set before it
            # leaves, and waiting on that would not yield.
            self._left.clear()
            await self._left.wait()

    async def run(self) -> None:
        """The worker tasks; returns when the queue is closed and drained, or cancelled."""
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self.config.workers):
                    tg.start_soon(self.watch.run, self._work, self._receive.clone())
        finally:
            # Whatever is still queued when the workers stop finishes as CANCELLED, so no
            # caller waits on it forever; only then is the queue closed. Closed first, even
            # without a close() (the link's task cancelled): nothing more is accepted.
            self.close()
            self.cancel_queued()
            self._receive.close()

    async def _work(self, receive: anyio.abc.ObjectReceiveStream[PrefetchHandle]) -> None:
        async with receive:
            async for handle in receive:
                self._send.release(handle)
                try:
                    await self._process(handle)
                finally:
                    self._live_done(handle)

    def close(self) -> None:
        """Accept no more prefetches; cancel those queued or running."""
        self._closed = True
        self._send.close()
        for handle in list(self._running):
            handle._abort()

    def cancel_queued(self) -> None:
        """Cancel every prefetch still waiting in the queue (they finish as CANCELLED)."""
        while True:
            try:
                handle = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            self._send.release(handle)
            if not handle.done():
                self._ended(handle, PrefetchStatus.CANCELLED)
            self._live_done(handle)

    def discard(self) -> None:
        """For a prefetcher whose worker never ran (its backend did not open): cancel what
        is queued and close both ends of the queue."""
        self.close()
        self.cancel_queued()
        self._receive.close()

    def statistics(self) -> PrefetchStatistics:
        return PrefetchStatistics(
            submitted=self.submitted,
            completed=self.completed,
            terminated=self.terminated,
            cancelled=self.cancelled,
            skipped=self.skipped,
            timeouts=self.timeouts,
            queued=self._send.queued,
            pages_read=self.pages_read,
            bytes_read=self.bytes_read,
            pages_shared=self.pages_shared,
            misses=self.misses,
            corrupt=self.corrupt,
            errors=self.errors,
            pages_abandoned=self.pages_abandoned,
            pages_skipped=self.pages_skipped,
            host_pages_held=self._held,
            host_pages_limit=self._host_limit,
        )

    # -- one prefetch -----------------------------------------------------------------------

    async def _process(self, handle: PrefetchHandle) -> None:
        if handle.done():
            return  # given up while queued, or its submit gave up on room: counted then
        # Closed: a detach in progress (the cache is still open then), which cancels every
        # prefetch, this one included if a worker took it just before.
        if handle._cancel_requested or self._closed or self._cache._state != "open":
            self._ended(handle, PrefetchStatus.CANCELLED)
            return
        if handle._terminated:
            # Given up before it started without passing through the queue (which finishes
            # those at once): no read of it would be used.
            self._ended(handle, PrefetchStatus.TERMINATED)
            return
        handle._status = PrefetchStatus.RUNNING
        self._running.add(handle)
        status = PrefetchStatus.CANCELLED
        try:
            with anyio.CancelScope() as scope:
                handle._scope = scope
                status = await self._fetch(handle)
        except Exception as exc:  # a bug or an unexpected backend failure: never kill the worker
            status = PrefetchStatus.TERMINATED
            # Pages, as in the other cases: those it was to read and that are in no counter
            # yet (one read but not landed is in `pages_read` already).
            self.errors += handle._count_until(handle._read_end)
            self._warn("hicache.prefetch.failed", exc, request_id=handle.request_id)
        finally:
            # Whatever stopped it: the pages it was to read and did not reach.
            self.pages_abandoned += handle._count_until(handle._read_end)
            self._running.discard(handle)
            # Not kept until another prefetch plans: the handle holds its keys and pages.
            self._distinct.discard(handle)
            self._left.set()
            handle._scope = None
            self._report_only_cached(handle)
            # Counted here: a prefetch cancelled from outside (a detach) counts too.
            self._ended(handle, status)

    def _warn(self, event: str, exc: Exception, **fields: object) -> None:
        """Log a failed backend call: each kind of error at once, a repeated one at most
        once a minute (`unlogged_since_last` tells how many were left out, and for a call
        about `pages`, `unlogged_pages_since_last` how many pages they were about)."""
        error = describe_error(exc, self.config.io_timeout_s)
        if "pages" in fields:
            self._log_limit.warn_tallied(
                _log, event, error, "pages", backend=self._backend.name, **fields
            )
        else:
            self._log_limit.warn(_log, event, error, backend=self._backend.name, **fields)

    def _report_only_cached(self, handle: PrefetchHandle) -> None:
        """Cut what `handle` reports to what is cached now: the first match's pages, or
        pages landed since, may have been evicted meanwhile (newest figures first)."""
        cache = self._cache
        found = cache._tree.match(handle._keys, touch=False)
        here = (found.num_device_pages + found.num_host_pages) * cache.config.page_size
        excess = handle.device_tokens + handle.host_tokens + handle.storage_tokens - here
        cut = min(max(excess, 0), handle.storage_tokens)
        handle._storage_tokens -= cut
        excess -= cut
        cut = min(max(excess, 0), handle.host_tokens)
        handle._host_tokens -= cut
        excess -= cut
        handle._device_tokens -= min(max(excess, 0), handle.device_tokens)

    async def _fetch(self, handle: PrefetchHandle) -> PrefetchStatus:
        cache = self._cache
        tree = cache._tree
        size = cache.config.page_size
        keys = handle._keys
        found = tree.match(keys, touch=False)
        handle._device_tokens = found.num_device_pages * size
        handle._host_tokens = found.num_host_pages * size
        start = handle._counted_to = found.num_device_pages + found.num_host_pages
        if start == len(keys):
            return PrefetchStatus.COMPLETE  # everything is cached already
        threshold = self.config.threshold_tokens if handle.min_tokens is None else handle.min_tokens
        threshold = max(threshold, 1)
        if (len(keys) - start) * size < threshold:
            handle._read_end = start  # too short to look for: in no counter
            return PrefetchStatus.SKIPPED
        if handle._gave_up():
            return PrefetchStatus.TERMINATED
        if self.failed_reads.first(keys[start : start + 1], self._inflight) == 0:
            # Its first page's read just failed: nothing to read, nothing to look up.
            self.misses += handle._read_only_to(start)
            handle._cut_at_failed = True
            return PrefetchStatus.TERMINATED
        try:
            # A prefetch terminated meanwhile (its caller's wait ran out) would drop the
            # answer: its lookup is cut short, so that a store slow to answer for some keys
            # does not hold a worker, and the prefetches queued behind it, for as long.
            with anyio.CancelScope() as lookup:
                handle._lookup = lookup
                with anyio.fail_after(self.config.io_timeout_s):
                    answer = await self._backend.exists(
                        self._cache.namespace.storage_keys(keys[start:])
                    )
            if lookup.cancelled_caught:
                return handle._stopped()  # its pages count as not reached
            existing = check_exists(answer, len(keys) - start)
        except Exception as exc:
            # Pages, as everywhere in these counters: the ones that could not be looked up.
            self.errors += handle._read_only_to(start)
            self._warn("hicache.prefetch.exists.failed", exc, request_id=handle.request_id)
            return PrefetchStatus.SKIPPED
        finally:
            handle._lookup = None
        self.misses += handle._read_only_to(start + existing)  # asked of storage, not there
        if existing * size < threshold:
            self.pages_skipped += handle._read_only_to(start)
            return PrefetchStatus.SKIPPED
        if handle._gave_up():  # meanwhile
            return handle._stopped()
        fruitless = 0
        # A plan per page and a few more: bounded however often others give up under it.
        for _ in range(len(keys) + _REPLANS):
            before = handle.storage_tokens
            status = await self._read(handle, handle._read_end)
            if isinstance(status, PrefetchStatus):
                return status
            if status is _Again.BUDGET:
                if not await self._budget_room(handle):
                    return handle._stopped() if handle._gave_up() else PrefetchStatus.TERMINATED
                continue
            # Plan again, and read what was given up. A plan that brought pages, or whose
            # reader stopped on request (a timeout, a cancelled caller), does not use up one:
            # a prefetch sharing with readers that give up in turn still reads everything.
            if handle.storage_tokens <= before and status is _Shared.DROPPED:
                fruitless += 1
                if fruitless == _REPLANS:
                    break
        return PrefetchStatus.TERMINATED

    async def _budget_room(self, handle: PrefetchHandle) -> bool:
        """Wait until the host budget has room for a page and `handle` is first in line
        for it; False once `handle` was told to stop, or if no room can ever come (a
        budget of no pages).

        In line: a prefetch back for its next turn goes behind those that waited while it
        read, so prefetches larger than the budget take turns, and a small one started
        meanwhile is not held until a large one has read everything.
        """
        if self._host_limit == 0 or handle._gave_up():
            return False
        if self._held < self._host_limit and not self._budget_line:
            return True
        self._budget_line.append(handle)
        try:
            while not (self._budget_line[0] is handle and self._held < self._host_limit):
                if handle._gave_up():
                    return False
                await self._budget_changed.wait()
            if handle._gave_up():
                return False
            self._granted = handle
            return True
        finally:
            self._budget_line.remove(handle)
            self._wake_budget_waiters()  # the next in line looks again

    def _wake_budget_waiters(self) -> None:
        changed, self._budget_changed = self._budget_changed, asyncio.Event()
        changed.set()

    def _shared_in_flight(self, handle: PrefetchHandle) -> bool:
        """Whether another prefetch, not given up, waits on a page of `handle`'s storage
        call in flight."""
        return any(
            flight.wanted()
            for flight in (self._inflight.get(key) for key in handle._reading)
            if flight is not None and flight.reader is handle
        )

    def _unwait(self, flight: _Flight, waiter: PrefetchHandle) -> None:
        """`waiter` no longer waits on `flight`: its reader, cancelled but kept reading for
        its waiters, stops now if no one else wants the read."""
        flight.waiters.discard(waiter)
        self._let_go(flight.reader)

    def _unwanted(self, waiter: PrefetchHandle) -> None:
        """`waiter` gave up (it still waits until its reads end): readers kept going only
        for it stop now."""
        for flight in waiter._waiting:
            self._let_go(flight.reader)

    def _let_go(self, reader: PrefetchHandle) -> None:
        if reader._cancel_requested and not self._shared_in_flight(reader):
            reader._cancel_scope()

    async def _read(self, handle: PrefetchHandle, end: int) -> PrefetchStatus | _Shared | _Again:
        """Read keys[cached:end] into the host pool, landing batches as they arrive.

        Returns how a page another prefetch was reading was given up (STOPPED, DROPPED)
        while this one goes on: the caller plans again, and this prefetch reads that page
        itself. Returns `_Again.BUDGET` when the host budget cut the plan short: the caller
        plans the rest once there is room; `_Again.MORE` when the plan took on as many pages
        as one may and read them: the caller plans the rest at once. A page storage did not
        deliver to that prefetch (FAILED) ends this one as it ended that one, with what it
        has: it is not asked for again.
        """
        if handle._gave_up():
            return handle._stopped()
        cache = self._cache
        tree = cache._tree
        host = cache._host_pool
        assert host is not None
        size = cache.config.page_size
        keys = handle._keys
        # A chain never repeats a key; keys that do (a forged manifest entry) would give one
        # host page two places in the tree. Read no further than the first repeat.
        if handle not in self._distinct:
            if len(set(keys[:end])) < end:
                seen: set[bytes] = set()
                repeat = 0
                while keys[repeat] not in seen:
                    seen.add(keys[repeat])
                    repeat += 1
                self.pages_abandoned += handle._read_only_to(repeat)
                end = handle._read_end
            if end > _PLAN_PAGES:  # read in several plans
                self._distinct.add(handle)
        # Re-plan after the await: others may have brought pages meanwhile.
        found = tree.match(keys, touch=False)
        begin = found.num_device_pages + found.num_host_pages
        # Pages past the first match, in pages: cached then (`device_tokens`, `host_tokens`)
        # and at most the rest of the prompt from storage, so a page counts once.
        first = (handle.device_tokens + handle.host_tokens) // size
        cap = len(keys) - first
        # What became cached since the first match (while `exists` ran, before this plan:
        # landed by others, and maybe loaded to the device by a request since) is cached for
        # this prompt as much as what this prefetch lands itself. (Which of it a request
        # computed rather than storage delivered, the tree cannot tell.)
        counted = handle.storage_tokens // size
        landed = min(max(counted, begin - first), cap)
        # Pages cached by others since the first match: this prefetch did not read them, and
        # would have waited for them had it planned a moment earlier. Only up to `end`: those
        # past what storage holds were counted as misses at the lookup. Only those past the
        # pages in its counters (every page it read is): `landed` also grows with pages it
        # reads again once evicted, which no one shared.
        self.pages_shared += handle._count_until(min(begin, end))
        handle._storage_tokens = landed * size
        failing = self.failed_reads.first(keys[begin:end], self._inflight)
        if failing is not None:
            # Read no further than a page whose read just failed: the rest are misses, but
            # for those it read before and lost since (in the counters already).
            self.misses += handle._read_only_to(begin + failing)
            end = handle._read_end
            handle._cut_at_failed = True
        finished = PrefetchStatus.TERMINATED if handle._cut_at_failed else PrefetchStatus.COMPLETE
        if begin >= end:
            return finished
        batch_limit = max(
            1, min(self.config.batch_pages, self._backend.capabilities.max_batch_pages)
        )
        span = max(_PLAN_PAGES, len(keys) // _PLAN_PARTS, batch_limit)
        todo = keys[begin : min(end, begin + span - span % batch_limit)]
        planned = len(todo)
        # Take the anchor first: allocating host pages below may evict, and must not take
        # the prefix these pages will hang from. Protecting it keeps the whole prefix in the
        # tree; its device pages are not locked: a request's allocation may still take them
        # (they leave for the host, or are backed up there first), and a read that can last
        # up to io_timeout_s must not make a lone request fail with OutOfPagesError.
        anchor: TreeNode = found.host_node
        tree.protect_host(anchor)
        # Pages another prefetch is reading: wait on its flights (captured now, since it
        # forgets them once they land), never read them twice.
        others = {k: self._inflight[k] for k in todo if k in self._inflight}
        own = [k for k in todo if k not in others]
        budget = max(0, self._host_limit - self._held)
        if self._budget_line and self._granted is not handle:
            # Those waiting for room go first: a plan that needs some waits in line behind
            # them (`_Again.BUDGET` below), one reading nothing of its own goes on.
            budget = 0
        self._granted = None
        if len(own) > budget:
            # Stop the plan before the first page beyond the budget.
            cut = self._cut(todo, budget)
            todo, own = todo[:cut], own[:budget]
        # A full pool (nothing more to evict) ends the prefetch with what it has; a budget
        # taken by reads in flight only defers the rest.
        pool_full = False
        pages = cache._try_alloc_host(len(own))
        if pages is None:
            assert cache._host_pool is not None
            spare = cache._host_pool.allocator.free_count
            pages = cache._host_pool.allocator.alloc(spare) or []
            cut = self._cut(todo, len(pages))
            todo, own = todo[:cut], own[: len(pages)]
            pool_full = True
        cut_short: PrefetchStatus | _Again = (
            PrefetchStatus.TERMINATED
            if pool_full
            else _Again.BUDGET
            if len(todo) < planned
            else _Again.MORE
        )
        if not todo:
            cache._host_free(pages)
            tree.unprotect_host(anchor)
            return cut_short
        # Cut by the host budget or a full pool: what it reads is not all storage had.
        short = begin + len(todo) < end
        # Counted as a waiter of each until it passes it or leaves: a cancelled reader keeps
        # reading a batch someone waits on (see `PrefetchHandle.cancel`).
        waiting = {k: others[k] for k in todo if k in others}
        for flight in waiting.values():
            flight.waiters.add(handle)
        handle._waiting = list(waiting.values())
        loop = asyncio.get_running_loop()
        # The storage calls, planned now so those who come to wait on a page find its
        # batch: each run of own pages cut every `batch_limit` pages from its start.
        flights: dict[bytes, _Flight] = {}
        read: _Read | None = None
        for key in todo:
            if key in waiting:
                read = None
                continue
            if read is None or len(read.keys) == batch_limit:
                read = _Read(loop.create_future())
            read.keys.append(key)
            read.unsettled += 1
            flights[key] = self._inflight[key] = _Flight(read, handle)
        page_of = dict(zip(own, pages, strict=True))
        self._held += len(pages)
        own_landed = 0
        failed: set[bytes] = set()  # own pages storage did not deliver
        given_up = _Shared.STOPPED  # what an own page not landed tells those waiting on it
        status: PrefetchStatus | _Shared | _Again = cut_short if short else finished
        try:
            pos = 0
            while pos < len(todo):
                if handle._terminated:
                    status = handle._stopped()
                    break
                key = todo[pos]
                if key not in flights:
                    flight = others[key]
                    await asyncio.shield(flight.read.future)
                    outcome = flight.outcome
                    assert outcome is not None  # its batch's future is set once all have one
                    if outcome is not _Shared.LANDED:
                        if outcome is _Shared.FAILED:
                            # Not read again: this page and the rest are misses, as for a
                            # prefetch planned just after that read failed (`_FailedReads`).
                            # Not those it read before and lost since (in the counters).
                            self.misses += handle._count_until(end)
                            status, given_up = PrefetchStatus.TERMINATED, _Shared.DROPPED
                        elif handle._gave_up():
                            status = handle._stopped()
                        else:
                            status = given_up = outcome
                        break
                    # Every page of the run landed with it: take them together.
                    run = pos + 1
                    while run < len(todo) and todo[run] in waiting:
                        if waiting[todo[run]].outcome is not _Shared.LANDED:
                            break
                        run += 1
                    for k in todo[pos:run]:
                        self._unwait(waiting.pop(k), handle)
                    # Hold them as own pages are held (`_land`): their reader lets go of
                    # them when it ends, and the pages after them must have them to attach.
                    # From the protected anchor on, not the whole prefix again for every run.
                    reached = tree.descend(anchor, keys[begin + pos : begin + run])
                    if reached is None:
                        # Evicted before this prefetch could hold them: plan again.
                        status = given_up = _Shared.DROPPED
                        break
                    tree.move_protection(anchor, reached)
                    anchor = reached
                    self.pages_shared += run - pos  # each time it waits for them
                    handle._count_until(begin + run)
                    landed = min(landed + run - pos, cap)
                    handle._storage_tokens = landed * size  # what ready() reports meanwhile
                    pos = run
                    continue
                # An own page starts a planned batch: the ones before it all landed.
                batch = flights[key].read.keys
                after = begin + pos + len(batch)  # the first page past the batch
                handle._reading = batch
                try:
                    outcomes = await self._get(batch, [page_of[k] for k in batch])
                finally:
                    handle._reading = []
                # Every page of the batch is in a counter now (by its outcome).
                handle._count_until(after)
                ok = 0
                while ok < len(batch) and outcomes[ok] is Outcome.OK:
                    ok += 1
                if ok:
                    extended = self._land(
                        batch[:ok], priority=handle.priority, page_of=page_of, anchor=anchor
                    )
                    if extended is None:
                        # The prefix was evicted (what is reported is cut below).
                        status, given_up = PrefetchStatus.TERMINATED, _Shared.DROPPED
                        break
                    anchor = extended
                    for k in batch[:ok]:
                        del page_of[k]
                        flights.pop(k).settle(_Shared.LANDED)
                        self._inflight.pop(k, None)
                    landed = min(landed + ok, cap)
                    own_landed += ok
                    handle._storage_tokens = landed * size  # what ready() reports meanwhile
                pos += ok
                if ok < len(batch):
                    failed.update(
                        k for k, o in zip(batch, outcomes, strict=True) if o is not Outcome.OK
                    )
                    # Not a MISS, which a backup may fill a moment later, nor a CORRUPT page
                    # (removed): a store that failed may fail again at once.
                    self.failed_reads.add(
                        [k for k, o in zip(batch, outcomes, strict=True) if o is Outcome.ERROR]
                    )
                    # The pages after the batch are left unread: errors after a failed page,
                    # misses after one storage lacks or found damaged (the prefix ends there).
                    # Not those read before and evicted since (a batch read again): they are
                    # in the counters already.
                    unreached = handle._count_until(end)
                    if outcomes[ok] is Outcome.ERROR:
                        self.errors += unreached
                    else:
                        self.misses += unreached
                    status, given_up = PrefetchStatus.TERMINATED, _Shared.DROPPED
                    break
        except BaseException:
            status, given_up = PrefetchStatus.CANCELLED, _Shared.STOPPED
            raise
        finally:
            # Sync cleanup: every page not landed goes back, every waiter learns the outcome.
            handle._waiting = []
            for flight in waiting.values():
                self._unwait(flight, handle)
            leftover = list(page_of.values())
            self._held -= len(pages)
            if pages:
                self._wake_budget_waiters()
            cache._host_free(leftover)
            for k, flight in flights.items():
                flight.settle(_Shared.FAILED if k in failed else given_up)
                if self._inflight.get(k) is flight:
                    del self._inflight[k]
            tree.unprotect_host(anchor)
            # What is evicted by the end is cut once, when the prefetch finishes
            # (`_report_only_cached`).
            handle._storage_tokens = landed * size
            # Only what this prefetch read: a shared page counts for the one that read it.
            cache._counters.tokens_storage += own_landed * size
        if handle._kept_for_others and isinstance(status, PrefetchStatus):
            # Cancelled while its last batch was kept going for others: it still ends as
            # it was asked to. (A cancel after its last read, a detach's, finds it done.)
            return PrefetchStatus.CANCELLED
        if (
            status is PrefetchStatus.COMPLETE
            and handle._terminated
            and not handle._cancel_requested
        ):
            # Terminated (a timeout, best_effort) while its last read was in flight: it ends
            # as it was asked to, so wait() tells every timeout. (A cancel too late to stop
            # that read, a detach's, finds it complete.)
            return PrefetchStatus.TERMINATED
        return status

    def _cut(self, todo: list[bytes], allowed_own: int) -> int:
        """Length of the longest prefix of `todo` that needs at most `allowed_own` own reads."""
        count = 0
        for i, key in enumerate(todo):
            if key not in self._inflight:
                if count == allowed_own:
                    return i
                count += 1
        return len(todo)

    async def _get(self, keys: list[bytes], pages: list[int]) -> list[Outcome]:
        host = self._cache._host_pool
        assert host is not None
        into = [host.page_segments(p) for p in pages]
        began = time.monotonic()
        try:
            with anyio.fail_after(self.config.io_timeout_s):
                namespace = self._cache.namespace
                outcomes = await self._backend.get(
                    namespace.storage_keys(keys), into, namespace=namespace.fingerprint
                )
            check_outcomes(outcomes, len(keys), "get")
            if Outcome.OK in outcomes:  # a call that read nothing says nothing of speed
                self._cache.storage_get_latency.observe(time.monotonic() - began)
        except Exception as exc:
            self.errors += len(keys)
            self._warn("hicache.prefetch.get.failed", exc, pages=len(keys))
            return [Outcome.ERROR] * len(keys)
        for outcome in outcomes:
            if outcome is Outcome.OK:
                self.pages_read += 1
                self.bytes_read += host.page_nbytes
            elif outcome is Outcome.MISS:
                self.misses += 1
            elif outcome is Outcome.CORRUPT:
                self.corrupt += 1
            else:
                self.errors += 1
        return outcomes

    def _land(
        self,
        batch: list[bytes],
        *,
        priority: int,
        page_of: dict[bytes, int],
        anchor: TreeNode,
    ) -> TreeNode | None:
        """Insert verified pages under `anchor`, the protected node that ends the cached
        prefix they continue (splits keep it as the suffix, so it still ends there); one sync
        step, in proportion to the batch: matching the whole prefix again for every batch
        made landing a long prompt quadratic in its length."""
        tree = self._cache._tree
        if anchor is not tree.root and anchor.parent is None:
            # Cannot happen while it is protected; if it was removed all the same, these
            # pages have nothing to attach to.
            return None
        pages = [page_of[k] for k in batch]
        result = tree.insert(batch, host_pages=pages, under=anchor, priority=priority)
        self._cache._host_free(result.duplicate_host_pages)
        if self._is_current():
            for node in self._cache._path(result.node, len(batch)):
                tree.mark_in_storage(node)
        tree.move_protection(anchor, result.node)
        return result.node
