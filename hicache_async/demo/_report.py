"""The demo's summary (a msgspec Struct, so `--json` is its encoding), its text form, and the
progress bar drawn on stderr while the replay runs."""

from __future__ import annotations

import sys
import time
from typing import TextIO

import msgspec

__all__ = [
    "BytesMoved",
    "DemoSummary",
    "LogitCheck",
    "Progress",
    "TTFTStats",
    "TierTokenCounts",
    "format_summary",
]


class TierTokenCounts(msgspec.Struct, frozen=True):
    """Prompt tokens of the hicache server by where their KV came from; they add up to the
    prompt tokens."""

    device: int
    host: int
    storage: int
    computed: int


class TTFTStats(msgspec.Struct, frozen=True):
    """Time to first token (arrival to first token, queueing included), in seconds."""

    p50_s: float
    p99_s: float
    mean_s: float


class BytesMoved(msgspec.Struct, frozen=True):
    """KV bytes moved between tiers by the hicache server (its final drain included)."""

    host_to_device: int
    device_to_host: int
    storage_read: int
    storage_written: int


class LogitCheck(msgspec.Struct, frozen=True):
    """The cached path's first-token logits against the baseline's, request by request."""

    compared: int
    max_abs_diff: float
    argmax_agreement: float


class DemoSummary(msgspec.Struct, frozen=True):
    """Everything the demo measured."""

    requests: int
    prompt_tokens: int
    max_prompt_tokens: int
    trace_seconds: float
    time_compression: float
    concurrency: int
    model: str
    model_parameters: int
    kv_bytes_per_token: int
    device: str
    threads: int
    storage: str | None
    #: pages the storage held when the cache opened (from earlier runs, with --keep-storage)
    storage_pages_at_start: int
    device_pages: int
    host_pages: int
    page_size: int
    write_policy: str
    prefetch_policy: str
    tokens: TierTokenCounts
    #: share of prompt tokens the hicache server did not compute
    hit_rate: float
    #: prompt tokens any cache could have served (blocks whose prefix was seen earlier)
    upper_bound_tokens: int
    #: the best hit rate any cache could reach on these requests
    upper_bound_rate: float
    #: tokens served from the cache over `upper_bound_tokens`
    share_of_upper_bound: float
    ttft_baseline: TTFTStats
    ttft_hicache: TTFTStats
    #: baseline TTFT over cached TTFT
    speedup_p50: float
    speedup_p99: float
    #: time each server's model thread was busy
    compute_baseline_s: float
    compute_hicache_s: float
    #: first arrival to each server's last first token
    last_token_baseline_s: float
    last_token_hicache_s: float
    bytes: BytesMoved
    device_evicted_pages: int
    host_evicted_pages: int
    check: LogitCheck
    seconds: float


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_summary(s: DemoSummary) -> str:
    """The summary as the text `hicache-async demo` prints."""
    total = max(s.prompt_tokens, 1)
    lines = [
        f"replayed {s.requests} multi-turn trace requests ({s.prompt_tokens:,} prompt tokens, "
        f"prompts <= {s.max_prompt_tokens:,}; {s.trace_seconds:.0f} s of trace at "
        f"{s.time_compression:g}x, {s.concurrency} in flight) in {s.seconds:.1f} s",
        f"model {s.model}: {s.model_parameters / 1e6:.1f}M parameters, "
        f"KV {s.kv_bytes_per_token:,} B/token, on {s.device} ({s.threads} threads)",
        f"cache: {s.device_pages} device + {s.host_pages} host pages of {s.page_size} tokens, "
        f"{s.write_policy}, prefetch {s.prefetch_policy}, storage {s.storage or 'none'}",
        "",
        "prompt tokens of the hicache server",
    ]
    for label, value in (
        ("device (L1)", s.tokens.device),
        ("host (L2)", s.tokens.host),
        ("storage (L3)", s.tokens.storage),
        ("recomputed", s.tokens.computed),
    ):
        lines.append(f"  {label:<14} {value:>10,}  {100 * value / total:5.1f}%")
    lines += [
        f"  hit rate {100 * s.hit_rate:.1f}% of an upper bound of {100 * s.upper_bound_rate:.1f}%"
        f" (any cache, however large): {100 * s.share_of_upper_bound:.1f}% of the reachable reuse",
    ]
    if s.storage_pages_at_start:
        lines.append(
            f"  (storage held {s.storage_pages_at_start:,} pages from earlier runs; the bound "
            "counts reuse within this run only, so storage hits can take the rate past it)"
        )
    lines += [
        "",
        "time to first token      p50        p99       mean",
    ]
    for label, t in (("without cache", s.ttft_baseline), ("with hicache", s.ttft_hicache)):
        p50, p99, mean = t.p50_s * 1e3, t.p99_s * 1e3, t.mean_s * 1e3
        lines.append(f"  {label:<16} {p50:8.0f} ms {p99:7.0f} ms {mean:7.0f} ms")
    lines += [
        f"  speedup          {s.speedup_p50:10.2f}x {s.speedup_p99:9.2f}x",
        f"  model busy {s.compute_baseline_s:.1f} s without cache, "
        f"{s.compute_hicache_s:.1f} s with it; last first token after "
        f"{s.last_token_baseline_s:.1f} s and {s.last_token_hicache_s:.1f} s",
        "",
        "KV bytes moved",
        f"  host -> device (loads)       {_size(s.bytes.host_to_device):>10}",
        f"  device -> host (backups)     {_size(s.bytes.device_to_host):>10}",
        f"  storage -> host (reads)      {_size(s.bytes.storage_read):>10}",
        f"  host -> storage (writes)     {_size(s.bytes.storage_written):>10}",
        f"  evicted: {s.device_evicted_pages:,} device pages, {s.host_evicted_pages:,} host pages",
        "",
        f"first-token logits vs. the baseline over {s.check.compared} requests: max abs "
        f"difference {s.check.max_abs_diff:.2e}, argmax agreement "
        f"{100 * s.check.argmax_agreement:.1f}%",
    ]
    return "\n".join(lines)


class Progress:
    """A one-line progress bar with a count per lane (e.g. "baseline" and "hicache"), redrawn
    in place on a terminal; silent elsewhere (a log file or a pipe gets nothing rather than
    hundreds of carriage returns)."""

    _WIDTH = 30

    def __init__(
        self, lanes: dict[str, int], *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._totals = dict(lanes)
        self._done = dict.fromkeys(lanes, 0)
        self._began = time.perf_counter()
        isatty = getattr(self._stream, "isatty", None)
        self._enabled = enabled and bool(isatty and isatty())
        self._drawn = False

    def done(self, lane: str) -> int:
        """Steps of `lane` completed so far."""
        return self._done[lane]

    def advance(self, lane: str, steps: int = 1) -> None:
        """Count `steps` more of `lane` as done."""
        self._done[lane] = min(self._totals[lane], self._done[lane] + steps)
        self.draw()

    def draw(self) -> None:
        """Redraw the line (on a terminal)."""
        if not self._enabled:
            return
        total = max(1, sum(self._totals.values()))
        filled = self._WIDTH * sum(self._done.values()) // total
        bar = "#" * filled + "-" * (self._WIDTH - filled)
        counts = "  ".join(f"{k} {self._done[k]}/{n}" for k, n in self._totals.items())
        elapsed = time.perf_counter() - self._began
        self._stream.write(f"\r[{bar}] {counts}  {elapsed:5.1f} s")
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the line the bar was drawn on. Idempotent."""
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False
