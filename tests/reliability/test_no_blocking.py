"""No blocking calls on the event loop: a representative workload under blockbuster.

blockbuster (https://github.com/cbornet/blockbuster) wraps the blocking functions of the
standard library (file and socket I/O, os.stat/rename/unlink/listdir..., time.sleep, contended
lock acquisition, ...) and raises when one runs on a thread with a running event loop while a
frame of a scanned package is on the stack. Here every wrapper is wrapped once more so that a
call is recorded (function, and the hicache_async frames that led to it) and then allowed to
proceed: the workload runs to the end and the test reports every blocking call at once, not
just the first.

The workload: caches over file storage with prefetch, backup and warmup, concurrent requests
through small pools, a corrupt page, attach and detach at run time, and maintenance calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import forbiddenfruit  # type: ignore[import-untyped]
import numpy as np
import pytest
from blockbuster import BlockBuster, BlockBusterFunction, BlockingError

import hicache_async
from hicache_async import HiCache
from hicache_async.storage import FileStorage
from hicache_async.testing import KVGenerator, serve

from . import PAGE, Record, assert_drained, make_config, prompt_pool, settle

#: The loop this suite runs under in the short run (the full run uses every loop).
SHORT_LOOP = "uvloop"

_PACKAGE = os.path.dirname(hicache_async.__file__) + os.sep
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_BLOCKBUSTER = inspect.getfile(BlockBuster)
_DESCRIPTOR_CALLS = (
    "os.open",
    "os.fstat",
    "os.lstat",
    "os.fsync",
    "os.fdatasync",
    "os.pread",
    "os.preadv",
    "os.pwrite",
    "os.pwritev",
    "os.ftruncate",
    "os.truncate",
    "os.scandir",
    "os.utime",
    "fcntl.flock",
)


@dataclass
class _Finding:
    function: str
    #: the innermost hicache_async frame, as "path:line in function"
    site: str
    #: True when that frame made the call itself; False when it went through another
    #: package first (the blocking call is then that package's internal).
    direct: bool
    stack: list[str] = field(default_factory=list)
    #: how long the call took (how long it held up the loop)
    seconds: float = 0.0


def _is_stdlib(filename: str) -> bool:
    """The standard library, or the wrappers watching it (blockbuster's and ours)."""
    if filename in (_BLOCKBUSTER, __file__):
        return True
    return filename.startswith((_STDLIB, "<frozen")) and "site-packages" not in filename


def _library_frames(frame: FrameType | None) -> tuple[list[str], bool]:
    """hicache_async frames from the innermost out, and whether the code that made the
    blocking call is the library's: the innermost frame outside the standard library (a
    `thread.join()` blocks in threading.py, but the library chose to call it)."""
    sites: list[str] = []
    caller = frame
    while caller is not None and _is_stdlib(caller.f_code.co_filename):
        caller = caller.f_back
    direct = caller is not None and caller.f_code.co_filename.startswith(_PACKAGE)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE):
            relative = "hicache_async/" + name[len(_PACKAGE) :]
            sites.append(f"{relative}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return sites, direct


def _allowed(function: str, args: tuple[Any, ...]) -> bool:
    if function == "os.path.abspath":
        # posixpath.abspath of an absolute path is string work (it calls os.getcwd only for a
        # relative one); blockbuster wraps the function whatever its argument.
        return bool(args) and os.path.isabs(args[0])
    return False


def _recorder(name: str, checker: Any, original: Any, findings: list[_Finding]) -> Any:
    """Call blockbuster's checker; on a BlockingError record the call and let it proceed."""

    def record(*args: Any, **kwargs: Any) -> Any:
        try:
            return checker(*args, **kwargs)
        except BlockingError:
            if _allowed(name, args):
                return original(*args, **kwargs)
            caller = inspect.currentframe()
            sites, direct = _library_frames(caller.f_back if caller else None)
            finding = _Finding(name, sites[0] if sites else "?", direct, sites)
            findings.append(finding)
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                finding.seconds = time.perf_counter() - began

    return record


@contextlib.contextmanager
def recording_blockbuster() -> Iterator[list[_Finding]]:
    """blockbuster scanning hicache_async, recording blocking calls instead of raising."""
    findings: list[_Finding] = []
    buster = BlockBuster(scanned_modules=["hicache_async"])
    # blockbuster covers buffered file objects and path-level os calls; FileStorage works on
    # descriptors, so the descriptor-level calls it makes are watched too. Not os.close: it
    # blocks only to flush written data, and FileStorage closes written files on its threads
    # (on the loop it closes only its directory and lock descriptors, when it shuts down).
    for name in _DESCRIPTOR_CALLS:
        buster.functions[name] = BlockBusterFunction(None, name, scanned_modules=["hicache_async"])
    # blockbuster sees a join only when the lock it waits on happens to be held; a join of a
    # thread that is still alive always waits for it.
    buster.functions["threading.Thread.join"] = BlockBusterFunction(
        None,
        "threading.Thread.join",
        scanned_modules=["hicache_async"],
        can_block_predicate=lambda thread, *_, **__: not thread.is_alive(),
    )
    buster.activate()
    try:
        for name, function in buster.functions.items():
            if not function.activated:
                continue
            checker = getattr(function.module, function.func_name)
            record = _recorder(name, checker, function.original_func, findings)
            try:
                setattr(function.module, function.func_name, record)
            except TypeError:  # a C type: blockbuster itself patches these with forbiddenfruit
                forbiddenfruit.curse(function.module, function.func_name, record)
        yield findings
    finally:
        buster.deactivate()  # puts every original back, over our wrappers too


async def _workload(root: Path) -> dict[str, int]:
    config = make_config(
        device_pages=64,
        host_pages=160,
        prefetch={"policy": "wait_complete"},
        warmup={"enabled": True, "deadline_s": 30.0},
    )
    generator = KVGenerator(config.layout, PAGE, seed=41)
    prompts = prompt_pool(60, seed=43)
    counts = {"requests": 0}

    async def serve_all(cache: HiCache, tag: str) -> None:
        semaphore = asyncio.Semaphore(4)

        async def one(number: int, prompt: np.ndarray[Any, Any]) -> None:
            async with semaphore:
                await serve(cache, prompt, generator, request_id=f"{tag}{number}", check="all")
                counts["requests"] += 1

        await asyncio.gather(*(one(n, p) for n, p in enumerate(prompts)))

    async with HiCache(config, storage=f"file://{root}?shared=1") as first:
        await serve_all(first, "a")
        await settle(first)
        await first.detach_storage()
        await first.attach_storage(f"file://{root}?shared=1")
        await serve_all(first, "b")
        await settle(first)
        assert_drained(first)
    # Damage one page on disk: the next reader finds it corrupt and removes it.
    victim = next((root / "pages").glob("*/*"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    async with HiCache(config, storage=f"file://{root}?shared=1") as second:
        await second.wait_warmup()
        await serve_all(second, "c")
        await settle(second)
        assert_drained(second)
        status = second.storage_status()
        assert status.prefetch is not None
        counts["pages_read"] = status.prefetch.pages_read
    async with FileStorage(root) as storage:
        await storage.verify()
        await storage.list_pages(limit=10)
        await storage.gc()
    return counts


async def test_no_blocking_calls_on_the_loop(tmp_path: Path, figures: Record) -> None:
    root = tmp_path / "l3"
    root.mkdir(mode=0o700)
    with recording_blockbuster() as findings:
        counts = await _workload(root)
    unique: dict[tuple[str, str], _Finding] = {}
    for finding in findings:
        unique.setdefault((finding.function, finding.site), finding)
    direct = [f for f in unique.values() if f.direct]
    internal = [f for f in unique.values() if not f.direct]
    figures(
        "blocking calls",
        requests=counts["requests"],
        pages_read=counts["pages_read"],
        calls_recorded=len(findings),
        in_library_code=len(direct),
        in_third_party_internals=len(internal),
        sites="; ".join(f"{f.function} at {f.site}" for f in unique.values()) or "none",
    )
    assert counts["pages_read"] > 0
    # Third-party internals reached from library code (none found when this was written)
    # are reported above but not failed on: the fix would be in that package.
    assert not direct, "blocking calls on the loop:\n" + "\n".join(
        f"{f.function} at {f.site}\n    " + "\n    ".join(f.stack[1:4]) for f in direct
    )


def test_the_recorder_catches_a_blocking_call(tmp_path: Path) -> None:
    """The harness itself: library code that reads a file on a running loop is recorded with
    its site (`load_config` reads synchronously by design; the library never calls it on the
    loop), and the same call without a running loop is not."""
    path = tmp_path / "config.toml"
    path.write_text("device_pages = 8\n[layout]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 2\n")

    async def on_the_loop() -> None:
        hicache_async.load_config(path)

    with recording_blockbuster() as findings:
        asyncio.run(on_the_loop())
    assert any("hicache_async/_config.py" in f.site for f in findings), findings
    with recording_blockbuster() as quiet:
        hicache_async.load_config(path)
    assert not quiet, quiet


@pytest.mark.parametrize("name", ["os.stat", "os.unlink", "time.sleep"])
def test_the_recorder_restores_every_function(name: str) -> None:
    module_name, _, attribute = name.rpartition(".")
    module = __import__(module_name)
    before = getattr(module, attribute)
    with recording_blockbuster():
        assert getattr(module, attribute) is not before
    assert getattr(module, attribute) is before


CLOSES = 6


def test_closing_caches_does_not_join_threads_on_the_loop(figures: Record) -> None:
    """Closing a cache closes its CPU copy engine, whose `aclose` ends with `thread.join()`
    on the loop: the worker has signalled its exit but usually has not finished, so the loop
    waits for it."""
    config = make_config()
    generator = KVGenerator(config.layout, PAGE, seed=47)

    async def cycles() -> None:
        for number in range(CLOSES):
            async with HiCache(config) as cache:
                await serve(cache, np.arange(10 * PAGE) + number, generator)
                await cache.drain()

    # A busy Python thread, as a serving process has: the copy worker then needs its turn at
    # the GIL to finish exiting, so it is still alive when the loop joins it.
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    hog = threading.Thread(target=busy, daemon=True)
    hog.start()
    try:
        with recording_blockbuster() as findings:
            asyncio.run(cycles())
    finally:
        stop.set()
        hog.join()
    direct = [f for f in findings if f.direct]
    figures(
        "blocking calls at close",
        closes=CLOSES,
        blocked=len(direct),
        longest_ms=round(max((f.seconds for f in direct), default=0.0) * 1e3, 2),
    )
    assert not direct, "\n".join(f"{f.function} at {f.site}" for f in direct[:3])
