"""The Prometheus exposition stays parseable whatever the records a backend answers with."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from hicache_async import CacheConfig, HiCache, prometheus_collector
from hicache_async._metrics import Histogram
from hicache_async.storage import MemoryStorage, StorageStats

PAGE = 4
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KINDS = {"counter", "gauge", "histogram"}


def _config() -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
            "page_size": PAGE,
            "device_pages": 16,
            "host_pages": 32,
            "model_id": "metrics-export",
        }
    )


class _ExtendedStats(StorageStats, frozen=True):
    """What a third-party backend may answer: `check_stats` takes a subclass."""

    attached: int = 7
    by_namespace: dict[str, int] = msgspec.field(default_factory=dict)
    hit_ratio: float = 0.5


class _ExtendedStorage(MemoryStorage):
    def stats(self) -> StorageStats:
        base = msgspec.structs.asdict(super().stats())
        return _ExtendedStats(**base, by_namespace={'odd "ns"\\\n': 3, "plain": 1})


def _parse_strictly(text: str) -> dict[str, tuple[str, list[tuple[str, float]]]]:
    """Family name -> (kind, samples) of a text exposition; AssertionError at the first line
    the 0.0.4 format does not allow (a repeated family, a sample outside its family)."""
    families: dict[str, tuple[str, list[tuple[str, float]]]] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ")
            assert len(parts) == 4, line
            _, word, name, kind = parts
            assert word == "TYPE", line
            assert _NAME.fullmatch(name), line
            assert kind in _KINDS, line
            assert name not in families, f"family {name} repeated"
            families[name] = (kind, [])
            current = name
            continue
        match = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{le="[^"\\\n]*"\})? (\S+)', line)
        assert match is not None, line
        assert current is not None, line
        kind, samples = families[current]
        name = match.group(1)
        suffixes = ("_bucket", "_count", "_sum") if kind == "histogram" else ("",)
        assert any(name == current + suffix for suffix in suffixes), line
        samples.append((name, float(match.group(3))))
    return families


async def test_a_stats_subclass_with_extra_fields_leaves_the_exposition_parseable() -> None:
    # Its dict's keys became metric names (quotes, a newline) and its `attached` repeated
    # the cache's own family: Prometheus refused the whole scrape.
    async with HiCache(_config(), storage=_ExtendedStorage()) as cache:
        status = cache.storage_status()
        assert status.attached
        assert isinstance(status.storage, _ExtendedStats)
        families = _parse_strictly(cache.metrics_text())
        assert families["hicache_storage_attached"] == (
            "gauge",
            [("hicache_storage_attached", 1.0)],
        )
        storage = {name for name in families if name.startswith("hicache_storage_")}
        # The fields StorageStats declares (capacity_bytes is set here), and no others.
        declared = {f"hicache_storage_{f}" for f in StorageStats.__struct_fields__[1:]}
        histograms = {"hicache_storage_get_batch_seconds", "hicache_storage_put_batch_seconds"}
        assert storage == {"hicache_storage_attached", *declared, *histograms}

        prometheus_client: Any = pytest.importorskip("prometheus_client")
        from prometheus_client.openmetrics.exposition import generate_latest
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
        from prometheus_client.parser import (
            text_string_to_metric_families as text_families,
        )

        assert {f.name for f in text_families(cache.metrics_text())} >= storage
        registry = prometheus_client.CollectorRegistry()
        registry.register(prometheus_collector(cache))
        parsed = list(text_string_to_metric_families(generate_latest(registry).decode()))
        assert {f.name for f in parsed} >= storage


async def test_the_collector_without_its_extra_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As every other export that needs an extra: a ModuleNotFoundError naming the package
    # and the extra, raised when the collector is asked for.
    import sys

    for name in [m for m in sys.modules if m.split(".")[0] == "prometheus_client"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if it were not installed
    async with HiCache(_config()) as cache:
        with pytest.raises(
            ModuleNotFoundError,
            match=r"prometheus_collector needs the 'prometheus_client' package: "
            r"pip install 'hicache-async\[prometheus\]'",
        ) as raised:
            prometheus_collector(cache)
    assert (raised.value.name or "").split(".")[0] == "prometheus_client"


async def test_a_caches_histograms_and_their_names_cannot_be_replaced() -> None:
    # Replaced, a histogram started again from zero (an exported count going down) or
    # was exported under another name.
    async with HiCache(_config()) as cache:
        cache.prefetch_wait.observe(0.5)
        for name in ("prefetch_wait", "storage_get_latency", "storage_put_latency"):
            with pytest.raises(AttributeError):
                setattr(cache, name, Histogram(name))
            with pytest.raises(AttributeError):
                getattr(cache, name).name = "other"
        assert cache.prefetch_wait.snapshot().count == 1
        assert "hicache_prefetch_wait_seconds_count 1" in cache.metrics_text()
