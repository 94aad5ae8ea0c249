"""A command that times out is not sent again, on one server or a cluster; one whose
connection is lost is."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from hicache_async import StorageError
from hicache_async.storage._redis import RedisStorage
from hicache_async.testing import RedisServer


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


@pytest.fixture
async def one_node_cluster() -> AsyncIterator[RedisServer]:
    """A Redis Cluster of one node, which holds every slot, of its own: a test may stop it."""
    node = RedisServer(
        extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    )
    await asyncio.to_thread(node.start)
    try:
        admin = redis.asyncio.Redis(host=node.host, port=node.port)
        try:
            await admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + 30
            while b"cluster_state:ok" not in await admin.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the one-node cluster never became ok"
                await asyncio.sleep(0.05)
        finally:
            await admin.aclose()
        yield node
    finally:
        await asyncio.to_thread(node.stop)


async def test_a_cluster_command_that_timed_out_is_not_sent_again(
    one_node_cluster: RedisServer,
) -> None:
    node = one_node_cluster
    assert node.pid is not None
    url = f"redis://{node.host}:{node.port}/0?cluster=1&timeout=0.3&prefix=t{uuid.uuid4().hex}"
    async with RedisStorage.from_url(url) as backend:
        await backend.exists([bytes(32)])  # the slot map learnt, connections open
        os.kill(node.pid, signal.SIGSTOP)  # silent: connections accepted, nothing answered
        try:
            with pytest.raises(StorageError, match="Timeout reading"):
                await backend.exists([bytes(32)])
            # The client marked the slot map to be learnt again; learning it times out, and
            # that timeout is the call's error. Retried, the map would be asked for again
            # after a pause, and the call fail on that as a node it cannot connect to.
            with pytest.raises(StorageError, match="Timeout reading") as failed:
                await backend.delete([bytes(32)])
            assert "cannot be connected" not in str(failed.value)
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert await backend.exists([bytes(32)]) == 0
