"""`CpuCopyEngine`: copies in one dedicated worker thread, layer by layer.

A batch is one job: one queue hand-off per `copy()`, then per layer a few torch ops (which run
without the GIL and use torch's intra-op threads) and one `call_soon_threadsafe` to tell the
loop the layer has landed.
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any

import numpy as np
import torch

from ._handle import LayerwiseCopy
from ._protocol import CopyPlan, Stop, ThreadedEngine, signal

__all__ = ["DEFAULT_MIN_RUN_BYTES", "CpuCopyEngine", "LayerKernel", "StagingBuffer"]

#: Gathers and scatters take one op per run of consecutive rows; below this many bytes per run
#: on average the per-op cost outweighs a second pass, and rows go through a staging buffer.
DEFAULT_MIN_RUN_BYTES = 64 * 1024

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
    """

    __slots__ = (
        "_dst_rows",
        "_dst_step",
        "_mode",
        "_non_blocking",
        "_ops",
        "_plan",
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
        if src.device != dst.device or plan.num_runs * _MIN_MEAN_RUN_PAGES <= plan.num_pages:
            self._mode = "runs"
            return
        per_token = src.token_major or dst.token_major
        src_rows = src.copy_rows(per_token=per_token)
        dst_rows = dst.copy_rows(per_token=per_token)
        s_rows, self._src_step = src.copy_row_index(plan.src_pages, per_token=per_token)
        d_rows, self._dst_step = dst.copy_row_index(plan.dst_pages, per_token=per_token)
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

    @property
    def mode(self) -> str:
        """How pages move: gather, scatter, stage or runs."""
        return self._mode

    def __call__(self, layer: int) -> None:
        mode = self._mode
        if mode == "runs":
            self._copy_runs(layer)
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


class _Job:
    __slots__ = ("handle", "loop", "min_run_bytes", "plan")

    def __init__(
        self,
        plan: CopyPlan,
        handle: LayerwiseCopy,
        loop: asyncio.AbstractEventLoop,
        min_run_bytes: int,
    ) -> None:
        self.plan = plan
        self.handle = handle
        self.loop = loop
        self.min_run_bytes = min_run_bytes


def _run(job: _Job, staging: StagingBuffer) -> None:
    handle, loop = job.handle, job.loop
    try:
        kernel = LayerKernel(job.plan, min_run_bytes=job.min_run_bytes, staging=staging)
        for layer in range(handle.num_layers):
            kernel(layer)
            signal(loop, handle._layer_landed, layer)
    except BaseException as exc:
        # Reported, never swallowed: a waiter left hanging would hold its pages forever.
        signal(loop, handle._fail, exc)
        if not isinstance(exc, Exception):
            raise


def _worker(jobs: queue.SimpleQueue[_Job | Stop | None]) -> None:
    staging = StagingBuffer()
    while True:
        job = jobs.get()
        if job is None:
            return
        if isinstance(job, Stop):
            job.acknowledge()
            return
        _run(job, staging)
        del job  # an idle worker holds no pools alive


class CpuCopyEngine(ThreadedEngine[_Job]):
    """A `CopyEngine` for pools in host memory: one worker thread copies whole batches.

    The thread starts with the first copy. Statistics and completion bookkeeping live on the
    loop thread, like every other piece of state. `min_run_bytes` tunes when scattered pages
    go through a staging buffer (see `LayerKernel`).
    """

    def __init__(
        self, *, name: str = "cpu-copy", min_run_bytes: int = DEFAULT_MIN_RUN_BYTES
    ) -> None:
        super().__init__(name, _worker)
        if min_run_bytes < 0:
            raise ValueError(f"min_run_bytes must be >= 0, got {min_run_bytes}")
        self._min_run_bytes = min_run_bytes

    def _submit(
        self, plan: CopyPlan, handle: LayerwiseCopy, loop: asyncio.AbstractEventLoop
    ) -> _Job:
        return _Job(plan, handle, loop, self._min_run_bytes)
