"""How serving stacks embed the cache: handles they lose, threads they call from, teardown."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import pickle
import subprocess
import sys
import threading
import warnings
import weakref
from collections.abc import Callable

import pytest
from _gated_copies import A, B, GatedEngine, held, host_cache
from structlog.testing import capture_logs

from hicache_async import (
    CacheClosedError,
    CacheConfig,
    HiCache,
    KVLayout,
    Request,
    WrongThreadError,
)
from hicache_async.storage import MemoryStorage
from hicache_async.testing import KVGenerator, RedisServer, assert_drained, serve
from hicache_async.transfer import CpuCopyEngine

try:
    import uvloop
except ImportError:  # pragma: no cover - the testing extra brings it everywhere but Windows
    uvloop = None

PAGE = 8
CONFIG = CacheConfig(
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=8),
    page_size=PAGE,
    device_pages=16,
    host_pages=32,
    model_id="embedding",
)
PROMPT = list(range(10 * PAGE))
OTHER = list(range(1000, 1000 + 10 * PAGE))
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.new_event_loop


async def _until_released(cache: HiCache) -> None:
    """Run the loop until no request is live (bounded: a few loop steps suffice)."""
    for _ in range(100):
        if cache.statistics().live_requests == 0:
            return
        await asyncio.sleep(0)


async def _handler_that_loses_its_request(cache: HiCache) -> None:
    req = cache.request(PROMPT)
    await req.allocate(PAGE)
    raise RuntimeError("a handler bug before its `with`")


async def test_a_request_dropped_without_release_gives_its_pages_back() -> None:
    # The cache held every request strongly until its close: a handle a stack lost (an
    # exception before its `with`) kept its device prefix locked and its pages taken for the
    # cache's whole life, silently, until allocations failed with OutOfPagesError.
    generator = KVGenerator(CONFIG.layout, PAGE)
    async with HiCache(CONFIG) as cache:
        await serve(cache, PROMPT, generator)
        with warnings.catch_warnings(record=True) as caught, capture_logs() as logs:
            warnings.simplefilter("always")
            with contextlib.suppress(RuntimeError):
                await _handler_that_loses_its_request(cache)
            gc.collect()  # the traceback's frames may sit in a reference cycle
            await _until_released(cache)
        assert cache.statistics().live_requests == 0
        assert any(
            issubclass(w.category, ResourceWarning) and "without release()" in str(w.message)
            for w in caught
        )
        assert [e["num_tokens"] for e in logs if e["event"] == "hicache.request.dropped"] == [
            len(PROMPT)
        ]
        # The whole device pool is needed: the lost request's lock and page are back.
        served = await serve(cache, OTHER, generator)
        assert served.computed_tokens == len(OTHER)
        await cache.drain()
        assert_drained(cache)


async def test_a_request_dropped_in_another_thread_is_released_on_the_loop() -> None:
    # A sync stack hands handles to worker threads: the last reference may go there, and the
    # release must still run on the cache's loop.
    async with HiCache(CONFIG) as cache:
        held: list[Request] = [cache.request(PROMPT)]
        await held[0].allocate(len(PROMPT))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            thread = threading.Thread(target=held.clear)
            thread.start()
            await asyncio.to_thread(thread.join)
            gc.collect()
            await _until_released(cache)
        assert cache.statistics().live_requests == 0
        assert cache.device_pool.allocator.used_count == 0
        await cache.drain()
        assert_drained(cache)


async def test_a_dropped_request_reached_through_a_weak_reference_is_released() -> None:
    # The release waits for the loop, which holds the request meanwhile, and a weak reference
    # to it stays valid until then: a registry of weak references returned the dropped
    # request as active, and its pages went at the next loop step under whoever used it.
    async with HiCache(CONFIG) as cache:
        registry: weakref.WeakValueDictionary[str, Request] = weakref.WeakValueDictionary()
        req = cache.request(PROMPT, request_id="r")
        registry["r"] = req
        await req.allocate(PAGE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del req
            again = registry.get("r")
            if again is not None:
                assert again.released
                with pytest.raises(CacheClosedError):
                    await again.allocate(PAGE)
            del again
            gc.collect()
            await _until_released(cache)
        assert cache.statistics().live_requests == 0
        assert cache.device_pool.allocator.used_count == 0
        await cache.drain()
        assert_drained(cache)


class _Holder:
    """A handler's state that refers to itself, as a traceback's frames do."""

    req: Request
    me: _Holder


async def test_a_request_collected_in_a_cycle_counts_as_live_until_released() -> None:
    # gc clears the weak references of a cycle before finalizing it: the request left the
    # cache's weak set at once, and live_requests said 0 while its lock and pages were held.
    async with HiCache(CONFIG) as cache:
        holder = _Holder()
        holder.req = cache.request(PROMPT)
        holder.me = holder
        await holder.req.allocate(PAGE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del holder
            gc.collect()
            assert cache.statistics().live_requests == 1  # its release is still to run
            assert cache.device_pool.allocator.used_count == 1
            await _until_released(cache)
        assert cache.statistics().live_requests == 0
        assert cache.device_pool.allocator.used_count == 0
        await cache.drain()
        assert_drained(cache)


async def test_dropped_requests_leave_no_entry_in_the_warning_registry() -> None:
    # Each warning names its request: under the "default" action (python -X dev) the module's
    # __warningregistry__ kept one entry per dropped request, for the life of the process.
    async with HiCache(CONFIG) as cache:
        with warnings.catch_warnings(record=True) as caught, capture_logs():
            warnings.simplefilter("default")
            for n in range(3):
                dropped = cache.request(PROMPT, request_id=f"dropped-{n}")
                del dropped
                gc.collect()
                await _until_released(cache)
            registry = vars(sys.modules[Request.__module__]).get("__warningregistry__", {})
            assert not [key for key in registry if "without release()" in str(key)]
        assert len([w for w in caught if "without release()" in str(w.message)]) == 3
        assert cache.statistics().live_requests == 0


async def test_a_request_cannot_be_copied() -> None:
    # A copy shared the request's lock and pages: once collected it was released as a lost
    # request, and the pages of the original, still in use, went to the next allocation.
    async with HiCache(CONFIG) as cache:
        with cache.request(PROMPT) as req:
            pages = await req.allocate(2 * PAGE)
            for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError, match="cannot be copied"):
                    duplicate(req)
            gc.collect()
            for _ in range(10):
                await asyncio.sleep(0)
            assert not req.released
            assert cache.device_pool.allocator.used_count == len(pages)
        await cache.drain()
        assert_drained(cache)


async def test_a_request_collected_after_the_close_does_nothing() -> None:
    async with HiCache(CONFIG) as cache:
        held = [cache.request(PROMPT)]
    assert held[0].released  # the close released it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        held.clear()
        gc.collect()


def _record_free(pool: object, freed_on: list[int]) -> None:
    weakref.finalize(pool, lambda: freed_on.append(threading.get_ident()))


async def test_the_close_frees_the_pools_off_the_loop() -> None:
    # Unmapping the pools takes the kernel about 0.1 s a GiB: done on the loop, closing a
    # cache with real pools stalled every other task of the process for seconds.
    freed_on: list[int] = []
    async with HiCache(CONFIG) as cache:
        await serve(cache, PROMPT, KVGenerator(CONFIG.layout, PAGE))
        _record_free(cache.device_pool, freed_on)
        _record_free(cache.host_pool, freed_on)
    assert len(freed_on) == 2
    assert threading.get_ident() not in freed_on
    assert cache.statistics().device_pool is not None  # the figures outlive the pools


@pytest.mark.parametrize("new_loop", list(LOOPS.values()), ids=list(LOOPS))
def test_one_copy_engine_serves_caches_on_successive_loops(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # A harness passes one engine to the cache of each test, each on its own loop: bound to
    # the first loop for good, the engine failed every load of the next cache with
    # WrongThreadError, and refused its host backups.
    engine = CpuCopyEngine()
    generator = KVGenerator(CONFIG.layout, PAGE)

    async def use() -> None:
        async with HiCache(CONFIG, copy_engine=engine) as cache:
            await serve(cache, PROMPT, generator)
            await serve(cache, OTHER, generator)  # moves PROMPT to the host
            served = await serve(cache, PROMPT, generator, check="all")
            assert served.host_tokens > 0  # loaded back through the engine
            await cache.drain()
            assert_drained(cache)

    for _ in range(2):
        loop = new_loop()
        try:
            loop.run_until_complete(use())
        finally:
            loop.close()
    loop = new_loop()
    try:
        loop.run_until_complete(engine.aclose())
    finally:
        loop.close()
    assert engine.statistics().failed == 0


@pytest.mark.parametrize("new_loop", list(LOOPS.values()), ids=list(LOOPS))
def test_a_copy_engine_whose_close_its_loop_cut_short_closes_on_the_next_loop(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # A harness's teardown cancelled the engine's close and its loop ended: the close of the
    # next loop raised WrongThreadError, so the engine could never be closed again.
    engine = CpuCopyEngine(name="cut-short-engine")

    async def use_then_cut_the_close_short() -> None:
        async with HiCache(CONFIG, copy_engine=engine) as cache:
            generator = KVGenerator(CONFIG.layout, PAGE)
            await serve(cache, PROMPT, generator)
            await serve(cache, OTHER, generator)
            await serve(cache, PROMPT, generator)  # loaded back through the engine
        closing = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0)  # the close has queued the worker's Stop and waits for it
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing

    first = new_loop()
    try:
        first.run_until_complete(use_then_cut_the_close_short())
    finally:
        first.close()
    second = new_loop()
    try:
        second.run_until_complete(engine.aclose())
    finally:
        second.close()
    assert engine.closed
    assert not any(t.name == "cut-short-engine" for t in threading.enumerate())


def test_a_copy_engine_refuses_a_second_loop_while_its_loop_is_open() -> None:
    engine = CpuCopyEngine()
    generator = KVGenerator(CONFIG.layout, PAGE)
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    owner, other = HiCache(CONFIG, copy_engine=engine), HiCache(CONFIG, copy_engine=engine)
    try:
        first.run_until_complete(owner.__aenter__())
        first.run_until_complete(serve(owner, PROMPT, generator))
        second.run_until_complete(other.__aenter__())
        with pytest.raises(WrongThreadError, match="another event loop"):
            second.run_until_complete(serve(other, PROMPT, generator))
        second.run_until_complete(other.__aexit__(None, None, None))
        first.run_until_complete(serve(owner, PROMPT, generator, check="all"))
        first.run_until_complete(owner.__aexit__(None, None, None))
        first.run_until_complete(engine.aclose())
    finally:
        first.close()
        second.close()


async def test_a_request_dropped_while_its_load_is_in_flight_is_released_once_it_lands(
    gate: GatedEngine,
) -> None:
    # The copy keeps the request until it lands (its pages join the tree under the request's
    # lock); then the request goes, and its lock with it.
    async with host_cache(gate, A, mode="hold") as (cache, _):
        req = cache.request(B)
        load = held(await req.load())
        del req
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
            assert cache.statistics().live_requests == 1  # its load is in flight
            await gate.land(load)
            gc.collect()
            await _until_released(cache)
        assert cache.statistics().live_requests == 0
        assert cache.match(A).device_tokens == len(A)  # the load landed in the tree


async def test_a_cancelled_close_with_nothing_to_flush_does_not_warn() -> None:
    # A shutdown under a deadline that cancels the exit logged a warning that backups were
    # abandoned, with none pending and none being written.
    cache = HiCache(CONFIG, storage=MemoryStorage())
    await cache.__aenter__()
    await serve(cache, PROMPT, KVGenerator(CONFIG.layout, PAGE))
    await cache.drain()
    with capture_logs() as logs:
        leave = asyncio.create_task(cache.__aexit__(None, None, None))
        for _ in range(100):
            if cache.state == "closing":
                break
            await asyncio.sleep(0)
        leave.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leave
    assert cache.state == "closed"
    abandoned = [e for e in logs if e["event"] == "hicache.backup.flush.abandoned"]
    assert [(e["log_level"], e["pending"], e["writing_pages"]) for e in abandoned] == [
        ("info", 0, 0)
    ]


_IMPORT_THREAD = """
import asyncio, importlib.abc, sys, threading
imported_on = []

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "hicache_async.storage._redis":
            imported_on.append(threading.get_ident())

sys.meta_path.insert(0, Watch())
from hicache_async import CacheConfig, HiCache, KVLayout

config = CacheConfig(
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=8), page_size=8, device_pages=8
)

async def main():
    async with HiCache(config, storage=sys.argv[1]) as cache:
        assert cache.storage_status().attached
    return threading.get_ident()

loop_thread = asyncio.run(main())
assert len(imported_on) == 1 and imported_on[0] != loop_thread, (imported_on, loop_thread)
"""


def test_the_first_redis_attach_imports_the_client_off_the_loop() -> None:
    # Imported on the loop, the client library stalled every other task for about 0.1 s
    # at the process's first attach (an asyncio debug-mode warning on every start).
    with RedisServer() as server:
        done = subprocess.run(
            [sys.executable, "-c", _IMPORT_THREAD, server.url],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr


_CONCURRENT_IMPORT = """
import asyncio, importlib, importlib.abc, importlib.machinery, sys, threading
NAME = "hicache_async.storage._redis"
executing, executed, release = threading.Event(), threading.Event(), threading.Event()
executed_on = []  # threads that ran the module's code
waited_on = []  # threads that asked for the module while that code ran

class Gated(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        executed_on.append(threading.get_ident())
        executing.set()
        release.wait(60)  # held until another attach asks for the module
        self.inner.exec_module(module)
        executed.set()

class Gate(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = Gated(spec.loader)
        return spec

real_import_module = importlib.import_module

def import_module(name, package=None):
    if name == NAME and executing.is_set() and not executed.is_set():
        waited_on.append(threading.get_ident())
        release.set()
    return real_import_module(name, package)

importlib.import_module = import_module
sys.meta_path.insert(0, Gate())
from hicache_async import CacheConfig, HiCache, KVLayout

config = CacheConfig(
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=8), page_size=8, device_pages=8
)

async def main():
    async with HiCache(config) as one, HiCache(config) as two:
        first = asyncio.create_task(one.attach_storage(sys.argv[1]))
        assert await asyncio.to_thread(executing.wait, 60)
        # The second attach starts while the first one's import runs.
        await asyncio.gather(first, two.attach_storage(sys.argv[1]))
        assert one.storage_status().attached and two.storage_status().attached
    return threading.get_ident()

loop_thread = asyncio.run(main())
assert len(executed_on) == 1 and executed_on[0] != loop_thread, (executed_on, loop_thread)
assert waited_on and loop_thread not in waited_on, (waited_on, loop_thread)
"""


def test_a_second_redis_attach_waits_for_the_first_ones_import_off_the_loop() -> None:
    # The module is in sys.modules while its code runs: a second attach took it for imported
    # and waited on the loop for the first attach's import to finish.
    with RedisServer() as server:
        done = subprocess.run(
            [sys.executable, "-c", _CONCURRENT_IMPORT, server.url],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    assert done.returncode == 0, done.stderr


_EXIT_WITH_A_REQUEST = """
import asyncio
from hicache_async import CacheConfig, HiCache, KVLayout

config = CacheConfig(
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=8), page_size=8, device_pages=8
)
loop = asyncio.new_event_loop()
cache = HiCache(config)
loop.run_until_complete(cache.__aenter__())

async def start():
    req = cache.request(list(range(16)), request_id="kept")
    await req.allocate(16)
    return req

req = loop.run_until_complete(start())
# The loop is stopped, never closed; the request is collected at the interpreter's exit.
"""


def test_a_request_collected_at_exit_does_not_claim_its_pages_are_given_back() -> None:
    # Its release was handed to a loop that never runs again, and the warning said the
    # pages were given back now.
    done = subprocess.run(
        [sys.executable, "-W", "default::ResourceWarning", "-c", _EXIT_WITH_A_REQUEST],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if "without release()" in x]
    assert "request kept of 16 tokens" in line
    assert "are not given back: the interpreter is exiting" in line
    assert "given back now" not in done.stderr
