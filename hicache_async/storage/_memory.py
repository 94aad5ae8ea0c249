"""MemoryStorage: pages as `header ‖ payload` bytes in this process, bounded, LRU-evicted.

For tests, single-process setups and as a reference for value stores: it runs the same integrity
checks as Redis or Mooncake (`read_value_into`). Copies of a batch up to `_INLINE_MAX_BYTES` are
done on the event loop, where a thread hand-off (~0.1 ms) would cost more than the copy; larger
batches (a 64-page batch of 8 MiB pages is 512 MiB, ~0.1 s of copying and hashing) are one job
on a worker thread so the loop stays responsive.

Values are `bytearray`s, and the buffers of deleted and evicted pages are kept, up to
`spare_bytes` beyond the capacity, for later puts of the same size: a fresh buffer costs a page
fault per 4 KiB on its first write, about as much as the copy itself, and a cache at its
capacity evicts a page for every page it stores. A buffer is recycled only while no get or
verify reads values (on a thread, or on the loop between its turns), so a reader never sees it
change.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import islice

import anyio.lowlevel
import msgspec

from .. import _native
from .._errors import StorageConfigError
from ._base import (
    BackendBase,
    _State,
    byte_segments,
    check_batch,
    check_key,
    check_keys,
    check_put,
    corrupt_reason,
    is_int,
    parse_query,
    parse_size,
    payload_nbytes,
    split_url,
)
from ._maintenance import GcReport, PageInfo, VerifyReport
from ._manifest import ManifestLimits, MemoryManifest
from ._page import (
    HEADER_NBYTES,
    PageCheck,
    PageHeader,
    decode_header,
    encode_header,
    read_value_into,
    verify_payload,
)
from ._protocol import Outcome, PageBuffer, PageMeta, StorageCapabilities

__all__ = ["MemoryStorage"]

_INLINE_MAX_BYTES = 1 << 20
#: Batches run on the loop let it run after this many pages or bytes (see `_run_each`).
_YIELD_PAGES = 256
_YIELD_BYTES = 256 << 10
# Keys a lookup checks or touches between two turns of the loop: a hundred thousand took
# about 0.1 s in one step.
_LOOKUP_STEP = 1 << 12
_DEFAULT_CAPACITY = 1 << 30
_SPARE_DEFAULT = 1 << 30
#: `list_pages` lets the loop run between slices of this many pages.
_LIST_SLICE = 4096
_URL_PARAMS = {
    "capacity": "byte size, e.g. 1GiB",
    "spare": "bytes of removed pages' buffers kept for reuse, e.g. 64MiB (0: none)",
}


class _Value(msgspec.Struct, gc=False):
    # Untracked by the garbage collector (a buffer and a number cannot form a cycle): half a
    # million pages otherwise cost every full collection a third of a second.
    data: bytearray
    last_access: float


class MemoryStorage(BackendBase):
    """An in-process store of at most `capacity_bytes` (an int >= 1, headers included),
    LRU-evicted.

    Up to `spare_bytes` more (default 1 GiB, at most an eighth of the capacity; 0 for none)
    hold the buffers of removed pages until a put of the same size reuses them or `gc()` frees
    them.
    """

    def __init__(
        self,
        *,
        capacity_bytes: int = _DEFAULT_CAPACITY,
        mac_key: bytes | None = None,
        spare_bytes: int | None = None,
    ) -> None:
        # Whole numbers only: nan passes every comparison (an unbounded store), 1.5 a
        # capacity stats() cannot report, True a capacity of one byte.
        if not (is_int(capacity_bytes) and capacity_bytes >= 1):
            raise StorageConfigError(
                f"capacity_bytes must be an integer >= 1, got {capacity_bytes!r}"
            )
        if spare_bytes is not None and not (is_int(spare_bytes) and spare_bytes >= 0):
            raise StorageConfigError(
                f"spare_bytes must be an integer >= 0 or None, got {spare_bytes!r}"
            )
        if spare_bytes is None:
            spare_bytes = min(_SPARE_DEFAULT, capacity_bytes // 8)
        super().__init__(mac_key=mac_key, job_threads=1, thread_name="hicache-memory")
        self._capacity = capacity_bytes
        self._name = f"memory://?capacity={capacity_bytes}"
        # Loop-owned: values in LRU order, their bytes, bytes reserved by puts in flight.
        self._values: OrderedDict[bytes, _Value] = OrderedDict()
        self._bytes = 0
        self._reserved = 0
        self._writing: set[bytes] = set()
        self._evicting: set[bytes] = set()
        # Each put in flight's victims and the bytes it reserved (see `_plan_room`).
        self._plans: list[tuple[list[bytes], int]] = []
        # Buffers of removed values, by size, for puts to reuse, and thread jobs reading
        # values in flight (while there are any, removed buffers are not recycled).
        self._spares: dict[int, list[bytearray]] = {}
        self._spare_bytes = 0
        self._spare_limit = spare_bytes
        self._readers = 0
        self._manifest: MemoryManifest | None = None

    @classmethod
    def from_url(cls, url: str, *, mac_key: bytes | None = None) -> MemoryStorage:
        """`memory://?capacity=1GiB&spare=64MiB` (the default capacity is 1 GiB); a fragment
        is refused."""
        parts = split_url(url, scheme="memory")
        if parts.scheme != "memory":
            raise StorageConfigError(f"not a memory:// URL: {url!r}")
        if "#" in url:
            # urlsplit drops it: `memory://#capacity=1KiB` would get the default 1 GiB.
            raise StorageConfigError(
                f"memory:// URLs take no fragment, got {url!r}; accepted: "
                "memory://?capacity=SIZE&spare=SIZE (a '#' in a value is written %23)"
            )
        if parts.netloc or parts.path not in ("", "/"):
            raise StorageConfigError(
                f"memory:// URLs take no host or path, only ?capacity=SIZE&spare=SIZE; got {url!r}"
            )
        params = parse_query(parts.query, _URL_PARAMS, scheme="memory")
        capacity = parse_size(params.get("capacity", str(_DEFAULT_CAPACITY)), field="capacity")
        if capacity < 1:
            raise StorageConfigError(f"capacity must be at least 1 byte, got {capacity}")
        spare = params.get("spare")
        spare_bytes = parse_size(spare, field="spare") if spare is not None else None
        return cls(capacity_bytes=capacity, mac_key=mac_key, spare_bytes=spare_bytes)

    def manifest(self, limits: ManifestLimits | None = None) -> MemoryManifest:
        """The warmup manifest, kept in memory beside the pages."""
        if self._manifest is None:
            # One made in a forked child of the process that opened the store is that
            # process's, as the store is: the child is refused both.
            owner = None if self._state is _State.NEW else self._pid
            self._manifest = MemoryManifest(limits, owner_pid=owner)
        elif limits is not None:
            self._manifest.limits = limits
        return self._manifest

    @property
    def capabilities(self) -> StorageCapabilities:
        """In-process only: neither shared nor persistent, and values are copies."""
        return StorageCapabilities(
            max_batch_pages=1024,
            zero_copy=False,
            shared=False,
            persistent=False,
            put_skips_stored=True,
        )

    def __repr__(self) -> str:
        return (
            f"<MemoryStorage state={self._state.value} pages={len(self._values)} "
            f"bytes={self._bytes} capacity={self._capacity} reserved={self._reserved} "
            f"spare={self._spare_bytes}>"
        )

    async def _open(self) -> None:
        return None

    async def _release(self) -> None:
        self._values.clear()
        self._bytes = 0
        self._drop_spares()

    def _occupancy(self) -> tuple[int, int, int | None]:
        return len(self._values), self._bytes, self._capacity

    async def _run_each(self, item: Callable[[int], None], sizes: Sequence[int]) -> None:
        """`item(i)` for each of the batch's pages (`sizes`: their bytes), in order; pages
        left out by a close or a cancellation are not called.

        Small batches run on the loop, which they let run every `_YIELD_PAGES` pages or
        `_YIELD_BYTES` bytes: a batch of many tiny pages otherwise holds it throughout, since
        such a call never suspends. Big batches are one thread job.
        """
        if sum(sizes) > _INLINE_MAX_BYTES:

            def work(stop: threading.Event) -> None:
                for i in range(len(sizes)):
                    if stop.is_set():
                        return
                    item(i)

            await self.run_job(work)
            return
        pages = nbytes = 0
        for i, size in enumerate(sizes):
            if self.closed:
                return
            item(i)
            pages += 1
            nbytes += size
            if pages >= _YIELD_PAGES or nbytes >= _YIELD_BYTES:
                pages = nbytes = 0
                await anyio.lowlevel.checkpoint()

    def _remove(self, key: bytes) -> _Value | None:
        value = self._values.pop(key, None)
        if value is not None:
            size = len(value.data)
            self._bytes -= size
            if (
                self._readers == 0
                and not self.closed
                and self._spare_bytes + size <= self._spare_limit
            ):
                self._spares.setdefault(size, []).append(value.data)
                self._spare_bytes += size
        return value

    def _take_spare(self, size: int) -> bytearray | None:
        pool = self._spares.get(size)
        if not pool:
            return None
        buffer = pool.pop()
        if not pool:
            del self._spares[size]
        self._spare_bytes -= size
        return buffer

    def _drop_spares(self) -> None:
        self._spares.clear()
        self._spare_bytes = 0

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Held while a job may read stored buffers: none is recycled meanwhile."""
        self._readers += 1
        try:
            yield
        finally:
            self._readers -= 1

    # StorageBackend.

    async def exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, counted from the first, exist consecutively."""
        # A call of a few pages never suspends otherwise, so a task streaming such calls would
        # hold the loop. Taken first, before any state changes: cancelled here, it did nothing.
        await anyio.lowlevel.checkpoint()
        self._check_open()
        check_keys(keys)
        count = 0
        values = self._values
        # A lookup in steps moves what it finds to the recent end as it walks: a put between
        # its steps evicts pages it has not reached, never the first of a chain it counted
        # (the touch below then leaves a live tail behind a cut). One step needs no move.
        move_to_end = values.move_to_end if len(keys) > _LOOKUP_STEP else None
        now = time.time()
        walking = True
        end = 0
        try:
            for start in range(0, len(keys), _LOOKUP_STEP):
                if start:  # a long prompt at a small page size
                    await anyio.lowlevel.checkpoint()
                    self._check_open()
                for key in keys[start : start + _LOOKUP_STEP]:
                    if key not in values:
                        break
                    count += 1
                    if move_to_end is not None:
                        move_to_end(key)
                if count < start + _LOOKUP_STEP:
                    break
            walking = False
            # A lookup is a use: a prefix every new chain is checked against stays in the
            # store. In steps too, the last keys first (the order one step gives).
            end = count
            while end > 0:
                start = max(0, end - _LOOKUP_STEP)
                self._touch_chain(keys[start:end], now)
                end = start
                if end:
                    await anyio.lowlevel.checkpoint()
                    self._check_open()
        except BaseException:
            if not self.closed:
                # Cancelled between steps: the first keys become the most recent now, or the
                # deepest would outlive them and evicting the first would cut the chain.
                self._touch_chain(keys[: count if walking else end], now)
            raise
        return count

    def _touch_chain(self, keys: Sequence[bytes], now: float) -> None:
        """Make the stored `keys` the most recently used, the first of them most of all.

        A batch's keys run down a prefix chain, which is found only up to its first missing
        page: evicting a chain's deepest pages first keeps the rest of it usable.
        """
        for key in reversed(keys):
            if (value := self._values.get(key)) is not None:
                value.last_access = now
                self._values.move_to_end(key)

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        """Check and copy each page into its buffer; one outcome per key."""
        await anyio.lowlevel.checkpoint()
        self._check_open()
        check_batch(keys, ("buffers", into))
        check_keys(keys, namespace)
        # Bad buffers are the caller's error, raised before anything is read or counted.
        segments = [byte_segments(page, writable=True) for page in into]
        outcomes = [Outcome.MISS] * len(keys)
        self._counters.gets += len(keys)
        # A thread may read values even if they are removed meanwhile: see `_reading`.
        found = [
            (i, value) for i, key in enumerate(keys) if (value := self._values.get(key)) is not None
        ]
        if not found:
            return outcomes
        results: list[PageCheck | None] = [None] * len(found)
        mac_key = self._mac_key

        def read(slot: int) -> None:
            i, value = found[slot]
            results[slot] = read_value_into(
                memoryview(value.data),
                key=keys[i],
                namespace=namespace,
                into=segments[i],
                mac_key=mac_key,
            )

        with self._reading():
            cancelled = False
            try:
                await self._run_each(read, [len(value.data) for _, value in found])
            except asyncio.CancelledError:
                cancelled = True
                raise
            finally:
                self._commit_get(
                    keys,
                    into,
                    namespace,
                    found=found,
                    results=results,
                    outcomes=outcomes,
                    cancelled=cancelled,
                )
        return outcomes

    def _commit_get(
        self,
        keys: Sequence[bytes],
        into: Sequence[PageBuffer],
        namespace: bytes,
        *,
        found: list[tuple[int, _Value]],
        results: list[PageCheck | None],
        outcomes: list[Outcome],
        cancelled: bool,
    ) -> None:
        hits: list[bytes] = []
        for (i, value), check in zip(found, results, strict=True):
            key = keys[i]
            if check is PageCheck.OK:
                outcomes[i] = Outcome.OK
                self._counters.get_hits += 1
                if self._values.get(key) is value:
                    hits.append(key)
            elif check is PageCheck.CORRUPT:
                outcomes[i] = Outcome.CORRUPT
                if self._values.get(key) is value:
                    self._remove(key)
                reason = corrupt_reason(
                    memoryview(value.data),
                    key=key,
                    namespace=namespace,
                    payload_nbytes=payload_nbytes(into[i]),
                )
                self._report_corrupt(key, reason)
            elif check is None:  # not read: stopped by close(), or the caller gave up
                outcomes[i] = Outcome.ERROR
                if not cancelled:
                    self._counters.errors += 1
            # UNSUPPORTED: a newer writer's page, a miss left in place.
        self._touch_chain(hits, time.time())

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        """Store each page; one outcome per key.

        An existing key is kept (OK), unless a put in flight is evicting it (a MISS: it will
        be gone when that put ends). A page larger than the capacity, or that does not fit
        even after evicting every page not in the batch, is a MISS, as is every later page of
        the batch not stored already.
        """
        await anyio.lowlevel.checkpoint()
        self._check_open()
        check_put(keys, pages, metas)
        outcomes = [Outcome.OK] * len(keys)
        self._counters.puts += len(keys)
        now = time.time()
        slots: dict[bytes, int] = {}
        writes: list[int] = []
        sizes: list[int] = []
        duplicates: list[tuple[int, int]] = []
        # A batch runs down a prefix chain: past a page it cannot store, its pages would be
        # unreachable, so storing them would only evict reachable ones.
        full = False
        for i, key in enumerate(keys):
            if key in self._evicting:
                # Still stored, but the put in flight that chose it removes it at its commit.
                outcomes[i] = Outcome.MISS
            elif (value := self._values.get(key)) is not None:
                value.last_access = now
                self._values.move_to_end(key)
            elif key in slots:
                duplicates.append((i, slots[key]))
            elif key in self._writing:
                outcomes[i] = Outcome.MISS
            else:
                size = HEADER_NBYTES + payload_nbytes(pages[i])
                if full or size > self._capacity:
                    full = True
                    outcomes[i] = Outcome.MISS
                    continue
                slots[key] = len(writes)
                writes.append(i)
                sizes.append(size)
        victims, admitted = self._plan_room(sizes, keep=set(keys))
        for i in writes[admitted:]:
            outcomes[i] = Outcome.MISS
        writes, sizes = writes[:admitted], sizes[:admitted]
        if writes:
            await self._store(
                keys,
                pages,
                metas,
                writes=writes,
                sizes=sizes,
                victims=victims,
                outcomes=outcomes,
                now=now,
            )
        for i, slot in duplicates:
            outcomes[i] = outcomes[writes[slot]] if slot < len(writes) else Outcome.MISS
        self._counters.put_ok += outcomes.count(Outcome.OK)
        self._touch_chain([k for k, o in zip(keys, outcomes, strict=True) if o is Outcome.OK], now)
        return outcomes

    def _plan_room(self, sizes: list[int], *, keep: set[bytes]) -> tuple[list[bytes], int]:
        # The victims of puts in flight are room already made: their reservations count
        # against it, so counting them stored too would evict as much again.
        free = self._capacity - self._bytes - self._reserved + self._doomed()
        victims: list[bytes] = []
        candidates = iter(self._values)
        admitted = 0
        for size in sizes:
            marked, freed = len(victims), free
            while free < size:
                key = next(candidates, None)
                if key is None:
                    break
                if key not in keep and key not in self._evicting:
                    victims.append(key)
                    free += len(self._values[key].data)
            if free < size:
                del victims[marked:]
                free = freed
                break
            free -= size
            admitted += 1
        return victims, admitted

    def _doomed(self) -> int:
        """Bytes the puts in flight will evict, each put's only up to what it reserved: a
        cancelled put leaves its victims stored, so only that much is sure to be made."""
        doomed = 0
        for planned, reserved in self._plans:
            made = sum(len(v.data) for k in planned if (v := self._values.get(k)) is not None)
            doomed += min(made, reserved)
        return doomed

    async def _store(
        self,
        keys: Sequence[bytes],
        pages: Sequence[PageBuffer],
        metas: Sequence[PageMeta],
        *,
        writes: list[int],
        sizes: list[int],
        victims: list[bytes],
        outcomes: list[Outcome],
        now: float,
    ) -> None:
        built: list[bytearray | None] = [None] * len(writes)
        mac_key = self._mac_key
        # Spares are taken here, on the loop (a put that is cancelled or fails just drops
        # them); new buffers are allocated by the job, off the loop: bytearray zero-fills.
        spares = [self._take_spare(size) for size in sizes]

        def write(slot: int) -> None:
            i = writes[slot]
            segments = byte_segments(pages[i], writable=False)
            buffer = spares[slot]
            if buffer is None:
                buffer = bytearray(sizes[slot])
            value = memoryview(buffer)
            digest = _native.copy_checksum([value[HEADER_NBYTES:]], segments)
            value[:HEADER_NBYTES] = encode_header(
                metas[i], segments, mac_key=mac_key, checksum=digest
            )
            built[slot] = buffer

        # Plan: reserve the room and mark keys and victims; evict and insert only at commit,
        # so a cancelled put leaves the store as it was.
        reserve = sum(sizes)
        write_keys = [keys[i] for i in writes]
        self._reserved += reserve
        self._writing.update(write_keys)
        self._evicting.update(victims)
        plan = (victims, reserve)
        self._plans.append(plan)
        try:
            await self._run_each(write, sizes)
        finally:
            self._reserved -= reserve
            self._writing.difference_update(write_keys)
            self._evicting.difference_update(victims)
            self._plans.remove(plan)
        if self.closed:  # stopped by close(), which has dropped every value
            for i in writes:
                outcomes[i] = Outcome.ERROR
            self._counters.errors += len(writes)
            return
        for key in victims:
            if self._remove(key) is not None:
                self._counters.evictions += 1
        for key, data in zip(write_keys, built, strict=True):
            if data is not None and key not in self._values:
                self._values[key] = _Value(data, now)
                self._bytes += len(data)

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the pages; return how many existed."""
        await anyio.lowlevel.checkpoint()
        self._check_open()
        check_keys(keys)
        count = sum(1 for key in dict.fromkeys(keys) if self._remove(key) is not None)
        self._counters.deletes += count
        return count

    # RawAccess.

    async def read_raw(self, key: bytes) -> bytes | None:
        """The stored `header ‖ payload` bytes, unchecked, or None."""
        await anyio.lowlevel.checkpoint()  # first, as in `exists`
        self._check_open()
        check_key(key)
        value = self._values.get(key)
        return None if value is None else bytes(value.data)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        """Store `value` under `key` unchecked, replacing what is there."""
        await anyio.lowlevel.checkpoint()  # first, as in `exists`
        self._check_open()
        check_key(key)
        self._remove(key)
        self._values[key] = _Value(bytearray(value), time.time())
        self._bytes += len(value)

    # MaintainableStorage.

    async def list_pages(self, limit: int | None = None) -> list[PageInfo]:
        """Stored pages, most recently used first; 0 tokens and priority 0 where the header
        cannot be read (a damaged page or a newer format's), so every stored page is listed."""
        self._check_open()
        pages: list[PageInfo] = []
        listed = list(islice(reversed(self._values.items()), limit))
        if not listed:
            await anyio.lowlevel.checkpoint()  # the loop below takes the turns of the others
        for at, (key, value) in enumerate(listed):
            if at % _LIST_SLICE == 0:
                # Half a million headers decoded in one go held the loop for over a second.
                await anyio.lowlevel.checkpoint()
                self._check_open()  # closed meanwhile: an error, not a short listing
            if self._values.get(key) is not value:
                continue  # removed (its buffer maybe reused) meanwhile
            header = decode_header(memoryview(value.data))
            tokens = priority = 0
            if isinstance(header, PageHeader):
                tokens, priority = header.num_tokens, header.priority
            pages.append(
                PageInfo(
                    key=key,
                    nbytes=len(value.data),
                    num_tokens=tokens,
                    priority=priority,
                    last_access=value.last_access,
                )
            )
        return pages

    async def verify(self) -> VerifyReport:
        """Check every stored page; remove the corrupt ones."""
        # A small store's check never suspends otherwise (see `_run_each`): first, as in
        # `exists`, so a verify cancelled here did nothing.
        await anyio.lowlevel.checkpoint()
        self._check_open()
        items = list(self._values.items())
        mac_key = self._mac_key

        checks: list[PageCheck] = []

        def examine(slot: int) -> None:
            key, value = items[slot]
            checks.append(_self_check(key, value.data, mac_key))

        with self._reading():
            await self._run_each(examine, [len(value.data) for _, value in items])
        ok = unsupported = removed = 0
        for (key, value), check in zip(items, checks, strict=False):
            if check is PageCheck.OK:
                ok += 1
            elif check is PageCheck.UNSUPPORTED:
                unsupported += 1
            else:
                removed += 1
                if self._values.get(key) is value:
                    self._remove(key)
                self._report_corrupt(key, "verify")
        return VerifyReport(
            checked=len(checks),
            ok=ok,
            corrupt_removed=removed,
            unsupported=unsupported,
            leftovers_removed=0,
        )

    async def gc(self) -> GcReport:
        """Evict least recently used pages until within capacity (puts already keep it so);
        free the spare buffers kept for reuse."""
        await anyio.lowlevel.checkpoint()  # first, as in `exists`
        self._check_open()
        evicted = freed = 0
        # Pages that puts in flight will evict at their commit are room already made, up to
        # what each reserved (see `_doomed`); they are left to those puts (evicting others
        # instead would free twice).
        doomed = self._doomed()
        over = self._bytes - doomed + self._reserved > self._capacity
        # Only when over: a copy of every key is no small cost for a big store.
        for key in [k for k in self._values if k not in self._evicting] if over else []:
            if self._bytes - doomed + self._reserved <= self._capacity:
                break
            value = self._remove(key)
            if value is not None:
                evicted += 1
                freed += len(value.data)
        self._drop_spares()
        self._counters.evictions += evicted
        return GcReport(evicted_pages=evicted, freed_bytes=freed)


def _self_check(key: bytes, data: bytearray, mac_key: bytes | None) -> PageCheck:
    """A stored value's own consistency (no reader namespace to compare against)."""
    header = decode_header(memoryview(data))
    if isinstance(header, PageCheck):
        return header
    if header.key != key or len(data) != header.page_nbytes:
        return PageCheck.CORRUPT
    return verify_payload(header, [memoryview(data)[HEADER_NBYTES:]], mac_key=mac_key)
