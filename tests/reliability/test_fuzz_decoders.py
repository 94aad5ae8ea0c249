"""Property tests of the decoders that read bytes other processes wrote: the stored page
format (`storage/_page.py`) and the warmup manifest (`storage/_manifest.py`).

What must hold for any input: the decoders never raise, and they never accept a page whose
payload differs from what its writer stored — not when bits flip, not when the page is cut or
extended, not when the header is rewritten to match (then only a MAC can tell, and a reader
with a MAC key must). An accepted manifest entry satisfies every rule the reader relies on.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hicache_async.storage import FileStorage, MemoryStorage, Outcome, PageMeta
from hicache_async.storage._manifest import (
    MANIFEST_VERSION,
    FileManifest,
    ManifestCollector,
    ManifestEntry,
    ManifestLimits,
    decode_entry,
    encode_entry,
)
from hicache_async.storage._page import (
    HEADER_NBYTES,
    PageCheck,
    PageHeader,
    check_header,
    decode_header,
    encode_header,
    read_value_into,
    verify_payload,
)

from . import scaled

EXAMPLES = scaled(150, 5_000)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
KEY = bytes(range(32))
NAMESPACE = bytes(range(100, 116))
MAC_KEY = b"reliability-mac-key-0123456789ab"

keys = st.binary(min_size=32, max_size=32)
namespaces = st.binary(min_size=16, max_size=16)
payloads = st.binary(min_size=0, max_size=2048)
mac_keys = st.one_of(st.none(), st.binary(min_size=1, max_size=64))


def _segments(payload: bytes, cuts: list[int]) -> list[memoryview]:
    """`payload` split at `cuts` into writable segments (a page is scattered over several)."""
    bounds = sorted({0, len(payload), *(c % (len(payload) + 1) for c in cuts)})
    return [memoryview(bytearray(payload[a:b])) for a, b in itertools.pairwise(bounds)]


def _page(
    payload: bytes,
    *,
    key: bytes = KEY,
    namespace: bytes = NAMESPACE,
    mac_key: bytes | None = None,
    tokens: int = 16,
    priority: int = 0,
) -> bytes:
    meta = PageMeta(key=key, namespace=namespace, num_tokens=tokens, priority=priority)
    return encode_header(meta, [memoryview(payload)], mac_key=mac_key) + payload


def _read(value: bytes, nbytes: int, *, mac_key: bytes | None = None) -> PageCheck:
    into = [memoryview(bytearray(nbytes))]
    return read_value_into(value, key=KEY, namespace=NAMESPACE, into=into, mac_key=mac_key)


# The page format.


@FUZZ
@given(raw=st.binary(max_size=4 * HEADER_NBYTES))
def test_decode_header_never_raises(raw: bytes) -> None:
    header = decode_header(raw)
    assert isinstance(header, (PageHeader, PageCheck))
    assert header is not PageCheck.OK
    check = check_header(header, key=KEY, namespace=NAMESPACE, payload_nbytes=len(raw))
    assert isinstance(check, PageCheck)
    if isinstance(header, PageHeader):
        assert raw[:4] == b"HCKV"
        assert verify_payload(header, [memoryview(raw)]) in (PageCheck.OK, PageCheck.CORRUPT)


@FUZZ
@given(
    value=st.binary(max_size=1024),
    nbytes=st.integers(0, 1024),
    cuts=st.lists(st.integers(0, 2048), max_size=4),
    mac_key=mac_keys,
)
def test_read_value_into_never_raises_on_arbitrary_bytes(
    value: bytes, nbytes: int, cuts: list[int], mac_key: bytes | None
) -> None:
    into = _segments(bytes(nbytes), cuts)
    check = read_value_into(value, key=KEY, namespace=NAMESPACE, into=into, mac_key=mac_key)
    assert isinstance(check, PageCheck)
    # Random bytes are a page only by forging the header's own xxh3 checksum: a fuzzer
    # that gets there has found a way to forge pages.
    assert check is not PageCheck.OK


metas = st.builds(
    PageMeta,
    key=keys,
    namespace=namespaces,
    num_tokens=st.integers(0, 2**32 - 1),
    priority=st.integers(-(2**31), 2**31 - 1),
)


@FUZZ
@given(
    payload=payloads,
    meta=metas,
    mac_key=mac_keys,
    cuts=st.lists(st.integers(0, 4096), max_size=6),
)
def test_round_trip(payload: bytes, meta: PageMeta, mac_key: bytes | None, cuts: list[int]) -> None:
    value = encode_header(meta, [memoryview(payload)], mac_key=mac_key) + payload
    into = _segments(bytes(len(payload)), cuts)
    check = read_value_into(
        value, key=meta.key, namespace=meta.namespace, into=into, mac_key=mac_key
    )
    assert check is PageCheck.OK
    assert b"".join(into) == payload
    header = decode_header(value)
    assert isinstance(header, PageHeader)
    assert (header.num_tokens, header.priority) == (meta.num_tokens, meta.priority)


@FUZZ
@given(
    payload=payloads.filter(bool),
    mac_key=mac_keys,
    flips=st.lists(st.tuples(st.integers(0), st.integers(0, 7)), min_size=1, max_size=8),
)
def test_a_payload_with_flipped_bits_is_never_accepted(
    payload: bytes, mac_key: bytes | None, flips: list[tuple[int, int]]
) -> None:
    value = bytearray(_page(payload, mac_key=mac_key))
    for position, bit in flips:
        value[HEADER_NBYTES + position % len(payload)] ^= 1 << bit
    assume(bytes(value[HEADER_NBYTES:]) != payload)  # flips may cancel out
    assert _read(bytes(value), len(payload), mac_key=mac_key) is PageCheck.CORRUPT


@FUZZ
@given(
    payload=payloads,
    mac_key=mac_keys,
    position=st.integers(0, HEADER_NBYTES - 1),
    bit=st.integers(0, 7),
)
def test_a_header_with_a_flipped_bit_is_never_accepted(
    payload: bytes, mac_key: bytes | None, position: int, bit: int
) -> None:
    value = bytearray(_page(payload, mac_key=mac_key))
    value[position] ^= 1 << bit
    assert _read(bytes(value), len(payload), mac_key=mac_key) is not PageCheck.OK


@FUZZ
@given(payload=payloads, mac_key=mac_keys, change=st.integers(-4096, 4096).filter(bool))
def test_a_cut_or_extended_page_is_never_accepted(
    payload: bytes, mac_key: bytes | None, change: int
) -> None:
    value = _page(payload, mac_key=mac_key)
    value = value[: len(value) + change] if change < 0 else value + bytes(change)
    # Read both as the original length and as the length the damaged value suggests.
    for nbytes in {len(payload), max(0, len(value) - HEADER_NBYTES)}:
        assert _read(value, nbytes, mac_key=mac_key) is not PageCheck.OK


def _forge(value: bytes, payload: bytes) -> bytes:
    """Replace the payload and rewrite the header to match it, as anyone without the MAC key
    can: payload checksum, then the header's own checksum (the MAC field kept as it was)."""
    header = bytearray(value[:HEADER_NBYTES])
    struct.pack_into("<Q", header, 56, len(payload))
    struct.pack_into("<Q", header, 72, xxhash.xxh3_64_intdigest(payload))
    struct.pack_into("<Q", header, 120, xxhash.xxh3_64_intdigest(bytes(header[:120])))
    return bytes(header) + payload


@FUZZ
@given(original=payloads, forged=payloads, with_mac=st.booleans())
def test_a_forged_page_is_rejected_by_a_reader_with_the_mac_key(
    original: bytes, forged: bytes, with_mac: bool
) -> None:
    assume(original != forged)
    value = _page(original, mac_key=MAC_KEY if with_mac else None)
    fake = _forge(value, forged)
    # Without a key, a consistent forgery is indistinguishable from a page (the checksum
    # guards against damage, not against writers); with the key it is always rejected.
    assert _read(fake, len(forged), mac_key=None) is PageCheck.OK
    assert _read(fake, len(forged), mac_key=MAC_KEY) is PageCheck.CORRUPT


@FUZZ
@given(payload=payloads, other=st.binary(min_size=1, max_size=64))
def test_a_page_under_another_mac_key_or_none_is_rejected(payload: bytes, other: bytes) -> None:
    assume(other != MAC_KEY)
    assert _read(_page(payload, mac_key=MAC_KEY), len(payload), mac_key=MAC_KEY) is PageCheck.OK
    assert _read(_page(payload, mac_key=other), len(payload), mac_key=MAC_KEY) is PageCheck.CORRUPT
    assert _read(_page(payload), len(payload), mac_key=MAC_KEY) is PageCheck.CORRUPT


@FUZZ
@given(payload=payloads, key=keys, namespace=namespaces)
def test_a_page_of_another_key_or_namespace_is_rejected(
    payload: bytes, key: bytes, namespace: bytes
) -> None:
    assume(key != KEY or namespace != NAMESPACE)
    value = _page(payload, key=key, namespace=namespace)
    assert _read(value, len(payload)) is PageCheck.CORRUPT


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as loop:
        yield loop


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_backends_never_serve_damaged_bytes(
    kind: str, runner: asyncio.Runner, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same properties end to end: a stored value replaced by arbitrary bytes, or by a
    damaged copy of the page, is a miss or CORRUPT, never an OK with other bytes."""
    nbytes = 512
    payload = bytes(range(256)) * 2
    backend: FileStorage | MemoryStorage
    if kind == "file":
        backend = FileStorage(tmp_path_factory.mktemp("fuzz") / "l3")
    else:
        backend = MemoryStorage(capacity_bytes=1 << 20)
    runner.run(backend.__aenter__())
    meta = PageMeta(key=KEY, namespace=NAMESPACE, num_tokens=16)
    assert runner.run(backend.put([KEY], [[memoryview(payload)]], [meta])) == [Outcome.OK]
    good = runner.run(backend.read_raw(KEY))
    assert good is not None

    @settings(max_examples=scaled(100, 1_000), deadline=None)
    @given(
        damage=st.one_of(
            st.binary(max_size=HEADER_NBYTES + nbytes + 64),
            st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)).map(
                lambda flip: (
                    good[: flip[0]] + bytes([good[flip[0]] ^ flip[1]]) + good[flip[0] + 1 :]
                )
            ),
        )
    )
    def check(damage: bytes) -> None:
        runner.run(backend.write_raw(KEY, damage))
        into = bytearray(nbytes)
        [outcome] = runner.run(backend.get([KEY], [[memoryview(into)]], namespace=NAMESPACE))
        if outcome is Outcome.OK:
            assert damage == good
            assert bytes(into) == payload
        else:
            assert outcome in (Outcome.CORRUPT, Outcome.MISS)

    try:
        check()
    finally:
        runner.run(backend.close())


# The warmup manifest.

hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)
hex32 = st.text("0123456789abcdef", min_size=32, max_size=32)
entries = st.builds(
    ManifestEntry,
    namespace=hex32,
    keys=st.lists(hex64, min_size=1, max_size=8, unique=True),  # a chain never repeats a key
    num_tokens=st.integers(0, 2**32 - 1),
    priority=st.integers(-(2**31), 2**31 - 1),
    last_use=st.floats(0, 1e11, allow_nan=False),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=70),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=20,
)


def _assert_acceptable(entry: ManifestEntry) -> None:
    """Everything a reader relies on once an entry is accepted."""
    assert entry.v == MANIFEST_VERSION
    assert len(entry.namespace) == 32
    assert all(c in "0123456789abcdef" for c in entry.namespace)
    assert entry.keys
    assert all(len(k) == 64 and all(c in "0123456789abcdef" for c in k) for k in entry.keys)
    assert entry.num_tokens >= 0
    assert math.isfinite(entry.last_use)
    assert abs(entry.last_use) < 1e12


def _assert_fits_pages(entry: ManifestEntry) -> None:
    """Warmup gives an entry's priority to the pages it loads, and a page header stores it as
    an int32 (the token count as a uint32): anything wider cannot be written back."""
    assert -(2**31) <= entry.priority < 2**31, entry.priority
    assert entry.num_tokens < 2**32, entry.num_tokens


@FUZZ
@given(line=st.binary(max_size=1024))
def test_decode_entry_never_raises_on_bytes(line: bytes) -> None:
    entry = decode_entry(line)
    if entry is not None:
        _assert_acceptable(entry)


@FUZZ
@given(document=json_values, base=entries)
def test_decode_entry_validates_any_json(document: object, base: ManifestEntry) -> None:
    for candidate in (document, {**msgspec.to_builtins(base), "extra": document}):
        entry = decode_entry(msgspec.json.encode(candidate))
        if entry is not None:
            _assert_acceptable(entry)


@FUZZ
@given(
    base=entries,
    field=st.sampled_from(["namespace", "keys", "num_tokens", "priority", "last_use", "v"]),
    value=json_values | st.integers(-(2**80), 2**80) | st.sampled_from([math.inf, -math.inf]),
)
def test_decode_entry_with_one_field_replaced(
    base: ManifestEntry, field: str, value: object
) -> None:
    record = msgspec.to_builtins(base)
    record[field] = value
    try:
        line = msgspec.json.encode(record)
    except (OverflowError, ValueError):  # not representable as JSON: nothing to decode
        return
    entry = decode_entry(line)
    if entry is not None:
        _assert_acceptable(entry)


@FUZZ
@given(entry=entries)
def test_manifest_entries_round_trip(entry: ManifestEntry) -> None:
    assert decode_entry(encode_entry(entry)) == entry


@FUZZ
@given(
    base=entries,
    field=st.sampled_from(["num_tokens", "priority"]),
    value=st.one_of(st.integers(2**31, 2**80), st.integers(-(2**80), -(2**31) - 1)),
)
def test_an_accepted_entry_fits_the_page_header(
    base: ManifestEntry, field: str, value: int
) -> None:
    """Today priorities and token counts of any size are accepted (msgspec ints are
    unbounded), though a page header cannot hold them: struct.error when the page is backed
    up again."""
    record = msgspec.to_builtins(base)
    record[field] = value
    entry = decode_entry(msgspec.json.encode(record))
    if entry is not None:
        _assert_fits_pages(entry)


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("num_tokens", 2**32 - 1, True),
        ("num_tokens", 2**32, False),
        ("num_tokens", -1, False),
        ("priority", 2**31 - 1, True),
        ("priority", -(2**31), True),
        ("priority", 2**31, False),
        ("priority", -(2**31) - 1, False),
    ],
)
def test_header_widths_bound_entries_exactly(field: str, value: int, accepted: bool) -> None:
    """The bounds are the page header's own: its extremes are entries, one past is malformed
    (counted as such by a reader, never kept)."""
    record = msgspec.to_builtins(
        ManifestEntry(namespace="0" * 32, keys=["1" * 64], num_tokens=16, priority=0)
    )
    record[field] = value
    line = msgspec.json.encode(record)
    assert (decode_entry(line) is not None) is accepted
    collector = ManifestCollector(ManifestLimits())
    collector.add_line(line)
    result = collector.result(truncated=False)
    assert (len(result.entries), result.malformed) == ((1, 0) if accepted else (0, 1))


@FUZZ
@given(lines=st.lists(st.binary(max_size=300) | entries.map(encode_entry), max_size=40))
def test_the_collector_is_bounded_and_never_raises(lines: list[bytes]) -> None:
    limits = ManifestLimits(max_entries=5, max_entry_bytes=200, max_bytes=1 << 20)
    collector = ManifestCollector(limits)
    for line in lines:
        collector.add_line(line.rstrip(b"\n"))
    result = collector.result(truncated=False)
    assert len(result.entries) <= limits.max_entries
    assert result.malformed + result.oversized <= len(lines)
    for entry in result.entries:
        _assert_acceptable(entry)


def test_file_manifest_of_arbitrary_bytes(
    runner: asyncio.Runner, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("manifest")
    limits = ManifestLimits(max_entries=8, max_entry_bytes=256, max_bytes=4096)

    @settings(max_examples=scaled(100, 1_000), deadline=None)
    @given(chunks=st.lists(st.binary(max_size=600) | entries.map(encode_entry), max_size=30))
    def check(chunks: list[bytes]) -> None:
        path = Path(root / "manifest.jsonl")
        path.write_bytes(b"".join(chunks))
        manifest = FileManifest(path, limits)
        read = runner.run(manifest.read())
        assert len(read.entries) <= limits.max_entries
        for entry in read.entries:
            _assert_acceptable(entry)
        report = runner.run(manifest.compact())
        assert report.entries_after == len(read.entries) or read.truncated
        again = runner.run(manifest.read())
        assert (again.malformed, again.oversized) == (0, 0)
        assert (
            sorted(e.chain_id for e in again.entries) == sorted(e.chain_id for e in read.entries)
            or read.truncated
        )

    check()
