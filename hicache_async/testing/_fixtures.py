"""Session-scoped pytest fixtures that run real storage servers on loopback.

Import them into a `conftest.py` (`from hicache_async.testing._fixtures import redis_url`, ...).
A missing server binary makes the fixture fail with `ServerBinaryNotFoundError`: a suite that
needs Redis or Mooncake should fail, not skip, where they are not installed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from ._servers import MooncakeMaster, RedisClusterServer, RedisServer

__all__ = [
    "close_mooncake_clients",
    "mooncake_master",
    "mooncake_url",
    "redis_cluster",
    "redis_cluster_url",
    "redis_server",
    "redis_url",
]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A `redis-server` on a free 127.0.0.1 port for the whole session."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    """`redis://127.0.0.1:PORT/0` of the session's server."""
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServer]:
    """A Redis Cluster of three primaries on free 127.0.0.1 ports for the whole session."""
    with RedisClusterServer() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_cluster_url(redis_cluster: RedisClusterServer) -> str:
    """`redis://127.0.0.1:PORT/0?cluster=1` of the session's cluster (PORT: a seed node)."""
    return redis_cluster.url


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A `mooncake_master` with its HTTP metadata server on free 127.0.0.1 ports.

    Before it stops, the pooled Mooncake clients of closed backends are closed while it still
    answers (otherwise Mooncake's exit handler spends seconds trying to unmount them).
    """
    with MooncakeMaster() as master:
        try:
            yield master
        finally:
            close_mooncake_clients(master)


def close_mooncake_clients(master: MooncakeMaster) -> int:
    """Close the idle pooled clients of `master`, if the Mooncake backend was ever loaded."""
    module = sys.modules.get("hicache_async.storage._mooncake")
    if module is None:
        return 0
    closed: int = module.close_idle_clients(master.address)
    return closed


@pytest.fixture(scope="session")
def mooncake_url(mooncake_master: MooncakeMaster) -> str:
    """A `mooncake://` URL for the session's master (TCP transport, loopback hostname)."""
    return mooncake_master.url
