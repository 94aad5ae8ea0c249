"""Backup: host → storage, in batches, never on a request's path.

Offering a node is synchronous and never waits: it protects the node's host pages and queues
it, or, when the queue is full, skips it and counts the skip. The worker writes batches,
retries failed pages with bounded backoff, marks a node "in storage" only once the backend
acknowledged all its pages, and then lifts the protection.

A protection must never cost a request its pages: a device allocation that eviction cannot
meet otherwise makes the worker give way (`give_way`), dropping what is queued and ending the
batch in progress after the backend call it is in, without retrying.

A batch also writes the pages above each job that storage lacks: a prefix is found in storage
only up to its first missing page, so one page skipped, failed, or lost by the store (a
restart without persistence, its own eviction, another instance's gc) would otherwise cut
every chain through it for every other instance, for as long as this one holds the page.

Keys name content, so a page storage holds already (another instance stored it, or this one
before its tree forgot the node) is the same page: a batch asks `exists` first and writes
only what storage lacks (`skip_stored`), unless the backend's own put already moves nothing
for such pages (`put_skips_stored`: file, memory and Mooncake; a shared file root's put also
looks at the disk, where its `exists` trusts this instance's index).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import anyio
import msgspec
import structlog

from .._config import BackupConfig
from .._ratelog import LogLimiter, describe_error
from ..storage import Outcome, PageMeta, StorageBackend
from ..storage._manifest import (
    ManifestEntry,
    ManifestLimits,
    SupportsManifest,
    WarmupManifest,
    chain_entry,
    encode_entry,
    record_time,
)
from ..storage._protocol import check_exists, check_outcomes

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from .._cache import HiCache
    from ..tree import TreeNode

__all__ = ["BackupStatistics", "BackupWorker"]

_log = structlog.get_logger("hicache_async")

_T = TypeVar("_T")

#: Most nodes kept on record as found whole in storage (see `_checked`): past it the least
#: recently found is forgotten even if fresh, and its chain is next asked about whole, one
#: longer `exists`, as after `check_prefix_interval_s`. About 120 bytes each.
_CHECKED_MAX = 65536

#: Most `exists` calls a batch's look-ups of stored pages, or its checks of the prefixes
#: above its jobs, have in flight at once (one per chain).
_LOOKUPS_IN_FLIGHT = 8

#: The longest manifest record warmup reads (it reads with the default limits).
_MAX_ENTRY_BYTES = ManifestLimits().max_entry_bytes
#: What one more key adds to a record: 64 hex digits, two quotes and a comma.
_KEY_RECORD_BYTES = 67
#: More than a record's fields besides its keys take: a chain whose keys fit in the bound
#: with this much to spare needs no encoding to be measured.
_RECORD_FIELDS_BYTES = 1024
#: Doublings of `retry_backoff_s` past which a retry's backoff stops growing: `2.0 ** 1000`
#: is still a float (the product may reach inf, which waits for a give-way), while
#: `2 ** 1024` cannot be made one.
_MAX_DOUBLINGS = 1000


class _Job(msgspec.Struct):
    node: TreeNode
    num_pages: int


class BackupStatistics(msgspec.Struct, frozen=True):
    """Counters of the backup worker."""

    offered_pages: int
    queued: int
    written_pages: int
    bytes_written: int
    skipped_pages: int
    retried_pages: int
    failed_pages: int
    dropped_pages: int
    batches: int
    manifest_entries: int
    #: offered pages that needed no write by the time their batch ran (stored meanwhile,
    #: or offered twice in one batch)
    superseded_pages: int = 0
    #: pages above a job's range, not offered, added to its batch because storage lacked them
    repaired_pages: int = 0
    #: pages marked in storage that a check of the prefix above a job found missing there
    lost_pages: int = 0
    #: planned pages (offered or repaired) not written because storage held them already
    #: (another instance stored them, or this one before its tree forgot them)
    already_stored_pages: int = 0
    #: times the worker gave way to a device allocation (`give_way`; logged as
    #: `hicache.backup.gave_way`, at most once a minute)
    gave_way: int = 0


class BackupWorker:
    """Writes host pages to storage from a bounded queue."""

    def __init__(
        self,
        cache: HiCache,
        backend: StorageBackend,
        config: BackupConfig,
        *,
        is_current: Callable[[], bool],
        stored: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        self._cache = cache
        self._backend = backend
        self.config = config
        # Told the keys of the pages each put stored, or found stored: a read of them may
        # succeed now.
        self._stored = stored
        # After a detach the flush still writes, but its pages belong to a backend that is
        # no longer ours: they must not mark nodes "in storage".
        self._is_current = is_current
        #: node id -> when storage was last asked about its pages and held them, the least
        #: recently found first (so the stale ones are dropped from the front)
        self._checked: OrderedDict[int, float] = OrderedDict()
        self._manifest: WarmupManifest | None = (
            backend.manifest() if isinstance(backend, SupportsManifest) else None
        )
        self.manifest_entries = 0
        self._send, self._receive = anyio.create_memory_object_stream[_Job](
            max_buffer_size=config.queue_size
        )
        self._closed = False
        # A store that fails every call would otherwise log once per batch.
        self._log_limit = LogLimiter()
        self._writing = False
        # Set by `give_way` for the batch being written (a fresh one per batch).
        self._give_way: anyio.Event | None = None
        # The scope of the batch's look-ups in flight (`_overlapped`), which `give_way`
        # cancels: their answers only save writes the give-way leaves out anyway.
        self._lookups: anyio.CancelScope | None = None
        # The next batch starts giving way: `give_way` came while its first job was handed
        # to the worker, no longer queued, before the batch began.
        self._give_way_next = False
        # Jobs whose protection is held: queued, handed to the worker, or in the batch.
        self._held_jobs = 0
        self._stopped = False
        #: pages of the batch being written (0 between batches)
        self.writing_pages = 0
        # Set, and dropped, when the worker goes idle or stops: one for every `wait_idle()`
        # caller, so a caller cancelled while the worker stays busy leaves nothing behind.
        self._idle_event: anyio.Event | None = None
        self.offered_pages = self.written_pages = self.bytes_written = 0
        self.skipped_pages = self.retried_pages = self.failed_pages = 0
        self.dropped_pages = self.batches = self.superseded_pages = 0
        self.repaired_pages = self.lost_pages = self.already_stored_pages = 0
        self.gave_way = 0

    def offer(self, node: TreeNode, num_pages: int) -> bool:
        """Queue the last `num_pages` pages ending at `node` for backup; never waits."""
        self.offered_pages += num_pages
        if self._closed:
            self.skipped_pages += num_pages
            return False
        try:
            self._send.send_nowait(_Job(node, num_pages))
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.skipped_pages += num_pages
            return False
        self._cache._tree.protect_host(node)
        self._held_jobs += 1
        return True

    async def run(self) -> None:
        """The worker task; returns once closed and drained, or cancelled."""
        try:
            async for job in self._receive:
                jobs = [job]
                pages = job.num_pages
                while pages < self.config.batch_pages:
                    try:
                        more = self._receive.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                    jobs.append(more)
                    pages += more.num_pages
                self._give_way = anyio.Event()
                if self._give_way_next:
                    self._give_way_next = False
                    self._give_way.set()
                self._writing = True
                self.writing_pages = pages
                try:
                    await self._write(jobs)
                finally:
                    self._writing = False
                    self._give_way = None
                    self.writing_pages = 0
                    self._wake_idle()
                    # An allocation that made the worker give way waits for the batch's end.
                    self._cache._capacity_changed.set()
        finally:
            # Nothing is written any more, whatever ended the worker (a flush past its
            # deadline, the link's task cancelled without a close): later offers are skipped
            # and `wait_idle()` waiters woken. The jobs still queued give their host
            # protection back now; only then is the queue closed.
            self.close()
            self.drop_queued()
            self._receive.close()
            self._stopped = True  # nothing will lift a protection left now

    def close(self) -> None:
        """Accept nothing more; `run()` finishes once the queue is drained."""
        self._closed = True
        self._send.close()
        self._wake_idle()

    def discard(self) -> None:
        """For a worker that never ran (its backend did not open): drop what is queued and
        close both ends of the queue."""
        self.close()
        self.drop_queued()
        self._receive.close()
        self._stopped = True

    def drop_queued(self) -> None:
        """Drop every queued job (counted), lifting its protection."""
        while True:
            try:
                job = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            self.dropped_pages += job.num_pages
            self._cache._tree.unprotect_host(job.node)
            self._held_jobs -= 1
            self._cache._capacity_changed.set()
        # Between two batches (a `give_way` then) the emptied queue leaves the worker idle,
        # and no batch ends to wake the waiters.
        self._wake_idle()

    def give_way(self) -> None:
        """Let go of the host pages this worker protects, for a device allocation that
        eviction cannot meet otherwise: a backup must never make a request fail.

        Queued jobs are dropped (`dropped_pages`). The batch being written (or the one about
        to begin with a job already handed to the worker) makes no further backend call (no
        retry, no later chunk, no further prefix check or look-up of stored pages): the
        look-ups in flight are cancelled (one in a backend's thread still ends first), a put
        in flight returns first, within `io_timeout_s`; its unwritten pages are counted in
        `failed_pages`, and then it lifts its protections. What it wrote, or found stored
        before, is marked as usual.
        """
        if not self.protecting or (self.pending == 0 and (self._giving_way or self._give_way_next)):
            return  # nothing held, or nothing more to give up
        self.gave_way += 1
        # Under steady device pressure it comes at every request: one line a minute, the
        # rest in `gave_way` and the pages in `dropped_pages` and `failed_pages`.
        unlogged = self._log_limit.admit("hicache.backup.gave_way")
        if unlogged is not None:
            _log.warning(
                "hicache.backup.gave_way",
                queued=self.pending,
                writing_pages=self.writing_pages,
                unlogged_since_last=unlogged,
            )
        self.drop_queued()
        if self._writing and self._give_way is not None:
            self._give_way.set()
            if self._lookups is not None:
                # Several may be in flight, queued behind each other in the backend (its
                # threads or connections): the allocation would wait for all of them.
                self._lookups.cancel()
        elif self._held_jobs:
            self._give_way_next = True

    @property
    def protecting(self) -> bool:
        """Some job's host protection is held, and the running worker will lift it."""
        return self._held_jobs > 0 and not self._stopped

    @property
    def _giving_way(self) -> bool:
        return self._give_way is not None and self._give_way.is_set()

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being written."""
        return not self._writing and self.pending == 0

    async def wait_idle(self) -> None:
        """Wait until `idle` (or the worker stops)."""
        while not self.idle and not self._closed:
            if self._idle_event is None:
                self._idle_event = anyio.Event()
            await self._idle_event.wait()

    def _wake_idle(self) -> None:
        if (self.idle or self._closed) and self._idle_event is not None:
            self._idle_event.set()
            self._idle_event = None

    @property
    def pending(self) -> int:
        return self._send.statistics().current_buffer_used

    def statistics(self) -> BackupStatistics:
        return BackupStatistics(
            offered_pages=self.offered_pages,
            queued=self.pending,
            written_pages=self.written_pages,
            bytes_written=self.bytes_written,
            skipped_pages=self.skipped_pages,
            retried_pages=self.retried_pages,
            failed_pages=self.failed_pages,
            dropped_pages=self.dropped_pages,
            batches=self.batches,
            manifest_entries=self.manifest_entries,
            superseded_pages=self.superseded_pages,
            repaired_pages=self.repaired_pages,
            lost_pages=self.lost_pages,
            already_stored_pages=self.already_stored_pages,
            gave_way=self.gave_way,
        )

    async def _write(self, jobs: list[_Job]) -> None:
        cache = self._cache
        tree = cache._tree
        host = cache._host_pool
        assert host is not None
        fingerprint = cache.namespace.fingerprint
        size = cache.config.page_size
        entries: list[ManifestEntry] = []
        # Pages this batch must account for (offered, then planned), and what it has so far.
        owed = sum(job.num_pages for job in jobs)
        settled_before = self.written_pages + self.failed_pages + self.already_stored_pages
        try:
            if self.config.check_prefix and self._is_current():
                await self._check_prefixes(jobs)
            # Plan: the pages of every node not yet in storage, in tree order, with those
            # above each job's range that storage lacks. A flush to a backend no longer
            # attached writes only what was offered: the detach unmarked every node.
            # Only the tree's keys and page numbers are gathered here; each call's storage
            # keys, buffers and records are made as it is cut (below), so that a
            # long prompt is not prepared in one step.
            planned: list[tuple[TreeNode, int]] = []
            # Indexes into `planned` of each path's nodes, root first: one chain each.
            chains: list[list[int]] = []
            seen: set[int] = set()
            keys: list[bytes] = []
            pages: list[int] = []
            priorities: list[int] = []
            paths = [cache._path(job.node, job.num_pages) for job in jobs]
            offered_ids = {node.id for path in paths for node in path}
            repairing = self._is_current()
            repaired = 0
            for path in paths:
                above = _chain(path[0].parent) if repairing else []
                chains.append([])
                for node in (*above, *path):
                    if node.in_storage or node.host_pages is None or node.id in seen:
                        continue
                    seen.add(node.id)
                    chains[-1].append(len(planned))
                    planned.append((node, node.num_pages))
                    if node.id not in offered_ids:
                        repaired += node.num_pages
                    keys.extend(node.keys)
                    pages.extend(node.host_pages)
                    priorities.extend([node.priority] * node.num_pages)
            offered = sum(job.num_pages for job in jobs)
            self.repaired_pages += repaired
            self.superseded_pages += max(0, offered - (len(keys) - repaired))
            owed = len(keys)
            if not keys:
                return
            self.batches += 1
            done = [False] * len(keys)
            if (
                self.config.skip_stored
                and not self._backend.capabilities.put_skips_stored
                and self._is_current()
            ):
                await self._find_stored(planned, chains, keys, done)
            todo = [i for i, stored in enumerate(done) if not stored]
            limit = max(1, self._backend.capabilities.max_batch_pages)
            for start in range(0, len(todo), limit):
                chunk = todo[start : start + limit]
                chunk_keys = cache.namespace.storage_keys([keys[i] for i in chunk])
                written = await self._put_with_retries(
                    chunk_keys,
                    # Read-only: a backend that wrote into them would change pages the host
                    # pool still serves.
                    [[s.toreadonly() for s in host.page_segments(pages[i])] for i in chunk],
                    [
                        PageMeta(key, fingerprint, size, priorities[i])
                        for key, i in zip(chunk_keys, chunk, strict=True)
                    ],
                )
                for i, ok in zip(chunk, written, strict=True):
                    done[i] = ok
                if self._stored is not None:
                    self._stored([keys[i] for i, ok in zip(chunk, written, strict=True) if ok])
            # By the page counts planned: a node split meanwhile holds fewer of them now,
            # the rest in the new node above it, and both are marked.
            offset = 0
            for node, n in planned:
                if all(done[offset : offset + n]) and self._is_current():
                    for part in cache._path(node, n):
                        tree.mark_in_storage(part)
                offset += n
            if self._manifest is not None and self._is_current():
                entries = [e for e in map(self._chain_entry, jobs) if e is not None]
        except BaseException:
            # Cancelled (a detach or close that gave up its flush): the pages neither written
            # nor settled otherwise are left unwritten, as the queued ones are.
            settled = self.written_pages + self.failed_pages + self.already_stored_pages
            self.dropped_pages += max(0, owed - (settled - settled_before))
            raise
        finally:
            for job in jobs:
                tree.unprotect_host(job.node)
            self._held_jobs -= len(jobs)
            cache._capacity_changed.set()  # an allocation waiting on them retries
        # The entries are taken: the manifest append needs no host page held.
        await self._record(entries)

    async def _find_stored(
        self,
        planned: list[tuple[TreeNode, int]],
        chains: list[list[int]],
        keys: list[bytes],
        done: list[bool],
    ) -> None:
        """Set `done` for the leading pages of each chain of `planned` that storage holds
        already, so that they are not written again (nor their bytes sent).

        One `exists` per chain, its planned pages in chain order, several in flight at once
        (`_overlapped`): a page past the first missing one is written even if storage holds
        it (putting a stored page is harmless). A failed or timed-out call leaves the rest
        unknown (no further call begins), so written as before. `keys`
        are the tree's keys of the planned pages (their storage keys are made per call).
        """
        offsets = [0, *itertools.accumulate(n for _, n in planned)]
        lookups = [
            [i for k in chain for i in range(offsets[k], offsets[k + 1])] for chain in chains
        ]

        async def look_up(indexes: list[int]) -> bool:
            try:
                stored = self._cache.namespace.storage_keys([keys[i] for i in indexes])
                with anyio.fail_after(self.config.io_timeout_s):
                    answer = await self._backend.exists(stored)
                found = check_exists(answer, len(indexes))
            except Exception as exc:
                self._warn("hicache.backup.stored.failed", exc, pages=len(indexes))
                return False
            if not self._is_current():
                return False  # detached meanwhile: the flush writes what is left, as it would
            for i in indexes[:found]:
                done[i] = True
            self.already_stored_pages += found
            if self._stored is not None:
                # Stored, as a put that wrote them would say (a backend whose put skips
                # stored pages answers OK for them).
                self._stored([keys[i] for i in indexes[:found]])
            return True

        await self._overlapped([indexes for indexes in lookups if indexes], look_up)

    async def _overlapped(self, items: list[_T], ask: Callable[[_T], Awaitable[bool]]) -> bool:
        """`ask(item)` for each of `items` in turn, up to `_LOOKUPS_IN_FLIGHT` at once: on a
        slow store, chains asked one after another would cost a round trip each. None
        begins once one has answered False (its call failed: the rest is left unknown);
        when the worker gives way (a device allocation needs the pages) those in flight are
        cancelled, and their chains left unknown. False if one answered False or the worker
        gave way. What escapes `ask` ends this call as it would with one item: the first
        error raised as it is (never in an exception group), any others logged."""
        pending = iter(items)
        stopped = False
        # What escaped `ask` (a bug: it contains the backend's failures) in a task of the
        # group, raised bare as with one item rather than in an exception group.
        errors: list[BaseException] = []
        cancelled = anyio.get_cancelled_exc_class()

        async def asker() -> None:
            nonlocal stopped
            for item in pending:
                if stopped or self._giving_way:
                    return
                if not await ask(item):
                    stopped = True

        async def asker_task(group: TaskGroup) -> None:
            nonlocal stopped
            try:
                await asker()
            except cancelled:
                raise
            except BaseException as exc:
                errors.append(exc)
                stopped = True
                group.cancel_scope.cancel()  # as the error would end a single asker

        with anyio.CancelScope() as scope:
            self._lookups = scope
            try:
                if len(items) == 1:  # the common case, without a task
                    await asker()
                else:
                    try:
                        async with anyio.create_task_group() as tg:
                            for _ in range(min(len(items), _LOOKUPS_IN_FLIGHT)):
                                tg.start_soon(asker_task, tg)
                    finally:
                        if errors:
                            for other in errors[1:]:
                                _log.error("hicache.backup.lookup.also_failed", error=repr(other))
                            raise errors[0]
            finally:
                self._lookups = None
        return not (stopped or scope.cancelled_caught or self._giving_way)

    async def _check_prefixes(self, jobs: list[_Job]) -> None:
        """Unmark the nodes above the jobs' ranges that are marked in storage but missing
        there, so that this batch writes them again (those still on the host).

        One `exists` per chain answers up to its first missing page; the node holding it is
        unmarked and the rest of the chain is asked again. A chain found whole within the
        last `check_prefix_interval_s` is not asked about again, only what lies below it: a
        long conversation's batches would otherwise ask about its whole history each time.
        Chains are checked several at once (`_overlapped`), except that of chains whose
        first node to ask about is the same, one is checked before the others.
        """
        cache = self._cache
        tops: dict[int, TreeNode] = {}
        for job in jobs:
            top = cache._path(job.node, job.num_pages)[0].parent
            if top is not None and top.parent is not None:
                tops[top.id] = top
        # A chain that runs through another one's top covers it.
        covered = {n.id for top in tops.values() for n in _chain(top.parent)}

        async def check(top: TreeNode) -> bool:
            # Pages of the chain known to be in storage, or already unmarked.
            asked = start = self._checked_pages(_chain(top), time.monotonic())
            whole = True  # no page found missing yet: what was found is on record
            while not self._giving_way:
                # The chain is read again after every wait: a node may have been split
                # meanwhile (which keeps the chain's keys); protection keeps all of it.
                chain = _chain(top)
                ends = list(itertools.accumulate(node.num_pages for node in chain))
                if not any(n.in_storage for n, end in zip(chain, ends, strict=True) if end > start):
                    break  # nothing marked in storage is left to check
                keys = [key for node in chain for key in node.keys][start:]
                try:
                    with anyio.fail_after(self.config.io_timeout_s):
                        answer = await self._backend.exists(cache.namespace.storage_keys(keys))
                    found = check_exists(answer, len(keys))
                except Exception as exc:
                    # Unknown: nothing is unmarked on a guess.
                    self._warn("hicache.backup.check.failed", exc, pages=len(keys))
                    return False
                if not self._is_current():
                    return False
                start += found
                chain = _chain(top)
                ends = list(itertools.accumulate(node.num_pages for node in chain))
                if whole:
                    self._note_checked(chain, ends, asked, start, time.monotonic())
                missing = next((k for k, end in enumerate(ends) if end > start), None)
                if missing is None:
                    break
                whole = False
                node = chain[missing]
                if node.in_storage:
                    cache._tree.mark_in_storage(node, False)
                    self.lost_pages += node.num_pages
                    _log.info("hicache.backup.lost", pages=node.num_pages)
                start = ends[missing]
            return True

        # Chains whose first node to ask about is one they share (a system prompt gone
        # stale) would each ask about all of it at once: one of them is checked first, and
        # the others then start below what it found.
        now = time.monotonic()
        first: list[TreeNode] = []
        after: list[TreeNode] = []
        leading: set[int] = set()
        for top in tops.values():
            if top.id in covered:
                continue
            chain = _chain(top)
            k = self._checked_nodes(chain, now)
            if k < len(chain) and chain[k].id in leading:
                after.append(top)
                continue
            # A node found missing, or not stored, or with no record kept (an interval of 0),
            # would be asked about by the others all the same: no reason to wait then.
            if k < len(chain) and chain[k].in_storage and self.config.check_prefix_interval_s > 0:
                leading.add(chain[k].id)
            first.append(top)
        if await self._overlapped(first, check) and after:
            await self._overlapped(after, check)

    def _checked_nodes(self, chain: list[TreeNode], now: float) -> int:
        """How many nodes at the top of `chain` were found whole in storage lately: its
        first nodes that storage was each asked about, and held, within the interval."""
        for k, node in enumerate(chain):
            when = self._checked.get(node.id)
            if when is None or now - when >= self.config.check_prefix_interval_s:
                return k
        return len(chain)

    def _checked_pages(self, chain: list[TreeNode], now: float) -> int:
        """How many pages at the top of `chain` were found whole in storage lately (those
        of its `_checked_nodes`)."""
        return sum(node.num_pages for node in chain[: self._checked_nodes(chain, now)])

    def _note_checked(
        self, chain: list[TreeNode], ends: list[int], asked: int, found: int, now: float
    ) -> None:
        """Record the nodes of `chain` whose pages lie past the first `asked` (those taken
        from the record, not asked about now) and within the first `found`.

        Only what was asked is stamped: renewing the nodes above would keep a hot prefix
        (a shared system prompt, which every chain's check starts below) on record for
        ever, never asked about again, so never a use in a store that evicts by use.
        """
        checked = self._checked
        for node, end in zip(chain, ends, strict=True):
            if end > found:
                break
            if end <= asked:
                continue
            checked[node.id] = now
            checked.move_to_end(node.id)  # `now` never decreases: the order stays by time
        # Forget what is stale (removed nodes too, in time), and the least recently found
        # past the cap: each entry is dropped once, so this costs O(1) amortized per entry.
        interval = self.config.check_prefix_interval_s
        while checked and (
            len(checked) > _CHECKED_MAX or now - checked[next(iter(checked))] >= interval
        ):
            checked.popitem(last=False)

    def _chain_entry(self, job: _Job) -> ManifestEntry | None:
        """A manifest entry for the chain ending at the job's node, if all of it is stored."""
        keys: list[bytes] = []
        node: TreeNode | None = job.node
        while node is not None and node.parent is not None:
            if not node.in_storage:
                return None
            keys[:0] = node.keys
            node = node.parent
        if not keys or node is None:
            return None  # the node left the tree meanwhile
        size = self._cache.config.page_size
        fingerprint = self._cache.namespace.fingerprint
        priority, now = job.node.priority, record_time()
        entry = chain_entry(fingerprint, keys, len(keys) * size, priority, now)
        # A record longer than a reader takes is skipped by every warmup: a chain of more
        # pages than that (some 3,900 at the default bound: 3,900 tokens at page size 1) is
        # recorded as its longest prefix that fits, which warmup can load.
        bound = self._entry_bound()
        if len(keys) * _KEY_RECORD_BYTES + _RECORD_FIELDS_BYTES <= bound:
            return entry  # the common case: no encoding just to measure
        excess = len(encode_entry(entry)) - bound
        while excess > 0:
            cut = -(-excess // _KEY_RECORD_BYTES)
            if cut >= len(keys):
                return None
            keys = keys[: len(keys) - cut]
            entry = chain_entry(fingerprint, keys, len(keys) * size, priority, now)
            excess = len(encode_entry(entry)) - bound
        return entry

    def _entry_bound(self) -> int:
        """The longest record to write: what warmup reads with the default limits, or less
        where the manifest holds its records to a lower bound (a `MemoryStorage` given its
        own limits, which its warmup reads with too)."""
        limits = getattr(self._manifest, "limits", None)
        if isinstance(limits, ManifestLimits):
            return min(_MAX_ENTRY_BYTES, limits.max_entry_bytes)
        return _MAX_ENTRY_BYTES

    async def _record(self, entries: list[ManifestEntry]) -> None:
        """Append to the warmup manifest; a failure costs warmup value, never a request."""
        if not entries or self._manifest is None:
            return
        try:
            with anyio.fail_after(self.config.io_timeout_s):
                await self._manifest.append(entries)
            self.manifest_entries += len(entries)
        except Exception as exc:
            self._warn("hicache.manifest.append.failed", exc, entries=len(entries))

    def _warn(self, event: str, exc: Exception, **fields: object) -> None:
        """Log a failed backend call: each kind of error at once, a repeated one at most
        once a minute (`unlogged_since_last` tells how many were left out, and for a call
        about `pages` or manifest `entries`, `unlogged_pages_since_last` or
        `unlogged_entries_since_last` how many they were about)."""
        error = describe_error(exc, self.config.io_timeout_s)
        tally = next((name for name in ("pages", "entries") if name in fields), None)
        if tally is not None:
            self._log_limit.warn_tallied(
                _log, event, error, tally, backend=self._backend.name, **fields
            )
        else:
            self._log_limit.warn(_log, event, error, backend=self._backend.name, **fields)

    async def _put_with_retries(
        self, keys: list[bytes], buffers: list[list[memoryview]], metas: list[PageMeta]
    ) -> list[bool]:
        done = [False] * len(keys)
        todo = list(range(len(keys)))
        page_nbytes = self._cache.config.page_nbytes
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                # The backoff ends early when the worker gives way.
                doublings = min(attempt - 1, _MAX_DOUBLINGS)
                with anyio.move_on_after(self.config.retry_backoff_s * 2.0**doublings):
                    assert self._give_way is not None
                    await self._give_way.wait()
            if self._giving_way:
                break  # a device allocation needs the pages: no further call
            if attempt:
                self.retried_pages += len(todo)
            began = time.monotonic()
            try:
                with anyio.fail_after(self.config.io_timeout_s):
                    outcomes = await self._backend.put(
                        [keys[i] for i in todo],
                        [buffers[i] for i in todo],
                        [metas[i] for i in todo],
                    )
                check_outcomes(outcomes, len(todo), "put")
                if Outcome.OK in outcomes:  # a call that stored nothing says nothing of speed
                    self._cache.storage_put_latency.observe(time.monotonic() - began)
            except Exception as exc:
                self._warn("hicache.backup.put.failed", exc, pages=len(todo), attempt=attempt)
                continue
            failed = []
            for i, outcome in zip(todo, outcomes, strict=True):
                if outcome is Outcome.OK:
                    done[i] = True
                    self.written_pages += 1
                    self.bytes_written += page_nbytes
                elif outcome is Outcome.ERROR:
                    failed.append(i)
                else:  # MISS: the store declined (no room); retrying won't help
                    self.failed_pages += 1
            todo = failed
            if not todo:
                break
        if todo:
            self.failed_pages += len(todo)
            admitted = self._log_limit.admit_counting("hicache.backup.dropped", "", len(todo))
            if admitted is not None:
                _log.warning(
                    "hicache.backup.dropped",
                    backend=self._backend.name,
                    pages=len(todo),
                    unlogged_since_last=admitted[0],
                    unlogged_pages_since_last=admitted[1],
                )
        return done


def _chain(node: TreeNode | None) -> list[TreeNode]:
    """The nodes from the root (left out) down to `node`, top-down."""
    chain: list[TreeNode] = []
    while node is not None and node.parent is not None:
        chain.append(node)
        node = node.parent
    chain.reverse()
    return chain
