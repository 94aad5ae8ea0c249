"""`CudaCopyEngine`: copies on a side CUDA stream, one event per layer, awaited from a thread.

`copy()` only records an event on the caller's current stream (so the copy starts after work
already queued there, such as the model writing the pages being backed up) and hands the batch
to the engine's thread. That thread enqueues every layer's copy on the engine's side stream,
recording an event after each layer, then blocks in `event.synchronize()` layer by layer and
tells the loop with `call_soon_threadsafe`: the loop neither blocks nor polls, and the launch
cost of a scattered batch (one DMA per page and layer) stays off the loop too.

torch.cuda is touched only when an engine is created, so importing this module is free on
machines without CUDA.
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any

import torch

from ._cpu import LayerKernel
from ._handle import LayerwiseCopy
from ._protocol import CopyPlan, Stop, ThreadedEngine, signal

__all__ = ["CudaCopyEngine"]


class _Batch:
    __slots__ = ("handle", "loop", "plan", "ready")

    def __init__(
        self, plan: CopyPlan, handle: LayerwiseCopy, loop: asyncio.AbstractEventLoop, ready: Any
    ) -> None:
        self.plan = plan
        self.handle = handle
        self.loop = loop
        self.ready = ready


def _run_batch(batch: _Batch, device: torch.device, stream: Any) -> None:
    handle, loop = batch.handle, batch.loop
    events: list[Any] = []
    error: Exception | None = None
    with torch.cuda.device(device), torch.cuda.stream(stream):
        try:
            stream.wait_event(batch.ready)
            kernel = LayerKernel(batch.plan, non_blocking=True)
            for layer in range(handle.num_layers):
                kernel(layer)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
        except Exception as exc:
            error = exc
        for layer, event in enumerate(events):
            event.synchronize()
            if error is None:
                signal(loop, handle._layer_landed, layer)
        if error is not None:
            # A launch failed part-way: let everything already queued finish before reporting,
            # so the caller never reuses pages the stream is still writing.
            stream.synchronize()
            signal(loop, handle._fail, error)


def _waiter(
    batches: queue.SimpleQueue[_Batch | Stop | None], device: torch.device, stream: Any
) -> None:
    while True:
        batch = batches.get()
        if batch is None:
            return
        if isinstance(batch, Stop):
            batch.acknowledge()
            return
        try:
            _run_batch(batch, device, stream)
        except BaseException as exc:
            signal(batch.loop, batch.handle._fail, exc)
            if not isinstance(exc, Exception):
                raise


class CudaCopyEngine(ThreadedEngine[_Batch]):
    """A `CopyEngine` that copies on a side CUDA stream and awaits per-layer CUDA events.

    Host pools should be pinned (as `make_pools` makes them) for host copies to be asynchronous.
    """

    def __init__(self, device: torch.device | str = "cuda", *, name: str = "cuda-copy") -> None:
        import torch.cuda

        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyEngine needs a CUDA device")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaCopyEngine needs a cuda device, got {dev}")
        # The waiter thread must select the same device the caller means by plain "cuda".
        index: int | None = dev.index
        if index is None:
            index = torch.cuda.current_device()
        dev = torch.device("cuda", index)
        stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]

        def worker(batches: queue.SimpleQueue[_Batch | Stop | None]) -> None:
            _waiter(batches, dev, stream)

        super().__init__(name, worker)
        self._device = dev
        self._stream = stream

    def _submit(
        self, plan: CopyPlan, handle: LayerwiseCopy, loop: asyncio.AbstractEventLoop
    ) -> _Batch:
        with torch.cuda.device(self._device):
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream())
        return _Batch(plan, handle, loop, ready)
