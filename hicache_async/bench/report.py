"""`python -m hicache_async.bench.report`: run every benchmark, keep their JSON, regenerate
docs/benchmarks.md from it.

Each benchmark runs as its own `python -m hicache_async bench KIND --json PATH ...` process, so a
crash, a hang (`--timeout`) or a missing module costs that benchmark only: the page then says
what happened instead of showing figures. The page is rebuilt from the JSON files alone, with
the hand-written preface below, so `--render-only` can regenerate it without rerunning.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec

from .._extras import install_hint
from ..cli._args import positive_float
from . import BENCHMARKS
from ._records import Record

__all__ = ["Job", "JobResult", "PREFACE", "jobs", "main", "render"]

#: The hand-written part of docs/benchmarks.md; everything after it is generated.
PREFACE = f"""\
# Benchmarks

Figures on this page are generated: `nox -s bench` (or `python -m hicache_async.bench.report`)
runs every benchmark, writes each one's records as JSON and rebuilds this page from them, so it
shows one real run. Every speed figure is a ratio against a baseline measured in the same
process and the same run, because absolute figures on a shared or virtual machine mean little;
read the *ratio* column. A throughput ratio above 1 is better than the baseline; for times (µs,
seconds) below 1 is.

`storage` runs on uvloop and `orchestration` under both asyncio's loop and uvloop, which the
`bench` extra brings (`{install_hint("bench")}`; `nox -s bench` and
`scripts/setup.sh --dev` install it). Without it, `hicache-async bench` runs on asyncio's loop
and says so once on stderr (its figures are then not comparable with a run on uvloop), and
`hicache-async bench orchestration --loops uvloop` exits with status 2, naming the extra.

How the two sides are timed:

- `storage` throughputs and `orchestration`'s `prefetch_gbps`: in pairs, back to back and in
  alternating order; `value` and `baseline` are the medians of each side and `ratio` the
  median of the pairs' ratios, so it need not equal `value / baseline`. The same runs'
  `loop_us_per_page` compares the medians of each side: `ratio` is `value / baseline`.
- `storage` `exists64_us`: the median of as many calls on each side; `ratio` is
  `value / baseline`.
- `copy`: each round times the plain copy, then the engine's; `value` and `baseline` are the
  best round of each side and `ratio` is `value / baseline`.
- The `memory://` part of `orchestration`: each round runs the prefetches (one at a time, then
  all at once) before the baseline; `value` and `baseline` are the medians of each side and
  `ratio` is `value / baseline`.

What each benchmark measures, and what it must reach:

- **tree**: the radix tree on the first requests of the packaged chat trace: key hashing per
  request, match and insert per call, memory per cached token. No baseline (it is the baseline
  other paths are compared with).
- **copy**: device ↔ host page copies through the CPU copy engine, for both host layouts and
  contiguous or scattered pages, against one plain `tensor.copy_` of as many bytes.
  **Target: ≥ 0.9x the plain copy.**
- **storage**: `put`, `get` and `exists` of each backend against a raw baseline moving the same
  bytes, the fastest plain-Python way found in the same run: for `file://`, `os.pwritev` and
  `os.preadv` on one file per page, writes on 1, 2, 4 and 8 threads, reads (page cache hot
  and cold) in three ways (one call, header then page, 128 KiB pieces) on 2, 4 and 8 threads;
  a dict of bytes for `memory://`; redis-py for `redis://`, several pipelined and asyncio
  ways (its fastest parser, `hiredis`, only when that is installed: the run says which it
  used, and warns otherwise); the Mooncake client's own batch calls for `mooncake://`. Where
  there are several ways, each is tried twice and the two best by median both run in every
  pair, the faster counting.
  **Targets: get and put ≥ 0.9x raw; `exists` of 64 keys < 0.1 ms on files.**
- **orchestration**: the prefetch path (storage → host pool) end to end. With `memory://` and
  512-byte pages, its own cost: pages per second and loop-thread CPU µs per page, against the
  backend's bare `get` of the same pages into the same host pages. With `file://` and 8 MiB
  pages (Llama-3-8B, 64 tokens), GB/s of `HiCache.prefetch` against `FileStorage.get` of the
  same pages into the same host-pool buffers in the same batches, for host layouts
  `page_first_direct` (one segment per page) and `layer_first` (64 segments per page), under
  the default asyncio loop and uvloop. **Target: prefetch ≥ 0.9x raw get.**
- **trace**: the whole packaged trace (12,031 requests of one hour of chat) through a real
  `HiCache` (tree, pools, copy engine, prefetch and backup workers, `memory://` storage) with
  tiny pages and simulated time, for several host and storage sizes. Hit rates are shares of
  all prompt tokens by the tier they came from, compared with the upper bound an unlimited cache
  reaches on the same requests (a page hits if an earlier request computed the same page of
  the same prefix; per 512-token block, as the trace README counts it, that is 36.6%). TTFT is
  compared with the same replay without any cache.

### How the trace replay models time

A discrete-event simulation ordered by the trace's timestamps; nothing sleeps. A request
arrives, starts a storage prefetch (its pages' bytes over the storage read bandwidth, one
storage channel, first come first served), waits for a free prefill slot and for its prefetch,
loads its host pages (bytes over the host-to-device bandwidth), then computes its uncached
tokens: `n * prefill_s_per_token + (n * p + n * (n + 1) / 2) * attention_s_per_pair` for `n` new
tokens after `p` cached ones. TTFT = finish - arrival. Device-to-host and host-to-storage
backups are off the request path and complete before the next event; decode is not modelled.
Bytes are those of the real model (the cache itself holds 2 bytes per token).

The assumed profile, `llama3-8b-h100`, is derived rather than measured:

- Llama-3-8B (Meta's model card): 8.03 B parameters, 32 layers, hidden size 4096, 8 KV heads of
  dimension 128, bf16, so 2 x 32 x 8 x 128 x 2 B = 128 KiB of KV per token.
- One H100 SXM: 989 TFLOP/s dense bf16 (NVIDIA datasheet); prefill is assumed to reach 50% of
  it. Linear layers: 2 x 8.03e9 FLOP per token → 32.5 µs per token (30.8k tokens/s); attention:
  4 x 32 x 4096 FLOP per (query, key) pair → 1.06 ns per pair.
- Device KV pool: 88% of 80 GB for weights and KV (SGLang's static share on an H100) minus
  16 GB of weights → 414,581 tokens.
- Host → device: 50 GB/s (PCIe 5.0 x16, of its 64 GB/s). Storage → host: 6 GB/s (one PCIe 4.0
  NVMe SSD, ~7 GB/s sequential read, derated).
- One prefill at a time (`--prefill-slots 1`), arrivals stretched 3x (`--time-scale 3`): the
  trace asks for 40k prompt tokens per second, which one GPU cannot prefill (the production
  trace was served by a cluster). Stretching keeps the order, so hit rates change only through
  concurrency; without a cache the GPU is then about 68% busy.
"""

#: Targets checked against the records; (title, name contains, field, comparison, threshold).
_TARGETS: tuple[tuple[str, str, str, str, float], ...] = (
    ("copy ≥ 0.9x tensor.copy_", "copy ", "ratio", ">=", 0.9),
    ("storage put ≥ 0.9x raw", "put_gbps", "ratio", ">=", 0.9),
    ("storage put into new files ≥ 0.9x raw (file)", "put_new_gbps", "ratio", ">=", 0.9),
    ("storage get ≥ 0.9x raw", "get", "ratio", ">=", 0.9),
    ("exists of 64 keys < 0.1 ms (file)", "storage.file.", "value", "<", 100.0),
    ("prefetch ≥ 0.9x raw get", "prefetch_gbps", "ratio", ">=", 0.9),
)


class Job(msgspec.Struct, frozen=True):
    """One benchmark invocation of the report."""

    key: str
    title: str
    kind: str
    args: list[str]
    #: Not run, and why (set when the job cannot run on this machine).
    skipped: str | None = None


class JobResult(msgspec.Struct):
    """What one job left: its command, its outcome and its JSON file's name."""

    key: str
    title: str
    kind: str
    command: str
    status: str  # "ok", "missing", "failed", "skipped"
    detail: str = ""
    seconds: float = 0.0
    json: str | None = None
    #: When it started (UTC), so a page merged from several runs says which is which.
    started: str = ""


def jobs(
    *,
    quick: bool,
    redis: tuple[str | None, str | None] = (None, "not selected"),
    mooncake: tuple[str | None, str | None] = (None, "not selected"),
) -> list[Job]:
    """The benchmarks of a report, full or `quick` sized; `redis` and `mooncake` are each
    (URL of a running server, None) or (None, why that job is skipped)."""
    if quick:
        sizes = {
            "tree": ["--requests", "500", "--repeat", "1"],
            "copy": ["--pages", "4", "--repeats", "2"],
            "storage": ["--shape", "small", "--pages", "32", "--reps", "1"],
            "orchestration": [
                *("--shape", "small", "--pages", "8", "--reps", "3"),
                *("--prompts", "16", "--prompt-pages", "16"),
            ],
            "trace": [
                *("--requests", "1000", "--host-ratios", "2"),
                *("--storages", "off,unbounded"),
            ],
        }
    else:
        sizes = {
            "tree": ["--requests", "3000"],
            "copy": ["--pages", "16", "--repeats", "9"],
            "storage": ["--reps", "7"],
            "orchestration": ["--pages", "32", "--reps", "7"],
            "trace": [],
        }
    # The Redis job measures the small shape only (8 MiB values are unusual there).
    server_args = ["--shape", "small", *(sizes["storage"][2:] if quick else sizes["storage"])]
    return [
        Job(key="tree", title="tree", kind="tree", args=sizes["tree"]),
        Job(key="copy", title="copy", kind="copy", args=sizes["copy"]),
        Job(
            key="storage-file",
            title="storage (file://)",
            kind="storage",
            args=["--backend", "file://", *sizes["storage"]],
        ),
        Job(
            key="storage-memory",
            title="storage (memory://)",
            kind="storage",
            args=["--backend", "memory://", *sizes["storage"]],
        ),
        Job(
            key="storage-redis",
            title="storage (redis://)",
            kind="storage",
            args=["--backend", redis[0] or "redis://", *server_args],
            skipped=redis[1],
        ),
        Job(
            key="storage-mooncake",
            title="storage (mooncake://)",
            kind="storage",
            args=["--backend", mooncake[0] or "mooncake://", *sizes["storage"]],
            skipped=mooncake[1],
        ),
        Job(
            key="orchestration",
            title="orchestration",
            kind="orchestration",
            args=sizes["orchestration"],
        ),
        Job(key="trace", title="trace", kind="trace", args=sizes["trace"]),
    ]


def _command(job: Job, json_path: Path) -> list[str]:
    return [sys.executable, "-m", "hicache_async", "bench", job.kind, "--json", str(json_path)]


def _shown(job: Job) -> str:
    """The command as a reader would type it."""
    words = ["hicache-async", "bench", job.kind, *job.args, "--json", f"{job.key}.json"]
    return shlex.join(words)


def _tail(text: str, lines: int = 6) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def run_job(job: Job, out_dir: Path, timeout_s: float) -> JobResult:
    """Run one benchmark in its own process; never raises for the benchmark's failures."""
    result = JobResult(
        key=job.key,
        title=job.title,
        kind=job.kind,
        command=_shown(job),
        status="ok",
        started=_now(),
    )
    if job.skipped:
        result.status, result.detail = "skipped", job.skipped
        return result
    module = BENCHMARKS.get(job.kind)
    try:
        found = module is not None and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        result.status = "missing"
        result.detail = f"the module of `{job.kind}` ({module or 'unregistered'}) is not installed"
        return result
    json_path = out_dir / f"{job.key}.json"
    with contextlib.suppress(FileNotFoundError):
        json_path.unlink()
    began = time.perf_counter()
    try:
        done = subprocess.run(
            [*_command(job, json_path), *job.args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        result.status, result.detail = "failed", f"did not finish within {timeout_s:.0f} s"
        result.seconds = time.perf_counter() - began
        return result
    result.seconds = time.perf_counter() - began
    (out_dir / f"{job.key}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0 or not json_path.exists():
        result.status = "failed"
        result.detail = f"exit status {done.returncode}: {_tail(done.stderr or done.stdout)}"
        return result
    result.json = json_path.name
    return result


def _read_records(path: Path) -> list[Record]:
    return msgspec.json.decode(path.read_bytes(), type=list[Record])


# The machine.


def _meminfo_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        return None
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:
        return "not installed"


def _git_commit() -> str:
    git = shutil.which("git")
    if git is None:
        return "unknown"
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            [git, "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            [git, "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine() -> dict[str, str]:
    """A description of this machine and software, for the page."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    memory = _meminfo_gib()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": _now(),
        "cpu": _cpu_model(),
        "nproc": str(affinity or os.cpu_count()),
        "memory": f"{memory:.1f} GiB" if memory is not None else "unknown",
        "load average at start": " ".join(f"{x:.2f}" for x in load) if load else "unknown",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "uvloop": _version("uvloop"),
        "redis-py reply parser": _redis_parser(),
        "commit": _git_commit(),
    }


def _redis_parser() -> str:
    """The parser the Redis baseline's redis-py uses here: its speed depends on it."""
    if importlib.util.find_spec("redis") is None:
        return "redis-py not installed"
    from ._storage_redis import parser_name

    return parser_name()


# The page.


def _cell(value: float | None, ratio: bool = False) -> str:
    if value is None:
        return "-"
    if ratio:
        return f"{value:.3f}"
    return f"{value:.4g}"


def _table(records: Sequence[Record]) -> list[str]:
    lines = ["| record | value | unit | baseline | ratio |", "|---|---:|---|---:|---:|"]
    for r in records:
        lines.append(
            f"| `{r.name}` | {_cell(r.value)} | {r.unit} | {_cell(r.baseline)} "
            f"| {_cell(r.ratio, ratio=True)} |"
        )
    return lines


def _compare(value: float, op: str, threshold: float) -> bool:
    return value >= threshold if op == ">=" else value < threshold


def _targets(loaded: dict[str, list[Record]]) -> list[str]:
    records = [r for rs in loaded.values() for r in rs]
    lines = [
        "| target | records | met | worst |",
        "|---|---:|---:|---|",
    ]
    for title, needle, field, op, threshold in _TARGETS:
        chosen = [r for r in records if needle in r.name and _applies(title, r)]
        values = [(getattr(r, field), r) for r in chosen if getattr(r, field) is not None]
        if not values:
            lines.append(f"| {title} | 0 | - | no records in this run |")
            continue
        met = sum(_compare(v, op, threshold) for v, _ in values)
        worst_value, worst = (min if op == ">=" else max)(values, key=lambda item: item[0])
        lines.append(
            f"| {title} | {len(values)} | {met} | `{worst.name}`: "
            f"{worst_value:.3g}{' µs' if field == 'value' else 'x'} |"
        )
    return lines


def _applies(title: str, record: Record) -> bool:
    """Narrow the substring match of a target to the records it is about."""
    name = record.name
    # `raw_checked_*` records measure the baseline itself (its calls plus checksums), not us.
    ours = name.startswith("storage.") and ".raw_" not in name
    if title.startswith("storage put"):
        return ours
    if title.startswith("storage get"):
        return ours and "_gbps" in name and "put" not in name
    if title.startswith("exists"):
        return name.endswith("exists64_us")
    return True


def render(results: Sequence[JobResult], out_dir: Path, info: dict[str, str], quick: bool) -> str:
    """The whole page: preface, machine, targets, then one section per benchmark."""
    loaded: dict[str, list[Record]] = {}
    problems: dict[str, str] = {}
    for result in results:
        if result.json is None:
            continue
        try:
            loaded[result.key] = _read_records(out_dir / result.json)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            problems[result.key] = f"its JSON could not be read: {exc}"
    lines = [PREFACE.rstrip(), "", "## This run", ""]
    if quick:
        lines += ["*A `--quick` run: sizes are cut down and figures are rough.*", ""]
    lines += [f"- **{key}**: {value}" for key, value in info.items()]
    lines += ["", "### Targets", "", *_targets(loaded), ""]
    for result in results:
        lines += [f"## {result.title}", ""]
        describe = _describe(result.kind)
        if describe:
            lines += [f"{describe[0].upper()}{describe[1:]}.", ""]
        lines += ["```", result.command, "```", ""]
        if result.key in loaded:
            records = loaded[result.key]
            took = f"took {result.seconds:.0f} s."
            lines += [f"Ran {result.started}, {took}" if result.started else f"T{took[1:]}", ""]
            if result.kind == "trace":
                lines += [*_trace_summary(records), "", "<details><summary>All records</summary>"]
                lines += ["", *_table(records), "", "</details>", ""]
            else:
                lines += [*_table(records), ""]
        elif result.key in problems:
            lines += [f"**Not shown:** {problems[result.key]}", ""]
        elif result.status == "skipped":
            lines += [f"**Skipped:** {result.detail}", ""]
        elif result.status == "missing":
            lines += [f"**Not run:** {result.detail}.", ""]
        else:
            detail = result.detail.replace("\n", " ⏎ ")
            lines += [f"**Failed** after {result.seconds:.0f} s: {detail}", ""]
    return "\n".join(lines).rstrip() + "\n"


def _trace_summary(records: Sequence[Record]) -> list[str]:
    """One row per replay of `bench trace`: hit rates, TTFT, storage traffic."""
    by = {r.name: r for r in records}
    labels = [
        r.name.removeprefix("trace.").removesuffix(".hit.total")
        for r in records
        if r.name.endswith(".hit.total")
    ]

    def value(name: str) -> float | None:
        record = by.get(name)
        return record.value if record is not None else None

    def pct(share: float | None) -> str:
        return f"{share:.1%}" if share is not None else "-"

    def secs(name: str) -> str:
        record = by.get(name)
        if record is None:
            return "-"
        ratio = f" ({record.ratio:.2f}x)" if record.ratio is not None else ""
        return f"{record.value:.2f} s{ratio}"

    def tb(name: str) -> str:
        gb = value(name)
        return f"{gb / 1000:.2f} TB" if gb is not None else "-"

    lines = []
    bound, blocks = value("trace.bound.token_hit_rate"), value("trace.bound.block_hit_rate")
    if bound is not None:
        lines += [
            f"Upper bound (unlimited cache): {pct(bound)} of prompt tokens, "
            f"{pct(blocks)} of 512-token blocks.",
            "",
        ]
    lines += [
        "| host, storage | device | host | storage | total | of bound | TTFT p50 | TTFT p99 "
        "| read | written | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in labels:
        prefix = f"trace.{label}"
        total = by[f"{prefix}.hit.total"]
        errors = sum(
            int(value(f"{prefix}.{name}") or 0)
            for name in ("prefetch.errors", "prefetch.stuck", "allocation_errors")
        )
        host, _, storage = label.partition(".storage-")
        lines.append(
            f"| {host.removeprefix('host')}, {storage} | {pct(value(f'{prefix}.hit.device'))} "
            f"| {pct(value(f'{prefix}.hit.host'))} | {pct(value(f'{prefix}.hit.storage'))} "
            f"| {pct(total.value)} | {pct(total.ratio)} "
            f"| {secs(f'{prefix}.ttft_p50_s')} | {secs(f'{prefix}.ttft_p99_s')} "
            f"| {tb(f'{prefix}.storage.read_gb')} | {tb(f'{prefix}.storage.written_gb')} "
            f"| {errors} |"
        )
    p50, p99 = value("trace.nocache.ttft_p50_s"), value("trace.nocache.ttft_p99_s")
    if p50 is not None and p99 is not None:
        lines += [
            "",
            f"Host and storage sizes are multiples of the device pool. Without a cache: TTFT "
            f"p50 {p50:.2f} s, p99 {p99:.2f} s (the ratios in brackets compare with these). "
            "Traffic is in bytes of the real model's KV. Errors: failed or stuck prefetches "
            "and failed device allocations.",
        ]
    return lines


def _describe(kind: str) -> str:
    module = BENCHMARKS.get(kind)
    if module is None:
        return ""
    try:
        return str(importlib.import_module(module).describe)
    except Exception:
        return ""


@contextlib.contextmanager
def _server(kind: str, wanted: bool) -> Iterator[tuple[str | None, str | None]]:
    """(url, None) with a private `redis-server` or `mooncake_master` running, or (None, why
    not)."""
    if not wanted:
        yield None, "not selected"
        return
    from ..testing._servers import MooncakeMaster, RedisServer

    server_type = RedisServer if kind == "redis" else MooncakeMaster
    binary = "redis-server" if kind == "redis" else "mooncake_master"
    try:
        server = server_type().start()
    except Exception as exc:
        yield None, f"{binary} did not start: {exc}"
        return
    try:
        yield server.url, None
    finally:
        server.stop()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options; an unknown `--only` key is an error (exit 2) listing the known ones."""
    parser = argparse.ArgumentParser(
        prog="python -m hicache_async.bench.report",
        description="Run every benchmark and regenerate docs/benchmarks.md from their JSON.",
    )
    parser.add_argument(
        "--out-dir", default="build/bench", help="where JSON and logs go (default build/bench)"
    )
    parser.add_argument(
        "--docs",
        default=None,
        help="the page to write (default docs/benchmarks.md; for a --quick run, "
        "OUT_DIR/benchmarks.md; with --render-only, as the stored run was)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated job keys to run (tree, copy, storage-file, storage-memory, "
        "storage-redis, storage-mooncake, orchestration, trace); the others keep their last "
        "results",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=1800.0,
        help="seconds per benchmark (default 1800)",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rebuild the page from the JSON already in OUT_DIR without running anything",
    )
    args = parser.parse_args(argv)
    if args.only is not None:
        known = [job.key for job in jobs(quick=False)]
        args.only = {key.strip() for key in args.only.split(",") if key.strip()}
        unknown = sorted(args.only - set(known))
        if unknown or not args.only:
            # Otherwise nothing would run, and the page would be rewritten without its figures.
            parser.error(
                f"--only: unknown job key(s) {', '.join(unknown) or '(none given)'}; "
                f"known: {', '.join(known)}"
            )
    return args


def _default_page(out_dir: Path, quick: bool) -> Path:
    """A quick run's page goes beside its JSON: only a full run replaces the documentation."""
    return out_dir / "benchmarks.md" if quick else Path("docs") / "benchmarks.md"


def _load_manifest(path: Path) -> tuple[dict[str, str], bool, list[JobResult]] | None:
    """(machine, quick, results) of the last run in `path`, or None."""
    try:
        data = msgspec.json.decode(path.read_bytes())
        return (
            msgspec.convert(data["machine"], dict[str, str]),
            bool(data["quick"]),
            msgspec.convert(data["results"], list[JobResult]),
        )
    except (OSError, KeyError, TypeError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks (or reuse their JSON) and write the page. Exit status 1 when a
    benchmark run by this invocation failed (the page still says how), else 0."""
    args = _parse(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = out_dir / "report.json"
    previous = _load_manifest(manifest)
    failed: list[str] = []
    if args.render_only:
        if previous is None:
            raise SystemExit(f"no readable {manifest}: run the report without --render-only")
        # The stored run says whether it was quick, not this command line.
        info, quick, results = previous
    else:
        info, quick = machine(), args.quick
        wanted: set[str] | None = args.only
        with (
            _server("redis", wanted is None or "storage-redis" in wanted) as redis,
            _server("mooncake", wanted is None or "storage-mooncake" in wanted) as mooncake,
        ):
            planned = jobs(quick=quick, redis=redis, mooncake=mooncake)
            if wanted is not None:
                planned = [job for job in planned if job.key in wanted]
            results = []
            for job in planned:
                print(f"[report] {job.key}: {_shown(job)}", file=sys.stderr, flush=True)
                result = run_job(job, out_dir, args.timeout)
                print(
                    f"[report] {job.key}: {result.status} in {result.seconds:.0f} s "
                    f"{result.detail}".rstrip(),
                    file=sys.stderr,
                    flush=True,
                )
                results.append(result)
                if result.status == "failed":
                    failed.append(job.key)
        if wanted is not None and previous is not None and previous[1] == quick:
            # A partial run replaces its jobs in the last full one; the rest stay.
            merged = {r.key: r for r in previous[2]}
            merged.update((r.key, r) for r in results)
            results = list(merged.values())
        payload = {"machine": info, "quick": quick, "results": results}
        manifest.write_bytes(msgspec.json.format(msgspec.json.encode(payload)) + b"\n")
    docs = Path(args.docs) if args.docs else _default_page(out_dir, quick)
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(render(results, out_dir, info, quick), encoding="utf-8")
    print(f"[report] wrote {docs}", file=sys.stderr)
    if failed:
        print(f"[report] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
