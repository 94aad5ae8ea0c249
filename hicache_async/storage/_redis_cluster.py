"""redis-py's asyncio Redis Cluster client, with the guards `RedisStorage` needs on it.

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
* **Relearning.** After a lost node (or CLUSTERDOWN) fails a pipeline, redis-py closes every
  connection of every node before it tries again with the slot map learnt anew; the
  pipelines running on the other nodes then lose their replies, and a batch split per node
  lost the keys of healthy nodes with those of the lost one. Within a call the client only
  marks the slot map to be learnt again at the next command, as it does itself for a single
  command that lost its node; a connection that failed has closed itself already.
* **ASK.** redis-py follows an ASK redirect with `ASKING` and then the command, each on a
  connection it takes from the node's free ones; it takes the one freed longest ago and so,
  with two or more free, sends the command on another connection than `ASKING`. The node
  then answers MOVED back to the old owner, which answers ASK again, until the redirects
  run out: every key of a slot being moved failed. A node's free connections are taken
  most recently freed first here, so the command follows `ASKING` on its connection.
* **Timeouts.** redis-py's cluster client sends a command or pipeline that timed out again
  (after relearning the slot map, and for a pipeline a 0.25 s pause), whatever retry it was
  given: a silent node took over twice `timeout` to fail a call. `timeout` is the bound the
  user set on a call, so here a timeout is not retried; a lost or refused connection, MOVED,
  ASK, TRYAGAIN and CLUSTERDOWN still are.
* **Command table.** redis-py asks the first primary of its slot map for the command table
  (`COMMAND`) each time it learns the map, and fails the call if that node does not answer:
  a lost first primary (down, or frozen once a timeout marks the map stale: below) failed
  every call, the keys of the nodes that answer included, until it came back. The table
  is asked once and kept. Where `COMMAND` is refused (an ACL that lists commands without it,
  or a server that renamed it away) the client opened no more; it then finds a command's
  keys by rule: every argument for `DEL`, `EXISTS`, `TOUCH`, `UNLINK`, `MGET` and `WATCH`,
  the argument after the subcommand for `OBJECT` and `MEMORY`, the first two for `RENAME`
  and its kind, and otherwise the first.
* **Scripts.** redis-py sends SCRIPT LOAD to every primary and fails if one does not answer;
  here it fails only when none took the script, so a lost primary fails the scripts of its
  own keys only.
* **Read-only scripts.** redis-py finds the slot of an `EVAL` or `EVALSHA` from its own
  arguments, but asks a node for the keys of `EVAL_RO` and `EVALSHA_RO` (`COMMAND GETKEYS`,
  with the script's text): two round trips more for each of the manifest's read windows, a
  user refused `COMMAND GETKEYS` could not read the manifest at all, and a lost seed node
  failed every such read. Their keys lie where `EVAL`'s do, so their slot is found the same
  way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from typing import Any

from redis._parsers import AsyncCommandsParser
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["GuardedCluster", "closed_by_server"]

# Set while this task holds a turn: a call the client makes from within one (a redirected
# command of a pipeline, a script load) must not wait for a second turn.
_HOLDING_TURN: ContextVar[bool] = ContextVar("hicache_redis_cluster_turn", default=False)


class _LastFreedFirst(collections.deque[Connection]):
    """A cluster node's free connections, from which redis-py takes the leftmost: a
    connection freed goes to the left, so the next command runs on it (see ASK above)."""

    def append(self, connection: Connection) -> None:
        self.appendleft(connection)

    def popleft(self) -> Connection:
        connection = super().popleft()
        if closed_by_server(connection):
            # As the standalone pool (see `_send_once`): a connection the server closed while
            # it sat here (`timeout` in redis.conf) failed the next pipeline sent on it. Its
            # next send connects again; the check costs no system call.
            connection._close()  # type: ignore[no-untyped-call]
        return connection


#: Where the command table is refused, the keys of a command are found by these rules:
#: every argument, those after a subcommand, the first two, or else the first.
_EVERY_ARGUMENT_A_KEY = frozenset({"del", "unlink", "exists", "touch", "mget", "watch"})
_KEY_AFTER_SUBCOMMAND = frozenset({"object", "memory"})
_TWO_KEYS = frozenset({"rename", "renamenx", "copy", "smove", "rpoplpush", "lmove"})


def _keys_by_rule(args: Sequence[Any]) -> tuple[Any, ...] | None:
    """The keys of the command `args`, without a command table (see "Command table")."""
    if len(args) < 2:
        return None
    name = str(args[0]).lower().split()
    if len(name) > 1:  # `SCRIPT LOAD` and the like, sent as one word: keyless
        return None
    if name[0] in _EVERY_ARGUMENT_A_KEY:
        return tuple(args[1:])
    if name[0] in _KEY_AFTER_SUBCOMMAND:
        return tuple(args[2:3]) or None
    if name[0] in _TWO_KEYS:
        return tuple(args[1:3])
    return (args[1],)


class _KeptCommands(AsyncCommandsParser):
    """The command table, asked of a node once (see "Command table" above)."""

    _by_rule = False

    async def initialize(self, node: ClusterNode | None = None) -> None:
        if node is not None:
            self.node = node
        if self.commands or self._by_rule:
            return
        try:
            await super().initialize(node)
        except ResponseError as error:
            # An ACL without `COMMAND` (one that lists commands), or a server where it is
            # renamed away: the cluster could not be opened at all.
            if not isinstance(error, NoPermissionError) and type(error) is not ResponseError:
                raise
            self._by_rule = True

    async def get_keys(self, *args: Any) -> Any:
        if self._by_rule:
            return _keys_by_rule(args)
        return await super().get_keys(*args)


def closed_by_server(connection: object) -> bool:
    """Whether the server has closed `connection` (its end of stream already received)."""
    reader = getattr(connection, "_reader", None)
    return isinstance(reader, asyncio.StreamReader) and reader.at_eof()


#: Script commands whose keys redis-py would ask a node for (see `_determine_slot`).
_READ_ONLY_SCRIPTS = frozenset({"EVAL_RO", "EVALSHA_RO"})

#: The failures after which the client sends a call again: redis-py's, but a timeout.
_ERRORS_ALLOW_RETRY: tuple[type[Exception], ...] = tuple(
    error for error in RedisCluster.ERRORS_ALLOW_RETRY if not issubclass(error, RedisTimeoutError)
)


class GuardedCluster(RedisCluster):
    """`RedisCluster` running at most `turns` commands or pipelines at once, whose failures
    are always `RedisError`s (or the client's own `RedisClusterException`s), and which does
    not send a call that timed out again."""

    # Read by redis-py's execute_command as `self.__class__.ERRORS_ALLOW_RETRY`; typed there
    # as the exact tuple redis-py lists.
    ERRORS_ALLOW_RETRY = _ERRORS_ALLOW_RETRY  # type: ignore[assignment]

    def __init__(self, *args: Any, turns: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turns = asyncio.Semaphore(turns)
        self.commands_parser = _KeptCommands()

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold one of the turns for the block (or nothing, if this task holds one)."""
        if _HOLDING_TURN.get():
            yield
            return
        self._reuse_last_freed()
        async with self._turns:
            token = _HOLDING_TURN.set(True)
            try:
                yield
            finally:
                _HOLDING_TURN.reset(token)

    async def initialize(self, *args: Any, **kwargs: Any) -> GuardedCluster:
        await super().initialize(*args, **kwargs)
        self._reuse_last_freed()  # the nodes it may have learnt
        return self

    def _reuse_last_freed(self) -> None:
        # redis-py's private free list: a release that lays it out otherwise keeps its order.
        for node in self.nodes_manager.nodes_cache.values():
            free = getattr(node, "_free", None)
            if isinstance(free, collections.deque) and not isinstance(free, _LastFreedFirst):
                node._free = _LastFreedFirst(free, maxlen=free.maxlen)

    async def aclose(self) -> None:
        """Close every connection; called by redis-py within a call (holding a turn) to
        relearn the slot map after a fault, it only marks the map to be learnt again."""
        if _HOLDING_TURN.get():
            self._initialize = True
            return
        # redis-py closes only a client whose map is not marked stale, and a call that failed
        # for good leaves it marked, with the connections to the other nodes still open.
        self._initialize = False
        await super().aclose()

    async def _determine_slot(self, command: str, *args: Any) -> int:
        # `EVAL_RO script numkeys key ...`: the keys where EVAL has them (see above).
        if isinstance(command, str) and command.upper() in _READ_ONLY_SCRIPTS:
            command = "EVAL"
        return await super()._determine_slot(command, *args)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.turn():
            try:
                return await super().execute_command(*args, **kwargs)
            except (RedisError, RedisClusterException):
                raise
            except Exception as exc:
                raise _lost(exc) from exc

    async def script_load(self, script: Any) -> Any:
        """SCRIPT LOAD on every primary that answers; its SHA1 digest.

        redis-py sends it to every primary and fails if one does not answer, so a script's
        first call on a live node failed while another primary was lost (its keys' node is
        the one that needs it). Raises only when no primary took the script."""
        nodes = self.get_primaries()
        replies = await asyncio.gather(
            *(self.execute_command("SCRIPT LOAD", script, target_nodes=node) for node in nodes),
            return_exceptions=True,
        )
        failures = [reply for reply in replies if isinstance(reply, BaseException)]
        loaded = [reply for reply in replies if not isinstance(reply, BaseException)]
        if loaded:
            return loaded[0]
        if failures:
            raise failures[0]
        raise RedisClusterException("SCRIPT LOAD: no primary is known")

    def by_node(self, keys: Sequence[bytes]) -> list[list[int]]:
        """The indexes of `keys` grouped by the node that owns each key's slot in the
        client's slot map, groups in the order of their first key, each in the order of
        `keys`. Keys of a slot the map lacks (not learnt yet) make one group of their own,
        which the cluster pipeline routes as it can; a stale map costs a MOVED, which it
        follows."""
        # As redis-py's own get_node_from_key, for bytes keys and without its error.
        # A release without the slot map's cache: one group, routed by the pipeline.
        slots: dict[int, list[Any]] = getattr(self.nodes_manager, "slots_cache", {})
        groups: dict[str | None, list[int]] = {}
        for i, key in enumerate(keys):
            owners = slots.get(self.keyslot(key))
            groups.setdefault(owners[0].name if owners else None, []).append(i)
        return list(groups.values())

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
        # redis-py's strategies name `RedisCluster.ERRORS_ALLOW_RETRY`, timeouts included.
        # Before redis-py 6.2 pipelines have no strategies: their own retries stay.
        strategy = getattr(self, "_execution_strategy", None)
        if _strategies is None or _UntimedPipelineStrategy is None or strategy is None:
            return
        pipeline_strategy, transaction_strategy = _strategies
        if isinstance(strategy, transaction_strategy):
            retry = copy.copy(client.retry)
            retry.update_supported_errors(
                (*_ERRORS_ALLOW_RETRY, *strategy.SLOT_REDIRECT_ERRORS)  # type: ignore[arg-type]
            )
            strategy._retry = retry
        elif type(strategy) is pipeline_strategy:
            self._execution_strategy = _UntimedPipelineStrategy(self)

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


def _load_strategies() -> tuple[type[Any], type[Any]] | None:
    try:
        from redis.asyncio.cluster import (  # type: ignore[attr-defined,unused-ignore]
            PipelineStrategy,
            TransactionStrategy,
        )
    except ImportError:
        return None
    return PipelineStrategy, TransactionStrategy


_strategies = _load_strategies()


def _untimed_pipeline_strategy(base: type[Any]) -> type[Any]:
    """redis-py's strategy for a pipeline outside a transaction (`base`), whose `execute` is
    redis-py's but for the failures it sends the pipeline again after: those of
    `GuardedCluster`."""

    class UntimedPipelineStrategy(base):  # type: ignore[misc]
        async def execute(
            self, raise_on_error: bool = True, allow_redirections: bool = True
        ) -> list[Any]:
            if not self._command_queue:
                return []
            client = self._pipe.cluster_client
            try:
                retries = client.retry.get_retries()
                while True:
                    try:
                        if client._initialize:
                            await client.initialize()
                        result: list[Any] = await self._execute(
                            client,
                            self._command_queue,
                            raise_on_error=raise_on_error,
                            allow_redirections=allow_redirections,
                        )
                    except _ERRORS_ALLOW_RETRY:
                        if retries <= 0:
                            raise
                        # Again with the slot map learnt anew (see `GuardedCluster.aclose`).
                        retries -= 1
                        await client.aclose()
                        await asyncio.sleep(0.25)
                    except RedisTimeoutError:
                        # Not sent again, but the next call learns the slot map anew, as
                        # redis-py does after a single command's timeout: a frozen primary's
                        # replica may have taken over its slots, and the old map would send
                        # their keys to the frozen node until it woke up.
                        await client.aclose()
                        raise
                    else:
                        return result
            finally:
                await self.reset()

    return UntimedPipelineStrategy


_UntimedPipelineStrategy = (
    None if _strategies is None else _untimed_pipeline_strategy(_strategies[0])
)


def _lost(error: Exception) -> RedisConnectionError:
    return RedisConnectionError(f"cluster connection lost under the call: {error!r}")
