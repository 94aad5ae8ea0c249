"""FaultyStorage: every fault is injected, counted, and reproducible from its seed."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from _plain_storage import PlainStorage

from hicache_async import StorageConfigError, StorageError
from hicache_async.storage import FileStorage, MemoryStorage, Outcome, PageMeta, StorageBackend
from hicache_async.storage._maintenance import MaintainableStorage, RawAccess
from hicache_async.storage._manifest import SupportsManifest
from hicache_async.storage._page import HEADER_NBYTES
from hicache_async.storage._protocol import PageBuffer
from hicache_async.testing._faults import FaultCounts, FaultyStorage

NS = b"faulty-storage-1"
PAGE = 4096


def _keys(count: int, seed: int = 0) -> list[bytes]:
    return [bytes([seed, i]) * 16 for i in range(count)]


async def _put(storage: StorageBackend, keys: list[bytes]) -> list[Outcome]:
    pages = [[memoryview(bytearray(key[:1] * PAGE))] for key in keys]
    metas = [PageMeta(key=k, namespace=NS, num_tokens=4) for k in keys]
    return await storage.put(keys, pages, metas)


async def _get(storage: StorageBackend, keys: list[bytes]) -> list[Outcome]:
    buffers = [[memoryview(bytearray(PAGE))] for _ in keys]
    return await storage.get(keys, buffers, namespace=NS)


async def _workload(seed: int) -> tuple[list[object], FaultCounts]:
    storage = FaultyStorage(
        MemoryStorage(capacity_bytes=1 << 24),
        seed=seed,
        error_rate=0.2,
        partial_batch_rate=0.3,
        corrupt_rate=0.2,
        truncate_rate=0.1,
        latency_spike_rate=0.3,
    )
    trace: list[object] = []
    async with storage:
        for round_ in range(12):
            keys = _keys(6, round_)
            for op in (_put, _get):
                try:
                    trace.append(await op(storage, keys))
                except StorageError:
                    trace.append("error")
    return trace, storage.injected()


async def test_same_seed_same_faults() -> None:
    first, first_counts = await _workload(7)
    second, second_counts = await _workload(7)
    assert first == second
    assert first_counts == second_counts
    assert first_counts.errors > 0
    assert first_counts.partial_batches > 0
    assert first_counts.corrupted > 0
    other, other_counts = await _workload(8)
    assert (other, other_counts) != (first, first_counts)


async def test_error_rate_one_raises_from_every_call() -> None:
    async with FaultyStorage(MemoryStorage(), error_rate=1.0) as storage:
        keys = _keys(2)
        with pytest.raises(StorageError, match="injected"):
            await _put(storage, keys)
        with pytest.raises(StorageError, match="injected"):
            await _get(storage, keys)
        with pytest.raises(StorageError, match="injected"):
            await storage.exists(keys)
        with pytest.raises(StorageError, match="injected"):
            await storage.delete(keys)
        assert storage.injected().errors == 4
        assert storage.inner.stats().puts == 0


async def test_partial_batches_fail_a_subset() -> None:
    inner = MemoryStorage()
    async with FaultyStorage(inner, seed=3, partial_batch_rate=1.0) as storage:
        keys = _keys(8)
        outcomes = await _put(storage, keys)
        failed = [k for k, o in zip(keys, outcomes, strict=True) if o is Outcome.ERROR]
        assert 1 <= len(failed) <= 8
        assert all(o in (Outcome.OK, Outcome.ERROR) for o in outcomes)
        assert storage.injected().partial_keys == len(failed)
        for key, outcome in zip(keys, outcomes, strict=True):
            assert await inner.exists([key]) == (outcome is Outcome.OK)


async def test_hang_waits_until_cancelled() -> None:
    async with FaultyStorage(MemoryStorage(), hang_rate=1.0) as storage:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_get(storage, _keys(1)), 0.02)
        assert storage.injected().hangs == 1


async def test_latency_spikes_are_counted() -> None:
    async with FaultyStorage(
        MemoryStorage(), latency_s=0.0001, latency_spike_rate=1.0, latency_spike_s=0.0001
    ) as storage:
        await _put(storage, _keys(2))
        await storage.exists(_keys(2))
        assert storage.injected().latency_spikes == 2


@pytest.mark.parametrize("fault", ["corrupt_rate", "truncate_rate"])
@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_damage_is_caught_by_the_inner_verification(
    tmp_path: Path, fault: str, kind: str
) -> None:
    inner: MemoryStorage | FileStorage = (
        MemoryStorage() if kind == "memory" else FileStorage(tmp_path / "store")
    )
    rates = {"corrupt_rate": 0.0, "truncate_rate": 0.0, fault: 1.0}
    async with FaultyStorage(inner, seed=5, **rates) as storage:
        keys = [os.urandom(32) for _ in range(4)]
        assert await _put(storage, keys) == [Outcome.OK] * 4
        counts = storage.injected()
        assert (counts.corrupted, counts.truncated) == (
            (4, 0) if fault == "corrupt_rate" else (0, 4)
        )
        assert await _get(storage, keys) == [Outcome.CORRUPT] * 4
        assert inner.stats().corrupt == 4
        assert await inner.exists(keys[:1]) == 0


def test_an_inner_object_that_is_no_backend_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match=r"inner backend \(object\) is not a StorageBackend"):
        FaultyStorage(object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("error_rate", 1.5),
        ("error_rate", "0.5"),
        ("hang_rate", float("nan")),
        ("corrupt_rate", True),
        ("latency_s", -1),
        ("latency_s", float("inf")),
        pytest.param("latency_s", 10**400, id="latency_s-int-past-float-range"),
        ("latency_spike_s", float("nan")),
    ],
)
def test_rates_and_latencies_are_checked(name: str, value: object) -> None:
    with pytest.raises(StorageConfigError, match=name):
        FaultyStorage(MemoryStorage(), **{name: value})


@pytest.mark.parametrize("seed", [None, 1.0, "1", True, np.bool_(True), [1]])
def test_a_seed_that_is_not_an_int_is_refused(seed: object) -> None:
    # Seeds are text to the generator: True and 1, or 1.0 and 1, gave other faults, and None
    # a fixed seed where random.Random(None) means a fresh one.
    with pytest.raises(StorageConfigError, match="seed must be an int"):
        FaultyStorage(MemoryStorage(), seed=seed)  # type: ignore[arg-type]


async def test_numpy_numbers_are_taken_for_seeds_rates_and_latencies() -> None:
    plain = FaultyStorage(MemoryStorage(), seed=3, error_rate=0.5, latency_s=0.001)
    numpy = FaultyStorage(
        MemoryStorage(),
        seed=np.int64(3),  # type: ignore[arg-type]
        error_rate=np.float32(0.5),  # type: ignore[arg-type]
        latency_s=np.float32(0.001),  # type: ignore[arg-type]
    )
    outcomes: list[list[object]] = []
    for storage in (plain, numpy):
        trace: list[object] = []
        async with storage:
            for round_ in range(10):
                try:
                    trace.append(await _put(storage, _keys(2, round_)))
                except StorageError:
                    trace.append("error")
        outcomes.append(trace)
    assert outcomes[0] == outcomes[1]
    assert "error" in outcomes[0]


async def _overlapping_puts(root: Path) -> tuple[FaultCounts, list[tuple[int, bytes] | None]]:
    storage = FaultyStorage(
        FileStorage(root, io_threads=4), seed=7, corrupt_rate=0.5, truncate_rate=0.5
    )
    keys = _keys(8)
    async with storage:
        for _ in range(6):
            await asyncio.gather(_put(storage, keys), _put(storage, keys))
        values = [await storage.read_raw(key) for key in keys]
    # The header holds the write's time; the length and payload are what damage changes.
    stored = [None if v is None else (len(v), v[HEADER_NBYTES:]) for v in values]
    return storage.injected(), stored


async def test_overlapping_puts_of_a_key_damage_it_alike_in_every_run(tmp_path: Path) -> None:
    # Two instances backing up one prefix put the same keys at once. Damage was a read and a
    # write across awaits, so the two calls' damages interleaved differently run to run (one
    # lost, or one cut applied over the other's flip): same seed, other stored bytes.
    runs = [await _overlapping_puts(tmp_path / str(run)) for run in range(8)]
    assert all(run == runs[0] for run in runs[1:])
    counts, stored = runs[0]
    assert counts.corrupted
    assert counts.truncated
    assert any(value is not None and value[0] < PAGE for value in stored)


async def test_a_damage_whose_raw_access_fails_is_skipped(tmp_path: Path) -> None:
    class _Unwritable(FileStorage):
        async def write_raw(self, key: bytes, data: bytes) -> None:
            raise StorageError("read-only medium")

    storage = FaultyStorage(_Unwritable(tmp_path), seed=1, corrupt_rate=1.0)
    async with storage:
        assert await _put(storage, _keys(3)) == [Outcome.OK] * 3
        assert await _get(storage, _keys(3)) == [Outcome.OK] * 3
    assert storage.injected().corrupted == 0


async def test_bad_input_raises_before_any_fault() -> None:
    # Every fault certain: still the caller's bug is a ValueError, and nothing is stored.
    storage = FaultyStorage(
        MemoryStorage(capacity_bytes=1 << 24), error_rate=1.0, hang_rate=1.0, partial_batch_rate=1.0
    )
    (good,) = _keys(1)
    page = [memoryview(bytearray(PAGE))]
    async with storage:
        for bad in (good[:5], good + b"x"):
            with pytest.raises(ValueError, match="32 bytes"):
                await storage.exists([good, bad])
            with pytest.raises(ValueError, match="32 bytes"):
                await storage.get([good, bad], [page, page], namespace=NS)
            with pytest.raises(ValueError, match="32 bytes"):
                await storage.delete([bad])
            metas = [PageMeta(key=k, namespace=NS, num_tokens=4) for k in (good, bad)]
            with pytest.raises(ValueError, match="32 bytes"):
                await storage.put([good, bad], [page, page], metas)
        with pytest.raises(ValueError, match="16 bytes"):
            await storage.get([good], [page], namespace=NS + b"x")
        with pytest.raises(ValueError, match="meta"):
            await storage.put(
                [good], [page], [PageMeta(key=b"\x09" * 32, namespace=NS, num_tokens=4)]
            )
        with pytest.raises(ValueError, match="buffers"):
            await storage.get([good], [page, page], namespace=NS)
        with pytest.raises(ValueError, match="writable"):
            await storage.get([good], [[memoryview(bytes(PAGE))]], namespace=NS)
        assert storage.injected() == FaultCounts()
        assert await storage.inner.exists([good]) == 0


async def test_passthrough_and_close() -> None:
    storage = FaultyStorage(MemoryStorage(capacity_bytes=1 << 20))
    assert "FaultyStorage new" in repr(storage)  # not open before it is entered
    async with storage:
        assert storage.name.startswith("faulty+memory://")
        assert storage.capabilities == storage.inner.capabilities
        await _put(storage, _keys(3))
        assert storage.stats().pages == 3
        assert len(await storage.list_pages()) == 3
        assert (await storage.verify()).ok == 3
        assert (await storage.gc()).evicted_pages == 0
        assert "FaultyStorage open" in repr(storage)
    assert "FaultyStorage closed" in repr(storage)
    await storage.close()
    with pytest.raises(StorageError, match="closed"):
        await storage.exists(_keys(1))


class _ReorderedPuts(MemoryStorage):
    """Memory storage whose put number n finishes after `delays[n]` loop iterations, so a test
    chooses the order in which concurrent puts complete."""

    def __init__(self, delays: list[int]) -> None:
        super().__init__(capacity_bytes=1 << 24)
        self._delays = iter(delays)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        delay = next(self._delays)
        outcomes = await super().put(keys, pages, metas)
        for _ in range(delay):
            await asyncio.sleep(0)
        return outcomes


async def _concurrent_faults(delays: list[int]) -> tuple[object, ...]:
    inner = _ReorderedPuts(delays)
    async with FaultyStorage(
        inner, seed=11, corrupt_rate=0.3, truncate_rate=0.2, partial_batch_rate=0.3
    ) as storage:
        batches = [_keys(4, batch) for batch in range(len(delays))]
        outcomes = await asyncio.gather(*(_put(storage, keys) for keys in batches))
        damaged = [await _get(inner, keys) for keys in batches]
        return tuple(map(tuple, outcomes)), tuple(map(tuple, damaged)), storage.injected()


async def test_concurrent_calls_get_the_faults_of_their_call_order() -> None:
    # The same puts, made in the same order, finishing in issue order and in reverse: every
    # decision belongs to the call's number, not to when the call reaches a draw.
    count = 12
    in_order = await _concurrent_faults(list(range(count)))
    reversed_ = await _concurrent_faults([count - i for i in range(count)])
    assert in_order == reversed_
    counts = in_order[2]
    assert isinstance(counts, FaultCounts)
    assert counts.corrupted
    assert counts.truncated
    assert counts.partial_batches


class _Registering(PlainStorage):
    """A plain backend that registers memory, as MooncakeStorage does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object, int | None]] = []

    async def register_memory(self, memory: object, nbytes: int | None = None) -> None:
        self.calls.append(("register", memory, nbytes))

    async def unregister_memory(self, memory: object) -> None:
        self.calls.append(("unregister", memory, None))


def test_optional_interfaces_follow_the_inner_backend() -> None:
    plain = FaultyStorage(PlainStorage())
    assert isinstance(plain, FaultyStorage)
    assert isinstance(plain, StorageBackend)
    for interface in (RawAccess, MaintainableStorage, SupportsManifest):
        assert not isinstance(plain, interface)
    assert not hasattr(plain, "register_memory")
    full = FaultyStorage(MemoryStorage(), seed=4, error_rate=0.5)
    assert isinstance(full, FaultyStorage)
    assert type(full).__name__ == "FaultyStorage"
    for interface in (RawAccess, MaintainableStorage, SupportsManifest):
        assert isinstance(full, interface)
    assert not hasattr(full, "register_memory")
    with pytest.raises(StorageConfigError, match="raw access"):
        FaultyStorage(PlainStorage(), corrupt_rate=0.1)


async def test_manifest_and_memory_registration_are_forwarded() -> None:
    inner = MemoryStorage()
    storage = FaultyStorage(inner)
    assert isinstance(storage, SupportsManifest)
    async with storage:
        manifest = storage.manifest()
        assert type(manifest) is type(inner.manifest())
        assert (await manifest.read()).entries == (await inner.manifest().read()).entries
    registering = _Registering()
    wrapped = FaultyStorage(registering)
    memory = bytearray(64)
    await getattr(wrapped, "register_memory")(memory, 32)  # noqa: B009
    await getattr(wrapped, "unregister_memory")(memory)  # noqa: B009
    assert registering.calls == [("register", memory, 32), ("unregister", memory, None)]
