"""Warmup: load the most valuable prefixes of a shared store into a cold host pool.

It reads the backend's manifest (bounded), agrees with the other tensor-parallel ranks on the
entries they all have, and loads them by priority then recency through the prefetch path,
one at a time and only while no live prefetch is waiting, until the host budget, the deadline,
a detach or the cache's close stops it.

With a rank group, each entry costs exactly two collectives on every rank whatever happens
locally: one to agree to go on, one to agree on how many pages every rank has; a rank that
loaded more than the others drops the excess so every rank ends with the same tree.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import msgspec
import structlog

from ..distributed import CollectiveError, agree_entries, agree_min
from ..storage._manifest import SupportsManifest
from ._prefetch import PrefetchHandle

if TYPE_CHECKING:
    from .._cache import HiCache
    from ._link import StorageLink

__all__ = ["WarmupResult", "WarmupStatus", "Warmer"]

_log = structlog.get_logger("hicache_async")


class WarmupStatus(enum.Enum):
    """Why a warmup ended."""

    COMPLETE = "complete"
    BUDGET = "budget"
    DEADLINE = "deadline"
    STOPPED = "stopped"
    UNSUPPORTED = "unsupported"
    NO_STORAGE = "no_storage"


class WarmupResult(msgspec.Struct, frozen=True):
    """What a warmup read, agreed on and loaded."""

    status: WarmupStatus
    entries_read: int = 0
    entries_agreed: int = 0
    entries_loaded: int = 0
    pages_loaded: int = 0
    malformed: int = 0
    oversized: int = 0
    seconds: float = 0.0


class Warmer:
    """One warmup run over one attached backend."""

    def __init__(
        self, cache: HiCache, link: StorageLink, *, ratio: float, deadline_s: float
    ) -> None:
        self._cache = cache
        self._link = link
        self._ratio = ratio
        self._deadline_s = deadline_s
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    async def run(self) -> WarmupResult:
        """Warm up; a broken rank group stops it (logged), it never fails the caller."""
        try:
            return await self._run()
        except CollectiveError as exc:
            _log.warning("hicache.warmup.agreement.failed", error=repr(exc))
            return WarmupResult(status=WarmupStatus.STOPPED)

    async def _run(self) -> WarmupResult:
        began = time.monotonic()
        cache = self._cache
        backend = self._link.backend
        group = cache.rank_group
        tp = group is not None and group.size > 1
        if not isinstance(backend, SupportsManifest):
            if tp:
                assert group is not None
                await agree_entries(group, _nothing)
            return WarmupResult(status=WarmupStatus.UNSUPPORTED)
        manifest = backend.manifest()
        namespace = cache.namespace.fingerprint.hex()
        read = None

        async def local_entries() -> list[bytes]:
            nonlocal read
            try:
                read = await manifest.read(namespace=namespace)
            except Exception as exc:  # a storage fault: no warmup, never a failed caller
                _log.warning("hicache.warmup.manifest.failed", error=repr(exc))
                return []
            return [bytes.fromhex(e.chain_id) for e in read.entries]

        if tp:
            assert group is not None
            agreed_ids = await agree_entries(group, local_entries)
        else:
            agreed_ids = await local_entries()
        if read is None:
            return WarmupResult(status=WarmupStatus.STOPPED, seconds=time.monotonic() - began)
        by_id = {bytes.fromhex(e.chain_id): e for e in read.entries}
        entries = [by_id[i] for i in agreed_ids if i in by_id]
        assert cache._host_pool is not None
        budget = int(self._ratio * cache._host_pool.num_pages)
        size = cache.config.page_size
        loaded_pages = 0
        loaded_entries = 0
        status = WarmupStatus.COMPLETE
        for entry in entries:
            go_on = self._may_continue(loaded_pages, budget, began)
            if tp:
                assert group is not None

                async def wanted(flag: int = int(go_on is WarmupStatus.COMPLETE)) -> int:
                    return flag

                if not await agree_min(group, wanted) and go_on is WarmupStatus.COMPLETE:
                    go_on = WarmupStatus.STOPPED  # another rank stopped: stop together
            if go_on is not WarmupStatus.COMPLETE:
                status = go_on
                break
            keys = [bytes.fromhex(k) for k in entry.keys]
            await self._link.prefetcher.wait_quiet()
            handle = PrefetchHandle(
                self._link.prefetcher,
                keys,
                len(keys) * size,
                "warmup",
                "wait_complete",
                priority=entry.priority,
                min_tokens=1,  # a warmup entry is worth loading whatever its length
            )
            await self._link.prefetcher.run_now(handle)
            landed = handle.storage_tokens // size
            if tp:
                assert group is not None

                async def mine(value: int = handle.result().cached_tokens) -> int:
                    return value

                agreed = await agree_min(group, mine)
                cache._trim_host(keys, agreed // size)
            loaded_pages += landed
            loaded_entries += landed > 0
        return WarmupResult(
            status=status,
            entries_read=len(read.entries),
            entries_agreed=len(entries),
            entries_loaded=loaded_entries,
            pages_loaded=loaded_pages,
            malformed=read.malformed,
            oversized=read.oversized,
            seconds=time.monotonic() - began,
        )

    def _may_continue(self, loaded: int, budget: int, began: float) -> WarmupStatus:
        if self._stop or self._cache._link is not self._link or self._cache._state != "open":
            return WarmupStatus.STOPPED
        if loaded >= budget:
            return WarmupStatus.BUDGET
        if time.monotonic() - began >= self._deadline_s:
            return WarmupStatus.DEADLINE
        return WarmupStatus.COMPLETE


async def _nothing() -> list[bytes]:
    return []
