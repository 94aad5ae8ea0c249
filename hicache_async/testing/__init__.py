"""Testing helpers shipped as API: the KV oracle, a request driver, fault injection, the
storage conformance suite, and real Redis / Mooncake servers for scenario tests.

`StorageConformance` and the server helpers are imported lazily: the first needs pytest (the
`testing` extra), so `import *` leaves it out; the second the server binaries; `KVGenerator`
too, as it needs torch, and this package is imported by the pytest plugin in every test run
of the environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._extras import failed_import, missing_module
from ._invariants import assert_drained
from ._workload import ServedRequest, serve

if TYPE_CHECKING:
    from ._conformance import StorageConformance as StorageConformance
    from ._faults import FaultCounts, FaultyStorage
    from ._kvgen import KVGenerator
    from ._mac_key import MAC_KEY
    from ._servers import (
        MooncakeMaster,
        RedisClusterServer,
        RedisServer,
        ServerBinaryNotFoundError,
        ServerError,
    )

__all__ = [
    "MAC_KEY",
    "FaultCounts",
    "FaultyStorage",
    "KVGenerator",
    "MooncakeMaster",
    "RedisClusterServer",
    "RedisServer",
    "ServedRequest",
    "ServerBinaryNotFoundError",
    "ServerError",
    "assert_drained",
    "serve",
]

_LAZY = {
    "KVGenerator": "._kvgen",
    "FaultyStorage": "._faults",
    "FaultCounts": "._faults",
    "MAC_KEY": "._mac_key",
    "StorageConformance": "._conformance",
    "RedisServer": "._servers",
    "RedisClusterServer": "._servers",
    "MooncakeMaster": "._servers",
    "ServerError": "._servers",
    "ServerBinaryNotFoundError": "._servers",
}

# The lazy names whose modules import a package only an extra installs.
_EXTRAS = {"StorageConformance": "testing"}


def __dir__() -> list[str]:
    # The lazy names too, for completion and help().
    return sorted({*globals(), *__all__, *_LAZY})


if not TYPE_CHECKING:
    # Hidden from type checkers, which would otherwise type any misspelt name as Any.
    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        try:
            loaded = importlib.import_module(module, __name__)
        except ModuleNotFoundError as exc:
            extra = _EXTRAS.get(name)
            if extra is None or exc.name is None or exc.name.split(".")[0] == "hicache_async":
                raise
            raise missing_module(name, exc, extra) from exc
        except AttributeError as exc:
            raise failed_import(name, f"{__name__}{module}", exc) from exc
        return getattr(loaded, name)
