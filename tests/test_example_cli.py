"""`hicache-async example` against a store an earlier release filled."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

from hicache_async import CacheConfig, HiCache, KVLayout, StorageConfigError
from hicache_async._trace import load_trace, request_tokens
from hicache_async.cli import main
from hicache_async.cli._example import _check_storage
from hicache_async.storage import MemoryStorage
from hicache_async.testing import KVGenerator, serve


def test_pages_an_earlier_release_stored_with_other_generator_bytes_are_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path / 'store'}"
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16")
    # The example's model as an earlier release named it, whose generator wrote other bytes.
    earlier = CacheConfig(
        layout=layout, page_size=64, device_pages=2048, host_pages=6144, model_id="hicache-example"
    )
    other_bytes = KVGenerator(layout, 64, seed=1)
    tokens = request_tokens(load_trace(limit=1)[0])

    async def fill() -> None:
        async with HiCache(earlier, storage=url) as cache:
            await serve(cache, tokens, other_bytes)
            await cache.drain()
            assert cache.storage_status().backup is not None

    asyncio.run(fill())
    capsys.readouterr()  # the fill's log lines
    assert main(["example", "--requests", "2", "--storage", url, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["storage_tokens"] == 0  # nothing of the earlier model's was taken
    assert summary["storage_pages_written"] > 0  # its own, under its own name


def test_an_unreachable_store_is_a_one_line_error_before_the_replay(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("redis")
    with socket.socket() as sock:  # a local port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"redis://user:hunter2hunter2@127.0.0.1:{port}/0"
    assert main(["example", "--requests", "2", "--storage", url, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no summary of a run without its storage
    assert "hicache-async example: error: the example's storage cannot be used" in captured.err
    assert "hunter2" not in captured.err
    assert "Traceback" not in captured.err


class _Silent(MemoryStorage):
    """A store whose look-ups never answer."""

    async def exists(self, keys: Sequence[bytes]) -> int:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class _Broken(MemoryStorage):
    """A store whose look-ups fail with an error of its own, not a StorageError."""

    async def exists(self, keys: Sequence[bytes]) -> int:
        raise RuntimeError("the store's own failure")


def silent_store(url: str, *, mac_key: bytes | None = None) -> MemoryStorage:
    return _Silent()


def broken_store(url: str, *, mac_key: bytes | None = None) -> MemoryStorage:
    return _Broken()


async def test_a_store_that_never_answers_the_look_up_is_an_error_not_a_hang() -> None:
    # The look-up had no bound: the example waited for ever, where the cache's own look-ups
    # give up after io_timeout_s.
    with pytest.raises(StorageConfigError, match=r"no answer within 0\.05 s"):
        await asyncio.wait_for(_check_storage(f"{__name__}:silent_store", 0.05), 30)


def test_a_store_failing_the_look_up_with_its_own_error_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"{__name__}:broken_store"
    assert main(["example", "--requests", "2", "--storage", url, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "hicache-async example: error: the example's storage cannot be used" in captured.err
    assert "RuntimeError: the store's own failure" in captured.err
    assert "Traceback" not in captured.err
