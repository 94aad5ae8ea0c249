"""The raw Mooncake baseline for `hicache-async bench storage --backend mooncake://...`.

The Mooncake client's own zero-copy calls moving the same bytes as the backend (`page_nbytes`
per page, no header, no checksum) between registered host memory and the store:
`batch_put_from`, `batch_get_into` and `batch_is_exist`, with the client set up exactly as the
URL says, its placement included (`placement=local`: this client's segment first, as the backend
does). A whole-batch call and 16-page calls are tried; the bench pairs the one with the
better median with the backend, run by run, as for Redis.

The same calls with xxh3 of every page (before a put, checked after a get, on two threads)
are timed too, in the same runs: that is what any store that checksums its pages must do at
the least, so their ratio to the plain calls is the ceiling of a checked store here.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import _native
from .._errors import StorageError
from ..storage._mooncake import _NO_SPACE, MooncakeStorage, pooled_client
from ._timing import EXISTS_CALLS, median_us

__all__ = ["RawModes"]


def _calls(
    store: Any,
    keys: Sequence[str],
    base: int,
    page_nbytes: int,
    chunk: int,
    *,
    put: bool,
    config: Any = None,
) -> Callable[[], None]:
    def run() -> None:
        for start in range(0, len(keys), chunk):
            part = list(keys[start : start + chunk])
            ptrs = [base + (start + i) * page_nbytes for i in range(len(part))]
            sizes = [page_nbytes] * len(part)
            if not put:
                codes = store.batch_get_into(part, ptrs, sizes)
            elif config is None:
                codes = store.batch_put_from(part, ptrs, sizes)
            else:
                codes = store.batch_put_from(part, ptrs, sizes, config)
            expected = 0 if put else page_nbytes
            failed = sorted({int(code) for code in codes if code != expected})
            if failed:
                # A StorageError: the command reports it in one line (a full cluster is
                # a state of the store, not a bug of the bench).
                full = " (-200: the cluster has no room)" if _NO_SPACE in failed else ""
                op = "put" if put else "get"
                raise StorageError(f"raw mooncake {op} failed with {failed}{full}")

    return run


def _digests(pool: ThreadPoolExecutor, data: np.ndarray[Any, Any], page_nbytes: int) -> list[int]:
    view = memoryview(data.data)
    pages = [view[start : start + page_nbytes] for start in range(0, len(view), page_nbytes)]
    return list(pool.map(lambda page: _native.checksum([page]), pages))


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class RawModes:
    """The Mooncake client's own calls moving `num_pages` objects of `page_nbytes`, run one at
    a time, for paired runs against the backend.

    Modes: one call for the whole batch (`whole`) and 16-page calls (`c16`). `put(mode)` first
    removes what the previous put stored (untimed), then stores keys the cluster does not
    hold, from registered memory; `get(mode)` reads the last put's objects into registered
    memory and checks they came back intact (untimed). Both return seconds. With
    `checked=True` the timed part also hashes every page (xxh3, two threads): before the put,
    and after the get against the source's digests. Use as a context manager; it removes its
    objects and registrations on the way out.
    """

    #: The bench also times the calls with checksums (`checked=True`), for the ceiling record.
    checked_ceiling = True

    def __init__(self, url: str, page_nbytes: int, num_pages: int) -> None:
        if page_nbytes < 1 or num_pages < 1:
            raise ValueError("page_nbytes and num_pages must be >= 1")
        self._url = url
        self._nbytes = page_nbytes
        self._source = np.random.default_rng(0).integers(
            0, 256, page_nbytes * num_pages, dtype=np.uint8
        )
        self._target = np.zeros_like(self._source)
        self._tag = f"hicache-raw-bench:{uuid.uuid4().hex}"
        self._runs = itertools.count()
        self._keys: list[str] = []
        self._stack = contextlib.ExitStack()
        self._store: Any = None
        self._replicate: Any = None
        self._hashers: ThreadPoolExecutor | None = None
        self._digests: list[int] = []
        self.modes = sorted({"whole", f"c{min(16, num_pages)}"})

    def __enter__(self) -> RawModes:
        with contextlib.ExitStack() as stack:
            self._hashers = stack.enter_context(ThreadPoolExecutor(2, "raw-mooncake-hash"))
            self._digests = _digests(self._hashers, self._source, self._nbytes)
            self._store = stack.enter_context(pooled_client(self._url))
            if MooncakeStorage.from_url(self._url).placement == "local":
                # The same placement as the backend's: this client's own segment first.
                from mooncake.store import ReplicateConfig

                self._replicate = ReplicateConfig()
                self._replicate.preferred_segment = self._store.get_hostname()
            for array in (self._source, self._target):
                address = int(array.ctypes.data)
                if self._store.register_buffer(address, array.nbytes) != 0:
                    raise RuntimeError("raw mooncake: register_buffer failed")
                stack.callback(self._store.unregister_buffer, address)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with self._stack:
                self._remove()
        finally:
            self._store = self._hashers = None

    def _check_open(self) -> None:
        if self._store is None:
            raise RuntimeError("RawModes is used outside its with block")

    def _remove(self) -> None:
        if self._keys:
            self._store.batch_remove(self._keys, force=True)
            self._keys = []

    def _chunk(self, mode: str) -> int:
        if mode not in self.modes:
            raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(self.modes)}")
        return len(self._keys) if mode == "whole" else int(mode[1:])

    def _hash(self, data: np.ndarray[Any, Any]) -> list[int]:
        assert self._hashers is not None
        return _digests(self._hashers, data, self._nbytes)

    def put(self, mode: str, *, checked: bool = False) -> float:
        self._check_open()
        self._remove()
        run = next(self._runs)
        pages = self._source.nbytes // self._nbytes
        self._keys = [f"{self._tag}:{run}:{i}" for i in range(pages)]
        base = int(self._source.ctypes.data)
        calls = _calls(
            self._store,
            self._keys,
            base,
            self._nbytes,
            self._chunk(mode),
            put=True,
            config=self._replicate,
        )
        if not checked:
            return _timed(calls)

        def hashed_calls() -> None:
            self._hash(self._source)
            calls()

        return _timed(hashed_calls)

    def get(self, mode: str, *, checked: bool = False) -> float:
        self._check_open()
        if not self._keys:
            raise RuntimeError("get before any put")
        self._target[:] = 0
        base = int(self._target.ctypes.data)
        calls = _calls(self._store, self._keys, base, self._nbytes, self._chunk(mode), put=False)
        intact = True

        def checked_calls() -> None:
            nonlocal intact
            calls()
            intact = self._hash(self._target) == self._digests

        seconds = _timed(checked_calls if checked else calls)
        if not intact or not np.array_equal(self._source, self._target):
            raise RuntimeError("raw mooncake get returned other bytes")
        return seconds

    def exists_us(self, calls: int = EXISTS_CALLS) -> float:
        """Median microseconds of `calls` calls of `batch_is_exist` of 64 of the last put's
        keys."""
        self._check_open()
        if not self._keys:
            raise RuntimeError("exists before any put")
        probe = [self._keys[i % len(self._keys)] for i in range(64)]
        return median_us(lambda: self._store.batch_is_exist(probe), calls)
