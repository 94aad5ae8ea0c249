"""Warmup manifests of every backend, against real servers: memory, file, Redis (one server
and a three-primary cluster), Mooncake.

The same properties for each: round trip, newest record per chain, malformed and oversized
records skipped and counted, bounded reads of a manifest far beyond its limits, bounded
storage under appends, atomic and idempotent compaction, separated namespaces. Then the
backend-specific ones (Redis Cluster slots, no scripting, TTL; Mooncake's index validation
and compaction lock) and a HiCache that warms up from what another one backed up to Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import redis
import structlog
from redis.asyncio import Redis
from redis.crc import key_slot

from hicache_async import CacheConfig, HiCache, StorageError
from hicache_async.storage import (
    FileStorage,
    MemoryStorage,
    Outcome,
    PageMeta,
    StorageBackend,
)
from hicache_async.storage._manifest import (
    ManifestCollector,
    ManifestEntry,
    ManifestLimits,
    ManifestRead,
    MemoryManifest,
    SupportsManifest,
    WarmupManifest,
    chain_entry,
    encode_entry,
)
from hicache_async.storage._manifest_mooncake import MooncakeManifest, _records, _with_token
from hicache_async.storage._manifest_mooncake import _Stale as MooncakeStale
from hicache_async.storage._manifest_redis import RedisManifest
from hicache_async.storage._manifest_redis import _Stale as RedisStale
from hicache_async.storage._mooncake import MooncakeStorage
from hicache_async.storage._redis import RedisStorage
from hicache_async.testing import KVGenerator, serve
from hicache_async.testing._servers import RedisServer
from hicache_async.workers import WarmupStatus

NS_A = bytes(range(16))
NS_B = bytes(range(16, 32))
PAGE = 4
LIMITS = ManifestLimits(max_entries=64, max_entry_bytes=4096, max_bytes=8 << 20)
MOONCAKE_SMALL = "&segment_size=512MiB&buffer_size=16MiB&staging_size=8MiB"


def entry(ns: bytes, i: int, *, priority: int = 0, last_use: float | None = None) -> ManifestEntry:
    """The entry of chain `i` of namespace `ns`: three page keys."""
    keys = [hashlib.sha256(b"%d:%d:" % (i, j) + ns).digest() for j in range(3)]
    return chain_entry(ns, keys, 3 * PAGE, priority, float(i) if last_use is None else last_use)


def _hidden(*commands: str) -> list[str]:
    """redis-server arguments that take `commands` away, as a proxy that refuses them."""
    return [arg for command in commands for arg in ("--rename-command", command, "")]


def line(value: object) -> bytes:
    return json.dumps(value).encode()


class Store:
    """A backend under test, with raw access to where its manifest lives."""

    def __init__(self, kind: str, backend: StorageBackend) -> None:
        self.kind = kind
        self.backend = backend
        self._manifest: WarmupManifest | None = None

    def manifest(self, limits: ManifestLimits = LIMITS) -> WarmupManifest:
        assert isinstance(self.backend, SupportsManifest)
        self._manifest = self.backend.manifest(limits)
        return self._manifest

    async def write_raw(self, ns: bytes, lines: list[bytes]) -> None:
        """Store `lines` as manifest records of `ns` as they are: no validation, no bounds."""
        manifest = self._manifest or self.manifest()
        if isinstance(manifest, MemoryManifest):
            for raw in lines:
                manifest._add_line(raw + b"\n")
        elif isinstance(self.backend, FileStorage):
            with (self.backend.root / "manifest.jsonl").open("ab") as f:
                f.write(b"".join(raw + b"\n" for raw in lines))
        elif isinstance(manifest, RedisManifest):
            assert isinstance(self.backend, RedisStorage)
            client = self.backend._redis()
            for start in range(0, len(lines), 1000):
                await client.rpush(manifest.list_key(ns.hex()), *lines[start : start + 1000])
            await client.sadd(manifest.index_key, ns.hex())
        else:
            assert isinstance(manifest, MooncakeManifest)
            index = await manifest._index(ns.hex())
            payload = b"".join(raw + b"\n" for raw in lines)
            await manifest._put_log(ns.hex(), index.stem, payload)

    async def raw_records(self, ns: bytes) -> list[bytes]:
        """The records stored for `ns` (for the file: of every namespace) as they are, oldest
        first as far as the store orders them."""
        manifest = self._manifest or self.manifest()
        if isinstance(manifest, MemoryManifest):
            held = manifest._held.items()
            return [raw[:-1] for ident, (_, raw) in held if ident[0] == ns.hex()]
        if isinstance(self.backend, FileStorage):
            path = self.backend.root / "manifest.jsonl"
            return [raw for raw in path.read_bytes().split(b"\n") if raw]
        if isinstance(manifest, RedisManifest):
            assert isinstance(self.backend, RedisStorage)
            client = self.backend._redis()
            return list(await client.lrange(manifest.list_key(ns.hex()), 0, -1))
        assert isinstance(manifest, MooncakeManifest)
        index = await manifest._index(ns.hex())
        end = await manifest._log_end(ns.hex(), index.stem)
        names = manifest._chunk_names(ns.hex(), index.stem, "b", range(index.base))
        names += manifest._chunk_names(ns.hex(), index.stem, "l", range(end))
        chunks = await manifest._get(names, manifest.chunk_bytes)
        return [raw for chunk in chunks if isinstance(chunk, bytes) for raw in _records(chunk)]

    async def write_huge(self, ns: bytes, nbytes: int) -> None:
        """One record (for Mooncake: one object) of `nbytes`, beyond every bound."""
        manifest = self._manifest or self.manifest()
        if not isinstance(manifest, MooncakeManifest):
            await self.write_raw(ns, [b"z" * nbytes])
            return
        assert isinstance(self.backend, MooncakeStorage)
        index = await manifest._index(ns.hex())
        end = await manifest._log_end(ns.hex(), index.stem)
        name = manifest.object_name(ns.hex(), f"{index.stem}:l{end}")
        store, config = self.backend._store, manifest._replicate_config()
        code = await self.backend.run_job(lambda stop: store.put(name, b"z" * nbytes, config))
        assert code == 0


@pytest.fixture(params=["memory", "file", "redis", "redis-cluster", "mooncake"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str, mooncake_url: str
) -> AsyncIterator[Store]:
    prefix = f"t{uuid.uuid4().hex}"
    backend: StorageBackend
    if request.param == "memory":
        backend = MemoryStorage()
    elif request.param == "file":
        backend = FileStorage(tmp_path / "root")
    elif request.param == "redis":
        backend = RedisStorage.from_url(f"{redis_url}?prefix={prefix}")
    elif request.param == "redis-cluster":
        # Three primaries: the manifest's keys of a namespace share a slot, the set of
        # namespaces lies elsewhere, and its scripts and RENAME run on the slot's node.
        cluster_url = request.getfixturevalue("redis_cluster_url")
        backend = RedisStorage.from_url(f"{cluster_url}&prefix={prefix}")
    else:
        backend = MooncakeStorage.from_url(f"{mooncake_url}{MOONCAKE_SMALL}&prefix={prefix}")
    async with backend:
        yield Store(request.param, backend)


def chains(read: ManifestRead) -> set[str]:
    return {e.chain_id for e in read.entries}


async def test_round_trip_and_the_newest_record_of_a_chain_wins(store: Store) -> None:
    manifest = store.manifest()
    written = [entry(NS_A, i, priority=i % 3) for i in range(20)]
    await manifest.append(written[:12])
    await manifest.append(written[12:])
    read = await manifest.read(namespace=NS_A.hex())
    assert sorted(read.entries, key=lambda e: e.last_use) == written
    assert (read.malformed, read.oversized, read.truncated) == (0, 0, False)
    assert [e.priority for e in read.entries] == sorted((e.priority for e in written), reverse=True)

    await manifest.append([entry(NS_A, 3, priority=7, last_use=1e6)])
    await manifest.append([entry(NS_A, 4, priority=9, last_use=1.5)])  # older than chain 4's
    read = await manifest.read(namespace=NS_A.hex())
    assert len(read.entries) == 20
    by_chain = {e.chain_id: e for e in read.entries}
    assert by_chain[written[3].chain_id].priority == 7
    assert by_chain[written[4].chain_id].priority == written[4].priority
    assert read.entries[0].chain_id == written[3].chain_id  # highest priority first


async def test_a_record_stamped_far_ahead_ranks_as_never_used_and_a_near_one_as_now(
    store: Store,
) -> None:
    # A writer's clock a day ahead: its record ranked first until that day came, pushing
    # out chains used since. More than 300 s ahead it ranks below every other record;
    # less far ahead, as now.
    manifest = store.manifest()
    now = time.time()
    ahead = entry(NS_A, 10_000, last_use=now + 86_400)
    await manifest.append([ahead])
    assert [e.chain_id for e in (await manifest.read(namespace=NS_A.hex())).entries] == [
        ahead.chain_id
    ]
    cap = LIMITS.max_entries
    since = [entry(NS_A, i, last_use=now - 1_000 + i) for i in range(2 * cap)]
    for start in range(0, len(since), 16):
        await manifest.append(since[start : start + 16])
    newest = sorted(since, key=lambda e: -e.last_use)[:cap]
    read = await manifest.read(namespace=NS_A.hex())
    assert read.entries == newest
    await manifest.compact()
    assert (await manifest.read(namespace=NS_A.hex())).entries == newest
    # A record a minute ahead, stored last, ranks as now: first, its stamp kept.
    later = entry(NS_A, 20_000, last_use=now + 60)
    await manifest.append([later])
    read = await manifest.read(namespace=NS_A.hex())
    assert read.entries[0] == later
    assert read.entries[1:] == newest[: cap - 1]


async def test_a_chain_evicted_while_stamped_far_ahead_is_kept_when_used_again(
    store: Store,
) -> None:
    # The eviction remembered the chain's stamp a day ahead, so the chain's next record,
    # stamped by a correct clock, counted as older and was dropped: a chain in use was lost.
    manifest = store.manifest()
    now = time.time()
    chain = 10_000
    await manifest.append([entry(NS_A, chain, last_use=now + 86_400)])
    cap = LIMITS.max_entries
    since = [entry(NS_A, i, last_use=now - 1_000 + i) for i in range(2 * cap - 1)]
    for start in range(0, len(since), 16):
        await manifest.append(since[start : start + 16])
    used = entry(NS_A, chain, last_use=now - 1)
    await manifest.append([used])
    newest = [used, *sorted(since, key=lambda e: -e.last_use)[: cap - 1]]
    assert (await manifest.read(namespace=NS_A.hex())).entries == newest
    await manifest.compact()
    assert (await manifest.read(namespace=NS_A.hex())).entries == newest
    # Nor does a record stamped far ahead that is still held hide the chain's next one.
    await manifest.append([entry(NS_B, chain, last_use=now + 86_400)])
    again = entry(NS_B, chain, last_use=now - 1)
    await manifest.append([again])
    assert (await manifest.read(namespace=NS_B.hex())).entries == [again]
    await manifest.compact()
    assert (await manifest.read(namespace=NS_B.hex())).entries == [again]


async def test_chains_of_the_same_stamp_keep_the_last_stored_on_every_backend(
    store: Store,
) -> None:
    # Of chains that tie, the one held longest made way first: the first stored where the
    # manifest is read oldest first (a file), the last stored where newest first (Redis,
    # Mooncake), so backends kept different chains, and listed them in different orders.
    manifest = store.manifest()
    cap = LIMITS.max_entries
    stored = [entry(NS_A, i, last_use=1_000.0) for i in range(3 * cap)]
    for start in range(0, len(stored), 16):
        await manifest.append(stored[start : start + 16])
    kept = stored[::-1][:cap]
    assert (await manifest.read(namespace=NS_A.hex())).entries == kept
    await manifest.compact()
    assert (await manifest.read(namespace=NS_A.hex())).entries == kept


async def test_malformed_and_oversized_records_are_skipped_and_counted(store: Store) -> None:
    manifest = store.manifest()
    good = [entry(NS_A, i) for i in range(5)]
    await manifest.append(good)
    bad_key = {"namespace": NS_A.hex(), "keys": ["xy" * 32], "num_tokens": 4}
    await store.write_raw(
        NS_A,
        [
            b"not json",
            line({"namespace": "zz", "keys": [], "num_tokens": -1}),
            line({"namespace": NS_A.hex(), "keys": ["ab" * 32], "num_tokens": 4, "v": 99}),
            line(bad_key),
            b"x" * (LIMITS.max_entry_bytes + 10),
        ],
    )
    await store.write_huge(NS_A, 3 << 19)  # 1.5 MiB: more than a record or a chunk may be
    read = await manifest.read(namespace=NS_A.hex())
    assert chains(read) == {e.chain_id for e in good}
    # The record of version 99 is no damage: one of a newer version, skipped and counted.
    assert (read.malformed, read.oversized, read.newer, read.truncated) == (3, 2, 1, False)

    report = await manifest.compact()
    # Kept by compaction for readers that know it, except in memory (see below).
    carried = 0 if store.kind == "memory" else 1
    assert (report.entries_after, report.malformed, report.oversized) == (5 + carried, 3, 2)
    read = await manifest.read(namespace=NS_A.hex())
    assert chains(read) == {e.chain_id for e in good}
    assert (read.malformed, read.oversized, read.newer) == (0, 0, carried)


async def _net_output(store: Store) -> int:
    assert isinstance(store.backend, RedisStorage)
    info = await store.backend._redis().info("stats")
    return int(info["total_net_output_bytes"])


async def test_a_manifest_far_beyond_its_limits_is_read_within_them(store: Store) -> None:
    limits = ManifestLimits(max_entries=16, max_entry_bytes=2048, max_bytes=64 << 10)
    manifest = store.manifest(limits)
    records = [encode_entry(entry(NS_A, i, priority=i % 5))[:-1] for i in range(3000)]
    assert sum(map(len, records)) > 10 * limits.max_bytes
    for start in range(0, len(records), 100):
        await store.write_raw(NS_A, records[start : start + 100])
    before = await _net_output(store) if store.kind == "redis" else 0
    read = await manifest.read(namespace=NS_A.hex())
    assert 0 < len(read.entries) <= limits.max_entries
    assert all(e.namespace == NS_A.hex() for e in read.entries)
    if store.kind == "memory":
        # The whole manifest is in this process already; the collector still keeps the bound.
        assert not read.truncated
    else:
        assert read.truncated
    if store.kind == "redis":
        # What crossed the network: the byte bound (and one record), not the 900 KB stored.
        sent = await _net_output(store) - before
        assert sent < limits.max_bytes + limits.max_entry_bytes + (16 << 10)
    report = await manifest.compact()
    assert report.entries_after <= limits.max_entries
    assert report.bytes_after <= limits.max_bytes


async def test_appends_keep_the_stored_manifest_within_its_bounds(store: Store) -> None:
    limits = ManifestLimits(max_entries=16, max_entry_bytes=2048, max_bytes=16 << 10)
    manifest = store.manifest(limits)
    for i in range(300):
        await manifest.append([entry(NS_A, i)])
    read = await manifest.read(namespace=NS_A.hex())
    assert chains(read) == {entry(NS_A, i).chain_id for i in range(300 - 16, 300)}
    record = len(encode_entry(entry(NS_A, 0)))
    if isinstance(manifest, RedisManifest):
        assert isinstance(store.backend, RedisStorage)
        client = store.backend._redis()
        assert await client.llen(manifest.list_key(NS_A.hex())) <= 2 * limits.max_entries
        nbytes = int(await client.hget(manifest.meta_key(NS_A.hex()), "bytes") or 0)
        assert nbytes <= limits.max_bytes + record
    elif isinstance(manifest, MooncakeManifest):
        index = await manifest._index(NS_A.hex())
        assert index.generation >= 1  # the 256th append compacted it
        assert await manifest._log_end(NS_A.hex(), index.stem) < 256
    elif isinstance(manifest, MemoryManifest):
        assert manifest._bytes <= limits.max_bytes + record
    else:
        assert isinstance(store.backend, FileStorage)
        size = (store.backend.root / "manifest.jsonl").stat().st_size
        assert size <= limits.max_bytes + record


async def test_compaction_is_atomic_and_idempotent(store: Store) -> None:
    manifest = store.manifest()
    await manifest.append([entry(NS_A, i, priority=i % 4) for i in range(40)])
    await manifest.append([entry(NS_A, i, priority=5, last_use=100.0 + i) for i in range(0, 40, 3)])
    await store.write_raw(NS_A, [b"garbage"])
    expected = await manifest.read(namespace=NS_A.hex())
    assert len(expected.entries) == 40
    assert expected.malformed == 1
    snapshot = {(e.chain_id, e.priority) for e in expected.entries}

    seen: list[set[tuple[str, int]]] = []

    async def reader() -> None:
        for _ in range(6):
            read = await manifest.read(namespace=NS_A.hex())
            seen.append({(e.chain_id, e.priority) for e in read.entries})

    report, *_ = await asyncio.gather(manifest.compact(), reader(), reader())
    # Every read saw the whole manifest, before or after the switch, never a partial one.
    assert len(seen) == 12
    assert all(s == snapshot for s in seen)
    assert (report.records_before, report.entries_after, report.malformed) == (55, 40, 1)

    again = await manifest.compact()
    assert (again.records_before, again.entries_after, again.malformed) == (40, 40, 0)
    third = await manifest.compact()
    assert third.bytes_after == again.bytes_after
    read = await manifest.read(namespace=NS_A.hex())
    assert {(e.chain_id, e.priority) for e in read.entries} == snapshot
    assert read.malformed == 0


async def test_records_appended_during_a_compaction_are_kept(store: Store) -> None:
    manifest = store.manifest()
    await manifest.append([entry(NS_A, i) for i in range(200)])
    late = [entry(NS_A, 1000 + i) for i in range(12)]

    async def appender() -> None:
        for item in late:
            await manifest.append([item])
            await asyncio.sleep(0)

    await asyncio.gather(manifest.compact(), appender())
    read = await manifest.read(namespace=NS_A.hex())
    assert len(read.entries) == LIMITS.max_entries
    assert {e.chain_id for e in late} <= chains(read)


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
async def test_a_read_overtaken_every_time_says_it_is_partial(
    kind: str, redis_url: str, mooncake_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = f"t{uuid.uuid4().hex}"
    backend: StorageBackend
    if kind == "redis":
        backend = RedisStorage.from_url(f"{redis_url}?prefix={prefix}")
    else:
        backend = MooncakeStorage.from_url(f"{mooncake_url}{MOONCAKE_SMALL}&prefix={prefix}")
    async with backend:
        manifest = Store(kind, backend).manifest()
        assert isinstance(manifest, RedisManifest | MooncakeManifest)
        await manifest.append([entry(NS_A, i) for i in range(8)])
        assert not (await manifest.read(namespace=NS_A.hex())).truncated
        stale = RedisStale if kind == "redis" else MooncakeStale
        original = manifest._collect
        overtaken = 0

        async def collect(*args: Any, **kwargs: Any) -> Any:
            nonlocal overtaken
            await original(*args, **kwargs)  # what it read stays in the collector
            overtaken += 1
            raise stale

        monkeypatch.setattr(manifest, "_collect", collect)
        read = await manifest.read(namespace=NS_A.hex())
        assert overtaken > 1
        assert read.truncated  # not a complete manifest that happens to hold little


async def test_namespaces_are_kept_apart(store: Store) -> None:
    manifest = store.manifest()
    await manifest.append([entry(NS_A, i) for i in range(6)] + [entry(NS_B, i) for i in range(4)])
    # A record that claims namespace B, stored among A's records, never counts for A.
    await store.write_raw(NS_A, [encode_entry(entry(NS_B, 99))[:-1]])
    for _ in range(2):
        a = await manifest.read(namespace=NS_A.hex())
        assert chains(a) == {entry(NS_A, i).chain_id for i in range(6)}
        b = await manifest.read(namespace=NS_B.hex())
        assert {entry(NS_B, i).chain_id for i in range(4)} <= chains(b)
        assert all(e.namespace == NS_B.hex() for e in b.entries)
        both = await manifest.read()
        assert chains(a) | {entry(NS_B, i).chain_id for i in range(4)} <= chains(both)
        await manifest.compact()
    assert (await manifest.read(namespace="00" * 16)).entries == []
    if store.kind in ("redis", "redis-cluster", "mooncake"):
        # A fresh reader knows no namespaces of its own: they come from the store.
        fresh = store.manifest()
        assert chains(a) | chains(b) <= chains(await fresh.read())


async def test_of_records_of_a_chain_with_the_same_use_the_later_one_wins(store: Store) -> None:
    # The same chain recorded twice in one clock tick (or with the default use, 0): every
    # backend keeps the later record, in one append or two, and a compaction keeps it too.
    manifest = store.manifest()
    await manifest.append([entry(NS_A, 1, priority=1, last_use=7.0)])
    await manifest.append([entry(NS_A, 1, priority=2, last_use=7.0)])
    pair = [entry(NS_A, 2, priority=p, last_use=7.0) for p in (3, 4)]
    await manifest.append(pair)
    await manifest.append([entry(NS_A, 3, priority=5, last_use=7.0), entry(NS_A, 4)])
    await manifest.append([entry(NS_A, 3, priority=6, last_use=7.0)])
    wanted = {entry(NS_A, 1).chain_id: 2, pair[0].chain_id: 4, entry(NS_A, 3).chain_id: 6}
    for _ in range(2):
        read = await manifest.read(namespace=NS_A.hex())
        kept = {e.chain_id: e.priority for e in read.entries if e.chain_id in wanted}
        assert kept == wanted
        await manifest.compact()


# Evolution: what an older reader does with what a newer writer recorded.


def newer_record(ns: bytes, i: int, *, v: int = 2, priority: int = 0, last_use: float) -> bytes:
    """A record of chain `i` as a writer of manifest version `v` might store it: fields this
    version does not know, spaced as another encoder spaces them."""
    keys = [
        k.hex() for k in (hashlib.sha256(b"newer:%d:%d" % (i, j) + ns).digest() for j in (0, 1))
    ]
    fields = {"namespace": ns.hex(), "keys": keys, "num_tokens": 2 * PAGE}
    fields |= {"priority": priority, "last_use": last_use, "v": v, "tokens_hash": "abc"}
    return line(fields)


def with_unknown_field(e: ManifestEntry) -> bytes:
    """The record of `e` with a field this version does not know (a newer writer's v1)."""
    return line({**msgspec.to_builtins(e), "adapter": "lora-7"})


async def test_compaction_keeps_a_newer_writers_records_byte_for_byte(store: Store) -> None:
    manifest = store.manifest()
    await manifest.append([entry(NS_A, i, last_use=1000.0 + i) for i in range(4)])
    v2 = newer_record(NS_A, 1, priority=5, last_use=2000.0)
    # Of a version that retyped the fields this one ranks by: kept, ranked lowest.
    v3 = line({"namespace": NS_A.hex(), "keys": {"root": "x"}, "priority": "high", "v": 3})
    extra = with_unknown_field(entry(NS_A, 10, last_use=2001.0))
    # A later record of chain 2 by the newer writer: merged by chain, and kept whole.
    update = with_unknown_field(entry(NS_A, 2, priority=3, last_use=3000.0))
    await store.write_raw(NS_A, [v2, v3, extra, update])
    read = await manifest.read(namespace=NS_A.hex())
    assert (read.malformed, read.newer) == (0, 2)
    assert entry(NS_A, 10).chain_id in chains(read)  # its unknown field ignored

    for _ in range(2):  # a compaction, and one of what it wrote
        report = await manifest.compact()
        raw = await store.raw_records(NS_A)
        if store.kind == "memory":
            # Appended in this process, by this version: a record of another is not kept.
            assert report.entries_after == 5
            assert {extra, update} <= set(raw)
            continue
        assert {v2, v3, extra, update} <= set(raw)
        assert encode_entry(entry(NS_A, 2, last_use=1002.0))[:-1] not in raw
        assert report.newer == 2
        assert report.entries_after == 7
        read = await manifest.read(namespace=NS_A.hex())
        assert len(read.entries) == 5
        assert (read.malformed, read.newer) == (0, 2)
        assert {e.chain_id: e.priority for e in read.entries}[entry(NS_A, 2).chain_id] == 3


async def test_a_newer_writers_records_survive_automatic_compaction(store: Store) -> None:
    # Past 16 KiB the file compacts (Redis past 32 records, memory trims). Mooncake compacts
    # at its 256th log chunk, and like every compaction reads only the newest `max_bytes`:
    # room for the whole log, so that the records written first are read at all.
    max_bytes = (1 << 20) if store.kind == "mooncake" else 16 << 10
    limits = ManifestLimits(max_entries=16, max_entry_bytes=2048, max_bytes=max_bytes)
    manifest = store.manifest(limits)
    v2 = newer_record(NS_A, 1, priority=9, last_use=9e8)
    extra = with_unknown_field(entry(NS_A, 1000, priority=9, last_use=9e8))
    await store.write_raw(NS_A, [v2, extra])
    for i in range(300):  # an older instance's ordinary backups, one entry each
        await manifest.append([entry(NS_A, i)])
    raw = await store.raw_records(NS_A)
    if store.kind != "memory":
        assert v2 in raw
    assert extra in raw
    read = await manifest.read(namespace=NS_A.hex())
    assert entry(NS_A, 1000).chain_id in chains(read)


def manifest_beyond_memory(store: Store, max_entries: int, why: str) -> WarmupManifest:
    """The manifest of `store` with room for `max_entries` of each namespace; a memory
    manifest, to which `why` does not apply, is skipped."""
    if store.kind == "memory":
        pytest.skip(why)
    limits = ManifestLimits(max_entries=max_entries, max_entry_bytes=2048, max_bytes=8 << 20)
    return store.manifest(limits)


async def test_a_newer_writers_records_are_bounded_and_ranked_like_entries(store: Store) -> None:
    manifest = manifest_beyond_memory(store, 4, "a memory manifest holds this version's only")
    await manifest.append([entry(NS_A, i, last_use=10.0 + i) for i in range(2)])
    # Chain 0 twice: the later use wins, as for entries. With room for four, chains 1 and 2
    # (uses 1 and 2) rank below the two entries and chains 0 and 3 (uses 5 and 4): they go.
    older = [newer_record(NS_A, 0, last_use=3.0)]
    kept = [newer_record(NS_A, 0, last_use=5.0), newer_record(NS_A, 3, last_use=4.0)]
    aged = [newer_record(NS_A, 1, last_use=1.0), newer_record(NS_A, 2, last_use=2.0)]
    await store.write_raw(NS_A, older + aged + kept)
    report = await manifest.compact()
    raw = await store.raw_records(NS_A)
    assert report.entries_after == 4
    assert len(raw) == 4
    assert set(kept) <= set(raw)
    assert not (set(aged) | set(older)) & set(raw)
    read = await manifest.read(namespace=NS_A.hex())
    assert chains(read) == {entry(NS_A, i).chain_id for i in range(2)}
    # Of a higher priority, a newer record outranks entries as one of this version would.
    await store.write_raw(NS_A, [newer_record(NS_A, 7, priority=1, last_use=0.5)])
    await manifest.append([entry(NS_A, 5, last_use=20.0)])
    await manifest.compact()
    raw = await store.raw_records(NS_A)
    assert newer_record(NS_A, 7, priority=1, last_use=0.5) in raw
    assert len(raw) == 4


async def test_compaction_keeps_max_entries_per_namespace(store: Store) -> None:
    manifest = manifest_beyond_memory(
        store, 16, "a memory manifest's bounds count every namespace together (documented)"
    )
    await manifest.append([entry(NS_B, i, last_use=1.0 + i) for i in range(5)])
    # A busy namespace, every chain of it more recent than the quiet one's.
    await manifest.append([entry(NS_A, i, last_use=100.0 + i) for i in range(40)])
    await manifest.compact()
    quiet = await manifest.read(namespace=NS_B.hex())
    assert chains(quiet) == {entry(NS_B, i).chain_id for i in range(5)}
    busy = await manifest.read(namespace=NS_A.hex())
    assert chains(busy) == {entry(NS_A, i).chain_id for i in range(24, 40)}


# Off the loop: the collector's work grows with the manifest, so it runs on worker threads.


class _Held:
    """Holds one collector method on the thread that calls it, until released: to act (cancel,
    append, serve other tasks) while the work runs. Without the worker thread the call would
    hold the loop, and every wait here ends at its wall-time bound instead."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()
        self.done = threading.Event()
        self.released = False
        original = getattr(ManifestCollector, name)

        def held(collector: ManifestCollector, *args: Any, **kwargs: Any) -> Any:
            self.inside.set()
            self.released = self.release.wait(10)
            try:
                return original(collector, *args, **kwargs)
            finally:
                self.done.set()

        monkeypatch.setattr(ManifestCollector, name, held)

    async def entered(self) -> bool:
        return await anyio.to_thread.run_sync(self.inside.wait, 10)

    async def finish(self) -> bool:
        """Release the work; whether it was released by this, not by its wait running out."""
        self.release.set()
        return await anyio.to_thread.run_sync(self.done.wait, 10) and self.released


async def _filled(store: Store) -> WarmupManifest:
    """A manifest with entries, a chain recorded twice, a malformed and a newer record."""
    manifest = store.manifest()
    await manifest.append([entry(NS_A, i, priority=i % 3) for i in range(30)])
    await manifest.append([entry(NS_A, 4, priority=7, last_use=100.0)])
    await store.write_raw(NS_A, [b"garbage", newer_record(NS_A, 1, last_use=50.0)])
    return manifest


async def test_reads_and_compactions_decode_and_rank_off_the_loop(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = await _filled(store)
    calls: dict[str, set[int]] = {}
    for name in ("add_line", "add_entry", "_trim", "result", "compacted"):
        original = getattr(ManifestCollector, name)

        def record(collector: Any, *args: Any, _of: Any = original, **kwargs: Any) -> Any:
            calls.setdefault(_of.__name__, set()).add(threading.get_ident())
            return _of(collector, *args, **kwargs)

        monkeypatch.setattr(ManifestCollector, name, record)
    read = await manifest.read(namespace=NS_A.hex())
    report = await manifest.compact()
    assert len(read.entries) == report.entries_after - (0 if store.kind == "memory" else 1) == 30
    assert {"result", "compacted", "add_line" if store.kind != "memory" else "add_entry"} <= set(
        calls
    )
    loop = threading.get_ident()
    assert all(loop not in threads for threads in calls.values()), calls


@pytest.mark.parametrize("name", ["result", "compacted"])
async def test_the_loop_serves_other_tasks_while_a_collector_ranks(
    store: Store, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    manifest = await _filled(store)
    held = _Held(monkeypatch, name)
    work = asyncio.ensure_future(manifest.read() if name == "result" else manifest.compact())
    # Another task runs while the ranking is under way: this one.
    assert await held.entered()
    assert not work.done()
    assert await held.finish()
    await work


async def test_a_read_cancelled_while_it_ranks_changes_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = await _filled(store)
    before = await manifest.read(namespace=NS_A.hex())
    held = _Held(monkeypatch, "result")
    read = asyncio.ensure_future(manifest.read(namespace=NS_A.hex()))
    assert await held.entered()
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert await held.finish()  # the abandoned work ends on its own
    monkeypatch.undo()
    assert await manifest.read(namespace=NS_A.hex()) == before


async def test_a_compaction_cancelled_while_it_ranks_leaves_the_manifest_whole(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = await _filled(store)
    raw = await store.raw_records(NS_A)
    before = await manifest.read(namespace=NS_A.hex())
    held = _Held(monkeypatch, "compacted")
    compaction = asyncio.ensure_future(manifest.compact())
    assert await held.entered()
    compaction.cancel()
    with pytest.raises(asyncio.CancelledError):
        await compaction
    assert await held.finish()
    monkeypatch.undo()
    assert await store.raw_records(NS_A) == raw
    assert await manifest.read(namespace=NS_A.hex()) == before
    if isinstance(store.backend, FileStorage):
        assert not list(store.backend.root.glob(".manifest.jsonl.*.tmp"))
    # Nothing of it is left holding the manifest (a lock, a count): the next one runs whole.
    report = await manifest.compact()
    assert (report.records_before, report.malformed) == (33, 1)
    # (A memory manifest keeps no newer version's record: see the evolution tests.)
    newer = 0 if store.kind == "memory" else before.newer
    after = msgspec.structs.replace(before, malformed=0, newer=newer)
    assert await manifest.read(namespace=NS_A.hex()) == after


async def test_a_memory_compaction_keeps_what_is_appended_while_it_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest = MemoryManifest(ManifestLimits(max_entries=8, max_entry_bytes=4096))
    await manifest.append([entry(NS_A, i, last_use=10.0 + i) for i in range(12)])
    manifest._add_line(b"garbage\n")
    held = _Held(monkeypatch, "compacted")
    compaction = asyncio.ensure_future(manifest.compact())
    assert await held.entered()
    # Meanwhile: a new chain, a newer record of a chain the compaction drops (too old to rank
    # among the 8 kept), another of one it keeps, an older one of a kept chain (ignored),
    # and damage.
    late = [entry(NS_A, 100, last_use=1.0), entry(NS_A, 0, priority=3, last_use=50.0)]
    late += [entry(NS_A, 11, priority=2, last_use=60.0), entry(NS_A, 10, priority=9, last_use=0.0)]
    await manifest.append(late)
    manifest._add_line(b"more garbage\n")
    assert await held.finish()
    report = await compaction
    assert (report.records_before, report.entries_after, report.malformed) == (13, 8, 1)
    held_now = {ident[1]: rank for ident, (rank, _) in manifest._held.items()}
    kept = {entry(NS_A, i).chain_id: (0, 10.0 + i) for i in range(4, 11)}  # as ranked
    kept |= {entry(NS_A, 100).chain_id: (0, 1.0), entry(NS_A, 0).chain_id: (3, 50.0)}
    kept |= {entry(NS_A, 11).chain_id: (2, 60.0)}
    assert held_now == kept
    # The counts the appends added survive the compaction; its own were reset.
    assert (await manifest.read(namespace=NS_A.hex())).malformed == 1
    again = await manifest.compact()
    # 7 records the compaction kept (one replaced since), 5 appended meanwhile.
    assert (again.records_before, again.malformed, again.entries_after) == (7 + 5, 1, 8)


# Redis: Cluster slots, no scripting, TTL.


@pytest.fixture(scope="module")
def cluster_node() -> Iterator[RedisServer]:
    """A one-node Redis Cluster: multi-key commands across slots fail with CROSSSLOT."""
    with RedisServer(
        extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    ) as server:
        client = redis.Redis(host=server.host, port=server.port)
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)  # type: ignore[no-untyped-call]
        for _ in range(200):
            info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
            if b"cluster_state:ok" in info:
                break
            time.sleep(0.05)
        client.close()
        yield server


@pytest.fixture(scope="module")
def unscripted_redis() -> Iterator[RedisServer]:
    """A redis-server that refuses scripts, as some proxies do."""
    hidden = ["--rename-command", "EVALSHA", f"x{uuid.uuid4().hex}"]
    hidden += ["--rename-command", "EVAL", f"x{uuid.uuid4().hex}"]
    hidden += ["--rename-command", "EVAL_RO", f"x{uuid.uuid4().hex}"]
    with RedisServer(extra_args=hidden) as server:
        yield server


def test_a_namespaces_keys_share_one_cluster_slot() -> None:
    manifest = RedisManifest(Redis, prefix="hicache", name="redis")  # builds, never connects
    ns = NS_A.hex()
    slots = {key_slot(k.encode()) for k in (manifest.list_key(ns), manifest.meta_key(ns))}
    slots.add(key_slot(f"{manifest.list_key(ns)}:compacting:0123".encode()))
    assert len(slots) == 1
    assert key_slot(manifest.list_key(NS_B.hex()).encode()) not in slots


@pytest.mark.parametrize("server", ["cluster", "unscripted"])
async def test_redis_manifest_on_a_cluster_and_without_scripting(
    server: str, cluster_node: RedisServer, unscripted_redis: RedisServer
) -> None:
    node = cluster_node if server == "cluster" else unscripted_redis
    url = f"{node.url}?prefix=t{uuid.uuid4().hex}&multikey=0"
    async with RedisStorage.from_url(url) as backend:
        manifest = backend.manifest(LIMITS)
        await manifest.append([entry(NS_A, i) for i in range(100)])
        await manifest.append([entry(NS_B, i, priority=1) for i in range(3)])
        await backend._redis().rpush(manifest.list_key(NS_A.hex()), b"junk", b"y" * 5000)
        read = await manifest.read(namespace=NS_A.hex())
        assert len(read.entries) == LIMITS.max_entries
        assert (read.malformed, read.oversized) == (1, 1)
        report = await manifest.compact()
        assert (report.entries_after, report.malformed, report.oversized) == (67, 1, 1)
        assert (await manifest.read(namespace=NS_A.hex())).entries == read.entries
        everything = await manifest.read()  # both namespaces, still max_entries in all
        assert len(everything.entries) == LIMITS.max_entries
        assert {entry(NS_B, i).chain_id for i in range(3)} <= chains(everything)
        assert manifest._scripting is (server == "cluster")


@pytest.mark.parametrize("scripts", [True, False])
@pytest.mark.parametrize("ttl", [None, 3600])
async def test_redis_manifest_follows_the_page_ttl(
    redis_url: str, unscripted_redis: RedisServer, ttl: int | None, scripts: bool
) -> None:
    query = f"prefix=t{uuid.uuid4().hex}" + (f"&ttl={ttl}" if ttl else "")
    base = redis_url if scripts else unscripted_redis.url
    async with RedisStorage.from_url(f"{base}?{query}") as backend:
        manifest = backend.manifest(LIMITS)
        client = backend._redis()
        await manifest.append([entry(NS_A, i) for i in range(5)])
        key, meta = manifest.list_key(NS_A.hex()), manifest.meta_key(NS_A.hex())
        if ttl is not None:
            await client.expire(meta, 5)  # as if the last append was long ago
        await manifest.compact()  # built under a temporary key that expires on its own
        remaining = [await client.ttl(key), await client.ttl(meta)]
        if ttl is None:
            assert remaining == [-1, -1]
        else:
            # The meta hash is refreshed with the list: expiring first, it would reset `gen`.
            assert all(5 < left <= ttl for left in remaining)
        assert await client.keys(f"{key}:compacting:*") == []


async def test_redis_manifest_that_vanishes_mid_read_ends_the_read(redis_url: str) -> None:
    async with RedisStorage.from_url(f"{redis_url}?prefix=t{uuid.uuid4().hex}") as backend:
        manifest = backend.manifest(LIMITS)
        client = backend._redis()
        ns = NS_A.hex()
        await manifest.append([entry(NS_A, i) for i in range(5)])  # never compacted: gen 0
        snapshot = manifest._snapshot

        async def then_expire(namespace: str) -> tuple[bytes, int]:
            # The list and its meta expire (or are deleted) right after the snapshot.
            taken = await snapshot(namespace)
            await client.delete(manifest.list_key(ns), manifest.meta_key(ns))
            return taken

        manifest._snapshot = then_expire  # type: ignore[method-assign]
        read = await asyncio.wait_for(manifest.read(namespace=ns), 10)
        assert read.entries == []


async def test_redis_manifest_index_keeps_live_namespaces_only(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hicache_async.storage._manifest_redis as manifest_redis

    async with RedisStorage.from_url(f"{redis_url}?prefix=t{uuid.uuid4().hex}") as backend:
        manifest = backend.manifest(LIMITS)
        assert isinstance(manifest, RedisManifest)
        client = backend._redis()
        spaces = [bytes([n]) * 16 for n in range(5)]
        for ns in spaces:
            await manifest.append([entry(ns, 0)])
        # Two lists go (expired with a ttl, or deleted): their namespaces leave the index at
        # the next read instead of piling up in it.
        for ns in spaces[:2]:
            await client.delete(manifest.list_key(ns.hex()), manifest.meta_key(ns.hex()))
        read = await manifest.read()
        assert {e.namespace for e in read.entries} == {ns.hex() for ns in spaces[2:]}
        assert not read.truncated
        members = {m.decode() for m in await client.smembers(manifest.index_key)}
        assert members == {ns.hex() for ns in spaces[2:]}
        # Past the bound on namespaces, the read says it did not read everything.
        monkeypatch.setattr(manifest_redis, "_MAX_NAMESPACES", 2)
        bounded = await manifest.read()
        assert bounded.truncated
        assert len({e.namespace for e in bounded.entries}) == 2
        monkeypatch.undo()
        # An index lost (evicted, flushed) is rebuilt by the next append of each namespace.
        await client.delete(manifest.index_key)
        await manifest.append([entry(spaces[4], 1)])
        assert {e.namespace for e in (await manifest.read()).entries} == {spaces[4].hex()}


@pytest.fixture(params=[True, False], ids=["scripts", "no-scripts"])
async def redis_backend(
    request: pytest.FixtureRequest, redis_url: str, unscripted_redis: RedisServer
) -> AsyncIterator[RedisStorage]:
    """A RedisStorage under a prefix of its own, on a server with scripting and on one
    without."""
    base = redis_url if request.param else unscripted_redis.url
    async with RedisStorage.from_url(f"{base}?prefix=t{uuid.uuid4().hex}") as backend:
        yield backend


async def test_redis_manifest_with_a_non_numeric_byte_count_stays_usable(
    redis_backend: RedisStorage,
) -> None:
    manifest = redis_backend.manifest(LIMITS)
    client = redis_backend._redis()
    meta = manifest.meta_key(NS_A.hex())
    await manifest.append([entry(NS_A, i) for i in range(3)])
    await client.hset(meta, "bytes", "notanumber")  # type: ignore[misc]
    # Only a statistic: compaction counts it as 0 and writes it afresh.
    report = await manifest.compact_namespace(NS_A.hex())
    assert (report.bytes_before, report.entries_after) == (0, 3)
    assert int(await client.hget(meta, "bytes")) == report.bytes_after  # type: ignore[misc]
    # An append that meets it (HINCRBY refuses it) keeps its records and repairs it.
    await client.hset(meta, "bytes", "notanumber")  # type: ignore[misc]
    await manifest.append([entry(NS_A, 3)])
    assert len((await manifest.read(namespace=NS_A.hex())).entries) == 4
    assert int(await client.hget(meta, "bytes")) > 0  # type: ignore[misc]


async def test_a_non_integer_redis_manifest_generation_is_reset_and_moved_on(
    redis_backend: RedisStorage,
) -> None:
    manifest = redis_backend.manifest(ManifestLimits(max_entries=4, max_entry_bytes=4096))
    assert isinstance(manifest, RedisManifest)
    client = redis_backend._redis()
    ns = NS_A.hex()
    meta, key = manifest.meta_key(ns), manifest.list_key(ns)

    async def gen() -> bytes:
        value = await client.hget(meta, "gen")  # type: ignore[misc]
        assert isinstance(value, bytes)
        return value

    await manifest.append([entry(NS_A, i) for i in range(3)])
    # Another client's write: HINCRBY refuses it. A compaction replaces the list and moves
    # the generation on (readers compare it), every time, not only once.
    for damage in (b"garbage", b"1.5", b"007", b"9223372036854775807"):
        await client.hset(meta, "gen", damage)  # type: ignore[misc]
        await manifest.compact_namespace(ns)
        moved = await gen()
        assert moved.isdigit()
        assert moved != damage
    assert {e.chain_id for e in (await manifest.read(namespace=ns)).entries} == {
        entry(NS_A, i).chain_id for i in range(3)
    }
    # The trim of an append (the list past 4 x max_entries) moves it on too.
    await client.rpush(key, *[encode_entry(entry(NS_A, i))[:-1] for i in range(20)])  # type: ignore[misc]
    await client.hset(meta, "gen", b"garbage")  # type: ignore[misc]
    await manifest._trim(ns)
    assert await client.llen(key) == 16  # type: ignore[misc]
    assert (await gen()).isdigit()
    # So does the repair of a list of another type.
    await client.delete(key)
    await client.set(key, b"not ours")
    await client.hset(meta, "gen", b"garbage")  # type: ignore[misc]
    await manifest.append([entry(NS_A, 20)])
    assert (await gen()).isdigit()
    assert [e.chain_id for e in (await manifest.read(namespace=ns)).entries] == [
        entry(NS_A, 20).chain_id
    ]


async def test_a_redis_compaction_goes_on_past_a_namespace_that_fails(
    redis_backend: RedisStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = redis_backend.manifest(LIMITS)
    assert isinstance(manifest, RedisManifest)
    client = redis_backend._redis()
    spaces = sorted([NS_A, NS_B, bytes(range(32, 48))], key=bytes.hex)
    for ns in spaces:
        for i in range(3):  # the same chain three times: compaction keeps one record
            await manifest.append([entry(ns, 0, last_use=float(i))])
    compact_namespace = manifest.compact_namespace

    async def first_fails(namespace: str) -> Any:
        if namespace == spaces[0].hex():
            raise StorageError("node down")
        return await compact_namespace(namespace)

    monkeypatch.setattr(manifest, "compact_namespace", first_fails)
    with structlog.testing.capture_logs() as logs, pytest.raises(StorageError, match="1 of 3"):
        await manifest.compact()
    failed = [e["namespace"] for e in logs if e["event"] == "hicache.manifest.compact_failed"]
    assert failed == [spaces[0].hex()]
    lengths = [await client.llen(manifest.list_key(ns.hex())) for ns in spaces]  # type: ignore[misc]
    assert lengths == [3, 1, 1]


@pytest.mark.parametrize("damaged", ["list", "meta"])
async def test_a_damaged_redis_manifest_namespace_spares_the_others(
    redis_backend: RedisStorage, damaged: str
) -> None:
    manifest = redis_backend.manifest(LIMITS)
    client = redis_backend._redis()
    ns = NS_A.hex()
    await manifest.append([entry(NS_A, 0), entry(NS_B, 1)])
    # Another client's string where the namespace's list or meta hash should be: every
    # command on it answers WRONGTYPE.
    key = manifest.list_key(ns) if damaged == "list" else manifest.meta_key(ns)
    await client.delete(key)
    await client.set(key, b"not ours")
    with structlog.testing.capture_logs() as logs:
        read = await manifest.read()
    assert {e.namespace for e in read.entries} == {NS_B.hex()}
    assert read.malformed == 1
    assert [e["namespace"] for e in logs if e["event"] == "hicache.manifest.damaged"] == [ns]
    # The next append to it removes the damaged key and stores its records.
    with structlog.testing.capture_logs() as logs:
        await manifest.append([entry(NS_A, 2)])
    assert [e["removed"] for e in logs if e["event"] == "hicache.manifest.repaired"] == [[key]]
    chains = {e.chain_id for e in (await manifest.read(namespace=ns)).entries}
    assert entry(NS_A, 2).chain_id in chains
    # A compaction repairs it too, and compacts every namespace.
    await client.delete(key)
    await client.set(key, b"not ours")
    report = await manifest.compact()
    assert report.entries_after >= 1
    read = await manifest.read()
    assert read.malformed == 0
    assert NS_B.hex() in {e.namespace for e in read.entries}


# Mooncake: index validation, the compaction lock.


async def test_mooncake_ignores_a_forged_index(mooncake_url: str) -> None:
    url = f"{mooncake_url}{MOONCAKE_SMALL}&prefix=t{uuid.uuid4().hex}"
    async with MooncakeStorage.from_url(url) as backend:
        manifest = backend.manifest(LIMITS)
        await manifest.append([entry(NS_A, i) for i in range(4)])
        ns = NS_A.hex()
        # An index that points outside the namespace's objects, and one that is not JSON.
        forged = {"v": 1, "namespace": ns, "generation": 1, "stem": "../other", "base": 1}
        store, config = backend._store, manifest._replicate_config()
        for slot, value in ((1, json.dumps(forged).encode()), (0, b"\xff{")):
            name = manifest.object_name(ns, f"index.{slot}")

            def put(stop: object, name: str = name, value: bytes = value) -> int:
                return int(store.put(name, value, config))

            assert await backend.run_job(put) == 0
        read = await manifest.read(namespace=ns)
        assert chains(read) == {entry(NS_A, i).chain_id for i in range(4)}
        assert (await manifest._index(ns)).generation == 0


async def test_mooncake_leaves_a_manifest_of_a_newer_index_layout_alone(
    mooncake_url: str,
) -> None:
    # A newer release that changed the index's layout (its `v`) keeps this namespace's
    # manifest in objects this one would misread. Taking it for a namespace without an index
    # would append where no reader looks, and compact into the newer index's slot, then
    # sweep away its chunks.
    url = f"{mooncake_url}{MOONCAKE_SMALL}&prefix=t{uuid.uuid4().hex}"
    async with MooncakeStorage.from_url(url) as backend:
        manifest = backend.manifest(LIMITS)
        ns = NS_A.hex()
        await manifest.append([entry(NS_B, 0)])
        stem = f"g1-{'ab' * 8}"
        index = json.dumps({"v": 2, "namespace": ns, "generation": 1, "root": stem}).encode()
        chunk = _with_token(encode_entry(entry(NS_A, 0)))
        lock = b'{"holder": "a newer compaction"}'  # not a lock of this release's layout
        names = [manifest.object_name(ns, name) for name in ("index.1", f"{stem}:b0", "lock")]
        store, config = backend._store, manifest._replicate_config()
        for name, value in zip(names, (index, chunk, lock), strict=True):

            def put(stop: object, name: str = name, value: bytes = value) -> int:
                return int(store.put(name, value, config))

            assert await backend.run_job(put) == 0
        with structlog.testing.capture_logs() as logs:
            await manifest.append([entry(NS_A, 1)])
            read = await manifest.read()
            report = await manifest.compact()
        assert chains(read) == {entry(NS_B, 0).chain_id}
        assert (read.newer, report.newer) == (1, 1)
        assert await manifest._get(names, manifest.chunk_bytes) == [index, chunk, lock]
        assert await manifest._log_end(ns, "g0") == 0  # nothing appended beside it
        steps = [e["step"] for e in logs if e["event"] == "hicache.manifest.newer_layout"]
        assert steps == ["append", "read", "compaction"]
        assert chains(await manifest.read(namespace=NS_B.hex())) == {entry(NS_B, 0).chain_id}


async def test_mooncake_many_concurrent_appends_all_land(mooncake_url: str) -> None:
    # Every appender starts from the same end of the log; more of them than one round of
    # claims must still each find a chunk.
    url = f"{mooncake_url}{MOONCAKE_SMALL}&prefix=t{uuid.uuid4().hex}"
    async with MooncakeStorage.from_url(url) as one, MooncakeStorage.from_url(url) as two:
        manifests = [one.manifest(LIMITS), two.manifest(LIMITS)]
        entries = [entry(NS_A, i) for i in range(24)]
        await asyncio.gather(*(manifests[i % 2].append([e]) for i, e in enumerate(entries)))
        read = await manifests[0].read(namespace=NS_A.hex())
        assert chains(read) == {e.chain_id for e in entries}


async def test_mooncake_compactions_exclude_each_other(mooncake_url: str) -> None:
    url = f"{mooncake_url}{MOONCAKE_SMALL}&prefix=t{uuid.uuid4().hex}"
    async with MooncakeStorage.from_url(url) as backend:
        manifest = backend.manifest(LIMITS)
        await manifest.append([entry(NS_A, i) for i in range(4)])
        token = await manifest._lock(NS_A.hex())
        assert token is not None
        with pytest.raises(StorageError, match="another compaction"):
            await manifest.compact_namespace(NS_A.hex())
        await manifest._unlock(NS_A.hex(), token)
        report = await manifest.compact_namespace(NS_A.hex())
        assert report.entries_after == 4


async def test_a_mooncake_lock_expiring_beyond_its_lifetime_is_broken(
    mooncake_url: str,
) -> None:
    # A lock's expiry is its holder's wall clock plus the lock's lifetime (300 s). One that
    # expires more than a lifetime later than one taken now came from a clock that ran
    # ahead (a host booted with a wrong time) or from before this clock stepped back: left
    # by a compaction that died, it held off every compaction of the namespace until that
    # time came, while the log, hard-pinned, kept growing.
    url = f"{mooncake_url}{MOONCAKE_SMALL}&prefix=t{uuid.uuid4().hex}"
    async with MooncakeStorage.from_url(url) as backend:
        manifest = backend.manifest(LIMITS)
        ns = NS_A.hex()
        await manifest.append([entry(NS_A, i) for i in range(4)])
        name = manifest.object_name(ns, "lock")
        store, config = backend._store, manifest._replicate_config()

        async def plant(expires: float) -> None:
            value = json.dumps({"token": "ab" * 8, "expires": expires}).encode()

            def put(stop: object) -> int:
                return int(store.put(name, value, config))

            assert await backend.run_job(put) == 0

        # From a clock up to a lock's lifetime ahead of this one: a compaction may still
        # hold it.
        await plant(time.time() + 2 * 300 - 60)
        with pytest.raises(StorageError, match="another compaction"):
            await manifest.compact_namespace(ns)
        await manifest._remove([name])
        await plant(time.time() + 86_400)  # a day ahead
        with structlog.testing.capture_logs() as logs:
            report = await manifest.compact_namespace(ns)
        assert report.entries_after == 4
        assert [e["event"] for e in logs].count("hicache.manifest.lock_broken") == 1
        assert (await manifest._get([name], 1024))[0] is None  # released after the compaction


async def test_a_mooncake_compaction_sweeps_only_its_own_chunk_names(mooncake_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}"
    # Another client whose prefix starts with this one's manifest lead for NS_A.
    other_url = f"{mooncake_url}{MOONCAKE_SMALL}&prefix={prefix}:manifest:{NS_A.hex()}"
    async with (
        MooncakeStorage.from_url(f"{mooncake_url}{MOONCAKE_SMALL}&prefix={prefix}") as backend,
        MooncakeStorage.from_url(other_url) as other,
    ):
        keys = [hashlib.sha256(b"page %d" % i).digest() for i in range(4)]
        pages = [[memoryview(bytes([i]) * 4096)] for i in range(4)]
        metas = [PageMeta(key=k, namespace=NS_A, num_tokens=16, priority=0) for k in keys]
        assert set(await other.put(keys, pages, metas)) == {Outcome.OK}
        manifest = backend.manifest(LIMITS)
        await manifest.append([entry(NS_A, i) for i in range(4)])
        # A chunk of a generation nobody refers to (a compaction that died), and an object
        # under the lead of a form the manifest never writes.
        stray = manifest.object_name(NS_A.hex(), "g7-0123456789abcdef:l0")
        foreign = manifest.object_name(NS_A.hex(), "notes")
        store, config = backend._store, manifest._replicate_config()
        for name in (stray, foreign):
            code = await backend.run_job(lambda stop, name=name: store.put(name, b"x", config))
            assert code == 0
        report = await manifest.compact_namespace(NS_A.hex())
        assert report.entries_after == 4
        assert await manifest._exist([stray, foreign]) == [False, True]
        assert len(await other.list_pages()) == 4
        got = await other.get(keys, [[bytearray(4096)] for _ in keys], namespace=NS_A)
        assert set(got) == {Outcome.OK}


async def test_mooncake_records_appended_during_a_switch_survive_a_compaction_that_died(
    mooncake_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process appends to the old log while the compaction switches (acknowledged:
    # the stem had not changed yet), and the compacting process dies before copying it over.
    url = f"{mooncake_url}{MOONCAKE_SMALL}&prefix=t{uuid.uuid4().hex}"
    ns = NS_A.hex()
    async with MooncakeStorage.from_url(url) as backend:
        manifest, other = backend.manifest(LIMITS), backend.manifest(LIMITS)
        assert isinstance(manifest, MooncakeManifest)
        await manifest.append([entry(NS_A, i) for i in range(4)])
        late = entry(NS_A, 99)
        switch, lines = manifest._switch, manifest._lines
        calls = 0

        async def appending_switch(*args: Any) -> bool:
            await other.append([late])
            return await switch(*args)

        async def dying_lines(*args: Any) -> list[bytes]:
            nonlocal calls
            calls += 1
            if calls == 2:  # the copy of what arrived during the switch
                raise RuntimeError("the compacting process died here")
            return await lines(*args)

        monkeypatch.setattr(manifest, "_switch", appending_switch)
        monkeypatch.setattr(manifest, "_lines", dying_lines)
        with pytest.raises(RuntimeError, match="died"):
            await manifest.compact_namespace(ns)
        assert calls == 2
        index = await other._index(ns)
        assert index.generation == 1  # the switch happened
        assert late.chain_id in chains(await other.read(namespace=ns))
        # The next compaction folds the carried records in and removes the old log.
        report = await other.compact_namespace(ns)
        assert report.entries_after == 5
        after = await other._index(ns)
        assert after.generation == 2
        assert await other._carried(ns, after) == []
        assert await other._carried(ns, index) == []
        assert chains(await other.read(namespace=ns)) == {
            entry(NS_A, i).chain_id for i in [0, 1, 2, 3, 99]
        }


async def test_mooncake_ignores_an_index_whose_carry_is_forged(mooncake_url: str) -> None:
    url = f"{mooncake_url}{MOONCAKE_SMALL}&prefix=t{uuid.uuid4().hex}"
    ns = NS_A.hex()
    async with MooncakeStorage.from_url(url) as backend:
        manifest = backend.manifest(LIMITS)
        assert isinstance(manifest, MooncakeManifest)
        await manifest.append([entry(NS_A, 1)])
        await manifest.compact_namespace(ns)
        index = await manifest._index(ns)
        for carry, carry_from in ((index.stem, 0), ("g7-" + "0" * 16, 0), ("g0", -1), ("", 3)):
            forged = msgspec.structs.replace(index, carry=carry, carry_from=carry_from)
            raw = msgspec.json.encode(forged)
            assert manifest._valid_index(raw, ns, index.generation % 2) is None
        assert manifest._valid_index(msgspec.json.encode(index), ns, index.generation % 2)


# A HiCache warms up from what another one backed up to Redis.


def _config(**overrides: Any) -> CacheConfig:
    base: dict[str, Any] = {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "page_size": PAGE,
        "device_pages": 64,
        "host_pages": 512,
        "model_id": "manifest-e2e",
        "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
        "backup": {"retry_backoff_s": 0.001},
    }
    base.update(overrides)
    return CacheConfig.from_dict(base)


async def test_a_cold_instance_warms_up_from_redis_and_serves_from_its_host_pool(
    redis_url: str,
) -> None:
    url = f"{redis_url}?prefix=t{uuid.uuid4().hex}"
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 50_000, size=int(rng.integers(3, 12)) * PAGE + 2) for _ in range(10)]
    generator = KVGenerator(_config().layout, PAGE, seed=3)
    async with HiCache(_config(), storage=url) as first:
        for prompt in prompts:
            served = await serve(first, prompt, generator)
            assert served.computed_tokens == len(prompt)
        await first.drain()
        status = first.storage_status()
        assert status.backup is not None
        assert status.backup.manifest_entries >= len(prompts)

    config = _config(warmup={"enabled": True, "ratio": 1.0})
    async with HiCache(config, storage=url) as second:
        result = await second.wait_warmup()
        assert result is not None
        assert result.status is WarmupStatus.COMPLETE
        assert result.pages_loaded == sum(len(p) // PAGE for p in prompts)
        assert (result.malformed, result.oversized) == (0, 0)
        for prompt in prompts:
            served = await serve(second, prompt, generator, check="all")
            assert served.host_tokens == len(prompt) // PAGE * PAGE
            assert served.storage_tokens == 0
            assert served.checked_pages == len(prompt) // PAGE
        await second.drain()
        for node in second.tree.iter_nodes():
            assert node.lock_ref == 0
            assert node.host_ref == 0


class _RaceAfter:
    """A client whose first command that `picked(name, args)` chooses, sent on its own or run
    at once under WATCH, lets `meanwhile` run right after it: what another writer may do
    between a read and what follows it."""

    def __init__(
        self,
        client: Any,
        meanwhile: Callable[[], Awaitable[None]],
        picked: Callable[[str, tuple[Any, ...]], bool],
    ) -> None:
        self._client = client
        self._meanwhile: Callable[[], Awaitable[None]] | None = meanwhile
        self._picked = picked

    async def _after(self) -> None:
        if self._meanwhile is not None:
            run, self._meanwhile = self._meanwhile, None
            await run()

    def _wrapped(self, name: str, attr: Any, queue: object) -> Any:
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            if result is queue or not self._picked(name, args):
                return result  # queued in a pipeline, or not the command picked

            async def then() -> Any:
                value = await result
                await self._after()
                return value

            return then()

        return call

    def pipeline(self, transaction: bool = True) -> Any:
        race = self
        inner = self._client.pipeline(transaction=transaction)

        class Pipe:
            async def __aenter__(self) -> Pipe:
                await inner.__aenter__()
                return self

            async def __aexit__(self, *exc: object) -> None:
                await inner.__aexit__(*exc)

            def __getattr__(self, name: str) -> Any:
                return race._wrapped(name, getattr(inner, name), inner)

        return Pipe()

    def __getattr__(self, name: str) -> Any:
        return self._wrapped(name, getattr(self._client, name), None)


async def test_a_redis_manifest_repair_never_removes_a_list_repaired_meanwhile(
    redis_url: str,
) -> None:
    prefix = f"t{uuid.uuid4().hex}"
    async with (
        RedisStorage.from_url(f"{redis_url}?prefix={prefix}") as one,
        RedisStorage.from_url(f"{redis_url}?prefix={prefix}") as two,
    ):
        first, second = one.manifest(LIMITS), two.manifest(LIMITS)
        first._scripting_chosen = False  # the path that checks, then deletes
        ns = NS_A.hex()
        key = first.list_key(ns)
        client = one._redis()
        await client.set(key, b"not ours")
        # Another writer repairs the list and appends to it between this one's check and its
        # delete: what it appended must stay.
        plain = first._client
        first._client = lambda: _RaceAfter(
            plain(),
            lambda: second.append([entry(NS_A, 100)]),
            lambda name, args: name == "type" and str(args[0]).endswith(":meta"),
        )
        await first.append([entry(NS_A, 1)])
        chains = {e.chain_id for e in (await second.read(namespace=ns)).entries}
        assert entry(NS_A, 100).chain_id in chains
        assert entry(NS_A, 1).chain_id in chains


async def test_a_redis_manifest_trim_reads_and_resets_a_damaged_gen_in_one_step(
    redis_backend: RedisStorage,
) -> None:
    # A compaction that moved a damaged `gen` on between the trim's read of it and its reset
    # was undone by that reset: the list trimmed after it, under the generation a reader had
    # seen after the compaction.
    limits = ManifestLimits(max_entries=4, max_entry_bytes=4096)
    manifest, other = redis_backend.manifest(limits), redis_backend.manifest(limits)
    client = redis_backend._redis()
    ns = NS_A.hex()
    meta, key = manifest.meta_key(ns), manifest.list_key(ns)
    records = [encode_entry(entry(NS_A, i))[:-1] for i in range(20)]
    await client.rpush(key, *records)  # type: ignore[misc]
    await client.hset(meta, "gen", b"garbage")  # type: ignore[misc]
    seen: dict[str, Any] = {}

    async def compact_and_append() -> None:
        await other.compact_namespace(ns)  # moves the damaged gen on: reset, then 1
        await client.rpush(key, *records)  # type: ignore[misc]  # past the cap again
        seen["gen"] = await client.hget(meta, "gen")  # type: ignore[misc]
        seen["list"] = await client.lrange(key, 0, -1)  # type: ignore[misc]

    plain = manifest._client
    manifest._client = lambda: _RaceAfter(
        plain(), compact_and_append, lambda name, args: name == "hget" and args[1:] == ("gen",)
    )
    await manifest._trim(ns)
    gen = await client.hget(meta, "gen")  # type: ignore[misc]
    assert isinstance(gen, bytes)
    assert gen.isdigit()
    assert await client.llen(key) == 16  # type: ignore[misc]
    if seen:  # read apart from the script (without scripting: under WATCH)
        assert gen != seen["gen"] or await client.lrange(key, 0, -1) == seen["list"]  # type: ignore[misc]


async def test_a_redis_cluster_manifest_trims_without_scripting(redis_cluster_url: str) -> None:
    # Without scripting the trim watches the namespace's keys on plain connections to their
    # node (redis-py's cluster pipeline would block the loop through WATCH).
    url = f"{redis_cluster_url}&prefix=t{uuid.uuid4().hex}"
    async with RedisStorage.from_url(url) as backend:
        manifest = backend.manifest(ManifestLimits(max_entries=4, max_entry_bytes=4096))
        manifest._scripting_chosen = False
        client = backend._redis()
        ns = NS_A.hex()
        meta, key = manifest.meta_key(ns), manifest.list_key(ns)
        await client.rpush(key, *[encode_entry(entry(NS_A, i))[:-1] for i in range(20)])  # type: ignore[misc]
        await client.hset(meta, "gen", b"garbage")  # type: ignore[misc]
        await manifest._trim(ns)
        assert await client.llen(key) == 16  # type: ignore[misc]
        assert await client.hget(meta, "gen") == b"1"  # type: ignore[misc]
        await manifest._trim(ns)  # within the cap: nothing to do, gen stays
        assert await client.hget(meta, "gen") == b"1"  # type: ignore[misc]


async def test_a_redis_manifest_is_read_through_a_client_pause_write(redis_url: str) -> None:
    # FAILOVER and a manual cluster failover pause writes for seconds: the window script
    # only reads and says so, or Redis 7 held it (the read failed after `timeout`).
    admin = Redis.from_url(redis_url)
    try:
        async with RedisStorage.from_url(f"{redis_url}?prefix=t{uuid.uuid4().hex}") as backend:
            manifest = backend.manifest(LIMITS)
            written = [entry(NS_A, i) for i in range(10)]
            await manifest.append(written)
            assert len((await manifest.read(namespace=NS_A.hex())).entries) == 10
            # Not cached by the server (a restart, SCRIPT FLUSH): an EVALSHA would be held
            # for the pause before it could answer NOSCRIPT.
            await admin.script_flush()
            await admin.execute_command("CLIENT", "PAUSE", 30000, "WRITE")
            try:
                read = await asyncio.wait_for(manifest.read(namespace=NS_A.hex()), 10)
                everything = await asyncio.wait_for(manifest.read(), 10)
            finally:
                await admin.execute_command("CLIENT", "UNPAUSE")
            assert sorted(read.entries, key=lambda e: e.last_use) == written
            assert chains(everything) == chains(read)
    finally:
        await admin.aclose()


@pytest.mark.parametrize("scripts", [True, False], ids=["scripts", "no-scripts"])
async def test_a_redis_manifest_is_read_from_a_server_at_its_maxmemory(scripts: bool) -> None:
    # Under noeviction (Redis's default policy) a full server still serves every page, but
    # refuses to queue commands in MULTI: warmup read nothing from it.
    hidden = [] if scripts else _hidden("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO")
    with RedisServer(extra_args=hidden) as server:
        async with RedisStorage.from_url(f"{server.url}?prefix=full") as backend:
            manifest = backend.manifest(LIMITS)
            written = [entry(NS_A, i) for i in range(40)]
            await manifest.append(written)
            admin = Redis(host=server.host, port=server.port)
            try:
                await admin.config_set("maxmemory-policy", "noeviction")
                await admin.config_set("maxmemory", 1)
                with pytest.raises(StorageError, match="maxmemory"):
                    await manifest.append([entry(NS_A, 99)])  # full indeed
                read = await manifest.read(namespace=NS_A.hex())
                everything = await manifest.read()
            finally:
                await admin.config_set("maxmemory", 0)
                await admin.aclose()
            assert sorted(read.entries, key=lambda e: e.last_use) == written
            assert chains(everything) == chains(read)
            assert manifest._scripting is scripts


@pytest.mark.parametrize("scripts", [True, False], ids=["scripts", "no-scripts"])
async def test_a_failed_redis_compaction_is_not_tried_again_at_every_append(scripts: bool) -> None:
    # A server with room for the manifest's appends but not for a compaction's copy of the
    # list (refused, or evicted under volatile-lru as the only key with a TTL): every append
    # past the bound read the whole list for a compaction that failed again.
    hidden = [] if scripts else _hidden("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO")
    limits = ManifestLimits(max_entries=64, max_entry_bytes=64 << 10, max_bytes=64 << 20)
    backoff = limits.max_entries // 2
    # Records of about 10 KiB, ranked first: a compaction keeps them, so its copy of the list
    # is far larger than what the server's memory does besides.
    big = [
        chain_entry(NS_A, [hashlib.sha256(b"%d:%d" % (i, j)).digest() for j in range(150)],
                    150 * PAGE, 1, float(i))
        for i in range(2 * limits.max_entries)
    ]  # fmt: skip
    with RedisServer(extra_args=hidden) as server:
        admin = Redis(host=server.host, port=server.port)
        try:
            async with RedisStorage.from_url(f"{server.url}?prefix=stayfull") as backend:
                manifest = backend.manifest(limits)
                key = manifest.list_key(NS_A.hex())
                # A compaction of another namespace first: what it sets up on the server
                # (its scripts) takes memory once.
                await manifest.append([entry(NS_B, i) for i in range(2 * limits.max_entries + 1)])
                assert await admin.llen(manifest.list_key(NS_B.hex())) <= limits.max_entries
                await manifest.append(big)  # at the bound: no compaction yet
                usage = await admin.memory_usage(key)
                assert usage is not None
                used = (await admin.info("memory"))["used_memory"]
                await admin.config_set("maxmemory-policy", "volatile-lru")
                await admin.config_set("maxmemory", used + usage // 3)
                with structlog.testing.capture_logs() as logs:
                    for i in range(backoff):
                        await manifest.append([entry(NS_A, 1000 + i)])
                failed = [e for e in logs if e["event"] == "hicache.manifest.compact_failed"]
                assert len(failed) == 1, failed
                # The next record ends the back-off: with room again, the list is compacted.
                await admin.config_set("maxmemory", 0)
                assert await admin.llen(key) == 2 * limits.max_entries + backoff
                with structlog.testing.capture_logs() as logs:
                    await manifest.append([entry(NS_A, 2000)])
                assert not [e for e in logs if e["event"] == "hicache.manifest.compact_failed"]
                assert await admin.llen(key) <= limits.max_entries
                read = await manifest.read(namespace=NS_A.hex())
                assert len(read.entries) == await admin.llen(key)
                assert manifest._scripting is scripts
        finally:
            await admin.config_set("maxmemory", 0)
            await admin.aclose()


@pytest.mark.parametrize("scripts", [True, False], ids=["scripts", "no-scripts"])
async def test_a_compaction_whose_temporary_list_is_evicted_leaves_the_manifest(
    scripts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under a volatile-* policy the compaction's temporary list (it has a TTL) is the first
    # key a full server evicts, the pages and the manifest having none; under allkeys-* it
    # can go too. The switch took a missing temporary list for an empty compaction and
    # deleted the manifest: every record was lost.
    hidden = [] if scripts else _hidden("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO")
    limits = ManifestLimits(max_entries=2048, max_entry_bytes=4096, max_bytes=8 << 20)
    with RedisServer(extra_args=hidden) as server:
        admin = Redis(host=server.host, port=server.port)
        async with RedisStorage.from_url(f"{server.url}?prefix=evicted") as backend:
            manifest = backend.manifest(limits)
            written = [entry(NS_A, i) for i in range(1000)]
            await manifest.append(written)

            async def fill_up_to_evict(temp: str) -> None:
                # The server over its maxmemory by half of the temporary list: its next
                # command evicts the list (the only key with a TTL), and then is under.
                usage = await admin.memory_usage(temp)
                assert usage is not None
                assert usage > 64 << 10
                used = (await admin.info("memory"))["used_memory"]
                await admin.config_set("maxmemory-policy", "volatile-lru")
                await admin.config_set("maxmemory", used - usage // 2)

            run_script, switch_watched = manifest._run_script, manifest._switch_watched

            async def evicting_run_script(script: Any, keys: list[str], args: Any) -> Any:
                if len(keys) == 3 and ":compacting:" in keys[2]:
                    await fill_up_to_evict(keys[2])
                return await run_script(script, keys, args)

            async def evicting_switch(
                namespace: str, gen: bytes, length: int, temp: str, nbytes: int, **kwargs: Any
            ) -> Any:
                await fill_up_to_evict(temp)
                return await switch_watched(namespace, gen, length, temp, nbytes, **kwargs)

            monkeypatch.setattr(manifest, "_run_script", evicting_run_script)
            monkeypatch.setattr(manifest, "_switch_watched", evicting_switch)
            try:
                with pytest.raises(StorageError, match="evicted"):
                    await manifest.compact_namespace(NS_A.hex())
                assert await admin.dbsize() > 0
            finally:
                await admin.config_set("maxmemory", 0)
                await admin.aclose()
            monkeypatch.undo()
            read = await manifest.read(namespace=NS_A.hex())
            assert sorted(read.entries, key=lambda e: e.last_use) == written
            assert manifest._scripting is scripts
            report = await manifest.compact_namespace(NS_A.hex())
            assert report.entries_after == len(written)


async def test_a_redis_manifest_warns_once_where_a_full_server_may_evict_it() -> None:
    # allkeys-* evicts any key when the server is full, volatile-* those with a TTL (the
    # manifest's, with the store's ttl): warmup then reads part of the manifest, silently.
    cases = [
        ("allkeys-lru", "100mb", None, True),
        ("allkeys-lfu", "100mb", None, True),
        ("allkeys-random", "100mb", None, True),
        ("volatile-lru", "100mb", 3600, True),
        ("volatile-lfu", "100mb", None, False),
        ("noeviction", "100mb", None, False),
        ("allkeys-lru", "0", None, False),  # no limit: nothing is evicted
    ]
    with RedisServer() as server:
        admin = Redis(host=server.host, port=server.port)
        try:
            for policy, maxmemory, ttl, warned in cases:
                await admin.config_set("maxmemory-policy", policy)
                await admin.config_set("maxmemory", maxmemory)
                query = f"prefix=t{uuid.uuid4().hex}" + (f"&ttl={ttl}" if ttl else "")
                async with RedisStorage.from_url(f"{server.url}?{query}") as backend:
                    manifest = backend.manifest(LIMITS)
                    with structlog.testing.capture_logs() as logs:
                        await manifest.append([entry(NS_A, 1)])
                        await manifest.append([entry(NS_A, 2)])
                        assert len((await manifest.read(namespace=NS_A.hex())).entries) == 2
                        await backend.manifest(LIMITS).read()  # another manifest says it too
                    told = [r for r in logs if r["event"] == "hicache.manifest.evictable"]
                    assert len(told) == (2 if warned else 0), (policy, maxmemory, ttl)
                    assert all(r["policy"] == policy for r in told)
        finally:
            await admin.aclose()
    # Where CONFIG is refused (a managed service), nothing is said and the manifest works.
    refused = ["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"]
    with RedisServer(extra_args=[*refused, "--rename-command", "CONFIG", ""]) as server:
        async with RedisStorage.from_url(f"{server.url}?prefix=refused") as backend:
            manifest = backend.manifest(LIMITS)
            with structlog.testing.capture_logs() as logs:
                await manifest.append([entry(NS_A, 1)])
                assert len((await manifest.read(namespace=NS_A.hex())).entries) == 1
            assert not [r for r in logs if r["log_level"] == "warning"]
            # Once, that the policy is unknown.
            (told,) = [r for r in logs if r["event"] == "hicache.manifest.eviction_unchecked"]
            assert told["log_level"] == "info"
            assert "CONFIG" in told["error"].upper()


async def test_a_redis_manifest_for_a_user_without_multi(redis_url: str) -> None:
    # A refused MULTI runs the transaction's commands one by one (redis-py sends MULTI, them
    # and EXEC in one write): every append stored its records and raised, so the namespace
    # was never indexed, compacted nor trimmed, and read(namespace) raised. Scripts do it
    # instead; where scripting is refused too, appends are refused before writing anything.
    admin = Redis.from_url(redis_url)
    names = [f"u{uuid.uuid4().hex[:12]}" for _ in range(2)]
    users = {names[0]: ["-multi"], names[1]: ["-multi", "-@scripting"]}
    host = redis_url.removeprefix("redis://")
    try:
        for name, rules in users.items():
            await admin.execute_command("ACL", "SETUSER", name, "on", ">pw", "~*", "+@all", *rules)
        limits = ManifestLimits(max_entries=10, max_entry_bytes=4096)
        url = f"redis://{names[0]}:pw@{host}?prefix=t{uuid.uuid4().hex}"
        async with RedisStorage.from_url(url) as backend:
            manifest = backend.manifest(limits)
            for i in range(100):
                await manifest.append([entry(NS_A, i % 15, last_use=float(i))])
            assert await admin.llen(manifest.list_key(NS_A.hex())) <= 2 * limits.max_entries  # type: ignore[misc]
            assert await admin.sismember(manifest.index_key, NS_A.hex())  # type: ignore[misc]
            read = await manifest.read(namespace=NS_A.hex())
            assert len(read.entries) == limits.max_entries
            assert chains(await manifest.read()) == chains(read)
            await manifest.compact()
            assert chains(await manifest.read(namespace=NS_A.hex())) == chains(read)
        url = f"redis://{names[1]}:pw@{host}?prefix=t{uuid.uuid4().hex}"
        async with RedisStorage.from_url(url) as backend:
            manifest = backend.manifest(limits)
            with pytest.raises(StorageError, match="MULTI"):
                await manifest.append([entry(NS_A, 0)])
            assert await admin.exists(manifest.list_key(NS_A.hex())) == 0
            assert (await manifest.read(namespace=NS_A.hex())).entries == []
    finally:
        for name in users:
            await admin.execute_command("ACL", "DELUSER", name)
        await admin.aclose()


@contextlib.asynccontextmanager
async def config_swallowed(server: RedisServer) -> AsyncIterator[str]:
    """A loopback relay to `server` that never forwards (nor answers) a CONFIG command, as a
    proxy that drops what it does not know does; its URL."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, drop: bool) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                # redis-py sends a lone command in one write: the probe's comes alone.
                if not (drop and b"\r\nCONFIG\r\n" in chunk.upper()):
                    writer.write(chunk)
                    await writer.drain()
        except OSError:
            return
        finally:
            writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(server.host, server.port)
        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = relay_server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        relay_server.close()


async def test_a_redis_manifest_read_never_waits_on_a_config_get_left_unanswered() -> None:
    # The eviction probe runs after the first append or read, a read inside warmup's
    # deadline: a proxy that never answers CONFIG held that call for the store's whole
    # timeout (and, with a shorter deadline, made warmup give up on a manifest it had read).
    with RedisServer() as server:
        async with config_swallowed(server) as url:
            # The store's timeout far past the guards: only the probe's own bound ends it.
            query = f"prefix=t{uuid.uuid4().hex}&timeout=300"
            async with RedisStorage.from_url(f"{url}?{query}") as backend:
                manifest = backend.manifest(LIMITS)
                with structlog.testing.capture_logs() as logs:
                    await asyncio.wait_for(manifest.append([entry(NS_A, 1)]), 20)
                    read = await asyncio.wait_for(manifest.read(namespace=NS_A.hex()), 20)
                    assert len(read.entries) == 1
                # Given up without a word, the check looked passed: it says so, once.
                (told,) = [r for r in logs if r["event"] == "hicache.manifest.eviction_unchecked"]
                assert told["log_level"] == "info"
                assert told["error"] == "no answer within 1 s"
                read = await asyncio.wait_for(
                    backend.manifest(LIMITS).read(namespace=NS_A.hex()), 20
                )
                assert len(read.entries) == 1
