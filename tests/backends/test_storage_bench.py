"""Smoke tests of `hicache-async bench storage` against every built-in backend, at tiny sizes.

They check that the records are complete and well formed, each with its raw baseline, and
that the bench leaves nothing behind; never how fast anything is.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from hicache_async import StorageError
from hicache_async.bench import Record, storage
from hicache_async.bench._storage_mooncake import RawModes as MooncakeRawModes
from hicache_async.cli import main
from hicache_async.storage._mooncake import close_idle_clients, pooled_client
from hicache_async.testing import MooncakeMaster, RedisClusterServer

_TINY = ["--shape", "small", "--pages", "3", "--reps", "1", "--batch", "2"]
_THROUGHPUT = ["put_gbps", "get_gbps", "exists64_us"]


def _run(backend: str, *extra: str) -> dict[str, Record]:
    parser = argparse.ArgumentParser()
    storage.add_arguments(parser)
    records = storage.run(parser.parse_args(["--backend", backend, *_TINY, *extra]))
    by = {r.name: r for r in records}
    assert len(by) == len(records), "record names must be unique"
    return by


def _check(by: dict[str, Record], scheme: str, figures: list[str]) -> None:
    assert sorted(by) == sorted(f"storage.{scheme}.small.{f}" for f in figures)
    for name, r in by.items():
        assert math.isfinite(r.value), r
        assert r.value > 0, r
        assert r.baseline is not None, r
        assert r.baseline > 0, r
        assert r.ratio is not None, r
        assert r.ratio > 0, r
        assert r.unit == ("us" if name.endswith("exists64_us") else "GB/s"), r
        if name.endswith("exists64_us"):
            # One figure each, not paired runs: the ratio is exactly value / baseline.
            assert r.ratio == pytest.approx(r.value / r.baseline), r


def test_file_records(tmp_path: Path) -> None:
    by = _run(f"file://{tmp_path}")
    figures = ["put_gbps", "put_new_gbps", "get_hot_gbps", "get_cold_gbps", "exists64_us"]
    _check(by, "file", [*figures, "raw_checked_put_gbps", "raw_checked_get_hot_gbps"])
    assert list(tmp_path.iterdir()) == []  # its store and the baseline's files are gone


def test_memory_records() -> None:
    _check(_run("memory://"), "memory", _THROUGHPUT)


def test_redis_records(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        # The server is shared with other tests, some of whose keys expire meanwhile: the
        # check is that no key is new, not that the count is the same.
        before = set(client.scan_iter(count=1000))
        _check(_run(redis_url), "redis", _THROUGHPUT)
        assert set(client.scan_iter(count=1000)) - before == set()  # ours and the baseline's
    finally:
        client.close()


def test_redis_cluster_records(redis_cluster: RedisClusterServer) -> None:
    import redis

    clients = [redis.Redis(host=node.host, port=node.port) for node in redis_cluster.nodes]
    try:
        before = [set(client.scan_iter(count=1000)) for client in clients]  # it is shared
        # The baseline runs redis-py's cluster clients: a plain client would meet MOVED.
        _check(_run(redis_cluster.url), "redis", _THROUGHPUT)
        after = [set(client.scan_iter(count=1000)) for client in clients]
        assert [a - b for a, b in zip(after, before, strict=True)] == [set()] * len(clients)
    finally:
        for client in clients:
            client.close()


def test_mooncake_records(mooncake_url: str) -> None:
    by = _run(mooncake_url)
    _check(by, "mooncake", [*_THROUGHPUT, "raw_checked_put_gbps", "raw_checked_get_gbps"])
    for op in ("put", "get"):
        # The checked calls are the plain calls plus hashing, against those same plain calls.
        ceiling = by[f"storage.mooncake.small.raw_checked_{op}_gbps"]
        assert ceiling.baseline == by[f"storage.mooncake.small.{op}_gbps"].baseline


def test_mooncake_checked_raw_calls_verify_what_they_read(mooncake_url: str) -> None:
    with MooncakeRawModes(mooncake_url, 4096, 3) as raw:
        assert raw.put("whole", checked=True) > 0
        assert raw.get("whole", checked=True) > 0
        raw._digests[1] ^= 1  # as if the second page had come back other than it was sent
        with pytest.raises(RuntimeError, match="other bytes"):
            raw.get("whole", checked=True)
        assert raw.get("whole") > 0  # the plain call does not hash
    for call in (lambda: raw.put("whole"), lambda: raw.get("whole"), raw.exists_us):
        with pytest.raises(RuntimeError, match="outside its with block"):
            call()


def test_mooncake_raw_modes(mooncake_url: str) -> None:
    with MooncakeRawModes(mooncake_url, 4096, 5) as raw:
        assert raw.modes == ["c5", "whole"]
        with pytest.raises(RuntimeError, match="get before any put"):
            raw.get("whole")
        with pytest.raises(ValueError, match="modes: c5, whole"):
            raw.put("c16")
        assert raw.put("whole") > 0
        assert raw.get("c5") > 0  # checks the bytes came back
        first = list(raw._keys)
        assert raw.put("c5") > 0  # removes the first put's objects
        keys = list(raw._keys)
        assert raw.exists_us() > 0
    with pooled_client(mooncake_url) as client:
        assert list(client.batch_is_exist(first + keys)) == [0] * 10
    with pytest.raises(ValueError, match=">= 1"):
        MooncakeRawModes(mooncake_url, 0, 1)


def test_mooncake_raw_calls_follow_the_urls_placement(mooncake_url: str) -> None:
    # A segment size of its own: a fresh client, whose segment has room for local placement.
    url = mooncake_url + "&placement=local&segment_size=64MiB"
    with MooncakeRawModes(url, 4096, 6) as raw:
        raw.put("whole")
        own = raw._store.get_hostname()
        described = raw._store.batch_get_replica_desc(raw._keys)
        endpoints = {
            replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for replicas in described.values()
            for replica in replicas
        }
        assert endpoints == {own}
        assert raw.get("c6") > 0


def test_mooncake_bench_on_a_full_cluster_fails_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The only segment is full of objects the master may not evict: every put is refused.
    from mooncake.store import ReplicateConfig

    with MooncakeMaster() as master:
        with pooled_client(master.url + "&segment_size=16MiB") as lender:
            config = ReplicateConfig()
            config.with_hard_pin = True
            config.preferred_segment = str(lender.get_hostname())
            for i in range(64):
                if lender.put(f"filler{i}", bytes(1 << 20), config) != 0:
                    break
            else:
                pytest.fail("16 MiB segment took 64 MiB of hard-pinned objects")
            url = master.url + "&segment_size=0"
            no_room = pytest.raises(StorageError, match="no room")
            with MooncakeRawModes(url, 4096, 3) as raw, no_room:
                raw.put("whole")
            capsys.readouterr()
            assert main(["bench", "storage", "--backend", url, *_TINY]) == 1
            err = capsys.readouterr().err
            assert "failed: raw mooncake put failed with [-200]" in err, err
        # The pooled clients are closed while their master answers, so no later command's
        # exit finds them orphaned.
        close_idle_clients(master.address)
