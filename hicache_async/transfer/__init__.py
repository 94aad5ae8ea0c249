"""Copy engines: move pages between KV pools layer by layer, off the event loop's thread.

`default_copy_engine(device)` picks the engine for a device pool: `CudaCopyEngine` (side stream,
per-layer events) for CUDA, `CpuCopyEngine` (one worker thread) otherwise.
"""

from __future__ import annotations

import torch

from ._cpu import CpuCopyEngine
from ._cuda import CudaCopyEngine
from ._handle import LayerwiseCopy
from ._protocol import CopyEngine, CopyStatistics

__all__ = [
    "CopyEngine",
    "CopyStatistics",
    "CpuCopyEngine",
    "CudaCopyEngine",
    "LayerwiseCopy",
    "default_copy_engine",
]


def default_copy_engine(device: torch.device | str) -> CopyEngine:
    """The engine for a device pool on `device`: CUDA streams and events, or a CPU thread."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaCopyEngine(dev)
    return CpuCopyEngine()
