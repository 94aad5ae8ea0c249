"""Storage URLs: built-in schemes, sizes, errors, entry-point and import-path plugins."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import structlog

import hicache_async.storage
from hicache_async import CacheConfig, HiCache, KVLayout, StorageConfigError
from hicache_async.storage import (
    FileStorage,
    MemoryStorage,
    StorageBackend,
    _registry,
    default_root,
    open_storage,
    storage_schemes,
)
from hicache_async.storage._base import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123", 123),
        ("0", 0),
        ("4KiB", 4096),
        ("4kib", 4096),
        ("4K", 4096),
        ("1.5GiB", 3 << 29),
        ("10MB", 10_000_000),
        ("2 GB", 2_000_000_000),
        ("1TiB", 1 << 40),
        (".5MiB", 1 << 19),
        ("7B", 7),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "", "-1", "1.2.3", "10XB", "GiB", "1e3"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(StorageConfigError, match="KiB/MiB/GiB"):
        parse_size(text, field="capacity")


def test_file_urls() -> None:
    storage = open_storage("file:///srv/kv?capacity=10GiB&fsync=data&shared=1&io_threads=2")
    assert isinstance(storage, FileStorage)
    assert storage.root == Path("/srv/kv")
    assert storage.stats().capacity_bytes == 10 << 30
    assert storage.capabilities.shared
    assert storage.io_threads == 2
    assert "shared=1" in storage.name
    spaced = open_storage("file:///srv/with%20space")
    assert isinstance(spaced, FileStorage)
    assert spaced.root == Path("/srv/with space")
    local = open_storage("file://localhost/srv/kv")
    assert isinstance(local, FileStorage)
    assert local.root == Path("/srv/kv")


def test_file_url_without_path_is_the_default_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    storage = open_storage("file://")
    assert isinstance(storage, FileStorage)
    assert storage.root == default_root() == tmp_path / "hicache_async"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file://relative/path", "absolute path"),
        ("file:relative", "start with file://"),
        ("file:///x?capacity=lots", "capacity='lots'"),
        ("file:///x?fsync=sometimes", "accepted: none, data, always"),
        # Every spelling parse_bool takes, on/off too.
        ("file:///x?shared=maybe", r"not a boolean \(1/0, true/false, yes/no, on/off\)"),
        ("file:///x?io_threads=many", "io_threads"),
        ("file:///x?colour=blue", "accepted: capacity .*fsync"),
        ("file:///x?capacity=1&capacity=2", "given twice"),
        ("memory://host", "no host or path"),
        ("memory://?size=1", "accepted: capacity"),
        ("ftp://example.org/x", "unknown storage scheme 'ftp'.*file://.*memory://.*redis://"),
        ("just some words", "not a storage URL"),
        ("", "non-empty"),
    ],
)
def test_bad_urls_say_what_is_accepted(url: str, message: str) -> None:
    with pytest.raises(StorageConfigError, match=message):
        open_storage(url)


def test_memory_url() -> None:
    storage = open_storage("memory://?capacity=1GiB", mac_key=b"k" * 32)
    assert isinstance(storage, MemoryStorage)
    assert storage.stats().capacity_bytes == 1 << 30


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown storage scheme"):
        open_storage("nope://")


@pytest.mark.parametrize(
    ("scheme", "module"),
    [
        ("redis", "hicache_async.storage._redis"),
        ("rediss", "hicache_async.storage._redis"),
        ("mooncake", "hicache_async.storage._mooncake"),
    ],
)
def test_missing_optional_backend(
    monkeypatch: pytest.MonkeyPatch, scheme: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(StorageConfigError, match="not part of this installation"):
        open_storage(f"{scheme}://127.0.0.1:1")


def test_missing_redis_dependency_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    module = "hicache_async.storage._redis"
    if importlib.util.find_spec(module) is None:
        pytest.skip("no redis backend in this tree")
    monkeypatch.delitem(sys.modules, module, raising=False)
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")] or ["redis"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if redis were not installed
    with pytest.raises(
        StorageConfigError, match=r"needs the 'redis' package: pip install 'hicache-async\[redis\]'"
    ):
        open_storage("redis://127.0.0.1:1")


def test_missing_mooncake_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # As for redis://: the URL cannot be served by this installation, said by open_storage,
    # not by a StorageError once the store opens.
    for name in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "mooncake", None)  # as if Mooncake were not installed
    with pytest.raises(StorageConfigError, match=r"pip install 'hicache-async\[mooncake\]'"):
        open_storage("mooncake://127.0.0.1:1")


def test_a_lazy_backend_class_without_its_library_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = "hicache_async.storage._redis"
    if importlib.util.find_spec(module) is None:
        pytest.skip("no redis backend in this tree")
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.delitem(vars(hicache_async.storage), "RedisStorage", raising=False)
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")] or ["redis"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if redis were not installed
    # Still a ModuleNotFoundError for `from ... import` callers, but naming the extra.
    with pytest.raises(
        ModuleNotFoundError,
        match=r"RedisStorage needs the 'redis' package: pip install 'hicache-async\[redis\]'",
    ):
        from hicache_async.storage import RedisStorage  # noqa: F401


def _broken_redis(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An installed `redis` whose import fails (a release too old for the backend, a broken
    install), as the backend first imports it."""
    if importlib.util.find_spec("hicache_async.storage._redis") is None:
        pytest.skip("no redis backend in this tree")
    package = tmp_path / "redis"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError(\"cannot import name 'BlockingConnectionPool' from 'redis.asyncio'\")\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "hicache_async.storage._redis", raising=False)


def test_a_redis_library_that_fails_to_import_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _broken_redis(monkeypatch, tmp_path)
    with pytest.raises(StorageConfigError, match="failed to import: ImportError: cannot import"):
        open_storage("redis://127.0.0.1:1")


async def test_attaches_over_a_redis_library_that_fails_to_import_raise_config_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Both go through the import off the loop (the first one's still running or failed).
    _broken_redis(monkeypatch, tmp_path)
    config = CacheConfig(
        layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=8), page_size=8, device_pages=8
    )
    async with HiCache(config) as one, HiCache(config) as two:
        results = await asyncio.gather(
            one.attach_storage("redis://127.0.0.1:1"),
            two.attach_storage("redis://127.0.0.1:1"),
            return_exceptions=True,
        )
        assert all(isinstance(r, StorageConfigError) for r in results), results
        assert not one.storage_status().attached
        assert not two.storage_status().attached


def test_redis_url_builds_a_redis_backend() -> None:
    if importlib.util.find_spec("hicache_async.storage._redis") is None:
        pytest.skip("no redis backend in this tree")
    pytest.importorskip("redis")
    storage = open_storage("redis://127.0.0.1:6379/0")
    assert type(storage).__name__ == "RedisStorage"


_PLUGIN = textwrap.dedent(
    """
    from hicache_async.storage import MemoryStorage

    calls = []

    def make(url, *, mac_key):
        calls.append((url, mac_key))
        return MemoryStorage(capacity_bytes=4096, mac_key=mac_key)

    class Factory:
        @classmethod
        def from_url(cls, url, *, mac_key):
            return make(url, mac_key=mac_key)

    def not_a_backend(url, *, mac_key):
        return object()

    not_callable = 42
    """
)


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module `kvplugin` and an installed distribution declaring its entry point."""
    (tmp_path / "kvplugin.py").write_text(_PLUGIN)
    dist = tmp_path / "kvplugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvplugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[hicache_async.storage]\nkvstore = kvplugin:make\nbroken = kvplugin_missing:make\n"
        "KvUpper = kvplugin:make\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvplugin", raising=False)
    return tmp_path


@pytest.mark.parametrize("mac_key", [b"", b"short", "a str key of 32 characters......"])
def test_a_bad_mac_key_is_refused_before_a_plugin_is_called(plugin_dir: Path, mac_key: Any) -> None:
    # A plugin's backend need not derive from BackendBase: open_storage checks the key itself.
    with pytest.raises(StorageConfigError, match="mac_key must be"):
        open_storage("kvstore://anything", mac_key=mac_key)
    import kvplugin  # type: ignore[import-not-found]

    assert kvplugin.calls == []


def test_entry_point_plugin(plugin_dir: Path) -> None:
    assert "kvstore" in storage_schemes()
    storage = open_storage("kvstore://anything?x=1", mac_key=b"m" * 32)
    assert isinstance(storage, MemoryStorage)
    import kvplugin  # type: ignore[import-not-found]

    assert kvplugin.calls == [("kvstore://anything?x=1", b"m" * 32)]
    with pytest.raises(StorageConfigError, match="failed to load"):
        open_storage("broken://x")
    # Schemes are case-insensitive: a name declared with capitals opens, under any case.
    assert "kvupper" in storage_schemes()
    assert isinstance(open_storage("KvUpper://x"), MemoryStorage)
    assert isinstance(open_storage("kvupper://x"), MemoryStorage)


def test_import_path_plugin(plugin_dir: Path) -> None:
    storage = open_storage("kvplugin:make?capacity=1")
    assert isinstance(storage, StorageBackend)
    assert isinstance(open_storage("kvplugin:Factory.from_url"), MemoryStorage)
    for url, message in [
        ("kvplugin_missing:make", "cannot import"),
        ("kvplugin:absent", "'absent' is missing"),
        ("kvplugin:not_callable", "not callable"),
        ("kvplugin:not_a_backend", "not a StorageBackend"),
    ]:
        with pytest.raises(StorageConfigError, match=message):
            open_storage(url)


def test_builtin_classes_have_from_url() -> None:
    for cls in (FileStorage, MemoryStorage):
        assert callable(cls.from_url)


def _distribution(root: Path, name: str, entry_points: str) -> None:
    dist = root / f"{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[hicache_async.storage]\n{entry_points}")


def test_entry_points_that_cannot_be_schemes_are_left_out_with_a_warning(
    plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _distribution(plugin_dir, "oddplugin", "my_scheme = kvplugin:make\n9lives = kvplugin:make\n")
    monkeypatch.setattr(_registry, "_warned", set())
    with structlog.testing.capture_logs() as logs:
        schemes = storage_schemes()
        storage_schemes()  # warned once, not at every lookup
    assert "my_scheme" not in schemes
    assert "9lives" not in schemes
    refused = [e for e in logs if e["event"] == "storage.plugin.refused"]
    assert sorted(e["name"] for e in refused) == ["9lives", "my_scheme"]
    assert {e["distribution"] for e in refused} == {"oddplugin"}
    # The error says why, instead of listing the scheme as accepted.
    with pytest.raises(StorageConfigError, match="'my_scheme' of distribution 'oddplugin'") as info:
        open_storage("my_scheme://x")
    assert "accepted:" not in str(info.value)


def test_duplicate_and_built_in_entry_point_names_are_warned_about(
    plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _distribution(plugin_dir, "dupplugin", "KVSTORE = kvplugin:make\nmemory = kvplugin:make\n")
    monkeypatch.setattr(_registry, "_warned", set())
    with structlog.testing.capture_logs() as logs:
        schemes = storage_schemes()
    assert schemes.count("kvstore") == 1
    assert isinstance(open_storage("memory://"), MemoryStorage)  # the built-in wins
    events = {e["event"]: e for e in logs}
    assert events["storage.plugin.shadowed"]["name"] == "memory"
    duplicate = events["storage.plugin.duplicate"]
    assert {duplicate["name"].lower(), duplicate["kept"].split()[0].lower()} == {"kvstore"}
