"""The warmup manifest of `MooncakeStorage`, kept in the Mooncake store as immutable objects.

Mooncake has no lists, no renames, no compare-and-swap, and an object, once put, never
changes until it is removed (a second `put` of a name returns 0 and keeps the first value).
So the manifest of a namespace `<ns>` is a set of immutable objects under
`<prefix>:manifest:<ns>:`:

    index.0, index.1        the index of generation g lives in slot g % 2: its stem, how
                            many base chunks it has, and the rest of the previous log it
                            carries (generation 0 has no index)
    <stem>:b<i>             base chunks: the records a compaction kept
    <stem>:l<seq>           log chunks: one per append (more for a large one), seq 0, 1, ...
    lock                    held by the one compaction that may run

A chunk is a header line with a random token, then JSON records. Appends claim the next
free `seq` by putting a chunk and reading it back: if the token is not theirs another writer
won that seq, and they take the next one. Every object is hard-pinned (Mooncake never evicts
it); readers fetch at most `chunk_bytes` per object into the backend's registered arena, so
an object of any size costs bounded memory.

A compaction writes the new base chunks under a fresh stem, folds in what was appended
meanwhile, then puts the new index in the other slot (the switch: one object appears whole),
copies what was appended during the switch into the new log, and only then removes the old
index and the old generation's chunks. Until then the new index carries the old log from
where the switch began, so readers see those records, and a compaction that dies after its
switch leaves them for the next one to fold in. Readers see the old generation or the new one,
complete; a reader overtaken by a switch starts over. An appender that finds the stem
changed after its put writes its records again under the new stem and removes its copy.
"""

from __future__ import annotations

import functools
import http.client
import os
import re
import threading
import time
import urllib.request
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import msgspec
import structlog

from .._errors import StorageError
from .._forks import current_pid
from ._base import _State
from ._manifest import (
    CompactReport,
    ManifestCollector,
    ManifestEntry,
    ManifestLimits,
    ManifestRead,
    add_reports,
    carried_record,
    check_same_process,
    encode_entry,
    off_loop,
)
from ._redact import mask_userinfo

if TYPE_CHECKING:
    from ._mooncake import MooncakeStorage

__all__ = ["MooncakeManifest"]

_log = structlog.get_logger("hicache_async")

_NAMESPACE = re.compile(r"[0-9a-f]{32}\Z")
_STEM = re.compile(r"g0\Z|g([1-9][0-9]{0,17})-[0-9a-f]{16}\Z")
#: The name of a chunk under a namespace's lead: `<stem>:b<i>` or `<stem>:l<seq>`.
_CHUNK_NAME = re.compile(rb"(g0|g[1-9][0-9]{0,17}-[0-9a-f]{16}):[bl](0|[1-9][0-9]{0,17})\Z")
_CHUNK_MAGIC = b"#hicache-manifest-chunk "
#: The header line of a chunk: the magic, a 16-hex-digit token and a newline.
_HEADER_BYTES = len(_CHUNK_MAGIC) + 17
_NOT_READY = -703  # being put: not visible yet
_NOT_FOUND = -704
_TOO_LARGE = -600
_RPC_FAIL = -900  # the master did not answer
#: What `_get` gives for an object larger than its bound (not read).
_OVERSIZED = -1
#: What `_get(..., gaps=True)` gives for an object whose transfer failed (a replica in the
#: segment of a client that died and that the master has not dropped yet, for instance).
_UNREADABLE = -2
#: Largest chunk object; a record must fit one chunk.
_CHUNK_BYTES = 1 << 20
_INDEX_BYTES = 64 << 10
#: Sequence numbers probed per `batch_is_exist`; a gap this long ends a log.
_PROBE = 64
# Rounds of eight claims, each after looking for the log's end again, before an append gives up.
_CLAIM_ROUNDS = 64
#: An append that lands at this seq (or later) compacts the namespace.
_LOG_CHUNKS = 256
#: Chunks read per Mooncake call.
_READ_BATCH = 16
_ATTEMPTS = 3
#: Bound on an index's `carry_from` (a log this long would have compacted long before).
_MAX_CARRY_FROM = 1 << 20
#: A lock older than this belongs to a compaction that died; it may be broken. So may one
#: that expires more than this later than one taken now would (see `_lock`).
_LOCK_TTL_S = 300.0
_ADMIN_TIMEOUT_S = 10.0
_MAX_NAMESPACES = 4096


class _Index(msgspec.Struct, frozen=True):
    v: int
    namespace: str
    generation: int
    stem: str
    base: int
    # The previous generation's stem and the seq from which its log may hold records not yet
    # copied into this one (a compaction that died between its switch and that copy): readers
    # and the next compaction read them too. Added in place: older indexes decode without it.
    carry: str = ""
    carry_from: int = 0


class _Lock(msgspec.Struct, frozen=True):
    token: str
    expires: float


class _Stale(Exception):
    """A compaction switched generations while a read was under way."""


class _NewerLayout(Exception):
    """The namespace's manifest has an index of a newer layout version than this one knows:
    a newer release keeps it, in objects this one would misread."""


class _IndexVersion(msgspec.Struct):
    """What any index version holds: its layout version and namespace."""

    v: int
    namespace: object = None


#: The index layout version this release writes and reads.
_INDEX_VERSION = 1


_GEN0 = "g0"


class MooncakeManifest:
    """A bounded, per-namespace warmup manifest of immutable Mooncake objects.

    Build it with `MooncakeStorage.manifest()`. Listing namespaces (a `read()` without a
    namespace, `compact()`) needs the master's admin URL; without it only the namespaces
    this object has appended to are known.
    """

    def __init__(self, storage: MooncakeStorage, limits: ManifestLimits | None = None) -> None:
        self.limits = limits or ManifestLimits()
        self._storage = storage
        self._known: set[str] = set()
        self._config: Any = None
        # One made in a forked child of the process that opened the store is that process's,
        # as the store is: the child is refused both.
        self._pid = current_pid() if storage._state is _State.NEW else storage._pid

    def _check_process(self) -> None:
        # The store refuses a forked child's calls, but a call that sends none (an empty
        # append, a read of a malformed namespace) went through there unrefused.
        check_same_process(f"the manifest of {self._storage.name}", self._pid)

    # Names.

    def object_name(self, namespace: str, suffix: str) -> str:
        """The object `<prefix>:manifest:<namespace>:<suffix>`."""
        return f"{self._storage.prefix}:manifest:{namespace}:{suffix}"

    def _chunk_names(
        self, namespace: str, stem: str, kind: str, numbers: Iterable[int]
    ) -> list[str]:
        """Names of the log (`kind="l"`) or base (`"b"`) chunks `numbers` of `stem`."""
        return [self.object_name(namespace, f"{stem}:{kind}{n}") for n in numbers]

    @property
    def chunk_bytes(self) -> int:
        """The largest chunk this manifest writes or reads (at most half the backend's
        staging arena, which reads go through, so page transfers keep room, and half of
        Mooncake's local buffer, which a put is copied through: a larger one is refused)."""
        wanted = max(_CHUNK_BYTES, self.limits.max_entry_bytes + _HEADER_BYTES + 1)
        return min(wanted, self._storage._arena.capacity // 2, self._storage._buffer_size // 2)

    @property
    def _line_limit(self) -> int:
        """The longest record line stored: within the limits and within one chunk."""
        return min(self.limits.max_entry_bytes, self.chunk_bytes - _HEADER_BYTES)

    # The protocol.

    async def append(self, entries: Sequence[ManifestEntry]) -> None:
        """Store the records as new log chunks; compact a namespace whose log grew long.

        A record longer than `max_entry_bytes` (or than a chunk) is not stored.
        """
        self._check_process()
        groups: dict[str, list[bytes]] = {}
        limit = self._line_limit
        for entry in entries:
            if not _NAMESPACE.match(entry.namespace):
                raise ValueError(f"manifest entry namespace is not 32 hex digits: {entry!r}")
            line = encode_entry(entry)
            if len(line) > limit:
                _log.warning("hicache.manifest.entry_too_large", nbytes=len(line))
                continue
            groups.setdefault(entry.namespace, []).append(line)
        if not groups:
            await anyio.lowlevel.checkpoint()  # nothing to send: an async call yields all the same
        for namespace, lines in groups.items():
            self._known.add(namespace)
            try:
                last_seq = await self._append(namespace, lines)
            except _NewerLayout:
                # Its index names objects of a layout this release does not know: writing
                # beside them would only leave records no reader of either release reads.
                _newer_layout(namespace, "append", records=len(lines))
                continue
            if last_seq + 1 >= _LOG_CHUNKS:
                try:
                    await self.compact_namespace(namespace)
                except StorageError as exc:
                    _log.warning("hicache.manifest.compact_failed", error=str(exc))

    async def read(self, *, namespace: str | None = None) -> ManifestRead:
        """The newest record per chain (of `namespace`, or of every known namespace).

        Newest chunks first, at most `max_bytes` of them (`truncated` says the bound
        stopped the read, or that chunks could not be read: their records are left out and
        the rest is returned); every record is validated. Raises `StorageError` if the master
        does not answer or an index cannot be read.
        """
        self._check_process()
        if namespace is not None and not _NAMESPACE.match(namespace):
            return ManifestRead(entries=[])
        namespaces = [namespace] if namespace is not None else await self._namespaces()
        result = ManifestRead(entries=[])
        for _ in range(_ATTEMPTS):
            collector = ManifestCollector(self.limits, namespace, newest_first=True)
            budget = self.limits.max_bytes
            truncated = False
            try:
                for ns in namespaces:
                    try:
                        used, cut, unreadable = await self._collect(ns, collector, budget)
                    except _NewerLayout:
                        collector.newer += 1  # left to the release that reads it
                        _newer_layout(ns, "read")
                        continue
                    budget -= used
                    # Chunks that could not be read: what the others hold is still returned,
                    # and said to be partial.
                    truncated = truncated or unreadable
                    if cut or budget <= 0:
                        truncated = True
                        break
            except _Stale:
                # What was read before the list changed: partial, and said to be.
                result = await off_loop(
                    functools.partial(collector.result, truncated=True), owner=self._storage
                )
                continue
            return await off_loop(
                functools.partial(collector.result, truncated=truncated), owner=self._storage
            )
        return result

    async def compact(self) -> CompactReport:
        """Compact every known namespace (see `compact_namespace`)."""
        self._check_process()
        total = CompactReport(0, 0, 0, 0, 0, 0)
        for namespace in await self._namespaces():
            total = add_reports(total, await self.compact_namespace(namespace))
        return total

    async def compact_namespace(self, namespace: str) -> CompactReport:
        """Rewrite a namespace's manifest as one new generation; see the module docstring.

        Raises `StorageError` if another compaction holds the lock.
        """
        self._check_process()
        if not _NAMESPACE.match(namespace):
            raise ValueError(f"not a namespace fingerprint: {namespace!r}")
        try:
            return await self._compact_locked(namespace)
        except _NewerLayout:
            # Compacting would remove the newer index's slot and sweep its chunks.
            _newer_layout(namespace, "compaction")
            return CompactReport(0, 0, 0, 0, 0, 0, newer=1)

    async def _compact_locked(self, namespace: str) -> CompactReport:
        # Looked at before the lock: a newer layout's lock need not read as one, and a lock
        # that does not is broken as abandoned.
        await self._index(namespace)
        token = await self._lock(namespace)
        if token is None:
            raise StorageError(
                f"{self._storage.name}: another compaction of the manifest of {namespace} runs"
            )
        try:
            return await self._compact(namespace)
        finally:
            # Even when cancelled: a lock left behind blocks compaction until it expires.
            with anyio.CancelScope(shield=True):
                await self._unlock(namespace, token)

    # Appending.

    async def _append(self, namespace: str, lines: list[bytes]) -> int:
        """Write `lines` into the current log; returns the last seq used."""
        payloads = _chunks(lines, self.chunk_bytes)
        for _ in range(_ATTEMPTS):
            index = await self._index(namespace)
            written: list[str] = []
            last = -1
            for payload in payloads:
                name, last = await self._put_log(namespace, index.stem, payload)
                written.append(name)
            now = await self._index(namespace)
            if now.stem == index.stem:
                return last
            # A compaction switched generations meanwhile and may not have copied these:
            # write them again under the new stem, and drop the copies nobody reads.
            await self._remove(written)
        raise StorageError(f"{self._storage.name}: manifest append kept racing compactions")

    async def _put_log(self, namespace: str, stem: str, payload: bytes) -> tuple[str, int]:
        """Put one chunk at the next free seq of `stem`'s log: (its name, its seq)."""
        seq = await self._log_end(namespace, stem)
        # Concurrent appenders all start from the same end and take seqs one after another:
        # after a few lost races, look for the end again rather than give up.
        for _ in range(_CLAIM_ROUNDS):
            for _ in range(8):
                name = self.object_name(namespace, f"{stem}:l{seq}")
                if await self._claim(name, payload):
                    return name, seq
                seq += 1  # another writer took it
            seq = await self._log_end(namespace, stem, seq)
        raise StorageError(f"{self._storage.name}: no free manifest chunk in {stem}")

    async def _claim(self, name: str, payload: bytes) -> bool:
        """Put `payload` under `name` unless something is there; True if it is ours now.

        Mooncake's put keeps an existing object and still returns 0, so the object is read
        back: each payload carries a random token, so equal bytes mean it is ours.
        """
        chunk = _with_token(payload)
        store = await self._storage._master_store_turning()
        config = self._replicate_config()
        code = await self._storage.run_job(lambda stop: int(store.put(name, chunk, config)))
        if code != 0:
            raise StorageError(f"{self._storage.name}: manifest put of {name} failed: {code}")
        stored = await self._get([name], self.chunk_bytes)
        return stored[0] == chunk

    async def _log_end(self, namespace: str, stem: str, start: int = 0) -> int:
        """One past the last seq of the log, scanning from `start` until a gap of `_PROBE`."""
        end = start
        base = start
        while True:
            names = self._chunk_names(namespace, stem, "l", range(base, base + _PROBE))
            found = await self._exist(names)
            present = [base + i for i, there in enumerate(found) if there]
            if not present:
                return end
            end = present[-1] + 1
            base += _PROBE

    # Reading.

    async def _collect(
        self, namespace: str, collector: ManifestCollector, budget: int
    ) -> tuple[int, bool, bool]:
        """Feed one namespace's records to `collector`, newest chunks first.

        Returns (bytes read, whether the budget stopped it, whether chunks could not be
        read); raises `_Stale` if a compaction switched generations meanwhile. A chunk whose
        transfer failed is left out (logged and counted in the backend's errors): the read
        goes on without its records.
        """
        index = await self._index(namespace)
        end = await self._log_end(namespace, index.stem)
        # The carried log may have gaps (appenders that saw the switch moved their records)
        # and goes once copied into this log: a chunk missing there is no reason to restart.
        carried = await self._carried(namespace, index)
        base = set(self._chunk_names(namespace, index.stem, "b", range(index.base)))
        names = self._chunk_names(namespace, index.stem, "l", reversed(range(end)))
        names += carried
        names += self._chunk_names(namespace, index.stem, "b", reversed(range(index.base)))
        used = 0
        truncated = unreadable = False
        for group_start in range(0, len(names), _READ_BATCH):
            group = names[group_start : group_start + _READ_BATCH]
            if used >= budget:
                truncated = True
                break
            values = await self._get(group, self.chunk_bytes, gaps=True)
            chunks: list[bytes | int] = []
            stale = False
            for name, value in zip(group, values, strict=True):
                if value is None:
                    if name in base:
                        stale = True  # its generation was removed under us
                        break
                    continue  # a gap in the log
                if value == _UNREADABLE:
                    unreadable = True
                    continue
                # An int: larger than any chunk, not read.
                used += self.chunk_bytes if isinstance(value, int) else len(value)
                chunks.append(value)
            await collector.feed(_newest_first(chunks), owner=self._storage)
            if stale:
                raise _Stale
        if (await self._index(namespace)).stem != index.stem:
            raise _Stale
        return used, truncated, unreadable

    async def _carried(self, namespace: str, index: _Index) -> list[str]:
        """Names of the previous generation's log chunks that `index` carries, newest first
        (none once the compaction that switched to it has copied and removed them)."""
        if not index.carry:
            return []
        end = await self._log_end(namespace, index.carry, index.carry_from)
        return self._chunk_names(
            namespace, index.carry, "l", reversed(range(index.carry_from, end))
        )

    async def _index(self, namespace: str) -> _Index:
        """The newest valid index of `namespace` (generation 0 when there is none). Raises
        `_NewerLayout` if a slot holds an index of a newer layout version."""
        names = [self.object_name(namespace, f"index.{slot}") for slot in (0, 1)]
        best = _Index(v=_INDEX_VERSION, namespace=namespace, generation=0, stem=_GEN0, base=0)
        for slot, value in enumerate(await self._get(names, _INDEX_BYTES)):
            if not isinstance(value, bytes):
                continue
            if _newer_index(value, namespace):
                raise _NewerLayout
            index = self._valid_index(value, namespace, slot)
            if index is not None and index.generation > best.generation:
                best = index
        return best

    @staticmethod
    def _valid_carry(index: _Index) -> bool:
        if not index.carry:
            return index.carry_from == 0
        match = _STEM.match(index.carry)
        previous = str(index.generation - 1) if index.generation > 1 else None
        return (
            match is not None
            and match.group(1) == previous
            and index.carry != index.stem
            and 0 <= index.carry_from <= _MAX_CARRY_FROM
        )

    def _valid_index(self, value: bytes, namespace: str, slot: int) -> _Index | None:
        try:
            index = msgspec.json.decode(value, type=_Index)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            index = None
        # A compacted base has at most one chunk per kept entry, plus the folded-in tail.
        max_base = self.limits.max_entries + 4 * _LOG_CHUNKS
        match = _STEM.match(index.stem) if index is not None else None
        if (
            index is None
            or match is None
            or index.v != _INDEX_VERSION
            or index.namespace != namespace
            or index.generation < 1
            or index.generation % 2 != slot
            or match.group(1) != str(index.generation)
            or not 0 <= index.base <= max_base
            or not self._valid_carry(index)
        ):
            _log.warning("hicache.manifest.bad_index", namespace=namespace, slot=slot)
            return None
        return index

    async def _namespaces(self) -> list[str]:
        """Namespaces this object wrote to, plus those the master's admin API lists."""
        found = set(self._known)
        admin = self._storage._admin
        if admin is None:
            if not found:
                _log.warning(
                    "hicache.manifest.no_admin",
                    backend=self._storage.name,
                    hint="listing manifests needs ?admin=http://master:port",
                )
            return sorted(found)
        await self._storage._master_store_turning()  # the admin server runs in the master's process
        lead = f"{self._storage.prefix}:manifest:".encode()
        url = f"{admin}/get_all_keys"

        def job(stop: threading.Event) -> set[str]:
            names: set[str] = set()
            try:
                with urllib.request.urlopen(url, timeout=_ADMIN_TIMEOUT_S) as response:
                    for line in response:  # streamed: the list holds every page too
                        if stop.is_set() or len(names) >= _MAX_NAMESPACES:
                            break
                        name = line.strip()
                        rest = name[len(lead) :]
                        if name.startswith(lead) and rest[32:33] == b":":
                            ns = rest[:32].decode("ascii", "replace")
                            if _NAMESPACE.match(ns):
                                names.add(ns)
            except (OSError, http.client.HTTPException) as exc:  # URLError is an OSError
                raise StorageError(
                    f"{self._storage.name}: {mask_userinfo(url)} failed: {exc}"
                ) from exc
            return names

        found |= await self._storage.run_job(job)
        return sorted(found)

    # Compaction.

    async def _compact(self, namespace: str) -> CompactReport:
        old = await self._index(namespace)
        end = await self._log_end(namespace, old.stem)
        collector = ManifestCollector(self.limits, namespace, newest_first=True, carry=True)
        # What an earlier compaction carried but never copied (it died after its switch).
        carried = await self._carried(namespace, old)
        # The rest of that earlier generation (hard-pinned: nothing else ever frees it without
        # the admin API's sweep): its base and the log before `carry_from`, which the base of
        # `old` holds. Its index, if still there, sits in the slot this switch takes.
        leftovers: list[str] = []
        if old.carry:
            slot = (old.generation - 1) % 2
            name = self.object_name(namespace, f"index.{slot}")
            held = (await self._get([name], _INDEX_BYTES))[0]
            previous = self._valid_index(held, namespace, slot) if isinstance(held, bytes) else None
            if previous is not None and previous.stem == old.carry:
                leftovers += self._chunk_names(namespace, old.carry, "b", range(previous.base))
            leftovers += self._chunk_names(namespace, old.carry, "l", range(old.carry_from))
        before = await self._feed(namespace, old, range(end), collector, carried)
        # Records as stored (fields this version does not know kept), newer versions'
        # included, within half of `max_bytes` so the manifest has room to grow.
        kept, payloads = await off_loop(
            functools.partial(
                _compacted_chunks, collector, self.limits.max_bytes // 2, self.chunk_bytes
            ),
            owner=self._storage,
        )
        generation = old.generation + 1
        stem = f"g{generation}-{os.urandom(8).hex()}"
        # What was appended while the base was being built goes into the base too.
        tail_end = await self._log_end(namespace, old.stem, end)
        tail = await self._lines(namespace, old.stem, range(end, tail_end))
        payloads += _chunks(tail, self.chunk_bytes)
        new_base = self._chunk_names(namespace, stem, "b", range(len(payloads)))
        # Records appended to the old log from `tail_end` on are copied after the switch;
        # until then (or for good, should this process die first) the index carries them.
        index = _Index(
            v=_INDEX_VERSION,
            namespace=namespace,
            generation=generation,
            stem=stem,
            base=len(payloads),
            carry=old.stem,
            carry_from=tail_end,
        )
        try:
            switched = await self._switch(namespace, index, new_base, payloads)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._remove(new_base)
            raise
        if not switched:
            await self._remove(new_base)
            raise StorageError(f"{self._storage.name}: manifest objects of {stem} were taken")
        # Switched: readers now take the new generation. Carry over what arrived meanwhile,
        # then remove the old generation.
        last_end = await self._log_end(namespace, old.stem, tail_end)
        late = await self._lines(namespace, old.stem, range(tail_end, last_end))
        for payload in _chunks(late, self.chunk_bytes):
            await self._put_log(namespace, stem, payload)
        old_names = self._chunk_names(namespace, old.stem, "l", range(last_end))
        old_names += self._chunk_names(namespace, old.stem, "b", range(old.base))
        old_names += carried + leftovers
        if old.generation:
            old_names.append(self.object_name(namespace, f"index.{old.generation % 2}"))
        await self._remove(old_names)
        await self._sweep(namespace, stem)
        return CompactReport(
            records_before=collector.records,
            entries_after=len(kept),
            bytes_before=before,
            bytes_after=sum(len(p) + _HEADER_BYTES for p in payloads),
            malformed=collector.malformed,
            oversized=collector.oversized,
            newer=collector.newer,
        )

    async def _switch(
        self, namespace: str, index: _Index, names: list[str], payloads: list[bytes]
    ) -> bool:
        """Write the base chunks, then the index into its slot: the switch. False if any of
        those objects turned out to be someone else's."""
        for name, payload in zip(names, payloads, strict=True):
            if not await self._claim(name, payload):
                return False
        slot = self.object_name(namespace, f"index.{index.generation % 2}")
        held = (await self._get([slot], _INDEX_BYTES))[0]
        if isinstance(held, bytes) and _newer_index(held, namespace):
            raise _NewerLayout  # a newer release's, put there since this compaction began
        await self._remove([slot])  # a stale generation's, if any
        return await self._claim_raw(slot, msgspec.json.encode(index))

    async def _feed(
        self,
        namespace: str,
        index: _Index,
        seqs: range,
        collector: ManifestCollector,
        carried: list[str],
    ) -> int:
        """Feed the log chunks `seqs`, the `carried` chunks and the base (newest first) to
        `collector`, bounded."""
        names = self._chunk_names(namespace, index.stem, "l", reversed(seqs))
        names += carried
        names += self._chunk_names(namespace, index.stem, "b", reversed(range(index.base)))
        used = 0
        for start in range(0, len(names), _READ_BATCH):
            if used >= self.limits.max_bytes:
                break
            values = await self._get(names[start : start + _READ_BATCH], self.chunk_bytes)
            chunks = [value for value in values if value is not None]
            # An int: larger than any chunk, not read.
            used += sum(self.chunk_bytes if isinstance(v, int) else len(v) for v in chunks)
            await collector.feed(_newest_first(chunks), owner=self._storage)
        return used

    async def _lines(self, namespace: str, stem: str, seqs: range) -> list[bytes]:
        """The records of the log chunks `seqs` worth keeping (valid, or of a newer version),
        as lines."""
        names = self._chunk_names(namespace, stem, "l", seqs)
        lines: list[bytes] = []
        for start in range(0, len(names), _READ_BATCH):
            values = await self._get(names[start : start + _READ_BATCH], self.chunk_bytes)
            chunks = [value for value in values if isinstance(value, bytes)]
            # Validated on a worker thread, as a read decodes them (see `off_loop`).
            lines += await off_loop(
                functools.partial(_carried_lines, chunks, self._line_limit), owner=self._storage
            )
        return lines

    async def _sweep(self, namespace: str, stem: str) -> None:
        """With the admin API: remove objects of `namespace` no generation refers to any more
        (left by compactions or appends that died half-way).

        Only names of the chunks a manifest writes (`<stem>:b<i>`, `<stem>:l<seq>`) are
        removed: another client's prefix may itself start with this namespace's lead (a
        prefix `t:manifest:<ns>` under `t`), and its objects are not ours.
        """
        admin = self._storage._admin
        if admin is None:
            return
        lead = self.object_name(namespace, "").encode()
        current = f"{stem}:".encode()
        url = f"{admin}/get_all_keys"

        def job(stop: threading.Event) -> list[str]:
            names: list[str] = []
            try:
                with urllib.request.urlopen(url, timeout=_ADMIN_TIMEOUT_S) as response:
                    for line in response:
                        name = line.strip()
                        if not name.startswith(lead):
                            continue
                        rest = name[len(lead) :]
                        if _CHUNK_NAME.match(rest) and not rest.startswith(current):
                            names.append(name.decode("ascii", "replace"))
            except (OSError, http.client.HTTPException) as exc:  # URLError is an OSError
                raise StorageError(
                    f"{self._storage.name}: {mask_userinfo(url)} failed: {exc}"
                ) from exc
            return names

        await self._remove(await self._storage.run_job(job))

    async def _lock(self, namespace: str) -> str | None:
        """Take the compaction lock of `namespace`: its token, or None if someone holds it."""
        name = self.object_name(namespace, "lock")
        for _ in range(2):
            token = os.urandom(8).hex()
            body = msgspec.json.encode(_Lock(token=token, expires=time.time() + _LOCK_TTL_S))
            if await self._claim_raw(name, body):
                return token
            held = (await self._get([name], _INDEX_BYTES))[0]
            if held is None:
                continue  # released meanwhile, or another compaction is putting it
            try:
                lock = msgspec.json.decode(held, type=_Lock) if isinstance(held, bytes) else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                lock = None
            # Held until it expires, on its holder's wall clock. One that expires more than
            # a lock's lifetime later than one taken now came from a clock that ran that
            # far ahead (a host booted with a wrong time), or from before this one stepped
            # back: left by a compaction that died, it would hold off every compaction until
            # that time came, while the log grew. (A clock a few seconds ahead is no cause.)
            if lock is not None and 0 < lock.expires - time.time() <= 2 * _LOCK_TTL_S:
                return None
            # Abandoned (or unreadable): break it, once.
            _log.warning("hicache.manifest.lock_broken", namespace=namespace)
            await self._remove([name])
        return None

    async def _unlock(self, namespace: str, token: str) -> None:
        name = self.object_name(namespace, "lock")
        held = (await self._get([name], _INDEX_BYTES))[0]
        if isinstance(held, bytes):
            try:
                lock = msgspec.json.decode(held, type=_Lock)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return
            if lock.token == token:
                await self._remove([name])

    # Mooncake calls (one job each).

    def _replicate_config(self) -> Any:
        if self._config is None:
            from mooncake.store import ReplicateConfig

            config = ReplicateConfig()
            config.replica_num = self._storage._replicas
            config.with_hard_pin = True  # never evicted: a manifest is small and its gaps hurt
            self._config = config
        return self._config

    async def _claim_raw(self, name: str, value: bytes) -> bool:
        """Put `value` (which must be unique) under `name`; True if the object is it."""
        store = await self._storage._master_store_turning()
        config = self._replicate_config()
        code = await self._storage.run_job(lambda stop: int(store.put(name, value, config)))
        if code != 0:
            raise StorageError(f"{self._storage.name}: manifest put of {name} failed: {code}")
        return (await self._get([name], _INDEX_BYTES))[0] == value

    async def _exist(self, names: list[str]) -> list[bool]:
        store = await self._storage._master_store_turning()
        codes = await self._storage.run_job(lambda stop: list(store.batch_is_exist(names)))
        if any(code < 0 for code in codes):
            raise StorageError(f"{self._storage.name}: manifest lookup failed")
        return [code == 1 for code in codes]

    async def _get(
        self, names: list[str], bound: int, *, gaps: bool = False
    ) -> list[bytes | int | None]:
        """Each object's bytes, None if absent (or still being put), or `_OVERSIZED` if
        larger than `bound` (not read).

        An object whose transfer failed raises `StorageError`, or with `gaps` is
        `_UNREADABLE` (logged and counted in the backend's errors): only a read may go on
        without it, never a step that writes or removes what it read. The master not
        answering raises either way. Objects land in the backend's registered arena, `bound`
        bytes each, so nothing larger than the bound is ever transferred.
        """
        size = self._storage._arena.rounded(bound)
        step = max(1, self._storage._arena.capacity // 2 // size)
        values: list[bytes | int | None] = []
        for start in range(0, len(names), step):
            values += await self._get_some(names[start : start + step], bound, size, gaps)
        return values

    async def _get_some(
        self, names: list[str], bound: int, size: int, gaps: bool
    ) -> list[bytes | int | None]:
        storage = self._storage
        store = await storage._master_store_turning()
        arena = storage._arena
        offset = await storage._acquire_arena(size * len(names))
        view, address = storage._arena_view, storage._arena_base + offset
        assert view is not None

        def job(stop: threading.Event) -> tuple[list[bytes | int | None], list[int]]:
            addresses = [address + i * size for i in range(len(names))]
            codes = list(store.batch_get_into(names, addresses, [bound] * len(names)))
            values: list[bytes | int | None] = []
            for i, code in enumerate(codes):
                if code >= 0:
                    start = offset + i * size
                    values.append(bytes(view[start : start + code]))
                elif code in (_NOT_FOUND, _NOT_READY):
                    values.append(None)
                elif code == _TOO_LARGE:
                    values.append(_OVERSIZED)
                else:
                    values.append(_UNREADABLE)
            return values, codes

        try:
            values, codes = await storage.run_job(job)
        finally:
            arena.release(offset, size * len(names))
        failed = [
            (name, code)
            for name, code, value in zip(names, codes, values, strict=True)
            if value == _UNREADABLE
        ]
        if failed:
            code = failed[0][1]
            if not gaps or storage._master_down() or any(c == _RPC_FAIL for _, c in failed):
                raise StorageError(f"{storage.name}: manifest read failed with {code}")
            storage._counters.errors += len(failed)
            _log.warning(
                "hicache.manifest.unreadable",
                backend=storage.name,
                objects=len(failed),
                first=failed[0][0],
                code=code,
            )
        return values

    async def _remove(self, names: Iterable[str]) -> None:
        todo = list(names)
        if not todo:
            return
        store = await self._storage._master_store_turning()
        codes = await self._storage.run_job(lambda stop: list(store.batch_remove(todo, force=True)))
        failed = [c for c in codes if c not in (0, _NOT_FOUND)]
        if failed:
            _log.warning("hicache.manifest.remove_failed", count=len(failed), code=failed[0])


def _newer_index(value: bytes, namespace: str) -> bool:
    """Whether `value` is the index of `namespace` in a newer layout version: a JSON object
    with an integer `v` above this release's and this namespace, whatever else it holds."""
    try:
        found = msgspec.json.decode(value, type=_IndexVersion)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return False
    return found.v > _INDEX_VERSION and found.namespace == namespace


def _newer_layout(namespace: str, step: str, **fields: int) -> None:
    _log.warning("hicache.manifest.newer_layout", namespace=namespace, step=step, **fields)


def _with_token(payload: bytes) -> bytes:
    return _CHUNK_MAGIC + os.urandom(8).hex().encode() + b"\n" + payload


def _records(chunk: bytes) -> Iterable[bytes]:
    """The record lines of a chunk (its header line, if it has one, left out)."""
    lines = chunk.split(b"\n")
    if lines and lines[0].startswith(_CHUNK_MAGIC):
        lines = lines[1:]
    return (line for line in lines if line.strip())


def _newest_first(chunks: list[bytes | int]) -> Iterator[bytes | int]:
    """The records of `chunks`, newest first as the chunks are (for a collector's `feed`,
    which runs it on a worker thread); an int, a chunk too large to be read, stands for one
    oversized record."""
    for chunk in chunks:
        if isinstance(chunk, int):
            yield chunk
        else:
            yield from reversed([*_records(chunk)])


def _carried_lines(chunks: list[bytes], limit: int) -> list[bytes]:
    """The records of `chunks` worth keeping (shorter than `limit`, and valid or of a newer
    version), as lines."""
    return [
        line + b"\n"
        for chunk in chunks
        for line in _records(chunk)
        if len(line) < limit and carried_record(line)
    ]


def _compacted_chunks(
    collector: ManifestCollector, budget: int, chunk_bytes: int
) -> tuple[list[tuple[Hashable, bytes]], list[bytes]]:
    """What a compaction keeps, and the payloads of the chunks that hold it."""
    kept = collector.compacted(budget)
    return kept, _chunks([line + b"\n" for _, line in kept], chunk_bytes)


def _chunks(lines: list[bytes], chunk_bytes: int) -> list[bytes]:
    """Lines packed into payloads that fit a chunk with its header line."""
    room = chunk_bytes - _HEADER_BYTES
    payloads: list[bytes] = []
    current: list[bytes] = []
    size = 0
    for line in lines:
        if current and size + len(line) > room:
            payloads.append(b"".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        payloads.append(b"".join(current))
    return payloads
