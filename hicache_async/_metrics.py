"""Histograms, and the Prometheus exposition of a cache's statistics.

The cache keeps plain counters and fixed-bucket histograms on its loop (no locks, no
dependency); `prometheus_collector()` adapts them for `prometheus-client` (the `prometheus`
extra) and `render_prometheus()` renders the text exposition format.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ._pool import PoolStatistics
from ._stats import TierTokens
from .storage._protocol import StorageStats
from .transfer._protocol import CopyStatistics
from .tree._results import TreeStatistics
from .workers._backup import BackupStatistics
from .workers._prefetch import PrefetchStatistics

if TYPE_CHECKING:
    # Resolved only by type checkers: the `prometheus` extra is optional.
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector

    from ._cache import HiCache

__all__ = ["Histogram", "HistogramSnapshot", "prometheus_collector", "render_prometheus"]

#: Seconds, from 100 µs to about 30 s.
LATENCY_BUCKETS: tuple[float, ...] = tuple(0.0001 * 2**i for i in range(19))


class HistogramSnapshot(msgspec.Struct, frozen=True):
    """Cumulative bucket counts as Prometheus exposes them."""

    buckets: list[tuple[float, int]]
    count: int
    sum: float

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding quantile `q` (0 when empty)."""
        if not self.count:
            return 0.0
        rank = q * self.count
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                return bound
        return float("inf")


class Histogram:
    """A fixed-bucket histogram; `observe` is O(log buckets)."""

    __slots__ = ("_bounds", "_counts", "_name", "_sum")

    def __init__(self, name: str, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self._name = name
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0

    @property
    def name(self) -> str:
        """The name it is exported under (`hicache_<name>_seconds`), fixed for its life."""
        return self._name

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative = 0
        buckets: list[tuple[float, int]] = []
        for bound, count in zip((*self._bounds, float("inf")), self._counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        return HistogramSnapshot(buckets=buckets, count=cumulative, sum=self._sum)


def _flatten(prefix: str, record: Any, kind: type[msgspec.Struct]) -> Iterator[tuple[str, float]]:
    """The numeric fields `kind` declares, of `record`, as (metric name, value).

    Only `kind`'s own fields: a backend's `stats()` (or a copy engine's `statistics()`) may
    answer a subclass, whose extra fields could hold any name (a dict's keys with quotes or
    newlines) or repeat another family's, and make the whole exposition unparseable.
    """
    for field in kind.__struct_fields__:
        value = getattr(record, field, None)
        if isinstance(value, (bool, int, float)):
            yield f"{prefix}_{field}", float(value)


# CacheStatistics fields exported as gauges, the name prefix and the record type of each.
_GAUGE_SECTIONS: tuple[tuple[str, str, type[msgspec.Struct]], ...] = (
    ("tokens", "tier_tokens", TierTokens),
    ("device_pool", "device_pool", PoolStatistics),
    ("host_pool", "host_pool", PoolStatistics),
    ("tree", "tree", TreeStatistics),
    ("copy_engine", "copy_engine", CopyStatistics),
)
# StorageStatus fields exported as gauges, and the record type of each.
_STORAGE_SECTIONS: tuple[tuple[str, type[msgspec.Struct]], ...] = (
    ("storage", StorageStats),
    ("prefetch", PrefetchStatistics),
    ("backup", BackupStatistics),
    ("flushing", BackupStatistics),
)


def _families(cache: HiCache) -> Iterator[tuple[str, str, Any]]:
    """(name, kind, value-or-histogram) for everything the cache exposes."""
    stats = cache.statistics()
    # `tier_tokens`, not `tokens`: the gauge `hicache_tokens_device` would share its family
    # name with the counter `hicache_tokens_device_total`, which OpenMetrics refuses.
    for field, prefix, kind in _GAUGE_SECTIONS:
        record = getattr(stats, field)
        if record is not None:
            for name, value in _flatten(f"hicache_{prefix}", record, kind):
                yield name, "gauge", value
    for name, value in stats.counters.items():
        yield f"hicache_{name}_total", "counter", float(value)
    yield "hicache_live_requests", "gauge", float(stats.live_requests)
    # From the same snapshot: asking the backend's stats() a second time would log a failing
    # one twice per scrape.
    status = stats.storage
    yield "hicache_storage_attached", "gauge", float(status is not None and status.attached)
    for section, kind in _STORAGE_SECTIONS:
        record = None if status is None else getattr(status, section)
        if record is not None:
            for name, value in _flatten(f"hicache_{section}", record, kind):
                yield name, "gauge", value
    for histogram in cache._histograms():
        yield f"hicache_{histogram.name}_seconds", "histogram", histogram.snapshot()


def render_prometheus(cache: HiCache) -> str:
    """The cache's metrics in the Prometheus text exposition format (version 0.0.4)."""
    lines: list[str] = []
    for name, kind, value in _families(cache):
        lines.append(f"# TYPE {name} {kind}")
        if kind == "histogram":
            for bound, count in value.buckets:
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f'{name}_bucket{{le="{le}"}} {count}')
            lines.append(f"{name}_count {value.count}")
            lines.append(f"{name}_sum {value.sum!r}")
        else:
            lines.append(f"{name} {value!r}")
    return "\n".join(lines) + "\n"


def prometheus_collector(cache: HiCache) -> Collector:
    """A `prometheus_client` collector for `cache`; register it with a registry.

    Needs the `prometheus` extra. Collection reads the cache's statistics, so the registry
    must be scraped from the cache's event loop thread (e.g. an ASGI `/metrics` route).
    """
    try:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
    except ModuleNotFoundError as exc:
        # As the lazy exports' messages: still what `except ModuleNotFoundError` callers
        # catch, naming the package and the extra that brings it.
        raise ModuleNotFoundError(
            "prometheus_collector needs the 'prometheus_client' package: "
            "pip install 'hicache-async[prometheus]'",
            name=exc.name,
        ) from exc

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            for name, kind, value in _families(cache):
                if kind == "histogram":
                    buckets = [
                        ("+Inf" if b == float("inf") else repr(b), c) for b, c in value.buckets
                    ]
                    yield HistogramMetricFamily(name, name, buckets=buckets, sum_value=value.sum)
                elif kind == "counter":
                    yield CounterMetricFamily(name.removesuffix("_total"), name, value=value)
                else:
                    yield GaugeMetricFamily(name, name, value=value)

    return _Collector()
