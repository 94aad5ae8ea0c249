"""Histograms, and the Prometheus exposition of a cache's statistics.

The cache keeps plain counters and fixed-bucket histograms on its loop (no locks, no
dependency); `prometheus_collector()` adapts them for `prometheus-client` (the `prometheus`
extra) and `render_prometheus()` renders the text exposition format.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import re
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from ._errors import WrongThreadError
from ._extras import missing_module
from ._pool import PoolStatistics
from ._ratelog import LogLimiter
from ._stats import Counters, TierTokens
from .storage._protocol import StorageStats
from .transfer._protocol import CopyStatistics
from .tree._results import TreeStatistics
from .workers._backup import BackupStatistics
from .workers._prefetch import PrefetchStatistics

if TYPE_CHECKING:
    import asyncio

    # Resolved only by type checkers: the `prometheus` extra is optional.
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector, CollectorRegistry

    from ._cache import HiCache
else:
    # Not imported at run time (the extra is optional, and the cache imports this module):
    # tools that read hints at run time (typing.get_type_hints, beartype, sphinx) see these
    # as Any rather than fail.
    HiCache = Metric = Collector = CollectorRegistry = Any

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


def _families(cache: HiCache, *, unentered: bool = False) -> Iterator[tuple[str, str, Any]]:
    """(name, kind, value-or-histogram) for everything the cache exposes. `unentered`: read
    off the owner's thread a cache not entered yet, which nothing changes meanwhile."""
    stats = cache._snapshot(cache._tree._counts()) if unentered else cache.statistics()
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


# Prometheus label names; `__`-prefixed ones are reserved for its own use.
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Labels the exported families already carry: a histogram's bucket bound.
_OWN_LABELS = frozenset({"le"})


def _described(histograms: set[str]) -> Iterator[tuple[str, str]]:
    """(name, kind) of every family a cache can export, whatever its state (storage attached
    or not): what a registry checks for clashes at `register`, so a second collector of these
    names is refused there rather than exporting the same series twice, and what it looks a
    collector up by for a scrape asking for some names (`/metrics?name[]=...`)."""
    for _, prefix, kind in _GAUGE_SECTIONS:
        for field in kind.__struct_fields__:
            yield f"hicache_{prefix}_{field}", "gauge"
    for name in Counters.__slots__:
        yield f"hicache_{name}_total", "counter"
    yield "hicache_live_requests", "gauge"
    yield "hicache_storage_attached", "gauge"
    for section, kind in _STORAGE_SECTIONS:
        for field in kind.__struct_fields__:
            yield f"hicache_{section}_{field}", "gauge"
    for name in sorted(histograms):
        yield f"hicache_{name}_seconds", "histogram"


_FIX = (
    "give each cache labels and the registry: "
    "prometheus_collector(cache, labels={'cache': 'a'}, registry=registry)"
)

_Labels = tuple[tuple[str, str], ...]


def _check_labels(labels: Mapping[str, str] | None) -> _Labels:
    """`labels` as (name, value) pairs, in order; ValueError or TypeError naming the first
    that Prometheus, or this exposition, does not allow."""
    if labels is None:
        return ()
    if not isinstance(labels, Mapping):
        raise TypeError(f"labels must be a mapping of str to str, not {type(labels).__name__}")
    pairs: list[tuple[str, str]] = []
    for name, value in labels.items():
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name):
            raise ValueError(
                f"label name {name!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)"
            )
        if name.startswith("__"):
            raise ValueError(f"label name {name!r}: names starting with '__' are reserved")
        if name in _OWN_LABELS:
            raise ValueError(f"label name {name!r} is the histograms' bucket label")
        if not isinstance(value, str):
            raise TypeError(f"label {name!r} must be a str, not {type(value).__name__}")
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            # A lone surrogate (`os.fsdecode` of undecodable bytes): the exposition is UTF-8,
            # and encoding it would fail every later scrape of the whole registry.
            raise ValueError(
                f"label {name!r} must be UTF-8 text: {exc.reason} at index {exc.start}"
            ) from None
        pairs.append((name, value))
    return tuple(pairs)


_log = structlog.get_logger("hicache_async")

#: How long a collection off a cache's loop thread waits for that loop to read the cache: well
#: under Prometheus's default scrape timeout (10 s), so the rest of the registry still answers
#: while the loop is held.
_LOOP_WAIT_S = 5.0
_LIMITER = LogLimiter()

_Family = tuple[str, str, Any]


def _read_on(loop: asyncio.AbstractEventLoop, caches: list[HiCache]) -> list[list[_Family]] | None:
    """Each cache's families, read on `loop` (the caches' owner) and waited for from this
    thread; None when the loop is not running or does not answer within `_LOOP_WAIT_S`."""
    if loop.is_closed() or not loop.is_running():
        return None  # nothing would run the read: skipped rather than waited for
    future: concurrent.futures.Future[list[list[_Family]]] = concurrent.futures.Future()

    def read() -> None:
        if not future.set_running_or_notify_cancel():
            return  # the collection gave up first
        try:
            future.set_result([list(_families(cache)) for cache in caches])
        except BaseException as exc:
            future.set_exception(exc)

    try:
        loop.call_soon_threadsafe(read)
    except RuntimeError:  # closed since the check
        return None
    try:
        return future.result(timeout=_LOOP_WAIT_S)
    except concurrent.futures.TimeoutError:
        if not future.cancel():
            return future.result()  # began meanwhile: a read takes no time to finish
    unlogged = _LIMITER.admit("hicache.metrics.loop_unresponsive")
    if unlogged is not None:
        _log.warning(
            "hicache.metrics.loop_unresponsive",
            caches=len(caches),
            waited_s=_LOOP_WAIT_S,
            unlogged_since_last=unlogged,
        )
    return None


def _read(members: list[tuple[HiCache, _Labels]]) -> list[tuple[_Labels, list[_Family]]]:
    """Each member's labels and families, read on its loop's thread: the statistics are the
    loop's own state, which another thread (prometheus_client's `start_http_server`) must
    not read while the loop changes it. Members that could not be read are left out."""
    read: list[list[_Family] | None] = [None] * len(members)
    elsewhere: dict[asyncio.AbstractEventLoop, list[int]] = {}
    for index, (cache, _) in enumerate(members):
        if cache._owner.on_owner_thread():
            try:
                read[index] = list(_families(cache))
                continue
            except WrongThreadError:
                if cache._owner.on_owner_thread():
                    raise  # not a move to another thread (a forked child's read): as before
                # Entered on another thread since the check (its first step binds it there):
                # read on that loop, as any entered cache.
        loop = cache.loop
        if loop is None:
            # Not entered: nothing changes a cache before `__aenter__`, whose first step binds
            # its loop, so a read that ends with the loop still unbound saw a still cache.
            families = list(_families(cache, unentered=True))
            loop = cache.loop
            if loop is None:
                read[index] = families
                continue
        elsewhere.setdefault(loop, []).append(index)
    for loop, indexes in elsewhere.items():
        answers = _read_on(loop, [members[index][0] for index in indexes])
        if answers is not None:
            for index, families in zip(indexes, answers, strict=True):
                read[index] = families
    return [
        (labels, families)
        for (_, labels), families in zip(members, read, strict=True)
        if families is not None
    ]


class _Collector:
    """The `prometheus_client` collector of one or more caches, their series told apart by
    their labels. One family per name across the caches, as both exposition formats
    require."""

    def __init__(self) -> None:
        # Weak: a registry (the process-wide one above all) must not keep a cache alive, nor
        # its labels taken, once the application has let go of it.
        self._members: list[tuple[weakref.ref[HiCache], _Labels]] = []
        self._lock = threading.Lock()  # a scrape's thread prunes as a joining cache adds

    def _live(self) -> list[tuple[HiCache, _Labels]]:
        """The members still exported, pruning the others: a closed cache's series would
        stay at their last values for ever, and its labels could not go to the cache that
        replaces it (the same model's cache made again)."""
        with self._lock:
            live: list[tuple[HiCache, _Labels]] = []
            kept: list[tuple[weakref.ref[HiCache], _Labels]] = []
            for ref, labels in self._members:
                cache = ref()
                if cache is not None and cache.state != "closed":
                    live.append((cache, labels))
                    kept.append((ref, labels))
            self._members = kept
            return live

    def _add(self, cache: HiCache, labels: _Labels) -> None:
        members = self._live()
        if any(member is cache for member, _ in members):
            raise ValueError("this cache's collector is already registered in this registry")
        if members:
            names = [name for name, _ in members[0][1]]
            if not names or not labels:
                raise ValueError(
                    "another cache's collector is registered in this registry, and "
                    "without labels both would export the same series: " + _FIX
                )
            if sorted(name for name, _ in labels) != sorted(names):
                raise ValueError(
                    f"label names {[name for name, _ in labels]} differ from {names}, the "
                    "names of the other caches in this registry: give every cache the same names"
                )
            # The same names in another order: the values go in the registry's order.
            given = dict(labels)
            labels = tuple((name, given[name]) for name in names)
            if any(other == labels for _, other in members):
                raise ValueError(f"labels {dict(labels)} are already another cache's here")
        with self._lock:
            self._members.append((weakref.ref(cache), labels))

    def describe(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        histograms = {h.name for cache, _ in self._live() for h in cache._histograms()}
        for name, kind in _described(histograms):
            if kind == "histogram":
                yield HistogramMetricFamily(name, name)
            elif kind == "counter":
                yield CounterMetricFamily(name.removesuffix("_total"), name)
            else:
                yield GaugeMetricFamily(name, name)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        members = self._live()
        label_names = [name for name, _ in members[0][1]] if members else []
        families: dict[str, Any] = {}
        for labels, read in _read(members):
            values = [value for _, value in labels]
            for name, kind, value in read:
                family = families.get(name)
                if kind == "histogram":
                    if family is None:
                        family = HistogramMetricFamily(name, name, labels=label_names)
                    buckets = [
                        ("+Inf" if b == float("inf") else repr(b), c) for b, c in value.buckets
                    ]
                    family.add_metric(values, buckets, value.sum)
                elif kind == "counter":
                    if family is None:
                        family = CounterMetricFamily(
                            name.removesuffix("_total"), name, labels=label_names
                        )
                    family.add_metric(values, value)
                else:
                    if family is None:
                        family = GaugeMetricFamily(name, name, labels=label_names)
                    family.add_metric(values, value)
                families[name] = family
        yield from families.values()


# The collector `prometheus_collector(..., registry=r)` registered in each registry, so a
# second cache joins it: one family per name, whichever caches export it.
_BY_REGISTRY: weakref.WeakKeyDictionary[Any, _Collector] = weakref.WeakKeyDictionary()
_BY_REGISTRY_LOCK = threading.Lock()


def prometheus_collector(
    cache: HiCache,
    *,
    labels: Mapping[str, str] | None = None,
    registry: CollectorRegistry | None = None,
) -> Collector:
    """A `prometheus_client` collector for `cache`; register it with a registry.

    Needs the `prometheus` extra. Collection reads the cache's statistics on its event loop:
    from another thread (prometheus_client's `start_http_server`) it hands the reading to that
    loop and waits up to 5 s, leaving out of the scrape a cache whose loop does not answer. A
    cache not entered yet is read by the collecting thread itself.

    `labels` (label name to value) are added to every series of the cache. `registry`
    registers the collector there; a later call naming the same registry adds its cache to
    that collector, so several caches export one family per name, told apart by their labels
    (every cache needs labels then, with the same names and different values). Without
    `registry`, registering a second cache's collector in one registry raises
    `ValueError` (prometheus_client's `DuplicateTimeseries`). A cache closed or
    garbage-collected is no longer exported, and its labels are free for another cache.
    """
    try:
        import prometheus_client.core  # noqa: F401 - the extra, checked before anything else
    except ModuleNotFoundError as exc:
        # As the lazy exports' messages: still what `except ModuleNotFoundError` callers
        # catch, naming the package and the extra that brings it.
        raise missing_module("prometheus_collector", exc, "prometheus") from exc
    pairs = _check_labels(labels)
    if registry is None:
        alone = _Collector()
        alone._add(cache, pairs)
        return alone
    with _BY_REGISTRY_LOCK:
        collector: _Collector | None = _BY_REGISTRY.get(registry)
        if collector is not None:
            try:
                # Unregistered and registered again around the change, so the registry never
                # sees a half-changed collector and one unregistered since is noticed.
                registry.unregister(collector)
            except KeyError:
                collector = None  # unregistered by the application: start afresh
        if collector is None:
            collector = _Collector()
            collector._add(cache, pairs)
            try:
                registry.register(collector)
            except ValueError as exc:
                # A collector of these names registered without `registry`.
                raise ValueError(f"{exc}: {_FIX}") from exc
            _BY_REGISTRY[registry] = collector
            return collector
        try:
            collector._add(cache, pairs)
        finally:
            registry.register(collector)  # with the new cache, or as it was
        return collector
