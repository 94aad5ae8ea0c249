"""`hicache-async demo`: replay a chat trace through a tiny model, with and without the cache.

Prints where the prompt tokens came from (device, host, storage, recomputed), time to first
token with and without hicache_async, KV bytes moved per tier, the hit rate against the best
any cache could do, and how closely the cached path's first-token logits match a full
recompute. Exit codes: 0 on success, 2 on bad options or a storage URL that cannot be used
(malformed, or a store that cannot be reached when the demo starts).
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from .._errors import StorageConfigError
from ..demo import DemoOptions, demo_storage_root, format_summary, plan_demo, run_demo
from ._args import integer, positive_float, positive_int
from ._output import print_output

__all__ = ["add_arguments", "run"]

_DEFAULTS = DemoOptions()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hicache-async demo`."""
    d = _DEFAULTS
    parser.add_argument(
        "--storage",
        default=d.storage,
        metavar="URL",
        help="L3 storage: file:// alone is the demo's own root (default, "
        f"{demo_storage_root()}), or file:///path, memory://, redis://host:port, "
        "mooncake://..., or 'none'",
    )
    parser.add_argument("--device-pages", type=positive_int, default=d.device_pages)
    parser.add_argument("--host-pages", type=positive_int, default=d.host_pages)
    parser.add_argument("--page-size", type=positive_int, default=d.page_size)
    parser.add_argument(
        "--write-policy",
        default=d.write_policy,
        choices=["write_through", "write_through_selective", "write_back"],
    )
    parser.add_argument(
        "--prefetch-policy",
        default=d.prefetch_policy,
        choices=["best_effort", "wait_complete", "timeout"],
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=d.requests,
        metavar="N",
        help="replay the first N multi-turn requests that fit (default %(default)s)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=d.max_prompt_tokens,
        metavar="T",
        help="only requests with prompts of at most T tokens (default %(default)s)",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=d.concurrency,
        help="requests served at once; later arrivals queue (default %(default)s)",
    )
    parser.add_argument(
        "--time-compression",
        type=positive_float,
        default=d.time_compression,
        metavar="X",
        help="replay trace time X times faster (default %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=integer,
        default=d.threads,
        help="torch threads for the model (default: half the cores)",
    )
    parser.add_argument(
        "--keep-storage",
        action="store_true",
        help="keep pages from earlier runs (shows storage hits across restarts)",
    )
    parser.add_argument(
        "--seed", type=integer, default=d.seed, help="seed of the model weights, in [0, 2**64)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the demo with the parsed options; print the summary."""
    try:
        options = DemoOptions(
            storage=args.storage,
            device_pages=args.device_pages,
            host_pages=args.host_pages,
            page_size=args.page_size,
            write_policy=args.write_policy,
            prefetch_policy=args.prefetch_policy,
            requests=args.requests,
            max_prompt_tokens=args.max_prompt_tokens,
            concurrency=args.concurrency,
            time_compression=args.time_compression,
            keep_storage=args.keep_storage,
            seed=args.seed,
            threads=args.threads,
        )
        requests = plan_demo(options)
    except ValueError as exc:
        print(f"hicache-async demo: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = run_demo(options, requests=requests)
    except StorageConfigError as exc:  # a bad or unreachable store, before any replay
        print(f"hicache-async demo: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        text = msgspec.json.format(msgspec.json.encode(summary)).decode()
    else:
        text = format_summary(summary)
    return print_output(text, prog="hicache-async demo")
