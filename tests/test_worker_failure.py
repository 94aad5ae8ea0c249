"""A cache whose workers were ended by an exception no worker contains (a KeyboardInterrupt or
SystemExit raised in a backend call, as a Ctrl-C landing in backend code would): the error goes
on out of the event loop as before, and the program that catches it and keeps the loop finds a
cache that says so (storage detached, `WorkersFailedError` on what needs workers), whose close
ends and releases its file root, which a fresh cache then serves byte for byte."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import anyio
import msgspec
import pytest
from test_backup_already_stored import (
    AnswersOnceTheGateOpens,
    _config,
    _prompt,
    _served_and_stored,
    _until_begun,
)
from test_backup_repair import _queued

from hicache_async import CacheConfig, HiCache, PrefetchStatus, WorkersFailedError
from hicache_async.storage import FileStorage, MemoryStorage, Outcome, PageBuffer, PageMeta
from hicache_async.testing import KVGenerator, assert_drained, serve
from hicache_async.workers import StorageLink

try:
    import uvloop
except ImportError:  # pragma: no cover - the testing extra brings it everywhere but Windows
    uvloop = None

PAGE = 8

CONFIG = CacheConfig.from_dict(
    {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "page_size": PAGE,
        "device_pages": 64,
        "host_pages": 128,
        "model_id": "worker-failure",
        # One worker: a second prefetch stays queued behind the one whose read fails.
        "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE, "workers": 1},
        "backup": {"flush_deadline_s": 10.0},
    }
)
GEN = KVGenerator(CONFIG.layout, CONFIG.page_size, seed=11)
PROMPTS = [[100 + i] * PAGE + list(range(3 * PAGE)) for i in range(4)]

GUARD_S = 30.0  # a hang guard only

LOOPS: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.new_event_loop]
if uvloop is not None:
    LOOPS.append(uvloop.new_event_loop)
LOOP_IDS = [factory.__module__.split(".")[0] for factory in LOOPS]

# What a backend call may raise that no worker contains.
ESCAPING = [KeyboardInterrupt, lambda: SystemExit(3)]
ESCAPING_IDS = ["KeyboardInterrupt", "SystemExit"]


class RaisesOnce(FileStorage):
    """A file store whose first `get` or `put` (as `method` says) raises `error()` instead of
    running, once `gate` is set; every other call is the real store's."""

    method: ClassVar[Literal["get", "put"]] = "get"
    error: ClassVar[Callable[[], BaseException]] = KeyboardInterrupt
    raised = False
    gate: asyncio.Event | None = None

    async def _raise_once(self, method: str) -> None:
        if method == self.method and not self.raised:
            self.raised = True
            if self.gate is not None:
                await self.gate.wait()
            raise self.error()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        await self._raise_once("get")
        return await super().get(keys, into, namespace=namespace)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        await self._raise_once("put")
        return await super().put(keys, pages, metas)


def _raising(method: Literal["get", "put"], error: Callable[[], BaseException]) -> type[RaisesOnce]:
    return type("Raises", (RaisesOnce,), {"method": method, "error": staticmethod(error)})


@pytest.fixture(params=LOOPS, ids=LOOP_IDS)
def loop(request: pytest.FixtureRequest) -> Iterator[asyncio.AbstractEventLoop]:
    """A loop of each kind the program keeps using after the error came out of it."""
    made: asyncio.AbstractEventLoop = request.param()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(params=ESCAPING, ids=ESCAPING_IDS)
def error(request: pytest.FixtureRequest) -> Callable[[], BaseException]:
    factory: Callable[[], BaseException] = request.param
    return factory


def _run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return loop.run_until_complete(asyncio.wait_for(coro, GUARD_S))


def _raised_out_of(
    loop: asyncio.AbstractEventLoop, body: Coroutine[Any, Any, None], kind: type[BaseException]
) -> None:
    """Run `body` until `kind` comes out of the loop, as a program that catches it sees it,
    then cancel `body`. It must not end by itself in the step the error left: uvloop still
    runs that step's ready callbacks, and a run whose future finished there stops the
    loop's next run."""
    task = loop.create_task(body)
    with pytest.raises(kind):
        loop.run_until_complete(task)
    task.cancel()
    loop.run_until_complete(asyncio.wait([task], timeout=GUARD_S))
    assert task.done()


async def _populate(root: Path) -> None:
    async with HiCache(CONFIG, storage=FileStorage(str(root))) as cache:
        for prompt in PROMPTS:
            await serve(cache, prompt, GEN)
        await cache.drain()


async def _until(condition: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + GUARD_S
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met")
        await asyncio.sleep(0)


async def _serves_from_storage(root: Path) -> None:
    """A fresh cache over the same root (its lock released) serves every prompt from it,
    byte for byte."""
    async with HiCache(CONFIG, storage=FileStorage(str(root))) as cache:
        for prompt in PROMPTS:
            served = await serve(cache, prompt, GEN, check="all")
            assert served.storage_tokens > 0
        await cache.drain()
        assert_drained(cache)


async def _after_the_failure(cache: HiCache, root: Path, error: type[BaseException]) -> None:
    # At once, while the task groups above the failed worker still unwind (several loop
    # steps): nothing may find the workers gone without a word meanwhile.
    with pytest.raises(WorkersFailedError, match=error.__name__):
        await cache.attach_storage(FileStorage(str(root)))
    status = cache.storage_status()
    # Nothing attached (the backend whose workers ended is closed), no attach left half done.
    assert not status.attached
    assert not status.opening
    assert error.__name__ in (status.workers_failed or "")
    assert cache.statistics().storage == status
    assert cache.state == "open"
    with pytest.raises(WorkersFailedError):
        await cache.prefetch(PROMPTS[3])
    with pytest.raises(WorkersFailedError):
        await cache.warmup()
    with pytest.raises(WorkersFailedError):
        await cache.wait_warmup()
    # The device and host tiers still serve, byte for byte; nothing waits on storage.
    await serve(cache, PROMPTS[2], GEN, prefetch=False, check="all")
    await cache.drain()
    assert_drained(cache)
    await cache.detach_storage()
    await cache.__aexit__(None, None, None)
    assert cache.state == "closed"


def test_a_read_that_ends_the_workers_leaves_a_cache_that_says_so_and_closes(
    tmp_path: Path, loop: asyncio.AbstractEventLoop, error: Callable[[], BaseException]
) -> None:
    kind = type(error())
    _run(loop, _populate(tmp_path))
    backend = _raising("get", error)(str(tmp_path))
    backend.gate = gate = asyncio.Event()
    cache = HiCache(CONFIG, storage=backend)
    _run(loop, cache.__aenter__())
    handles = []

    async def prefetch_two() -> None:
        handles.append(await cache.start_prefetch(PROMPTS[0]))
        # Queued behind the first, whose read raises once this one is in the queue.
        handles.append(await cache.start_prefetch(PROMPTS[1]))
        gate.set()
        await asyncio.Event().wait()

    # As a program sees it, before and after: the error comes out of the loop.
    _raised_out_of(loop, prefetch_two(), kind)
    assert backend.raised
    assert len(handles) == 2
    _run(loop, _after_the_failure(cache, tmp_path, kind))
    # Neither the prefetch whose read raised nor the one queued behind it waits on.
    for handle in handles:
        result = _run(loop, handle.wait())
        assert result.status in (PrefetchStatus.CANCELLED, PrefetchStatus.TERMINATED)
    _run(loop, _serves_from_storage(tmp_path))


def test_a_write_that_ends_the_workers_leaves_a_cache_that_says_so_and_closes(
    tmp_path: Path, loop: asyncio.AbstractEventLoop, error: Callable[[], BaseException]
) -> None:
    kind = type(error())
    backend = _raising("put", error)(str(tmp_path))
    cache = HiCache(CONFIG, storage=backend)
    _run(loop, cache.__aenter__())

    async def commit_and_drain() -> None:
        await serve(cache, PROMPTS[0], GEN, prefetch=False)
        await cache.drain()
        await asyncio.Event().wait()

    _raised_out_of(loop, commit_and_drain(), kind)
    assert backend.raised
    _run(loop, _after_the_failure(cache, tmp_path, kind))
    # The root is free again: a fresh cache writes every prompt there and reads it back.
    _run(loop, _populate(tmp_path))
    _run(loop, _serves_from_storage(tmp_path))


def test_a_warmup_that_ends_the_workers_is_known_at_once(
    tmp_path: Path, loop: asyncio.AbstractEventLoop, error: Callable[[], BaseException]
) -> None:
    # The warmup started on attach runs beside the workers: an error that escapes it ends
    # them too, and must be known as soon as it is, as theirs is.
    kind = type(error())
    _run(loop, _populate(tmp_path))
    backend = _raising("get", error)(str(tmp_path))
    warming = msgspec.structs.replace(
        CONFIG, warmup=msgspec.structs.replace(CONFIG.warmup, enabled=True, ratio=1.0)
    )
    cache = HiCache(warming, storage=backend)

    async def enter_and_wait() -> None:
        await cache.__aenter__()
        await asyncio.Event().wait()

    _raised_out_of(loop, enter_and_wait(), kind)
    assert backend.raised
    _run(loop, _after_the_failure(cache, tmp_path, kind))
    _run(loop, _serves_from_storage(tmp_path))


async def test_a_link_that_never_ran_closes_at_once(tmp_path: Path) -> None:
    # Its `run()` never began (a task group that had ended refused it, or it was never
    # handed to one): nothing else would set what its close waits for, which then waited out
    # the flush deadline and then for ever, with the cache's close (and its root) behind it.
    async with HiCache(CONFIG) as cache:
        never_started = StorageLink(cache, FileStorage(str(tmp_path / "a")), generation=1)
        await asyncio.wait_for(never_started.close(flush=True, deadline_s=GUARD_S), GUARD_S)
        assert never_started.closed

        async with anyio.create_task_group() as ended:
            pass
        refused = StorageLink(cache, FileStorage(str(tmp_path / "b")), generation=1)
        with pytest.raises(RuntimeError):
            await refused.start(ended)
        assert not refused.running
        await asyncio.wait_for(refused.close(flush=True, deadline_s=GUARD_S), GUARD_S)
        assert refused.closed


def test_a_system_exit_from_several_look_ups_at_once_comes_out_once(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # A batch's look-ups of several chains run in tasks of their own: when each raises, the
    # error still comes out of the loop once, as from one look-up, and ends the workers as
    # itself (not in an exception group).
    chains = 3
    config = _config(check_prefix=False, batch_pages=16)
    generator = KVGenerator(config.layout, config.page_size, seed=13)
    first = _prompt(60, 1)
    prompts = [_prompt(61 + i, 1) for i in range(chains)]
    memory = MemoryStorage(capacity_bytes=16 << 20)
    shared = AnswersOnceTheGateOpens(memory)
    cache = HiCache(config, storage=shared)
    raised: list[SystemExit] = []

    async def setup() -> None:
        await memory.__aenter__()
        shared.gate.set()
        for tokens in (first, *prompts):
            await _served_and_stored(config, shared, tokens, generator)
        shared.begun = 0
        shared.gate = asyncio.Event()
        await cache.__aenter__()
        link = cache._link
        assert link is not None
        assert link.backup._stored is not None
        forget = link.backup._stored
        failing = {key for tokens in prompts for key in cache.keys_for(tokens)}

        def stored(keys: list[bytes]) -> None:
            if failing.intersection(keys):
                raised.append(SystemExit(len(raised)))
                raise raised[-1]
            forget(keys)

        link.backup._stored = stored
        await serve(cache, first, generator, prefetch=False)
        await _until_begun(shared, 1)
        for tokens in prompts:
            await serve(cache, tokens, generator, prefetch=False)
        await _queued(cache, chains)
        held, shared.gate = shared.gate, asyncio.Event()
        held.set()
        await _until_begun(shared, 1 + chains)

    async def answer() -> None:
        shared.gate.set()
        await asyncio.Event().wait()

    _run(loop, setup())
    link = cache._link
    assert link is not None
    _raised_out_of(loop, answer(), SystemExit)
    assert len(raised) == chains
    _run(loop, _until(lambda: cache.storage_status().workers_failed is not None))
    assert link.failed_with is raised[0]
    assert cache.storage_status().workers_failed == repr(raised[0])

    async def leave() -> None:
        await cache.detach_storage()
        await cache.__aexit__(None, None, None)
        await memory.__aexit__(None, None, None)

    _run(loop, leave())
