"""Real servers for the backend tests: a redis-server, a Redis Cluster and a mooncake_master
per session.

A missing binary fails these fixtures (and the tests that use them); it never skips them.
"""

from hicache_async.testing._fixtures import (
    redis_cluster,
    redis_cluster_url,
    redis_server,
    redis_url,
)

# The mooncake_master fixtures are in tests/conftest.py: the fork tests use them too.
__all__ = [
    "redis_cluster",
    "redis_cluster_url",
    "redis_server",
    "redis_url",
]
