"""The whole cache against a reference model, driven by hypothesis.

The machine serves prompts drawn from a small alphabet (so prefixes repeat) through tiny
device and host pools, holds some requests across steps, prefetches (awaited, cancelled or
terminated), drains, and closes and reopens the cache over the same store, behind a store
that injects faults. After every step it checks what the design promises whatever the
faults: every page the tree holds on either tier, and every page a request was handed, has
the oracle's bytes for its tokens; no request sees more cached tokens than were ever
committed; both pools balance; and no request fails for a storage fault.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hicache_async import CacheConfig, HiCache, OutOfPagesError, PrefetchHandle, Request
from hicache_async.storage import FileStorage, MemoryStorage, StorageBackend
from hicache_async.testing import FaultyStorage, KVGenerator, assert_drained

ALPHABET = 3
Prompt = tuple[int, ...]


def config_for(
    *,
    page_size: int,
    device_pages: int,
    host_pages: int,
    policy: str,
    host_layout: str,
    eviction: str,
) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "host_layout": host_layout,
            "eviction": eviction,
            "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4},
            "page_size": page_size,
            "device_pages": device_pages,
            "host_pages": host_pages,
            "device": "cpu",
            "model_id": "stateful",
            "write_policy": policy,
            "write_through_threshold": 1,
            "prefetch": {
                "policy": "wait_complete",
                "threshold_tokens": 1,
                "io_timeout_s": 0.2,
                "failed_read_window_s": 0,
            },
            "backup": {
                "io_timeout_s": 0.2,
                "retry_backoff_s": 0.001,
                "max_retries": 1,
                "flush_deadline_s": 2.0,
                "check_prefix_interval_s": 0,
            },
            "warmup": {"enabled": True, "ratio": 1.0, "deadline_s": 5.0},
        }
    )


async def settled(cache: HiCache) -> None:
    """Wait (boundedly) until the pools hold only the tree's pages: a cancelled prefetch's
    read frees its host pages once the backend call it abandoned returns."""
    for _ in range(3000):  # 30 s: a loaded machine can be slow to return an abandoned call
        stats = cache.statistics()
        if (
            cache.host_pool.allocator.used_count == stats.tree.host_pages
            and cache.device_pool.allocator.used_count == stats.tree.device_pages
        ):
            return
        await asyncio.sleep(0.01)


@dataclass
class Held:
    """A request kept open across steps: its computed pages must stay as written."""

    request: Request
    tokens: Prompt
    pages: list[int] = field(default_factory=list)  # page_table of its whole pages


class CacheMachine(RuleBasedStateMachine):
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).loop_factory()
        self.root = tempfile.mkdtemp(prefix="hicache-stateful-")
        self.cache: HiCache | None = None
        self.held: list[Held] = []
        # Every page prefix (its tokens) ever committed: nothing else can be cached anywhere.
        self.committed: set[Prompt] = set()
        # Page key -> (prompt, page index) of every key the machine has used.
        self.page_of: dict[bytes, tuple[Prompt, int]] = {}
        self.faulty: FaultyStorage | None = None
        # Prefetches left running: a close waits for them before checking the pools.
        self.left: list[PrefetchHandle] = []
        self.seed = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # Setup and restarts.

    @initialize(
        page_size=st.integers(2, 4),
        device_pages=st.integers(3, 6),
        extra_host=st.integers(1, 6),
        policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
        kind=st.sampled_from(["file", "memory"]),
        faults=st.booleans(),
        seed=st.integers(0, 1000),
        host_layout=st.sampled_from(["layer_first", "page_first", "page_first_direct"]),
        eviction=st.sampled_from(["lru", "lfu"]),
    )
    def setup(
        self,
        *,
        page_size: int,
        device_pages: int,
        extra_host: int,
        policy: str,
        kind: str,
        faults: bool,
        seed: int,
        host_layout: str,
        eviction: str,
    ) -> None:
        self.config = config_for(
            page_size=page_size,
            device_pages=device_pages,
            host_pages=device_pages + extra_host,
            policy=policy,
            host_layout=host_layout,
            eviction=eviction,
        )
        self.model = KVGenerator(self.config.layout, page_size)
        self.page_size = page_size
        self.kind = kind
        self.faults = faults
        self.seed = seed
        self.run(self.open())

    def storage(self) -> StorageBackend:
        nbytes = self.config.page_nbytes
        # Small stores evict by themselves too.
        capacity = (nbytes + 4096) * 24
        inner: StorageBackend
        if self.kind == "file":
            inner = FileStorage(self.root, capacity_bytes=capacity * 4, spare_bytes=0)
        else:
            inner = MemoryStorage(capacity_bytes=capacity, spare_bytes=0)
        if not self.faults:
            self.faulty = None
            return inner
        self.seed += 1
        self.faulty = FaultyStorage(
            inner,
            seed=self.seed,
            error_rate=0.05,
            partial_batch_rate=0.1,
            corrupt_rate=0.1,
            truncate_rate=0.05,
            hang_rate=0.02,
        )
        return self.faulty

    async def open(self) -> None:
        cache = HiCache(self.config, storage=self.storage())
        await cache.__aenter__()
        self.cache = cache
        await cache.wait_warmup()

    async def close(self) -> None:
        cache = self.cache
        assert cache is not None
        for held in self.held:
            held.request.release()
        self.held.clear()
        for handle in self.left:
            await handle.wait()
        self.left.clear()
        await cache.drain()
        await settled(cache)
        assert_drained(cache)
        await cache.__aexit__(None, None, None)

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                self.run(self.close())
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            shutil.rmtree(self.root, ignore_errors=True)

    @rule()
    def restart(self) -> None:
        """Close and reopen over the same store: a memory store starts empty again."""
        self.run(self.close())
        if self.kind == "memory":
            self.committed.clear()
        self.run(self.open())

    # The model.

    def prefix(self, tokens: Prompt, pages: int, salt: str | None = None) -> Prompt:
        """The model's name for the first `pages` pages: a salted prompt's start with -1."""
        return (-1,) * bool(salt) + tokens[: pages * self.page_size]

    def bound(self, tokens: Prompt, salt: str | None = None) -> int:
        """Tokens of `tokens` that could be cached: its committed whole-page prefix."""
        size = self.page_size
        pages = 0
        while (pages + 1) * size <= len(tokens) and self.prefix(
            tokens, pages + 1, salt
        ) in self.committed:
            pages += 1
        return pages * size

    def commit(self, tokens: Prompt, pages: int, salt: str | None = None) -> None:
        for index in range(pages):
            self.committed.add(self.prefix(tokens, index + 1, salt))

    def remember(self, tokens: Prompt, salt: str | None = None) -> None:
        assert self.cache is not None
        for index, key in enumerate(self.cache.keys_for(list(tokens), salt=salt)):
            self.page_of.setdefault(key, (self.prefix(tokens, index + 1, salt), index))

    def held_pages(self) -> int:
        return sum(len(h.request.page_table) for h in self.held)

    # Requests.

    async def start(
        self,
        tokens: Prompt,
        prefetch: bool,
        *,
        priority: int = 0,
        crowded: bool = False,
        salt: str | None = None,
        policy: str | None = None,
        cap: int | None = None,
    ) -> tuple[Request, list[int]] | None:
        """Make, load, check, compute and commit a request; None when pages ran out only
        because held requests take them."""
        cache = self.cache
        assert cache is not None
        self.remember(tokens, salt)
        if prefetch:
            result = await cache.prefetch(list(tokens), salt=salt, policy=policy)  # type: ignore[arg-type]
            assert result.cached_tokens <= self.bound(tokens, salt), result
        request = cache.request(list(tokens), priority=priority, salt=salt, max_cached_tokens=cap)
        try:
            bound = self.bound(tokens, salt)
            if cap is not None:
                bound = min(bound, cap)
            assert request.cached_tokens <= bound, (request.cached_tokens, bound)
            load = await request.load()
            try:
                await load
            except Exception:  # a failed copy: its tokens are computed instead
                assert request.cached_tokens == request.device_tokens
            cached = request.cached_tokens
            assert cached % self.page_size == 0
            assert cached <= bound
            table = request.page_table
            for index in range(cached // self.page_size):
                self.model.check_page(cache.device_pool, table[index], list(tokens), index)
            new = await request.allocate(len(tokens) - cached)
            full = len(tokens) // self.page_size
            for offset, page in enumerate(new):
                index = cached // self.page_size + offset
                if index < full:
                    self.model.fill_page(cache.device_pool, page, list(tokens), index)
            request.commit()
        except OutOfPagesError:
            request.release()
            if not self.held and not crowded:
                raise
            return None
        except BaseException:
            request.release()
            raise
        self.commit(tokens, full, salt)
        return request, request.page_table[:full]

    prompts = st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=14).map(tuple)

    @rule(
        tokens=prompts,
        prefetch=st.booleans(),
        salt=st.sampled_from([None, "a"]),
        policy=st.sampled_from([None, "best_effort", "timeout"]),
        cap=st.none() | st.integers(0, 8),
    )
    def serve(
        self, tokens: Prompt, prefetch: bool, salt: str | None, policy: str | None, cap: int | None
    ) -> None:
        tokens = tokens[: self.config.device_pages * self.page_size]
        started = self.run(self.start(tokens, prefetch, salt=salt, policy=policy, cap=cap))
        if started is not None:
            started[0].release()
            # What a request committed is cached when it ends, on one tier or the other.
            assert self.cache is not None
            match = self.cache.match(list(tokens), salt=salt)
            full = len(tokens) // self.page_size * self.page_size
            assert match.device_tokens + match.host_tokens == full, (match, full)

    @precondition(lambda self: len(self.held) < 2)
    @rule(tokens=prompts, prefetch=st.booleans())
    def hold(self, tokens: Prompt, prefetch: bool) -> None:
        tokens = tokens[: 2 * self.page_size]
        started = self.run(self.start(tokens, prefetch))
        if started is not None:
            self.held.append(Held(started[0], tokens, started[1]))

    @precondition(lambda self: len(self.held) < 2)
    @rule(tokens=prompts)
    def hold_loading(self, tokens: Prompt) -> None:
        """A request whose load may still be copying when the step ends."""

        async def go() -> None:
            cache = self.cache
            assert cache is not None
            tokens_ = tokens[: 2 * self.page_size]
            self.remember(tokens_)
            request = cache.request(list(tokens_))
            try:
                assert request.cached_tokens <= self.bound(tokens_)
                await request.load()
            except OutOfPagesError:
                request.release()
                if not self.held:
                    raise
                return
            self.held.append(Held(request, tokens_))

        self.run(go())

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        held.request.release()

    @rule(tokens=prompts, steps=st.integers(0, 6), how=st.sampled_from(["cancel", "terminate"]))
    def stop_prefetch(self, tokens: Prompt, steps: int, how: str) -> None:
        async def go() -> None:
            cache = self.cache
            assert cache is not None
            self.remember(tokens)
            handle = await cache.start_prefetch(list(tokens))
            for _ in range(steps):
                await asyncio.sleep(0)
            if how == "cancel":
                handle.cancel()
            else:
                handle.terminate()
            await handle.wait()
            assert handle.result().cached_tokens <= self.bound(tokens)

        self.run(go())

    @rule(
        prompts=st.lists(prompts, min_size=2, max_size=3),
        prefetch=st.booleans(),
        priorities=st.lists(st.integers(-1, 1), min_size=3, max_size=3),
        detach=st.sampled_from([None, 0, 1, 3]),
    )
    def serve_together(
        self, prompts: list[Prompt], prefetch: bool, priorities: list[int], detach: int | None
    ) -> None:
        """Concurrent requests: pages may run out for some, never for a storage fault."""

        async def one(tokens: Prompt, priority: int) -> None:
            started = await self.start(tokens, prefetch, priority=priority, crowded=True)
            if started is not None:
                await asyncio.sleep(0)
                started[0].release()

        async def reattach(steps: int) -> None:
            cache = self.cache
            assert cache is not None
            for _ in range(steps):
                await asyncio.sleep(0)
            await cache.detach_storage(flush=False)
            if self.kind == "memory":
                self.committed = self.cached_now()
            await cache.attach_storage(self.storage())
            await cache.wait_warmup()  # its reads hold host pages outside the tree

        async def go() -> None:
            limit = self.config.device_pages * self.page_size // len(prompts)
            jobs = [one(p[: max(limit, 1)], q) for p, q in zip(prompts, priorities, strict=False)]
            if detach is not None:
                jobs.append(reattach(detach))
            await asyncio.gather(*jobs)

        self.run(go())

    @rule(flush=st.booleans())
    def reattach(self, flush: bool) -> None:
        """Detach and attach again: the tree forgets what was stored, the store keeps it."""

        async def go() -> None:
            cache = self.cache
            assert cache is not None
            await cache.detach_storage(flush=flush)
            if self.kind == "memory":
                self.committed = self.cached_now()
            await cache.attach_storage(self.storage())
            await cache.wait_warmup()

        self.run(go())

    def cached_now(self) -> set[Prompt]:
        """Prefixes the tree holds (what survives a memory store's loss)."""
        cache = self.cache
        assert cache is not None
        return {
            self.page_of[key][0]
            for node in cache.tree.iter_nodes()
            if node.device_pages is not None or node.host_pages is not None
            for key in node.keys
        } | {
            self.prefix(held.tokens, index + 1)
            for held in self.held
            for index in range(len(held.pages))
        }

    @rule(
        tokens=prompts,
        steps=st.integers(0, 8),
        how=st.sampled_from(["cancel", "terminate", "wait", "leave"]),
    )
    def request_during_prefetch(self, tokens: Prompt, steps: int, how: str) -> None:
        """A request of a prompt whose prefetch is still running."""

        async def go() -> None:
            cache = self.cache
            assert cache is not None
            self.remember(tokens)
            handle = await cache.start_prefetch(list(tokens))
            for _ in range(steps):
                await asyncio.sleep(0)
            started = await self.start(tokens, False, crowded=True)
            if how == "cancel":
                handle.cancel()
            elif how == "terminate":
                handle.terminate()
            if how != "leave":
                await handle.wait()
            else:
                self.left.append(handle)
            if started is not None:
                started[0].release()

        self.run(go())

    @precondition(lambda self: len(self.held) < 2)
    @rule(tokens=prompts, steps=st.integers(0, 4), commit=st.booleans())
    def abandon(self, tokens: Prompt, steps: int, commit: bool) -> None:
        """A request released while its load may still be copying, before or after commit."""

        async def go() -> None:
            cache = self.cache
            assert cache is not None
            self.remember(tokens)
            tokens_ = tokens[: 2 * self.page_size]
            request = cache.request(list(tokens_))
            try:
                assert request.cached_tokens <= self.bound(tokens_)
                load = await request.load()
                for _ in range(steps):
                    await asyncio.sleep(0)
                if commit:
                    await load
                    await request.allocate(len(tokens_) - request.cached_tokens)
                    full = len(tokens_) // self.page_size
                    table = request.page_table
                    first = request.cached_tokens // self.page_size
                    for index in range(first, full):
                        self.model.fill_page(cache.device_pool, table[index], list(tokens_), index)
                    request.commit()
                    self.commit(tokens_, full)
            except OutOfPagesError:
                if not self.held:
                    raise
            finally:
                request.release()

        self.run(go())

    @rule()
    def drain(self) -> None:
        cache = self.cache
        assert cache is not None
        self.run(cache.drain())
        if not self.held and all(handle.done() for handle in self.left):
            self.run(settled(cache))
            assert_drained(cache)

    # Invariants.

    @invariant()
    def pools_balance(self) -> None:
        cache = self.cache
        if cache is None:
            return
        stats = cache.statistics()
        assert stats.live_requests == len(self.held)
        for pool, pool_stats in (
            (cache.device_pool, stats.device_pool),
            (cache.host_pool, stats.host_pool),
        ):
            alloc = pool.allocator
            assert alloc.free_count + alloc.used_count == alloc.capacity
            assert pool_stats is not None
            assert pool_stats.free + pool_stats.used == pool_stats.num_pages
            assert pool_stats.used == alloc.used_count
        assert stats.tree.device_pages <= cache.device_pool.allocator.used_count
        assert stats.tree.host_pages <= cache.host_pool.allocator.used_count
        counters = stats.counters
        assert counters["tokens_device"] + counters["tokens_host"] <= counters["tokens_requested"]
        assert stats.tokens.device == counters["tokens_device"]
        assert stats.tokens.host == counters["tokens_host"]
        cache.tree.check_invariants()

    @invariant()
    def held_pages_intact(self) -> None:
        cache = self.cache
        if cache is None:
            return
        for held in self.held:
            for index, page in enumerate(held.pages):
                self.model.check_page(cache.device_pool, page, list(held.tokens), index)

    @invariant()
    def tree_pages_match_the_oracle(self) -> None:
        cache = self.cache
        if cache is None:
            return
        for node in cache.tree.iter_nodes():
            for tier, pool in (
                (node.device_pages, cache.device_pool),
                (node.host_pages, cache.host_pool),
            ):
                if tier is None:
                    continue
                for key, page in zip(node.keys, tier, strict=True):
                    name, index = self.page_of[key]
                    assert name in self.committed, "a page nobody committed is cached"
                    tokens = [t for t in name if t >= 0]
                    self.model.check_page(pool, page, tokens, index)


SETTINGS = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    # The same programs every run: CI checks what was checked here, not new draws.
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
CacheMachine.TestCase.settings = SETTINGS
test_cache_model = CacheMachine.TestCase

try:
    import uvloop
except ImportError:  # pragma: no cover - the testing extra brings it everywhere but Windows
    uvloop = None

if uvloop is not None:

    class UvloopCacheMachine(CacheMachine):
        loop_factory = uvloop.new_event_loop

    UvloopCacheMachine.TestCase.settings = SETTINGS
    test_cache_model_uvloop = UvloopCacheMachine.TestCase
