"""The copy engine protocol and statistics, and what every engine shares: validation, planning,
the worker-thread life cycle and completion bookkeeping."""

from __future__ import annotations

import abc
import asyncio
import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import anyio.to_thread
import msgspec
import numpy as np

from .._errors import CacheClosedError
from .._loop import LoopOwner
from .._pool import KVPool
from ._handle import LayerwiseCopy

__all__ = [
    "CopyEngine",
    "CopyJob",
    "CopyPlan",
    "CopyStatistics",
    "Stop",
    "ThreadedEngine",
    "plan_copy",
    "signal",
]


class CopyStatistics(msgspec.Struct, frozen=True):
    """A snapshot of a copy engine's counters.

    `copies`, `pages` and `bytes` count copies that completed successfully and what they moved;
    `failed` counts copies that failed; `in_flight` is the number started and not yet done.
    """

    copies: int
    pages: int
    bytes: int
    in_flight: int
    failed: int


@runtime_checkable
class CopyEngine(Protocol):
    """Moves pages between KV pools, layer by layer, off the event loop's thread."""

    def copy(
        self, src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
    ) -> LayerwiseCopy:
        """Start copying `src_pages` of `src` into `dst_pages` of `dst` (pairwise).

        Called on the loop thread; never blocks on the copy itself. Raises `ValueError`
        before starting anything if the pools differ in layout or page size, the page lists
        differ in length, a page is out of range or a destination page is repeated.
        """

    async def aclose(self) -> None:
        """Wait for in-flight copies, then stop the engine's threads; `copy` raises after."""

    def statistics(self) -> CopyStatistics:
        """A snapshot of the engine's counters."""


def _as_pages(pages: Sequence[int], pool: KVPool, what: str) -> np.ndarray[Any, Any]:
    arr = np.asarray(pages)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a flat sequence of integers")
    arr = arr.astype(np.int64, copy=False)
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= pool.num_pages:
        bad = low if low < 0 else high
        raise ValueError(f"{what}: page {bad} is out of range [0, {pool.num_pages}) of {pool.name}")
    return arr


class CopyPlan:
    """A validated copy: the pools, the page pairs, and the pairs grouped into runs.

    A run is a stretch of pairs where both source and destination pages are consecutive, so it
    moves as one slice per buffer and layer.
    """

    __slots__ = (
        "dst",
        "dst_pages",
        "nbytes",
        "num_pages",
        "run_dst",
        "run_len",
        "run_src",
        "src",
        "src_pages",
    )

    def __init__(
        self,
        src: KVPool,
        src_pages: np.ndarray[Any, Any],
        dst: KVPool,
        dst_pages: np.ndarray[Any, Any],
    ) -> None:
        self.src = src
        self.dst = dst
        self.src_pages = src_pages
        self.dst_pages = dst_pages
        self.num_pages = len(src_pages)
        self.nbytes = self.num_pages * src.page_nbytes
        if self.num_pages:
            breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
            starts = np.concatenate(([0], breaks))
            ends = np.concatenate((breaks, [self.num_pages]))
        else:
            starts = ends = np.zeros(0, dtype=np.int64)
        self.run_src: list[int] = src_pages[starts].tolist()
        self.run_dst: list[int] = dst_pages[starts].tolist()
        self.run_len: list[int] = (ends - starts).tolist()

    @property
    def num_runs(self) -> int:
        return len(self.run_len)


def plan_copy(
    src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
) -> CopyPlan:
    """Validate a copy request (raising `ValueError`) and group its pages into runs."""
    if src.layout != dst.layout:
        raise ValueError(f"cannot copy between layouts: {src.layout!r} and {dst.layout!r}")
    if src.page_size != dst.page_size:
        raise ValueError(
            f"cannot copy between page sizes {src.page_size} ({src.name}) and "
            f"{dst.page_size} ({dst.name})"
        )
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    s = _as_pages(src_pages, src, "source pages")
    d = _as_pages(dst_pages, dst, "destination pages")
    # A sort and a look at neighbours: np.unique and np.intersect1d cost five to ten times
    # as much, and a long prompt at page size 1 copies a hundred thousand pages in one step.
    ordered = np.sort(d)
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise ValueError("a destination page appears more than once")
    if src is dst and len(ordered) and len(s):
        at = np.minimum(np.searchsorted(ordered, s), len(ordered) - 1)
        if bool((ordered[at] == s).any()):
            raise ValueError("source and destination pages overlap within one pool")
    return CopyPlan(src, s, dst, d)


def signal(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """`call_soon_threadsafe` from a worker thread, ignoring a loop that has closed meanwhile
    (nobody is left to tell; the copy itself has still run)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Stop:
    """The last item on a worker's queue: the worker resolves `done` on `loop` and exits."""

    __slots__ = ("done", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future[None]) -> None:
        self.loop = loop
        self.done = done

    def acknowledge(self) -> None:
        """Called by the worker thread as it exits."""
        signal(self.loop, _resolve, self.done)


class CopyJob(Protocol):
    """What an engine queues for its worker: a copy's handle and the loop to tell."""

    @property
    def handle(self) -> LayerwiseCopy: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...


JobT = TypeVar("JobT", bound=CopyJob)


# Engines whose worker thread runs. A daemon thread still running when the interpreter
# finalizes is stopped wherever it is, inside libtorch's frames too, and that aborts the
# process; an engine left without aclose() (by a cache never left) is stopped and joined at
# exit instead.
_RUNNING: weakref.WeakSet[ThreadedEngine[Any]] = weakref.WeakSet()
_EXIT_JOIN_S = 5.0
# Set by the exit hook: an engine whose worker never started refuses copies from then on too,
# since a worker started by a later exit hook would be one that nothing joins.
_EXITING = threading.Event()


@atexit.register
def _stop_running_engines() -> None:
    _EXITING.set()
    engines = list(_RUNNING)
    for engine in engines:
        engine._stop_at_exit()
    deadline = time.monotonic() + _EXIT_JOIN_S  # one for all, not one each
    for engine in engines:
        thread = engine._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
    # Copies the workers did not take in time never run: their waiters (a later exit hook
    # may run their loop) are told so instead of waiting for ever.
    for engine in engines:
        engine._fail_left_behind()


class ThreadedEngine(abc.ABC, Generic[JobT]):
    """What every engine shares: validation, handles, one worker thread fed by a queue,
    completion bookkeeping on the loop, draining `aclose`, statistics.

    A subclass turns a validated plan into a job (`_submit`) and provides the worker, a
    function of the queue that runs jobs until it takes a `Stop` (or None).
    """

    def __init__(self, name: str, worker: Callable[[queue.SimpleQueue[JobT | Stop | None]], None]):
        self._name = name
        self._worker = worker
        self._owner = LoopOwner(name)
        self._jobs: queue.SimpleQueue[JobT | Stop | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._exit_stopped = False
        self._stopped: asyncio.Future[None] | None = None
        self._idle: list[asyncio.Future[None]] = []
        self._in_flight = 0
        self._copies = 0
        self._pages = 0
        self._bytes = 0
        self._failed = 0
        # An engine dropped without aclose() still lets its thread exit.
        weakref.finalize(self, self._jobs.put, None)

    @abc.abstractmethod
    def _submit(
        self, plan: CopyPlan, handle: LayerwiseCopy, loop: asyncio.AbstractEventLoop
    ) -> JobT:
        """Turn a validated, non-empty plan into the job the worker runs (on the loop thread)."""

    def copy(
        self, src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
    ) -> LayerwiseCopy:
        """Start a layer-by-layer copy of `src_pages` of `src` into `dst_pages` of `dst`.

        See `CopyEngine.copy`. Raises `CacheClosedError` once `aclose` has been called.
        """
        if self._closed:
            raise CacheClosedError(f"{self._name} is closed")
        if _EXITING.is_set():
            raise CacheClosedError(f"{self._name} is closed: the interpreter is exiting")
        loop = asyncio.get_running_loop()
        self._take_loop(loop)
        plan = plan_copy(src, src_pages, dst, dst_pages)
        handle = LayerwiseCopy(loop, src.layout.num_layers, plan.num_pages, plan.nbytes)
        handle._on_finish = self._finished
        if plan.num_pages == 0:
            self._in_flight += 1
            handle._layer_landed(handle.num_layers - 1)
            return handle
        job = self._submit(plan, handle, loop)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._worker, args=(self._jobs,), name=self._name, daemon=True
            )
            self._thread.start()
            _RUNNING.add(self)
        self._in_flight += 1
        self._jobs.put(job)
        if self._exit_stopped:
            # The exit hook stopped the engine (on another thread) after the check above, and
            # may have failed what was queued before this job came: fail it here.
            self._fail_left_behind()
        return handle

    def _finished(self, handle: LayerwiseCopy) -> None:
        self._in_flight -= 1
        if handle.exception() is None:
            self._copies += 1
            self._pages += handle.num_pages
            self._bytes += handle.nbytes
        else:
            self._failed += 1
        if self._in_flight == 0:
            idle, self._idle = self._idle, []
            for waiter in idle:
                _resolve(waiter)

    def _take_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve `loop`: the loop of the first copy, or the next one once that has closed.

        Raises `WrongThreadError` while another loop that is still open owns the engine.
        """
        owner = self._owner.loop
        if owner is None or (owner is not loop and owner.is_closed()):
            # Nothing of a closed loop's can complete any more (its copies' completions are
            # dropped with it), so the engine is free for the next: one engine passed to the
            # caches of successive loops (a test harness's) failed every load after the first.
            self._owner.bind(loop)
            self._in_flight = 0
            self._idle = []
            if self._stopped is not None:
                # A close began there and queued its Stop: the worker answers that loop
                # (nobody now) and exits, so a later `aclose` here has only the join left.
                self._stopped = loop.create_future()
                self._stopped.set_result(None)
        else:
            self._owner.check()

    async def aclose(self) -> None:
        """Wait for in-flight copies, then stop the worker thread; `copy` raises after.

        Idempotent; cancelling it leaves the engine closed, and a later `aclose` finishes (on
        the next loop, if the cancelled one's has closed since).
        """
        loop = asyncio.get_running_loop()
        self._take_loop(loop)
        self._closed = True
        if self._exit_stopped:
            # Stopped at interpreter exit: the worker took its None and answers nothing more
            # (copies it left in its queue were failed there), and it was joined there.
            self._thread = None
            _RUNNING.discard(self)
            return
        while self._in_flight:
            waiter: asyncio.Future[None] = loop.create_future()
            self._idle.append(waiter)
            await waiter
        if self._stopped is None:
            self._stopped = loop.create_future()
            if self._thread is None or not self._thread.is_alive():
                self._stopped.set_result(None)  # no worker (or a dead one) to answer a Stop
            else:
                self._jobs.put(Stop(loop, self._stopped))
        await asyncio.shield(self._stopped)
        thread = self._thread
        if thread is not None:
            if thread.is_alive():
                # The worker has signalled its exit but may not have finished it (it may still
                # be waiting for the GIL): joining here would hold up the loop meanwhile.
                await anyio.to_thread.run_sync(thread.join)
            self._thread = None
            _RUNNING.discard(self)

    def _stop_at_exit(self) -> None:
        """Ask the worker to stop (joined by the caller); later copies are refused."""
        self._closed = True
        self._exit_stopped = True
        if self._thread is not None:
            self._jobs.put(None)

    def _fail_left_behind(self) -> None:
        """After an exit stop: fail every copy still queued with `CacheClosedError`, on its
        loop if that loop is still open (a closed one has nobody left to tell).

        A worker still copying past the exit's deadline gets its None back, so that it stops
        after that copy instead of waiting on an empty queue.
        """
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Stop):
                item.acknowledge()  # an aclose waiting for a worker that will never answer
            elif item is not None:
                error = CacheClosedError(
                    f"{self._name} is closed: stopped at interpreter exit before this copy ran"
                )
                signal(item.loop, item.handle._fail, error)
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._jobs.put(None)

    @property
    def closed(self) -> bool:
        """Whether `aclose` has been called."""
        return self._closed

    def statistics(self) -> CopyStatistics:
        """A snapshot of the engine's counters."""
        return CopyStatistics(
            copies=self._copies,
            pages=self._pages,
            bytes=self._bytes,
            in_flight=self._in_flight,
            failed=self._failed,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<{type(self).__name__} {self._name!r} {state} in_flight={self._in_flight} "
            f"copies={self._copies} pages={self._pages} failed={self._failed}>"
        )
