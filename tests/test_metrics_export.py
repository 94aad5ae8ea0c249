"""The Prometheus exposition stays parseable whatever the records a backend answers with."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import msgspec
import pytest

from hicache_async import CacheConfig, HiCache, prometheus_collector
from hicache_async._metrics import Histogram
from hicache_async.storage import MemoryStorage, StorageStats
from hicache_async.testing import KVGenerator

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


def _labelled_config(model_id: str) -> CacheConfig:
    return CacheConfig.from_dict({**_config().to_dict(), "model_id": model_id})


def _block(text: str, family: str) -> list[str]:
    """The lines of `family` in a 0.0.4 exposition, its HELP and TYPE lines first."""
    lines = text.splitlines()
    start = lines.index(f"# HELP {family} {family}")
    end = next((i for i in range(start + 2, len(lines)) if lines[i].startswith("# ")), len(lines))
    return lines[start:end]


async def test_two_labelled_caches_in_one_registry_export_one_family_per_name() -> None:
    # Two collectors in one registry exported every series twice, with nothing to tell the
    # caches apart: a scrape either took the last value or was refused.
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    async with (
        HiCache(_labelled_config("a")) as a,
        HiCache(_labelled_config("b"), storage=MemoryStorage()) as b,
    ):
        a.prefetch_wait.observe(0.5)
        registry = prometheus_client.CollectorRegistry()
        first = prometheus_collector(a, labels={"cache": "a", "rank": "0"}, registry=registry)
        second = prometheus_collector(b, labels={"cache": "b", "rank": "0"}, registry=registry)
        assert second is first
        text = prometheus_client.generate_latest(registry).decode()
        assert _block(text, "hicache_storage_attached") == [
            "# HELP hicache_storage_attached hicache_storage_attached",
            "# TYPE hicache_storage_attached gauge",
            'hicache_storage_attached{cache="a",rank="0"} 0.0',
            'hicache_storage_attached{cache="b",rank="0"} 1.0',
        ]
        assert _block(text, "hicache_requests_total") == [
            "# HELP hicache_requests_total hicache_requests_total",
            "# TYPE hicache_requests_total counter",
            'hicache_requests_total{cache="a",rank="0"} 0.0',
            'hicache_requests_total{cache="b",rank="0"} 0.0',
        ]
        wait = _block(text, "hicache_prefetch_wait_seconds")
        assert 'hicache_prefetch_wait_seconds_bucket{cache="a",le="+Inf",rank="0"} 1.0' in wait
        assert 'hicache_prefetch_wait_seconds_bucket{cache="b",le="+Inf",rank="0"} 0.0' in wait
        assert {
            'hicache_prefetch_wait_seconds_count{cache="a",rank="0"} 1.0',
            'hicache_prefetch_wait_seconds_sum{cache="a",rank="0"} 0.5',
            'hicache_prefetch_wait_seconds_count{cache="b",rank="0"} 0.0',
            'hicache_prefetch_wait_seconds_sum{cache="b",rank="0"} 0.0',
        } <= set(wait)
        # Every family once, every sample labelled; the storage families are b's alone.
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types))
        samples = [line for line in text.splitlines() if not line.startswith("#")]
        assert all('cache="a"' in s or 'cache="b"' in s for s in samples)
        assert _block(text, "hicache_storage_puts")[2:] == [
            'hicache_storage_puts{cache="b",rank="0"} 0.0'
        ]
        # OpenMetrics refuses a family's metadata after its samples (two collectors' blocks).
        parsed = list(text_string_to_metric_families(openmetrics(registry).decode()))
        assert len(parsed) == len(types)


async def test_a_second_unlabelled_cache_in_one_registry_is_refused() -> None:
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    async with HiCache(_labelled_config("a")) as a, HiCache(_labelled_config("b")) as b:
        registry = prometheus_client.CollectorRegistry()
        registry.register(prometheus_collector(a))
        with pytest.raises(ValueError, match="Duplicated timeseries in CollectorRegistry"):
            registry.register(prometheus_collector(b))
        text = prometheus_client.generate_latest(registry).decode()
        assert _block(text, "hicache_live_requests")[2:] == ["hicache_live_requests 0.0"]
        # Through `registry`, the error says what to do, and the registry keeps a's series.
        fix = r"prometheus_collector\(cache, labels=\{'cache': 'a'\}, registry=registry\)"
        for labels in (None, {"cache": "b"}):
            with pytest.raises(ValueError, match=fix):
                prometheus_collector(b, labels=labels, registry=registry)
        registry = prometheus_client.CollectorRegistry()
        prometheus_collector(a, registry=registry)
        for labels in (None, {"cache": "b"}):
            with pytest.raises(ValueError, match=fix):
                prometheus_collector(b, labels=labels, registry=registry)
        assert prometheus_client.generate_latest(registry).decode() == text


@pytest.mark.parametrize(
    ("labels", "error", "message"),
    [
        ({"le": "x"}, ValueError, "the histograms' bucket label"),
        ({"__name__": "x"}, ValueError, "reserved"),
        ({"0cache": "x"}, ValueError, "not a Prometheus label name"),
        ({"cache-name": "x"}, ValueError, "not a Prometheus label name"),
        ({"": "x"}, ValueError, "not a Prometheus label name"),
        ({1: "x"}, ValueError, "not a Prometheus label name"),
        ({"cache": 1}, TypeError, "label 'cache' must be a str, not int"),
        # Taken, it failed every scrape of the registry (UnicodeEncodeError).
        ({"cache": "m\udcff"}, ValueError, "label 'cache' must be UTF-8 text: surrogates not"),
        ([("cache", "a")], TypeError, "labels must be a mapping of str to str, not list"),
    ],
)
async def test_labels_are_checked_when_the_collector_is_made(
    labels: Any, error: type[Exception], message: str
) -> None:
    pytest.importorskip("prometheus_client")
    async with HiCache(_config()) as cache:
        with pytest.raises(error, match=re.escape(message)):
            prometheus_collector(cache, labels=labels)


async def test_caches_joining_a_registry_need_labels_of_the_same_names_and_other_values() -> None:
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    async with (
        HiCache(_labelled_config("a")) as a,
        HiCache(_labelled_config("b")) as b,
        HiCache(_labelled_config("c")) as c,
    ):
        registry = prometheus_client.CollectorRegistry()
        collector = prometheus_collector(a, labels={"cache": "a"}, registry=registry)
        before = prometheus_client.generate_latest(registry).decode()
        for cache, labels, message in [
            (b, {"model": "b"}, "label names ['model'] differ from ['cache']"),
            (b, {"cache": "b", "rank": "0"}, "differ from ['cache']"),
            (b, {"cache": "a"}, "labels {'cache': 'a'} are already another cache's here"),
            (a, {"cache": "z"}, "this cache's collector is already registered"),
        ]:
            with pytest.raises(ValueError, match=re.escape(message)):
                prometheus_collector(cache, labels=labels, registry=registry)
        # Refused, the registry still has the collector as it was.
        assert prometheus_client.generate_latest(registry).decode() == before
        prometheus_collector(b, labels={"cache": "b"}, registry=registry)
        text = prometheus_client.generate_latest(registry).decode()
        assert _block(text, "hicache_live_requests")[2:] == [
            'hicache_live_requests{cache="a"} 0.0',
            'hicache_live_requests{cache="b"} 0.0',
        ]
        # Unregistered by the application, the collector is not joined again.
        registry.unregister(collector)
        prometheus_collector(c, labels={"cache": "c"}, registry=registry)
        text = prometheus_client.generate_latest(registry).decode()
        assert _block(text, "hicache_live_requests")[2:] == ['hicache_live_requests{cache="c"} 0.0']


async def test_a_closed_or_dropped_cache_leaves_the_registry_and_frees_its_labels() -> None:
    # The registry held every cache it was given for ever: a closed cache's series stayed at
    # their last values, the cache was never freed, and the same model's cache made again
    # was refused its labels ("already another cache's here").
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    import gc
    import weakref

    registry = prometheus_client.CollectorRegistry()

    def live_requests() -> list[str]:
        text = prometheus_client.generate_latest(registry).decode()
        return [line for line in text.splitlines() if line.startswith("hicache_live_requests")]

    async with HiCache(_labelled_config("b")) as b:
        async with HiCache(_labelled_config("a")) as a:
            prometheus_collector(a, labels={"model": "a"}, registry=registry)
            prometheus_collector(b, labels={"model": "b"}, registry=registry)
            assert live_requests() == [
                'hicache_live_requests{model="a"} 0.0',
                'hicache_live_requests{model="b"} 0.0',
            ]
        assert live_requests() == ['hicache_live_requests{model="b"} 0.0']
        closed = weakref.ref(a)
        del a
        gc.collect()
        assert closed() is None
        # A cache never entered, then dropped, goes too.
        prometheus_collector(
            HiCache(_labelled_config("c")), labels={"model": "c"}, registry=registry
        )
        gc.collect()
        assert live_requests() == ['hicache_live_requests{model="b"} 0.0']
        async with HiCache(_labelled_config("a")) as again:
            again.prefetch_wait.observe(0.5)
            prometheus_collector(again, labels={"model": "a"}, registry=registry)
            text = prometheus_client.generate_latest(registry).decode()
            assert _block(text, "hicache_live_requests")[2:] == [
                'hicache_live_requests{model="b"} 0.0',
                'hicache_live_requests{model="a"} 0.0',
            ]
            assert 'hicache_prefetch_wait_seconds_count{model="a"} 1.0' in text
    # The last cache closed, the registry has none: an unlabelled cache may take it alone.
    assert live_requests() == []
    async with HiCache(_labelled_config("d")) as d:
        prometheus_collector(d, registry=registry)
        assert live_requests() == ["hicache_live_requests 0.0"]


async def _serve(cache: HiCache, prompts: int) -> None:
    """`prompts` requests that commit their pages: the loop's state changing all along."""
    generator = KVGenerator(cache.config.layout, PAGE)
    for i in range(prompts):
        prompt = list(range(i % 7 * 100, i % 7 * 100 + PAGE * (1 + i % 5)))
        await cache.prefetch(prompt, request_id=f"r{i}")
        with cache.request(prompt, request_id=f"r{i}") as req:
            load = await req.load()
            for layer in range(cache.config.layout.num_layers):
                await load.layer(layer)
            cached = req.cached_tokens
            pages = await req.allocate(len(prompt) - cached)
            for offset, page in enumerate(pages[: (len(prompt) - cached) // PAGE]):
                generator.fill_page(cache.device_pool, page, prompt, cached // PAGE + offset)
            req.commit()
        await asyncio.sleep(0)


async def test_a_registry_scraped_from_prometheus_clients_server_thread_reads_on_the_loop() -> None:
    # The collection ran on the scraping thread and read the loop's own state there: the
    # tree refused it (WrongThreadError), so every scrape of the whole registry, the
    # application's own metrics included, failed with HTTP 500.
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    import urllib.request

    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
    from prometheus_client.openmetrics.parser import text_string_to_metric_families
    from prometheus_client.parser import text_string_to_metric_families as text_families

    registry = prometheus_client.CollectorRegistry()
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    served = threading.Event()

    def scrape() -> int:
        scrapes = 0
        while not served.is_set() or scrapes < 2:
            with urllib.request.urlopen(url, timeout=30) as response:
                text = response.read().decode()
            requests = {
                s.labels["model"]: s.value
                for f in text_families(text)
                if f.name == "hicache_requests"
                for s in f.samples
            }
            assert set(requests) == {"a", "b"}, text
            parsed = list(text_string_to_metric_families(openmetrics(registry).decode()))
            assert any(f.name == "hicache_requests" for f in parsed)
            scrapes += 1
        return scrapes

    try:
        async with (
            HiCache(_labelled_config("a"), storage=MemoryStorage()) as a,
            HiCache(_labelled_config("b"), storage=MemoryStorage()) as b,
        ):
            prometheus_collector(a, labels={"model": "a"}, registry=registry)
            prometheus_collector(b, labels={"model": "b"}, registry=registry)
            scraping = asyncio.ensure_future(asyncio.to_thread(scrape))
            try:
                await asyncio.gather(_serve(a, 60), _serve(b, 60))
            finally:
                served.set()
            assert await scraping >= 2
            # Read after the traffic, from the thread, the figures are the loop's own.
            text = await asyncio.to_thread(
                lambda: prometheus_client.generate_latest(registry).decode()
            )
            assert 'hicache_requests_total{model="a"} 60.0' in text
            assert 'hicache_requests_total{model="b"} 60.0' in text
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_a_scrape_off_the_loop_leaves_out_a_cache_whose_loop_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    from structlog.testing import capture_logs

    from hicache_async import _metrics
    from hicache_async._ratelog import LogLimiter

    monkeypatch.setattr(_metrics, "_LOOP_WAIT_S", 0.01)
    monkeypatch.setattr(_metrics, "_LIMITER", LogLimiter())  # as in a process not yet warned
    registry = prometheus_client.CollectorRegistry()
    async with HiCache(_labelled_config("a")) as a:
        prometheus_collector(a, labels={"model": "a"}, registry=registry)
        scraped: list[str] = []
        scraper = threading.Thread(
            target=lambda: scraped.append(prometheus_client.generate_latest(registry).decode())
        )
        with capture_logs() as logs:
            scraper.start()
            scraper.join()  # holds the loop: the read handed to it cannot run
            await asyncio.sleep(0)  # the read given up runs now, and does nothing
        assert [line for line in scraped[0].splitlines() if "hicache_" in line] == []
        assert [entry for entry in logs if entry["event"].startswith("hicache.metrics")] == [
            {
                "event": "hicache.metrics.loop_unresponsive",
                "log_level": "warning",
                "caches": 1,
                "waited_s": 0.01,
                "unlogged_since_last": 0,
            }
        ]
        # Answering again, the loop's cache is back in the next scrape.
        text = await asyncio.to_thread(lambda: prometheus_client.generate_latest(registry).decode())
        assert 'hicache_live_requests{model="a"} 0.0' in text


async def test_a_scrape_off_its_thread_exports_a_cache_never_entered() -> None:
    # Left out: a cache not entered has no loop to hand the read to, and nothing changes it
    # until it is entered, so the scraping thread reads it as its own thread does.
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    waiting = HiCache(_labelled_config("waiting"))
    prometheus_collector(waiting, labels={"model": "waiting"}, registry=registry)

    def scrape() -> str:
        return str(prometheus_client.generate_latest(registry).decode())

    here = scrape()
    assert 'hicache_live_requests{model="waiting"} 0.0' in here
    assert await asyncio.to_thread(scrape) == here
    async with waiting:  # entered, it is read on its loop as before
        text = await asyncio.to_thread(scrape)
        assert 'hicache_live_requests{model="waiting"} 0.0' in text


def test_a_scrape_on_the_building_thread_while_another_thread_enters_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The scrape saw its own thread as the owner, then the cache was entered on another
    # thread's loop before its statistics were read: they refused the read
    # (WrongThreadError), and the whole scrape failed.
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    from hicache_async._loop import LoopOwner

    registry = prometheus_client.CollectorRegistry()
    cache = HiCache(_labelled_config("moving"))
    prometheus_collector(cache, labels={"model": "moving"}, registry=registry)
    entered, done = threading.Event(), threading.Event()

    async def serve() -> None:
        async with cache:
            entered.set()
            await asyncio.to_thread(done.wait, 60)

    server = threading.Thread(target=asyncio.run, args=(serve(),))
    checked = LoopOwner.on_owner_thread

    def entered_right_after(owner: LoopOwner) -> bool:
        answer = checked(owner)
        if owner is cache._owner and answer and not server.is_alive():
            server.start()
            assert entered.wait(60)
        return answer

    monkeypatch.setattr(LoopOwner, "on_owner_thread", entered_right_after)
    try:
        text = prometheus_client.generate_latest(registry).decode()
    finally:
        done.set()
        if server.ident is not None:
            server.join(60)
    assert server.ident is not None  # the interleaving happened
    assert 'hicache_live_requests{model="moving"} 0.0' in text


async def test_label_names_given_in_another_order_are_the_same_names() -> None:
    # A mapping's order means nothing to its writer: {"rank": ..., "model": ...} after
    # {"model": ..., "rank": ...} was refused as names that "differ".
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    async with (
        HiCache(_labelled_config("a")) as a,
        HiCache(_labelled_config("b")) as b,
        HiCache(_labelled_config("c")) as c,
    ):
        registry = prometheus_client.CollectorRegistry()
        prometheus_collector(a, labels={"model": "a", "rank": "0"}, registry=registry)
        prometheus_collector(b, labels={"rank": "0", "model": "b"}, registry=registry)
        with pytest.raises(ValueError, match=re.escape("labels {'model': 'a', 'rank': '0'} are")):
            prometheus_collector(c, labels={"rank": "0", "model": "a"}, registry=registry)
        text = prometheus_client.generate_latest(registry).decode()
        assert _block(text, "hicache_live_requests")[2:] == [
            'hicache_live_requests{model="a",rank="0"} 0.0',
            'hicache_live_requests{model="b",rank="0"} 0.0',
        ]


async def test_a_scrape_asking_for_some_names_gets_every_family_a_cache_exports() -> None:
    # The registry finds the collectors for `/metrics?name[]=...` by the names they
    # describe: only two were described, so asking for any other family answered nothing.
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families as text_families

    async with HiCache(_labelled_config("a")) as a:
        registry = prometheus_client.CollectorRegistry()
        prometheus_collector(a, labels={"model": "a"}, registry=registry)
        # Storage attached after the registration: its families are found too.
        await a.attach_storage(MemoryStorage())
        everything = list(text_families(prometheus_client.generate_latest(registry).decode()))
        assert any(f.name == "hicache_storage_puts" for f in everything)
        for family in everything:
            sample = family.samples[0].name
            restricted = registry.restricted_registry([sample])
            found = list(text_families(prometheus_client.generate_latest(restricted).decode()))
            assert {s.name for f in found for s in f.samples} == {sample}, sample
