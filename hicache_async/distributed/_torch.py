"""`TorchRankGroup`: the rank group over a torch.distributed gloo process group.

Collectives block, so they run on one dedicated thread per group, never on the event loop's
thread. One thread gives two guarantees: the loop keeps serving while a collective waits for a
slow peer, and collectives reach gloo in exactly the order they were called on this rank.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import numpy as np
import structlog
import torch
import torch.distributed as dist

from .._errors import ConfigError
from .._loop import LoopOwner
from .._numbers import as_float
from ._errors import AgreementMismatch, CollectiveError, CollectiveTimeout, GroupBrokenError
from ._group import (
    GroupStatistics,
    agreement_tag,
    check_int64,
    check_payload,
    check_tag,
    unique_items,
)

__all__ = ["TorchRankGroup"]

_log = structlog.get_logger("hicache_async")

T = TypeVar("T")

_ITEMS = msgspec.msgpack.Decoder(list[bytes])
_ENCODER = msgspec.msgpack.Encoder()


class _CollectiveThread:
    """One thread that runs jobs in submission order and hands results back to a loop.

    A daemon thread rather than a `ThreadPoolExecutor`: a job stuck in a collective (until its
    timeout) must not hold up interpreter exit, and nothing here is ever cancelled, so a job
    that was submitted always runs.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queue `fn`; the returned future (of `loop`) gets its result or exception."""
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if future.done():  # only if someone cancelled the future itself; nobody awaits it
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def job() -> None:
            result: T | None = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting side, whatever it is
                error = exc
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:
                # The loop is closed: nobody can be waiting for this result any more.
                return

        self._jobs.put(job)
        return future

    def stop(self) -> None:
        """Let the thread end once the jobs already queued have run."""
        self._jobs.put(None)


class _TagMismatch(Exception):
    """Raised on the collective thread when the reduced tags show ranks paired different
    agreements; `_guarded` turns it into `AgreementMismatch`."""


def _is_timeout(error: BaseException, elapsed: float, timeout_s: float) -> bool:
    # gloo reports "Timed out waiting <n>ms for recv/send operation"; a peer whose own timeout
    # closed the connection a moment earlier shows up as a failure after about as long.
    text = str(error).lower()
    return "timed out" in text or "timeout" in text or elapsed >= timeout_s


class TorchRankGroup:
    """A `RankGroup` over a torch.distributed process group with the gloo backend.

    Wrap an existing group (``TorchRankGroup(dist.new_group(backend="gloo"))``; the default
    group if `group` is None), or join a new one with `await TorchRankGroup.create(...)`.

    Every collective runs with `timeout_s`, whatever the process group's own timeout. One that
    does not complete in time raises `CollectiveTimeout`; one that fails otherwise raises
    `CollectiveError`. Either way the group is then broken, because gloo cannot resynchronise
    after a partial collective: every later call raises `GroupBrokenError` at once, and callers
    degrade (treat storage as a miss, skip warmup).

    A call is entered when its coroutine starts. If the awaiting task is then cancelled, the
    collective still runs to completion on the group's thread, its result is dropped, and later
    collectives follow it in order, so the ranks stay in step. Call collectives from one task
    (or in an order every rank reproduces). The group belongs to the event loop (and thread)
    that makes its first collective call; a call from elsewhere raises `WrongThreadError`.

    Use as ``async with`` (or call `aclose`) to stop the thread and, for a group made by
    `create`, destroy the process group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout_s: float = 30.0) -> None:
        timeout = _check_timeout("timeout_s", timeout_s)
        if not dist.is_available():
            raise ConfigError("group", "this torch build has no torch.distributed")
        if group is None:
            if not dist.is_initialized():
                raise ConfigError(
                    "group",
                    "no process group given and torch.distributed is not initialised; "
                    "pass a gloo group or use TorchRankGroup.create(...)",
                )
            group = dist.group.WORLD
            assert group is not None  # initialised above
        backend = str(dist.get_backend(group))
        if "gloo" not in backend:
            raise ConfigError(
                "group",
                f"needs a process group with the gloo backend (got {backend!r}); "
                "make one with dist.new_group(backend='gloo')",
            )
        worker = _CollectiveThread(f"hicache-tp-{group.rank()}")
        self._setup(group, timeout_s, timeout, worker, owned=False)

    def _setup(
        self,
        group: dist.ProcessGroup,
        timeout_s: float,
        timeout: timedelta,
        worker: _CollectiveThread,
        *,
        owned: bool,
    ) -> None:
        # None once `aclose` destroyed it: an owned group's TCPStore keeps listening on its
        # port for as long as anything references the group.
        self._group: dist.ProcessGroup | None = group
        self._rank: int = group.rank()
        self._size: int = group.size()
        self._timeout_s = timeout_s
        self._timeout = timeout
        self._worker = worker
        self._owned = owned
        self._owner = LoopOwner("TorchRankGroup")
        # Counters and the broken flag are written on the collective thread and read on the
        # loop's thread.
        self._lock = threading.Lock()
        self._collectives = 0
        self._timeouts = 0
        self._failures = 0
        self._cancelled = 0
        self._broken = False
        self._closed = False

    @classmethod
    async def create(
        cls,
        rank: int,
        size: int,
        *,
        address: str = "127.0.0.1",
        port: int,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 60.0,
    ) -> TorchRankGroup:
        """Join a new gloo group of `size` ranks as `rank`; rank 0 hosts a TCPStore at
        `address`:`port`.

        This initialises torch.distributed's default group (so there must be none yet). The
        rendezvous runs on the group's thread and waits up to `connect_timeout_s` for every
        rank; `timeout_s` bounds each later collective. A failed rendezvous raises
        `CollectiveError`. Leaving the group (`aclose`) destroys the process group.
        """
        # bool is an int subclass: rank=True would silently mean rank 1.
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError("size", f"must be an int >= 1, got {size!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
            raise ConfigError("rank", f"must be an int in [0, {size}), got {rank!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ConfigError("port", f"must be an int in [1, 65535], got {port!r}")
        # Both timedeltas are built here, before any thread starts or any rank joins: a value
        # that cannot become one must fail as a ConfigError now, not after the rendezvous.
        timeout = _check_timeout("timeout_s", timeout_s)
        connect = _check_timeout("connect_timeout_s", connect_timeout_s)
        if dist.is_initialized():
            raise ConfigError(
                "torch.distributed",
                "a default process group already exists; wrap it (or a gloo group made with "
                "dist.new_group(backend='gloo')) with TorchRankGroup(group) instead",
            )

        def join() -> dist.ProcessGroup:
            # TCPStore is public API, re-exported without being listed in torch's stubs.
            store = dist.TCPStore(  # type: ignore[attr-defined]
                address, port, size, is_master=rank == 0, timeout=connect
            )
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=size, timeout=connect
            )
            world = dist.group.WORLD
            assert world is not None  # just initialised
            return world

        def leave_if_joined() -> None:
            if dist.is_initialized():
                dist.destroy_process_group()

        worker = _CollectiveThread(f"hicache-tp-{rank}")
        try:
            group = await asyncio.shield(worker.submit(asyncio.get_running_loop(), join))
        except asyncio.CancelledError:
            # The rendezvous cannot be withdrawn; undo it once it is over, on the same thread.
            worker.submit(asyncio.get_running_loop(), leave_if_joined)
            worker.stop()
            raise
        except Exception as exc:
            worker.stop()
            raise CollectiveError(
                f"rank {rank} of {size} could not join the group at {address}:{port}: {exc}"
            ) from exc
        self = cls.__new__(cls)
        self._setup(group, timeout_s, timeout, worker, owned=True)
        return self

    # Read-only: a cache checks them against its configuration once, and the collectives
    # (rank 0's broadcast, each rank's slot in a gather) follow the process group's own.
    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._size

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "ok"
        return f"<TorchRankGroup rank={self.rank}/{self.size} timeout={self._timeout_s}s {state}>"

    async def __aenter__(self) -> TorchRankGroup:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Refuse new calls, let queued collectives finish, then stop the group's thread.

        A group made by `create` also destroys its process group. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        owned = self._owned

        def shutdown() -> None:
            if owned and dist.is_initialized():
                dist.destroy_process_group(self._group)
            # Queued collectives have run (this job is last), so nothing needs the group any
            # more; dropping it lets the TCPStore close its port, so the port can be reused.
            self._group = None

        done = self._worker.submit(asyncio.get_running_loop(), shutdown)
        self._worker.stop()
        await asyncio.shield(done)

    def statistics(self) -> GroupStatistics:
        """A snapshot of this rank's counters."""
        with self._lock:
            return GroupStatistics(
                collectives=self._collectives,
                timeouts=self._timeouts,
                failures=self._failures,
                broken=self._broken or self._closed,
                cancelled=self._cancelled,
            )

    # -- the collectives -------------------------------------------------------------------

    async def all_min(self, value: int, *, tag: int | None = None) -> int:
        """The minimum of `value` (a signed 64-bit integer) over all ranks.

        One reduction of ``[value, tag, -tag]`` also checks the tags: they match iff
        ``min(tag) == -min(-tag)``. A mismatch raises `AgreementMismatch` on every rank and
        breaks the group. Without a `tag`, the tag is that of a plain `all_min`, so pairing
        one with another agreement, `all_max` or `barrier` is a mismatch too.
        """
        number = check_int64(value)
        checked = check_tag(tag)
        mine = _ALL_MIN_TAG if checked is None else checked
        return await self._collective("all_min", lambda: self._tagged_min(number, mine))

    async def all_max(self, value: int) -> int:
        """The maximum of `value` (a signed 64-bit integer) over all ranks (tag-checked as
        `all_min` is)."""
        number = check_int64(value)
        # max(v) == ~min(~v), and ~ maps the int64 range onto itself (unlike negation).
        low = await self._collective("all_max", lambda: self._tagged_min(~number, _ALL_MAX_TAG))
        return ~low

    async def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload`, indexed by rank; payloads may differ in length."""
        check_payload(payload)
        return await self._collective("all_gather_bytes", lambda: self._gather(payload))

    async def agree_common(self, items: Sequence[bytes], *, tag: int | None = None) -> list[bytes]:
        """The items every rank has, without duplicates, in rank 0's order.

        Rank 0 broadcasts its list once; each rank answers with one byte per item (does it
        have it) and a MIN reduction of those bytes keeps what all ranks have. So the traffic is
        rank 0's list plus one byte per item, not every rank's list. With a `tag`, the
        reduction carries ``[tag, -tag]`` too and checks it as `all_min` does.
        """
        unique = unique_items(items)
        checked = check_tag(tag)
        return await self._collective("agree_common", lambda: self._common(unique, checked))

    async def barrier(self) -> None:
        """Return once every rank has called `barrier`."""
        await self._collective("barrier", lambda: self._tagged_min(0, _BARRIER_TAG))

    # -- plumbing --------------------------------------------------------------------------

    async def _collective(self, op: str, fn: Callable[[], T]) -> T:
        if self._owner.loop is None:
            # The first call binds: a group may be built on one thread and used on the loop's.
            self._owner.bind()
        else:
            self._owner.check()
        if self._closed:
            raise GroupBrokenError(f"{op}: the group of rank {self.rank} is closed")
        with self._lock:
            if self._broken:
                raise GroupBrokenError(
                    f"{op}: an earlier collective failed on rank {self.rank}; the group is "
                    "broken and enters no more collectives"
                )
        future = self._worker.submit(asyncio.get_running_loop(), self._guarded(op, fn))
        try:
            # Shielded: cancelling the caller must not cancel the queued collective, or this
            # rank would skip it and fall out of step with its peers.
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                with self._lock:
                    self._cancelled += 1
                # Retrieve the dropped result's exception so it is not reported as unhandled.
                future.add_done_callback(_drop)
            raise

    def _guarded(self, op: str, fn: Callable[[], T]) -> Callable[[], T]:
        """`fn` wrapped to run on the collective thread: refuse if broken, count, classify."""

        def run() -> T:
            with self._lock:
                if self._broken:
                    # Queued before an earlier collective broke the group; do not enter it.
                    raise GroupBrokenError(
                        f"{op}: an earlier collective failed on rank {self.rank}; the group is "
                        "broken and enters no more collectives"
                    )
                self._collectives += 1
            started = time.monotonic()
            try:
                return fn()
            except Exception as exc:
                mismatch = isinstance(exc, _TagMismatch)
                timed_out = not mismatch and _is_timeout(
                    exc, time.monotonic() - started, self._timeout_s
                )
                with self._lock:
                    self._broken = True
                    if timed_out:
                        self._timeouts += 1
                    else:
                        self._failures += 1
                _log.warning(
                    "tp.collective.failed",
                    op=op,
                    rank=self.rank,
                    size=self.size,
                    timed_out=timed_out,
                    error=str(exc),
                )
                where = f"{op} on rank {self.rank} of {self.size}"
                if mismatch:
                    raise AgreementMismatch(f"{where}: {exc}; the group is broken") from exc
                if timed_out:
                    raise CollectiveTimeout(
                        f"{where} did not complete within {self._timeout_s}s; the group is broken"
                    ) from exc
                raise CollectiveError(f"{where} failed: {exc}; the group is broken") from exc

        return run

    # The bodies below run on the collective thread only.

    def _pg(self) -> dist.ProcessGroup:
        group = self._group
        # Collectives are refused once closed, and shutdown is the thread's last job.
        assert group is not None, "the group was used after aclose"
        return group

    def _tagged_min(self, value: int, tag: int) -> int:
        """The minimum of `value`, in one reduction that also carries the tags as
        [tag, -tag], from which every rank learns the lowest and highest tag. Always MIN:
        ranks reducing with different operations could each see matching tags."""
        tensor = torch.tensor([value, tag, -tag], dtype=torch.int64)
        self._pg().allreduce(tensor, op=dist.ReduceOp.MIN, timeout=self._timeout).wait()
        result, low_tag, neg_high_tag = (int(x) for x in tensor.tolist())
        _check_tags(tag, low_tag, -neg_high_tag)
        return result

    def _broadcast_from_first(self, payload: bytes) -> bytes:
        """Rank 0's `payload` on every rank (other ranks' payloads are ignored)."""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        self._pg().broadcast(length, 0, timeout=self._timeout).wait()
        n = int(length.item())
        if n == 0:  # every rank knows n, so every rank skips the second transfer
            return b""
        buf = torch.zeros(n, dtype=torch.uint8)
        if self.rank == 0:
            buf.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        self._pg().broadcast(buf, 0, timeout=self._timeout).wait()
        return buf.numpy().tobytes()

    def _gather(self, payload: bytes) -> list[bytes]:
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        mine = torch.tensor([len(payload)], dtype=torch.int64)
        self._pg().allgather(lengths, mine, timeout=self._timeout).wait()
        sizes = [int(t.item()) for t in lengths]
        longest = max(sizes)
        if longest == 0:  # the same decision on every rank
            return [b""] * self.size
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded.numpy()[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        outputs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._pg().allgather(outputs, padded, timeout=self._timeout).wait()
        return [out.numpy()[:n].tobytes() for out, n in zip(outputs, sizes, strict=True)]

    def _common(self, unique: list[bytes], tag: int | None) -> list[bytes]:
        first = _ITEMS.decode(self._broadcast_from_first(_ENCODER.encode(unique)))
        have = set(unique)
        if tag is None:
            if not first:  # every rank got the same `first`, so every rank skips the reduction
                return []
            mask = torch.tensor([item in have for item in first], dtype=torch.uint8)
            self._pg().allreduce(mask, op=dist.ReduceOp.MIN, timeout=self._timeout).wait()
            return [item for item, kept in zip(first, mask.tolist(), strict=True) if kept]
        # Tagged: the tag rides in the same reduction as the mask (int64, to hold it), and the
        # reduction runs even for an empty list so the tag is always checked.
        flags = [tag, -tag, *(int(item in have) for item in first)]
        reduced = torch.tensor(flags, dtype=torch.int64)
        self._pg().allreduce(reduced, op=dist.ReduceOp.MIN, timeout=self._timeout).wait()
        values = reduced.tolist()
        _check_tags(tag, int(values[0]), -int(values[1]))
        return [item for item, kept in zip(first, values[2:], strict=True) if kept]


# The tags of the plain calls: all_min, all_max and barrier always check one.
_ALL_MIN_TAG = agreement_tag("tp.all_min")
_ALL_MAX_TAG = agreement_tag("tp.all_max")
_BARRIER_TAG = agreement_tag("tp.barrier")


def _check_tags(mine: int, lowest: int, highest: int) -> None:
    if lowest != highest:
        raise _TagMismatch(
            f"the ranks paired different agreements (tags from {lowest:#x} to {highest:#x}, "
            f"this rank {mine:#x}); every rank must make its agreements in the same order"
        )


def _check_timeout(field: str, value: float) -> timedelta:
    """`value` seconds as the timedelta the collectives use; `ConfigError` unless it is a
    finite number > 0 that a timedelta can hold (inf or 1e300 would otherwise pass here and
    fail with OverflowError later, after threads started and ranks joined)."""
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(as_float(value))
        or not value > 0
    ):
        raise ConfigError(field, f"must be a finite number of seconds > 0, got {value!r}")
    try:
        return timedelta(seconds=value)
    except OverflowError:
        raise ConfigError(field, f"is too large for a timedelta, got {value!r}") from None


def _drop(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
