"""The exceptions hicache_async raises.

Misuse and configuration mistakes raise early; storage faults never surface as exceptions on a
request's path (they become misses), so only the backend API itself raises `StorageError`.
"""

from __future__ import annotations

import operator

import numpy as np

__all__ = [
    "CacheClosedError",
    "ConfigError",
    "HiCacheError",
    "InvalidTokensError",
    "OutOfPagesError",
    "StorageConfigError",
    "StorageError",
    "WorkersFailedError",
    "WrongThreadError",
]


class HiCacheError(Exception):
    """Base class of every error hicache_async raises."""


class ConfigError(HiCacheError, ValueError):
    """A configuration value is invalid; `field` names it (dotted path), `reason` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"invalid configuration at {field!r}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str], dict[str, object]]:
        # Pickled by its arguments: the default (the message alone) does not unpickle, and a
        # process pool then reports a worker's ConfigError as a broken pool. Its __dict__
        # goes along, as by default: notes added on the way up, and attributes set on it.
        return (type(self), (self.field, self.reason), self.__dict__)


class WrongThreadError(HiCacheError, RuntimeError):
    """A loop-owned object was touched from another thread or event loop."""


class CacheClosedError(HiCacheError, RuntimeError):
    """The cache is not open (never entered, or already left)."""


class WorkersFailedError(CacheClosedError):
    """The cache's workers stopped while it was open: an exception no worker may contain (a
    `KeyboardInterrupt` or `SystemExit` raised in a backend call) ended them. Storage was
    detached then, and nothing can be attached, prefetched or warmed up any more; the device
    and host tiers still serve. Leave the cache (its close still works) and open a new one."""


class InvalidTokensError(HiCacheError, ValueError):
    """Token ids are not a sequence of integers in [0, 2**32)."""


class OutOfPagesError(HiCacheError, RuntimeError):
    """A pool cannot provide the pages asked for, even after evicting all it may."""


class StorageError(HiCacheError):
    """A storage backend failed. On a request's path this is turned into a miss."""


class StorageConfigError(HiCacheError, ValueError):
    """A storage URL or backend parameter is invalid; the message lists what is accepted."""


def type_name(value: object) -> str:
    """The name of `value`'s type for an error message, qualified outside the builtins:
    numpy's bool is also called `bool`, and "must be a bool, got bool" helps no one."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def index_of(value: object, what: str) -> int:
    """`value` as an index (`operator.index`), refusing a bool: `True` would pass as 1, and a
    bool where a page or layer number belongs is a bug upstream."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {type_name(value)}")
    return operator.index(value)  # type: ignore[arg-type]
