"""`hicache-async bench orchestration`: what the prefetch path (storage → host) costs beyond the
storage backend's own `get`.

Two parts, each under the default asyncio loop and under uvloop (the `bench` extra; without
it, under asyncio's loop alone, said once, unless `--loops` names uvloop: exit 2):

- `memory`: the orchestration's own cost. Prompts whose pages are in a `memory://` store are
  prefetched (`HiCache.prefetch`, policy `wait_complete`) into the host pool with tiny pages
  (1 layer, 1 KV head, head dim 8, fp16, 16-token pages: 512 B), so moving bytes costs next to
  nothing and what is left is hashing the prompt into keys, the hop to a prefetch worker,
  `exists`, planning, allocating host pages, the backend call and landing pages in the tree.
  Figures: pages per second and loop-thread CPU microseconds per page (`time.thread_time()`
  deltas on the loop thread; `MemoryStorage` copies batches this small on the loop, so the loop
  thread does all the work), one prompt at a time (`sequential`) and every prompt submitted at
  once (`concurrent`). Baseline: `MemoryStorage.get` of the same pages into the same host pages
  in the same batches (`prefetch.batch_pages`). `keys_us_per_page` is the hashing share.
- `file`: throughput with realistic pages. Prompts of `--shape` pages (default llama8b: 32
  layers x 8 KV heads x 128 x fp16 x 64 tokens = 8 MiB) in a `file://` store (a temporary root
  under the user's cache directory, page cache hot) are prefetched into a host pool of layout
  `page_first_direct` (one segment per page) and `layer_first` (2 x layers segments per page).
  Baseline: `FileStorage.get` of the same keys into the same host-pool pages in the same
  batches. The two run back to back, taking turns to go first; throughput is from the median
  times and the ratio is the median of the per-pair ratios (target >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._config import CacheConfig, HostLayout, KVLayout
from ..cli._args import positive_int
from ..storage import FileStorage, MemoryStorage, Outcome, PageMeta, StorageBackend, default_root
from ._records import Record
from ._runner import UVLOOP_EXTRA, LoopRunner, say_asyncio_fallback, uvloop_factory

__all__ = ["SHAPES", "Shape", "add_arguments", "describe", "prepare", "run"]

describe = "prefetch path: loop CPU per page (memory://, tiny pages), GB/s vs raw get (file://)"

_LAYOUTS: tuple[HostLayout, ...] = ("page_first_direct", "layer_first")
_LOOPS = ("asyncio", "uvloop")
_PARTS = ("memory", "file")
_VOCAB = 128_000
# Prompts the file part rotates through; the host pool holds two, so each prefetch evicts the
# least recently landed one and the pages it reads are never already there.
_FILE_PROMPTS = 3


class Shape(NamedTuple):
    """A KV page: `layers` x K and V x `kv_heads` x `head_dim`, `page_size` tokens."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across every layer, K and V."""
        return KVLayout(**self.layout()).page_nbytes(self.page_size)

    def layout(self) -> dict[str, Any]:
        """The `CacheConfig.layout` mapping of this shape."""
        return {
            "num_layers": self.layers,
            "num_kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }


SHAPES = {
    # Llama-3-8B, fp16, 64-token pages: 8 MiB.
    "llama8b": Shape("llama8b", 32, 8, 128, "float16", 64),
    # A Qwen2.5-0.5B-sized model, bf16, 64-token pages: 768 KiB.
    "small": Shape("small", 24, 2, 64, "bfloat16", 64),
}
_TINY = Shape("tiny", 1, 1, 8, "float16", 16)


def _names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {', '.join(allowed)}; got {text!r}"
            )
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hicache-async bench orchestration`."""
    parser.add_argument(
        "--parts", type=_names(_PARTS), default=list(_PARTS), help="memory,file (default both)"
    )
    parser.add_argument(
        "--loops",
        type=_names(_LOOPS),
        default=None,
        help="asyncio,uvloop (default both; asyncio alone where uvloop is not installed)",
    )
    parser.add_argument(
        "--layouts",
        type=_names(_LAYOUTS),
        default=list(_LAYOUTS),
        help="host layouts of the file part (default page_first_direct,layer_first)",
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="llama8b", help="file part page shape"
    )
    parser.add_argument(
        "--pages",
        type=positive_int,
        default=32,
        help="pages per prompt in the file part (default 32)",
    )
    parser.add_argument(
        "--reps", type=positive_int, default=7, help="rounds per figure; medians count (default 7)"
    )
    parser.add_argument(
        "--prompts",
        type=positive_int,
        default=64,
        help="prompts per memory-part round (default 64)",
    )
    parser.add_argument(
        "--prompt-pages",
        type=positive_int,
        default=64,
        help="pages per prompt in the memory part (default 64)",
    )
    parser.add_argument(
        "--batch-pages",
        type=positive_int,
        default=None,
        help="prefetch.batch_pages (default: the configuration's default); the raw get uses "
        "the same batches",
    )
    parser.add_argument(
        "--root",
        default=None,
        help="directory for the temporary file store (default: the user's cache directory)",
    )


def _loops(args: argparse.Namespace) -> list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]]:
    """(name, factory) of the loops to run under. Without uvloop, a default run goes on
    asyncio's loop alone (said once); `--loops` naming uvloop is a ValueError naming the extra."""
    uvloop = uvloop_factory()
    names: list[str] = list(_LOOPS) if args.loops is None else args.loops
    if uvloop is None and "uvloop" in names:
        if args.loops is not None:
            raise ValueError(f"--loops uvloop: uvloop is not installed: {UVLOOP_EXTRA}")
        say_asyncio_fallback()
        names = [name for name in names if name != "uvloop"]
    return [
        (name, uvloop if name == "uvloop" and uvloop else asyncio.new_event_loop) for name in names
    ]


def _config(
    shape: Shape, host_pages: int, host_layout: HostLayout, batch_pages: int | None = None
) -> CacheConfig:
    prefetch: dict[str, Any] = {
        "policy": "wait_complete",
        "threshold_tokens": shape.page_size,
        "max_host_share": 1.0,
    }
    if batch_pages is not None:
        prefetch["batch_pages"] = batch_pages
    return CacheConfig.from_dict(
        {
            "layout": shape.layout(),
            "page_size": shape.page_size,
            "device_pages": 1,
            "host_pages": host_pages,
            "host_layout": host_layout,
            "device": "cpu",
            "model_id": f"bench-orchestration-{shape.name}",
            "write_policy": "write_back",
            "prefetch": prefetch,
        }
    )


def _prompt(seed: int, num_pages: int, page_size: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, _VOCAB, size=num_pages * page_size, dtype=np.uint32)


async def _store(
    storage: StorageBackend, cache: Any, keys: list[bytes], page: memoryview, batch: int
) -> None:
    """Put the pages of `keys` (storage keys) with `page` as every page's bytes, as the
    cache's backup would."""
    fingerprint = cache.namespace.fingerprint
    size = cache.config.page_size
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        metas = [PageMeta(key=k, namespace=fingerprint, num_tokens=size) for k in part]
        outcomes = await storage.put(part, [[page]] * len(part), metas)
        if any(o is not Outcome.OK for o in outcomes):
            raise SystemExit(f"{storage.name}: could not store the benchmark's pages")


def _batch_limit(cache: Any, storage: StorageBackend) -> int:
    """Pages per `get` the prefetcher issues: the raw baseline uses the same."""
    limit: int = min(cache.config.prefetch.batch_pages, storage.capabilities.max_batch_pages)
    return limit


async def _raw_get(
    storage: StorageBackend, cache: Any, keys: list[bytes], into: list[Any], batch: int
) -> None:
    """`get` of `keys` (storage keys) into `into`, `batch` pages per call."""
    fingerprint = cache.namespace.fingerprint
    for start in range(0, len(keys), batch):
        outcomes = await storage.get(
            keys[start : start + batch], into[start : start + batch], namespace=fingerprint
        )
        if any(o is not Outcome.OK for o in outcomes):
            raise SystemExit(f"{storage.name}: raw get missed pages the prefetch had read")


def _host_buffers(cache: Any, keys: list[bytes]) -> list[Any]:
    """The host-pool segments holding `keys` (all of them must be on the host)."""
    found = cache.tree.match(keys, touch=False)
    if found.num_device_pages or found.num_host_pages != len(keys):
        raise SystemExit("a prefetched prompt is not (only) in the host pool")
    host = cache.host_pool
    return [host.page_segments(p) for p in found.host_pages]


class _Timer:
    """Wall and loop-thread CPU seconds of a block (enter and leave on the loop thread)."""

    def __enter__(self) -> _Timer:
        self.wall = time.perf_counter()
        self.cpu = time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.thread_time() - self.cpu


# memory: the orchestration's own cost.


async def _memory_part(args: argparse.Namespace) -> dict[str, list[float]]:
    from .._cache import HiCache

    shape = _TINY
    per_round = args.prompts * args.prompt_pages
    rounds = 2 * args.reps
    config = _config(shape, per_round * rounds + 1, "page_first_direct", args.batch_pages)
    storage = MemoryStorage(capacity_bytes=1 << 40)
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    async with HiCache(config, storage=storage) as cache:
        page = memoryview(bytearray(config.page_nbytes))
        batch = _batch_limit(cache, storage)
        prompts = [
            _prompt(seed, args.prompt_pages, shape.page_size)
            for seed in range(args.prompts * rounds)
        ]
        all_keys = [cache.keys_for(p) for p in prompts]
        stored = [cache.namespace.storage_keys(k) for k in all_keys]
        for keys in stored:
            await _store(storage, cache, keys, page, 1024)
        expected = args.prompt_pages * shape.page_size
        for rep in range(args.reps):
            seq = range(2 * rep * args.prompts, (2 * rep + 1) * args.prompts)
            conc = range((2 * rep + 1) * args.prompts, (2 * rep + 2) * args.prompts)
            with _Timer() as t:
                for i in seq:
                    result = await cache.prefetch(prompts[i])
                    if result.storage_tokens != expected:
                        raise SystemExit(f"prefetch read {result.storage_tokens} tokens")
            add("sequential.wall", t.wall)
            add("sequential.cpu", t.cpu)
            with _Timer() as t:
                handles = [await cache.start_prefetch(prompts[i]) for i in conc]
                results = [await h.wait() for h in handles]
            if any(r.storage_tokens != expected for r in results):
                raise SystemExit("a concurrent prefetch did not read every page")
            add("concurrent.wall", t.wall)
            add("concurrent.cpu", t.cpu)
            buffers = [_host_buffers(cache, all_keys[i]) for i in seq]
            with _Timer() as t:
                for i, into in zip(seq, buffers, strict=True):
                    await _raw_get(storage, cache, stored[i], into, batch)
            add("raw.wall", t.wall)
            add("raw.cpu", t.cpu)
            with _Timer() as t:
                for i in seq:
                    cache.keys_for(prompts[i])
            add("keys.cpu", t.cpu)
    return samples


def _memory_records(loop: str, samples: dict[str, list[float]], pages: int) -> list[Record]:
    """Records from per-round samples; `pages` is pages per round."""
    med = {name: statistics.median(values) for name, values in samples.items()}
    prefix = f"orchestration.memory.{loop}"
    records = []
    for mode in ("sequential", "concurrent"):
        records.append(
            Record.compare(
                f"{prefix}.{mode}.pages_per_s",
                pages / med[f"{mode}.wall"],
                "pages/s",
                pages / med["raw.wall"],
            )
        )
        records.append(
            Record.compare(
                f"{prefix}.{mode}.loop_us_per_page",
                med[f"{mode}.cpu"] / pages * 1e6,
                "us",
                med["raw.cpu"] / pages * 1e6,
            )
        )
    records.append(Record(f"{prefix}.keys_us_per_page", med["keys.cpu"] / pages * 1e6, "us"))
    return records


# file: GB/s against the raw get.


async def _file_part(
    args: argparse.Namespace, shape: Shape, host_layout: HostLayout, parent: Path
) -> dict[str, list[float]]:
    from .._cache import HiCache

    work = Path(tempfile.mkdtemp(prefix="hicache-bench-orchestration-", dir=parent))
    samples: dict[str, list[float]] = {}
    try:
        num = args.pages
        config = _config(shape, 2 * num, host_layout, args.batch_pages)
        storage = FileStorage(work / "store")
        async with HiCache(config, storage=storage) as cache:
            page = memoryview(bytearray(np.random.default_rng(1).bytes(config.page_nbytes)))
            batch = _batch_limit(cache, storage)
            prompts = [_prompt(seed, num, shape.page_size) for seed in range(_FILE_PROMPTS)]
            keys = [cache.keys_for(p) for p in prompts]
            stored = [cache.namespace.storage_keys(k) for k in keys]
            for k in stored:
                await _store(storage, cache, k, page, 16)
            expected = num * shape.page_size

            async def prefetch(i: int) -> _Timer:
                with _Timer() as t:
                    result = await cache.prefetch(prompts[i])
                if result.storage_tokens != expected:
                    raise SystemExit(f"prefetch read {result.storage_tokens} of {expected} tokens")
                return t

            async def raw(i: int) -> _Timer:
                into = _host_buffers(cache, keys[i])
                with _Timer() as t:
                    await _raw_get(storage, cache, stored[i], into, batch)
                return t

            # Warm up: the first prompt, both ways, not counted.
            await prefetch(_FILE_PROMPTS - 1)
            await raw(_FILE_PROMPTS - 1)
            previous = _FILE_PROMPTS - 1
            for rep in range(args.reps):
                current = rep % _FILE_PROMPTS
                if rep % 2 == 0:
                    ours = await prefetch(current)
                    base = await raw(current)
                else:
                    # The previous prompt is still in the host pool: read it raw first.
                    base = await raw(previous)
                    ours = await prefetch(current)
                previous = current
                samples.setdefault("prefetch.wall", []).append(ours.wall)
                samples.setdefault("prefetch.cpu", []).append(ours.cpu)
                samples.setdefault("raw.wall", []).append(base.wall)
                samples.setdefault("raw.cpu", []).append(base.cpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return samples


def _file_records(
    shape: Shape, host_layout: str, loop: str, samples: dict[str, list[float]], pages: int
) -> list[Record]:
    nbytes = pages * shape.page_nbytes
    ours, base = samples["prefetch.wall"], samples["raw.wall"]
    prefix = f"orchestration.file.{shape.name}.{host_layout}.{loop}"
    return [
        Record(
            name=f"{prefix}.prefetch_gbps",
            value=nbytes / statistics.median(ours) / 1e9,
            unit="GB/s",
            baseline=nbytes / statistics.median(base) / 1e9,
            ratio=statistics.median(b / o for o, b in zip(ours, base, strict=True)),
        ),
        Record.compare(
            f"{prefix}.loop_us_per_page",
            statistics.median(samples["prefetch.cpu"]) / pages * 1e6,
            "us",
            statistics.median(samples["raw.cpu"]) / pages * 1e6,
        ),
    ]


def prepare(args: argparse.Namespace) -> Path:
    """Check the sizes and the loops asked for (ValueError) and make the parent of the
    temporary store (OSError); return that parent."""
    batch = 1 if args.batch_pages is None else args.batch_pages  # None: the config's default
    if args.loops is not None:
        _loops(args)  # a uvloop run asked for where it is not installed: before the parent
    if min(args.pages, args.reps, args.prompts, args.prompt_pages, batch) < 1:
        raise ValueError("--pages, --reps, --prompts, --prompt-pages, --batch-pages must be >= 1")
    parent = Path(args.root) if args.root else default_root().parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return parent


def run(args: argparse.Namespace) -> list[Record]:
    """Run the chosen parts under the chosen loops."""
    parent = prepare(args)
    shape = SHAPES[args.shape]
    records: list[Record] = []
    for loop, factory in _loops(args):
        if "memory" in args.parts:
            with LoopRunner(factory) as runner:
                samples = runner.run(_memory_part(args))
            records += _memory_records(loop, samples, args.prompts * args.prompt_pages)
        if "file" in args.parts:
            for host_layout in args.layouts:
                with LoopRunner(factory) as runner:
                    samples = runner.run(_file_part(args, shape, host_layout, parent))
                records += _file_records(shape, host_layout, loop, samples, args.pages)
    return records
