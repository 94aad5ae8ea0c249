"""One request's view of the cache: its matched prefix, its loads, its pages, its commit."""

from __future__ import annotations

import asyncio
import sys
import warnings
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

import numpy as np
from numpy.typing import NDArray

from ._errors import CacheClosedError, type_name
from .transfer import LayerwiseCopy
from .tree import MatchResult, TreeNode

if TYPE_CHECKING:
    from ._cache import HiCache
else:
    # Not imported at run time (it imports this module): tools that read hints at run time
    # (typing.get_type_hints, beartype, sphinx) see a cache as Any rather than fail.
    HiCache = Any

__all__ = ["Request"]


def check_count(name: str, value: object) -> int:
    """`value` as a count: `TypeError` unless an int (a bool or a float is a bug upstream, not
    a count to round), `ValueError` if negative."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type_name(value)}")
    count = int(value)
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return count


class Request:
    """The pages one request uses, from `HiCache.request()` until `release()`.

    The request holds a device lock on its cached prefix for its whole life, owns the device
    pages it allocates until it commits them, and gives everything back on `release()` (or on
    leaving its `with` block) whatever happened in between, cancellation included.
    """

    __slots__ = (
        "__weakref__",
        "_cache",
        "_cached_pages",
        "_committed",
        "_host_node",
        "_host_pages",
        "_joining",
        "_keys",
        "_load",
        "_load_lock",
        "_lock_node",
        "_new_pages",
        "_page_table",
        "_priority",
        "_private_pages",
        "_released",
        "_request_id",
        "_tokens",
    )

    def __init__(
        self,
        cache: HiCache,
        tokens: NDArray[np.uint32],
        keys: list[bytes],
        match: MatchResult,
        request_id: str | None,
        *,
        priority: int = 0,
    ) -> None:
        self._cache = cache
        self._priority = priority
        self._tokens = tokens
        self._keys = keys
        self._request_id = request_id
        self._lock_node: TreeNode | None = match.device_node
        self._page_table: list[int] = list(match.device_pages)
        self._cached_pages = match.num_device_pages
        self._host_node: TreeNode | None = match.host_node if match.num_host_pages else None
        self._host_pages = match.num_host_pages
        self._load: LayerwiseCopy | None = None
        # While `load()` waits for another request's copy: `release()` resolves it, so the
        # wait ends at once instead of when that copy lands.
        self._joining: asyncio.Future[None] | None = None
        # Created on first use: makes `load()` single-flight.
        self._load_lock: asyncio.Lock | None = None
        self._committed = False
        self._new_pages: list[int] = []
        # Device pages this request copied or computed that the tree already had from someone
        # else: the request may still be reading them, so they are freed only on release.
        self._private_pages: list[int] = []
        cache._tree.lock_device(match.device_node)
        # Last: a request whose construction failed took no lock for `__del__` to give back.
        self._released = False

    # -- what the request has -------------------------------------------------------------

    # Read-only, `keys` a copy: `commit()` inserts the request's pages under its keys, with
    # its priority, for as many pages as its tokens fill; changed afterwards, they would
    # publish its KV under another prompt's keys, or a priority no page header can hold.
    @property
    def tokens(self) -> NDArray[np.uint32]:
        """The token ids (a `uint32` numpy array)."""
        return self._tokens

    @property
    def keys(self) -> list[bytes]:
        """A copy of the page keys."""
        return list(self._keys)

    @property
    def priority(self) -> int:
        """The priority the request's pages are inserted with, as given."""
        return self._priority

    @property
    def request_id(self) -> str | None:
        """The id given to `HiCache.request()`, if any."""
        return self._request_id

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def device_tokens(self) -> int:
        """Tokens whose KV is on the device now (the matched prefix, plus a finished load)."""
        return self._cached_pages * self._cache.config.page_size

    @property
    def host_tokens(self) -> int:
        """Tokens matched in the host pool that `load()` brings to the device."""
        return self._host_pages * self._cache.config.page_size

    @property
    def cached_tokens(self) -> int:
        """Tokens the request does not have to compute: device prefix plus host extension."""
        return self.device_tokens + (self.host_tokens if self._host_node is not None else 0)

    @property
    def page_table(self) -> list[int]:
        """Device page of every page of the request so far: cached, loading, then allocated."""
        return list(self._page_table)

    @property
    def released(self) -> bool:
        return self._released

    # -- the lifecycle ----------------------------------------------------------------------

    async def load(self) -> LayerwiseCopy:
        """Start copying the host-matched pages to the device; await layers on the result.

        Waits only to obtain device pages (eviction may have to back pages up first), or for
        another request's copy of the same host pages to land: a page already being loaded
        is shared, not copied again. The returned copy always finishes, even if the caller
        stops awaiting it; its pages join the tree when it does.

        Single-flight: concurrent and later calls get the same copy. The loaded pages go into
        `page_table` right after the device prefix, ahead of pages from `allocate()` whether
        it was called before or after. Raises `RuntimeError` when first called after
        `commit()` (the committed pages already stand for those tokens; a load started
        before the commit is returned again, as to any later call), `CacheClosedError` once
        released (a call waiting for another request's copy raises as soon as this one is
        released), and `HiCacheError` if the copy engine refuses to start the copy (nothing
        is held then; `load()` may be called again).
        """
        self._check()
        if self._load is not None:
            return self._load
        self._check_loadable()
        lock = self._load_lock
        if lock is None:
            lock = self._load_lock = asyncio.Lock()
        async with lock:
            # The caller holding the lock before us may have loaded, failed or been released.
            self._check()
            if self._load is None:
                self._check_loadable()
                self._load = await self._begin_load()
        return self._load

    def _check_loadable(self) -> None:
        if self._committed:
            raise RuntimeError(
                "load() after commit(): the committed pages already cover the host run; "
                "call load() before committing"
            )

    async def _begin_load(self) -> LayerwiseCopy:
        """Obtain device pages for the host run and start its copy (under the load lock)."""
        cache = self._cache
        while True:
            self._take_landed()
            host_node = self._host_node
            if host_node is None:
                return cache._engine_done_copy()
            joined = cache._loads_in_flight(host_node, self._host_pages)
            if joined:
                # Another request is copying some of these pages: wait (a wait of our own, so
                # cancelling it leaves that copy alone), then adopt what it landed.
                self._joining = cache._copies_landed(joined)
                try:
                    await self._joining
                finally:
                    self._joining = None
                self._check()
                continue
            # The host pages stay protected from `HiCache.request()` until the load finishes.
            host_pages = cache._host_path_pages(host_node, self._host_pages)
            device_pages = await cache._alloc_device(len(host_pages), self)
            if cache._loads_in_flight(host_node, self._host_pages) or self._top_on_device():
                # Someone started or finished loading these pages while we waited: share.
                cache._device_free(device_pages)
                continue
            # Frees the device pages itself if the engine refuses: nothing is held before this.
            copy = cache._start_load(host_pages, device_pages)
            # Right after the device prefix: pages from an earlier `allocate()` hold the
            # tokens after the host run.
            at = self._cached_pages
            self._page_table[at:at] = device_pages
            cache._track_load(self, host_node, host_pages, device_pages, copy)
            return copy

    def _top_on_device(self) -> bool:
        assert self._host_node is not None
        return self._cache._path(self._host_node, self._host_pages)[0].on_device

    def _take_landed(self) -> None:
        """Adopt the top of the host run that another request's load or commit put on the
        device: lock it and move it from the host run to the device prefix."""
        host_node = self._host_node
        if host_node is None:
            return
        cache = self._cache
        landed: list[TreeNode] = []
        for node in cache._path(host_node, self._host_pages):
            if not node.on_device:
                break  # device residency is prefix-closed: nothing below is on the device
            landed.append(node)
        if not landed:
            return
        pages = [page for node in landed for page in node.device_pages or ()]
        cache._tree.lock_device(landed[-1])
        if self._lock_node is not None:
            cache._tree.unlock_device(self._lock_node)
        self._lock_node = landed[-1]
        at = self._cached_pages
        self._page_table[at:at] = pages
        self._cached_pages += len(pages)
        self._host_pages -= len(pages)
        if self._host_pages == 0:
            cache._tree.unprotect_host(host_node)
            self._host_node = None

    async def allocate(self, num_tokens: int) -> list[int]:
        """Device pages for `num_tokens` more tokens (whole pages, the tail page included).

        May wait for pages being freed (write-backs, loads landing, and at most
        `backup.io_timeout_s` for a storage backup in progress that gives way); raises
        `OutOfPagesError` when running requests hold the pages, and `CacheClosedError` once
        released, a call still waiting included. `num_tokens` must be
        an int (`TypeError` otherwise, a bool included) and >= 0 (`ValueError`).
        """
        self._check()
        num_tokens = check_count("num_tokens", num_tokens)
        count = -(-num_tokens // self._cache.config.page_size)
        pages = await self._cache._alloc_device(count, self)
        self._new_pages.extend(pages)
        self._page_table.extend(pages)
        return pages

    def commit(self) -> int:
        """Publish the computed whole pages of the prompt; apply the write policy.

        Returns how many pages were committed. The tail page (fewer than `page_size` tokens)
        is never committed; it is freed on release. Raises `RuntimeError` while `load()` is
        starting or its copy has not landed; once pages are committed, a first `load()` is
        refused.
        """
        self._check()
        if self._load_lock is not None and self._load_lock.locked():
            raise RuntimeError("commit() while load() is starting: await load() and the load")
        if self._load_in_flight():
            raise RuntimeError("commit() before the load finished: await the load first")
        cache = self._cache
        page_size = cache.config.page_size
        full = len(self._tokens) // page_size
        start = self._cached_pages
        count = full - start
        if count <= 0:
            if full > 0:
                # Nothing to insert, but the prompt's pages take its priority as an insert
                # would give it: pages read back from storage came in without theirs.
                found = cache._tree.match(self._keys[:full], touch=False)
                cache._tree.raise_priority(found.host_node, self._priority)
            return 0
        if len(self._new_pages) < count:
            raise RuntimeError(
                f"commit() needs {count} computed pages after the cached prefix, but only "
                f"{len(self._new_pages)} were allocated"
            )
        # A load landing now would move the request's lock above these pages and place the
        # host run over positions they hold.
        self._committed = True
        pages = self._new_pages[:count]
        result = cache._tree.insert(
            self._keys[:full], device_pages=self._page_table[:full], priority=self._priority
        )
        own = set(pages)
        duplicates = [p for p in result.duplicate_device_pages if p in own]
        del self._new_pages[:count]
        self._private_pages.extend(duplicates)
        cache._tree.lock_device(result.node)
        if self._lock_node is not None:
            cache._tree.unlock_device(self._lock_node)
        self._lock_node = result.node
        self._cached_pages = full
        cache._counters.pages_committed += count - len(duplicates)
        cache._counters.pages_duplicate += len(duplicates)
        cache._counters.tokens_computed += count * page_size
        cache._after_commit(result.node, count)
        return count

    def release(self) -> None:
        """Give back every lock and page. Idempotent; safe at any point.

        A `load()` or `allocate()` of this request still waiting raises `CacheClosedError`
        right away; a copy already started goes on and frees its pages when it lands. From
        another thread or loop it raises `WrongThreadError` and changes nothing (unless already
        released: then it returns, from anywhere): the owner's release still gives everything
        back.
        """
        if self._released:
            return  # from anywhere, as before: a `with` block's exit after the owner's release
        # Before the request is marked released: a call from another thread would otherwise
        # mark it and then fail at the tree, and the owner's release would find nothing to do.
        self._cache._owner.check()
        self._released = True
        self._give_back()

    def _give_back(self) -> None:
        """What `release()` gives back, once the request is marked released (on the loop)."""
        cache = self._cache
        loading = self._load_in_flight()
        # A load in flight lands its pages under the device prefix this lock holds: keep the
        # lock until it lands (`_on_load_done`), or the prefix could be evicted first.
        if self._lock_node is not None and not loading:
            cache._tree.unlock_device(self._lock_node)
            self._lock_node = None
        if loading:
            cache._abandoned_loads += 1
        if self._host_node is not None and self._load is None:
            cache._tree.unprotect_host(self._host_node)
            self._host_node = None
        # A `load()` or `allocate()` still waiting holds nothing yet: wake it to raise now,
        # not when the copy or the pages it waits for turn up.
        joining = self._joining
        if joining is not None and not joining.done():
            joining.set_result(None)
        cache._capacity_changed.set()
        # A load still in flight finishes on its own and frees what it must.
        cache._device_free(self._new_pages + self._private_pages)
        self._new_pages = []
        self._private_pages = []
        cache._requests.discard(self)

    # -- internal hooks used by the cache -------------------------------------------------

    def _load_in_flight(self) -> bool:
        """Whether a load started and has not landed. The cache books a load as its copy
        completes (`_track_load`), so a done copy is a landed one."""
        return self._load is not None and not self._load.done()

    def _on_load_done(self, host_node: TreeNode, private: list[int], ok: bool) -> None:
        """Called by the cache when this request's load finished (on the loop)."""
        if self._released:
            self._cache._abandoned_loads -= 1
            self._cache._device_free(private)
            if self._lock_node is not None:
                self._cache._tree.unlock_device(self._lock_node)
                self._lock_node = None
            return
        if not ok:
            # The host part was not copied: those tokens must be computed instead, so they
            # leave the page table (pages allocated later keep their order after it).
            del self._page_table[self._cached_pages : self._cached_pages + self._host_pages]
            self._cache._device_free(private)
            self._host_pages = 0
            self._host_node = None
            return
        self._private_pages.extend(private)
        self._cache._tree.lock_device(host_node)
        if self._lock_node is not None:
            self._cache._tree.unlock_device(self._lock_node)
        self._lock_node = host_node
        self._cached_pages += self._host_pages
        self._host_node = None
        self._host_pages = 0

    def _check(self) -> None:
        self._cache._owner.check()
        if self._released:
            raise CacheClosedError("the request was released")

    def __del__(self) -> None:
        # A handle dropped unreleased (a handler that raised before its `with`, a registry
        # that forgot it): the cache tracks requests weakly, so without this its locks and
        # pages stayed taken until the cache closed, and allocations failed meanwhile. This
        # may run in any thread, and on the loop's in the middle of cache code: the release
        # is handed to the loop.
        if getattr(self, "_released", True):
            return
        cache = self._cache
        loop = cache.loop
        if loop is None or loop.is_closed() or cache.state == "closed":
            return
        if sys.is_finalizing():
            # At interpreter exit (a loop stopped, never closed, with the cache still open):
            # the loop never runs again, so a release handed to it would never happen.
            self._dropped_warning("are not given back: the interpreter is exiting")
            return
        # Marked before the hand-over: a weak reference to the request (a registry's) stays
        # valid while the loop holds it, and what reaches it that way must find it released,
        # not have its pages go under it at the next loop step.
        self._released = True
        if self not in cache._requests:
            cache._dropped.add(self)  # collected in a cycle: still live until released
        try:
            loop.call_soon_threadsafe(cache._release_dropped, self)
        except RuntimeError:  # the loop closed meanwhile: so did the cache's use
            cache._dropped.discard(self)
            return
        # After the release is scheduled: under `-W error` this raises (and is only printed).
        self._dropped_warning("are given back now")

    def _dropped_warning(self, fate: str) -> None:
        """The `ResourceWarning` of a request collected unreleased; `fate`: what becomes of
        its locks and pages."""
        # Explicit, with no registry: each message names its request, and the module's
        # `__warningregistry__` kept one entry per message under the "default" action.
        warnings.warn_explicit(
            f"request {self.request_id or hex(id(self))} of {len(self.tokens)} tokens was "
            f"garbage-collected without release(); its locks and pages {fate}. "
            "Use `with cache.request(...) as req:` or call release()",
            ResourceWarning,
            __file__,
            Request.__del__.__code__.co_firstlineno,  # shown as `def __del__`
            module=__name__,
            source=self,  # with tracemalloc on, the warning shows where it was made
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # A copy would share this request's lock and pages, and give them back when it is
        # collected (see `__del__`) while this one still uses them.
        raise TypeError(
            "a Request cannot be copied or pickled: it holds locks and pages of its cache"
        )

    # -- context manager and repr ---------------------------------------------------------

    def __enter__(self) -> Request:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "active"
        loading = self._load_in_flight()
        return (
            f"<Request {self.request_id or hex(id(self))} {state} tokens={self.num_tokens} "
            f"device={self.device_tokens} host={self.host_tokens} "
            f"allocated_pages={len(self._new_pages)} loading={loading}>"
        )
