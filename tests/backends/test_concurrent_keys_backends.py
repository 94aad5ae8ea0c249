"""Overlapping puts, gets, deletes and `exists` of the same keys on Redis and Mooncake, through
one client and through two clients of one store, with and without faults and cancellations;
see `_key_races`.

Neither checks `stats().pages` against the store: a client's count is its own estimate. A
Redis put cancelled after its SETs were sent may have stored pages it never counts, and
Mooncake's put answers the same code whether it stored an object or found it there, so a
put that raced another put of its key counts the page again. Mooncake's put also answers OK
for a key another put is still writing, so a get meanwhile may miss it.
"""

from __future__ import annotations

import uuid

import pytest
from _key_races import Race, race_and_check

from hicache_async.storage._mooncake import MooncakeStorage
from hicache_async.storage._redis import RedisStorage
from hicache_async.testing._faults import FaultyStorage

_SEEDS = [1, 2]
_MOONCAKE = "&segment_size=512MiB&buffer_size=16MiB&staging_size=8MiB"


def _redis(url: str, prefix: str) -> RedisStorage:
    return RedisStorage.from_url(f"{url}?prefix={prefix}")


def _mooncake(url: str, prefix: str, extra: str = "") -> MooncakeStorage:
    return MooncakeStorage.from_url(f"{url}{_MOONCAKE}&prefix={prefix}{extra}")


@pytest.mark.parametrize("seed", _SEEDS)
@pytest.mark.parametrize("clients", [1, 2])
async def test_redis(seed: int, clients: int, redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}"
    await race_and_check(
        lambda: [_redis(redis_url, prefix) for _ in range(clients)],
        Race(seed, check_occupancy=False),
    )


@pytest.mark.parametrize("seed", _SEEDS)
async def test_redis_without_cancellations_counts_its_pages(seed: int, redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}"
    await race_and_check(lambda: [_redis(redis_url, prefix)], Race(seed, cancel_rate=0.0))


@pytest.mark.parametrize("seed", _SEEDS)
async def test_redis_with_faults(seed: int, redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}"

    def backends() -> list[FaultyStorage]:
        inner = _redis(redis_url, prefix)
        return [FaultyStorage(inner, seed=seed, error_rate=0.1, partial_batch_rate=0.2)]

    await race_and_check(backends, Race(seed, faults=True, check_occupancy=False))


@pytest.mark.parametrize("seed", _SEEDS)
@pytest.mark.parametrize("clients", [1, 2])
@pytest.mark.parametrize("direct_reads", ["true", "false"])
async def test_mooncake(seed: int, clients: int, direct_reads: str, mooncake_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}"
    extra = f"&direct_reads={direct_reads}"
    await race_and_check(
        lambda: [_mooncake(mooncake_url, prefix, extra) for _ in range(clients)],
        Race(seed, check_occupancy=False, ok_is_readable=False),
        pooled=True,
    )


@pytest.mark.parametrize("seed", _SEEDS)
async def test_mooncake_with_faults(seed: int, mooncake_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}"

    def backends() -> list[FaultyStorage]:
        inner = _mooncake(mooncake_url, prefix)
        return [FaultyStorage(inner, seed=seed, error_rate=0.1, partial_batch_rate=0.2)]

    await race_and_check(
        backends,
        Race(seed, faults=True, check_occupancy=False, ok_is_readable=False),
        pooled=True,
    )


@pytest.mark.parametrize("seed", _SEEDS)
async def test_damaged_pages_on_redis(seed: int, redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}"

    def backends() -> list[RedisStorage | FaultyStorage]:
        inner = _redis(redis_url, prefix)
        damaging = FaultyStorage(inner, seed=seed, corrupt_rate=0.2, truncate_rate=0.2)
        return [damaging, _redis(redis_url, prefix)]

    await race_and_check(backends, Race(seed, faults=True, check_occupancy=False))


@pytest.mark.parametrize("seed", _SEEDS)
async def test_damaged_pages_on_mooncake(seed: int, mooncake_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}"

    def backends() -> list[MooncakeStorage | FaultyStorage]:
        inner = _mooncake(mooncake_url, prefix)
        damaging = FaultyStorage(inner, seed=seed, corrupt_rate=0.2, truncate_rate=0.2)
        return [damaging, _mooncake(mooncake_url, prefix)]

    race = Race(seed, faults=True, check_occupancy=False, ok_is_readable=False)
    await race_and_check(backends, race, pooled=True)
