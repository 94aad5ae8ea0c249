"""A pytest conformance suite for StorageBackend implementations (built-in or plugins).

Subclass `StorageConformance` in a test module and provide an async fixture `backend` that
yields an entered backend; optionally `mac_backend` (entered with `mac_key=MAC_KEY`) and the
class attribute `page_nbytes` (the page size the tests use, default 64 KiB, at least 16):

    import pytest_asyncio
    from hicache_async.testing import MAC_KEY, StorageConformance

    class TestMyStorage(StorageConformance):
        @pytest_asyncio.fixture
        async def backend(self):
            async with MyStorage("...") as storage:
                yield storage

        @pytest_asyncio.fixture
        async def mac_backend(self):
            async with MyStorage("...", mac_key=MAC_KEY) as storage:
                yield storage

Tests that damage stored pages need the backend's raw access (`read_raw`/`write_raw`): without
it they fail, unless the class sets `raw_access = False`, which skips them. Keys are random per
test, so a shared server needs no cleanup between tests. No call of the suite holds more pages
than the backend's `capabilities.max_batch_pages`, except the one test of a bigger batch, which
the backend may serve or refuse with StorageError (a backend whose capacity is under twice that
batch's bytes may answer MISS for the pages it has no room for).
"""

from __future__ import annotations

import asyncio
import dis
import importlib
import os
import random
import re
import struct
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import pytest
import pytest_asyncio

from .._errors import StorageError
from ..storage._maintenance import RawAccess
from ..storage._page import FORMAT_VERSION, HEADER_NBYTES, encode_header
from ..storage._protocol import (
    Outcome,
    PageBuffer,
    PageMeta,
    StorageBackend,
    StorageStats,
    check_stats,
)
from ._mac_key import MAC_KEY

__all__ = ["MAC_KEY", "NAMESPACE", "OTHER_NAMESPACE", "StorageConformance"]

NAMESPACE = b"conformance-ns-1"
OTHER_NAMESPACE = b"conformance-ns-2"

_CANARY = 0xA5

#: The smallest `page_nbytes` the suite takes: its pages are cut into segments of up to four
#: parts, one of 7 bytes, and a test reads into a buffer one byte shorter than a page.
_MIN_PAGE_NBYTES = 16
#: The most pages in one call of the cancellation and close tests, whatever the page size:
#: they size their batches at 8 MiB, which at a few bytes a page would be millions of pages.
_MAX_BATCH_PAGES = 1024
#: The most page bytes in the one batch of more than `max_batch_pages` pages the suite sends;
#: a backend whose limit is higher than this holds has that test skipped.
_OVERSIZED_BATCH_BYTES = 128 << 20
#: How long a thread the backend started may take to end once close() has returned.
_THREAD_GRACE_S = 5.0
#: How long a cancelled call may take to end (a backend may finish a step it cannot cut
#: short, a pipeline sent or a copy under way, before it re-raises).
_CANCELLED_CALL_END_S = 10.0
# Threads of the event loop's default executor (asyncio's `asyncio_N`, uvloop's `uvloop_N`)
# and of anyio's per-loop worker pool: they serve any code on the loop, `asyncio.to_thread`
# included, and end with the loop (or idle), not with a backend. uvloop before 0.23 (and a
# default executor an application set) names them `ThreadPoolExecutor-M_N`, as it does any
# unnamed pool's: those are told apart by the executor's number (`_default_executor_names`).
_LOOP_THREAD = re.compile(r"(asyncio|uvloop)_\d+|AnyIO worker thread")


def _keys(count: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(count)]


def _payload(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def _segments(data: bytes, sizes: list[int]) -> list[memoryview]:
    """`data` cut into segments of `sizes`, each its own writable buffer."""
    assert sum(sizes) == len(data)
    views = []
    offset = 0
    for size in sizes:
        views.append(memoryview(bytearray(data[offset : offset + size])))
        offset += size
    return views


def _empty(sizes: list[int], fill: int = 0) -> list[memoryview]:
    return [memoryview(bytearray([fill]) * size) for size in sizes]


class _PageRing:
    """Page buffers for the cancellation tests, cut from a few arenas taken in turn: each
    attempt needs buffers of its own while earlier ones are watched, and a backend that
    registers host memory on first use (Mooncake) then registers a few arenas, as it would
    a host pool, instead of every attempt's pages."""

    def __init__(self, pages: int, page_nbytes: int) -> None:
        # The attempt running, the ones watched, and one more.
        self._arenas = [bytearray(pages * page_nbytes) for _ in range(_CANCEL_WINDOW + 2)]
        self._pages = pages
        self._page_nbytes = page_nbytes
        self._taken = 0

    def take(self) -> list[list[memoryview]]:
        arena = memoryview(self._arenas[self._taken % len(self._arenas)])
        self._taken += 1
        n = self._page_nbytes
        return [[arena[i * n : (i + 1) * n]] for i in range(self._pages)]


def _joined(page: list[memoryview]) -> bytes:
    return b"".join(bytes(view) for view in page)


def _meta(key: bytes, namespace: bytes = NAMESPACE) -> PageMeta:
    return PageMeta(key=key, namespace=namespace, num_tokens=64, priority=1)


def _check_page_nbytes(value: object) -> None:
    if type(value) is not int or value < _MIN_PAGE_NBYTES:
        raise ValueError(
            f"page_nbytes must be an int of at least {_MIN_PAGE_NBYTES} bytes, got {value!r}"
        )


def _batch_limit(backend: StorageBackend) -> int:
    limit = backend.capabilities.max_batch_pages
    if type(limit) is not int or limit < 1:
        raise AssertionError(f"capabilities.max_batch_pages is {limit!r}, not an int of 1 or more")
    return limit


def _batches(backend: StorageBackend, count: int) -> list[slice]:
    """`range(count)` cut into slices of at most the backend's `max_batch_pages`."""
    limit = _batch_limit(backend)
    return [slice(start, start + limit) for start in range(0, count, limit)]


async def _get_batches(
    backend: StorageBackend,
    keys: Sequence[bytes],
    into: Sequence[PageBuffer],
    namespace: bytes = NAMESPACE,
) -> list[Outcome]:
    """A get of `keys` in calls of at most `max_batch_pages` pages, as the cache makes them."""
    outcomes: list[Outcome] = []
    for part in _batches(backend, len(keys)):
        outcomes += await backend.get(keys[part], into[part], namespace=namespace)
    return outcomes


async def _put_batches(
    backend: StorageBackend,
    keys: Sequence[bytes],
    pages: Sequence[PageBuffer],
    metas: Sequence[PageMeta],
) -> list[Outcome]:
    """A put of `keys` in calls of at most `max_batch_pages` pages, as the cache makes them."""
    outcomes: list[Outcome] = []
    for part in _batches(backend, len(keys)):
        outcomes += await backend.put(keys[part], pages[part], metas[part])
    return outcomes


async def _delete_batches(backend: StorageBackend, keys: Sequence[bytes]) -> int:
    return sum([await backend.delete(keys[part]) for part in _batches(backend, len(keys))])


def _too_small_for(stats: StorageStats, payload_nbytes: int) -> bool:
    """Whether a backend of this capacity may have no room for `payload_nbytes` of pages.

    Twice the payload leaves room for what a backend adds to each page (headers, allocation
    granularity), which the suite cannot know."""
    return stats.capacity_bytes is not None and stats.capacity_bytes < 2 * payload_nbytes


#: Return types a backend may not declare, by method: type checkers pass an `exists` or
#: `delete` declared `-> bool` (a bool is an int to them), whose answers the cache refuses as
#: failed calls; and an `__aenter__` declared `-> None`, which the cache's own `async with`
#: takes, makes `async with open_storage(url) as store` bind None.
_REFUSED_RETURNS = {"__aenter__": "None", "exists": "bool", "delete": "bool"}


def _declared_return(method: object) -> str | None:
    """The return type `method` declares, as written (`None`, `bool`, ...); None when it
    declares none. Read from `__annotations__`, not resolved: a backend's hints may name types
    it imports only for type checkers."""
    try:
        annotations = getattr(method, "__annotations__", None)
    except Exception:
        # Python 3.14 evaluates annotations when they are read (PEP 649): one naming a type
        # imported only for type checkers raises NameError there, as written it does not.
        annotations = _annotations_as_written(method)
    if not isinstance(annotations, dict) or "return" not in annotations:
        return None
    declared = annotations["return"]
    if isinstance(declared, str):
        return declared.strip()
    if declared is None or declared is type(None):
        return "None"
    return declared.__name__ if isinstance(declared, type) else repr(declared)


def _returns_only_none(method: object) -> bool:
    """Whether the Python function `method` (a method as its class holds it) returns None on
    every path: each of its returns hands back the constant None (an implicit return, a bare
    `return`). Read from its bytecode, so an undeclared `__aenter__` that forgets `return
    self` is found at run time although no backend can be entered twice. False when it cannot
    tell (not a Python function, a return reached by a jump from elsewhere)."""
    code = getattr(getattr(method, "__func__", method), "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    returns = 0
    previous: dis.Instruction | None = None
    for instruction in dis.get_instructions(code):
        if instruction.opname == "RETURN_CONST":  # Python 3.12 and 3.13
            if instruction.argval is not None:
                return False
            returns += 1
        elif instruction.opname == "RETURN_VALUE":
            # A jump to it may bring another value than the constant loaded before it.
            if (
                instruction.is_jump_target
                or previous is None
                or previous.opname != "LOAD_CONST"
                or previous.argval is not None
            ):
                return False
            returns += 1
        previous = instruction
    return returns > 0


def _annotations_as_written(method: object) -> object:
    """`method`'s annotations as strings, through `annotationlib` (Python 3.14 and later);
    None where they cannot be had (nothing declared that can be checked)."""
    try:
        annotationlib = importlib.import_module("annotationlib")
        return annotationlib.get_annotations(method, format=annotationlib.Format.STRING)
    except Exception:
        return None


def _assert_count(value: object, expected: int, call: str) -> None:
    # `==` alone would pass False for 0 and True for 1, which the cache refuses as answers.
    assert type(value) is int, f"{call} returned {value!r}, a {type(value).__name__}, not an int"
    assert value == expected, f"{call} returned {value}, not {expected}"


async def _assert_no_tasks_left(before: set[asyncio.Task[object]]) -> None:
    """Fail if a task not in `before` is still running once the backend is closed."""
    for _ in range(8):  # a task cancelled by close() ends within a few loop iterations
        await asyncio.sleep(0)
    current = asyncio.current_task()
    left = [task for task in asyncio.all_tasks() if task is not current and task not in before]
    assert not left, f"close() left {len(left)} task(s) running: {left[:3]}"


def _assert_overlapped_by_close(call: str, result: object, count: int) -> None:
    """A call that a close() overlapped either kept to its outcomes, one per key, or raised
    StorageError."""
    if isinstance(result, BaseException):
        assert isinstance(result, StorageError), f"{call} raised {result!r}"
    else:
        assert isinstance(result, list), f"{call} returned {result!r}"
        assert len(result) == count, f"{call} returned {len(result)} outcomes"


def _threads_left(
    before: set[threading.Thread], loop_threads: re.Pattern[str] | None = None
) -> list[threading.Thread]:
    return [
        thread
        for thread in threading.enumerate()
        if thread not in before
        and not _LOOP_THREAD.fullmatch(thread.name)
        and not (loop_threads is not None and loop_threads.fullmatch(thread.name))
    ]


def _thread_name() -> str:
    return threading.current_thread().name


async def _default_executor_names() -> re.Pattern[str] | None:
    """The names of the running loop's default executor's threads, learnt from one of them:
    a thread pool numbers its threads after one prefix of its own (`ThreadPoolExecutor-4_0`,
    `ThreadPoolExecutor-4_1`), which no other pool shares."""
    name = await asyncio.get_running_loop().run_in_executor(None, _thread_name)
    numbered = re.fullmatch(r"(.+_)\d+", name)
    return re.compile(re.escape(numbered.group(1) if numbered else name) + r"\d*")


def _join(threads: list[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


async def _assert_no_threads_left(before: set[threading.Thread]) -> None:
    """Fail if a thread not in `before` still runs `_THREAD_GRACE_S` after the backend closed
    (a close() may ask its threads to stop without joining them)."""
    if left := _threads_left(before):
        loop_threads = await _default_executor_names()
        if left := _threads_left(before, loop_threads):
            # Joined from a worker thread: the loop runs on, for threads that wait on it to end.
            await asyncio.to_thread(_join, left, _THREAD_GRACE_S)
            left = _threads_left(before, loop_threads)
    assert not left, (
        f"close() left {len(left)} thread(s) running after {_THREAD_GRACE_S:g} s: "
        f"{[thread.name for thread in left[:3]]}"
    )


def _flip(value: bytes, position: int) -> bytes:
    damaged = bytearray(value)
    damaged[position] ^= 0x40
    return bytes(damaged)


#: The smallest batch (in page bytes) that must let other tasks run while it is served: a
#: smaller one may be handled on the event loop whole (`memory://` does up to 1 MiB there).
_LOOP_BATCH_BYTES = 4 << 20

#: The longest share of a large call the loop may spend without a turn for another task: a
#: backend that suspends once and then does its I/O on the loop holds it for nearly all of
#: the call, one that does it elsewhere for a small part.
_LOOP_GAP_SHARE = 0.75
#: A stretch of up to this many GIL switch intervals is never held against a call, whatever
#: its share: a backend whose threads run Python code can keep the loop's thread from the GIL
#: for an interval at a time, and a short call (a 2 ms get) can be one stretch whole.
_LOOP_GAP_SWITCHES = 10
#: Tries of a large put and get before the loop stretches of each are held against it.
_LOOP_TRIES = 3


class _LoopWatch:
    """The turns another task had while a call was watched, and the longest stretch
    without one."""

    def __init__(self) -> None:
        self._began = self._last = 0.0
        self._longest = 0.0
        self.turns = 0

    async def run(self) -> None:
        """The task that takes a turn whenever the loop lets it."""
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            self._longest = max(self._longest, now - self._last)
            self._last = now
            self.turns += 1

    def start(self) -> None:
        self._began = self._last = time.perf_counter()
        self._longest = 0.0
        self.turns = 0

    def stop(self) -> tuple[float, float]:
        """The longest stretch and the call's duration, in seconds."""
        now = time.perf_counter()
        return max(self._longest, now - self._last), now - self._began


# Cancellation points: after 0, 1, 2, ... event-loop iterations (sparser as they grow), then
# after short delays, until a batch completes before its cancellation lands. A backend may
# misbehave only when cancelled at one particular stage (mid-copy in a worker thread, between
# network round trips, ...), which one fixed point would miss.
_CANCEL_ITERATIONS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 20, 25, 32, 40, 50, 64, 80, 100, 128)
_CANCEL_DELAYS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
# Cancelled attempts under watch at once (the oldest is checked as a new one arrives): bounds
# the memory at a few batches while later attempts run.
_CANCEL_WINDOW = 6


class _CancelPoint(NamedTuple):
    iterations: int  # -1: never cancel, await the batch to its end
    delay: float

    def __str__(self) -> str:
        return f"{self.delay * 1000:g} ms" if self.delay else f"{self.iterations} loop iterations"


class _GetAttempt(NamedTuple):
    point: _CancelPoint
    buffers: list[list[memoryview]]


class _PutAttempt(NamedTuple):
    point: _CancelPoint
    keys: list[bytes]


def _cancel_points() -> list[_CancelPoint]:
    points = [_CancelPoint(n, 0.0) for n in _CANCEL_ITERATIONS]
    points += [_CancelPoint(0, d) for d in _CANCEL_DELAYS]
    return [*points, _CancelPoint(-1, 0.0)]


async def _cancel_at(point: _CancelPoint, task: asyncio.Task[list[Outcome]], call: str) -> bool:
    """Let `task` run until `point`, cancel it and wait for it to end; whether it was cancelled
    (False: it completed first, or `point` is the last, which never cancels).

    Once cancelled, a call must end cancelled, or raise: one that waits out its I/O and
    returns outcomes holds its caller past any deadline (the cache's `io_timeout_s` then takes
    as long as the I/O does). The task is cancelled again at every loop iteration until it
    ends, as the cache's anyio deadlines do: a cancellation lost to a race (Python 3.11's
    `asyncio.wait_for`, which redis-py awaits, drops one that lands as its inner call ends)
    reaches the call at its next await, and only one that catches them all returns.
    """
    if point.iterations < 0:
        await task
        return False
    for _ in range(point.iterations):
        await asyncio.sleep(0)
    if point.delay:
        await asyncio.sleep(point.delay)
    if task.done():
        return False
    deadline = time.monotonic() + _CANCELLED_CALL_END_S
    while not task.done():
        task.cancel()
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{call} cancelled after {point} still runs {_CANCELLED_CALL_END_S:g} s later"
            )
        await asyncio.sleep(0)
    if not task.cancelled() and task.exception() is None:
        raise AssertionError(
            f"{call} cancelled after {point} returned {len(task.result())} outcomes instead of "
            "ending cancelled: a cancelled call must stop waiting and re-raise CancelledError"
        )
    return True


class StorageConformance:
    """Behaviour every StorageBackend must show. Subclasses provide the `backend` fixture."""

    #: Payload bytes per page in these tests: an int of at least 16, checked when a subclass
    #: is defined.
    page_nbytes: int = 64 * 1024

    #: Whether the backend implements `RawAccess`, which the tests that damage stored pages
    #: need. Without it they fail, so that a suite cannot pass without checking integrity
    #: unnoticed; set False for a backend that has no raw access to skip them instead.
    raw_access: bool = True

    pytestmark = pytest.mark.asyncio

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Refused when the test module is collected, not as a test that takes minutes.
        super().__init_subclass__(**kwargs)
        _check_page_nbytes(cls.page_nbytes)

    @pytest_asyncio.fixture(autouse=True)
    async def tasks_before_backend(self) -> AsyncIterator[set[asyncio.Task[object]]]:
        """The tasks running before the `backend` fixture opened it (autouse fixtures are set
        up first): any other task still running once it is closed is one it left behind."""
        yield set(asyncio.all_tasks())

    @pytest_asyncio.fixture(autouse=True)
    async def threads_before_backend(self) -> AsyncIterator[set[threading.Thread]]:
        """The threads running before the `backend` fixture opened it: any other thread still
        running a few seconds after it is closed is one it left behind (the event loop's
        default executor and anyio's worker threads excepted)."""
        yield set(threading.enumerate())

    if TYPE_CHECKING:
        # Overrides take whatever fixtures they need (`tmp_path`, a server): a typed
        # signature here would make each of them an incompatible override.
        mac_backend: Any
    else:

        @pytest_asyncio.fixture
        async def mac_backend(self) -> AsyncIterator[StorageBackend | None]:
            """Override to yield a backend entered with `mac_key=MAC_KEY`; None skips MAC
            tests."""
            yield None

    # Helpers.

    def _raw(self, backend: StorageBackend) -> RawAccess:
        if isinstance(backend, RawAccess):
            return backend
        if not self.raw_access:
            pytest.skip(f"{backend.name} has no raw access (read_raw/write_raw)")
        raise AssertionError(
            f"{backend.name} has no raw access (read_raw/write_raw), which the tests that damage "
            "stored pages need: implement RawAccess, or set raw_access = False in the test "
            "class to skip them"
        )

    def _shapes(self) -> list[list[int]]:
        n = self.page_nbytes
        shapes = [[n], [n // 2, n - n // 2], [1, n - 2, 1], [7, n - 7]]
        quarter = n // 4
        shapes.append([quarter, quarter, quarter, n - 3 * quarter])
        return [shape for shape in shapes if all(size > 0 for size in shape)]

    async def _put(
        self, backend: StorageBackend, keys: list[bytes], seed: int = 0
    ) -> dict[bytes, bytes]:
        data = {key: _payload(self.page_nbytes, seed + i) for i, key in enumerate(keys)}
        pages = [_segments(data[key], [self.page_nbytes]) for key in keys]
        outcomes = await _put_batches(backend, keys, pages, [_meta(key) for key in keys])
        assert outcomes == [Outcome.OK] * len(keys)
        return data

    async def _get_one(
        self, backend: StorageBackend, key: bytes, namespace: bytes = NAMESPACE
    ) -> tuple[Outcome, bytes]:
        page = _empty([self.page_nbytes])
        (outcome,) = await backend.get([key], [page], namespace=namespace)
        return outcome, _joined(page)

    # Round trips.

    async def test_round_trip_page_shapes(self, backend: StorageBackend) -> None:
        shapes = self._shapes()
        keys = _keys(len(shapes))
        data = [_payload(self.page_nbytes, i) for i in range(len(shapes))]
        pages = [_segments(d, shape) for d, shape in zip(data, shapes, strict=True)]
        metas = [_meta(key) for key in keys]
        assert await _put_batches(backend, keys, pages, metas) == [Outcome.OK] * len(keys)
        # Read each page back through a different segmentation than it was written with.
        read_shapes = shapes[1:] + shapes[:1]
        buffers = [_empty(shape) for shape in read_shapes]
        assert await _get_batches(backend, keys, buffers) == [Outcome.OK] * len(keys)
        for expected, buffer in zip(data, buffers, strict=True):
            assert _joined(buffer) == expected

    async def test_round_trip_typed_segments(self, backend: StorageBackend) -> None:
        # Segments need not be bytes-formatted: sizes are nbytes, not len().
        n = self.page_nbytes
        if n % 16:
            pytest.skip("page_nbytes is not a multiple of 16")
        (key,) = _keys(1)
        data = _payload(n, 3)
        page = [
            memoryview(bytearray(data[: n // 2])).cast("I"),
            memoryview(bytearray(data[n // 2 :])).cast("Q"),
        ]
        assert await backend.put([key], [page], [_meta(key)]) == [Outcome.OK]
        target = [memoryview(bytearray(n)).cast("H")]
        assert await backend.get([key], [target], namespace=NAMESPACE) == [Outcome.OK]
        assert target[0].tobytes() == data

    async def test_put_leaves_its_pages_untouched_and_takes_read_only_ones(
        self, backend: StorageBackend
    ) -> None:
        # The cache puts straight from host-pool pages it goes on serving: a backend that used
        # them as scratch space (encrypting or compressing in place) would corrupt served KV.
        shapes = self._shapes()
        count = len(shapes)
        keys = _keys(2 * count)
        data = [_payload(self.page_nbytes, 40 + i) for i in range(2 * count)]
        metas = [_meta(key) for key in keys]
        writable = [_segments(d, shape) for d, shape in zip(data, shapes, strict=False)]
        outcomes = await _put_batches(backend, keys[:count], writable, metas[:count])
        assert outcomes == [Outcome.OK] * count
        for index, page in enumerate(writable):
            assert _joined(page) == data[index], f"put wrote into page {index} it was given"
        # What the cache hands over: read-only views of the host pool's memory.
        read_only = [
            [view.toreadonly() for view in _segments(d, shape)]
            for d, shape in zip(data[count:], shapes, strict=True)
        ]
        outcomes = await _put_batches(backend, keys[count:], read_only, metas[count:])
        assert outcomes == [Outcome.OK] * count
        buffers = [_empty([self.page_nbytes]) for _ in keys]
        assert await _get_batches(backend, keys, buffers) == [Outcome.OK] * len(keys)
        for expected, buffer in zip(data, buffers, strict=True):
            assert _joined(buffer) == expected

    async def test_declared_return_types_are_the_protocol_s(self, backend: StorageBackend) -> None:
        # Answers are checked at every call below; a declaration the protocol refuses is
        # looked at here, as `async with X() as store` cannot be checked on the entered
        # backend (a backend opens once).
        for name, refused in _REFUSED_RETURNS.items():
            declared = _declared_return(getattr(type(backend), name, None))
            expected = "the backend itself" if name == "__aenter__" else "an int count"
            assert declared not in (refused, f"builtins.{refused}"), (
                f"{type(backend).__name__}.{name} is declared to return {declared}, not "
                f"{expected} (StorageBackend.{name})"
            )
        # Undeclared, the same mistake is in the code: every return of it gives None.
        assert not _returns_only_none(getattr(type(backend), "__aenter__", None)), (
            f"{type(backend).__name__}.__aenter__ returns None on every path, so `async with "
            "backend as b` binds None, not the backend itself: end it with `return self` "
            "(StorageBackend.__aenter__)"
        )

    async def test_capabilities_are_usable(self, backend: StorageBackend) -> None:
        # Callers size their batches by max_batch_pages: 0 would leave them nothing to send.
        caps = backend.capabilities
        assert type(caps.max_batch_pages) is int, f"max_batch_pages is {caps.max_batch_pages!r}"
        assert caps.max_batch_pages >= 1
        for flag in (caps.zero_copy, caps.shared, caps.persistent):
            assert isinstance(flag, bool)

    async def test_a_batch_over_max_batch_pages_is_served_or_refused_cleanly(
        self, backend: StorageBackend
    ) -> None:
        # The cache never sends more than max_batch_pages pages in one call. A backend may
        # still serve a bigger batch, or refuse it with StorageError before any I/O: nothing
        # stored, no buffer written, and the batches it takes still served. A bounded backend
        # too small for the batch may leave out (MISS) the pages it has no room for.
        count = _batch_limit(backend) + 1
        if count * self.page_nbytes > _OVERSIZED_BATCH_BYTES:
            pytest.skip(f"max_batch_pages + 1 = {count} pages is more than the suite sends")
        bounded = _too_small_for(check_stats(backend.stats()), count * self.page_nbytes)
        allowed = {Outcome.OK, Outcome.MISS} if bounded else {Outcome.OK}
        keys = _keys(count)
        payload = _payload(self.page_nbytes, 50)
        pages = [[memoryview(payload)]] * count  # read-only, one page for every key
        metas = [_meta(key) for key in keys]
        try:
            outcomes = await backend.put(keys, pages, metas)
        except StorageError:
            _assert_count(await _delete_batches(backend, keys), 0, "delete after a refused put")
            outcomes = await _put_batches(backend, keys, pages, metas)
        assert len(outcomes) == count
        assert set(outcomes) <= allowed, f"put outcomes {set(outcomes)}, not within {allowed}"
        n = self.page_nbytes
        arena = memoryview(bytearray([_CANARY]) * (count * n))
        buffers = [[arena[i * n : (i + 1) * n]] for i in range(count)]
        try:
            outcomes = await backend.get(keys, buffers, namespace=NAMESPACE)
        except StorageError:
            assert arena == bytes([_CANARY]) * len(arena), "a refused get wrote into buffers"
            outcomes = await _get_batches(backend, keys, buffers)
        assert len(outcomes) == count
        assert set(outcomes) <= allowed, f"get outcomes {set(outcomes)}, not within {allowed}"
        read = [i for i, outcome in enumerate(outcomes) if outcome is Outcome.OK]
        assert all(bytes(buffers[i][0]) == payload for i in read), "a page read back changed"
        deleted = await _delete_batches(backend, keys)
        if bounded:
            # Only the pages read back are sure to be stored still.
            assert type(deleted) is int, f"delete returned {deleted!r}, not an int"
            assert len(read) <= deleted <= count, f"delete returned {deleted}"
        else:
            _assert_count(deleted, count, "delete")

    async def test_empty_batches(self, backend: StorageBackend) -> None:
        _assert_count(await backend.exists([]), 0, "exists([])")
        assert await backend.get([], [], namespace=NAMESPACE) == []
        assert await backend.put([], [], []) == []
        _assert_count(await backend.delete([]), 0, "delete([])")

    async def test_put_is_idempotent_and_keeps_the_first(self, backend: StorageBackend) -> None:
        (key,) = _keys(1)
        first = await self._put(backend, [key], seed=10)
        second = _segments(_payload(self.page_nbytes, 11), [self.page_nbytes])
        assert await backend.put([key], [second], [_meta(key)]) == [Outcome.OK]
        outcome, got = await self._get_one(backend, key)
        assert outcome is Outcome.OK
        assert got == first[key]

    async def test_mismatched_lengths_raise_before_io(self, backend: StorageBackend) -> None:
        keys = _keys(2)
        page = _segments(_payload(self.page_nbytes, 0), [self.page_nbytes])
        # Any message: the docs ask only for ValueError.
        with pytest.raises(ValueError):  # noqa: PT011
            await backend.put(keys, [page], [_meta(keys[0]), _meta(keys[1])])
        with pytest.raises(ValueError):  # noqa: PT011
            await backend.put(keys, [page, page], [_meta(keys[0])])
        with pytest.raises(ValueError):  # noqa: PT011
            await backend.get(keys, [_empty([self.page_nbytes])], namespace=NAMESPACE)
        assert await backend.exists(keys[:1]) == 0

    async def test_bad_keys_and_namespaces_raise_on_every_call(
        self, backend: StorageBackend
    ) -> None:
        # A key of another length or type would otherwise read as a miss, silently.
        (key,) = _keys(1)
        data = await self._put(backend, [key])
        page = [_empty([self.page_nbytes])]
        for bad in (key[:-1], key + b"\x00", key.hex(), None):
            keys = [key, bad]
            with pytest.raises(ValueError, match="32 bytes"):
                await backend.exists(keys)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="32 bytes"):
                await backend.get(keys, page * 2, namespace=NAMESPACE)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="32 bytes"):
                await backend.delete(keys)  # type: ignore[arg-type]
            (fresh,) = _keys(1)
            pages = [_segments(_payload(self.page_nbytes, 1), [self.page_nbytes])] * 2
            metas = [_meta(fresh), PageMeta(key=bad, namespace=NAMESPACE, num_tokens=64)]  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="32 bytes"):
                await backend.put([fresh, bad], pages, metas)  # type: ignore[list-item]
            assert await backend.exists([fresh]) == 0  # refused before any I/O
        for namespace in (NAMESPACE[:-1], NAMESPACE + b"\x00", NAMESPACE.hex()):
            with pytest.raises(ValueError, match="16 bytes"):
                await backend.get([key], page, namespace=namespace)  # type: ignore[arg-type]
        (fresh,) = _keys(1)
        # A str of 16 characters too: the header packs bytes.
        for namespace in (NAMESPACE[:-1], NAMESPACE.decode()):
            meta = PageMeta(key=fresh, namespace=namespace, num_tokens=64)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="16 bytes"):
                await backend.put([fresh], [_segments(data[key], [self.page_nbytes])], [meta])
            assert await backend.exists([fresh]) == 0
        if isinstance(backend, RawAccess):
            for bad in (key[:-1], key.hex()):
                with pytest.raises(ValueError, match="32 bytes"):
                    await backend.read_raw(bad)  # type: ignore[arg-type]
        assert await self._get_one(backend, key) == (Outcome.OK, data[key])

    async def test_a_meta_of_another_key_raises_before_io(self, backend: StorageBackend) -> None:
        keys = _keys(2)
        pages = [_segments(_payload(self.page_nbytes, i), [self.page_nbytes]) for i in range(2)]
        with pytest.raises(ValueError, match="meta"):
            await backend.put(keys, pages, [_meta(keys[0]), _meta(keys[0])])
        assert await backend.exists(keys[:1]) == 0
        assert await backend.exists(keys[1:]) == 0

    async def test_malformed_pages_and_metas_raise_before_io(self, backend: StorageBackend) -> None:
        # Bytes iterate as ints and a str is no buffer: a page is a sequence of bytes-like
        # segments. Refused before the batch counts or stores anything.
        keys = _keys(2)
        good = _segments(_payload(self.page_nbytes, 0), [self.page_nbytes])
        puts = backend.stats().puts
        for bad in (None, b"abc", ["abc"], [None], iter([good[0]])):
            with pytest.raises(ValueError, match=r"pages\[1\]"):
                await backend.put(keys, [good, bad], [_meta(keys[0]), _meta(keys[1])])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="PageMeta"):
            await backend.put(keys, [good, good], [_meta(keys[0]), None])  # type: ignore[list-item]
        assert await backend.exists(keys[:1]) == 0
        assert backend.stats().puts == puts

    async def test_unwritable_buffers_raise_whether_or_not_stored(
        self, backend: StorageBackend
    ) -> None:
        # A bad buffer is the caller's error: raised as well for a key that is not stored,
        # so it shows before the first hit, and never counted as a get.
        stored, absent = _keys(2)
        data = await self._put(backend, [stored])
        gets = backend.stats().gets
        for key in (absent, stored):
            with pytest.raises(ValueError):  # noqa: PT011 - any message
                await backend.get(
                    [key], [[_empty([self.page_nbytes])[0].toreadonly()]], namespace=NAMESPACE
                )
            with pytest.raises(ValueError):  # noqa: PT011 - any message
                await backend.get(
                    [key], [[memoryview(bytearray(2 * self.page_nbytes))[::2]]], namespace=NAMESPACE
                )
            for bad in (None, bytearray(self.page_nbytes), [5], ["text"]):
                with pytest.raises(ValueError):  # noqa: PT011 - any message
                    await backend.get([key], [bad], namespace=NAMESPACE)  # type: ignore[list-item]
        assert backend.stats().gets == gets
        assert await self._get_one(backend, stored) == (Outcome.OK, data[stored])

    async def test_out_of_range_meta_raises_before_io(self, backend: StorageBackend) -> None:
        keys = _keys(3)
        pages = [_segments(_payload(self.page_nbytes, i), [self.page_nbytes]) for i in range(3)]
        for bad in (
            PageMeta(key=keys[2], namespace=NAMESPACE, num_tokens=1 << 32),
            PageMeta(key=keys[2], namespace=NAMESPACE, num_tokens=-1),
            PageMeta(key=keys[2], namespace=NAMESPACE, num_tokens=64, priority=1 << 31),
            PageMeta(key=keys[2], namespace=NAMESPACE, num_tokens=64, priority=-(1 << 31) - 1),
            PageMeta(key=keys[2], namespace=NAMESPACE, num_tokens=True),
            PageMeta(key=keys[2], namespace=NAMESPACE, num_tokens=64, priority=False),
        ):
            with pytest.raises(ValueError, match=r"num_tokens|priority"):
                await backend.put(keys, pages, [_meta(keys[0]), _meta(keys[1]), bad])
            # The pages before the bad one were not stored either.
            assert await backend.exists(keys[:1]) == 0
            assert await backend.exists(keys[1:2]) == 0
        extremes = [
            PageMeta(key=keys[0], namespace=NAMESPACE, num_tokens=(1 << 32) - 1),
            PageMeta(key=keys[1], namespace=NAMESPACE, num_tokens=0, priority=-(1 << 31)),
            PageMeta(key=keys[2], namespace=NAMESPACE, num_tokens=1, priority=(1 << 31) - 1),
        ]
        assert await _put_batches(backend, keys, pages, extremes) == [Outcome.OK] * 3

    # Batches and prefixes.

    async def test_mixed_batch_has_one_outcome_per_key(self, backend: StorageBackend) -> None:
        # Needs no raw access, so every backend is held to it: outcome i and buffer i belong
        # to key i, however the backend groups the keys it finds and the ones it does not.
        present_a, absent_a, present_b, absent_b = _keys(4)
        data = await self._put(backend, [present_a, present_b])
        keys = [present_a, absent_a, present_b, absent_b]
        buffers = [_empty([self.page_nbytes]) for _ in keys]
        outcomes = await _get_batches(backend, keys, buffers)
        assert outcomes == [Outcome.OK, Outcome.MISS, Outcome.OK, Outcome.MISS]
        assert _joined(buffers[0]) == data[present_a]
        assert _joined(buffers[2]) == data[present_b]

    async def test_mixed_batch_with_a_damaged_page(self, backend: StorageBackend) -> None:
        # The damaged page sits between sound ones: the outcomes and buffers after it still
        # belong to their own keys, and only the damaged page is removed.
        present_a, damaged, absent, present_b, present_c = _keys(5)
        data = await self._put(backend, [present_a, damaged, present_b, present_c])
        raw = self._raw(backend)
        value = await raw.read_raw(damaged)
        assert value is not None
        await raw.write_raw(damaged, _flip(value, HEADER_NBYTES + self.page_nbytes // 2))
        keys = [present_a, damaged, absent, present_b, present_c]
        buffers = [_empty([self.page_nbytes]) for _ in keys]
        outcomes = await _get_batches(backend, keys, buffers)
        assert outcomes == [Outcome.OK, Outcome.CORRUPT, Outcome.MISS, Outcome.OK, Outcome.OK]
        for i in (0, 3, 4):
            assert _joined(buffers[i]) == data[keys[i]]
        assert await backend.exists([present_a]) == 1
        assert await backend.exists([present_b, present_c]) == 2
        assert await backend.exists([damaged]) == 0

    async def test_exists_counts_the_consecutive_prefix(self, backend: StorageBackend) -> None:
        keys = _keys(6)
        await self._put(backend, [keys[0], keys[1], keys[2], keys[4]])
        for query, expected in (
            (keys, 3),
            (keys[:2], 2),
            (keys[3:], 0),
            (keys[4:], 1),
            ([keys[5], keys[0]], 0),
        ):
            _assert_count(await backend.exists(query), expected, f"exists of {len(query)} keys")

    async def test_delete(self, backend: StorageBackend) -> None:
        keys = _keys(3)
        data = await self._put(backend, keys)
        (unknown,) = _keys(1)
        _assert_count(await backend.delete([keys[0], keys[1], unknown]), 2, "delete")
        assert await backend.exists(keys[:2]) == 0
        assert (await self._get_one(backend, keys[0]))[0] is Outcome.MISS
        assert await self._get_one(backend, keys[2]) == (Outcome.OK, data[keys[2]])
        _assert_count(await backend.delete(keys[:2]), 0, "delete of deleted pages")
        # One page, however often named.
        _assert_count(await backend.delete([keys[2], keys[2]]), 1, "delete of one key twice")

    # Integrity.

    def _damages(self) -> dict[str, Callable[[bytes, bytes, bytes], bytes]]:
        n = self.page_nbytes

        def other_key(key: bytes, value: bytes, payload: bytes) -> bytes:
            return encode_header(_meta(bytes(32)), [memoryview(payload)]) + payload

        return {
            "payload_byte": lambda key, value, payload: _flip(value, HEADER_NBYTES + n // 3),
            "last_payload_byte": lambda key, value, payload: _flip(value, len(value) - 1),
            "header_key_byte": lambda key, value, payload: _flip(value, 40),
            "header_length_byte": lambda key, value, payload: _flip(value, 57),
            "header_checksum_byte": lambda key, value, payload: _flip(value, 125),
            "truncated": lambda key, value, payload: value[: HEADER_NBYTES + n // 2],
            "header_only": lambda key, value, payload: value[:HEADER_NBYTES],
            "half_header": lambda key, value, payload: value[: HEADER_NBYTES // 2],
            "extended": lambda key, value, payload: value + b"\x00",
            "wrong_key": other_key,
        }

    @pytest.mark.parametrize(
        "damage",
        [
            "payload_byte",
            "last_payload_byte",
            "header_key_byte",
            "header_length_byte",
            "header_checksum_byte",
            "truncated",
            "header_only",
            "half_header",
            "extended",
            "wrong_key",
        ],
    )
    async def test_damaged_page_is_corrupt_and_removed(
        self, backend: StorageBackend, damage: str
    ) -> None:
        (key,) = _keys(1)
        data = await self._put(backend, [key])
        raw = self._raw(backend)
        value = await raw.read_raw(key)
        assert value is not None
        assert value[HEADER_NBYTES:] == data[key]
        await raw.write_raw(key, self._damages()[damage](key, value, data[key]))
        corrupt_before = backend.stats().corrupt
        outcome, _ = await self._get_one(backend, key)
        assert outcome is Outcome.CORRUPT
        assert backend.stats().corrupt == corrupt_before + 1
        assert await raw.read_raw(key) is None
        assert await backend.exists([key]) == 0
        assert (await self._get_one(backend, key))[0] is Outcome.MISS

    async def test_reader_with_other_namespace_misses_and_leaves_it(
        self, backend: StorageBackend
    ) -> None:
        (key,) = _keys(1)
        await self._put(backend, [key])
        outcome, _ = await self._get_one(backend, key, namespace=OTHER_NAMESPACE)
        assert outcome is Outcome.MISS
        assert await backend.exists([key]) == 1  # another deployment's page stays
        assert (await self._get_one(backend, key))[0] is Outcome.OK

    @pytest.mark.parametrize("delta", [-1, 1])
    async def test_reader_with_another_length_misses_and_leaves_it(
        self, backend: StorageBackend, delta: int
    ) -> None:
        # The page agrees with itself; the buffer may be what is wrong, so nothing is lost.
        (key,) = _keys(1)
        data = await self._put(backend, [key])
        corrupt_before = backend.stats().corrupt
        (outcome,) = await backend.get(
            [key], [_empty([self.page_nbytes + delta])], namespace=NAMESPACE
        )
        assert outcome is Outcome.MISS
        assert backend.stats().corrupt == corrupt_before
        assert await backend.exists([key]) == 1
        assert await self._get_one(backend, key) == (Outcome.OK, data[key])

    async def test_newer_format_version_is_a_miss_left_in_place(
        self, backend: StorageBackend
    ) -> None:
        (key,) = _keys(1)
        await self._put(backend, [key])
        raw = self._raw(backend)
        value = await raw.read_raw(key)
        assert value is not None
        newer = value[:4] + struct.pack("<H", FORMAT_VERSION + 1) + value[6:]
        await raw.write_raw(key, newer)
        corrupt_before = backend.stats().corrupt
        outcome, _ = await self._get_one(backend, key)
        assert outcome is Outcome.MISS
        assert backend.stats().corrupt == corrupt_before
        assert await raw.read_raw(key) == newer

    async def test_mac_round_trip_and_rejection(self, mac_backend: StorageBackend | None) -> None:
        if mac_backend is None:
            pytest.skip("no mac_backend fixture")
        backend = mac_backend
        good, unkeyed, other_key = _keys(3)
        data = await self._put(backend, [good, unkeyed, other_key])
        assert await self._get_one(backend, good) == (Outcome.OK, data[good])
        raw = self._raw(backend)
        value = await raw.read_raw(good)
        assert value is not None
        assert struct.unpack_from("<H", value, 6)[0] & 1  # the MAC flag is set
        for key, mac_key in ((unkeyed, None), (other_key, b"another-key-entirely-32-bytes!!!")):
            payload = data[key]
            header = encode_header(_meta(key), [memoryview(payload)], mac_key=mac_key)
            await raw.write_raw(key, header + payload)
            assert (await self._get_one(backend, key))[0] is Outcome.CORRUPT
            assert await raw.read_raw(key) is None

    # Concurrency and cancellation.

    async def test_counters_count_keys(self, backend: StorageBackend) -> None:
        keys = _keys(3)
        (absent,) = _keys(1)
        before = backend.stats()
        await self._put(backend, keys)
        buffers = [_empty([self.page_nbytes]) for _ in range(3)]
        await _get_batches(backend, [keys[0], keys[1], absent], buffers)
        after = backend.stats()
        assert (after.puts - before.puts, after.put_ok - before.put_ok) == (3, 3)
        assert (after.gets - before.gets, after.get_hits - before.get_hits) == (3, 2)

    async def test_stats_have_their_declared_types(self, backend: StorageBackend) -> None:
        # msgspec does not check a Struct's fields when it is built: a str or float counter
        # would reach the cache's status calls, admin JSON and metrics as it is.
        await self._put(backend, _keys(2))
        for moment in ("after two puts", "after a get"):
            problem = None
            try:
                check_stats(backend.stats())
            except StorageError as exc:
                problem = str(exc)
            assert problem is None, f"{moment}: {problem}"
            await self._get_one(backend, _keys(1)[0])

    async def test_a_get_racing_a_put_of_the_same_key_sees_all_of_it_or_nothing(
        self, backend: StorageBackend
    ) -> None:
        # Never the page half written, never judged damaged (and removed) while it is. The
        # reads start at a different loop iteration of the put each time, so a window of a
        # single iteration is met whatever the get awaits before it reads.
        corrupt_before = backend.stats().corrupt
        for offset in range(12):
            (key,) = _keys(1)
            payload = _payload(self.page_nbytes, 17 + offset)
            put = asyncio.create_task(
                backend.put([key], [_segments(payload, [self.page_nbytes])], [_meta(key)])
            )
            for _ in range(offset):
                await asyncio.sleep(0)
            reads = 0
            while not put.done() and reads < 10_000:
                outcome, data = await self._get_one(backend, key)
                reads += 1
                assert outcome is not Outcome.CORRUPT, f"read {reads} after {offset} iterations"
                if outcome is Outcome.OK:
                    assert data == payload
                await asyncio.sleep(0)  # the put runs too, whether or not the get yielded
            assert await put == [Outcome.OK]
            assert await self._get_one(backend, key) == (Outcome.OK, payload)
        assert backend.stats().corrupt == corrupt_before

    async def test_concurrent_batches(self, backend: StorageBackend) -> None:
        groups = [_keys(4) for _ in range(12)]

        async def put_then_get(index: int, keys: list[bytes]) -> None:
            data = await self._put(backend, keys, seed=100 * index)
            assert await backend.exists(keys) == len(keys)
            buffers = [_empty([self.page_nbytes]) for _ in keys]
            assert await _get_batches(backend, keys, buffers) == [Outcome.OK] * 4
            for key, buffer in zip(keys, buffers, strict=True):
                assert _joined(buffer) == data[key]

        await asyncio.gather(*(put_then_get(i, keys) for i, keys in enumerate(groups)))
        # The same pages read by many batches at once.
        flat = [key for keys in groups for key in keys]
        reads = [[_empty([self.page_nbytes]) for _ in flat] for _ in range(4)]
        results = await asyncio.gather(*(_get_batches(backend, flat, buffers) for buffers in reads))
        assert all(outcomes == [Outcome.OK] * len(flat) for outcomes in results)

    async def test_get_writes_only_inside_its_buffers(self, backend: StorageBackend) -> None:
        # The host pool hands out pages that sit side by side in one arena: a backend that
        # copies (or DMAs) a byte past a segment, or before it, damages the next page, which
        # may be serving a request. Guard bytes around every segment must stay as they were,
        # for pages read (OK) and pages not found (MISS) alike.
        present, absent = _keys(2)
        data = await self._put(backend, [present])
        guard = 64
        shape = self._shapes()[2]  # [1, n - 2, 1]: single-byte segments at both ends
        arena = bytearray([_CANARY]) * (sum(shape) * 2 + guard * (2 * len(shape) + 1))
        view = memoryview(arena)
        buffers: list[list[memoryview]] = []
        spans = []
        offset = guard
        for _ in range(2):
            page = []
            for size in shape:
                page.append(view[offset : offset + size])
                spans.append((offset, offset + size))
                offset += size + guard
            buffers.append(page)
        outcomes = await backend.get([present, absent], buffers, namespace=NAMESPACE)
        assert outcomes == [Outcome.OK, Outcome.MISS]
        assert _joined(buffers[0]) == data[present]
        start = 0
        for begin, end in [*spans, (len(arena), len(arena))]:
            assert arena[start:begin] == bytes([_CANARY]) * (begin - start), (
                f"a get wrote into the {begin - start} bytes before arena offset {begin}, "
                "outside every buffer it was given"
            )
            start = end

    async def test_a_large_batch_lets_other_tasks_run(self, backend: StorageBackend) -> None:
        # The cache serves every request from the event loop its storage calls run on: a
        # backend that does a batch's I/O there (a synchronous client, file or socket calls
        # in the coroutine) stalls them all for as long as the I/O takes, even if it
        # suspends once or twice on the way. The longest stretch without a turn for another
        # task must be at most a share of the call (`_LOOP_GAP_SHARE`) or a few GIL switch
        # intervals, in one of a few tries with fresh pages (a loaded machine may hold the
        # loop's thread back in any one).
        count = self._cancel_batch_pages(backend)
        if count * self.page_nbytes < _LOOP_BATCH_BYTES:
            pytest.skip(f"a batch of {count} pages is under {_LOOP_BATCH_BYTES >> 20} MiB")
        data = [_payload(self.page_nbytes, 60 + i) for i in range(count)]
        floor = _LOOP_GAP_SWITCHES * sys.getswitchinterval()
        watch = _LoopWatch()
        ticker = asyncio.create_task(watch.run())
        await asyncio.sleep(0)  # the ticker starts
        try:
            # Per call: the (longest stretch, duration) of each try held against it.
            held: dict[str, list[tuple[float, float]]] = {"put": [], "get": []}
            passed: set[str] = set()
            for _ in range(_LOOP_TRIES):
                keys = _keys(count)
                pages = [_segments(d, [self.page_nbytes]) for d in data]
                watch.start()
                outcomes = await backend.put(keys, pages, [_meta(key) for key in keys])
                put = watch.stop()
                assert watch.turns, f"a put of {count} pages ran without letting any task run"
                assert outcomes == [Outcome.OK] * count
                buffers = [_empty([self.page_nbytes]) for _ in keys]
                watch.start()
                outcomes = await backend.get(keys, buffers, namespace=NAMESPACE)
                get = watch.stop()
                assert watch.turns, f"a get of {count} pages ran without letting any task run"
                assert outcomes == [Outcome.OK] * count
                assert all(_joined(b) == d for b, d in zip(buffers, data, strict=True))
                await backend.delete(keys)
                for verb, (longest, duration) in (("put", put), ("get", get)):
                    if verb in passed:
                        continue
                    if longest <= max(_LOOP_GAP_SHARE * duration, floor):
                        passed.add(verb)
                        held[verb] = []
                    else:
                        held[verb].append((longest, duration))
                if len(passed) == len(held):
                    break
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
        for verb, tries in held.items():
            assert not tries, (
                f"a {verb} of {count} pages held the event loop without letting any other "
                f"task run for most of the call (and over {floor * 1e3:.0f} ms), in every "
                "try: "
                + ", ".join(f"{longest * 1e3:.1f} of {d * 1e3:.1f} ms" for longest, d in tries)
            )

    def _cancel_batch_pages(self, backend: StorageBackend) -> int:
        # 8 MiB, for a batch long enough to be cancelled in the middle, in one call the cache
        # could make, and few enough pages that tiny ones do not take minutes.
        pages = max(16, (8 << 20) // self.page_nbytes)
        return min(pages, _MAX_BATCH_PAGES, _batch_limit(backend))

    async def _check_get_attempt(self, attempt: _GetAttempt) -> None:
        canary = bytes([_CANARY]) * self.page_nbytes
        for index, buffer in enumerate(attempt.buffers):
            assert bytes(buffer[0]) == canary, (
                f"buffer {index} of a get cancelled after {attempt.point} was written after "
                "the cancelled call returned"
            )

    async def test_cancelled_get_never_writes_after_returning(
        self, backend: StorageBackend
    ) -> None:
        keys = _keys(self._cancel_batch_pages(backend))
        data = await self._put(backend, keys)
        ring = _PageRing(len(keys), self.page_nbytes)
        pending: list[_GetAttempt] = []
        for point in _cancel_points():
            buffers = ring.take()
            for buffer in buffers:
                buffer[0][:] = bytes(self.page_nbytes)
            task = asyncio.create_task(backend.get(keys, buffers, namespace=NAMESPACE))
            if not await _cancel_at(point, task, "a get"):
                # The batch completed before the cancellation could land: every earlier
                # point was a cancellation somewhere inside it.
                outcomes = task.result()
                assert outcomes == [Outcome.OK] * len(keys)
                assert all(_joined(b) == data[k] for k, b in zip(keys, buffers, strict=True))
                break
            # The caller now owns the buffers again: mark them, and check them once later
            # attempts (and at the end a whole batch and a pause) gave any straggling worker
            # every chance to write.
            for buffer in buffers:
                buffer[0][:] = bytes([_CANARY]) * self.page_nbytes
            pending.append(_GetAttempt(point, buffers))
            if len(pending) > _CANCEL_WINDOW:
                await self._check_get_attempt(pending.pop(0))
        again = ring.take()
        assert await backend.get(keys, again, namespace=NAMESPACE) == [Outcome.OK] * len(keys)
        await asyncio.sleep(0.05)
        for attempt in pending:
            await self._check_get_attempt(attempt)
        assert all(_joined(buffer) == data[key] for key, buffer in zip(keys, again, strict=True))

    async def _check_put_attempt(
        self, backend: StorageBackend, attempt: _PutAttempt, data: list[bytes], ring: _PageRing
    ) -> None:
        buffers = ring.take()
        outcomes = await backend.get(attempt.keys, buffers, namespace=NAMESPACE)
        for index, (outcome, buffer) in enumerate(zip(outcomes, buffers, strict=True)):
            assert outcome in (Outcome.OK, Outcome.MISS), (
                f"page {index} of a put cancelled after {attempt.point}: {outcome}"
            )
            if outcome is Outcome.OK:
                assert _joined(buffer) == data[index], (
                    f"page {index} of a put cancelled after {attempt.point} is not the page "
                    "as it was when the call returned"
                )
        await backend.delete(attempt.keys)

    async def test_cancelled_put_stores_pages_whole_or_not_at_all(
        self, backend: StorageBackend
    ) -> None:
        count = self._cancel_batch_pages(backend)
        data = [_payload(self.page_nbytes, i) for i in range(count)]
        ring = _PageRing(count, self.page_nbytes)
        pending: list[_PutAttempt] = []
        for point in _cancel_points():
            keys = _keys(count)  # fresh keys: a put of stored keys has nothing left to do
            pages = ring.take()
            for page, payload in zip(pages, data, strict=True):
                page[0][:] = payload
            metas = [_meta(key) for key in keys]
            task = asyncio.create_task(backend.put(keys, pages, metas))
            if not await _cancel_at(point, task, "a put"):
                assert task.result() == [Outcome.OK] * count
                break
            # The caller owns its pages again and reuses them: a page stored from them from
            # now on would be torn, which the checks below catch.
            for page in pages:
                page[0][:] = bytes([_CANARY]) * self.page_nbytes
            pending.append(_PutAttempt(point, keys))
            if len(pending) > _CANCEL_WINDOW:
                await self._check_put_attempt(backend, pending.pop(0), data, ring)
        else:
            pytest.fail("no put completed, even uncancelled")
        # The store still works: a cancelled batch completes when retried.
        if pending:
            retry = pending[-1]
            pages = ring.take()
            for page, payload in zip(pages, data, strict=True):
                page[0][:] = payload
            outcomes = await backend.put(retry.keys, pages, [_meta(key) for key in retry.keys])
            assert outcomes == [Outcome.OK] * count
            assert await backend.exists(retry.keys) == count
        await asyncio.sleep(0.05)
        for attempt in pending:
            await self._check_put_attempt(backend, attempt, data, ring)

    # Lifecycle.

    async def test_leaving_its_context_closes_it(self, backend: StorageBackend) -> None:
        (key,) = _keys(1)
        await backend.__aexit__(None, None, None)
        with pytest.raises(StorageError):
            await backend.exists([key])

    async def test_close_is_idempotent_and_later_calls_raise(self, backend: StorageBackend) -> None:
        (key,) = _keys(1)
        await self._put(backend, [key])
        await backend.close()
        await backend.close()
        page = _segments(_payload(self.page_nbytes, 0), [self.page_nbytes])
        with pytest.raises(StorageError):
            await backend.exists([key])
        with pytest.raises(StorageError):
            await backend.get([key], [_empty([self.page_nbytes])], namespace=NAMESPACE)
        with pytest.raises(StorageError):
            await backend.put([key], [page], [_meta(key)])
        with pytest.raises(StorageError):
            await backend.delete([key])

    async def test_close_leaves_no_task_or_thread_running(
        self,
        backend: StorageBackend,
        tasks_before_backend: set[asyncio.Task[object]],
        threads_before_backend: set[threading.Thread],
    ) -> None:
        (key,) = _keys(1)
        await self._put(backend, [key])
        await self._get_one(backend, key)
        await backend.close()
        await _assert_no_tasks_left(tasks_before_backend)
        await _assert_no_threads_left(threads_before_backend)

    async def test_a_close_cancelled_by_an_anyio_scope_keeps_the_cancellation_there(
        self,
        backend: StorageBackend,
        tasks_before_backend: set[asyncio.Task[object]],
        threads_before_backend: set[threading.Thread],
    ) -> None:
        # A deadline or a cancelled task group around close() while a put runs: the backend
        # closes, and the scope takes the cancellation. Re-raising a fresh CancelledError
        # instead of the scope's own lets it escape the scope, into the caller's task.
        count = self._cancel_batch_pages(backend)
        fresh = _keys(count)
        pages = [_segments(_payload(self.page_nbytes, i), [self.page_nbytes]) for i in range(count)]
        put = asyncio.create_task(backend.put(fresh, pages, [_meta(key) for key in fresh]))
        await asyncio.sleep(0)  # the put starts
        with anyio.CancelScope() as scope:
            scope.cancel()
            await backend.close()
        current = asyncio.current_task()
        assert current is not None
        if sys.version_info >= (3, 11):
            assert current.cancelling() == 0, "close() left its caller's task cancelled"
        _assert_overlapped_by_close(
            "put", (await asyncio.gather(put, return_exceptions=True))[0], count
        )
        with pytest.raises(StorageError):
            await backend.exists(fresh[:1])
        await _assert_no_tasks_left(tasks_before_backend)
        await _assert_no_threads_left(threads_before_backend)

    async def test_close_while_a_get_and_a_put_run(
        self,
        backend: StorageBackend,
        tasks_before_backend: set[asyncio.Task[object]],
        threads_before_backend: set[threading.Thread],
    ) -> None:
        # close() may wait for calls in flight or make them raise StorageError; either way a
        # call that returns outcomes kept to them, and nothing writes into buffers later.
        count = self._cancel_batch_pages(backend)
        stored = _keys(count)
        data = await self._put(backend, stored)
        buffers = [_empty([self.page_nbytes]) for _ in stored]
        fresh = _keys(count)
        pages = [_segments(data[key], [self.page_nbytes]) for key in stored]
        get = asyncio.create_task(backend.get(stored, buffers, namespace=NAMESPACE))
        put = asyncio.create_task(backend.put(fresh, pages, [_meta(key) for key in fresh]))
        await asyncio.sleep(0)  # both calls start
        await backend.close()
        got, put_result = await asyncio.gather(get, put, return_exceptions=True)
        for call, result in (("get", got), ("put", put_result)):
            _assert_overlapped_by_close(call, result, count)
        if isinstance(got, list):
            for index, (key, outcome) in enumerate(zip(stored, got, strict=True)):
                if outcome is Outcome.OK:
                    assert _joined(buffers[index]) == data[key], f"page {index} reported OK"
        canary = bytes([_CANARY]) * self.page_nbytes
        for buffer in buffers:
            buffer[0][:] = canary
        await _assert_no_tasks_left(tasks_before_backend)
        await _assert_no_threads_left(threads_before_backend)
        await asyncio.sleep(0.05)  # a straggling worker thread's chance to write
        for index, buffer in enumerate(buffers):
            assert bytes(buffer[0]) == canary, f"buffer {index} written after the get returned"
