"""The storage conformance suite against every built-in backend, and against broken backends
it must fail."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import threading
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from _plain_storage import PlainStorage

from hicache_async import StorageError
from hicache_async.storage import (
    FileStorage,
    MemoryStorage,
    Outcome,
    PageMeta,
    StorageBackend,
    StorageCapabilities,
    StorageStats,
)
from hicache_async.storage._protocol import PageBuffer
from hicache_async.testing._conformance import (
    MAC_KEY,
    StorageConformance,
    _declared_return,
    _returns_only_none,
)
from hicache_async.testing._faults import FaultyStorage

_CAPACITY = 256 << 20


class TestMemoryStorage(StorageConformance):
    @pytest_asyncio.fixture
    async def backend(self) -> AsyncIterator[MemoryStorage]:
        async with MemoryStorage(capacity_bytes=_CAPACITY) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self) -> AsyncIterator[MemoryStorage]:
        async with MemoryStorage(capacity_bytes=_CAPACITY, mac_key=MAC_KEY) as storage:
            yield storage


class TestFileStorage(StorageConformance):
    @pytest_asyncio.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[FileStorage]:
        async with FileStorage(tmp_path / "store", capacity_bytes=_CAPACITY) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self, tmp_path: Path) -> AsyncIterator[FileStorage]:
        async with FileStorage(tmp_path / "mac", mac_key=MAC_KEY, fsync="data") as storage:
            yield storage


class TestSharedFileStorage(StorageConformance):
    """Shared mode, with a second instance open on the same root the whole time."""

    @pytest_asyncio.fixture
    async def other_instance(self, tmp_path: Path) -> AsyncIterator[FileStorage]:
        async with FileStorage(tmp_path / "shared", shared=True, io_threads=2) as storage:
            yield storage

    @pytest_asyncio.fixture(autouse=True)
    async def threads_before_backend(
        self, other_instance: FileStorage
    ) -> AsyncIterator[set[threading.Thread]]:
        # Taken once the other instance is open: its threads run on after `backend` closes.
        yield set(threading.enumerate())

    @pytest_asyncio.fixture
    async def backend(
        self, other_instance: FileStorage, tmp_path: Path
    ) -> AsyncIterator[FileStorage]:
        async with FileStorage(tmp_path / "shared", shared=True, fsync="always") as storage:
            yield storage


class TestFaultyStorageWithoutFaults(StorageConformance):
    page_nbytes = 48 * 1024 + 16

    @pytest_asyncio.fixture
    async def backend(self) -> AsyncIterator[FaultyStorage]:
        async with FaultyStorage(MemoryStorage(capacity_bytes=_CAPACITY), seed=1) as storage:
            yield storage


class TestPlainBackend(StorageConformance):
    """The tests that need no raw access still run (the others are skipped)."""

    raw_access = False

    @pytest_asyncio.fixture
    async def backend(self) -> AsyncIterator[PlainStorage]:
        async with PlainStorage(_CAPACITY) as storage:
            yield storage


class TestFaultyStorageOverAPlainBackend(StorageConformance):
    """The wrapper claims no raw access its inner backend lacks, so the suite skips those
    tests (declared here) instead of failing them."""

    raw_access = False

    @pytest_asyncio.fixture
    async def backend(self) -> AsyncIterator[FaultyStorage]:
        async with FaultyStorage(PlainStorage(_CAPACITY), seed=2) as storage:
            yield storage


class _BatchLimited(MemoryStorage):
    """Serves at most 3 pages in a get or put, as its capabilities declare, and refuses a
    bigger batch with StorageError before any I/O."""

    limit = 3

    def __init__(self, *, mac_key: bytes | None = None) -> None:
        super().__init__(capacity_bytes=_CAPACITY, mac_key=mac_key)

    @property
    def capabilities(self) -> StorageCapabilities:
        return msgspec.structs.replace(super().capabilities, max_batch_pages=self.limit)

    def _refuse_oversized(self, keys: Sequence[bytes]) -> None:
        if len(keys) > self.limit:
            raise StorageError(f"at most {self.limit} pages a call, got {len(keys)}")

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        self._refuse_oversized(keys)
        return await super().get(keys, into, namespace=namespace)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        self._refuse_oversized(keys)
        return await super().put(keys, pages, metas)


class TestBatchLimitedStorage(StorageConformance):
    """The suite sends no call bigger than max_batch_pages, but for the one test of it."""

    @pytest_asyncio.fixture
    async def backend(self) -> AsyncIterator[_BatchLimited]:
        async with _BatchLimited() as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self) -> AsyncIterator[_BatchLimited]:
        async with _BatchLimited(mac_key=MAC_KEY) as storage:
            yield storage


class TestMemoryStorageWithTheSmallestPages(TestMemoryStorage):
    page_nbytes = 16


class _Compacting(PlainStorage):
    """BROKEN: a get reads the pages it finds into the first buffers and reports the hits
    first, the classic batching bug."""

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        present = [key for key in keys if await self._inner.exists([key])]
        found = await self._inner.get(present, list(into[: len(present)]), namespace=namespace)
        return found + [Outcome.MISS] * (len(keys) - len(present))


class _StragglingGet(PlainStorage):
    """BROKEN: a get copies into the caller's buffers from a worker thread, which carries on
    after the awaiting task is cancelled."""

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        staged = [[memoryview(bytearray(sum(s.nbytes for s in page)))] for page in into]
        outcomes = await self._inner.get(keys, staged, namespace=namespace)

        def copy() -> None:
            for source, page in zip(staged, into, strict=True):
                offset = 0
                for segment in page:
                    target = memoryview(segment).cast("B")
                    target[:] = source[0][offset : offset + target.nbytes]
                    offset += target.nbytes
                time.sleep(0.0005)  # slow enough that a cancellation lands mid-copy

        await asyncio.to_thread(copy)
        return outcomes


class _StragglingPut(PlainStorage):
    """BROKEN: a put reads the caller's pages from a worker thread after a cancellation."""

    def __init__(self) -> None:
        super().__init__()
        # Its own threads, joined by close() while the loop still runs: a straggler waits on
        # the loop, so one left behind at loop shutdown would hang the executor's join.
        self._threads = concurrent.futures.ThreadPoolExecutor(2)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._threads.shutdown)
        await super().close()

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        inner = self._inner
        loop = asyncio.get_running_loop()

        def store() -> list[Outcome]:
            outcomes = []
            for key, page, meta in zip(keys, pages, metas, strict=True):
                time.sleep(0.0005)
                copy = [memoryview(bytearray(b"".join(bytes(s) for s in page)))]
                future = asyncio.run_coroutine_threadsafe(inner.put([key], [copy], [meta]), loop)
                outcomes += future.result()
            return outcomes

        return await loop.run_in_executor(self._threads, store)


class _WaitsOutCancellation(PlainStorage):
    """BROKEN: a get or put waits for its I/O through every cancellation, then returns its
    outcomes as if it had not been cancelled."""

    @staticmethod
    async def _slow(call: Awaitable[list[Outcome]]) -> list[Outcome]:
        await asyncio.sleep(0.01)
        return await call

    async def _uncancellable(self, call: Awaitable[list[Outcome]]) -> list[Outcome]:
        io = asyncio.ensure_future(self._slow(call))
        while not io.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(io)
        return io.result()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        return await self._uncancellable(super().get(keys, into, namespace=namespace))

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        return await self._uncancellable(super().put(keys, pages, metas))


class _StoresThenRefuses(_BatchLimited):
    """BROKEN: a put of more than max_batch_pages pages stores the first ones, then raises."""

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        n = self.limit
        await MemoryStorage.put(self, keys[:n], pages[:n], metas[:n])
        return await super().put(keys, pages, metas)


class _WritesThenRefuses(_BatchLimited):
    """BROKEN: a get of more than max_batch_pages pages fills the first buffers, then raises."""

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        n = self.limit
        await MemoryStorage.get(self, keys[:n], into[:n], namespace=namespace)
        return await super().get(keys, into, namespace=namespace)


class _SmallErroring(MemoryStorage):
    """BROKEN: too small for the suite's oversized batch, and answers ERROR, not MISS, for
    the pages it has no room for."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=64 << 20)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        outcomes = await super().put(keys, pages, metas)
        return [Outcome.ERROR if o is Outcome.MISS else o for o in outcomes]


class _SmallGarbling(MemoryStorage):
    """BROKEN: too small for the suite's oversized batch, and its gets garble the last byte of
    every page they read."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=64 << 20)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        outcomes = await super().get(keys, into, namespace=namespace)
        for page, outcome in zip(into, outcomes, strict=True):
            if outcome is Outcome.OK:
                page[-1][-1] ^= 0xFF
        return outcomes


class _HugeLimit(_BatchLimited):
    """Declares a limit of 2**30 pages a call, yet refuses a call of more than 1024 pages,
    the most the suite sends whatever the page size; remembers the biggest it was sent."""

    limit = 1 << 30
    largest = 0

    def _refuse_oversized(self, keys: Sequence[bytes]) -> None:
        if len(keys) > 1024:
            raise StorageError(f"the suite sent a batch of {len(keys)} pages")
        self.largest = max(self.largest, len(keys))


class _ScribblingPut(PlainStorage):
    """BROKEN: a put uses the caller's pages as scratch space once it has stored them."""

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        outcomes = await self._inner.put(keys, pages, metas)
        for page in pages:
            for segment in page:
                view = memoryview(segment)
                if not view.readonly:
                    view.cast("B")[:] = bytes(view.nbytes)
        return outcomes


class _BoolCounts(PlainStorage):
    """BROKEN: exists and delete answer 0 and 1 as bools (`return key in pages`)."""

    async def exists(self, keys: Sequence[bytes]) -> int:
        found = await self._inner.exists(keys)
        return bool(found) if found <= 1 else found

    async def delete(self, keys: Sequence[bytes]) -> int:
        removed = await self._inner.delete(keys)
        return bool(removed) if removed <= 1 else removed


class _BoolCapabilities(PlainStorage):
    """BROKEN: max_batch_pages is True, which is 1 to `==` and an int to isinstance."""

    @property
    def capabilities(self) -> StorageCapabilities:
        return msgspec.structs.replace(self._inner.capabilities, max_batch_pages=True)


class _FloatStats(PlainStorage):
    """BROKEN: every counter a float, which msgspec builds without a word."""

    def stats(self) -> StorageStats:
        stats = self._inner.stats()
        counters = {f: float(getattr(stats, f)) for f in StorageStats.__struct_fields__[1:]}
        return msgspec.structs.replace(stats, **counters)


class _LeavesATask(PlainStorage):
    """BROKEN: opening starts a flusher task that close() never stops."""

    async def __aenter__(self) -> _LeavesATask:
        await super().__aenter__()
        self._flusher = asyncio.create_task(asyncio.Event().wait())
        return self

    def stop_flusher(self) -> None:
        self._flusher.cancel()


class _LeavesAThread(PlainStorage):
    """BROKEN: opening starts a flusher thread that close() never stops."""

    async def __aenter__(self) -> _LeavesAThread:
        await super().__aenter__()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._stop.wait, name="plain-flusher")
        self._flusher.start()
        return self

    def stop_flusher(self) -> None:
        self._stop.set()
        self._flusher.join()


def _without_turns(call: Coroutine[object, None, list[Outcome]]) -> list[Outcome]:
    """Run a memory store's single-page call to its end without letting the loop run: its
    only suspensions are bare turns (pages on the loop, no thread job), resumed at once."""
    while True:
        try:
            suspended = call.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if suspended is not None:  # a real wait: the page was not served on the loop
            call.close()
            raise AssertionError(f"the call waited for {suspended!r}")


class _BlocksTheLoop(PlainStorage):
    """BROKEN: serves a batch page by page without ever suspending, as a backend calling a
    synchronous client from its coroutines does."""

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for key, page in zip(keys, into, strict=True):
            outcomes += _without_turns(self._inner.get([key], [page], namespace=namespace))
        return outcomes

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for key, page, meta in zip(keys, pages, metas, strict=True):
            outcomes += _without_turns(self._inner.put([key], [page], [meta]))
        return outcomes


class _BlocksTheLoopInGets(_BlocksTheLoop):
    """BROKEN: only its gets never suspend."""

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        return await self._inner.put(keys, pages, metas)


class _SuspendsOnceThenBlocks(PlainStorage):
    """BROKEN: each call suspends once, then does its I/O with a synchronous client on the
    loop, as a coroutine that awaits something small first does. Half a second: on a loaded
    machine the loop's thread can be held back for a tenth of a second around the stretch,
    which made a fifth of a second look like a share of the call under the limit."""

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        await asyncio.sleep(0)
        time.sleep(0.5)  # noqa: ASYNC251 - the synchronous client it stands for
        return await self._inner.get(keys, into, namespace=namespace)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        await asyncio.sleep(0)
        time.sleep(0.5)  # noqa: ASYNC251 - the synchronous client it stands for
        return await self._inner.put(keys, pages, metas)


class _SuspendsOnceThenBlocksInGets(_SuspendsOnceThenBlocks):
    """BROKEN: only its gets block the loop after suspending once."""

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        return await self._inner.put(keys, pages, metas)


class _Overruns(PlainStorage):
    """BROKEN: a get writes the byte after each segment it was given too, as a copy through
    a raw pointer whose length is off by one does."""

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        outcomes = await self._inner.get(keys, into, namespace=namespace)
        for page in into:
            for segment in page:
                target = memoryview(segment).cast("B")
                start = ctypes.addressof(ctypes.c_char.from_buffer(target))
                ctypes.memset(start + target.nbytes, 0, 1)
        return outcomes


class _OkWhenClosed(PlainStorage):
    """BROKEN: a get that close() interrupts reports every page OK, read or not."""

    closed = False

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        for _ in range(3):
            await asyncio.sleep(0)
        if self.closed:
            return [Outcome.OK] * len(keys)
        return await self._inner.get(keys, into, namespace=namespace)

    async def close(self) -> None:
        self.closed = True
        await super().close()


async def _suite_fails(check: Awaitable[None]) -> None:
    try:
        await check
    except AssertionError:
        return
    except pytest.skip.Exception as exc:
        pytest.fail(f"the suite skipped its check of a broken backend: {exc}")
    pytest.fail("the suite passed a broken backend")


class _EntersAsNone(PlainStorage):
    async def __aenter__(self) -> None:  # type: ignore[override]
        await super().__aenter__()


class _EntersAsNoneUndeclared(PlainStorage):
    async def __aenter__(self):  # type: ignore[no-untyped-def]
        await super().__aenter__()


class _ExistsAsBool(PlainStorage):
    async def exists(self, keys: Sequence[bytes]) -> bool:
        return await super().exists(keys) == len(keys)


class _DeletesAsBool(PlainStorage):
    async def delete(self, keys: Sequence[bytes]) -> bool:
        return await super().delete(keys) > 0


@pytest.mark.parametrize(
    "broken", [_EntersAsNone, _EntersAsNoneUndeclared, _ExistsAsBool, _DeletesAsBool]
)
async def test_the_suite_fails_a_backend_declaring_what_the_protocol_refuses(
    broken: type[PlainStorage],
) -> None:
    # `async with` in the cache takes an `__aenter__` that returns None, and each answer of a
    # `-> bool` method might happen to be refused only by a call the suite does not make: the
    # declarations are what type checkers see and let through or refuse.
    backend = broken(_CAPACITY)
    async with backend:
        await _suite_fails(
            StorageConformance().test_declared_return_types_are_the_protocol_s(backend)
        )


def test_an_enter_that_may_return_something_is_not_taken_for_one_that_returns_none() -> None:
    class Conditional:
        async def __aenter__(self, ready: bool = True) -> Any:
            return self if ready else None

        async def bare(self) -> None:
            return

        def neither(self) -> Any:
            return None if self else self

    assert not _returns_only_none(Conditional.__aenter__)
    assert not _returns_only_none(Conditional.neither)
    assert _returns_only_none(Conditional.bare)
    assert _returns_only_none(_EntersAsNoneUndeclared.__aenter__)
    assert not _returns_only_none(PlainStorage.__aenter__)
    assert not _returns_only_none(None)
    assert not _returns_only_none(len)


def test_declared_returns_are_read_as_written() -> None:
    def evaluated() -> None: ...

    evaluated.__annotations__ = {"return": bool}
    assert _declared_return(evaluated) == "bool"
    evaluated.__annotations__ = {"return": None}
    assert _declared_return(evaluated) == "None"
    evaluated.__annotations__ = {}
    assert _declared_return(evaluated) is None
    assert _declared_return(PlainStorage.exists) == "int"
    assert _declared_return(None) is None


class _EvaluatedOnRead:
    """A method as Python 3.14 gives one whose hints name a type imported only for type
    checkers: reading its `__annotations__` evaluates them, which raises NameError."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self._function, instance)

    @property
    def __annotations__(self) -> dict[str, Any]:  # type: ignore[override]
        raise NameError("name 'PageCount' is not defined")


class _HintsOnlyForTypeCheckers(PlainStorage):
    exists = _EvaluatedOnRead(PlainStorage.exists)  # type: ignore[assignment]


async def test_the_suite_passes_a_backend_whose_hints_cannot_be_evaluated_at_run_time() -> None:
    # The NameError came out of the suite as the backend's failure.
    async with _HintsOnlyForTypeCheckers(_CAPACITY) as backend:
        assert await backend.exists([b"\x01" * 32]) == 0
        await StorageConformance().test_declared_return_types_are_the_protocol_s(backend)
    assert _declared_return(_HintsOnlyForTypeCheckers.exists) is None


async def test_the_suite_fails_a_get_that_writes_past_its_buffers() -> None:
    async with _Overruns(_CAPACITY) as backend:
        await _suite_fails(StorageConformance().test_get_writes_only_inside_its_buffers(backend))


@pytest.mark.parametrize(
    "broken",
    [_BlocksTheLoop, _BlocksTheLoopInGets, _SuspendsOnceThenBlocks, _SuspendsOnceThenBlocksInGets],
)
async def test_the_suite_fails_a_backend_that_blocks_the_event_loop(
    broken: type[PlainStorage],
) -> None:
    async with broken(_CAPACITY) as backend:
        suite = StorageConformance()
        await _suite_fails(suite.test_a_large_batch_lets_other_tasks_run(backend))


async def test_the_suite_fails_a_get_that_compacts_hits() -> None:
    async with _Compacting() as backend:
        await _suite_fails(StorageConformance().test_mixed_batch_has_one_outcome_per_key(backend))


async def test_the_suite_fails_a_get_that_writes_after_cancellation() -> None:
    async with _StragglingGet() as backend:
        suite = StorageConformance()
        await _suite_fails(suite.test_cancelled_get_never_writes_after_returning(backend))


async def test_the_suite_fails_a_put_that_reads_after_cancellation() -> None:
    async with _StragglingPut() as backend:
        suite = StorageConformance()
        await _suite_fails(suite.test_cancelled_put_stores_pages_whole_or_not_at_all(backend))


@pytest.mark.parametrize(
    "test",
    [
        StorageConformance.test_cancelled_get_never_writes_after_returning,
        StorageConformance.test_cancelled_put_stores_pages_whole_or_not_at_all,
    ],
    ids=["get", "put"],
)
async def test_the_suite_fails_a_call_that_waits_out_its_cancellation(
    test: Callable[[StorageConformance, StorageBackend], Awaitable[None]],
) -> None:
    async with _WaitsOutCancellation() as backend:
        await _suite_fails(test(StorageConformance(), backend))


@pytest.mark.parametrize(
    "broken", [_StoresThenRefuses, _WritesThenRefuses, _SmallErroring, _SmallGarbling]
)
async def test_the_suite_fails_a_broken_answer_to_an_oversized_batch(
    broken: type[MemoryStorage],
) -> None:
    # Refused after I/O; or, from a store too small for the batch, ERROR or wrong bytes.
    async with broken() as backend:
        suite = StorageConformance()
        await _suite_fails(
            suite.test_a_batch_over_max_batch_pages_is_served_or_refused_cleanly(backend)
        )


async def test_the_suite_takes_misses_from_a_store_too_small_for_its_oversized_batch() -> None:
    # 64 MiB holds 1022 of the 1025 pages of 64 KiB (headers included): the pages it has no
    # room for are misses, which a bounded store may answer.
    async with MemoryStorage(capacity_bytes=64 << 20) as backend:
        suite = StorageConformance()
        await suite.test_a_batch_over_max_batch_pages_is_served_or_refused_cleanly(backend)


async def test_the_suite_sends_tiny_pages_in_batches_of_at_most_1024() -> None:
    # 8 MiB of 16-byte pages would be half a million pages a call.
    class TestTinyPages(StorageConformance):
        page_nbytes = 16

    async with _HugeLimit() as backend:
        await TestTinyPages().test_cancelled_get_never_writes_after_returning(backend)
        await TestTinyPages().test_cancelled_put_stores_pages_whole_or_not_at_all(backend)
    assert 16 <= backend.largest <= 1024


@pytest.mark.parametrize("page_nbytes", [15, 1, 0, -65536, 65536.0, True, "65536"])
def test_the_suite_refuses_a_page_size_it_cannot_test(page_nbytes: object) -> None:
    with pytest.raises(ValueError, match=r"page_nbytes must be an int of at least 16 bytes"):
        type("TestBadPages", (StorageConformance,), {"page_nbytes": page_nbytes})


async def test_the_suite_fails_a_put_that_writes_into_its_pages() -> None:
    async with _ScribblingPut() as backend:
        suite = StorageConformance()
        await _suite_fails(
            suite.test_put_leaves_its_pages_untouched_and_takes_read_only_ones(backend)
        )


@pytest.mark.parametrize(
    "test",
    [
        StorageConformance.test_empty_batches,
        StorageConformance.test_exists_counts_the_consecutive_prefix,
        StorageConformance.test_delete,
    ],
)
async def test_the_suite_fails_counts_that_are_bools(
    test: Callable[[StorageConformance, StorageBackend], Awaitable[None]],
) -> None:
    async with _BoolCounts() as backend:
        await _suite_fails(test(StorageConformance(), backend))


async def test_the_suite_fails_a_bool_max_batch_pages() -> None:
    async with _BoolCapabilities() as backend:
        await _suite_fails(StorageConformance().test_capabilities_are_usable(backend))


async def test_the_suite_fails_stats_of_other_types() -> None:
    async with _FloatStats() as backend:
        await _suite_fails(StorageConformance().test_stats_have_their_declared_types(backend))


@pytest.mark.parametrize("broken", [_LeavesATask, _LeavesAThread])
async def test_the_suite_fails_a_close_that_leaves_a_task_or_thread_running(
    broken: type[_LeavesATask | _LeavesAThread],
) -> None:
    before, threads = set(asyncio.all_tasks()), set(threading.enumerate())
    async with broken() as backend:
        suite = StorageConformance()
        try:
            await _suite_fails(
                suite.test_close_leaves_no_task_or_thread_running(backend, before, threads)
            )
        finally:
            backend.stop_flusher()


async def test_the_default_executors_unnamed_threads_are_the_loops_not_the_backends() -> None:
    # uvloop before 0.23 gives its default executor no thread name prefix, as an application's
    # own `ThreadPoolExecutor()` set as the default has none: its idle threads outlive a close
    # and must not count as the backend's.
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor())
    before, threads = set(asyncio.all_tasks()), set(threading.enumerate())
    name = await loop.run_in_executor(None, lambda: threading.current_thread().name)
    assert name.startswith("ThreadPoolExecutor-")
    async with PlainStorage() as backend:
        await StorageConformance().test_close_leaves_no_task_or_thread_running(
            backend, before, threads
        )
    # A pool of the backend's own, numbered apart from the default one, still counts.
    own = concurrent.futures.ThreadPoolExecutor()
    try:
        own.submit(time.sleep, 0).result()
        async with PlainStorage() as backend:
            await _suite_fails(
                StorageConformance().test_close_leaves_no_task_or_thread_running(
                    backend, before, threads
                )
            )
    finally:
        own.shutdown()


async def test_the_suite_fails_a_get_that_close_interrupts_and_reports_ok() -> None:
    before, threads = set(asyncio.all_tasks()), set(threading.enumerate())
    async with _OkWhenClosed() as backend:
        suite = StorageConformance()
        await _suite_fails(suite.test_close_while_a_get_and_a_put_run(backend, before, threads))


async def test_the_suite_fails_a_backend_without_raw_access_unless_declared() -> None:
    async with PlainStorage() as backend:
        await _suite_fails(StorageConformance().test_mixed_batch_with_a_damaged_page(backend))

        class Declared(StorageConformance):
            raw_access = False

        with pytest.raises(pytest.skip.Exception, match="no raw access"):
            await Declared().test_mixed_batch_with_a_damaged_page(backend)
