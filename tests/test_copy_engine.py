"""Copy engines: exact copies across memory layouts, per-layer readiness, cancellation, closing."""

from __future__ import annotations

import asyncio
import collections
import gc
import queue
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache_async._config import HostLayout, KVLayout
from hicache_async._errors import CacheClosedError, WrongThreadError
from hicache_async._pool import KVPool
from hicache_async.testing._kvgen import KVGenerator
from hicache_async.transfer import (
    CopyEngine,
    CopyStatistics,
    CpuCopyEngine,
    CudaCopyEngine,
    LayerwiseCopy,
    default_copy_engine,
)
from hicache_async.transfer import _cpu as cpu_engine
from hicache_async.transfer import _protocol as protocol_module
from hicache_async.transfer._cpu import DEFAULT_MIN_RUN_BYTES, LayerKernel, StagingBuffer
from hicache_async.transfer._protocol import plan_copy

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16")
PAGE = 4
PAGES = 16
MEMORY_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first", "page_first_direct")
TOKENS = np.random.default_rng(7).integers(0, 50_000, size=PAGES * PAGE)

# (source pages, destination pages), from fully consecutive to scattered on both sides.
PATTERNS: dict[str, tuple[list[int], list[int]]] = {
    "contiguous": ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]),
    "mixed": ([0, 1, 2, 3, 12, 13, 14, 15, 9], [8, 9, 10, 11, 0, 1, 2, 3, 6]),
    "to_run": ([9, 2, 14, 5, 0], [3, 4, 5, 6, 7]),
    "from_run": ([4, 5, 6, 7, 8], [15, 0, 9, 2, 6]),
    "scattered": ([3, 11, 0, 7, 6, 13], [12, 1, 2, 10, 8, 5]),
}


def _source(memory_layout: HostLayout, layout: KVLayout = LAYOUT, *, seed: int = 0) -> KVPool:
    """A pool whose page i holds prompt page i of TOKENS."""
    pool = KVPool(layout, PAGE, PAGES, memory_layout=memory_layout, name="src")
    gen = KVGenerator(layout, PAGE, seed=seed)
    for page in range(PAGES):
        gen.fill_page(pool, page, TOKENS, page)
    return pool


def _check(
    dst: KVPool, src_pages: list[int], dst_pages: list[int], *, layout: KVLayout = LAYOUT
) -> None:
    gen = KVGenerator(layout, PAGE)
    for s, d in zip(src_pages, dst_pages, strict=True):
        gen.check_page(dst, d, TOKENS, s)
    empty = bytes(dst.page_nbytes)
    for page in set(range(PAGES)) - set(dst_pages):
        assert dst.read_page(page) == empty, f"page {page} was not a destination"


@pytest.fixture(
    params=[(0, None, 1), (DEFAULT_MIN_RUN_BYTES, None, 1), (0, 0, 1), (0, 0, 3)],
    ids=["row-ops", "staged", "direct", "direct-shared"],
)
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[CpuCopyEngine]:
    """With min_run_bytes=0 scattered pages move by gathers and scatters; with the default,
    this test layout's small rows go through the staging buffer (runs are runs either way);
    with min_direct_bytes=0 every row moves by a direct copy, by one thread or shared out
    between three (whatever the batch size, so that these small batches are shared too)."""
    min_run, min_direct, threads = request.param
    eng = CpuCopyEngine(
        name="test-copy", min_run_bytes=min_run, min_direct_bytes=min_direct, threads=threads
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        if threads > 1:
            monkeypatch.setattr(cpu_engine, "_MIN_SHARED_BYTES", 0)
        yield eng
        await eng.aclose()


def test_kernel_modes() -> None:
    src = KVPool(LAYOUT, PAGE, PAGES)
    dst = KVPool(LAYOUT, PAGE, PAGES)
    expected = {
        "contiguous": ("runs", "runs"),
        "mixed": ("runs", "runs"),
        "to_run": ("gather", "stage"),
        "from_run": ("scatter", "stage"),
        "scattered": ("gather", "stage"),
    }
    for name, (a, b) in PATTERNS.items():
        plan = plan_copy(src, a, dst, b)
        # This layout's rows are far below the default run size, so scattered pages stage.
        got = (
            LayerKernel(plan, min_run_bytes=0, min_direct_bytes=None).mode,
            LayerKernel(plan).mode,
        )
        assert got == expected[name], name
        assert LayerKernel(plan, min_direct_bytes=0).mode == "direct"
    # Within one pool index ops cannot run in place; the staging buffer separates them.
    a, b = PATTERNS["scattered"]
    assert LayerKernel(plan_copy(src, a, src, b), min_run_bytes=0).mode == "stage"
    a, b = PATTERNS["contiguous"]
    assert LayerKernel(plan_copy(src, a, src, b)).mode == "runs"
    # Rows big enough to be worth one op each: in host memory, one direct copy each.
    big = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128)
    host = KVPool(big, 64, 6, memory_layout="page_first_direct")
    device = KVPool(big, 64, 6)
    for a, b in (([4, 0, 2], [3, 4, 5]), ([0, 1, 2], [3, 4, 5])):
        kernel = LayerKernel(plan_copy(host, a, device, b))
        assert (kernel.mode, kernel.shareable) == ("direct", True)
    no_direct = {"min_direct_bytes": None}
    assert LayerKernel(plan_copy(host, [4, 0, 2], device, [3, 4, 5]), **no_direct).mode == "gather"
    assert LayerKernel(plan_copy(device, [0, 1, 2], host, [3, 1, 5]), **no_direct).mode == "scatter"
    kernel = LayerKernel(plan_copy(host, [0, 1, 2], device, [3, 4, 5]), **no_direct)
    assert (kernel.mode, kernel.shareable) == ("runs", False)
    # Token-major rows are 2 KiB and never consecutive: between two such pools, they stage.
    two_layers = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128)
    token_major = KVPool(two_layers, 64, 6, memory_layout="page_first")
    layer_major = KVPool(two_layers, 64, 6)
    assert LayerKernel(plan_copy(token_major, [4, 0], layer_major, [1, 3])).mode == "gather"
    other = KVPool(two_layers, 64, 6, memory_layout="page_first")
    assert LayerKernel(plan_copy(token_major, [4, 0], other, [1, 3])).mode == "stage"


def test_staging_buffer_is_reused() -> None:
    staging = StagingBuffer()
    like = torch.zeros(4, 6, dtype=torch.complex128)
    first = staging.rows(3, like)
    assert (first.shape, first.dtype) == ((3, 6), torch.complex128)
    smaller = staging.rows(2, torch.zeros(1, 5, dtype=torch.int64))
    assert (smaller.shape, smaller.dtype) == ((2, 5), torch.int64)
    assert smaller.data_ptr() == first.data_ptr()
    larger = staging.rows(40, like)
    assert larger.shape == (40, 6)
    larger.fill_(1)  # the whole view is backed by memory


@pytest.mark.parametrize("src_layout", MEMORY_LAYOUTS)
@pytest.mark.parametrize("dst_layout", MEMORY_LAYOUTS)
async def test_copies_are_exact_across_layouts(
    engine: CpuCopyEngine, src_layout: HostLayout, dst_layout: HostLayout
) -> None:
    src = _source(src_layout)
    for a, b in PATTERNS.values():
        dst = KVPool(LAYOUT, PAGE, PAGES, memory_layout=dst_layout, name="dst")
        await engine.copy(src, a, dst, b)
        _check(dst, a, b)


@pytest.mark.parametrize(
    "layout",
    [
        KVLayout(num_layers=2, attention="mla", kv_lora_rank=12, qk_rope_head_dim=4),
        KVLayout(num_layers=3, attention="mla", kv_lora_rank=5, qk_rope_head_dim=2, dtype="uint8"),
        KVLayout(num_layers=2, num_kv_heads=1, head_dim=6, dtype="float8_e5m2"),
        KVLayout(num_layers=2, num_kv_heads=3, head_dim=5, dtype="float32"),
    ],
)
async def test_copies_are_exact_for_every_word_size(
    engine: CpuCopyEngine, layout: KVLayout
) -> None:
    src = _source("page_first", layout, seed=0)
    for a, b in PATTERNS.values():
        for dst_layout in ("layer_first", "page_first_direct"):
            dst = KVPool(layout, PAGE, PAGES, memory_layout=dst_layout)
            await engine.copy(src, a, dst, b)
            _check(dst, a, b, layout=layout)


@pytest.mark.parametrize("memory_layout", MEMORY_LAYOUTS)
async def test_copy_within_one_pool(engine: CpuCopyEngine, memory_layout: HostLayout) -> None:
    gen = KVGenerator(LAYOUT, PAGE)
    for a, b in (([0, 1, 2], [10, 5, 11]), ([4, 5, 6, 7], [8, 9, 10, 11]), ([3], [15])):
        pool = _source(memory_layout)
        await engine.copy(pool, a, pool, b)
        moved = dict(zip(b, a, strict=True))
        for page in range(PAGES):
            gen.check_page(pool, page, TOKENS, moved.get(page, page))


async def test_layers_land_in_order(engine: CpuCopyEngine) -> None:
    layout = KVLayout(num_layers=6, num_kv_heads=4, head_dim=64)
    src = KVPool(layout, 16, 32, memory_layout="page_first")
    dst = KVPool(layout, 16, 32)
    src.data.view(torch.uint8).random_(0, 256)
    pages = list(range(32))
    order = pages[::-1]
    copy = engine.copy(src, pages, dst, order)
    for layer in range(layout.num_layers):
        await copy.layer(layer)
        assert copy.layers_landed > layer
        for s, d in zip(pages, order, strict=True):
            for a, b in zip(src.page_view(s, layer), dst.page_view(d, layer), strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    await copy
    assert copy.done()
    assert copy.exception() is None
    await copy.layer(0)  # landed layers return at once, any number of times
    with pytest.raises(ValueError, match="out of range"):
        await copy.layer(layout.num_layers)
    with pytest.raises(TypeError, match="layer must be an int, got bool"):
        await copy.layer(True)


@pytest.mark.parametrize("whole", [False, True])
async def test_cancelling_waiters_never_cancels_the_copy(
    engine: CpuCopyEngine, whole: bool
) -> None:
    src = _source("page_first")
    a, b = PATTERNS["scattered"]
    for layer in range(LAYOUT.num_layers):
        dst = KVPool(LAYOUT, PAGE, PAGES)
        copy = engine.copy(src, a, dst, b)
        fired: list[LayerwiseCopy] = []
        copy.add_done_callback(fired.append)

        async def wait(copy: LayerwiseCopy = copy, layer: int = layer) -> None:
            if whole:
                await copy
            else:
                await copy.layer(layer)

        task = asyncio.create_task(wait())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await copy
        await asyncio.sleep(0)
        assert fired == [copy]
        _check(dst, a, b)
    assert engine.statistics().in_flight == 0


async def test_cancelling_at_each_layer_of_a_driven_copy() -> None:
    """Drive a copy's layers by hand and cancel a consumer while it waits on each one."""
    loop = asyncio.get_running_loop()
    layers = 5
    for stop in range(layers):
        copy = LayerwiseCopy(loop, layers, 2)
        fired: list[LayerwiseCopy] = []
        copy.add_done_callback(fired.append)
        reached: list[int] = []

        async def consume(copy: LayerwiseCopy = copy, reached: list[int] = reached) -> None:
            for i in range(layers):
                await copy.layer(i)
                reached.append(i)

        async def whole(copy: LayerwiseCopy = copy) -> str:
            await copy
            return "all"

        consumer = asyncio.create_task(consume())
        bystander = asyncio.create_task(whole())
        await asyncio.sleep(0)
        for i in range(stop):
            copy._layer_landed(i)
            await asyncio.sleep(0)
        assert reached == list(range(stop))
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        assert not copy.done()
        assert copy.layers_landed == stop
        for i in range(stop, layers):
            copy._layer_landed(i)
        assert await bystander == "all"
        assert copy.done()
        assert fired == [copy]
        assert reached == list(range(stop))


async def test_done_callbacks_run_before_waiters_resume(engine: CpuCopyEngine) -> None:
    src = _source("layer_first")
    dst = KVPool(LAYOUT, PAGE, PAGES)
    order: list[str] = []
    copy = engine.copy(src, [1, 2], dst, [3, 4])
    copy.add_done_callback(lambda c: order.append(f"callback {c.num_pages}"))
    await copy
    order.append("awaited")
    assert order == ["callback 2", "awaited"]

    late: list[LayerwiseCopy] = []
    copy.add_done_callback(late.append)
    assert late == []  # scheduled, not called in place
    await asyncio.sleep(0)
    assert late == [copy]


async def test_failure_reaches_waiters_and_callbacks() -> None:
    loop = asyncio.get_running_loop()
    copy = LayerwiseCopy(loop, 3, 1)
    fired: list[BaseException | None] = []
    copy.add_done_callback(lambda c: fired.append(c.exception()))
    waiting = asyncio.create_task(copy.layer(2))
    await asyncio.sleep(0)
    copy._layer_landed(0)
    error = RuntimeError("device lost")
    copy._fail(error)
    with pytest.raises(RuntimeError, match="device lost"):
        await waiting
    await copy.layer(0)  # landed before the failure
    with pytest.raises(RuntimeError, match="device lost"):
        await copy.layer(1)
    with pytest.raises(RuntimeError, match="device lost"):
        await copy
    assert copy.done()
    assert copy.exception() is error
    assert fired == [error]
    assert "failed" in repr(copy)


async def test_validation_errors_start_nothing(engine: CpuCopyEngine) -> None:
    src = KVPool(LAYOUT, PAGE, PAGES)
    dst = KVPool(LAYOUT, PAGE, 4)
    other_layout = KVPool(KVLayout(num_layers=4, num_kv_heads=2, head_dim=4), PAGE, PAGES)
    other_page = KVPool(LAYOUT, PAGE * 2, PAGES)
    cases: list[tuple[KVPool, list[int], KVPool, list[int], str]] = [
        (src, [0], other_layout, [0], "layouts"),
        (src, [0], other_page, [0], "page sizes"),
        (src, [0, 1], dst, [0], "2 source pages but 1"),
        (src, [PAGES], dst, [0], "out of range"),
        (src, [0], dst, [4], "out of range"),
        (src, [-1], dst, [0], "out of range"),
        (src, [0, 1], dst, [2, 2], "more than once"),
        (src, [0, 1], src, [1, 2], "overlap"),
        (src, [0.5], dst, [1], "integers"),  # type: ignore[list-item]
    ]
    for a, a_pages, b, b_pages, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.copy(a, a_pages, b, b_pages)
    assert engine.statistics() == CopyStatistics(copies=0, pages=0, bytes=0, in_flight=0, failed=0)


def test_repeats_and_overlaps_are_refused_exactly_when_there_are_some() -> None:
    # The checks sort once rather than call np.unique and np.intersect1d; both must still
    # catch a repeat or an overlap anywhere (ends of the sorted order included), and only then.
    pool = KVPool(LAYOUT, PAGE, 12)
    other = KVPool(LAYOUT, PAGE, 12)
    rng = np.random.default_rng(7)
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(3000):
        n = int(rng.integers(1, 7))
        a = rng.integers(0, 12, size=n).tolist()
        b = rng.integers(0, 12, size=n).tolist()
        for dst in (pool, other):
            repeated = len(set(b)) < len(b)
            overlaps = dst is pool and bool(set(a) & set(b))
            try:
                plan_copy(pool, a, dst, b)
            except ValueError as exc:
                refused = "more than once" if "more than once" in str(exc) else "overlap"
                assert refused == ("more than once" if repeated else "overlap"), (a, b)
                assert repeated or overlaps, (a, b)
            else:
                refused = "none"
                assert not repeated, (a, b)
                assert not overlaps, (a, b)
            seen[refused] += 1
    assert min(seen.values()) > 100, seen


async def test_statistics_and_empty_copies(engine: CpuCopyEngine) -> None:
    src = _source("layer_first")
    dst = KVPool(LAYOUT, PAGE, PAGES)
    first = engine.copy(src, [0, 1, 2], dst, [5, 6, 7])
    second = engine.copy(src, [3], dst, [8])
    assert engine.statistics().in_flight == 2  # completion only lands on the loop
    assert "in_flight=2" in repr(engine)
    await asyncio.gather(first, second)
    assert engine.statistics() == CopyStatistics(
        copies=2, pages=4, bytes=4 * src.page_nbytes, in_flight=0, failed=0
    )
    empty = engine.copy(src, [], dst, [])
    assert empty.done()
    await empty
    assert engine.statistics().copies == 3
    assert "pages=0" in repr(empty)


async def test_many_copies_in_flight_at_once(engine: CpuCopyEngine) -> None:
    src = _source("page_first_direct")
    dsts = [KVPool(LAYOUT, PAGE, PAGES, memory_layout=m) for m in MEMORY_LAYOUTS * 2]
    rng = np.random.default_rng(1)
    jobs = []
    for dst in dsts:
        a = rng.choice(PAGES, 10, replace=False).tolist()
        b = rng.choice(PAGES, 10, replace=False).tolist()
        jobs.append((engine.copy(src, a, dst, b), dst, a, b))
    await asyncio.gather(*(job[0] for job in jobs))
    for _, dst, a, b in jobs:
        _check(dst, a, b)


async def test_aclose_waits_for_copies_and_stops_the_thread() -> None:
    engine = CpuCopyEngine(name="closing-engine")
    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64)
    src = KVPool(layout, 16, 24)
    dst = KVPool(layout, 16, 24, memory_layout="page_first")
    src.data.view(torch.uint8).random_(0, 256)
    copies = [engine.copy(src, [i, i + 12], dst, [23 - i, 11 - i]) for i in range(12)]
    assert any(t.name == "closing-engine" for t in threading.enumerate())
    await engine.aclose()
    assert all(c.done() and c.exception() is None for c in copies)
    assert engine.statistics().in_flight == 0
    for i in range(12):
        assert src.read_page(i) == dst_page_as_layer_major(dst, 23 - i)
    assert not any(t.name == "closing-engine" for t in threading.enumerate())
    assert engine.closed
    with pytest.raises(CacheClosedError):
        engine.copy(src, [0], dst, [0])
    await engine.aclose()  # idempotent
    assert "closed" in repr(engine)


async def test_an_engine_stopped_at_interpreter_exit_closes_at_once_and_refuses_copies() -> None:
    # A cache left by a shutdown hook that runs after the library's: aclose() sent its Stop
    # to a worker that had exited, and waited for the answer for ever.
    engine = CpuCopyEngine(name="exit-engine")
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16)
    src, dst = KVPool(layout, 16, 4), KVPool(layout, 16, 4)
    await engine.copy(src, [0], dst, [1])
    thread = engine._thread
    assert thread is not None
    # The worker may not have taken its None yet (or still runs a copy past the exit's
    # deadline): a Stop queued behind it was never answered either.
    engine._stop_at_exit()
    with pytest.raises(CacheClosedError):
        engine.copy(src, [1], dst, [2])
    await asyncio.wait_for(engine.aclose(), 10)
    assert engine.closed
    thread.join(10)
    assert not thread.is_alive()


async def test_an_engine_never_started_refuses_copies_after_the_exit_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The exit hook stops only engines whose worker runs: a copy asked of another one by a
    # later exit hook started a worker that nothing joins before finalization.
    engine = CpuCopyEngine(name="late-engine")
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16)
    src, dst = KVPool(layout, 16, 4), KVPool(layout, 16, 4)
    exiting = threading.Event()
    exiting.set()
    monkeypatch.setattr(protocol_module, "_EXITING", exiting)
    with pytest.raises(CacheClosedError, match="interpreter is exiting"):
        engine.copy(src, [0], dst, [1])
    assert engine._thread is None
    assert engine.statistics().in_flight == 0
    await engine.aclose()


async def test_shared_copies_fail_whole_and_stop_with_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure in a partner's layers fails the copy (once every thread has finished with
    the pools); the engine goes on copying; its partners stop with it."""
    monkeypatch.setattr(cpu_engine, "_MIN_SHARED_BYTES", 0)
    engine = CpuCopyEngine(name="shared-engine", min_direct_bytes=0, threads=3)
    layout = KVLayout(num_layers=7, num_kv_heads=4, head_dim=64)
    src = KVPool(layout, 16, 8)
    dst = KVPool(layout, 16, 8, memory_layout="page_first_direct")
    src.data.view(torch.uint8).random_(0, 256)
    real_call = LayerKernel.__call__
    partner_threads: set[str] = set()

    def failing(kernel: LayerKernel, layer: int) -> None:
        name = threading.current_thread().name
        if "-partner-" in name:
            partner_threads.add(name)
        if layer == 4:  # dealt to the first partner: layers 1, 4
            raise OSError("copy failed")
        real_call(kernel, layer)

    monkeypatch.setattr(LayerKernel, "__call__", failing)
    copy = engine.copy(src, [0, 3, 5], dst, [7, 2, 1])
    await copy.layer(3)  # layers below the failed one still land
    with pytest.raises(OSError, match="copy failed"):
        await copy
    assert copy.layers_landed == 4
    assert partner_threads == {"shared-engine-partner-1", "shared-engine-partner-2"}
    assert engine.statistics().failed == 1

    monkeypatch.setattr(LayerKernel, "__call__", real_call)
    await engine.copy(src, [0, 3, 5], dst, [7, 2, 1])
    for s, d in ((0, 7), (3, 2), (5, 1)):
        assert src.read_page(s) == dst.read_page(d)
    await engine.aclose()
    alive = {t.name for t in threading.enumerate()}
    assert not any(name.startswith("shared-engine") for name in alive)


@pytest.mark.parametrize("threads", [0, -1, True, 2.0, "2"])
def test_engine_threads_must_be_a_positive_integer(threads: object) -> None:
    with pytest.raises(ValueError, match="threads"):
        CpuCopyEngine(threads=threads)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_direct_bytes"):
        CpuCopyEngine(min_direct_bytes=-1)


def dst_page_as_layer_major(pool: KVPool, page: int) -> bytes:
    """The layer-major bytes of a page of any pool, read through its per-layer views."""
    parts = [
        pool.page_view(page, layer)[b].contiguous().view(torch.uint8).numpy().tobytes()
        for b in range(pool.layout.num_buffers)
        for layer in range(pool.layout.num_layers)
    ]
    return b"".join(parts)


async def test_aclose_waits_for_the_thread_off_the_loop() -> None:
    """A worker that has signalled its stop may take a while to end (a busy process makes it
    wait for the GIL): the loop keeps running meanwhile, and the thread is gone once aclose
    returns."""
    engine = CpuCopyEngine(name="slow-exit-engine")
    worker = engine._worker
    stopped = threading.Event()

    def slow_exit(jobs: queue.SimpleQueue[object]) -> None:
        worker(jobs)  # type: ignore[arg-type]
        stopped.set()
        time.sleep(0.3)

    engine._worker = slow_exit  # type: ignore[assignment]
    src, dst = KVPool(LAYOUT, PAGE, 2), KVPool(LAYOUT, PAGE, 2)
    await engine.copy(src, [0], dst, [1])
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    await engine.aclose()
    ticker.cancel()
    assert stopped.is_set()
    assert ticks >= 5, "the loop stood still while the thread finished"
    assert not any(t.name == "slow-exit-engine" for t in threading.enumerate())


async def test_aclose_of_an_unused_engine() -> None:
    engine = CpuCopyEngine(name="unused-engine")
    await engine.aclose()
    assert not any(t.name == "unused-engine" for t in threading.enumerate())


def test_engine_belongs_to_one_open_loop() -> None:
    engine = CpuCopyEngine(name="one-loop-engine")
    src = KVPool(LAYOUT, PAGE, 2)
    dst = KVPool(LAYOUT, PAGE, 2)

    async def use(engine: CpuCopyEngine) -> None:
        await engine.copy(src, [0], dst, [1])

    async def close(engine: CpuCopyEngine) -> None:
        await engine.aclose()

    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(use(engine))
        with pytest.raises(WrongThreadError):
            asyncio.run(use(engine))
        with pytest.raises(WrongThreadError):
            asyncio.run(close(engine))
    finally:
        first.close()
    asyncio.run(use(engine))  # its loop closed: the next loop takes it over
    # Dropped without aclose, an engine still lets its thread go.
    (thread,) = [t for t in threading.enumerate() if t.name == "one-loop-engine"]
    del engine
    gc.collect()
    thread.join()


async def test_default_engine_for_cpu() -> None:
    engine = default_copy_engine(torch.device("cpu"))
    assert isinstance(engine, CpuCopyEngine)
    assert isinstance(engine, CopyEngine)
    await engine.aclose()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_cuda_engine_needs_cuda() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaCopyEngine()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_engine_round_trip() -> None:
    engine = default_copy_engine("cuda")
    assert isinstance(engine, CudaCopyEngine)
    try:
        for host_layout in MEMORY_LAYOUTS:
            host = _source(host_layout)
            device = KVPool(LAYOUT, PAGE, PAGES, device="cuda", name="device")
            back = KVPool(LAYOUT, PAGE, PAGES, memory_layout=host_layout, name="back")
            for a, b in PATTERNS.values():
                copy = engine.copy(host, a, device, b)
                for layer in range(LAYOUT.num_layers):
                    await copy.layer(layer)
                await copy
                _check(device, a, b)
                await engine.copy(device, b, back, a)
                for page in a:
                    assert back.read_page(page) == host.read_page(page)
        assert engine.statistics().failed == 0
    finally:
        await engine.aclose()


_LEFT_OPEN = """
import atexit, threading

def report():  # registered first, so it runs after every other exit hook
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    print("alive", sum(t.is_alive() for t in others), flush=True)

atexit.register(report)

import asyncio
import collections
from hicache_async import CacheConfig, HiCache
from hicache_async.testing import KVGenerator, serve

config = CacheConfig.from_dict({
    "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16},
    "page_size": 16, "device_pages": 32, "host_pages": 64, "model_id": "left-open",
})
kept = []

async def main():
    for i in range(3):
        cache = HiCache(config)
        await cache.__aenter__()
        prompt = list(range(7000 + i, 7300 + i))
        await serve(cache, prompt, KVGenerator(config.layout, 16), prefetch=False)
        kept.append(cache)  # a singleton never left

asyncio.run(main())
"""


def test_copy_threads_of_caches_never_left_are_joined_before_the_interpreter_ends(
    tmp_path: Path,
) -> None:
    # A worker still running while the interpreter finalized was stopped inside libtorch's
    # frames, and the process aborted (SIGABRT) in about one exit out of six.
    script = tmp_path / "left_open.py"
    script.write_text(_LEFT_OPEN)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "alive 0", done.stdout[-2000:]


_QUEUED_AT_EXIT = """
import asyncio, atexit, threading

loop = asyncio.new_event_loop()
copies = []

def await_queued():  # registered before the engines' exit hook, so it runs after it
    async def outcome(copy):
        try:
            await copy
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "copied"
    print("queued:", loop.run_until_complete(outcome(copies[1])), flush=True)
    print("in flight:", engine.statistics().in_flight, flush=True)

atexit.register(await_queued)

from hicache_async._config import KVLayout
from hicache_async._pool import KVPool
from hicache_async.transfer import CpuCopyEngine, _protocol
from hicache_async.transfer._cpu import LayerKernel

_protocol._EXIT_JOIN_S = 0.5
started, release = threading.Event(), threading.Event()
real_call = LayerKernel.__call__

def held(kernel, layer):  # the first copy outlasts the exit's deadline
    started.set()
    release.wait()
    real_call(kernel, layer)

LayerKernel.__call__ = held
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16)
src, dst = KVPool(layout, 16, 4), KVPool(layout, 16, 4)
engine = CpuCopyEngine(name="exit-queue-engine")

async def start():
    copies.append(engine.copy(src, [0], dst, [1]))
    copies.append(engine.copy(src, [1], dst, [2]))

loop.run_until_complete(start())
started.wait()
"""


def test_a_copy_left_queued_at_interpreter_exit_fails_for_its_waiters(tmp_path: Path) -> None:
    # The exit stop ended the worker's queue: a copy still queued behind a copy that outlasted
    # the join deadline (or put there after the stop) never ran, and an exit hook that ran
    # its loop to await it waited for ever.
    script = tmp_path / "queued_at_exit.py"
    script.write_text(_QUEUED_AT_EXIT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("queued: CacheClosedError: exit-queue-engine is closed"), lines
    assert "interpreter exit" in lines[0]
    # The held copy is still the worker's; the queued one was counted as failed.
    assert lines[1] == "in flight: 1", lines


async def test_a_copy_refuses_another_loop() -> None:
    import threading

    from hicache_async import WrongThreadError

    loop = asyncio.get_running_loop()
    copy = LayerwiseCopy(loop, 2, 1)
    errors: list[BaseException] = []

    def elsewhere() -> None:
        async def wait() -> None:
            await copy.layer(0)

        for attempt in (lambda: asyncio.run(wait()), lambda: copy.add_done_callback(print)):
            try:
                attempt()
            except BaseException as exc:
                errors.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert [type(e) for e in errors] == [WrongThreadError, WrongThreadError]
    assert copy._waiters == []
    assert copy._callbacks == []
    copy._layer_landed(1)
    await copy  # still usable on its own loop


def _old_copy_rule(src: KVPool, s: np.ndarray, dst: KVPool, d: np.ndarray) -> str | None:
    """The checks `plan_copy` made with np.unique and np.intersect1d: the error, or None."""
    if len(d) and len(np.unique(d)) != len(d):
        return "a destination page appears more than once"
    if src is dst and len(np.intersect1d(s, d)):
        return "source and destination pages overlap within one pool"
    return None


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32])
def test_plan_copy_refuses_what_the_unique_and_intersect_rule_refused(dtype: type) -> None:
    # The sort-based checks give the np.unique / np.intersect1d answers for every input:
    # empty, one page, repeats, overlaps, strided (non-contiguous) arrays and lists.
    rng = np.random.default_rng(11)
    src = KVPool(LAYOUT, PAGE, PAGES)
    dst = KVPool(LAYOUT, PAGE, PAGES)
    for case in range(3000):
        n = int(rng.integers(0, PAGES + 1)) if case % 10 else int(rng.integers(0, 2))
        high = int(rng.integers(1, PAGES + 1))
        wide = rng.integers(0, high, size=(2 * n, 2)).astype(dtype)
        if case % 3 == 0:  # views of every other row of one column: strided
            s_arr, d_arr = wide[::2, 0], wide[1::2, 1]
        else:
            s_arr = rng.integers(0, high, size=n).astype(dtype)
            d_arr = rng.integers(0, high, size=n).astype(dtype)
        s_pages: Sequence[int] = s_arr.tolist() if case % 4 == 1 else s_arr
        d_pages: Sequence[int] = d_arr.tolist() if case % 4 == 1 else d_arr
        target = src if case % 2 else dst
        s = np.asarray(s_arr, dtype=np.int64)
        d = np.asarray(d_arr, dtype=np.int64)
        expected = _old_copy_rule(src, s, target, d)
        got: str | None = None
        plan = None
        try:
            plan = plan_copy(src, s_pages, target, d_pages)
        except ValueError as exc:
            got = str(exc)
        assert got == expected, (s_pages, d_pages, target is src)
        if plan is not None:
            assert plan.src_pages.tolist() == s.tolist()
            assert plan.dst_pages.tolist() == d.tolist()
