"""The admin ASGI app, through a real uvicorn server on loopback and a real HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import structlog
import uvicorn
from test_file_storage import _keys as _file_keys
from test_file_storage import _put as _file_put

from hicache_async import CacheConfig, CacheStatistics, HiCache, HiCacheError, KVLayout
from hicache_async._errors import StorageConfigError
from hicache_async._ratelog import LogLimiter
from hicache_async.admin import AdminApp
from hicache_async.admin._app import _describe
from hicache_async.admin._http import redact
from hicache_async.storage import (
    FileStorage,
    FileStorageStats,
    MemoryStorage,
    Outcome,
    StorageError,
    StorageStats,
    open_storage,
)
from hicache_async.testing import KVGenerator, RedisServer, ServedRequest, serve
from hicache_async.workers import StorageStatus

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)
TOKEN = "admin-test-token-4f0c2a9d7b1e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STORAGE = "/hicache/storage-backend"
SECRET = "s3cret-pass-91c7"


def _config() -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": 64,
            "host_pages": 128,
            "model_id": "admin-test",
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE, "batch_pages": 8},
            "backup": {"batch_pages": 8, "retry_backoff_s": 0.001},
        }
    )


def _listening_socket() -> socket.socket:
    # Bound and listening before the server starts: early connections wait in the backlog,
    # so no test has to poll for readiness.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


@contextlib.contextmanager
def _closed_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound (so nobody else takes it), not listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


class SilentListener:
    """A loopback port that accepts connections and never sends a byte."""

    def __init__(self) -> None:
        self._sock = _listening_socket()
        self.port: int = self._sock.getsockname()[1]
        self.connected = threading.Event()
        self._accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="silent-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listening socket was closed
            while True:
                connection, _ = self._sock.accept()
                self._accepted.append(connection)
                self.connected.set()

    def close(self) -> None:
        self._sock.close()
        for connection in self._accepted:
            connection.close()
        self._thread.join(5)


@contextlib.contextmanager
def _silent_port() -> Iterator[SilentListener]:
    listener = SilentListener()
    try:
        yield listener
    finally:
        listener.close()


class ThreadRecorder:
    """An ASGI wrapper noting which threads the app ran on."""

    def __init__(self, app: AdminApp) -> None:
        self.app = app
        self.threads: set[int] = set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.threads.add(threading.get_ident())
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def running(app: Any, *, thread: bool = False) -> AsyncIterator[httpx.AsyncClient]:
    """`app` behind uvicorn on 127.0.0.1 (in this loop, or a thread with its own loop)."""
    sock = _listening_socket()
    host, port = sock.getsockname()
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan="on", http="h11", log_level="warning", access_log=False)
    )
    runner: threading.Thread | None = None
    task: asyncio.Task[None] | None = None
    if thread:
        runner = threading.Thread(
            target=asyncio.run, args=(server.serve([sock]),), name="admin-uvicorn"
        )
        runner.start()
    else:
        task = asyncio.create_task(server.serve([sock]))
    try:
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=60) as client:
            yield client
    finally:
        server.should_exit = True
        if task is not None:
            await task
        if runner is not None:
            # Joined off the loop: the server thread may still hand calls to this loop.
            await asyncio.to_thread(runner.join)
        sock.close()
    assert server.started, "uvicorn did not complete the lifespan startup"


@contextlib.asynccontextmanager
async def admin(
    *, thread: bool = False, storage: str | None = None, **options: Any
) -> AsyncIterator[tuple[HiCache, httpx.AsyncClient]]:
    async with HiCache(_config(), storage=storage) as cache:
        app = AdminApp(cache, token=options.pop("token", TOKEN), **options)
        async with running(app, thread=thread) as client:
            yield cache, client


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error", "detail"}
    assert body["error"] == code
    detail: str = body["detail"]
    return detail


# -- authentication -----------------------------------------------------------------------


async def test_requests_need_the_bearer_token() -> None:
    async with admin() as (_, client):
        missing = await client.get(STORAGE)
        assert "required" in _error(missing, 401, "unauthorized")
        assert missing.headers["www-authenticate"].startswith("Bearer")

        wrong = await client.get(STORAGE, headers={"Authorization": f"Bearer {TOKEN}x"})
        _error(wrong, 401, "unauthorized")
        assert wrong.headers["www-authenticate"].startswith("Bearer")
        assert 'error="invalid_token"' in wrong.headers["www-authenticate"]

        prefix = await client.get(STORAGE, headers={"Authorization": f"Bearer {TOKEN[:-1]}"})
        _error(prefix, 401, "unauthorized")
        basic = await client.get(STORAGE, headers={"Authorization": f"Basic {TOKEN}"})
        _error(basic, 401, "unauthorized")
        metrics = await client.get("/metrics")
        _error(metrics, 401, "unauthorized")
        # Unauthenticated callers learn nothing about which routes exist.
        _error(await client.get("/no/such/route"), 401, "unauthorized")
        # Nothing changes without the token.
        put = await client.put(STORAGE, json={"url": "memory://"})
        _error(put, 401, "unauthorized")

        right = await client.get(STORAGE, headers=AUTH)
        assert right.status_code == 200
        assert right.json()["attached"] is False
        lower = await client.get(STORAGE, headers={"authorization": f"bearer {TOKEN}"})
        assert lower.status_code == 200


async def test_another_scheme_gets_the_challenge_without_an_error_code() -> None:
    # RFC 6750: `error="invalid_token"` is for a bearer token that is wrong; a request that
    # brings no bearer credentials (another scheme) only learns which scheme is wanted.
    async with admin() as (_, client):
        for scheme in ("Basic", "Digest", "Token"):
            other = await client.get(STORAGE, headers={"Authorization": f"{scheme} {TOKEN}"})
            assert "required" in _error(other, 401, "unauthorized")
            assert other.headers["www-authenticate"] == 'Bearer realm="hicache-admin"'


async def test_every_refused_attempt_is_logged_once() -> None:
    # A request with no Authorization header at all (the usual probe) used to leave no trace.
    attempts: list[dict[str, str]] = [
        {},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Basic {TOKEN}"},
    ]
    async with HiCache(_config()) as cache:
        for number, headers in enumerate(attempts):
            # A peer of its own each, as the log is limited per peer.
            app = AdminApp(cache, token=TOKEN)
            transport = httpx.ASGITransport(app=app, client=(f"10.0.0.{number + 1}", 4000))
            async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
                with structlog.testing.capture_logs() as logs:
                    _error(await client.get(STORAGE, headers=headers), 401, "unauthorized")
                refused = [e for e in logs if e["event"] == "hicache.admin.unauthorized"]
                assert len(refused) == 1, headers
                assert refused[0]["path"] == STORAGE
                assert refused[0]["client"] == f"10.0.0.{number + 1}:4000"
                with structlog.testing.capture_logs() as logs:
                    assert (await client.get(STORAGE, headers=AUTH)).status_code == 200
                assert not [e for e in logs if e["event"] == "hicache.admin.unauthorized"]


async def test_refused_attempts_are_logged_once_a_minute_per_peer() -> None:
    # A client on the network could otherwise flood the log with one line per refusal; the
    # operator still learns from which peer and how many.
    now = [1000.0]
    async with HiCache(_config()) as cache:
        app = AdminApp(cache, token=TOKEN)
        app._refusals = LogLimiter(60.0, clock=lambda: now[0])

        async def refuse(host: str, port: int, times: int) -> None:
            transport = httpx.ASGITransport(app=app, client=(host, port))
            async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
                for attempt in range(times):
                    wrong = {"Authorization": f"Bearer {TOKEN}{attempt}"}
                    _error(await client.get(STORAGE, headers=wrong), 401, "unauthorized")

        with structlog.testing.capture_logs() as logs:
            await refuse("10.0.0.1", 4000, 50)
            await refuse("10.0.0.1", 4001, 50)  # a new connection of the same peer
            await refuse("10.0.0.2", 4000, 3)
            now[0] += 60.0
            await refuse("10.0.0.1", 4002, 1)
        refused = [
            (e["client"], e["unlogged_since_last"])
            for e in logs
            if e["event"] == "hicache.admin.unauthorized"
        ]
        assert refused == [("10.0.0.1:4000", 0), ("10.0.0.2:4000", 0), ("10.0.0.1:4002", 99)]


async def test_refusals_after_a_peers_last_line_are_told_once_its_minute_is_up() -> None:
    # A peer that stopped within the minute after its line left its other refusals untold
    # for good: a burst of guesses showed as one line.
    now = [1000.0]
    async with HiCache(_config()) as cache:
        app = AdminApp(cache, token=TOKEN)
        # A short interval for the flush's timer, the limiter's own time moved by hand.
        app._refusals = LogLimiter(0.05, clock=lambda: now[0])
        with structlog.testing.capture_logs() as logs:
            for host, times in (("10.0.0.1", 5), ("10.0.0.2", 2), ("10.0.0.3", 1)):
                transport = httpx.ASGITransport(app=app, client=(host, 4000))
                async with httpx.AsyncClient(transport=transport, base_url="http://admin") as c:
                    for attempt in range(times):
                        wrong = {"Authorization": f"Bearer {TOKEN}{attempt}"}
                        _error(await c.get(STORAGE, headers=wrong), 401, "unauthorized")
            now[0] += 60.0

            def told() -> list[tuple[str | None, int]]:
                return sorted(
                    (e["client"], e["unlogged_since_last"])
                    for e in logs
                    if e["event"] == "hicache.admin.unauthorized" and "path" not in e
                )

            deadline = asyncio.get_running_loop().time() + 30
            while len(told()) < 2:
                assert asyncio.get_running_loop().time() < deadline, told()
                await asyncio.sleep(0.01)
        assert told() == [("10.0.0.1", 4), ("10.0.0.2", 1)]


async def test_bytes_token() -> None:
    async with admin(token=TOKEN.encode()) as (_, client):
        assert (await client.get(STORAGE, headers=AUTH)).status_code == 200
        _error(await client.get(STORAGE), 401, "unauthorized")


async def test_constructor_validates() -> None:
    async with HiCache(_config()) as cache:
        with pytest.raises(ValueError, match="empty"):
            AdminApp(cache, token="")
        with pytest.raises(ValueError, match="whitespace"):
            AdminApp(cache, token="two words")
        with pytest.raises(ValueError, match="max_body_bytes"):
            AdminApp(cache, token=TOKEN, max_body_bytes=0)
        with pytest.raises(ValueError, match="path_prefix"):
            AdminApp(cache, token=TOKEN, path_prefix="admin")
        for name in ("attach_timeout_s", "body_timeout_s"):
            for bad in (0, -1.0, float("inf"), float("nan"), True, "5", 10**400):
                with pytest.raises(ValueError, match=name):
                    AdminApp(cache, token=TOKEN, **{name: bad})


async def test_what_the_constructor_checked_cannot_be_changed_afterwards() -> None:
    # Assigned later, a body limit or timeout skipped the checks above, and another cache
    # would have been served through the first one's loop.
    async with HiCache(_config()) as cache, HiCache(_config()) as other:
        app = AdminApp(cache, token=TOKEN, max_body_bytes=64)
        for name, value in (
            ("max_body_bytes", 0),
            ("path_prefix", "admin"),
            ("attach_timeout_s", float("nan")),
            ("body_timeout_s", -1.0),
            ("send_timeout_s", float("inf")),
            ("cache", other),
        ):
            with pytest.raises(AttributeError):
                setattr(app, name, value)
        assert (app.cache, app.max_body_bytes, app.path_prefix) == (cache, 64, "")


# -- storage status, attach, detach -------------------------------------------------------


async def test_a_file_stores_refused_writes_show_in_status_statistics_and_metrics(
    tmp_path: Path,
) -> None:
    # Refused writes are MISSes, not errors: without their own counter a disk that takes
    # nothing (full, read-only, a file size limit) showed in none of the figures served.
    backend = FileStorage(tmp_path / "s")
    async with HiCache(_config(), storage=backend) as cache:
        app = AdminApp(cache, token=TOKEN)
        async with running(app) as client:
            keys = _file_keys(3)
            old = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (512, old[1]))
            try:
                outcomes = await _file_put(backend, keys)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, old)
            assert outcomes == [Outcome.MISS] * 3
            assert backend.refused_writes == 3
            status = cache.storage_status()
            assert isinstance(status.storage, FileStorageStats)
            assert status.storage.refused_writes == 3
            stats = cache.statistics()
            encoded = msgspec.json.decode(msgspec.json.encode(stats))
            assert encoded["storage"]["storage"]["refused_writes"] == 3
            # The snapshot decodes back to itself, the count included.
            for again in (
                msgspec.json.decode(msgspec.json.encode(stats), type=CacheStatistics),
                msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=CacheStatistics),
            ):
                assert again == stats
            served = await client.get(STORAGE, headers=AUTH)
            assert served.json()["storage"]["refused_writes"] == 3
            metrics = (await client.get("/metrics", headers=AUTH)).text
            assert "hicache_storage_refused_writes 3.0" in metrics.splitlines()
            assert "hicache_storage_refused_writes 3.0" in cache.metrics_text().splitlines()


async def test_status_attach_and_detach_memory() -> None:
    async with admin() as (cache, client):
        detached = await client.get(STORAGE, headers=AUTH)
        assert detached.status_code == 200
        assert detached.headers["content-type"] == "application/json"
        assert detached.headers["cache-control"] == "no-store"
        assert detached.json()["attached"] is False
        assert detached.json()["backend"] is None

        put = await client.put(STORAGE, headers=AUTH, json={"url": "memory://?capacity=1MiB"})
        assert put.status_code == 200, put.text
        status = put.json()
        assert status["attached"] is True
        assert status["backend"] == "memory://?capacity=1048576"
        assert status["storage"]["capacity_bytes"] == 1 << 20
        assert status["generation"] == 1
        assert cache.storage_status().attached

        get = await client.get(STORAGE, headers=AUTH)
        assert get.json() == status

        delete = await client.delete(STORAGE, headers=AUTH)
        assert delete.status_code == 200
        assert delete.json()["attached"] is False
        assert not cache.storage_status().attached


async def test_attach_file_then_detach_flushes_backups(tmp_path: Path) -> None:
    root = tmp_path / "store"
    url = f"file://{root}"
    generator = KVGenerator(LAYOUT, PAGE, seed=3)
    prompts = [np.arange(1000 * i, 1000 * i + 6 * PAGE, dtype=np.int64) for i in range(4)]
    async with admin() as (cache, client):
        put = await client.put(STORAGE, headers=AUTH, json={"url": url})
        assert put.status_code == 200, put.text
        assert put.json()["backend"].startswith(f"file://{root}")
        assert root.is_dir()
        for prompt in prompts:
            await serve(cache, prompt, generator)
        # Device -> host copies finish in the background; a page is offered for backup once
        # it is on the host. Wait (through the API) until all of them have been offered.
        while True:
            status = (await client.get(STORAGE, headers=AUTH)).json()
            if status["backup"]["offered_pages"] == 6 * len(prompts):
                break
            await asyncio.sleep(0.01)

        delete = await client.request("DELETE", STORAGE, headers=AUTH, json={"flush": True})
        assert delete.status_code == 200, delete.text
        assert delete.json()["attached"] is False

        # Every offered page was written before the backend closed: the same directory,
        # attached again, holds them all.
        again = await client.put(STORAGE, headers=AUTH, json={"url": url})
        assert again.status_code == 200, again.text
        assert again.json()["storage"]["pages"] == 6 * len(prompts)
        assert again.json()["generation"] == 2


class _OddStats(StorageStats, frozen=True):
    """A third-party backend's record with fields JSON cannot encode."""

    kinds: Any = None
    ratio: Any = None
    shown: Any = None
    huge: Any = None


class _Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class _Wordy:
    def __repr__(self) -> str:
        return "<wordy " + "x" * 10**6 + ">"


class _OddStatsStorage(MemoryStorage):
    def stats(self) -> StorageStats:
        base = msgspec.structs.asdict(super().stats())
        return _OddStats(**base, kinds={1 + 2j}, ratio=0.5, shown=_Unprintable(), huge=_Wordy())


async def test_a_stats_field_json_cannot_encode_is_shown_as_its_repr() -> None:
    # It made `msgspec.json.encode(cache.statistics())` raise, and the status route 500.
    async with HiCache(_config(), storage=_OddStatsStorage()) as cache:
        decoded = msgspec.json.decode(msgspec.json.encode(cache.statistics()))
        assert decoded["storage"]["storage"]["kinds"] == "{(1+2j)}"
        assert decoded["storage"]["storage"]["ratio"] == 0.5
        assert decoded["storage"]["storage"]["shown"] == "<_Unprintable>"
        # A repr of megabytes is cut, not sent with every status call.
        huge = decoded["storage"]["storage"]["huge"]
        assert huge.startswith("<wordy xxx")
        assert huge.endswith(" characters)")
        assert len(huge) < 1100
        async with running(AdminApp(cache, token=TOKEN)) as client:
            response = await client.get(STORAGE, headers=AUTH)
            assert response.status_code == 200, response.text
            assert response.json()["storage"]["kinds"] == "{(1+2j)}"
            assert response.json()["storage"]["pages"] == 0
            assert (await client.get("/metrics", headers=AUTH)).status_code == 200


async def test_double_attach_conflicts_unless_replace(tmp_path: Path) -> None:
    async with admin() as (cache, client):
        first = await client.put(STORAGE, headers=AUTH, json={"url": "memory://"})
        assert first.status_code == 200
        name = first.json()["backend"]

        with structlog.testing.capture_logs() as logs:
            second = await client.put(STORAGE, headers=AUTH, json={"url": f"file://{tmp_path}"})
        detail = _error(second, 409, "storage_attached")
        (refused,) = [log for log in logs if log["event"] == "hicache.admin.storage.refused"]
        assert refused["status"] == 409
        assert refused["client"].startswith("127.0.0.1:")
        assert name in detail
        assert cache.storage_status().backend == name

        explicit = await client.put(
            STORAGE, headers=AUTH, json={"url": f"file://{tmp_path}", "replace": False}
        )
        _error(explicit, 409, "storage_attached")

        replaced = await client.put(
            STORAGE, headers=AUTH, json={"url": f"file://{tmp_path}", "replace": True}
        )
        assert replaced.status_code == 200, replaced.text
        assert replaced.json()["backend"].startswith(f"file://{tmp_path}")
        assert replaced.json()["generation"] == 2
        assert cache.storage_status().backend == replaced.json()["backend"]

        # Replacing with nothing attached is a plain attach.
        await client.delete(STORAGE, headers=AUTH)
        fresh = await client.put(STORAGE, headers=AUTH, json={"url": "memory://", "replace": True})
        assert fresh.status_code == 200
        assert fresh.json()["generation"] == 3


async def test_concurrent_attaches_are_serialised(tmp_path: Path) -> None:
    async with admin() as (cache, client):
        first, second = await asyncio.gather(
            client.put(STORAGE, headers=AUTH, json={"url": "memory://"}),
            client.put(STORAGE, headers=AUTH, json={"url": f"file://{tmp_path}"}),
        )
        assert sorted([first.status_code, second.status_code]) == [200, 409]
        winner = first if first.status_code == 200 else second
        assert cache.storage_status().backend == winner.json()["backend"]
        assert cache.storage_status().generation == 1


async def test_cache_not_open_is_503() -> None:
    cache = HiCache(_config())
    async with running(AdminApp(cache, token=TOKEN)) as client:
        _error(await client.get(STORAGE, headers=AUTH), 503, "cache_unavailable")
        _error(await client.get("/metrics", headers=AUTH), 503, "cache_unavailable")

    async with cache:
        pass
    async with running(AdminApp(cache, token=TOKEN)) as client:
        closed = _error(await client.get(STORAGE, headers=AUTH), 503, "cache_unavailable")
        assert closed == "the cache is closed"
        put = await client.put(STORAGE, headers=AUTH, json={"url": "memory://"})
        assert "closed" in _error(put, 503, "cache_unavailable")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("nope://somewhere", "unknown storage scheme"),
        ("memory://host/path", "memory:// URLs take no host or path"),
        ("memory://?capacity=lots", "capacity"),
        ("memory://?colour=blue", "colour"),
        ("", "scheme:// URLs only"),
        ("os:system", "scheme:// URLs only"),
    ],
)
async def test_bad_url_is_400(url: str, expected: str) -> None:
    async with admin() as (cache, client):
        with structlog.testing.capture_logs() as logs:
            response = await client.put(STORAGE, headers=AUTH, json={"url": url})
        detail = _error(response, 400, "invalid_storage_url")
        assert expected in detail
        assert "import path" not in detail  # the admin API refuses them
        assert not cache.storage_status().attached
        (refused,) = [log for log in logs if log["event"] == "hicache.admin.storage.refused"]
        assert refused["status"] == 400
        assert refused["client"].startswith("127.0.0.1:")


@pytest.mark.parametrize(
    ("package", "url"),
    [("redis", "redis://127.0.0.1:1/0"), ("mooncake", "mooncake://127.0.0.1:1")],
)
async def test_a_missing_client_library_is_400_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, package: str, url: str
) -> None:
    # As if the extra were not installed: Mooncake's was a 502 `storage_unreachable`, as for
    # a store that failed, where redis-py's was a 400.
    monkeypatch.delitem(sys.modules, "hicache_async.storage._redis", raising=False)
    names = [m for m in sys.modules if m == package or m.startswith(f"{package}.")]
    for name in names or [package]:
        monkeypatch.setitem(sys.modules, name, None)
    async with admin(storage="memory://") as (cache, client):
        response = await client.put(STORAGE, headers=AUTH, json={"url": url, "replace": True})
        detail = _error(response, 400, "invalid_storage_url")
        assert f"pip install 'hicache-async[{package}]'" in detail
        # Refused before anything was detached.
        assert cache.storage_status().backend == "memory://?capacity=1073741824"


async def test_bad_url_keeps_the_attached_backend_even_with_replace() -> None:
    async with admin(storage="memory://") as (cache, client):
        response = await client.put(
            STORAGE, headers=AUTH, json={"url": "nope://x", "replace": True}
        )
        _error(response, 400, "invalid_storage_url")
        assert cache.storage_status().backend == "memory://?capacity=1073741824"


async def test_credentials_in_a_bad_url_are_not_echoed() -> None:
    async with admin() as (_, client):
        response = await client.put(
            STORAGE, headers=AUTH, json={"url": f"nope://admin:{SECRET}@db.internal/0"}
        )
        detail = _error(response, 400, "invalid_storage_url")
        assert "unknown storage scheme" in detail
        assert SECRET not in response.text
        assert "***@db.internal" in detail


async def test_unreachable_redis_is_502_and_nothing_is_attached() -> None:
    async with admin() as (cache, client):
        with _closed_port() as port:
            response = await client.put(
                STORAGE,
                headers=AUTH,
                json={"url": f"redis://admin:{SECRET}@127.0.0.1:{port}/0?timeout=2"},
            )
        detail = _error(response, 502, "storage_unreachable")
        assert f"redis://127.0.0.1:{port}/0" in detail
        assert "unreachable" in detail
        assert SECRET not in response.text
        assert not cache.storage_status().attached
        status = await client.get(STORAGE, headers=AUTH)
        assert status.json()["attached"] is False


async def test_unreachable_replacement_leaves_nothing_attached() -> None:
    async with admin(storage="memory://") as (cache, client):
        with _closed_port() as port, structlog.testing.capture_logs() as logs:
            response = await client.put(
                STORAGE,
                headers=AUTH,
                json={"url": f"redis://127.0.0.1:{port}/0?timeout=2", "replace": True},
            )
        detail = _error(response, 502, "storage_unreachable")
        assert "memory://" in detail  # says what was detached
        assert not cache.storage_status().attached
        events = {log["event"]: log for log in logs}
        detached = events["hicache.admin.storage.detached"]
        assert detached["backend"].startswith("memory://")
        assert detached["client"].startswith("127.0.0.1:")
        assert events["hicache.admin.storage.refused"]["status"] == 502


async def test_replacement_refused_after_the_detach_says_nothing_is_attached(
    tmp_path: Path,
) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_bytes(b"")  # a file: the root under it can be neither found nor made
    async with admin(storage="memory://") as (cache, client):
        response = await client.put(
            STORAGE, headers=AUTH, json={"url": f"file://{blocked}/root", "replace": True}
        )
        detail = _error(response, 502, "storage_unreachable")
        assert "nothing is attached" in detail
        assert "memory://" in detail  # says what was detached
        assert not cache.storage_status().attached


async def test_attach_that_never_answers_times_out_and_leaves_nothing_attached() -> None:
    # The URL's own timeout (60 s, with retries) would hold the lock for minutes.
    async with admin(storage="memory://", attach_timeout_s=1.0) as (cache, client):
        with _silent_port() as silent:
            url = f"redis://admin:{SECRET}@127.0.0.1:{silent.port}/0?timeout=60"
            response = await client.put(STORAGE, headers=AUTH, json={"url": url, "replace": True})
        detail = _error(response, 504, "storage_timeout")
        assert "within 1 s" in detail
        assert "memory://" in detail  # says what was detached
        assert SECRET not in response.text
        assert not cache.storage_status().attached
        assert cache.storage_status().generation == 0
        again = await client.put(STORAGE, headers=AUTH, json={"url": "memory://"})
        assert again.status_code == 200, again.text
        assert again.json()["generation"] == 2  # the timed-out attach never opened


async def test_status_and_delete_during_a_slow_attach() -> None:
    # A DELETE waited behind the attach's lock until the open gave up (attach_timeout_s, 30 s
    # by default); it now cancels the open, as the bound would, and goes on at once.
    async with admin(attach_timeout_s=30.0) as (cache, client):
        with _silent_port() as silent:
            url = f"redis://admin:{SECRET}@127.0.0.1:{silent.port}/0?timeout=60"
            put = asyncio.create_task(client.put(STORAGE, headers=AUTH, json={"url": url}))
            await asyncio.to_thread(silent.connected.wait, 30)
            status = await client.get(STORAGE, headers=AUTH)
            assert status.json()["attached"] is False  # not open yet
            metrics = await client.get("/metrics", headers=AUTH)
            assert "hicache_storage_attached 0.0" in metrics.text
            delete = await client.delete(STORAGE, headers=AUTH)
            assert delete.status_code == 200, delete.text
            assert delete.json()["attached"] is False
            assert delete.json()["opening"] is False
            response = await put
            detail = _error(response, 409, "attach_cancelled")
            assert "a DELETE came before it was" in detail
            assert SECRET not in response.text
        # Nothing half-attached: the backend never opened, and the next attach is whole.
        assert cache.storage_status() == StorageStatus(attached=False)
        again = await client.put(STORAGE, headers=AUTH, json={"url": "memory://"})
        assert again.status_code == 200, again.text
        assert again.json()["generation"] == 1


class _Silent(Exception):
    """An error without any text."""


def test_error_details_are_never_empty() -> None:
    wrapped = StorageError("empty://: exists failed: ")
    wrapped.__cause__ = _Silent()
    assert _describe(wrapped, "empty://") == "exists failed: _Silent()"
    assert _describe(_Silent(), "empty://") == "_Silent"
    assert _describe(StorageError("empty://: "), "empty://") == "StorageError"
    assert _describe(StorageError("empty://: gone"), "empty://") == "gone"


# Unescaped '/', '?' or '#' in a password: `urlsplit` ends the user information there.
_CUT_PASSWORDS = ["Zx9/Qw+7kLm", "Zx9?Qw7kLm", "Zx9#Qw7kLm", "Zx9:Qw7kLm/x"]


@pytest.mark.parametrize("password", _CUT_PASSWORDS)
async def test_password_cut_short_by_the_url_parser_is_not_echoed(password: str) -> None:
    async with admin() as (_, client):
        for url in (
            f"redis://default:{password}@10.0.0.5:6379/0",
            f"nope://default:{password}@10.0.0.5:6379/0",
        ):
            response = await client.put(STORAGE, headers=AUTH, json={"url": url})
            _error(response, 400, "invalid_storage_url")
            for piece in ("Zx9", "Qw7kLm", "Qw+7kLm"):
                assert piece not in response.text


@pytest.mark.parametrize("password", _CUT_PASSWORDS)
def test_open_storage_errors_hide_a_cut_password(password: str) -> None:
    # What the command line prints: the StorageConfigError's own message.
    with pytest.raises(StorageConfigError) as caught:
        open_storage(f"redis://default:{password}@10.0.0.5:6379/0")
    for piece in ("Zx9", "Qw7kLm", "Qw+7kLm"):
        assert piece not in str(caught.value)


def test_secrets_are_scrubbed_from_long_messages() -> None:
    long = "a" * 50_000
    text = f"{long} redis://user:hunter2@host:6379/0 {long}x://tok@h"
    scrubbed = redact(text)
    assert "hunter2" not in scrubbed
    assert "tok@" not in scrubbed
    assert scrubbed.count("***@") == 2


async def test_redis_password_is_never_echoed() -> None:
    server = RedisServer(extra_args=["--user", "admin", "on", f">{SECRET}", "~*", "&*", "+@all"])
    await asyncio.to_thread(server.start)
    try:
        async with admin() as (cache, client):
            url = f"redis://admin:{SECRET}@127.0.0.1:{server.port}/0"
            put = await client.put(STORAGE, headers=AUTH, json={"url": url})
            assert put.status_code == 200, put.text
            assert put.json()["backend"] == f"redis://127.0.0.1:{server.port}/0?prefix=hicache"
            await serve(cache, np.arange(8 * PAGE, dtype=np.int64), KVGenerator(LAYOUT, PAGE))
            for response in (
                put,
                await client.get(STORAGE, headers=AUTH),
                await client.get("/metrics", headers=AUTH),
                await client.delete(STORAGE, headers=AUTH),
            ):
                assert response.status_code == 200
                assert SECRET not in response.text

            wrong = url.replace(SECRET, "not-the-password")
            refused = await client.put(STORAGE, headers=AUTH, json={"url": wrong})
            _error(refused, 400, "invalid_storage_url")  # the server refused its credentials
            assert "refused this configuration" in refused.text
            assert "not-the-password" not in refused.text
            assert not cache.storage_status().attached
    finally:
        await asyncio.to_thread(server.stop)


async def test_delete_with_and_without_flush_and_twice() -> None:
    async with admin() as (cache, client):
        idle = await client.delete(STORAGE, headers=AUTH)
        assert idle.status_code == 200
        assert idle.json() == {
            "attached": False,
            "backend": None,
            "generation": 0,
            "opening": False,
            "storage": None,
            "prefetch": None,
            "backup": None,
            "flushing": None,
            "flushing_backend": None,
            "workers_failed": None,
        }

        assert (await client.put(STORAGE, headers=AUTH, json={"url": "memory://"})).is_success
        no_flush = await client.request("DELETE", STORAGE, headers=AUTH, json={"flush": False})
        assert no_flush.status_code == 200, no_flush.text
        assert no_flush.json()["attached"] is False
        assert not cache.storage_status().attached

        again = await client.request("DELETE", STORAGE, headers=AUTH, json={"flush": False})
        assert again.status_code == 200
        assert again.json()["attached"] is False

        assert (await client.put(STORAGE, headers=AUTH, json={"url": "memory://"})).is_success
        flush = await client.request("DELETE", STORAGE, headers=AUTH, json={"flush": True})
        assert flush.status_code == 200
        assert flush.json()["attached"] is False

        typed = await client.request("DELETE", STORAGE, headers=AUTH, json={"flush": "yes"})
        assert "Expected `bool`" in _error(typed, 400, "invalid_request")
        unknown = await client.request("DELETE", STORAGE, headers=AUTH, json={"force": True})
        assert "force" in _error(unknown, 400, "invalid_request")
        text = await client.request(
            "DELETE",
            STORAGE,
            headers={**AUTH, "Content-Type": "text/plain"},
            content=b'{"flush": true}',
        )
        _error(text, 415, "unsupported_media_type")


# -- metrics ------------------------------------------------------------------------------


async def test_metrics_exposition() -> None:
    async with admin(storage="memory://") as (cache, client):
        await serve(cache, np.arange(5 * PAGE, dtype=np.int64), KVGenerator(LAYOUT, PAGE))
        response = await client.get("/metrics", headers=AUTH)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = response.text
        for name in (
            "# TYPE hicache_requests_total counter",
            "hicache_requests_total 1.0",
            "hicache_storage_attached 1.0",
            "hicache_device_pool_num_pages 64.0",
            "hicache_host_pool_num_pages 128.0",
            "# TYPE hicache_prefetch_wait_seconds histogram",
        ):
            assert name in text, name
        post = await client.post("/metrics", headers=AUTH)
        _error(post, 405, "method_not_allowed")
        assert post.headers["allow"] == "GET"


# -- protocol errors ----------------------------------------------------------------------


async def test_unknown_path_and_wrong_method() -> None:
    async with admin() as (_, client):
        _error(await client.get("/hicache/nothing", headers=AUTH), 404, "not_found")
        _error(await client.get(STORAGE + "/", headers=AUTH), 404, "not_found")
        post = await client.post(STORAGE, headers=AUTH, json={"url": "memory://"})
        _error(post, 405, "method_not_allowed")
        assert post.headers["allow"] == "DELETE, GET, PUT"
        patch = await client.patch(STORAGE, headers=AUTH)
        _error(patch, 405, "method_not_allowed")


async def test_body_too_large_is_413() -> None:
    async with admin(max_body_bytes=64) as (cache, client):
        declared = await client.put(
            STORAGE, headers={**AUTH, "Content-Type": "application/json"}, content=b" " * 200
        )
        assert "64 bytes" in _error(declared, 413, "payload_too_large")

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"url": "memory://"'
            for _ in range(4):
                yield b" " * 32
            yield b"}"

        streamed = await client.put(
            STORAGE, headers={**AUTH, "Content-Type": "application/json"}, content=chunks()
        )
        _error(streamed, 413, "payload_too_large")
        assert not cache.storage_status().attached

        deleted = await client.request("DELETE", STORAGE, headers=AUTH, json={"x": "y" * 100})
        _error(deleted, 413, "payload_too_large")

        body = b'{"url": "memory://"}'
        exact = body.ljust(64)
        fits = await client.put(
            STORAGE, headers={**AUTH, "Content-Type": "application/json"}, content=exact
        )
        assert fits.status_code == 200, fits.text
        assert cache.storage_status().attached


async def test_stalled_body_is_408_and_closes_the_connection() -> None:
    async with admin(body_timeout_s=0.5) as (_, client):
        address = client.base_url
        reader, writer = await asyncio.open_connection(address.host, address.port)
        try:
            writer.write(
                f"PUT {STORAGE} HTTP/1.1\r\nHost: admin\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
            )
            await writer.drain()
            # Generous: only that the server answers and hangs up, not how fast.
            answer = await asyncio.wait_for(reader.read(), 30)
        finally:
            writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), answer
        assert b'"error":"request_timeout"' in body
        # Other requests are still served.
        assert (await client.get(STORAGE, headers=AUTH)).status_code == 200


async def test_non_json_content_type_is_415() -> None:
    async with admin() as (cache, client):
        body = b'{"url": "memory://"}'
        for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www"}, {}):
            response = await client.put(STORAGE, headers={**AUTH, **headers}, content=body)
            _error(response, 415, "unsupported_media_type")
        form = await client.put(STORAGE, headers=AUTH, data={"url": "memory://"})
        _error(form, 415, "unsupported_media_type")
        assert not cache.storage_status().attached

        charset = await client.put(
            STORAGE,
            headers={**AUTH, "Content-Type": "application/json; charset=utf-8"},
            content=body,
        )
        assert charset.status_code == 200


@pytest.mark.parametrize(
    ("body", "code", "expected"),
    [
        (b"{not json", "invalid_json", "malformed"),
        (b"", "invalid_json", "required"),
        (b"[]", "invalid_request", "Expected `object`"),
        (b'{"url": 5}', "invalid_request", "Expected `str`, got `int`"),
        (b'{"replace": true}', "invalid_request", "missing required field `url`"),
        (b'{"url": "memory://", "force": 1}', "invalid_request", "unknown field `force`"),
        (b'{"url": "memory://", "replace": "yes"}', "invalid_request", "Expected `bool`"),
        (b'{"url": "\xff\xfe"}', "invalid_json", "utf-8"),
    ],
)
async def test_invalid_body_is_400(body: bytes, code: str, expected: str) -> None:
    async with admin() as (cache, client):
        response = await client.put(
            STORAGE, headers={**AUTH, "Content-Type": "application/json"}, content=body
        )
        assert expected in _error(response, 400, code)
        assert not cache.storage_status().attached


# -- mounting -----------------------------------------------------------------------------


async def test_path_prefix() -> None:
    async with admin(path_prefix="/admin/") as (_, client):
        assert (await client.get("/admin" + STORAGE, headers=AUTH)).status_code == 200
        assert (await client.get("/admin/metrics", headers=AUTH)).status_code == 200
        _error(await client.get(STORAGE, headers=AUTH), 404, "not_found")


async def test_mounted_under_a_host_app() -> None:
    async with HiCache(_config()) as cache:
        admin_app = AdminApp(cache, token=TOKEN)

        async def host(scope: Any, receive: Any, send: Any) -> None:
            # A minimal router: /ops/* goes to the admin app with root_path set, as
            # frameworks' Mount does; everything else is the host's own.
            if scope["type"] == "http" and scope["path"].startswith("/ops/"):
                await admin_app({**scope, "root_path": "/ops"}, receive, send)
                return
            if scope["type"] == "lifespan":
                await admin_app(scope, receive, send)
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/plain")],
                }
            )
            await send({"type": "http.response.body", "body": b"host"})

        async with running(host) as client:
            assert (await client.get("/")).text == "host"
            put = await client.put("/ops" + STORAGE, headers=AUTH, json={"url": "memory://"})
            assert put.status_code == 200, put.text
            assert cache.storage_status().attached
            assert (await client.get("/ops/metrics", headers=AUTH)).status_code == 200
            _error(await client.get("/ops/unknown", headers=AUTH), 404, "not_found")


# -- loop affinity ------------------------------------------------------------------------


async def test_server_on_another_thread_and_loop(tmp_path: Path) -> None:
    async with HiCache(_config()) as cache:
        recorder = ThreadRecorder(AdminApp(cache, token=TOKEN))
        async with running(recorder, thread=True) as client:
            assert (await client.get(STORAGE, headers=AUTH)).json()["attached"] is False
            put = await client.put(STORAGE, headers=AUTH, json={"url": f"file://{tmp_path}"})
            assert put.status_code == 200, put.text
            assert cache.storage_status().attached
            conflict = await client.put(STORAGE, headers=AUTH, json={"url": "memory://"})
            _error(conflict, 409, "storage_attached")
            metrics = await client.get("/metrics", headers=AUTH)
            assert "hicache_storage_attached 1.0" in metrics.text
            _error(
                await client.put(STORAGE, headers=AUTH, json={"url": "x://"}),
                400,
                "invalid_storage_url",
            )
            delete = await client.delete(STORAGE, headers=AUTH)
            assert delete.json()["attached"] is False
        assert not cache.storage_status().attached
        assert recorder.threads
        assert threading.get_ident() not in recorder.threads


@pytest.mark.parametrize("thread", [False, True], ids=["same-loop", "server-thread"])
async def test_changes_while_requests_are_served(tmp_path: Path, thread: bool) -> None:
    generator = KVGenerator(LAYOUT, PAGE, seed=7)
    prompts = [np.arange(500 * i, 500 * i + 7 * PAGE + 1, dtype=np.int64) for i in range(3)]
    changed = asyncio.Event()

    async def traffic(prompt: np.ndarray[Any, Any], name: str) -> list[ServedRequest]:
        served: list[ServedRequest] = []
        # Serve before, during and after the changes: stop only once they are all done.
        while True:
            served.append(await serve(cache, prompt, generator, request_id=f"{name}{len(served)}"))
            if changed.is_set() and len(served) >= 3:
                return served

    async def changes() -> list[httpx.Response]:
        try:
            return [
                await client.put(
                    STORAGE, headers=AUTH, json={"url": f"file://{tmp_path}", "replace": True}
                ),
                await client.get("/metrics", headers=AUTH),
                await client.request("DELETE", STORAGE, headers=AUTH, json={"flush": True}),
                await client.put(STORAGE, headers=AUTH, json={"url": "memory://"}),
            ]
        finally:
            changed.set()

    async with admin(thread=thread, storage="memory://") as (cache, client):
        responses, served = await asyncio.gather(
            changes(), asyncio.gather(*(traffic(p, f"r{i}-") for i, p in enumerate(prompts)))
        )
        assert [r.status_code for r in responses] == [200, 200, 200, 200]
        assert responses[0].json()["backend"].startswith(f"file://{tmp_path}")
        assert responses[3].json()["backend"].startswith("memory://")
        for prompt, rounds in zip(prompts, served, strict=True):
            assert len(rounds) >= 3
            assert all(r.num_tokens == len(prompt) for r in rounds)
        await cache.drain()
        assert cache.statistics().live_requests == 0


class _OpensWhenLetGo(MemoryStorage):
    """A store whose opening waits for the test: an attach in progress, for as long as needed."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def __aenter__(self) -> _OpensWhenLetGo:
        await self.go.wait()
        await super().__aenter__()
        return self


async def test_an_attach_still_opening_is_reported_refused_and_can_be_detached() -> None:
    async with admin() as (cache, client):
        opening = _OpensWhenLetGo()
        try:
            attach = asyncio.create_task(cache.attach_storage(opening))
            for _ in range(100):
                if cache.storage_status().opening:
                    break
                await asyncio.sleep(0.01)
            status = cache.storage_status()
            assert (status.attached, status.opening, status.backend) == (False, True, opening.name)
            assert cache.statistics().storage == status
            # Another attach, from the API too, is refused as for an attached one.
            response = await client.put(STORAGE, headers=AUTH, json={"url": "memory://"})
            _error(response, 409, "storage_attached")
            # A detach meanwhile waits for the open to end, then closes the backend; the attach
            # says it was detached.
            with structlog.testing.capture_logs() as logs:
                delete = asyncio.create_task(client.delete(STORAGE, headers=AUTH))
                for _ in range(100):
                    if not cache.storage_status().opening:  # the detach has taken the link
                        break
                    await asyncio.sleep(0.01)
                opening.go.set()
                response = await delete
            assert response.status_code == 200, response.text
            assert [
                e["backend"] for e in logs if e["event"] == "hicache.admin.storage.detached"
            ] == [opening.name]
            with pytest.raises(HiCacheError, match="detached while it was opening"):
                await attach
            assert not cache.storage_status().attached
            assert cache.storage_status().generation == 0
            with pytest.raises(StorageError):  # closed: it refuses calls
                await opening.exists([bytes(32)])
        finally:
            opening.go.set()  # a failure above must not leave the cache's exit waiting


async def test_the_scheme_check_scans_entry_points_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The scan reads every installed distribution's metadata: file I/O, kept off the loop.
    import threading

    from hicache_async.admin import _app
    from hicache_async.storage import storage_schemes

    threads: list[threading.Thread] = []

    def scan() -> list[str]:
        threads.append(threading.current_thread())
        return storage_schemes()

    monkeypatch.setattr(_app, "storage_schemes", scan)
    async with admin() as (_, client):
        response = await client.put(STORAGE, headers=AUTH, json={"url": "nope://x"})
        assert "memory://" in _error(response, 400, "invalid_storage_url")
    assert threads
    assert threading.main_thread() not in threads
