"""Prefetch and backup over real storage backends, checked against the KV generator."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import TracebackType

import anyio
import numpy as np
import pytest
import structlog
from _unowned_storage import Unowned, assert_backup_adds_up
from test_cancelled_close import _until

from hicache_async import CacheConfig, HiCache, KVLayout, PrefetchHandle, PrefetchStatus
from hicache_async._metrics import _families, prometheus_collector
from hicache_async.storage import (
    FileStorage,
    MemoryStorage,
    Outcome,
    PageBuffer,
    PageMeta,
    StorageBackend,
    StorageCapabilities,
    StorageStats,
)
from hicache_async.testing import FaultyStorage, KVGenerator, assert_drained, serve
from hicache_async.workers._link import StorageLink

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)


def _config(**overrides: object) -> CacheConfig:
    base: dict[str, object] = {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
        "page_size": PAGE,
        "device_pages": 64,
        "host_pages": 128,
        "model_id": "orchestration-test",
        "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE, "batch_pages": 8},
        "backup": {"batch_pages": 8, "retry_backoff_s": 0.001},
    }
    base.update(overrides)
    return CacheConfig.from_dict(base)


def _prompts(count: int, seed: int, *, length: int = 10 * PAGE) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 5000, size=4 * PAGE)
    return [
        np.concatenate([shared, rng.integers(0, 5000, size=int(rng.integers(PAGE, length)))])
        for _ in range(count)
    ]


@pytest.fixture
def file_root(tmp_path: Path) -> Path:
    root = tmp_path / "l3"
    root.mkdir(mode=0o700)
    return root


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_second_instance_serves_first_ones_prefixes_from_storage(
    kind: str, file_root: Path
) -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=11)
    prompts = _prompts(30, seed=1)
    memory = MemoryStorage(capacity_bytes=64 << 20)

    def backend() -> StorageBackend:
        if kind == "memory":
            return Unowned(memory)
        return FileStorage(file_root, shared=True)

    async with memory:
        async with HiCache(config, storage=backend()) as first:
            for i, prompt in enumerate(prompts):
                await serve(first, prompt, generator, request_id=f"a{i}")
            await first.drain()
            written = first.storage_status().backup
            assert written is not None
            assert written.written_pages > 0
            assert_backup_adds_up(written)
        async with HiCache(config, storage=backend()) as second:
            results = [
                await serve(second, prompt, generator, request_id=f"b{i}")
                for i, prompt in enumerate(prompts)
            ]
            assert sum(r.storage_tokens for r in results) > 0
            # Every page that came from storage was checked on the device by serve().
            assert sum(r.checked_pages for r in results) >= sum(
                r.storage_tokens // PAGE for r in results
            )
            await second.drain()
            assert_drained(second)


async def test_namespaces_never_share_pages() -> None:
    memory = MemoryStorage(capacity_bytes=64 << 20)
    generator = KVGenerator(LAYOUT, PAGE)
    prompt = _prompts(1, seed=2)[0]
    async with memory:
        async with HiCache(_config(model_id="a"), storage=Unowned(memory)) as a:
            await serve(a, prompt, generator)
            await a.drain()
        async with HiCache(_config(model_id="b"), storage=Unowned(memory)) as b:
            result = await serve(b, prompt, generator)
            assert result.storage_tokens == 0
            assert result.computed_tokens == len(prompt)


async def test_concurrent_prefetches_of_one_prefix_read_each_page_once() -> None:
    config = _config(
        device_pages=8192,
        host_pages=8192,
        page_size=64,
        host_layout="page_first_direct",
        prefetch={"policy": "wait_complete", "threshold_tokens": 64, "batch_pages": 16},
        backup={"batch_pages": 64},
    )
    generator = KVGenerator(config.layout, 64, seed=3)
    prefix = np.random.default_rng(5).integers(0, 30000, size=16 * 1024)
    memory = MemoryStorage(capacity_bytes=256 << 20)
    async with memory:
        async with HiCache(config, storage=Unowned(memory)) as writer:
            await serve(writer, prefix, generator, prefetch=False)
            await writer.drain()
        pages = len(prefix) // 64
        assert memory.stats().pages == pages
        gets_before = memory.stats().gets
        async with HiCache(config, storage=Unowned(memory)) as reader:
            results = await asyncio.gather(
                *(reader.prefetch(prefix, request_id=f"p{i}") for i in range(100))
            )
            assert all(r.status is PrefetchStatus.COMPLETE for r in results)
            assert sum(r.storage_tokens for r in results) >= len(prefix)
            reads = memory.stats().gets - gets_before
            assert reads == pages, f"{reads} page reads for {pages} pages"
            status = reader.storage_status()
            assert status.prefetch is not None
            assert status.prefetch.pages_read == pages
            served = await serve(reader, prefix, generator, prefetch=False, check="all")
            assert served.host_tokens == len(prefix)
            await reader.drain()
            assert_drained(reader)


@pytest.mark.parametrize("seed", [1, 2])
async def test_faulty_storage_degrades_to_misses(seed: int) -> None:
    config = _config(
        prefetch={
            "policy": "wait_complete",
            "threshold_tokens": PAGE,
            "batch_pages": 4,
            "io_timeout_s": 0.2,
        },
        backup={"batch_pages": 4, "retry_backoff_s": 0.001, "io_timeout_s": 0.2},
    )
    generator = KVGenerator(config.layout, PAGE, seed=seed)
    prompts = _prompts(40, seed=seed)
    memory = MemoryStorage(capacity_bytes=64 << 20)
    async with memory:
        async with HiCache(config, storage=Unowned(memory)) as first:
            for prompt in prompts:
                await serve(first, prompt, generator)
            await first.drain()
        faulty = FaultyStorage(
            Unowned(memory),
            seed=seed,
            error_rate=0.1,
            hang_rate=0.05,
            latency_spike_rate=0.1,
            latency_spike_s=0.01,
            corrupt_rate=0.1,
            truncate_rate=0.05,
            partial_batch_rate=0.1,
        )
        async with HiCache(config, storage=faulty) as second:
            for i, prompt in enumerate(prompts * 2):
                result = await serve(second, prompt, generator, request_id=f"f{i}")
                assert result.num_tokens == len(prompt)
            await second.drain()
            assert_drained(second)
            counts = faulty.injected()
            assert counts.errors + counts.partial_batches + counts.hangs > 0


async def test_cancelling_a_prefetching_handler_at_every_await_point() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=4)
    prompts = _prompts(12, seed=9)
    memory = MemoryStorage(capacity_bytes=64 << 20)
    async with memory:
        async with HiCache(config, storage=Unowned(memory)) as first:
            for prompt in prompts:
                await serve(first, prompt, generator)
            await first.drain()
        cancelled = 0
        for prompt in prompts:
            step = 0
            while True:
                async with HiCache(config, storage=Unowned(memory)) as cache:
                    task = asyncio.create_task(serve(cache, prompt, generator))
                    for _ in range(step):
                        await asyncio.sleep(0)
                    finished = task.done()
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    await cache.drain()
                    for handle in list(cache._link.prefetcher._running if cache._link else []):
                        await handle.wait()
                    assert_drained(cache)
                if finished:
                    break
                cancelled += 1
                step += 1
        assert cancelled > len(prompts)


class SlowPuts(Unowned):
    """A real backend whose puts take a while: the backup queue fills up."""

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        await asyncio.sleep(0.05)
        return await self.inner.put(keys, pages, metas)


async def test_pages_offered_again_once_stored_are_counted_superseded() -> None:
    config = _config(write_policy="write_through")
    generator = KVGenerator(config.layout, PAGE, seed=14)
    prompt = np.random.default_rng(14).integers(0, 5000, size=6 * PAGE)
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory, HiCache(config, storage=Unowned(memory)) as cache:
        await serve(cache, prompt, generator, prefetch=False)
        await cache.drain()
        link = cache._link
        assert link is not None
        stored = [n for n in cache.tree.iter_nodes() if n.in_storage and n.host_pages is not None]
        assert stored
        before = link.backup.statistics()
        for node in stored:  # twice each: one batch sees a node once, and stored already
            assert link.backup.offer(node, node.num_pages)
            assert link.backup.offer(node, node.num_pages)
        await cache.drain()
        after = link.backup.statistics()
        again = 2 * sum(node.num_pages for node in stored)
        assert after.superseded_pages - before.superseded_pages == again
        assert after.written_pages == before.written_pages
        assert memory.stats().puts == before.written_pages  # no page was put twice
        assert_backup_adds_up(after)
        assert_drained(cache)


async def test_slow_backend_fills_backup_queue_and_requests_go_on() -> None:
    config = _config(backup={"queue_size": 2, "batch_pages": 2, "flush_deadline_s": 0.2})
    generator = KVGenerator(config.layout, PAGE, seed=6)
    memory = MemoryStorage(capacity_bytes=64 << 20)
    prompts = [np.random.default_rng(i).integers(0, 5000, size=12 * PAGE) for i in range(60)]
    async with memory:
        async with HiCache(config, storage=SlowPuts(memory)) as cache:
            for prompt in prompts:
                await serve(cache, prompt, generator, prefetch=False)
            status = cache.storage_status()
            assert status.backup is not None
            assert status.backup.skipped_pages > 0
            assert status.backup.written_pages < len(prompts) * 12
        # Leaving flushed within the deadline and dropped (and counted) the rest.
        assert cache.statistics().state == "closed"


async def test_attach_detach_switch_at_run_time(tmp_path: Path) -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=8)
    prompts = _prompts(10, seed=3)
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    async with HiCache(config) as cache:
        assert not cache.storage_status().attached
        await cache.attach_storage(f"file://{root_a}")
        with pytest.raises(Exception, match="detach it before attaching"):
            await cache.attach_storage(f"file://{root_b}")
        for prompt in prompts:
            await serve(cache, prompt, generator)
        await cache.drain()
        assert any(node.in_storage for node in cache.tree.iter_nodes())
        await cache.detach_storage()
        await cache.detach_storage()  # harmless
        assert not any(node.in_storage for node in cache.tree.iter_nodes())
        await cache.attach_storage(f"file://{root_b}")
        status = cache.storage_status()
        assert status.attached
        assert status.generation == 2
        # New backups go to the new backend; nothing is taken for granted from the old one.
        for prompt in _prompts(10, seed=4):
            await serve(cache, prompt, generator)
        await cache.drain()
        assert_drained(cache)
    async with FileStorage(root_b) as b:
        assert b.stats().pages > 0


async def test_prefetch_policies_and_early_termination() -> None:
    config = _config(prefetch={"policy": "best_effort", "threshold_tokens": PAGE, "batch_pages": 1})
    generator = KVGenerator(config.layout, PAGE, seed=12)
    prompt = _prompts(1, seed=4, length=30 * PAGE)[0]
    memory = MemoryStorage(capacity_bytes=64 << 20)
    async with memory:
        async with HiCache(config, storage=Unowned(memory)) as writer:
            await serve(writer, prompt, generator, prefetch=False)
            await writer.drain()
        async with HiCache(
            config, storage=FaultyStorage(Unowned(memory), latency_s=0.002)
        ) as cache:
            handle = await cache.start_prefetch(prompt, request_id="early")
            first = await handle.ready()  # best effort: what has landed now
            # Running, or finished at once if it was still queued.
            assert first.status in (PrefetchStatus.RUNNING, PrefetchStatus.TERMINATED)
            final = await handle.wait()
            assert final.status is PrefetchStatus.TERMINATED
            assert final.storage_tokens < len(prompt) // PAGE * PAGE
            complete = await cache.prefetch(prompt, policy="wait_complete")
            assert complete.status is PrefetchStatus.COMPLETE
            assert complete.cached_tokens == len(prompt) // PAGE * PAGE
            nothing = await cache.prefetch([1, 2, 3], policy="wait_complete")  # no whole page
            assert nothing.status is PrefetchStatus.COMPLETE
            assert nothing.cached_tokens == 0
            absent = await cache.prefetch(
                list(range(90_000, 90_000 + 3 * PAGE)), policy="wait_complete"
            )
            assert absent.status is PrefetchStatus.SKIPPED  # storage has none of it
            served = await serve(cache, prompt, generator, prefetch=False, check="all")
            assert served.computed_tokens == len(prompt) % PAGE
            await cache.drain()
            assert_drained(cache)


async def test_metrics_and_statistics() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE)
    async with HiCache(config, storage="memory://?capacity=16MiB") as cache:
        for prompt in _prompts(5, seed=1):
            await serve(cache, prompt, generator)
        await cache.drain()
        text = cache.metrics_text()
        assert "hicache_requests_total 5.0" in text
        assert "hicache_prefetch_wait_seconds_bucket" in text
        assert "hicache_storage_attached 1.0" in text
        stats = cache.statistics()
        assert stats.storage is not None
        assert stats.storage.backup is not None
        assert stats.storage.backup.written_pages > 0

        # OpenMetrics names a counter's family without `_total`: a gauge of that name clashes.
        families = [
            name.removesuffix("_total") if kind == "counter" else name
            for name, kind, _ in _families(cache)
        ]
        assert len(families) == len(set(families))
        assert "hicache_tier_tokens_device" in families
        prometheus_client = pytest.importorskip("prometheus_client")
        from prometheus_client.openmetrics.exposition import generate_latest
        from prometheus_client.openmetrics.parser import text_string_to_metric_families

        registry = prometheus_client.CollectorRegistry()
        registry.register(prometheus_collector(cache))
        parsed = list(text_string_to_metric_families(generate_latest(registry).decode()))
        assert {family.name for family in parsed} == set(families)


async def test_overlapping_prefetches_share_reads_and_both_complete() -> None:
    """A prefetch extending another's prefix waits for the shared pages, then reads its own."""
    config = _config(
        prefetch={"policy": "wait_complete", "threshold_tokens": PAGE, "batch_pages": 1}
    )
    generator = KVGenerator(config.layout, PAGE, seed=21)
    rng = np.random.default_rng(21)
    short = rng.integers(0, 5000, size=20 * PAGE)
    long = np.concatenate([short, rng.integers(0, 5000, size=10 * PAGE)])
    memory = MemoryStorage(capacity_bytes=64 << 20)
    async with memory:
        async with HiCache(config, storage=Unowned(memory)) as writer:
            await serve(writer, long, generator, prefetch=False)
            await writer.drain()
        gets_before = memory.stats().gets
        slow = FaultyStorage(Unowned(memory), latency_s=0.001)
        async with HiCache(config, storage=slow) as reader:
            first, second = await asyncio.gather(
                reader.prefetch(short, request_id="short"), reader.prefetch(long, request_id="long")
            )
            assert first.status is PrefetchStatus.COMPLETE
            assert second.status is PrefetchStatus.COMPLETE
            assert second.cached_tokens == len(long)
            assert memory.stats().gets - gets_before == len(long) // PAGE
            served = await serve(reader, long, generator, prefetch=False, check="all")
            assert served.host_tokens == len(long)
            await reader.drain()
            assert_drained(reader)


class GatedGets(Unowned):
    """A real backend whose gets, once done, wait for `gate` (None: they don't)."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate: asyncio.Future[None] | None = None
        self.get_started = asyncio.Event()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        outcomes = await self.inner.get(keys, into, namespace=namespace)
        self.get_started.set()
        if self.gate is not None:
            await self.gate
        return outcomes


async def _stored(memory: MemoryStorage, config: CacheConfig, prompts: list[np.ndarray]) -> None:
    generator = KVGenerator(config.layout, PAGE, seed=11)
    async with HiCache(config, storage=Unowned(memory)) as writer:
        for prompt in prompts:
            await serve(writer, prompt, generator, prefetch=False)
        await writer.drain()


async def test_prefetches_still_queued_at_a_detach_finish_cancelled() -> None:
    prefetch = {"policy": "wait_complete", "threshold_tokens": PAGE, "queue_size": 4}
    config = _config(prefetch={**prefetch, "workers": 1})
    prompts = [np.random.default_rng(40 + i).integers(0, 5000, size=4 * PAGE) for i in range(4)]
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory:
        await _stored(memory, config, prompts)
        gated = GatedGets(memory)
        gated.gate = asyncio.get_running_loop().create_future()  # the first get never returns
        async with HiCache(config, storage=gated) as cache:
            handles = [await cache.start_prefetch(p) for p in prompts]
            await gated.get_started.wait()  # one is reading, the others are queued
            link = cache._link
            assert link is not None
            assert link.prefetcher.statistics().queued == len(prompts) - 1
            await cache.detach_storage()
            results = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 10)
            assert {r.status for r in results} == {PrefetchStatus.CANCELLED}
            stats = link.prefetcher.statistics()
            assert (stats.cancelled, stats.queued) == (len(prompts), 0)
            assert_drained(cache)


class GatedExists(Unowned):
    """A real backend whose `exists` calls are counted and, while `gate` is set, wait for it;
    its gets wait for `get_gate` while that is set."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate: asyncio.Future[None] | None = None
        self.get_gate: asyncio.Future[None] | None = None
        self.calls = 0
        self.started = asyncio.Event()

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.calls += 1
        self.started.set()
        if self.gate is not None:
            await asyncio.shield(self.gate)  # a lookup cut short leaves the gate to the test
        return await self.inner.exists(keys)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        if self.get_gate is not None:
            await asyncio.shield(self.get_gate)
        return await self.inner.get(keys, into, namespace=namespace)


# A `timeout` policy's limit: 50 ms whatever the prompt's length.
_SHORT_LIMITS = {"timeout_base_s": 0.05, "timeout_per_1k_tokens_s": 0.0, "timeout_max_s": 0.05}


@contextlib.asynccontextmanager
async def _one_stuck_one_queued(
    prefetch: dict[str, object], *, seed: int
) -> AsyncIterator[tuple[HiCache, GatedExists, list[np.ndarray], PrefetchHandle, PrefetchHandle]]:
    """A cache whose one prefetch worker is stuck in `exists` (until `gated.gate` is set) on
    the first of three stored prompts, with the second queued in its one-slot queue."""
    base = {"threshold_tokens": PAGE, "queue_size": 1, "workers": 1, "io_timeout_s": 3600}
    config = _config(prefetch={**base, **prefetch})
    prompts = [np.random.default_rng(seed + i).integers(0, 5000, size=4 * PAGE) for i in range(3)]
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory:
        await _stored(memory, config, prompts)
        gated = GatedExists(memory)
        gated.gate = asyncio.get_running_loop().create_future()
        async with HiCache(config, storage=gated) as cache:
            stuck = await cache.start_prefetch(prompts[0])
            await gated.started.wait()
            queued = await cache.start_prefetch(prompts[1])
            yield cache, gated, prompts, stuck, queued


@pytest.mark.parametrize("policy", ["timeout", "best_effort"])
async def test_a_full_queue_bounds_the_wait_and_abandoned_prefetches_read_nothing(
    policy: str,
) -> None:
    # Storage hangs: one prefetch is stuck in `exists`, one waits in the one-slot queue. A
    # third caller must not wait for room past its policy's limit, and the queued one, whose
    # caller gave up meanwhile, must issue no call when its turn comes.
    async with _one_stuck_one_queued({"policy": policy, **_SHORT_LIMITS}, seed=60) as (
        cache,
        gated,
        prompts,
        stuck,
        queued,
    ):
        third = await asyncio.wait_for(cache.prefetch(prompts[2]), 10)
        assert third.status is PrefetchStatus.TERMINATED
        assert third.cached_tokens == 0
        # The callers give up, the queued one's first: the stuck one's lookup is cut short
        # then, and its worker would take a prefetch still queued.
        for handle in (queued, stuck):
            assert (await handle.ready()).cached_tokens == 0
        gated.gate.set_result(None)
        results = await asyncio.wait_for(asyncio.gather(stuck.wait(), queued.wait()), 10)
        assert {r.status for r in results} == {PrefetchStatus.TERMINATED}
        assert gated.calls == 1  # the queued prefetch read nothing
        link = cache._link
        assert link is not None
        stats = link.prefetcher.statistics()
        assert (stats.terminated, stats.queued, stats.skipped) == (3, 0, 0)
        assert stats.timeouts == (3 if policy == "timeout" else 0)
        assert_drained(cache)
        # Storage answers again: the same prompt is read in full.
        again = await cache.prefetch(prompts[2], policy="wait_complete")
        assert again.storage_tokens == len(prompts[2])


class TakenAsTheLimitPasses:
    """Stands in for the prefetch queue when it is full: the item sent is taken by a worker,
    which starts reading it, and the sender runs again only after its limit passed."""

    def __init__(self, link: StorageLink) -> None:
        self.link = link
        self.send_to_worker, self.worker_queue = anyio.create_memory_object_stream[PrefetchHandle](
            1
        )

    def send_nowait(self, handle: PrefetchHandle) -> None:
        raise anyio.WouldBlock

    async def send(self, handle: PrefetchHandle) -> None:
        self.send_to_worker.send_nowait(handle)
        await asyncio.sleep(3600)  # the worker starts it; the limit passes

    def release(self, handle: PrefetchHandle) -> None:
        """No slot to free: the item went straight to the worker."""


async def test_a_prefetch_a_worker_runs_as_its_submit_gives_up_stays_live() -> None:
    # Warmup waits while any live prefetch runs; one whose caller stopped waiting for room just
    # as a worker took it still reads into the host pool until that worker stops it.
    async with _one_stuck_one_queued({"policy": "timeout", **_SHORT_LIMITS}, seed=90) as (
        cache,
        gated,
        prompts,
        stuck,
        queued,
    ):
        link = cache._link
        assert link is not None
        prefetcher = link.prefetcher
        full = TakenAsTheLimitPasses(link)
        real_send, prefetcher._send = prefetcher._send, full  # type: ignore[assignment]
        worker = asyncio.ensure_future(prefetcher._work(full.worker_queue))
        # The third's lookup answers and its get waits: a terminate cuts a lookup short, but
        # lets a read in flight land.
        lookups = gated.gate
        assert lookups is not None
        gated.gate = None
        gated.get_gate = asyncio.get_running_loop().create_future()
        try:
            third = await asyncio.wait_for(cache.start_prefetch(prompts[2]), 10)
            assert third.status is PrefetchStatus.RUNNING  # in the (gated) get
            assert prefetcher._live == 3  # the stuck one, the queued one, and this one
            assert not prefetcher._quiet.is_set()
        finally:
            prefetcher._send = real_send
            lookups.set_result(None)
            gated.get_gate.set_result(None)
        await asyncio.wait_for(asyncio.gather(stuck.wait(), queued.wait(), third.wait()), 10)
        full.send_to_worker.close()
        await asyncio.wait_for(worker, 10)
        assert prefetcher._live == 0
        assert prefetcher._quiet.is_set()
        assert_drained(cache)


class Misbehaving(Unowned):
    """A real backend that breaks the protocol in one chosen way, as a buggy plugin might."""

    def __init__(self, inner: StorageBackend, fault: str) -> None:
        super().__init__(inner)
        self.fault = fault
        self.closed = False

    @property
    def capabilities(self) -> StorageCapabilities:
        caps = self.inner.capabilities
        if self.fault == "zero_batch":
            return StorageCapabilities(
                max_batch_pages=0, zero_copy=caps.zero_copy, shared=caps.shared, persistent=False
            )
        return caps

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        outcomes = await self.inner.get(keys, into, namespace=namespace)
        if self.fault == "short_get":
            return outcomes[:-1]
        if self.fault == "long_get":
            return [*outcomes, Outcome.OK]
        return outcomes

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        outcomes = await self.inner.put(keys, pages, metas)
        return outcomes[:-1] if self.fault == "short_put" else outcomes

    async def exists(self, keys: Sequence[bytes]) -> int:
        found = await self.inner.exists(keys)
        return len(keys) + 1 if self.fault == "long_exists" else found

    def stats(self) -> StorageStats:
        if self.fault == "stats":
            raise RuntimeError("stats broke")
        return self.inner.stats()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.closed = True
        if self.fault == "close":
            raise RuntimeError("close broke")


@pytest.mark.parametrize(
    "fault", ["short_put", "short_get", "long_get", "long_exists", "zero_batch", "stats", "close"]
)
async def test_a_backend_breaking_the_protocol_costs_misses_never_the_cache(fault: str) -> None:
    config = _config(write_policy="write_through", backup={"max_retries": 1})
    generator = KVGenerator(config.layout, PAGE, seed=11)  # as `_stored` writes them
    prompts = _prompts(6, seed=15)
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory:
        if fault in ("short_get", "long_get", "long_exists", "zero_batch"):
            await _stored(memory, config, prompts)
        backend = Misbehaving(memory, fault)
        async with HiCache(config, storage=backend) as cache:
            results = [
                await asyncio.wait_for(serve(cache, p, generator, check="all"), 10) for p in prompts
            ]
            await asyncio.wait_for(cache.drain(), 10)
            status = cache.storage_status()
            assert status.attached
            assert status.prefetch is not None
            assert status.backup is not None
            assert "hicache_prefetch_" in cache.metrics_text()
            storage_tokens = sum(r.storage_tokens for r in results)
            if fault == "short_put":
                assert status.backup.failed_pages > 0  # refused answers, counted, retried once
                assert status.backup.written_pages == 0
            elif fault in ("short_get", "long_get", "long_exists"):
                assert storage_tokens == 0  # a wrong answer lands nothing
                assert status.prefetch.errors > 0
            elif fault == "zero_batch":
                assert storage_tokens > 0  # read a page per call, and checked by serve()
                assert status.prefetch.errors == 0
            elif fault == "stats":
                assert status.storage is None
            await cache.detach_storage()
            assert backend.closed
            await cache.attach_storage(Unowned(memory))  # the cache goes on
            await asyncio.wait_for(serve(cache, prompts[0], generator, check="all"), 10)
            assert_drained(cache)


async def test_a_prefetch_cancelled_while_waiting_for_room_is_counted_once() -> None:
    async with _one_stuck_one_queued({"policy": "wait_complete"}, seed=70) as (
        cache,
        gated,
        prompts,
        stuck,
        queued,
    ):
        waiting = asyncio.ensure_future(cache.start_prefetch(prompts[2]))
        await asyncio.sleep(0.01)  # it waits for room
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gated.gate.set_result(None)
        await asyncio.wait_for(asyncio.gather(stuck.wait(), queued.wait()), 10)
        link = cache._link
        assert link is not None
        stats = link.prefetcher.statistics()
        assert stats.submitted == 3
        assert (stats.completed, stats.cancelled, stats.queued) == (2, 1, 0)
        assert stats.terminated + stats.skipped == 0
        assert_drained(cache)


class SlowAfterFirstGet(Unowned):
    """A real backend whose first `get` returns at once and whose later ones wait for `gate`."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.gets = 0

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        self.gets += 1
        if self.gets > 1:
            await self.gate
        return await self.inner.get(keys, into, namespace=namespace)


async def test_ready_reports_the_pages_that_landed_before_the_limit() -> None:
    prefetch = {
        "policy": "timeout",
        "threshold_tokens": PAGE,
        "batch_pages": 2,
        "timeout_base_s": 0.05,
        "timeout_per_1k_tokens_s": 0.0,
        "timeout_max_s": 0.05,
        "io_timeout_s": 3600,
    }
    config = _config(prefetch=prefetch)
    prompt = np.random.default_rng(80).integers(0, 5000, size=8 * PAGE)
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory:
        await _stored(memory, config, [prompt])
        slow = SlowAfterFirstGet(memory)
        async with HiCache(config, storage=slow) as cache:
            result = await cache.prefetch(prompt)  # the limit passes in the second batch
            assert result.status is PrefetchStatus.RUNNING
            assert result.storage_tokens == 2 * PAGE
            assert cache.match(prompt).host_tokens == 2 * PAGE
            slow.gate.set_result(None)
            link = cache._link
            assert link is not None
            await asyncio.wait_for(link.prefetcher.wait_quiet(), 10)
            assert_drained(cache)


@pytest.mark.parametrize("hanging", [False, True], ids=["idle", "cancelled"])
async def test_a_backend_whose_close_raises_when_the_cache_closes_logs_it_once(
    hanging: bool,
) -> None:
    # Cancelled: a backup hangs, so the close's flush passes its deadline and cancels the
    # workers; the close error must not replace that cancellation.
    config = _config(write_policy="write_through", backup={"flush_deadline_s": 0.05})
    generator = KVGenerator(config.layout, PAGE, seed=16)
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory:
        backend = HangingPuts(memory, "close") if hanging else Misbehaving(memory, "close")
        with structlog.testing.capture_logs() as logs:
            async with HiCache(config, storage=backend) as cache:
                await serve(cache, np.arange(2 * PAGE), generator, prefetch=False)
        events = [entry["event"] for entry in logs]
        assert backend.closed
        assert events.count("hicache.storage.close.failed") == 1
        assert "hicache.workers.failed" not in events


class _HeldExists(Unowned):
    """A real backend whose first `exists` calls wait for their gates; `on_call[n]` runs as
    call n (from 1) begins, before the call goes on."""

    def __init__(
        self,
        inner: StorageBackend,
        gates: list[asyncio.Future[None]],
        on_call: dict[int, Callable[[], None]],
    ) -> None:
        super().__init__(inner)
        self.gates = gates
        self.on_call = on_call
        self.calls = 0

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.calls += 1
        hook = self.on_call.get(self.calls)
        if hook is not None:
            hook()
            await asyncio.sleep(0)  # where a cancellation the hook caused lands
        if self.calls <= len(self.gates):
            await self.gates[self.calls - 1]
        return await self.inner.exists(keys)


async def test_a_submit_cancelled_as_a_worker_takes_its_prefetch_counts_it_once() -> None:
    # Two workers blocked, one prefetch queued, a fourth waiting for room. Both workers free
    # up in one tick: the first takes the queued one (moving the fourth into the queue and
    # waking its submit), the second takes the fourth and runs it before that submit resumes;
    # the submit is cancelled right then. The worker counts it; the submit must not as well.
    prefetch = {"policy": "wait_complete", "threshold_tokens": PAGE, "queue_size": 1}
    config = _config(prefetch={**prefetch, "workers": 2, "io_timeout_s": 3600})
    prompts = [np.random.default_rng(90 + i).integers(0, 5000, size=2 * PAGE) for i in range(4)]
    loop = asyncio.get_running_loop()
    gates: list[asyncio.Future[None]] = [loop.create_future(), loop.create_future()]
    both_held = asyncio.Event()
    raced: list[bool] = []
    memory = MemoryStorage(capacity_bytes=16 << 20)
    backend = _HeldExists(memory, gates, {2: both_held.set})
    async with memory, HiCache(config, storage=backend) as cache:
        link = cache._link
        assert link is not None
        await cache.start_prefetch(prompts[0])
        await cache.start_prefetch(prompts[1])
        await asyncio.wait_for(both_held.wait(), 10)
        await cache.start_prefetch(prompts[2])  # fills the queue
        fourth = asyncio.create_task(cache.start_prefetch(prompts[3]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not fourth.done()
        assert link.prefetcher.statistics().submitted == 4

        def cancel_fourth() -> None:
            raced.append(not fourth.done())
            fourth.cancel()

        backend.on_call[4] = cancel_fourth
        for gate in gates:
            gate.set_result(None)
        await asyncio.wait([fourth], timeout=10)
        await asyncio.wait_for(link.prefetcher.wait_quiet(), 10)
        stats = link.prefetcher.statistics()
    assert raced == [True]  # the fourth ran before its submit resumed
    assert fourth.cancelled()
    assert (stats.cancelled, stats.skipped) == (1, 3)  # the others found nothing stored
    assert stats.completed + stats.terminated + stats.skipped + stats.cancelled == 4


class _Started:
    """A task status for a task started without a task group."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def started(self, value: object = None) -> None:
        self.event.set()


async def test_a_cancelled_link_stays_cancelled_when_closing_its_backend_raises() -> None:
    # The cache's own close and detach end the workers through the link's scope, not by
    # cancelling its task: this cancels the task itself, which must end cancelled, neither
    # with the close error nor with a normal return that swallowed the cancellation.
    config = _config()
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory, HiCache(config) as cache:
        backend = Misbehaving(memory, "close")
        link = StorageLink(cache, backend, generation=1)
        started = _Started()
        task = asyncio.create_task(link.run(task_status=started))
        await asyncio.wait_for(started.event.wait(), 10)
        with structlog.testing.capture_logs() as logs:
            task.cancel()
            await asyncio.wait([task], timeout=10)
        assert task.cancelled()
        assert backend.closed
        assert [entry["event"] for entry in logs].count("hicache.storage.close.failed") == 1


class HangingPuts(Misbehaving):
    """A real backend whose puts never finish (and with `fault`, misbehaving so too)."""

    def __init__(self, inner: StorageBackend, fault: str = "") -> None:
        super().__init__(inner, fault)
        self.putting = asyncio.Event()

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        self.putting.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_flush_past_its_deadline_leaves_no_host_page_protected() -> None:
    config = _config(
        write_policy="write_through",
        backup={"batch_pages": 1, "queue_size": 8, "flush_deadline_s": 0.1, "io_timeout_s": 3600},
    )
    generator = KVGenerator(config.layout, PAGE, seed=12)
    rng = np.random.default_rng(12)
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory, HiCache(config, storage=HangingPuts(memory)) as cache:
        for _ in range(4):
            await serve(cache, rng.integers(0, 5000, size=2 * PAGE), generator, prefetch=False)
        await asyncio.sleep(0.05)
        status = cache.storage_status().backup
        assert status is not None
        assert status.queued > 0  # jobs wait behind the hanging put
        await cache.detach_storage(flush=True)  # gives up after 0.1 s
        await cache.drain()
        assert [n for n in cache.tree.iter_nodes() if n.host_ref] == []
        assert_drained(cache)


async def test_a_detach_without_flush_cancels_the_write_in_progress_at_once() -> None:
    # The deadline is an hour: only a detach that waits for it runs into the test's bound.
    config = _config(backup={"flush_deadline_s": 3600, "io_timeout_s": 3600})
    generator = KVGenerator(config.layout, PAGE, seed=16)
    memory = MemoryStorage(capacity_bytes=16 << 20)
    hanging = HangingPuts(memory)
    async with memory, HiCache(config, storage=hanging) as cache:
        prompt = np.random.default_rng(16).integers(0, 5000, size=2 * PAGE)
        await serve(cache, prompt, generator, prefetch=False)
        await asyncio.wait_for(hanging.putting.wait(), 30)
        await asyncio.wait_for(cache.detach_storage(flush=False), 30)
        assert not cache.storage_status().attached
        assert [n for n in cache.tree.iter_nodes() if n.host_ref or n.in_storage] == []
        assert_drained(cache)


async def test_a_prefetch_landing_after_a_detach_marks_nothing_in_storage() -> None:
    config = _config()
    prompt = np.random.default_rng(13).integers(0, 5000, size=8 * PAGE)
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory:
        await _stored(memory, config, [prompt])
        gated = GatedGets(memory)
        gated.gate = asyncio.get_running_loop().create_future()
        async with HiCache(config, storage=gated) as cache:
            handle = await cache.start_prefetch(prompt)
            await gated.get_started.wait()
            gated.gate.set_result(None)  # the get has its bytes: nothing cancels it any more
            await cache.detach_storage()
            result = await handle.wait()
            assert result.status is PrefetchStatus.COMPLETE
            assert result.storage_tokens == len(prompt)  # the pages are good and landed
            assert cache.statistics().tree.storage_pages == 0  # but no storage holds them now
            assert_drained(cache)


def _prefetches_add_up(link: StorageLink) -> None:
    """Once no prefetch runs: each one submitted is counted in exactly one outcome, or queued."""
    stats = link.prefetcher.statistics()
    outcomes = stats.completed + stats.terminated + stats.cancelled + stats.skipped
    assert stats.submitted == outcomes + stats.queued, stats


async def test_cancelling_a_queued_prefetch_frees_its_slot_for_a_new_arrival() -> None:
    # One worker stuck on a stored prompt, the next one queued in the one-slot queue. The
    # request behind the queued prefetch is aborted: its slot must be free at once, so the
    # next arrival (timeout policy) is queued rather than turned away, and loads every page.
    async with _one_stuck_one_queued({"policy": "timeout", **_SHORT_LIMITS}, seed=100) as (
        cache,
        gated,
        prompts,
        stuck,
        queued,
    ):
        link = cache._link
        assert link is not None
        queued.cancel()
        assert (queued.status, queued.done()) == (PrefetchStatus.CANCELLED, True)
        assert (await asyncio.wait_for(queued.wait(), 10)).status is PrefetchStatus.CANCELLED
        assert link.prefetcher.statistics().queued == 0
        arrival = await asyncio.wait_for(cache.start_prefetch(prompts[2]), 10)
        assert (arrival.status, arrival.done()) == (PrefetchStatus.QUEUED, False)
        gated.gate.set_result(None)
        result = await asyncio.wait_for(arrival.wait(), 10)
        assert result.status is PrefetchStatus.COMPLETE
        assert result.storage_tokens == len(prompts[2])
        await asyncio.wait_for(stuck.wait(), 10)
        assert gated.calls == 2  # the cancelled prefetch asked storage nothing
        generator = KVGenerator(cache.config.layout, PAGE, seed=11)  # as `_stored` wrote them
        served = await serve(cache, prompts[2], generator, prefetch=False, check="all")
        assert served.host_tokens == len(prompts[2])  # and every loaded page checked
        stats = link.prefetcher.statistics()
        assert (stats.submitted, stats.completed, stats.cancelled) == (3, 2, 1)
        assert (stats.terminated, stats.timeouts, stats.queued) == (0, 0, 0)
        _prefetches_add_up(link)
        await cache.drain()
        assert_drained(cache)


@pytest.mark.parametrize("policy", ["timeout", "best_effort"])
async def test_ready_giving_up_on_a_queued_prefetch_finishes_it_at_once(policy: str) -> None:
    async with _one_stuck_one_queued({"policy": policy, **_SHORT_LIMITS}, seed=110) as (
        cache,
        gated,
        prompts,
        stuck,
        queued,
    ):
        link = cache._link
        assert link is not None
        result = await asyncio.wait_for(queued.ready(), 10)
        assert result.status is PrefetchStatus.TERMINATED
        assert result.cached_tokens == 0
        assert queued.done()
        stats = link.prefetcher.statistics()
        assert (stats.terminated, stats.queued) == (1, 0)
        assert stats.timeouts == (1 if policy == "timeout" else 0)
        arrival = await asyncio.wait_for(cache.start_prefetch(prompts[2]), 10)
        assert arrival.status is PrefetchStatus.QUEUED  # the slot was free
        gated.gate.set_result(None)
        finals = await asyncio.wait_for(asyncio.gather(stuck.wait(), arrival.wait()), 10)
        assert {r.status for r in finals} == {PrefetchStatus.COMPLETE}
        assert gated.calls == 2  # the prefetch given up asked storage nothing
        stats = link.prefetcher.statistics()
        assert (stats.completed, stats.terminated, stats.cancelled) == (2, 1, 0)
        _prefetches_add_up(link)
        assert_drained(cache)


@pytest.mark.parametrize("how", ["cancel", "terminate"])
async def test_a_prefetch_given_up_as_the_worker_dequeues_it_is_counted_once(how: str) -> None:
    # The idle worker waits on the queue, so the prefetch is handed straight to it; the
    # caller gives it up before the worker runs again.
    config = _config(prefetch={"policy": "wait_complete", "threshold_tokens": PAGE, "workers": 1})
    prompt = np.random.default_rng(120).integers(0, 5000, size=4 * PAGE)
    memory = MemoryStorage(capacity_bytes=16 << 20)
    async with memory:
        await _stored(memory, config, [prompt])
        backend = GatedExists(memory)
        async with HiCache(config, storage=backend) as cache:
            link = cache._link
            assert link is not None
            receive = link.prefetcher._receive
            await _until(lambda: receive.statistics().tasks_waiting_receive == 1)
            handle = await cache.start_prefetch(prompt)
            # In the worker's hands: not in the stream's buffer, and not yet running.
            assert receive.statistics().current_buffer_used == 0
            assert handle.status is PrefetchStatus.QUEUED
            handle.cancel() if how == "cancel" else handle.terminate()
            expected = PrefetchStatus.CANCELLED if how == "cancel" else PrefetchStatus.TERMINATED
            assert (handle.status, handle.done()) == (expected, True)
            assert link.prefetcher.statistics().queued == 0
            await asyncio.wait_for(link.prefetcher.wait_quiet(), 10)
            # Waiting again: it has taken the prefetch and skipped it.
            await _until(lambda: receive.statistics().tasks_waiting_receive == 1)
            assert handle.status is expected
            stats = link.prefetcher.statistics()
            assert (stats.submitted, stats.cancelled + stats.terminated, stats.completed) == (
                1,
                1,
                0,
            )
            _prefetches_add_up(link)
            assert backend.calls == 0
            again = await asyncio.wait_for(cache.prefetch(prompt), 10)  # the worker goes on
            assert again.storage_tokens == len(prompt)
            assert_drained(cache)


async def test_many_queued_prefetches_cancelled_in_a_row_keep_the_queue_small() -> None:
    # While the worker is stuck, every arrival is cancelled at once (its request aborted).
    # Each frees its slot, and the entries they leave in the stream are dropped as they pile
    # up, so neither the wait for room nor the memory held grows with their number.
    size = 4
    async with _one_stuck_one_queued({"policy": "wait_complete", "queue_size": size}, seed=130) as (
        cache,
        gated,
        prompts,
        stuck,
        queued,
    ):
        link = cache._link
        assert link is not None
        queue = link.prefetcher._send
        most = 0
        for _ in range(500):
            handle = await asyncio.wait_for(cache.start_prefetch(prompts[2]), 10)
            handle.cancel()
            assert handle.status is PrefetchStatus.CANCELLED
            most = max(most, queue._stream.statistics().current_buffer_used)
        assert most <= 2 * size + 1
        assert link.prefetcher.statistics().queued == 1  # the one queued before
        gated.gate.set_result(None)
        await asyncio.wait_for(asyncio.gather(stuck.wait(), queued.wait()), 10)
        await asyncio.wait_for(link.prefetcher.wait_quiet(), 10)
        stats = link.prefetcher.statistics()
        assert (stats.submitted, stats.completed, stats.cancelled) == (502, 2, 500)
        _prefetches_add_up(link)
        assert gated.calls == 2
        assert_drained(cache)
