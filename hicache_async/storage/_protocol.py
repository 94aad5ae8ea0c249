"""The async storage protocol every L3 backend implements.

Batched with a result per key, one thread hand-off per batch at most, cancellable. A page is
moved as a list of memoryview segments (scatter/gather), so a backend can read straight into
host-pool memory and write straight from it whatever the host layout.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, cast, runtime_checkable

import msgspec

from .._errors import StorageConfigError, StorageError

__all__ = [
    "Outcome",
    "PageBuffer",
    "PageMeta",
    "StorageBackend",
    "StorageCapabilities",
    "StorageStats",
    "StorageError",
    "check_backend",
    "check_outcomes",
    "check_stats",
]

#: One page's memory as an ordered list of byte segments; their total is the payload length.
#: Segments for `get` are writable; a backend fills them in order. Segments for `put` may be
#: read-only and must never be written: they are host-pool pages the cache goes on serving.
PageBuffer = Sequence[memoryview]


class Outcome(enum.Enum):
    """The result of one key in a batch."""

    OK = "ok"
    #: get: no such page. put: not stored (e.g. no room) but nothing is wrong.
    MISS = "miss"
    #: get: the page existed but failed its integrity check; it has been removed.
    CORRUPT = "corrupt"
    #: the backend failed for this key (I/O error, timeout, connection loss).
    ERROR = "error"


class PageMeta(msgspec.Struct, frozen=True):
    """What is stored with a page besides its bytes."""

    key: bytes
    #: `Namespace.fingerprint` of the writer; a reader with another fingerprint gets a MISS
    #: and the page stays (it belongs to another deployment sharing the store).
    namespace: bytes
    num_tokens: int
    priority: int = 0


class StorageCapabilities(msgspec.Struct, frozen=True):
    """What a backend can do, so callers can size batches and choose paths."""

    max_batch_pages: int
    #: get/put move bytes between the backend and the caller's buffers without a staging copy.
    zero_copy: bool
    #: other instances see this backend's pages (files on a shared root, Redis, Mooncake).
    shared: bool
    #: pages survive a restart of this process.
    persistent: bool
    #: `put` finds the pages the store holds already and moves none of their bytes (they
    #: come back OK), so asking `exists` first saves nothing: the backup leaves its look-up
    #: of stored pages (`backup.skip_stored`) out. False for a put that sends every page.
    put_skips_stored: bool = False


class StorageStats(msgspec.Struct, frozen=True):
    """A snapshot of a backend's counters."""

    backend: str
    pages: int
    bytes: int
    capacity_bytes: int | None
    gets: int = 0
    get_hits: int = 0
    puts: int = 0
    put_ok: int = 0
    deletes: int = 0
    corrupt: int = 0
    errors: int = 0
    evictions: int = 0
    #: Pages `put` could not store because the storage refused them (a file store: no room
    #: even after evicting, a read-only file system, a file size limit): MISSes, not errors,
    #: so without it a full or read-only disk shows in no counter. 0 where a backend counts
    #: none. Declared here, not in a backend's subclass, so that a snapshot decodes back to
    #: itself: `statistics()` types `storage` as this class.
    refused_writes: int = 0


@runtime_checkable
class StorageBackend(Protocol):
    """An L3 store. Use as `async with backend:`; every call after `close()` raises.

    Implementations must be safe to cancel at any await: a cancelled `get` leaves the
    target buffers in an unspecified state (the caller discards them) but the store intact;
    a cancelled `put` either stored a page whole or not at all.
    """

    @property
    def name(self) -> str:
        """A short description (scheme and location), safe to log (no secrets)."""
        ...

    @property
    def capabilities(self) -> StorageCapabilities: ...

    async def __aenter__(self) -> StorageBackend: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, counted from the first, exist consecutively."""
        ...

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        """Read each page into its buffer; one outcome per key.

        A page whose header, key, own length or checksum (or MAC) does not match is `CORRUPT`
        (counted and removed); its buffer content is then undefined. A sound page of another
        namespace, of another length than its buffer, or of a newer format version, is a
        `MISS` and is left in place.
        """
        ...

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        """Store each page atomically; one outcome per key. An existing key is kept (OK).

        `pages` may be read-only views and are only read, never written."""
        ...

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the pages; return how many existed."""
        ...

    def stats(self) -> StorageStats:
        """Counters and occupancy, without I/O."""
        ...

    async def close(self) -> None:
        """Release connections and threads. Idempotent."""
        ...


# What `check_backend` looks for. `async with` looks its methods up on the type, so those are
# checked there; the rest on the object, so that proxies answering through __getattr__ pass.
_CONTEXT_METHODS = ("__aenter__", "__aexit__")
_METHODS = ("exists", "get", "put", "delete", "stats", "close")
_PROPERTIES = ("name", "capabilities")


def _present(obj: object, name: str, *, call: bool) -> bool:
    try:
        value = getattr(obj, name)
    except Exception:  # a property that fails, or a proxy's __getattr__ that does
        return False
    return callable(value) if call else True


#: What a cache takes as its storage, for error messages.
STORAGE_ACCEPTED = "pass a storage URL (str) or a StorageBackend object"


def check_backend(obj: object, what: str, *, accepted: str = "") -> StorageBackend:
    """`obj` if it has every member of `StorageBackend`, else StorageConfigError naming what
    it lacks (`isinstance` against the protocol would say no more than yes or no).

    `what` names the object in the message; `accepted`, when given, ends it.
    """
    missing = [n for n in _CONTEXT_METHODS if not _present(type(obj), n, call=True)]
    missing += [n for n in _METHODS if not _present(obj, n, call=True)]
    missing += [n for n in _PROPERTIES if not _present(obj, n, call=False)]
    if missing:
        members = ", ".join([*_PROPERTIES, "async with", *_METHODS])
        raise StorageConfigError(
            f"{what} ({type(obj).__name__}) is not a StorageBackend: it lacks "
            f"{', '.join(missing)} (a StorageBackend has {members})"
            + (f"; {accepted}" if accepted else "")
        )
    return cast(StorageBackend, obj)


def check_outcomes(outcomes: object, count: int, call: str) -> list[Outcome]:
    """`outcomes` if it is a list of `count` Outcomes (what `get` and `put` must return),
    else StorageError: a backend's wrong answer is a failed call, not a crash of its caller."""
    if (
        not isinstance(outcomes, list)
        or len(outcomes) != count
        or not all(isinstance(o, Outcome) for o in outcomes)
    ):
        shown = f"{len(outcomes)} items" if isinstance(outcomes, list) else type(outcomes).__name__
        raise StorageError(f"{call} returned {shown}, not a list of {count} Outcomes")
    return outcomes


def check_exists(found: object, count: int) -> int:
    """`found` if it is a count of 0 to `count` keys (what `exists` must return), else
    StorageError: a backend's wrong answer is a failed call, not a crash of its caller."""
    index = getattr(found, "__index__", None)  # an int, or an integer type such as numpy's
    value = index() if callable(index) else -1
    if isinstance(found, bool) or not 0 <= value <= count:
        raise StorageError(f"exists returned {found!r}, not a count of 0 to {count} keys")
    return value


#: The longest repr `encodable_stats` keeps of a field JSON cannot encode.
_MAX_REPR_CHARS = 1000


def encodable_stats(stats: StorageStats) -> StorageStats:
    """`stats` with each field a subclass added that JSON cannot encode (a set, a complex, an
    object) replaced by its `repr` (cut to 1,000 characters), so `statistics()` and the
    admin API's JSON still encode."""
    changes: dict[str, str] = {}
    for field in type(stats).__struct_fields__:
        if field in StorageStats.__struct_fields__:
            continue
        value = getattr(stats, field)
        try:
            msgspec.json.encode(value)
        except Exception:  # a third-party value: anything may fail, its repr included
            try:
                shown = repr(value)
            except Exception:
                shown = f"<{type(value).__name__}>"
            # Cut: a repr can run to megabytes, sent with every status and statistics call.
            if len(shown) > _MAX_REPR_CHARS:
                shown = f"{shown[:_MAX_REPR_CHARS]}... ({len(shown)} characters)"
            changes[field] = shown
    return msgspec.structs.replace(stats, **changes) if changes else stats


def check_stats(stats: object) -> StorageStats:
    """`stats` if it is a StorageStats whose fields have their declared types (a str `backend`,
    counters that are ints, not bools, and not negative; `capacity_bytes` may be None), else
    StorageError. msgspec does not check a Struct's fields when it is built, and these go on
    to status calls, the admin API's JSON and metrics. A subclass's own field that JSON
    cannot encode comes back as its `repr` (a str)."""
    if not isinstance(stats, StorageStats):
        raise StorageError(f"stats returned {type(stats).__name__}, not a StorageStats")
    if not isinstance(stats.backend, str):
        raise StorageError(f"stats returned backend={stats.backend!r}, not a str")
    for field in StorageStats.__struct_fields__[1:]:
        value = getattr(stats, field)
        if field == "capacity_bytes" and value is None:
            continue
        if type(value) is not int or value < 0:
            raise StorageError(f"stats returned {field}={value!r}, not an int of 0 or more")
    return encodable_stats(stats)
