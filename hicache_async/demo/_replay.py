"""The demo's serving stack: a trace replayed through the tiny model, with and without HiCache.

Two servers run side by side in one process and receive the same requests at the same times
(trace timestamps divided by `time_compression`); each serves at most `concurrency` requests at
once, and a request that arrives when every slot is taken waits, its TTFT (arrival to first
token) including the wait. Each server runs its model work one job at a time on its own worker
thread (`ModelRunner`), as a GPU runs one kernel stream: concurrent requests interleave layer by
layer, and the event loop stays free to drive the cache's copies and storage I/O meanwhile.
Sharing the machine's time this way, rather than running one after the other, means whatever
else the machine is doing slows both alike.

- **baseline**: every prompt is computed from scratch with a contiguous KV; no cache at all.
- **hicache**: a request handler as an engine would write one: await the storage prefetch,
  take a slot, start the request, start the host → device load, allocate pages for the rest,
  then compute layer i as soon as layer i of the cached prefix has landed, commit, release.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import anyio
import msgspec
import numpy as np
import torch

from .._cache import HiCache
from .._config import CacheConfig, PrefetchConfig, PrefetchPolicy, WritePolicy
from .._errors import OutOfPagesError, StorageConfigError, StorageError
from .._keys import Namespace, page_keys
from .._numbers import as_float
from .._trace import BLOCK_TOKENS, TraceRequest, load_trace, request_tokens
from ..storage import default_root, open_storage
from ._model import ContiguousKV, ModelConfig, PagedKV, Prefill, TinyTransformer
from ._report import (
    BytesMoved,
    DemoSummary,
    LogitCheck,
    Progress,
    TierTokenCounts,
    TTFTStats,
)

__all__ = [
    "DEFAULT_STORAGE",
    "DemoOptions",
    "ModelRunner",
    "demo_storage_root",
    "plan_demo",
    "reuse_upper_bound",
    "run_demo",
    "select_requests",
]

_T = TypeVar("_T")

#: `--storage` default: file storage under `demo_storage_root()`.
DEFAULT_STORAGE = "file://"

# An allocation can find every device page locked by requests and prefetches in flight for a
# moment; it waits this long between attempts, this many times, before giving up.
_OUT_OF_PAGES_WAIT_S = 0.02
_OUT_OF_PAGES_ATTEMPTS = 500


class DemoOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What `hicache-async demo` runs. Defaults are the documented default run."""

    #: storage URL; `file://` alone is the dedicated demo root, "none" means no L3.
    storage: str = DEFAULT_STORAGE
    device_pages: int = 384
    host_pages: int = 768
    page_size: int = 64
    write_policy: WritePolicy = "write_through"
    prefetch_policy: PrefetchPolicy = "timeout"
    requests: int = 80
    max_prompt_tokens: int = 4096
    concurrency: int = 4
    #: trace time runs this many times faster than the replay clock.
    time_compression: float = 5.0
    keep_storage: bool = False
    seed: int = 0
    #: torch intra-op threads for each server's model thread; 0 picks half the cores, so the
    #: two servers together use them all.
    threads: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("device_pages", "host_pages", "page_size", "requests", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens <= BLOCK_TOKENS:
            raise ValueError(
                f"max_prompt_tokens must exceed one trace block ({BLOCK_TOKENS} tokens), "
                f"got {self.max_prompt_tokens}"
            )
        if not (math.isfinite(as_float(self.time_compression)) and self.time_compression > 0):
            raise ValueError(
                f"time_compression must be a finite number > 0, got {self.time_compression}"
            )
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if not 0 <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.page_size > self.max_prompt_tokens:
            # Only whole pages are cached, and no prompt fills a page longer than the longest.
            raise ValueError(
                f"page_size ({self.page_size}) must not exceed max_prompt_tokens "
                f"({self.max_prompt_tokens}): no prompt would fill a page, so none is cached"
            )
        needed = self.concurrency * math.ceil(self.max_prompt_tokens / self.page_size)
        if needed > self.device_pages:
            raise ValueError(
                f"{self.concurrency} concurrent prompts of up to {self.max_prompt_tokens} tokens "
                f"need {needed} device pages of {self.page_size} tokens; "
                f"device_pages is {self.device_pages}"
            )

    @property
    def storage_url(self) -> str | None:
        """The storage URL to open, or None for no L3."""
        if self.storage.strip().lower() == "none":
            return None
        if self.storage.strip() == DEFAULT_STORAGE:
            return "file://" + quote(str(demo_storage_root()))
        return self.storage.strip()


def demo_storage_root() -> Path:
    """The demo's own file storage root: `demo` under the default file storage root."""
    return default_root() / "demo"


# -- the subset ---------------------------------------------------------------------------


def _conversation(request: TraceRequest) -> tuple[int, int]:
    # Every request of this trace starts with the same block (a shared system prompt), so a
    # conversation is named by its first two blocks.
    return (request.hash_ids[0], request.hash_ids[1])


def select_requests(
    trace: Sequence[TraceRequest], count: int, max_prompt_tokens: int
) -> list[TraceRequest]:
    """The multi-turn part of the trace: the first `count` requests (in arrival order) whose
    prompt has at most `max_prompt_tokens` tokens and whose conversation has at least two such
    turns in the trace."""
    fits = [r for r in trace if len(r.hash_ids) >= 2 and 0 < r.input_length <= max_prompt_tokens]
    turns: dict[tuple[int, int], int] = {}
    for request in fits:
        key = _conversation(request)
        turns[key] = turns.get(key, 0) + 1
    return [r for r in fits if turns[_conversation(r)] >= 2][:count]


def reuse_upper_bound(requests: Sequence[TraceRequest], *, page_size: int = 1) -> int:
    """Prompt tokens any cache at all could have served, however large, with pages of
    `page_size` tokens.

    A block can be reused when the same block ids up to and including it (the same prefix at
    the same position) appeared in an earlier request of `requests`; it then gives at most as
    many tokens as the earlier copies of it had in whole pages (a cache keeps whole pages
    only). A request reuses the run of such tokens from its start, cut to whole pages and
    short of its last token, which is always computed (its logits are the first token).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    seen: dict[tuple[int, ...], int] = {}
    reusable = 0
    for request in requests:
        length = request.input_length
        kept = length // page_size * page_size  # what this request leaves cached
        matched = 0
        matching = True
        for index in range(len(request.hash_ids)):
            start = index * BLOCK_TOKENS
            here = min(BLOCK_TOKENS, length - start)
            if here <= 0:
                break
            prefix = tuple(request.hash_ids[: index + 1])
            earlier = seen.get(prefix, 0)
            if matching:
                matched += min(here, earlier)
                matching = earlier >= here
            seen[prefix] = max(earlier, min(BLOCK_TOKENS, max(0, kept - start)))
        reusable += min(matched, length - 1) // page_size * page_size
    return reusable


# -- the serving stack --------------------------------------------------------------------


class _Abandoned(Exception):
    """A job whose caller left before it started: it never runs."""


class _Job(Generic[_T]):
    """One call on a model thread, which its caller may leave before or while it runs."""

    def __init__(self, fn: Callable[[], _T]) -> None:
        self._fn = fn
        self._mutex = threading.Lock()
        self._started = self._abandoned = False
        self.finished = threading.Event()  # set once a started call returns
        self.busy_s = 0.0

    def __call__(self) -> _T:
        with self._mutex:
            if self._abandoned:
                raise _Abandoned
            self._started = True
        began = time.perf_counter()
        try:
            return self._fn()
        finally:
            self.busy_s = time.perf_counter() - began
            self.finished.set()

    def abandon(self) -> bool:
        """Make a call that has not started never start; True if it had started."""
        with self._mutex:
            self._abandoned = True
            return self._started


class ModelRunner:
    """Runs model work one job at a time on a worker thread, like a GPU's compute stream."""

    def __init__(self) -> None:
        self._lock = anyio.Lock()
        self.busy_s = 0.0

    async def run(self, fn: Callable[[], _T], *, stop: threading.Event | None = None) -> _T:
        """Run `fn` on the model thread when it is free.

        A cancelled caller (a cancel scope, or the main task cancelled by Ctrl-C) sets `stop`,
        which model work checks between layers and between pieces of a layer, and waits for
        `fn` to return: it may be writing into pool pages that must not be freed under it.
        Only then is the next job started, and the cancellation goes on.
        """
        job = _Job(fn)
        async with self._lock:
            try:
                # Abandoned on cancellation, so that even the event loop's own cancellation of
                # its main task (which no shield holds back) gets here and sets `stop` rather
                # than leaving the thread to run to its end while the process exits.
                return await anyio.to_thread.run_sync(job, abandon_on_cancel=True)
            except anyio.get_cancelled_exc_class():
                if job.abandon():
                    if stop is not None:
                        stop.set()
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(job.finished.wait)
                raise
            finally:
                self.busy_s += job.busy_s


class _Item(msgspec.Struct, frozen=True):
    index: int
    request_id: str
    arrival_s: float
    tokens: Any  # np.ndarray of token ids


class _Served(msgspec.Struct):
    logits: Any  # torch.Tensor [vocab] float32
    device_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: float = 0.0
    finished_s: float = 0.0


async def _baseline(
    model: TinyTransformer, runner: ModelRunner, slots: anyio.Semaphore, item: _Item
) -> _Served:
    """Compute the whole prompt with a contiguous KV."""
    async with slots:
        kv = ContiguousKV(model.config.num_layers, model.config.kv_torch_dtype)
        prefill = Prefill(model, item.tokens, 0, kv)
        for layer in range(model.config.num_layers):
            await runner.run(functools.partial(prefill.run_layer, layer), stop=prefill.stop)
        logits = await runner.run(prefill.logits)
    return _Served(logits=logits, computed_tokens=len(item.tokens))


async def _cached(
    cache: HiCache,
    model: TinyTransformer,
    runner: ModelRunner,
    slots: anyio.Semaphore,
    item: _Item,
) -> _Served:
    """Serve one prompt through the cache, the way an engine's request handler would."""
    tokens = item.tokens
    storage_tokens = 0
    if cache.storage_status().attached:
        # Prefetch on arrival, before waiting for a slot, so storage reads overlap the wait;
        # no further than the request can use (its last token is always computed).
        result = await cache.prefetch(tokens[: len(tokens) - 1], request_id=item.request_id)
        storage_tokens = result.storage_tokens
    async with slots:
        # At least the last token is computed: its logits are the first token.
        limit = len(tokens) - 1
        for _ in range(_OUT_OF_PAGES_ATTEMPTS):
            try:
                served = await _compute_cached(cache, model, runner, item, limit)
            except OutOfPagesError:
                await anyio.sleep(_OUT_OF_PAGES_WAIT_S)
                continue
            if served is None:
                limit = 0  # the host → device copy failed: compute the whole prompt instead
                continue
            break
        else:
            raise OutOfPagesError(f"{item.request_id}: no device pages after many attempts")
    loaded = served.host_tokens
    served.storage_tokens = min(storage_tokens, loaded)
    served.host_tokens = loaded - served.storage_tokens
    return served


async def _compute_cached(
    cache: HiCache, model: TinyTransformer, runner: ModelRunner, item: _Item, limit: int
) -> _Served | None:
    """One attempt; None if loading the host part failed (nothing was committed)."""
    tokens = item.tokens
    with cache.request(tokens, request_id=item.request_id, max_cached_tokens=limit) as req:
        device_tokens = req.device_tokens
        load = await req.load()
        start = req.cached_tokens
        await req.allocate(len(tokens) - start)
        kv = PagedKV(cache.device_pool, req.page_table, start, len(tokens))
        prefill = Prefill(model, tokens, start, kv)
        for layer in range(model.config.num_layers):
            try:
                # Layer i of the cached prefix is on the device: compute layer i while later
                # layers are still being copied.
                await load.layer(layer)
            except Exception:  # a failed copy means recompute, not fail
                return None
            await runner.run(functools.partial(prefill.run_layer, layer), stop=prefill.stop)
        logits = await runner.run(prefill.logits)
        req.commit()
    return _Served(
        logits=logits,
        device_tokens=device_tokens,
        host_tokens=start - device_tokens,
        computed_tokens=len(tokens) - start,
    )


async def _replay(
    items: Sequence[_Item],
    handle: Callable[[_Item], Awaitable[_Served]],
    origin: float,
    on_done: Callable[[], None],
) -> list[_Served]:
    """Start each item at `origin` + its arrival time; TTFT is measured from that arrival."""
    results: list[_Served | None] = [None] * len(items)

    async def one(item: _Item) -> None:
        served = await handle(item)
        now = time.perf_counter()
        served.ttft_s = now - (origin + item.arrival_s)
        served.finished_s = now - origin
        results[item.index] = served
        on_done()

    async with anyio.create_task_group() as tg:
        for item in items:
            delay = origin + item.arrival_s - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            tg.start_soon(one, item)
    done = [r for r in results if r is not None]
    assert len(done) == len(items), "a request finished without a result"
    return done


def _cache_config(options: DemoOptions, model: TinyTransformer) -> CacheConfig:
    return CacheConfig(
        layout=model.config.kv_layout(),
        device_pages=options.device_pages,
        host_pages=options.host_pages,
        page_size=options.page_size,
        write_policy=options.write_policy,
        model_id=model.model_id,
        prefetch=PrefetchConfig(policy=options.prefetch_policy),
    )


async def _check_storage(
    url: str, config: CacheConfig, items: Sequence[_Item], *, forget: bool
) -> None:
    """Reach the storage before the replay: with `forget`, delete the pages the demo would
    write (so every run starts cold; only this model's namespace is touched), else look one
    up. A store that cannot be reached would turn the replay into one without L3, so it is
    refused here, as StorageConfigError, rather than logged on every request."""
    try:
        await _forget_pages(url, config, items, probe_only=not forget)
    except (StorageError, OSError) as exc:
        # The backend's own message names it with any password masked; the URL may hold one.
        raise StorageConfigError(f"the demo's storage cannot be used: {exc}") from exc


async def _forget_pages(
    url: str, config: CacheConfig, items: Sequence[_Item], *, probe_only: bool = False
) -> None:
    """Delete the pages the demo would write from a backend it does not own (`probe_only`:
    look the first up instead)."""
    namespace = Namespace.from_config(config)
    keys = sorted(
        {
            key
            for item in items
            for key in namespace.storage_keys(
                page_keys(item.tokens, config.page_size, namespace.seed)
            )
        }
    )
    async with open_storage(url) as backend:
        if probe_only:
            await backend.exists(keys[:1])
            return
        batch = max(1, backend.capabilities.max_batch_pages)
        for begin in range(0, len(keys), batch):
            await backend.delete(keys[begin : begin + batch])


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def _ratio(before: float, after: float) -> float:
    return before / after if after > 0 else 0.0


def _ttft(served: Sequence[_Served]) -> TTFTStats:
    values = [s.ttft_s for s in served]
    return TTFTStats(
        p50_s=_percentile(values, 50),
        p99_s=_percentile(values, 99),
        mean_s=float(np.mean(values)) if values else 0.0,
    )


async def _run(
    options: DemoOptions,
    requests: Sequence[TraceRequest],
    model: TinyTransformer,
    progress: Progress,
) -> DemoSummary:
    began = time.perf_counter()
    first = requests[0].timestamp if requests else 0
    items = [
        _Item(
            index=i,
            request_id=f"trace-{i}",
            arrival_s=(r.timestamp - first) / 1000.0 / options.time_compression,
            tokens=request_tokens(r),
        )
        for i, r in enumerate(requests)
    ]
    config = _cache_config(options, model)
    url = options.storage_url
    if url is not None and options.storage != DEFAULT_STORAGE:
        # The default root was emptied by run_demo; its own store needs no check.
        await _check_storage(url, config, items, forget=not options.keep_storage)

    baseline_runner, cached_runner = ModelRunner(), ModelRunner()
    # Warm the kernels up so neither server pays for first-call setup.
    warm = np.arange(2 * options.page_size, dtype=np.int64) % model.config.vocab_size
    stop = threading.Event()
    await ModelRunner().run(functools.partial(model.prefill_logits, warm, stop=stop), stop=stop)

    baseline: list[_Served] = []
    cached: list[_Served] = []
    async with HiCache(config, storage=url) as cache:
        opened = cache.storage_status().storage
        stored_before = opened.pages if opened is not None else 0
        progress.draw()
        origin = time.perf_counter() + 0.05  # both servers see the first arrival at once

        async def serve_baseline() -> None:
            slots = anyio.Semaphore(options.concurrency)
            handle = functools.partial(_baseline, model, baseline_runner, slots)
            done = functools.partial(progress.advance, "baseline")
            baseline.extend(await _replay(items, handle, origin, done))

        async def serve_cached() -> None:
            slots = anyio.Semaphore(options.concurrency)
            handle = functools.partial(_cached, cache, model, cached_runner, slots)
            done = functools.partial(progress.advance, "hicache")
            cached.extend(await _replay(items, handle, origin, done))

        # Two servers side by side on the same arrivals, each with its own model thread, so
        # whatever else the machine is doing slows both alike.
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_baseline)
            tg.start_soon(serve_cached)
        await cache.drain()
        stats = cache.statistics()
        status = cache.storage_status()
        backend_name = status.backend if status.attached else None
    progress.close()

    page_nbytes = config.page_nbytes
    counters = stats.counters
    prefetch, backup = status.prefetch, status.backup
    diffs = [
        float((c.logits - b.logits).abs().max()) for c, b in zip(cached, baseline, strict=True)
    ]
    agree = sum(
        int(torch.argmax(c.logits)) == int(torch.argmax(b.logits))
        for c, b in zip(cached, baseline, strict=True)
    )
    prompt_tokens = sum(len(item.tokens) for item in items)
    tiers = TierTokenCounts(
        device=sum(s.device_tokens for s in cached),
        host=sum(s.host_tokens for s in cached),
        storage=sum(s.storage_tokens for s in cached),
        computed=sum(s.computed_tokens for s in cached),
    )
    bound = reuse_upper_bound(requests, page_size=options.page_size)
    ttft_baseline, ttft_cached = _ttft(baseline), _ttft(cached)
    return DemoSummary(
        requests=len(items),
        prompt_tokens=prompt_tokens,
        max_prompt_tokens=options.max_prompt_tokens,
        trace_seconds=(requests[-1].timestamp - first) / 1000.0 if requests else 0.0,
        time_compression=options.time_compression,
        concurrency=options.concurrency,
        model=model.model_id,
        model_parameters=model.num_parameters,
        kv_bytes_per_token=config.layout.token_nbytes,
        device=str(model.device),
        threads=torch.get_num_threads(),
        storage=backend_name,
        storage_pages_at_start=stored_before,
        device_pages=options.device_pages,
        host_pages=options.host_pages,
        page_size=options.page_size,
        write_policy=options.write_policy,
        prefetch_policy=options.prefetch_policy,
        tokens=tiers,
        hit_rate=(prompt_tokens - tiers.computed) / prompt_tokens if prompt_tokens else 0.0,
        upper_bound_tokens=bound,
        upper_bound_rate=bound / prompt_tokens if prompt_tokens else 0.0,
        share_of_upper_bound=(prompt_tokens - tiers.computed) / bound if bound else 0.0,
        ttft_baseline=ttft_baseline,
        ttft_hicache=ttft_cached,
        speedup_p50=_ratio(ttft_baseline.p50_s, ttft_cached.p50_s),
        speedup_p99=_ratio(ttft_baseline.p99_s, ttft_cached.p99_s),
        compute_baseline_s=baseline_runner.busy_s,
        compute_hicache_s=cached_runner.busy_s,
        last_token_baseline_s=max((s.finished_s for s in baseline), default=0.0),
        last_token_hicache_s=max((s.finished_s for s in cached), default=0.0),
        bytes=BytesMoved(
            host_to_device=counters["loaded_pages"] * page_nbytes,
            device_to_host=counters["host_backup_pages"] * page_nbytes,
            storage_read=prefetch.bytes_read if prefetch is not None else 0,
            storage_written=backup.bytes_written if backup is not None else 0,
        ),
        device_evicted_pages=counters["device_evicted_pages"],
        host_evicted_pages=counters["host_evicted_pages"],
        check=LogitCheck(
            compared=len(diffs),
            max_abs_diff=max(diffs, default=0.0),
            argmax_agreement=agree / len(diffs) if diffs else 1.0,
        ),
        seconds=time.perf_counter() - began,
    )


def plan_demo(
    options: DemoOptions, requests: Sequence[TraceRequest] | None = None
) -> list[TraceRequest]:
    """The requests `run_demo` replays: `requests`, or the subset of the packaged trace that
    `select_requests` picks. Raises ValueError if they cannot run with these options."""
    if requests is None:
        requests = select_requests(load_trace(), options.requests, options.max_prompt_tokens)
    chosen = list(requests)
    if not chosen:
        raise ValueError("no trace request fits; raise max_prompt_tokens")
    longest = max(r.input_length for r in chosen)
    pages = options.concurrency * math.ceil(longest / options.page_size)
    if pages > options.device_pages:
        raise ValueError(
            f"{options.concurrency} prompts of {longest} tokens need {pages} device pages; "
            f"device_pages is {options.device_pages}"
        )
    return chosen


def run_demo(
    options: DemoOptions,
    *,
    requests: Sequence[TraceRequest] | None = None,
    model_config: ModelConfig | None = None,
) -> DemoSummary:
    """Run the demo and return its summary.

    `requests` replaces the trace subset (see `plan_demo`); tests use it to replay a handful
    of short prompts. Sets torch's thread count for the run and restores it after.
    """
    chosen = plan_demo(options, requests)
    if options.storage == DEFAULT_STORAGE and not options.keep_storage:
        # The dedicated demo root holds nothing else: start from an empty store.
        shutil.rmtree(demo_storage_root(), ignore_errors=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads or max(1, _cores() // 2))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lanes = {"baseline": len(chosen), "hicache": len(chosen)}
    progress = Progress(lanes, enabled=options.progress, stream=sys.stderr)
    try:
        model = TinyTransformer(model_config, seed=options.seed, device=device)
        return anyio.run(_run, options, chosen, model, progress)
    finally:
        progress.close()
        torch.set_num_threads(threads)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
