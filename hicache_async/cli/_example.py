"""`hicache-async example`: replay part of the chat trace through the cache and report.

Every page computed is written by the KV generator and every page read back from the host pool
(or storage) is checked against it, so the run also proves the bytes are right.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import anyio
import msgspec

from .._cache import HiCache
from .._config import CacheConfig, KVLayout
from .._errors import HiCacheError, StorageConfigError, StorageError
from .._trace import load_trace, request_tokens
from ..storage import open_storage
from ..testing import KVGenerator, ServedRequest, serve
from ._args import positive_int
from ._output import print_output

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests", type=positive_int, default=150, help="trace requests to replay"
    )
    parser.add_argument(
        "--storage",
        default="file://",
        help="storage URL (default: files in the user's cache directory; 'none' for no L3)",
    )
    parser.add_argument("--device-pages", type=positive_int, default=2048)
    parser.add_argument("--host-pages", type=positive_int, default=6144)
    parser.add_argument("--page-size", type=positive_int, default=64)
    parser.add_argument(
        "--write-policy",
        default="write_through",
        choices=["write_through", "write_through_selective", "write_back"],
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


class ExampleSummary(msgspec.Struct, frozen=True):
    requests: int
    prompt_tokens: int
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    computed_tokens: int
    pages_checked: int
    device_evicted_pages: int
    host_evicted_pages: int
    host_backup_pages: int
    storage_pages_written: int
    seconds: float


# Never a page key (those are hashes): the look-up reads nothing and writes nothing.
_PROBE_KEY = bytes(32)


async def _check_storage(url: str, timeout_s: float) -> None:
    """Reach the storage before the replay: a store that cannot be reached would turn the run
    into one without L3, each request logging its failure, and still report success.

    The look-up gets `timeout_s`, as the cache's own do: a store that never answers ends the
    run instead of holding it for ever. Whatever the store raises is an answer that it
    cannot be used, not a traceback: the cache would take any failure of a look-up alike.
    """
    try:
        async with open_storage(url) as backend:
            try:
                with anyio.fail_after(timeout_s):
                    await backend.exists([_PROBE_KEY])
            except TimeoutError as exc:
                if str(exc):
                    raise
                raise StorageError(
                    f"{backend.name}: exists gave no answer within {timeout_s:g} s"
                ) from exc
    except StorageConfigError:
        raise  # a bad URL or parameter: its own message says which
    except Exception as exc:
        # The backend's own message names it with any password masked; the URL may hold one.
        detail = (
            str(exc) if isinstance(exc, (StorageError, OSError)) else f"{type(exc).__name__}: {exc}"
        )
        raise StorageConfigError(f"the example's storage cannot be used: {detail}") from exc


async def _replay(args: argparse.Namespace) -> ExampleSummary:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16")
    config = CacheConfig(
        layout=layout,
        page_size=args.page_size,
        device_pages=args.device_pages,
        host_pages=args.host_pages,
        write_policy=args.write_policy,
        # The generator's bytes are this "model's" KV: a release whose generator writes other
        # bytes (v2: they depend on the layout) names another model, so pages an earlier
        # release stored are never read back as this one's and fail the check.
        model_id="hicache-example/kvgen-v2",
    )
    storage = None if args.storage == "none" else args.storage
    if storage is not None:
        await _check_storage(storage, config.prefetch.io_timeout_s)
    generator = KVGenerator(layout, args.page_size, seed=0)
    trace = load_trace(limit=args.requests)
    started = time.perf_counter()
    served: list[ServedRequest] = []
    async with HiCache(config, storage=storage) as cache:
        for index, entry in enumerate(trace):
            if entry.input_length > args.device_pages * args.page_size // 2:
                continue  # a prompt that cannot fit next to others in the device pool
            tokens = request_tokens(entry)
            served.append(await serve(cache, tokens, generator, request_id=f"trace-{index}"))
        await cache.drain()
        stats = cache.statistics()
        status = cache.storage_status()
    written = status.backup.written_pages if status.backup is not None else 0
    return ExampleSummary(
        requests=len(served),
        prompt_tokens=sum(s.num_tokens for s in served),
        device_tokens=sum(s.device_tokens for s in served),
        host_tokens=sum(s.host_tokens for s in served),
        storage_tokens=sum(s.storage_tokens for s in served),
        computed_tokens=sum(s.computed_tokens for s in served),
        pages_checked=sum(s.checked_pages for s in served),
        device_evicted_pages=stats.counters["device_evicted_pages"],
        host_evicted_pages=stats.counters["host_evicted_pages"],
        host_backup_pages=stats.counters["host_backup_pages"],
        storage_pages_written=written,
        seconds=time.perf_counter() - started,
    )


def run(args: argparse.Namespace) -> int:
    try:
        summary = asyncio.run(_replay(args))
    except (HiCacheError, ValueError) as exc:  # configuration, storage URL, opening the cache
        print(f"hicache-async example: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        text = msgspec.json.format(msgspec.json.encode(summary)).decode()
        return print_output(text, prog="hicache-async example")
    total = max(summary.prompt_tokens, 1)
    lines = [f"replayed {summary.requests} trace requests in {summary.seconds:.1f} s"]
    for label, value in (
        ("from device (L1)", summary.device_tokens),
        ("from host (L2)", summary.host_tokens),
        ("from storage (L3)", summary.storage_tokens),
        ("computed", summary.computed_tokens),
    ):
        lines.append(f"  tokens {label:<18} {value:>10,}  {100 * value / total:5.1f}%")
    lines.append(
        f"  pages read back and checked against the KV generator: {summary.pages_checked:,}"
    )
    lines.append(
        f"  evicted: {summary.device_evicted_pages:,} device pages, "
        f"{summary.host_evicted_pages:,} host pages; backed up: {summary.host_backup_pages:,} "
        f"to host, {summary.storage_pages_written:,} to storage"
    )
    return print_output("\n".join(lines), prog="hicache-async example")
