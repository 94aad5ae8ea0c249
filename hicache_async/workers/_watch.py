"""The first error that ends a worker, noted as it happens."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["WorkerWatch"]


class WorkerWatch:
    """Runs workers and keeps the first error that ends one (a KeyboardInterrupt raised in a
    backend call) in `failed_with`, the moment it does: the task groups above it take
    several loop steps to unwind, in which callers would otherwise find the workers gone
    without a word. A cancellation is no failure."""

    __slots__ = ("failed_with",)

    def __init__(self) -> None:
        self.failed_with: BaseException | None = None

    async def run(self, worker: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await worker(*args)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self.failed_with is None:
                self.failed_with = exc
            raise
