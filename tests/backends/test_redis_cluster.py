"""RedisStorage with `cluster=1` against real three-primary Redis Clusters on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio
import redis
import structlog
from redis.crc import key_slot

from hicache_async import StorageConfigError, StorageError
from hicache_async.storage import HEADER_NBYTES, Outcome, open_storage
from hicache_async.storage._manifest import ManifestLimits, chain_entry
from hicache_async.storage._manifest_redis import RedisManifest
from hicache_async.storage._redis import RedisStorage
from hicache_async.testing import RedisClusterServer, RedisServer, ServerError
from hicache_async.testing._conformance import MAC_KEY, StorageConformance

from .test_redis import (
    NS,
    _aged_pages,
    _connections_named,
    buffers,
    check_oversized_values_are_not_read_whole,
    joined,
    make_pages,
)

#: Bound of every test that makes a node fail: a hang fails the test instead of the suite.
FAULT_TIMEOUT_S = 30.0


def fresh_url(base: str, **params: object) -> str:
    """`base` (which carries `?cluster=1`) with a prefix of its own and `params` added."""
    extra = {"prefix": f"t{uuid.uuid4().hex}", **params}
    return base + "".join(f"&{k}={v}" for k, v in extra.items())


def node_client(node: RedisServer) -> redis.Redis:
    return redis.Redis(host=node.host, port=node.port)


def keys_on(node: RedisServer, prefix: str) -> set[bytes]:
    """The keys under `prefix` that `node` itself holds."""
    client = node_client(node)
    try:
        return set(client.scan_iter(match=f"{prefix}:*", count=1000))
    finally:
        client.close()


async def cluster_failed(node: RedisServer) -> None:
    """Return once `node` reports the cluster failed (a lost primary marked failed, with
    full coverage required); bounded by the caller."""
    client = node_client(node)
    try:
        while True:
            info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
            if b"cluster_state:fail" in info:
                return
            await asyncio.sleep(0.05)
    finally:
        client.close()


def pages_on(node: RedisServer, prefix: str) -> set[bytes]:
    """The page keys (`<prefix>:` and 64 hex digits) that `node` holds: not the mark that
    maintenance leaves under the prefix."""
    return {k for k in keys_on(node, prefix) if len(k) == len(prefix) + 65}


def slots_of(node: RedisServer) -> set[int]:
    """The slots `node` serves, as it says itself."""
    client = node_client(node)
    try:
        ranges = client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
    finally:
        client.close()
    return {
        slot
        for first, last, primary, *_ in ranges
        if int(primary[1]) == node.port
        for slot in range(first, last + 1)
    }


def node_failed(survivor: RedisServer, lost: RedisServer) -> bool:
    """`survivor` has marked `lost` failed (`fail` in its flags, not just suspected)."""
    client = node_client(survivor)
    try:
        nodes = client.execute_command("CLUSTER", "NODES")  # type: ignore[no-untyped-call]
    finally:
        client.close()
    text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[1].split("@")[0].endswith(f":{lost.port}"):
            return "fail" in fields[2].split(",")
    return False


def replication(node: RedisServer) -> dict[str, object]:
    """`node`'s `INFO replication` fields."""
    client = node_client(node)
    try:
        return dict(client.info("replication"))
    finally:
        client.close()


async def replicated(primary: RedisServer, nodes: Sequence[RedisServer]) -> None:
    """Return once each replica of `primary` among `nodes` has applied every write `primary`
    took so far; bounded by the caller. A `WAIT` is no such check: it waits for the offset its
    own connection last saw, and as a connection's first command (redis-py 6.2 sends nothing
    before it) for none, so it returned at once with a replica still without the pages."""
    target = replication(primary)["master_repl_offset"]
    assert isinstance(target, int)
    assert target > 0
    replicas = [node for node in nodes if replication(node).get("master_port") == primary.port]
    assert replicas
    while True:
        offsets = [replication(node).get("slave_repl_offset") for node in replicas]
        if all(isinstance(offset, int) and offset >= target for offset in offsets):
            return
        await asyncio.sleep(0.05)


def cluster_ok(node: RedisServer) -> bool:
    client = node_client(node)
    try:
        info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    finally:
        client.close()
    return b"cluster_state:ok" in info


@pytest_asyncio.fixture
async def backend(redis_cluster_url: str) -> AsyncIterator[RedisStorage]:
    async with RedisStorage.from_url(fresh_url(redis_cluster_url)) as storage:
        yield storage


class TestRedisClusterConformance(StorageConformance):
    @pytest_asyncio.fixture
    async def backend(self, redis_cluster_url: str) -> AsyncIterator[RedisStorage]:
        async with RedisStorage.from_url(fresh_url(redis_cluster_url)) as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self, redis_cluster_url: str) -> AsyncIterator[RedisStorage]:
        url = fresh_url(redis_cluster_url)
        async with RedisStorage.from_url(url, mac_key=MAC_KEY) as storage:
            yield storage


class TestRedisClusterConformanceWithoutCommandTable(StorageConformance):
    """A user whose ACL leaves out `COMMAND`: the keys of each command are found by rule."""

    @pytest_asyncio.fixture
    async def backend(self, redis_cluster: RedisClusterServer) -> AsyncIterator[RedisStorage]:
        user = f"u{uuid.uuid4().hex[:12]}"
        admins = [node_client(node) for node in redis_cluster.nodes]
        try:
            for admin in admins:
                rules = ["+@all", "-command"]
                admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], commands=rules)
            url = fresh_url(redis_cluster.url.replace("redis://", f"redis://{user}:pw@"))
            async with RedisStorage.from_url(url) as storage:
                yield storage
        finally:
            for admin in admins:
                admin.acl_deluser(user)
                admin.close()


def test_the_cluster_helper_runs_three_primaries(redis_cluster: RedisClusterServer) -> None:
    assert redis_cluster.url == f"redis://127.0.0.1:{redis_cluster.nodes[0].port}/0?cluster=1"
    assert len({node.port for node in redis_cluster.nodes}) == 3
    for node in redis_cluster.nodes:
        client = node_client(node)
        try:
            info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
            assert b"cluster_state:ok" in info
            assert b"cluster_known_nodes:3" in info
            assert b"cluster_size:3" in info  # three primaries serving slots
        finally:
            client.close()


def test_a_stopped_cluster_leaves_no_process() -> None:
    cluster = RedisClusterServer().start()
    nodes = cluster.nodes
    assert all(node.running for node in nodes)
    cluster.stop()
    assert not any(node.running for node in nodes)
    assert not cluster.running
    cluster.stop()  # idempotent


def test_the_cluster_helper_refuses_a_full_coverage_that_is_not_a_bool() -> None:
    with pytest.raises(ServerError, match="full_coverage"):
        RedisClusterServer(full_coverage="no")  # type: ignore[arg-type]
    with pytest.raises(ServerError, match="replicas"):
        RedisClusterServer(replicas=-1)


async def test_pages_spread_over_every_primary(
    backend: RedisStorage, redis_cluster: RedisClusterServer
) -> None:
    keys, pages, metas = make_pages(64)
    assert await backend.put(keys, pages, metas) == [Outcome.OK] * 64
    held = [pages_on(node, backend.prefix) for node in redis_cluster.nodes]
    assert all(held), [len(h) for h in held]  # every primary holds some
    assert sum(len(h) for h in held) == 64  # and no page is on two
    assert set().union(*held) == {backend._rkey(k) for k in keys}
    into = buffers(64)
    assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 64
    assert [joined(b) for b in into] == [joined(p) for p in pages]
    assert await backend.exists(keys) == 64
    assert await backend.delete(keys[:10]) == 10
    assert await backend.exists(keys) == 0
    assert await backend.exists(keys[10:]) == 54


async def test_a_get_never_reads_a_value_longer_than_its_page(backend: RedisStorage) -> None:
    await check_oversized_values_are_not_read_whole(backend)


async def test_maintenance_sees_the_pages_of_every_primary(
    redis_cluster_url: str, redis_cluster: RedisClusterServer
) -> None:
    page = HEADER_NBYTES + 3000
    async with RedisStorage.from_url(fresh_url(redis_cluster_url, capacity=60 * page)) as backend:
        keys, pages, metas = make_pages(64)
        await backend.put(keys, pages, metas)
        listed = await backend.list_pages()
        assert sorted(p.key for p in listed) == sorted(keys)
        assert {p.nbytes for p in listed} == {page}
        # One damaged page on each primary: verify reads them all and removes exactly those.
        damaged: list[bytes] = []
        for node in redis_cluster.nodes:
            rkey = sorted(pages_on(node, backend.prefix))[0]
            key = backend._key_of(rkey)
            raw = await backend.read_raw(key)
            assert raw is not None
            await backend.write_raw(key, raw[:-1] + bytes([raw[-1] ^ 1]))
            damaged.append(key)
        report = await backend.verify()
        assert (report.checked, report.ok, report.corrupt_removed) == (64, 61, 3)
        assert [await backend.read_raw(k) for k in damaged] == [None] * 3
        gc = await backend.gc()  # 61 pages, room for 60
        assert (gc.evicted_pages, gc.freed_bytes) == (1, page)
        assert len(await backend.list_pages()) == 60
        assert sum(len(pages_on(node, backend.prefix)) for node in redis_cluster.nodes) == 60


def test_the_storage_command_counts_pages_on_every_primary(
    redis_cluster_url: str,
    redis_cluster: RedisClusterServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hicache_async.cli import main

    page = HEADER_NBYTES + 3000
    url = fresh_url(redis_cluster_url, capacity=40 * page)
    keys, pages, metas = make_pages(48)

    async def put() -> None:
        async with open_storage(url) as storage:
            assert await storage.put(keys, pages, metas) == [Outcome.OK] * 48

    asyncio.run(put())
    prefix = url.rsplit("prefix=", 1)[1].split("&")[0]
    per_node = [len(pages_on(node, prefix)) for node in redis_cluster.nodes]
    assert all(per_node)
    assert main(["storage", "stats", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["pages"], stats["bytes"]) == (sum(per_node), sum(per_node) * page)
    assert main(["storage", "ls", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(row["key"] for row in listed) == sorted(k.hex() for k in keys)
    assert main(["storage", "verify", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] == 48
    assert main(["storage", "gc", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evicted_pages"] == 8
    assert sum(len(pages_on(node, prefix)) for node in redis_cluster.nodes) == 40


@pytest.mark.parametrize("scripting", [True, False])
async def test_warmup_manifest_round_trip_on_the_cluster(
    backend: RedisStorage, redis_cluster: RedisClusterServer, scripting: bool
) -> None:
    limits = ManifestLimits(max_entries=16, max_entry_bytes=4096, max_bytes=1 << 20)
    # Without scripting, a compaction switches lists with WATCH, MULTI, RENAME and EXEC.
    manifest = RedisManifest(
        backend._redis, prefix=backend.prefix, name=backend.name, scripting=scripting, limits=limits
    )
    namespaces = [bytes([n]) * 16 for n in range(6)]
    written = {
        ns: [chain_entry(ns, make_pages(2)[0], 8, i, float(i)) for i in range(20)]
        for ns in namespaces
    }
    for entries in written.values():
        await manifest.append(entries)
    # Each namespace's keys lie on one node, and the namespaces on more than one.
    held = {node.port: keys_on(node, f"{backend.prefix}:manifest") for node in redis_cluster.nodes}
    homes = {
        ns: {port for port, keys in held.items() if any(ns.hex().encode() in k for k in keys)}
        for ns in namespaces
    }
    assert all(len(ports) == 1 for ports in homes.values()), homes
    assert len(set().union(*homes.values())) > 1
    report = await manifest.compact()
    assert report.entries_after == 6 * 16
    for ns, entries in written.items():
        read = await manifest.read(namespace=ns.hex())
        newest = {e.chain_id for e in entries if e.priority >= 4}
        assert {e.chain_id for e in read.entries} == newest
    assert manifest._scripting is scripting


@pytest.mark.parametrize("fault", ["killed", "stopped"])
async def test_a_lost_primary_leaves_the_manifest_scripts_of_the_others_working(
    fault: str,
) -> None:
    # redis-py loads a script on every primary, and failed its first call when one of them
    # did not answer: a namespace whose keys live on a live node could not be compacted.
    with RedisClusterServer(full_coverage=False) as cluster:
        async with RedisStorage.from_url(fresh_url(cluster.url, timeout=1)) as backend:
            limits = ManifestLimits(max_entries=4, max_entry_bytes=4096, max_bytes=1 << 20)
            manifest = RedisManifest(
                backend._redis,
                prefix=backend.prefix,
                name=backend.name,
                scripting=True,
                limits=limits,
            )
            # A primary that holds neither the namespace's keys nor the namespace index, and
            # is not the one keyless commands go to.
            index_slot = key_slot(manifest.index_key.encode())
            default = backend._redis().get_default_node()
            assert default is not None
            victim = next(
                n for n in cluster.nodes if index_slot not in slots_of(n) and n.port != default.port
            )
            lost_slots = slots_of(victim)
            ns = next(
                bytes([n]) * 16
                for n in range(256)
                if key_slot((bytes([n]) * 16).hex().encode()) not in lost_slots
            )
            entries = [chain_entry(ns, make_pages(2)[0], 8, i, float(i)) for i in range(8)]
            pid = victim.pid
            assert pid is not None
            if fault == "killed":
                victim.kill()
            else:
                os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.wait_for(manifest.append(entries), FAULT_TIMEOUT_S)
                report = await asyncio.wait_for(manifest.compact(), FAULT_TIMEOUT_S)
                assert report.entries_after == 4
                read = await asyncio.wait_for(manifest.read(namespace=ns.hex()), FAULT_TIMEOUT_S)
                assert {e.chain_id for e in read.entries} == {e.chain_id for e in entries[4:]}
                assert manifest._scripting
            finally:
                if fault == "stopped":
                    os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("fault", ["killed", "stopped"])
async def test_a_lost_seed_node_leaves_the_manifest_reads_of_the_others_working(
    fault: str,
) -> None:
    # redis-py asked the seed node for the keys of every EVAL_RO (COMMAND GETKEYS): with the
    # seed lost, the warmup manifest's scripted read failed on every node.
    with RedisClusterServer(full_coverage=False) as cluster:
        victim = cluster.nodes[0]  # the URL's seed
        lost_slots = slots_of(victim)
        url = next(  # a prefix whose namespace index lies on another node
            url
            for url in (fresh_url(cluster.url, timeout=1) for _ in range(1000))
            if key_slot(f"{url.split('prefix=')[1].split('&')[0]}:manifest:namespaces".encode())
            not in lost_slots
        )
        async with RedisStorage.from_url(url) as backend:
            limits = ManifestLimits(max_entries=16, max_entry_bytes=4096, max_bytes=1 << 20)
            manifest = RedisManifest(
                backend._redis,
                prefix=backend.prefix,
                name=backend.name,
                scripting=True,
                limits=limits,
            )
            assert key_slot(manifest.index_key.encode()) not in lost_slots
            default = backend._redis().get_default_node()
            assert default is not None
            assert default.port == victim.port
            ns = next(
                bytes([n]) * 16
                for n in range(256)
                if key_slot((bytes([n]) * 16).hex().encode()) not in lost_slots
            )
            entries = [chain_entry(ns, make_pages(2)[0], 8, i, float(i)) for i in range(8)]
            await manifest.append(entries)
            pid = victim.pid
            assert pid is not None
            if fault == "killed":
                victim.kill()
            else:
                os.kill(pid, signal.SIGSTOP)
            try:
                for read in (manifest.read(namespace=ns.hex()), manifest.read()):
                    got = await asyncio.wait_for(read, FAULT_TIMEOUT_S)
                    assert {e.chain_id for e in got.entries} == {e.chain_id for e in entries}
                assert manifest._scripting
            finally:
                if fault == "stopped":
                    os.kill(pid, signal.SIGCONT)


def test_compactions_without_scripting_never_block_the_loop(redis_cluster_url: str) -> None:
    # redis-py's cluster pipeline ran the commands between WATCH and MULTI in threads the
    # loop waited for, blocked; with one connection per node and three appenders it froze
    # for good. In a process of its own, so such a freeze fails the test, not the suite.
    worker = Path(__file__).resolve().parent.parent / "_cluster_manifest_worker.py"
    url = fresh_url(redis_cluster_url, max_connections=1, timeout=2)
    result = subprocess.run(
        [sys.executable, str(worker), url, "4"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["foreign"] == []
    assert all(count > 0 for count in report["appends"])
    assert report["namespaces_read"]


async def test_a_slot_moved_under_a_client_is_followed(redis_cluster: RedisClusterServer) -> None:
    # A reshard: the slot of a stored page moves to another primary while a backend holds the
    # old slot map. Mid-move (ASK) and after it (MOVED) the backend finds the page there.
    async with RedisStorage.from_url(fresh_url(redis_cluster.url)) as backend:
        keys, pages, metas = make_pages(8)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 8
        # Batches at once, as under load, leave every node more than one free connection:
        # the command an ASK redirects must still follow its ASKING on the same one.
        reads = [backend.get(keys, buffers(8), namespace=NS) for _ in range(6)]
        assert await asyncio.gather(*reads) == [[Outcome.OK] * 8] * 6
        rkey = backend._rkey(keys[0])
        source = next(n for n in redis_cluster.nodes if rkey in pages_on(n, backend.prefix))
        target = next(n for n in redis_cluster.nodes if n is not source)
        clients = {node.port: node_client(node) for node in redis_cluster.nodes}
        try:
            src, dst = clients[source.port], clients[target.port]
            slot = int(src.execute_command("CLUSTER", "KEYSLOT", rkey))  # type: ignore[no-untyped-call]
            src_id = src.execute_command("CLUSTER", "MYID").decode()  # type: ignore[no-untyped-call]
            dst_id = dst.execute_command("CLUSTER", "MYID").decode()  # type: ignore[no-untyped-call]
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)  # type: ignore[no-untyped-call]
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)  # type: ignore[no-untyped-call]
            # Every key of the slot moves (other tests' pages may share it on this session's
            # cluster): the slot's owner cannot change while its old node holds one.
            held = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000)  # type: ignore[no-untyped-call]
            assert rkey in held
            src.execute_command(  # type: ignore[no-untyped-call]
                "MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *held
            )
            into = buffers(8)
            outcomes = await asyncio.wait_for(
                backend.get(keys, into, namespace=NS), FAULT_TIMEOUT_S
            )
            assert outcomes == [Outcome.OK] * 8  # page 0 through ASK
            assert joined(into[0]) == joined(pages[0])
            for client in clients.values():
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)  # type: ignore[no-untyped-call]
            into = buffers(8)
            outcomes = await asyncio.wait_for(
                backend.get(keys, into, namespace=NS), FAULT_TIMEOUT_S
            )
            assert outcomes == [Outcome.OK] * 8  # through MOVED
            assert [joined(b) for b in into] == [joined(p) for p in pages]
            assert rkey in pages_on(target, backend.prefix)
            assert await backend.exists(keys[:1]) == 1
        finally:
            for client in clients.values():
                client.close()


async def test_calls_after_the_nodes_closed_idle_connections_succeed() -> None:
    # `timeout 1` on every node: each closes connections idle for a second.
    with RedisClusterServer() as cluster:
        for node in cluster.nodes:
            with node_client(node) as admin:
                admin.config_set("timeout", 1)
        name = f"idle{uuid.uuid4().hex[:8]}"
        async with RedisStorage.from_url(fresh_url(cluster.url, client_name=name)) as backend:
            keys, pages, metas = make_pages(6)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 6

            async def idle_closed() -> None:
                for _ in range(300):  # up to ~30 s for the nodes' idle sweeps
                    counts = [
                        await asyncio.to_thread(_connections_named, n.host, n.port, name)
                        for n in cluster.nodes
                    ]
                    if not any(counts):
                        return
                    await asyncio.sleep(0.1)
                pytest.fail("the nodes did not close the idle connections")

            await idle_closed()
            assert await backend.delete(keys[:3]) == 3
            await idle_closed()
            assert await backend.exists(keys[3:]) == 3
            await idle_closed()
            into = buffers(3)
            assert await backend.get(keys[3:], into, namespace=NS) == [Outcome.OK] * 3
            assert [joined(p) for p in into] == [joined(p) for p in pages[3:]]
            assert backend.stats().errors == 0


async def test_a_killed_node_gives_errors_not_wrong_pages_or_hangs() -> None:
    with RedisClusterServer(node_timeout=0.5) as cluster:
        url = fresh_url(cluster.url, timeout=2)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(32)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 32
            victim = cluster.nodes[1]
            survivors = [n for n in cluster.nodes if n is not victim]
            lost = pages_on(victim, backend.prefix)
            assert lost
            lost_slots = slots_of(victim)
            victim.kill()

            def serving() -> bool:
                return all(cluster_ok(n) for n in survivors)

            async def faults() -> None:
                # Until the survivors mark the node failed they serve their own slots, and
                # only the lost node's keys fail; a call that ended while they still did
                # (the state never goes back while the node is down) met only that.
                into = buffers(32)
                outcomes = await backend.get(keys, into, namespace=NS)
                served = serving()
                for key, outcome, page, got in zip(keys, outcomes, pages, into, strict=True):
                    assert outcome in (Outcome.OK, Outcome.ERROR)
                    if backend._rkey(key) in lost:
                        assert outcome is Outcome.ERROR
                    else:
                        assert outcome is Outcome.OK or not served
                    if outcome is Outcome.OK:
                        assert joined(got) == joined(page)
                more, more_pages, more_metas = make_pages(16)
                put = await backend.put(more, more_pages, more_metas)
                served = serving()
                for key, outcome in zip(more, put, strict=True):
                    if key_slot(backend._rkey(key)) in lost_slots:
                        assert outcome is Outcome.ERROR
                    else:
                        assert outcome is Outcome.OK or not served
                for call in (backend.exists(keys), backend.list_pages(), backend.verify()):
                    with pytest.raises(StorageError):
                        await call
                # The survivors soon mark the node failed and refuse every slot (CLUSTERDOWN).
                await cluster_failed(cluster.nodes[0])
                outcomes = await backend.get(keys, buffers(32), namespace=NS)
                assert outcomes == [Outcome.ERROR] * 32
                with pytest.raises(StorageError):
                    await backend.delete(keys)

            await asyncio.wait_for(faults(), FAULT_TIMEOUT_S)
            assert backend.stats().errors > 32


async def test_a_lost_primary_fails_only_its_own_keys() -> None:
    # With cluster-require-full-coverage no the other primaries go on serving their slots:
    # a batch's keys on them are read and written as usual, before the survivors mark the
    # lost node failed and after, and only the lost node's keys are ERROR.
    with RedisClusterServer(node_timeout=0.5, full_coverage=False) as cluster:
        url = fresh_url(cluster.url, timeout=2)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(48)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 48
            victim = cluster.nodes[1]
            survivors = [n for n in cluster.nodes if n is not victim]
            lost_slots = slots_of(victim)

            def on_victim(key: bytes) -> bool:
                return key_slot(backend._rkey(key)) in lost_slots

            assert any(map(on_victim, keys))
            assert not all(map(on_victim, keys))
            victim.kill()

            async def only_the_lost_keys_fail() -> None:
                into = buffers(48)
                outcomes = await backend.get(keys, into, namespace=NS)
                for key, outcome, page, got in zip(keys, outcomes, pages, into, strict=True):
                    if on_victim(key):
                        assert outcome is Outcome.ERROR
                    else:
                        assert outcome is Outcome.OK
                        assert joined(got) == joined(page)
                more, more_pages, more_metas = make_pages(48)
                put = await backend.put(more, more_pages, more_metas)
                assert put == [Outcome.ERROR if on_victim(k) else Outcome.OK for k in more]
                live = [k for k in more if not on_victim(k)]
                into = buffers(len(live))
                got = await backend.get(live, into, namespace=NS)
                assert got == [Outcome.OK] * len(live)
                stored = {k: joined(p) for k, p in zip(more, more_pages, strict=True)}
                assert [joined(b) for b in into] == [stored[k] for k in live]
                # exists: exact wherever a missing key on a live node ends the prefix before
                # any key of the lost node; unknown (raised) where a lost key comes first.
                alive = [k for k in keys if not on_victim(k)]
                dead = [k for k in keys if on_victim(k)]
                absent = next(k for k in make_pages(64)[0] if not on_victim(k))
                assert await backend.exists([*alive[:5], absent, *dead]) == 5
                assert await backend.exists(alive) == len(alive)
                with pytest.raises(StorageError):
                    await backend.exists([*alive[:5], dead[0], absent])
                # A delete removes what the live nodes hold and raises only where no node
                # answered (see test_a_delete_removes_the_pages_of_the_live_primaries).
                assert await backend.delete([absent, dead[0]]) == 0
                with pytest.raises(StorageError):
                    await backend.delete([dead[0]])

            await asyncio.wait_for(only_the_lost_keys_fail(), FAULT_TIMEOUT_S)

            async def marked_failed() -> None:
                while True:
                    if all(node_failed(n, victim) for n in survivors):
                        return
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(marked_failed(), FAULT_TIMEOUT_S)
            assert all(cluster_ok(n) for n in survivors)  # serving their own slots still
            await asyncio.wait_for(only_the_lost_keys_fail(), FAULT_TIMEOUT_S)


@pytest.mark.parametrize("fault", ["killed", "stopped"])
async def test_a_delete_removes_the_pages_of_the_live_primaries(fault: str) -> None:
    # A lost primary failed the whole delete (and gc), the live nodes' pages left in place:
    # they are removed now, the lost node's counted as errors, and only a delete that no
    # node answered raises. A frozen node costs one `timeout`, not one per pipeline.
    with RedisClusterServer(node_timeout=0.5, full_coverage=False) as cluster:
        url = fresh_url(cluster.url, timeout=1)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(1000, 200)  # two pipelines or more on every node
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 1000
            victim = cluster.nodes[1]
            lost_slots = slots_of(victim)
            dead = [k for k in keys if key_slot(backend._rkey(k)) in lost_slots]
            alive = [k for k in keys if key_slot(backend._rkey(k)) not in lost_slots]
            assert len(dead) > 256
            assert alive
            pid = victim.pid
            assert pid is not None
            if fault == "killed":
                victim.kill()
            else:
                os.kill(pid, signal.SIGSTOP)
            try:
                errors = backend.stats().errors
                removed = await asyncio.wait_for(backend.delete(keys), FAULT_TIMEOUT_S)
                assert removed == len(alive)
                assert backend.stats().errors == errors + 1  # the lost node's first pipeline
                for node in cluster.nodes:
                    if node is not victim:
                        assert not pages_on(node, backend.prefix)
                with pytest.raises(StorageError, match=str(victim.port)):
                    await asyncio.wait_for(backend.delete(dead[:5]), FAULT_TIMEOUT_S)
            finally:
                if fault == "stopped":
                    os.kill(pid, signal.SIGCONT)
            if fault == "stopped":
                # It runs the pipeline it had received once it goes on; the node's next
                # pipelines were never sent.
                assert len(pages_on(victim, backend.prefix)) >= len(dead) - 256


async def test_a_delete_refused_some_keys_removes_and_counts_the_others(
    redis_cluster: RedisClusterServer,
) -> None:
    # A node that answered with a refusal for some DELs (an error reply each) counted as a
    # node that did not answer: the call raised though the others were removed, and the keys
    # after the refusal in its pipeline stayed in `stats()`.
    user = f"u{uuid.uuid4().hex[:12]}"
    admins = [node_client(node) for node in redis_cluster.nodes]
    try:
        for admin in admins:
            admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
        url = fresh_url(redis_cluster.url.replace("redis://", f"redis://{user}:pw@"))
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(60)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 60
            rules = [f"%W~{backend.prefix}:{d}*" for d in "01234567"]
            for admin in admins:
                admin.execute_command("ACL", "SETUSER", user, "resetkeys", "%R~*", *rules)
            errors = backend.stats().errors
            with structlog.testing.capture_logs() as logs:
                removed = await asyncio.wait_for(backend.delete(keys), FAULT_TIMEOUT_S)
            left = sum(len(pages_on(node, backend.prefix)) for node in redis_cluster.nodes)
            assert removed == 60 - left
            assert left == sum(1 for k in keys if k.hex()[0] not in "01234567")
            assert backend.stats().pages == left
            assert backend.stats().bytes == left * (HEADER_NBYTES + 3000)
            assert backend.stats().errors > errors
            assert [r for r in logs if r["event"] == "storage.redis.delete_failed"]
    finally:
        for admin in admins:
            admin.acl_deluser(user)
            admin.close()


class _LosesANodeBeforeEvicting(RedisStorage):
    """Kills `victim` once gc has listed the pages, before it removes any."""

    victim: RedisServer | None = None

    async def _delete_rkeys(
        self,
        rkeys: Sequence[bytes],
        read_nbytes: Sequence[int] | None = None,
        *,
        totals: list[int] | None = None,
    ) -> tuple[int, int, int]:
        if self.victim is not None:
            self.victim.kill()
            self.victim = None
        return await super()._delete_rkeys(rkeys, read_nbytes, totals=totals)


async def test_gc_evicts_on_the_live_primaries_and_counts_the_rest_failed() -> None:
    page = HEADER_NBYTES + 3000
    with RedisClusterServer(node_timeout=0.5, full_coverage=False) as cluster:
        url = fresh_url(cluster.url, timeout=1, capacity=10 * page)
        async with _LosesANodeBeforeEvicting.from_url(url) as backend:
            assert isinstance(backend, _LosesANodeBeforeEvicting)
            keys, pages, metas = make_pages(40)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 40
            # The primary holding most: more than the 10 pages that may stay (40 on three).
            victim = max(cluster.nodes, key=lambda n: len(pages_on(n, backend.prefix)))
            on_victim = len(pages_on(victim, backend.prefix))
            assert 10 < on_victim < 30
            backend.victim = victim
            report = await asyncio.wait_for(backend.gc(), FAULT_TIMEOUT_S)
            # The 30 oldest go; pages put in one batch tie at Redis's one-second idle clock,
            # so which of the lost node's pages are among them is not known, only how many
            # at least: all but the 10 that may stay.
            assert report.failed + report.evicted_pages == 30
            assert on_victim - 10 <= report.failed <= on_victim
            assert report.freed_bytes == report.evicted_pages * page
            assert report.over_capacity_bytes == report.failed * page
            live = [n for n in cluster.nodes if n is not victim]
            left = sum(len(pages_on(n, backend.prefix)) for n in live)
            assert left == 40 - on_victim - report.evicted_pages


async def test_two_gc_passes_at_once_on_a_cluster_evict_to_the_capacity_not_below() -> None:
    # As on one server: the lease is one key, on its slot's node.
    page = HEADER_NBYTES + 256
    with RedisClusterServer() as cluster:
        url = fresh_url(cluster.url, timeout=120)
        async with RedisStorage.from_url(url) as writer:
            old, new = await _aged_pages(writer, 150)
        nodes = [node_client(n) for n in cluster.nodes]
        async with (
            RedisStorage.from_url(f"{url}&capacity={150 * page}") as first,
            RedisStorage.from_url(f"{url}&capacity={150 * page}") as second,
        ):
            # Writes wait on every node, reads do not: both passes list before either evicts.
            for node in nodes:
                node.client_pause(120_000, all=False)
            try:
                passes = asyncio.gather(first.gc(), second.gc())
                for _ in range(3000):
                    if sum(node.info("clients")["blocked_clients"] for node in nodes) >= 2:
                        break
                    await asyncio.sleep(0.02)
                else:
                    pytest.fail("the two passes never waited on the paused nodes")
            finally:
                for node in nodes:
                    node.client_unpause()
            reports = await asyncio.wait_for(passes, FAULT_TIMEOUT_S)
            assert sorted(r.evicted_pages for r in reports) == [0, 150]
            assert await first.count_pages() == (150, 150 * page)
            assert await first.exists(new) == 150
            assert sum([await first.exists([key]) for key in old]) == 0
        for node in nodes:
            node.close()


async def test_a_frozen_primary_replaced_by_its_replica_is_left_for_the_replica() -> None:
    # A timeout is not sent again, and on a pipeline it left the slot map as it was: once a
    # replica had taken over a frozen primary's slots, every batch still sent those keys to
    # the frozen node and they stayed ERROR (a `timeout` each) until it woke up.
    with RedisClusterServer(replicas=1, node_timeout=0.5) as cluster:
        url = fresh_url(cluster.url, timeout=1)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(24)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 24
            victim = cluster.nodes[1]
            assert pages_on(victim, backend.prefix)
            # Replication is asynchronous: a replica that takes over before it has the pages
            # serves them as absent (MISS), as Redis Cluster does with unreplicated writes.
            others = [n for n in cluster.nodes + cluster.replica_nodes if n is not victim]
            await asyncio.wait_for(replicated(victim, others), FAULT_TIMEOUT_S)
            pid = victim.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                # Batches while the replica takes over; then the keys are read there.
                first = await backend.get(keys, buffers(24), namespace=NS)
                assert Outcome.ERROR in first
                survivors = others

                async def taken_over() -> None:
                    while True:
                        if all(cluster_ok(n) for n in survivors):
                            return
                        await asyncio.sleep(0.05)

                await asyncio.wait_for(taken_over(), FAULT_TIMEOUT_S)

                async def served() -> list[Outcome]:
                    # Each call after a timeout learns the slot map again: within a few.
                    for _ in range(5):
                        into = buffers(24)
                        outcomes = await backend.get(keys, into, namespace=NS)
                        if Outcome.ERROR not in outcomes:
                            assert [joined(b) for b in into] == [joined(p) for p in pages]
                            return outcomes
                    return outcomes

                got = await asyncio.wait_for(served(), FAULT_TIMEOUT_S)
                assert got == [Outcome.OK] * 24
                assert await backend.exists(keys) == 24
                more, more_pages, more_metas = make_pages(12)
                assert await backend.put(more, more_pages, more_metas) == [Outcome.OK] * 12
            finally:
                os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("fault", ["stopped", "killed"])
async def test_a_lost_first_primary_without_replica_leaves_the_others_served(fault: str) -> None:
    # A timeout or a lost connection marks the slot map stale; learning it again asked the
    # first primary of the map for the command table, and while that node was lost every
    # call failed, the keys of the nodes that answer included (a frozen one: a `timeout` or
    # more each).
    with RedisClusterServer() as cluster:
        url = fresh_url(cluster.url, timeout=1)
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(60)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 60
            (victim,) = [node for node in cluster.nodes if 0 in slots_of(node)]
            lost_slots = slots_of(victim)
            alive = [k for k in keys if key_slot(backend._rkey(k)) not in lost_slots]
            assert 0 < len(alive) < 60
            pid = victim.pid
            assert pid is not None
            if fault == "killed":
                victim.kill()
            else:
                os.kill(pid, signal.SIGSTOP)
            try:

                async def batches() -> None:
                    for _ in range(3):  # each fails on the lost node
                        outcomes = await backend.get(keys, buffers(60), namespace=NS)
                        assert outcomes.count(Outcome.OK) == len(alive)
                    for _ in range(2):
                        into = buffers(len(alive))
                        outcomes = await backend.get(alive, into, namespace=NS)
                        assert outcomes == [Outcome.OK] * len(alive)
                    more, more_pages, more_metas = make_pages(60)
                    outcomes = await backend.put(more, more_pages, more_metas)
                    on_live = [key_slot(backend._rkey(k)) not in lost_slots for k in more]
                    assert [o == Outcome.OK for o in outcomes] == on_live

                await asyncio.wait_for(batches(), FAULT_TIMEOUT_S)
            finally:
                if fault == "stopped":
                    os.kill(pid, signal.SIGCONT)


async def test_more_batches_than_connections_wait_for_a_turn(redis_cluster_url: str) -> None:
    # A cluster node's pool does not wait: past max_connections redis-py fails the call and
    # closes every connection under the others. The backend runs at most max_connections
    # commands and pipelines at once instead, so all of these succeed.
    url = fresh_url(redis_cluster_url, max_connections=2, get_pipeline_bytes="8KiB")
    async with RedisStorage.from_url(url) as backend:
        keys, pages, metas = make_pages(64)
        assert await backend.put(keys, pages, metas) == [Outcome.OK] * 64

        async def read() -> None:
            into = buffers(64)
            assert await backend.get(keys, into, namespace=NS) == [Outcome.OK] * 64
            assert [joined(b) for b in into] == [joined(p) for p in pages]

        async def write() -> None:
            assert await backend.put(*make_pages(8)) == [Outcome.OK] * 8

        calls = [read() for _ in range(10)] + [write() for _ in range(10)]
        await asyncio.wait_for(asyncio.gather(*calls), FAULT_TIMEOUT_S)
        assert backend.stats().errors == 0


async def test_a_node_lost_under_concurrent_batches_raises_only_storage_errors() -> None:
    # redis-py closes every connection after a fault, under the calls still using them; what
    # those then raise inside redis-py must still reach the caller as ERROR or StorageError.
    with RedisClusterServer(node_timeout=0.5) as cluster:
        url = fresh_url(cluster.url, timeout=2, get_pipeline_bytes="8KiB")
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(64)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 64
            first_round = asyncio.Event()
            rounds = 6
            errors = 0

            async def worker(i: int) -> None:
                nonlocal errors
                for n in range(rounds):
                    if n == 1:
                        first_round.set()
                    try:
                        if i % 3 == 0:
                            outcomes = await backend.get(keys, buffers(64), namespace=NS)
                        elif i % 3 == 1:
                            outcomes = await backend.put(*make_pages(8))
                        else:
                            await backend.exists(keys)
                            continue
                    except StorageError:
                        errors += 1
                        continue
                    assert set(outcomes) <= {Outcome.OK, Outcome.ERROR}
                    errors += outcomes.count(Outcome.ERROR)

            async def kill() -> None:
                await first_round.wait()
                cluster.nodes[2].kill()

            work = [worker(i) for i in range(12)]
            await asyncio.wait_for(asyncio.gather(kill(), *work), FAULT_TIMEOUT_S)
            assert errors > 0


async def test_a_cluster_that_never_answered_gives_errors() -> None:
    with RedisClusterServer() as cluster:
        url = fresh_url(cluster.url, timeout=1)
    async with RedisStorage.from_url(url) as backend:
        keys, pages, metas = make_pages(2)
        outcomes = await asyncio.wait_for(backend.put(keys, pages, metas), FAULT_TIMEOUT_S)
        assert outcomes == [Outcome.ERROR] * 2
        got = await asyncio.wait_for(backend.get(keys, buffers(2), namespace=NS), FAULT_TIMEOUT_S)
        assert got == [Outcome.ERROR] * 2
        with pytest.raises(StorageError):
            await asyncio.wait_for(backend.exists(keys), FAULT_TIMEOUT_S)


@pytest.mark.parametrize("bulk", [1, 0])
async def test_a_plain_client_on_a_cluster_node_says_to_use_cluster_mode(
    redis_cluster: RedisClusterServer, bulk: int
) -> None:
    node = redis_cluster.nodes[0]
    url = f"redis://127.0.0.1:{node.port}/0?prefix=t{uuid.uuid4().hex}&bulk={bulk}"
    keys, pages, metas = make_pages(16)
    with structlog.testing.capture_logs() as logs:
        async with RedisStorage.from_url(url) as backend:
            put = await backend.put(keys, pages, metas)
            got = await backend.get(keys, buffers(16), namespace=NS)
    assert Outcome.ERROR in put  # the keys of the other two primaries
    assert [o is Outcome.OK for o in got] == [o is Outcome.OK for o in put]
    events = [entry for entry in logs if entry["event"] == "storage.redis.cluster_node"]
    assert len(events) == 1
    assert "cluster=1" in events[0]["hint"]


def test_cluster_configuration_errors() -> None:
    with pytest.raises(StorageConfigError, match="only database 0"):
        RedisStorage.from_url("redis://127.0.0.1:7000/1?cluster=1")
    with pytest.raises(StorageConfigError, match="only database 0"):
        RedisStorage("redis://127.0.0.1:7000/2", cluster=True)
    with pytest.raises(StorageConfigError, match="different cluster slots"):
        RedisStorage.from_url("redis://127.0.0.1:7000/0?cluster=1&multikey=1")
    with pytest.raises(StorageConfigError, match="cluster"):
        RedisStorage.from_url("redis://127.0.0.1:7000/0?cluster=maybe")
    with pytest.raises(StorageConfigError, match="as arguments"):
        RedisStorage("redis://127.0.0.1:7000/0?cluster=1")
    # The accepted parameters, listed in the error about an unknown one, name it.
    with pytest.raises(StorageConfigError, match="cluster"):
        RedisStorage.from_url("redis://127.0.0.1:7000/0?clutser=1")
    storage = RedisStorage.from_url("redis://127.0.0.1:7000?cluster=1&multikey=0")
    assert storage.name == "redis://127.0.0.1:7000/0?prefix=hicache&cluster=1"
    assert (storage._multikey, storage._bulk_wanted) == (False, False)
    assert RedisStorage.from_url("redis://127.0.0.1:7000/0?cluster=0")._multikey


async def test_credentials_a_cluster_refuses_fail_the_open(redis_cluster_url: str) -> None:
    # The cluster client wraps the node's refusal; it is a configuration error all the same.
    url = fresh_url(redis_cluster_url.replace("redis://", "redis://nouser:wrong@"))
    with pytest.raises(StorageConfigError, match="refused this configuration") as info:
        async with RedisStorage.from_url(url):
            pytest.fail("opened with credentials the cluster refuses")
    assert "wrong" not in str(info.value)


async def test_a_close_after_a_command_failed_on_a_down_cluster_closes_every_connection() -> None:
    # redis-py answers CLUSTERDOWN by closing the client within the call, which the backend
    # turns into a mark to learn the slot map again (closing would cut the other nodes'
    # pipelines): a command that failed for good left the map marked, and redis-py's close
    # skips a marked client, so the connections to the live nodes stayed open.
    def connections(node: RedisServer) -> int:
        client = node_client(node)
        try:
            return sum(1 for c in client.client_list() if c["cmd"] != "client|list")
        finally:
            client.close()

    with RedisClusterServer(node_timeout=0.5) as cluster:
        backend = RedisStorage.from_url(fresh_url(cluster.url, timeout=2))
        async with backend:
            keys, pages, metas = make_pages(8)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 8
            victim, survivors = cluster.nodes[1], [cluster.nodes[0], cluster.nodes[2]]
            victim.kill()

            await asyncio.wait_for(
                asyncio.gather(*(cluster_failed(node) for node in survivors)), FAULT_TIMEOUT_S
            )
            with pytest.raises(StorageError):
                await backend.read_raw(keys[0])
            assert sum(connections(node) for node in survivors) > 0
        assert [connections(node) for node in survivors] == [0, 0]


async def test_a_manifest_warns_where_only_one_primary_may_evict_it(
    redis_cluster: RedisClusterServer,
) -> None:
    # CONFIG GET has no key: redis-py sent it to the default node only, so a primary that
    # holds namespaces and evicts when full went unseen (and another node's policy was told).
    url = fresh_url(redis_cluster.url)
    async with open_storage(url) as backend:
        assert isinstance(backend, RedisStorage)
        client = backend._redis()
        default = client.get_default_node()
        assert default is not None
        victim = next(n for n in redis_cluster.nodes if n.port != default.port)
        admin = node_client(victim)
        try:
            admin.config_set("maxmemory-policy", "allkeys-lru")
            admin.config_set("maxmemory", "100mb")
            manifest = backend.manifest(ManifestLimits(max_entries=16, max_entry_bytes=4096))
            with structlog.testing.capture_logs() as logs:
                await manifest.read()
            told = [r for r in logs if r["event"] == "hicache.manifest.evictable"]
            assert [r["policy"] for r in told] == ["allkeys-lru"]
        finally:
            admin.config_set("maxmemory", 0)
            admin.config_set("maxmemory-policy", "noeviction")
            admin.close()


async def test_a_user_refused_the_command_table_opens_and_serves(
    redis_cluster: RedisClusterServer,
) -> None:
    # redis-py asks a node for the command table (`COMMAND`) when it opens a cluster client,
    # and failed the open where an ACL that lists commands leaves it out.
    user = f"u{uuid.uuid4().hex[:12]}"
    admins = [node_client(node) for node in redis_cluster.nodes]
    try:
        for admin in admins:
            rules = ["+@all", "-command"]
            admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], commands=rules)
        url = fresh_url(redis_cluster.url.replace("redis://", f"redis://{user}:pw@"))
        async with RedisStorage.from_url(url) as backend:
            keys, pages, metas = make_pages(60)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 60
            assert await backend.exists(keys) == 60
            assert await backend.get(keys, buffers(60), namespace=NS) == [Outcome.OK] * 60
            assert await backend.delete(keys[:20]) == 20
            left = sum(len(pages_on(node, backend.prefix)) for node in redis_cluster.nodes)
            assert left == 40
            assert backend.stats().pages == 40
            entries = [chain_entry(NS, make_pages(2)[0], 8, 0, float(i)) for i in range(3)]
            await backend.manifest().append(entries)
            read = await backend.manifest().read()
            assert {e.chain_id for e in read.entries} == {e.chain_id for e in entries}
    finally:
        for admin in admins:
            admin.acl_deluser(user)
            admin.close()


async def test_the_manifest_read_script_finds_its_node_without_asking_one(
    redis_cluster: RedisClusterServer,
) -> None:
    # redis-py asked a node for the keys of every EVAL_RO (COMMAND GETKEYS, with the
    # script's text): two round trips more per read window, and a user refused that
    # subcommand could not read the manifest at all.
    user = f"u{uuid.uuid4().hex[:12]}"
    admins = [node_client(node) for node in redis_cluster.nodes]
    try:
        for admin in admins:
            admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
            admin.execute_command("ACL", "SETUSER", user, "-command|getkeys")
        async with RedisStorage.from_url(fresh_url(redis_cluster.url)) as writer:
            entries = [chain_entry(NS, make_pages(2)[0], 8, 0, float(i)) for i in range(3)]
            await writer.manifest().append(entries)
            prefix = writer.prefix
        url = fresh_url(redis_cluster.url.replace("redis://", f"redis://{user}:pw@"), prefix=prefix)
        for admin in admins:
            admin.config_resetstat()
        async with RedisStorage.from_url(url) as reader:
            read = await reader.manifest().read()
        assert {e.chain_id for e in read.entries} == {e.chain_id for e in entries}
        stats = [admin.info("commandstats") for admin in admins]
        assert sum(s.get("cmdstat_eval_ro", {}).get("calls", 0) for s in stats) >= 1
        assert not [s["cmdstat_command|getkeys"] for s in stats if "cmdstat_command|getkeys" in s]
    finally:
        for admin in admins:
            admin.acl_deluser(user)
            admin.close()
