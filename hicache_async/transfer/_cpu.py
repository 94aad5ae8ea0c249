"""`CpuCopyEngine`: copies in dedicated worker threads, layer by layer.

A batch is one job: one queue hand-off per `copy()`, then per layer a few torch ops (which run
without the GIL and use torch's intra-op threads) or direct memory copies of whole rows, and
one `call_soon_threadsafe` to tell the loop the layer has landed. Direct copies run in the
calling thread only, so a large batch of them has its layers shared out between the worker and
its partner threads.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from typing import Any, NamedTuple

import numpy as np
import torch

from .._native import copy_at
from ._handle import LayerwiseCopy
from ._protocol import CopyPlan, Stop, ThreadedEngine, signal

__all__ = [
    "DEFAULT_MIN_DIRECT_BYTES",
    "DEFAULT_MIN_RUN_BYTES",
    "CpuCopyEngine",
    "LayerKernel",
    "StagingBuffer",
]

#: Gathers and scatters take one op per run of consecutive rows; below this many bytes per run
#: on average the per-op cost outweighs a second pass, and rows go through a staging buffer.
DEFAULT_MIN_RUN_BYTES = 64 * 1024

#: Between pools in host memory, rows consecutive on both sides for at least this many bytes
#: on average move by one direct memory copy each (about half a microsecond of Python per
#: copy, against some 10 µs for 64 KiB), in a single pass and without the GIL.
DEFAULT_MIN_DIRECT_BYTES = 64 * 1024

# A batch of direct copies is shared out between threads from this size: below it, the
# hand-off to a partner thread (about 100 µs) costs more than the partner saves.
_MIN_SHARED_BYTES = 4 << 20

# Pages consecutive on both sides, in runs of at least this many on average, move as plain
# slice copies: no index tensors, and both buffers of a layer in one op.
_MIN_MEAN_RUN_PAGES = 2


class StagingBuffer:
    """A staging area reused from batch to batch, so scattered copies do not fault in fresh
    pages every time. Owned by one worker thread."""

    __slots__ = ("_raw",)

    def __init__(self) -> None:
        self._raw = torch.empty(0, dtype=torch.uint8)

    def rows(self, count: int, like: torch.Tensor) -> torch.Tensor:
        """A [count, like.shape[1]] tensor of `like`'s dtype and device, contents undefined."""
        nbytes = count * like.shape[1] * like.element_size()
        raw = self._raw
        if raw.numel() < nbytes or raw.device != like.device:
            raw = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
            self._raw = raw
        return raw[:nbytes].view(like.dtype).view(count, like.shape[1])


class LayerKernel:
    """Copies one layer of a planned batch; built once per batch, called once per layer.

    A layer is moved by a few large torch ops (they run without the GIL and spread over torch's
    intra-op threads), never by a Python loop over pages unless the pages themselves are that
    scattered:

    - `runs`: pages consecutive on both sides move as one strided slice copy per run, both
      buffers at once; so do copies between devices (`non_blocking` lets a CUDA stream order
      them);
    - otherwise rows are used: whole pages of one layer and buffer, or single tokens when
      either pool is token-major (`page_first`), so any two memory layouts pair up row for row.
      The pairs are sorted to find runs of consecutive rows on each side, and
    - `gather`: the destination's runs are longer: one `index_select` (a parallel memcpy)
      straight into each destination run;
    - `scatter`: the source's runs are longer: one `index_copy_` out of each source run;
    - `stage`: neither side has runs worth an op each (or both are one pool, where index ops
      cannot run in place): one `index_select` of the whole layer into a staging buffer, then
      one `index_copy_` out of it.

    Between two pools in host memory whose rows pair up in stretches of at least
    `min_direct_bytes` on average (None: never), one more mode comes before all of these,
    `runs` included:

    - `direct`: one copy per stretch of rows consecutive on both sides, all of a layer in one
      native call with streaming stores (no read-for-ownership of the destination). It reads
      and writes each byte once, like `runs`, whatever the two layouts, and releases the GIL,
      so layers can be copied by several threads at once (`shareable`).
    """

    __slots__ = (
        "_direct_rows",
        "_dst_base",
        "_dst_rows",
        "_dst_step",
        "_mode",
        "_non_blocking",
        "_ops",
        "_plan",
        "_src_base",
        "_src_rows",
        "_src_step",
        "_stage",
        "_staging",
    )

    def __init__(
        self,
        plan: CopyPlan,
        *,
        non_blocking: bool = False,
        min_run_bytes: int = DEFAULT_MIN_RUN_BYTES,
        min_direct_bytes: int | None = DEFAULT_MIN_DIRECT_BYTES,
        staging: StagingBuffer | None = None,
    ) -> None:
        self._plan = plan
        self._non_blocking = non_blocking
        self._staging = staging if staging is not None else StagingBuffer()
        self._stage: torch.Tensor | None = None
        # (index, first row on the other side, row count) per op of layer 0.
        self._ops: list[tuple[torch.Tensor, int, int]] = []
        src, dst = plan.src, plan.dst
        self._src_rows = self._dst_rows = torch.empty(0)
        self._src_step = self._dst_step = 0
        self._src_base = self._dst_base = 0
        # (source byte offset, destination byte offset, bytes) per copy of layer 0.
        self._direct_rows = np.empty((0, 3), dtype=np.int64)
        long_runs = plan.num_runs * _MIN_MEAN_RUN_PAGES <= plan.num_pages
        direct = min_direct_bytes is not None and src.device.type == "cpu"
        if src.device != dst.device or (long_runs and not direct):
            self._mode = "runs"
            return
        per_token = src.token_major or dst.token_major
        src_rows = src.copy_rows(per_token=per_token)
        dst_rows = dst.copy_rows(per_token=per_token)
        s_rows, s_step = src.copy_row_index(plan.src_pages, per_token=per_token)
        d_rows, d_step = dst.copy_row_index(plan.dst_pages, per_token=per_token)
        if direct and self._plan_direct(
            min_direct_bytes or 0, (src_rows, s_rows, s_step), (dst_rows, d_rows, d_step)
        ):
            self._mode = "direct"
            return
        if long_runs:
            self._mode = "runs"
            return
        self._src_step, self._dst_step = s_step, d_step
        row_bytes = src_rows.shape[1] * src_rows.element_size()
        # Every buffer's rows are the same pattern shifted, so buffer 0 decides the runs.
        d_order = np.argsort(d_rows[0], kind="stable")
        s_order = np.argsort(s_rows[0], kind="stable")
        d_runs = _runs(d_rows[0][d_order])
        s_runs = _runs(s_rows[0][s_order])
        total = s_rows.shape[1] * row_bytes
        d_mean, s_mean = total / len(d_runs[0]), total / len(s_runs[0])
        device = src.device
        if src is not dst and d_mean >= max(s_mean, min_run_bytes):
            self._mode = "gather"
            self._src_rows, self._dst_rows = src_rows, dst_rows
            by_dst = torch.from_numpy(np.ascontiguousarray(s_rows[:, d_order])).to(device)
            for b in range(s_rows.shape[0]):
                for a, e in zip(*d_runs, strict=True):
                    self._ops.append((by_dst[b, a:e], int(d_rows[b, d_order[a]]), e - a))
        elif src is not dst and s_mean >= min_run_bytes:
            self._mode = "scatter"
            self._src_rows, self._dst_rows = _wide(src_rows), _wide(dst_rows)
            by_src = torch.from_numpy(np.ascontiguousarray(d_rows[:, s_order])).to(device)
            for b in range(d_rows.shape[0]):
                for a, e in zip(*s_runs, strict=True):
                    self._ops.append((by_src[b, a:e], int(s_rows[b, s_order[a]]), e - a))
        else:
            self._mode = "stage"
            self._src_rows, self._dst_rows = _wide(src_rows), _wide(dst_rows)
            s_index = torch.from_numpy(s_rows.reshape(-1)).to(device)
            d_index = torch.from_numpy(d_rows.reshape(-1)).to(device)
            self._ops.append((s_index, 0, s_index.numel()))
            self._ops.append((d_index, 0, d_index.numel()))

    def _plan_direct(
        self,
        min_direct_bytes: int,
        src: tuple[torch.Tensor, np.ndarray[Any, Any], int],
        dst: tuple[torch.Tensor, np.ndarray[Any, Any], int],
    ) -> bool:
        """Plan `direct` copies if the rows pair up in long enough stretches. `src` and `dst`
        are each side's (`copy_rows`, layer-0 row index, row step per layer)."""
        (src_rows, s_rows, s_step), (dst_rows, d_rows, d_step) = src, dst
        s_flat, d_flat = s_rows.reshape(-1), d_rows.reshape(-1)
        order = np.argsort(d_flat, kind="stable")
        s_flat, d_flat = s_flat[order], d_flat[order]
        breaks = np.flatnonzero((np.diff(d_flat) != 1) | (np.diff(s_flat) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        counts = np.diff(np.concatenate((starts, [len(d_flat)])))
        row_bytes = src_rows.shape[1] * src_rows.element_size()
        if len(d_flat) * row_bytes < min_direct_bytes * len(starts):
            return False
        # Raw addresses are only as safe as their bounds: every row of every layer must lie
        # inside its pool (copy_row_index guarantees it; this keeps a slip from being a
        # silent write into other memory).
        last = self._plan.src.layout.num_layers - 1
        for rows, step, pool_rows in ((s_flat, s_step, src_rows), (d_flat, d_step, dst_rows)):
            if rows.min() < 0 or rows.max() + last * step >= pool_rows.shape[0]:
                raise AssertionError("direct copy rows fall outside their pool")
            if not pool_rows.is_contiguous():
                raise AssertionError("direct copies need contiguous pool rows")
        self._src_rows, self._dst_rows = src_rows, dst_rows
        self._src_base, self._dst_base = src_rows.data_ptr(), dst_rows.data_ptr()
        self._src_step, self._dst_step = s_step * row_bytes, d_step * row_bytes
        self._direct_rows = np.ascontiguousarray(
            np.stack((s_flat[starts], d_flat[starts], counts), axis=1) * row_bytes,
            dtype=np.int64,
        )
        return True

    @property
    def mode(self) -> str:
        """How pages move: direct, gather, scatter, stage or runs."""
        return self._mode

    @property
    def shareable(self) -> bool:
        """Whether different layers may be copied by different threads at the same time with
        any gain (torch ops already spread over torch's own threads)."""
        return self._mode == "direct"

    def __call__(self, layer: int) -> None:
        mode = self._mode
        if mode == "runs":
            self._copy_runs(layer)
            return
        if mode == "direct":
            src_at = self._src_base + layer * self._src_step
            dst_at = self._dst_base + layer * self._dst_step
            # Streaming stores: the destination is not read again soon, and skipping the
            # cache saves the read-for-ownership of every line written.
            copy_at(dst_at, src_at, self._direct_rows, stream=True)
            return
        # Layer l's rows are layer 0's shifted by a fixed step, so slicing the row views lets
        # every layer reuse the same index tensors.
        src = self._src_rows[layer * self._src_step :]
        dst = self._dst_rows[layer * self._dst_step :]
        if mode == "gather":
            for index, first, count in self._ops:
                torch.index_select(src, 0, index, out=dst[first : first + count])
        elif mode == "scatter":
            for index, first, count in self._ops:
                dst.index_copy_(0, index, src[first : first + count])
        else:
            (s_index, _, count), (d_index, _, _) = self._ops
            stage = self._stage
            if stage is None:
                stage = self._staging.rows(count, src)
                self._stage = stage
            torch.index_select(src, 0, s_index, out=stage)
            dst.index_copy_(0, d_index, stage)

    def _copy_runs(self, layer: int) -> None:
        plan = self._plan
        sv = plan.src.copy_views(layer)
        dv = plan.dst.copy_views(layer)
        runs = list(zip(plan.run_src, plan.run_dst, plan.run_len, strict=True))
        if not self._non_blocking:
            for s, d, n in runs:
                dv[:, d : d + n].copy_(sv[:, s : s + n])
            return
        # Between devices, each copy should be one contiguous block on both sides so that it is
        # a single DMA; a run that is not (page_first_direct pages, token-major pages) goes
        # page by page.
        for b in range(sv.shape[0]):
            src_b, dst_b = sv[b], dv[b]
            for s, d, n in runs:
                src_run, dst_run = src_b[s : s + n], dst_b[d : d + n]
                if src_run.is_contiguous() and dst_run.is_contiguous():
                    dst_run.copy_(src_run, non_blocking=True)
                    continue
                for i in range(n):
                    dst_b[d + i].copy_(src_b[s + i], non_blocking=True)


def _runs(rows: np.ndarray[Any, Any]) -> tuple[list[int], list[int]]:
    """[start, end) positions of the runs of consecutive values in sorted `rows`."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(rows)]
    return starts, ends


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """The same rows in 16-byte elements where they divide evenly.

    `index_copy_` moves one element per step, so wider elements move rows faster; complex128
    elements are only ever copied, never computed on, so every bit pattern survives.
    """
    if rows.dtype == torch.int64 and rows.shape[1] % 2 == 0:
        return rows.view(torch.complex128)
    return rows


class _Tuning(NamedTuple):
    min_run_bytes: int
    min_direct_bytes: int | None
    threads: int


class _Job:
    __slots__ = ("handle", "loop", "plan", "tuning")

    def __init__(
        self,
        plan: CopyPlan,
        handle: LayerwiseCopy,
        loop: asyncio.AbstractEventLoop,
        tuning: _Tuning,
    ) -> None:
        self.plan = plan
        self.handle = handle
        self.loop = loop
        self.tuning = tuning


class _Landed:
    """Layers finished by one or several threads, told to the loop as the longest finished
    prefix: a handle's layers land in order whichever thread copied them.

    A layer that lands while the loop has yet to hear of the one before it rides along with
    it: the loop is woken at most once per pending news, never once per layer regardless,
    which on a machine with as many copying threads as cores would take a core from them.
    """

    __slots__ = ("_done", "_handle", "_lock", "_loop", "_pending", "_prefix", "_told")

    def __init__(self, handle: LayerwiseCopy, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = handle
        self._loop = loop
        self._done = [False] * handle.num_layers
        self._prefix = 0
        self._pending = False
        self._told = 0
        # Worker threads only; the loop never takes it.
        self._lock = threading.Lock()

    def finished(self, layer: int) -> None:
        """Called by a worker thread once `layer` has been copied."""
        with self._lock:
            self._done[layer] = True
            prefix = self._prefix
            while prefix < len(self._done) and self._done[prefix]:
                prefix += 1
            self._prefix = prefix
            # Single assignments and reads are atomic, so the loop's `_tell` either sees this
            # prefix or clears `_pending` before it is read here (and then it is told again).
            if prefix > self._told and not self._pending:
                self._pending = True
                signal(self._loop, self._tell)

    def _tell(self) -> None:
        # On the loop thread.
        self._pending = False
        prefix = self._prefix
        if prefix > self._told:
            self._told = prefix
            self._handle._layer_landed(prefix - 1)


class _Share:
    """Some layers of a kernel, for a partner thread; `done` is set when it has copied them
    or failed (`error`)."""

    __slots__ = ("done", "error", "kernel", "landed", "layers")

    def __init__(self, kernel: LayerKernel, layers: range, landed: _Landed) -> None:
        self.kernel = kernel
        self.layers = layers
        self.landed = landed
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for layer in self.layers:
                self.kernel(layer)
                self.landed.finished(layer)
        except BaseException as exc:  # handed to the worker, which reports it
            self.error = exc
        finally:
            self.done.set()


def _partner(shares: queue.SimpleQueue[_Share | None]) -> None:
    while (share := shares.get()) is not None:
        share.run()
        del share


class _Partners:
    """Threads that copy some layers of a worker's large direct batches; started as needed,
    stopped with the worker."""

    def __init__(self) -> None:
        self._threads: list[tuple[threading.Thread, queue.SimpleQueue[_Share | None]]] = []

    def start(self, count: int) -> list[queue.SimpleQueue[_Share | None]]:
        name = threading.current_thread().name
        while len(self._threads) < count:
            shares: queue.SimpleQueue[_Share | None] = queue.SimpleQueue()
            thread = threading.Thread(
                target=_partner,
                args=(shares,),
                name=f"{name}-partner-{len(self._threads) + 1}",
                daemon=True,
            )
            thread.start()
            self._threads.append((thread, shares))
        return [shares for _, shares in self._threads[:count]]

    def stop(self) -> None:
        for _, shares in self._threads:
            shares.put(None)
        for thread, _ in self._threads:
            thread.join()
        self._threads = []


def _run(job: _Job, staging: StagingBuffer, partners: _Partners) -> None:
    handle, loop = job.handle, job.loop
    shares: list[_Share] = []
    try:
        tuning = job.tuning
        kernel = LayerKernel(
            job.plan,
            min_run_bytes=tuning.min_run_bytes,
            min_direct_bytes=tuning.min_direct_bytes,
            staging=staging,
        )
        threads = min(tuning.threads, handle.num_layers)
        if not kernel.shareable or threads < 2 or job.plan.nbytes < _MIN_SHARED_BYTES:
            landed = _Landed(handle, loop)
            for layer in range(handle.num_layers):
                kernel(layer)
                landed.finished(layer)
            return
        # Layers dealt out in turn, so that the lowest ones land first.
        landed = _Landed(handle, loop)
        for i, queue_ in enumerate(partners.start(threads - 1), start=1):
            share = _Share(kernel, range(i, handle.num_layers, threads), landed)
            shares.append(share)
            queue_.put(share)
        for layer in range(0, handle.num_layers, threads):
            kernel(layer)
            landed.finished(layer)
    except BaseException as exc:
        _fail(job, shares, exc)
        if not isinstance(exc, Exception):
            raise
    else:
        error = next((s.error for s in _wait(shares) if s.error is not None), None)
        if error is not None:
            _fail(job, [], error)


def _wait(shares: list[_Share]) -> list[_Share]:
    for share in shares:
        share.done.wait()
    return shares


def _fail(job: _Job, shares: list[_Share], exc: BaseException) -> None:
    # Partners may still be copying into the pools: the handle fails only once they are done.
    _wait(shares)
    # Reported, never swallowed: a waiter left hanging would hold its pages forever.
    signal(job.loop, job.handle._fail, exc)


def _worker(jobs: queue.SimpleQueue[_Job | Stop | None]) -> None:
    # A thread of its own starts without torch's intra-op setting, and strided copies then
    # run on one core (about 0.7x the speed): restating the process-wide value fixes that.
    torch.set_num_threads(torch.get_num_threads())
    staging = StagingBuffer()
    partners = _Partners()
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            if isinstance(job, Stop):
                partners.stop()
                job.acknowledge()
                return
            _run(job, staging, partners)
            del job  # an idle worker holds no pools alive
    finally:
        partners.stop()


class CpuCopyEngine(ThreadedEngine[_Job]):
    """A `CopyEngine` for pools in host memory: one worker thread copies whole batches.

    The thread starts with the first copy. Statistics and completion bookkeeping live on the
    loop thread, like every other piece of state. `min_run_bytes` tunes when scattered pages
    go through a staging buffer and `min_direct_bytes` when rows move by direct memory copies
    (None: never; see `LayerKernel`). A batch of direct copies of at least 4 MiB is shared
    between `threads` threads (the worker and partners it starts as needed; default: up to
    4, no more than the CPUs), as one thread cannot use all of a machine's memory bandwidth.
    """

    def __init__(
        self,
        *,
        name: str = "cpu-copy",
        min_run_bytes: int = DEFAULT_MIN_RUN_BYTES,
        min_direct_bytes: int | None = DEFAULT_MIN_DIRECT_BYTES,
        threads: int | None = None,
    ) -> None:
        if min_run_bytes < 0:
            raise ValueError(f"min_run_bytes must be >= 0, got {min_run_bytes}")
        if min_direct_bytes is not None and min_direct_bytes < 0:
            raise ValueError(f"min_direct_bytes must be >= 0 or None, got {min_direct_bytes}")
        if threads is None:
            threads = max(1, min(4, os.cpu_count() or 1))
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        super().__init__(name, _worker)
        self._tuning = _Tuning(min_run_bytes, min_direct_bytes, threads)

    def _submit(
        self, plan: CopyPlan, handle: LayerwiseCopy, loop: asyncio.AbstractEventLoop
    ) -> _Job:
        return _Job(plan, handle, loop, self._tuning)
