"""FaultyStorage: wrap any backend and inject failures, deterministically by seed.

Faults, drawn per call (and per key of a put for damage):

- `error_rate`: the call raises StorageError.
- `partial_batch_rate`: a get/put returns ERROR for a random non-empty subset of its keys
  (those keys are not passed to the inner backend).
- `latency_s` on every call, plus `latency_spike_s` with probability `latency_spike_rate`.
- `hang_rate`: the call waits forever (until cancelled), as a dead connection would.
- `corrupt_rate` / `truncate_rate`: after a successful inner put, the stored bytes of a page are
  damaged through the inner backend's raw access (one payload byte flipped, or the value cut
  short), so the inner backend's own verification must catch it on get. A page is corrupted
  with probability `corrupt_rate`, else truncated with probability `truncate_rate` (so
  truncation happens at `(1 - corrupt_rate) * truncate_rate` overall). A put of a key already
  stored answers OK without writing, and a drawn damage then hits the stored page, as decay of
  stored bytes would. Damages drawn for one key are applied one at a time in the order of
  their calls, each after the earlier call's put has finished, so overlapping puts of a key
  leave the same bytes whatever order they finish in. A damage whose page is gone by then (a
  read found an earlier damage and removed it), or whose raw access fails, is not applied and
  not counted.

Bad input (keys that are not 32 bytes, a namespace that is not 16, a meta of another key,
batches of mismatched lengths) raises ValueError before any fault is drawn, as the protocol
asks of every backend: a fault never hides a caller's bug.

Determinism: calls are numbered in the order they are made (entered, not finished), and every
random decision of call n (its spike, hang, error, failed subset, and which of its pages are
damaged where) is drawn when the call is made, before it first awaits, from a generator seeded
by (seed, n) alone. So with the same seed, the n-th call gets the same faults whatever the calls
before it drew and in whatever order calls finish; a workload that makes the same calls in the
same order replays exactly, also when they run concurrently.

`injected()` returns counts of every fault actually injected, so a test can assert that its
faults happened. The wrapper offers the inner backend's optional interfaces (`RawAccess`,
`MaintainableStorage`, `SupportsManifest`, `register_memory`/`unregister_memory`) exactly when
the inner backend has them, passed through without faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
import random
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from .._errors import StorageConfigError, StorageError, index_of
from .._numbers import as_float
from ..storage._base import byte_segments, check_batch, check_keys, check_pages, check_put
from ..storage._maintenance import GcReport, MaintainableStorage, PageInfo, RawAccess, VerifyReport
from ..storage._manifest import ManifestLimits, SupportsManifest, WarmupManifest
from ..storage._page import HEADER_NBYTES
from ..storage._protocol import (
    Outcome,
    PageBuffer,
    PageMeta,
    StorageBackend,
    StorageCapabilities,
    StorageStats,
    check_backend,
)

if TYPE_CHECKING:
    from typing_extensions import Self

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


class _Damage(msgspec.Struct, frozen=True):
    """Damage drawn for one page of a put: applied once the inner put stored it."""

    corrupt: bool  # else truncate
    where: float  # in [0, 1): the flipped byte's or the cut's place in the stored value
    bit: int


class _Turn(msgspec.Struct, frozen=True):
    """One drawn damage's place in its key's queue: it waits for `before` (the earlier
    call's turn on the key, if any) and sets `mine` when done."""

    index: int  # in the call's batch
    key: bytes
    damage: _Damage
    before: asyncio.Event | None
    mine: asyncio.Event


class _Plan(msgspec.Struct, frozen=True):
    """Every fault decision of one call, drawn before the call first awaits."""

    spike: bool
    hang: bool
    error: bool
    failed: frozenset[int]
    damage: tuple[_Damage | None, ...]


def _rate(name: str, value: float) -> float:
    if not _is_number(value) or not 0.0 <= value <= 1.0:
        raise StorageConfigError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _seconds(name: str, value: float) -> float:
    # inf would hang every call (hang_rate says that), nan would silently add nothing.
    if not _is_number(value) or not 0.0 <= value < math.inf:
        raise StorageConfigError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    number = as_float(value)
    if number == math.inf:  # an int past a float's range
        raise StorageConfigError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return number


def _is_number(value: object) -> bool:
    # numbers.Real takes numpy's scalars too (a rate computed with numpy is one).
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _seed(value: object) -> int:
    # Seeds are text to the generator: True and 1, or 1.0 and 1, would give other faults,
    # and None a fixed seed where random.Random(None) means a fresh one.
    try:
        return index_of(value, "seed")
    except TypeError:
        raise StorageConfigError(f"seed must be an int, got {value!r}") from None


def _check_writable(pages: Sequence[PageBuffer]) -> None:
    for page in pages:
        byte_segments(page, writable=True)


class FaultyStorage:
    """A StorageBackend that forwards to `inner` and injects faults (see the module doc).

    Entering and closing it enters and closes `inner`. The object is of a subclass that adds
    the optional interfaces `inner` has (and only those), so `isinstance(f, RawAccess)` and the
    like answer for the inner backend.
    """

    def __new__(cls, inner: StorageBackend, **rates: Any) -> FaultyStorage:
        """A FaultyStorage of the subclass that matches `inner`'s optional interfaces."""
        del rates  # __init__ takes and checks them
        return object.__new__(_subclass_for(inner))

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
        try:
            check_backend(inner, "FaultyStorage's inner backend")
        except StorageConfigError as exc:
            # A wrong argument type, here rather than as an AttributeError on entry.
            raise TypeError(str(exc)) from None
        latency_s = _seconds("latency_s", latency_s)
        latency_spike_s = _seconds("latency_spike_s", latency_spike_s)
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
        self._seed = _seed(seed)
        self._calls = 0
        # Per key, the turn of the last put drawn to damage it.
        self._last_turn: dict[bytes, asyncio.Event] = {}
        self._counts: dict[str, int] = dict.fromkeys(FaultCounts.__struct_fields__, 0)
        self._entered = False
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
        state = "closed" if self._closed else "open" if self._entered else "new"
        return f"<FaultyStorage {state} over {self._inner!r} injected({injected})>"

    async def __aenter__(self) -> Self:
        await self._inner.__aenter__()
        self._entered = True
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

    # Fault drawing: all of a call's decisions come from its own generator, seeded by (seed,
    # call number) and used up before the call's first await (see the module doc).

    def _plan(self, op: str, count: int) -> _Plan:
        if self._closed:
            raise StorageError(f"{self.name} is closed")
        index = self._calls
        self._calls += 1
        rng = random.Random(f"{self._seed}:{index}")

        def hit(rate: float) -> bool:
            return rate > 0.0 and rng.random() < rate

        spike = hit(self._spike_rate)
        hang = hit(self._hang_rate)
        error = hit(self._error_rate)
        failed: frozenset[int] = frozenset()
        if op in ("get", "put") and count and hit(self._partial_rate):
            failed = frozenset(rng.sample(range(count), rng.randint(1, count)))
        damage: list[_Damage | None] = []
        if op == "put" and (self._corrupt_rate or self._truncate_rate):
            for _ in range(count):
                corrupt = hit(self._corrupt_rate)
                truncate = not corrupt and hit(self._truncate_rate)
                damage.append(
                    _Damage(corrupt, rng.random(), rng.randrange(8))
                    if corrupt or truncate
                    else None
                )
        return _Plan(spike, hang, error, failed, tuple(damage))

    async def _call_faults(self, plan: _Plan, op: str) -> None:
        delay = self._latency_s
        if plan.spike:
            self._counts["latency_spikes"] += 1
            delay += self._spike_s
        if delay > 0:
            await asyncio.sleep(delay)
        if plan.hang:
            self._counts["hangs"] += 1
            await asyncio.Event().wait()  # never set: only cancellation ends it
        if plan.error:
            self._counts["errors"] += 1
            raise StorageError(f"injected fault in {op} on {self._inner.name}")

    def _count_failed(self, plan: _Plan) -> None:
        if plan.failed:
            self._counts["partial_batches"] += 1
            self._counts["partial_keys"] += len(plan.failed)

    # StorageBackend.

    async def exists(self, keys: Sequence[bytes]) -> int:
        """The inner `exists`, after latency, hang and error faults."""
        check_keys(keys)
        plan = self._plan("exists", len(keys))
        await self._call_faults(plan, "exists")
        return await self._inner.exists(keys)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        """The inner `get`, after call faults, with a partial batch failed when drawn."""
        check_batch(keys, ("buffers", into))
        check_keys(keys, namespace)
        check_pages(into)  # ValueError, not byte_segments' TypeError, for a wrong type
        _check_writable(into)
        plan = self._plan("get", len(keys))
        await self._call_faults(plan, "get")
        self._count_failed(plan)
        keep = [i for i in range(len(keys)) if i not in plan.failed]
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
        check_put(keys, pages, metas)
        plan = self._plan("put", len(keys))
        turns = self._queue_damage(keys, plan)
        try:
            await self._call_faults(plan, "put")
            self._count_failed(plan)
            keep = [i for i in range(len(keys)) if i not in plan.failed]
            outcomes = [Outcome.ERROR] * len(keys)
            inner = await self._inner.put(
                [keys[i] for i in keep], [pages[i] for i in keep], [metas[i] for i in keep]
            )
            for i, outcome in zip(keep, inner, strict=True):
                outcomes[i] = outcome
            if turns:
                await self._damage(turns, {i for i in keep if outcomes[i] is Outcome.OK})
            return outcomes
        finally:
            for turn in turns:
                self._end_turn(turn)

    def _queue_damage(self, keys: Sequence[bytes], plan: _Plan) -> list[_Turn]:
        # Synchronous, with the plan: the queue order is the call order.
        if plan.hang or plan.error:
            return []  # this call never reaches its damage
        turns = []
        for i, damage in enumerate(plan.damage):
            if damage is None or i in plan.failed:
                continue
            key = keys[i]
            mine = asyncio.Event()
            turns.append(_Turn(i, key, damage, self._last_turn.get(key), mine))
            self._last_turn[key] = mine
        return turns

    def _end_turn(self, turn: _Turn) -> None:
        turn.mine.set()
        if self._last_turn.get(turn.key) is turn.mine:
            del self._last_turn[turn.key]

    async def _damage(self, turns: list[_Turn], stored: set[int]) -> None:
        inner = self._inner
        assert isinstance(inner, RawAccess)  # checked in __init__
        for turn in turns:
            if turn.before is not None:
                await turn.before.wait()
            if turn.index in stored:
                with contextlib.suppress(StorageError):  # decay that did not happen
                    await self._damage_one(inner, turn.key, turn.damage)
            self._end_turn(turn)

    async def _damage_one(self, inner: RawAccess, key: bytes, damage: _Damage) -> None:
        value = await inner.read_raw(key)
        if not value:
            return
        if damage.corrupt:
            damaged = bytearray(value)
            # A payload byte when there is a payload, so the checksum (not the header check)
            # has to catch it.
            low = HEADER_NBYTES if len(value) > HEADER_NBYTES else 0
            position = low + int(damage.where * (len(value) - low))
            damaged[position] ^= 1 << damage.bit
            await inner.write_raw(key, bytes(damaged))
            self._counts["corrupted"] += 1
        else:
            await inner.write_raw(key, value[: int(damage.where * len(value))])
            self._counts["truncated"] += 1

    async def delete(self, keys: Sequence[bytes]) -> int:
        """The inner `delete`, after latency, hang and error faults."""
        check_keys(keys)
        plan = self._plan("delete", len(keys))
        await self._call_faults(plan, "delete")
        return await self._inner.delete(keys)


# The optional interfaces, each in a subclass that forwards it to the inner backend without
# faults. `FaultyStorage.__new__` picks the combination the inner backend has, so a wrapper
# never claims an interface (to isinstance checks, to the cache's warmup, to the conformance
# suite) that its inner backend lacks, and never hides one it has.


class _FaultyRaw(FaultyStorage):
    """Adds `RawAccess`."""

    async def read_raw(self, key: bytes) -> bytes | None:
        """The inner backend's stored bytes."""
        inner = self._inner
        assert isinstance(inner, RawAccess)  # this class is chosen only then
        return await inner.read_raw(key)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        """Replace the inner backend's stored bytes."""
        inner = self._inner
        assert isinstance(inner, RawAccess)
        await inner.write_raw(key, value)


class _FaultyMaintainable(FaultyStorage):
    """Adds `MaintainableStorage`."""

    def _maintainable(self) -> MaintainableStorage:
        inner = self._inner
        assert isinstance(inner, MaintainableStorage)  # this class is chosen only then
        return inner

    async def list_pages(self, limit: int | None = None) -> list[PageInfo]:
        """The inner backend's pages."""
        return await self._maintainable().list_pages(limit)

    async def verify(self) -> VerifyReport:
        """The inner backend's verify."""
        return await self._maintainable().verify()

    async def gc(self) -> GcReport:
        """The inner backend's gc."""
        return await self._maintainable().gc()


class _FaultyManifest(FaultyStorage):
    """Adds `SupportsManifest`: warmup and manifest writes keep working through the wrapper."""

    def manifest(self, limits: ManifestLimits | None = None) -> WarmupManifest:
        """The inner backend's warmup manifest."""
        inner = self._inner
        assert isinstance(inner, SupportsManifest)  # this class is chosen only then
        return inner.manifest(limits)


class _FaultyMemory(FaultyStorage):
    """Adds memory registration (as `MooncakeStorage` has)."""

    async def register_memory(self, memory: object, nbytes: int | None = None) -> None:
        """The inner backend's `register_memory`."""
        await getattr(self._inner, "register_memory")(memory, nbytes)  # noqa: B009

    async def unregister_memory(self, memory: object) -> None:
        """The inner backend's `unregister_memory`."""
        await getattr(self._inner, "unregister_memory")(memory)  # noqa: B009


def _has_memory_registration(inner: object) -> bool:
    return callable(getattr(inner, "register_memory", None)) and callable(
        getattr(inner, "unregister_memory", None)
    )


_SUBCLASSES: dict[tuple[bool, ...], type[FaultyStorage]] = {}


# help() and inspect show the rates `__init__` takes, not `__new__`'s catch-all.
_init_signature = inspect.signature(FaultyStorage.__init__)
FaultyStorage.__signature__ = _init_signature.replace(  # type: ignore[attr-defined]
    return_annotation=inspect.Signature.empty,
    parameters=list(_init_signature.parameters.values())[1:],
)


def _subclass_for(inner: StorageBackend) -> type[FaultyStorage]:
    """FaultyStorage, or a (cached) subclass with the optional interfaces of `inner`."""
    flags = (
        isinstance(inner, RawAccess),
        isinstance(inner, MaintainableStorage),
        isinstance(inner, SupportsManifest),
        _has_memory_registration(inner),
    )
    found = _SUBCLASSES.get(flags)
    if found is None:
        mixins = (_FaultyRaw, _FaultyMaintainable, _FaultyManifest, _FaultyMemory)
        bases = tuple(m for m, has in zip(mixins, flags, strict=True) if has)
        if not bases:
            found = FaultyStorage
        else:
            # Named FaultyStorage too: reprs, tracebacks and docs show the one public name.
            found = type("FaultyStorage", bases, {"__module__": __name__})
        _SUBCLASSES[flags] = found
    return found
