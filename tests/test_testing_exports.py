"""Names the docs point to are importable from the public packages."""

from __future__ import annotations

import importlib

import pytest

import hicache_async.storage
import hicache_async.testing
from hicache_async.storage import _manifest
from hicache_async.testing import _servers


def test_server_errors_are_exported_from_testing() -> None:
    from hicache_async.testing import ServerBinaryNotFoundError, ServerError

    assert ServerError is _servers.ServerError
    assert ServerBinaryNotFoundError is _servers.ServerBinaryNotFoundError
    assert issubclass(ServerBinaryNotFoundError, ServerError)
    assert {"ServerError", "ServerBinaryNotFoundError"} <= set(hicache_async.testing.__all__)


def test_server_helpers_are_exported_from_testing() -> None:
    from hicache_async.testing import RedisClusterServer, RedisServer

    assert RedisServer is _servers.RedisServer
    assert RedisClusterServer is _servers.RedisClusterServer
    assert {"RedisServer", "RedisClusterServer"} <= set(hicache_async.testing.__all__)


@pytest.mark.parametrize("name", hicache_async.testing.__all__)
def test_every_testing_name_resolves(name: str) -> None:
    module = importlib.import_module("hicache_async.testing")
    assert getattr(module, name) is not None


MANIFEST_NAMES = [
    "SupportsManifest",
    "WarmupManifest",
    "ManifestEntry",
    "ManifestLimits",
    "ManifestRead",
    "CompactReport",
]


@pytest.mark.parametrize("name", MANIFEST_NAMES)
def test_manifest_interface_is_exported_from_storage(name: str) -> None:
    assert name in hicache_async.storage.__all__
    assert getattr(hicache_async.storage, name) is getattr(_manifest, name)


def test_every_storage_name_resolves() -> None:
    for name in hicache_async.storage.__all__:
        assert hasattr(hicache_async.storage, name), name


def test_faulty_storage_shows_its_rates() -> None:
    import inspect

    from hicache_async.testing import FaultyStorage

    parameters = inspect.signature(FaultyStorage).parameters
    assert list(parameters)[:3] == ["inner", "seed", "error_rate"]
    assert "rates" not in parameters


def test_star_import_and_mac_key_need_no_pytest() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['pytest'] = None  # as if the testing extra were not installed\n"
        "from hicache_async.testing import *\n"
        "from hicache_async.testing import MAC_KEY\n"
        "assert len(MAC_KEY) >= 16 and callable(serve)\n"
        "import hicache_async.testing as t\n"
        "assert 'StorageConformance' in dir(t)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


def test_the_conformance_suite_without_the_testing_extra_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.delitem(sys.modules, "hicache_async.testing._conformance", raising=False)
    monkeypatch.delitem(vars(hicache_async.testing), "StorageConformance", raising=False)
    monkeypatch.setitem(sys.modules, "pytest_asyncio", None)  # as if it were not installed
    with pytest.raises(
        ModuleNotFoundError,
        match=r"StorageConformance needs the 'pytest_asyncio' package: "
        r"pip install 'hicache-async\[testing\]'",
    ):
        from hicache_async.testing import StorageConformance  # noqa: F401
