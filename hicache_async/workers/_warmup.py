"""Warmup: load the most valuable prefixes of a shared store into a cold host pool.

It reads the backend's manifest (bounded), agrees with the other tensor-parallel ranks on the
prefixes of its entries they all hold (see `_offers` and `_longest_shared`), and loads them by
priority then recency through the prefetch path, one at a time and only while no live
prefetch is waiting (it waits for them no longer than its deadline), until the host budget,
the deadline, a detach or the cache's close stops it.

With a rank group, after the agreements on the entries (the same number on every rank), each
entry costs exactly two collectives on every rank whatever happens
locally: one to agree to go on, one to agree on how many pages every rank has; a rank that
loaded more than the others drops the excess so every rank ends with the same tree. Each
collective is tagged with what it agrees on (the step and the entry). A warmup cancelled
between its collectives still enters the rest of the current entry's, contributing "stop"
(the pages it holds of the entry, without loading more), and applies the trim they agree on
before it re-raises, so no peer is left waiting and every
rank keeps the same pages. A request agreement that arrives meanwhile asks the warmup to stop
(`BackgroundAgreements`): the next "go on?" agreement then stops it on every rank at the same
entry, and the request agrees after it.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import msgspec
import structlog

from .._config import _times_ratio
from ..distributed import (
    BackgroundAgreements,
    CollectiveError,
    RankGroup,
    agree_entries,
    agree_min,
    agreement_tag,
    run_uncancelled,
)
from ..storage._manifest import ManifestEntry, ManifestRead, SupportsManifest, covered_key
from ._prefetch import PrefetchHandle, PrefetchStatus

if TYPE_CHECKING:
    from .._cache import HiCache
    from ._link import StorageLink

__all__ = ["WarmupResult", "WarmupStatus", "Warmer"]

_log = structlog.get_logger("hicache_async")


class WarmupStatus(enum.Enum):
    """Why a warmup ended.

    `COMPLETE`: every agreed entry was tried. `BUDGET`: it loaded its share of the host
    pool. `DEADLINE`: its deadline passed (reading the manifest counts). `STOPPED`: a
    detach, the cache's close, `stop`, a cancellation, another rank stopping, a request
    agreement on the rank group or a failed agreement. `MANIFEST_FAILED`: the manifest could
    not be read (a storage fault, logged as `hicache.warmup.manifest.failed`), so nothing was
    loaded. `UNSUPPORTED`: the backend keeps no manifest. `NO_STORAGE`: none is attached.
    """

    COMPLETE = "complete"
    BUDGET = "budget"
    DEADLINE = "deadline"
    STOPPED = "stopped"
    MANIFEST_FAILED = "manifest_failed"
    UNSUPPORTED = "unsupported"
    NO_STORAGE = "no_storage"


class WarmupResult(msgspec.Struct, frozen=True):
    """What a warmup read, agreed on and loaded."""

    status: WarmupStatus
    entries_read: int = 0
    #: entries to load: with a rank group, the prefixes every rank holds (see `_offers`)
    entries_agreed: int = 0
    entries_loaded: int = 0
    pages_loaded: int = 0
    malformed: int = 0
    oversized: int = 0
    seconds: float = 0.0
    #: entries tried that are not wholly cached after it: storage lacked pages of them (gone,
    #: damaged, or another deployment's), or their read failed
    entries_missed: int = 0
    #: manifest records of a newer format version than this instance knows: left in place for
    #: the instances that know it, never loaded (a rolling upgrade's older instances count them;
    #: on Mooncake a namespace whose index is of a newer layout counts once)
    newer: int = 0


class BackgroundCount:
    """One warmup's count on its group's `BackgroundAgreements`: begun when made, ended by
    the first `end()` (later ones do nothing), so every `begin` pairs with exactly one `end`
    whichever of its holders ends it."""

    def __init__(self, background: BackgroundAgreements) -> None:
        background.begin()
        self._background: BackgroundAgreements | None = background

    @property
    def background(self) -> BackgroundAgreements | None:
        """What this count is on; None once ended."""
        return self._background

    def end(self) -> None:
        """End the count, if not ended yet."""
        background, self._background = self._background, None
        if background is not None:
            background.end()


#: In a link's warmup task, the count `StorageLink.start_warmup` took for the warmup before
#: the task ran; the `Warmer` the task runs takes it over instead of counting itself again.
#: A context variable, so a warmup started from any other task never takes it.
scheduled_count: contextvars.ContextVar[BackgroundCount | None] = contextvars.ContextVar(
    "hicache_async_scheduled_warmup_count", default=None
)


class Warmer:
    """One warmup run over one attached backend."""

    def __init__(
        self, cache: HiCache, link: StorageLink, *, ratio: float, deadline_s: float
    ) -> None:
        self._cache = cache
        self._link = link
        self._ratio = ratio
        self._deadline_s = deadline_s
        self._stop = False
        # What was read and loaded so far: a broken group ends the run with an exception.
        self._partial = WarmupResult(status=WarmupStatus.STOPPED)
        group = cache.rank_group
        self._background = (
            BackgroundAgreements.of(group) if group is not None and group.size > 1 else None
        )

    def stop(self) -> None:
        self._stop = True

    def _stopping(self) -> bool:
        """Stop requested locally, or by a request agreement waiting for this warmup."""
        return self._stop or (self._background is not None and self._background.stop_requested)

    async def run(self) -> WarmupResult:
        """Warm up; a broken rank group stops it (logged), it never fails the caller."""
        count: BackgroundCount | None = None
        if self._background is not None:
            # Request agreements on this group wait until every warmup's last collective.
            count = scheduled_count.get()
            if count is not None and count.background is self._background:
                # The link's warmup task counted this warmup when it was scheduled: take
                # that count over (a second one would not be this warmup's either).
                scheduled_count.set(None)
            else:
                count = BackgroundCount(self._background)
        began = time.monotonic()
        try:
            return await self._run()
        except CollectiveError as exc:
            _log.warning("hicache.warmup.agreement.failed", error=repr(exc))
            return msgspec.structs.replace(self._partial, seconds=time.monotonic() - began)
        finally:
            if count is not None:
                count.end()

    async def _run(self) -> WarmupResult:
        began = time.monotonic()
        cache = self._cache
        backend = self._link.backend
        group = cache.rank_group
        tp = group is not None and group.size > 1
        if not isinstance(backend, SupportsManifest):
            if tp:
                assert group is not None
                await agree_entries(group, _nothing, tag=_ENTRIES_TAG)
            return WarmupResult(status=WarmupStatus.UNSUPPORTED)
        manifest = backend.manifest()
        namespace = cache.namespace.fingerprint.hex()
        read = None
        read_too_long = False
        # With a rank group: what this rank offers to agree on, each id with the entry it
        # names a prefix of and that prefix's pages (see `_offers`).
        offered: dict[bytes, tuple[ManifestEntry, int]] = {}

        async def local_entries() -> list[bytes]:
            nonlocal read, read_too_long, offered
            try:
                # The deadline covers the read too: a large manifest takes seconds to read.
                with anyio.move_on_after(self._deadline_s - (time.monotonic() - began)) as scope:
                    read = await manifest.read(namespace=namespace)
            except Exception as exc:  # a storage fault: no warmup, never a failed caller
                _log.warning("hicache.warmup.manifest.failed", error=repr(exc))
                return []
            if scope.cancelled_caught:
                read_too_long = True
                return []
            assert read is not None
            if tp:
                offered = await _offers(read)
            return list(offered)

        agreed: list[ManifestEntry] = []
        if tp:
            assert group is not None
            agreed = await self._agree_entries_owing(
                group, local_entries, lambda: offered, cache.config.page_size
            )
        else:
            await local_entries()
        if read is None:
            if read_too_long:
                status = WarmupStatus.DEADLINE
            elif self._ended():
                status = WarmupStatus.STOPPED  # the read failed because of a detach or close
            else:
                status = WarmupStatus.MANIFEST_FAILED
            return WarmupResult(status=status, seconds=time.monotonic() - began)
        entries = agreed if tp else read.entries
        assert cache._host_pool is not None
        budget = _times_ratio(cache._host_pool.num_pages, self._ratio)  # as for max_host_share
        size = cache.config.page_size
        loaded_pages = 0
        loaded_entries = 0
        # The keys of the entries that brought pages, most valuable first.
        loaded: list[list[bytes]] = []
        missed = 0
        budget_cut = False  # an entry was loaded only in part, for the budget
        self._partial = WarmupResult(
            status=WarmupStatus.STOPPED,
            entries_read=len(read.entries),
            entries_agreed=len(entries),
            malformed=read.malformed,
            oversized=read.oversized,
            newer=read.newer,
        )
        status = WarmupStatus.COMPLETE
        # Why this rank stops after the current entry (None: it goes on). With a rank group
        # the next "go on?" agreement then stops every rank at the same entry.
        halt: WarmupStatus | None = None
        for index, entry in enumerate(entries):
            go_on = self._may_continue(loaded_pages, budget, began) if halt is None else halt
            if tp:
                assert group is not None
                wanted = int(go_on is WarmupStatus.COMPLETE)
                agreed_go = await self._agree_go_on_owing(group, wanted, entries, index)
                if not agreed_go and go_on is WarmupStatus.COMPLETE:
                    go_on = WarmupStatus.STOPPED  # another rank stopped: stop together
            if go_on is not WarmupStatus.COMPLETE:
                status = go_on
                break
            try:
                # Entries the store cannot serve end without suspending (the file index
                # answers on the loop): a long stale manifest would otherwise hold it.
                await anyio.lowlevel.checkpoint()
                halt = await self._yield_to_live(loaded_pages, budget, began)
                landed = 0
                before = 0  # pages of the entry cached before its read
                whole: bool | None = None  # all cached after its read; None: not begun
                # Past the deadline or stopped (a detach, the close, a request agreement
                # waiting) while live prefetches went first: the entry is not begun. With a
                # rank group the trim below still runs, and keeps what every rank held of it.
                if halt is None:
                    keys = [bytes.fromhex(k) for k in entry.keys]
                    if not tp:
                        # No further than the budget allows: pages cached already cost
                        # nothing. (With a rank group the entry is loaded whole: ranks hold
                        # different prefixes of it, and cuts of their own would make the trim
                        # below drop pages some rank held before.)
                        found = cache._tree.match(keys, touch=False)
                        cached = found.num_device_pages + found.num_host_pages
                        allowed = cached + budget - loaded_pages
                        if len(keys) > allowed:
                            keys = keys[:allowed]
                            budget_cut = True
                    handle = PrefetchHandle(
                        self._link.prefetcher,
                        keys,
                        len(keys) * size,
                        "warmup",
                        "wait_complete",
                        priority=entry.priority,
                        min_tokens=1,  # a warmup entry is worth loading whatever its length
                    )
                    await self._link.prefetcher.run_now(handle)
                    landed = handle.storage_tokens // size
                    before = (handle.device_tokens + handle.host_tokens) // size
                    cached = handle.device_tokens + handle.host_tokens + handle.storage_tokens
                    whole = cached >= handle.num_tokens
                    missed += not whole
                    # A detach or the close cancelled the entry's read.
                    if handle.status is PrefetchStatus.CANCELLED:
                        halt = WarmupStatus.STOPPED
            except asyncio.CancelledError:
                if tp:
                    assert group is not None
                    await self._agree_trim_owing(group, entries, index, cancelled=True)
                raise
            loaded_pages += landed
            loaded_entries += landed > 0
            if landed:
                loaded.append(keys)
            # Before the trim's agreement: should it fail, what landed stays (untrimmed).
            self._count(loaded_entries, loaded_pages, missed)
            if tp:
                assert group is not None
                cancelled, agreed_tokens = await self._agree_trim_owing(group, entries, index)
                if agreed_tokens is not None and whole is not None:
                    # What the trim dropped of the pages this read loaded is not loaded, and
                    # an entry it cut short is not wholly cached.
                    kept = min(landed, max(0, agreed_tokens // size - before))
                    loaded_pages -= landed - kept
                    loaded_entries -= landed > 0 and kept == 0
                    missed += whole and agreed_tokens < len(entry.keys) * size
                    self._count(loaded_entries, loaded_pages, missed)
                if cancelled:
                    raise asyncio.CancelledError
            if halt is None and self._ended():
                halt = WarmupStatus.STOPPED  # stopped while the entry ran
            # A last entry that is all there anyway was not cut short: the run is complete.
            if halt is not None and not (index + 1 == len(entries) and self._all_cached(entry)):
                status = halt
                if not tp:
                    break
        if status is WarmupStatus.COMPLETE and budget_cut and loaded_pages >= budget:
            status = WarmupStatus.BUDGET  # reached within the last entry
        await self._order_by_value(loaded)
        # `_partial` holds every count by now.
        return msgspec.structs.replace(
            self._partial, status=status, seconds=time.monotonic() - began
        )

    async def _order_by_value(self, loaded: list[list[bytes]]) -> None:
        """Give what the entries loaded (their keys, most valuable first) access times in
        reverse order of value: loaded most valuable first, each was the least recently
        used of them, and the first to go when eviction needed room. Matching a chain costs
        its length: the loop gets its turn every few entries."""
        tree = self._cache._tree
        for done, keys in enumerate(reversed(loaded), 1):
            found = tree.match(keys, touch=False)
            if found.host_node.parent is not None:
                tree.refresh(found.host_node)
            if done % _ORDER_STEP == 0:
                await anyio.lowlevel.checkpoint()

    def _count(self, entries_loaded: int, pages_loaded: int, entries_missed: int) -> None:
        """Record the figures so far in the result a stopped warmup returns."""
        self._partial = msgspec.structs.replace(
            self._partial,
            entries_loaded=entries_loaded,
            pages_loaded=pages_loaded,
            entries_missed=entries_missed,
        )

    async def _agree_entries_owing(
        self,
        group: RankGroup,
        local: Callable[[], Awaitable[list[bytes]]],
        offered: Callable[[], dict[bytes, tuple[ManifestEntry, int]]],
        page_size: int,
    ) -> list[ManifestEntry]:
        """The entries to load: the prefixes every rank offered (`local`, then `offered()`:
        what it offered), each lengthened to the longest prefix the ranks share
        (`_longest_shared`). A cancellation waits for the agreements (this rank may have
        entered them already); if peers then go on to the first entry, it answers that
        entry's "go on?" with "no" before re-raising, so they stop there with it."""
        agreed: list[list[ManifestEntry]] = []

        async def agree() -> None:
            ids = await agree_entries(group, local, tag=_ENTRIES_TAG)
            chosen = await _agreed_prefixes(ids, offered())
            lengths = await _longest_shared(group, chosen)
            agreed.append(await _cut(chosen, lengths, page_size))

        if not await run_uncancelled(agree()):
            return agreed[0]
        # Nothing agreed: a collective failed (logged), and the peers see that failure too.
        # The entries are the same on every rank (their keys are the prefixes they share).
        if agreed and agreed[0]:
            await self._owe(group, _go_on_tag(agreed[0][0].chain_id))
        raise asyncio.CancelledError

    async def _agree_go_on_owing(
        self, group: RankGroup, wanted: int, entries: list[ManifestEntry], index: int
    ) -> int:
        """Entry `index`'s "go on?" agreement. A cancellation waits for it (this rank may have
        entered it with "go on"); if the peers go on, it still enters what it owes them for
        the entry (its trim, and "no" for the next "go on?") before re-raising."""
        entry = entries[index]
        agreed: list[int] = []

        async def agree() -> None:
            agreed.append(await _agree_value(group, wanted, _go_on_tag(entry.chain_id)))

        if not await run_uncancelled(agree()):
            return agreed[0]
        if agreed and agreed[0]:  # nothing agreed: as in `_agree_entries_owing`
            await self._agree_trim_owing(group, entries, index, cancelled=True)
        raise asyncio.CancelledError

    async def _owe(self, group: RankGroup, tag: int) -> None:
        """Enter a "go on?" agreement with "no", whatever cancels the caller meanwhile."""

        async def answer() -> None:
            await _agree_value(group, 0, tag)

        try:
            await run_uncancelled(answer())
        except CollectiveError as exc:
            _log.warning("hicache.warmup.agreement.failed", error=repr(exc))

    async def _agree_trim_owing(
        self,
        group: RankGroup,
        entries: list[ManifestEntry],
        index: int,
        *,
        cancelled: bool = False,
    ) -> tuple[bool, int | None]:
        """Entry `index`'s trim agreement, then the trim it agrees on; whether the caller was
        cancelled (during it, or before it: `cancelled`) and must re-raise, and the tokens
        agreed on (None if the agreement failed).

        This rank offers the entry's pages it holds now (loaded by this warmup or there
        before; a stopped or cancelled warmup loads nothing more) and holds them until the
        trim: a page evicted while the peers are waited for would be offered and then kept
        by the peers alone. A cancellation waits for the agreement and still trims to the
        agreed pages, so this rank keeps the same pages as its peers; then, if they go on to
        the next entry, it answers that entry's "go on?" with "no", so they stop there with it.
        """
        entry = entries[index]
        keys = [bytes.fromhex(k) for k in entry.keys]
        held, nodes = self._cache._hold_prefix(keys)
        agreed: list[int] = []

        async def agree() -> None:
            agreed.append(await _agree_value(group, held, _trim_tag(entry.chain_id)))

        try:
            cancelled = await run_uncancelled(agree()) or cancelled
        except CollectiveError as exc:
            if not cancelled:
                raise
            # The caller re-raises its cancellation either way; the group's failure is what
            # the next agreement on it reports.
            _log.warning("hicache.warmup.agreement.failed", error=repr(exc))
        finally:
            self._cache._let_go(nodes)
        if agreed:
            self._cache._trim_host(keys, agreed[0] // self._cache.config.page_size)
        if cancelled and agreed and index + 1 < len(entries):
            await self._owe(group, _go_on_tag(entries[index + 1].chain_id))
        return cancelled, agreed[0] if agreed else None

    async def _yield_to_live(self, loaded: int, budget: int, began: float) -> WarmupStatus | None:
        """Wait until no live prefetch is queued or running, but no longer than the deadline;
        then why the warmup must not begin its next entry (None: it may)."""
        prefetcher = self._link.prefetcher
        # Timed against `time.monotonic()`, as `_may_continue` is: the loop's clock may lag it.
        while (left := self._deadline_s - (time.monotonic() - began)) > 0:
            with anyio.move_on_after(left) as scope:
                await prefetcher.wait_quiet()
            if not scope.cancelled_caught:
                break
        go_on = self._may_continue(loaded, budget, began)
        return None if go_on is WarmupStatus.COMPLETE else go_on

    def _all_cached(self, entry: ManifestEntry) -> bool:
        keys = [bytes.fromhex(k) for k in entry.keys]
        found = self._cache._tree.match(keys, touch=False)
        return found.num_device_pages + found.num_host_pages == len(keys)

    def _ended(self) -> bool:
        """Stopped: locally, by a request agreement, a detach or the cache's close."""
        return (
            self._stopping() or self._cache._link is not self._link or self._cache._state != "open"
        )

    def _may_continue(self, loaded: int, budget: int, began: float) -> WarmupStatus:
        if self._ended():
            return WarmupStatus.STOPPED
        if loaded >= budget:
            return WarmupStatus.BUDGET
        if time.monotonic() - began >= self._deadline_s:
            return WarmupStatus.DEADLINE
        return WarmupStatus.COMPLETE


_ENTRIES_TAG = agreement_tag("warmup.entries")
#: Loaded entries whose access times are set in one step of the loop at the end of a warmup
#: (a step matches that many chains, each as long as its entry).
_ORDER_STEP = 64
#: Keys the entries agreement maps in one step of the loop (`_offers`, `_agreed_prefixes`,
#: `_cut`): 10,000 entries of 90 pages held it for 0.15 to 0.6 s in each of them at once.
_MAP_STEP = 16_384


def _extend_tag(step: int) -> int:
    return agreement_tag("warmup.extend", step)


def _go_on_tag(chain_id: str) -> int:
    return agreement_tag("warmup.go_on", chain_id)


def _trim_tag(chain_id: str) -> int:
    return agreement_tag("warmup.trim", chain_id)


async def _agree_value(group: RankGroup, value: int, tag: int) -> int:
    """The minimum of a value this rank already knows (no local step can fail)."""

    async def mine() -> int:
        return value

    return await agree_min(group, mine, tag=tag)


async def _nothing() -> list[bytes]:
    return []


def _returning(items: list[bytes]) -> Callable[[], Awaitable[list[bytes]]]:
    async def local() -> list[bytes]:
        return items

    return local


async def _offers(read: ManifestRead) -> dict[bytes, tuple[ManifestEntry, int]]:
    """What a rank offers to the entries agreement, in its order: for each entry (by
    priority, then recency), longest first, the ids of its whole chain, of the covered
    chains it starts with (`ManifestRead.covered`) and of its prefixes whose page counts are
    powers of two; each with the entry and the prefix's pages (the best-ranked entry that
    offers it).

    A chain's key at page n names the prefix of n pages on every rank, so ranks whose latest
    backups differ (one lacks the last turn of a conversation) still agree on a prefix they
    all hold: at a length one of them recorded as a chain of its own, else at the largest
    power of two they share; `_longest_shared` then lengthens it to all they share. The ids
    number at most the entries and covered records
    read (at most `max_entries`) plus floor(log2(pages)) + 1 per entry.
    """
    offered: dict[bytes, tuple[ManifestEntry, int]] = {}
    work = 0
    for entry in read.entries:
        if work >= _MAP_STEP:
            work = 0
            await anyio.lowlevel.checkpoint()
        full = len(entry.keys)
        work += 8 * full.bit_length() + 16  # an entry's ids cost more than a key put in a set
        lengths = {full, *read.covered.get(covered_key(entry), ())}
        lengths.update(1 << bit for bit in range(full.bit_length()) if 1 << bit < full)
        for pages in sorted(lengths, reverse=True):
            offered.setdefault(bytes.fromhex(entry.keys[pages - 1]), (entry, pages))
    return offered


async def _agreed_prefixes(
    agreed: list[bytes], offered: dict[bytes, tuple[ManifestEntry, int]]
) -> list[tuple[ManifestEntry, int]]:
    """The prefixes to load, in the agreed order, from the ids every rank offered: each
    agreed prefix that no agreed prefix before it continues (loading that one loads it), as
    this rank's entry that offered it and the prefix's pages.

    Every rank decides alike: the agreed list is the same everywhere, and so are the keys of
    a prefix (each key hashes the ones before it). A prefix before a longer one that
    continues it ranks higher on rank 0, so it is loaded first, on its own.
    """
    chosen: list[tuple[ManifestEntry, int]] = []
    within: set[str] = set()  # the keys of the prefixes chosen so far
    work = 0
    for ident in agreed:
        if work >= _MAP_STEP:
            work = 0
            await anyio.lowlevel.checkpoint()
        work += 1
        found = offered.get(ident)
        if found is None or ident.hex() in within:
            continue
        entry, pages = found
        work += pages
        within.update(entry.keys[:pages])
        chosen.append(found)
    return chosen


async def _longest_shared(group: RankGroup, chosen: list[tuple[ManifestEntry, int]]) -> list[int]:
    """For each chosen prefix, the pages of the longest prefix every rank's entry for it
    shares: a binary search, all prefixes at once, one `agree_entries` per step.

    A prefix of P pages was chosen because no longer one the ranks share was offered, and
    every rank offers each power of two below its entry's length: so the ranks share fewer
    than 2P pages of their entries. The first step asks for one page more than each prefix;
    only the prefixes every rank holds one page more of are searched further, up to 2P - 1.
    A step offers, for each prefix still searched, this rank's key at the page it asks about
    (nothing if its entry is shorter), tagged with the prefix's place in `chosen`: a key
    names the prefix that ends with it, so the ranks share that prefix exactly when every
    one offered it. The steps depend only on what was agreed, so every rank takes the same
    number: at most 1 + ceil(log2 P) for the longest P, none when no prefix is longer than
    a page.
    """
    low = [pages for _, pages in chosen]  # pages every rank shares
    high = [2 * pages - 1 for pages in low]  # at most this many
    step = 0
    while True:
        if step == 0:
            asked = {i: low[i] + 1 for i in range(len(chosen)) if low[i] < high[i]}
        else:
            asked = {i: (low[i] + high[i] + 1) // 2 for i in range(len(chosen)) if low[i] < high[i]}
        if not asked:
            return low
        probes = {
            _probe(i, chosen[i][0].keys[pages - 1]): i
            for i, pages in asked.items()
            if len(chosen[i][0].keys) >= pages
        }
        agreed = await agree_entries(group, _returning(list(probes)), tag=_extend_tag(step))
        shared = {probes[probe] for probe in agreed if probe in probes}
        for i, pages in asked.items():
            if i in shared:
                low[i] = pages
            else:
                high[i] = pages - 1
        step += 1


def _probe(index: int, key: str) -> bytes:
    """What a rank offers for the chosen prefix `index` reaching the page `key` ends."""
    return hashlib.blake2b(
        index.to_bytes(8, "little") + bytes.fromhex(key), digest_size=32
    ).digest()


async def _cut(
    chosen: list[tuple[ManifestEntry, int]], lengths: list[int], page_size: int
) -> list[ManifestEntry]:
    """Each chosen entry cut to its agreed pages, leaving out those an entry before it
    holds whole (a longer agreed length can reach a prefix chosen after it)."""
    entries: list[ManifestEntry] = []
    within: set[str] = set()
    work = 0
    for (entry, _), pages in zip(chosen, lengths, strict=True):
        if work >= _MAP_STEP:
            work = 0
            await anyio.lowlevel.checkpoint()
        work += 1
        if entry.keys[pages - 1] in within:
            continue
        work += pages
        within.update(entry.keys[:pages])
        if pages < len(entry.keys):
            entries.append(
                msgspec.structs.replace(
                    entry, keys=entry.keys[:pages], num_tokens=pages * page_size
                )
            )
        else:
            entries.append(entry)
    return entries
