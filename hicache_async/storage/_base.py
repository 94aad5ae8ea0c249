"""Machinery the built-in backends share: lifecycle, counters, batch checks, thread jobs, URLs.

A backend derived from `BackendBase` gets `async with` handling, idempotent `close()` that waits
for its running jobs, `stats()` from its counters, and `run_job`, the one thread hand-off per
batch: the job gets a stop flag it checks between pages, and a cancelled caller sets that flag
and waits for the job to stop before it re-raises, so no thread touches the caller's buffers
after the coroutine has returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar
from urllib.parse import SplitResult, parse_qsl, urlsplit

import structlog

from .._errors import StorageConfigError, StorageError
from .._forks import current_pid, forked_error
from ._page import HEADER_NBYTES, PageCheck, check_header_fields, decode_header
from ._protocol import PageBuffer, PageMeta, StorageStats
from ._threads import Job, JobThreads

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "BackendBase",
    "Counters",
    "byte_segments",
    "check_batch",
    "check_get",
    "check_key",
    "check_keys",
    "check_mac_key",
    "check_pages",
    "check_put",
    "corrupt_reason",
    "fan_out",
    "is_int",
    "parse_bool",
    "parse_int",
    "parse_number",
    "parse_port",
    "parse_query",
    "parse_size",
    "payload_nbytes",
    "split_url",
]

T = TypeVar("T")

log = structlog.get_logger("hicache_async.storage")

#: The shortest MAC secret a backend takes (the cache asks the same of `mac_key`).
MIN_MAC_KEY_NBYTES = 16


class Counters:
    """A backend's running counters, touched only on its event loop."""

    __slots__ = (
        "corrupt",
        "deletes",
        "errors",
        "evictions",
        "get_hits",
        "gets",
        "put_ok",
        "puts",
    )

    def __init__(self) -> None:
        self.gets = 0
        self.get_hits = 0
        self.puts = 0
        self.put_ok = 0
        self.deletes = 0
        self.corrupt = 0
        self.errors = 0
        self.evictions = 0

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in sorted(self.__slots__))
        return f"Counters({fields})"


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


def is_int(value: object) -> TypeGuard[int]:
    """True for an int that is not a bool (a count or size given as True is a bug upstream)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_batch(keys: Sequence[bytes], *others: tuple[str, Sequence[Any]]) -> None:
    """Raise ValueError unless every sequence has one item per key (checked before any I/O)."""
    for label, items in others:
        if len(items) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(items)} {label}")


def check_keys(keys: Sequence[bytes], namespace: bytes | None = None) -> None:
    """Raise ValueError unless every key is a 32-byte page key (and `namespace`, when given,
    a 16-byte fingerprint): a wrong key would otherwise read as a miss, silently."""
    for key in keys:
        if not isinstance(key, bytes) or len(key) != 32:
            raise ValueError(f"page keys are 32 bytes, got {key!r:.40}")
    if namespace is not None and (not isinstance(namespace, bytes) or len(namespace) != 16):
        raise ValueError(f"namespace fingerprints are 16 bytes, got {namespace!r:.40}")


def check_key(key: bytes, meta: PageMeta | None = None) -> None:
    """Raise ValueError unless `key` is a 32-byte page key (matching `meta` when given)."""
    if not isinstance(key, bytes) or len(key) != 32:
        raise ValueError(f"page keys are 32 bytes, got {key!r:.40}")
    if meta is not None:
        if meta.key != key:
            raise ValueError(f"meta.key does not match its key {key.hex()}")
        if not isinstance(meta.namespace, bytes) or len(meta.namespace) != 16:
            raise ValueError(f"namespace fingerprints are 16 bytes, got {meta.namespace!r:.40}")
        # Before any page of the batch is written, rather than midway while encoding.
        check_header_fields(meta)


def check_metas(keys: Sequence[bytes], metas: Sequence[PageMeta]) -> None:
    """Raise ValueError unless there is one `PageMeta` per key, each for its own 32-byte key,
    with a 16-byte namespace and fields a page header can hold: a put's checks before any I/O."""
    check_batch(keys, ("metas", metas))
    for key, meta in zip(keys, metas, strict=True):
        if not isinstance(meta, PageMeta):
            # ValueError like every other bad argument of a put (the documented contract).
            raise ValueError(f"each meta must be a PageMeta, got {type(meta).__name__}")  # noqa: TRY004
        check_key(key, meta)


def check_pages(pages: Sequence[PageBuffer]) -> None:
    """Raise ValueError unless every page is a sequence of C-contiguous bytes-like segments
    (what `payload_nbytes` and `byte_segments` take), before a put counts or touches a key."""
    for index, page in enumerate(pages):
        problem = _page_problem(page)
        if problem is not None:
            raise ValueError(f"pages[{index}] must be a sequence of bytes-like segments: {problem}")


def _page_problem(page: Any) -> str | None:
    # Bytes iterate as ints, a memoryview of several dimensions not at all, and a one-shot
    # iterator would be used up here and then read as an empty page.
    if isinstance(page, (str, bytes, bytearray, memoryview)):
        return f"got {type(page).__name__}"
    try:
        if iter(page) is page:
            return f"got {type(page).__name__}, an iterator"
    except TypeError:
        return f"got {type(page).__name__}"
    for segment in page:
        # A host pool's pages are memoryviews already: no new view per segment for them
        # (this runs on the loop for every page a put is given).
        view = segment if type(segment) is memoryview else None
        if view is None:
            try:
                view = memoryview(segment)
            except TypeError:
                return f"got a segment of type {type(segment).__name__}"
        if not view.c_contiguous:
            return "got a segment that is not C-contiguous"
    return None


def check_get(keys: Sequence[bytes], into: Sequence[PageBuffer], namespace: bytes) -> None:
    """A `get`'s checks in one call, before any I/O or counter: one buffer per key,
    `check_keys`, and every buffer a sequence of writable, C-contiguous bytes-like segments
    (whether or not its key is stored). Raises ValueError."""
    check_batch(keys, ("buffers", into))
    check_keys(keys, namespace)
    for index, page in enumerate(into):
        problem = _page_problem(page)
        if problem is None and any(memoryview(segment).readonly for segment in page):
            problem = "got a segment that is not writable"
        if problem is not None:
            raise ValueError(
                f"into[{index}] must be a sequence of writable bytes-like segments: {problem}"
            )


def check_put(
    keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
) -> None:
    """A put's checks of its arguments (`check_metas`, `check_pages`, the batch lengths), all
    before any I/O, counter or change of use order: a bad batch raises ValueError and changes
    nothing."""
    check_batch(keys, ("pages", pages))
    check_metas(keys, metas)
    check_pages(pages)


def check_mac_key(mac_key: bytes | None) -> bytes | None:
    """`mac_key` if it is None or bytes of at least `MIN_MAC_KEY_NBYTES`, else
    StorageConfigError: an empty key would turn the MAC off, and a short one is guessable."""
    if mac_key is None:
        return None
    if not isinstance(mac_key, bytes):
        raise StorageConfigError(f"mac_key must be bytes or None, got {type(mac_key).__name__}")
    if len(mac_key) < MIN_MAC_KEY_NBYTES:
        raise StorageConfigError(
            f"mac_key must be at least {MIN_MAC_KEY_NBYTES} bytes, got {len(mac_key)}"
        )
    return mac_key


def corrupt_reason(
    value: bytes | memoryview,
    *,
    key: bytes,
    namespace: bytes,
    payload_nbytes: int,
    stored_nbytes: int | None = None,
) -> str:
    """Which check a stored value failed, for the `storage.page.corrupt` log event.

    `stored_nbytes`: the stored value's length, when `value` holds only its first bytes.
    """
    stored = len(value) if stored_nbytes is None else stored_nbytes
    header = decode_header(value)
    if isinstance(header, PageCheck):
        return "header"
    if header.key != key:
        return "key"
    if header.namespace != namespace:
        return "namespace"
    if header.payload_nbytes != payload_nbytes or stored != HEADER_NBYTES + payload_nbytes:
        return "length"
    return "checksum or mac"


def byte_segments(page: PageBuffer, *, writable: bool) -> list[memoryview]:
    """The page's segments as flat byte views (preadv, hashing and slicing need format 'B')."""
    views: list[memoryview] = []
    if isinstance(page, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"a page is a sequence of segments, got {type(page).__name__}")  # noqa: TRY004 - the documented contract
    try:
        segments = iter(page)  # not list(): no copy of the segment list per page
    except TypeError:
        raise ValueError(f"a page is a sequence of segments, got {type(page).__name__}") from None
    for segment in segments:
        try:
            view = memoryview(segment)
        except TypeError:
            raise ValueError(
                f"page segments are bytes-like, got {type(segment).__name__}"
            ) from None
        if not view.c_contiguous:
            raise ValueError("page segments must be C-contiguous")
        if writable and view.readonly:
            raise ValueError("get needs writable page segments")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        views.append(view)
    return views


def payload_nbytes(page: PageBuffer) -> int:
    """Total bytes of a page's segments (`nbytes`, so any memoryview format counts right)."""
    return sum(memoryview(segment).nbytes for segment in page)


def fan_out(
    helpers: concurrent.futures.Executor | None,
    count: int,
    work: Callable[[int], None],
    stop: threading.Event,
    width: int,
) -> None:
    """Run `work(i)` for i in range(count) on this thread plus up to `width - 1` helpers.

    Items are handed out in order from a shared counter, so a helper that starts late simply
    takes less. Returns when every started item is finished; helpers that never started are
    cancelled. Stops handing out items once `stop` is set or any item raises (then re-raises).
    """
    lock = threading.Lock()
    position = 0
    failed = threading.Event()

    def drain() -> None:
        nonlocal position
        while not (stop.is_set() or failed.is_set()):
            with lock:
                index = position
                position += 1
            if index >= count:
                return
            try:
                work(index)
            except BaseException:
                failed.set()
                raise

    extra = min(width, count) - 1 if helpers is not None else 0
    futures = [helpers.submit(drain) for _ in range(extra)] if helpers is not None else []
    try:
        drain()
    finally:
        for future in futures:
            future.cancel()  # only succeeds for helpers that never started
        concurrent.futures.wait(futures)
    for future in futures:
        if not future.cancelled() and (error := future.exception()) is not None:
            raise error


def _collected_open(name: str, executor: JobThreads) -> None:
    """A backend collected while open: warn, and end its idle job threads (no I/O)."""
    warnings.warn(
        f"storage backend {name} was never closed; close it or use `async with`",
        ResourceWarning,
        stacklevel=1,
    )
    executor.shutdown(wait=False)


class BackendBase:
    """Lifecycle, counters and thread jobs for a storage backend.

    Subclasses set `self._name` and implement `capabilities`, `_open()`, `_release()`,
    `_occupancy()` and the storage methods. `mac_key` is checked with `check_mac_key`
    (StorageConfigError for a key that is not bytes of at least 16).

    A backend garbage-collected while open (never closed) emits a ResourceWarning, as
    asyncio's unclosed transports do, and its job threads end; a subclass releases what it
    can without I/O from a finalizer of its own (see FileStorage).

    A backend belongs to the process that opened it: in a child forked from that process
    every call raises StorageError (its job threads did not follow the fork, so a job would
    wait for ever, and its descriptors and connections are the parent's too), and `close()`
    there only drops the child's copies (`_abandon()`), touching nothing the parent uses.
    """

    _name: str

    def __init__(self, *, mac_key: bytes | None, job_threads: int, thread_name: str) -> None:
        self._mac_key = check_mac_key(mac_key)
        self._counters = Counters()
        self._state = _State.NEW
        self._pid = current_pid()  # the process that opened it (or made it, until opened)
        self._jobs: set[Job[Any]] = set()
        self._executor = JobThreads(job_threads, thread_name)
        self._unclosed: weakref.finalize[[str, JobThreads], BackendBase] | None = None
        #: the last job `_run_while_closing` started (see FileStorage._release)
        self._closing_job: Job[None] | None = None

    @property
    def name(self) -> str:
        """A short description (scheme and location), safe to log (no secrets)."""
        return self._name

    @property
    def closed(self) -> bool:
        """True once `close()` has begun."""
        return self._state is _State.CLOSED

    async def __aenter__(self) -> Self:
        if self._state is not _State.NEW:
            raise StorageError(f"{self._name} is {self._state.value}; a backend opens once")
        self._pid = current_pid()
        try:
            await self._open()
        except BaseException:
            # Never opened: nothing of ours runs any more, so just release what we hold.
            self._state = _State.CLOSED
            self._executor.shutdown(wait=False)
            raise
        if self.closed:  # close() was called while we were opening
            try:
                await self._release()
            finally:
                self._executor.shutdown(wait=False)
            raise StorageError(f"{self._name} was closed while opening")
        self._state = _State.OPEN
        # Holds the name and the threads, not the backend: the threads reference the queue
        # they wait on, never the backend, so it stays collectable.
        self._unclosed = weakref.finalize(self, _collected_open, self._name, self._executor)
        self._unclosed.atexit = False  # the process's end releases everything anyway
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop running jobs, wait for them, release resources. Idempotent."""
        if self._state is _State.CLOSED:
            return
        was_open = self._state is _State.OPEN
        self._state = _State.CLOSED
        if self._unclosed is not None:
            self._unclosed.detach()
        if current_pid() != self._pid:
            # A forked child's copy: the jobs in flight at the fork run in the parent only,
            # and a release would do the parent's close (its root's spare files, say).
            try:
                if was_open:
                    self._abandon()
            finally:
                self._executor.shutdown(wait=False)
            return
        jobs = list(self._jobs)
        for job in jobs:
            job.halt()
        interrupted: asyncio.CancelledError | None = None
        for job in jobs:
            cancelled = await job.drain()
            interrupted = interrupted or cancelled
        try:
            if was_open:
                await self._release()
        finally:
            self._executor.shutdown(wait=False)
        if interrupted is not None:
            raise interrupted  # the caller's own: an anyio scope swallows only its own

    def stats(self) -> StorageStats:
        """Counters and occupancy, without I/O."""
        pages, nbytes, capacity = self._occupancy()
        c = self._counters
        return StorageStats(
            backend=self._name,
            pages=pages,
            bytes=nbytes,
            capacity_bytes=capacity,
            gets=c.gets,
            get_hits=c.get_hits,
            puts=c.puts,
            put_ok=c.put_ok,
            deletes=c.deletes,
            corrupt=c.corrupt,
            errors=c.errors,
            evictions=c.evictions,
        )

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            verb = "closed" if self._state is _State.CLOSED else "not open (use `async with`)"
            raise StorageError(f"{self._name} is {verb}")
        if current_pid() != self._pid:
            raise StorageError(forked_error(self._name, self._pid))

    def _report_corrupt(self, key: bytes, reason: str) -> None:
        self._counters.corrupt += 1
        log.warning("storage.page.corrupt", backend=self._name, key=key.hex(), reason=reason)

    async def run_job(
        self,
        work: Callable[[threading.Event], T],
        *,
        interrupt: Callable[[], None] | None = None,
    ) -> T:
        """Run `work(stop)` on a worker thread: one hand-off, cancellation-safe.

        If the caller is cancelled, `stop` is set and the call waits until `work` has
        returned before re-raising, so `work` never outlives the coroutine. `interrupt`,
        called on the loop right after `stop` is set (by a cancellation or a close), ends
        what `work` waits for where it cannot check `stop`.
        """
        if self._state is _State.CLOSED:
            raise StorageError(f"{self._name} is closed")
        if current_pid() != self._pid:  # no thread of the parent's would ever take the job
            raise StorageError(forked_error(self._name, self._pid))
        job = Job(work, asyncio.get_running_loop(), interrupt=interrupt)
        try:
            self._executor.start(job)
        except RuntimeError as exc:  # shut down under us
            raise StorageError(f"{self._name} is closed") from exc
        self._jobs.add(job)
        try:
            await job.wait()
        except asyncio.CancelledError:
            job.halt()
            await job.drain()
            raise
        finally:
            self._jobs.discard(job)
        return job.result()

    async def _run_while_closing(self, work: Callable[[], None]) -> asyncio.CancelledError | None:
        """Run `work` on a job thread from `_release()`, where `run_job` refuses (the backend
        is closed), and wait for it whatever happens: the cancellation that came in
        meanwhile, if one did, for the caller to raise once it has released the rest. Its
        errors propagate."""
        job: Job[None] = Job(lambda stop: work(), asyncio.get_running_loop())
        self._executor.start(job)
        self._closing_job = job
        interrupted = await job.drain()
        job.result()
        return interrupted

    # Subclass hooks.

    def _occupancy(self) -> tuple[int, int, int | None]:
        """(pages, bytes, capacity) for `stats()`."""
        raise NotImplementedError

    async def _open(self) -> None:
        """Acquire resources; on failure or cancellation leave nothing behind."""
        raise NotImplementedError

    async def _release(self) -> None:
        """Release resources after every job has stopped."""
        raise NotImplementedError

    def _abandon(self) -> None:
        """In a child forked from the process that opened the backend: release this process's
        copies of what it holds, without I/O and without anything the parent still uses (a
        socket's shutdown, a file's removal). By default nothing: they go with the child."""


# URL parameters, shared by the built-in backends' `from_url`.

# ASCII only: \d would take other scripts' digits ("١٢"), which Decimal and int() read as 12.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$", re.ASCII)
# Long enough for any real value, short of Python's limit on digits it converts (4300).
_MAX_NUMBER_CHARS = 40
_NUMBER = re.compile(r"^(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$", re.ASCII)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE_HELP = "a byte size such as 123, 4KiB, 1.5GiB or 10MB (KiB/MiB/GiB/TiB or KB/MB/GB/TB)"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _shown(text: str) -> str:
    """`text` quoted for a message, cut short: a parameter can be thousands of characters."""
    if len(text) <= _MAX_NUMBER_CHARS:
        return repr(text)
    return f"{text[:_MAX_NUMBER_CHARS]!r}... ({len(text)} characters)"


def parse_size(text: str, *, field: str = "size") -> int:
    """Bytes from `123`, `4KiB`, `1.5GiB`, `10MB` (binary K/M/G/T, decimal KB/MB/GB/TB)."""
    match = _SIZE.match(text) if len(text) <= _MAX_NUMBER_CHARS else None
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise StorageConfigError(f"{field}={_shown(text)} is not {_SIZE_HELP}")
    try:
        value = Decimal(match.group(1)) * _UNITS[unit]
    except InvalidOperation:
        raise StorageConfigError(f"{field}={_shown(text)} is not {_SIZE_HELP}") from None
    if value != value.to_integral_value():
        # Truncated, 0.5 would quietly mean 0 (for a segment: lend nothing).
        raise StorageConfigError(f"{field}={_shown(text)} is not a whole number of bytes")
    return int(value)


def parse_int(
    text: str, *, field: str, minimum: int = 0, maximum: int | None = None, detail: str = ""
) -> int:
    """A whole number from a URL parameter, in ASCII digits (int() would also take other
    scripts' digits, signs and spaces, and fail on "²" or past 4300 digits with its own
    message). Anything else, or a value out of range, is a `StorageConfigError` that says
    what is accepted (`field`, then `detail` after the range)."""
    if text.isascii() and text.isdigit() and len(text) <= _MAX_NUMBER_CHARS:
        value = int(text)
        if value >= minimum and (maximum is None or value <= maximum):
            return value
    bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    raise StorageConfigError(
        f"{field}={_shown(text)} must be an integer {bound}{detail} (ASCII digits 0-9)"
    )


def parse_number(text: str, *, field: str) -> float:
    """A number from a URL parameter: ASCII decimal digits with an optional fraction and
    exponent (`5`, `0.25`, `1e-3`); float() would also take other scripts' digits, `inf`,
    `nan` and spaces. Anything else is a `StorageConfigError` saying what is accepted."""
    if len(text) <= _MAX_NUMBER_CHARS and _NUMBER.match(text):
        return float(text)
    raise StorageConfigError(
        f"{field}={_shown(text)} is not a number (ASCII decimal digits, e.g. 5, 0.25 or 1e-3)"
    )


def parse_bool(text: str, *, field: str) -> bool:
    """`1/true/yes/on` or `0/false/no/off`."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise StorageConfigError(f"{field}={text!r} is not a boolean (1/0, true/false, yes/no, on/off)")


def split_url(url: str, *, scheme: str) -> SplitResult:
    """`urlsplit(url)`, with its ValueError (a malformed IPv6 host) as StorageConfigError."""
    try:
        return urlsplit(url)
    except ValueError as exc:
        raise StorageConfigError(f"{scheme}:// URL is malformed ({exc})") from None


def parse_port(parts: SplitResult, *, scheme: str) -> int | None:
    """The port of a split URL, None when it has none; StorageConfigError when it is no port."""
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is None or port > 0:
        return port
    # Shown from the text rather than the URL, which may carry a password.
    text = parts.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")[2]
    raise StorageConfigError(
        f"{scheme}:// URL port {text!r} is not a port number; accepted: an integer 1..65535"
    )


def parse_query(query: str, accepted: Mapping[str, str], *, scheme: str) -> dict[str, str]:
    """A URL query as a dict, refusing unknown or repeated keys with the list of accepted ones.

    `accepted` maps each key to a short description used in the error message.
    """
    params: dict[str, str] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise StorageConfigError(f"{scheme}:// URL has a malformed query {query!r}") from None
    for key, value in pairs:
        if key not in accepted:
            listing = "; ".join(f"{k} ({v})" for k, v in accepted.items()) or "none"
            raise StorageConfigError(
                f"unknown parameter {key!r} in {scheme}:// URL; accepted: {listing}"
            )
        if key in params:
            raise StorageConfigError(f"parameter {key!r} given twice in {scheme}:// URL")
        if not value.isascii():
            # Passed on as UTF-8 (a file name, a header): a lone surrogate cannot be.
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise StorageConfigError(
                    f"parameter {key!r} in {scheme}:// URL must be text UTF-8 can encode, "
                    f"got {value!r}"
                ) from None
        params[key] = value
    return params
