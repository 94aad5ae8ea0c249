"""redis-py's asyncio Redis Cluster client, with the two guards `RedisStorage` needs on it.

* **Turns.** A cluster node's pool does not wait for a free connection: past its bound it
  raises `MaxConnectionsError`, which the client treats like a lost node and answers by
  closing every connection of every node, under the other calls still using them. So at
  most `turns` commands or pipelines run at once and the others wait for a turn; each holds
  at most one connection per node, so no node's pool is ever exhausted by them.
* **Foreign errors.** When the client closes its connections after a fault (a lost node,
  CLUSTERDOWN), a concurrent call can fail inside redis-py with something other than a
  `RedisError` (seen: `AttributeError` on a writer already gone). Those are raised as
  `redis.exceptions.ConnectionError`, so that the backend turns them into `ERROR` outcomes
  or `StorageError` like any other lost connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

__all__ = ["GuardedCluster"]

# Set while this task holds a turn: a call the client makes from within one (a redirected
# command of a pipeline, a script load) must not wait for a second turn.
_HOLDING_TURN: ContextVar[bool] = ContextVar("hicache_redis_cluster_turn", default=False)


class GuardedCluster(RedisCluster):
    """`RedisCluster` running at most `turns` commands or pipelines at once, whose failures
    are always `RedisError`s (or the client's own `RedisClusterException`s)."""

    def __init__(self, *args: Any, turns: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turns = asyncio.Semaphore(turns)

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold one of the turns for the block (or nothing, if this task holds one)."""
        if _HOLDING_TURN.get():
            yield
            return
        async with self._turns:
            token = _HOLDING_TURN.set(True)
            try:
                yield
            finally:
                _HOLDING_TURN.reset(token)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.turn():
            try:
                return await super().execute_command(*args, **kwargs)
            except (RedisError, RedisClusterException):
                raise
            except Exception as exc:
                raise _lost(exc) from exc

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        # Built as redis-py builds its own: the abstract attribute mypy sees comes from a
        # typing protocol of redis-py's that ClusterPipeline never sets.
        return _GuardedPipeline(self, transaction)  # type: ignore[abstract]


class _GuardedPipeline(ClusterPipeline):
    """A cluster pipeline whose `execute` takes a turn and raises only `RedisError`s."""

    def __init__(self, client: GuardedCluster, transaction: Any | None = None) -> None:
        super().__init__(client, transaction)
        self._guarded = client

    async def execute(
        self, raise_on_error: bool = True, allow_redirections: bool = True
    ) -> list[Any]:
        async with self._guarded.turn():
            try:
                return await super().execute(raise_on_error, allow_redirections)
            except (RedisError, RedisClusterException):
                raise
            except Exception as exc:
                raise _lost(exc) from exc


def _lost(error: Exception) -> RedisConnectionError:
    return RedisConnectionError(f"cluster connection lost under the call: {error!r}")
