"""Embedding the cache in an async HTTP handler (a plain ASGI app served by uvicorn).

Each POST /generate awaits its prefetch, loads its cached prefix layer by layer, "computes"
the rest and commits it. Run: python examples/http_handler.py
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
from typing import Any

import httpx
import uvicorn

from hicache_async import CacheConfig, HiCache, InvalidTokensError, KVLayout
from hicache_async.testing import KVGenerator

CONFIG = CacheConfig(
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=16),
    page_size=16,
    device_pages=128,
    host_pages=512,
    model_id="http-example",
)


def make_app(cache: HiCache, model: KVGenerator) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        payload: dict[str, int | str]
        try:
            tokens = json.loads(body)["tokens"]
            status, payload = 200, dict(await handle(cache, model, tokens))
        except (KeyError, ValueError, InvalidTokensError) as exc:
            status, payload = 400, {"error": str(exc)}
        data = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


async def handle(cache: HiCache, model: KVGenerator, tokens: list[int]) -> dict[str, int]:
    """What a serving engine's request handler does with the cache."""
    prefetched = await cache.prefetch(tokens)
    size = cache.config.page_size
    with cache.request(tokens) as req:
        load = await req.load()
        for layer in range(cache.config.layout.num_layers):
            await load.layer(layer)  # compute layer `layer` while later layers still load
        cached = req.cached_tokens
        pages = await req.allocate(len(tokens) - cached)
        for offset, page in enumerate(pages[: len(tokens) // size - cached // size]):
            model.fill_page(cache.device_pool, page, tokens, cached // size + offset)
        req.commit()
    return {"tokens": len(tokens), "cached": cached, "from_storage": prefetched.storage_tokens}


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hicache-http-") as root:
        model = KVGenerator(CONFIG.layout, CONFIG.page_size)
        async with HiCache(CONFIG, storage=f"file://{root}") as cache:
            # Bind the listening socket first: connections queue in its backlog until the
            # server accepts them, so there is no start-up race to wait out.
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            port = sock.getsockname()[1]
            server = uvicorn.Server(uvicorn.Config(make_app(cache, model), log_level="warning"))
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            system_prompt = list(range(500, 564))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                for turn in range(3):
                    tokens = system_prompt + list(range(turn * 40, turn * 40 + 40))
                    reply = await client.post("/generate", json={"tokens": tokens})
                    print(f"turn {turn}: {reply.json()}")
                bad = await client.post("/generate", json={"tokens": [-1]})
                print(f"bad input: {bad.status_code} {bad.json()['error']}")
            server.should_exit = True
            await serving


if __name__ == "__main__":
    asyncio.run(main())
