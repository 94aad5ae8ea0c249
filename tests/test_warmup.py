"""Warmup from a shared store's manifest into a cold host pool."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Hashable, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from _unowned_storage import Unowned
from structlog.testing import capture_logs

from hicache_async import CacheConfig, HiCache, StorageError
from hicache_async.storage import FileStorage, MemoryStorage, _manifest
from hicache_async.storage._manifest import (
    FileManifest,
    ManifestCollector,
    ManifestEntry,
    ManifestLimits,
    ManifestRead,
    MemoryManifest,
    chain_entry,
    decode_entry,
    encode_entry,
)
from hicache_async.testing import KVGenerator, serve
from hicache_async.workers import WarmupStatus
from hicache_async.workers._prefetch import PrefetchHandle

PAGE = 4


def _config(**overrides: object) -> CacheConfig:
    base: dict[str, object] = {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
        "page_size": PAGE,
        "device_pages": 64,
        "host_pages": 256,
        "model_id": "warmup-test",
        "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
        "backup": {"retry_backoff_s": 0.001},
    }
    base.update(overrides)
    return CacheConfig.from_dict(base)


def _prompts(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 50_000, size=int(rng.integers(3 * PAGE, 12 * PAGE))) for _ in range(count)
    ]


async def _fill(root: Path, prompts: list[np.ndarray], *, pinned: int | None = None) -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with HiCache(config, storage=FileStorage(root)) as cache:
        for i, prompt in enumerate(prompts):
            with cache.request(prompt, priority=10 if i == pinned else 0) as req:
                await req.load()
                pages = await req.allocate(len(prompt) - req.cached_tokens)
                first = req.cached_tokens // PAGE
                for offset, page in enumerate(pages[: len(prompt) // PAGE - first]):
                    generator.fill_page(cache.device_pool, page, prompt, first + offset)
                req.commit()
        await cache.drain()


async def test_cold_instance_warms_up_and_serves_from_host(tmp_path: Path) -> None:
    prompts = _prompts(12, seed=1)
    await _fill(tmp_path, prompts)
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=1.0)
        assert result.status is WarmupStatus.COMPLETE
        assert result.entries_read >= len(prompts)
        assert result.pages_loaded == sum(len(p) // PAGE for p in prompts)
        for prompt in prompts:
            served = await serve(cache, prompt, generator, prefetch=False, check="all")
            assert served.host_tokens == len(prompt) // PAGE * PAGE
        await cache.drain()
        for node in cache.tree.iter_nodes():
            assert node.lock_ref == 0
            assert node.host_ref == 0


async def test_entries_whose_pages_are_gone_are_counted_missed(tmp_path: Path) -> None:
    prompts = _prompts(6, seed=3)
    await _fill(tmp_path, prompts)
    config = _config()
    async with HiCache(config) as keyer:
        gone = [keyer.namespace.storage_keys(keyer.keys_for(p))[-1] for p in prompts[:2]]
    async with FileStorage(tmp_path) as storage:
        assert await storage.delete(gone) == 2
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=1.0)
        assert result.status is WarmupStatus.COMPLETE
        assert result.entries_missed == 2
        assert result.entries_loaded == result.entries_agreed  # their other pages did land
        for prompt in prompts[2:]:
            assert cache.match(prompt).host_tokens == len(prompt) // PAGE * PAGE


async def test_budget_takes_pinned_prefixes_first_and_keeps_priority(tmp_path: Path) -> None:
    prompts = _prompts(12, seed=2)
    await _fill(tmp_path, prompts, pinned=3)
    config = _config()
    pinned_pages = len(prompts[3]) // PAGE
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        ratio = pinned_pages / config.resolved_host_pages
        result = await cache.warmup(ratio=ratio)
        assert result.status is WarmupStatus.BUDGET
        assert result.entries_loaded == 1
        info = cache.match(prompts[3])
        assert info.host_tokens == pinned_pages * PAGE
        assert all(node.priority == 10 for node in cache.tree.iter_nodes())


async def test_warmup_without_storage_or_manifest() -> None:
    async with HiCache(_config()) as cache:
        assert (await cache.warmup()).status is WarmupStatus.NO_STORAGE


@pytest.mark.parametrize("damage", ["directory", "symlink", "nested"])
async def test_a_manifest_that_cannot_be_read_means_no_warmup(tmp_path: Path, damage: str) -> None:
    prompts = _prompts(2, seed=9)
    await _fill(tmp_path, prompts)
    path = tmp_path / "manifest.jsonl"
    if damage == "nested":
        # Deep nesting in an unknown field: the decoder recurses, well within a record's size.
        line = path.read_bytes().splitlines()[0]
        assert line.endswith(b"}")
        with path.open("ab") as f:
            f.write(line[:-1] + b',"x":' + b"[" * 1200 + b"]" * 1200 + b"}\n")
    else:
        path.unlink()
        if damage == "directory":
            path.mkdir()
        else:
            (tmp_path / "elsewhere.jsonl").write_bytes(b"")
            path.symlink_to(tmp_path / "elsewhere.jsonl")
    async with HiCache(_config(), storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=1.0)
        if damage == "nested":  # that record alone is skipped as malformed
            assert result.status is WarmupStatus.COMPLETE
            assert result.pages_loaded == sum(len(p) // PAGE for p in prompts)
        else:
            # A storage fault, told apart from a detach or the close (STOPPED).
            assert result.status is WarmupStatus.MANIFEST_FAILED
            assert result.status.value == "manifest_failed"
            assert result.pages_loaded == 0
        served = await serve(cache, prompts[0], KVGenerator(_config().layout, PAGE, seed=5))
        assert served.computed_tokens < len(prompts[0])  # storage still serves the pages


class _ClosingManifestStorage(FileStorage):
    """A file store whose manifest read waits for `gate`, then fails as a read of a closed
    backend does."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reading = asyncio.Event()
        self.gate = asyncio.Event()

    def manifest(self, limits: ManifestLimits | None = None) -> FileManifest:
        reading, gate = self.reading, self.gate

        class Closing(FileManifest):
            async def read(self, *, namespace: str | None = None) -> ManifestRead:
                reading.set()
                await gate.wait()
                raise StorageError("the backend is closed")

        return Closing(self.root / "manifest.jsonl", limits)


async def test_a_manifest_read_failed_by_a_detach_reports_stopped(tmp_path: Path) -> None:
    await _fill(tmp_path, _prompts(2, seed=23))
    storage = _ClosingManifestStorage(tmp_path)
    async with HiCache(_config(), storage=storage) as cache:
        warm = asyncio.create_task(cache.warmup(ratio=1.0))
        await asyncio.wait_for(storage.reading.wait(), 30)
        await cache.detach_storage()
        storage.gate.set()
        result = await asyncio.wait_for(warm, 30)
        assert result.status is WarmupStatus.STOPPED
        assert result.pages_loaded == 0


async def test_warmup_stops_on_detach_and_on_cancel(tmp_path: Path) -> None:
    prompts = _prompts(30, seed=3)
    await _fill(tmp_path, prompts)
    async with HiCache(_config(), storage=FileStorage(tmp_path)) as cache:
        task = asyncio.create_task(cache.warmup(ratio=1.0))
        await asyncio.sleep(0)
        await cache.detach_storage()
        result = await task
        assert result.status in (WarmupStatus.STOPPED, WarmupStatus.COMPLETE)
        await cache.attach_storage(f"file://{tmp_path}")
        task = asyncio.create_task(cache.warmup(ratio=1.0))
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await cache.drain()
        for node in cache.tree.iter_nodes():
            assert node.lock_ref == 0
            assert node.host_ref == 0
        cache.tree.check_invariants()


async def test_manifest_is_bounded_validated_and_compacted(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    limits = ManifestLimits(max_entries=5, max_entry_bytes=4096, max_bytes=1 << 20)
    manifest = FileManifest(path, limits)
    namespace = bytes(range(16))
    entries = [
        chain_entry(namespace, [bytes([i, j]) * 16 for j in range(3)], 3 * PAGE, i % 3, float(i))
        for i in range(20)
    ]
    await manifest.append(entries)
    # A record of a newer version (99) is no damage: skipped, counted apart, kept.
    newer_version = json.dumps(
        {"namespace": "00" * 16, "keys": ["ab" * 32], "num_tokens": 4, "v": 99}
    ).encode()
    with path.open("ab") as f:
        f.write(b"not json\n")
        f.write(b'{"namespace": "zz", "keys": [], "num_tokens": -1}\n')
        f.write(b"x" * 10_000 + b"\n")
        f.write(newer_version + b"\n")
    read = await manifest.read(namespace=namespace.hex())
    assert len(read.entries) == 5
    assert (read.malformed, read.newer) == (2, 1)
    assert read.oversized == 1
    assert [e.priority for e in read.entries] == sorted(
        (e.priority for e in read.entries), reverse=True
    )
    report = await manifest.compact()
    assert report.entries_after == 6  # five entries of `namespace`, and the newer record
    assert report.bytes_after < report.bytes_before
    kept = path.read_bytes().splitlines()
    assert newer_version in kept
    assert all(decode_entry(line) is not None for line in kept if line != newer_version)
    # A later record for the same chain replaces the earlier one.
    newer = chain_entry(namespace, [bytes.fromhex(k) for k in read.entries[0].keys], 12, 9, 1e6)
    await manifest.append([newer])
    again = await manifest.read(namespace=namespace.hex())
    assert again.entries[0].priority == 9
    assert len([e for e in again.entries if e.chain_id == newer.chain_id]) == 1


def _chain(namespace: bytes, i: int, *, priority: int = 0, last_use: float = 0.0) -> ManifestEntry:
    """Chain `i`: 25 page keys, as a 100-token prefix of 4-token pages would have."""
    keys = [hashlib.sha256(b"%d:%d" % (i, j)).digest() for j in range(25)]
    return chain_entry(namespace, keys, 25 * PAGE, priority, last_use)


async def test_a_memory_manifest_holds_a_bounded_number_of_records() -> None:
    limits = ManifestLimits(max_entries=16)
    manifest = MemoryStorage().manifest(limits)
    namespace = bytes(range(16))
    written = [_chain(namespace, i, priority=i % 4, last_use=float(i)) for i in range(5 * 16)]
    for item in written:
        await manifest.append([item])
    read = await manifest.read(namespace=namespace.hex())
    assert read.entries == sorted(written, key=lambda e: (-e.priority, -e.last_use))[:16]
    # What it held: trimmed on the way, never more than twice the entries a read keeps.
    report = await manifest.compact()
    record = max(len(encode_entry(e)) for e in written)
    assert report.records_before == len(written)
    assert report.bytes_before <= 2 * limits.max_entries * record
    assert report.entries_after == 16
    assert report.bytes_after == sum(len(encode_entry(e)) for e in read.entries)
    assert (await manifest.read(namespace=namespace.hex())).entries == read.entries


async def test_a_busy_namespace_never_takes_a_quiet_ones_place_in_a_memory_manifest() -> None:
    # `max_entries` counted all namespaces together: the busy one's newer chains pushed the
    # quiet one's out at the first trim, where compaction keeps `max_entries` of each.
    limits = ManifestLimits(max_entries=8)
    manifest = MemoryStorage().manifest(limits)
    quiet, busy = bytes(range(16)), bytes(range(16, 32))
    kept = [_chain(quiet, i, last_use=float(i)) for i in range(3)]
    for item in kept:
        await manifest.append([item])
    for i in range(10 * limits.max_entries):
        await manifest.append([_chain(busy, 100 + i, priority=5, last_use=1000.0 + i)])
    read = await manifest.read(namespace=quiet.hex())
    assert read.entries == kept[::-1]
    busy_read = await manifest.read(namespace=busy.hex())
    assert len(busy_read.entries) == limits.max_entries
    assert [e.last_use for e in busy_read.entries] == [
        1000.0 + i for i in reversed(range(9 * limits.max_entries, 10 * limits.max_entries))
    ]
    # Each namespace stays within twice its bound between trims, and a compaction keeps
    # what the trims kept.
    report = await manifest.compact()
    assert report.records_before == 3 + 10 * limits.max_entries
    assert report.bytes_before <= (3 + 2 * limits.max_entries) * len(encode_entry(kept[0]))
    assert (await manifest.read(namespace=quiet.hex())).entries == kept[::-1]


async def test_a_memory_manifest_trim_ranks_a_record_stamped_far_ahead_as_never_used() -> None:
    # The trim on append kept it as the newest of all, in place of a chain used since; one
    # stamped a minute ahead ranks as now.
    limits = ManifestLimits(max_entries=8)
    manifest = MemoryManifest(limits)
    namespace = bytes(range(16))
    now = time.time()
    far = _chain(namespace, 1_000, last_use=now + 86_400)
    near = _chain(namespace, 1_001, last_use=now + 60)
    await manifest.append([far, near])
    since = [_chain(namespace, i, last_use=now - 100 + i) for i in range(2 * 8 - 2)]
    await manifest.append(since)
    held = [ident for ident, _ in manifest._held.items()]
    assert held == [near.ident] + [e.ident for e in since[-7:]]


def test_a_compaction_of_records_stamped_ahead_in_many_namespaces_costs_linear_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With `carry` each namespace keeps `max_entries`: ranking must not pass over every
    # record held at each record fed (10,000 records once took a minute).
    ranks = 0
    ranked_use = _manifest._ranked_use

    def counted(use: float, now: float) -> tuple[float, float]:
        nonlocal ranks
        ranks += 1
        return ranked_use(use, now)

    monkeypatch.setattr(_manifest, "_ranked_use", counted)
    collector = ManifestCollector(ManifestLimits(max_entries=50), carry=True)
    now = time.time()
    records = 4_000
    for i in range(records):
        use = now + 86_400 + i if i % 2 == 0 else now - 1_000 + i / 1_000
        collector.add_entry(_chain(bytes([i % 8]) * 16, i, last_use=use))
    assert len(collector.result(truncated=False).entries) == 8 * 50
    assert ranks < 5 * records


@pytest.mark.parametrize("seed", range(3))
def test_oldest_and_newest_first_reads_keep_the_same_chains_with_records_stamped_ahead(
    seed: int,
) -> None:
    # A file manifest is read oldest first, Redis and Mooncake newest first: with records
    # stamped ahead ranked by the records stored after them, a third of such sets of records
    # kept different chains depending on the order.
    rng = np.random.default_rng(seed)
    now = time.time()
    namespace = bytes(range(16))
    offsets = [-100.0, -50.0, 0.5, 100.0, 1_000.0, 86_400.0]
    for _ in range(100):
        chains = rng.integers(16, size=int(rng.integers(2, 41)))
        records = [
            _chain(
                namespace,
                int(chain),
                priority=int(chain) % 3 // 2,  # a chain's priority does not change
                last_use=now + offsets[int(rng.integers(len(offsets)))] + float(rng.random()),
            )
            for chain in chains
        ]
        limits = ManifestLimits(max_entries=int(rng.integers(1, 9)))
        oldest_first = ManifestCollector(limits)
        for record in records:
            oldest_first.add_entry(record)
        newest_first = ManifestCollector(limits, newest_first=True)
        for record in reversed(records):
            newest_first.add_entry(record)
        read = oldest_first.result(truncated=False)
        assert read.entries == newest_first.result(truncated=False).entries
        # A chain's record stamped far ahead never hides a later one of it.
        for e in read.entries:
            later = [r.last_use for r in records if r.ident == e.ident and r.last_use <= now + 300]
            if later:
                assert e.last_use == max(later)


@pytest.mark.parametrize("seed", range(3))
async def test_every_reader_keeps_the_same_chains_of_equal_stamps(seed: int) -> None:
    # Chains whose records share a stamp (a record without `last_use`, a newer version's
    # that holds none this version reads, one stamp copied) tie: the one held longest made
    # way first, which is the first stored when read oldest first and the last when read
    # newest first, so file, Redis and memory:// readers, and a read after a compaction,
    # kept different chains.
    rng = np.random.default_rng(seed)
    namespace = bytes(range(16))
    for _ in range(100):
        chains = rng.integers(12, size=int(rng.integers(2, 31)))
        records = [
            _chain(namespace, int(chain), last_use=float(rng.integers(3)) * 100.0)
            for chain in chains
        ]
        limits = ManifestLimits(max_entries=int(rng.integers(1, 6)))
        lines = [encode_entry(record)[:-1] for record in records]
        oldest_first = ManifestCollector(limits)
        oldest_first.add_lines(lines)
        read = oldest_first.result(truncated=False)
        newest_first = ManifestCollector(limits, newest_first=True)
        newest_first.add_lines(lines[::-1])
        assert newest_first.result(truncated=False).entries == read.entries
        for newest in (False, True):
            compaction = ManifestCollector(limits, newest_first=newest, carry=True)
            compaction.add_lines(lines[::-1] if newest else lines)
            rewritten = [line for _, line in compaction.compacted(limits.max_bytes // 2)]
            after = ManifestCollector(limits, newest_first=True)
            after.add_lines(rewritten[::-1])
            assert after.result(truncated=False).entries == read.entries
        memory = MemoryManifest(limits)
        await memory.append(records)
        assert (await memory.read()).entries == read.entries
        await memory.compact()
        assert (await memory.read()).entries == read.entries


async def test_a_newer_memory_manifest_record_replaces_the_older() -> None:
    manifest = MemoryManifest()
    namespace = bytes(range(16))
    for i in range(500):
        await manifest.append([_chain(namespace, 7, priority=i % 3, last_use=float(i))])
    await manifest.append([_chain(namespace, 7, priority=9, last_use=-1.0)])  # older: ignored
    read = await manifest.read()
    assert [(e.priority, e.last_use) for e in read.entries] == [(499 % 3, 499.0)]
    report = await manifest.compact()
    assert report.records_before == 501
    assert report.bytes_before == report.bytes_after == len(encode_entry(read.entries[0]))


async def test_a_memory_manifest_costs_memory_by_its_entries_not_its_appends() -> None:
    limits = ManifestLimits(max_entries=20)
    manifest = MemoryManifest(limits)
    namespace = bytes(range(16))
    record = len(encode_entry(_chain(namespace, 0)))
    appends = 50 * limits.max_entries
    # The first append's one-time costs (lazy imports, the loop's first checkpoint) aside.
    await manifest.append([_chain(bytes(16), 0)])
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for i in range(appends):
            await manifest.append([_chain(namespace, i, last_use=float(i))])
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # At most 2 * max_entries records, with room for their bookkeeping: a tenth of what
    # keeping every appended record would take.
    assert after - before < appends * record // 10
    read = await manifest.read(namespace=namespace.hex())
    newest = reversed(range(appends - limits.max_entries, appends))
    assert [e.last_use for e in read.entries] == [float(i) for i in newest]


async def test_an_append_after_a_torn_last_line_is_kept(tmp_path: Path) -> None:
    # A writer killed mid-write leaves a line without its newline: only that record is lost.
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    namespace = bytes(range(16))
    first, second = (chain_entry(namespace, [bytes([i]) * 32], PAGE, 0, float(i)) for i in range(2))
    await manifest.append([first])
    with path.open("ab") as f:
        f.write(b'{"namespace": "torn')
    await manifest.append([second])
    read = await manifest.read(namespace=namespace.hex())
    assert {e.chain_id for e in read.entries} == {first.chain_id, second.chain_id}
    assert read.malformed == 1


async def test_compaction_removes_temporary_files_of_compactions_that_died(
    tmp_path: Path,
) -> None:
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    await manifest.append([chain_entry(bytes(16), [bytes(32)], PAGE, 0, 1.0)])
    leftover = tmp_path / ".manifest.jsonl.4242.tmp"
    leftover.write_bytes(b"half a compaction")
    unrelated = tmp_path / ".other.4242.tmp"
    unrelated.write_bytes(b"not ours")
    await manifest.compact()
    assert not leftover.exists()
    assert unrelated.exists()
    assert len((await manifest.read()).entries) == 1


@contextlib.asynccontextmanager
async def _fifo_guard(*fifos: Path, seconds: float = 10.0) -> AsyncIterator[None]:
    """A wall bound on code that might block opening a FIFO, so that it fails the test instead
    of hanging it: at the bound each FIFO is opened at both ends, which lets an open blocked on
    a thread go on, and the block fails with TimeoutError soon after."""

    async def release() -> None:
        await anyio.sleep(seconds)
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(release)
        with anyio.fail_after(2 * seconds):
            yield
        tasks.cancel_scope.cancel()


def _refused(name: str) -> pytest.RaisesExc[StorageError]:
    return pytest.raises(StorageError, match=f"/{name} is a FIFO, not a regular file; remove it")


@pytest.mark.parametrize("planted", ["manifest.jsonl", ".manifest.jsonl.lock"])
async def test_a_fifo_in_place_of_a_manifest_file_is_refused_without_blocking(
    tmp_path: Path, planted: str
) -> None:
    # Opening a FIFO blocks until its other end is opened, and a thread blocked in open()
    # cannot be cancelled: the manifest opens its files non-blocking and refuses all but
    # regular files.
    fifo = tmp_path / planted
    os.mkfifo(fifo, 0o600)
    manifest = FileManifest(tmp_path / "manifest.jsonl")
    entry = chain_entry(bytes(16), [bytes(32)], PAGE, 0, 1.0)
    async with _fifo_guard(fifo):
        with _refused(planted):
            await manifest.append([entry])
        with _refused(planted):
            await manifest.compact()
        if planted == "manifest.jsonl":
            with _refused(planted):
                await manifest.read()
        else:  # reads take no lock
            assert (await manifest.read()).entries == []
    assert stat.S_ISFIFO(fifo.lstat().st_mode)  # left for whoever planted it
    fifo.unlink()
    await manifest.append([entry])
    assert [e.chain_id for e in (await manifest.read()).entries] == [entry.chain_id]


async def test_a_fifo_for_the_manifest_costs_only_warmup_and_manifest_entries(
    tmp_path: Path,
) -> None:
    # Planted by anyone who can write the root: warmup reads nothing, backups store their
    # pages and log their failed appends, and drain, detach and close finish.
    async with FileStorage(tmp_path):
        pass
    fifo = tmp_path / "manifest.jsonl"
    os.mkfifo(fifo, 0o600)
    prompts = _prompts(3, seed=4)
    generator = KVGenerator(_config().layout, PAGE, seed=5)
    with capture_logs() as logs:
        async with _fifo_guard(fifo), HiCache(_config(), storage=FileStorage(tmp_path)) as cache:
            result = await cache.warmup(ratio=1.0)
            assert (result.status, result.pages_loaded) == (WarmupStatus.MANIFEST_FAILED, 0)
            for prompt in prompts:
                await serve(cache, prompt, generator)
            await cache.drain()
            await cache.detach_storage(flush=True)
    failures = [e for e in logs if e["event"].startswith("hicache.") and "failed" in e["event"]]
    assert {e["event"] for e in failures} == {
        "hicache.warmup.manifest.failed",
        "hicache.manifest.append.failed",
    }
    assert all("a FIFO, not a regular file" in e["error"] for e in failures)
    async with FileStorage(tmp_path) as storage:
        assert storage.stats().pages == sum(len(p) // PAGE for p in prompts)


async def test_an_append_gives_up_at_its_deadline_while_another_holds_the_lock(
    tmp_path: Path,
) -> None:
    # Another process's compaction holds the lock for as long as it takes: an append under a
    # deadline (the backup worker's io_timeout_s) gives up at it, having written nothing.
    manifest = FileManifest(tmp_path / "manifest.jsonl")
    first, second, third = (chain_entry(bytes(16), [bytes([i]) * 32], PAGE, 0, i) for i in range(3))
    await manifest.append([first])
    # An open file description of its own, as another process's: flock is per description.
    holder = os.open(tmp_path / ".manifest.jsonl.lock", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        released = anyio.Event()

        async def release_at_the_wall_bound() -> None:  # a hang guard only
            await anyio.sleep(10)
            released.set()
            fcntl.flock(holder, fcntl.LOCK_UN)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(release_at_the_wall_bound)
            with pytest.raises(TimeoutError), anyio.fail_after(0.5):
                await manifest.append([second])
            assert not released.is_set(), "the append waited for the lock past its deadline"
            assert (await manifest.read()).entries == [first]
            tasks.cancel_scope.cancel()
    finally:
        os.close(holder)
    with anyio.fail_after(10):  # the lock is free again: nothing kept it
        await manifest.append([third])
        await manifest.compact()
    assert sorted(e.last_use for e in (await manifest.read()).entries) == [0.0, 2.0]


async def test_an_append_given_up_mid_write_writes_nothing_after_and_then_unlocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stalled filesystem, as the gate stands for: the append's thread cannot be stopped,
    # so the caller stops waiting for it. The thread keeps the lock until it ends (a
    # compaction must not replace the file under its write), then writes nothing, since
    # the caller was told the append failed, and releases the lock.
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    first, second = (chain_entry(bytes(16), [bytes([i]) * 32], PAGE, 0, i) for i in range(2))
    await manifest.append([first])
    reached, go = threading.Event(), threading.Event()
    append_records = _manifest._append_records

    def stalled(*args: Any) -> int:
        reached.set()
        assert go.wait(10), "the caller waited for the stalled write"
        return append_records(*args)

    monkeypatch.setattr(_manifest, "_append_records", stalled)
    with pytest.raises(TimeoutError), anyio.fail_after(0.5):
        await manifest.append([second])
    assert reached.is_set()
    lock = os.open(tmp_path / ".manifest.jsonl.lock", os.O_RDWR | os.O_CLOEXEC)
    try:
        with pytest.raises(BlockingIOError):  # still the stalled thread's
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        go.set()
        with anyio.fail_after(10):  # the thread ends and releases it
            while True:
                with contextlib.suppress(BlockingIOError):
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                await anyio.sleep(0.01)
    finally:
        os.close(lock)
    assert (await manifest.read()).entries == [first]
    assert path.read_bytes() == encode_entry(first)


def test_a_pinned_prefix_is_kept_beside_the_chains_that_continue_it() -> None:
    namespace = bytes(range(16))
    system = [bytes([1]) * 32, bytes([2]) * 32]
    collector = ManifestCollector(ManifestLimits())
    for keys, priority, used in (
        (system, 10, 1.0),  # pinned
        ([*system, bytes([3]) * 32], 0, 2.0),  # a conversation on top of it
        ([bytes([4]) * 32], 0, 3.0),
        ([bytes([4]) * 32, bytes([5]) * 32], 0, 4.0),  # covers the chain before: dropped
    ):
        collector.add_line(encode_entry(chain_entry(namespace, keys, PAGE, priority, used)))
    read = collector.result(truncated=False)
    assert [(len(e.keys), e.priority) for e in read.entries] == [(2, 10), (2, 0), (3, 0)]
    assert read.entries[0].keys == [k.hex() for k in system]


def test_a_chain_evicted_for_room_does_not_come_back_with_an_older_record() -> None:
    namespace = bytes(range(16))
    collector = ManifestCollector(ManifestLimits(max_entries=2))

    def add(chain: int, priority: int, used: float) -> None:
        keys = [bytes([chain]) * 32]
        collector.add_line(encode_entry(chain_entry(namespace, keys, PAGE, priority, used)))

    # Newest first, as Redis and Mooncake read: chain 1's newest record is the least valuable
    # and makes room; its older record, ranked higher, must not replace it.
    add(1, 0, 5.0)
    add(2, 5, 4.0)
    add(3, 5, 3.0)
    add(1, 9, 1.0)
    kept = {e.keys[0]: e.priority for e in collector.result(truncated=False).entries}
    assert kept == {(bytes([2]) * 32).hex(): 5, (bytes([3]) * 32).hex(): 5}


def _line(namespace: bytes, keys: list[bytes], priority: int, used: float) -> bytes:
    return encode_entry(chain_entry(namespace, keys, PAGE, priority, used))


def test_what_a_read_remembers_of_evicted_chains_follows_max_entries() -> None:
    # A manifest of many distinct chains (a long-lived file's log): every trim evicts some,
    # and the collector must not keep one record per chain it ever evicted.
    namespace = bytes(range(16))
    limits = ManifestLimits(max_entries=10)
    collector = ManifestCollector(limits)
    most = 0
    for chain in range(2_000):
        collector.add_line(_line(namespace, [chain.to_bytes(32, "big")], 0, float(chain)))
        most = max(most, len(collector._evicted))
    assert most <= 2 * limits.max_entries
    kept = [e.last_use for e in collector.result(truncated=False).entries]
    assert kept == [float(chain) for chain in range(1_999, 1_989, -1)]


class _EveryEvictionKept(ManifestCollector):
    """The collector as it was before its memory of evicted chains was bounded: it refused an
    older record of every chain it ever evicted."""

    def _trim(self) -> None:
        before = self._evicted
        super()._trim()
        if self._evicted is not before:
            before.update(self._evicted)
            self._evicted = before


@pytest.mark.parametrize("seed", range(40))
def test_a_bounded_memory_of_evictions_keeps_the_same_chains(seed: int) -> None:
    # While a chain keeps its priority, an older record met after the trim that forgets its
    # eviction ranks no higher than the chains that pushed it out: it makes way again, so
    # reads and compactions keep what they kept with every eviction remembered.
    rng = np.random.default_rng(seed)
    namespaces = [bytes([n]) * 16 for n in range(1, 1 + int(rng.integers(1, 4)))]
    chains = int(rng.choice([5, 40, 300]))
    priority = rng.choice([0, 0, 0, 1, 5], size=chains)
    records = int(rng.choice([50, 400, 1_500]))
    # Integer uses make ties; the order is newest first (Redis, Mooncake), oldest first (a
    # file) or shuffled.
    uses = np.sort(rng.integers(0, records // 3 + 1, size=records)).astype(float)
    order = int(rng.integers(0, 3))
    if order == 1:
        uses = uses[::-1]
    elif order == 2:
        rng.shuffle(uses)
    lines = []
    for used in uses:
        chain = int(rng.integers(0, chains))
        keys = [(chain * 8 + depth).to_bytes(32, "big") for depth in range(int(rng.integers(1, 4)))]
        namespace = namespaces[int(rng.integers(0, len(namespaces)))]
        lines.append(_line(namespace, keys, int(priority[chain]), float(used)))
    limits = ManifestLimits(max_entries=int(rng.choice([1, 3, 10, 30])))
    for carry in (False, True):
        for newest_first in (False, True):
            bounded = ManifestCollector(limits, newest_first=newest_first, carry=carry)
            unbounded = _EveryEvictionKept(limits, newest_first=newest_first, carry=carry)
            for line in lines:
                bounded.add_line(line)
                unbounded.add_line(line)
            assert bounded.result(truncated=False) == unbounded.result(truncated=False)
            if carry:
                assert bounded.compacted(1 << 30) == unbounded.compacted(1 << 30)


def test_the_most_valuable_chains_are_kept_past_many_times_the_bound() -> None:
    namespace = bytes(range(16))
    rng = np.random.default_rng(12)
    collector = ManifestCollector(ManifestLimits(max_entries=50))
    chains = []
    for chain in range(1_000):
        priority, used = int(rng.integers(0, 4)), float(rng.integers(0, 10_000))
        chains.append((priority, used, chain))
        key = chain.to_bytes(32, "big")
        collector.add_line(_line(namespace, [key], priority, used))
    best = sorted(chains, reverse=True)[:50]
    kept = collector.result(truncated=False).entries
    assert [(e.priority, e.last_use) for e in kept] == [(p, u) for p, u, _ in best]


def test_chains_of_namespaces_that_share_keys_are_kept_apart() -> None:
    # Tensor-parallel ranks' namespaces share page keys: one namespace's chain neither
    # replaces nor covers another's.
    a, b = bytes(range(16)), bytes(range(1, 17))
    keys = [bytes([i]) * 32 for i in range(3)]
    collector = ManifestCollector(ManifestLimits())
    collector.add_line(_line(a, keys[:2], 0, 1.0))
    collector.add_line(_line(b, keys[:2], 0, 2.0))
    collector.add_line(_line(b, keys, 0, 3.0))
    read = collector.result(truncated=False)
    assert sorted((e.namespace, len(e.keys)) for e in read.entries) == [
        (a.hex(), 2),
        (b.hex(), 3),
    ]


async def test_compaction_keeps_each_namespace_s_chains(tmp_path: Path) -> None:
    a, b = bytes(range(16)), bytes(range(1, 17))
    keys = [bytes([i]) * 32 for i in range(3)]
    manifest = FileManifest(tmp_path / "manifest.jsonl")
    await manifest.append(
        [
            chain_entry(a, keys[:2], PAGE, 0, 1.0),
            chain_entry(b, keys[:2], PAGE, 0, 2.0),
            chain_entry(b, keys, PAGE, 0, 3.0),
        ]
    )
    report = await manifest.compact()
    assert report.entries_after == 2
    assert [len(e.keys) for e in (await manifest.read(namespace=a.hex())).entries] == [2]
    assert [len(e.keys) for e in (await manifest.read(namespace=b.hex())).entries] == [3]


def test_a_chain_covers_only_the_chains_it_starts_with() -> None:
    namespace = bytes(range(16))
    k = [bytes([i]) * 32 for i in range(6)]
    collector = ManifestCollector(ManifestLimits())
    collector.add_line(_line(namespace, [k[0], k[1]], 0, 1.0))
    # A damaged (or forged) record listing k1 after another key, ranked high: it must not
    # make the real chain ending at k1 look redundant.
    collector.add_line(_line(namespace, [k[5], k[1], k[4]], 1000, 2.0))
    read = collector.result(truncated=False)
    assert sorted(len(e.keys) for e in read.entries) == [2, 3]


async def test_the_budget_holds_within_one_long_entry(tmp_path: Path) -> None:
    rng = np.random.default_rng(21)
    prompt = rng.integers(0, 50_000, size=40 * PAGE)
    await _fill(tmp_path, [prompt])
    config = _config()
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=10 / config.resolved_host_pages)
        assert result.status is WarmupStatus.BUDGET
        assert result.pages_loaded == 10
        assert cache.match(prompt).host_tokens == 10 * PAGE
        # The rest still comes from storage, whole and right.
        generator = KVGenerator(config.layout, PAGE, seed=5)
        served = await serve(cache, prompt, generator, check="all")
        assert served.storage_tokens == 30 * PAGE


async def test_the_budget_is_the_pages_the_ratio_s_decimal_says(tmp_path: Path) -> None:
    # 0.29 x 100 host pages is 28.999999999999996 in binary floating point, which rounded
    # the budget down to 28 pages.
    prompt = np.random.default_rng(23).integers(0, 50_000, size=40 * PAGE)
    await _fill(tmp_path, [prompt])
    async with HiCache(_config(host_pages=100), storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=0.29)
        assert (result.status, result.pages_loaded) == (WarmupStatus.BUDGET, 29)
        assert cache.match(prompt).host_tokens == 29 * PAGE


class _SlowManifestStorage(FileStorage):
    """A file store whose manifest takes an hour to read."""

    def manifest(self, limits: ManifestLimits | None = None) -> FileManifest:
        class Slow(FileManifest):
            async def read(self, *, namespace: str | None = None) -> ManifestRead:
                await asyncio.sleep(3600)
                return await super().read(namespace=namespace)

        return Slow(self.root / "manifest.jsonl", limits)


async def test_the_deadline_covers_reading_the_manifest(tmp_path: Path) -> None:
    await _fill(tmp_path, _prompts(2, seed=22))
    async with HiCache(_config(), storage=_SlowManifestStorage(tmp_path)) as cache:
        result = await asyncio.wait_for(cache.warmup(ratio=1.0, deadline_s=0.1), 10)
        assert result.status is WarmupStatus.DEADLINE
        assert result.pages_loaded == 0


class _GatedStorage(FileStorage):
    """A file store whose `exists` calls (a prefetch's first read) are counted and wait for
    `gate`, and whose manifest reads wait for `manifest_gate` and then set `manifest_read`."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.exists_calls = 0
        self.in_exists = asyncio.Event()
        self.gate = asyncio.Event()
        self.manifest_gate = asyncio.Event()
        self.manifest_read = asyncio.Event()

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.exists_calls += 1
        self.in_exists.set()
        await self.gate.wait()
        return await super().exists(keys)

    def manifest(self, limits: ManifestLimits | None = None) -> FileManifest:
        gate, read = self.manifest_gate, self.manifest_read

        class Gated(FileManifest):
            async def read(self, *, namespace: str | None = None) -> ManifestRead:
                await gate.wait()
                entries = await super().read(namespace=namespace)
                read.set()
                return entries

        return Gated(self.root / "manifest.jsonl", limits)


def _gated_config(**overrides: object) -> CacheConfig:
    # A live prefetch held in `exists` must not time out while a test holds it.
    prefetch = {"policy": "wait_complete", "threshold_tokens": PAGE, "io_timeout_s": 3600}
    return _config(prefetch=prefetch, **overrides)


#: Tokens no store holds: a live prefetch of them is one `exists`, then a miss.
_LIVE = np.arange(60_000, 60_000 + 8 * PAGE)


@pytest.mark.parametrize("started", ["by_call", "on_attach"])
async def test_the_deadline_holds_while_live_prefetches_run(tmp_path: Path, started: str) -> None:
    prompts = _prompts(4, seed=31)
    await _fill(tmp_path, prompts)
    storage = _GatedStorage(tmp_path)
    deadline = 0.5
    on_attach = started == "on_attach"
    config = _gated_config(warmup={"enabled": on_attach, "ratio": 1.0, "deadline_s": deadline})
    async with HiCache(config, storage=storage) as cache:
        live = asyncio.create_task(cache.prefetch(_LIVE))
        await storage.in_exists.wait()  # a live prefetch runs, and goes on until the gate opens
        storage.manifest_gate.set()
        warm = asyncio.create_task(
            cache.wait_warmup() if on_attach else cache.warmup(ratio=1.0, deadline_s=deadline)
        )
        # The warmup yields to the live prefetch, but only until its deadline. (A hang guard:
        # waiting for the live traffic to end, it would still be waiting.)
        done, _ = await asyncio.wait([warm], timeout=30)
        storage.gate.set()
        await live
        result = await warm
        assert result is not None
        assert done, "the warmup outlived its deadline while a live prefetch ran"
        assert result.status is WarmupStatus.DEADLINE
        assert result.entries_read >= len(prompts)  # it got past the manifest
        # No entry was begun: the only `exists` is the live prefetch's.
        assert storage.exists_calls == 1
        assert (result.entries_loaded, result.pages_loaded, result.entries_missed) == (0, 0, 0)


@pytest.mark.parametrize("when", ["detach_in_entry", "close_in_entry", "detach_while_yielding"])
async def test_a_warmup_stopped_in_its_last_entry_reports_stopped(
    tmp_path: Path, when: str
) -> None:
    prompts = _prompts(1, seed=32)
    await _fill(tmp_path, prompts)
    storage = _GatedStorage(tmp_path)
    storage.manifest_gate.set()
    async with HiCache(_gated_config(), storage=storage) as cache:
        live = None
        if when == "detach_while_yielding":
            live = asyncio.create_task(cache.prefetch(_LIVE))
            await storage.in_exists.wait()
            warm = asyncio.create_task(cache.warmup(ratio=1.0))
            # From its manifest read the warmup goes on to wait for the live prefetch
            # without yielding: once the read is seen over, it waits there.
            await storage.manifest_read.wait()
        else:
            warm = asyncio.create_task(cache.warmup(ratio=1.0))
            await storage.in_exists.wait()  # the one entry's read is in progress
        if when == "close_in_entry":
            await cache.__aexit__(None, None, None)
        else:
            await cache.detach_storage()
        result = await asyncio.wait_for(warm, 30)
        if live is not None:
            await live
        assert result.status is WarmupStatus.STOPPED
        assert result.entries_agreed == 1
        assert result.pages_loaded == 0
        assert storage.exists_calls == 1


def _open_files() -> set[str]:
    """The paths this process has open."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
    return paths


async def test_a_manifest_read_cut_short_closes_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "manifest.jsonl"
    namespace = bytes(range(16))
    with path.open("wb") as f:  # several read chunks
        for chain in range(5_000):
            f.write(_line(namespace, [chain.to_bytes(32, "big")], 0, float(chain)))
    scope = anyio.CancelScope()
    original = ManifestCollector.add_line

    def add_line(self: ManifestCollector, line: bytes) -> None:
        if not scope.cancel_called:  # a deadline passing mid-read, while records are decoded
            anyio.from_thread.run_sync(scope.cancel)  # (on a worker thread)
        original(self, line)

    monkeypatch.setattr(ManifestCollector, "add_line", add_line)
    with scope:
        await FileManifest(path).read()
    assert scope.cancelled_caught
    assert str(path) not in _open_files()


async def test_enormous_manifest_costs_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    with path.open("wb") as f:
        for _ in range(64):
            f.write(b"y" * (1 << 20))  # one endless 64 MiB line
    manifest = FileManifest(path, ManifestLimits(max_bytes=8 << 20))
    read = await manifest.read()
    assert read.truncated
    assert read.entries == []


def _manifest_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "hicache_async", "manifest", *args]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def test_manifest_cli_show_and_compact(tmp_path: Path) -> None:
    asyncio.run(_fill(tmp_path, _prompts(4, seed=4)))
    show = _manifest_cli("show", f"file://{tmp_path}", "--json")
    assert show.returncode == 0, show.stderr
    shown = json.loads(show.stdout)
    assert len(shown["entries"]) >= 4
    compact = _manifest_cli("compact", f"file://{tmp_path}", "--json")
    assert compact.returncode == 0, compact.stderr
    assert json.loads(compact.stdout)["entries_after"] == len(shown["entries"])
    bad = _manifest_cli("show", "nope://x")
    assert bad.returncode == 2
    assert "nope" in bad.stderr
    missing = tmp_path / "missing"
    absent = _manifest_cli("show", f"file://{missing}")
    assert absent.returncode == 2
    assert "no storage at" in absent.stderr
    assert not missing.exists()  # an inspection does not create a store
    (tmp_path / "manifest.jsonl").unlink()
    (tmp_path / "manifest.jsonl").mkdir()
    broken = _manifest_cli("show", f"file://{tmp_path}")
    assert broken.returncode == 1
    assert "Traceback" not in broken.stderr
    assert "IsADirectoryError" in broken.stderr


@pytest.mark.parametrize("enabled", [True])
async def test_warmup_on_attach_when_configured(tmp_path: Path, enabled: bool) -> None:
    prompts = _prompts(6, seed=6)
    await _fill(tmp_path, prompts)
    config = _config(warmup={"enabled": enabled, "ratio": 1.0})
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        status = await cache.wait_warmup()
        assert status is not None
        assert status.pages_loaded == sum(len(p) // PAGE for p in prompts)


@pytest.mark.parametrize("pattern", [(0, 0, 1), (0, 1, 0, 2), (3, 1, 3, 2), (0, 1, 0)])
async def test_a_manifest_entry_that_repeats_a_key_is_malformed(
    tmp_path: Path, pattern: tuple[int, ...]
) -> None:
    # A forged record; each key of a real chain hashes the one before, so none repeats. Read
    # as a chain, it gave one host page two places in the tree, and a later request's commit
    # raised while freeing that page twice.
    prompt = _prompts(1, seed=8)[0][: 4 * PAGE]
    await _fill(tmp_path, [prompt])
    path = tmp_path / "manifest.jsonl"
    record = json.loads(path.read_bytes().splitlines()[-1])
    real = record["keys"]
    record["keys"] = [real[i] for i in pattern]
    path.write_bytes(json.dumps(record).encode() + b"\n")
    assert decode_entry(path.read_bytes()) is None
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=1.0)
        assert (result.malformed, result.pages_loaded) == (1, 0)
        cache.tree.check_invariants()
        for _ in range(3):
            await serve(cache, prompt, generator, check="all")
        await cache.drain()
        cache.tree.check_invariants()


async def test_a_prefetch_reads_no_further_than_the_first_repeated_key(tmp_path: Path) -> None:
    prompt = _prompts(1, seed=9)[0][: 4 * PAGE]
    await _fill(tmp_path, [prompt])
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        link = cache._link
        assert link is not None
        real = cache.keys_for(prompt)
        keys = [real[0], real[1], real[0], real[2]]
        handle = PrefetchHandle(link.prefetcher, keys, len(keys) * PAGE, "own", "wait_complete")
        await link.prefetcher.run_now(handle)
        assert handle.storage_tokens == 2 * PAGE
        cache.tree.check_invariants()
        served = await serve(cache, prompt, generator, check="all")
        assert served.host_tokens == 2 * PAGE
        await cache.drain()
        cache.tree.check_invariants()


async def test_a_memory_manifest_read_keeps_to_a_lowered_byte_bound() -> None:
    # MemoryStorage.manifest(limits) may lower max_bytes below what is held: a read returned
    # every held record, where the file and Redis manifests stop at the bound.
    storage = MemoryStorage()
    async with storage:
        manifest = storage.manifest()
        ours, theirs = bytes(range(16)), bytes(range(1, 17))
        # Uses of one width, so that every record has the same size.
        written = [_chain(ours, i, last_use=1000.0 + i) for i in range(40)]
        for i, entry in enumerate(written):
            await manifest.append([entry, _chain(theirs, 100 + i, last_use=1000.0 + i)])
        whole = await manifest.read(namespace=ours.hex())
        assert (len(whole.entries), whole.truncated) == (40, False)
        record = len(encode_entry(written[0]))
        assert all(len(encode_entry(e)) == record for e in written)
        # Room for 10 records and a half: the 10 newest are read, newest first.
        lowered = storage.manifest(ManifestLimits(max_bytes=10 * record + record // 2))
        read = await lowered.read(namespace=ours.hex())
        assert read.truncated
        assert read.entries == written[:-11:-1]
        assert sum(len(encode_entry(e)) for e in read.entries) <= lowered.limits.max_bytes
        # Every namespace: the bound covers them all, still newest first.
        both = await lowered.read()
        assert both.truncated
        assert len(both.entries) == 10
        assert {e.last_use for e in both.entries} == {1000.0 + i for i in range(35, 40)}


async def test_a_memory_manifest_checks_held_records_against_lowered_limits() -> None:
    # MemoryStorage.manifest(limits) gives the held manifest new limits; records held since a
    # higher max_entry_bytes were served as if they fitted.
    storage = MemoryStorage()
    async with storage:
        manifest = storage.manifest(ManifestLimits(max_entry_bytes=1 << 20))
        keys = [f"{i:064x}" for i in range(1, 3000)]  # a record of about 200 KB
        small = ManifestEntry(namespace="0" * 32, keys=["ab" * 32], num_tokens=1)
        await manifest.append([ManifestEntry(namespace="0" * 32, keys=keys, num_tokens=1), small])
        lowered = storage.manifest(ManifestLimits(max_entry_bytes=64 * 1024))
        read = await lowered.read()
        assert ([e.keys for e in read.entries], read.oversized) == ([small.keys], 1)
        report = await lowered.compact()
        assert (report.entries_after, report.oversized) == (1, 1)
        assert [e.keys for e in (await lowered.read()).entries] == [small.keys]


async def test_a_cache_left_before_its_attach_warmup_ran_ends_it_stopped(tmp_path: Path) -> None:
    # The warmup attach starts runs as a task: a cache entered and left without yielding
    # (an aborted start, a health probe) closed before that task first ran, and the task
    # then failed on the closed cache, logged as `hicache.warmup.failed`.
    config = _config(warmup={"enabled": True, "ratio": 1.0})
    with capture_logs() as logs:
        async with HiCache(config, storage=FileStorage(tmp_path)):
            pass
    events = [e["event"] for e in logs]
    assert "hicache.warmup.failed" not in events, logs
    done = [e for e in logs if e["event"] == "hicache.warmup.done"]
    assert [e["status"] for e in done] == ["stopped"]


async def test_a_warmup_counts_records_of_a_newer_version_and_leaves_them(tmp_path: Path) -> None:
    prompt = _prompts(1, seed=9)[0][: 3 * PAGE]
    await _fill(tmp_path, [prompt])
    path = tmp_path / "manifest.jsonl"
    record = json.loads(path.read_bytes().splitlines()[-1])
    newer = json.dumps({**record, "v": record["v"] + 1, "shape": "unknown here"}).encode()
    path.write_bytes(path.read_bytes() + newer + b"\n")
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=5)
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=1.0)
        assert (result.status, result.newer, result.malformed) == (WarmupStatus.COMPLETE, 1, 0)
        assert result.pages_loaded == 3  # from the record of this version only
        served = await serve(cache, prompt, generator, prefetch=False, check="all")
        assert served.host_tokens == 3 * PAGE
        await cache.drain()
    assert newer in path.read_bytes()


async def test_entries_the_store_cannot_serve_still_let_the_loop_run(tmp_path: Path) -> None:
    # A stale manifest (every chain's first page gone) ends each entry without any I/O: the
    # loop must still get to other tasks between entries, not only once warmup returns.
    prompts = _prompts(30, seed=11)
    await _fill(tmp_path, prompts)
    config = _config()
    async with HiCache(config) as keyer:
        firsts = [keyer.namespace.storage_keys(keyer.keys_for(p))[0] for p in prompts]
    async with FileStorage(tmp_path) as storage:
        assert await storage.delete(firsts) == len(prompts)
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        link = cache._link
        assert link is not None
        seen: set[int] = set()
        warming = asyncio.ensure_future(cache.warmup(ratio=1.0))
        while not warming.done():
            seen.update(w._partial.entries_missed for w in link.warmers)
            await asyncio.sleep(0)
        result = warming.result()
        assert result.entries_missed == len(prompts)
        assert seen & set(range(1, len(prompts))), seen  # seen part-way through the entries


async def test_a_warmup_in_the_callers_task_outlives_the_close_safely() -> None:
    # `warmup()` runs in the caller's task, which a close does not wait for: its manifest
    # read may end after the close, and the pools must still be there for it.
    import gc
    import weakref

    from hicache_async.storage import open_storage

    backend = open_storage("memory://")
    reading = asyncio.Event()
    release = asyncio.Event()
    manifest_of = backend.manifest

    class _HeldManifest:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        async def read(self, **kwargs: Any) -> Any:
            found = await self._inner.read(**kwargs)
            reading.set()
            await release.wait()
            return found

    backend.manifest = lambda *args, **kwargs: _HeldManifest(manifest_of(*args, **kwargs))  # type: ignore[method-assign]
    async with HiCache(_config(), storage=backend) as cache:
        host = weakref.ref(cache.host_pool.data)
        warming = asyncio.ensure_future(cache.warmup(ratio=1.0))
        await reading.wait()
    assert cache.state == "closed"
    release.set()
    result = await warming
    assert result.status in (WarmupStatus.COMPLETE, WarmupStatus.STOPPED)
    gc.collect()
    assert host() is None  # released once the warmup ended


async def _holding_the_gate(
    gate: threading.Event, owner: Hashable = "held"
) -> asyncio.Future[bool]:
    """A manifest job of `owner` that holds its gate on this loop until `gate` is set."""
    from hicache_async.storage import _manifest

    started = threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait(30)

    job = asyncio.ensure_future(_manifest.off_loop(hold, owner=owner))
    assert await asyncio.to_thread(started.wait, 30)
    return job


async def test_manifest_work_given_up_before_its_turn_never_runs() -> None:
    # Warmups cut by short deadlines give up their manifest reads; the abandoned work must
    # not pile up (each job holds its own copy of a large manifest).
    import threading

    from hicache_async.storage import _manifest

    gate = threading.Event()
    ran: list[int] = []
    first = await _holding_the_gate(gate)
    second = asyncio.ensure_future(_manifest.off_loop(lambda: ran.append(1), owner="held"))
    for _ in range(20):
        await asyncio.sleep(0.01)  # let it reach its worker thread (not needed for the check)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    gate.set()
    assert await first
    # Once the abandoned job has had its turn, a new one runs (the gate is free again).
    assert await _manifest.off_loop(lambda: ran.append(2) or True, owner="held")
    assert ran == [2]


async def test_manifest_work_of_other_loops_never_waits_for_this_ones() -> None:
    # Ranks or caches on loops of their own: a large read on one must not hold up another.
    import threading

    from hicache_async.storage import _manifest

    gate = threading.Event()
    held = await _holding_the_gate(gate)
    try:
        # Run on another thread's loop, while this loop's gate is held.
        other = await asyncio.to_thread(
            asyncio.run, asyncio.wait_for(_manifest.off_loop(lambda: "done", owner="held"), 10)
        )
        assert other == "done"
    finally:
        gate.set()
    assert await held


async def test_manifest_work_of_other_stores_on_this_loop_never_waits_for_it() -> None:
    # Two caches on one loop: a large manifest read of one store must not hold up the
    # other's warmup (it would end DEADLINE behind work that is none of its business).
    entry = ManifestEntry(namespace="0" * 32, keys=["ab" * 32], num_tokens=16, last_use=1.0)
    busy, other = MemoryStorage().manifest(), MemoryStorage().manifest()
    await other.append([entry])
    gate = threading.Event()
    held = await _holding_the_gate(gate, owner=busy)
    try:
        # Its own work done off the loop while the other store's gate is held.
        found = await asyncio.wait_for(other.read(namespace=entry.namespace), 10)
        assert found.entries == [entry]
        # The held store's own work waits its turn (one job at a time per manifest).
        reading = asyncio.ensure_future(busy.read(namespace=entry.namespace))
        await asyncio.sleep(0.2)
        assert not reading.done()
    finally:
        gate.set()
    assert await held
    assert (await reading).entries == []


def test_file_manifests_of_one_file_share_a_gate_however_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert _manifest._owner_of(Path("m.jsonl")) == _manifest._owner_of(tmp_path / "m.jsonl")
    assert _manifest._owner_of(tmp_path / "a") != _manifest._owner_of(tmp_path / "b")


def test_a_forked_child_does_not_inherit_a_held_manifest_gate() -> None:
    import os
    import threading

    from hicache_async.storage import _manifest

    async def main() -> None:
        gate = threading.Event()
        held = await _holding_the_gate(gate)
        pid = os.fork()
        if pid == 0:  # the child: its own loop, and a manifest job of its own
            try:
                ok = asyncio.run(
                    asyncio.wait_for(_manifest.off_loop(lambda: True, owner="held"), 20)
                )
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        gate.set()
        assert await held
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0

    asyncio.run(main())


async def test_warmed_entries_leave_least_valuable_first(tmp_path: Path) -> None:
    # Warmup loads the most valuable entry first; left with that load's access time, it
    # would be the least recently used of them and the first a new request evicts.
    chains = [np.arange(8 * PAGE) + 100_000 * (i + 1) for i in range(4)]  # C3 the newest
    for chain in chains:
        await _fill(tmp_path, [chain])
    generator = KVGenerator(_config().layout, PAGE, seed=5)
    config = _config(host_pages=40, device_pages=16)
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        result = await cache.warmup(ratio=1.0)
        assert (result.entries_loaded, result.pages_loaded) == (4, 32)
        for fresh in range(2):  # write-through: 16 host pages wanted, 8 free
            await serve(cache, np.arange(8 * PAGE) + 900_000 + fresh * 10_000, generator)
            await cache.drain()
        on_host = [cache.match(chain).host_tokens // PAGE for chain in chains]
        assert on_host == [0, 8, 8, 8], on_host  # the oldest chain went, the newest stayed
        await serve(cache, chains[3], generator, prefetch=False, check="all")


class _SharedMemory(Unowned):
    """A memory store two caches share, its manifest included."""

    def __init__(self, inner: MemoryStorage) -> None:
        super().__init__(inner)
        self.memory = inner

    def manifest(self, limits: ManifestLimits | None = None) -> MemoryManifest:
        return self.memory.manifest(limits)


@pytest.mark.parametrize("store", ["file", "memory"])
async def test_a_chain_longer_than_a_record_holds_is_warmed_up_as_its_prefix(
    tmp_path: Path, store: str
) -> None:
    # At page size 1 every token is a key: a 4,000-token conversation's whole chain would not
    # fit one record, which every warmup skips (file) or no store keeps (memory).
    config = _config(
        layout={"num_layers": 1, "attention": "mla", "kv_lora_rank": 1, "dtype": "uint8"},
        page_size=1,
        device_pages=4100,
        host_pages=8200,
    )
    generator = KVGenerator(config.layout, 1, seed=5)
    prompt = np.random.default_rng(8).integers(0, 50_000, size=4001)
    backend = FileStorage(tmp_path) if store == "file" else MemoryStorage()
    async with contextlib.AsyncExitStack() as stack:
        if store == "memory":
            await stack.enter_async_context(backend)
        shared = _SharedMemory(backend) if isinstance(backend, MemoryStorage) else backend
        async with HiCache(config, storage=shared) as first:
            await serve(first, prompt, generator)
            await first.drain()
        read = await backend.manifest().read()
        assert read.oversized == 0
        assert len(read.entries) == 1
        (entry,) = read.entries
        limit = ManifestLimits().max_entry_bytes
        # The longest prefix that fits: one more key would not.
        assert len(encode_entry(entry)) <= limit < len(encode_entry(entry)) + 67
        pages = len(entry.keys)
        assert entry.num_tokens == pages
        if isinstance(backend, FileStorage):
            shared = FileStorage(tmp_path)
        async with HiCache(config, storage=shared) as cold:
            result = await cold.warmup(ratio=1.0)
            assert result.status is WarmupStatus.COMPLETE
            assert result.pages_loaded == pages
            served = await serve(cold, prompt, generator, prefetch=False, check="all")
            assert served.host_tokens == pages


async def test_a_chain_past_a_lowered_memory_bound_is_recorded_as_its_prefix() -> None:
    # MemoryStorage.manifest(limits) lowers the bound every user of its manifest (backup and
    # warmup alike) holds records to: a chain past it is recorded as the prefix that fits,
    # not left unrecorded as one past the default bound was.
    config = _config(page_size=1)
    generator = KVGenerator(config.layout, 1, seed=5)
    prompt = np.random.default_rng(9).integers(0, 50_000, size=60)
    limit = 2048  # some 30 keys
    storage = MemoryStorage()
    async with storage:
        storage.manifest(ManifestLimits(max_entry_bytes=limit))
        async with HiCache(config, storage=_SharedMemory(storage)) as first:
            await serve(first, prompt, generator)
            await first.drain()
        read = await storage.manifest().read()
        assert read.oversized == 0
        (entry,) = read.entries
        pages = len(entry.keys)
        assert len(encode_entry(entry)) <= limit < len(encode_entry(entry)) + 67
        assert entry.num_tokens == pages
        async with HiCache(config, storage=_SharedMemory(storage)) as cold:
            result = await cold.warmup(ratio=1.0)
            assert result.status is WarmupStatus.COMPLETE
            assert result.pages_loaded == pages
            served = await serve(cold, prompt, generator, prefetch=False, check="all")
            assert served.host_tokens == pages


@pytest.mark.parametrize("back", [200.0, 3600.0])
async def test_chains_recorded_after_the_clock_steps_back_rank_no_older(
    monkeypatch: pytest.MonkeyPatch, back: float
) -> None:
    # A record's `last_use` is wall-clock time. Stepped back (NTP, a VM's resume), it made
    # the chains recorded since rank as older than those recorded before: warmup loaded
    # them last, and a full manifest trimmed them first.
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=5)
    first, second = _prompts(2, seed=11)
    assert len(first) // PAGE != len(second) // PAGE  # told apart by their lengths
    async with HiCache(config, storage=MemoryStorage()) as cache:
        link = cache._link
        assert link is not None
        backend = link.backend
        assert isinstance(backend, MemoryStorage)
        await serve(cache, first, generator, prefetch=False)
        await cache.drain()
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - back)
        await serve(cache, second, generator, prefetch=False)
        await cache.drain()
        read = await backend.manifest().read()
    uses = {e.num_tokens: e.last_use for e in read.entries}
    earlier, later = (len(p) // PAGE * PAGE for p in (first, second))
    assert set(uses) == {earlier, later}
    # Within 300 s the floor holds; past it the clock's own time is stamped (staying above
    # the earlier record would make every later one rank as never used), and the reader,
    # whose clock is back too, ranks the earlier record, now far ahead, as never used.
    assert (uses[later] >= uses[earlier]) == (back < 300)
    assert read.entries[0].num_tokens == later  # the most recent first


@pytest.mark.parametrize("back", [200.0, 3600.0])
async def test_chains_recorded_after_a_reattach_and_a_clock_step_back_rank_no_older(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, back: float
) -> None:
    # Each attach runs a backup worker of its own: the floor under `last_use` must outlive
    # it, or the chains recorded after a detach, an attach and a clock stepped back rank as
    # older than those recorded before (warmup loads them last, a full manifest trims them
    # first).
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=5)
    first, second = _prompts(2, seed=11)
    assert len(first) // PAGE != len(second) // PAGE  # told apart by their lengths
    async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
        await serve(cache, first, generator, prefetch=False)
        await cache.drain()
        await cache.detach_storage()
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - back)
        await cache.attach_storage(FileStorage(tmp_path))
        await serve(cache, second, generator, prefetch=False)
        await cache.drain()
        link = cache._link
        assert link is not None
        backend = link.backend
        assert isinstance(backend, FileStorage)
        read = await backend.manifest().read()
    uses = {e.num_tokens: e.last_use for e in read.entries}
    earlier, later = (len(p) // PAGE * PAGE for p in (first, second))
    assert set(uses) == {earlier, later}
    # Within 300 s the floor holds; past it the clock's own time is stamped (staying above
    # the earlier record would make every later one rank as never used), and the reader,
    # whose clock is back too, ranks the earlier record, now far ahead, as never used.
    assert (uses[later] >= uses[earlier]) == (back < 300)
    assert read.entries[0].num_tokens == later  # the most recent first


def test_a_forked_child_does_not_inherit_a_held_record_clock() -> None:
    # A backup worker's thread may hold the clock's lock at the moment another forks.
    from hicache_async.storage import _manifest

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _manifest._RECORD_CLOCK._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:  # the child: a record's time on a thread it can wait for with a bound
            try:
                stamp = threading.Thread(target=_manifest.record_time, daemon=True)
                stamp.start()
                stamp.join(20)
                os._exit(1 if stamp.is_alive() else 0)
            except BaseException:
                os._exit(2)
    finally:
        release.set()
        holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_record_clock_set_right_after_a_jump_ahead_stamps_by_the_clock_again() -> None:
    # A clock that jumped an hour ahead and was set right: staying above the stamps made
    # meanwhile would have every later record of the process rank as never used (readers
    # rank stamps more than 300 s ahead of their clocks so) for the rest of its life.
    from hicache_async.storage import _manifest

    wall = [1_000_000.0]
    clock = _manifest._RecordClock(lambda: wall[0])
    first = clock.now()
    assert clock.now() > first  # the same clock reading still moves forward
    wall[0] += 3600.0
    ahead = clock.now()
    wall[0] -= 3600.0 - 1.0
    assert clock.now() == wall[0]
    wall[0] -= 100.0  # a small step back keeps to the floor
    assert clock.now() > wall[0] + 100.0
    assert ahead > wall[0]
