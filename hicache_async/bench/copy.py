"""`bench copy`: page copies through the CPU copy engine against a plain `tensor.copy_`.

A Llama-3-8B-like layout (32 layers, 8 KV heads, head dim 128, fp16, 64-token pages: 8 MiB a
page). For each host memory layout, direction (host to device, device to host) and page set
(contiguous runs, random scattered pages) it times `await engine.copy(...)` and, in the same
rounds, a single `dst.copy_(src)` of as many bytes between two contiguous buffers. Each figure
is the best of `--repeats` rounds, so a busy machine shows less than it would otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import torch

from .._config import HostLayout, KVLayout
from .._pool import KVPool
from ..cli._args import positive_int, seed
from ..transfer import CpuCopyEngine
from ._records import Record

__all__ = ["add_arguments", "describe", "run"]

describe = "device<->host page copies through the CPU copy engine vs a plain tensor.copy_"

_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
_PAGE_SIZE = 64
_HOST_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first_direct")
_SETTLE_S = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument(
        "--pages", type=positive_int, default=16, help="pages per copy (8 MiB each; default 16)"
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=7,
        help="rounds per figure; the best counts (default 7)",
    )
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random page sets")


def _page_sets(
    num_pages: int, pool_pages: int, rng: np.random.Generator
) -> dict[str, tuple[list[int], list[int]]]:
    """(source pages, destination pages) per pattern: consecutive on both sides, scattered
    pages into a consecutive run (as freshly allocated pages often are), scattered on both."""
    run = list(range(num_pages))
    return {
        "contiguous": (run, list(range(num_pages, 2 * num_pages))),
        "random-src": (rng.choice(pool_pages, num_pages, replace=False).tolist(), run),
        "random": (
            rng.choice(pool_pages, num_pages, replace=False).tolist(),
            rng.choice(pool_pages, num_pages, replace=False).tolist(),
        ),
    }


async def _measure(args: argparse.Namespace) -> list[Record]:
    n = args.pages
    if n < 1 or args.repeats < 1:
        raise ValueError("--pages and --repeats must be >= 1")
    pool_pages = 2 * n
    rng = np.random.default_rng(args.seed)
    device = KVPool(_LAYOUT, _PAGE_SIZE, pool_pages, memory_layout="layer_first", name="device")
    nbytes = n * device.page_nbytes
    plain_src = torch.zeros(nbytes, dtype=torch.uint8)
    plain_dst = torch.zeros(nbytes, dtype=torch.uint8)
    engine = CpuCopyEngine(name="bench-copy")
    records: list[Record] = []
    try:
        for host_layout in _HOST_LAYOUTS:
            host = KVPool(_LAYOUT, _PAGE_SIZE, pool_pages, memory_layout=host_layout, name="host")
            for pattern, (a, b) in _page_sets(n, pool_pages, rng).items():
                for direction, (src, dst) in (("h2d", (host, device)), ("d2h", (device, host))):
                    best_engine = best_plain = float("inf")
                    for _ in range(args.repeats):
                        # Let torch's idle worker threads stop spinning before each timing,
                        # so neither measurement pays for the other's threads.
                        await asyncio.sleep(_SETTLE_S)
                        start = time.perf_counter()
                        plain_dst.copy_(plain_src)
                        best_plain = min(best_plain, time.perf_counter() - start)
                        await asyncio.sleep(_SETTLE_S)
                        start = time.perf_counter()
                        await engine.copy(src, a, dst, b)
                        best_engine = min(best_engine, time.perf_counter() - start)
                    records.append(
                        Record.compare(
                            f"copy {direction} {pattern} host={host_layout}",
                            nbytes / best_engine / 1e9,
                            "GB/s",
                            nbytes / best_plain / 1e9,
                        )
                    )
            del host
    finally:
        await engine.aclose()
    return records


def run(args: argparse.Namespace) -> list[Record]:
    """Run the benchmark; every record's baseline is a plain copy_ of the same bytes."""
    return asyncio.run(_measure(args))
