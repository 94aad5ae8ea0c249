"""A command that times out is not sent again; one whose connection is lost is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from hicache_async import StorageError
from hicache_async.storage._redis import RedisStorage


class _Endpoint:
    """A TCP endpoint on loopback that counts the connections it accepts, and either never
    answers (`silent`) or hangs up on each at once."""

    def __init__(self, *, silent: bool) -> None:
        self.silent = silent
        self.connections = 0
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.silent:
            await reader.read()  # until the client gives up and closes
        writer.close()


@pytest.fixture(params=[True, False], ids=["silent", "hangs-up"])
async def endpoint(request: pytest.FixtureRequest) -> AsyncIterator[_Endpoint]:
    found = _Endpoint(silent=request.param)
    server = await asyncio.start_server(found.serve, "127.0.0.1", 0)
    found.port = server.sockets[0].getsockname()[1]
    try:
        yield found
    finally:
        server.close()
        await server.wait_closed()


async def test_a_timeout_is_the_bound_and_a_lost_connection_is_retried(
    endpoint: _Endpoint,
) -> None:
    url = f"redis://127.0.0.1:{endpoint.port}/0?timeout=0.2&bulk=0"
    async with RedisStorage.from_url(url) as backend:  # unreachable: warned, not raised
        before = endpoint.connections
        with pytest.raises(StorageError):
            await backend.exists([bytes(32)])
        # A silent server: the command waited out `timeout` once. A server that hangs up:
        # two retries, each on a new connection.
        assert endpoint.connections - before == (1 if endpoint.silent else 3)
