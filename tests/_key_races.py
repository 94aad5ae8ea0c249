"""A seeded checker of concurrent put, get, delete and exists calls on a few shared keys.

Tasks issue overlapping calls on the same four keys through one or two backend objects (two
instances sharing a store), some cancelled after a few loop iterations. Every call's start and
end are stamped with one logical clock (all tasks run on one loop, so a call's effect falls
between its two stamps), and the history is then checked:

- a get that is OK holds exactly the bytes of one put of that key begun before the get ended,
  and not of a put whose page a later delete removed before the get began;
- a get or `exists` never misses a key that was stored throughout the call (no faults), and
  `exists` never counts a key that was absent throughout it;
- once everything has ended, a final get of each key agrees with the history;
- the counters moved by what the calls did (exact bounds without faults);
- no exception but cancellation (and injected `StorageError`s) escapes, and closing leaves no
  task, thread or descriptor behind.

Every put writes bytes of its own (the KV oracle's page for a prompt of its own), so the bytes
a get returns name the put that wrote them.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache_async import KVLayout, StorageError
from hicache_async.storage import Outcome, PageMeta, StorageBackend
from hicache_async.testing._conformance import _assert_no_threads_left
from hicache_async.testing._kvgen import KVGenerator

NAMESPACE = b"key-races-ns-001"
_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64)
_PAGE_TOKENS = 16
_CANARY = 0x5A


@dataclass
class Call:
    """One call: what it asked, when it began and ended, and what it answered."""

    kind: str  # put, get, delete, exists
    instance: int
    keys: list[bytes]
    start: int
    end: int = -1
    #: put: the payload id of each key; get: the bytes read into each buffer.
    payloads: list[int] = field(default_factory=list)
    read: list[bytes] = field(default_factory=list)
    outcomes: list[Outcome] | None = None
    count: int | None = None  # exists, delete
    cancelled: bool = False
    error: BaseException | None = None

    @property
    def completed(self) -> bool:
        return not self.cancelled and self.error is None


@dataclass
class Race:
    """The settings of one run."""

    seed: int
    tasks: int = 6
    calls_per_task: int = 40
    keys: int = 4
    cancel_rate: float = 0.2
    #: Pages are stored until deleted: misses of stored pages and a final MISS are failures.
    no_eviction: bool = True
    #: Calls can fail (a fault wrapper): StorageError, ERROR and CORRUPT outcomes are
    #: expected, and `gets` and `puts` may count fewer keys than were asked.
    faults: bool = False
    #: `exists` of one instance may count a page another removed (a shared file root).
    exists_trusts_own_index: bool = False
    #: The instances' `stats().pages` count the pages stored (not a shared store's view).
    check_occupancy: bool = True
    #: A put that answers OK has made the page readable (Mooncake's may answer OK while
    #: another put of the key is still writing it: gets and lookups meanwhile miss it).
    ok_is_readable: bool = True
    #: A batch may name a key more than once.
    repeats: bool = True
    page_tokens: int = _PAGE_TOKENS


class KeyRaces:
    """Runs one race on `backends` (entered) and checks it; see the module doc."""

    def __init__(self, backends: Sequence[StorageBackend], race: Race) -> None:
        self.backends = list(backends)
        self.race = race
        self.clock = 0
        self.calls: list[Call] = []
        rng = random.Random(f"keys:{race.seed}")
        self.keys = [rng.randbytes(32) for _ in range(race.keys)]
        self.gen = KVGenerator(_LAYOUT, race.page_tokens, seed=race.seed)
        self.payload_ids = 0
        self.payloads: dict[int, bytes] = {}
        self.owner: dict[bytes, tuple[int, bytes]] = {}  # payload bytes -> (id, key)
        self.page_nbytes = len(self._payload(0))
        self.payloads.clear()

    def _payload(self, pid: int) -> bytes:
        data = self.gen.page_bytes([pid + 1, 7, 11] * self.race.page_tokens, 0)
        self.payloads[pid] = data
        return data

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _segments(self, rng: random.Random, data: bytes) -> list[memoryview]:
        cut = rng.randrange(1, len(data))
        return [memoryview(bytearray(data[:cut])), memoryview(bytearray(data[cut:]))]

    async def _one(self, rng: random.Random) -> None:
        r = rng.random()
        kind = "put" if r < 0.35 else "get" if r < 0.7 else "delete" if r < 0.85 else "exists"
        count = rng.randint(1, 3)
        if self.race.repeats:
            keys = [rng.choice(self.keys) for _ in range(count)]
        else:
            keys = rng.sample(self.keys, count)
        instance = rng.randrange(len(self.backends))
        backend = self.backends[instance]
        call = Call(kind, instance, keys, start=0)
        coro: Any
        buffers: list[list[memoryview]] = []
        if kind == "put":
            pages = []
            for key in keys:
                pid = self.payload_ids
                self.payload_ids += 1
                data = self._payload(pid)
                self.owner[data] = (pid, key)
                call.payloads.append(pid)
                pages.append(self._segments(rng, data))
            metas = [PageMeta(key=k, namespace=NAMESPACE, num_tokens=16) for k in keys]
            coro = backend.put(keys, pages, metas)
        elif kind == "get":
            for _ in keys:
                cut = rng.randrange(1, self.page_nbytes)
                buffers.append(
                    [
                        memoryview(bytearray([_CANARY]) * cut),
                        memoryview(bytearray([_CANARY]) * (self.page_nbytes - cut)),
                    ]
                )
            coro = backend.get(keys, buffers, namespace=NAMESPACE)
        elif kind == "delete":
            coro = backend.delete(keys)
        else:
            coro = backend.exists(keys)
        cancel_after = rng.randrange(0, 6) if rng.random() < self.race.cancel_rate else None
        self.calls.append(call)
        call.start = self._tick()
        task = asyncio.ensure_future(coro)
        try:
            if cancel_after is not None:
                for _ in range(cancel_after):
                    if task.done():
                        break
                    await asyncio.sleep(0)
                task.cancel()
            result = await task
        except asyncio.CancelledError:
            call.cancelled = True
            if not task.cancelled():
                raise
        except Exception as exc:  # recorded and judged by `check`
            call.error = exc
        else:
            if kind in ("put", "get"):
                call.outcomes = result
            else:
                call.count = result
        finally:
            call.end = self._tick()
        call.read = [b"".join(bytes(s) for s in page) for page in buffers]

    async def _task(self, index: int) -> None:
        rng = random.Random(f"task:{self.race.seed}:{index}")
        for _ in range(self.race.calls_per_task):
            await self._one(rng)
            if rng.random() < 0.3:
                await asyncio.sleep(0)

    async def run(self) -> None:
        before = [b.stats() for b in self.backends]
        await asyncio.gather(*(self._task(i) for i in range(self.race.tasks)))
        self.settled = [b.stats() for b in self.backends]
        self.finals: list[list[tuple[Outcome, bytes]]] = []
        for backend in self.backends:
            # Past a fault wrapper: these reads are the check, not part of the race.
            reader = getattr(backend, "inner", backend)
            results = []
            for key in self.keys:
                buffer = [memoryview(bytearray(self.page_nbytes))]
                (outcome,) = await reader.get([key], [buffer], namespace=NAMESPACE)
                results.append((outcome, bytes(buffer[0])))
            self.finals.append(results)
        self.before = before

    # Checks.

    def _deletes(self, key: bytes) -> list[Call]:
        return [c for c in self.calls if c.kind == "delete" and key in c.keys]

    def _puts(self, key: bytes) -> list[Call]:
        return [c for c in self.calls if c.kind == "put" and key in c.keys]

    def _removed_before(self, key: bytes, put_end: int, start: int, instance: int | None) -> bool:
        """A delete of `key` that completed began after `put_end` and ended before `start`."""
        return any(
            d.completed and d.start > put_end and d.end < start
            for d in self._deletes(key)
            if instance is None or d.instance == instance
        )

    def _stored_throughout(self, key: bytes, start: int, end: int) -> bool:
        """A put of `key` answered OK before `start`, and no delete of it may have run
        between that put's start and `end`."""
        for p in self._puts(key):
            if not p.completed or p.end >= start or p.outcomes is None:
                continue
            if not any(
                o is Outcome.OK for k, o in zip(p.keys, p.outcomes, strict=True) if k == key
            ):
                continue
            if all(d.end < p.start or d.start > end for d in self._deletes(key)):
                return True
        return False

    def _absent_throughout(self, key: bytes, start: int, end: int, instance: int | None) -> bool:
        """A delete of `key` completed before `start`, after every put of it begun before
        `end` had ended."""
        puts = [p for p in self._puts(key) if p.start < end]
        for d in self._deletes(key):
            if instance is not None and d.instance != instance:
                continue
            if d.completed and d.end < start and all(p.end < d.start for p in puts):
                return True
        return False

    def _check_read(self, key: bytes, data: bytes, start: int, end: int, what: str) -> None:
        owner = self.owner.get(data)
        assert owner is not None, f"{what}: OK with bytes no put of any key wrote (torn or mixed)"
        pid, owner_key = owner
        assert owner_key == key, f"{what}: OK with the bytes of another key's put {pid}"
        (put,) = [c for c in self._puts(key) if pid in c.payloads]
        assert put.start < end, f"{what}: read put {pid}, which began after the read ended"
        assert not self._removed_before(key, put.end, start, None), (
            f"{what}: read put {pid} (calls {put.start}-{put.end}), removed by a delete "
            f"that completed before the read began"
        )

    def check(self) -> None:
        race = self.race
        for c in self.calls:
            what = f"{c.kind} #{c.start}-{c.end} on instance {c.instance}"
            if c.error is not None:
                assert race.faults, f"{what} raised {c.error!r}"
                assert isinstance(c.error, StorageError), f"{what} raised {c.error!r}"
                continue
            if c.cancelled:
                continue
            if c.kind == "get":
                assert c.outcomes is not None
                for i, (key, outcome) in enumerate(zip(c.keys, c.outcomes, strict=True)):
                    item = f"{what} key {self.keys.index(key)}"
                    if outcome is Outcome.OK:
                        self._check_read(key, c.read[i], c.start, c.end, item)
                    elif not race.faults:
                        assert outcome is Outcome.MISS, f"{item}: {outcome}"
                        if race.no_eviction and race.ok_is_readable:
                            assert not self._stored_throughout(key, c.start, c.end), (
                                f"{item}: MISS of a page stored throughout the call"
                            )
            elif c.kind == "exists":
                assert c.count is not None, what
                assert 0 <= c.count <= len(c.keys), f"{what}: {c.count}"
                own = c.instance if race.exists_trusts_own_index else None
                for i, key in enumerate(c.keys[: c.count]):
                    assert not self._absent_throughout(key, c.start, c.end, own), (
                        f"{what}: counted key {self.keys.index(key)} (place {i}), absent "
                        f"throughout the call"
                    )
                if not race.faults and race.no_eviction and race.ok_is_readable:
                    present = 0
                    for key in c.keys:
                        if not self._stored_throughout(key, c.start, c.end):
                            break
                        present += 1
                    assert c.count >= present, (
                        f"{what}: {c.count} of {len(c.keys)}, but {present} were stored "
                        f"throughout the call"
                    )
            elif c.kind == "put" and not race.faults:
                assert c.outcomes is not None
                assert all(o in (Outcome.OK, Outcome.MISS) for o in c.outcomes), (
                    f"{what}: {c.outcomes}"
                )
        self._check_finals()
        self._check_counters()

    def _check_finals(self) -> None:
        race = self.race
        end = self.clock + 1
        for instance, results in enumerate(self.finals):
            for key, (outcome, data) in zip(self.keys, results, strict=True):
                what = f"final get of key {self.keys.index(key)} on instance {instance}"
                if outcome is Outcome.OK:
                    self._check_read(key, data, end, end, what)
                    continue
                # A fault wrapper's damage is found by the last read, as by any other.
                allowed = (Outcome.MISS, Outcome.CORRUPT) if race.faults else (Outcome.MISS,)
                assert outcome in allowed, f"{what}: {outcome}"
                if race.no_eviction and not race.faults:
                    assert not self._stored_throughout(key, end, end), (
                        f"{what}: MISS, though a put answered OK after every delete of it"
                    )

    def _check_counters(self) -> None:
        race = self.race
        delta: dict[str, int] = {}
        for before, after in zip(self.before, self.settled, strict=True):
            for name in ("gets", "get_hits", "puts", "put_ok", "deletes"):
                delta[name] = delta.get(name, 0) + getattr(after, name) - getattr(before, name)
        bounds: dict[str, list[int]] = {n: [0, 0] for n in delta}

        def add(name: str, low: int, high: int) -> None:
            bounds[name][0] += low
            bounds[name][1] += high

        for c in self.calls:
            n = len(c.keys)
            done = c.completed
            if c.kind in ("get", "put"):
                calls, oks = ("gets", "get_hits") if c.kind == "get" else ("puts", "put_ok")
                ok = c.outcomes.count(Outcome.OK) if c.outcomes is not None else 0
                add(calls, n if done and not race.faults else 0, n)
                add(oks, ok if done else 0, ok if done else n)
            elif c.kind == "delete":
                removed = c.count if done and c.count is not None else 0
                add("deletes", removed, removed if done else n)
        problems = [
            f"{name}: moved {delta[name]}, expected {low} to {high}"
            for name, (low, high) in bounds.items()
            if not low <= delta[name] <= high
        ]
        assert not problems, "; ".join(problems)
        if race.check_occupancy:
            # Taken before the final reads, which remove the damaged pages they find.
            stored = sum(o in (Outcome.OK, Outcome.CORRUPT) for o, _ in self.finals[0])
            pages = sum(s.pages - b.pages for s, b in zip(self.settled, self.before, strict=True))
            assert pages == stored, f"stats().pages moved {pages}, {stored} keys are stored"


def open_fds() -> set[str]:
    """The descriptors this process has open (Linux)."""
    return set(os.listdir("/proc/self/fd"))


async def race_and_check(
    open_backends: Callable[[], Sequence[StorageBackend]], race: Race, *, pooled: bool = False
) -> KeyRaces:
    """Opens the backends, runs `race` on them, closes them and checks the history, then that
    no task, thread or descriptor is left behind. `pooled`: the backends keep their clients
    for the next ones (Mooncake), so one set is opened and closed first."""
    if pooled:
        for backend in open_backends():
            async with backend:
                await backend.exists([])
    threads = set(threading.enumerate())
    tasks = set(asyncio.all_tasks())
    fds = open_fds()
    backends = list(open_backends())
    for backend in backends:
        await backend.__aenter__()
    try:
        races = KeyRaces(backends, race)
        await races.run()
    finally:
        for backend in reversed(backends):
            await backend.close()
    races.check()
    for _ in range(8):
        await asyncio.sleep(0)
    current = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not current and t not in tasks]
    assert not left, f"tasks left running: {left[:3]}"
    await _assert_no_threads_left(threads)
    leaked = _describe(open_fds() - fds)
    if pooled:
        # A pooled client keeps its transfer engine's connections to the clients it read
        # from, and its event descriptors, for the backend that takes it next.
        leaked = [fd for fd in leaked if " -> socket:" not in fd and " -> anon_inode:" not in fd]
    assert not leaked, f"descriptors left open: {leaked}"
    return races


def _describe(fds: set[str]) -> list[str]:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue
    return out
