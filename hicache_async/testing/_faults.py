"""FaultyStorage: wrap any backend and inject failures, deterministically by seed.

Faults, each drawn per call (or per key) from one `random.Random(seed)`:

- `error_rate`: the call raises StorageError.
- `partial_batch_rate`: a get/put returns ERROR for a random non-empty subset of its keys
  (those keys are not passed to the inner backend).
- `latency_s` on every call, plus `latency_spike_s` with probability `latency_spike_rate`.
- `hang_rate`: the call waits forever (until cancelled), as a dead connection would.
- `corrupt_rate` / `truncate_rate`: after a successful inner put, the stored bytes of a page are
  damaged through the inner backend's raw access (one payload byte flipped, or the value cut
  short), so the inner backend's own verification must catch it on get.

`injected()` returns counts of every fault actually injected, so a test can assert that its
faults happened.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import msgspec

from .._errors import StorageConfigError, StorageError
from ..storage._maintenance import GcReport, MaintainableStorage, PageInfo, RawAccess, VerifyReport
from ..storage._page import HEADER_NBYTES
from ..storage._protocol import (
    Outcome,
    PageBuffer,
    PageMeta,
    StorageBackend,
    StorageCapabilities,
    StorageStats,
)

if TYPE_CHECKING:
    from typing import Self

__all__ = ["FaultCounts", "FaultyStorage"]


class FaultCounts(msgspec.Struct, frozen=True):
    """How many faults of each kind were injected."""

    errors: int = 0
    partial_batches: int = 0
    partial_keys: int = 0
    latency_spikes: int = 0
    hangs: int = 0
    corrupted: int = 0
    truncated: int = 0


def _rate(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise StorageConfigError(f"{name} must be in [0, 1], got {value}")
    return value


class FaultyStorage:
    """A StorageBackend that forwards to `inner` and injects faults (see the module doc).

    Entering and closing it enters and closes `inner`.
    """

    def __init__(
        self,
        inner: StorageBackend,
        *,
        seed: int = 0,
        error_rate: float = 0.0,
        latency_s: float = 0.0,
        latency_spike_rate: float = 0.0,
        latency_spike_s: float = 0.0,
        hang_rate: float = 0.0,
        corrupt_rate: float = 0.0,
        truncate_rate: float = 0.0,
        partial_batch_rate: float = 0.0,
    ) -> None:
        if latency_s < 0 or latency_spike_s < 0:
            raise StorageConfigError("latencies must be >= 0")
        self._error_rate = _rate("error_rate", error_rate)
        self._spike_rate = _rate("latency_spike_rate", latency_spike_rate)
        self._hang_rate = _rate("hang_rate", hang_rate)
        self._corrupt_rate = _rate("corrupt_rate", corrupt_rate)
        self._truncate_rate = _rate("truncate_rate", truncate_rate)
        self._partial_rate = _rate("partial_batch_rate", partial_batch_rate)
        if (corrupt_rate or truncate_rate) and not isinstance(inner, RawAccess):
            raise StorageConfigError(
                f"corrupt_rate and truncate_rate need raw access (read_raw/write_raw), "
                f"which {type(inner).__name__} does not offer"
            )
        self._inner = inner
        self._latency_s = latency_s
        self._spike_s = latency_spike_s
        self._random = random.Random(seed)
        self._counts: dict[str, int] = dict.fromkeys(FaultCounts.__struct_fields__, 0)
        self._closed = False

    @property
    def inner(self) -> StorageBackend:
        """The wrapped backend."""
        return self._inner

    @property
    def name(self) -> str:
        """`faulty+` and the inner backend's name."""
        return f"faulty+{self._inner.name}"

    @property
    def capabilities(self) -> StorageCapabilities:
        """The inner backend's capabilities."""
        return self._inner.capabilities

    def injected(self) -> FaultCounts:
        """Counts of every fault injected so far."""
        return FaultCounts(**self._counts)

    def __repr__(self) -> str:
        injected = ", ".join(f"{k}={v}" for k, v in self._counts.items() if v)
        state = "closed" if self._closed else "open"
        return f"<FaultyStorage {state} over {self._inner!r} injected({injected})>"

    async def __aenter__(self) -> Self:
        await self._inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the inner backend. Idempotent."""
        self._closed = True
        await self._inner.close()

    def stats(self) -> StorageStats:
        """The inner backend's counters (injected faults are in `injected()`)."""
        return self._inner.stats()

    # Fault drawing. Every draw happens on the loop in call order, so a seed replays exactly.

    def _hit(self, rate: float) -> bool:
        return rate > 0.0 and self._random.random() < rate

    async def _before(self, op: str) -> None:
        if self._closed:
            raise StorageError(f"{self.name} is closed")
        delay = self._latency_s
        if self._hit(self._spike_rate):
            self._counts["latency_spikes"] += 1
            delay += self._spike_s
        hang = self._hit(self._hang_rate)
        error = self._hit(self._error_rate)
        if delay > 0:
            await asyncio.sleep(delay)
        if hang:
            self._counts["hangs"] += 1
            await asyncio.Event().wait()  # never set: only cancellation ends it
        if error:
            self._counts["errors"] += 1
            raise StorageError(f"injected fault in {op} on {self._inner.name}")

    def _failed_subset(self, count: int) -> set[int]:
        if count == 0 or not self._hit(self._partial_rate):
            return set()
        size = self._random.randint(1, count)
        failed = set(self._random.sample(range(count), size))
        self._counts["partial_batches"] += 1
        self._counts["partial_keys"] += size
        return failed

    # StorageBackend.

    async def exists(self, keys: Sequence[bytes]) -> int:
        """The inner `exists`, after latency, hang and error faults."""
        await self._before("exists")
        return await self._inner.exists(keys)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        """The inner `get`, after call faults, with a partial batch failed when drawn."""
        if len(into) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(into)} buffers")
        await self._before("get")
        failed = self._failed_subset(len(keys))
        keep = [i for i in range(len(keys)) if i not in failed]
        outcomes = [Outcome.ERROR] * len(keys)
        inner = await self._inner.get(
            [keys[i] for i in keep], [into[i] for i in keep], namespace=namespace
        )
        for i, outcome in zip(keep, inner, strict=True):
            outcomes[i] = outcome
        return outcomes

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        """The inner `put` (call and partial-batch faults), then stored pages damaged when
        drawn."""
        if len(pages) != len(keys) or len(metas) != len(keys):
            raise ValueError(f"got {len(keys)} keys, {len(pages)} pages and {len(metas)} metas")
        await self._before("put")
        failed = self._failed_subset(len(keys))
        keep = [i for i in range(len(keys)) if i not in failed]
        outcomes = [Outcome.ERROR] * len(keys)
        inner = await self._inner.put(
            [keys[i] for i in keep], [pages[i] for i in keep], [metas[i] for i in keep]
        )
        for i, outcome in zip(keep, inner, strict=True):
            outcomes[i] = outcome
        await self._damage([keys[i] for i, o in zip(keep, inner, strict=True) if o is Outcome.OK])
        return outcomes

    async def _damage(self, keys: list[bytes]) -> None:
        if not (self._corrupt_rate or self._truncate_rate):
            return
        inner = self._inner
        assert isinstance(inner, RawAccess)  # checked in __init__
        for key in keys:
            corrupt = self._hit(self._corrupt_rate)
            truncate = not corrupt and self._hit(self._truncate_rate)
            if not (corrupt or truncate):
                continue
            value = await inner.read_raw(key)
            if value is None:
                continue
            if corrupt:
                damaged = bytearray(value)
                # A payload byte when there is a payload, so the checksum (not the header
                # check) has to catch it.
                low = HEADER_NBYTES if len(value) > HEADER_NBYTES else 0
                position = self._random.randrange(low, len(value))
                damaged[position] ^= 1 << self._random.randrange(8)
                await inner.write_raw(key, bytes(damaged))
                self._counts["corrupted"] += 1
            else:
                await inner.write_raw(key, value[: self._random.randrange(len(value))])
                self._counts["truncated"] += 1

    async def delete(self, keys: Sequence[bytes]) -> int:
        """The inner `delete`, after latency, hang and error faults."""
        await self._before("delete")
        return await self._inner.delete(keys)

    # Pass-through of the optional protocols, without faults.

    async def read_raw(self, key: bytes) -> bytes | None:
        """The inner backend's stored bytes (needs its raw access)."""
        return await self._raw().read_raw(key)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        """Replace the inner backend's stored bytes (needs its raw access)."""
        await self._raw().write_raw(key, value)

    def _raw(self) -> RawAccess:
        if not isinstance(self._inner, RawAccess):
            raise StorageError(f"{self._inner.name} has no raw access")
        return self._inner

    def _maintainable(self) -> MaintainableStorage:
        if not isinstance(self._inner, MaintainableStorage):
            raise StorageError(f"{self._inner.name} has no maintenance operations")
        return self._inner

    async def list_pages(self, limit: int | None = None) -> list[PageInfo]:
        """The inner backend's pages (needs its maintenance operations)."""
        return await self._maintainable().list_pages(limit)

    async def verify(self) -> VerifyReport:
        """The inner backend's verify (needs its maintenance operations)."""
        return await self._maintainable().verify()

    async def gc(self) -> GcReport:
        """The inner backend's gc (needs its maintenance operations)."""
        return await self._maintainable().gc()
