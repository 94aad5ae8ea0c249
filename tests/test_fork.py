"""Objects made or opened before an `os.fork` (a prefork server's preloaded app): the child is
refused with an error naming the fork, and the parent goes on unharmed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from hicache_async import (
    CacheConfig,
    HiCache,
    KVLayout,
    PrefetchConfig,
    StorageConfigError,
    StorageError,
    WrongThreadError,
)
from hicache_async.storage import FileStorage, MemoryStorage, Outcome, PageMeta, open_storage
from hicache_async.storage._base import BackendBase
from hicache_async.storage._manifest import chain_entry
from hicache_async.testing import KVGenerator, serve

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)
NS = b"fork-test-space!"
# A bound on the child, so that one stuck for ever fails the test instead of hanging it.
CHILD_BOUND_S = 60.0


def _in_child(body: Callable[[], str]) -> str:
    """Fork; the child runs `body()` and reports what it returns (or what it raised), then
    leaves with `os._exit`. The parent's answer is the report."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        report = "child: no report"
        try:
            os.close(read_fd)
            report = body()
        except BaseException:
            report = traceback.format_exc()
        finally:
            with contextlib.suppress(BaseException):
                os.write(write_fd, report.encode()[:4000])
                sys.stdout.flush()
            os._exit(0)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], CHILD_BOUND_S)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            return "child stuck"
        chunks = []
        while chunk := os.read(read_fd, 4096):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)


def _pages(keys: list[bytes]) -> list[list[memoryview]]:
    return [[memoryview(bytearray(key[:1] * 4096))] for key in keys]


def _metas(keys: list[bytes]) -> list[PageMeta]:
    return [PageMeta(key=k, namespace=NS, num_tokens=PAGE, priority=0) for k in keys]


async def _get(storage: BackendBase, keys: list[bytes]) -> list[Outcome]:
    buffers = [[memoryview(bytearray(4096))] for _ in keys]
    outcomes: list[Outcome] = await storage.get(keys, buffers, namespace=NS)  # type: ignore[attr-defined]
    for key, outcome, buffer in zip(keys, outcomes, buffers, strict=True):
        if outcome is Outcome.OK:
            assert bytes(buffer[0]) == key[:1] * 4096
    return outcomes


def _shared_store(kind: str, prefix: str, request: pytest.FixtureRequest) -> BackendBase:
    """A Redis or Mooncake store of the session's server under a prefix of its own. A
    Mooncake client's child leaves through `os._exit` (`_in_child`): Mooncake's own exit
    handler crashes a forked child."""
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        return cast(BackendBase, open_storage(f"{url}?prefix={prefix}{os.urandom(8).hex()}"))
    pytest.importorskip("mooncake")
    url = request.getfixturevalue("mooncake_url")
    small = "segment_size=512MiB&buffer_size=16MiB&staging_size=8MiB"
    return cast(BackendBase, open_storage(f"{url}&{small}&prefix={prefix}{os.urandom(8).hex()}"))


@pytest.mark.parametrize("kind", ["file", "memory", "redis", "mooncake"])
def test_a_store_opened_before_a_fork_refuses_the_child_and_serves_the_parent(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    # The child's calls would wait for ever for job threads that stayed in the parent
    # (file), or send commands down the parent's connections from another loop (redis).
    root = tmp_path / "s"
    storage: BackendBase
    if kind == "file":
        storage = FileStorage(root)
    elif kind == "memory":
        storage = MemoryStorage()
    else:
        storage = _shared_store(kind, "fork", request)
    keys = [os.urandom(32) for _ in range(4)]
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(storage.__aenter__())
        put = storage.put(keys, _pages(keys), _metas(keys))  # type: ignore[attr-defined]
        assert loop.run_until_complete(put) == [Outcome.OK] * 4

        def child() -> str:
            async def use() -> str:
                # Its job threads stayed in the parent: a job would wait for ever.
                with pytest.raises(StorageError, match="forked"):
                    await _get(storage, keys)
                with pytest.raises(StorageError, match="forked"):
                    await storage.delete(keys)  # type: ignore[attr-defined]
                await storage.close()  # drops the child's copies, nothing of the parent's
                return "refused"

            return asyncio.run(use())

        assert _in_child(child) == "refused"
        assert loop.run_until_complete(_get(storage, keys)) == [Outcome.OK] * 4
        more = [os.urandom(32) for _ in range(2)]
        put = storage.put(more, _pages(more), _metas(more))  # type: ignore[attr-defined]
        assert loop.run_until_complete(put) == [Outcome.OK] * 2
        loop.run_until_complete(storage.close())
    finally:
        loop.close()
    if kind == "file":

        async def reopened() -> list[Outcome]:
            async with FileStorage(root) as again:
                return await _get(again, keys + more)

        assert asyncio.run(reopened()) == [Outcome.OK] * 6


@pytest.mark.parametrize("kind", ["file", "memory", "redis", "mooncake"])
def test_a_manifest_obtained_before_a_fork_refuses_the_child_and_serves_the_parent(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    # Its store is refused in the child: the manifest, which shares the store's root lock
    # file, connections or memory, must not go on there as if it were the parent's. An
    # empty append sends nothing through the store: Mooncake's went unrefused.
    storage: BackendBase
    if kind == "file":
        storage = FileStorage(tmp_path / "s")
    elif kind == "memory":
        storage = MemoryStorage()
    else:
        storage = _shared_store(kind, "forkm", request)
    first = chain_entry(NS, [os.urandom(32)], PAGE, 0, 1.0)
    second = chain_entry(NS, [os.urandom(32)], PAGE, 0, 2.0)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(storage.__aenter__())
        manifest = storage.manifest()  # type: ignore[attr-defined]
        loop.run_until_complete(manifest.append([first]))

        def child() -> str:
            async def use() -> str:
                with pytest.raises(StorageError, match="forked"):
                    await manifest.append([second])
                with pytest.raises(StorageError, match="forked"):
                    await manifest.append([])
                with pytest.raises(StorageError, match="forked"):
                    await manifest.read(namespace="not a namespace")
                with pytest.raises(StorageError, match="forked"):
                    await manifest.read()
                with pytest.raises(StorageError, match="forked"):
                    await manifest.compact()
                await storage.close()
                return "refused"

            return asyncio.run(use())

        report = _in_child(child)
        assert report == "refused", report
        loop.run_until_complete(manifest.append([second]))
        loop.run_until_complete(manifest.compact())
        read = loop.run_until_complete(manifest.read())
        assert {e.chain_id for e in read.entries} == {first.chain_id, second.chain_id}
        loop.run_until_complete(storage.close())
    finally:
        loop.close()


@pytest.mark.parametrize("kind", ["file", "memory", "redis", "mooncake"])
def test_a_manifest_obtained_in_the_child_of_a_store_opened_before_the_fork_is_refused(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    # The store refuses the child; a file manifest taken from it there went by the root's path
    # and appended to, read and compacted the parent's root, and a memory one worked on. The
    # calls that send nothing (an empty append, a read of a malformed namespace) went through
    # unrefused on file and Redis manifests made there.
    storage: BackendBase
    if kind == "file":
        storage = FileStorage(tmp_path / "s")
    elif kind == "memory":
        storage = MemoryStorage()
    else:
        storage = _shared_store(kind, "forkc", request)
    entry = chain_entry(NS, [os.urandom(32)], PAGE, 0, 1.0)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(storage.__aenter__())

        def child() -> str:
            async def use() -> str:
                manifest = storage.manifest()  # type: ignore[attr-defined]
                with pytest.raises(StorageError, match="forked"):
                    await manifest.append([])
                with pytest.raises(StorageError, match="forked"):
                    await manifest.read(namespace="not a namespace")
                with pytest.raises(StorageError, match="forked"):
                    await manifest.append([entry])
                with pytest.raises(StorageError, match="forked"):
                    await manifest.read()
                with pytest.raises(StorageError, match="forked"):
                    await manifest.compact()
                await storage.close()
                return "refused"

            return asyncio.run(use())

        report = _in_child(child)
        assert report == "refused", report
        manifest = storage.manifest()  # type: ignore[attr-defined]
        assert loop.run_until_complete(manifest.read()).entries == []
        loop.run_until_complete(manifest.append([entry]))
        assert [e.chain_id for e in loop.run_until_complete(manifest.read()).entries] == [
            entry.chain_id
        ]
        loop.run_until_complete(storage.close())
    finally:
        loop.close()


def test_a_cache_entered_before_a_fork_refuses_a_child_running_the_parent_s_loop(
    tmp_path: Path,
) -> None:
    # A preloaded app's loop object is the child's too: only the process tells them apart.
    config = CacheConfig(
        layout=LAYOUT,
        page_size=PAGE,
        device_pages=16,
        host_pages=32,
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
    )
    generator = KVGenerator(LAYOUT, PAGE)
    prompt = np.arange(6 * PAGE)
    root = tmp_path / "s"
    loop = asyncio.new_event_loop()
    try:
        cache = HiCache(config, storage=f"file://{root}")
        loop.run_until_complete(cache.__aenter__())
        loop.run_until_complete(serve(cache, prompt, generator))
        loop.run_until_complete(cache.drain())

        def child() -> str:
            with pytest.raises(WrongThreadError, match="forked"):
                cache.match(prompt)
            with pytest.raises(WrongThreadError, match="forked"):
                loop.run_until_complete(cache.__aexit__(None, None, None))
            return "refused"

        assert _in_child(child) == "refused"
        other = np.arange(100, 100 + 5 * PAGE)
        loop.run_until_complete(serve(cache, other, generator))
        loop.run_until_complete(cache.__aexit__(None, None, None))

        async def reopened() -> None:
            async with HiCache(config, storage=f"file://{root}") as again:
                for tokens in (prompt, other):
                    served = await serve(again, tokens, generator, check="all")
                    # Every page read back and checked against the generator.
                    assert served.storage_tokens == len(tokens)
                    assert served.checked_pages == len(tokens) // PAGE

        loop.run_until_complete(reopened())
    finally:
        loop.close()


def test_two_children_forked_from_one_parent_cannot_both_hold_a_private_root(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    first_holds, first_may_go = os.pipe(), os.pipe()
    # The first child holds the root open until told; the second, forked meanwhile, is
    # refused, and so is the parent; once the first has closed it, the parent opens it.
    pid = os.fork()
    if pid == 0:
        try:

            async def hold() -> None:
                async with FileStorage(root):
                    os.write(first_holds[1], b"h")
                    os.read(first_may_go[0], 1)

            asyncio.run(hold())
        finally:
            os._exit(0)
    try:
        ready, _, _ = select.select([first_holds[0]], [], [], CHILD_BOUND_S)
        assert ready, "the first child never opened the root"
        assert os.read(first_holds[0], 1) == b"h"

        def second() -> str:
            async def open_it() -> str:
                try:
                    async with FileStorage(root):
                        return "opened a root another process holds"
                except StorageConfigError as exc:
                    return "refused" if "in use by another instance" in str(exc) else str(exc)

            return asyncio.run(open_it())

        assert _in_child(second) == "refused"
    finally:
        os.write(first_may_go[1], b"g")
        os.waitpid(pid, 0)
        for fd in (*first_holds, *first_may_go):
            os.close(fd)

    async def reopened() -> int:
        async with FileStorage(root) as storage:
            return storage.stats().pages

    assert asyncio.run(reopened()) == 0


def test_a_forked_child_s_normal_exit_leaves_the_parent_s_test_server_running(
    tmp_path: Path,
) -> None:
    # The exit hook that stops the servers a process started runs in a child that leaves
    # through sys.exit too; there it must leave the parent's alone (their directories too).
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys\n"
        "from hicache_async.testing import RedisServer\n"
        "server = RedisServer().start()\n"
        "directory = server._tmpdir\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "import redis\n"
        "answers = redis.Redis.from_url(server.url).ping()\n"
        "print(os.path.isdir(directory), answers)\n"
        "server.stop()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
