"""The device and host tiers end to end, checked page by page against the KV generator."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import pytest
from structlog.testing import capture_logs

from hicache_async import (
    CacheClosedError,
    CacheConfig,
    HiCache,
    KVLayout,
    OutOfPagesError,
    WrongThreadError,
)
from hicache_async.testing import KVGenerator, assert_drained, serve

PAGE = 4


def _config(**overrides: object) -> CacheConfig:
    base: dict[str, object] = {
        "layout": KVLayout(num_layers=3, num_kv_heads=2, head_dim=4),
        "page_size": PAGE,
        "device_pages": 24,
        "host_pages": 40,
    }
    base.update(overrides)
    return CacheConfig(**base)  # type: ignore[arg-type]


def _prompts(count: int, seed: int) -> list[np.ndarray]:
    """Prompts sharing prefixes: a few system prompts, a few conversations, new turns."""
    rng = random.Random(seed)
    systems = [np.array([rng.randrange(1000) for _ in range(3 * PAGE)]) for _ in range(3)]
    prompts: list[np.ndarray] = []
    conversations: list[np.ndarray] = []
    for _ in range(count):
        if conversations and rng.random() < 0.6:
            base = rng.choice(conversations)
        else:
            base = rng.choice(systems)
        turn = np.array([rng.randrange(1000) for _ in range(rng.randrange(1, 3 * PAGE))])
        prompt = np.concatenate([base, turn])
        prompts.append(prompt)
        if len(prompt) < 12 * PAGE:
            conversations.append(prompt)
    return prompts


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first_direct", "page_first"])
async def test_many_requests_through_small_pools(policy: str, host_layout: str) -> None:
    config = _config(write_policy=policy, host_layout=host_layout, write_through_threshold=2)
    generator = KVGenerator(config.layout, PAGE, seed=7)
    async with HiCache(config) as cache:
        served = []
        for i, prompt in enumerate(_prompts(300, seed=hash(policy + host_layout) % 1000)):
            served.append(await serve(cache, prompt, generator, request_id=f"r{i}", check="all"))
            if i % 50 == 0:
                await asyncio.sleep(0.01)  # let write-backs land between bursts
        await cache.drain()
        stats = cache.statistics()
        assert sum(s.device_tokens for s in served) > 0
        assert stats.counters["device_evicted_pages"] > 0
        if policy != "write_back":
            assert sum(s.host_tokens for s in served) > 0, "no request was served from host"
            assert stats.counters["loaded_pages"] > 0
        assert sum(s.checked_pages for s in served) > 0
        assert_drained(cache)


@pytest.mark.parametrize("threshold", [1, 2, 3])
async def test_selective_write_through_counts_the_commit_as_a_first_use(threshold: int) -> None:
    # As SGLang counts: with the default 2 a prefix is backed up the first time it is
    # reused (a chat's next turn), not at its third use, which eviction usually pre-empts.
    config = _config(write_policy="write_through_selective", write_through_threshold=threshold)
    generator = KVGenerator(config.layout, PAGE, seed=4)
    prompt = np.arange(100, 100 + 3 * PAGE)
    async with HiCache(config) as cache:
        uses = 1
        await serve(cache, prompt, generator, check="all")
        while True:
            await cache.drain()
            if cache.statistics().counters["host_backup_pages"]:
                break
            assert uses < threshold, f"not backed up after {uses} uses"
            cache.request(prompt).release()
            uses += 1
        assert uses == threshold
        assert cache.statistics().counters["host_backup_pages"] == 3
        assert cache.statistics().tree.host_pages == 3
        assert_drained(cache)


@pytest.mark.parametrize(
    ("policy", "host_pages", "warned"),
    [
        ("write_through", 24, True),
        ("write_through_selective", 12, True),
        ("write_through", 25, False),
        ("write_back", 12, False),  # host copies only of pages leaving the device
    ],
)
async def test_a_host_pool_no_larger_than_the_device_is_logged(
    policy: str, host_pages: int, warned: bool
) -> None:
    config = _config(write_policy=policy, device_pages=24, host_pages=host_pages)
    with capture_logs() as logs:
        async with HiCache(config):
            small = [e for e in logs if e["event"] == "hicache.config.host_pool_small"]
    assert bool(small) is warned
    if warned:
        assert small[0]["host_pages"] == host_pages
        assert small[0]["log_level"] == "warning"


async def test_concurrent_requests_share_and_balance() -> None:
    config = _config(device_pages=32, host_pages=64)
    generator = KVGenerator(config.layout, PAGE, seed=1)
    prompts = _prompts(200, seed=3)
    async with HiCache(config) as cache:
        sem = asyncio.Semaphore(4)

        async def one(i: int, prompt: np.ndarray) -> None:
            async with sem:
                # A device pool full of running requests' pages is allowed to refuse.
                with contextlib.suppress(OutOfPagesError):
                    await serve(cache, prompt, generator, request_id=f"c{i}")

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        await cache.drain()
        assert_drained(cache)


async def test_cancellation_at_every_await_point() -> None:
    """Cancel a request handler after k loop iterations, for every k until it finishes."""
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=2)
    prompts = _prompts(80, seed=5)
    async with HiCache(config) as cache:
        for prompt in prompts[:30]:
            await serve(cache, prompt, generator)
        cancelled = 0
        for prompt in prompts[30:]:
            step = 0
            while True:
                task = asyncio.create_task(serve(cache, prompt, generator))
                for _ in range(step):
                    await asyncio.sleep(0)
                if task.done():
                    await task
                    break
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                cancelled += 1
                step += 1
                await cache.drain()
                assert_drained(cache)
        assert cancelled >= len(prompts[30:])
        # The cache still serves correct bytes after all that.
        for prompt in prompts[:20]:
            result = await serve(cache, prompt, generator, check="all")
            assert result.device_tokens + result.host_tokens > 0


async def test_wrong_thread_and_closed_errors() -> None:
    config = _config()
    unentered = HiCache(config)
    assert unentered.state == "new"
    async with HiCache(config) as cache:
        errors: list[BaseException] = []

        shown: list[str] = []

        def other_thread() -> None:
            shown.append(repr(cache))  # a repr never raises, from anywhere
            shown.append(cache.state)  # nor does reading the state
            try:
                cache.match([1, 2, 3, 4])
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert len(errors) == 1
        assert isinstance(errors[0], WrongThreadError)
        assert shown[0].startswith("<HiCache open")
        assert "nodes=" in shown[0]
        assert shown[1] == "open"
        info = cache.match(list(range(9)))
        assert info.device_tokens == 0
        assert "HiCache open" in repr(cache)
    assert cache.state == "closed"
    with pytest.raises(CacheClosedError):
        cache.match([1, 2, 3, 4])
    with pytest.raises(CacheClosedError):
        await cache.__aenter__()


async def test_request_lifecycle_and_repr() -> None:
    config = _config()
    generator = KVGenerator(config.layout, PAGE)
    tokens = list(range(10))  # two whole pages and a tail of two tokens
    async with HiCache(config) as cache:
        with cache.request(tokens, request_id="first") as req:
            assert req.cached_tokens == 0
            pages = await req.allocate(10)
            assert len(pages) == 3
            for i in range(2):
                generator.fill_page(cache.device_pool, pages[i], tokens, i)
            assert req.commit() == 2
            assert "first active" in repr(req)
        assert req.released
        with pytest.raises(CacheClosedError):
            await req.allocate(1)
        info = cache.match(tokens)
        assert info.device_tokens == 8
        with cache.request([*tokens, 99, 98]) as again:
            assert again.device_tokens == 8
            await again.load()
            generator.check_page(cache.device_pool, again.page_table[1], tokens, 1)
        await cache.drain()
        assert_drained(cache)
        with pytest.raises(ValueError, match="num_tokens"), cache.request(tokens) as bad:
            await bad.allocate(-1)


async def test_a_closed_cache_lets_its_pools_go() -> None:
    import gc
    import weakref

    config = _config()
    async with HiCache(config) as cache:
        device = weakref.ref(cache.device_pool.data)
        host = weakref.ref(cache.host_pool.data)
        open_stats = cache.statistics()
    # A copy thread the close stopped may still be leaving its last step, with a view of a
    # pool in a local: the pools go once it has (within moments, even on a loaded machine).
    deadline = time.monotonic() + 10
    while (device() is not None or host() is not None) and time.monotonic() < deadline:
        gc.collect()
        await asyncio.sleep(0.01)
    assert device() is None
    assert host() is None
    closed = cache.statistics()
    assert closed.device_pool is not None
    assert closed.device_pool.num_pages == open_stats.device_pool.num_pages  # type: ignore[union-attr]
    assert closed.host_pool is not None
    assert repr(cache) == "<HiCache closed>"
    # A snapshot decodes back to itself (its field types resolve at run time).
    import msgspec

    from hicache_async import CacheStatistics

    assert msgspec.json.decode(msgspec.json.encode(closed), type=CacheStatistics) == closed
    with pytest.raises(CacheClosedError):
        cache.device_pool  # noqa: B018


async def test_the_counters_of_a_snapshot_are_read_only() -> None:
    import copy
    import pickle

    import msgspec

    from hicache_async import CacheStatistics

    async with HiCache(_config()) as cache:
        generator = KVGenerator(cache.config.layout, PAGE, seed=3)
        await serve(cache, np.arange(4 * PAGE), generator)
        stats = cache.statistics()
    # A plain dict: a caller's change showed in a record declared frozen.
    counters = cast("dict[str, int]", stats.counters)
    changes: list[Callable[[], object]] = [
        lambda: counters.__setitem__("requests", 0),
        lambda: counters.update(requests=0),
        lambda: counters.pop("requests"),
        lambda: counters.setdefault("new", 1),
        counters.clear,
        counters.popitem,
        lambda: counters.__delitem__("requests"),
        lambda: counters.__ior__({"requests": 0}),
    ]
    for change in changes:
        with pytest.raises(TypeError):
            change()
    # Calling __init__ again (as dict's would fill it) changes nothing either.
    counters.__init__({"requests": 0, "new": 1})  # type: ignore[misc]
    assert counters["requests"] == 1
    assert "new" not in counters
    from hicache_async._stats import ReadOnlyCounts

    assert ReadOnlyCounts.fromkeys(["a", "b"], 2) == {"a": 2, "b": 2}
    plain = dict(counters)
    assert counters == plain
    editable = counters.copy()
    editable["requests"] = 5
    assert counters["requests"] == 1
    # The snapshot still encodes, decodes, pickles and copies as the same record.
    assert msgspec.json.decode(msgspec.json.encode(stats))["counters"] == plain
    for again in (
        msgspec.json.decode(msgspec.json.encode(stats), type=CacheStatistics),
        msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=CacheStatistics),
        pickle.loads(pickle.dumps(stats)),
        copy.deepcopy(stats),
    ):
        assert again == stats
        with pytest.raises(TypeError):
            cast("dict[str, int]", again.counters)["requests"] = 0
    assert msgspec.to_builtins(stats)["counters"] == plain


def test_the_counters_of_a_snapshot_stay_a_dict_for_every_encoder() -> None:
    # Why they are a dict subclass and not an immutable Mapping: a Mapping that is not a dict
    # is refused by json.dumps, msgspec and `isinstance(..., dict)` checks (docs/api.md says
    # what the subclass leaves open: dict's own methods called on it directly).
    import json

    import msgspec

    from hicache_async._stats import ReadOnlyCounts

    counts = ReadOnlyCounts({"requests": 1})
    assert isinstance(counts, dict)
    assert json.loads(json.dumps(counts)) == {"requests": 1}
    assert msgspec.json.decode(msgspec.json.encode(counts)) == {"requests": 1}
    assert msgspec.to_builtins(counts) == {"requests": 1}
    assert counts == {"requests": 1}


async def test_a_cached_prompt_takes_its_requests_priority_at_commit() -> None:
    # Pages read back from storage (or committed before at a lower priority) must be pinned
    # by a request that finds them all cached, as an insert of them would pin them.
    config = _config(device_pages=8, host_pages=16)
    generator = KVGenerator(config.layout, PAGE, seed=9)
    pinned = np.arange(500, 500 + 4 * PAGE)
    async with HiCache(config) as cache:
        await serve(cache, pinned, generator)  # priority 0
        with cache.request(pinned, priority=5) as req:
            assert req.cached_tokens == len(pinned)
            assert req.commit() == 0
        for i in range(6):  # other traffic fills the device over and over
            await serve(cache, np.arange(4 * PAGE) + 10_000 * (i + 1), generator)
            await cache.drain()  # its host copy landed: it is as free to leave as the pin
        assert cache.match(pinned).device_tokens == len(pinned)
        await serve(cache, pinned, generator, check="all")
        await cache.drain()
        assert_drained(cache)
