"""What a cache logs while its store fails every call: each kind of failure once, with the
backend and the error, then at most once a minute, however many requests and batches fail;
the counters keep the totals."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from _log_table import assert_documented

from hicache_async import CacheConfig, HiCache
from hicache_async._ratelog import LogLimiter, describe_error
from hicache_async.storage import FileStorage, ManifestEntry, MemoryStorage, Outcome, PageMeta
from hicache_async.storage._redis import RedisStorage
from hicache_async.testing import FaultyStorage, KVGenerator, RedisServer, serve

PAGE = 4
REQUESTS = 30
PROMPT_PAGES = 3
IO_TIMEOUT_S = 0.05

#: Logged at every failed prefetch or backup batch before the rate limit.
REPEATED = ("hicache.prefetch.exists.failed", "hicache.backup.put.failed", "hicache.backup.dropped")


def _config() -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "storm",
            "prefetch": {
                "policy": "wait_complete",
                "threshold_tokens": PAGE,
                "batch_pages": 4,
                "io_timeout_s": IO_TIMEOUT_S,
            },
            "backup": {
                "batch_pages": 4,
                "max_retries": 1,
                "retry_backoff_s": 0.001,
                "io_timeout_s": IO_TIMEOUT_S,
            },
        }
    )


@pytest.mark.parametrize("fault", ["error", "hang"])
async def test_a_store_failing_every_call_logs_each_failure_once(fault: str) -> None:
    rates = {"error_rate": 1.0} if fault == "error" else {"hang_rate": 1.0}
    faulty = FaultyStorage(MemoryStorage(), seed=1, **rates)
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=3)
    rng = np.random.default_rng(7)
    with structlog.testing.capture_logs() as logs:
        async with HiCache(config, storage=faulty) as cache:
            for n in range(REQUESTS):
                # A new prompt each time: every prefetch asks the store, every commit is
                # backed up.
                prompt = rng.integers(0, 30_000, size=PROMPT_PAGES * PAGE)
                await serve(cache, prompt, generator, request_id=f"r{n}")
                await cache.drain()
            status = cache.storage_status()
    assert status.prefetch is not None
    assert status.backup is not None
    # Every request failed in storage, and the counters say so.
    assert status.prefetch.errors == REQUESTS * PROMPT_PAGES
    assert status.prefetch.skipped == REQUESTS
    assert status.backup.failed_pages == REQUESTS * PROMPT_PAGES
    assert status.backup.written_pages == 0
    events = [entry["event"] for entry in logs]
    expected = "injected fault" if fault == "error" else f"no answer within {IO_TIMEOUT_S:g} s"
    for event in REPEATED:
        # Once, or twice where the run took longer than the limit's interval; never once
        # per request.
        assert 1 <= events.count(event) <= 2, (event, events.count(event))
    for entry in logs:
        assert "exc_info" not in entry, entry
        if entry["event"] in REPEATED:
            assert entry["backend"] == faulty.name
            assert entry["unlogged_since_last"] >= 0
        if entry["event"] in REPEATED[:2]:
            assert expected in entry["error"], entry
    # Each line has the fields operations.md's table gives its event, no others.
    assert assert_documented(logs, exact=REPEATED) >= len(REPEATED)


async def test_backup_lines_count_the_pages_of_the_lines_left_out() -> None:
    # Every batch's failed put and dropped pages are a line each before the limit: those
    # left out must keep how many pages they were about, not only how many lines.
    faulty = FaultyStorage(MemoryStorage(), seed=1, error_rate=1.0)
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=3)
    rng = np.random.default_rng(7)
    now = [0.0]
    with structlog.testing.capture_logs() as logs:
        async with HiCache(config, storage=faulty) as cache:
            link = cache._link
            assert link is not None
            link.backup._log_limit = LogLimiter(60.0, clock=lambda: now[0])
            for n in range(6):
                if n == 5:
                    now[0] = 60.0  # a minute later: the last request's lines are told
                    retried_before = link.backup.retried_pages
                prompt = rng.integers(0, 30_000, size=PROMPT_PAGES * PAGE)
                await serve(cache, prompt, generator, request_id=f"r{n}")
                await cache.drain()
            failed, retried = link.backup.failed_pages, link.backup.retried_pages
    assert failed == 6 * PROMPT_PAGES
    assert retried == failed  # one retry each

    def told(event: str) -> int:
        lines = [e for e in logs if e["event"] == event]
        assert len(lines) == 2, lines
        return sum(e["pages"] + e["unlogged_pages_since_last"] for e in lines)

    assert told("hicache.backup.dropped") == failed
    assert assert_documented(logs, exact=["hicache.backup.dropped", "hicache.backup.put.failed"])
    # The last request's retry comes after its first try was told: left out for good.
    assert told("hicache.backup.put.failed") == failed + retried_before


def test_the_limiter_tells_each_kind_at_once_and_repeats_once_per_interval() -> None:
    now = [0.0]
    limiter = LogLimiter(60.0, max_kinds=3, clock=lambda: now[0])
    assert limiter.admit("put", "refused") == 0
    assert limiter.admit("put", "refused") is None
    assert limiter.admit("put", "refused") is None
    # Another error, or another event, is news.
    assert limiter.admit("put", "timed out") == 0
    assert limiter.admit("get", "refused") == 0
    now[0] = 59.0
    assert limiter.admit("put", "refused") is None
    now[0] = 60.0
    # The next record of a kind tells how many were left out since the last one.
    assert limiter.admit("put", "refused") == 3
    assert limiter.admit("put", "refused") is None
    # Past max_kinds, new errors of an event share one kind: the table cannot grow.
    assert limiter.admit("put", "new 1") == 0
    assert limiter.admit("put", "new 2") is None
    assert limiter.admit("put", "new 3") is None


def test_a_line_told_after_lines_left_out_sums_what_they_were_about() -> None:
    # A line per put's eviction names how many pages stayed: the lines left out must not
    # lose those pages, only how many lines there were.
    now = [0.0]
    limiter = LogLimiter(60.0, clock=lambda: now[0])
    with structlog.testing.capture_logs() as logs:
        for pages in (3, 5, 7, 11):
            limiter.warn_tallied(structlog.get_logger(), "evict", "refused", "pages", pages=pages)
        now[0] = 60.0
        limiter.warn_tallied(structlog.get_logger(), "evict", "refused", "pages", pages=2)
        limiter.warn_tallied(structlog.get_logger(), "evict", "refused", "pages", pages=4)
    told = [(e["pages"], e["unlogged_since_last"], e["unlogged_pages_since_last"]) for e in logs]
    assert told == [(3, 0, 0), (2, 3, 23)]
    # A kind logged again starts from nothing.
    now[0] = 120.0
    assert limiter.admit_counting("evict", "refused", 1) == (1, 4)


class _CountingManifest:
    """A manifest that counts the entries asked of its appends, then passes them on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.asked = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def append(self, entries: list[ManifestEntry]) -> None:
        self.asked += len(entries)
        await self.inner.append(entries)


async def test_failed_manifest_appends_count_the_entries_of_the_lines_left_out(
    tmp_path: Path,
) -> None:
    # Every backup batch appends its chains' records: with the manifest refused (a FIFO
    # planted in its place), a line per batch comes before the limit, and those left out
    # must keep how many entries they were about.
    async with FileStorage(tmp_path):
        pass
    fifo = tmp_path / "manifest.jsonl"
    os.mkfifo(fifo, 0o600)
    # Held open at both ends: an open of it that should not happen cannot block the test.
    held = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    config = _config()
    generator = KVGenerator(config.layout, PAGE, seed=3)
    rng = np.random.default_rng(11)
    now = [0.0]
    try:
        with structlog.testing.capture_logs() as logs:
            async with HiCache(config, storage=FileStorage(tmp_path)) as cache:
                link = cache._link
                assert link is not None
                link.backup._log_limit = LogLimiter(60.0, clock=lambda: now[0])
                manifest = _CountingManifest(link.backup._manifest)
                link.backup._manifest = manifest
                for n in range(5):
                    if n == 4:
                        now[0] = 60.0  # a minute later: the last request's line is told
                    prompt = rng.integers(0, 30_000, size=PROMPT_PAGES * PAGE)
                    await serve(cache, prompt, generator, request_id=f"r{n}")
                    await cache.drain()
                assert link.backup.manifest_entries == 0
    finally:
        os.close(held)
    lines = [e for e in logs if e["event"] == "hicache.manifest.append.failed"]
    assert len(lines) == 2, lines
    assert all("a FIFO, not a regular file" in e["error"] for e in lines)
    assert lines[1]["unlogged_since_last"] > 0
    assert sum(e["entries"] + e["unlogged_entries_since_last"] for e in lines) == manifest.asked
    assert assert_documented(lines, exact=["hicache.manifest.append.failed"]) == 2


def test_a_tallied_count_may_be_any_integer_but_not_a_bool() -> None:
    # Page counts often come from numpy (a batch's mask summed): such a count is a count,
    # and is logged as a plain int; a bool is a flag passed by mistake.
    now = [0.0]
    limiter = LogLimiter(60.0, clock=lambda: now[0])
    with structlog.testing.capture_logs() as logs:
        limiter.warn_tallied(structlog.get_logger(), "evict", "x", "pages", pages=np.int64(3))
        limiter.warn_tallied(structlog.get_logger(), "evict", "x", "pages", pages=np.int32(4))
        now[0] = 60.0
        limiter.warn_tallied(structlog.get_logger(), "evict", "x", "pages", pages=np.uint8(5))
    told = [(e["pages"], e["unlogged_pages_since_last"]) for e in logs]
    assert told == [(3, 0), (5, 4)]
    assert all(type(e["pages"]) is int for e in logs)
    for flag in (True, np.bool_(True)):
        with pytest.raises(TypeError, match="'pages'"):
            limiter.warn_tallied(structlog.get_logger(), "evict", "x", "pages", pages=flag)
    with pytest.raises(TypeError, match="not an integer"):
        limiter.warn_tallied(structlog.get_logger(), "evict", "x", "pages", pages=2.0)
    # Refused counts add nothing to what the next line tells.
    now[0] = 120.0
    assert limiter.admit_counting("evict", "x", 0) == (0, 0)


def test_kinds_quiet_for_an_hour_make_room_for_new_failures() -> None:
    # A process that runs for weeks meets many kinds of errors: those of long ago must not
    # fill the table for good, or every new failure after them shares one kind with the
    # others and is left out behind them.
    now = [0.0]
    limiter = LogLimiter(60.0, max_kinds=3, clock=lambda: now[0])
    for text in ("old 1", "old 2", "old 3"):
        assert limiter.admit("put", text) == 0
    # Within the hour the table stays full: errors whose text changes at every call get no
    # line each.
    now[0] = 600.0
    assert limiter.admit("put", "disk full") == 0
    assert limiter.admit("put", "timed out") is None
    now[0] = 3600.0
    assert limiter.admit("put", "refused") == 0
    assert limiter.admit("put", "reset") == 0
    assert limiter.admit("put", "refused") is None
    # The kind shared within the hour, logged in the last one, is kept with its count.
    assert limiter.admit("put", "closed") == 1
    assert len(limiter._kinds) <= 3 + 1


def test_records_of_a_kind_forgotten_are_told_by_its_event_shared_line() -> None:
    # Kinds quiet for an hour with records left out make room only when nothing else
    # does: what they left out (lines and pages) must not go with them.
    now = [0.0]
    limiter = LogLimiter(60.0, max_kinds=2, clock=lambda: now[0])
    assert limiter.admit_counting("put", "old 1", 3) == (0, 0)
    assert limiter.admit_counting("put", "old 1", 4) is None
    assert limiter.admit_counting("put", "old 2", 5) == (0, 0)
    assert limiter.admit_counting("put", "old 2", 6) is None
    now[0] = 3600.0
    # Room made for a new kind: told at once, as a new kind is.
    assert limiter.admit_counting("put", "new 1", 7) == (0, 0)
    now[0] = 3601.0
    # The table full again: the next new kind shares its event's kind, whose line tells
    # the two records and 10 pages of the kinds forgotten.
    assert limiter.admit_counting("put", "new 2", 8) == (2, 10)
    assert len(limiter._kinds) <= 2 + 1


def test_a_timeout_says_how_long_the_call_was_given() -> None:
    assert describe_error(TimeoutError(), 0.25) == "TimeoutError: no answer within 0.25 s"
    assert describe_error(TimeoutError("slow"), 0.25) == "TimeoutError('slow')"
    assert describe_error(ValueError("x"), 0.25) == "ValueError('x')"


def _pages(
    count: int, salt: int, nbytes: int = 64
) -> tuple[list[bytes], list[list[memoryview]], list[PageMeta]]:
    keys = [bytes([salt, i]) * 16 for i in range(count)]
    pages = [[memoryview(bytearray(b"p" * nbytes))] for _ in range(count)]
    metas = [PageMeta(key=key, namespace=b"n" * 16, num_tokens=PAGE) for key in keys]
    return keys, pages, metas


async def test_a_stopped_redis_server_is_logged_once_not_per_batch() -> None:
    with RedisServer() as server:
        async with RedisStorage.from_url(f"{server.url}?timeout=0.2") as backend:
            keys, pages, metas = _pages(2, 0)
            assert await backend.put(keys, pages, metas) == [Outcome.OK] * 2
            pid = server.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                with structlog.testing.capture_logs() as logs:
                    for batch in range(1, 9):
                        assert await backend.put(*_pages(2, batch)) == [Outcome.ERROR] * 2
            finally:
                os.kill(pid, signal.SIGCONT)
    failed = [entry for entry in logs if entry["event"] == "storage.redis.put_failed"]
    assert 1 <= len(failed) <= 2, len(failed)
    assert failed[0]["backend"] == backend.name
    assert backend.stats().errors == 16


async def test_a_file_store_refused_every_write_logs_it_once_not_per_batch(tmp_path: Path) -> None:
    async with FileStorage(tmp_path / "s") as storage:
        with structlog.testing.capture_logs() as logs:
            # Pages of 64 bytes and their header: the file size limit refuses every one.
            old = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64, old[1]))
            try:
                for batch in range(8):
                    assert await storage.put(*_pages(2, batch)) == [Outcome.MISS] * 2
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, old)
        assert storage.refused_writes == 16
    errors = [entry for entry in logs if entry["event"] == "storage.page.error"]
    assert 1 <= len(errors) <= 2, len(errors)
    assert errors[0]["count"] == 2
    assert errors[0]["backend"] == storage.name


async def test_a_page_error_line_counts_the_pages_of_the_lines_left_out(tmp_path: Path) -> None:
    now = [0.0]
    async with FileStorage(tmp_path / "s") as storage:
        storage._page_errors_log = LogLimiter(60.0, clock=lambda: now[0])
        with structlog.testing.capture_logs() as logs:
            old = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64, old[1]))
            try:
                for batch, count in enumerate((2, 3, 5, 7)):
                    assert await storage.put(*_pages(count, batch)) == [Outcome.MISS] * count
                now[0] = 60.0  # a minute later: the next batch's line gets through
                assert await storage.put(*_pages(1, 9)) == [Outcome.MISS]
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, old)
    errors = [entry for entry in logs if entry["event"] == "storage.page.error"]
    told = [(e["count"], e["unlogged_since_last"], e["unlogged_count_since_last"]) for e in errors]
    # The three batches left out failed 15 pages: the log keeps them, not only 3 lines.
    assert told == [(2, 0, 0), (1, 3, 15)]
    assert assert_documented(errors, exact=["storage.page.error"]) == 2


def _chattr(flag: str, paths: list[Path]) -> None:
    for path in paths:
        done = subprocess.run(["chattr", flag, str(path)], capture_output=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"chattr {flag} does not work here: {done.stderr.decode().strip()}")


async def test_files_puts_cannot_evict_are_logged_once_not_per_put(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with FileStorage(root, capacity_bytes=20 * 1200, spare_bytes=0) as storage:
        assert await storage.put(*_pages(16, 0, 1000)) == [Outcome.OK] * 16
        files = [path for path in (root / "pages").rglob("*") if path.is_file()]
        try:
            # Immutable (`chattr +i`): even root cannot unlink them, so every put's eviction
            # meets them again.
            _chattr("+i", files)
            with structlog.testing.capture_logs() as logs:
                for batch in range(1, 21):
                    assert await storage.put(*_pages(4, batch, 1000)) == [Outcome.OK] * 4
        finally:
            _chattr("-i", files)
        assert storage.stats().errors > 20  # each file that stayed, each time
    stayed = [entry for entry in logs if entry["event"] == "storage.evict.error"]
    assert 1 <= len(stayed) <= 2, len(stayed)
    assert stayed[0]["error"] == os.strerror(1)  # EPERM, without the file's name
    assert stayed[0]["backend"] == storage.name


async def test_a_put_eviction_line_counts_the_pages_of_the_lines_left_out(tmp_path: Path) -> None:
    root = tmp_path / "s"
    now = [0.0]
    async with FileStorage(root, capacity_bytes=20 * 1200, spare_bytes=0) as storage:
        storage._page_errors_log = LogLimiter(60.0, clock=lambda: now[0])
        assert await storage.put(*_pages(16, 0, 1000)) == [Outcome.OK] * 16
        files = [path for path in (root / "pages").rglob("*") if path.is_file()]
        try:
            _chattr("+i", files)
            with structlog.testing.capture_logs() as logs:
                for batch in range(1, 11):
                    assert await storage.put(*_pages(4, batch, 1000)) == [Outcome.OK] * 4
                stayed_before = storage.stats().errors  # each file that stayed, each time
                now[0] = 60.0  # a minute later: the next put's line gets through
                assert await storage.put(*_pages(4, 11, 1000)) == [Outcome.OK] * 4
        finally:
            _chattr("-i", files)
    first, last = [entry for entry in logs if entry["event"] == "storage.evict.error"]
    assert first["unlogged_pages_since_last"] == 0
    assert last["unlogged_since_last"] >= 1
    # The lines left out were about every page that stayed but those of the first line.
    assert last["unlogged_pages_since_last"] == stayed_before - first["pages"]
    assert assert_documented([first, last]) == 2
