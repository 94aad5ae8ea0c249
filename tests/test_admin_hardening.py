"""The admin app against a client that never reads and a cache that closes under it, driven
through the ASGI interface directly (a socket test would depend on buffer sizes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hicache_async import HiCache
from hicache_async.admin import AdminApp
from tests.test_admin import _config, _silent_port

TOKEN = "admin-hardening-token-7d21"
STORAGE = "/hicache/storage-backend"
# Wall-time bound on a call that should end quickly; reached only when it hangs.
BOUND_S = 30.0


class Exchange:
    """One ASGI request: its body, and the messages the app sent back."""

    def __init__(self, body: bytes = b"", *, never_sends: bool = False) -> None:
        self._body = body
        self._never_sends = never_sends
        self._received = False
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if not self._received:
            self._received = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the client stays
        raise AssertionError("unreachable")

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if self._never_sends:
            await asyncio.Event().wait()  # a client that never reads: the send never completes

    @property
    def status(self) -> int:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        assert len(starts) == 1, self.sent
        status: int = starts[0]["status"]
        return status

    @property
    def json(self) -> Any:
        bodies = [m for m in self.sent if m["type"] == "http.response.body"]
        assert len(bodies) == 1, self.sent
        return json.loads(bodies[0]["body"])


def _scope(method: str, path: str, *, content_type: bytes | None = None) -> dict[str, Any]:
    headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
    }


async def _call(app: AdminApp, scope: dict[str, Any], exchange: Exchange) -> Exchange:
    await asyncio.wait_for(app(scope, exchange.receive, exchange.send), BOUND_S)
    return exchange


@contextlib.asynccontextmanager
async def _open_cache(storage: str | None = None) -> AsyncIterator[HiCache]:
    async with HiCache(_config(), storage=storage) as cache:
        yield cache


async def test_a_response_the_client_never_takes_is_given_up() -> None:
    # uvicorn's send waits while the client does not read (flow control): unbounded, one
    # client pipelining requests held its connection, and a graceful shutdown, at will.
    async with _open_cache() as cache:
        app = AdminApp(cache, token=TOKEN, send_timeout_s=0.2)
        for method, path in (("GET", "/metrics"), ("GET", STORAGE), ("GET", "/nowhere")):
            exchange = Exchange(never_sends=True)
            await _call(app, _scope(method, path), exchange)
            # Given up in the first send: the response stays incomplete, which a server
            # ends by closing the connection.
            assert [m["type"] for m in exchange.sent] == ["http.response.start"]


def test_send_timeout_is_validated() -> None:
    cache = HiCache(_config())
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="send_timeout_s must be a positive finite"):
            AdminApp(cache, token=TOKEN, send_timeout_s=bad)  # type: ignore[arg-type]


async def test_requests_after_the_close_are_503() -> None:
    # The cache's loop (this one) runs on after the close: the app used to answer from the
    # closed cache's leftovers with 200, and a DELETE "detached" nothing.
    async with _open_cache("memory://") as cache:
        app = AdminApp(cache, token=TOKEN)
    for method, path in (("GET", STORAGE), ("GET", "/metrics"), ("DELETE", STORAGE)):
        exchange = await _call(app, _scope(method, path), Exchange())
        assert exchange.status == 503, (method, path, exchange.sent)
        assert exchange.json == {"error": "cache_unavailable", "detail": "the cache is closed"}


async def test_an_attach_still_opening_when_the_cache_closes_is_503() -> None:
    # The close detaches the backend under way: the storage is not what failed.
    cache = HiCache(_config(), storage="memory://")
    await cache.__aenter__()
    try:
        app = AdminApp(cache, token=TOKEN, attach_timeout_s=BOUND_S)
        with _silent_port() as silent:
            body = json.dumps(
                {"url": f"redis://127.0.0.1:{silent.port}/0", "replace": True}
            ).encode()
            put = asyncio.create_task(
                _call(
                    app,
                    _scope("PUT", STORAGE, content_type=b"application/json"),
                    Exchange(body),
                )
            )
            assert await asyncio.to_thread(silent.connected.wait, BOUND_S)
            await asyncio.wait_for(cache.__aexit__(None, None, None), BOUND_S)
            exchange = await put
        assert exchange.status == 503, exchange.sent
        body_out = exchange.json
        assert body_out["error"] == "cache_unavailable"
        assert body_out["detail"].startswith("the cache is clos")
        assert "was not attached" in body_out["detail"]
    finally:
        await cache.__aexit__(None, None, None)
