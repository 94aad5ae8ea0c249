"""An attached storage backend together with the workers that use it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import msgspec
import structlog

from .._ratelog import LogLimiter
from .._uncancelled import finish_uncancelled
from ..distributed import BackgroundAgreements
from ..storage import StorageBackend, StorageStats
from ..storage._protocol import STORAGE_ACCEPTED, check_backend, check_stats
from ._backup import BackupStatistics, BackupWorker
from ._prefetch import Prefetcher, PrefetchStatistics
from ._warmup import BackgroundCount, Warmer, WarmupResult, scheduled_count
from ._watch import WorkerWatch

if TYPE_CHECKING:
    from .._cache import HiCache

__all__ = ["StorageLink", "StorageStatus"]

_log = structlog.get_logger("hicache_async")


class StorageStatus(msgspec.Struct, frozen=True):
    """What `HiCache.storage_status()` reports."""

    attached: bool
    backend: str | None = None
    generation: int = 0
    #: `attach_storage` is opening `backend`: not attached yet, and another attach refused
    opening: bool = False
    storage: StorageStats | None = None
    prefetch: PrefetchStatistics | None = None
    backup: BackupStatistics | None = None
    #: a backend a detach, a replace or the cache's close is flushing, named in
    #: `flushing_backend`: its backup figures, live while its pending backups are being
    #: written (the final ones come with the `hicache.storage.detached` log line). None when
    #: no flush runs: a detach with `flush=False`, or one given up, shows none.
    flushing: BackupStatistics | None = None
    flushing_backend: str | None = None
    #: the cache's workers stopped while it was open, on this error (a KeyboardInterrupt or
    #: SystemExit raised in a backend call): storage was detached then, and attaching,
    #: prefetching and warming up raise `WorkersFailedError` from then on. None otherwise.
    workers_failed: str | None = None


class StorageLink:
    """Owns one backend for as long as it is attached: enters it, runs its workers, closes it."""

    def __init__(self, cache: HiCache, backend: StorageBackend, generation: int) -> None:
        self.cache = cache
        # Checked here, before any worker holds it: otherwise a non-backend fails later, as
        # a TypeError from inside the link's task.
        self.backend = check_backend(backend, "storage", accepted=STORAGE_ACCEPTED)
        self.generation = generation
        self.prefetcher = Prefetcher(
            cache, backend, cache.config.prefetch, is_current=self._is_current
        )
        self.backup = BackupWorker(
            cache,
            backend,
            cache.config.backup,
            is_current=self._is_current,
            stored=self.prefetcher.failed_reads.forget,
        )
        self.warmers: set[Warmer] = set()
        self.warmup_result: asyncio.Future[WarmupResult] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._scope: anyio.CancelScope | None = None
        self._backup_done = anyio.Event()
        # Warmups scheduled by `start_warmup` whose task has not run yet: their results, and
        # their counts on the group's background agreements.
        self._unstarted: dict[asyncio.Future[WarmupResult], BackgroundCount | None] = {}
        self._watch = WorkerWatch()  # the backup worker and the warmup task
        self._stopped = anyio.Event()
        # A close whose caller was cancelled: its flush is given up (`hurry`).
        self._hurried = False
        self._flush_scope: anyio.CancelScope | None = None
        # The backup worker's, cancelled once a close stops flushing (see `_finish_close`).
        self._backup_scope: anyio.CancelScope | None = None
        self._backup_stop = False
        self._flushing = False
        #: The backend is open and the workers have started.
        self.running = False
        # `run()` was handed to a task group (`start`), and it began: one scheduled that never
        # began (cancelled before its first step) or never scheduled sets no event of its own.
        self._scheduled = False
        self._began = False
        self._closed = anyio.Event()
        # `stats()` runs at every status call and metrics scrape: a broken backend scraped
        # every few seconds would otherwise log the same failure at each.
        self._stats_log = LogLimiter()

    def _is_current(self) -> bool:
        return self.cache._link is self

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run the link in `task_group`; returns once the backend opened and the workers
        started, raises what stopped them first (the task group's own refusal included)."""
        self._scheduled = True
        try:
            await task_group.start(self.run)
        finally:
            # Once `start` has returned or raised, a run that has not begun never will (a
            # failed start waits for the task it cancelled): its waiters are released here.
            if not self._began:
                self._end()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Enter the backend, start the workers, report started; exit closes the backend."""
        self._scheduled = self._began = True
        entered = False
        body_exc: BaseException | None = None
        try:
            async with self.backend:
                entered = True
                try:
                    with anyio.CancelScope() as scope:
                        self._scope = scope
                        async with anyio.create_task_group() as tg:
                            self._tg = tg
                            tg.start_soon(self._watch.run, self.prefetcher.run)
                            tg.start_soon(self._watch.run, self._run_backup)
                            self.running = True
                            task_status.started()
                except BaseException as exc:
                    body_exc = exc
                    raise
                finally:
                    if self.running:
                        await self._stop_outside_readers()
        except Exception as exc:
            if not entered or exc is body_exc:  # the backend did not open, or the workers failed
                raise
            # Closing the backend failed: its workers are done, nothing is lost by going on,
            # and a detach or the cache's close must not fail for it. What ended the workers
            # (a cancellation, their own failure) goes on as it was.
            _log.warning("hicache.storage.close.failed", backend=self.backend.name, error=repr(exc))
            if body_exc is not None:
                raise body_exc from None
        finally:
            self._end()

    @property
    def failed_with(self) -> BaseException | None:
        """What ended a worker, as soon as it did (a prefetch worker's, the backup worker's
        or the warmup's error; see `WorkerWatch`); None while they run."""
        return self.prefetcher.watch.failed_with or self._watch.failed_with

    def _end(self) -> None:
        """Release everything that waits on the workers, once they can no longer run: `run()`
        has ended, or will never begin. Idempotent."""
        # The workers may never have run (the backend did not open), or been cancelled
        # before their first step, or ended by an error that escaped them (a
        # KeyboardInterrupt in a backend call): their own `finally` never closed their
        # queues. Whatever is queued finishes now (prefetches CANCELLED, backups dropped),
        # and no backup can be pending: a close has nothing left to flush (it would wait
        # out the whole flush deadline, or for ever for `_backup_done`).
        self.prefetcher.discard()
        self.backup.discard()
        self._backup_done.set()
        # A warmup task cancelled before its first step never runs its own `finally`, and
        # one ended by such an error never sets its result.
        for future, count in self._unstarted.items():
            future.cancel()
            if count is not None:
                count.end()
        self._unstarted.clear()
        if self.warmup_result is not None and not self.warmup_result.done():
            self.warmup_result.cancel()
        self._stopped.set()

    def start_warmup(self, warmup: Callable[[], Awaitable[WarmupResult]]) -> None:
        """Run `warmup` in this link's task group (a detach stops it); keep its result.

        With a rank group, the warmup counts as running from this call on, before its task
        first runs: a request agreement made in between waits for (and stops) it on every
        rank alike, instead of entering its collective before the warmup's on some ranks.
        """
        assert self._tg is not None
        future: asyncio.Future[WarmupResult] = asyncio.get_running_loop().create_future()
        group = self.cache.rank_group

        async def run() -> None:
            count = self._unstarted.pop(future)
            # The warmup this task runs takes the count over (see `Warmer.run`); ending it
            # here too is a no-op then, and ends it if `warmup` never got to take it.
            scheduled_count.set(count)
            try:
                result = await warmup()
            except asyncio.CancelledError:
                future.cancel()
                raise
            except Exception as exc:
                future.set_exception(exc)
                future.exception()  # retrieved here: a failed warmup is no error of the link
                _log.warning("hicache.warmup.failed", error=repr(exc))
                return
            finally:
                if count is not None:
                    count.end()
            future.set_result(result)

        # Counted before it is scheduled (a task may start eagerly, inside `start_soon`); a
        # task group that has ended refuses it, and then the count ends at once.
        count = (
            BackgroundCount(BackgroundAgreements.of(group))
            if group is not None and group.size > 1
            else None
        )
        self._unstarted[future] = count
        try:
            # Watched as the workers are: an error that escapes it ends them all.
            self._tg.start_soon(self._watch.run, run)
        except BaseException:
            self._unstarted.pop(future, None)
            if count is not None:
                count.end()
            raise
        self.warmup_result = future

    async def _stop_outside_readers(self) -> None:
        """Before the backend closes: stop the warmups and wait for the prefetches they run in
        their own tasks. Done by `close()` already, unless this task was cancelled without it
        (an attach cancelled just as the backend opened)."""
        for warmer in self.warmers:
            warmer.stop()
        self.prefetcher.close()
        self.backup.close()
        with anyio.CancelScope(shield=True):
            await self.prefetcher.wait_stopped()

    async def _run_backup(self) -> None:
        try:
            with anyio.CancelScope() as scope:
                self._backup_scope = scope
                if self._backup_stop:
                    scope.cancel()  # the close stopped flushing before this task began
                await self.backup.run()
        finally:
            self._backup_scope = None
            self._backup_done.set()

    def _stop_backup(self) -> None:
        """End the backup worker now: the queued jobs dropped, the write in progress
        cancelled (a backend call that cannot be cut short still runs to its end, but no
        further call is made)."""
        self._backup_stop = True
        self.backup.drop_queued()
        if self._backup_scope is not None:
            self._backup_scope.cancel()

    async def close(self, *, flush: bool, deadline_s: float) -> None:
        """Stop prefetches, flush (or drop) pending backups within the deadline, close.

        Cancelling the caller abandons the flush, as `flush=False` would, but not the close:
        the workers have stopped and the backend is closed before the cancellation goes on.
        A link whose `run()` has ended, or was never started, closes at once.
        """
        if not self._scheduled:
            self._end()  # nothing will run it: no worker or backend to wait for
        for warmer in self.warmers:
            warmer.stop()
        self.prefetcher.close()
        self.prefetcher.cancel_queued()
        self.backup.close()
        if not flush:
            self.backup.drop_queued()
        # From here, not from the task below: a status asked for right after this call
        # began must see the flush.
        self._flushing = flush and not self._hurried and not self._backup_done.is_set()
        try:
            cancelled = await finish_uncancelled(
                self._finish_close(flush, deadline_s), on_cancel=self.hurry
            )
        finally:
            self._closed.set()
        if cancelled is not None:
            raise cancelled

    @property
    def closed(self) -> bool:
        """`close()` has finished: the workers have stopped and the backend is closed."""
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        """Wait until `closed` (a close must be in progress, or it waits for the next)."""
        await self._closed.wait()

    @property
    def flushing(self) -> bool:
        """A close is waiting for pending backups to be written (a flush not given up)."""
        return self._flushing

    def hurry(self) -> None:
        """Give up the flush of a close in progress (or about to start): what is queued is
        dropped and the write in progress cancelled, as with `flush=False`."""
        self._flushing = False
        if not self._hurried:
            self._hurried = True
            pending, writing = self.backup.pending, self.backup.writing_pages
            # A warning only when something is given up: a cancelled close with nothing left
            # to flush (a shutdown under a deadline) loses nothing.
            (_log.warning if pending or writing else _log.info)(
                "hicache.backup.flush.abandoned", pending=pending, writing_pages=writing
            )
        self.backup.drop_queued()
        if self._flush_scope is not None:
            self._flush_scope.cancel()

    async def _finish_close(self, flush: bool, deadline_s: float) -> None:
        # Without a flush nothing is waited for, the write in progress included.
        with anyio.move_on_after(deadline_s if flush and not self._hurried else 0.0) as scope:
            self._flush_scope = scope
            try:
                await self._backup_done.wait()
            finally:
                self._flushing = False
        self._flush_scope = None
        if flush and not self._hurried and not self._backup_done.is_set():
            _log.warning("hicache.backup.flush.deadline", pending=self.backup.pending)
        # The flush is over (done, past its deadline, given up or not asked for): no backup
        # may be written from here on, although the wait below can be long (a prefetch's
        # call that cannot be cut short, in a thread to a store that stopped answering).
        self._stop_backup()
        # Warmup prefetches run in their callers' tasks, outside the task group: the reads
        # they were cancelled in must be over before the backend closes under them.
        await self.prefetcher.wait_stopped()
        if self._scope is not None:
            self._scope.cancel()
        await self._stopped.wait()
        self.backup.drop_queued()

    def status(self) -> StorageStatus:
        try:
            # Checked: a malformed answer would reach the admin API's JSON and the metrics.
            stats: StorageStats | None = check_stats(self.backend.stats())
        except Exception as exc:  # a backend's bug must not break a status call or a scrape
            self._stats_log.warn(
                _log, "hicache.storage.stats.failed", repr(exc), backend=self.backend.name
            )
            stats = None
        return StorageStatus(
            attached=True,
            backend=self.backend.name,
            generation=self.generation,
            storage=stats,
            prefetch=self.prefetcher.statistics(),
            backup=self.backup.statistics(),
        )
