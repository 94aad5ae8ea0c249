"""`hicache-async bench trace`: the packaged chat trace replayed through a real `HiCache` on a
virtual clock, for several host and storage sizes.

The tree, the pools, the copy engine, the prefetch and backup workers and the storage backend
(`memory://`) are the real ones, with tiny pages (one layer, one head, head dim 1, uint8:
`2 * page_size` bytes a page), so the whole trace fits in a few hundred MiB. Time is simulated
from a model profile (`_sim.PROFILES`): a request arrives at its (scaled) trace timestamp and
starts a storage prefetch, whose read takes its pages' real-model bytes over the storage
bandwidth (one storage channel, first come first served); it waits for a free prefill slot and
for its prefetch; then it loads its host pages (real-model bytes over the host-to-device
bandwidth) and computes its uncached tokens. TTFT is finish minus arrival. Real cache calls
happen in virtual-time order, so the cache sees the requests interleave as they would.

Replays are independent of wall time (the clock is virtual), so `--jobs` runs them side by
side in worker processes with identical results. Hit rates are shares of all prompt tokens,
per tier where the tokens came from, against the upper bound an unlimited page-granular cache
reaches on the same requests. TTFT percentiles compare with the same replay without any cache.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import multiprocessing
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import anyio
import msgspec
import numpy as np

from .._config import CacheConfig
from .._errors import OutOfPagesError
from .._trace import BLOCK_TOKENS, TraceRequest, load_trace
from ..cli._args import ascii_only, positive_float, positive_int
from ..storage import HEADER_NBYTES, MemoryStorage
from ._records import Record
from ._sim import PROFILES, ModelProfile, NoCacheEngine, percentile, simulate, upper_bound

__all__ = [
    "ReplayOutcome",
    "Scenario",
    "add_arguments",
    "describe",
    "prepare",
    "prompt_tokens",
    "replay_scenario",
    "run",
]

describe = "chat trace on a virtual clock: hit rate per tier vs the unlimited bound, TTFT, traffic"

_UNBOUNDED = "unbounded"
_OFF = "off"
# Storage capacity for "unbounded": more than the trace's every page (and no eviction).
_UNBOUNDED_BYTES = 1 << 40
_STUCK_S = 1.0

_T = TypeVar("_T")


class Scenario(msgspec.Struct, frozen=True):
    """One replay: host pool size (x device pool) and storage size (x device pool, or off or
    unbounded)."""

    host_ratio: float
    storage: str

    @property
    def label(self) -> str:
        """The scenario's part of record names, e.g. `host2x.storage-unbounded`."""
        return f"host{_ratio_text(self.host_ratio)}x.storage-{self.storage}"


def _ratio_text(value: float) -> str:
    return f"{value:g}"


def _parse_ratios(text: str) -> list[float]:
    ascii_only(text, "a list of numbers")
    try:
        values = [float(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"ratios must be positive numbers, got {text!r}")
    return values


def _parse_storages(text: str) -> list[str]:
    ascii_only(text, "a list of storage sizes")
    sizes = [part.strip() for part in text.split(",") if part.strip()]
    for size in sizes:
        if size in (_OFF, _UNBOUNDED):
            continue
        try:
            value = float(size.removesuffix("x"))
        except ValueError:
            value = -1.0
        if not size.endswith("x") or not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(
                f"storage sizes are 'off', 'unbounded' or a multiple of the device pool like "
                f"'32x'; got {size!r}"
            )
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one storage size")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hicache-async bench trace`."""
    parser.add_argument(
        "--requests", type=positive_int, default=None, help="requests from the trace (default: all)"
    )
    parser.add_argument("--trace", default=None, help="a trace file (default: the packaged one)")
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default=next(iter(PROFILES)), help="model profile"
    )
    parser.add_argument(
        "--page-size",
        type=positive_int,
        default=BLOCK_TOKENS,
        help="tokens per page (default 512, the trace's block: it knows reuse per block only)",
    )
    parser.add_argument(
        "--device-tokens",
        type=positive_int,
        default=None,
        help="device pool in tokens (default: the profile's KV pool)",
    )
    parser.add_argument(
        "--host-ratios",
        type=_parse_ratios,
        default=[0.5, 2.0, 8.0],
        help="host pool sizes as multiples of the device pool (default 0.5,2,8)",
    )
    parser.add_argument(
        "--storages",
        type=_parse_storages,
        default=[_OFF, "32x", _UNBOUNDED],
        help="storage sizes: off, unbounded or a multiple of the device pool (default "
        "off,32x,unbounded)",
    )
    parser.add_argument(
        "--prefill-slots",
        type=positive_int,
        default=1,
        help="prefills that run at once, each at the profile's full rate (default 1)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=min(4, os.cpu_count() or 1),
        help="replays run side by side in worker processes (default: CPUs, at most 4)",
    )
    parser.add_argument(
        "--time-scale",
        type=positive_float,
        default=3.0,
        help="stretch the trace's arrival times by this factor (default 3: one GPU cannot "
        "prefill the trace's 40k tokens/s as it came)",
    )


_BLOCK_OFFSETS = np.arange(BLOCK_TOKENS, dtype=np.uint32)


def prompt_tokens(request: TraceRequest) -> np.ndarray[Any, Any]:
    """Token ids of a trace prompt: block b is tokens b*512 .. b*512+511, cut to the length.

    Equal block ids give equal tokens and different ids different tokens, as with
    `_trace.request_tokens`, at a fraction of its cost (it seeds a generator per block,
    which dominated the replay).
    """
    ids = np.asarray(request.hash_ids, dtype=np.uint32)
    if ids.size and int(ids.max()) >= 2**32 // BLOCK_TOKENS:
        raise ValueError("block ids must be below 2**23 to map to distinct uint32 tokens")
    tokens = (ids[:, None] * BLOCK_TOKENS + _BLOCK_OFFSETS).reshape(-1)
    return tokens[: request.input_length]


class _Replay:
    """The `_sim.Engine` of a real `HiCache`: real calls, simulated durations."""

    def __init__(
        self,
        cache: Any,
        requests: Sequence[TraceRequest],
        profile: ModelProfile,
        clock: list[float],
    ) -> None:
        self._cache = cache
        self._requests = requests
        self._profile = profile
        self._clock = clock
        self._storage = cache.storage_status().attached
        self._storage_free = 0.0
        self._tokens: dict[int, np.ndarray[Any, Any]] = {}
        self._prefetched: dict[int, int] = {}
        self._running: dict[int, Any] = {}
        self.device = self.host = self.from_storage = self.computed = 0
        self.stuck_prefetches = 0
        self.allocation_errors = 0

    def _tokens_of(self, index: int) -> np.ndarray[Any, Any]:
        tokens = self._tokens.get(index)
        if tokens is None:
            tokens = self._tokens[index] = prompt_tokens(self._requests[index])
        return tokens

    async def arrive(self, index: int, now: float) -> float:
        self._clock[0] = now
        if not self._storage:
            return now
        handle = await self._cache.start_prefetch(
            self._tokens_of(index), request_id=str(index), policy="wait_complete"
        )
        # A prefetch of tiny pages from memory takes microseconds; one that takes seconds is
        # stuck (waiting on a read that will never land): cancel it, count it, go on.
        with anyio.move_on_after(_STUCK_S):
            await handle.wait()
        if not handle.done():
            handle.cancel()
            self.stuck_prefetches += 1
        result = await handle.wait()
        self._prefetched[index] = result.storage_tokens
        if not result.storage_tokens:
            return now
        begin = max(now, self._storage_free)
        self._storage_free = begin + self._profile.storage_read_s(result.storage_tokens)
        return self._storage_free

    async def start(self, index: int, now: float) -> float | None:
        self._clock[0] = now
        tokens = self._tokens_of(index)
        request = self._cache.request(tokens, request_id=str(index))
        device = request.device_tokens
        try:
            load = await self._with_retry(request.load)
            await load
            await self._with_retry(lambda: request.allocate(len(tokens) - request.cached_tokens))
        except OutOfPagesError:
            request.release()  # running prefills hold the pool: retry after one finishes
            return None
        host = request.cached_tokens - device  # what the load brought (none if it failed)
        storage = min(self._prefetched.get(index, 0), host)
        computed = len(tokens) - device - host
        self.device += device
        self.host += host - storage
        self.from_storage += storage
        self.computed += computed
        self._running[index] = request
        return self._profile.host_load_s(host) + self._profile.compute_s(computed, device + host)

    async def _with_retry(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """`call()`, once more if device allocation failed with ValueError.

        `HiCache._try_alloc_device` can ask the tree to evict a negative number of pages
        (its fallback runs after the first pass already freed enough) and raise; the pages
        that pass freed are back in the pool by then, so a second attempt succeeds. Counted
        in `allocation_errors` so the replay shows it rather than hides it.
        """
        try:
            return await call()
        except ValueError:
            self.allocation_errors += 1
            return await call()

    async def finish(self, index: int, now: float) -> None:
        self._clock[0] = now
        request = self._running.pop(index)
        request.commit()
        request.release()
        del self._tokens[index]
        self._prefetched.pop(index, None)
        # Copies and backups are off the request path: they complete before the next event.
        await self._cache.drain()


def _config(args: argparse.Namespace, device_pages: int, host_pages: int) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"},
            "page_size": args.page_size,
            "device_pages": device_pages,
            "host_pages": host_pages,
            "device": "cpu",
            "model_id": f"bench-trace-{args.profile}",
            "write_policy": "write_through",
            "prefetch": {"policy": "wait_complete"},
        }
    )


class ReplayOutcome(msgspec.Struct, frozen=True):
    """What one replay produced (plain data, so it can come back from a worker process)."""

    scenario: Scenario
    device: int
    host: int
    storage: int
    computed: int
    ttft: list[float]
    attached: bool
    read_pages: int
    written_pages: int
    prefetch_errors: int
    stuck_prefetches: int
    allocation_errors: int
    wall_s: float


async def _replay(
    args: argparse.Namespace,
    scenario: Scenario,
    requests: Sequence[TraceRequest],
    arrivals: Sequence[float],
    device_pages: int,
) -> ReplayOutcome:
    from .._cache import HiCache

    began = time.perf_counter()
    profile = PROFILES[args.profile]
    host_pages = max(1, round(device_pages * scenario.host_ratio))
    config = _config(args, device_pages, host_pages)
    storage: MemoryStorage | None = None
    if scenario.storage != _OFF:
        if scenario.storage == _UNBOUNDED:
            capacity = _UNBOUNDED_BYTES
        else:
            pages = round(device_pages * float(scenario.storage.removesuffix("x")))
            capacity = max(1, pages) * (HEADER_NBYTES + config.page_nbytes)
        storage = MemoryStorage(capacity_bytes=capacity)
    clock = [0.0]
    async with HiCache(config, storage=storage, clock=lambda: clock[0]) as cache:
        replay = _Replay(cache, requests, profile, clock)
        ttft, _ = await simulate(arrivals, replay, slots=args.prefill_slots)
        status = cache.storage_status()
    return ReplayOutcome(
        scenario=scenario,
        device=replay.device,
        host=replay.host,
        storage=replay.from_storage,
        computed=replay.computed,
        ttft=ttft,
        attached=status.attached,
        read_pages=status.prefetch.pages_read if status.prefetch else 0,
        written_pages=status.backup.written_pages if status.backup else 0,
        prefetch_errors=status.prefetch.errors if status.prefetch else 0,
        stuck_prefetches=replay.stuck_prefetches,
        allocation_errors=replay.allocation_errors,
        wall_s=time.perf_counter() - began,
    )


def _configure_logging() -> None:
    """Warnings and up, on stderr: a worker process starts with the library's default logging
    (every level, on stdout, which holds the records' table)."""
    import logging

    from ..cli._logging import configure_logging

    configure_logging(logging.WARNING)


def replay_scenario(
    args: argparse.Namespace, scenario: Scenario, device_pages: int
) -> ReplayOutcome:
    """One replay of the trace (run in a worker process when `--jobs` > 1)."""
    _configure_logging()
    requests = load_trace(args.trace, limit=args.requests)
    arrivals = [r.timestamp / 1000 * args.time_scale for r in requests]
    return asyncio.run(_replay(args, scenario, requests, arrivals, device_pages))


def _outcomes(
    args: argparse.Namespace, scenarios: list[Scenario], device_pages: int
) -> list[ReplayOutcome]:
    """Every scenario's outcome, in order; replays are independent of wall time, so they
    may run side by side."""
    jobs = min(args.jobs, len(scenarios))
    if jobs <= 1:
        return [replay_scenario(args, s, device_pages) for s in scenarios]
    # spawn: the parent has torch and maybe threads loaded, which fork does not copy safely.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [pool.submit(replay_scenario, args, s, device_pages) for s in scenarios]
        return [f.result() for f in futures]


def _scenario_records(
    outcome: ReplayOutcome,
    total_tokens: int,
    bound: float,
    base: tuple[float, float],
    page_bytes: int,
) -> list[Record]:
    prefix = f"trace.{outcome.scenario.label}"
    hits = {
        "device": outcome.device,
        "host": outcome.host,
        "storage": outcome.storage,
        "total": outcome.device + outcome.host + outcome.storage,
    }
    records = [
        Record.compare(f"{prefix}.hit.{tier}", tokens / total_tokens, "fraction", bound)
        for tier, tokens in hits.items()
    ]
    records += [
        Record.compare(f"{prefix}.ttft_p50_s", percentile(outcome.ttft, 50), "s", base[0]),
        Record.compare(f"{prefix}.ttft_p99_s", percentile(outcome.ttft, 99), "s", base[1]),
    ]
    if outcome.attached:
        read, written = outcome.read_pages, outcome.written_pages
        records += [
            Record(f"{prefix}.storage.read_pages", float(read), "pages"),
            Record(f"{prefix}.storage.read_gb", read * page_bytes / 1e9, "GB"),
            Record(f"{prefix}.storage.written_pages", float(written), "pages"),
            Record(f"{prefix}.storage.written_gb", written * page_bytes / 1e9, "GB"),
            Record(f"{prefix}.prefetch.errors", float(outcome.prefetch_errors), "count"),
            Record(f"{prefix}.prefetch.stuck", float(outcome.stuck_prefetches), "count"),
        ]
    records += [
        Record(f"{prefix}.allocation_errors", float(outcome.allocation_errors), "count"),
        Record(f"{prefix}.replay_wall_s", outcome.wall_s, "s"),
    ]
    return records


@functools.lru_cache(maxsize=1)
def _requests(path: str | None, limit: int | None) -> tuple[TraceRequest, ...]:
    # Read once for prepare() and run() alike.
    return tuple(load_trace(path, limit=limit))


def _device_pages(args: argparse.Namespace) -> int:
    tokens: int | None = args.device_tokens
    if tokens is None:
        tokens = PROFILES[args.profile].device_kv_tokens
    page_size: int = args.page_size
    return max(1, tokens // page_size)


def prepare(args: argparse.Namespace) -> None:
    """Check the options against the trace before anything runs: ValueError, or OSError for
    an unreadable trace."""
    for name in ("requests", "page_size", "device_tokens", "prefill_slots", "jobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        # nan or inf arrivals would make every TTFT nan: records of nulls, not figures.
        raise ValueError(f"--time-scale must be a finite number > 0, got {args.time_scale}")
    if BLOCK_TOKENS % args.page_size:
        raise ValueError(f"--page-size must divide {BLOCK_TOKENS}, got {args.page_size}")
    requests = _requests(args.trace, args.requests)
    if not requests:
        raise ValueError(f"the trace {args.trace or '(packaged)'} holds no requests")
    longest = max(r.input_length for r in requests)
    if longest > _device_pages(args) * args.page_size:
        raise ValueError(
            f"the device pool ({_device_pages(args) * args.page_size} tokens) is smaller than "
            f"the longest prompt ({longest} tokens); raise --device-tokens"
        )


def run(args: argparse.Namespace) -> list[Record]:
    """Replay the trace once without a cache, then once per host and storage size."""
    prepare(args)
    profile = PROFILES[args.profile]
    page_size: int = args.page_size
    requests = list(_requests(args.trace, args.requests))
    arrivals = [r.timestamp / 1000 * args.time_scale for r in requests]
    lengths = [r.input_length for r in requests]
    total_tokens = sum(lengths)
    device_pages = _device_pages(args)
    bound = upper_bound(requests, page_size)
    no_cache = NoCacheEngine(profile, lengths)
    base_ttft, _ = asyncio.run(simulate(arrivals, no_cache, slots=args.prefill_slots))
    base = (percentile(base_ttft, 50), percentile(base_ttft, 99))
    records = [
        Record("trace.requests", float(len(requests)), "requests"),
        Record("trace.prompt_tokens", float(total_tokens), "tokens"),
        Record("trace.device_pool_tokens", float(device_pages * page_size), "tokens"),
        Record("trace.bound.block_hit_rate", bound.block_hit_rate, "fraction"),
        Record("trace.bound.token_hit_rate", bound.token_hit_rate, "fraction"),
        Record("trace.nocache.ttft_p50_s", base[0], "s"),
        Record("trace.nocache.ttft_p99_s", base[1], "s"),
    ]
    scenarios = [Scenario(h, s) for h in args.host_ratios for s in args.storages]
    page_bytes = profile.kv_bytes(page_size)
    for outcome in _outcomes(args, scenarios, device_pages):
        records += _scenario_records(outcome, total_tokens, bound.token_hit_rate, base, page_bytes)
    return records
