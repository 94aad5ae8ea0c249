"""The child process of the crash-consistency suite: writes pages to file storage until killed.

    python _child.py MODE ROOT LOG SEED FSYNC IO_THREADS

MODE `storage` feeds a FileStorage pages from the KV generator, in batches of random size;
MODE `cache` runs a real HiCache that serves prompts and backs them up to a FileStorage. Either
way, once the backend has acknowledged a page (its put returned OK) the child appends
`ack <key hex>` to LOG and flushes and fsyncs it, so a line in the log proves the ack came
before the kill. Before it starts on prompt i it logs `prompt i`, so the parent knows whose
pages can be on disk. It prints `imported`, waits for `go` on stdin before it touches ROOT,
prints `ready` once the storage is open, and stops by itself after `_DEADLINE_S` if nobody
kills it.

The parent imports this module for the configuration and the prompts, so both sides agree on
every page's bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
import structlog

from hicache_async import CacheConfig, HiCache, Namespace, page_keys
from hicache_async.storage import (
    FileStorage,
    Outcome,
    PageBuffer,
    PageMeta,
    StorageBackend,
    StorageCapabilities,
    StorageStats,
)
from hicache_async.testing import KVGenerator, serve

__all__ = ["PAGE", "crash_config", "crash_prompt", "namespace"]

PAGE = 16
_DEADLINE_S = 60.0
_SYSTEMS = 4


def crash_config() -> CacheConfig:
    """Pages of 16 tokens x 4 layers x 4 heads x 32 wide, float16: 32 KiB each, so a write
    takes long enough for kills to land in the middle of one."""
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 4, "num_kv_heads": 4, "head_dim": 32},
            "page_size": PAGE,
            "device_pages": 32,
            "host_pages": 48,
            "model_id": "crash-consistency",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
            "backup": {"batch_pages": 8},
        }
    )


def namespace() -> Namespace:
    return Namespace.from_config(crash_config())


def crash_prompt(seed: int, index: int) -> np.ndarray[Any, Any]:
    """Prompt `index` of child `seed`: one of a few system prompts shared by every child (so
    later children find earlier children's pages), then a turn of its own."""
    system = random.Random(index % _SYSTEMS)
    head = [system.randrange(30_000) for _ in range(2 * PAGE)]
    rng = random.Random(seed * 1_000_003 + index)
    turn = [rng.randrange(30_000) for _ in range(rng.randrange(PAGE, 9 * PAGE))]
    return np.array(head + turn, dtype=np.int64)


class _AckLog:
    """The append-only log of acknowledged keys (blocking writes: this is a test child)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, line: str, *, durable: bool) -> None:
        os.write(self._fd, line.encode() + b"\n")
        if durable:
            os.fsync(self._fd)


class _Acknowledging:
    """Forwards to a FileStorage and logs every key whose put it acknowledged."""

    def __init__(self, inner: FileStorage, log: _AckLog) -> None:
        self._inner = inner
        self._log = log

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def capabilities(self) -> StorageCapabilities:
        return self._inner.capabilities

    async def __aenter__(self) -> _Acknowledging:
        await self._inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._inner.close()

    async def exists(self, keys: Sequence[bytes]) -> int:
        return await self._inner.exists(keys)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        return await self._inner.get(keys, into, namespace=namespace)

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        outcomes = await self._inner.put(keys, pages, metas)
        for key, outcome in zip(keys, outcomes, strict=True):
            if outcome is Outcome.OK:
                self._log.write(f"ack {key.hex()}", durable=True)
        return outcomes

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self._inner.delete(keys)

    def stats(self) -> StorageStats:
        return self._inner.stats()

    async def close(self) -> None:
        await self._inner.close()


async def _write_storage(storage: FileStorage, log: _AckLog, seed: int) -> None:
    config = crash_config()
    generator = KVGenerator(config.layout, PAGE)
    ns = namespace()
    rng = random.Random(seed)
    async with storage:
        print("ready", flush=True)
        index = 0
        while True:
            log.write(f"prompt {index}", durable=False)
            tokens = crash_prompt(seed, index)
            keys = page_keys(tokens, PAGE, ns.seed)
            position = 0
            while position < len(keys):
                batch = range(position, min(position + rng.randint(1, 8), len(keys)))
                pages: list[PageBuffer] = [
                    [memoryview(generator.page_bytes(tokens, j))] for j in batch
                ]
                metas = [PageMeta(keys[j], ns.fingerprint, PAGE) for j in batch]
                outcomes = await storage.put([keys[j] for j in batch], pages, metas)
                for j, outcome in zip(batch, outcomes, strict=True):
                    if outcome is Outcome.OK:
                        log.write(f"ack {keys[j].hex()}", durable=True)
                position = batch.stop
            index += 1


async def _serve_cache(storage: FileStorage, log: _AckLog, seed: int) -> None:
    config = crash_config()
    generator = KVGenerator(config.layout, PAGE)
    backend: StorageBackend = _Acknowledging(storage, log)
    async with HiCache(config, storage=backend) as cache:
        print("ready", flush=True)
        index = 0
        while True:
            log.write(f"prompt {index}", durable=False)
            await serve(cache, crash_prompt(seed, index), generator, request_id=f"{seed}.{index}")
            index += 1


async def _main(argv: list[str]) -> None:
    mode, root, log_path, seed, fsync, threads = argv
    # stdout carries only `ready`; the library's events go to stderr.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    log = _AckLog(log_path)
    storage = FileStorage(root, fsync=fsync, io_threads=int(threads))  # type: ignore[arg-type]
    run = _write_storage if mode == "storage" else _serve_cache
    try:
        await asyncio.wait_for(run(storage, log, int(seed)), _DEADLINE_S)
    except TimeoutError:
        print("deadline reached without a kill", file=sys.stderr, flush=True)


if __name__ == "__main__":
    # Imports take seconds; the parent starts the next child while it checks the last kill,
    # and says `go` once the root is free again.
    print("imported", flush=True)
    if sys.stdin.readline().strip() == "go":
        asyncio.run(_main(sys.argv[1:]))
