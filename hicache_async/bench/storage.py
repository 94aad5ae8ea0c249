"""`hicache-async bench storage`: put, get and exists throughput of a backend, each against a raw
baseline moving the same bytes in the same run.

Baselines: for `file://`, plain Python file I/O on the same kind of files (one file per page,
same sizes): writes are `os.pwritev` on 1, 2, 4 or 8 threads (`_FilePuts`); reads, page-cache
hot and cold (evicted with `posix_fadvise(DONTNEED)` after a sync, before every read of either
side), are `os.preadv` in the modes of `_FileReads` (one call, header then page, 128 KiB
pieces; on 2, 4 and 8 threads). Puts are compared like for like twice: `put`, where the store
writes over the files of the pages removed before the run (its spare files) and the baseline
over its previous run's files, each renamed to a new page's name; and `put_new`, new files on
both sides (a store with `spare=0`). For `memory://`, a dict of bytes with the same copies; for
any other scheme, the module `hicache_async.bench._storage_<scheme>` when it exists (`redis`,
`mooncake`), else no baseline: its `RawModes` are ways of moving the bytes with the plain
client. Wherever the baseline has several modes, each is tried twice (`_pick`); the two best
by median both run in every paired run, and the faster is the baseline's. Which ones, and for
Redis which reply parser redis-py uses (hiredis, its fastest, or pure Python, with a warning),
go to stderr.
Where `RawModes` has `checked_ceiling` (Mooncake), the same calls plus xxh3 of every page take
a third turn in each run, recorded as `raw_checked_put`/`raw_checked_get` against the plain
calls: how close any store that checksums its pages could come to the baseline there. The
file bench does the same for puts over existing files and hot reads (`raw_checked_put`, each
page hashed before it is written; `raw_checked_get_hot`, right after it is read).

Pages are one contiguous segment by default (`--segments N` cuts each into N, like a layer-first
host pool). Ours and the baseline run back to back, taking turns to go first; a throughput is
the median over the runs (`--reps`; hot reads twice as many, cold ones one fewer) and its ratio
the median of the per-pair ratios, so load that comes and goes between runs cancels out. Ratios
above 1 are better for throughput; for `exists64` (microseconds per call, the median of as many
calls on each side) below 1 is.

Where the file backend stands: it verifies every page it reads and checksums every page it
writes (xxh3-64, ~20 GB/s per core from cache with python-xxhash's SSE2 build); the raw baseline
does neither. On a machine whose cores are busy copying, that pass is most of the gap.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import numpy as np

from .. import _native
from ..cli._args import positive_int
from ..storage import (
    HEADER_NBYTES,
    FileStorage,
    MemoryStorage,
    Outcome,
    PageMeta,
    StorageBackend,
    default_root,
    open_storage,
)
from ._records import Record
from ._runner import LoopRunner, fastest_loop_factory
from ._timing import EXISTS_CALLS, amedian_us, median_us

__all__ = ["SHAPES", "Shape", "add_arguments", "describe", "prepare", "run"]

describe = "storage backends: put/get/exists throughput against a raw baseline of the same bytes"

_NAMESPACE = bytes(range(16))
#: Calls timed for each side's `exists64_us` (the median counts); the baselines get the same.
_EXISTS_CALLS = EXISTS_CALLS
_CHECK_NBYTES = 1 << 20
#: Runs of each baseline mode before the best is chosen (by median) for the paired runs.
_MODE_TRIALS = 2
#: Threads of the file baseline's write and read modes, and the piece size of its chunked
#: reads.
_WRITE_THREADS = (1, 2, 4, 8)
_READ_THREADS = (2, 4, 8)
_READ_CHUNK = 128 << 10
_READ_MODES = tuple(f"{how}/t{n}" for how in ("preadv", "split", "chunked") for n in _READ_THREADS)

_Item = TypeVar("_Item")


class Shape(NamedTuple):
    """A model's KV page: every layer, K and V, `page_tokens` tokens."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    page_tokens: int
    default_pages: int

    @property
    def page_nbytes(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * self.dtype_bytes * self.page_tokens * 2


SHAPES = {
    # Llama-3-8B, fp16, 64-token pages: 8 MiB.
    "llama8b": Shape("llama8b", 32, 8, 128, 2, 64, 64),
    # A Qwen2.5-0.5B-sized model, bf16, 64-token pages: 768 KiB.
    "small": Shape("small", 24, 2, 64, 2, 64, 256),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hicache-async bench storage`."""
    parser.add_argument(
        "--backend",
        default="file://",
        metavar="URL",
        help="storage URL (default file://: a temporary directory under the user's cache dir)",
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), help="page shape (default: both, llama8b first)"
    )
    parser.add_argument(
        "--pages", type=positive_int, help="pages per run (default 64 llama8b, 256 small)"
    )
    parser.add_argument(
        "--batch", type=positive_int, default=64, help="pages per call (default 64)"
    )
    parser.add_argument("--reps", type=positive_int, default=3, help="runs per figure (default 3)")
    parser.add_argument(
        "--segments", type=positive_int, default=1, help="segments per page (default 1)"
    )


def _scheme(url: str) -> str | None:
    """The URL's scheme, or None for a plugin's import path (`package.module:factory`, which
    urlsplit would read as scheme `package.module`)."""
    url = url.strip()
    return urlsplit(url).scheme.lower() if "://" in url else None


_MAX_SEGMENTS = 1023


def prepare(args: argparse.Namespace) -> None:
    """Check the sizes and the URL before anything runs (StorageConfigError, StorageError
    for a missing client library, ValueError): the backend is built, not opened."""
    for name in ("pages", "batch", "reps", "segments"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if args.segments > _MAX_SEGMENTS:
        # One vectored call per page: the kernel takes at most IOV_MAX (1024) buffers, one
        # of them the header's.
        raise ValueError(f"--segments must be at most {_MAX_SEGMENTS}, got {args.segments}")
    scheme = _scheme(args.backend)
    if scheme == "file":
        FileStorage.from_url(args.backend)
    elif scheme == "memory":
        MemoryStorage.from_url(_memory_url(args.backend, 1))
    else:
        open_storage(args.backend)
        if scheme == "mooncake":
            # Its backend imports the client library only when it opens, and the baseline
            # needs it too: say which extra is missing now, not as a traceback mid-run.
            from ..storage._mooncake import client_library

            client_library()


def run(args: argparse.Namespace) -> list[Record]:
    """Measure every figure for the chosen shapes."""
    prepare(args)
    shapes = [SHAPES[args.shape]] if args.shape else list(SHAPES.values())
    scheme = _scheme(args.backend)
    records: list[Record] = []
    for shape in shapes:
        pages = args.pages or shape.default_pages
        data = _Data(shape, pages, args.segments)
        if scheme == "file":
            records += _bench_file(args, data)
        elif scheme == "memory":
            records += _bench_memory(args, data)
        else:
            records += _bench_other(args, data, scheme)
    return records


class _Data:
    """Source pages, destination buffers, keys and metas for one shape."""

    def __init__(self, shape: Shape, pages: int, segments: int) -> None:
        self.shape = shape
        self.pages = pages
        nbytes = shape.page_nbytes
        self.nbytes = nbytes
        self.total = nbytes * pages
        rng = np.random.default_rng(0)
        self.source = memoryview(bytearray(rng.bytes(self.total)))
        self.target = memoryview(bytearray(self.total))
        cuts = [nbytes * s // segments for s in range(segments + 1)]
        self.src = [
            [self.source[p * nbytes + a : p * nbytes + b] for a, b in itertools.pairwise(cuts)]
            for p in range(pages)
        ]
        self.dst = [
            [self.target[p * nbytes + a : p * nbytes + b] for a, b in itertools.pairwise(cuts)]
            for p in range(pages)
        ]
        self.generation = 0

    def keys(self) -> list[bytes]:
        """Fresh keys (a put of existing keys would be a no-op)."""
        self.generation += 1
        prefix = self.generation.to_bytes(4, "little")
        return [prefix + p.to_bytes(4, "little") + os.urandom(24) for p in range(self.pages)]

    def metas(self, keys: Sequence[bytes]) -> list[PageMeta]:
        tokens = self.shape.page_tokens
        return [PageMeta(key=k, namespace=_NAMESPACE, num_tokens=tokens) for k in keys]

    def check(self) -> None:
        """Exit if the destination differs from the source; then zero it for the next read."""
        # Compared piece by piece in place: a whole-buffer comparison allocates (or unpacks)
        # as much again, which took seconds per check on a guest that faults memory in.
        target = np.frombuffer(self.target, dtype=np.uint8)
        source = np.frombuffer(self.source, dtype=np.uint8)
        for start in range(0, self.total, _CHECK_NBYTES):
            piece = slice(start, start + _CHECK_NBYTES)
            if not np.array_equal(target[piece], source[piece]):
                raise SystemExit("benchmark read back different bytes than it wrote")
        target.fill(0)


def _batches(count: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


async def _put_all(storage: StorageBackend, data: _Data, keys: list[bytes], batch: int) -> float:
    metas = data.metas(keys)
    start = time.perf_counter()
    for part in _batches(len(keys), batch):
        outcomes = await storage.put(keys[part], data.src[part], metas[part])
        if any(o is not Outcome.OK for o in outcomes):
            raise SystemExit(
                f"{storage.name}: put returned {sorted({o.value for o in outcomes})}; "
                "is the capacity large enough for --pages?"
            )
    return time.perf_counter() - start


async def _get_all(storage: StorageBackend, data: _Data, keys: list[bytes], batch: int) -> float:
    start = time.perf_counter()
    for part in _batches(len(keys), batch):
        outcomes = await storage.get(keys[part], data.dst[part], namespace=_NAMESPACE)
        if any(o is not Outcome.OK for o in outcomes):
            raise SystemExit(f"{storage.name}: get returned {sorted({o.value for o in outcomes})}")
    return time.perf_counter() - start


def _probe(items: Sequence[_Item]) -> list[_Item]:
    """64 of `items`, repeating them when there are fewer (`--pages` < 64), so the
    `exists64_us` records always time calls of 64 keys."""
    return [items[i % len(items)] for i in range(64)]


async def _exists_us(storage: StorageBackend, keys: list[bytes]) -> float:
    probe = _probe(keys)
    if await storage.exists(probe) != len(probe):
        raise SystemExit(f"{storage.name}: exists did not find the pages just written")
    return await amedian_us(lambda: storage.exists(probe), _EXISTS_CALLS)


class _Pairs:
    """Timings of ours and the baseline, taken back to back, per figure."""

    def __init__(self) -> None:
        self.ours: dict[str, list[float]] = {}
        self.base: dict[str, list[float]] = {}

    def add(self, name: str, ours: float, base: float) -> None:
        self.ours.setdefault(name, []).append(ours)
        self.base.setdefault(name, []).append(base)

    def records(self, prefix: str, nbytes: int) -> list[Record]:
        """Throughput from median times; the ratio is the median of the paired ratios, which
        shrugs off load that comes and goes between runs."""
        records = []
        for name, ours in self.ours.items():
            base = self.base[name]
            ratio = statistics.median(b / o for o, b in zip(ours, base, strict=True))
            records.append(
                Record(
                    name=f"{prefix}.{name}_gbps",
                    value=nbytes / statistics.median(ours) / 1e9,
                    unit="GB/s",
                    baseline=nbytes / statistics.median(base) / 1e9,
                    ratio=ratio,
                )
            )
        return records


def _exists_record(prefix: str, ours_us: float, base_us: float | None) -> Record:
    name = f"{prefix}.exists64_us"
    if base_us is None:
        return Record(name=name, value=ours_us, unit="us")
    return Record.compare(name, ours_us, "us", base_us)


def _rotate(rep: int, sides: int = 2) -> list[int]:
    """The order of `sides` contenders in run `rep` (ours is 0, the baseline 1): each goes
    first in turn."""
    return [(rep + i) % sides for i in range(sides)]


# file://


@contextlib.contextmanager
def _workdir(url: str) -> Iterator[tuple[str, Path]]:
    """A fresh storage URL and a baseline directory on the same file system, removed after."""
    parts = urlsplit(url)
    path = unquote(parts.path)
    parent = Path(path) if path else default_root().parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hicache-bench-", dir=parent))
    try:
        raw = work / "raw"
        raw.mkdir(mode=0o700)
        # Quoted: the URL is parsed (and unquoted) again, so a '%' or '#' in the path would
        # otherwise name another directory, outside the one removed below.
        yield urlunsplit(("file", "", quote(str(work / "store")), parts.query, "")), raw
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _without_spares(url: str, name: str) -> str:
    """`url` (a store in the bench's work directory) for a sibling store `name` that keeps
    no spare files, with the same other parameters."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "spare"] + [("spare", "0")]
    path = str(Path(unquote(parts.path)).with_name(name))
    return urlunsplit(("file", "", quote(path), urlencode(query), ""))


def _raw_put(
    pool: ThreadPoolExecutor,
    paths: list[str],
    data: _Data,
    *,
    reuse: list[str] | None = None,
    checked: bool = False,
) -> float:
    """Write each page into a file of its own: the file of the same position in `reuse`,
    while there is one, renamed to the page's path and written over (as the backend writes
    over the files of removed pages it kept), else a new one. `checked` also takes the xxh3
    of each page first, as a store that checksums its pages must at least."""
    header = memoryview(bytes(HEADER_NBYTES))
    reused = reuse or []
    over = os.O_WRONLY | os.O_CLOEXEC
    new = over | os.O_CREAT | os.O_TRUNC

    def one(p: int) -> None:
        if p < len(reused):
            os.rename(reused[p], paths[p])
        if checked:
            _native.checksum(data.src[p])
        fd = os.open(paths[p], over if p < len(reused) else new, 0o600)
        try:
            os.pwritev(fd, [header, *data.src[p]], 0)
        finally:
            os.close(fd)

    start = time.perf_counter()
    list(pool.map(one, range(data.pages)))
    return time.perf_counter() - start


class _FilePuts:
    """The baseline's puts: each writes every page into a file of its own, in mode `tN` on N
    threads (`_WRITE_THREADS`), and returns its seconds.

    `over(mode)` writes over the files of the `over` before (as many as the store keeps as
    spare files, each renamed to a new page's name; the rest are removed first), as the store
    writes over its spares; `paths` are then the new files. `new(mode)` writes new files in
    `fresh`, after removing those of the `new` before (`discard()` removes the last ones).
    Removals and a sync come before the timed part.
    """

    def __init__(
        self, stack: contextlib.ExitStack, root: Path, fresh: Path, data: _Data, keep: int
    ) -> None:
        self._root, self._fresh, self._data, self._keep = root, fresh, data, keep
        self._runs = itertools.count()
        self._pools: dict[int, ThreadPoolExecutor] = {}
        for count in _WRITE_THREADS:
            pool = stack.enter_context(ThreadPoolExecutor(count, f"raw-write-{count}"))
            _start_threads(pool, count)
            self._pools[count] = pool
        self.modes = [f"t{count}" for count in _WRITE_THREADS]
        self.paths: list[str] = []
        self._new: list[str] = []

    def _pool(self, mode: str) -> ThreadPoolExecutor:
        if mode not in self.modes:
            raise ValueError(f"unknown write mode {mode!r}; modes: {', '.join(self.modes)}")
        return self._pools[int(mode[1:])]

    def _names(self, folder: Path) -> list[str]:
        run = next(self._runs)
        return [str(folder / f"{run}-{page}") for page in range(self._data.pages)]

    def over(self, mode: str, *, checked: bool = False) -> float:
        pool = self._pool(mode)
        old, self.paths = self.paths, self._names(self._root)
        for path in old[self._keep :]:
            os.unlink(path)
        os.sync()  # no writeback of an earlier put competes with this one
        return _raw_put(pool, self.paths, self._data, reuse=old[: self._keep], checked=checked)

    def new(self, mode: str) -> float:
        pool = self._pool(mode)
        self.discard()
        self._new = self._names(self._fresh)
        os.sync()
        return _raw_put(pool, self._new, self._data)

    def discard(self) -> None:
        """Remove the files of the last `new`."""
        for path in self._new:
            os.unlink(path)
        self._new = []


def _start_threads(pool: ThreadPoolExecutor, count: int) -> None:
    """Start `count` threads of `pool` now (it starts them on demand), so that no timed
    read pays for a thread's start."""
    barrier = threading.Barrier(count)
    list(pool.map(lambda _: barrier.wait(timeout=60.0), range(count)))


class _FileReads:
    """Plain-Python ways of reading every page's file (its header, then the page) into the
    destination buffers, for the baseline's gets. Modes are `HOW/tN`, on N threads:

    - `preadv`: header and page in one `os.preadv`;
    - `split`: the header, then the page, in two calls (as the store reads);
    - `chunked`: the header, then the page in calls of `_READ_CHUNK` bytes.

    Which is fastest depends on the machine and on whether the page cache is hot or cold,
    so the bench times them all and pairs the best with the store (`_pick`). Calling a mode
    reads every page once and returns its seconds.
    """

    def __init__(self, stack: contextlib.ExitStack, paths: Sequence[str], data: _Data) -> None:
        self._paths = list(paths)
        self._pages = data.pages
        self._headers = [memoryview(bytearray(HEADER_NBYTES)) for _ in range(data.pages)]
        self._dst = data.dst
        self._pieces = [_pieces(page, _READ_CHUNK) for page in data.dst]
        self._pools: dict[int, ThreadPoolExecutor] = {}
        for count in _READ_THREADS:
            pool = stack.enter_context(ThreadPoolExecutor(count, f"raw-read-{count}"))
            _start_threads(pool, count)
            self._pools[count] = pool
        self._ways: dict[str, Callable[[int], None]] = {
            "preadv": self._whole,
            "split": self._split,
            "chunked": self._chunked,
        }
        self.modes = list(_READ_MODES)

    def __call__(self, mode: str, *, checked: bool = False) -> float:
        """Read every page in `mode`; `checked` also takes the xxh3 of each page right after
        reading it (from the cache), as a store that verifies its pages must at least."""
        if mode not in self.modes:
            raise ValueError(f"unknown read mode {mode!r}; modes: {', '.join(self.modes)}")
        how, _, count = mode.partition("/t")
        read, pool = self._ways[how], self._pools[int(count)]
        if checked:
            plain = read

            def read(p: int) -> None:
                plain(p)
                _native.checksum(self._dst[p])

        start = time.perf_counter()
        list(pool.map(read, range(self._pages)))
        return time.perf_counter() - start

    def _whole(self, p: int) -> None:
        fd = os.open(self._paths[p], os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.preadv(fd, [self._headers[p], *self._dst[p]], 0)
        finally:
            os.close(fd)

    def _split(self, p: int) -> None:
        fd = os.open(self._paths[p], os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.preadv(fd, [self._headers[p]], 0)
            os.preadv(fd, self._dst[p], HEADER_NBYTES)
        finally:
            os.close(fd)

    def _chunked(self, p: int) -> None:
        fd = os.open(self._paths[p], os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.preadv(fd, [self._headers[p]], 0)
            for offset, piece in self._pieces[p]:
                os.preadv(fd, [piece], offset)
        finally:
            os.close(fd)


def _pieces(page: Sequence[memoryview], size: int) -> list[tuple[int, memoryview]]:
    """(file offset, view) of each piece of at most `size` bytes of `page`'s segments, in
    order, as stored after the header."""
    pieces = []
    offset = HEADER_NBYTES
    for segment in page:
        for start in range(0, segment.nbytes, size):
            piece = segment[start : start + size]
            pieces.append((offset, piece))
            offset += piece.nbytes
    return pieces


def _pick(modes: Sequence[str], trial: Callable[[str], float]) -> list[str]:
    """The two of `modes` with the best median of `_MODE_TRIALS` runs of `trial(mode)` (its
    seconds), best first; the runs go round all modes in turn, so that a spell of load does
    not fall on one mode's runs alone. Both run in every paired run and the faster counts: a
    few noisy trials cannot saddle the baseline with a weak mode."""
    if not modes:
        raise ValueError("no modes to pick from")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(_MODE_TRIALS):
        for mode in modes:
            times[mode].append(trial(mode))
    return sorted(modes, key=lambda mode: statistics.median(times[mode]))[:2]


def _raw_exists_us(paths: list[str]) -> float:
    probe = _probe(paths)

    def call() -> None:
        for path in probe:
            os.stat(path)

    return median_us(call, _EXISTS_CALLS)


def _drop_cache(*dirs: Path) -> None:
    """Write back, then evict from the page cache, every file under `dirs`."""
    os.sync()
    for top in dirs:
        for folder, _, files in os.walk(top):
            for name in files:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _bench_file(args: argparse.Namespace, data: _Data) -> list[Record]:
    reps = args.reps
    pairs = _Pairs()
    with (
        _workdir(args.backend) as (url, raw_dir),
        LoopRunner(fastest_loop_factory()) as runner,
    ):
        storage = FileStorage.from_url(url)
        # The same store without spare files, for puts into new files on both sides.
        fresh = FileStorage.from_url(_without_spares(url, "fresh"))
        fresh_raw = raw_dir.with_name("fresh-raw")
        fresh_raw.mkdir(mode=0o700)
        runner.run(storage.__aenter__())
        runner.run(fresh.__aenter__())
        try:
            spares = storage._spares
            spare_pages = (0 if spares is None else spares.limit) // (HEADER_NBYTES + data.nbytes)
            with contextlib.ExitStack() as stack:
                # Untimed: a first put on both sides, so that every timed `put` (the first
                # one too) writes over the files of the run before, as in a steady state.
                puts = _FilePuts(stack, raw_dir, fresh_raw, data, spare_pages)
                keys = data.keys()
                runner.run(_put_all(storage, data, keys, args.batch))
                puts.over(puts.modes[-1])
                # The baseline's thread counts: each tried twice, the two best in every pair.
                put_modes = _pick(puts.modes, puts.over)
                new_modes = _pick(puts.modes, puts.new)
                print(
                    f"file {data.shape.name}: baseline put {' or '.join(put_modes)}, "
                    f"put_new {' or '.join(new_modes)}",
                    file=sys.stderr,
                )
                times = [0.0, 0.0]
                for rep in range(reps):
                    # Fresh pages each time (a put of an existing key is a no-op). The store
                    # keeps the removed pages' files as spares and writes over them; the
                    # baseline writes over the previous put's files likewise (as many as the
                    # store keeps; the rest go first, untimed). `put_new` has neither: new
                    # files on both sides.
                    runner.run(storage.delete(keys))
                    runner.run(fresh.delete(keys))
                    puts.discard()  # as the store's fresh files just went
                    keys = data.keys()
                    # A third turn: the baseline's writes plus the xxh3 of each page, the
                    # least a store that checksums its pages must do (`raw_checked_put`).
                    written = [0.0, 0.0, 0.0]
                    for turn in _rotate(rep, 3):
                        if turn == 0:
                            os.sync()  # no writeback of an earlier run competes with this one
                            written[0] = runner.run(_put_all(storage, data, keys, args.batch))
                        elif turn == 1:  # each mode syncs first too
                            written[1] = min(puts.over(mode) for mode in put_modes)
                        else:
                            written[2] = min(puts.over(mode, checked=True) for mode in put_modes)
                    pairs.add("put", written[0], written[1])
                    pairs.add("raw_checked_put", written[2], written[1])
                    for turn in _rotate(rep):
                        if turn == 0:
                            os.sync()
                            times[0] = runner.run(_put_all(fresh, data, keys, args.batch))
                        else:
                            times[1] = min(puts.new(mode) for mode in new_modes)
                    pairs.add("put_new", *times)
                puts.discard()
                paths = puts.paths
                reads = _FileReads(stack, paths, data)

                def hot(mode: str) -> float:
                    seconds = reads(mode)
                    data.check()  # both sides start from the same state of the buffers
                    return seconds

                def cold(mode: str) -> float:
                    _drop_cache(storage.root, raw_dir)
                    return hot(mode)

                hot_modes = _pick(reads.modes, hot)
                print(
                    f"file {data.shape.name}: baseline get_hot {' or '.join(hot_modes)}",
                    file=sys.stderr,
                )
                # A third turn: the baseline's reads plus the xxh3 of each page, the least a
                # store that verifies what it reads must do (`raw_checked_get_hot`).
                checked = [0.0, 0.0, 0.0]
                for rep in range(2 * reps):  # cheap, and the noisiest
                    for turn in _rotate(rep, 3):
                        if turn == 0:
                            checked[0] = runner.run(_get_all(storage, data, keys, args.batch))
                            data.check()
                        elif turn == 1:
                            checked[1] = min(hot(mode) for mode in hot_modes)
                        else:
                            checked[2] = min(reads(mode, checked=True) for mode in hot_modes)
                            data.check()
                    pairs.add("get_hot", checked[0], checked[1])
                    pairs.add("raw_checked_get_hot", checked[2], checked[1])
                cold_modes = _pick(reads.modes, cold)
                print(
                    f"file {data.shape.name}: baseline get_cold {' or '.join(cold_modes)}",
                    file=sys.stderr,
                )
                for rep in range(max(1, reps - 1)):  # each pair writes back and re-reads all
                    for turn in _rotate(rep):
                        if turn == 0:
                            _drop_cache(storage.root, raw_dir)
                            times[0] = runner.run(_get_all(storage, data, keys, args.batch))
                            data.check()
                        else:  # each of the baseline's modes from a cold cache too
                            times[1] = min(cold(mode) for mode in cold_modes)
                    pairs.add("get_cold", *times)
                exists = runner.run(_exists_us(storage, keys))
                raw_exists = _raw_exists_us(paths)
        finally:
            runner.run(storage.close())
            runner.run(fresh.close())
    prefix = f"storage.file.{data.shape.name}"
    return [*pairs.records(prefix, data.total), _exists_record(prefix, exists, raw_exists)]


# memory://


def _dict_put(
    store: dict[bytes, bytearray], keys: list[bytes], data: _Data, spares: list[bytearray]
) -> float:
    """Copy each page behind a header into a buffer of the run before (`spares`, as the
    store writes over its spare buffers), else a new one."""
    header = bytes(HEADER_NBYTES)
    size = HEADER_NBYTES + data.nbytes
    start = time.perf_counter()
    for key, page in zip(keys, data.src, strict=True):
        buffer = spares.pop() if spares else bytearray(size)
        view = memoryview(buffer)
        view[:HEADER_NBYTES] = header
        offset = HEADER_NBYTES
        for segment in page:
            end = offset + segment.nbytes
            view[offset:end] = segment
            offset = end
        store[key] = buffer
    return time.perf_counter() - start


def _dict_get(store: dict[bytes, bytearray], keys: list[bytes], data: _Data) -> float:
    start = time.perf_counter()
    for key, page in zip(keys, data.dst, strict=True):
        value = memoryview(store[key])
        offset = HEADER_NBYTES
        for segment in page:
            end = offset + segment.nbytes
            segment[:] = value[offset:end]
            offset = end
    return time.perf_counter() - start


def _dict_exists_us(store: dict[bytes, bytearray], keys: list[bytes]) -> float:
    probe = _probe(keys)

    def call() -> None:
        for key in probe:  # the same prefix walk MemoryStorage.exists does
            if key not in store:
                break

    return median_us(call, _EXISTS_CALLS)


def _bench_memory(args: argparse.Namespace, data: _Data) -> list[Record]:
    reps = args.reps
    pairs = _Pairs()
    capacity = 2 * data.pages * (data.nbytes + HEADER_NBYTES)
    storage = MemoryStorage.from_url(_memory_url(args.backend, capacity))
    with LoopRunner(fastest_loop_factory()) as runner:
        runner.run(storage.__aenter__())
        try:
            # Untimed: a first put on both sides. Each timed put then follows the removal of
            # the run before, whose buffers the store keeps as spares up to its quota; the
            # baseline reuses as many, and allocates the rest as the store does.
            reused = storage._spare_limit // (data.nbytes + HEADER_NBYTES)
            keys = data.keys()
            runner.run(_put_all(storage, data, keys, args.batch))
            store: dict[bytes, bytearray] = {}
            _dict_put(store, keys, data, [])
            times = [0.0, 0.0]
            for rep in range(reps):
                runner.run(storage.delete(keys))
                spares = list(store.values())[:reused]
                store = {}
                keys = data.keys()
                for turn in _rotate(rep):
                    if turn == 0:
                        times[0] = runner.run(_put_all(storage, data, keys, args.batch))
                    else:
                        times[1] = _dict_put(store, keys, data, spares)
                pairs.add("put", *times)
            for rep in range(2 * reps):
                for turn in _rotate(rep):
                    if turn == 0:
                        times[0] = runner.run(_get_all(storage, data, keys, args.batch))
                        data.check()
                    else:
                        times[1] = _dict_get(store, keys, data)
                        data.check()  # both start from the same state of the buffers
                pairs.add("get", *times)
            exists = runner.run(_exists_us(storage, keys))
            raw_exists = _dict_exists_us(store, keys)
        finally:
            runner.run(storage.close())
    prefix = f"storage.memory.{data.shape.name}"
    return [*pairs.records(prefix, data.total), _exists_record(prefix, exists, raw_exists)]


def _memory_url(url: str, capacity: int) -> str:
    """The given memory:// URL, its parameters kept, with `capacity` added when it has none."""
    head, _, query = url.strip().partition("?")
    if any(part.partition("=")[0] == "capacity" for part in query.split("&")):
        return url.strip()
    return f"{head}?{'&'.join(filter(None, (query, f'capacity={capacity}')))}"


# Other schemes.


def _raw_module(scheme: str) -> Any | None:
    # removesuffix, not rstrip: "rediss" is TLS Redis, whose baseline is redis's.
    for name in dict.fromkeys((scheme, scheme.removesuffix("s"))):
        module_name = f"hicache_async.bench._storage_{name}"
        try:
            found = importlib.util.find_spec(module_name) is not None
        except (ImportError, ValueError):  # a scheme with '.' or '-' names no module of ours
            found = False
        if found:
            return importlib.import_module(module_name)
    return None


def _forget_pages(runner: LoopRunner, storage: StorageBackend, keys: list[bytes]) -> None:
    """Delete what a run that failed part-way stored (on a full server it would stay and keep
    it full); the run's own error is what the command reports, not this one's."""
    if keys:
        with contextlib.suppress(Exception):
            runner.run(storage.delete(keys))


def _bench_paired(args: argparse.Namespace, data: _Data, scheme: str, modes: Any) -> list[Record]:
    """Ours against the baseline's best mode, run by run, for a raw module with `RawModes`."""
    reps = args.reps
    pairs = _Pairs()
    storage = open_storage(args.backend)
    with (
        LoopRunner(fastest_loop_factory()) as runner,
        modes(args.backend, data.nbytes, data.pages) as raw,
    ):
        # The baseline's modes: the two best medians of a few trials each, for put and for
        # get (every get reads the last put's values).
        put_modes = _pick(raw.modes, raw.put)
        get_modes = _pick(raw.modes, raw.get)
        put_mode, get_mode = put_modes[0], get_modes[0]
        chosen = f"baseline put {' or '.join(put_modes)}, get {' or '.join(get_modes)}"
        # Where the plain client's speed depends on how it is installed (redis-py's reply
        # parser), which way it ran, and a warning when that is not its fastest.
        parser = getattr(raw, "parser", None)
        if parser is not None:
            chosen += f"; reply parser {parser}"
        warning = getattr(raw, "warning", None)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        print(f"{scheme} {data.shape.name}: {chosen}", file=sys.stderr)
        runner.run(storage.__aenter__())
        keys: list[bytes] = []
        try:
            # One untimed round of ours too (connections, first allocations), as the mode
            # trials were for the baseline.
            keys = data.keys()
            runner.run(_put_all(storage, data, keys, args.batch))
            runner.run(_get_all(storage, data, keys, args.batch))
            ceiling = bool(getattr(raw, "checked_ceiling", False))
            times = [(0.0, 0.0), (0.0, 0.0), (0.0, 0.0)]
            for rep in range(reps):
                for turn in _rotate(rep, 3 if ceiling else 2):
                    if turn == 2:
                        times[2] = (
                            raw.put(put_mode, checked=True),
                            raw.get(get_mode, checked=True),
                        )
                    elif turn == 0:
                        if keys:
                            runner.run(storage.delete(keys))
                        keys = data.keys()
                        put_s = runner.run(_put_all(storage, data, keys, args.batch))
                        get_s = runner.run(_get_all(storage, data, keys, args.batch))
                        data.check()
                        times[0] = (put_s, get_s)
                    else:
                        put_s = min(raw.put(mode) for mode in put_modes)
                        times[1] = (put_s, min(raw.get(mode) for mode in get_modes))
                pairs.add("put", times[0][0], times[1][0])
                pairs.add("get", times[0][1], times[1][1])
                if ceiling:
                    pairs.add("raw_checked_put", times[2][0], times[1][0])
                    pairs.add("raw_checked_get", times[2][1], times[1][1])
            exists = runner.run(_exists_us(storage, keys))
            raw_exists = raw.exists_us(_EXISTS_CALLS)
            runner.run(storage.delete(keys))
            keys = []
        finally:
            try:
                _forget_pages(runner, storage, keys)
            finally:
                runner.run(storage.close())
    prefix = f"storage.{scheme}.{data.shape.name}"
    return [*pairs.records(prefix, data.total), _exists_record(prefix, exists, raw_exists)]


def _bench_other(args: argparse.Namespace, data: _Data, scheme: str | None) -> list[Record]:
    """A scheme with a raw module: paired with it. Otherwise (an entry point's scheme, or a
    plugin's import path, whose records are named `storage.plugin.*`) ours alone."""
    module = _raw_module(scheme) if scheme is not None else None
    if scheme is not None and module is not None:
        return _bench_paired(args, data, scheme, module.RawModes)
    label = scheme or "plugin"
    # No raw way to move the bytes is known for this scheme (a plugin): ours alone.
    reps = args.reps
    ours: dict[str, list[float]] = {"put": [], "get": []}
    storage = open_storage(args.backend)

    async def session() -> float:
        async with storage:
            keys: list[bytes] = []
            try:
                for _ in range(reps):
                    if keys:
                        await storage.delete(keys)
                    keys = data.keys()
                    ours["put"].append(await _put_all(storage, data, keys, args.batch))
                for _ in range(reps):
                    ours["get"].append(await _get_all(storage, data, keys, args.batch))
                    data.check()
                exists = await _exists_us(storage, keys)
                await storage.delete(keys)
                keys = []
            finally:
                if keys:
                    # A run that failed part-way (a full server) leaves none of its pages.
                    with contextlib.suppress(Exception):
                        await storage.delete(keys)
            return exists

    with LoopRunner(fastest_loop_factory()) as runner:
        exists = runner.run(session())
    prefix = f"storage.{label}.{data.shape.name}"
    records = [
        Record(
            name=f"{prefix}.{name}_gbps",
            value=data.total / statistics.median(times) / 1e9,
            unit="GB/s",
        )
        for name, times in ours.items()
    ]
    records.append(_exists_record(prefix, exists, None))
    return records
