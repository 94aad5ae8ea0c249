"""Warmup manifests: which prefixes a store holds, so a cold instance can load the best ones.

A manifest is a sequence of JSON lines, one `ManifestEntry` each. Later records replace
earlier ones for the same chain (same last page key). Every record is validated on read;
malformed or oversized records are skipped and counted, never trusted. Readers never hold more
than the configured bound in memory, whatever the manifest's size.

Entries hold page keys, not token ids: the keys are all a cache needs to find the pages, and a
shared manifest of raw prompts would hand every reader of the store everyone's prompts.

Evolution: a reader ignores the fields it does not know (a newer writer may add some), and
skips a record whose `v` is newer than it knows (counted as `newer`, not as malformed).
Compaction changes neither: it carries every record it keeps as the bytes stored, so unknown
fields survive, and keeps a newer version's records byte for byte, bounded and ranked with the
others (see `ManifestCollector`). Removing or retyping a field needs a new `v`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import math
import os
import re
import stat
import threading
import time
import weakref
from collections import Counter
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Sequence,
)
from pathlib import Path
from typing import (
    Annotated,
    BinaryIO,
    Generic,
    NamedTuple,
    Protocol,
    TypeVar,
    cast,
    runtime_checkable,
)

import aiofiles
import aiofiles.os
import aiofiles.threadpool
import anyio
import anyio.lowlevel
import msgspec

from .._errors import StorageError
from .._forks import current_pid, forked_error
from ._flocks import close_lock_fd, open_lock_fd
from ._page import CREATED_AHEAD_S

__all__ = [
    "CompactReport",
    "FileManifest",
    "ManifestEntry",
    "ManifestLimits",
    "ManifestRead",
    "ManifestCollector",
    "MemoryManifest",
    "SupportsManifest",
    "WarmupManifest",
    "chain_entry",
    "record_time",
    "decode_entry",
    "encode_entry",
]

MANIFEST_VERSION = 1
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")

# Warmup hands an entry's priority to the pages it loads, and those pages are backed up again
# with headers that hold the priority as an int32 and the token count as a uint32 (see
# `_page`): a wider value read from a shared manifest would fail that write, so it is refused
# as malformed when the entry is decoded.
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
Priority = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]


class ManifestEntry(msgspec.Struct, frozen=True):
    """One warmable prefix: the page keys of a chain from the root, in order."""

    namespace: str
    keys: list[str]
    num_tokens: TokenCount
    priority: Priority = 0
    last_use: float = 0.0
    v: int = MANIFEST_VERSION

    @property
    def chain_id(self) -> str:
        """Names the chain: its last key (which covers the whole prefix)."""
        return self.keys[-1]

    @property
    def ident(self) -> tuple[str, str]:
        """(namespace, chain id): the chain within its namespace."""
        return (self.namespace, self.keys[-1])


class ManifestLimits(msgspec.Struct, frozen=True):
    """Bounds on what a manifest may hold and what a reader keeps in memory."""

    max_entries: int = 10_000
    max_entry_bytes: int = 256 * 1024
    max_bytes: int = 64 << 20


class ManifestRead(msgspec.Struct, frozen=True):
    """The entries read (deduplicated, newest record per chain) and what was skipped."""

    entries: list[ManifestEntry]
    malformed: int = 0
    oversized: int = 0
    #: the manifest was larger than the byte bound; reading stopped there.
    truncated: bool = False
    #: records of a newer manifest version than this reader knows: skipped, left in place
    #: (on Mooncake a namespace whose index is of a newer layout counts once).
    newer: int = 0
    #: Per entry (by `covered_key()`: "<namespace>:<chain id>", so the record encodes as
    #: JSON), the page counts of the shorter chains of its namespace that it starts with and
    #: that were left out of `entries` for it (loading it loads them), ascending.
    #: Tensor-parallel warmup offers them as prefixes the ranks may agree on: a rank that
    #: lacks the longer chain may hold one of them.
    covered: dict[str, list[int]] = {}


def covered_key(entry: ManifestEntry) -> str:
    """The key of `entry` in `ManifestRead.covered`."""
    return f"{entry.namespace}:{entry.chain_id}"


class CompactReport(msgspec.Struct, frozen=True):
    records_before: int
    entries_after: int
    bytes_before: int
    bytes_after: int
    malformed: int
    oversized: int
    #: records of a newer manifest version: carried as they are (those kept are counted in
    #: `entries_after`); on Mooncake a namespace whose index is of a newer layout, left as it
    #: is, counts once.
    newer: int = 0


def add_reports(first: CompactReport, second: CompactReport) -> CompactReport:
    """The report of two compactions together (of two namespaces, say)."""
    pairs = zip(msgspec.structs.astuple(first), msgspec.structs.astuple(second), strict=True)
    return CompactReport(*(a + b for a, b in pairs))


@runtime_checkable
class WarmupManifest(Protocol):
    """Where a backend keeps its manifest."""

    async def append(self, entries: Sequence[ManifestEntry]) -> None: ...

    async def read(self, *, namespace: str | None = None) -> ManifestRead: ...

    async def compact(self) -> CompactReport: ...


@runtime_checkable
class SupportsManifest(Protocol):
    """A backend that records warmup metadata."""

    def manifest(self, limits: ManifestLimits | None = None) -> WarmupManifest: ...


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ManifestEntry)


def encode_entry(entry: ManifestEntry) -> bytes:
    """One manifest line, newline included."""
    return _encoder.encode(entry) + b"\n"


_K = TypeVar("_K", bound=Hashable)
# A record's use as ranked (see `_ranked_use`).
_Rank = tuple[float, float]
_T = TypeVar("_T")


async def off_loop(work: Callable[[], _T], *, owner: Hashable) -> _T:
    """`work` on a worker thread: the CPU-bound part of a read or compaction (decoding
    records, ranking them, joining what is written), which grows with the manifest and would
    otherwise hold the event loop for as long (hundreds of milliseconds for tens of MB). The
    thread gives the loop its turn every switch interval, so the loop keeps serving meanwhile.

    `owner` names the manifest the work is for (its file, or its store): such jobs of one
    owner run one at a time per event loop.

    `work` must touch only what its caller owns alone (the collector of one read or
    compaction, a snapshot, immutable bytes): a caller cancelled meanwhile does not wait for
    it, and the work runs on to its end on what nobody reads any more.
    """
    abandoned = threading.Event()
    gate = _gate_of(asyncio.get_running_loop(), owner)

    def run() -> _T:
        # One job at a time per manifest, held by the thread: a caller that gave up does not
        # wait for its job, and repeated give-ups (warmups cut by short deadlines) would
        # otherwise pile up jobs, each with its own copy of a large manifest. Per manifest
        # and loop, so caches of other stores, or on loops of their own, never wait for it.
        with gate:
            if abandoned.is_set():
                raise _Abandoned  # its caller is gone: nothing reads the result
            return work()

    try:
        return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    except BaseException:
        abandoned.set()
        raise


class _Gate:
    """A lock that can be weakly referenced (a `threading.Lock` cannot)."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


# Held only by the jobs that run or wait (their threads' closures): a gate lasts while its
# owner has work under way, so owners come and go without the map growing.
_gates: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, weakref.WeakValueDictionary[Hashable, _Gate]
] = weakref.WeakKeyDictionary()


def _gate_of(loop: asyncio.AbstractEventLoop, owner: Hashable) -> _Gate:
    of_loop = _gates.get(loop)
    if of_loop is None:
        of_loop = _gates[loop] = weakref.WeakValueDictionary()
    gate = of_loop.get(owner)
    if gate is None:
        gate = of_loop[owner] = _Gate()
    return gate


def _forget_gates() -> None:
    # A child forked while a job held a gate would inherit it locked, with no thread left
    # to release it: every manifest read there would wait for ever.
    _gates.clear()


os.register_at_fork(after_in_child=_forget_gates)


class _Abandoned(Exception):
    """An `off_loop` job whose caller had already given up when its turn came."""


def _ranked_use(use: float, now: float) -> _Rank:
    """How a record's `last_use` ranks by a reader's clock `now`: (use as ranked, stamp).

    A stamp more than `CREATED_AHEAD_S` ahead of `now` (a writer's clock far ahead, a
    forged record) ranks below every stamp not that far ahead, as never used: it would
    otherwise rank first, pushing out chains used since, until its time came. One less far
    ahead ranks as `now`. Ties go by the stamp. Only the stamp and the clock decide, never
    the order records are read in, as page listings rank creation times (`created_recency`).
    """
    if use <= now:
        return use, use
    return (now if use <= now + CREATED_AHEAD_S else -math.inf), use


def _evicted_before(evicted: dict[_K, tuple[float, ...]], key: _K, rank: tuple[float, ...]) -> bool:
    """Whether the chain `key` was evicted for room with a use ranked no lower than `rank`
    (a use as ranked, then where the record was stored: a record that must not come back in
    its place); a newer record ends the eviction."""
    last = evicted.get(key)
    if last is None:
        return False
    if rank <= last:
        return True
    del evicted[key]
    return False


class _Newer(NamedTuple):
    """A record of a newer manifest version: never loaded, carried by compaction as stored."""

    #: What deduplicates it: (version, namespace, last key) where it has them as this version
    #: knows them, else its bytes (only identical records are one).
    key: Hashable
    namespace: str | None
    priority: int
    last_use: float
    line: bytes


class _Envelope(msgspec.Struct):
    """What an older reader looks at in a record of any version: its `v`, and the fields that
    rank and deduplicate it, whatever their type."""

    v: int
    namespace: object = None
    keys: object = None
    priority: object = 0
    last_use: object = 0.0


_envelope_decoder = msgspec.json.Decoder(_Envelope)


def _newer_record(line: bytes) -> _Newer | None:
    """The record as one of a newer version (a JSON object with an integer `v` above this
    version's), or None. Fields that do not hold what this version means by them rank it
    lowest: priority 0, last use 0."""
    try:
        envelope = _envelope_decoder.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return None
    if envelope.v <= MANIFEST_VERSION:
        return None
    namespace = envelope.namespace if isinstance(envelope.namespace, str) else None
    priority = envelope.priority
    if (
        not isinstance(priority, int)
        or isinstance(priority, bool)
        or not -(2**31) <= priority < 2**31
    ):
        priority = 0
    last_use = envelope.last_use
    if (
        not isinstance(last_use, (int, float))
        or isinstance(last_use, bool)
        or not abs(last_use) < 1e12  # NaN, huge
    ):
        last_use = 0.0
    keys = envelope.keys
    chain = keys[-1] if isinstance(keys, list) and keys and isinstance(keys[-1], str) else None
    key: Hashable = line
    if namespace is not None and chain is not None:
        key = (envelope.v, namespace, chain)
    return _Newer(key, namespace, priority, float(last_use), line)


def _checked_line(
    line: bytes, limits: ManifestLimits, count: Callable[[str], None]
) -> ManifestEntry | _Newer | None:
    """A record line's entry, the line as a newer version's record, or None; `count` is told
    "records" for every line that is not blank, then "oversized" or "malformed" for those
    that are neither, "newer" for a newer version's."""
    if not line.strip():
        return None
    count("records")
    if len(line) > limits.max_entry_bytes:
        count("oversized")
        return None
    entry = decode_entry(line)
    if entry is not None:
        return entry
    newer = _newer_record(line)
    count("malformed" if newer is None else "newer")
    return newer


def decode_entry(line: bytes | memoryview) -> ManifestEntry | None:
    """A validated entry of this version, or None for anything else (malformed, or of a newer
    version). Never raises on bad bytes."""
    try:
        entry = _decoder.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        # RecursionError: deeply nested JSON in an unknown field, well within a record's size.
        return None
    if entry.v != MANIFEST_VERSION or not entry.keys or entry.num_tokens < 0:
        return None
    if not _HEX32.match(entry.namespace) or not all(_HEX64.match(k) for k in entry.keys):
        return None
    if len(set(entry.keys)) != len(entry.keys):
        # Each key of a chain hashes the one before, so a real chain never repeats one.
        return None
    if not (entry.last_use == entry.last_use and abs(entry.last_use) < 1e12):  # NaN, huge
        return None
    return entry


def carried_record(line: bytes) -> bool:
    """Whether a compaction keeps the record (it may still rank too low to): a valid entry
    of this version, or a record of a newer one."""
    return decode_entry(line) is not None or _newer_record(line) is not None


class ManifestCollector:
    """Keeps the newest record per chain, at most `max_entries` of them; of records with
    the same use, the one stored last (records are fed oldest first unless `newest_first`).
    Uses rank as `_ranked_use` says by the clock when the collector was made: a record
    stamped far ahead of it counts as the oldest.

    When full, the least valuable entries (lowest priority, then oldest use, then the first
    stored, whichever order records are fed in) make room, so a
    huge manifest costs bounded memory (twice `max_entries` at most between trims, and the
    chains the last trim evicted, remembered so that an older record read soon after does
    not bring one back; when compacting, per namespace, so a file holding many namespaces,
    or newer records naming many, costs more) and keeps what warmup would want most.

    With `carry` (a compaction's collector) `max_entries` bounds each namespace, and it also
    keeps every entry's record as stored, so that fields this version does not know survive,
    and the records of newer manifest versions (see `_Newer` for how they are deduplicated).
    Those compete with the entries of their namespace for room, ranked by their `priority`
    and `last_use` where these hold what this version means by them: they age out as entries
    do, and are never dropped while their namespace has room. `compacted` gives what a
    compaction writes. Without `carry` newer records are only counted.
    """

    def __init__(
        self,
        limits: ManifestLimits,
        namespace: str | None = None,
        *,
        newest_first: bool = False,
        carry: bool = False,
    ) -> None:
        self._limits = limits
        self._namespace = namespace
        # Which of two records of a chain with the same use wins: the later one stored,
        # which is the later fed, or with `newest_first` (records fed newest first) the
        # earlier fed.
        self._newest_first = newest_first
        self._carry = carry
        # Entries by (namespace, chain id) (tensor-parallel ranks' namespaces share page
        # keys), and with `carry` newer records by their key.
        self._held: dict[Hashable, ManifestEntry | _Newer] = {}
        # With `carry`: each held entry's record as stored, where it was given.
        self._lines: dict[Hashable, bytes] = {}
        # What `max_entries` bounds separately (see `_bound_of`), as of the last trim and since.
        self._namespaces: set[str | None] = set()
        # Chains the last trim evicted for room, with the newest use seen of each, as ranked:
        # an older record of one of them, met later, must not come back in its place. Only
        # the last trim's, as `MemoryManifest` keeps: every chain ever evicted would make a
        # read's memory follow the manifest's size, not `max_entries`. An older record met
        # after the next trim competes as any other, and with its chain's priority unchanged
        # ranks no higher than the chains that pushed it out.
        self._evicted: dict[Hashable, tuple[float, ...]] = {}
        # The clock uses are ranked by (see `_ranked_use`), one for the whole read.
        self._now = time.time()
        # Where each held record was stored, ascending in storage order whichever way records
        # are fed: records of the same rank go by it, so that readers in either order, and a
        # compaction's rewrite, keep the same chains (the order they are held in follows the
        # feeding order, which is the reverse when newest first).
        self._fed = 0
        self._stored_at: dict[Hashable, int] = {}
        self.records = 0
        self.malformed = 0
        self.oversized = 0
        self.newer = 0

    def add_line(self, line: bytes) -> None:
        """Adds a record line as stored (without its newline), validated."""
        record = _checked_line(line, self._limits, self._count)
        if isinstance(record, ManifestEntry):
            self._add(record.ident, record, line)
        elif record is not None and self._carry:
            self._add(record.key, record, None)

    def add_lines(self, lines: Iterable[bytes | int]) -> None:
        """Adds record lines as `add_line` does, in order; an int stands for a record left
        unread for its size (counted as a record, and as oversized)."""
        for line in lines:
            if isinstance(line, int):
                self.records += 1
                self.oversized += 1
            else:
                self.add_line(line)

    async def feed(self, lines: Iterable[bytes | int], *, owner: Hashable) -> None:
        """`add_lines` on a worker thread (see `off_loop`, which `owner` is for): a batch
        of records, or a lazy iterable over data the caller owns alone, so it is decoded
        there too."""
        await off_loop(functools.partial(self.add_lines, lines), owner=owner)

    def _count(self, what: str) -> None:
        setattr(self, what, getattr(self, what) + 1)

    def add_entry(self, entry: ManifestEntry, line: bytes | None = None) -> None:
        """Adds a valid entry (as `decode_entry` returns them), with its record as stored
        (without newline) if known; it counts as no record."""
        self._add(entry.ident, entry, line)

    def _rank(self, record: ManifestEntry | _Newer) -> _Rank:
        return _ranked_use(record.last_use, self._now)

    def _add(self, key: Hashable, record: ManifestEntry | _Newer, line: bytes | None) -> None:
        self._fed += 1
        namespace = record.namespace
        if self._namespace is not None and namespace not in (None, self._namespace):
            return
        # By rank, not stamp: a record stamped far ahead must not outlive a later one. Of
        # the same rank, the one stored later.
        at = -self._fed if self._newest_first else self._fed
        order = (*self._rank(record), at)
        if _evicted_before(self._evicted, key, order):
            return
        previous = self._held.pop(key, None)
        if previous is not None and (*self._rank(previous), self._stored_at[key]) > order:
            self._held[key] = previous
        else:
            self._held[key] = record
            self._stored_at[key] = at
            if self._carry and line is not None:
                self._lines[key] = line
            elif previous is not None:
                self._lines.pop(key, None)
        self._namespaces.add(self._bound_of(record))
        if len(self._held) >= 2 * self._limits.max_entries * len(self._namespaces):
            self._trim()

    def _bound_of(self, record: ManifestEntry | _Newer) -> str | None:
        """What `max_entries` bounds the record with: its namespace's records when
        compacting (a busy namespace must not push a quiet one's out of the store), all
        records read together when reading (what a reader holds)."""
        return record.namespace if self._carry else None

    def _trim(self) -> None:
        """Keep the `max_entries` most valuable records (of each namespace, with `carry`).
        Once per `max_entries` new chains (per namespace), not once per record: finding the
        least valuable costs a pass over all of them."""
        cap = self._limits.max_entries
        counts = Counter(self._bound_of(record) for record in self._held.values())
        self._namespaces = set(counts)
        excess = {bound: n - cap for bound, n in counts.items() if n > cap}
        if not excess:
            return
        # Among equals, the first stored goes first.
        at = self._stored_at
        ranked = sorted(
            self._held.items(),
            key=lambda item: (item[1].priority, self._rank(item[1]), at[item[0]]),
        )
        evicted: dict[Hashable, tuple[float, ...]] = {}  # replaces the last trim's (__init__)
        for key, worst in ranked:
            bound = self._bound_of(worst)
            left = excess.get(bound, 0)
            if left > 0:
                excess[bound] = left - 1
                del self._held[key]
                evicted[key] = (*self._rank(worst), at.pop(key))
                self._lines.pop(key, None)
        self._evicted = evicted

    def result(self, *, truncated: bool) -> ManifestRead:
        self._trim()
        entries = [r for r in self._held.values() if isinstance(r, ManifestEntry)]
        # A chain that is a strict prefix of another adds nothing, since loading the longer
        # one brings its pages too, unless it ranks higher (a pinned system prompt that
        # conversations continue): then it is kept, to be loaded first. Only a chain of the
        # same namespace that starts with the same keys covers it: ranks may share keys
        # across namespaces, and a damaged record may list any keys.
        # Only keys that end some chain are ever looked up: recording the others would
        # build (and free, in single calls that hold the GIL) a map of every key.
        idents = {e.ident for e in entries}
        covered: dict[tuple[str, str], ManifestEntry] = {}
        for e in entries:
            for k in e.keys[:-1]:
                at = (e.namespace, k)
                if at not in idents:
                    continue
                best = covered.get(at)
                if best is None or best.priority < e.priority:
                    covered[at] = e
        kept: list[ManifestEntry] = []
        dropped: list[ManifestEntry] = []
        for e in entries:
            (dropped if _covers(covered.get(e.ident), e) else kept).append(e)
        stored_at = self._stored_at
        ordered = sorted(
            kept, key=lambda e: (-e.priority, *(-x for x in self._rank(e)), -stored_at[e.ident])
        )
        lengths: dict[str, list[int]] = {}
        for e in dropped:
            # The entry that covers it may be dropped too: the kept one that covers that
            # (covering is transitive) starts with its keys as well.
            longer = covered[e.ident]
            while _covers(covered.get(longer.ident), longer):
                longer = covered[longer.ident]
            lengths.setdefault(covered_key(longer), []).append(len(e.keys))
        for found in lengths.values():
            found.sort()
        return ManifestRead(
            entries=ordered,
            malformed=self.malformed,
            oversized=self.oversized,
            truncated=truncated,
            newer=self.newer,
            covered=lengths,
        )

    def compacted(self, budget: int) -> list[tuple[Hashable, bytes]]:
        """What a compaction writes: (key, record as stored, without newline) of the entries
        `result` returns and of the newer records held, the most valuable that fit `budget`
        bytes (newlines counted; the most valuable always), oldest use first, so that
        appends after the compaction keep "later replaces earlier"."""
        at = self._stored_at
        ranked: list[tuple[int, _Rank, Hashable, bytes]] = [
            (
                e.priority,
                self._rank(e),
                e.ident,
                self._lines.get(e.ident) or encode_entry(e)[:-1],
            )
            for e in self.result(truncated=False).entries
        ]
        ranked += [
            (r.priority, self._rank(r), r.key, r.line)
            for r in self._held.values()
            if isinstance(r, _Newer)
        ]
        # Of equal rank, the last stored first.
        ranked.sort(key=lambda r: (-r[0], *(-x for x in r[1]), -at[r[2]]))
        kept: list[tuple[int, _Rank, Hashable, bytes]] = []
        used = 0
        for record in ranked:
            nbytes = len(record[3]) + 1
            if kept and used + nbytes > budget:
                continue
            kept.append(record)
            used += nbytes
        # Oldest use as ranked first: a record stamped far ahead before every other; of equal
        # rank, in the order they were stored, which a later read then goes by.
        kept.sort(key=lambda r: (r[1], at[r[2]]))
        return [(r[2], r[3]) for r in kept]


def _covers(longer: ManifestEntry | None, entry: ManifestEntry) -> bool:
    """Whether loading `longer` loads all of `entry` and ranks as high."""
    return (
        longer is not None
        and longer.priority >= entry.priority
        and longer.keys[: len(entry.keys)] == entry.keys
    )


def _open_for_lines(path: Path, box: list[BinaryIO], abandoned: list[bool]) -> BinaryIO:
    """Open `path` for `_lines` (on a worker thread). Whichever of this thread and a
    cancelled reader pops the file from `box` closes it (`list.pop` is atomic), so a file
    opened after its reader was cancelled is closed exactly once, whatever the loop does."""
    f = open(path, "rb", opener=_open_regular)  # noqa: SIM115 - handed to the reader
    box.append(f)
    if abandoned:
        with contextlib.suppress(IndexError):
            box.pop().close()
    return f


async def _lines(
    path: Path, limits: ManifestLimits, *, whole: bool = False
) -> AsyncGenerator[bytes | None, None]:
    """Lines of the file, each at most max_entry_bytes + 1 long (longer ones cut: oversized).

    Yields None at the end if the byte bound stopped the read early. Reads in chunks so an
    endless line costs no more memory than the bound.
    """
    chunk_size = 256 * 1024
    total = 0
    pending = bytearray()
    skipping = False
    loop = asyncio.get_running_loop()
    box: list[BinaryIO] = []
    abandoned: list[bool] = []
    try:
        raw = await loop.run_in_executor(None, _open_for_lines, path, box, abandoned)
    except FileNotFoundError:
        return
    except BaseException:
        # Cancelled: the worker thread may still open the file. Left to the collector, it
        # would hold a descriptor meanwhile and warn (ResourceWarning).
        abandoned.append(True)
        with contextlib.suppress(IndexError):
            box.pop().close()  # read-only: a close that cannot block
        raise
    f = aiofiles.threadpool.wrap(raw, loop=loop)
    try:
        while True:
            chunk = await f.read(chunk_size)
            if not chunk:
                break
            total += len(chunk)
            start = 0
            while True:
                end = chunk.find(b"\n", start)
                piece = chunk[start:] if end < 0 else chunk[start:end]
                if not skipping:
                    pending += piece
                    if len(pending) > limits.max_entry_bytes:
                        skipping = True
                if end < 0:
                    break
                if skipping:
                    yield bytes(limits.max_entry_bytes + 1)  # stands for an oversized line
                    skipping = False
                else:
                    yield bytes(pending)
                pending.clear()
                start = end + 1
            if total >= limits.max_bytes and not whole:
                yield None
                return
    finally:
        # Shielded: a read cut short by a cancel scope (warmup's deadline) still closes it.
        with anyio.CancelScope(shield=True):
            await f.close()
    if skipping:
        yield bytes(limits.max_entry_bytes + 1)
    elif pending:
        yield bytes(pending)


# Bytes of records a file manifest's reader decodes in one hand-off to a worker thread: few
# hand-offs (64 for a manifest at the default byte bound), each bounding what is held.
_FEED_BYTES = 1 << 20


async def _collect_file(
    path: Path, limits: ManifestLimits, collector: ManifestCollector, *, whole: bool = False
) -> bool:
    """Feed the records of the file at `path` to `collector`, decoded on worker threads in
    batches; returns whether the byte bound stopped the read (never with `whole`)."""
    owner = _owner_of(path)
    batch: list[bytes | int] = []
    size = 0
    truncated = False
    async with contextlib.aclosing(_lines(path, limits, whole=whole)) as lines:
        async for line in lines:
            if line is None:
                truncated = True
                break
            batch.append(line)
            size += len(line)
            if size >= _FEED_BYTES:
                await collector.feed(batch, owner=owner)
                batch, size = [], 0
    if batch:
        await collector.feed(batch, owner=owner)
    return truncated


def _owner_of(path: Path) -> tuple[str, str]:
    """What a file manifest's work is gated by (see `off_loop`): the file, however named."""
    return ("file", os.path.abspath(path))


def _compacted_file(
    collector: ManifestCollector, budget: int
) -> tuple[list[tuple[Hashable, bytes]], bytes]:
    """What a file compaction keeps, and the file it writes."""
    kept = collector.compacted(budget)
    return kept, b"".join(line + b"\n" for _, line in kept)


def _append_records(path: str, data: bytes, wanted: Callable[[], bool]) -> int:
    """Append `data` (whole lines) to the file; returns its size after. A last line left
    without its newline (a writer killed mid-write) is ended first, so only that record is
    lost, not the first of these. All or nothing: a write that fails part-way (a full disk)
    is cut back to the size before it, so no record of a failed append lands and no torn
    one is left for readers; so is one that `wanted()` stops (the caller gave up: it was
    told the append failed), unless the write under way had already written everything.
    The caller holds the manifest's lock, so nothing else appended meanwhile. A file with
    another hard link is first replaced by a copy of its own (see `_unshared`)."""
    fd = _unshared(path, _open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT))
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view and wanted():
                view = view[os.write(fd, view) :]
        finally:
            if view:
                # Best effort: should the cut fail too, the next append ends the torn line,
                # so only these records are lost.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _unshared(path: str, fd: int) -> int:
    """`fd`, the manifest at `path` opened for appending, when its file has no other hard
    link; else a descriptor of a copy that replaced it (`fd` is closed). A link from a
    snapshot of the root (`cp -al`, `rsync --link-dest`) or from outside it names the same
    file: an append (or its cut after a failed write) would change it under that name too.
    The caller holds the manifest's lock."""
    try:
        if os.fstat(fd).st_nlink <= 1:
            return fd
        parent, name = os.path.split(path)
        # Named as a compaction's temporary file, so that one left by a crash is removed.
        temp = os.path.join(parent, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        copy = _open_regular(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            offset = 0
            while chunk := os.pread(fd, 8 << 20, offset):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(copy, view) :]
                offset += len(chunk)
            # As a compaction's file is: the rename may reach the disk before the data, and
            # a crash then would leave an empty manifest where it held every record.
            os.fsync(copy)
            os.close(copy)
            copy = -1
            os.replace(temp, path)
        except BaseException:
            if copy >= 0:
                os.close(copy)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return _open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)


def _remove_temp_files(path: Path) -> int:
    """Remove the temp files of compactions of the manifest at `path`; how many. Only with
    its lock held: a compaction under way has one."""
    lead = f".{path.name}."
    removed = 0
    with contextlib.suppress(OSError), os.scandir(path.parent) as found:
        for item in found:
            if item.name.startswith(lead) and item.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(item.path)
                    removed += 1
    return removed


def remove_dead_compactions(path: Path) -> int:
    """Remove the temp files that compactions of the manifest at `path` left when their
    process died, unless a compaction holds the manifest's lock now; how many. Blocking: for
    a store's verify (the next compaction removes them too)."""
    lock_path = str(path.with_name(f".{path.name}.lock"))
    try:
        fd = open_lock_fd(lambda: _open_regular(lock_path, os.O_RDWR | os.O_CREAT))
    except (OSError, StorageError):
        return 0  # no lock to take (a read-only or damaged root): nothing is removed
    try:
        return _remove_temp_files(path) if _try_lock(fd) else 0
    finally:
        close_lock_fd(fd)


def _write_temp(path: str, data: bytes, wanted: Callable[[], bool]) -> None:
    """Write `data` into a new file at `path` and sync it; stops early (OSError EINTR) once
    nobody waits for it."""
    fd = _open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        view = memoryview(data)
        while view:
            if not wanted():
                raise OSError(errno.EINTR, "the compaction was given up")
            view = view[os.write(fd, view[: 8 << 20]) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _open_regular(path: str, flags: int) -> int:
    """Open a file of the manifest (created 0600 with O_CREAT), never through a symlink, and
    refuse anything but a regular file, or one this user may not open (EACCES, EPERM), with
    StorageError. Opened non-blocking, so that a
    FIFO planted in its place fails here instead of blocking the thread for ever (a
    write-only open of one without a reader fails with ENXIO); blocking again once known to
    be a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except PermissionError as exc:
        # A manifest or lock file of another user, or one chmod'ed away: what to fix, named.
        raise StorageError(
            f"{path}: {exc.strerror or exc}: give this user read and write permission on it "
            "(chmod u+rw)"
        ) from exc
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO without a reader, or a socket
            raise _not_regular(path, "a FIFO or a socket") from None
        raise
    try:
        _check_regular(fd, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(fd: int, path: str) -> None:
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):  # as an open of one for writing fails
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not stat.S_ISREG(mode):
        raise _not_regular(path, _file_kind(mode))


def _not_regular(path: str, kind: str) -> StorageError:
    return StorageError(
        f"{path} is {kind}, not a regular file; remove it (it is created again as needed)"
    )


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def check_same_process(name: str, owner_pid: int) -> None:
    """Refuse a manifest made in process `owner_pid` and used in a child forked from it: the
    store it belongs to is refused there too (its threads, locks and connections are the
    parent's). An integer comparison, so every call can afford it."""
    if current_pid() != owner_pid:
        raise StorageError(forked_error(name, owner_pid))


class FileManifest:
    """A manifest in one JSON-lines file, appended as a stream and compacted atomically."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        limits: ManifestLimits | None = None,
        *,
        guard: Callable[[], Awaitable[None]] | None = None,
        owner_pid: int | None = None,
    ):
        """`guard`, when given, is awaited before every append, read and compaction and may
        refuse it by raising StorageError (a file store's check that its root, which the
        manifest's path goes through, was not replaced since it was opened). `owner_pid`:
        the process it belongs to (default: this one), whose forked children it refuses,
        even the calls that do nothing."""
        self.path = Path(path)
        self.limits = limits or ManifestLimits()
        self._guard = guard
        self._pid = current_pid() if owner_pid is None else owner_pid
        # This instance's appends and compactions take the file's lock in turn: tries of a
        # lock held elsewhere are polls, which would otherwise let newcomers overtake.
        self._turns = anyio.Lock()

    async def append(self, entries: Sequence[ManifestEntry]) -> None:
        """Append records (one write); compacts once the file passes its byte bound.

        Cancellable at every step, so a deadline around it holds even while another
        process holds the manifest's lock or the filesystem stalls. An append given up
        while its thread waits on the filesystem writes nothing after that, except a write
        already under way, which completes (its records land whole); that thread holds the
        lock until it ends, so no compaction can lose them. Raises StorageError when the
        manifest or its lock file is not a regular file (a FIFO, say) or this user may not
        open it, OSError on an I/O error.
        """
        check_same_process(f"the manifest {self.path}", self._pid)
        if not entries:
            await anyio.lowlevel.checkpoint()  # an async call always lets the loop run once
            return
        await self._check()
        data = b"".join(encode_entry(e) for e in entries)
        async with self._turns:
            lock_fd = await _lock(self.path)
            try:
                # Again once the lock is held: the root may have been replaced while this
                # append waited for it.
                await self._check()
            except BaseException:
                _unlock(lock_fd)
                raise
            # The lock is released when the write ends: here, or by the thread if this task
            # gives up while the thread runs (see _Handoff).
            size = await _Handoff(
                functools.partial(_append_records, str(self.path), data),
                lambda _: _unlock(lock_fd),
            ).run()
            close_lock_fd(lock_fd)
        if size > self.limits.max_bytes:
            await self.compact()

    async def read(self, *, namespace: str | None = None) -> ManifestRead:
        """The newest record per chain (of `namespace`, if given), bounded by the limits.
        Raises StorageError when the manifest is not a regular file (a FIFO, say) or this
        user may not read it."""
        await self._check()
        collector = ManifestCollector(self.limits, namespace)
        truncated = await _collect_file(self.path, self.limits, collector)
        return await off_loop(
            functools.partial(collector.result, truncated=truncated), owner=_owner_of(self.path)
        )

    async def compact(self) -> CompactReport:
        """Rewrite the file with one valid record per chain; atomic (temp file + rename).

        Holds the manifest's lock throughout, so appends from this or another process on a
        shared root wait instead of landing in the file being replaced. The wait for the lock
        can be cancelled. Raises StorageError when the manifest or its lock file is not a
        regular file or this user may not open it.
        """
        await self._check()
        async with self._turns, _file_lock(self.path):
            return await self._compact()

    async def _check(self) -> None:
        check_same_process(f"the manifest {self.path}", self._pid)
        if self._guard is not None:
            await self._guard()

    async def _compact(self) -> CompactReport:
        try:
            before = (await aiofiles.os.stat(self.path)).st_size
        except FileNotFoundError:
            before = 0
        # The whole file, newest records included: memory stays bounded by the collector,
        # which keeps `max_entries` per namespace, each record as stored.
        collector = ManifestCollector(self.limits, carry=True)
        await _collect_file(self.path, self.limits, collector, whole=True)
        kept, data = await off_loop(
            functools.partial(_compacted_file, collector, self.limits.max_bytes // 2),
            owner=_owner_of(self.path),
        )
        # The lock is held, so no other compaction runs: a temporary file of one is a
        # leftover of a process that died compacting.
        await anyio.to_thread.run_sync(_remove_temp_files, self.path)
        # Named for this compaction alone: one given up may still be writing its temp file
        # when the next of this process begins, and removes only its own.
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            # On a thread the caller may give up waiting for; whichever side ends last removes
            # the file then, so a cancel while it is being opened leaves none behind.
            await _Handoff(
                functools.partial(_write_temp, str(temp), data),
                lambda _: _remove_quietly(temp),
            ).run()
            await self._check()  # the root may have been replaced while this compaction ran
            await aiofiles.os.replace(temp, self.path)
        except BaseException:
            # Failed or cancelled short of the replace: a temporary file left on a full disk
            # would hold the last free space until the next compaction, which would fail the
            # same way. (A replace that went through after all leaves nothing to remove.)
            _remove_quietly(temp)
            raise
        return CompactReport(
            records_before=collector.records,
            entries_after=len(kept),
            bytes_before=before,
            bytes_after=len(data),
            malformed=collector.malformed,
            oversized=collector.oversized,
            newer=collector.newer,
        )


class MemoryManifest:
    """A manifest kept in process memory (for MemoryStorage): the newest record of each chain.

    Records are validated as they are appended, as a reader would validate them, and only the
    newest of a chain is kept, so memory follows `max_entries`, not the number of appends (a
    record of a newer manifest version is counted as `newer` and not kept: the records come
    from this process, whose readers are of this version).
    Once a namespace holds `2 * max_entries` chains, or `max_bytes` of records are held, the
    least valuable make room in one pass, which leaves at most `max_entries` of each
    namespace (as a compaction does), within `max_bytes // 2` for all of them together: that
    pass runs at most once per `max_entries` new chains of a namespace or `max_bytes // 2`
    appended bytes, so an append costs amortized O(1) on the loop instead of an occasional
    rewrite of everything.
    """

    def __init__(
        self, limits: ManifestLimits | None = None, *, owner_pid: int | None = None
    ) -> None:
        """`owner_pid`: the process it belongs to (default: this one), whose forked children
        it refuses."""
        self.limits = limits or ManifestLimits()
        # By (namespace, chain id), as ManifestCollector keys chains, in the order the records
        # held were appended: the rank (priority, last use) and the record line of each
        # chain's newest record. Lines rather than entries: bytes and flat tuples are not
        # tracked by the garbage collector, so a full manifest does not slow every full
        # collection.
        self._held: dict[tuple[str, str], tuple[tuple[int, float], bytes]] = {}
        self._bytes = 0
        # Chains held per namespace: `max_entries` bounds each, as compaction bounds it.
        self._chains: Counter[str] = Counter()
        # Chains the last trim dropped, with their newest use as ranked: an older record of
        # one of them, appended later, must not come back in its place. Only the last trim's,
        # so this stays bounded too.
        self._evicted: dict[tuple[str, str], tuple[float, ...]] = {}
        # Since the last compaction, counted as a log of records would count them.
        self._records = 0
        self._malformed = 0
        self._oversized = 0
        self._newer = 0
        self._compacting = anyio.Lock()
        self._pid = current_pid() if owner_pid is None else owner_pid

    def _count(self, what: str) -> None:
        setattr(self, f"_{what}", getattr(self, f"_{what}") + 1)

    async def append(self, entries: Sequence[ManifestEntry]) -> None:
        """Validate and record `entries`; an older record of a chain never replaces a newer."""
        check_same_process("a memory manifest", self._pid)
        for entry in entries:
            self._add_line(encode_entry(entry))
        await anyio.lowlevel.checkpoint()

    def _add_line(self, line: bytes) -> None:
        # Decoded from its encoding, an entry meets exactly the checks a reader applies.
        entry = _checked_line(line, self.limits, self._count)
        if not isinstance(entry, ManifestEntry):
            return
        ident = entry.ident
        now = time.time()
        rank = _ranked_use(entry.last_use, now)
        # Stored after every record a trim dropped: of the same rank, it is the newer.
        if _evicted_before(self._evicted, ident, (*rank, 1)):
            return
        previous = self._held.get(ident)
        if previous is not None:
            if _ranked_use(previous[0][1], now) > rank:
                # Left where it is: the order held is the order the records kept were
                # stored, which records of the same rank go by, as a reader's.
                return
            del self._held[ident]
            self._bytes -= len(previous[1])
        else:
            self._chains[ident[0]] += 1
        self._held[ident] = ((entry.priority, entry.last_use), line)
        self._bytes += len(line)
        limits = self.limits
        if self._chains[ident[0]] >= 2 * limits.max_entries or self._bytes > limits.max_bytes:
            self._trim()

    def _trim(self) -> None:
        """Keep the most valuable records (highest priority, then newest use): at most
        `max_entries` of each namespace, within `max_bytes // 2` for all (a record that does
        not fit makes way for a less valuable one that does, as compaction's fit does)."""
        limits = self.limits
        now = time.time()

        def rank(
            item: tuple[tuple[str, str], tuple[tuple[int, float], bytes]],
        ) -> tuple[int, _Rank]:
            (priority, use), _ = item[1]
            return priority, _ranked_use(use, now)

        # Stable and ascending, walked from the end: among equals the first recorded goes
        # first, as in ManifestCollector.
        ranked = sorted(self._held.items(), key=rank)
        kept: dict[tuple[str, str], tuple[tuple[int, float], bytes]] = {}
        chains: Counter[str] = Counter()
        evicted: dict[tuple[str, str], tuple[float, ...]] = {}
        used = 0
        budget = limits.max_bytes // 2
        for ident, held in reversed(ranked):
            if chains[ident[0]] < limits.max_entries and used + len(held[1]) <= budget:
                kept[ident] = held
                chains[ident[0]] += 1
                used += len(held[1])
            else:
                evicted[ident] = (*_ranked_use(held[0][1], now), 0)
        self._held = {ident: held for ident, held in self._held.items() if ident in kept}
        self._bytes = used
        self._chains = chains
        self._evicted = evicted

    async def read(self, *, namespace: str | None = None) -> ManifestRead:
        """The newest record per chain (of `namespace`, if given), bounded by the limits.

        At most `max_bytes` of records are read, newest first, as the file and Redis
        manifests bound theirs; `truncated` says the bound stopped the read (the limits may
        have been lowered since the records were appended). The records are decoded and
        ranked on a worker thread (see `off_loop`), from a snapshot taken as the read begins:
        appends and compactions meanwhile do not change what it returns.
        """
        check_same_process("a memory manifest", self._pid)
        limits = self.limits
        collector = ManifestCollector(limits, namespace)
        collector.malformed, collector.oversized = self._malformed, self._oversized
        collector.newer = self._newer
        lines, truncated = self._newest_lines(namespace)
        return await off_loop(
            functools.partial(_read_held, collector, limits, lines, truncated=truncated),
            owner=self,
        )

    def _newest_lines(self, namespace: str | None) -> tuple[list[bytes], bool]:
        """The newest held lines (of `namespace`) within `max_bytes`, in the order they were
        recorded, and whether older ones were left out. An oversized line counts its bytes
        as well, as a reader of a log would have read them."""
        budget = self.limits.max_bytes
        used = 0
        newest: list[bytes] = []
        for ident, (_, line) in reversed(self._held.items()):
            if namespace is not None and ident[0] != namespace:
                continue
            if used + len(line) > budget:
                return newest[::-1], True
            used += len(line)
            newest.append(line)
        return newest[::-1], False

    async def compact(self) -> CompactReport:
        """Keep the newest valid record per chain as a reader sees them (prefixes covered by
        a longer chain dropped), fitting half of `max_bytes`, and reset the counts of records,
        malformed and oversized.

        A snapshot of at most `2 * max_entries` records is ranked on a worker thread (see
        `off_loop`), then what it kept replaces it in one step: readers see the manifest
        before or after it. Records appended meanwhile are kept, as are the counts they add;
        a compaction cancelled changes nothing.
        """
        check_same_process("a memory manifest", self._pid)
        # One at a time: each takes away the counts of its snapshot.
        async with self._compacting:
            snapshot = self._held.copy()
            limits = self.limits
            records, malformed, oversized = self._records, self._malformed, self._oversized
            newer, before = self._newer, self._bytes
            kept, report_oversized, after = await off_loop(
                functools.partial(_compact_held, limits, snapshot, oversized), owner=self
            )
            # Nothing is awaited from here on: the compaction lands whole or (cancelled
            # above) not at all. What the snapshot held and is held as it was (the same
            # record) is kept as ranked; a chain appended or replaced since was not ranked,
            # and is kept as the newest recorded, as if appended after the compaction; one a
            # trim dropped since stays dropped.
            held = self._held
            compacted = {
                ident: snapshot[ident] for ident in kept if held.get(ident) is snapshot[ident]
            }
            survivors = len(compacted)
            for ident, record in held.items():
                if snapshot.get(ident) is not record:
                    compacted[ident] = record
            self._held = compacted
            self._bytes = sum(len(line) for _, line in compacted.values())
            self._chains = Counter(ident[0] for ident in compacted)
            self._records += survivors - records
            self._malformed -= malformed
            self._oversized -= oversized
            self._newer -= newer
        return CompactReport(
            records_before=records,
            entries_after=len(kept),
            bytes_before=before,
            bytes_after=after,
            malformed=malformed,
            oversized=report_oversized,
            newer=newer,
        )


def _add_held(
    collector: ManifestCollector, limits: ManifestLimits, line: bytes, *, stored: bool = False
) -> None:
    """Adds a line a memory manifest holds to `collector` (with `stored`, as its record)."""
    # Checked again: `MemoryStorage.manifest(limits)` may have lowered the bound since.
    if len(line) > limits.max_entry_bytes:
        collector.oversized += 1
    else:
        collector.add_entry(_held_entry(line), line[:-1] if stored else None)


def _read_held(
    collector: ManifestCollector, limits: ManifestLimits, lines: list[bytes], *, truncated: bool
) -> ManifestRead:
    """A memory manifest's read of `lines` (oldest first), with `collector`."""
    for line in lines:
        _add_held(collector, limits, line)
    return collector.result(truncated=truncated)


def _compact_held(
    limits: ManifestLimits,
    held: dict[tuple[str, str], tuple[tuple[int, float], bytes]],
    oversized: int,
) -> tuple[list[tuple[str, str]], int, int]:
    """A memory manifest's compaction of `held` (`oversized` counted so far): the chains it
    keeps, oldest use first, the oversized count, and the bytes of the records kept."""
    collector = ManifestCollector(limits, carry=True)
    collector.oversized = oversized
    for _, line in held.values():
        _add_held(collector, limits, line, stored=True)
    # Only entries are held here, so every key kept is a chain's (namespace, chain id).
    kept = [cast(tuple[str, str], key) for key, _ in collector.compacted(limits.max_bytes // 2)]
    return kept, collector.oversized, sum(len(held[ident][1]) for ident in kept)


def _held_entry(line: bytes) -> ManifestEntry:
    """The entry of a line a memory manifest holds: it was validated when appended."""
    return _decoder.decode(line)


class _Handoff(Generic[_T]):
    """Work on a worker thread that its caller may stop waiting for (a deadline, a cancel),
    and who then releases what the work holds.

    The caller owns the work's result when it gets it; `release` is not called then. If the
    work raises, or the caller gives up first, `release` is called exactly once, with the
    work's result (None if it raised or never ran), by whichever side comes last: the
    caller, or the thread ending. Work that had not begun when the caller gave up never
    runs; work under way cannot be stopped, so it runs to its end, seeing through the
    `wanted` it is handed that nobody waits for it any more.
    """

    def __init__(
        self,
        work: Callable[[Callable[[], bool]], _T],
        release: Callable[[_T | None], None],
    ) -> None:
        self._work = work
        self._release = release
        self._mutex = threading.Lock()
        self._began = self._ended = self._given_up = False
        self._result: _T | None = None

    def _wanted(self) -> bool:
        with self._mutex:
            return not self._given_up

    def _run(self) -> _T | None:
        with self._mutex:
            if self._given_up:
                return None  # never begun: the caller released
            self._began = True
        try:
            self._result = self._work(self._wanted)
            return self._result
        finally:
            if self._end():
                self._release(self._result)

    def _end(self) -> bool:
        """Mark the work ended; returns whether the caller gave up (then the thread releases)."""
        with self._mutex:
            self._ended = True
            return self._given_up

    async def run(self) -> _T:
        try:
            result = await anyio.to_thread.run_sync(self._run, abandon_on_cancel=True)
        except BaseException:
            with self._mutex:
                self._given_up = True
                release = not self._began or self._ended
            if release:
                self._release(self._result)
            raise
        # Only a caller that did not give up gets here, and to it the work returned.
        return cast(_T, result)


def _unlock(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            close_lock_fd(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


# Pauses between tries of a lock another process holds: short at first (an append holds it
# for one write) and never long, as a waiter that pauses long loses the lock to newcomers.
_LOCK_PAUSE_FIRST_S = 0.001
_LOCK_PAUSE_MAX_S = 0.005


async def _lock(path: Path) -> int:
    """A descriptor of `<manifest>.lock` holding an exclusive flock on it; closing it
    releases the lock. Waiting can be cancelled at any point: the open and each try run on
    threads the caller need not wait for (see _Handoff), and the flock is tried without
    blocking, with pauses between tries."""
    lock_path = str(path.with_name(f".{path.name}.lock"))
    # Registered from its open to its close, so that a child forked meanwhile closes its copy
    # (see _flocks): one it kept would hold the lock for the child's life.
    fd = await _Handoff(
        lambda _: open_lock_fd(lambda: _open_regular(lock_path, os.O_RDWR | os.O_CREAT)),
        _unlock,
    ).run()
    pause = _LOCK_PAUSE_FIRST_S
    # A failed or cancelled try has closed the descriptor (its release).
    while not await _Handoff(lambda _: _try_lock(fd), lambda _: _unlock(fd)).run():
        try:
            await anyio.sleep(pause)
        except BaseException:
            close_lock_fd(fd)
            raise
        pause = min(2 * pause, _LOCK_PAUSE_MAX_S)
    return fd


@contextlib.asynccontextmanager
async def _file_lock(path: Path) -> AsyncIterator[None]:
    """An exclusive flock on `<manifest>.lock` (see `_lock`), held for the block."""
    fd = await _lock(path)
    try:
        yield
    finally:
        close_lock_fd(fd)


class _RecordClock:
    """Wall-clock time for records' `last_use`, each later than the one before (see
    `record_time`), unless the clock went back more than `CREATED_AHEAD_S`."""

    __slots__ = ("_clock", "_last", "_lock")

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last = -math.inf

    def now(self) -> float:
        with self._lock:
            wall = time.time() if self._clock is None else self._clock()
            # Readers rank a stamp that far ahead of their clocks as never used: after a
            # clock that jumped ahead is set right, staying above it would make every record
            # of this process rank so, for the rest of its life.
            if self._last - wall > CREATED_AHEAD_S:
                self._last = wall
            else:
                self._last = max(math.nextafter(self._last, math.inf), wall)
            return self._last

    def forget_lock(self) -> None:
        # A child forked while another thread held the lock would inherit it held for ever.
        self._lock = threading.Lock()


_RECORD_CLOCK = _RecordClock()
os.register_at_fork(after_in_child=_RECORD_CLOCK.forget_lock)


def record_time() -> float:
    """Wall-clock time for a record's `last_use`, which readers compare across instances;
    always later than the one this process handed out before. Process-wide, not per backup
    worker: each attach runs a worker of its own, and after a detach, an attach and a clock
    stepped back (NTP, a VM's resume) the chains recorded since must not rank (and get
    trimmed) as older than those recorded before, nor lose to their own older records. After
    a step back of more than `CREATED_AHEAD_S`, the time is the clock's again: readers rank
    records that far ahead of their clocks as never used, so holding to them would make every
    later record of this process rank so too."""
    return _RECORD_CLOCK.now()


def chain_entry(
    namespace: bytes, keys: Iterable[bytes], num_tokens: int, priority: int, last_use: float
) -> ManifestEntry:
    """The entry recording one chain (keys from the root, in order)."""
    return ManifestEntry(
        namespace=namespace.hex(),
        keys=[k.hex() for k in keys],
        num_tokens=num_tokens,
        priority=priority,
        last_use=last_use,
    )
