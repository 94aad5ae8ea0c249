"""The file manifest when the filesystem refuses a write part-way (a full disk, a file size
limit): an append lands whole or not at all, and a compaction leaves no temporary file, nor
does one cancelled at any step. And how a compaction shares the file among namespaces.

The refusal is real: a child process runs the step under `RLIMIT_FSIZE`, so the kernel
writes up to the limit (a short write) and then refuses with EFBIG, as a full disk does with
ENOSPC.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_async.storage import _manifest
from hicache_async.storage._manifest import (
    FileManifest,
    ManifestEntry,
    ManifestLimits,
    chain_entry,
    encode_entry,
)

NS = b"n" * 16

# argv: the manifest's path, the file size limit, then "append" (of five records) or
# "compact". Prints the errno the step failed with, or "ok".
_CHILD = """
import asyncio, resource, signal, sys
from hicache_async.storage._manifest import FileManifest, chain_entry

path, limit, step = sys.argv[1], int(sys.argv[2]), sys.argv[3]
manifest = FileManifest(path)
entries = [
    chain_entry(b"n" * 16, [bytes([i, j]) * 16 for j in range(64)], 1024, 0, 2.0 + i)
    for i in range(5)
]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    asyncio.run(manifest.append(entries) if step == "append" else manifest.compact())
except OSError as exc:
    print(exc.errno)
else:
    print("ok")
"""


def _run_limited(path: Path, limit: int, step: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(limit), step],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _entry(i: int) -> ManifestEntry:
    keys = [i.to_bytes(4, "big") + bytes([j]) * 28 for j in range(8)]
    return chain_entry(NS, keys, 128, 0, float(i))


def test_an_append_that_fails_part_way_lands_nothing(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    asyncio.run(manifest.append([_entry(0)]))
    before = path.read_bytes()
    # Room for a record and a half of the five: the write is cut short, then refused.
    assert _run_limited(path, len(before) + 6000, "append") == str(errno.EFBIG)
    assert path.read_bytes() == before
    read = asyncio.run(manifest.read())
    assert [e.chain_id for e in read.entries] == [_entry(0).chain_id]
    assert read.malformed == 0
    # The next append lands whole, after the record that was there.
    asyncio.run(manifest.append([_entry(1)]))
    read = asyncio.run(manifest.read())
    assert {e.chain_id for e in read.entries} == {_entry(0).chain_id, _entry(1).chain_id}
    assert read.malformed == 0


def test_a_compaction_that_fails_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    asyncio.run(manifest.append([_entry(i) for i in range(40)]))
    before = path.read_bytes()
    # The compacted file would be as large: its temporary copy is refused part-way.
    assert _run_limited(path, len(before) // 2, "compact") == str(errno.EFBIG)
    assert _names(tmp_path) == [".manifest.jsonl.lock", "manifest.jsonl"]
    assert path.read_bytes() == before
    report = asyncio.run(manifest.compact())
    assert report.entries_after == 40


async def test_a_compaction_cancelled_before_its_rename_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    # Large enough that writing and syncing the temporary file take a while.
    for start in range(0, 3000, 500):
        await manifest.append([_entry(i) for i in range(start, start + 500)])
    before = path.read_bytes()
    compaction = asyncio.create_task(manifest.compact())
    deadline = time.monotonic() + 30
    while not any(name.endswith(".tmp") for name in _names(tmp_path)):
        assert not compaction.done()
        assert time.monotonic() < deadline
        await asyncio.sleep(0)
    compaction.cancel()
    with pytest.raises(asyncio.CancelledError):
        await compaction
    assert _names(tmp_path) == [".manifest.jsonl.lock", "manifest.jsonl"]
    assert path.read_bytes() == before


async def test_a_compaction_cancelled_while_its_temporary_file_opens_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "manifest.jsonl"
    manifest = FileManifest(path)
    await manifest.append([_entry(i) for i in range(5)])
    before = path.read_bytes()
    # The open of the temporary file waits (a stalled filesystem) until the compaction has
    # been cancelled, then goes through.
    opening, go_on, opened = threading.Event(), threading.Event(), threading.Event()
    open_regular = _manifest._open_regular

    def stalled_open(name: str, flags: int) -> int:
        if not (str(name).startswith(str(tmp_path)) and str(name).endswith(".tmp")):
            return open_regular(name, flags)
        opening.set()
        go_on.wait(30)
        try:
            return open_regular(name, flags)
        finally:
            opened.set()

    monkeypatch.setattr(_manifest, "_open_regular", stalled_open)
    compaction = asyncio.create_task(manifest.compact())
    deadline = time.monotonic() + 30
    while not opening.is_set():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    compaction.cancel()
    with pytest.raises(asyncio.CancelledError):
        await compaction
    go_on.set()
    deadline = time.monotonic() + 30
    while not opened.is_set():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    # The thread that created the file removes it, since nobody waits for it any more.
    deadline = time.monotonic() + 10
    while any(name.endswith(".tmp") for name in _names(tmp_path)):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    assert _names(tmp_path) == [".manifest.jsonl.lock", "manifest.jsonl"]
    assert path.read_bytes() == before
    monkeypatch.undo()
    assert (await manifest.compact()).entries_after == 5


def _prompt(ns: bytes, i: int, used: float) -> ManifestEntry:
    """A 40-page prompt's chain, of about 2.8 KB."""
    keys = [i.to_bytes(4, "big") + ns[:1] + bytes([j]) * 27 for j in range(40)]
    return chain_entry(ns, keys, 160, 0, used)


async def test_a_busy_namespace_never_takes_a_quiet_ones_bytes(tmp_path: Path) -> None:
    quiet, busy = b"q" * 16, b"b" * 16
    size = len(encode_entry(_prompt(busy, 0, 0.0)))
    # Room for 11 records in half of `max_bytes`; the busy namespace alone has 16, all more
    # recent than the quiet one's 5.
    limits = ManifestLimits(max_entries=16, max_entry_bytes=8192, max_bytes=23 * size)
    manifest = FileManifest(tmp_path / "manifest.jsonl", limits)
    await manifest.append([_prompt(quiet, i, 1.0 + i) for i in range(5)])
    await manifest.append([_prompt(busy, i, 100.0 + i) for i in range(16)])
    report = await manifest.compact()
    assert report.bytes_after <= limits.max_bytes // 2
    kept_quiet = (await manifest.read(namespace=quiet.hex())).entries
    assert len(kept_quiet) == 5
    # Each namespace had half of the room; the busy one keeps its newest in its half and
    # what the quiet one left.
    kept_busy = (await manifest.read(namespace=busy.hex())).entries
    assert {e.last_use for e in kept_busy} == {100.0 + i for i in range(10, 16)}
    # A busy namespace of its own gets all the room.
    alone = FileManifest(tmp_path / "alone.jsonl", limits)
    await alone.append([_prompt(busy, i, 100.0 + i) for i in range(16)])
    await alone.compact()
    assert len((await alone.read()).entries) == 11


# What a compaction of every namespace keeps: each namespace's records ranked (priority, then
# last use, then the last recorded), at most `max_entries` of each; the namespaces take turns
# (every one's best, then every one's second best, ...; within a turn by rank, then by
# namespace); kept is the longest prefix of that order within half of `max_bytes`.
def _expected(records: list[ManifestEntry], limits: ManifestLimits) -> set[tuple[str, str]]:
    ranked = sorted(_newest(records), key=lambda entry: (entry.priority, entry.last_use))
    taken: dict[str, int] = {}
    turns = []
    for position, entry in enumerate(reversed(ranked)):
        turn = taken.get(entry.namespace, 0)
        if turn < limits.max_entries:
            taken[entry.namespace] = turn + 1
            order = (turn, -entry.priority, -entry.last_use, entry.namespace, position)
            turns.append((order, entry))
    kept: set[tuple[str, str]] = set()
    used = 0
    for _, entry in sorted(turns, key=lambda turn: turn[0]):
        used += len(encode_entry(entry))
        if used > limits.max_bytes // 2:
            break
        kept.add(entry.ident)
    return kept


def _newest(records: list[ManifestEntry]) -> list[ManifestEntry]:
    """The newest record of each chain, in the order each chain was last recorded."""
    newest: dict[tuple[str, str], ManifestEntry] = {}
    for entry in records:
        held = newest.pop(entry.ident, None)
        newest[entry.ident] = held if held is not None and held.last_use > entry.last_use else entry
    return list(newest.values())


def _chain(ns: str, tag: str, pages: int, priority: int, used: float) -> ManifestEntry:
    keys = [hashlib.sha256(f"{ns}.{tag}.{j}".encode()).hexdigest() for j in range(pages)]
    return ManifestEntry(
        namespace=ns, keys=keys, num_tokens=16 * pages, priority=priority, last_use=used
    )


async def _compacted(
    path: Path, limits: ManifestLimits, records: list[ManifestEntry]
) -> set[tuple[str, str]]:
    """Compact a manifest holding `records` (oldest first, as appended); the chains kept."""
    await anyio.Path(path).write_bytes(b"".join(encode_entry(e) for e in records))
    report = await FileManifest(path, limits).compact()
    assert report.bytes_after <= limits.max_bytes // 2
    lines = (await anyio.Path(path).read_bytes()).splitlines()
    kept = [_manifest.decode_entry(line) for line in lines]
    return {e.ident for e in kept if e is not None}


async def test_namespaces_under_the_budget_keep_all_their_entries(tmp_path: Path) -> None:
    """No cap on the records of all namespaces together: 40 namespaces of `max_entries`
    small entries each, far under the byte budget, keep every one."""
    limits = ManifestLimits(max_entries=30)
    records = [_chain(f"{n:032x}", str(i), 1, 0, float(i)) for n in range(40) for i in range(30)]
    assert await _compacted(tmp_path / "manifest.jsonl", limits, records) == {
        e.ident for e in records
    }


async def test_a_trim_while_compacting_keeps_what_the_compaction_keeps(tmp_path: Path) -> None:
    """Records fed past a trim: the compaction keeps exactly what it would keep of them all
    at once (a trim never evicts a record the final selection keeps), though the namespace
    that arrives after the trim takes turns with the one trimmed."""
    a, c = "a" * 32, "c" * 32
    a1, a2, x = _chain(a, "a1", 40, 3, 10.0), _chain(a, "a2", 60, 2, 9.0), _chain(a, "x", 1, 1, 8.0)
    fillers = [_chain(a, f"f{i}", 20, 0, 1.0 + i / 1000) for i in range(30)]
    last = _chain(c, "c", 1, 0, 5.0)
    records = [a1, a2, x, *fillers, last]
    budget = len(encode_entry(a1)) + len(encode_entry(a2))
    limits = ManifestLimits(
        max_entries=1000, max_entry_bytes=len(encode_entry(a2)) + 100, max_bytes=2 * budget
    )
    collector = _manifest.ManifestCollector(limits, carry=True)
    for entry in records[:-1]:
        collector.add_line(encode_entry(entry)[:-1])
    assert collector._evicted  # trimmed before the last namespace arrives
    kept = await _compacted(tmp_path / "manifest.jsonl", limits, records)
    assert kept == _expected(records, limits)
    # Turns: a1 and c (each namespace's best), then a2, which does not fit: the prefix ends.
    assert kept == {a1.ident, last.ident}


async def test_a_quiet_namespace_s_best_record_is_kept_whatever_its_size(tmp_path: Path) -> None:
    """A quiet namespace's one record, larger than the budget over the number of
    namespaces, comes first with every other namespace's best."""
    limits = ManifestLimits(max_entries=1000, max_entry_bytes=8000, max_bytes=16000)
    quiet = _chain("a" * 32, "q", 36, 5, 100.0)
    busy = [
        _chain(f"{n:032x}", str(i), 1, 9 if (n, i) == (1, 0) else 0, float(i))
        for n in range(1, 4)
        for i in range(40)
    ]
    assert len(encode_entry(quiet)) > limits.max_bytes // 2 // 4
    assert quiet.ident in await _compacted(tmp_path / "manifest.jsonl", limits, [quiet, *busy])


async def test_a_compaction_never_writes_more_than_its_budget(tmp_path: Path) -> None:
    limits = ManifestLimits(max_entries=100, max_entry_bytes=8000, max_bytes=16000)
    big = _chain("a" * 32, "big", 100, 9, 1.0)  # most of the budget, the most valuable
    small = [_chain(f"{n:032x}", str(i), 1, 0, float(i)) for n in range(1, 4) for i in range(30)]
    # `_compacted` checks the budget.
    assert big.ident in await _compacted(tmp_path / "manifest.jsonl", limits, [big, *small])


_NAMESPACES = [f"{n:032x}" for n in range(5)]


def _collected(limits: ManifestLimits, records: list[ManifestEntry]) -> list[tuple[object, bytes]]:
    """What a compaction's collector, fed `records` oldest first, trims and all, keeps."""
    collector = _manifest.ManifestCollector(limits, carry=True)
    for entry in records:
        collector.add_line(encode_entry(entry)[:-1])
    kept = collector.compacted(limits.max_bytes // 2)
    assert sum(len(line) + 1 for _, line in kept) <= limits.max_bytes // 2
    return list(kept)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_NAMESPACES),
            st.integers(0, 15),  # chain: a record of the same chain replaces an older one
            st.integers(0, 20),  # its use
        ),
        max_size=80,
    ),
    st.integers(1, 8),
    st.integers(1_000, 40_000),
)
def test_a_compaction_keeps_the_turns_prefix_of_all_records(
    shape: list[tuple[str, int, int]], max_entries: int, max_bytes: int
) -> None:
    """For any records and limits the collector, trims and all, keeps what the selection
    over all records at once keeps; never more than the budget; and every namespace's best
    record when the namespaces' best records fit the budget together.

    Exact where the trims are: records within a factor of two in size (6 to 12 pages: about
    510 to 910 bytes) and a chain's rank never lowered by its newer records (its priority
    fixed), so the bytes before a record in the turns never fall below half of what a trim
    saw (see `ManifestCollector`)."""
    limits = ManifestLimits(max_entries=max_entries, max_entry_bytes=4096, max_bytes=max_bytes)
    records = [
        _chain(ns, str(chain), 6 + (chain * 5) % 7, chain % 4, float(used))
        for ns, chain, used in shape
    ]
    kept = {key for key, _ in _collected(limits, records)}
    assert kept == _expected(records, limits)
    best: dict[str, ManifestEntry] = {}
    for entry in reversed(_newest(records)):  # of equals, the last recorded ranks first
        held = best.get(entry.namespace)
        if held is None or (entry.priority, entry.last_use) > (held.priority, held.last_use):
            best[entry.namespace] = entry
    if sum(len(encode_entry(e)) for e in best.values()) <= limits.max_bytes // 2:
        assert {e.ident for e in best.values()} <= kept


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_NAMESPACES),
            st.integers(0, 15),
            st.integers(1, 60),  # pages: about 170 bytes to 4.1 KB
            st.integers(0, 3),
            st.integers(0, 20),
        ),
        max_size=80,
    ),
    st.integers(1, 8),
    st.integers(1_000, 40_000),
)
def test_a_compaction_never_exceeds_its_budget_whatever_the_records(
    shape: list[tuple[str, int, int, int, int]], max_entries: int, max_bytes: int
) -> None:
    limits = ManifestLimits(max_entries=max_entries, max_entry_bytes=8192, max_bytes=max_bytes)
    records = [
        _chain(ns, f"{chain}.{pages}", pages, priority, float(used))
        for ns, chain, pages, priority, used in shape
    ]
    kept = _collected(limits, records)  # checks the budget
    assert len(kept) <= len(_newest(records))
