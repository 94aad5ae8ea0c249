"""Writing a storage backend plugin, and proving it with the shipped conformance suite.

`SqliteStorage` keeps pages in one SQLite file. It reuses the page format (header, checksum,
optional MAC) from `hicache_async.storage`, does each batch in one thread hand-off, and copies
bytes into the caller's buffers only on the event loop, so cancelling a call is always safe.

Run: python examples/storage_plugin.py   (runs the conformance suite, then serves a cache)
A plugin is found by URL scheme through the entry-point group `hicache_async.storage`, e.g.
in the plugin's pyproject.toml: [project.entry-points."hicache_async.storage"]
sqlite = "storage_plugin:SqliteStorage.from_url"
then `sqlite:///var/cache/pages.db`; or by import path, where the location goes in a
parameter: `storage_plugin:SqliteStorage.from_url?path=/var/cache/pages.db`.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar
from urllib.parse import parse_qsl, urlsplit

import anyio
import numpy as np
import pytest
import pytest_asyncio

from hicache_async import CacheConfig, HiCache, StorageError
from hicache_async.storage import (
    Outcome,
    PageBuffer,
    PageCheck,
    PageMeta,
    StorageCapabilities,
    StorageConfigError,
    StorageStats,
    check_get,
    check_keys,
    check_put,
    encode_header,
    read_value_into,
)
from hicache_async.testing import MAC_KEY, KVGenerator, StorageConformance, serve

T = TypeVar("T")


class SqliteStorage:
    """Pages in a SQLite database: `sqlite:///path/to/pages.db`."""

    def __init__(self, path: str | Path, *, mac_key: bytes | None = None) -> None:
        self._path = str(path)
        self._mac_key = mac_key
        self._db: sqlite3.Connection | None = None
        self._closed = False
        self._counts = {"gets": 0, "hits": 0, "puts": 0, "ok": 0, "corrupt": 0}
        self._pages = self._bytes = 0
        self._busy = 0  # thread jobs running: close() waits for them
        self._idle: anyio.Event | None = None

    @classmethod
    def from_url(cls, url: str, *, mac_key: bytes | None = None) -> SqliteStorage:
        """`sqlite:///path/to/pages.db`, or an import path with `?path=/path/to/pages.db`
        (its own path is the factory's name). Anything else is refused, saying what is."""
        parts = urlsplit(url)
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(params) - {"path"})
        if unknown:
            raise StorageConfigError(f"{url}: unknown parameters {unknown}; accepted: path")
        path = params.get("path", "") if parts.scheme != "sqlite" else parts.path
        if parts.scheme == "sqlite" and "path" in params:
            raise StorageConfigError(f"{url}: give the database path once, in the URL's path")
        if not path:
            raise StorageConfigError(
                f"{url}: no database path; use sqlite:///path/to/pages.db, or ?path= after an "
                "import path"
            )
        return cls(path, mac_key=mac_key)

    @property
    def name(self) -> str:
        return f"sqlite://{self._path}"

    @property
    def capabilities(self) -> StorageCapabilities:
        return StorageCapabilities(
            max_batch_pages=256, zero_copy=False, shared=False, persistent=True
        )

    async def __aenter__(self) -> SqliteStorage:
        def connect() -> sqlite3.Connection:
            db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
            db.execute("CREATE TABLE IF NOT EXISTS pages (key BLOB PRIMARY KEY, value BLOB)")
            return db

        self._db = await anyio.to_thread.run_sync(connect)
        # Counted once here, then kept up to date: stats() does no I/O.
        self._pages, self._bytes = await self._run(
            lambda db: db.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(value)), 0) FROM pages"
            ).fetchone()
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _run(self, job: Callable[[sqlite3.Connection], T]) -> T:
        """`job(db)` on a worker thread. A cancellation waits for the thread (anyio's default),
        so no job outlives its call; close() waits for running ones, since closing the
        connection under a job would crash SQLite."""
        if self._closed or self._db is None:
            raise StorageError(f"{self.name} is closed")
        db = self._db
        self._busy += 1
        try:
            return await anyio.to_thread.run_sync(lambda: job(db))
        finally:
            self._busy -= 1
            if not self._busy and self._idle is not None:
                self._idle.set()

    def _removed(self, lengths: Sequence[tuple[int]]) -> int:
        self._pages -= len(lengths)
        self._bytes -= sum(length for (length,) in lengths)
        return len(lengths)

    async def exists(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)

        def count(db: sqlite3.Connection) -> int:
            for n, key in enumerate(keys):
                if db.execute("SELECT 1 FROM pages WHERE key = ?", (key,)).fetchone() is None:
                    return n
            return len(keys)

        return await self._run(count)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        check_get(keys, into, namespace)

        def fetch(db: sqlite3.Connection) -> list[bytes | None]:
            rows = []
            for key in keys:
                row = db.execute("SELECT value FROM pages WHERE key = ?", (key,)).fetchone()
                rows.append(None if row is None else bytes(row[0]))
            return rows

        values = await self._run(fetch)
        outcomes: list[Outcome] = []
        corrupt: list[bytes] = []
        for key, value, target in zip(keys, values, into, strict=True):
            self._counts["gets"] += 1
            if value is None:
                outcomes.append(Outcome.MISS)
                continue
            check = read_value_into(
                value, key=key, namespace=namespace, into=target, mac_key=self._mac_key
            )
            if check is PageCheck.OK:
                self._counts["hits"] += 1
                outcomes.append(Outcome.OK)
            elif check is PageCheck.UNSUPPORTED:
                outcomes.append(Outcome.MISS)  # a newer writer's page: not ours to judge
            else:
                self._counts["corrupt"] += 1
                corrupt.append(key)
                outcomes.append(Outcome.CORRUPT)
        if corrupt:
            await self.delete(corrupt)
        return outcomes

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        # Lengths, keys, each meta for its own key, and every page a sequence of bytes-like
        # segments: a bad batch raises ValueError before any I/O.
        check_put(keys, pages, metas)
        if self._closed:
            raise StorageError(f"{self.name} is closed")
        rows = [
            (
                key,
                encode_header(meta, page, mac_key=self._mac_key)
                + b"".join(p.cast("B") for p in page),
            )
            for key, page, meta in zip(keys, pages, metas, strict=True)
        ]

        def store(db: sqlite3.Connection) -> list[int]:
            added = []
            with db:  # one transaction: the batch lands whole or not at all
                for key, value in rows:
                    insert = "INSERT OR IGNORE INTO pages (key, value) VALUES (?, ?)"
                    if db.execute(insert, (key, value)).rowcount:
                        added.append(len(value))
            return added

        added = await self._run(store)
        self._pages += len(added)
        self._bytes += sum(added)
        self._counts["puts"] += len(keys)
        self._counts["ok"] += len(keys)
        return [Outcome.OK] * len(keys)

    async def delete(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)

        def remove(db: sqlite3.Connection) -> list[tuple[int]]:
            delete = "DELETE FROM pages WHERE key = ? RETURNING LENGTH(value)"
            with db:
                return [row for k in keys for row in db.execute(delete, (k,)).fetchall()]

        return self._removed(await self._run(remove))

    async def read_raw(self, key: bytes) -> bytes | None:
        check_keys([key])

        def fetch(db: sqlite3.Connection) -> bytes | None:
            row = db.execute("SELECT value FROM pages WHERE key = ?", (key,)).fetchone()
            return None if row is None else bytes(row[0])

        return await self._run(fetch)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        def store(db: sqlite3.Connection) -> list[tuple[int]]:
            with db:
                delete = "DELETE FROM pages WHERE key = ? RETURNING LENGTH(value)"
                replaced = db.execute(delete, (key,)).fetchall()
                db.execute("INSERT INTO pages (key, value) VALUES (?, ?)", (key, value))
                return replaced

        self._removed(await self._run(store))
        self._pages += 1
        self._bytes += len(value)

    def stats(self) -> StorageStats:
        return StorageStats(
            backend=self.name,
            pages=self._pages,
            bytes=self._bytes,
            capacity_bytes=None,
            gets=self._counts["gets"],
            get_hits=self._counts["hits"],
            puts=self._counts["puts"],
            put_ok=self._counts["ok"],
            corrupt=self._counts["corrupt"],
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._busy:
            self._idle = anyio.Event()
            await self._idle.wait()
        if self._db is not None:
            await anyio.to_thread.run_sync(self._db.close)


class TestSqliteStorage(StorageConformance):
    """The shipped conformance suite, run against the plugin."""

    @pytest_asyncio.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[SqliteStorage]:
        async with SqliteStorage(tmp_path / "pages.db") as storage:
            yield storage

    @pytest_asyncio.fixture
    async def mac_backend(self, tmp_path: Path) -> AsyncIterator[SqliteStorage]:
        async with SqliteStorage(tmp_path / "mac.db", mac_key=MAC_KEY) as storage:
            yield storage


async def serve_with_plugin() -> None:
    config = CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
            "page_size": 8,
            "device_pages": 32,
            "host_pages": 64,
            "prefetch": {"policy": "wait_complete", "threshold_tokens": 8},
        }
    )
    model = KVGenerator(config.layout, config.page_size)
    with tempfile.TemporaryDirectory() as scratch:
        db = Path(scratch) / "pages.db"
        prompt = np.arange(200)
        async with HiCache(config, storage=SqliteStorage(db)) as first:
            await serve(first, prompt, model)
            await first.drain()
        async with HiCache(config, storage=SqliteStorage(db)) as second:
            result = await serve(second, prompt, model)
        print(f"a fresh cache read {result.storage_tokens} tokens back from {db.name}")


if __name__ == "__main__":
    code = pytest.main([__file__, "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto"])
    if code != 0:
        sys.exit(int(code))
    asyncio.run(serve_with_plugin())
