"""Damaged keys and refused settings on a real Redis server: repaired or refused at open,
never an error at every later call."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio
import structlog

from hicache_async import StorageConfigError, StorageError
from hicache_async.storage._manifest import ManifestEntry, ManifestLimits
from hicache_async.storage._manifest_redis import RedisManifest
from hicache_async.storage._redis import RedisStorage

NS = "ab" * 16


def _entry(i: int) -> ManifestEntry:
    return ManifestEntry(namespace=NS, keys=["%064x" % (i + 1)], num_tokens=16, last_use=float(i))


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisStorage]:
    async with RedisStorage.from_url(f"{redis_url}?prefix=t{uuid.uuid4().hex}") as opened:
        yield opened


async def test_a_manifest_index_of_another_type_is_repaired_where_it_is_met(
    backend: RedisStorage,
) -> None:
    manifest = backend.manifest(ManifestLimits(max_entries=10))
    assert isinstance(manifest, RedisManifest)
    client = backend._redis()
    repaired: list[object] = []
    for step in ("read", "append", "compact"):
        # Another client's string where the index set belongs: WRONGTYPE at every command.
        await client.set(manifest.index_key, b"not ours")
        with structlog.testing.capture_logs() as logs:
            if step == "read":
                assert (await manifest.read()).entries == []
            elif step == "append":
                await manifest.append([_entry(0)])
            else:
                await manifest.compact()
        repaired += [e["removed"] for e in logs if e["event"] == "hicache.manifest.repaired"]
        assert await client.type(manifest.index_key) in (b"set", b"none")
    assert repaired == [[manifest.index_key]] * 3
    # The append stored and indexed its record: found by a read of every namespace.
    await manifest.append([_entry(1)])
    assert sorted(e.keys[0] for e in (await manifest.read()).entries) == [
        _entry(0).keys[0],
        _entry(1).keys[0],
    ]


async def test_an_index_that_cannot_be_updated_does_not_stop_compaction(
    redis_url: str,
) -> None:
    # A user the server refuses SADD: every append's index update fails, after the
    # records were stored. The list must still be compacted and trimmed at its bound.
    name, prefix = f"u{uuid.uuid4().hex}", f"t{uuid.uuid4().hex}"
    admin = redis.asyncio.Redis.from_url(redis_url)
    await admin.acl_setuser(
        name,
        enabled=True,
        passwords=["+secret"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-sadd"],
    )
    try:
        host = redis_url.removeprefix("redis://")
        url = f"redis://{name}:secret@{host}?prefix={prefix}"
        async with RedisStorage.from_url(url) as backend:
            manifest = backend.manifest(ManifestLimits(max_entries=10))
            assert isinstance(manifest, RedisManifest)
            for i in range(60):
                with pytest.raises(StorageError) as info:
                    await manifest.append([_entry(i)])
            assert await admin.llen(manifest.list_key(NS)) <= 20
            assert "stored its records but could not index" in str(info.value)
    finally:
        await admin.acl_deluser(name)
        await admin.aclose()


@pytest.mark.parametrize("db", ["2147483648", "99999999999999999999"])
def test_a_database_past_what_select_takes_is_refused_by_the_parser(db: str) -> None:
    with pytest.raises(StorageConfigError, match="must be an integer from 0 to 2147483647"):
        RedisStorage.from_url(f"redis://127.0.0.1:6379/{db}")
    assert RedisStorage.from_url("redis://127.0.0.1:6379/2147483647") is not None


async def test_a_password_for_a_server_without_one_is_refused_at_open(redis_url: str) -> None:
    # redis-py lets this AUTH pass; the bulk path's connections did not, so every batch
    # failed on a store that had opened.
    url = redis_url.replace("redis://", "redis://:secret@", 1)
    with pytest.raises(StorageConfigError, match="without any password configured"):
        async with RedisStorage.from_url(url):
            pytest.fail("opened")


async def test_clients_repairing_the_index_at_once_keep_every_namespace(redis_url: str) -> None:
    # The repair is one step: a client that finds the damage never deletes the set another
    # client has just made (losing its namespace from every read of all namespaces). Checked
    # over many rounds, since the interleaving is the server's.
    def entry(namespace: str, i: int) -> ManifestEntry:
        return ManifestEntry(
            namespace=namespace, keys=["%064x" % (i + 1)], num_tokens=16, last_use=float(i)
        )

    namespaces = ["aa" * 16, "bb" * 16, "cc" * 16]
    for i in range(60):
        url = f"{redis_url}?prefix=t{uuid.uuid4().hex}"
        async with contextlib.AsyncExitStack() as stack:
            stores = [
                await stack.enter_async_context(RedisStorage.from_url(url)) for _ in namespaces
            ]
            manifests = [store.manifest(ManifestLimits(max_entries=10)) for store in stores]
            first = manifests[0]
            assert isinstance(first, RedisManifest)
            await stores[0]._redis().set(first.index_key, b"not ours")
            await asyncio.gather(
                *(m.append([entry(ns, i)]) for m, ns in zip(manifests, namespaces, strict=True))
            )
            members = await stores[0]._redis().smembers(first.index_key)
            assert sorted(members) == [ns.encode() for ns in namespaces], f"round {i}"
            found = {e.namespace for e in (await first.read()).entries}
            assert found == set(namespaces), f"round {i}"
