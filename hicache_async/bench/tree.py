"""Radix tree throughput and memory on the packaged chat trace.

Each request's prompt becomes page keys (hashing is timed on its own), then every request is
inserted as device pages from an unbounded counter (no eviction), then every request is matched
against the built tree. Memory is the tree's traced allocations, keys included, per cached token.
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
import tracemalloc
from typing import Any

import numpy as np

from .._keys import page_keys
from .._trace import TraceRequest, load_trace, request_tokens
from ..cli._args import positive_int
from ..tree import RadixTree
from ._records import Record

__all__ = ["add_arguments", "describe", "prepare", "run"]

describe = "radix tree: match and insert per call, key hashing, memory per cached token"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hicache-async bench tree`."""
    parser.add_argument(
        "--requests", type=positive_int, default=3000, help="requests taken from the trace"
    )
    parser.add_argument("--trace", default=None, help="a trace file (default: the packaged one)")
    parser.add_argument("--page-size", type=positive_int, default=64, help="tokens per page")
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="match passes over the requests"
    )


@functools.lru_cache(maxsize=1)
def _requests(path: str | None, limit: int) -> tuple[TraceRequest, ...]:
    # Read once for prepare() and run() alike.
    return tuple(load_trace(path, limit=limit))


def prepare(args: argparse.Namespace) -> None:
    """Check the options against the trace before anything is measured: ValueError or
    OSError (an unreadable trace) when they cannot run."""
    requests = _requests(args.trace, args.requests)
    if not requests:
        raise ValueError(f"the trace {args.trace or '(packaged)'} holds no requests")
    if max(r.input_length for r in requests) < args.page_size:
        # Every prompt would be shorter than a page: no keys, nothing to insert or match.
        raise ValueError(
            f"no prompt of the first {len(requests)} requests fills a page of "
            f"{args.page_size} tokens; lower --page-size"
        )


def _build(
    tokens: list[np.ndarray[Any, Any]], page_size: int
) -> tuple[RadixTree, float, float, int]:
    """Hash and insert every request; return the tree, hashing and insert seconds, calls."""
    tree = RadixTree()
    next_page = 0
    hashing = 0.0
    inserting = 0.0
    calls = 0
    for prompt in tokens:
        start = time.perf_counter()
        keys = page_keys(prompt, page_size)
        hashing += time.perf_counter() - start
        if not keys:
            continue
        pages = list(range(next_page, next_page + len(keys)))
        next_page += len(keys)
        start = time.perf_counter()
        tree.insert(keys, device_pages=pages)
        inserting += time.perf_counter() - start
        calls += 1
    return tree, hashing, inserting, calls


def _traced_bytes(tokens: list[np.ndarray[Any, Any]], page_size: int) -> tuple[int, int]:
    """Bytes the tree (with its keys) keeps alive after being built, and its cached tokens."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tree = RadixTree()
        next_page = 0
        for prompt in tokens:
            keys = page_keys(prompt, page_size)
            if keys:
                tree.insert(keys, device_pages=range(next_page, next_page + len(keys)))
                next_page += len(keys)
        del keys, prompt
        gc.collect()
        size = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return size, tree.statistics().device_pages * page_size


def run(args: argparse.Namespace) -> list[Record]:
    """Measure the tree on the first `--requests` requests of the trace."""
    prepare(args)
    page_size: int = args.page_size
    requests = _requests(args.trace, args.requests)
    tokens = [request_tokens(r) for r in requests]

    gc.collect()
    tree, hashing, inserting, insert_calls = _build(tokens, page_size)
    all_keys = [k for k in (page_keys(t, page_size) for t in tokens) if k]

    gc.collect()
    match_calls = 0
    matched_pages = 0
    start = time.perf_counter()
    for _ in range(args.repeat):
        for keys in all_keys:
            matched_pages += len(tree.match(keys).device_pages)
            match_calls += 1
    matching = time.perf_counter() - start
    stats = tree.statistics()
    if matched_pages != args.repeat * sum(len(k) for k in all_keys):
        raise RuntimeError("a request inserted into the tree did not match in full")

    memory, cached_tokens = _traced_bytes(tokens, page_size)
    return [
        Record("tree.match.ops_per_s", match_calls / matching, "ops/s"),
        Record("tree.match.us_per_call", matching / match_calls * 1e6, "us"),
        Record("tree.insert.ops_per_s", insert_calls / inserting, "ops/s"),
        Record("tree.insert.us_per_call", inserting / insert_calls * 1e6, "us"),
        Record("tree.keys.us_per_request", hashing / len(tokens) * 1e6, "us"),
        Record("tree.memory.bytes_per_cached_token", memory / cached_tokens, "B/token"),
        Record("tree.pages_per_request", sum(len(k) for k in all_keys) / len(all_keys), "pages"),
        Record("tree.nodes", float(stats.nodes), "nodes"),
        Record("tree.cached_tokens", float(cached_tokens), "tokens"),
    ]
