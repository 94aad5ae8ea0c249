"""The raw Mooncake baseline for `hicache-async bench storage --backend mooncake://...`.

The Mooncake client's own zero-copy calls moving the same bytes as the backend (`page_nbytes`
per page, no header, no checksum) between registered host memory and the store:
`batch_put_from`, `batch_get_into` and `batch_is_exist`, with the client set up exactly as the
URL says. A whole-batch call and 16-page calls are tried and the faster counts.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..storage._mooncake import pooled_client

__all__ = ["measure_raw"]

_EXISTS_CALLS = 200


def _calls(
    store: Any, keys: Sequence[str], base: int, page_nbytes: int, chunk: int, *, put: bool
) -> Callable[[], None]:
    def run() -> None:
        for start in range(0, len(keys), chunk):
            part = list(keys[start : start + chunk])
            ptrs = [base + (start + i) * page_nbytes for i in range(len(part))]
            sizes = [page_nbytes] * len(part)
            codes = (
                store.batch_put_from(part, ptrs, sizes)
                if put
                else store.batch_get_into(part, ptrs, sizes)
            )
            expected = 0 if put else page_nbytes
            if any(code != expected for code in codes):
                raise RuntimeError(f"raw mooncake {'put' if put else 'get'} failed: {codes}")

    return run


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure_raw(url: str, page_nbytes: int, num_pages: int, *, reps: int = 2) -> dict[str, float]:
    """Best raw Mooncake throughput for `num_pages` objects of `page_nbytes` at `url`.

    Returns `put_gbps`, `get_gbps` and `exists64_us` (median microseconds of one
    `batch_is_exist` of 64 keys). Every object written is removed again.
    """
    if page_nbytes < 1 or num_pages < 1 or reps < 1:
        raise ValueError("page_nbytes, num_pages and reps must be >= 1")
    total = page_nbytes * num_pages
    source = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    target = np.zeros(total, dtype=np.uint8)
    src, dst = int(source.ctypes.data), int(target.ctypes.data)
    tag = f"hicache-raw-bench:{uuid.uuid4().hex}"
    chunks = sorted({num_pages, min(16, num_pages)})
    best_put = best_get = float("inf")
    exists = float("nan")
    with pooled_client(url) as store:
        for address, array in ((src, source), (dst, target)):
            if store.register_buffer(address, array.nbytes) != 0:
                raise RuntimeError("raw mooncake: register_buffer failed")
        try:
            for rep in range(reps):
                for chunk in chunks:
                    keys = [f"{tag}:{rep}:{chunk}:{i}" for i in range(num_pages)]
                    best_put = min(
                        best_put, _timed(_calls(store, keys, src, page_nbytes, chunk, put=True))
                    )
                    for get_chunk in chunks:
                        run = _calls(store, keys, dst, page_nbytes, get_chunk, put=False)
                        best_get = min(best_get, _timed(run))
                    if not np.array_equal(source, target):
                        raise RuntimeError("raw mooncake get returned other bytes")
                    if rep == reps - 1 and chunk == chunks[-1]:
                        exists = _exists_us(store, keys)
                    store.batch_remove(keys, force=True)
        finally:
            store.unregister_buffer(src)
            store.unregister_buffer(dst)
    return {
        "put_gbps": total / best_put / 1e9,
        "get_gbps": total / best_get / 1e9,
        "exists64_us": exists,
    }


def _exists_us(store: Any, keys: Sequence[str]) -> float:
    probe = [keys[i % len(keys)] for i in range(64)]
    times: list[float] = []
    for _ in range(_EXISTS_CALLS):
        start = time.perf_counter()
        store.batch_is_exist(probe)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6
