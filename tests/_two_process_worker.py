"""One HiCache instance of tests/test_two_processes.py, run in a spawned process.

The parent sends commands `(label, phase, url, seed)` on this process's queue (None ends it)
and gets `(role, label, "ok" | "error", payload)` back on the results queue. Every phase
builds a new HiCache, so an instance always starts cold; `serve()` checks every page it
reads against the KV generator, and a failed check is counted as a mismatch.
"""

from __future__ import annotations

import asyncio
import queue
import traceback
from collections.abc import Callable, Coroutine
from multiprocessing.queues import Queue
from typing import Any

import numpy as np

from hicache_async import CacheConfig, HiCache
from hicache_async.testing import KVGenerator, serve

PAGE = 4
PROMPTS = 12
#: How long a phase waits for its peer before giving up (the parent's deadline is shorter
#: in total, so this only matters if the parent died).
PEER_TIMEOUT_S = 60.0

Payload = dict[str, Any]


def config(**overrides: Any) -> CacheConfig:
    base: dict[str, Any] = {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "page_size": PAGE,
        "device_pages": 64,
        "host_pages": 512,
        "model_id": "two-processes",
        "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
        "backup": {"retry_backoff_s": 0.001},
    }
    base.update(overrides)
    return CacheConfig.from_dict(base)


def prompts(seed: int) -> list[np.ndarray[Any, Any]]:
    """`PROMPTS` prompts of 3-12 whole pages plus a 2-token tail; prompts of a seed share a
    two-page system prompt, so chains branch as real traffic does."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 50_000, size=2 * PAGE)
    return [
        np.concatenate([system, rng.integers(0, 50_000, size=int(rng.integers(1, 10)) * PAGE + 2)])
        for _ in range(PROMPTS)
    ]


def full_tokens(prompt: np.ndarray[Any, Any]) -> int:
    return len(prompt) // PAGE * PAGE


def generator() -> KVGenerator:
    return KVGenerator(config().layout, PAGE, seed=9)


class _Tally:
    def __init__(self) -> None:
        self.device = self.host = self.storage = self.computed = 0
        self.checked = self.mismatches = self.served = 0

    async def serve(self, cache: HiCache, prompt: np.ndarray[Any, Any]) -> None:
        try:
            served = await serve(cache, prompt, generator(), check="all")
        except AssertionError:
            self.mismatches += 1
            return
        self.served += 1
        self.device += served.device_tokens
        self.host += served.host_tokens
        self.storage += served.storage_tokens
        self.computed += served.computed_tokens
        self.checked += served.checked_pages

    def payload(self, cache: HiCache) -> Payload:
        status = cache.storage_status()
        backup = status.backup
        return {
            "device_tokens": self.device,
            "host_tokens": self.host,
            "storage_tokens": self.storage,
            "computed_tokens": self.computed,
            "checked_pages": self.checked,
            "mismatches": self.mismatches,
            "served": self.served,
            "written_pages": backup.written_pages if backup else 0,
            "manifest_entries": backup.manifest_entries if backup else 0,
        }


async def fill(url: str, seed: int, peer: Queue[Any], own: Queue[Any]) -> Payload:
    """Serve the prompts from an empty cache and back everything up."""
    tally = _Tally()
    async with HiCache(config(), storage=url) as cache:
        for prompt in prompts(seed):
            await tally.serve(cache, prompt)
        await cache.drain()
        return tally.payload(cache)


async def warm(url: str, seed: int, peer: Queue[Any], own: Queue[Any]) -> Payload:
    """Start cold with warmup on, wait for it, then serve the same prompts."""
    tally = _Tally()
    async with HiCache(config(warmup={"enabled": True, "ratio": 1.0}), storage=url) as cache:
        result = await cache.wait_warmup()
        for prompt in prompts(seed):
            await tally.serve(cache, prompt)
        await cache.drain()
        payload = tally.payload(cache)
        payload["expected_tokens"] = sum(full_tokens(p) for p in prompts(seed))
        payload["warmup_status"] = result.status.value if result else None
        payload["warmup_pages"] = result.pages_loaded if result else 0
        payload["warmup_entries"] = result.entries_read if result else 0
        return payload


async def writer(url: str, seed: int, peer: Queue[Any], own: Queue[Any]) -> Payload:
    """Serve prompt after prompt; once one is backed up, tell the peer, and go on to the
    next while the peer reads it. Stays open until the peer has read the last one."""
    tally = _Tally()
    async with HiCache(config(), storage=url) as cache:
        pending: int | None = None
        for index, prompt in enumerate(prompts(seed)):
            await tally.serve(cache, prompt)  # the peer is reading `pending` meanwhile
            await cache.drain()
            if pending is not None:
                await _expect(own, ("read", pending))
            peer.put(index)
            pending = index
        peer.put(None)
        await _expect(own, ("read", pending))
        return tally.payload(cache)


async def reader(url: str, seed: int, peer: Queue[Any], own: Queue[Any]) -> Payload:
    """A second live instance: prefetch each prompt the writer announces, and serve it."""
    tally = _Tally()
    batch = prompts(seed)
    async with HiCache(config(), storage=url) as cache:
        while (index := await _receive(own)) is not None:
            await tally.serve(cache, batch[index])
            peer.put(("read", index))
        await cache.drain()
        payload = tally.payload(cache)
        payload["expected_tokens"] = sum(full_tokens(p) for p in batch)
        return payload


async def _receive(own: Queue[Any]) -> Any:
    try:
        return await asyncio.to_thread(own.get, True, PEER_TIMEOUT_S)
    except queue.Empty:
        raise TimeoutError("the peer went quiet") from None


async def _expect(own: Queue[Any], message: tuple[str, int | None]) -> None:
    got = await _receive(own)
    if got != message:
        raise RuntimeError(f"expected {message} from the peer, got {got!r}")


Phase = Callable[[str, int, "Queue[Any]", "Queue[Any]"], Coroutine[Any, Any, Payload]]
PHASES: dict[str, Phase] = {
    "fill": fill,
    "warm": warm,
    "writer": writer,
    "reader": reader,
}


def main(
    role: str, commands: Queue[Any], results: Queue[Any], peer: Queue[Any], own: Queue[Any]
) -> None:
    """Run commands until None (or until the parent stops sending any)."""
    while True:
        try:
            command = commands.get(timeout=300)
        except queue.Empty:
            return
        if command is None:
            return
        label, phase, url, seed = command
        try:
            payload = asyncio.run(PHASES[phase](url, seed, peer, own))
        except BaseException:
            results.put((role, label, "error", traceback.format_exc()))
        else:
            results.put((role, label, "ok", payload))
