"""`HiCache`: the facade that owns the pools, the tree, the copy engine and the workers."""

from __future__ import annotations

import asyncio
import functools
import stat
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Literal

import anyio
import anyio.lowlevel
import msgspec
import structlog

from ._config import (
    PREFETCH_POLICIES,
    CacheConfig,
    PrefetchPolicy,
    WarmupConfig,
    read_regular_file,
)
from ._errors import (
    CacheClosedError,
    ConfigError,
    HiCacheError,
    OutOfPagesError,
    WorkersFailedError,
    type_name,
)
from ._keys import Namespace, TokenIds, as_token_array, page_keys
from ._loop import LoopOwner
from ._metrics import Histogram
from ._pool import KVPool, PoolStatistics, make_pools
from ._ratelog import LogLimiter
from ._request import Request, check_count
from ._stats import CacheStatistics, Counters, TierTokens
from ._uncancelled import finish_uncancelled
from .distributed import (
    BackgroundAgreements,
    CollectiveError,
    RankGroup,
    agree_min,
    agreement_tag,
)
from .storage import StorageBackend
from .storage._page import check_priority
from .storage._protocol import STORAGE_ACCEPTED, check_backend
from .storage._registry import import_quietly, module_to_import
from .transfer import CopyEngine, LayerwiseCopy, default_copy_engine
from .tree import MatchResult, RadixTree, TreeNode, TreeStatistics
from .workers import (
    BackupWorker,
    PrefetchHandle,
    PrefetchResult,
    StorageLink,
    StorageStatus,
    Warmer,
    WarmupResult,
    WarmupStatus,
)
from .workers._prefetch import StartOrder

__all__ = ["HiCache", "MatchInfo"]

# Failed device -> host backups of a page in a row before an allocation prefers to free
# something else, and before it gives up on the page altogether.
_BACKUP_TRIES = 2
_BACKUP_GIVE_UP = 8

_log = structlog.get_logger("hicache_async")


def _read_mac_key(path: str) -> bytes:
    """The MAC secret from `path`, refusing a file others can read."""
    # A regular file only (a FIFO would block the constructor for ever); a symbolic link is
    # followed, as mounted secrets are commonly links.
    data, status = read_regular_file(path, "mac_key_file", 4096)
    if status.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError("mac_key_file", f"{path} is readable by others; chmod 600 it")
    key = data[:4096].strip()
    if len(key) < 16:
        raise ConfigError("mac_key_file", "the secret must be at least 16 bytes")
    return key


def _rank_salt_refusal(config: CacheConfig, own: Namespace, given: Namespace) -> str:
    """Why a given namespace's rank salt does not fit this cache, and which one to use."""
    own_salt = f"with rank_salt={own.rank_salt!r}" if own.rank_salt else "without a rank_salt"
    fix = (
        "build it with Namespace.from_config(config) of this configuration (its salt field, "
        f"or .salted(), keeps tenants apart), or give a namespace of your own {own_salt}"
    )
    if own.rank_salt:
        # Tensor-parallel ranks hold different shards under the same chain keys: only the
        # rank salt keeps one rank from reading another's pages as its own.
        return (
            f"rank {config.tp_rank} of {config.tp_size} stores its own shard under its own "
            f"rank_salt {own.rank_salt!r}, got {given.rank_salt!r}: it would read another "
            f"rank's shard as its own; {fix}"
        )
    whole = "MLA ranks share whole pages" if config.tp_size > 1 else "a single rank"
    return (
        f"this cache holds whole pages ({whole}), but the namespace carries the rank_salt "
        f"{given.rank_salt!r} of one tensor-parallel rank: it would read that rank's shard "
        f"as whole pages; {fix}"
    )


def _innermost(exc: BaseException) -> BaseException:
    """The error inside the exception groups anyio wraps it in, one per task group it left
    (read by their `exceptions`: Python 3.10 has no builtin exception groups)."""
    inner = getattr(exc, "exceptions", None)
    while isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc


# Where a `HiCache` stands in its life (`HiCache.state`).
_State = Literal["new", "opening", "open", "closing", "closed"]


class MatchInfo:
    """What the cache holds for a prompt, without taking anything (see `HiCache.match`)."""

    __slots__ = ("device_tokens", "host_tokens", "keys", "num_tokens")

    def __init__(self, num_tokens: int, keys: list[bytes], device: int, host: int) -> None:
        self.num_tokens = num_tokens
        self.keys = keys
        self.device_tokens = device
        self.host_tokens = host

    def __repr__(self) -> str:
        return (
            f"<MatchInfo tokens={self.num_tokens} device={self.device_tokens} "
            f"host={self.host_tokens}>"
        )


class HiCache:
    """A hierarchical KV cache owned by one event loop.

    Use as ``async with HiCache(config) as cache:``. Entering allocates the pools (off the
    loop's thread) and starts the workers; leaving waits for in-flight copies and closes
    everything. Every method must be called from the loop that entered it.

    The cache may be left from several tasks (a lifespan teardown and a shutdown hook): a
    leave that comes while another is closing returns once that close has finished, and one
    that comes while another task is still making the pools waits for that, then closes the
    cache (or returns, if the entry failed). One that comes while the entry attaches its
    `storage=` closes at once, cutting the attach short (that entry raises `HiCacheError`).
    Cancelling a leave that waits stops only its own wait, never the close.
    """

    # The link a detach (or the exit, or a cancelled attach) is closing, once it is no longer
    # `_link`: an attach waits for it to let go of its backend (a file root's lock), a second
    # detach and the exit for its flush. Stale once that link is closed.
    _closing: StorageLink | None = None

    def __init__(
        self,
        config: CacheConfig,
        *,
        storage: StorageBackend | str | None = None,
        mac_key: bytes | None = None,
        copy_engine: CopyEngine | None = None,
        namespace: Namespace | None = None,
        rank_group: RankGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        if mac_key is not None and not isinstance(mac_key, bytes):
            # Otherwise found only on entry, and never without storage.
            raise TypeError(f"mac_key must be bytes or None, got {type(mac_key).__name__}")
        if storage is not None and not isinstance(storage, str):
            check_backend(storage, "storage", accepted=STORAGE_ACCEPTED)  # not only on entry
        # Each would otherwise fail only once the cache is open, as an AttributeError.
        if namespace is not None and not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace or None, got {type_name(namespace)}")
        if copy_engine is not None and not all(
            callable(getattr(copy_engine, name, None)) for name in ("copy", "aclose", "statistics")
        ):
            raise TypeError(
                "copy_engine must be a CopyEngine (copy, aclose, statistics) or None, "
                f"got {type_name(copy_engine)}"
            )
        if rank_group is not None and not all(
            isinstance(getattr(rank_group, name, None), int) for name in ("rank", "size")
        ):
            raise TypeError(f"rank_group must be a RankGroup or None, got {type_name(rank_group)}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type_name(clock)}")
        if rank_group is not None and (
            rank_group.size != config.tp_size or rank_group.rank != config.tp_rank
        ):
            raise ConfigError(
                "tp_rank",
                f"the rank group is rank {rank_group.rank} of {rank_group.size} but the "
                f"configuration says tp_rank={config.tp_rank}, tp_size={config.tp_size}",
            )
        own = Namespace.from_config(config)
        if namespace is not None and namespace.rank_salt != own.rank_salt:
            raise ConfigError("namespace", _rank_salt_refusal(config, own, namespace))
        if mac_key is None and config.mac_key_file is not None:
            mac_key = _read_mac_key(config.mac_key_file)
        if mac_key is not None and len(mac_key) < 16:
            raise ConfigError("mac_key", "the secret must be at least 16 bytes")
        self._config = config
        self._rank_group = rank_group
        # Where each prefetch start stands, for the agreements of cancelled starts.
        self._start_order = (
            StartOrder(rank_group) if rank_group is not None and rank_group.size > 1 else None
        )
        self._namespace = namespace or own
        self._owner = LoopOwner("HiCache")
        self._tree = RadixTree(eviction=config.eviction, owner=self._owner, clock=clock)
        self._engine_arg = copy_engine
        self._engine: CopyEngine | None = None
        self._device_pool: KVPool | None = None
        self._host_pool: KVPool | None = None
        # Warmups running in callers' tasks (`warmup()`): a close releases no pool under them.
        self._callers_warming = 0
        # The pools' last statistics, once a close has released them.
        self._closed_pools: tuple[PoolStatistics | None, PoolStatistics | None] = (None, None)
        self._state: _State = "new"
        self._counters = Counters()
        # Weak: a request dropped without release is collected, and its `__del__` hands
        # the release back to the loop (`_release_dropped`) instead of leaking its locks.
        self._requests: weakref.WeakSet[Request] = weakref.WeakSet()
        # Collected requests whose release is still to run that `_requests` no longer lists
        # (gc clears the weak references of a reference cycle before finalizing it): they
        # count as live until released. A plain set, whose add and discard are atomic, as
        # `Request.__del__` may run in any thread.
        self._dropped: set[Request] = set()
        self._copies: set[LayerwiseCopy] = set()
        # Host page -> the load copying it to the device. Keyed by host page, not node id:
        # a node split after the load started keeps its host pages but not its id.
        self._loading: dict[int, LayerwiseCopy] = {}
        self._device_backups = 0
        # Device page -> device -> host backups of it that failed in a row: past
        # `_BACKUP_TRIES` of them within one allocation, it stops starting them (each failure
        # wakes it to retry, so it would only spin) and lets the fallback free something else.
        self._backup_failures: dict[int, int] = {}
        # Loads of released requests: their pages become evictable when they land.
        self._abandoned_loads = 0
        # A broken rank group fails every agreement after it: logged once a minute.
        self._tp_log = LogLimiter()
        # Device pages being copied to the host. Keyed by page, not node id: a split gives
        # the head a new id, and a node's pages are all in flight or none (nodes only split).
        self._backing_up: set[int] = set()
        self._capacity_changed = asyncio.Event()
        # Set once `__aenter__` has ended (however it ended), and once a close has finished:
        # a leave that comes meanwhile from another task waits on them.
        self._entry_ended = asyncio.Event()
        self._close_ended = asyncio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._storage_arg = storage if storage is not None else config.storage
        self._mac_key = mac_key
        self._link: StorageLink | None = None
        # What ended the workers' task group while the cache was open (None while it runs):
        # the calls that need workers raise `WorkersFailedError` from then on.
        self._workers_failed: str | None = None
        self._generation = 0
        self._prefetch_wait = Histogram("prefetch_wait")
        self._storage_get_latency = Histogram("storage_get_batch")
        self._storage_put_latency = Histogram("storage_put_batch")

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> HiCache:
        if self._state != "new":
            raise CacheClosedError(f"a HiCache can be entered once; this one is {self._state}")
        self._owner.bind()
        self._state = "opening"
        try:
            await self._enter()
        finally:
            self._entry_ended.set()
        return self

    async def _enter(self) -> None:
        try:
            device, host = await anyio.to_thread.run_sync(make_pools, self.config)
            self._device_pool, self._host_pool = device, host
            self._engine = self._engine_arg or default_copy_engine(device.device)
            # The workers' task group lives in a supervisor task, so the cache may be left
            # from another task than the one that entered it (async fixtures, lifespans).
            started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._supervisor = asyncio.create_task(self._supervise(started))
            await started
        except BaseException:
            self._state = "closed"
            self._stop.set()  # a supervisor that started before the cancellation ends
            raise
        self._state = "open"
        config = self.config
        if (
            config.write_policy != "write_back"
            and config.resolved_host_pages <= config.device_pages
        ):
            # A write-through host copy stays as long as its device page: a host pool no
            # larger than the device is all copies, with no room for reads or backups.
            _log.warning(
                "hicache.config.host_pool_small",
                host_pages=config.resolved_host_pages,
                device_pages=config.device_pages,
                write_policy=config.write_policy,
            )
        if self._storage_arg is not None:
            try:
                await self.attach_storage(self._storage_arg)
            except BaseException as exc:
                await self.__aexit__(type(exc), exc, exc.__traceback__)
                raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the cache (see the class docstring for a leave from several tasks)."""
        if self._state in ("new", "closed"):
            return  # nothing to do, from anywhere (teardown may run it again elsewhere)
        # Before any state changes or waits: from another thread this would wait on the owner
        # loop's supervisor (a deadlock if that loop is blocked), from another loop it cannot
        # await it.
        self._owner.check()
        if self._state == "opening":
            # Another task is entering: returning now would leave the cache to open and stay
            # open. What the entry ends in decides below (open, closed, or another leave's
            # close under way).
            await self._entry_ended.wait()
        if self._state == "closing":
            # Another task's close: a caller that reopens the same file root right after
            # must find its lock released. Cancelling this wait leaves that close alone.
            await self._close_ended.wait()
        if self._state != "open":
            return
        self._state = "closing"
        self._capacity_changed.set()  # waiters for pages see the cache closing
        link = self._link

        def hurry() -> None:
            # The attached link, and a detach's that the exit waits for.
            for each in (link, self._closing):
                if each is not None:
                    each.hurry()

        # A cancelled exit (a shutdown under a timeout) gives up the flush, never the close:
        # the copy threads and the backend are closed before the cancellation goes on.
        cancelled = await finish_uncancelled(self._shut_down(), on_cancel=hurry)
        if cancelled is not None:
            raise cancelled

    async def _shut_down(self) -> None:
        try:
            for request in list(self._requests):
                request.release()
            # Copies first: a device -> host backup landing now is still offered to storage,
            # so pages committed just before leaving are flushed too.
            while self._copies:
                await asyncio.gather(*self._copies, return_exceptions=True)
            # A detach in progress flushes within its deadline before the workers' task
            # group, which runs its link's workers, is stopped.
            await self._wait_closing()
            link, self._link = self._link, None
            if link is not None:
                await self._close_link(link, flush=True)
        finally:
            # Even when this task itself is cancelled (the loop shutting down): the copy
            # engine's threads must not outlive the cache.
            try:
                if self._engine is not None and self._engine_arg is None:
                    await self._engine.aclose()
            finally:
                self._state = "closed"
                self._stop.set()
                supervisor, self._supervisor = self._supervisor, None
                try:
                    if supervisor is not None:
                        await asyncio.wait([supervisor])
                    pools = self._release_pools()
                    if pools:
                        # The last references, dropped on a worker thread: the kernel takes
                        # about 0.1 s a GiB to unmap them (CUDA longer for pinned memory),
                        # which on the loop stalled every other task. Cancelled (the loop
                        # ending), they go with this frame, on the loop.
                        await anyio.to_thread.run_sync(pools.clear)
                finally:
                    self._close_ended.set()

    def _release_pools(self) -> list[KVPool]:
        """Let go of the pools, returning them (for the caller to drop where it likes).

        A closed cache may live on (a reference in a registry, a traceback): its pools'
        memory, device memory included, goes now. Not while a copy could still touch them.
        """
        if (
            self._copies
            or self._callers_warming
            or self._device_pool is None
            or self._host_pool is None
        ):
            return []
        self._closed_pools = (self._device_pool.statistics(), self._host_pool.statistics())
        pools = [self._device_pool, self._host_pool]
        self._device_pool = self._host_pool = None
        return pools

    async def _supervise(self, started: asyncio.Future[None]) -> None:
        """Own the workers' task group from entry to exit; workers are cancelled at exit."""
        if started.done():
            return  # the entry was cancelled before this task first ran
        began = False
        ended: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                started.set_result(None)
                began = True
                await self._stop.wait()
                tg.cancel_scope.cancel()
        except BaseException as exc:
            ended = exc
            if not started.done():
                started.set_exception(exc)
            elif isinstance(exc, asyncio.CancelledError):
                # Not a failure of the workers: the loop is shutting down (asyncio.run cancels
                # the tasks left), and before that the cache should have been left.
                if not self._stop.is_set():
                    _log.warning(
                        "hicache.unclosed",
                        reason="the event loop ended with the cache open; leave it with "
                        "`async with` (or await __aexit__) before the loop ends",
                    )
            else:
                _log.error("hicache.workers.failed", error=repr(exc))
        finally:
            self._task_group = None
            if began and not self._stop.is_set():
                self._workers_ended(ended)

    def _workers_ended(self, exc: BaseException | None) -> None:
        """The workers' task group ended while the cache was open, not by its close: a
        `KeyboardInterrupt` or `SystemExit` escaped a worker (it went on out of the event loop
        from that worker's task), or the loop cancelled the supervisor. Every link's `run()`
        ended with the group, releasing its waiters; the attached one, whose backend is
        closed, is detached, and what needs workers raises `WorkersFailedError` from now on
        rather than quietly missing."""
        self._workers_failed = (
            repr(_innermost(exc)) if exc is not None else "their task group ended"
        )
        link, self._link = self._link, None
        if link is not None:
            self._forget_storage()
            self._log_detached(link)

    # -- public API -------------------------------------------------------------------------

    @property
    def device_pool(self) -> KVPool:
        """The device (L1) pool; the model reads and writes KV here."""
        self._check_open()
        assert self._device_pool is not None
        return self._device_pool

    @property
    def host_pool(self) -> KVPool:
        """The host (L2) pool."""
        self._check_open()
        assert self._host_pool is not None
        return self._host_pool

    # Read-only: the checks above hold for the cache's whole life only if nothing can swap
    # these afterwards (another rank's namespace, a page size the pools were not made for).
    @property
    def config(self) -> CacheConfig:
        """The configuration the cache was built with."""
        return self._config

    @property
    def namespace(self) -> Namespace:
        """The namespace the cache's page keys are made in."""
        return self._namespace

    @property
    def rank_group(self) -> RankGroup | None:
        """The tensor-parallel rank group (None without one)."""
        return self._rank_group

    # Read-only: exported histograms only grow for the cache's life (a scraper takes a
    # count that goes down for a restart).
    @property
    def prefetch_wait(self) -> Histogram:
        """Seconds callers waited for prefetches."""
        return self._prefetch_wait

    @property
    def storage_get_latency(self) -> Histogram:
        """Seconds per storage get batch."""
        return self._storage_get_latency

    @property
    def storage_put_latency(self) -> Histogram:
        """Seconds per storage put batch."""
        return self._storage_put_latency

    @property
    def state(self) -> _State:
        """Where the cache stands: `"new"`, `"opening"`, `"open"`, `"closing"` or `"closed"`.

        A plain read, safe from any thread (the admin endpoint reads it from its own).
        """
        return self._state

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that owns the cache (None before it is entered)."""
        return self._owner.loop

    def open_storage(self, url: str) -> StorageBackend:
        """A backend for `url` set up as this cache would (its MAC key), not yet entered."""
        from .storage import open_storage

        return open_storage(url, mac_key=self._mac_key)

    @property
    def tree(self) -> RadixTree:
        """The radix tree (read its statistics; do not mutate it behind the cache's back)."""
        return self._tree

    def keys_for(self, tokens: TokenIds, *, salt: str | bytes | None = None) -> list[bytes]:
        """Page keys of `tokens` in this cache's namespace (and the request's salt).

        Raises `InvalidTokensError` for bad tokens, `TypeError` for a salt that is not a
        `str`, `bytes` or None.
        """
        namespace = self.namespace if salt is None else self.namespace.salted(salt)
        return page_keys(tokens, self.config.page_size, namespace.seed)

    def match(self, tokens: TokenIds, *, salt: str | bytes | None = None) -> MatchInfo:
        """How much of `tokens` is on the device and on the host. Takes nothing."""
        self._check_open()
        array = as_token_array(tokens)
        keys = self.keys_for(array, salt=salt)
        found = self._tree.match(keys, touch=False)
        size = self.config.page_size
        return MatchInfo(
            len(array), keys, found.num_device_pages * size, found.num_host_pages * size
        )

    def request(
        self,
        tokens: TokenIds,
        *,
        request_id: str | None = None,
        salt: str | bytes | None = None,
        max_cached_tokens: int | None = None,
        priority: int = 0,
    ) -> Request:
        """Start a request: lock its device prefix and hold its host extension for `load()`.

        Use as ``with cache.request(tokens) as req:``; leaving the block releases it.
        `max_cached_tokens` caps the cached prefix the request uses (tensor-parallel ranks
        pass the agreed figure so every rank computes the same tokens). `priority` is given
        to the pages it commits: higher priorities are evicted last (pin a system prompt).
        """
        self._check_open()
        # Stored in every page header: refused here, not by a backup much later.
        priority = check_priority(priority)
        array = as_token_array(tokens)
        keys = self.keys_for(array, salt=salt)
        if max_cached_tokens is not None:
            limit = check_count("max_cached_tokens", max_cached_tokens) // self.config.page_size
            found = self._tree.match(keys[:limit])
            cached = found.num_device_pages + found.num_host_pages
            group = self.rank_group
            if cached < min(limit, len(keys)) and group is not None and group.size > 1:
                # The ranks agreed on more than this one still has: an await came between
                # the agreement and this call. The ranks now compute different tokens.
                _log.warning(
                    "hicache.tp.prefix.short",
                    request_id=request_id,
                    agreed_tokens=max_cached_tokens,
                    cached_tokens=cached * self.config.page_size,
                )
            found = MatchResult(
                keys=keys,
                device_pages=found.device_pages,
                device_node=found.device_node,
                host_pages=found.host_pages,
                host_node=found.host_node,
            )
        else:
            found = self._tree.match(keys)
        request = Request(self, array, keys, found, request_id, priority=priority)
        if found.num_host_pages:
            self._tree.protect_host(found.host_node)
        self._requests.add(request)
        counters = self._counters
        size = self.config.page_size
        counters.requests += 1
        counters.tokens_requested += len(array)
        counters.tokens_device += found.num_device_pages * size
        counters.tokens_host += found.num_host_pages * size
        if self.config.write_policy == "write_through_selective":
            self._back_up_hot(found)
        return request

    async def agree_cached_tokens(
        self, tokens: TokenIds, *, salt: str | bytes | None = None
    ) -> int:
        """The cached prefix (device + host) every tensor-parallel rank has, in tokens.

        Enters exactly one collective when a rank group is set, whatever happens locally;
        every rank must make its agreeing calls in the same order (one that pairs with
        another prompt's agreement on some rank is an error there, and the answer is 0). A
        running warmup is stopped first, at the same entry on every rank, and the local
        figure is taken after it stopped. The prefix this rank offers stays protected
        (cached, on the device or the host) until the agreement returns: call
        `request(..., max_cached_tokens=...)` right after it, with no await in between.
        Tokens this cache refuses (`TypeError`, `ValueError`) and a closed cache
        (`CacheClosedError`) raise once the collective has been entered with 0. Refused
        tokens enter under a tag no valid prompt has: unless every rank refused the same way,
        that is an `AgreementMismatch`, so the peers get 0 and the group is broken, as after
        any mismatch.
        """
        self._owner.check()  # a call from another thread enters nothing
        group = self.rank_group
        if group is None or group.size == 1:
            info = self.match(tokens, salt=salt)
            await anyio.lowlevel.checkpoint()
            return info.device_tokens + info.host_tokens
        refused: Exception | None = None
        try:
            array = as_token_array(tokens)
            keys = self.keys_for(array, salt=salt)
            # The last key names the whole prefix (keys are chained).
            tag = agreement_tag("agree_cached_tokens", len(array), *keys[-1:])
        except (TypeError, ValueError) as exc:
            refused = exc
            tag = agreement_tag("agree_cached_tokens", "refused")
        background = BackgroundAgreements.of(group)
        held: list[TreeNode] = []

        async def mine() -> int:
            nonlocal refused
            # Taken once the warmup has stopped (it may have loaded or evicted pages
            # meanwhile); the gate below then returns in this same step.
            await background.wait_idle()
            if refused is not None:
                return 0
            try:
                self._check_open()
            except CacheClosedError as exc:
                refused = exc
                return 0
            # Held until the agreement returns: the loop serves others meanwhile, and what
            # this rank offers must still be here when every rank has agreed.
            tokens, nodes = self._hold_prefix(keys)
            held.append(nodes)
            return tokens

        try:
            agreed = await agree_min(group, mine, tag=tag, gate=background.wait_idle)
        except CollectiveError as exc:
            # The group is broken: no rank can rely on another's cache, so use none of it.
            self._agreement_failed(exc)
            agreed = 0
        finally:
            for nodes in held:
                self._let_go(nodes)
        if refused is not None:
            raise refused
        return agreed

    # -- storage ----------------------------------------------------------------------------

    async def attach_storage(self, storage: StorageBackend | str) -> None:
        """Attach an L3 backend (a URL or a backend object, which the cache then owns).

        Raises if one is attached (or opening) already: detach it first. A detach that comes
        while this one opens waits for the open to end and closes the backend; this call
        raises `HiCacheError` then. A detach still closing is waited for first (its backend
        may hold what this one opens, a file root). Cancelled once the backend opened, the
        backend is detached again, without a flush, before the cancellation goes on.
        """
        self._check_open()
        if (module := module_to_import(storage)) is not None:
            # The process's first attach of such a scheme imports a client library (about
            # 0.1 s here): on a worker thread, not on the loop.
            await anyio.to_thread.run_sync(import_quietly, module)
            self._check_open()
        # A detach still closing holds its backend (a file root's lock) until it has closed.
        await self._wait_closing()
        self._check_open()
        task_group = self._check_workers()
        if self._link is not None:
            raise HiCacheError(
                f"storage {self._link.backend.name!r} is attached; detach it before attaching"
            )
        backend = self.open_storage(storage) if isinstance(storage, str) else storage
        # Counted once the backend opened: a failed attach leaves no trace in the status.
        link = StorageLink(self, backend, self._generation + 1)
        self._link = link
        try:
            await link.start(task_group)
        except BaseException as exc:
            if self._link is link:
                self._link = None
                if link.running:
                    # Cancelled once the backend had opened, before this call resumed: the
                    # task group cancelled the link's task, which closes no worker's queue
                    # and wakes no waiter. Closed as a detach without a flush would.
                    self._forget_storage()
                    await self._close_link(link, flush=False)
            if isinstance(exc, Exception) and self._workers_failed is not None:
                # The workers ended while it opened (the task group then refuses its task).
                raise self._workers_failed_error() from exc
            raise
        if self._link is not link:  # a detach (or the cache's close) came while it opened
            if self._workers_failed is not None:
                raise self._workers_failed_error()
            raise HiCacheError(f"storage {backend.name!r} was detached while it was opening")
        self._generation = link.generation
        _log.info("hicache.storage.attached", backend=backend.name)
        if self.config.warmup.enabled:
            link.start_warmup(self._warmup_on_attach)

    async def detach_storage(self, *, flush: bool = True) -> None:
        """Detach the backend without waiting for idle.

        Prefetches in flight are cancelled (their requests go on without them); pending
        backups are flushed within `backup.flush_deadline_s` or, with `flush=False`,
        dropped, the write in progress cancelled at once; then the backend is closed.
        Detaching when nothing is attached does nothing; while another detach (or the
        cache's exit) is closing a backend, this returns once that close has finished.
        `flush` must be a bool (`TypeError` otherwise: "no" is true).
        """
        self._owner.check()
        if not isinstance(flush, bool):
            raise TypeError(f"flush must be a bool, got {type_name(flush)}")
        # One in progress (or the exit's close): this one returns once that has finished.
        await self._wait_closing()
        link = self._link
        if link is None:
            return
        self._link = None
        self._forget_storage()
        # A cancelled detach gives up the flush, not the close (see StorageLink.close).
        await self._close_link(link, flush=flush)

    def _forget_storage(self) -> None:
        """Unmark every node in storage: pages acknowledged by the old backend are not in the
        next one."""
        for node in self._tree.iter_nodes():
            if node.in_storage:
                self._tree.mark_in_storage(node, False)

    async def _close_link(self, link: StorageLink, *, flush: bool) -> None:
        """Close `link`, no longer `_link`, where every other caller sees it (`_closing`)."""
        self._closing = link
        try:
            await link.close(flush=flush, deadline_s=self.config.backup.flush_deadline_s)
        finally:
            if self._closing is link:
                self._closing = None
            self._log_detached(link)

    @staticmethod
    def _log_detached(link: StorageLink) -> None:
        # The link's figures go with it: what it left unwritten is said here, or nowhere.
        backup = link.backup
        (_log.warning if backup.dropped_pages else _log.info)(
            "hicache.storage.detached",
            backend=link.backend.name,
            written_pages=backup.written_pages,
            dropped_pages=backup.dropped_pages,
            failed_pages=backup.failed_pages,
        )

    def _check_workers(self) -> anyio.abc.TaskGroup:
        """The workers' task group; `WorkersFailedError` if it ended while the cache was open
        (a call that needs workers would otherwise quietly do nothing)."""
        task_group = self._task_group
        if task_group is None or self._failure() is not None:
            raise self._workers_failed_error()
        return task_group

    def _failure(self) -> str | None:
        """What ended the workers, if anything did: known from the moment a worker failed,
        before the task groups above it have unwound (`_workers_ended`)."""
        if self._workers_failed is not None:
            return self._workers_failed
        link = self._link
        if link is not None and link.failed_with is not None:
            return repr(_innermost(link.failed_with))
        return None

    def _workers_failed_error(self) -> WorkersFailedError:
        return WorkersFailedError(
            f"the cache's workers stopped ({self._failure() or 'their task group ended'}): "
            "storage cannot be attached, prefetched from or warmed up any more; leave the "
            "cache and open a new one"
        )

    async def _wait_closing(self) -> None:
        """Wait until no link is closing. Cancelling the caller stops only its wait: the close
        goes on in the task that started it."""
        while (link := self._closing) is not None and not link.closed:
            await link.wait_closed()

    def storage_status(self) -> StorageStatus:
        """Whether storage is attached, and its backend's and workers' statistics."""
        self._owner.check()
        return self._storage_status()

    def _storage_status(self) -> StorageStatus:
        link = self._link
        failure = self._failure()
        if link is None or failure is not None:
            # A link whose workers failed is detached once the task groups have unwound.
            status = StorageStatus(attached=False, workers_failed=failure)
        elif not link.running:  # not attached until the backend has opened: can take long
            status = StorageStatus(attached=False, opening=True, backend=link.backend.name)
        else:
            status = link.status()
        closing = self._closing
        if closing is None or not closing.flushing:
            return status
        # Its series are gone with the link: without this a long flush at a detach or at
        # shutdown showed nothing until it had ended.
        return msgspec.structs.replace(
            status,
            flushing=closing.backup.statistics(),
            flushing_backend=closing.backend.name,
        )

    def _agreement_failed(self, exc: Exception, **fields: object) -> None:
        """Log a prefetch's or `agree_cached_tokens()`'s failed collective: a broken group
        fails every one after it, so a repeated error is logged at most once a minute."""
        self._tp_log.warn(_log, "hicache.tp.agreement.failed", repr(exc), **fields)

    async def warmup(
        self, *, ratio: float | None = None, deadline_s: float | None = None
    ) -> WarmupResult:
        """Load the most valuable prefixes of the attached store into the host pool.

        Entries go by priority, then recency, up to `ratio` (default `warmup.ratio`) of the
        host pool, yielding to live prefetches; it stops at the budget, the deadline, a detach
        or the cache's close. With a rank group the ranks load the prefixes of their entries
        that every rank holds (docs/warmup.md). Cancelling it keeps the pages that already
        landed. A `ratio`
        outside [0, 1] or a `deadline_s` that is negative or not finite raises `ConfigError`.
        """
        self._check_open()
        self._check_workers()
        # The configuration's own checks, so the same limits apply (ConfigError naming
        # warmup.ratio or warmup.deadline_s), with or without storage.
        limits = WarmupConfig(
            ratio=self.config.warmup.ratio if ratio is None else ratio,
            deadline_s=self.config.warmup.deadline_s if deadline_s is None else deadline_s,
        )
        link = self._link
        if link is None:
            await anyio.lowlevel.checkpoint()
            return WarmupResult(status=WarmupStatus.NO_STORAGE)
        warmer = Warmer(self, link, ratio=limits.ratio, deadline_s=limits.deadline_s)
        link.warmers.add(warmer)
        # Run in the caller's task, so a close does not wait for it: the pools stay until it
        # has seen the close and ended.
        self._callers_warming += 1
        try:
            result = await warmer.run()
        finally:
            link.warmers.discard(warmer)
            self._callers_warming -= 1
            if self._state == "closed":
                self._release_pools()
        _log.info("hicache.warmup.done", status=result.status.value, pages=result.pages_loaded)
        return result

    async def _warmup_on_attach(self) -> WarmupResult:
        """`warmup()` as an attach starts it. Its task may first run after the cache's close
        began (a cache left without yielding): that ends it as the close ends a warmup
        under way, `STOPPED`, not as a failure."""
        if self._state != "open":
            await anyio.lowlevel.checkpoint()
            _log.info("hicache.warmup.done", status=WarmupStatus.STOPPED.value, pages=0)
            return WarmupResult(status=WarmupStatus.STOPPED)
        return await self.warmup()

    async def wait_warmup(self) -> WarmupResult | None:
        """The result of the warmup started on attach (`warmup.enabled`), once it ends."""
        self._check_open()
        self._check_workers()
        link = self._link
        if link is None or link.warmup_result is None:
            await anyio.lowlevel.checkpoint()
            return None
        future = link.warmup_result
        await asyncio.wait([future])
        if future.cancelled():
            return WarmupResult(status=WarmupStatus.STOPPED)
        return future.result()

    async def start_prefetch(
        self,
        tokens: TokenIds,
        *,
        request_id: str | None = None,
        salt: str | bytes | None = None,
        policy: PrefetchPolicy | None = None,
    ) -> PrefetchHandle:
        """Queue a storage → host prefetch of `tokens`; waits only while the queue is full.

        Under the `timeout` policy that wait counts against the policy's limit (a prefetch
        that finds no room in time is a miss, TERMINATED); `best_effort` does not wait. With
        a rank group, a start that is cancelled (or fails) while it waits still has the
        prefetch's agreement entered, with 0, where its `ready()` would have: after those of
        the prefetches started before it (docs/tensor-parallel.md).
        """
        self._check_open()
        self._check_workers()  # without them a prefetch would quietly miss
        if policy is not None and (not isinstance(policy, str) or policy not in PREFETCH_POLICIES):
            # Otherwise an unknown name would quietly act as `timeout` in the prefetcher.
            accepted = ", ".join(map(repr, PREFETCH_POLICIES))
            raise ValueError(f"policy must be None or one of {accepted}, got {policy!r}")
        array = as_token_array(tokens)
        keys = self.keys_for(array, salt=salt)
        link = self._link
        group = self.rank_group
        if link is not None and not link.running and (group is None or group.size == 1):
            # Still opening (an attach can take up to its timeout): a miss now, rather than
            # a request held in a queue no worker reads yet. Not with a rank group: this
            # rank's agreement must wait, as the peers' do, for the warmup the attach starts
            # (its collectives come first on every rank).
            link = None
        handle = PrefetchHandle(
            link.prefetcher if link else None,
            keys,
            len(array),
            request_id,
            self.config.prefetch.policy if policy is None else policy,
            group=self.rank_group,
            owner=self._owner,
            cache=self,
        )
        if link is None:
            found = self._tree.match(keys, touch=False)
            handle._device_tokens = found.num_device_pages * self.config.page_size
            handle._host_tokens = found.num_host_pages * self.config.page_size
            handle._finish(handle.status.SKIPPED)
        # Numbered right before the awaits: from here every path either hands the handle
        # (to `ready()`) or owes its agreement.
        if self._start_order is not None:
            handle._order = self._start_order
            handle._seq = self._start_order.started()
        try:
            if link is None:
                await anyio.lowlevel.checkpoint()
            else:
                await link.prefetcher.submit(handle)
        except BaseException:
            # Cancelled (or failed) while waiting for queue room: the caller never gets the
            # handle, so no `ready()` would enter the agreement the other ranks are in.
            await handle._enter_unstarted()
            raise
        return handle

    async def prefetch(
        self,
        tokens: TokenIds,
        *,
        request_id: str | None = None,
        salt: str | bytes | None = None,
        policy: PrefetchPolicy | None = None,
    ) -> PrefetchResult:
        """Prefetch `tokens` from storage and wait as the prefetch policy says.

        Cancelling the caller cancels the prefetch (`PrefetchHandle.cancel()`: a read other
        prefetches wait on still lands for them); pages that already landed stay cached.
        With a rank group, every rank must prefetch the same prompts in the same order (one
        scheduler task): a prefetch whose agreement pairs with another prompt's on some rank
        is an `AgreementMismatch`, logged, and its result is a miss. Call
        `request(max_cached_tokens=result.agreed_tokens)` right after, with no await between.
        """
        handle = await self.start_prefetch(tokens, request_id=request_id, salt=salt, policy=policy)
        try:
            return await handle.ready()
        except BaseException:
            handle.cancel()
            raise

    async def drain(self) -> None:
        """Wait until no copy is in flight and no backup is queued or being written.

        Prefetches are not waited for (await their handles). New work started meanwhile is
        waited for too, so call it when the workload has stopped.
        """
        self._check_open()
        while True:
            if self._copies:
                await asyncio.gather(*self._copies, return_exceptions=True)
                continue
            link = self._link
            if link is not None and not link.backup.idle:
                await link.backup.wait_idle()
                continue
            await anyio.lowlevel.checkpoint()
            if not self._copies and (self._link is None or self._link.backup.idle):
                return

    def statistics(self) -> CacheStatistics:
        """A snapshot of counters, pools, tree and copy engine."""
        return self._snapshot(self._tree.statistics())

    def _snapshot(self, tree: TreeStatistics) -> CacheStatistics:
        c = self._counters
        closed = self._closed_pools
        return CacheStatistics(
            state=self._state,
            live_requests=len(self._requests) + len(self._dropped),
            tokens=TierTokens(
                device=c.tokens_device,
                host=c.tokens_host,
                storage=c.tokens_storage,
                computed=c.tokens_computed,
            ),
            counters=c.snapshot(),
            device_pool=self._device_pool.statistics() if self._device_pool else closed[0],
            host_pool=self._host_pool.statistics() if self._host_pool else closed[1],
            tree=tree,
            copy_engine=self._engine.statistics() if self._engine else None,
            storage=(
                self._storage_status()
                if self._link
                or (self._closing and self._closing.flushing)
                or self._workers_failed is not None
                else None
            ),
        )

    def __repr__(self) -> str:
        if self._device_pool is None or self._host_pool is None:
            return f"<HiCache {self._state}>"
        d, h = self._device_pool.allocator, self._host_pool.allocator
        return (
            f"<HiCache {self._state} requests={len(self._requests) + len(self._dropped)} "
            f"device={d.used_count}/{d.capacity} host={h.used_count}/{h.capacity} "
            f"copies={len(self._copies)} nodes={self._tree.num_nodes}>"
        )

    def _histograms(self) -> list[Histogram]:
        return [self._prefetch_wait, self._storage_get_latency, self._storage_put_latency]

    def metrics_text(self) -> str:
        """Every statistic in the Prometheus text exposition format."""
        from ._metrics import render_prometheus

        self._owner.check()
        return render_prometheus(self)

    # -- page allocation --------------------------------------------------------------------

    def _release_dropped(self, request: Request) -> None:
        """Release a request that was garbage-collected unreleased (from `Request.__del__`,
        on the loop), which marked it released. Once the cache is closed its pools are gone,
        and with them the locks."""
        self._dropped.discard(request)
        if self._state == "closed":
            return
        _log.warning(
            "hicache.request.dropped",
            request_id=request.request_id,
            num_tokens=request.num_tokens,
            held_pages=len(request._page_table),
        )
        request._give_back()

    def _check_open(self) -> None:
        self._owner.check()
        if self._state != "open":
            raise CacheClosedError(f"the cache is {self._state}; use it inside `async with`")

    def _device_free(self, pages: Sequence[int]) -> None:
        if pages:
            if self._backup_failures:  # the pages go to other nodes: their record restarts
                for page in pages:
                    self._backup_failures.pop(page, None)
            assert self._device_pool is not None
            self._device_pool.allocator.free(pages)
            self._capacity_changed.set()

    def _host_free(self, pages: Sequence[int]) -> None:
        if pages:
            assert self._host_pool is not None
            self._host_pool.allocator.free(pages)

    def _try_alloc_device(
        self, count: int, failed_before: dict[int, int] | None = None
    ) -> list[int] | None:
        """`count` device pages, evicting as the policy says, or None if they must be waited
        for. `failed_before`: the backup failures recorded when the allocation began (only
        failures since then count against starting a backup again)."""
        assert self._device_pool is not None
        allocator = self._device_pool.allocator
        pages = allocator.alloc(count)
        if pages is not None:
            return pages
        write_back = self.config.write_policy == "write_back"
        eviction = self._tree.evict_device(count - allocator.free_count, backup_first=write_back)
        self._counters.device_evicted_pages += len(eviction.freed)
        self._device_free(eviction.freed)
        failures = self._backup_failures
        before = failed_before or {}

        def failed(node: TreeNode) -> int:
            # Within this allocation: a page that failed for an earlier one gets its tries.
            if not node.device_pages:
                return 0
            page = node.device_pages[0]
            return max(0, failures.get(page, 0) - before.get(page, 0))

        # A backup that failed in a row is not started again at once: each failure wakes
        # this allocation, which would only spin on it while something else could go.
        retrying = [node for node in eviction.needs_backup if failed(node) >= _BACKUP_TRIES]
        started = sum(
            self._back_up_victim(node)
            for node in eviction.needs_backup
            if failed(node) < _BACKUP_TRIES
        )
        if (
            allocator.free_count < count
            and eviction.needs_backup
            and not started
            and not self._device_backups
        ):
            # No backup can start (no host room, or copies failing): pages with a host copy
            # leave first, though later in the eviction order; only then are unbacked leaves
            # dropped, rather than fail.
            for backed_only in (True, False):
                fallback = self._tree.evict_device(
                    count - allocator.free_count, backup_first=False, backed_only=backed_only
                )
                self._counters.device_evicted_pages += len(fallback.freed)
                self._device_free(fallback.freed)
                if allocator.free_count >= count:
                    break
            else:
                # Nothing else could go (a node with children, or protected): its backup is
                # the only way, tried again up to a bound (a copy failing for good then
                # ends in OutOfPagesError, not a request waiting for ever).
                for node in retrying:
                    if failed(node) < _BACKUP_GIVE_UP:
                        self._back_up_to_host([node])
        return allocator.alloc(count)

    async def _alloc_device(self, count: int, request: Request) -> list[int]:
        """`count` device pages for `request`, evicting (and waiting for write-backs) as the
        policy says. Backups to storage that protect what eviction needs give way (a backup
        never fails a request): this then waits at most for their backend call in progress.
        Raises `OutOfPagesError` once nothing in flight could free pages, and
        `CacheClosedError` once `request` is released: checked right before taking the
        pages, with no await after, so a released request never gets any.
        """
        assert self._device_pool is not None
        if count > self._device_pool.num_pages:
            raise OutOfPagesError(
                f"the device pool cannot provide {count} pages: it has only "
                f"{self._device_pool.num_pages} in all; raise device_pages or shorten the prompt"
            )
        await anyio.lowlevel.checkpoint()  # a checkpoint before, never after, taking the pages
        failed_before = dict(self._backup_failures)
        while True:
            self._check_open()
            request._check()
            pages = self._try_alloc_device(count, failed_before)
            if pages is not None:
                return pages
            if self._abandoned_loads < 0:
                # A miscount here would make the wait below endless: repair it, loudly.
                _log.error("hicache.abandoned_loads.negative", value=self._abandoned_loads)
                self._abandoned_loads = 0
            if not self._device_backups and not self._abandoned_loads:
                # Nothing in flight will free pages. Backups to storage may still protect the
                # host pages eviction needs (a device-only node's host-only children, a host
                # too full to take a write-back): they give way, and once the call in progress
                # returns (within backup.io_timeout_s) this tries again. Not when pages locked
                # by running requests are what is missing: giving way could not help.
                backups = [b for b in self._storage_backups() if b.protecting]
                if not backups or self._device_short_of_unlocked(count):
                    raise self._out_of_pages(count)
                for backup in backups:
                    backup.give_way()
                if not any(backup.protecting for backup in backups):
                    continue  # only queued jobs held pages: they are dropped
            self._capacity_changed.clear()
            await self._capacity_changed.wait()

    def _device_short_of_unlocked(self, count: int) -> bool:
        """Whether free device pages and every page no running request locks, together, are
        fewer than `count`: then no eviction could make room."""
        assert self._device_pool is not None
        unlocked = self._tree.statistics().evictable_device_pages
        return self._device_pool.allocator.free_count + unlocked < count

    def _out_of_pages(self, count: int) -> OutOfPagesError:
        assert self._device_pool is not None
        return OutOfPagesError(
            f"the device pool cannot provide {count} pages: "
            f"{self._device_pool.allocator.free_count} free of "
            f"{self._device_pool.num_pages}, the rest in use by running requests"
        )

    def _storage_backups(self) -> list[BackupWorker]:
        """The backup workers of the attached link and of one still closing (its flush)."""
        links = (self._link, self._closing)
        return [link.backup for link in links if link is not None and not link.closed]

    def _try_alloc_host(self, count: int) -> list[int] | None:
        assert self._host_pool is not None
        allocator = self._host_pool.allocator
        pages = allocator.alloc(count)
        if pages is None:
            freed = self._tree.evict_host(count - allocator.free_count)
            self._counters.host_evicted_pages += len(freed)
            self._host_free(freed)
            pages = allocator.alloc(count)
        return pages

    # -- tree paths -------------------------------------------------------------------------

    def _path(self, deep: TreeNode, num_pages: int) -> list[TreeNode]:
        """Nodes (top-down) holding the last `num_pages` pages of the path ending at `deep`.

        Nodes split after an operation started keep page boundaries, so the range an
        operation began with is still a whole number of nodes.
        """
        nodes: list[TreeNode] = []
        total = 0
        node: TreeNode | None = deep
        while total < num_pages:
            assert node is not None, "path left the tree"
            assert node.parent is not None, "path reached the root"
            nodes.append(node)
            total += node.num_pages
            node = node.parent
        assert total == num_pages, "an operation's range no longer ends on a node boundary"
        nodes.reverse()
        return nodes

    def _hold_prefix(self, keys: list[bytes]) -> tuple[int, TreeNode]:
        """Protect the prefix of `keys` cached now, keeping it in the tree (device or host).

        Returns its length in tokens and what `_let_go` takes to undo the hold: what a rank
        offers in an agreement must still be cached once the ranks have agreed. Its device
        pages are not locked: a peer can be late for as long as it likes, and a request on
        this rank meanwhile may still move them to the host rather than fail with
        `OutOfPagesError`.
        """
        found = self._tree.match(keys, touch=False)
        self._tree.protect_host(found.host_node)
        tokens = (found.num_device_pages + found.num_host_pages) * self.config.page_size
        return tokens, found.host_node

    def _let_go(self, held: TreeNode) -> None:
        """Undo one `_hold_prefix`."""
        self._tree.unprotect_host(held)

    def _trim_host(self, keys: list[bytes], keep_pages: int) -> None:
        """Drop host-only pages of `keys` beyond the first `keep_pages` (deepest first)."""
        if keep_pages >= len(keys):
            return
        self._tree.match(keys[:keep_pages], touch=False)  # a node boundary at keep_pages
        found = self._tree.match(keys, touch=False)
        node: TreeNode | None = found.host_node
        depth = found.num_device_pages + found.num_host_pages
        while node is not None and node.parent is not None and depth > keep_pages:
            parent = node.parent
            if node.on_device or node.children or node.host_ref:
                break  # in use, or others built on it: keep it
            depth -= node.num_pages
            self._host_free(self._tree.discard_host_leaf(node))
            node = parent

    def _host_path_pages(self, deep: TreeNode, num_pages: int) -> list[int]:
        pages: list[int] = []
        for node in self._path(deep, num_pages):
            assert node.host_pages is not None
            pages.extend(node.host_pages)
        return pages

    # -- copies -----------------------------------------------------------------------------

    def _engine_done_copy(self) -> LayerwiseCopy:
        """A finished empty copy: what `load()` returns when there is nothing to copy."""
        assert self._engine is not None
        assert self._host_pool
        assert self._device_pool
        copy = self._engine.copy(self._host_pool, [], self._device_pool, [])
        if copy.done():
            return copy
        # An engine may finish even an empty copy later; nothing is booked for this load,
        # and a request takes a done load for a landed one, so hand back a finished handle.
        done = LayerwiseCopy(asyncio.get_running_loop(), copy.num_layers, 0)
        done._layer_landed(done.num_layers - 1)
        return done

    def _track(self, copy: LayerwiseCopy, done: Callable[[LayerwiseCopy], None]) -> None:
        self._copies.add(copy)

        def finished(c: LayerwiseCopy) -> None:
            self._copies.discard(c)
            done(c)

        copy.add_done_callback(finished)

    def _start_load(self, host_pages: list[int], device_pages: list[int]) -> LayerwiseCopy:
        """Start copying `host_pages` into `device_pages`; book it with `_track_load`.

        If the engine refuses to start (raises), `device_pages` are freed, as nothing will
        land in them, and `HiCacheError` is raised (the engine's own `HiCacheError` as is).
        """
        assert self._engine is not None
        assert self._host_pool
        assert self._device_pool
        try:
            return self._engine.copy(self._host_pool, host_pages, self._device_pool, device_pages)
        except BaseException as exc:
            self._device_free(device_pages)
            self._counters.copy_failures += 1
            _log.warning("hicache.load.refused", pages=len(device_pages), error=repr(exc))
            if isinstance(exc, HiCacheError) or not isinstance(exc, Exception):
                raise
            raise HiCacheError(
                f"the copy engine refused to start loading {len(device_pages)} pages: {exc!r}"
            ) from exc

    def _track_load(
        self,
        request: Request,
        host_node: TreeNode,
        host_pages: list[int],
        device_pages: list[int],
        copy: LayerwiseCopy,
    ) -> None:
        """Book a started load: others join it until it lands, and it lands in the tree."""
        self._counters.loaded_pages += len(device_pages)
        landed = functools.partial(self._on_load_done, request, host_node, host_pages, device_pages)
        if copy.done():
            # It finished inside `copy()`: a callback would only run on a later loop step,
            # and meanwhile the request would see a done load that has not landed.
            landed(copy)
            return
        self._loading.update(dict.fromkeys(host_pages, copy))
        self._track(copy, landed)

    def _loads_in_flight(self, deep: TreeNode, num_pages: int) -> list[LayerwiseCopy]:
        """The loads in flight that copy any of the last `num_pages` host pages up to `deep`."""
        if not self._loading:
            return []
        found: dict[int, LayerwiseCopy] = {}
        for node in self._path(deep, num_pages):
            # Loads cover whole nodes, so a node's first page tells.
            copy = self._loading.get(node.host_pages[0]) if node.host_pages else None
            if copy is not None:
                found[id(copy)] = copy
        return list(found.values())

    def _copies_landed(self, copies: Sequence[LayerwiseCopy]) -> asyncio.Future[None]:
        """A future resolved once `copies` are done and their done callbacks ran.

        Private to its waiter: cancelling it (or resolving it early, as a released request
        does) leaves the copies alone. The copies are in flight (a load leaves `_loading` in
        its own done callback, which runs as it completes), so this registers a callback
        after theirs and resolves once the last has placed its pages.
        """
        assert copies, "nothing to wait for: the future would never resolve"
        landed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        remaining = len(copies)

        def one_landed(_: LayerwiseCopy) -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0 and not landed.done():
                landed.set_result(None)

        for copy in copies:
            # Runs after the copy's own `_track` callback, so its pages are placed by then.
            copy.add_done_callback(one_landed)
        return landed

    def _on_load_done(
        self,
        request: Request,
        host_node: TreeNode,
        host_pages: list[int],
        device_pages: list[int],
        copy: LayerwiseCopy,
    ) -> None:
        for page in host_pages:
            if self._loading.get(page) is copy:
                del self._loading[page]
        ok = copy.exception() is None
        private: list[int] = list(device_pages)
        try:
            path = self._path(host_node, len(device_pages)) if ok else []
            top = path[0].parent if path else None
            if top is not None and top.parent is not None and not top.on_device:
                # The request's lock keeps the prefix above on the device until this runs;
                # should it be gone anyway, the pages must not join the tree without it.
                ok = False
                _log.error("hicache.load.orphaned", request_id=request.request_id)
            if ok:
                private = []
                offset = 0
                for node in path:
                    part = device_pages[offset : offset + node.num_pages]
                    offset += node.num_pages
                    if node.on_device:
                        private.extend(part)  # someone else's commit got there first
                    else:
                        self._tree.set_device_pages(node, part)
            else:
                self._counters.copy_failures += 1
                _log.warning(
                    "hicache.load.failed",
                    request_id=request.request_id,
                    error=repr(copy.exception()),
                )
        finally:
            # Runs in a done-callback, where an exception would only be logged: whatever
            # happened, the pages and the host protection go back.
            request._on_load_done(host_node, private, ok)
            self._tree.unprotect_host(host_node)
            self._capacity_changed.set()

    def _back_up_victim(self, node: TreeNode) -> bool:
        """Start the device -> host copy a write-back eviction of `node` needs.

        With storage attached, the prefix above it that only the device holds is copied in
        the same batch (it stays on the device too): a chain reaches storage, and a warmup
        manifest records it, only with every page from the root, and the prefix a
        conversation's turns share is the last thing eviction would ever take. Without room
        for that prefix, `node` alone.

        The prefix's host copy stays while it is on the device, where host eviction cannot
        take it: only with a host pool larger than the device pool (so such copies can never
        fill it), and only when the room is there, free or held by pages eviction may take
        (a batch that cannot fit must not evict host pages first for nothing).
        """
        config = self.config
        if self._link is not None and config.resolved_host_pages > config.device_pages:
            above: list[TreeNode] = []
            parent = node.parent
            while parent is not None and parent.parent is not None:
                on_device_only = parent.device_pages is not None and not parent.on_host
                if on_device_only and not parent.in_storage:
                    above.append(parent)
                parent = parent.parent
            if above:
                assert self._host_pool is not None
                room = self._host_pool.allocator.free_count
                room += self._tree.statistics().evictable_host_pages
                wanted = node.num_pages + sum(n.num_pages for n in above)
                batch = [*reversed(above), node]
                if wanted <= room and self._back_up_to_host(batch, count_skipped=False):
                    return True
        return self._back_up_to_host([node])

    def _back_up_to_host(self, nodes: Sequence[TreeNode], *, count_skipped: bool = True) -> bool:
        """Copy the device pages of `nodes` to fresh host pages, as one batch.

        A backup is optional: if there is no host room or the engine refuses to start the
        copy, nothing is booked, the pages go back and False is returned (never an error for
        the request, commit or eviction that asked for it). Without room, the pages count
        as skipped backups unless `count_skipped` is false (a caller that tries again with
        fewer).
        """
        assert self._engine is not None
        assert self._host_pool
        assert self._device_pool
        nodes = [
            n
            for n in nodes
            if n.device_pages is not None
            and n.host_pages is None
            and n.device_pages[0] not in self._backing_up
        ]
        if not nodes:
            return False
        total = sum(n.num_pages for n in nodes)
        host_pages = self._try_alloc_host(total)
        if host_pages is None:
            if count_skipped:
                self._counters.host_backups_skipped += total
            return False
        source: list[int] = []
        for node in nodes:
            assert node.device_pages is not None
            source.extend(node.device_pages)
        try:
            copy = self._engine.copy(self._device_pool, source, self._host_pool, host_pages)
        except BaseException as exc:
            self._host_free(host_pages)
            if not isinstance(exc, Exception):
                raise
            self._counters.copy_failures += 1
            _log.warning("hicache.backup.host.refused", pages=total, error=repr(exc))
            return False
        # Booked only once the copy runs, in this same synchronous step.
        for node in nodes:
            self._tree.lock_device(node)
        self._backing_up.update(source)
        sizes = [n.num_pages for n in nodes]
        self._device_backups += 1
        self._track(
            copy, functools.partial(self._on_host_backup_done, nodes, sizes, source, host_pages)
        )
        return True

    def _on_host_backup_done(
        self,
        nodes: list[TreeNode],
        sizes: list[int],
        device_pages: list[int],
        host_pages: list[int],
        copy: LayerwiseCopy,
    ) -> None:
        self._device_backups -= 1
        ok = copy.exception() is None
        offset = 0
        for node, size in zip(nodes, sizes, strict=True):
            part = host_pages[offset : offset + size]
            offset += size
            if ok:
                self._assign_host(node, size, part)
            else:
                self._host_free(part)
            self._tree.unlock_device(node)
        self._backing_up.difference_update(device_pages)
        if ok and self._backup_failures:
            for page in device_pages:
                self._backup_failures.pop(page, None)
        if ok:
            self._counters.host_backup_pages += len(host_pages)
        else:
            self._counters.copy_failures += 1
            failures = self._backup_failures
            for page in device_pages:
                failures[page] = failures.get(page, 0) + 1
            _log.warning("hicache.backup.host.failed", error=repr(copy.exception()))
        self._capacity_changed.set()

    def _assign_host(self, deep: TreeNode, num_pages: int, pages: list[int]) -> None:
        offset = 0
        for node in self._path(deep, num_pages):
            part = pages[offset : offset + node.num_pages]
            offset += node.num_pages
            if node.on_host:
                self._host_free(part)
            else:
                self._tree.set_host_pages(node, part)
                if self._link is not None and not node.in_storage:
                    self._link.backup.offer(node, node.num_pages)

    # -- write policy -----------------------------------------------------------------------

    def _after_commit(self, deep: TreeNode, num_pages: int) -> None:
        config = self.config
        if config.write_policy == "write_through_selective":
            # The commit that creates a node is its first use (see `_back_up_hot`).
            if config.write_through_threshold > 1:
                return
        elif config.write_policy != "write_through":
            return
        nodes = [n for n in self._path(deep, num_pages) if not n.on_host]
        if nodes:
            self._back_up_to_host(nodes)

    def _back_up_hot(self, found: MatchResult) -> None:
        # Uses of a node: the commit that created it, then each request that found it (its
        # `hit_count`). Counting the commit makes the default of 2 back a prefix up the first
        # time it is reused, while it is likely still on the device; counting hits alone
        # waited for a third use, which a chat's turns rarely reach before eviction.
        threshold = self.config.write_through_threshold
        hot: list[TreeNode] = []
        node: TreeNode | None = found.device_node
        while node is not None and node.parent is not None:
            if not node.on_host and 1 + node.hit_count >= threshold:
                hot.append(node)
            node = node.parent
        if hot:
            hot.reverse()
            self._back_up_to_host(hot)
