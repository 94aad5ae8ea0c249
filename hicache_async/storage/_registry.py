"""Storage URLs: which backend a URL names, and how plugins add their own schemes.

Built in: `file://`, `memory://`, `redis://` / `rediss://` and `mooncake://` (the last two need
the `redis` and `mooncake` extras and are imported only when used). A third-party backend is
either an entry point in the group `hicache_async.storage` named after its URL scheme, or an
import path `package.module:factory` (optionally followed by `?query`). Either way the object is
a callable `(url: str, *, mac_key: bytes | None) -> StorageBackend`; it receives the URL exactly
as given.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import re
import sys
import threading
from collections.abc import Callable
from typing import Protocol, cast

import structlog

from .._errors import StorageConfigError
from .._extras import install_hint, missing_package
from ._base import check_mac_key
from ._file import FileStorage
from ._memory import MemoryStorage
from ._protocol import StorageBackend, check_backend
from ._redact import mask_userinfo, scrub_secrets

__all__ = ["ENTRY_POINT_GROUP", "StorageFactory", "open_storage", "storage_schemes"]

ENTRY_POINT_GROUP = "hicache_async.storage"

_log = structlog.get_logger("hicache_async")

# `package.module:factory` or `package.module:Class.from_url`, optionally with `?query`.
_IMPORT_PATH = re.compile(
    r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
    r"(?:\?.*)?$"
)
_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEME_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*$")
_FACTORY = "a storage factory is called as factory(url, *, mac_key) and returns a StorageBackend"

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


# Each warning about the installed entry points once per process, not at every lookup.
_warned: set[tuple[str, ...]] = set()


def _warn_once(event: str, **fields: str) -> None:
    key = (event, *fields.values())
    if key not in _warned:
        _warned.add(key)
        _log.warning(event, **fields)


def _distribution(ep: importlib.metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "?"


def _scan() -> tuple[dict[str, importlib.metadata.EntryPoint], dict[str, str]]:
    """The usable entry points by lowercased name, and the refused names (lowercased) with
    why. URL schemes are case-insensitive, and `open_storage` lowercases them: so are the
    names. Of two entry points of one name the first found wins; a built-in scheme always
    does."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    refused: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        name, dist = ep.name.lower(), _distribution(ep)
        if _SCHEME_NAME.match(ep.name) is None:
            refused[name] = (
                f"entry point {ep.name!r} of distribution {dist!r} in group "
                f"{ENTRY_POINT_GROUP!r} is not a valid URL scheme ({_SCHEME_NAME.pattern})"
            )
            _warn_once("storage.plugin.refused", name=ep.name, distribution=dist)
        elif name in _BUILTIN or name in _OPTIONAL:
            _warn_once("storage.plugin.shadowed", name=ep.name, distribution=dist)
        elif name in found:
            kept = found[name]
            _warn_once(
                "storage.plugin.duplicate",
                name=ep.name,
                distribution=dist,
                kept=f"{kept.name} of {_distribution(kept)}",
            )
        else:
            found[name] = ep
    return found, refused


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return _scan()[0]


def storage_schemes() -> list[str]:
    """Every URL scheme `open_storage` accepts here (built in and from entry points).

    An entry point whose name is not a valid URL scheme, or is a built-in scheme, or was
    declared already (case-insensitively) by another, is left out, with a warning logged
    once (`storage.plugin.refused`, `.shadowed`, `.duplicate`)."""
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
            missing_package(f"the {scheme}:// backend", package, extra)
        ) from None
    except Exception as exc:  # an installed client library that fails to import (too old, broken)
        raise StorageConfigError(
            f"the {scheme}:// backend ({module_name}) failed to import: "
            f"{type(exc).__name__}: {exc}; check the installed {extra!r} extra: "
            + install_hint(extra)
        ) from exc
    factory: Callable[..., StorageBackend] = getattr(module, class_name).from_url
    return factory


# Modules `import_quietly` is importing, with how many calls: a module is in sys.modules
# from the start of its import, so that alone does not say it is ready.
_importing: dict[str, int] = {}
_importing_lock = threading.Lock()


def module_to_import(url: object) -> str | None:
    """The module `open_storage(url)` would import first for a built-in optional scheme
    (`redis://`, `mooncake://`), if it is not imported yet or its import (by `import_quietly`)
    is still running; None otherwise. Importing a client library takes about 0.1 s, once per
    process: a caller on an event loop can do it on a worker thread first
    (`import_quietly`)."""
    match = _SCHEME.match(url.strip()) if isinstance(url, str) else None
    entry = _OPTIONAL.get(match.group("scheme").lower()) if match is not None else None
    if entry is None:
        return None
    with _importing_lock:
        if entry[0] in sys.modules and entry[0] not in _importing:
            return None
    return entry[0]


def import_quietly(module_name: str) -> None:
    """Import `module_name`, leaving any failure to `open_storage` to report. Meant for a
    worker thread: a call made while another thread imports the module waits there for that
    import (Python's per-module import lock) instead of importing it again."""
    with _importing_lock:
        _importing[module_name] = _importing.get(module_name, 0) + 1
    try:
        with contextlib.suppress(Exception):
            importlib.import_module(module_name)
    finally:
        with _importing_lock:
            _importing[module_name] -= 1
            if not _importing[module_name]:
                del _importing[module_name]


def _import_factory(module_name: str, attr_path: str) -> Callable[..., StorageBackend]:
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise StorageConfigError(
            f"cannot import storage plugin module {module_name!r}: {exc}"
        ) from None
    except Exception as exc:  # the module's own code failed, as an entry point's may
        raise StorageConfigError(
            f"storage plugin module {module_name!r} failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise StorageConfigError(
                f"{module_name}:{attr_path} not found ({attr!r} is missing)"
            ) from None
        except Exception as exc:  # a module or class __getattr__ of the plugin's
            raise StorageConfigError(
                f"{module_name}:{attr_path} cannot be looked up ({attr!r}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    if not callable(target):
        raise StorageConfigError(f"{module_name}:{attr_path} is not callable; {_FACTORY}")
    return cast(Callable[..., StorageBackend], target)


def _redact(url: str) -> str:
    """`url` with its user information (which may hold a password) masked, for messages."""
    return mask_userinfo(url)


def open_storage(url: str, *, mac_key: bytes | None = None) -> StorageBackend:
    """The backend a storage URL names, constructed but not yet opened (`async with` it).

    Raises StorageConfigError for an unknown scheme or bad parameters, listing what is accepted,
    for a `mac_key` that is not bytes of at least 16 (before any factory is called), and when
    the factory fails or returns something that is not a StorageBackend.
    """
    if not isinstance(url, str) or not url.strip():
        raise StorageConfigError(f"a storage URL is a non-empty string; {_accepted()}")
    check_mac_key(mac_key)  # for plugins too, which need not derive from BackendBase
    url = url.strip()
    shown = _redact(url)
    factory: Callable[..., StorageBackend]
    scheme_match = _SCHEME.match(url)
    if scheme_match is not None:
        scheme = scheme_match.group("scheme").lower()
        source = f"the {scheme}:// backend"
        if scheme in _BUILTIN:
            factory = _BUILTIN[scheme]
        elif scheme in _OPTIONAL:
            factory = _optional(scheme)
        else:
            entry_point = _entry_points().get(scheme)
            if entry_point is None:
                raise StorageConfigError(
                    f"unknown storage scheme {scheme!r} in {shown!r}; {_accepted()}"
                )
            source = f"storage plugin {entry_point.value!r} for {scheme}://"
            try:
                factory = entry_point.load()
            except Exception as exc:
                raise StorageConfigError(f"{source} failed to load: {exc}") from exc
            if not callable(factory):
                raise StorageConfigError(f"{source} is not callable; {_FACTORY}")
    elif (head := url.split(":", 1)[0].lower()) in {*_BUILTIN, *_OPTIONAL}:
        raise StorageConfigError(f"{head} URLs start with {head}://, got {shown!r}")
    elif (path_match := _IMPORT_PATH.match(url)) is not None:
        module_name, attr_path = path_match.group("module"), path_match.group("attr")
        factory = _import_factory(module_name, attr_path)
        source = f"storage plugin {module_name}:{attr_path}"
    else:
        refused = _scan()[1].get(url.split("://", 1)[0].lower()) if "://" in url else None
        if refused is not None:
            raise StorageConfigError(f"not a storage URL: {shown!r}: {refused}")
        raise StorageConfigError(f"not a storage URL: {shown!r}; {_accepted()}")
    try:
        backend = factory(url, mac_key=mac_key)
    except StorageConfigError as exc:
        # A parser may quote a piece of a password it took for a port or a query.
        message = scrub_secrets(str(exc), url)
        if message == str(exc):
            raise
        raise StorageConfigError(message) from None
    except TypeError as exc:
        # Most likely called with arguments it does not take: say how factories are called.
        raise StorageConfigError(
            f"{source} cannot build a backend from {shown!r}: TypeError: "
            f"{scrub_secrets(str(exc), url)}; {_FACTORY}"
        ) from exc
    except Exception as exc:
        # Anything else from a factory (a parser's ValueError) is still a URL that cannot be
        # served: one exception type for every bad URL.
        raise StorageConfigError(
            f"{source} cannot build a backend from {shown!r}: {type(exc).__name__}: "
            f"{scrub_secrets(str(exc), url)}"
        ) from exc
    return check_backend(backend, f"what {source} returned for {shown!r}", accepted=_FACTORY)
