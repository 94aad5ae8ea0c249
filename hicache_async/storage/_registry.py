"""Storage URLs: which backend a URL names, and how plugins add their own schemes.

Built in: `file://`, `memory://`, `redis://` / `rediss://` and `mooncake://` (the last two need
the `redis` and `mooncake` extras and are imported only when used). A third-party backend is
either an entry point in the group `hicache_async.storage` named after its URL scheme, or an
import path `package.module:factory` (optionally followed by `?query`). Either way the object is
a callable `(url: str, *, mac_key: bytes | None) -> StorageBackend`; it receives the URL exactly
as given.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable
from typing import Protocol, cast

from .._errors import StorageConfigError
from ._file import FileStorage
from ._memory import MemoryStorage
from ._protocol import StorageBackend

__all__ = ["ENTRY_POINT_GROUP", "StorageFactory", "open_storage", "storage_schemes"]

ENTRY_POINT_GROUP = "hicache_async.storage"

# `package.module:factory` or `package.module:Class.from_url`, optionally with `?query`.
_IMPORT_PATH = re.compile(
    r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
    r"(?:\?.*)?$"
)
_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")

# scheme -> (module, class, extra to install for its dependency)
_OPTIONAL = {
    "redis": ("hicache_async.storage._redis", "RedisStorage", "redis"),
    "rediss": ("hicache_async.storage._redis", "RedisStorage", "redis"),
    "mooncake": ("hicache_async.storage._mooncake", "MooncakeStorage", "mooncake"),
}
_BUILTIN: dict[str, Callable[..., StorageBackend]] = {
    "file": FileStorage.from_url,
    "memory": MemoryStorage.from_url,
}


class StorageFactory(Protocol):
    """What an entry point or import path must name."""

    def __call__(self, url: str, *, mac_key: bytes | None) -> StorageBackend: ...


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def storage_schemes() -> list[str]:
    """Every URL scheme `open_storage` accepts here (built in and from entry points)."""
    return sorted({*_BUILTIN, *_OPTIONAL, *_entry_points()})


def _accepted() -> str:
    return (
        "accepted: "
        + ", ".join(f"{scheme}://" for scheme in storage_schemes())
        + f", an entry point in group {ENTRY_POINT_GROUP!r}, "
        + "or an import path 'package.module:factory[?query]'"
    )


def _optional(scheme: str) -> Callable[..., StorageBackend]:
    module_name, class_name, extra = _OPTIONAL[scheme]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise StorageConfigError(
                f"the {scheme}:// backend ({module_name}) is not part of this installation"
            ) from None
        package = (exc.name or "?").split(".")[0]
        raise StorageConfigError(
            f"the {scheme}:// backend needs the {package!r} package: "
            f"pip install 'hicache-async[{extra}]'"
        ) from None
    factory: Callable[..., StorageBackend] = getattr(module, class_name).from_url
    return factory


def _import_factory(module_name: str, attr_path: str) -> Callable[..., StorageBackend]:
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise StorageConfigError(
            f"cannot import storage plugin module {module_name!r}: {exc}"
        ) from None
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise StorageConfigError(
                f"{module_name}:{attr_path} not found ({attr!r} is missing)"
            ) from None
    if not callable(target):
        raise StorageConfigError(f"{module_name}:{attr_path} is not callable")
    return cast(Callable[..., StorageBackend], target)


def open_storage(url: str, *, mac_key: bytes | None = None) -> StorageBackend:
    """The backend a storage URL names, constructed but not yet opened (`async with` it).

    Raises StorageConfigError for an unknown scheme or bad parameters, listing what is accepted.
    """
    if not isinstance(url, str) or not url.strip():
        raise StorageConfigError(f"a storage URL is a non-empty string; {_accepted()}")
    url = url.strip()
    factory: Callable[..., StorageBackend]
    scheme_match = _SCHEME.match(url)
    if scheme_match is not None:
        scheme = scheme_match.group("scheme").lower()
        if scheme in _BUILTIN:
            factory = _BUILTIN[scheme]
        elif scheme in _OPTIONAL:
            factory = _optional(scheme)
        else:
            entry_point = _entry_points().get(scheme)
            if entry_point is None:
                raise StorageConfigError(
                    f"unknown storage scheme {scheme!r} in {url!r}; {_accepted()}"
                )
            try:
                factory = entry_point.load()
            except Exception as exc:
                raise StorageConfigError(
                    f"storage plugin {entry_point.value!r} for {scheme}:// failed to load: {exc}"
                ) from exc
    elif (head := url.split(":", 1)[0].lower()) in {*_BUILTIN, *_OPTIONAL}:
        raise StorageConfigError(f"{head} URLs start with {head}://, got {url!r}")
    elif (path_match := _IMPORT_PATH.match(url)) is not None:
        factory = _import_factory(path_match.group("module"), path_match.group("attr"))
    else:
        raise StorageConfigError(f"not a storage URL: {url!r}; {_accepted()}")
    backend = factory(url, mac_key=mac_key)
    if not isinstance(backend, StorageBackend):
        raise StorageConfigError(
            f"the factory for {url!r} returned {type(backend).__name__}, not a StorageBackend"
        )
    return backend
